"""The ResourceClaim fetch port: the claim fields the preparer reads, and how it reads them.

Owns the msgspec view of a ResourceClaim (metadata, allocation results and configs, node
selector), the `ClaimSource` port, and the Kubernetes implementation over kubernetes-asyncio
that discovers which `resource.k8s.io` version the API server serves (v1 on 1.34+, else v1beta2
or v1beta1; the fields read here have the same shape in all three).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from shared.kube import rest as kube
from shared.kube.versions import PREFERRED_VERSIONS, RESOURCE_GROUP, best_version, served_versions
from shared.logs import get_logger

log = get_logger(__name__)

# A claim body larger than this is refused before decoding: the API server stores objects of at most
# 1.5 MiB (etcd) and takes request bodies of at most 3 MiB, so no real claim comes near it, and
# decoding 3 MiB takes a bounded ~0.2 s.
MAX_CLAIM_BYTES = 3 * 1024 * 1024


class ObjectMeta(msgspec.Struct, kw_only=True):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    annotations: dict[str, str] = msgspec.field(default_factory=dict)


class AllocationResult(msgspec.Struct, kw_only=True):
    request: str
    driver: str
    pool: str
    device: str
    adminAccess: bool | None = None
    shareID: str | None = None
    consumedCapacity: dict[str, Any] | None = None  # KEP-5075: what this share takes (memory, compute, shares)


class OpaqueConfig(msgspec.Struct, kw_only=True):
    driver: str
    parameters: Any = None


class AllocationConfig(msgspec.Struct, kw_only=True):
    source: str = "FromClaim"
    requests: list[str] | None = None
    opaque: OpaqueConfig | None = None


class DeviceAllocation(msgspec.Struct, kw_only=True):
    results: list[AllocationResult] = msgspec.field(default_factory=list)
    config: list[AllocationConfig] = msgspec.field(default_factory=list)


class SelectorRequirement(msgspec.Struct, kw_only=True):
    key: str
    operator: str
    values: list[str] = msgspec.field(default_factory=list)


class SelectorTerm(msgspec.Struct, kw_only=True):
    matchExpressions: list[SelectorRequirement] = msgspec.field(default_factory=list)
    matchFields: list[SelectorRequirement] = msgspec.field(default_factory=list)


class NodeSelector(msgspec.Struct, kw_only=True):
    nodeSelectorTerms: list[SelectorTerm] = msgspec.field(default_factory=list)


class Allocation(msgspec.Struct, kw_only=True):
    devices: DeviceAllocation | None = None
    nodeSelector: NodeSelector | None = None


class Consumer(msgspec.Struct, kw_only=True):
    resource: str = ""
    name: str = ""
    uid: str = ""


class ClaimStatus(msgspec.Struct, kw_only=True):
    allocation: Allocation | None = None
    reservedFor: list[Consumer] = msgspec.field(default_factory=list)


class ResourceClaim(msgspec.Struct, kw_only=True):
    metadata: ObjectMeta
    status: ClaimStatus = msgspec.field(default_factory=ClaimStatus)


class ClaimDecodeError(ValueError):
    """A ResourceClaim body that is too large, not JSON, nests too deeply or has the wrong shape."""


def decode_claim(data: bytes) -> ResourceClaim:
    """A ResourceClaim from JSON; ClaimDecodeError (saying why) for anything else, checked by size first."""
    if len(data) > MAX_CLAIM_BYTES:
        raise ClaimDecodeError(f"the body is {len(data)} bytes, more than the {MAX_CLAIM_BYTES} a claim may have")
    try:
        return msgspec.json.decode(data, type=ResourceClaim)
    except RecursionError:
        raise ClaimDecodeError("the body nests too deeply") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ClaimDecodeError(str(exc)) from None


def selector_node_names(selector: NodeSelector | None) -> set[str] | None:
    """Node names a selector pins with `metadata.name In [...]`; None when it pins none by name."""
    if selector is None:
        return None
    names: set[str] = set()
    pinned = False
    for term in selector.nodeSelectorTerms:
        for req in term.matchFields:
            if req.key == "metadata.name" and req.operator == "In":
                pinned = True
                names.update(req.values)
    return names if pinned else None


class ClaimNotFound(LookupError):
    """The claim does not exist (deleted)."""


class ClaimFetchError(RuntimeError):
    """The claim could not be read (API server down, forbidden); retry later."""


class ClaimSource(Protocol):
    """Reads a ResourceClaim by namespace and name."""

    async def get(self, namespace: str, name: str) -> ResourceClaim: ...


class KubeClaimSource:
    """ClaimSource over a kubernetes-asyncio ApiClient; claims decoded with msgspec from the raw JSON."""

    def __init__(self, api_client: Any, *, timeout: float = 20.0) -> None:
        self.api_client = api_client
        self.timeout = timeout
        self.version = ""

    async def discover(self) -> str:
        """The best `resource.k8s.io` version the server serves (asked once, then cached)."""
        if self.version:
            return self.version
        try:
            served = await served_versions(self.api_client)
        except Exception as exc:  # noqa: BLE001 - transport failures are retryable
            raise ClaimFetchError(f"GET /apis/{RESOURCE_GROUP}: {exc}") from exc
        version = best_version(served)
        if version is None:
            raise ClaimFetchError(
                f"the API server serves no usable {RESOURCE_GROUP} version (it serves "
                f"{served or 'none'}); need one of {', '.join(PREFERRED_VERSIONS)}"
            )
        self.version = version
        log.info("resource.k8s.io version chosen", version=version)
        return version

    async def get(self, namespace: str, name: str) -> ResourceClaim:
        version = await self.discover()
        path = f"/apis/{RESOURCE_GROUP}/{version}/namespaces/{namespace}/resourceclaims/{name}"
        try:
            body = await kube.request(self.api_client, "GET", path, timeout=self.timeout)
        except kube.ApiError as exc:
            if exc.not_found:
                raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found") from None
            raise ClaimFetchError(f"GET ResourceClaim {namespace}/{name}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - transport failures are retryable
            raise ClaimFetchError(f"GET {path}: {exc}") from exc
        try:
            return decode_claim(body)
        except ClaimDecodeError as exc:
            raise ClaimFetchError(f"ResourceClaim {namespace}/{name} did not decode: {exc}") from exc
