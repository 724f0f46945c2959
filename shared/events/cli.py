"""`gpu-dra events`: list the catalog's subjects, export its JSON Schemas or AsyncAPI document, tail events."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.events import tail
from shared.events.asyncapi import document
from shared.events.catalog import CATALOG
from shared.events.schema import write_schemas
from shared.natstarget import TargetError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu-dra events", description="the event catalog")
    sub = parser.add_subparsers(dest="action", required=True)
    schema = sub.add_parser("schema", help="write one JSON Schema per message type and index.json")
    schema.add_argument("--out", type=Path, default=Path("schemas"), help="output directory")
    sub.add_parser("list", help="print subjects and message types")
    asyncapi = sub.add_parser("asyncapi", help="write the AsyncAPI 3.0 document of every channel and message")
    asyncapi.add_argument("--out", type=Path, help="output file (default: standard output)")
    tail.add_parser(sub)
    args = parser.parse_args(argv)
    if args.action == "tail":
        try:
            return tail.run(args, sys.stdout)
        except (tail.TailError, TargetError) as exc:
            print(f"gpu-dra events tail: {exc}", file=sys.stderr)
            return 2
    if args.action == "asyncapi":
        text = json.dumps(document(), indent=2) + "\n"
        if args.out:
            args.out.write_text(text)
            print(f"wrote the AsyncAPI document to {args.out}")
        else:
            sys.stdout.write(text)
    elif args.action == "schema":
        index = write_schemas(args.out)
        print(f"wrote {len(index['subjects'])} subjects' schemas to {args.out}")
    else:
        for entry in CATALOG:
            print(f"{entry.subject:<44} {entry.pattern:<8} {entry.message.__name__}")
    return 0
