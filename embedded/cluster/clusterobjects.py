"""The objects a local cluster starts with: the CRDs (ComputeDomain's, NodeConfig's as deploy/ ships it), the
DeviceClasses, `--node-config`'s NodeConfig, the namespaces, and a Node per simulated node (NotReady until its
kubelet says otherwise). Installing again on a kept data directory changes nothing that is already there, except
the NodeConfig (replaced by the file's) and each Node's Ready condition (reset)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.cluster import identities
from embedded.cluster.apply import load_documents
from shared.deviceclasses import device_classes

NOT_READY = {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}


async def install(
    api: client.ApiClient, node_names: list[str], node_config: str, progress: Callable[[str], None]
) -> None:
    from services.computedomain.crd import crds  # the ComputeDomain service owns its CRDs

    ext = client.ApiextensionsV1Api(api)
    # the publisher watches NodeConfig objects (its sharing config): the CRD as deploy/ ships it
    nodeconfigs = load_documents(identities.DEPLOY_BASE / "crds" / "nodeconfigs.yaml")
    for crd in [*crds(), *nodeconfigs]:
        with contextlib.suppress(ApiException):
            await ext.create_custom_resource_definition(crd)  # type: ignore[arg-type]  # the client sends plain dicts as they are
    custom = client.CustomObjectsApi(api)
    for dc in device_classes("v1"):
        with contextlib.suppress(_AlreadyThere):
            await _created(custom.create_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", dc))
    if node_config:  # checked at start (ClusterConfig): the object the publisher then watches
        name = await _replace_node_config(custom, load_documents(Path(node_config))[0])
        progress(f"NodeConfig {name} from {node_config}")
    core = client.CoreV1Api(api)
    for namespace in ("gpu-dra", "default"):
        with contextlib.suppress(ApiException):
            await core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]  # the client sends plain dicts as they are
    for node in node_names:
        body: dict[str, Any] = {
            "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "nvidia.com/gpu.present": "true"}},
            "status": NOT_READY,
        }
        try:
            await _created(core.create_node(body))  # type: ignore[arg-type]  # the client sends plain dicts as they are
        except _AlreadyThere:  # kept from a previous run: Ready again only once this run's kubelet says so
            await core.patch_node_status(node, {"status": NOT_READY})
    progress(f"CRDs, DeviceClasses, Nodes {', '.join(node_names)}")


class _AlreadyThere(Exception):
    """The object exists (409 Conflict on create)."""


async def _created(request: Any) -> None:
    try:
        await request
    except ApiException as exc:
        if exc.status == 409:
            raise _AlreadyThere from exc
        raise


async def _replace_node_config(custom: client.CustomObjectsApi, body: dict[str, Any]) -> str:
    """--node-config's object, created or (kept from an earlier run on this data dir) replaced; its name."""
    group, version = body["apiVersion"].split("/")
    name: str = body["metadata"]["name"]
    try:
        await _created(custom.create_cluster_custom_object(group, version, "nodeconfigs", body))
    except _AlreadyThere:
        stored = await custom.get_cluster_custom_object(group, version, "nodeconfigs", name)
        body = {**body, "metadata": {**body["metadata"], "resourceVersion": stored["metadata"]["resourceVersion"]}}
        await custom.replace_cluster_custom_object(group, version, "nodeconfigs", name, body)
    return name
