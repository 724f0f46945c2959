"""The ComputeDomain controller: CRs -> finalizer, workload claim template, status from membership.

Owns, while it leads: a watch on ComputeDomains (all namespaces) and a watch on the membership KV.
For each live domain it adds the finalizer, creates the workload ResourceClaimTemplate
(`spec.channel.resourceClaimTemplate.name`, class `compute-domain-default-channel.nvidia.com`, opaque
ComputeDomainChannelConfig with the UID and allocationMode), announces the domain on
`dra.v1.cd.<uid>.status`, and writes `status` whenever a member event changes it (coalesced per
domain: one write in flight, the next one carries every change since). Ready when every listed
node is Ready and (deprecated `numNodes` > 0) at least numNodes are listed; no nodes and numNodes 0
is Ready, as upstream. On deletion: announce `dra.v1.cd.<uid>.deleted` (agents stop the daemon and
leave), delete the template, wait (bounded) for the members to go, purge the domain's KV keys,
then drop the finalizer, so nothing stays Terminating.

Traces: each sync that follows a member change runs in a `computedomain.reconcile` span, the child of a
consumer span of that change (itself the child of the agent's write: the daemon's report), linked to
the other changes it coalesced; a sync a CR change asked for is a root. So the `cd-status` it publishes
continues the trace of what caused it. A status-only change of the CR (our own write coming back) asks
for no sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client import ApiClient
from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import Gauge

from services.computedomain import crd
from services.computedomain.assignments import Assigner
from services.computedomain.channelcore import channel_config
from services.computedomain.membership import Membership, token
from shared.backoff import Backoff
from shared.bus import Bus
from shared.events.base import now_unix
from shared.events.catalog import CD_DELETED, CD_STATUS
from shared.events.computedomain import DomainDeleted, DomainMember, DomainStatusChanged
from shared.kube.events import event_body, record_event
from shared.kube.informer import Informer
from shared.kube.resources import RESOURCECLAIMTEMPLATES, Kube, Resource
from shared.kube.rest import ApiError
from shared.kube.versions import best_version, served_versions
from shared.logs import get_logger
from shared.tasks import cancel_and_wait
from shared.telemetry import get_tracer

log = get_logger(__name__)
tracer = get_tracer(__name__)
MAX_CAUSES = 16  # member changes a sync links to (a burst of joins coalesces into one sync)
COMPUTEDOMAINS = Resource(crd.GROUP, crd.VERSION, crd.PLURAL, "ComputeDomain")
COMPUTE_DOMAINS = Gauge("gpu_dra_compute_domain_info", "ComputeDomains by global status", ["status"])


@dataclass
class _Domain:
    uid: str
    namespace: str = ""
    name: str = ""
    num_nodes: int = 0
    template: str = ""
    allocation_mode: str = "Single"
    live: bool = False  # seen as a CR without deletionTimestamp
    deleting: bool = False
    finalized: bool = False  # our finalizer and template are in place
    written: dict[str, Any] | None = None  # the status last written (or read from the CR)
    announced: tuple[str, int] | None = None  # (status, nodes) last published
    members: dict[str, DomainMember] = field(default_factory=dict)
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # any member change (deletion waits on it)
    worker: asyncio.Task[None] | None = None
    causes: list[otel_context.Context] = field(default_factory=list)  # member changes since the last sync
    # timing for the benchmark: when the last member turned Ready, and when status said Ready
    last_member_ready_at: float = 0.0
    ready_written_at: float = 0.0


def _same_but_status(obj: dict[str, Any], old: dict[str, Any]) -> bool:
    """The CR changed only in `status` (and bookkeeping metadata): nothing the controller acts on."""

    def acted_on(o: dict[str, Any]) -> tuple[Any, ...]:
        md = o.get("metadata") or {}
        return (o.get("spec"), md.get("deletionTimestamp"), md.get("finalizers"), md.get("namespace"), md.get("name"))

    return acted_on(obj) == acted_on(old)


def desired_status(domain: _Domain) -> dict[str, Any]:
    nodes = sorted(
        (
            {"name": m.node, "ipAddress": m.ip_address, "cliqueID": m.clique_id, "index": m.index, "status": m.status}
            for m in domain.members.values()
        ),
        key=lambda n: (n["cliqueID"], n["index"], n["name"]),
    )
    ready = all(n["status"] == "Ready" for n in nodes) and len(nodes) >= domain.num_nodes
    return {"status": "Ready" if ready else "NotReady", "nodes": nodes}


class Controller:
    def __init__(
        self, api: ApiClient, bus: Bus, *, deletion_timeout: float = 10.0, require_assignment: bool = False
    ) -> None:
        self.api = api
        self.kube = Kube(api)
        self.bus = bus
        self.membership = Membership(bus, require_assignment=require_assignment)
        self.deletion_timeout = deletion_timeout
        self.domains: dict[str, _Domain] = {}
        self._by_token: dict[str, str] = {}
        self.resource_version = "v1"
        self.synced = asyncio.Event()
        # Set once the membership replay has ended: until then a domain's members are not known, and a
        # new leader must neither write a status from none nor finalize a deletion without waiting for them.
        self.members_replayed = asyncio.Event()
        self.writes = 0
        self.templates: Informer | None = None  # workload claim templates, names and labels (`_watch_templates`)

    # ---- running ---------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        self.resource_version = await self._resource_api_version()
        tasks = [
            asyncio.create_task(self._watch_members(), name="cd-members"),
            asyncio.create_task(self._watch_domains(), name="cd-domains"),
            asyncio.create_task(self._watch_templates(), name="cd-templates"),
        ]
        if self.membership.require_assignment:
            assigner = Assigner(self.api, self.membership, resource_version=self.resource_version)
            tasks.append(asyncio.create_task(assigner.run(), name="cd-assignments"))
        stop = asyncio.create_task(stopping.wait())
        try:
            done, _ = await asyncio.wait({stop, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop:
                    task.result()  # a watch that ended with an error ends the controller
        finally:
            stop.cancel()
            for task in [d.worker for d in self.domains.values() if d.worker]:
                task.cancel()
            await cancel_and_wait(tasks)

    async def _resource_api_version(self) -> str:
        try:
            return best_version(await served_versions(self.api)) or "v1"
        except (ApiError, OSError) as exc:
            log.warning("cannot tell which resource.k8s.io version the server serves; using v1", error=str(exc))
            return "v1"

    def _domain(self, uid: str) -> _Domain:
        domain = self.domains.get(uid)
        if domain is None:
            domain = self.domains[uid] = _Domain(uid=uid)
            self._by_token[token(uid)] = uid
            domain.worker = asyncio.create_task(self._sync_loop(domain), name=f"cd-sync-{uid}")
        return domain

    # ---- membership ------------------------------------------------------------------------

    async def _watch_members(self) -> None:
        async for domain_token, node_token, member in self.membership.watch():
            if domain_token == "":
                self.members_replayed.set()
                continue
            uid = member.domain_uid if member is not None else self._by_token.get(domain_token, domain_token)
            domain = self._domain(uid)
            if member is None:
                gone = [n for n in domain.members if token(n) == node_token]
                for n in gone:
                    domain.members.pop(n)
            else:
                previous = domain.members.get(member.node)
                domain.members[member.node] = member
                if member.status == "Ready" and (previous is None or previous.status != "Ready"):
                    domain.last_member_ready_at = member.observed_at or now_unix()
            if self.members_replayed.is_set():  # a live change (the replay's are old news)
                with self.membership.consume(domain_token, node_token):
                    domain.causes = [*domain.causes[-(MAX_CAUSES - 1) :], otel_context.get_current()]
            domain.changed.set()
            domain.dirty.set()

    # ---- ComputeDomain CRs -----------------------------------------------------------------

    async def _watch_domains(self) -> None:
        """ComputeDomain CRs through the one informer (list + watch, re-list on 410 Gone); each change
        marks its domain dirty."""
        domains = Informer(self.kube, COMPUTEDOMAINS, on_change=lambda kind, obj, old: self._on_change(kind, obj, old))
        never = asyncio.Event()  # the controller's run() cancels this task when it stops
        listing = asyncio.create_task(domains.run(never), name="cd-domains-informer")
        try:
            synced = asyncio.create_task(domains.synced.wait())
            await asyncio.wait({listing, synced}, return_when=asyncio.FIRST_COMPLETED)
            synced.cancel()
            if listing.done():
                listing.result()
                return
            self.synced.set()
            for domain in self.domains.values():
                if not domain.name:
                    domain.dirty.set()
            await listing
        finally:
            await cancel_and_wait([listing])

    async def _watch_templates(self) -> None:
        """Workload claim templates through one informer, cut to their metadata: `_ensure_template` reads it
        instead of asking the API server to create the template at every sync (a member's join or Ready), and
        a domain's template deleted by hand marks the domain dirty, so its sync makes it again."""
        self.templates = Informer(
            self.kube,
            RESOURCECLAIMTEMPLATES.at(self.resource_version),
            on_change=self._on_template,
            transform=lambda obj: {"metadata": obj.get("metadata") or {}},
        )
        await self.templates.run(asyncio.Event())  # until run() cancels this task

    def _on_template(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if kind != "DELETED":
            return
        domain = self.domains.get(((obj.get("metadata") or {}).get("labels") or {}).get(crd.LABEL_DOMAIN, ""))
        if domain is not None and domain.live:
            domain.dirty.set()

    def _on_change(self, kind: str, obj: dict[str, Any] | None, old: dict[str, Any] | None) -> None:
        if kind == "MODIFIED" and obj is not None and old is not None and _same_but_status(obj, old):
            return  # our status write (or another's) coming back: nothing to reconcile
        self._on_object(obj, kind)

    def _on_object(self, obj: dict[str, Any] | None, kind: str, uid: str = "") -> None:
        if obj is not None:
            uid = obj["metadata"]["uid"]
        domain = self._domain(uid)
        if kind == "DELETED" or obj is None:
            domain.live = False
            domain.deleting = False
            domain.dirty.set()
            return
        md, spec = obj["metadata"], obj.get("spec") or {}
        channel = spec.get("channel") or {}
        domain.namespace, domain.name = md["namespace"], md["name"]
        domain.num_nodes = int(spec.get("numNodes") or 0)
        domain.template = ((channel.get("resourceClaimTemplate") or {}).get("name")) or ""
        domain.allocation_mode = channel.get("allocationMode") or "Single"
        domain.deleting = bool(md.get("deletionTimestamp"))
        domain.live = not domain.deleting
        if kind == "ADDED" or domain.written is None:
            domain.written = obj.get("status")
        domain.finalized = crd.FINALIZER in (md.get("finalizers") or [])
        domain.dirty.set()

    # ---- per-domain work -------------------------------------------------------------------

    async def _sync_loop(self, domain: _Domain) -> None:
        backoff = Backoff(initial_s=0.2, cap_s=5.0)
        await self.members_replayed.wait()
        while True:
            await domain.dirty.wait()
            domain.dirty.clear()
            causes, domain.causes = domain.causes, []
            links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in causes[:-1]]
            try:
                root = otel_context.Context()  # a CR change: no context to continue (not the task's)
                with tracer.start_as_current_span(
                    "computedomain.reconcile",
                    context=causes[-1] if causes else root,
                    links=links,
                    attributes={
                        "dra.compute_domain": domain.uid,
                        "k8s.namespace.name": domain.namespace,
                        "computedomain.name": domain.name,
                    },
                ):
                    await self._sync(domain)
                backoff.reset()
                if self.domains.get(domain.uid) is not domain:
                    return  # forgotten
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried with backoff; the domain must converge
                log.warning("ComputeDomain sync failed; retrying", domain=domain.uid, error=str(exc))
                await asyncio.sleep(backoff.next())
                domain.causes = [*causes, *domain.causes][-MAX_CAUSES:]  # the retry still continues them
                domain.dirty.set()

    async def _sync(self, domain: _Domain) -> None:
        if not domain.name:
            if self.synced.is_set():
                # members of a domain with no CR after the full list: deleted while nobody led
                log.info("removing members of a ComputeDomain that no longer exists", domain=domain.uid)
                await self._forget(domain)
            return
        if domain.deleting:
            await self._finalize(domain)
            return
        if not domain.live:
            await self._forget(domain)
            return
        if not domain.finalized:
            await self._add_finalizer(domain)
            domain.finalized = True
        await self._ensure_template(domain)
        status = desired_status(domain)
        if status != domain.written:
            await self.kube.patch(
                COMPUTEDOMAINS, domain.namespace, domain.name, {"status": status}, subresource="status"
            )
            self.writes += 1
            before = (domain.written or {}).get("status")  # a new domain starts NotReady: no news
            if status["status"] != before and (before is not None or status["status"] == "Ready"):
                await self._status_event(domain, status)
            domain.written = status
            if status["status"] == "Ready" and status["nodes"]:
                domain.ready_written_at = now_unix()
        announce = (status["status"], len(status["nodes"]))
        if announce != domain.announced:
            await self.bus.publish(
                CD_STATUS,
                DomainStatusChanged(
                    domain_uid=domain.uid,
                    domain_name=domain.name,
                    domain_namespace=domain.namespace,
                    status=announce[0],
                    nodes=announce[1],
                    observed_at=now_unix(),
                ),
                domain_uid=token(domain.uid),
            )
            domain.announced = announce
            self._count_statuses()

    def _count_statuses(self) -> None:
        """gpu_dra_compute_domain_info{status}: the domains per global status, as the reference driver's
        nvidia_dra_ one."""
        counts = {"Ready": 0, "NotReady": 0}
        for other in self.domains.values():
            if other.live and other.announced is not None:
                counts[str(other.announced[0])] = counts.get(str(other.announced[0]), 0) + 1
        for status, count in counts.items():
            COMPUTE_DOMAINS.labels(status).set(count)

    async def _status_event(self, domain: _Domain, status: dict[str, Any]) -> None:
        """An Event on the ComputeDomain when its status turns Ready or NotReady (best effort)."""
        ready = sum(1 for n in status["nodes"] if n["status"] == "Ready")
        involved = {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
            "kind": crd.KIND,
            "name": domain.name,
            "namespace": domain.namespace,
            "uid": domain.uid,
        }
        message = f"status {status['status']}: {ready} of {domain.num_nodes} nodes Ready"
        await record_event(
            self.api,
            event_body(
                involved,
                reason=f"ComputeDomain{status['status']}",
                message=message,
                type="Normal" if status["status"] == "Ready" else "Warning",
                component="compute-domain-controller",
            ),
        )

    async def _add_finalizer(self, domain: _Domain) -> None:
        obj = await self.kube.get(COMPUTEDOMAINS, domain.namespace, domain.name)
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if crd.FINALIZER in finalizers:
            return
        await self.kube.patch(
            COMPUTEDOMAINS,
            domain.namespace,
            domain.name,
            {
                "metadata": {
                    "finalizers": [*finalizers, crd.FINALIZER],
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                }
            },
        )

    def template_body(self, domain: _Domain) -> dict[str, Any]:
        if self.resource_version == "v1":
            request: dict[str, Any] = {"name": "channel", "exactly": {"deviceClassName": crd.CHANNEL_DEVICE_CLASS}}
        else:
            request = {"name": "channel", "deviceClassName": crd.CHANNEL_DEVICE_CLASS}
        return {
            "apiVersion": f"resource.k8s.io/{self.resource_version}",
            "kind": "ResourceClaimTemplate",
            "metadata": {
                "name": domain.template,
                "namespace": domain.namespace,
                "labels": {crd.LABEL_DOMAIN: domain.uid, crd.LABEL_TARGET: "Workload"},
                "ownerReferences": [
                    {
                        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
                        "kind": crd.KIND,
                        "name": domain.name,
                        "uid": domain.uid,
                    }
                ],
            },
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [request],
                        "config": [
                            {
                                "requests": ["channel"],
                                "opaque": {
                                    "driver": crd.DRIVER,
                                    "parameters": channel_config(domain.uid, domain.allocation_mode),
                                },
                            }
                        ],
                    }
                }
            },
        }

    async def _ensure_template(self, domain: _Domain) -> None:
        if not domain.template:
            return
        known = self.templates
        if known is not None and known.synced.is_set() and known.get(domain.namespace, domain.template) is not None:
            return  # in the informer's cache: no create, and no 409, at every member change
        try:
            made = await self.kube.create(
                RESOURCECLAIMTEMPLATES.at(self.resource_version), domain.namespace, self.template_body(domain)
            )
            if known is not None:
                known.apply(made, "ADDED")  # the next sync sees it before the watch brings it
            log.info("created workload claim template", domain=domain.uid, template=domain.template)
        except ApiError as exc:
            if not exc.conflict:
                raise

    async def _delete_template(self, domain: _Domain) -> None:
        if not domain.template:
            return
        try:
            existing = await self.kube.get(
                RESOURCECLAIMTEMPLATES.at(self.resource_version), domain.namespace, domain.template
            )
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        if (existing["metadata"].get("labels") or {}).get(crd.LABEL_DOMAIN) != domain.uid:
            return  # not ours: a user's template of the same name stays
        with contextlib.suppress(ApiError):
            await self.kube.delete(RESOURCECLAIMTEMPLATES.at(self.resource_version), domain.namespace, domain.template)

    async def _finalize(self, domain: _Domain) -> None:
        await self.bus.publish(
            CD_DELETED,
            DomainDeleted(
                domain_uid=domain.uid,
                domain_name=domain.name,
                domain_namespace=domain.namespace,
                observed_at=now_unix(),
            ),
            domain_uid=token(domain.uid),
        )
        await self._delete_template(domain)
        deadline = time.monotonic() + self.deletion_timeout
        while domain.members and time.monotonic() < deadline:
            domain.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(domain.changed.wait(), deadline - time.monotonic())
        if domain.members:
            log.warning(
                "members did not leave a deleted domain in time; removing them",
                domain=domain.uid,
                nodes=sorted(domain.members),
            )
        await self.membership.purge_domain(domain.uid)
        try:
            obj = await self.kube.get(COMPUTEDOMAINS, domain.namespace, domain.name)
        except ApiError as exc:
            if exc.not_found:
                await self._forget(domain)
                return
            raise
        finalizers = [f for f in obj["metadata"].get("finalizers") or [] if f != crd.FINALIZER]
        with contextlib.suppress(ApiError):
            await self.kube.patch(
                COMPUTEDOMAINS,
                domain.namespace,
                domain.name,
                {"metadata": {"finalizers": finalizers or None, "resourceVersion": obj["metadata"]["resourceVersion"]}},
            )
        log.info("ComputeDomain cleaned up", domain=domain.uid, name=f"{domain.namespace}/{domain.name}")

    async def _forget(self, domain: _Domain) -> None:
        """The CR is gone: drop what is left (a domain deleted while no controller was leading)."""
        if domain.members:
            await self.bus.publish(
                CD_DELETED,
                DomainDeleted(
                    domain_uid=domain.uid,
                    domain_name=domain.name,
                    domain_namespace=domain.namespace,
                    observed_at=now_unix(),
                ),
                domain_uid=token(domain.uid),
            )
        await self.membership.purge_domain(domain.uid)
        domain.members.clear()
        self.domains.pop(domain.uid, None)
        self._count_statuses()
        self._by_token.pop(token(domain.uid), None)
        if domain.worker is not None and domain.worker is not asyncio.current_task():
            domain.worker.cancel()
