"""The kubelet emulator end to end: embedded API server, real nats-server, simulated discovery (h100x2),
the real preparer on unix sockets, and `gpu-dra kubelet`'s run loop in-process.

The claims' allocation and reservedFor are written here (the scheduler is tested elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from embedded.apiserver.testing import running_apiserver
from embedded.harness.discovery import running_discovery
from embedded.kubelet.client import Claim
from embedded.nodeagent import cli as kubelet_cli
from embedded.nodeagent.podclaims import EDITS_ANNOTATION
from embedded.nodeagent.pods import EXIT_ANNOTATION, FAILED_REASON
from services.preparer.host.claims import KubeClaimSource
from shared.bus import Bus
from shared.kube.resources import PODS, RESOURCECLAIMS, Kube
from shared.natsserver import EmbeddedNats
from tests.preparer.helpers import ApiClaims, Node, claim_doc, cleanup, running_node, short_root

PREPARE_SPAN = "kubelet NodePrepareResources"
REPO = Path(__file__).resolve().parents[2]


async def until(what: str, check: Callable[[], Awaitable[Any]], timeout: float = 15.0) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@dataclass
class Cluster:
    root: Path
    api: Any
    client: k8s.ApiClient
    core: k8s.CoreV1Api
    kube: Kube
    claims: ApiClaims
    node: Node
    kubelet: asyncio.Task[None] | None = None
    stopping: asyncio.Event | None = None

    def kubelet_config(self) -> kubelet_cli.KubeletConfig:
        return kubelet_cli.KubeletConfig(
            node="n1",
            kubeconfig=str(self.api.kubeconfig_path),
            registry_dir=str(self.root / "reg"),
            cdi_dir=str(self.root / "cdi"),
            state_dir=str(self.root / "kubelet-state"),
            resync_seconds=5.0,
            runtime="none",
        )  # claims and status, not processes (test_containers.py runs those)

    def start_kubelet(self) -> None:
        self.stopping = asyncio.Event()
        self.kubelet = asyncio.create_task(kubelet_cli.run(self.kubelet_config(), self.stopping))

    async def kill_kubelet(self) -> None:
        """Gone at once, mid-whatever (an in-process kill -9: the task is cancelled, nothing waits for it)."""
        assert self.kubelet is not None
        self.kubelet.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.kubelet
        self.kubelet = None

    async def stop_kubelet(self) -> None:
        if self.kubelet is not None and self.stopping is not None:
            self.stopping.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self.kubelet, 10)
            self.kubelet = None

    async def kubelet_process(self) -> asyncio.subprocess.Process:
        cfg = self.kubelet_config()
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shared.cli",
            "kubelet",
            "--node",
            cfg.node,
            "--kubeconfig",
            cfg.kubeconfig,
            "--registry-dir",
            cfg.registry_dir,
            "--cdi-dir",
            cfg.cdi_dir,
            "--state-dir",
            cfg.state_dir,
            "--resync-seconds",
            "5",
            "--runtime",
            "none",
            cwd=str(REPO),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )

    async def pod(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        try:
            return self.client.sanitize_for_serialization(await self.core.read_namespaced_pod(name, ns))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def create_pod(
        self,
        name: str,
        claim: str | None,
        containers: list[str],
        *,
        annotations: dict[str, str] | None = None,
        request: str = "",
        node: str | None = "n1",
    ) -> dict[str, Any]:
        use = {"name": "gpu", **({"request": request} if request else {})}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}},
            "spec": {
                **({"nodeName": node} if node else {}),
                "terminationGracePeriodSeconds": 30,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}] if claim else [],
                "containers": [
                    {
                        "name": c,
                        "image": "cuda",
                        "command": ["sleep", "infinity"],
                        "resources": {"claims": [use]} if claim else {},
                    }
                    for c in containers
                ],
            },
        }
        created = await self.core.create_namespaced_pod("default", body)  # type: ignore[arg-type]  # the client sends a dict as it is
        return self.client.sanitize_for_serialization(created)

    async def reserve(self, claim: Claim, *pods: dict[str, Any]) -> None:
        await self.kube.patch(
            RESOURCECLAIMS,
            claim.namespace,
            claim.name,
            {
                "status": {
                    "reservedFor": [
                        {"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]} for p in pods
                    ]
                }
            },
            subresource="status",
        )

    async def running(self, name: str) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            pod = await self.pod(name)
            ok = (
                pod
                and pod["status"].get("phase") == "Running"
                and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
            )
            return pod if ok else None

        pod: dict[str, Any] = await until(f"pod {name} Running/Ready", check)
        return pod

    async def gone(self, name: str) -> None:
        async def check() -> bool:
            return await self.pod(name) is None

        await until(f"pod {name} gone", check)

    def checkpointed(self) -> set[str]:
        return set(self.node.service.checkpoint.claims)


@pytest.fixture
async def cluster(nats_server: EmbeddedNats) -> AsyncIterator[Cluster]:
    root = short_root()
    bus = await Bus.connect(nats_server.url, name="kubelet-test")
    await bus.provision()
    try:
        async with (
            running_discovery(bus, node="n1", simulate="h100x2", root=root / "sim"),
            running_apiserver(root / "api") as api,
            api.client() as client,
            running_node(KubeClaimSource(client), root, bus=bus) as node,
        ):
            c = Cluster(root, api, client, k8s.CoreV1Api(client), Kube(client), ApiClaims(client), node)
            c.start_kubelet()
            try:
                yield c
            finally:
                await c.stop_kubelet()
    finally:
        await bus.close()
        cleanup(root)


def edits_of(pod: dict[str, Any]) -> dict[str, Any]:
    return json.loads((pod["metadata"].get("annotations") or {}).get(EDITS_ANNOTATION, "{}"))


def visible(edit: dict[str, Any]) -> str:
    env = dict(e.split("=", 1) for e in edit["env"])
    return env.get("NVIDIA_VISIBLE_DEVICES", "")


async def test_node_ready_pod_runs_two_containers_share_gpu_and_delete_unprepares(
    cluster: Cluster, spans: InMemorySpanExporter
) -> None:
    async def ready() -> bool:
        try:
            node = await cluster.core.read_node("n1")
        except ApiException:
            return False
        conditions = (node.status.conditions if node.status else None) or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    await until("node n1 Ready", ready)
    node = await cluster.core.read_node("n1")
    assert node.status.allocatable["pods"] == "110" and node.status.capacity["cpu"] == "16"
    lease = await k8s.CoordinationV1Api(cluster.client).read_namespaced_lease("n1", "kube-node-lease")
    assert lease.spec.holder_identity == "n1" and lease.spec.renew_time is not None

    spans.clear()
    claim = await cluster.claims.add(claim_doc(name="shared", results=[("gpu", "gpu-0")]))
    pod = await cluster.create_pod("two", claim.name, ["a", "b"])
    await cluster.reserve(claim, pod)
    running = await cluster.running("two")
    edits = edits_of(running)
    assert set(edits) == {"a", "b"}
    assert edits["a"]["devices"] == edits["b"]["devices"] == ["n1/gpu-0"]
    assert edits["a"]["deviceNodes"] and edits["a"]["deviceNodes"] == edits["b"]["deviceNodes"]
    assert any("/dev/nvidia" in n for n in edits["a"]["deviceNodes"]), edits["a"]
    assert visible(edits["a"]) and visible(edits["a"]) == visible(edits["b"])
    assert claim.uid in cluster.checkpointed() and cluster.node.cdi_files()

    finished = spans.get_finished_spans()
    client_span = next(s for s in finished if s.name == PREPARE_SPAN)
    server = next(
        s for s in finished if s.name == "NodePrepareResources" and s.context.trace_id == client_span.context.trace_id
    )
    assert server.parent is not None and server.parent.span_id == client_span.context.span_id

    await cluster.core.delete_namespaced_pod("two", "default")  # graceful: the kubelet finishes it
    await cluster.gone("two")
    assert cluster.checkpointed() == set()
    assert cluster.node.cdi_files() == [] or all(claim.uid not in f for f in cluster.node.cdi_files())


async def test_claim_not_reserved_is_pending_with_reason_then_both_pods_run_with_one_prepare(
    cluster: Cluster, spans: InMemorySpanExporter
) -> None:
    claim = await cluster.claims.add(claim_doc(name="later", results=[("gpu", "gpu-1")]))
    first = await cluster.create_pod("waiting", claim.name, ["main"])
    second = await cluster.create_pod("waiting2", claim.name, ["main"])

    async def failed_events() -> list[Any]:
        listed = await cluster.core.list_namespaced_event(
            "default", field_selector=f"involvedObject.uid={first['metadata']['uid']},reason={FAILED_REASON}"
        )
        return list(listed.items)

    [event] = await until(FAILED_REASON, failed_events)  # as the kubelet: a Warning Event on the pod
    assert event.type == "Warning" and event.source.component == "kubelet"
    assert (event.involved_object.kind, event.involved_object.name) == ("Pod", "waiting")
    assert event.message.startswith("Failed to prepare dynamic resources: ")
    assert "not reserved for this pod" in event.message
    pending = await cluster.pod("waiting")
    assert pending is not None and pending["status"]["phase"] == "Pending"
    assert pending["status"]["containerStatuses"][0]["state"] == {"waiting": {"reason": "ContainerCreating"}}
    assert cluster.checkpointed() == set()

    spans.clear()
    await cluster.reserve(claim, first, second)
    for name in ("waiting", "waiting2"):
        running = await cluster.running(name)
        assert edits_of(running)["main"]["devices"] == ["n1/gpu-1"]
        # nothing of the failed attempts is left on the running pod
        assert set(running["status"]["containerStatuses"][0]["state"]) == {"running"}
        ready = next(c for c in running["status"]["conditions"] if c["type"] == "Ready")
        assert "reason" not in ready and "message" not in ready
    assert len(await failed_events()) == 1  # repeats of one failure are not recorded again
    assert len([s for s in spans.get_finished_spans() if s.name == PREPARE_SPAN]) == 1  # shared, prepared once

    await cluster.core.delete_namespaced_pod("waiting", "default")
    await cluster.gone("waiting")
    assert claim.uid in cluster.checkpointed()  # still used by waiting2
    await cluster.core.delete_namespaced_pod("waiting2", "default")
    await cluster.gone("waiting2")
    assert cluster.checkpointed() == set()


async def test_extended_resource_claim_and_emulated_exit_unprepares(cluster: Cluster) -> None:
    claim = await cluster.claims.add(claim_doc(name="ext", results=[("container-0-request-0", "gpu-0")]))
    pod = await cluster.create_pod("ext", None, ["main", "side"], annotations={EXIT_ANNOTATION: "0"}, node=None)
    # What the scheduler writes for `nvidia.com/gpu: 1` on container main, before it binds the pod.
    await cluster.kube.patch(
        PODS,
        "default",
        "ext",
        {
            "status": {
                "extendedResourceClaimStatus": {
                    "resourceClaimName": claim.name,
                    "requestMappings": [
                        {
                            "containerName": "main",
                            "resourceName": "nvidia.com/gpu",
                            "requestName": "container-0-request-0",
                        }
                    ],
                }
            }
        },
        subresource="status",
    )
    await cluster.reserve(claim, pod)
    await cluster.kube.create_subresource(
        PODS,
        "default",
        "ext",
        "binding",
        {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": "ext", "namespace": "default"},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
        },
    )

    async def done() -> dict[str, Any] | None:
        p = await cluster.pod("ext")
        return p if p and p["status"].get("phase") == "Succeeded" else None

    finished = await until("pod ext Succeeded", done)
    edits = edits_of(finished)
    assert set(edits) == {"main"} and edits["main"]["devices"] == ["n1/gpu-0"]
    terminated = finished["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0

    async def unprepared() -> bool:
        return claim.uid not in cluster.checkpointed()

    await until("extended claim unprepared", unprepared)


async def test_kill_9_and_restart_relearns_running_pods_and_unprepares_what_vanished_meanwhile(
    cluster: Cluster, spans: InMemorySpanExporter
) -> None:
    keep = await cluster.claims.add(claim_doc(name="keep", results=[("gpu", "gpu-0")]))
    lost = await cluster.claims.add(claim_doc(name="lost", results=[("gpu", "gpu-1")]))
    pod_keep = await cluster.create_pod("keep", keep.name, ["main"])
    pod_lost = await cluster.create_pod("lost", lost.name, ["main"])
    await cluster.reserve(keep, pod_keep)
    await cluster.reserve(lost, pod_lost)
    await cluster.running("keep")
    await cluster.running("lost")
    assert cluster.checkpointed() == {keep.uid, lost.uid}

    # From here on the emulator is `gpu-dra kubelet` in a process of its own, killed with SIGKILL.
    await cluster.stop_kubelet()
    spans.clear()
    first = await cluster.kubelet_process()
    try:

        async def relearned() -> bool:  # it wrote its node status: it is up and has listed the pods
            node = await cluster.core.read_node("n1")
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

        await until("restarted kubelet up", relearned)
    finally:
        first.kill()
        await first.wait()
    # While it is down, "lost" is force-deleted: nobody is left to tell the preparer.
    await cluster.core.delete_namespaced_pod("lost", "default", grace_period_seconds=0)
    await cluster.gone("lost")
    second = await cluster.kubelet_process()
    try:

        async def lost_unprepared() -> bool:
            return lost.uid not in cluster.checkpointed()

        await until("claim of the vanished pod unprepared", lost_unprepared)
        assert keep.uid in cluster.checkpointed()
        await cluster.running("keep")
        # The preparer saw no second NodePrepareResources for the pod that kept running.
        assert [s for s in spans.get_finished_spans() if s.name == "NodePrepareResources"] == []

        await cluster.core.delete_namespaced_pod("keep", "default")
        await cluster.gone("keep")
        assert cluster.checkpointed() == set()
    finally:
        second.kill()
        await second.wait()
