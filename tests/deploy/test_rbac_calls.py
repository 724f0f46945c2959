"""Every Kubernetes API call the services make is granted to the ServiceAccount of the pod that runs them.

CALLS names each call site in services/ and the dashboard's explain (module, API method or raw HTTP verb)
with the permission it needs; a scan of the sources fails on a call site missing from CALLS, so a new call
cannot ship without its rule.
The ServiceAccount of each module comes from the rendered manifests (the workload whose container runs that
`gpu-dra` command), the grants from the rendered Roles/ClusterRoles and their bindings."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import OVERLAYS, REPO, render_overlay
from tests.deploy.test_manifests import _can, _rules_by_service_account

pytestmark = pytest.mark.kubectl

RN, RK, CO = "resource.nvidia.com", "resource.k8s.io", "coordination.k8s.io"
# Non-resource URLs (/version, /apis/<group>) are open to every authenticated user (system:discovery).
DISCOVERY: list[tuple[str, str, set[str]]] = []

# (module, call) -> [(API group, resource, verbs)]; `api:<class>` entries record which typed API classes a
# module uses (their calls are listed beside them)
CALLS: dict[tuple[str, str], list[tuple[str, str, set[str]]]] = {
    ("services/preparer/cli.py", "record_event"): [("", "events", {"create"})],
    ("services/webhook/cli.py", "request:GET"): [
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations", {"get"})
    ],
    ("services/webhook/cli.py", "request:PATCH"): [
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations", {"patch"})
    ],
    ("services/preparer/host/claims.py", "request:GET"): [(RK, "resourceclaims", {"get"})],
    ("services/computedomain/controller.py", "informer:COMPUTEDOMAINS"): [(RN, "computedomains", {"list", "watch"})],
    ("services/computedomain/controller.py", "get:COMPUTEDOMAINS"): [(RN, "computedomains", {"get"})],
    ("services/computedomain/controller.py", "patch:COMPUTEDOMAINS"): [
        (RN, "computedomains", {"patch"}),
        (RN, "computedomains/status", {"patch"}),
    ],
    ("services/computedomain/controller.py", "get:RESOURCECLAIMTEMPLATES"): [(RK, "resourceclaimtemplates", {"get"})],
    ("services/computedomain/controller.py", "informer:RESOURCECLAIMTEMPLATES"): [
        (RK, "resourceclaimtemplates", {"list", "watch"})
    ],
    ("services/computedomain/controller.py", "create:RESOURCECLAIMTEMPLATES"): [
        (RK, "resourceclaimtemplates", {"create"})
    ],
    ("services/computedomain/controller.py", "delete:RESOURCECLAIMTEMPLATES"): [
        (RK, "resourceclaimtemplates", {"delete"})
    ],
    ("services/computedomain/assignments.py", "list:RESOURCECLAIMS"): [(RK, "resourceclaims", {"list"})],
    ("services/computedomain/assignments.py", "watch:RESOURCECLAIMS"): [(RK, "resourceclaims", {"watch"})],
    ("services/computedomain/leader.py", "get:LEASES"): [(CO, "leases", {"get"})],
    ("services/computedomain/leader.py", "create:LEASES"): [(CO, "leases", {"create"})],
    ("services/computedomain/leader.py", "replace:LEASES"): [(CO, "leases", {"update"})],
    ("services/authcallout/service.py", "api:AuthenticationV1Api"): [
        ("authentication.k8s.io", "tokenreviews", {"create"})
    ],
    ("services/publisher/nodes.py", "list_pages"): [("", "nodes", {"list"})],
    ("services/publisher/nodes.py", "watch_lines"): [("", "nodes", {"watch"})],
    ("services/publisher/apiversion.py", "get_json"): DISCOVERY,
    ("services/publisher/taintevents.py", "record_event"): [("", "events", {"create"})],
    ("services/publisher/nodeconfigs.py", "reader:NodeConfigObjects"): [(RN, "nodeconfigs", {"list", "watch"})],
    ("services/preparer/nodesettings.py", "reader:NodeConfigObjects"): [(RN, "nodeconfigs", {"list", "watch"})],
    ("services/preparer/nodesettings.py", "informer:NODES"): [("", "nodes", {"list", "watch"})],
    ("services/publisher/nodeconfigs.py", "patch:NODECONFIGS"): [(RN, "nodeconfigs/status", {"patch"})],
    ("services/publisher/nodeconfigs.py", "record_event"): [("", "events", {"create"})],
    ("services/computedomain/controller.py", "record_event"): [("", "events", {"create"})],
    ("services/publisher/writer.py", "request:GET"): [(RK, "resourceslices", {"list"})],
    ("services/publisher/writer.py", "list_pages"): [(RK, "resourceslices", {"list"})],
    ("services/publisher/writer.py", "request:POST"): [(RK, "resourceslices", {"create"})],
    ("services/publisher/writer.py", "request:PUT"): [(RK, "resourceslices", {"update"})],
    ("services/publisher/writer.py", "request:DELETE"): [(RK, "resourceslices", {"delete"})],
    ("services/dashboard/state.py", "informer:slices"): [(RK, "resourceslices", {"list", "watch"})],
    ("services/dashboard/state.py", "informer:claims"): [(RK, "resourceclaims", {"list", "watch"})],
    ("services/dashboard/state.py", "get:PODS"): [("", "pods", {"get"})],
    ("services/dashboard/state.py", "informer:NODES"): [("", "nodes", {"list", "watch"})],
    ("services/dashboard/pending.py", "informer:PODS"): [("", "pods", {"list", "watch"})],
    ("services/dashboard/allocmetrics.py", "get:PODS"): [("", "pods", {"get"})],
    ("services/dashboard/state.py", "informer:COMPUTEDOMAINS"): [(RN, "computedomains", {"list", "watch"})],
    ("services/dashboard/auth.py", "request:POST"): [
        ("authentication.k8s.io", "tokenreviews", {"create"}),
        ("authorization.k8s.io", "subjectaccessreviews", {"create"}),
    ],
    # the dashboard's explain (embedded/cluster/dashboardtools.py explainer): load_pod's reads
    ("embedded/cluster/explain.py", "get:PODS"): [("", "pods", {"get"})],
    ("embedded/cluster/explain.py", "list:RESOURCECLAIMS"): [(RK, "resourceclaims", {"list"})],
    ("embedded/cluster/explain.py", "list:RESOURCESLICES"): [(RK, "resourceslices", {"list"})],
    ("embedded/cluster/explain.py", "list:NODES"): [("", "nodes", {"list"})],
    ("embedded/cluster/explain.py", "list:DEVICECLASSES"): [(RK, "deviceclasses", {"list"})],
    ("embedded/cluster/explain.py", "get:NAMESPACES"): [("", "namespaces", {"get"})],
    ("embedded/cluster/explain.py", "list:EVENTS"): [("", "events", {"list"})],
}
# the `gpu-dra` command whose process runs each service package's (or module's) calls
COMMANDS = {
    "services/preparer": "preparer",
    "services/publisher": "publisher",
    "services/computedomain": "computedomain controller",
    "services/authcallout": "nats auth-callout",
    "services/dashboard": "dashboard",
    "embedded/cluster/explain.py": "dashboard",
    "services/webhook": "webhook",
}
# modules outside services/ that a service runs: the dashboard's explain (its claim path, load_state, is the
# CLI's alone and makes no call the scan matches)
SERVICE_MODULES_ELSEWHERE = ("embedded/cluster/explain.py",)
# API helpers and test support, not call sites
NOT_CALL_SITES = {"shared/kube/rest.py", "embedded/harness/publisher.py", "embedded/harness/discovery.py"}

_PATTERNS = (
    (
        re.compile(r"\.((?:create|read|list|patch|replace|delete|get|watch)_(?:namespaced|cluster)_\w+)\b"),
        lambda m: m.group(1),
    ),
    # a typed API class: its calls on cluster-scoped objects (create_node, ...) need an entry too
    (re.compile(r"\b(\w+V\d\w*Api|CustomObjectsApi)\("), lambda m: f"api:{m.group(1)}"),
    (re.compile(r"\bkube\.request\(\s*[\w.]+,\s*\"(\w+)\""), lambda m: f"request:{m.group(1)}"),
    (re.compile(r"\b(watch_lines|get_json|call_api|list_pages)\("), lambda m: m.group(1)),
    (re.compile(r"\b(record_event)\("), lambda m: m.group(1)),  # shared.kube.events: creates an Event
    # shared.kube.resources.Kube's typed calls on the resource they are given
    (
        re.compile(r"\bkube\.(get|list|create|patch|delete|update|replace|watch)\(\s*(\w+)"),
        lambda m: f"{m.group(1)}:{m.group(2)}",
    ),
    # the one informer (shared.kube.informer) lists and watches the resource it is given
    (re.compile(r"\bInformer\(\s*(?:Kube\([^)]*\)|(?:self\.)?kube),\s*(\w+)"), lambda m: f"informer:{m.group(1)}"),
    # shared.nodeconfig_objects lists and watches every NodeConfig for the module that uses it
    (re.compile(r"\b(NodeConfigObjects)\b"), lambda m: f"reader:{m.group(1)}"),
)


def _call_sites() -> set[tuple[str, str]]:
    found = set()
    for path in [*sorted((REPO / "services").rglob("*.py")), *(REPO / m for m in SERVICE_MODULES_ELSEWHERE)]:
        module = path.relative_to(REPO).as_posix()
        if module in NOT_CALL_SITES or "/protos/" in module:
            continue
        # the code without definitions and comment lines, as one text: a call the formatter split over lines
        # (`kube.patch(\n    COMPUTEDOMAINS, ...`) is one match
        code = "\n".join(
            line for line in path.read_text().splitlines() if not line.lstrip().startswith(("def ", "async def ", "#"))
        )
        for pattern, key in _PATTERNS:
            found |= {(module, key(m)) for m in pattern.finditer(code)}
    return found


def test_every_api_call_site_is_listed() -> None:
    sites = _call_sites()
    assert sites - set(CALLS) == set(), "API calls without a permission in CALLS: add them, and their RBAC rule"
    assert set(CALLS) - sites == set(), "CALLS lists call sites that are gone"


def _service_accounts(objects: list[dict[str, Any]]) -> dict[str, str]:
    """`gpu-dra` command -> the ServiceAccount of the pod that runs it."""
    out = {}
    for obj in objects:
        if obj["kind"] not in ("Deployment", "DaemonSet"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for container in spec["containers"]:
            env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
            argv = shlex.split(env["SERVICE_COMMAND"]) if "SERVICE_COMMAND" in env else container.get("args", [])
            if argv:
                out[" ".join(argv)] = spec["serviceAccountName"]
    return out


def _command(module: str) -> str:
    return next(cmd for prefix, cmd in COMMANDS.items() if module.startswith(prefix))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_api_call_is_granted_to_the_pod_that_makes_it(overlay: str) -> None:
    objects = render_overlay(overlay)
    accounts = _service_accounts(objects)
    rules = _rules_by_service_account(objects)
    missing = []
    for (module, call), needs in CALLS.items():
        account = accounts[_command(module)]
        for group, resource, verbs in needs:
            granted = _can(rules.get(account, []), group, resource, verbs)
            if granted != verbs:
                missing.append(
                    f"{module} {call}: {account} lacks {sorted(verbs - granted)} on {group or 'core'}/{resource}"
                )
    assert missing == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_preparer_may_create_events_and_nothing_more_on_them(overlay: str) -> None:
    objects = render_overlay(overlay)
    account = _service_accounts(objects)["preparer"]
    every_verb = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
    assert _can(_rules_by_service_account(objects)[account], "", "events", every_verb) == {"create"}


def test_the_scan_sees_the_preparers_event() -> None:
    """The scanner is what keeps CALLS honest: it must find a known call site."""
    assert ("services/preparer/cli.py", "record_event") in _call_sites()
    assert Path(REPO / "services/preparer/cli.py").is_file()
