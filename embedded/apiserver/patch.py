"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch.

Strategic merge patch merges lists of objects by their merge key (containers by name, conditions
by type, ...) as the built-in Go types declare it, and honours the directives kubectl sends:
`$patch: replace|delete|merge`, `$retainKeys`, `$setElementOrder/<field>` and
`$deleteFromPrimitiveList/<field>`. Lists the table does not name are replaced, as upstream does
for atomic lists. Errors raise `PatchError` (a 422/400 at the HTTP layer).
"""

from __future__ import annotations

import copy
from typing import Any

from shared.numbers import decimal_int

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


class PatchError(ValueError):
    pass


# field name -> merge key for lists merged by key in the built-in types (patchMergeKey tags).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "env": "name",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "resourceClaims": "name",
    "claims": "name",
    "readinessGates": "conditionType",
    "topologySpreadConstraints": "topologyKey",
    "taints": "key",
    "addresses": "type",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "ephemeralContainerStatuses": "name",
    "podIPs": "ip",
    "hostIPs": "ip",
    "resourceClaimStatuses": "name",
    "images": "names",
    "volumesAttached": "name",
    "subsets": "",
    "webhooks": "name",
}
# Lists of scalars merged as sets (patchStrategy:merge on []string).
MERGE_SCALAR_LISTS = {"finalizers"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}: it must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for part in parts:
        if isinstance(cur, dict):
            if part not in cur:
                raise PatchError(f"doc is missing path: {path!r}")
            cur = cur[part]
        elif isinstance(cur, list):
            idx = _index(part, len(cur), path)
            if idx >= len(cur):
                raise PatchError(f"doc is missing path: {path!r}: index out of range")
            cur = cur[idx]
        else:
            raise PatchError(f"doc is missing path: {path!r}")
    return cur


def _index(part: str, length: int, path: str) -> int:
    if part == "-":
        return length
    index = decimal_int(part)
    if index is None:
        raise PatchError(f"invalid array index {part!r} in path {path!r}")
    return index


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 add/remove/replace/move/copy/test, applied to a copy."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid JSON patch operation {op!r}: it needs 'op' and 'path'")
        kind, path = op["op"], op["path"]
        parts = _pointer(path)
        if kind == "test":
            if _resolve(doc, parts, path) != op.get("value"):
                raise PatchError(f"testing value {path!r} failed")
            continue
        if kind in ("move", "copy"):
            src = op.get("from")
            if src is None:
                raise PatchError(f"operation {kind!r} needs 'from'")
            value = copy.deepcopy(_resolve(doc, _pointer(src), src))
            if kind == "move":
                doc = _remove(doc, _pointer(src), src)
            doc = _add(doc, parts, value, path)
            continue
        if kind == "remove":
            doc = _remove(doc, parts, path)
        elif kind in ("add", "replace"):
            if "value" not in op:
                raise PatchError(f"operation {kind!r} on {path!r} needs 'value'")
            if kind == "replace":
                _resolve(doc, parts, path)
                doc = _remove(doc, parts, path) if parts else doc
            doc = _add(doc, parts, copy.deepcopy(op["value"]), path)
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}")
    return doc


def _add(doc: Any, parts: list[str], value: Any, path: str) -> Any:
    if not parts:
        return value
    parent = _resolve(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        idx = _index(last, len(parent), path)
        if idx > len(parent):
            raise PatchError(f"index out of range in path {path!r}")
        parent.insert(idx, value)
    else:
        raise PatchError(f"doc is missing path: {path!r}")
    return doc


def _remove(doc: Any, parts: list[str], path: str) -> Any:
    if not parts:
        return None
    parent = _resolve(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"unable to remove nonexistent key: {last}: missing value")
        del parent[last]
    elif isinstance(parent, list):
        idx = _index(last, len(parent), path)
        if idx >= len(parent):
            raise PatchError(f"unable to remove from path {path!r}: index out of range")
        del parent[idx]
    else:
        raise PatchError(f"doc is missing path: {path!r}")
    return doc


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Merge `patch` into a copy of `target` with the built-in types' list semantics."""
    if not isinstance(patch, dict):
        raise PatchError("a strategic merge patch must be a JSON object")
    return _smp_map(copy.deepcopy(target) if isinstance(target, dict) else {}, patch)


def _smp_map(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return {}
    retain = patch.get("$retainKeys")
    orders: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$setElementOrder/"):
            orders[key.split("/", 1)[1]] = value
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            remove = set(map(str, value or []))
            if isinstance(target.get(field), list):
                target[field] = [v for v in target[field] if str(v) not in remove]
            continue
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            current = target.get(key)
            target[key] = _smp_map(current if isinstance(current, dict) else {}, value)
        elif isinstance(value, list):
            target[key] = _smp_list(key, target.get(key), value)
        else:
            target[key] = value
    for field, order in orders.items():
        if isinstance(target.get(field), list):
            target[field] = _apply_order(field, target[field], order)
    if isinstance(retain, list):
        keep = set(retain)
        for k in list(target):
            if k not in keep:
                del target[k]
    return target


def _smp_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    if not isinstance(current, list):
        current = []
    if field in MERGE_SCALAR_LISTS:
        out = list(current)
        for v in patch:
            if v not in out:
                out.append(v)
        return out
    key = MERGE_KEYS.get(field)
    if not key or not all(isinstance(p, dict) for p in patch):
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, dict) and v.get("$patch"))]
    if any(p.get("$patch") == "replace" for p in patch):
        return [
            copy.deepcopy({k: v for k, v in p.items() if k != "$patch"}) for p in patch if p.get("$patch") != "replace"
        ]
    out = [copy.deepcopy(c) for c in current]
    for item in patch:
        if item.get("$patch") == "delete":
            out = [c for c in out if not (isinstance(c, dict) and c.get(key) == item.get(key))]
            continue
        for idx, c in enumerate(out):
            if isinstance(c, dict) and key in item and c.get(key) == item.get(key):
                out[idx] = _smp_map(c, item)
                break
        else:
            out.append(_smp_map({}, item))
    return out


def _apply_order(field: str, items: list[Any], order: list[Any]) -> list[Any]:
    key = MERGE_KEYS.get(field)

    def ident(v: Any) -> Any:
        if key and isinstance(v, dict):
            return v.get(key)
        return v if not isinstance(v, dict) else None

    wanted = [ident(o) for o in order]
    rank = {w: i for i, w in enumerate(wanted) if w is not None}
    ordered = sorted((v for v in items if ident(v) in rank), key=lambda v: rank[ident(v)])
    rest = [v for v in items if ident(v) not in rank]
    return ordered + rest
