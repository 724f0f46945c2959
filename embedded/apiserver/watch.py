"""Watch streams: newline-delimited JSON events over a chunked HTTP response, or, for a client that
prefers protobuf (client-go), length-prefixed meta.v1.WatchEvent frames (see protobuf.py).

A watch starts from a resourceVersion (history replay; 410 Expired as an ERROR event when that
version is compacted), or from "now" with the current objects as ADDED events. Selector
transitions become ADDED/DELETED as upstream does; BOOKMARKs carry the latest resourceVersion
when the client allows them; `sendInitialEvents` ends its initial list with the
`k8s.io/initial-events-end` bookmark. The stream ends at `timeoutSeconds` or server shutdown.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from embedded.apiserver import errors, protobuf, tables, versions
from embedded.apiserver.resources import Resource
from embedded.apiserver.selectors import Matcher
from embedded.apiserver.storage import Change, Expired, ObjKey, Store
from shared.numbers import decimal_int

_encode = msgspec.json.encode
_EVENT_HEAD = {t: b'{"type":"' + t.encode() + b'","object":' for t in ("ADDED", "MODIFIED", "DELETED")}


@dataclass
class WatchRequest:
    res: Resource
    version: str
    namespace: str | None
    label: Matcher | None
    field: Matcher | None
    resource_version: str
    bookmarks: bool
    timeout: float | None
    send_initial: bool
    as_table: bool
    include_object: str
    metadata_only: bool
    protobuf: bool = False


class WatchHub:
    """Server-wide watch settings and the set of open streams (closed on shutdown)."""

    def __init__(self, store: Store, bookmark_interval: float = 60.0) -> None:
        self.store = store
        self.bookmark_interval = bookmark_interval
        self.closing = asyncio.Event()
        self.open_streams = 0

    def _matches(self, wr: WatchRequest, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        if wr.label is not None and not wr.label(obj):
            return False
        return wr.field is None or wr.field(obj)

    def translate(self, wr: WatchRequest, change: Change) -> tuple[str, dict[str, Any]] | None:
        """The event this watch sees for a change, if any (selector transitions included)."""
        now_match = change.type != "DELETED" and self._matches(wr, change.obj)
        if wr.label is None and wr.field is None:
            return change.type, change.obj
        was_match = self._matches(wr, change.prev) if change.prev is not None else False
        if change.type == "ADDED":
            return ("ADDED", change.obj) if now_match else None
        if change.type == "DELETED":
            return ("DELETED", change.obj) if was_match else None
        if now_match and was_match:
            return "MODIFIED", change.obj
        if now_match:
            return "ADDED", change.obj
        if was_match:
            return "DELETED", change.obj
        return None

    async def serve(self, request: web.Request, wr: WatchRequest) -> web.StreamResponse:
        store = self.store
        watcher = store.watch(wr.res.key, wr.namespace)
        initial: list[tuple[str, dict[str, Any], ObjKey]] = []
        error: dict[str, Any] | None = None
        rv_text = wr.resource_version
        start_rv = store.rv
        try:
            if rv_text in ("", "0") or wr.send_initial:
                for key, obj in store.items(wr.res.key, wr.namespace):
                    if self._matches(wr, obj):
                        initial.append(("ADDED", obj, key))
            else:
                since = decimal_int(rv_text)
                if since is None:
                    store.unwatch(watcher)
                    raise errors.bad_request(f"invalid resourceVersion {rv_text!r}: it must be an integer")
                for change in store.changes_since(since, wr.res.key, wr.namespace):
                    ev = self.translate(wr, change)
                    if ev is not None:
                        initial.append((ev[0], ev[1], change.key))
        except Expired as exc:
            error = errors.expired(str(exc)).status()
        media = protobuf.WATCH_MEDIA_TYPE if wr.protobuf else "application/json"
        resp = web.StreamResponse(status=200, headers={"Content-Type": media, "Cache-Control": "no-cache, private"})
        resp.enable_chunked_encoding()
        self.open_streams += 1
        try:
            await resp.prepare(request)
            if error is not None:
                await resp.write(self._event(wr, "ERROR", error))
                return resp
            first = [True]
            for ev_type, obj, key in initial:
                await resp.write(self._frame(wr, ev_type, obj, first, key))
            if wr.send_initial and wr.bookmarks:
                await resp.write(self._bookmark(wr, start_rv, initial_end=True))
            await self._stream(resp, wr, watcher, first)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            store.unwatch(watcher)
            self.open_streams -= 1
        return resp

    async def _stream(self, resp: web.StreamResponse, wr: WatchRequest, watcher: Any, first: list[bool]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wr.timeout if wr.timeout else None
        # Jitter the bookmark period like the real server so many watchers do not fire at once.
        period = self.bookmark_interval * (0.9 + 0.2 * random.random())
        next_bookmark = loop.time() + period
        closing = asyncio.ensure_future(self.closing.wait())
        closing.add_done_callback(lambda _: watcher.interrupt())
        try:
            while True:
                if closing.done():
                    return
                wake = next_bookmark if wr.bookmarks else None
                if deadline is not None:
                    wake = deadline if wake is None else min(wake, deadline)
                await watcher.wait(wake)
                if closing.done():
                    return
                changes = watcher.take()
                if changes:
                    out = []
                    for change in changes:
                        ev = self.translate(wr, change)
                        if ev is not None:
                            out.append(self._frame(wr, ev[0], ev[1], first, change.key))
                    if out:
                        await resp.write(b"".join(out))
                now = loop.time()
                if deadline is not None and now >= deadline:
                    if wr.bookmarks:
                        await resp.write(self._bookmark(wr, self.store.rv))
                    return
                if wr.bookmarks and now >= next_bookmark:
                    await resp.write(self._bookmark(wr, self.store.rv))
                    next_bookmark = now + period
        finally:
            closing.cancel()

    def _frame(self, wr: WatchRequest, ev_type: str, obj: dict[str, Any], first: list[bool], key: ObjKey) -> bytes:
        out = versions.convert(wr.res, obj, wr.version)
        if out is obj and not wr.protobuf and not wr.as_table and not wr.metadata_only:
            # The stored object's cached JSON (encoded once for all watchers of the change, and for LISTs),
            # framed as `{"type": ..., "object": ...}` would encode it.
            return _EVENT_HEAD[ev_type] + self.store.encoded(wr.res.key, key, obj) + b"}\n"
        if wr.as_table:
            md = {"resourceVersion": (obj.get("metadata") or {}).get("resourceVersion", "")}
            out = tables.table(wr.res, wr.version, [out], md, wr.include_object, with_columns=first[0])
            first[0] = False
        elif wr.metadata_only:
            out = tables.partial_metadata(out)
        return self._event(wr, ev_type, out)

    @staticmethod
    def _event(wr: WatchRequest, ev_type: str, obj: dict[str, Any]) -> bytes:
        if wr.protobuf:
            return protobuf.watch_frame(ev_type, obj)
        return _encode({"type": ev_type, "object": obj}) + b"\n"

    def _bookmark(self, wr: WatchRequest, rv: int, initial_end: bool = False) -> bytes:
        md: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_end:
            md["annotations"] = {"k8s.io/initial-events-end": "true"}
        obj = {"kind": wr.res.kind, "apiVersion": wr.res.api_version(wr.version), "metadata": md}
        return self._event(wr, "BOOKMARK", obj)
