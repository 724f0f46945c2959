"""The device metadata file a prepared claim's containers read (KEP-5304, `metadata.resource.k8s.io/v1alpha1`).

Owns the file's format and where a container finds it, as upstream's kubelet plugin helper writes it: one file
per claim request, `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/
<driver>-metadata.json` (a claim made from a template: `resourceclaimtemplates/<pod claim name>/...`), holding a
JSON stream of one `DeviceMetadata` object per API version (here one: v1alpha1), each ending in a newline.
Device attributes use the DRA attribute encoding (`{"string": ...}`, `{"int": ...}`); the keys this driver
writes are in `docs/vm-tenants.md`. Not a bus message: its JSON Schema is exported beside the event schemas
(`gpu-dra events schema`, `index.json` "files").
"""

from __future__ import annotations

import json
from typing import Annotated

import msgspec

from shared.events.base import doc

API_VERSION = "metadata.resource.k8s.io/v1alpha1"
KIND = "DeviceMetadata"
CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
ENV = "GPU_DRA_DEVICE_METADATA_FILE"  # names, in a container, the metadata file of its device's request
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"  # set on claims made from a template


class DeviceAttributeValue(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One attribute value, as `resource.k8s.io` DeviceAttribute: exactly one field is set."""

    int_: Annotated[int | None, doc("An integer attribute.")] = msgspec.field(default=None, name="int")
    bool_: Annotated[bool | None, doc("A boolean attribute.")] = msgspec.field(default=None, name="bool")
    string: Annotated[str | None, doc("A string attribute (at most 64 characters in the API).")] = None
    version: Annotated[str | None, doc("A semantic version attribute.")] = None


class MetadataDevice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One allocated device of the request."""

    driver: Annotated[str, doc("The DRA driver that prepared it, gpu.nvidia.com.")]
    pool: Annotated[str, doc("The resource pool it was allocated from (the node's name).")]
    name: Annotated[str, doc("The device name in the pool, e.g. gpu-0, gpu-vfio-1, gpu-0-mig-1g10gb-19-0.")]
    attributes: Annotated[
        dict[str, DeviceAttributeValue],
        doc(
            "Facts about the device as prepared, by attribute name: type, uuid, parentUUID (MIG), "
            "resource.kubernetes.io/pciBusID, iommuGroup (VFIO), numaNode, shareID (a share)."
        ),
    ] = msgspec.field(default_factory=dict)


class MetadataRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request of the claim and the devices allocated for it by this driver."""

    name: Annotated[str, doc("The request name; req/sub for a subrequest of firstAvailable.")]
    devices: Annotated[list[MetadataDevice], doc("The request's devices prepared by this driver.")] = msgspec.field(
        default_factory=list
    )


class MetadataObjectMeta(msgspec.Struct, kw_only=True):
    """Which ResourceClaim the metadata describes."""

    name: Annotated[str, doc("The ResourceClaim's name.")]
    namespace: Annotated[str, doc("The ResourceClaim's namespace.")]
    uid: Annotated[str, doc("The ResourceClaim's UID.")]
    generation: Annotated[int, doc("Bumped when the file is rewritten for the same preparation; starts at 1.")] = 1


class DeviceMetadata(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The device metadata of one claim request, as its containers read it (KEP-5304)."""

    apiVersion: Annotated[str, doc("metadata.resource.k8s.io/v1alpha1.")]  # noqa: N815
    kind: Annotated[str, doc("DeviceMetadata.")]
    metadata: Annotated[MetadataObjectMeta, doc("The claim the file describes.")]
    podClaimName: Annotated[
        str | None,
        doc(  # noqa: N815
            "The pod's name for a claim made from a ResourceClaimTemplate; absent for a claim named directly."
        ),
    ] = None
    requests: Annotated[list[MetadataRequest], doc("The request this file is for (one entry).")] = msgspec.field(
        default_factory=list
    )


def document(*, name: str, namespace: str, uid: str, pod_claim_name: str, request: MetadataRequest) -> DeviceMetadata:
    """The v1alpha1 object for one request of a claim."""
    return DeviceMetadata(
        apiVersion=API_VERSION,
        kind=KIND,
        metadata=MetadataObjectMeta(name=name, namespace=namespace, uid=uid),
        podClaimName=pod_claim_name or None,
        requests=[request],
    )


def container_path(driver: str, request: str, *, claim_name: str, pod_claim_name: str = "") -> str:
    """Where a container finds the file of `request` (its top-level name) of a claim."""
    base = request.split("/", 1)[0]
    if pod_claim_name:
        return f"{CONTAINER_ROOT}/resourceclaimtemplates/{pod_claim_name}/{base}/{driver}-metadata.json"
    return f"{CONTAINER_ROOT}/resourceclaims/{claim_name}/{base}/{driver}-metadata.json"


def encode(document: DeviceMetadata) -> bytes:
    """The file's bytes: the JSON stream of one object per version written (v1alpha1), newline-terminated."""
    return msgspec.json.encode(document) + b"\n"


def decode(data: bytes) -> DeviceMetadata:
    """The first object of a file's stream (v1alpha1, the only version written)."""
    first, _ = json.JSONDecoder().raw_decode(data.decode())
    return msgspec.convert(first, DeviceMetadata)
