"""Table output (meta.k8s.io/v1 Table) for `kubectl get`: columns and cells per kind, as the real
server's printers produce them, and CRD additionalPrinterColumns evaluated with a small JSONPath.

`wants_table(accept)` reads the Accept header kubectl sends
(`application/json;as=Table;v=v1;g=meta.k8s.io,...`).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from typing import Any

from embedded.apiserver.resources import Resource

Column = tuple[str, str, str, int, Callable[[dict[str, Any]], Any]]  # name, type, format, priority, cell


def wants_table(accept: str) -> bool:
    return "as=Table" in accept.replace(" ", "")


def wants_metadata(accept: str) -> bool:
    return "as=PartialObjectMetadata" in accept.replace(" ", "")


def human_age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    try:
        then = dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    except ValueError:
        return "<invalid>"
    return human_duration((dt.datetime.now(dt.UTC) - then).total_seconds())


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery duration.HumanDuration."""
    s = int(seconds)
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    d = h // 24
    if h < 24 * 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if h < 24 * 365 * 2:
        return f"{d}d"
    return f"{d // 365}y{d % 365}d" if h < 24 * 365 * 8 else f"{d // 365}y"


def _md(o: dict[str, Any]) -> dict[str, Any]:
    return o.get("metadata") or {}


def _name(o: dict[str, Any]) -> str:
    return str(_md(o).get("name", ""))


def _age(o: dict[str, Any]) -> str:
    return human_age(_md(o).get("creationTimestamp"))


NAME: Column = ("Name", "string", "name", 0, _name)
AGE: Column = ("Age", "string", "", 0, _age)


def _pod_ready(o: dict[str, Any]) -> str:
    statuses = (o.get("status") or {}).get("containerStatuses") or []
    total = len((o.get("spec") or {}).get("containers") or [])
    ready = sum(1 for s in statuses if s.get("ready"))
    return f"{ready}/{total}"


def _pod_status(o: dict[str, Any]) -> str:
    if _md(o).get("deletionTimestamp"):
        return "Terminating"
    status = o.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            return str(waiting["reason"])
    return str(status.get("reason") or status.get("phase") or "Unknown")


def _pod_restarts(o: dict[str, Any]) -> int:
    return sum(int(s.get("restartCount") or 0) for s in (o.get("status") or {}).get("containerStatuses") or [])


def _get(path: str) -> Callable[[dict[str, Any]], Any]:
    parts = path.split(".")

    def cell(o: dict[str, Any]) -> Any:
        cur: Any = o
        for p in parts:
            cur = cur.get(p) if isinstance(cur, dict) else None
        return "<none>" if cur is None or cur == "" else cur

    return cell


def _node_status(o: dict[str, Any]) -> str:
    conds = {c.get("type"): c.get("status") for c in (o.get("status") or {}).get("conditions") or []}
    ready = {"True": "Ready", "False": "NotReady"}.get(conds.get("Ready", ""), "Unknown")
    if (o.get("spec") or {}).get("unschedulable"):
        ready += ",SchedulingDisabled"
    return ready


def _node_roles(o: dict[str, Any]) -> str:
    roles = [k.split("/", 1)[1] for k in (_md(o).get("labels") or {}) if k.startswith("node-role.kubernetes.io/")]
    return ",".join(sorted(roles)) or "<none>"


def _node_address(kind: str) -> Callable[[dict[str, Any]], str]:
    def cell(o: dict[str, Any]) -> str:
        for a in (o.get("status") or {}).get("addresses") or []:
            if a.get("type") == kind and a.get("address"):
                return str(a["address"])
        return "<none>"

    return cell


def _node_info(key: str) -> Callable[[dict[str, Any]], str]:
    def cell(o: dict[str, Any]) -> str:
        return str(((o.get("status") or {}).get("nodeInfo") or {}).get(key) or "<unknown>")

    return cell


def _claim_state(o: dict[str, Any]) -> str:
    status = o.get("status") or {}
    states = []
    if _md(o).get("deletionTimestamp"):
        states.append("deleted")
    if status.get("allocation"):
        states.append("allocated")
        if status.get("reservedFor"):
            states.append("reserved")
    return ",".join(states) or "pending"


def _count(path: str) -> Callable[[dict[str, Any]], int]:
    def cell(o: dict[str, Any]) -> int:
        v = o.get(path)
        return len(v) if isinstance(v, dict | list) else 0

    return cell


def _replicas(o: dict[str, Any]) -> str:
    status = o.get("status") or {}
    return f"{status.get('readyReplicas', 0)}/{(o.get('spec') or {}).get('replicas', 1)}"


def _job_status(o: dict[str, Any]) -> str:
    for c in (o.get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Complete", "Failed", "Suspended"):
            return str(c["type"])
    return "Running"


def _job_completions(o: dict[str, Any]) -> str:
    return f"{(o.get('status') or {}).get('succeeded', 0)}/{(o.get('spec') or {}).get('completions', 1)}"


def _event_object(o: dict[str, Any]) -> str:
    inv = o.get("involvedObject") or {}
    return f"{str(inv.get('kind', '')).lower()}/{inv.get('name', '')}"


def _event_last_seen(o: dict[str, Any]) -> str:
    return human_age(o.get("lastTimestamp") or o.get("eventTime") or _md(o).get("creationTimestamp"))


def _service_ports(o: dict[str, Any]) -> str:
    ports = (o.get("spec") or {}).get("ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


def _created_at(o: dict[str, Any]) -> str:
    return str(_md(o).get("creationTimestamp", ""))


COLUMNS: dict[tuple[str, str], list[Column]] = {
    ("", "pods"): [
        NAME,
        ("Ready", "string", "", 0, _pod_ready),
        ("Status", "string", "", 0, _pod_status),
        ("Restarts", "string", "", 0, _pod_restarts),
        AGE,
        ("IP", "string", "", 1, _get("status.podIP")),
        ("Node", "string", "", 1, _get("spec.nodeName")),
        ("Nominated Node", "string", "", 1, _get("status.nominatedNodeName")),
        ("Readiness Gates", "string", "", 1, lambda o: "<none>"),
    ],
    ("", "nodes"): [
        NAME,
        ("Status", "string", "", 0, _node_status),
        ("Roles", "string", "", 0, _node_roles),
        AGE,
        ("Version", "string", "", 0, _get("status.nodeInfo.kubeletVersion")),
        ("Internal-IP", "string", "", 1, _node_address("InternalIP")),
        ("External-IP", "string", "", 1, _node_address("ExternalIP")),
        ("OS-Image", "string", "", 1, _node_info("osImage")),
        ("Kernel-Version", "string", "", 1, _node_info("kernelVersion")),
        ("Container-Runtime", "string", "", 1, _node_info("containerRuntimeVersion")),
    ],
    ("", "namespaces"): [NAME, ("Status", "string", "", 0, _get("status.phase")), AGE],
    ("", "configmaps"): [
        NAME,
        ("Data", "integer", "", 0, lambda o: len(o.get("data") or {}) + len(o.get("binaryData") or {})),
        AGE,
    ],
    ("", "secrets"): [NAME, ("Type", "string", "", 0, _get("type")), ("Data", "integer", "", 0, _count("data")), AGE],
    ("", "serviceaccounts"): [NAME, ("Secrets", "integer", "", 0, _count("secrets")), AGE],
    ("", "services"): [
        NAME,
        ("Type", "string", "", 0, _get("spec.type")),
        ("Cluster-IP", "string", "", 0, _get("spec.clusterIP")),
        ("External-IP", "string", "", 0, lambda o: "<none>"),
        ("Port(s)", "string", "", 0, _service_ports),
        AGE,
    ],
    ("", "events"): [
        ("Last Seen", "string", "", 0, _event_last_seen),
        ("Type", "string", "", 0, _get("type")),
        ("Reason", "string", "", 0, _get("reason")),
        ("Object", "string", "", 0, _event_object),
        ("Message", "string", "", 0, _get("message")),
    ],
    ("apps", "deployments"): [
        NAME,
        ("Ready", "string", "", 0, _replicas),
        ("Up-to-date", "integer", "", 0, lambda o: (o.get("status") or {}).get("updatedReplicas", 0)),
        ("Available", "integer", "", 0, lambda o: (o.get("status") or {}).get("availableReplicas", 0)),
        AGE,
    ],
    ("apps", "replicasets"): [
        NAME,
        ("Desired", "integer", "", 0, lambda o: (o.get("spec") or {}).get("replicas", 1)),
        ("Current", "integer", "", 0, lambda o: (o.get("status") or {}).get("replicas", 0)),
        ("Ready", "integer", "", 0, lambda o: (o.get("status") or {}).get("readyReplicas", 0)),
        AGE,
    ],
    ("apps", "daemonsets"): [
        NAME,
        ("Desired", "integer", "", 0, lambda o: (o.get("status") or {}).get("desiredNumberScheduled", 0)),
        ("Current", "integer", "", 0, lambda o: (o.get("status") or {}).get("currentNumberScheduled", 0)),
        ("Ready", "integer", "", 0, lambda o: (o.get("status") or {}).get("numberReady", 0)),
        AGE,
    ],
    ("batch", "jobs"): [
        NAME,
        ("Status", "string", "", 0, _job_status),
        ("Completions", "string", "", 0, _job_completions),
        AGE,
    ],
    ("coordination.k8s.io", "leases"): [NAME, ("Holder", "string", "", 0, _get("spec.holderIdentity")), AGE],
    ("apiextensions.k8s.io", "customresourcedefinitions"): [NAME, ("Created At", "date", "", 0, _created_at)],
    ("resource.k8s.io", "resourceclaims"): [NAME, ("State", "string", "", 0, _claim_state), AGE],
    ("resource.k8s.io", "resourceslices"): [
        NAME,
        ("Node", "string", "", 0, _get("spec.nodeName")),
        ("Driver", "string", "", 0, _get("spec.driver")),
        ("Pool", "string", "", 0, _get("spec.pool.name")),
        AGE,
    ],
}


def columns_for(res: Resource, version: str) -> list[Column]:
    if res.is_custom:
        custom = res.printer_columns.get(version) or []
        return [NAME, *(_crd_column(c) for c in custom)] if custom else [NAME, AGE]
    return COLUMNS.get(res.key, [NAME, AGE])


def _crd_column(col: dict[str, Any]) -> Column:
    path = str(col.get("jsonPath", ""))
    kind = str(col.get("type", "string"))
    if path == ".metadata.creationTimestamp" and kind == "date":
        return (str(col.get("name", "")), "date", "", int(col.get("priority", 0)), _age)

    def cell(o: dict[str, Any]) -> Any:
        values = jsonpath(o, path)
        if not values:
            return None
        v = values[0] if len(values) == 1 else ",".join(str(x) for x in values)
        if kind == "date" and isinstance(v, str):
            return human_age(v)
        return v

    return (str(col.get("name", "")), kind, str(col.get("format", "")), int(col.get("priority", 0)), cell)


_STEP = re.compile(
    r"\.([A-Za-z0-9_\-/]+)|\[(\d+|\*)\]|\[\?\(@\.([A-Za-z0-9_.]+)\s*==\s*[\"']([^\"']*)[\"']\)\]", re.ASCII
)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """The subset of JSONPath CRD printer columns use: `.a.b`, `[0]`, `[*]`, `[?(@.type=="Ready")]`."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    if path.startswith("$"):
        path = path[1:]
    current = [obj]
    pos = 0
    while pos < len(path):
        m = _STEP.match(path, pos)
        if not m:
            return []
        pos = m.end()
        nxt: list[Any] = []
        for cur in current:
            if m.group(1) is not None:
                if isinstance(cur, dict) and m.group(1) in cur:
                    nxt.append(cur[m.group(1)])
            elif m.group(2) is not None:
                if isinstance(cur, list):
                    if m.group(2) == "*":
                        nxt.extend(cur)
                    elif int(m.group(2)) < len(cur):
                        nxt.append(cur[int(m.group(2))])
            else:
                field, want = m.group(3), m.group(4)
                if isinstance(cur, list):
                    for item in cur:
                        got = jsonpath(item, "." + field)
                        if got and str(got[0]) == want:
                            nxt.append(item)
        current = nxt
    return current


def column_definitions(res: Resource, version: str) -> list[dict[str, Any]]:
    return [
        {"name": name, "type": kind, "format": fmt, "description": _DESCRIPTIONS.get(name, name), "priority": prio}
        for name, kind, fmt, prio, _ in columns_for(res, version)
    ]


_DESCRIPTIONS = {
    "Name": "Name must be unique within a namespace. Is required when creating resources, although some "
    "resources may allow a client to request the generation of an appropriate name automatically.",
    "Age": "CreationTimestamp is a timestamp representing the server time when this object was created.",
}


def partial_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata") or {}}


def row(res: Resource, version: str, obj: dict[str, Any], include: str) -> dict[str, Any]:
    cells = [_cell(fn, obj) for _, _, _, _, fn in columns_for(res, version)]
    out: dict[str, Any] = {"cells": cells}
    if include == "Object":
        out["object"] = obj
    elif include != "None":
        out["object"] = partial_metadata(obj)
    return out


def _cell(fn: Callable[[dict[str, Any]], Any], obj: dict[str, Any]) -> Any:
    try:
        return fn(obj)
    except Exception:
        return None


def table(
    res: Resource,
    version: str,
    objs: list[dict[str, Any]],
    list_meta: dict[str, Any],
    include: str = "Metadata",
    with_columns: bool = True,
) -> dict[str, Any]:
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": column_definitions(res, version) if with_columns else [],
        "rows": [row(res, version, o, include) for o in objs],
    }
