"""JSON Schema export of the event catalog: one schema per message type plus a subject index, and the
schemas of the files this driver hands workloads (`FILES`: the device metadata file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from shared.events import devicemetadata
from shared.events.catalog import BUCKETS, CATALOG, STREAMS

DIALECT = "https://json-schema.org/draft/2020-12/schema"
# files (not bus messages) whose format is part of the contract: name -> (type, where it is found)
FILES: dict[str, tuple[type[msgspec.Struct], str]] = {
    "device-metadata": (
        devicemetadata.DeviceMetadata,
        devicemetadata.container_path("<driver>", "<request>", claim_name="<claim>"),
    ),
}


def message_schema(message: type[msgspec.Struct]) -> dict[str, Any]:
    """A draft 2020-12 schema for one message type (definitions under `$defs`)."""
    (schema,), components = msgspec.json.schema_components([message], ref_template="#/$defs/{name}")
    out: dict[str, Any] = {"$schema": DIALECT, "$id": f"{message.__name__}.json", **components[message.__name__]}
    out["$defs"] = {k: v for k, v in components.items() if k != message.__name__}
    if not out["$defs"]:
        del out["$defs"]
    del schema
    return out


def write_schemas(out_dir: Path) -> dict[str, Any]:
    """Write `<Message>.json` for every catalog type and `index.json` mapping subjects to them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"$schema": DIALECT, "subjects": [], "streams": [], "buckets": []}
    written: set[str] = set()
    for entry in CATALOG:
        types = [entry.message] + ([entry.reply] if entry.reply else [])
        for tp in types:
            if tp.__name__ not in written:
                (out_dir / f"{tp.__name__}.json").write_text(json.dumps(message_schema(tp), indent=2) + "\n")
                written.add(tp.__name__)
        index["subjects"].append(
            {
                "name": entry.name,
                "subject": entry.subject,
                "subscribe": entry.wildcard(),
                "pattern": entry.pattern,
                "summary": entry.summary,
                "schema": f"{entry.message.__name__}.json",
                **({"reply_schema": f"{entry.reply.__name__}.json"} if entry.reply else {}),
                # identity: which body field must name what each subject token names (see docs/security.md)
                **({"binds": dict(entry.binds)} if entry.binds else {}),
            }
        )
    index["streams"] = [{"name": s.name, "subjects": list(s.subjects), "max_age_s": s.max_age_s} for s in STREAMS]
    index["buckets"] = [
        {
            "name": b.name,
            "schema": f"{b.message.__name__}.json",
            **({"key": b.key, "binds": dict(b.binds)} if b.binds else {}),
        }
        for b in BUCKETS
    ]
    index["files"] = []
    for name, (file_type, path) in FILES.items():
        (out_dir / f"{file_type.__name__}.json").write_text(json.dumps(message_schema(file_type), indent=2) + "\n")
        index["files"].append({"name": name, "path": path, "schema": f"{file_type.__name__}.json"})
    (out_dir / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index
