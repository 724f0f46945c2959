"""CustomResourceDefinitions: serving custom resources as soon as their CRD is stored.

Listens to CRD changes: registers the kind (served versions in Kubernetes priority order, the
storage version, scope, names, status/scale subresources, openAPIV3Schema per version, printer
columns, selectable fields), writes the CRD's status (NamesAccepted, Established, acceptedNames,
storedVersions) as the real apiextensions controller does, and on CRD deletion deletes its
custom resources before the kind stops being served.
"""

from __future__ import annotations

import re
from typing import Any

from embedded.apiserver.core import Core, now
from embedded.apiserver.resources import Resource
from embedded.apiserver.storage import Change

CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
_VERSION = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?\Z", re.ASCII)


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Sort key: GA before beta before alpha, higher numbers first, non-kube versions last by name."""
    m = _VERSION.match(version)
    if not m:
        return (3, 0, 0, version)
    major = int(m.group(1))
    stage = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    minor = int(m.group(3) or 0)
    return (stage, -major, -minor, "")


def resource_from_crd(crd: dict[str, Any]) -> Resource | None:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    versions = [v for v in spec.get("versions") or [] if isinstance(v, dict) and v.get("served")]
    if not (group and plural and kind and versions):
        return None
    ordered = sorted(versions, key=lambda v: version_priority(str(v.get("name"))))
    storage = next((v["name"] for v in versions if v.get("storage")), ordered[0]["name"])
    subresources: list[str] = []
    schemas: dict[str, Any] = {}
    columns: dict[str, list[dict[str, Any]]] = {}
    fields: list[str] = []
    for v in ordered:
        subs = v.get("subresources") or spec.get("subresources") or {}
        for sub in ("status", "scale"):
            if sub in subs and sub not in subresources:
                subresources.append(sub)
        schema = (v.get("schema") or spec.get("validation") or {}).get("openAPIV3Schema")
        if schema:
            schemas[v["name"]] = schema
        cols = v.get("additionalPrinterColumns") or spec.get("additionalPrinterColumns")
        if cols:
            columns[v["name"]] = cols
        for f in v.get("selectableFields") or []:
            path = str(f.get("jsonPath", "")).lstrip(".")
            if path and path not in fields:
                fields.append(path)
    return Resource(
        group=group,
        versions=[str(v["name"]) for v in ordered],
        kind=kind,
        plural=plural,
        singular=names.get("singular") or kind.lower(),
        namespaced=spec.get("scope", "Namespaced") == "Namespaced",
        short_names=list(names.get("shortNames") or []),
        categories=list(names.get("categories") or []),
        subresources=subresources,
        field_selectors=tuple(fields),
        storage_version=storage,
        schemas=schemas,
        printer_columns=columns,
        crd_name=(crd.get("metadata") or {}).get("name", ""),
    )


class CrdController:
    def __init__(self, core: Core) -> None:
        self.core = core
        core.store.add_listener(self._on_change)
        core.before_delete[CRD_KEY] = self._before_delete

    def load_existing(self) -> None:
        """Register the CRDs found in storage (after a restart)."""
        for _, crd in self.core.store.items(CRD_KEY):
            res = resource_from_crd(crd)
            if res is not None:
                self.core.registry.add(res)

    def _on_change(self, change: Change) -> None:
        if change.res != CRD_KEY or change.type == "DELETED":
            return
        crd = change.obj
        if (crd.get("metadata") or {}).get("deletionTimestamp"):
            return
        res = resource_from_crd(crd)
        if res is None:
            return
        previous = self.core.registry.by_key(res.group, res.plural)
        if previous is not None and previous.crd_name != res.crd_name:
            return  # another CRD already serves these names
        self.core.registry.add(res)
        status = self._status(crd, res)
        if status != crd.get("status"):
            self.core.store.put(CRD_KEY, change.key, {**crd, "status": status})

    def _status(self, crd: dict[str, Any], res: Resource) -> dict[str, Any]:
        old = crd.get("status") or {}
        names = (crd.get("spec") or {}).get("names") or {}
        accepted = {
            "plural": res.plural,
            "singular": res.singular,
            "kind": res.kind,
            "listKind": names.get("listKind") or f"{res.kind}List",
        }
        if res.short_names:
            accepted["shortNames"] = res.short_names
        if res.categories:
            accepted["categories"] = res.categories
        old_conds = {c.get("type"): c for c in old.get("conditions") or []}
        stamp = now()

        def cond(kind: str, reason: str, message: str) -> dict[str, Any]:
            prev = old_conds.get(kind)
            if prev and prev.get("status") == "True":
                return dict(prev)
            return {"type": kind, "status": "True", "lastTransitionTime": stamp, "reason": reason, "message": message}

        stored = list(old.get("storedVersions") or [])
        if res.storage_version not in stored:
            stored.append(res.storage_version)
        return {
            "conditions": [
                cond("NamesAccepted", "NoConflicts", "no conflicts found"),
                cond("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            ],
            "acceptedNames": accepted,
            "storedVersions": stored,
        }

    def _before_delete(self, _res: Resource, crd: dict[str, Any]) -> None:
        res = resource_from_crd(crd)
        if res is None:
            return
        served = self.core.registry.by_key(res.group, res.plural)
        if served is None or served.crd_name != res.crd_name:
            return
        for key, _ in self.core.store.items(served.key):
            self.core.store.delete(served.key, key)
        self.core.registry.remove(res.group, res.plural)
        self.core.store.drop_resource(served.key)
