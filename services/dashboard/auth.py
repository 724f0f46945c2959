"""Who is looking, and which namespaces' claims they may see (`--auth none|kubernetes`).

The viewer's identity is their bearer token (`Authorization: Bearer`, or `?token=` for the page's first
load). With `kubernetes`, a TokenReview says who holds it and SubjectAccessReviews (`list resourceclaims`)
say in which namespaces: cluster-wide first, then each namespace that holds claims. Answers are cached for
`ttl_s` per token, so a page's stream and drill-downs cost the API server nothing more. Nodes and GPUs are
shown to every authenticated viewer; allocations outside the granted namespaces lose their names
(model.redact). With `none` (the local cluster), everyone sees everything.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

from shared.kube import rest as kube
from shared.kube.rest import ApiError
from shared.logs import get_logger

log = get_logger(__name__)
AuthMode = Literal["none", "kubernetes"]
Visible = frozenset[str] | None  # None: every namespace


class Unauthorized(Exception):
    """No token, or one the API server does not accept (HTTP 401)."""


class Viewer:
    def __init__(self, user: str, visible: Visible) -> None:
        self.user = user
        self.visible = visible

    def sees(self, namespace: str) -> bool:
        return self.visible is None or namespace in self.visible


EVERYONE = Viewer("anonymous", None)


def bearer(headers: Any, query: Any) -> str:
    header = str(headers.get("Authorization") or "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return str(query.get("token") or "")


class Authenticator:
    """`await auth.viewer(token, namespaces)`: the viewer, or Unauthorized."""

    async def viewer(self, token: str, namespaces: Iterable[str]) -> Viewer:
        return EVERYONE


class KubernetesAuth(Authenticator):
    """TokenReview + SubjectAccessReview through the dashboard's own client (`create tokenreviews`,
    `create subjectaccessreviews`), cached per token for `ttl_s`."""

    def __init__(
        self, api_client: Any, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic, max_entries: int = 4096
    ) -> None:
        self.api = api_client
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_entries = max_entries
        self._users: dict[str, tuple[float, dict[str, Any] | None]] = {}  # token digest -> (expiry, user)
        self._grants: dict[tuple[str, str], tuple[float, bool]] = {}  # (digest, namespace) -> (expiry, allowed)
        self._asking = asyncio.Semaphore(16)  # reviews in flight: a viewer of many namespaces is no burst

    async def viewer(self, token: str, namespaces: Iterable[str]) -> Viewer:
        if not token:
            raise Unauthorized(
                "no bearer token: send `Authorization: Bearer <token>` (or open the page with "
                "?token=<token>); `kubectl create token <serviceaccount>` makes one"
            )
        digest = hashlib.sha256(token.encode()).hexdigest()
        user = await self._cached(self._users, digest, lambda: self._review(token))
        if user is None:
            raise Unauthorized(
                "the API server does not accept this token (expired, revoked or for another "
                "cluster); get a new one with `kubectl create token <serviceaccount>`"
            )
        if await self._cached(self._grants, (digest, ""), lambda: self._may_list(user, "")):
            return Viewer(str(user.get("username") or ""), None)
        wanted = sorted(set(namespaces))
        answers = await asyncio.gather(
            *(self._cached(self._grants, (digest, ns), functools.partial(self._may_list, user, ns)) for ns in wanted)
        )  # asked together on a cold cache
        return Viewer(
            str(user.get("username") or ""), frozenset(ns for ns, ok in zip(wanted, answers, strict=True) if ok)
        )

    async def _cached(self, cache: dict[Any, Any], key: Any, fetch: Callable[[], Awaitable[Any]]) -> Any:
        now = self.clock()
        hit = cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        value = await fetch()
        if len(cache) >= self.max_entries:
            for stale in [k for k, (expiry, _) in cache.items() if expiry <= now] or list(cache)[: len(cache) // 2]:
                cache.pop(stale, None)
        cache[key] = (now + self.ttl_s, value)
        return value

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._asking:
            data: dict[str, Any] = kube.decode(await kube.request(self.api, "POST", path, body=body))
        return data

    async def _review(self, token: str) -> dict[str, Any] | None:
        try:
            out = await self._post(
                "/apis/authentication.k8s.io/v1/tokenreviews",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}},
            )
        except ApiError as exc:
            log.error("TokenReview failed", error=str(exc))
            raise
        status = out.get("status") or {}
        return dict(status.get("user") or {}) if status.get("authenticated") else None

    async def _may_list(self, user: dict[str, Any], namespace: str) -> bool:
        spec: dict[str, Any] = {
            "user": user.get("username", ""),
            "groups": list(user.get("groups") or []),
            "resourceAttributes": {
                "verb": "list",
                "group": "resource.k8s.io",
                "resource": "resourceclaims",
                "namespace": namespace,
            },
        }
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = user["extra"]
        out = await self._post(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec},
        )
        return bool((out.get("status") or {}).get("allowed"))


def authenticator(mode: AuthMode, api_client: Any) -> Authenticator:
    return KubernetesAuth(api_client) if mode == "kubernetes" else Authenticator()
