"""End to end in one process: claims in the embedded API server, the preparer on its real sockets, discovery
over a real nats-server. Traces, NATS outages, concurrent calls and stale-claim cleanup."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import RunningDiscovery
from embedded.kubelet.client import register
from services.preparer.host.checkpoint import ClaimRecord, PreparedDevice
from services.preparer.host.claims import KubeClaimSource
from shared.bus import Bus
from shared.events.claims import ClaimLifecycle
from shared.natsserver import EmbeddedNats
from shared.telemetry import CLAIM_TRACEPARENT_ANNOTATION
from tests.preparer.helpers import ApiClaims, claim_doc, gpu_config, running_node


async def test_one_trace_from_kubelet_through_discovery_to_checkpoint(
    spans: InMemorySpanExporter, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    async with running_apiserver(root / "api") as api, api.client() as client:
        claims = ApiClaims(client)
        claim = await claims.add(
            claim_doc(
                name="traced",
                results=[("gpu", "gpu-0")],
                configs=[gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}})],
            )
        )
        async with running_node(KubeClaimSource(client), root, bus=bus) as node:
            spans.clear()
            result = (await node.plugin.prepare([claim]))[claim.uid]
            assert result.error == ""
            finished = spans.get_finished_spans()
            client_span = next(s for s in finished if s.name == "kubelet NodePrepareResources")
            in_trace = [s for s in finished if s.context.trace_id == client_span.context.trace_id]
            by_name = {s.name: s for s in in_trace}
            server = by_name["NodePrepareResources"]
            assert server.kind == trace.SpanKind.SERVER
            assert server.parent is not None and server.parent.span_id == client_span.context.span_id
            for child in ("device.set-sharing", "cdi.write", "checkpoint.write"):
                assert child in by_name, (child, sorted(by_name))
            prepare = by_name["claim.prepare"]
            assert (prepare.attributes or {})["configs.groups"] == 1
            assert "serve device-set-sharing" in by_name  # discovery continued the same trace over NATS
            (read,) = [e for e in prepare.events if e.name == "claim.get"]  # the claim's read: an event, first
            took = (read.attributes or {})["dra.claim.get_ms"]
            assert (prepare.start_time or 0) < read.timestamp and isinstance(took, float) and took > 0
            assert prepare.events[0] is read
            await node.plugin.unprepare([claim])


async def test_a_kubelet_without_trace_context_gets_the_prepare_into_the_claims_trace(
    spans: InMemorySpanExporter, root: Path, bus: Bus, discovery: RunningDiscovery
) -> None:
    scheduler = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # the claim's trace, as annotated
    async with running_apiserver(root / "api") as api, api.client() as client:
        doc = claim_doc(name="annotated", results=[("gpu", "gpu-1")])
        doc["metadata"]["annotations"] = {CLAIM_TRACEPARENT_ANNOTATION: scheduler}
        claims = ApiClaims(client)
        claim = await claims.add(doc)
        async with running_node(KubeClaimSource(client), root, bus=bus) as node:
            spans.clear()
            plugin = node.plugin
            request = plugin._pb2.NodePrepareResourcesRequest(
                claims=[
                    plugin._pb2.Claim(  # noqa: SLF001
                        namespace=claim.namespace, uid=claim.uid, name=claim.name
                    )
                ]
            )
            response = await plugin._stub.NodePrepareResources(request, timeout=30)  # noqa: SLF001 - no metadata
            assert response.claims[claim.uid].error == ""
            await node.service.events.drained()
            finished = spans.get_finished_spans()
            server = next(s for s in finished if s.name == "NodePrepareResources")
            assert server.parent is None  # nobody sent a context: the RPC is a root ...
            prepare = next(s for s in finished if s.name == "claim.prepare")
            # ... and the claim's prepare continues the scheduler's trace, linked back to the RPC
            assert prepare.parent is not None and format(prepare.parent.span_id, "016x") == "b7ad6b7169203331"
            assert format(prepare.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
            assert [link.context.span_id for link in prepare.links] == [server.context.span_id]
            assert (prepare.attributes or {})["dra.device"] == ("gpu-1",)
            published = [s for s in finished if s.name == "publish claim-lifecycle"]
            assert len(published) == 2 and all(
                s.parent is not None and s.parent.span_id == prepare.context.span_id for s in published
            )
            spans.clear()
            # the claim is gone by the time of the unprepare (as after a pod's deletion): the link comes from
            # the context its checkpoint record kept, not from reading the claim
            await claims.delete(claim)
            await node.plugin.unprepare([claim])
            # the unprepare: the RPC's child, linked to the claim's trace, with what it held
            unprepare = next(s for s in spans.get_finished_spans() if s.name == "claim.unprepare")
            assert [format(link.context.span_id, "016x") for link in unprepare.links] == ["b7ad6b7169203331"]
            assert (unprepare.attributes or {})["dra.claim.uid"] == claim.uid
            assert (unprepare.attributes or {})["dra.device"] == ("gpu-1",)
            # a claim that cannot be read fails before any device is touched: its span is the RPC's child, failed
            spans.clear()
            gone = type(claim)(namespace=claim.namespace, name="gone", uid="0000-gone")
            assert "not found" in (await node.plugin.prepare([gone]))[gone.uid].error
            finished = spans.get_finished_spans()
            failed = next(s for s in finished if s.name == "claim.prepare")
            rpc = next(s for s in finished if s.name == "NodePrepareResources")
            assert failed.parent is not None and failed.parent.span_id == rpc.context.span_id
            assert failed.status.status_code == trace.StatusCode.ERROR and [e.name for e in failed.events] == [
                "claim.get",
                "exception",
            ]
            assert (failed.attributes or {})["dra.failure.reason"] == "not-found"
            assert (failed.attributes or {})["dra.claim.uid"] == "0000-gone"


async def test_plain_gpu_works_with_nats_down_and_events_follow_when_it_returns(
    root: Path, nats_server: EmbeddedNats, discovery: RunningDiscovery
) -> None:
    bus = await Bus.connect(nats_server.url, name="preparer-under-test", reconnect_wait=0.1)
    try:
        async with running_apiserver(root / "api") as api, api.client() as client:
            claims = ApiClaims(client)
            claim = await claims.add(claim_doc(name="offline", results=[("gpu", "gpu-3")]))
            async with running_node(KubeClaimSource(client), root, bus=bus) as node:
                await node.service.events.drained()
                await nats_server.stop()
                result = (await node.plugin.prepare([claim]))[claim.uid]
                assert result.error == "" and result.devices[0].device == "gpu-3"
                assert [e.event for e in node.service.events.pending] == ["prepare-started", "prepared"]
                await nats_server.start()
                async with asyncio.timeout(30):
                    await node.service.events.drained()
                reader = await Bus.connect(nats_server.url, name="reader")
                try:
                    sub = await reader.js.subscribe("dra.v1.claim.default.n1.>", ordered_consumer=True)
                    seen: list[ClaimLifecycle] = []
                    async with asyncio.timeout(10):
                        while len(seen) < 2:
                            msg = await sub.next_msg(timeout=5)
                            seen.append(msgspec.json.decode(msg.data, type=ClaimLifecycle))
                    assert [(e.event, e.claim_uid) for e in seen] == [
                        ("prepare-started", claim.uid),
                        ("prepared", claim.uid),
                    ]
                    assert seen[1].devices[0].device == "gpu-3"
                    assert msg.subject == "dra.v1.claim.default.n1.prepared"
                finally:
                    await reader.close()
                assert await node.plugin.unprepare([claim]) == {claim.uid: ""}
    finally:
        await bus.close()


async def test_concurrent_calls_for_one_claim_are_serialised(root: Path) -> None:
    async with running_apiserver(root / "api") as api, api.client() as client:
        (root / "host" / "dev").mkdir(parents=True)
        (root / "host" / "dev" / "nvidia0").touch()
        claims = ApiClaims(client)
        claim = await claims.add(claim_doc(name="twice", results=[("gpu", "gpu-0")]))
        async with running_node(KubeClaimSource(client), root, dev_root=str(root / "host")) as node:
            second = await register(node.service.registration_socket)
            try:
                a, b = await asyncio.gather(node.plugin.prepare([claim]), second.prepare([claim]))
            finally:
                await second.close()
            assert a == b and a[claim.uid].error == ""
            assert [e.event for e in node.service.events.pending] == ["prepare-started", "prepared"]


async def test_stale_prepare_started_claims_are_rolled_back(root: Path) -> None:
    async with running_apiserver(root / "api") as api, api.client() as client:
        claims = ApiClaims(client)
        live = await claims.add(claim_doc(name="live", results=[("gpu", "gpu-1")]))
        gone = await claims.add(claim_doc(name="gone", results=[("gpu", "gpu-0")]))
        moved = await claims.add(claim_doc(name="moved", results=[("gpu", "gpu-2")], node="n2"))
        await claims.delete(gone)
        async with running_node(KubeClaimSource(client), root) as node:
            for ref, dev in ((live, "gpu-1"), (gone, "gpu-0"), (moved, "gpu-2")):
                await node.service.checkpoint.put(
                    ref.uid,
                    ClaimRecord(
                        state="PrepareStarted",
                        name=ref.name,
                        namespace=ref.namespace,
                        started_at=time.time(),
                        devices=[PreparedDevice(requests=["gpu"], pool="n1", device=dev)],
                    ),
                )
            assert await node.service.preparer.cleanup_stale() == 2
            assert set(node.service.checkpoint.claims) == {live.uid}
            rolled = [e for e in node.service.events.pending if e.event == "rolled-back"]
            assert {e.claim_uid for e in rolled} == {gone.uid, moved.uid}
