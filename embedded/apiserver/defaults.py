"""Server-side defaulting for the kinds our services read back: the fields the real API server
fills in on create (pod phase and policies, namespace finalizers and label, DRA request
allocation modes), so clients see the same object they would see from a real cluster."""

from __future__ import annotations

import base64
from typing import Any

from embedded.apiserver.resources import Resource


def on_create(res: Resource, obj: dict[str, Any]) -> None:
    fn = _CREATE.get(res.key)
    if fn is not None:
        fn(obj)
    _common(res, obj)


def on_update(res: Resource, new: dict[str, Any], old: dict[str, Any]) -> None:
    _common(res, new)
    if res.key == ("", "secrets"):
        _secret(new)
    if res.key == ("", "namespaces"):
        _namespace_label(new)
    if res.key in (("resource.k8s.io", "resourceclaims"), ("resource.k8s.io", "resourceclaimtemplates")):
        _claim_spec(_claim_spec_of(res, new))


def _common(res: Resource, obj: dict[str, Any]) -> None:
    if res.key in (("resource.k8s.io", "resourceclaims"),):
        _claim_spec(obj.get("spec"))


def _pod(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    if "kubernetes.io/config.mirror" not in ((obj.get("metadata") or {}).get("annotations") or {}):
        spec.setdefault("serviceAccountName", "default")  # the ServiceAccount admission's; mirror pods get none
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    for c in spec.get("containers") or []:
        if isinstance(c, dict):
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            image = str(c.get("image", ""))
            c.setdefault(
                "imagePullPolicy", "Always" if image.endswith(":latest") or ":" not in image else "IfNotPresent"
            )
            c.setdefault("resources", {})
    spec.setdefault(
        "tolerations",
        [
            {
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            },
            {
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            },
        ],
    )
    obj["status"] = {"phase": "Pending", "qosClass": _qos(spec)}


def _qos(spec: dict[str, Any]) -> str:
    resources = [c.get("resources") or {} for c in spec.get("containers") or [] if isinstance(c, dict)]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    guaranteed = all(
        (r.get("limits") or {}).get(k) and (r.get("requests") or r.get("limits") or {}).get(k) == r["limits"][k]
        for r in resources
        for k in ("cpu", "memory")
    )
    return "Guaranteed" if guaranteed else "Burstable"


def _namespace(obj: dict[str, Any]) -> None:
    obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
    obj["status"] = {"phase": "Active"}
    _namespace_label(obj)


def _namespace_label(obj: dict[str, Any]) -> None:
    md = obj.setdefault("metadata", {})
    labels = dict(md.get("labels") or {})
    labels["kubernetes.io/metadata.name"] = md.get("name", "")
    md["labels"] = labels


def _node(obj: dict[str, Any]) -> None:
    obj.setdefault("spec", {})


def _claim_template(obj: dict[str, Any]) -> None:
    _claim_spec((obj.get("spec") or {}).get("spec"))


def _claim_spec_of(res: Resource, obj: dict[str, Any]) -> Any:
    if res.kind == "ResourceClaimTemplate":
        return (obj.get("spec") or {}).get("spec")
    return obj.get("spec")


def _claim_spec(spec: Any) -> None:
    """DeviceRequest defaults: exactly/firstAvailable allocationMode ExactCount, count 1 (v1 and v1beta1)."""
    if not isinstance(spec, dict):
        return
    devices = spec.get("devices")
    if not isinstance(devices, dict):
        return
    for req in devices.get("requests") or []:
        if not isinstance(req, dict):
            continue
        targets = []
        if isinstance(req.get("exactly"), dict):
            targets.append(req["exactly"])
        elif "deviceClassName" in req:  # v1beta1 shape
            targets.append(req)
        for sub in req.get("firstAvailable") or []:
            if isinstance(sub, dict):
                targets.append(sub)
        for t in targets:
            mode = t.setdefault("allocationMode", "ExactCount")
            if mode == "ExactCount":
                t.setdefault("count", 1)
            for tol in t.get("tolerations") or []:
                if isinstance(tol, dict):
                    tol.setdefault("operator", "Equal")


def _secret(obj: dict[str, Any]) -> None:
    if not obj.get("type"):
        obj["type"] = "Opaque"
    string_data = obj.pop("stringData", None)
    if isinstance(string_data, dict):  # stringData is write-only: merged into data, base64-encoded
        data = obj.setdefault("data", {}) or {}
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        obj["data"] = data


def _deployment(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    spec.setdefault(
        "strategy", {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}}
    )
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)


def _job(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    if not spec.get("manualSelector"):
        _job_selector(obj, spec)
    spec.setdefault("parallelism", 1)
    spec.setdefault("completions", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)


def _job_selector(obj: dict[str, Any], spec: dict[str, Any]) -> None:
    """The selector a Job gets unless it asks for its own (`manualSelector`), and the labels its pod template
    gets to match it, as the job registry's generateSelector does: the uid picks this Job's pods only."""
    md = obj.get("metadata") or {}
    uid, name = str(md.get("uid", "")), str(md.get("name", ""))
    template = spec.setdefault("template", {})
    labels = template.setdefault("metadata", {}).setdefault("labels", {})
    for key, value in (
        ("batch.kubernetes.io/controller-uid", uid),
        ("batch.kubernetes.io/job-name", name),
        ("controller-uid", uid),
        ("job-name", name),
    ):
        labels.setdefault(key, value)
    spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}


_CREATE = {
    ("apps", "deployments"): _deployment,
    ("batch", "jobs"): _job,
    ("", "secrets"): _secret,
    ("", "pods"): _pod,
    ("", "namespaces"): _namespace,
    ("", "nodes"): _node,
    ("resource.k8s.io", "resourceclaimtemplates"): _claim_template,
}
