"""Which nodes each ComputeDomain is assigned to, from the ResourceClaims the scheduler allocated.

Owns the controller's assignment keys (`<domain-uid>.assign.<node>` in `dra-cd-members`, through
Membership.assign/unassign): a domain is assigned to a node while at least one ResourceClaim whose
allocation carries a ComputeDomainChannelConfig of that domain has a device of driver
`compute-domain.nvidia.com` on that node. The allocation is written by the scheduler through the
API server, which no node's NATS credentials can touch, so an agent holding valid node creds
cannot assign itself a domain. Lists then watches ResourceClaims in every namespace (the
controller's ClusterRole has get/list/watch on them); after each list the stored assignments are
made equal to the claims (stale ones removed).
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio.client import ApiClient

from services.computedomain import crd
from services.computedomain.membership import Membership, token
from shared.kube.resources import RESOURCECLAIMS, Kube
from shared.kube.rest import Gone
from shared.logs import get_logger

log = get_logger(__name__)

Pair = tuple[str, str]  # (domain uid, node)


def claim_assignments(claim: dict[str, Any]) -> set[Pair]:
    """The (domain uid, node) pairs one ResourceClaim's allocation assigns."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    devices = allocation.get("devices") or {}
    nodes = {
        str(r["pool"])
        for r in devices.get("results") or []
        if isinstance(r, dict) and r.get("driver") == crd.DRIVER and r.get("pool")
    }
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("operator") == "In" and nodes:
                nodes &= {str(v) for v in field.get("values") or []} or nodes
    configs = list(devices.get("config") or []) + list(
        ((claim.get("spec") or {}).get("devices") or {}).get("config") or []
    )
    domains = set()
    for entry in configs:
        opaque = (entry or {}).get("opaque") or {}
        params = opaque.get("parameters") or {}
        if (
            opaque.get("driver") == crd.DRIVER
            and isinstance(params, dict)
            and params.get("kind") == crd.CHANNEL_CONFIG_KIND
            and params.get("domainID")
        ):
            domains.add(str(params["domainID"]))
    return {(uid, node) for uid in domains for node in nodes}


class Assigner:
    """Keeps the assignment keys equal to the allocated claims (run by the leading controller)."""

    def __init__(self, api: ApiClient, membership: Membership, *, resource_version: str = "v1") -> None:
        self.kube = Kube(api)
        self.membership = membership
        self.resource_version = resource_version
        self.claims: dict[str, set[Pair]] = {}  # claim uid -> its pairs
        self.written: dict[Pair, list[str]] = {}  # pair -> claims, as last written

    async def run(self) -> None:
        while True:
            listed, version = await self.kube.list(RESOURCECLAIMS.at(self.resource_version))
            self.claims = {}
            for obj in listed:
                self._track(obj, deleted=False)
            stored = await self.membership.assignments()
            wanted = {(token(uid), token(node)) for uid, node in self._desired()}
            for domain_token, node_token in stored - wanted:  # assigned while nobody watched, now gone
                await self.membership.unassign(domain_token, node_token)
            self.written = {}
            await self._apply()
            try:
                async for kind, obj in self.kube.watch(RESOURCECLAIMS.at(self.resource_version), version):
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._track(obj, deleted=kind == "DELETED")
                        await self._apply()
            except Gone:
                log.info("ResourceClaim watch expired; relisting")

    def _track(self, obj: dict[str, Any], *, deleted: bool) -> None:
        md = obj.get("metadata") or {}
        uid = str(md.get("uid") or f"{md.get('namespace')}/{md.get('name')}")
        pairs = set() if deleted else claim_assignments(obj)
        if pairs:
            self.claims[uid] = pairs
        else:
            self.claims.pop(uid, None)

    def _desired(self) -> dict[Pair, list[str]]:
        out: dict[Pair, list[str]] = {}
        for claim, pairs in self.claims.items():
            for pair in pairs:
                out.setdefault(pair, []).append(claim)
        return {pair: sorted(claims) for pair, claims in out.items()}

    async def _apply(self) -> None:
        desired = self._desired()
        for pair in set(self.written) - set(desired):
            await self.membership.unassign(*pair)
            del self.written[pair]
        for pair, claims in desired.items():
            if self.written.get(pair) != claims:
                await self.membership.assign(pair[0], pair[1], claims)
                self.written[pair] = claims
