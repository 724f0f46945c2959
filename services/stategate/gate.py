"""The state gate: node services' only way to JetStream.

A node's NATS user may publish on `dra.v1.gate.<node>.<role>.>` and on no stream's subject; its bus sends
every JetStream call there (nats-py's API prefix) and every message to store as `<prefix>.PUB.<subject>`.
The gate, one of a queue group of replicas, answers only the asker's own inbox, checks the call against
what that role on that node may do (shared.natsusers.node_state_rights), checks what the server does not
(a consumer delivers to the asker's inbox; a store carries no rollup and fits the node's share of bytes),
then makes the call with its own inbox and relays the server's answer unchanged. So no node can have the
server publish where it may not, and a node that floods is refused at its share instead of evicting other
nodes' messages from a shared stream.
"""

from __future__ import annotations

import json

import nats.errors
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind
from prometheus_client import Counter

from services.stategate import rules
from services.stategate.quota import Share
from shared.bus import Bus, inbox_prefix
from shared.events.catalog import GATE_SUBJECT
from shared.logs import Sparse, get_logger
from shared.natsusers import node_user
from shared.telemetry import extract_context, get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
QUEUE = "state-gate"
CALL_TIMEOUT_S = 10.0
CALLS = Counter("gpu_dra_gate_calls", "Calls the state gate made for node services", ["role", "kind"])
REFUSED = Counter("gpu_dra_gate_refused", "Calls of node services the state gate refused", ["role", "reason"])


class StateGate:
    """Serves `dra.v1.gate.>` on `bus` (a cluster identity with JetStream rights) until the bus closes."""

    def __init__(self, bus: Bus, share: Share) -> None:
        self.bus = bus
        self.share = share
        self._logged = Sparse()

    async def start(self) -> None:
        await self.bus.nc.subscribe(f"{GATE_SUBJECT}.*.*.>", queue=QUEUE, cb=self._on_call)  # ends with the bus
        await self.bus.nc.flush()

    async def _on_call(self, msg: Msg) -> None:
        tokens = msg.subject.split(".")
        node, role, call = tokens[3], tokens[4], tokens[5:]
        if not msg.reply or not msg.reply.startswith(inbox_prefix(node_user(role, node)) + "."):
            REFUSED.labels(role, "reply").inc()
            skipped = self._logged.due(f"{node}/{role}/reply")
            if skipped is not None:
                log.warning(
                    "state gate call with a reply subject not the asker's inbox: not answered",
                    subject=msg.subject[:200],
                    reply=(msg.reply or "")[:120],
                    not_logged_since=skipped,
                )
            return
        store = call[0] == "PUB"
        target = ".".join(call[1:]) if store else "$JS.API." + ".".join(call)
        kind = "store" if store else ".".join(call[:2])
        with tracer.start_as_current_span(
            f"gate {kind}",
            context=extract_context(dict(msg.headers or {})),
            kind=SpanKind.SERVER,
            attributes={"messaging.system": "nats", "gpu_dra.node": node, "gpu_dra.role": role},
        ):
            try:
                rules.check_subject(role, node, target)
                if store:
                    rules.check_store_headers(msg.headers)
                    size = len(msg.data) + sum(len(k) + len(v) for k, v in (msg.headers or {}).items())
                    if not self.share.take(node, size):
                        raise rules.Refused(
                            f"quota: node {node} is past its share of the shared streams "
                            f"({self.share.rate:.0f} bytes/s after {self.share.burst:.0f}); "
                            "retry later"
                        )
                elif call[:2] == ["CONSUMER", "CREATE"]:
                    rules.check_consumer(role, node, msg.data)
            except rules.Refused as exc:
                reason = "quota" if str(exc).startswith("quota") else "not-allowed"
                REFUSED.labels(role, reason).inc()
                skipped = self._logged.due(f"{node}/{role}/{reason}")
                if skipped is not None:
                    log.warning(
                        "state gate refused a call",
                        node=node,
                        role=role,
                        call=target[:200],
                        why=str(exc),
                        not_logged_since=skipped,
                    )
                await self._answer_refusal(msg, call, str(exc))
                return
            CALLS.labels(role, kind).inc()
            try:
                answer = await self.bus.nc.request(target, msg.data, timeout=CALL_TIMEOUT_S, headers=msg.headers)
            except nats.errors.NoRespondersError:
                await self.bus.nc.publish(msg.reply, b"", headers={"Status": "503"})
                return
            except nats.errors.TimeoutError:
                log.warning("JetStream did not answer a call the state gate made", call=target[:200])
                return
            await self.bus.nc.publish(msg.reply, answer.data, headers=answer.headers)

    async def _answer_refusal(self, msg: Msg, call: list[str], why: str) -> None:
        """A refusal in the form the asker's nats-py reads as an error: a status for a direct get, a
        JetStream API error for everything else."""
        assert msg.reply is not None
        if call[:2] == ["DIRECT", "GET"]:
            await self.bus.nc.publish(msg.reply, b"", headers={"Status": "403", "Description": why[:200]})
            return
        error = {"error": {"code": 403, "err_code": 10100, "description": why}}
        await self.bus.nc.publish(msg.reply, json.dumps(error).encode())
