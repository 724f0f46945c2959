"""`gpu-dra features`: every feature gate with its stage, default and state under the given setting.

gpu-dra features                               # defaults (and GPU_DRA_FEATURE_GATES if set)
gpu-dra features --feature-gates DynamicMIG=false -o json
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from shared import featuregates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-dra features", description="list the feature gates")
    parser.add_argument(
        "--feature-gates",
        default=None,
        help="Name=true|false,... to show in force (default: env GPU_DRA_FEATURE_GATES)",
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    text = args.feature_gates if args.feature_gates is not None else os.environ.get("GPU_DRA_FEATURE_GATES", "")
    try:
        gates = featuregates.parse(text)
    except featuregates.FeatureGateError as exc:
        print(f"gpu-dra features: error: {exc}", file=sys.stderr)
        return 2
    rows = [
        {
            "name": g.name,
            "stage": g.stage,
            "default": g.default,
            "enabled": gates.enabled(g.name),
            "requires": list(g.requires),
            "conflicts": list(g.conflicts),
            "description": g.description,
        }
        for g in sorted(gates.registry.values(), key=lambda g: g.name)
    ]
    if args.output == "json":
        print(msgspec.json.format(msgspec.json.encode(rows)).decode())
        return 0
    width = max(len(r["name"]) for r in rows)  # type: ignore[arg-type]
    print(f"{'NAME':<{width}}  STAGE  DEFAULT  ENABLED  DESCRIPTION")
    for r in rows:
        needs = f" (requires {', '.join(r['requires'])})" if r["requires"] else ""  # type: ignore[arg-type]
        print(
            f"{r['name']:<{width}}  {r['stage']:<5}  {str(r['default']).lower():<7}  "
            f"{str(r['enabled']).lower():<7}  {r['description']}{needs}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
