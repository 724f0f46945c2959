"""Resolve CDI device ids against the CDI spec files on a node, as a container runtime would.

Owns the lookup of fully-qualified ids (`vendor/class=device`) in `*.json`/`*.yaml` specs and the
merge of spec-level and device-level container edits into what one container gets: environment,
device nodes, mounts and hooks. An unknown id is an error naming the specs that were searched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import yaml


class CdiResolutionError(LookupError):
    """A CDI id did not resolve: no spec of that kind, or no device of that name."""


class ContainerEdits(msgspec.Struct, kw_only=True):
    """What the runtime would add to one container."""

    env: list[str] = msgspec.field(default_factory=list)
    device_nodes: list[str] = msgspec.field(default_factory=list)
    mounts: list[str] = msgspec.field(default_factory=list)  # "host:container"
    hooks: list[str] = msgspec.field(default_factory=list)
    cdi_devices: list[str] = msgspec.field(default_factory=list)


# path -> ((inode, mtime ns, size), the spec as read then): what `load_specs` need not read again
SpecCache = dict[str, tuple[tuple[int, int, int], dict[str, Any]]]


def load_specs(cdi_dirs: list[Path], cache: SpecCache | None = None) -> dict[str, list[dict[str, Any]]]:
    """kind -> specs, from every spec file in the given directories (later directories win ties). With a `cache`
    (kept by the caller across calls), a file whose inode, mtime and size are unchanged is not read again: a
    claim's spec has a name of its own and is written once, before its claim is prepared."""
    specs: dict[str, list[dict[str, Any]]] = {}
    seen: SpecCache = {}
    for directory in cdi_dirs:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            suffix = os.path.splitext(entry.name)[1]
            if suffix not in (".json", ".yaml", ".yml"):
                continue
            path = str(directory / entry.name)
            try:
                st = entry.stat()
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
                known = cache.get(path) if cache is not None else None
                if known is not None and known[0] == key:
                    spec = known[1]
                else:
                    text = Path(path).read_text()
                    spec = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
            except (OSError, ValueError, yaml.YAMLError):
                continue  # a runtime skips unreadable specs; the preparer writes them atomically
            if isinstance(spec, dict) and isinstance(spec.get("kind"), str):
                spec["_path"] = path
                specs.setdefault(spec["kind"], []).append(spec)
                seen[path] = (key, spec)
    if cache is not None:
        cache.clear()
        cache.update(seen)  # files gone are forgotten
    return specs


def _apply(edits: ContainerEdits, raw: dict[str, Any] | None) -> None:
    if not raw:
        return
    for entry in raw.get("env") or []:
        name = entry.split("=", 1)[0]
        edits.env = [e for e in edits.env if e.split("=", 1)[0] != name] + [entry]
    for node in raw.get("deviceNodes") or []:
        path = node.get("path", "")
        if path and path not in edits.device_nodes:
            edits.device_nodes.append(path)
    for mount in raw.get("mounts") or []:
        item = f"{mount.get('hostPath', '')}:{mount.get('containerPath', '')}"
        if item not in edits.mounts:
            edits.mounts.append(item)
    for hook in raw.get("hooks") or []:
        edits.hooks.append(f"{hook.get('hookName', '')}:{hook.get('path', '')}")


def resolve(cdi_ids: list[str], specs: dict[str, list[dict[str, Any]]]) -> ContainerEdits:
    """Merge the edits of every id, applying each spec's own edits once."""
    edits = ContainerEdits()
    applied_specs: set[str] = set()
    for cdi_id in cdi_ids:
        kind, sep, device_name = cdi_id.partition("=")
        if not sep or "/" not in kind:
            raise CdiResolutionError(f"malformed CDI id {cdi_id!r}: expected vendor/class=device")
        candidates = specs.get(kind, [])
        for spec in candidates:
            device = next((d for d in spec.get("devices") or [] if d.get("name") == device_name), None)
            if device is None:
                continue
            if spec["_path"] not in applied_specs:
                _apply(edits, spec.get("containerEdits"))
                applied_specs.add(spec["_path"])
            _apply(edits, device.get("containerEdits"))
            edits.cdi_devices.append(cdi_id)
            break
        else:
            searched = ", ".join(s["_path"] for s in candidates) or "no spec of that kind"
            raise CdiResolutionError(f"CDI device {cdi_id!r} not found (searched: {searched})")
    return edits
