"""One node's pods, listed then watched (`spec.nodeName=<node>`), straight as dicts (no client models, no
timestamp parsing): the list goes to `on_list`, each later event to `on_event`; a re-list after the
server ends the stream (every `resync_s`), at once after 410 Gone, a second after any other failure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from shared.kube.resources import PODS
from shared.kube.rest import ApiError, Gone, decode, request, watch_lines
from shared.logs import get_logger

log = get_logger(__name__)
Pod = dict[str, Any]


async def watch_node_pods(
    api: Any,
    node: str,
    resync_s: float,
    stopping: asyncio.Event,
    *,
    on_list: Callable[[list[Pod]], Awaitable[None]],
    on_event: Callable[[str, Pod], None],
) -> None:
    """Until `stopping`."""
    selector = [("fieldSelector", f"spec.nodeName={node}")]
    while not stopping.is_set():
        try:
            listing = decode(await request(api, "GET", PODS.path(), query=selector))
            await on_list(listing.get("items") or [])
            await _watch(api, selector, listing["metadata"].get("resourceVersion", ""), resync_s, stopping, on_event)
        except ApiError as exc:
            if not isinstance(exc, Gone):
                log.warning("pod watch failed; re-listing", node=node, status=exc.status)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 1.0)
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            log.warning("API server unreachable; retrying", node=node, error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 1.0)


async def _watch(
    api: Any,
    selector: list[tuple[str, str]],
    version: str,
    resync_s: float,
    stopping: asyncio.Event,
    on_event: Callable[[str, Pod], None],
) -> None:
    """Until the server ends the stream (the caller lists again)."""
    async for line in watch_lines(
        api, PODS.path(), resource_version=version, query=selector, timeout_s=max(1, int(resync_s))
    ):
        if stopping.is_set():
            return
        event = decode(line)
        raw = event.get("object") or {}
        kind = event.get("type")
        if kind == "ERROR":
            code = int(raw.get("code") or 500)
            raise (Gone if code == 410 else ApiError)(
                code, str(raw.get("reason") or "Error"), str(raw.get("message") or "")
            )
        if kind != "BOOKMARK":
            on_event(str(kind), raw)
