"""Structured-parameters allocation, as kube-scheduler does it (reference §5): a pure function.

Owns the search for one pod's unallocated claims on one node: requests in order, `ExactCount` and
`All`, `firstAvailable` subrequests (result `req/sub`), `matchAttribute` constraints, adminAccess
(namespace label), counters (partitionable devices), consumable capacity of shareable devices
(`capacity.py`: shares across claims, each within what the device has left), taints vs tolerations
(`taints.py`), depth-first with backtracking under a step budget. The output is the `status.allocation` v1 dict per
claim, or a `NodeReport` saying per request which check rejected which devices. Claim parsing lives in
`requests.py`, slice gathering in `pools.py`, result building in `results.py`.

Across scheduling cycles (the SliceIndex is kept until slices change): each device keeps its CEL
verdict per request signature (class and request selectors), and a node's single plain pool (no
counters, no taints) keeps its filtering result per signature, valid while the AllocatedState's
stamp for that pool is unchanged. A pass over 1,000 full nodes is then ~5 µs a node.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

import msgspec

from embedded.scheduler.capacity import consumption, qualify, shortage
from embedded.scheduler.cel import CelError
from embedded.scheduler.pools import Candidate, CounterKey, DeviceId, Pool, SliceIndex, node_labels
from embedded.scheduler.report import SAMPLE, ClaimProblem, NodeReport, Rejection, RequestReport
from embedded.scheduler.requests import ClaimError, ClaimRequests, Constraint, Req, parse_claims
from embedded.scheduler.results import allocation_result
from embedded.scheduler.taints import blocking_taint, taint_text
from embedded.scheduler.values import QuantityError, parse_quantity
from shared.heap import collection_paused

MAX_RESULTS = 32
MAX_VERDICTS = 256  # request signatures remembered per device
_UNSET: Any = object()
_stamps = itertools.count(1)
DEFAULT_BUDGET = 100_000  # device tries per node before the search gives up


class AllocatedState:
    """Devices held by allocated claims (admin-access results excluded), with the claim holding each,
    and the capacity that shares of shareable devices (results with a `shareID`) consume.

    Change `devices` and `shared` only through `add_claim` / `remove_claim`: they stamp each touched
    pool with a number never used before, which is what kept filtering results are checked against."""

    def __init__(self, devices: Mapping[DeviceId, str] | None = None):
        self.devices: dict[DeviceId, str] = dict(devices or {})
        # shareable device -> qualified capacity name -> consumed by all its allocated shares
        self.shared: dict[DeviceId, dict[str, Fraction]] = {}
        self._shares: dict[str, list[tuple[DeviceId, dict[str, Fraction]]]] = {}  # owner -> its shares
        self._share_count: dict[DeviceId, int] = {}
        self._in_use: dict[DeviceId, str] | None = None
        self.serial = next(_stamps)
        self._touched: dict[tuple[str, str], int] = {}

    @classmethod
    def from_claims(cls, claims: Iterable[Mapping[str, Any]]) -> AllocatedState:
        state = cls()
        for claim in claims:
            state.add_claim(claim)
        return state

    def add_claim(self, claim: Mapping[str, Any]) -> None:
        md = claim.get("metadata") or {}
        owner = f"{md.get('namespace', '')}/{md.get('name', '')}"
        if owner in self._shares:
            self._drop_shares(owner)
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for r in (allocation.get("devices") or {}).get("results") or []:
            if r.get("adminAccess"):
                continue
            did = (r["driver"], r["pool"], r["device"])
            if r.get("shareID"):
                amounts: dict[str, Fraction] = {}
                for name, value in (r.get("consumedCapacity") or {}).items():
                    try:
                        amounts[qualify(str(name), did[0])] = parse_quantity(str(value))
                    except QuantityError:
                        continue  # the API server validates these; a bad one consumes nothing
                self._shares.setdefault(owner, []).append((did, amounts))
                self._share_count[did] = self._share_count.get(did, 0) + 1
                used = self.shared.setdefault(did, {})
                for name, amount in amounts.items():
                    used[name] = used.get(name, Fraction(0)) + amount
            else:
                self.devices[did] = owner
            self._touched[(did[0], did[1])] = next(_stamps)
            self._in_use = None

    def remove_claim(self, claim: Mapping[str, Any]) -> None:
        md = claim.get("metadata") or {}
        owner = f"{md.get('namespace', '')}/{md.get('name', '')}"
        for key in [k for k, v in self.devices.items() if v == owner]:
            del self.devices[key]
            self._touched[(key[0], key[1])] = next(_stamps)
            self._in_use = None
        self._drop_shares(owner)

    def _drop_shares(self, owner: str) -> None:
        for did, amounts in self._shares.pop(owner, []):
            used = self.shared[did]
            for name, amount in amounts.items():
                used[name] -= amount
            self._share_count[did] -= 1
            if not self._share_count[did]:
                del self.shared[did], self._share_count[did]
            self._touched[(did[0], did[1])] = next(_stamps)
            self._in_use = None

    def share_count(self, did: DeviceId) -> int:
        """How many shares (results with a shareID) of the device are allocated."""
        return self._share_count.get(did, 0)

    def in_use(self) -> Mapping[DeviceId, str]:
        """Every device with an allocation: held whole or shared (what nets pools' counters)."""
        if not self.shared:
            return self.devices
        if self._in_use is None:
            self._in_use = {**{did: "" for did in self.shared}, **self.devices}
        return self._in_use

    def pool_stamp(self, driver: str, pool: str) -> tuple[int, int]:
        """Equal stamps: the same devices of this pool held by the same claims."""
        return self.serial, self._touched.get((driver, pool), 0)


class NodeOutcome(msgspec.Struct, kw_only=True, gc=False):
    """One node: allocations by claim (`namespace/name`) when it fits, and the report either way."""

    node: str
    allocations: dict[str, dict[str, Any]] | None
    report: NodeReport


class ScheduleOutcome(msgspec.Struct, kw_only=True):
    """The first node that fits (if any), with the reports of the nodes tried."""

    node: str | None
    allocations: dict[str, dict[str, Any]]
    reports: list[NodeReport]
    problems: list[ClaimProblem]


def constraint_value(device: Candidate, attribute: str) -> Any:
    """matchAttribute lookup: the exact `dom/name` key, else `name` when `dom` is the driver's domain."""
    attrs = device.device.get("attributes") or {}
    if attribute in attrs:
        found = attrs[attribute]
    else:
        domain, _, ident = attribute.rpartition("/")
        if domain != device.driver or ident not in attrs:
            return None
        found = attrs[ident]
    return tuple(sorted((k, str(v)) for k, v in found.items()))


class _ConstraintState:
    __slots__ = ("count", "spec", "value")

    def __init__(self, spec: Constraint):
        self.spec = spec
        self.value: Any = None
        self.count = 0

    def add(self, req: Req, device: Candidate) -> bool:
        if not self.spec.applies(req):
            return True
        value = constraint_value(device, self.spec.attribute)
        if value is None:
            return False
        if self.count and value != self.value:
            return False
        self.value = value
        self.count += 1
        return True

    def remove(self, req: Req) -> None:
        if self.spec.applies(req):
            self.count -= 1
            if self.count == 0:
                self.value = None


def _cel_verdict(req: Req, device: Candidate) -> str | CelError | None:
    """The first class selector or request selector that rejects the device (its reason), or the
    CelError of one that fails; None when every selector accepts it."""
    try:
        for sel in req.class_selectors:
            if not device.env.matches(sel):
                return f"not in class {req.class_name}"
        for i, sel in enumerate(req.selectors):
            if not device.env.matches(sel):
                return f"selector #{i + 1} `{_short(sel.expression)}` is false"
    except CelError as exc:
        return exc
    return None


class _Budget(Exception):
    pass


class NodeAttempt:
    """One pod's claims on one node: per-device filtering, then the combined search."""

    def __init__(
        self,
        claims: list[ClaimRequests],
        pools: list[Pool],
        allocated: AllocatedState,
        node: str,
        budget: int = DEFAULT_BUDGET,
    ):
        self.claims = claims
        self.pools = [p for p in pools if not p.incomplete and not p.invalid]
        self.all_pools = pools
        self.allocated = allocated
        self.node = node
        self.budget = budget
        self.steps = 0
        self.counters: dict[CounterKey, dict[str, Fraction]] = {}
        for p in self.pools:
            if p.counters:
                self.counters.update(p.counters)
        self.used: dict[CounterKey, dict[str, Fraction]] = {}
        self.eligible: dict[int, list[Candidate]] = {}
        self.reports: dict[int, RequestReport] = {}
        # The search's state, set up by run() (most nodes fail in filtering and never search).
        self.chosen: dict[DeviceId, list[int]] = {}  # device -> claim indices that picked it in this attempt
        self.results: list[list[tuple[Req, Candidate]]] = []
        self.constraints: list[list[_ConstraintState]] = []
        self.picked_alt: dict[tuple[int, int], int] = {}
        # Shareable devices: capacity consumed and shares taken by this attempt's choices so far.
        self.sharing: dict[DeviceId, dict[str, Fraction]] = {}
        self.share_uses: dict[DeviceId, int] = {}
        self.needs: dict[tuple[int, DeviceId], tuple[dict[str, Fraction], str]] = {}

    # ---- per-device checks (independent of the other choices) -------------------------------------

    def filter(self, req: Req) -> RequestReport:
        report = RequestReport(
            claim=req.claim_key,
            request=req.name,
            device_class=req.class_name,
            wanted="all" if req.mode == "All" else str(req.count),
        )
        eligible: list[Candidate] = []
        signature, admin, every = req.signature, req.admin, req.mode == "All"
        taken = self.allocated.devices
        kept = self.pools[0] if len(self.pools) == 1 and self.pools[0].plain and not every else None
        if kept is not None:
            # One plain pool: the outcome is fixed by the selectors and by who holds each device (stamped).
            holders = self.allocated.pool_stamp(kept.driver, kept.name)
            hit = kept.filtered.get((signature, admin))
            if hit is not None and hit[0] == holders:
                return self._reuse(req, report, hit[1], hit[2], len(kept.devices))
        buckets: dict[str, Rejection] = {}  # reason -> its entry in report.rejections (first-seen order)
        seen = 0
        for pool in self.pools:
            seen += len(pool.devices)
            for device in pool.devices:
                # The CEL part depends only on the request's selectors: cached on the device.
                verdict = device.verdicts.get(signature, _UNSET)
                if verdict is _UNSET:
                    verdict = _cel_verdict(req, device)
                    if len(device.verdicts) >= MAX_VERDICTS:
                        device.verdicts.clear()
                    device.verdicts[signature] = verdict
                label = device.text
                if verdict is None:
                    # Then the checks that depend on allocations and tolerations, cheapest first.
                    owner = None if admin else taken.get(device.id)
                    if owner is not None:
                        reason = f"already allocated to claim {owner}"
                    elif device.taints and (taint := blocking_taint(device.taints, req.tolerations)) is not None:
                        reason = f"taint {taint_text(taint)} not tolerated"
                    elif device.shareable and not admin and (lack := self._capacity_problem(req, device))[0]:
                        reason, label = lack[0], f"{device.text}: {lack[1]}"
                    elif not admin and device.consumes and (short := self._counter_shortage(device)):
                        reason = f"counters used up by allocated devices ({short})"
                    else:
                        eligible.append(device)
                        continue
                    if every:
                        report.error = report.error or f"allocationMode All needs every matching device, but {reason}"
                elif verdict.__class__ is str:
                    reason = verdict
                else:
                    report.seen = seen - len(pool.devices) + pool.devices.index(device) + 1
                    report.error = (
                        f"selector `{_short(verdict.expression)}` failed on device {device.text}: {verdict.message}"
                    )
                    self.eligible[id(req)] = []
                    self.reports[id(req)] = report
                    return report
                bucket = buckets.get(reason)
                if bucket is None:
                    bucket = buckets[reason] = Rejection(reason=reason, detailed=label is not device.text)
                    report.rejections.append(bucket)
                bucket.count += 1
                if len(bucket.devices) < SAMPLE:
                    bucket.devices.append(label)
        report.seen = seen
        report.eligible = len(eligible)
        if kept is not None:
            if len(kept.filtered) >= MAX_VERDICTS:
                kept.filtered.clear()
            kept.filtered[(signature, admin)] = (
                holders,
                tuple(eligible),
                tuple((r.reason, r.count, tuple(r.devices)) for r in report.rejections),
            )
        if every:
            if any(p.incomplete for p in self.all_pools):
                report.error = report.error or "allocationMode All cannot be used while a pool is incomplete"
            elif not eligible:
                report.error = report.error or "allocationMode All matched no device"
        self.eligible[id(req)] = [] if report.error else eligible
        self.reports[id(req)] = report
        return report

    def _reuse(
        self,
        req: Req,
        report: RequestReport,
        eligible: tuple[Candidate, ...],
        rejections: tuple[tuple[str, int, tuple[str, ...]], ...],
        seen: int,
    ) -> RequestReport:
        report.seen, report.eligible = seen, len(eligible)
        report.rejections = [
            Rejection(reason=reason, count=count, devices=list(devices)) for reason, count, devices in rejections
        ]
        self.eligible[id(req)] = list(eligible)
        self.reports[id(req)] = report
        return report

    def _need(self, req: Req, device: Candidate) -> tuple[dict[str, Fraction], str]:
        """What one share of `device` for `req` consumes, and the policy it violates ("" if none)."""
        key = (id(req), device.id)
        found = self.needs.get(key)
        if found is None:
            requests = {qualify(name, device.driver): amount for name, amount in req.capacity.items()}
            found = self.needs[key] = consumption(device.capacities, requests)
        return found

    def _capacity_problem(self, req: Req, device: Candidate) -> tuple[str, str]:
        """(reason, per-device detail) when a share of `device` cannot be given to `req`, else ("", "")."""
        need, violation = self._need(req, device)
        if violation:
            return "capacity request not allowed by the device's requestPolicy", violation
        short = shortage(device.capacities, need, self.allocated.shared.get(device.id), self.sharing.get(device.id))
        if short:
            return "not enough capacity left", short
        return "", ""

    def _due(self, device: Candidate) -> list[tuple[CounterKey, dict[str, Fraction]]]:
        """The counters taking `device` consumes: none for a shareable device that already has a share."""
        if device.shareable and (device.id in self.allocated.shared or self.share_uses.get(device.id)):
            return []
        return device.consumes

    def _counter_shortage(self, device: Candidate) -> str:
        for ckey, amounts in self._due(device):
            have = self.counters.get(ckey, {})
            used = self.used.get(ckey, {})
            for name, amount in amounts.items():
                if amount > have.get(name, Fraction(0)) - used.get(name, Fraction(0)):
                    return f"{ckey[3]}: {name}"
        return ""

    # ---- combined search ------------------------------------------------------------------------

    def run(self) -> bool:
        if self.claims and self.claims[0].requests:
            for req in self.claims[0].requests[0].alternatives:
                if self._may_try(req):
                    break
            else:
                return False  # the first request has no alternative to try: the search would stop at once
        self.results = [[] for _ in self.claims]
        self.constraints = [[_ConstraintState(c) for c in cr.constraints] for cr in self.claims]
        try:
            return self._claim(0)
        except _Budget:
            return False

    def _may_try(self, req: Req) -> bool:
        return not self.reports[id(req)].error and (req.mode == "All" or len(self.eligible[id(req)]) >= req.count)

    def _claim(self, ci: int) -> bool:
        if ci == len(self.claims):
            return True
        return self._request(ci, 0)

    def _request(self, ci: int, ri: int) -> bool:
        claim = self.claims[ci]
        if ri == len(claim.requests):
            return self._claim(ci + 1)
        spec = claim.requests[ri]
        for ai, req in enumerate(spec.alternatives):
            if not self._may_try(req):
                continue
            n = len(self.eligible[id(req)]) if req.mode == "All" else req.count
            if len(self.results[ci]) + n > MAX_RESULTS:
                self.reports[
                    id(req)
                ].error = f"the claim would get more than {MAX_RESULTS} devices ({len(self.results[ci])} + {n})"
                continue
            self.picked_alt[(ci, ri)] = ai
            if self._slot(ci, ri, req, n, 0, 0):
                return True
        return False

    def _slot(self, ci: int, ri: int, req: Req, n: int, k: int, start: int) -> bool:
        if k == n:
            return self._request(ci, ri + 1)
        devices = self.eligible[id(req)]
        report = self.reports[id(req)]
        positions = [k] if req.mode == "All" else range(start, len(devices))
        for pos in positions:
            self.steps += 1
            if self.steps > self.budget:
                raise _Budget
            device = devices[pos]
            reason = self._conflict(ci, req, device)
            if reason is None:
                self._take(ci, req, device)
                if self._slot(ci, ri, req, n, k + 1, pos + 1):
                    return True
                self._undo(ci, req, device)
            else:
                report.rejection(reason, conflicts=True).add(device.label())
            if req.mode == "All":
                return False
        return False

    def _conflict(self, ci: int, req: Req, device: Candidate) -> str | None:
        holders = self.chosen.get(device.id)
        if holders and (not req.admin or ci in holders):
            return "already chosen for another request of this pod"
        if not req.admin:
            if device.shareable:
                lack, detail = self._capacity_problem(req, device)
                if lack:
                    return f"capacity taken by this pod's other requests ({detail})"
            short = self._counter_shortage(device)
            if short:
                return f"counters taken by this pod's other devices ({short})"
        states = self.constraints[ci]
        for i, state in enumerate(states):
            if not state.add(req, device):
                for prior in states[:i]:
                    prior.remove(req)
                return f"matchAttribute {state.spec.attribute} differs from the devices already chosen"
        return None

    def _take(self, ci: int, req: Req, device: Candidate) -> None:
        if not device.shareable:
            self.chosen.setdefault(device.id, []).append(ci)
        if not req.admin:
            for ckey, amounts in self._due(device):
                used = self.used.setdefault(ckey, {})
                for name, amount in amounts.items():
                    used[name] = used.get(name, Fraction(0)) + amount
            if device.shareable:
                self.share_uses[device.id] = self.share_uses.get(device.id, 0) + 1
                sharing = self.sharing.setdefault(device.id, {})
                for name, amount in self._need(req, device)[0].items():
                    sharing[name] = sharing.get(name, Fraction(0)) + amount
        self.results[ci].append((req, device))

    def _undo(self, ci: int, req: Req, device: Candidate) -> None:
        self.results[ci].pop()
        if not device.shareable:
            holders = self.chosen[device.id]
            holders.remove(ci)
            if not holders:
                del self.chosen[device.id]
        if not req.admin:
            if device.shareable:
                self.share_uses[device.id] -= 1
                sharing = self.sharing[device.id]
                for name, amount in self._need(req, device)[0].items():
                    sharing[name] -= amount
            for ckey, amounts in self._due(device):
                used = self.used[ckey]
                for name, amount in amounts.items():
                    used[name] -= amount
        for state in self.constraints[ci]:
            state.remove(req)


def _short(expression: str, limit: int = 90) -> str:
    text = " ".join(expression.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def allocate_on_node(
    claims: list[ClaimRequests],
    index: SliceIndex,
    allocated: AllocatedState,
    node: Mapping[str, Any] | str,
    budget: int = DEFAULT_BUDGET,
) -> NodeOutcome:
    """Allocate all `claims` (already parsed) together on `node`, or explain why not."""
    node_obj: Mapping[str, Any]
    if isinstance(node, str):
        name, node_obj = node, {"metadata": {"name": node}}
    else:
        name, node_obj = node_labels(node)[0], node
    pools = index.gather(node_obj, allocated.in_use())
    report = NodeReport(node=name)
    for p in pools:
        if p.incomplete or p.invalid:
            report.notes = [p.incomplete for p in pools if p.incomplete] + [p.invalid for p in pools if p.invalid]
            break
    if not pools:
        report.problem = "no ResourceSlices are published for this node"
    attempt = NodeAttempt(claims, pools, allocated, name, budget)
    for claim in claims:
        for spec in claim.requests:
            for req in spec.alternatives:
                report.requests.append(attempt.filter(req))
    fits = attempt.run()
    if attempt.steps > budget:
        report.problem = report.problem or f"the search gave up after {budget} device tries"
    if not fits:
        if not report.problem and any(p.invalid for p in pools):
            report.problem = "a pool visible from this node is invalid; see notes"
        return NodeOutcome(node=name, allocations=None, report=report)
    report.fits = True
    allocations: dict[str, dict[str, Any]] = {}
    for ci, claim in enumerate(claims):
        picked = attempt.results[ci]
        for req, device in picked:
            attempt.reports[id(req)].allocated.append(device.label())
        chosen_alts = {
            ri: claim.requests[ri].alternatives[attempt.picked_alt.get((ci, ri), 0)]
            for ri in range(len(claim.requests))
        }
        allocations[claim.key] = allocation_result(claim, chosen_alts, picked, name)
    # On success only the chosen firstAvailable subrequests stay in the report.
    report.requests = [r for r in report.requests if r.allocated or "/" not in r.request]
    return NodeOutcome(node=name, allocations=allocations, report=report)


def schedule(
    claims: list[Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]] | SliceIndex,
    allocated: AllocatedState,
    nodes: Iterable[Mapping[str, Any] | str],
    *,
    admin_namespaces: Iterable[str] = (),
    budget: int = DEFAULT_BUDGET,
    all_nodes: bool = False,
) -> ScheduleOutcome:
    """Try `nodes` in order; the first that fits wins (with `all_nodes`, every node is still reported)."""
    try:
        parsed = parse_claims(claims, classes, set(admin_namespaces))
    except ClaimError as exc:
        return ScheduleOutcome(
            node=None, allocations={}, reports=[], problems=[ClaimProblem(claim=exc.claim, message=exc.message)]
        )
    index = slices if isinstance(slices, SliceIndex) else SliceIndex(slices)
    reports: list[NodeReport] = []
    winner: NodeOutcome | None = None
    # Thousands of short-lived reports over a heap of every slice: no full GC pass in the middle.
    with collection_paused():
        for node in nodes:
            outcome = allocate_on_node(parsed, index, allocated, node, budget)
            reports.append(outcome.report)
            if outcome.allocations is not None and winner is None:
                winner = outcome
                if not all_nodes:
                    break
    if winner is None:
        return ScheduleOutcome(node=None, allocations={}, reports=reports, problems=[])
    return ScheduleOutcome(node=winner.node, allocations=winner.allocations or {}, reports=reports, problems=[])
