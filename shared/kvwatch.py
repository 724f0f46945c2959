"""A watch of a JetStream KV bucket's keys (`KvWatch`): the values there when it began, then a None marker (the
end of that replay), then every change, as nats-py's `KeyValue.Entry`.

Made on one ordered consumer (shared.jetstream.ordered_consumer), whose create answer says how many values make the
replay. nats-py's own `KeyValue.watch` decides the end of the replay from the consumer's info read after the
subscription, and hands out its marker before values already on the wire when the server has sent them all: a key
listing then comes back empty, and a watcher takes the values that follow for changes (nats-py issue 842). Here the
marker is placed by count, where the reader takes it, so it follows exactly the values the bucket held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shared.jetstream import ordered_consumer

KV_OPERATION = "KV-Operation"  # a delete or purge written by a client: DEL or PURGE
MARKER_REASON = "Nats-Marker-Reason"  # a removal the server wrote (a TTL or age limit, a purge)
_MARKER_OPERATIONS = {"MaxAge": "PURGE", "Purge": "PURGE", "Remove": "DEL"}
_QUEUED = 256  # deliveries held for a slow reader before the consumer waits (flow control holds the rest)


class _Stopped:
    """Queued by stop(): iteration ends."""


_STOPPED = _Stopped()


class KvWatch:
    """One watch of `$KV.<bucket>.<pattern>`. Iterate it (or call `next`): entries, with None once, after the last
    value the bucket held when the watch began (at once if it held none). Stop it with `stop`."""

    def __init__(self, bucket: str, ignore_deletes: bool, arrived: Callable[[Msg], None] | None) -> None:
        self._bucket = bucket
        self._prefix = f"$KV.{bucket}."
        self._ignore_deletes = ignore_deletes
        self._arrived = arrived
        # every delivery, in order: its entry, or None for one not handed on (a delete a listing skips)
        self._queue: asyncio.Queue[KeyValue.Entry | _Stopped | None] = asyncio.Queue(maxsize=_QUEUED)
        self._replay = 0  # deliveries that make the replay (the create's count)
        self._taken = 0  # deliveries the reader has taken
        self._replayed = False  # the marker was handed out
        self._sub: JetStreamContext.PushSubscription | None = None

    @classmethod
    async def start(
        cls,
        nc: NatsClient,
        js: JetStreamContext,
        bucket: str,
        pattern: str = ">",
        *,
        meta_only: bool = False,
        ignore_deletes: bool = False,
        arrived: Callable[[Msg], None] | None = None,
    ) -> KvWatch:
        """Watch the keys of `bucket` that match `pattern`. `meta_only`: entries without values (a listing);
        `ignore_deletes`: deleted keys not handed on; `arrived(msg)`: called with each delivery as it comes."""
        watch = cls(bucket, ignore_deletes, arrived)
        watch._sub, watch._replay = await ordered_consumer(
            nc,
            js,
            f"KV_{bucket}",
            f"{watch._prefix}{pattern}",
            watch._deliver,
            last_per_subject=True,
            headers_only=meta_only,
        )
        return watch

    async def _deliver(self, msg: Msg, replayed: bool) -> None:
        if self._arrived is not None:
            self._arrived(msg)
        await self._queue.put(self._entry(msg))

    def _entry(self, msg: Msg) -> KeyValue.Entry | None:
        headers = msg.headers or {}
        operation = headers.get(KV_OPERATION)
        if operation is None and MARKER_REASON in headers:
            operation = _MARKER_OPERATIONS.get(headers[MARKER_REASON])
            if operation is None:  # a server marker of a kind not known here: neither a value nor a removal
                return None
        if self._ignore_deletes and operation in ("DEL", "PURGE"):
            return None
        meta = msg.metadata
        return KeyValue.Entry(
            bucket=self._bucket,
            key=msg.subject[len(self._prefix) :],
            value=msg.data,
            revision=meta.sequence.stream,
            delta=meta.num_pending,
            created=meta.timestamp,  # type: ignore[arg-type]
            operation=operation,
        )

    async def next(self) -> KeyValue.Entry | None:
        """The next entry, or None once at the end of the replay; StopAsyncIteration once stopped."""
        while True:
            if not self._replayed and self._taken >= self._replay:
                self._replayed = True
                return None
            item = await self._queue.get()
            if isinstance(item, _Stopped):
                self._queue.put_nowait(item)  # every later call ends too
                raise StopAsyncIteration
            self._taken += 1
            if item is not None:
                return item

    def __aiter__(self) -> KvWatch:
        return self

    async def __anext__(self) -> KeyValue.Entry | None:
        return await self.next()

    async def stop(self) -> None:
        """End the watch: its consumer goes, what was queued is dropped, and iteration ends. Stopping twice, or
        once the connection is closed (which ended the subscription), is no error."""
        assert self._sub is not None, "stop() of a watch that start() did not make"
        with contextlib.suppress(
            nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError, nats.errors.BadSubscriptionError
        ):
            await self._sub.unsubscribe()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_STOPPED)
