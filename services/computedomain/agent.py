"""The node agent: runs the IMEX daemon of the one ComputeDomain this node serves, and its membership.

Owns, per node: which domain it serves and for which channel claims (persisted in
`<state-dir>/agent-state.json` so a restarted agent resumes), the domain's daemon files and
supervisor, and the node's member entry. Requests (from the channel preparer on this node):
  `dra.v1.cd-agent.<node>.join`  -> look the domain up (its last `dra.v1.cd.<uid>.status` event),
     take the node's clique id from discovery's inventory, join membership with the lowest free
     index, write the peers' names, start the daemon; a claim for a second domain is refused.
  `dra.v1.cd-agent.<node>.leave` -> the last claim stops the daemon and leaves.
Peer changes (KV watch on the domain) rewrite the hosts entries and signal the daemon (peers by
IP: rewrite the nodes file and restart it); a peer whose daemon came back (NotReady -> Ready) is also
signalled so its peers redial at once. The daemon's readiness is the member's status.
`dra.v1.cd.<uid>.deleted` stops the daemon and leaves. Which daemon runs: services.computedomain.daemon.
At start, before anything else, daemons a previous (killed) agent left running are ended and the
files of domains it no longer serves removed (services.computedomain.orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats.errors
from nats.js.api import DeliverPolicy

from services.computedomain import orphans
from services.computedomain.config import AgentConfig
from services.computedomain.daemon import DaemonLaunch, resolve_launch
from services.computedomain.imex import DaemonSupervisor, ImexSupervisor
from services.computedomain.imexconfig import DaemonFiles, clear_hosts_block, write_peers, write_static
from services.computedomain.membership import Membership, MembershipError, MembershipUnavailable, token
from shared import identity
from shared.backoff import Backoff
from shared.bus import Bus, MsgContext
from shared.events.catalog import (
    CD_AGENT_JOIN,
    CD_AGENT_LEAVE,
    CD_DELETED,
    CD_STATUS,
    EVENTS_STREAM,
    INVENTORY_BUCKET,
)
from shared.events.computedomain import (
    DomainDeleted,
    DomainMember,
    DomainStatusChanged,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    MemberStatus,
)
from shared.events.inventory import NodeInventory
from shared.logs import get_logger
from shared.tasks import cancel_and_wait

log = get_logger(__name__)

STATE_FILE = "agent-state.json"


class AgentError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _State(msgspec.Struct, kw_only=True):
    domain_uid: str = ""
    claims: list[str] = msgspec.field(default_factory=list)


def clique_of(inventory: NodeInventory) -> str:
    """`<clusterUUID>.<cliqueId>` shared by all the node's GPUs, "" without NVLink fabric."""
    cliques = {
        f"{g.fabric.cluster_uuid}.{g.fabric.clique_id}"
        for g in inventory.gpus
        if g.fabric is not None and g.fabric.state == "completed" and g.fabric.cluster_uuid.strip("0-") != ""
    }
    if len(cliques) > 1:
        raise AgentError(
            "invalid",
            f"node {inventory.node}'s GPUs are in different NVLink cliques "
            f"({', '.join(sorted(cliques))}); a ComputeDomain node needs one clique",
        )
    return cliques.pop() if cliques else ""


@dataclass
class _Domain:
    uid: str
    name: str
    namespace: str
    member: DomainMember
    files: DaemonFiles
    claims: set[str] = field(default_factory=set)
    supervisor: DaemonSupervisor | None = None
    watcher: asyncio.Task[None] | None = None
    peers: dict[int, str] = field(default_factory=dict)
    peer_status: dict[str, str] = field(default_factory=dict)
    wanted_status: MemberStatus = "NotReady"  # as the daemon last reported it (`Agent._report_status`)
    reporter: asyncio.Task[None] | None = None

    async def stop_daemon(self) -> None:
        """Stop watching the peers and reporting, then the IMEX daemon (the membership is the caller's)."""
        await cancel_and_wait([t for t in (self.watcher, self.reporter) if t is not None])
        if self.supervisor is not None:
            await self.supervisor.stop()


class Agent:
    def __init__(
        self, cfg: AgentConfig, bus: Bus, *, supervisor: Callable[..., DaemonSupervisor] | None = None
    ) -> None:
        """`supervisor`: what supervises a domain's daemon, called with ImexSupervisor's keywords (the
        default); a benchmark passes a stand-in that runs many simulated daemons in one process."""
        self.cfg = cfg
        self._supervisor = supervisor or ImexSupervisor
        self.bus = bus
        self.membership = Membership(
            bus, max_per_clique=cfg.max_nodes_per_imex_domain, require_assignment=cfg.require_assignment
        )
        self.state_dir = Path(cfg.state_dir)
        self.domain: _Domain | None = None
        self._lock = asyncio.Lock()
        self.ready = asyncio.Event()
        self.launch: DaemonLaunch | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        await asyncio.to_thread(self.state_dir.mkdir, parents=True, exist_ok=True)
        ended = await asyncio.to_thread(orphans.sweep, self.domains_dir)
        if ended:
            log.warning("ended IMEX daemons a previous agent left running", pids=ended)
        self.launch = await asyncio.to_thread(resolve_launch, self.cfg)
        if self.launch.problem:
            log.warning(
                "no IMEX daemon can run on this node; channel claims on NVLink nodes will fail",
                problem=self.launch.problem,
            )
        await self._resume()
        await self.bus.serve(CD_AGENT_JOIN, self._serve_join, node=token(self.cfg.node))
        await self.bus.serve(CD_AGENT_LEAVE, self._serve_leave, node=token(self.cfg.node))
        await self.bus.subscribe(CD_DELETED, self._on_deleted)
        self.ready.set()
        log.info("computedomain agent ready", node=self.cfg.node, ip=self.cfg.ip_address)
        try:
            await stopping.wait()
        finally:
            await self._shutdown()

    @property
    def domains_dir(self) -> Path:
        return self.state_dir / "domains"

    async def _shutdown(self) -> None:
        """Stop the daemon but keep the membership and state: a restarted agent resumes them.

        Under the lock, so that a join still starting its daemon finishes first and that daemon is stopped too."""
        async with self._lock:
            domain = self.domain
            if domain is None:
                return
            await domain.stop_daemon()
            with contextlib.suppress(Exception):
                await self.membership.set_status(domain.member, "NotReady")

    async def _resume(self) -> None:
        state = await asyncio.to_thread(self._read_state)
        await asyncio.to_thread(self._remove_stale_files, state.domain_uid if state.claims else "")
        for stale in await self.membership.node_memberships(self.cfg.node):
            if stale.domain_uid != state.domain_uid:
                log.info("leaving a domain this node no longer serves", domain=stale.domain_uid)
                await self.membership.leave(stale, reason="agent has no claim for it")
        if state.domain_uid and state.claims:
            try:
                for claim in state.claims:
                    await self._join(state.domain_uid, claim, "", resume=True)
            except AgentError as exc:
                log.warning("cannot resume the domain this node served", domain=state.domain_uid, error=str(exc))
                await self._drop_domain(reason=str(exc))

    def _remove_stale_files(self, wanted_uid: str) -> None:
        """The files of domains the state does not want (left by an agent killed while leaving), and our
        hosts entries when it wants none."""
        wanted = token(wanted_uid) if wanted_uid else None
        if self.domains_dir.is_dir():
            for path in self.domains_dir.iterdir():
                if path.name != wanted:
                    log.info("removing a domain's files this node no longer serves", path=str(path))
                    _remove_tree(path)
        assert self.launch is not None
        if not wanted_uid and self.launch.hosts_file is not None:
            clear_hosts_block(self.launch.hosts_file)

    def _read_state(self) -> _State:
        path = self.state_dir / STATE_FILE
        try:
            return msgspec.json.decode(path.read_bytes(), type=_State)
        except FileNotFoundError:
            return _State()
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("agent state unreadable; starting empty", path=str(path), error=str(exc))
            return _State()

    async def _save_state(self) -> None:
        domain = self.domain
        state = _State(domain_uid=domain.uid if domain else "", claims=sorted(domain.claims) if domain else [])

        def _write() -> None:
            path = self.state_dir / STATE_FILE
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(msgspec.json.encode(state))
            os.replace(tmp, path)

        await asyncio.to_thread(_write)

    # ---- requests --------------------------------------------------------------------------

    async def _serve_join(self, request: JoinRequest) -> JoinReply:
        try:
            domain = await self._join(request.domain_uid, request.claim_uid, request.claim_namespace)
        except AgentError as exc:
            return JoinReply(ok=False, error_code=exc.code, error=str(exc), domain_uid=request.domain_uid)  # type: ignore[arg-type]
        return JoinReply(
            ok=True,
            domain_uid=domain.uid,
            domain_name=domain.name,
            domain_namespace=domain.namespace,
            clique_id=domain.member.clique_id,
            index=domain.member.index,
        )

    async def _serve_leave(self, request: LeaveRequest) -> LeaveReply:
        async with self._lock:
            domain = self.domain
            if domain is None or domain.uid != request.domain_uid:
                return LeaveReply(ok=True)  # unknown claim: nothing to undo (idempotent)
            domain.claims.discard(request.claim_uid)
            if domain.claims:
                await self._save_state()
                return LeaveReply(ok=True)
            await self._drop_domain(reason="last channel claim unprepared")
            return LeaveReply(ok=True, left_domain=True)

    async def _on_deleted(self, event: DomainDeleted, _ctx: MsgContext) -> None:
        async with self._lock:
            if self.domain is not None and self.domain.uid == event.domain_uid:
                await self._drop_domain(reason="ComputeDomain deleted")

    # ---- joining and leaving ---------------------------------------------------------------

    async def _lookup(self, uid: str) -> DomainStatusChanged:
        """The domain as the controller last announced it; not-found while it has not (yet)."""
        for subject, gone in (
            (CD_DELETED.format(domain_uid=token(uid)), True),
            (CD_STATUS.format(domain_uid=token(uid)), False),
        ):
            data = await self._last_event(subject)
            if data is None:
                continue
            if gone:
                raise AgentError("invalid", f"ComputeDomain {uid} is being deleted; its claims cannot be prepared")
            try:
                status = msgspec.json.decode(data, type=DomainStatusChanged)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise AgentError("internal", f"undecodable status event for ComputeDomain {uid}: {exc}") from None
            mismatch = identity.check_event(CD_STATUS, subject, status)
            if mismatch is not None:
                await self.bus.refuse(mismatch, data, self.bus.name)
                raise AgentError(
                    "internal",
                    f"the status event for ComputeDomain {uid} names another domain; "
                    "it was dead-lettered: check who publishes on its subject",
                )
            return status
        raise AgentError(
            "unavailable",
            f"ComputeDomain {uid} is not known (yet): no status from the "
            "computedomain controller; is it running, and does the domain exist?",
        )

    async def _last_event(self, subject: str) -> bytes | None:
        """The last event stored on `subject`, or None. Read through an ordered consumer filtered to
        that subject (the read a cd-agent's NATS user may do: the filter is in the create subject);
        STREAM.MSG.GET, which reads any subject, is not allowed to node users."""
        sub = await self.bus.js.subscribe(
            subject, stream=EVENTS_STREAM.name, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
        )
        try:
            info = await sub.consumer_info()
            if not info.num_pending and not (info.delivered and info.delivered.consumer_seq):
                return None
            try:
                return (await sub.next_msg(timeout=5.0)).data or b""
            except nats.errors.TimeoutError:
                raise AgentError(
                    "unavailable", f"NATS did not deliver the last event on {subject} within 5 s; kubelet retries"
                ) from None
        finally:
            await sub.unsubscribe()

    async def _clique(self) -> str:
        kv = await self.bus.kv(INVENTORY_BUCKET)
        inventory = await kv.get(self.cfg.node)
        if inventory is None:
            raise AgentError("unavailable", f"no GPU inventory for node {self.cfg.node} yet; is discovery running?")
        return clique_of(inventory)

    async def _join(self, uid: str, claim_uid: str, claim_namespace: str, *, resume: bool = False) -> _Domain:
        if not uid:
            raise AgentError("invalid", "the channel config has an empty domainID; it must be the ComputeDomain UID")
        async with self._lock:
            current = self.domain
            if current is not None:
                if current.uid != uid:
                    raise AgentError(
                        "conflict",
                        f"node {self.cfg.node} already serves ComputeDomain {current.namespace}/{current.name} "
                        f"(uid {current.uid}); a node serves one ComputeDomain at a time: run this workload on "
                        "other nodes or wait until that domain's pods leave this node",
                    )
                if claim_namespace and claim_namespace != current.namespace:
                    raise AgentError("invalid", self._namespace_error(claim_namespace, current.namespace, current.name))
                current.claims.add(claim_uid)
                await self._save_state()
                return current
            announced = await self._lookup(uid)
            if claim_namespace and claim_namespace != announced.domain_namespace:
                raise AgentError(
                    "invalid", self._namespace_error(claim_namespace, announced.domain_namespace, announced.domain_name)
                )
            clique = await self._clique()
            assert self.launch is not None
            if clique and self.launch.problem:
                raise AgentError(
                    "unavailable",
                    f"node {self.cfg.node} cannot run the IMEX daemon of ComputeDomain "
                    f"{announced.domain_namespace}/{announced.domain_name}: {self.launch.problem}",
                )
            if self.membership.require_assignment and token(self.cfg.node) not in await self.membership.assigned(uid):
                raise AgentError(
                    "unavailable",
                    f"ComputeDomain {announced.domain_namespace}/{announced.domain_name} "
                    f"is not assigned to node {self.cfg.node} (yet): the controller assigns a domain "
                    "to the nodes its channel claims are allocated on; kubelet retries",
                )
            files = DaemonFiles(self.domains_dir / token(uid))
            member = DomainMember(
                domain_uid=uid,
                domain_name=announced.domain_name,
                domain_namespace=announced.domain_namespace,
                node=self.cfg.node,
                ip_address=self.cfg.ip_address,
                clique_id=clique,
                index=-1,
            )
            try:
                member = await self.membership.join(member)
            except MembershipUnavailable as exc:
                raise AgentError("unavailable", f"{exc}; kubelet retries") from None
            except MembershipError as exc:
                raise AgentError("conflict", str(exc)) from None
            domain = _Domain(
                uid=uid,
                name=announced.domain_name,
                namespace=announced.domain_namespace,
                member=member,
                files=files,
                claims={claim_uid},
            )
            self.domain = domain
            await self._save_state()
            await self._start(domain)
            log.info(
                "serving compute domain",
                domain=uid,
                name=domain.name,
                clique=clique or "(none)",
                index=member.index,
                resume=resume,
            )
            return domain

    @staticmethod
    def _namespace_error(claim_ns: str, domain_ns: str, name: str) -> str:
        return (
            f"the claim is in namespace {claim_ns!r} but ComputeDomain {name} is in {domain_ns!r}; "
            "a channel claim must be in its domain's namespace"
        )

    async def _start(self, domain: _Domain) -> None:
        if domain.member.clique_id == "":
            # No NVLink fabric: no IMEX daemon; the node is Ready at once (and gets no channel devices).
            domain.member = await self.membership.set_status(domain.member, "Ready")
            return
        launch = self.launch
        assert launch is not None
        await asyncio.to_thread(
            write_static,
            domain.files,
            bind_ip=self.cfg.ip_address,
            server_port=self.cfg.imex_server_port,
            cmd_port=self.cfg.imex_cmd_port,
            max_nodes=self.cfg.max_nodes_per_imex_domain,
            peer_mode=self.cfg.imex_peer_mode,
            sim_hosts=domain.files.hosts if launch.simulated else None,
        )
        replayed = asyncio.Event()
        domain.watcher = asyncio.create_task(self._watch_peers(domain, replayed), name=f"peers-{domain.uid}")
        await replayed.wait()  # the hosts (or nodes) file lists the peers known now, before the daemon reads it

        async def on_ready(ready: bool) -> None:
            if self.domain is domain:
                domain.wanted_status = "Ready" if ready else "NotReady"
                if domain.reporter is None or domain.reporter.done():
                    domain.reporter = asyncio.create_task(self._report_status(domain), name=f"status-{domain.uid}")

        domain.supervisor = self._supervisor(
            name=f"{domain.uid}@{self.cfg.node}",
            command=launch.command,
            config=domain.files.config,
            on_ready=on_ready,
            reload_signal=launch.reload_signal,
            signal_spacing=launch.signal_spacing,
            check_command=launch.check_command,
            check_interval=self.cfg.imex_check_interval,
            env=launch.env,
            log_file=domain.files.log,
            pid_file=domain.files.pid,
        )
        await domain.supervisor.start()

    async def _report_status(self, domain: _Domain) -> None:
        """Write the member status the daemon last reported until KV has it: a write that NATS does not take
        (an outage, a server too loaded to answer) is tried again after the backoff, and a report that comes
        while one is written is written next. Before, a failed write was logged and lost: the member stayed
        NotReady, and its domain never Ready, until the daemon's readiness changed again."""
        backoff = Backoff(initial_s=0.2, cap_s=5.0)
        while self.domain is domain and domain.member.status != domain.wanted_status:
            wanted = domain.wanted_status
            try:
                domain.member = await self.membership.set_status(domain.member, wanted)
            except Exception as exc:  # noqa: BLE001 - retried: the status must reach KV
                log.warning("member status not written; trying again", domain=domain.uid, status=wanted, error=str(exc))
                await asyncio.sleep(backoff.next())

    async def _watch_peers(self, domain: _Domain, replayed: asyncio.Event) -> None:
        """Follow the domain's members: the peers file and the daemon's signals. A watch that fails (a NATS
        outage, a server too loaded to answer) is watched again after the backoff; its replay brings the
        peers back as they are then, so none joined or left meanwhile is missed."""
        backoff = Backoff(initial_s=0.2, cap_s=5.0)
        me = token(self.cfg.node)
        while True:
            peers: dict[str, DomainMember] = {}
            live = False  # past this watch's replay
            try:
                async for _d, node_token, member in self.membership.watch(domain.uid):
                    if node_token == "":
                        await self._apply_peers(domain, peers, restarted=False)
                        live = True
                        backoff.reset()
                        replayed.set()
                        continue
                    if node_token == me:
                        continue
                    restarted = False
                    if member is None:
                        peers.pop(node_token, None)
                        domain.peer_status.pop(node_token, None)
                    else:
                        before = domain.peer_status.get(node_token)
                        restarted = before == "NotReady" and member.status == "Ready" and node_token in peers
                        peers[node_token] = member
                        domain.peer_status[node_token] = member.status
                    if live:
                        await self._apply_peers(domain, peers, restarted=restarted)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - losing the watch must be visible, not silent, and not final
                log.exception("peer watch failed; watching again", domain=domain.uid)
                replayed.set()  # the daemon starts with the peers known so far; the next replay adds the rest
            await asyncio.sleep(backoff.next())

    async def _apply_peers(self, domain: _Domain, peers: dict[str, DomainMember], *, restarted: bool) -> None:
        wanted = {
            m.index: m.ip_address for m in peers.values() if m.clique_id == domain.member.clique_id and m.index >= 0
        }
        wanted[domain.member.index] = self.cfg.ip_address
        changed = False
        if wanted != domain.peers:
            domain.peers = wanted
            assert self.launch is not None
            changed = await asyncio.to_thread(
                write_peers,
                domain.files,
                wanted,
                peer_mode=self.cfg.imex_peer_mode,
                hosts_file=self.launch.hosts_for(domain.files),
            )
        if domain.supervisor is None:
            return
        if changed and self.cfg.imex_peer_mode == "ip":
            domain.supervisor.restart()  # the daemon reads its nodes file only at start
        elif changed or restarted:
            domain.supervisor.reload()

    async def _drop_domain(self, *, reason: str) -> None:
        """Stop the daemon, leave the membership, forget the domain (caller holds the lock)."""
        domain = self.domain
        self.domain = None
        await self._save_state()
        if domain is None:
            return
        await domain.stop_daemon()
        # the files go before the member: leaving is what the controller (and a deletion) waits for
        await asyncio.to_thread(_remove_tree, domain.files.directory)
        if self.launch is not None and self.launch.hosts_file is not None:
            await asyncio.to_thread(clear_hosts_block, self.launch.hosts_file)
        await self.membership.leave(domain.member, reason=reason)
        log.info("stopped serving compute domain", domain=domain.uid, reason=reason)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def describe(agent: Agent) -> str:
    """One line for logs and tests: what the agent serves."""
    d = agent.domain
    if d is None:
        return json.dumps({"node": agent.cfg.node, "domain": None})
    return json.dumps(
        {
            "node": agent.cfg.node,
            "domain": d.uid,
            "claims": sorted(d.claims),
            "index": d.member.index,
            "status": d.member.status,
        }
    )
