"""`gpu-dra events`: list the catalog's subjects or export its JSON Schemas."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.events.catalog import CATALOG
from shared.events.schema import write_schemas


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu-dra events", description="the event catalog")
    sub = parser.add_subparsers(dest="action", required=True)
    schema = sub.add_parser("schema", help="write one JSON Schema per message type and index.json")
    schema.add_argument("--out", type=Path, default=Path("schemas"), help="output directory")
    sub.add_parser("list", help="print subjects and message types")
    args = parser.parse_args(argv)
    if args.action == "schema":
        index = write_schemas(args.out)
        print(f"wrote {len(index['subjects'])} subjects' schemas to {args.out}")
    else:
        for entry in CATALOG:
            print(f"{entry.subject:<44} {entry.pattern:<8} {entry.message.__name__}")
    return 0
