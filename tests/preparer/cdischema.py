"""The CDI spec's JSON schema (a copy in tests/fixtures/cdi-schema) and the Go loader's extra rules (CDI SPEC §6.2)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "cdi-schema"
_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
HOOK_NAMES = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
KNOWN_VERSIONS = {"0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"}


def cdi_validator() -> Any:
    """A Draft 7 validator of the CDI spec schema."""
    from jsonschema import Draft7Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return Draft7Validator(schema, registry=registry)


def spec_errors(spec: dict[str, Any]) -> list[str]:
    """Schema and loader errors of a spec ([] when a CDI runtime would load it)."""
    return [e.message for e in cdi_validator().iter_errors(spec)] + loader_errors(spec)


def loader_errors(spec: dict[str, Any]) -> list[str]:
    """What the Go CDI loader checks beyond the schema (6.2)."""
    errors = []
    if spec.get("cdiVersion") not in KNOWN_VERSIONS:
        errors.append(f"cdiVersion {spec.get('cdiVersion')}")
    vendor, _, cls = spec.get("kind", "").partition("/")
    if not (_VENDOR_OR_CLASS.match(vendor) and _VENDOR_OR_CLASS.match(cls)):
        errors.append(f"kind {spec.get('kind')}")
    names = [d["name"] for d in spec.get("devices", [])]
    if not names or len(names) != len(set(names)):
        errors.append("device names missing or duplicated")
    edits_list = [spec.get("containerEdits", {})] + [d.get("containerEdits") for d in spec.get("devices", [])]
    for name in names:
        if not _DEVICE.match(name):
            errors.append(f"device name {name}")
    for dev in spec.get("devices", []):
        if not dev.get("containerEdits"):
            errors.append(f"device {dev['name']} has empty edits")
    for edits in edits_list:
        for env in (edits or {}).get("env", []):
            if env.find("=") <= 0:
                errors.append(f"env {env}")
        for node in (edits or {}).get("deviceNodes", []):
            if not node.get("path") or node.get("type", "") not in ("", "b", "c", "u", "p"):
                errors.append(f"deviceNode {node}")
        for mount in (edits or {}).get("mounts", []):
            if not mount.get("hostPath") or not mount.get("containerPath"):
                errors.append(f"mount {mount}")
        for hook in (edits or {}).get("hooks", []):
            if hook.get("hookName") not in HOOK_NAMES or not hook.get("path"):
                errors.append(f"hook {hook}")
    return errors
