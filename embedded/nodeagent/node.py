"""The kubelet emulator's node: the Node object's status and its heartbeat Lease.

Owns registering the Node if it is missing (labels, capacity/allocatable of cpu/memory/pods so
`kubectl get/describe node` look real), its Ready condition (True once the required DRA driver is
registered), and renewing `kube-node-lease/<node>` (coordination.k8s.io/v1 Lease) every ~10 s. It asks
for nothing a kubelet may not: its own Node and Lease (the API server's Node authorizer and NodeRestriction).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from typing import Any, cast

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.logs import get_logger

log = get_logger(__name__)
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
KUBELET_VERSION = "v1.34.0-gpu-dra-emulator"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_status(node: str, ready: bool, message: str, port: int = 10250) -> dict[str, Any]:
    now = _now()
    return {
        "capacity": CAPACITY,
        "allocatable": CAPACITY,
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "message": message,
            }
        ],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": node}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
        "nodeInfo": {
            "kubeletVersion": KUBELET_VERSION,
            "machineID": node,
            "systemUUID": node,
            "bootID": node,
            "kernelVersion": "",
            "osImage": "gpu-dra simulated node",
            "containerRuntimeVersion": "cdi://emulated",
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


class NodeAgent:
    """Writes this node's status and keeps its Lease fresh."""

    def __init__(self, core: client.CoreV1Api, api: client.ApiClient, node: str, port: int = 10250) -> None:
        self.port = port  # the kubelet API's (kubeletserver.py), published in status.daemonEndpoints
        self.core = core
        self.coord = client.CoordinationV1Api(api)
        self.node = node

    async def ensure_node(self, status: dict[str, Any]) -> None:
        """Register the Node if it is missing, with `status` in the create (as a kubelet does), so the
        object is never seen without one."""
        try:
            await self.core.read_node(self.node)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": self.node,
                    "labels": {
                        "kubernetes.io/hostname": self.node,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                    },
                },
                "status": status,
            }
            with contextlib.suppress(ApiException):
                await self.core.create_node(cast(Any, body))
            log.info("node registered", node=self.node)

    async def set_ready(self, ready: bool, message: str) -> None:
        try:
            status = node_status(self.node, ready, message, self.port)
            await self.ensure_node(status)
            await self.core.patch_node_status(self.node, {"status": status})
        except (ApiException, OSError, TimeoutError, aiohttp.ClientError) as exc:
            log.warning(
                "node status not written; retried on the next change or heartbeat", node=self.node, error=str(exc)
            )

    async def renew_lease(self) -> None:
        """Patch the node's Lease, or create it. As a kubelet, the emulator touches no Namespace: the API server
        makes kube-node-lease, and the Node authorizer lets a node at no other namespace's leases."""
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _micro_now()}
        try:
            await self.coord.patch_namespaced_lease(self.node, LEASE_NAMESPACE, {"spec": spec})
        except ApiException as exc:
            if exc.status != 404:
                raise
            await self.coord.create_namespaced_lease(
                LEASE_NAMESPACE,
                cast(
                    Any,
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": self.node, "namespace": LEASE_NAMESPACE},
                        "spec": spec,
                    },
                ),
            )

    async def heartbeat(self, stopping: asyncio.Event, interval: float = RENEW_SECONDS) -> None:
        while not stopping.is_set():
            try:
                await self.renew_lease()
            except (ApiException, OSError, TimeoutError, aiohttp.ClientError) as exc:
                log.warning("node lease not renewed; retrying", node=self.node, error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval)
