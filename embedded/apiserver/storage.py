"""Object storage: current objects, the global resourceVersion, watch history and persistence.

Objects are plain dicts in their storage version, owned by the store once written (callers never
mutate a dict they put or got; they build a new one). Every write takes the next resourceVersion
from one global counter, appends a `Change` to a bounded history (what watches resume from) and
fans it out to live watchers. With a data directory, writes are also queued to SQLite on a
writer thread, so the event loop never blocks on disk; `persisted()` waits for their commit (the
server answers a write only then) and `close()` flushes them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

ResKey = tuple[str, str]  # (group, plural)
ObjKey = tuple[str, str]  # (namespace or "", name)

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class Expired(Exception):
    """The requested resourceVersion is older than the retained history."""

    def __init__(self, requested: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {requested} ({oldest})")
        self.requested = requested
        self.oldest = oldest


@dataclass(slots=True)
class Change:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    res: ResKey
    key: ObjKey
    obj: dict[str, Any]
    prev: dict[str, Any] | None


class Watcher:
    """A live subscription: changes to one resource (optionally one namespace) are queued here, and
    the one stream that reads them is woken (one future per wait: no task or queue getter per event)."""

    __slots__ = ("_waiter", "namespace", "pending", "res")

    def __init__(self, res: ResKey, namespace: str | None) -> None:
        self.res = res
        self.namespace = namespace
        self.pending: list[Change] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, change: Change) -> None:
        self.pending.append(change)
        if self._waiter is not None:
            _resolve(self._waiter)

    def take(self) -> list[Change]:
        """Every change queued so far, oldest first."""
        changes, self.pending = self.pending, []
        return changes

    def interrupt(self) -> None:
        """Wake the reader now (the server is closing)."""
        if self._waiter is not None:
            _resolve(self._waiter)

    async def wait(self, until: float | None) -> None:
        """Until a change is queued, `interrupt()`, or the loop's clock reaches `until`."""
        if self.pending:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        timer = None if until is None else loop.call_at(until, _resolve, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def deep_copy(obj: Any) -> Any:
    return _decode(_encode(obj))


class Store:
    def __init__(self, data_dir: Path | None = None, history_size: int = 20000) -> None:
        self.rv = 0
        self._objects: dict[ResKey, dict[ObjKey, dict[str, Any]]] = collections.defaultdict(dict)
        self._history: collections.deque[Change] = collections.deque(maxlen=history_size)
        self._compacted = 0  # the rv below which history is gone
        self._watchers: dict[ResKey, set[Watcher]] = collections.defaultdict(set)
        self._encoded: dict[ResKey, dict[ObjKey, tuple[dict[str, Any], bytes]]] = collections.defaultdict(dict)
        self._encoded_proto: dict[ResKey, dict[ObjKey, tuple[dict[str, Any], bytes]]] = collections.defaultdict(dict)
        self._listeners: list[Callable[[Change], None]] = []
        self._db: _SqliteWriter | None = None
        if data_dir is not None:
            self._db = _SqliteWriter(Path(data_dir) / "apiserver.sqlite")
            self.rv, rows = self._db.load()
            for res, key, obj in rows:
                self._objects[res][key] = obj
            self._compacted = self.rv

    # ---- reads

    def get(self, res: ResKey, key: ObjKey) -> dict[str, Any] | None:
        return self._objects[res].get(key)

    def items(self, res: ResKey, namespace: str | None = None) -> list[tuple[ObjKey, dict[str, Any]]]:
        """Objects of one resource (one namespace if given), sorted by (namespace, name)."""
        objects = self._objects[res]
        if namespace is None:
            return sorted(objects.items())
        return sorted((k, v) for k, v in objects.items() if k[0] == namespace)

    def encoded(
        self, res: ResKey, key: ObjKey, obj: dict[str, Any], encode: Callable[[dict[str, Any]], bytes] | None = None
    ) -> bytes:
        """`obj`'s JSON, cached while it is the current version (LIST joins these instead of re-encoding);
        with `encode` (protobuf.object_message), its protobuf message, cached the same way."""
        cache = (self._encoded if encode is None else self._encoded_proto)[res]
        hit = cache.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        raw = _encode(obj) if encode is None else encode(obj)
        if self._objects[res].get(key) is obj:
            cache[key] = (obj, raw)
        return raw

    def resources(self) -> Iterable[ResKey]:
        return list(self._objects)

    def in_namespace(self, namespace: str) -> list[tuple[ResKey, ObjKey, dict[str, Any]]]:
        found = []
        for res, objects in self._objects.items():
            for key, obj in objects.items():
                if key[0] == namespace:
                    found.append((res, key, obj))
        return found

    # ---- writes

    def put(self, res: ResKey, key: ObjKey, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace; stamps the next resourceVersion onto `obj` and returns it."""
        self.rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        prev = self._objects[res].get(key)
        self._objects[res][key] = obj
        self._record(Change(self.rv, "MODIFIED" if prev is not None else "ADDED", res, key, obj, prev))
        return obj

    def delete(self, res: ResKey, key: ObjKey) -> dict[str, Any] | None:
        prev = self._objects[res].pop(key, None)
        self._encoded[res].pop(key, None)
        self._encoded_proto[res].pop(key, None)
        if prev is None:
            return None
        self.rv += 1
        final = dict(prev)
        final["metadata"] = {**prev.get("metadata", {}), "resourceVersion": str(self.rv)}
        self._record(Change(self.rv, "DELETED", res, key, final, prev))
        return final

    def drop_resource(self, res: ResKey) -> None:
        """Forget a resource's objects without events (its CRD is gone; they were deleted first)."""
        self._objects.pop(res, None)
        self._encoded.pop(res, None)
        self._encoded_proto.pop(res, None)

    def _record(self, change: Change) -> None:
        if len(self._history) == self._history.maxlen:
            self._compacted = self._history[0].rv
        self._history.append(change)
        for watcher in self._watchers.get(change.res, ()):
            if watcher.namespace is None or watcher.namespace == change.key[0]:
                watcher.push(change)
        if self._db is not None:
            self._db.submit(change, change.rv)
        for listener in self._listeners:
            listener(change)

    # ---- history and watches

    def compact(self) -> None:
        """Forget all history up to now, as etcd compaction does: older watches get 410."""
        self._history.clear()
        self._compacted = self.rv

    @property
    def oldest_rv(self) -> int:
        return self._compacted

    def changes_since(self, rv: int, res: ResKey, namespace: str | None) -> list[Change]:
        if rv < self._compacted:
            raise Expired(rv, self._compacted + 1)
        return [c for c in self._history if c.rv > rv and c.res == res and (namespace is None or c.key[0] == namespace)]

    def watch(self, res: ResKey, namespace: str | None) -> Watcher:
        watcher = Watcher(res, namespace)
        self._watchers[res].add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers[watcher.res].discard(watcher)

    def watcher_count(self) -> int:
        return sum(len(w) for w in self._watchers.values())

    def add_listener(self, listener: Callable[[Change], None]) -> None:
        """Called synchronously after every change (the garbage collector uses this)."""
        self._listeners.append(listener)

    async def persisted(self) -> None:
        """Return once every change made so far is in the data dir: the server answers a write only
        then, so an acknowledged write survives a SIGKILL of the server (as etcd's does)."""
        if self._db is not None:
            await self._db.committed(self.rv)

    async def close(self) -> None:
        if self._db is not None:
            await asyncio.to_thread(self._db.close)
            self._db = None


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


class _SqliteWriter:
    """One table of current objects plus the resourceVersion; written by a single thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        conn = sqlite3.connect(path)
        conn.execute(
            "CREATE TABLE IF NOT EXISTS objects (grp TEXT, res TEXT, ns TEXT, name TEXT, body BLOB,"
            " PRIMARY KEY (grp, res, ns, name))"
        )
        conn.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
        conn.commit()
        conn.close()
        self._queue: queue.Queue[tuple[Change, int] | None] = queue.Queue()
        self.committed_rv = 0  # every change up to it is in the file (a SIGKILL of the server keeps it)
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._waiters_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="apiserver-sqlite", daemon=True)
        self._thread.start()

    def load(self) -> tuple[int, list[tuple[ResKey, ObjKey, dict[str, Any]]]]:
        conn = sqlite3.connect(self._path)
        try:
            row = conn.execute("SELECT v FROM meta WHERE k = 'rv'").fetchone()
            rv = int(row[0]) if row else 0
            rows = [
                ((grp, res), (ns, name), _decode(body))
                for grp, res, ns, name, body in conn.execute("SELECT grp, res, ns, name, body FROM objects")
            ]
        finally:
            conn.close()
        self.committed_rv = rv
        return rv, rows

    async def committed(self, rv: int) -> None:
        """Return once the changes up to `rv` are committed (the writer thread wakes us)."""
        if self.committed_rv >= rv:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        with self._waiters_lock:
            if self.committed_rv >= rv:
                return
            self._waiters.append((rv, loop, done))
        await done

    def _wake(self, rv: int) -> None:
        with self._waiters_lock:
            self.committed_rv = rv
            ready = [w for w in self._waiters if w[0] <= rv]
            self._waiters = [w for w in self._waiters if w[0] > rv]
        for _, loop, done in ready:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, done)

    def submit(self, change: Change, rv: int) -> None:
        self._queue.put((change, rv))

    def _run(self) -> None:
        conn = sqlite3.connect(self._path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        while True:
            item = self._queue.get()
            batch = [item]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            done = any(b is None for b in batch)
            last_rv = None
            for b in batch:
                if b is None:
                    continue
                change, last_rv = b
                (grp, res), (ns, name) = change.res, change.key
                if change.type == "DELETED":
                    conn.execute("DELETE FROM objects WHERE grp=? AND res=? AND ns=? AND name=?", (grp, res, ns, name))
                else:
                    conn.execute(
                        "INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?)",
                        (grp, res, ns, name, _encode(change.obj)),
                    )
            if last_rv is not None:
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('rv', ?)", (str(last_rv),))
            conn.commit()
            if last_rv is not None:
                self._wake(last_rv)
            if done:
                conn.close()
                return

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
