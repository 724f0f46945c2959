"""One trace per claim, as an SRE sees it: `gpu-dra up` exporting OTLP over gRPC to an in-test receiver;
one pod's claim trace holds the scheduler, the kubelet call, the preparer, CDI and checkpoint spans and the
claim's lifecycle events, with the claim, pod, device and GPU attributes and per-service resources. A process
exporting over HTTP (a second `gpu-dra dashboard`) adds its spans to the same claim's trace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.cluster.helpers import Up, pod_manifest
from tests.otlpreceiver import Received, Spans, grpc_receiver, http_receiver

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]

WANTED = (
    "scheduler.allocate_claim",
    "kubelet NodePrepareResources",
    "NodePrepareResources",
    "claim.prepare",
    "cdi.write",
    "checkpoint.write",
    "publish claim-lifecycle",
)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Spans]]:
    spans = Spans()
    server, port = grpc_receiver(spans)
    cluster = Up(
        tmp_path_factory.mktemp("traced") / "cluster",
        nodes=1,
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        },
    )
    try:
        cluster.wait_ready()
        yield cluster, spans
    finally:
        cluster.kill()
        server.stop(0)


def claim_trace(spans: Spans, claim_uid: str, timeout: float = 60) -> list[Received]:
    """The spans of the trace the scheduler started for the claim, once every WANTED name is in it (re-checked
    at each export the receiver gets)."""
    names: set[str] = set()

    def complete(got: list[Received]) -> list[Received] | None:
        roots = [
            s for s in got if s.name == "scheduler.allocate_claim" and s.attributes.get("dra.claim.uid") == claim_uid
        ]
        if not roots:
            return None
        in_trace = [s for s in got if s.trace_id == roots[0].trace_id]
        names.clear()
        names.update(s.name for s in in_trace)
        done = all(n in names for n in WANTED) and sum(s.name == "publish claim-lifecycle" for s in in_trace) >= 2
        return in_trace if done else None

    found = spans.wait_for(complete, timeout)
    if found is None:
        raise AssertionError(f"claim {claim_uid}'s trace lacks {sorted(set(WANTED) - names)}; has {sorted(names)}")
    return found


def test_one_claims_trace_goes_from_the_scheduler_to_its_lifecycle_events(traced: tuple[Up, Spans]) -> None:
    up, spans = traced
    up.kubectl("apply", "-f", "-", stdin=pod_manifest("traced"))
    up.kubectl("wait", "--for=condition=Ready", "pod/traced", "--timeout=60s")
    pod = up.json("get", "pod", "traced")
    (claim,) = [c for c in up.json("get", "resourceclaims")["items"] if c["metadata"]["name"].startswith("traced-")]
    uid = claim["metadata"]["uid"]
    traceparent = claim["metadata"]["annotations"]["gpu.nvidia.com/traceparent"]

    in_trace = claim_trace(spans, uid)
    by_name = {s.name: s for s in in_trace}
    root = by_name["scheduler.allocate_claim"]
    assert traceparent.split("-")[1:3] == [root.trace_id, root.span_id]
    assert root.parent_span_id == "" and root.links, "a root of its own, linked to the pod's scheduling span"
    assert root.attributes["k8s.pod.uid"] == pod["metadata"]["uid"]
    # the kubelet's call continues the claim's trace, and stays the parent of the preparer's server span
    assert by_name["kubelet NodePrepareResources"].parent_span_id == root.span_id
    assert by_name["NodePrepareResources"].parent_span_id == by_name["kubelet NodePrepareResources"].span_id
    prepare = by_name["claim.prepare"]
    assert prepare.parent_span_id == by_name["NodePrepareResources"].span_id
    assert (root.trace_id, root.span_id) in prepare.links
    assert prepare.attributes["dra.claim.uid"] == uid
    assert prepare.attributes["k8s.namespace.name"] == "default"
    assert prepare.attributes["k8s.pod.uid"] == pod["metadata"]["uid"]
    (device,) = prepare.attributes["dra.device"]
    assert device.startswith("gpu-") and prepare.attributes["gpu.uuid"][0].startswith("GPU-")
    assert prepare.attributes["cdi.device_ids"] == [f"k8s.gpu.nvidia.com/claim={uid}-{device}"]
    # the lifecycle events are published (from the outbox, later) in the spans that caused them
    spans_by_id = {s.span_id: s for s in in_trace}
    published = [s for s in in_trace if s.name == "publish claim-lifecycle"]
    assert all(spans_by_id[s.parent_span_id].name == "claim.prepare" for s in published)
    assert {s.attributes["messaging.destination.name"].rsplit(".", 1)[1] for s in published} >= {
        "prepare-started",
        "prepared",
    }
    # resources: one logical service each, the node apart
    services = {s.resource["service.name"] for s in in_trace}
    assert {"gpu-dra-scheduler", "gpu-dra-kubelet", "gpu-dra-preparer"} <= services, services
    preparer = by_name["claim.prepare"].resource
    assert preparer["k8s.node.name"] == "gpu-node-0"
    assert preparer["service.version"] and preparer["service.instance.id"]


DOMAIN = """
apiVersion: resource.nvidia.com/v1beta1
kind: ComputeDomain
metadata: {name: traced-domain, namespace: default}
spec: {numNodes: 1, channel: {resourceClaimTemplate: {name: traced-channel}}}
---
apiVersion: v1
kind: Pod
metadata: {name: traced-imex, namespace: default}
spec:
  containers: [{name: ctr, image: ubuntu:22.04, command: [sleep, "600"], resources: {claims: [{name: channel}]}}]
  resourceClaims: [{name: channel, resourceClaimTemplateName: traced-channel}]
"""


def ancestry(span: Received, got: list[Received]) -> list[str] | None:
    """The names of `span`'s parents, nearest first, up to its trace's root; None while the receiver lacks one
    of them (each process exports its own spans in its own batches, so a child can arrive before its parent)."""
    by_id = {s.span_id: s for s in got}
    names: list[str] = []
    while span.parent_span_id:
        parent = by_id.get(span.parent_span_id)
        if parent is None:
            return None
        names.append(parent.name)
        span = parent
    return names


def test_a_nodes_first_inventory_and_a_domains_status_continue_the_traces_that_caused_them(
    traced: tuple[Up, Spans],
) -> None:
    up, spans = traced

    def first_write(got: list[Received]) -> list[str] | None:
        writes = [
            s
            for s in got
            if s.name == "publisher.sync-node"
            and s.attributes.get("publisher.writes")
            and s.attributes.get("k8s.node.name") == "gpu-node-0"
        ]
        return ancestry(writes[0], got) if writes else None

    # read from its KV key (the publisher was not listening yet) or from its event, the node's first
    # inventory is consumed in discovery's trace
    chain = spans.wait_for(first_write, 30)
    assert chain and chain[0] in ("consume dra-inventory", "consume inventory"), chain
    assert chain[-1] == "discovery.publish-inventory", chain

    up.kubectl("apply", "-f", "-", stdin=DOMAIN)
    up.kubectl("wait", "--for=condition=Ready", "pod/traced-imex", "--timeout=60s")
    (claim,) = [c for c in up.json("get", "resourceclaims")["items"] if c["metadata"]["name"].startswith("traced-imex")]
    uid = claim["metadata"]["uid"]

    def ready_status(got: list[Received]) -> list[Received] | None:
        roots = [s for s in got if s.name == "scheduler.allocate_claim" and s.attributes.get("dra.claim.uid") == uid]
        published = [s for s in got if s.name == "publish cd-status" and roots and s.trace_id == roots[0].trace_id]
        return [*roots, *published] if published else None

    def status_chain(got: list[Received]) -> list[str] | None:
        found = ready_status(got)
        return ancestry(found[-1], got) if found else None

    # the domain's status follows the agent's report of the node joining, which the claim's prepare asked for
    chain = spans.wait_for(status_chain, 30)
    assert chain, "no cd-status published in the channel claim's trace, or its parents never arrived"
    assert chain[:3] == ["computedomain.reconcile", "consume dra-cd-members", "serve cd-agent-join"], chain
    assert "claim.prepare" in chain and chain[-1] == "scheduler.allocate_claim", chain
    prepare = next(
        s for s in spans.snapshot() if s.name == "claim.prepare" and s.attributes.get("dra.claim.uid") == uid
    )
    (device,) = prepare.attributes["dra.device"]
    assert device.startswith("channel-") and prepare.resource["service.name"] == "gpu-dra-preparer"


def test_a_process_exporting_over_http_adds_its_spans_to_the_claims_trace(traced: tuple[Up, Spans]) -> None:
    """OTLP over HTTP/protobuf end to end: a second fleet page, beside the cluster, exports over HTTP to
    its own receiver; its consumer span of the claim's lifecycle event lands in the trace the scheduler
    started, whose other spans came over gRPC."""
    up, spans = traced
    assert up.data_dir is not None and up.kubeconfig is not None
    receiver = http_receiver(spans)
    nats = json.loads((up.data_dir / "nats.json").read_text())
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "GPU_DRA_NATS_URL": nats["url"],
        "GPU_DRA_NATS_CREDS": nats["creds"],
        "GPU_DRA_NATS_USER": nats["user"],
    }
    page = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "dashboard",
            "--kubeconfig",
            str(up.kubeconfig),
            "--listen",
            "127.0.0.1:0",
            "--auth",
            "none",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert page.stdout is not None
        line = page.stdout.readline()  # printed once it listed the fleet and subscribed to the bus
        assert line.startswith("dashboard: http://"), f"the second dashboard did not start (exit {page.poll()})"
        up.kubectl("delete", "pod", "traced", "--ignore-not-found", "--wait=true", "--timeout=60s")  # its GPU
        up.kubectl("apply", "-f", "-", stdin=pod_manifest("traced-http"))
        up.kubectl("wait", "--for=condition=Ready", "pod/traced-http", "--timeout=60s")
        (claim,) = [
            c for c in up.json("get", "resourceclaims")["items"] if c["metadata"]["name"].startswith("traced-http-")
        ]
        uid = claim["metadata"]["uid"]

        def joined(got: list[Received]) -> tuple[Received, Received] | None:
            roots = [
                s for s in got if s.name == "scheduler.allocate_claim" and s.attributes.get("dra.claim.uid") == uid
            ]
            if not roots:
                return None
            over_http = [
                s
                for s in got
                if s.trace_id == roots[0].trace_id and s.via == "http" and s.name == "consume claim-lifecycle"
            ]
            return (roots[0], over_http[0]) if over_http else None

        found = spans.wait_for(joined, 60)
        assert found is not None, "no span of the claim's trace came over HTTP"
        root, consumed = found
        assert root.via == "grpc" and consumed.resource["service.name"] == "gpu-dra-dashboard"
    finally:
        page.terminate()
        page.wait(timeout=30)
        receiver.shutdown()
