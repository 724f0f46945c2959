"""Raw JSON calls on the one Kubernetes client, and the one API error type.

On a client from `shared.kube.client.kube_api_client`: `request` returns the body bytes (decoded by
the caller with msgspec: hot objects never become models), `get_json` decodes them, `watch_lines` is
a watch stream that raises `Gone` on 410 so the caller re-lists. `ApiError` (status, reason, message)
is what every layer raises and catches for an API server's refusal.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar
from urllib.parse import urlencode

import aiohttp
import msgspec

from shared.logs import get_logger

log = get_logger(__name__)

_JSON = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()
T = TypeVar("T")


class ListMeta(msgspec.Struct):
    resourceVersion: str = ""  # noqa: N815
    cont: str = msgspec.field(default="", name="continue")  # a Python keyword


class Page(msgspec.Struct, Generic[T]):
    """One page of a LIST: its items decoded as T, and the list's metadata."""

    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[T] = msgspec.field(default_factory=list)


class ApiError(RuntimeError):
    """The API server refused a request: `status`, and `reason` and `message` as its Status said them."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @classmethod
    def from_response(cls, status: int, method: str, path: str, body: bytes) -> ApiError:
        """The error for a non-2xx answer to `method path` (Gone for 410), from its Status body."""
        reason, message = "", body.decode("utf-8", "replace")[:2000]
        try:
            doc = json.loads(body)
            reason = str(doc.get("reason") or "")
            message = str(doc.get("message") or message)
        except (ValueError, AttributeError):
            pass
        error = (Gone if status == 410 else cls)(status, reason or "Error", message)
        error.args = (f"{method} {path}: HTTP {status} {reason}: {message}",)
        return error

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


class Gone(ApiError):
    """The resourceVersion asked for is older than the server keeps (410 Gone): list again."""


async def request(
    api_client: Any,
    method: str,
    path: str,
    *,
    query: list[tuple[str, str]] | None = None,
    body: Any = None,
    timeout: float = 30.0,
    content_type: str = "application/json",
) -> bytes:
    """Send one request; the body bytes on 2xx, ApiError otherwise (`content_type`: a PATCH's kind).

    The client's configuration, auth headers and aiohttp session (its connection pool, TLS, proxy) make the
    request, without its layers above the session: `ApiClient.call_api` walks the whole body in Python to
    turn models into dicts (~0.3 ms for one 8-GPU slice), and the REST layer encodes a JSON body with the
    standard library's `json` (10% of the publisher's CPU in a cold publish). Our bodies are plain data,
    encoded once by msgspec (`body` may also be bytes, sent as they are)."""
    headers = {**api_client.default_headers, "Accept": "application/json", "Content-Type": content_type}
    if api_client.cookie:
        headers["Cookie"] = api_client.cookie
    params = list(query or [])
    await api_client.update_params_for_auth(headers, params, ["BearerToken"])
    rest = api_client.rest_client
    url = api_client.configuration.host + path
    if params:
        url += "?" + urlencode(params)
    data = None if body is None else body if isinstance(body, bytes) else _ENCODER.encode(body)
    tls_name = {"server_hostname": rest.server_hostname} if rest.server_hostname else {}
    async with rest.pool_manager.request(
        method,
        url,
        headers=headers,
        data=data,
        timeout=aiohttp.ClientTimeout(total=timeout),
        proxy=rest.proxy,
        proxy_headers=rest.proxy_headers,
        **tls_name,
    ) as resp:
        raw: bytes = await resp.read()
        status = resp.status
    if not 200 <= status <= 299:
        raise ApiError.from_response(status, method, path, raw)
    return raw


_PAGE_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


async def list_pages(
    api_client: Any,
    path: str,
    item_type: type[T],
    *,
    query: list[tuple[str, str]] | None = None,
    page_size: int = 500,
    timeout: float = 30.0,
) -> AsyncIterator[Page[T]]:
    """The pages of one LIST of `path` (following `continue`), each item decoded as `item_type` (a msgspec
    type: a hot object's few fields, or `dict` for the whole object)."""
    decoder = _PAGE_DECODERS.get(item_type)
    if decoder is None:
        any_type: Any = item_type
        decoder = _PAGE_DECODERS[item_type] = msgspec.json.Decoder(Page[any_type])
    token = ""
    while True:
        params = [*(query or []), ("limit", str(page_size)), *([("continue", token)] if token else [])]
        page: Page[T] = decoder.decode(await request(api_client, "GET", path, query=params, timeout=timeout))
        yield page
        token = page.metadata.cont
        if not token:
            return


def decode(raw: bytes) -> Any:
    return _JSON.decode(raw)


async def get_json(api_client: Any, path: str, query: list[tuple[str, str]] | None = None) -> Any:
    return _JSON.decode(await request(api_client, "GET", path, query=query))


async def watch_lines(
    api_client: Any,
    path: str,
    *,
    resource_version: str,
    query: list[tuple[str, str]] | None = None,
    timeout_s: int = 300,
    connect_timeout_s: float = 10,
) -> AsyncIterator[bytes]:
    """Raw watch events (one JSON object a line) from `resource_version`; Gone on 410.

    The stream ends when the server closes it (after `timeout_s`); the caller watches again from
    the last resourceVersion it saw.
    """
    params = [
        *(query or []),
        ("watch", "true"),
        ("resourceVersion", resource_version),
        ("allowWatchBookmarks", "true"),
        ("timeoutSeconds", str(timeout_s)),
    ]
    resp = await api_client.call_api(
        path,
        "GET",
        query_params=params,
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=(connect_timeout_s, timeout_s + 30),
    )
    try:
        if resp.status == 410:
            raise Gone(410, "Expired", f"watch {path} from {resource_version}: 410 Gone")
        if not 200 <= resp.status <= 299:
            raise ApiError.from_response(resp.status, "WATCH", path, await resp.read())
        while True:
            line = await resp.content.readline()
            if not line:
                return
            line = line.strip()
            if line:
                yield line
    finally:
        resp.release()
