"""Whether a NATS client is still connected, as the server sees it.

A process answers on a presence subject of its own (`answer`); a peer asks there (`probe`). nats-server
answers a request that no subscription can take with its no-responders status at once, and a client's
subscriptions end with its connection: a process killed, crashed or cut off is seen gone by the next probe,
without waiting out a heartbeat lease. A process that is slow or paused keeps its subscription: its probe
times out, which says nothing (None), so it is never taken for gone by a probe alone.
"""

from __future__ import annotations

import hashlib

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.events.catalog import as_token


def subject_of(prefix: str, name: str) -> str:
    """`<prefix>.<name as one token>`; a name that had to be changed to be one token gets a hash of the
    original after it, so two names never share a subject (`host.a-1` and `host_a-1`)."""
    token = as_token(name)
    if token != name:
        token += "-" + hashlib.blake2b(name.encode(), digest_size=6).hexdigest()
    return f"{prefix}.{token}"


async def answer(nc: Client, subject: str) -> Subscription:
    """Answer every probe on `subject` while the connection lasts (unsubscribe to stop)."""

    async def on_probe(msg: Msg) -> None:
        if msg.reply:
            await nc.publish(msg.reply, b"")

    return await nc.subscribe(subject, cb=on_probe)


async def probe(nc: Client, subject: str, timeout: float) -> bool | None:
    """True: someone answered on `subject`. False: the server says nobody is subscribed there. None: no
    answer in `timeout`, or this client's own connection is down (neither says the other is gone)."""
    try:
        await nc.request(subject, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        return False
    except nats.errors.Error:  # timed out; this connection closed, draining or reconnecting
        return None
    return True
