"""DesiredPool -> ResourceSlice objects on the wire, with stable names and a content hash.

Owns slice names (`<node>-<driver>-<index>`, shortened with a hash past 253 characters), the owner
reference to the Node, the content hash (over the v1 form, generation excluded) kept in an
annotation so that an unchanged pool writes nothing, and the v1beta1 form (`basic` wrapper).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from services.publisher.apiversion import ServerProfile
from services.publisher.slices import DesiredPool

HASH_ANNOTATION = "publisher.gpu-dra.io/content-hash"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpu-dra-publisher"
MAX_NAME = 253

_CANONICAL = msgspec.json.Encoder(order="sorted")


def slice_name(node: str, driver: str, index: int) -> str:
    """A deterministic DNS-subdomain name; a retried create can only collide with itself."""
    suffix = f"-{driver}-{index:03x}"
    name = f"{node}{suffix}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"{node[: MAX_NAME - len(suffix) - 11].rstrip('.-')}-{digest}{suffix}"


def owner_reference(node: str, node_uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}


def content_hash(spec: dict[str, Any], owner: dict[str, Any]) -> str:
    """sha256 over the v1 spec (pool generation left out) and the owner reference."""
    pool = {k: v for k, v in spec["pool"].items() if k != "generation"}
    doc = {"spec": {**spec, "pool": pool}, "owner": owner}
    return hashlib.sha256(_CANONICAL.encode(doc)).hexdigest()[:32]


class RenderedSlice(msgspec.Struct, kw_only=True):
    """One desired slice: its name, hash and v1 spec; `body()` makes the object for a generation."""

    name: str
    driver: str
    node: str
    content_hash: str
    spec: dict[str, Any]
    owner: dict[str, Any]

    def body(self, generation: int, profile: ServerProfile, resource_version: str = "") -> dict[str, Any]:
        spec = dict(self.spec)
        spec["pool"] = {**spec["pool"], "generation": generation}
        if profile.api_version == "v1beta1":
            spec = to_v1beta1(spec)
        metadata: dict[str, Any] = {
            "name": self.name,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY},
            "annotations": {HASH_ANNOTATION: self.content_hash},
            "ownerReferences": [self.owner],
        }
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {"apiVersion": profile.group_version, "kind": "ResourceSlice", "metadata": metadata, "spec": spec}


def render(pool: DesiredPool, node_uid: str) -> list[RenderedSlice]:
    """Each slice of the pool with its name and hash (v1 form; generation filled in at write time)."""
    owner = owner_reference(pool.node, node_uid)
    out: list[RenderedSlice] = []
    count = len(pool.slices)
    for index, content in enumerate(pool.slices):
        spec: dict[str, Any] = {
            "driver": pool.driver,
            "nodeName": pool.node,
            "pool": {"name": pool.node, "resourceSliceCount": count},
        }
        if content.devices:
            spec["devices"] = content.devices
        if content.shared_counters:
            spec["sharedCounters"] = content.shared_counters
        out.append(
            RenderedSlice(
                name=slice_name(pool.node, pool.driver, index),
                driver=pool.driver,
                node=pool.node,
                content_hash=content_hash(spec, owner),
                spec=spec,
                owner=owner,
            )
        )
    return out


def to_v1beta1(spec: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v1beta1: every device's fields except `name` move under `basic`."""
    out = dict(spec)
    if "devices" in spec:
        out["devices"] = [
            {"name": d["name"], "basic": {k: v for k, v in d.items() if k != "name"}} for d in spec["devices"]
        ]
    return out
