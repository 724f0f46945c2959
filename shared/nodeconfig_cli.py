"""`gpu-dra nodeconfig explain NODE --config FILE --inventory FILE [--labels k=v,...]`: the effective
sharing setting of each of the node's GPUs and the rule that decided it.

The inventory is what `gpu-dra discovery --once --output json` prints for the node (a NodeInventory).
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from shared import nodeconfig
from shared.events.inventory import NodeInventory


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-dra nodeconfig", description="NodeConfig tools")
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="the effective setting per GPU of one node, and the deciding rule")
    explain.add_argument("node", help="the node's name")
    explain.add_argument("--config", required=True, help="a NodeConfig YAML file")
    explain.add_argument(
        "--inventory",
        required=True,
        help="the node's inventory JSON, as 'gpu-dra discovery --once --output json' prints it",
    )
    explain.add_argument("--labels", default="", help="the node's labels, k=v,k2=v2")
    return parser


def explain_lines(config: nodeconfig.NodeConfig, node: str, labels: dict[str, str], inv: NodeInventory) -> list[str]:
    """One line per GPU: name, product, effective setting, deciding rule."""
    lines = [f"node {node}: {len(inv.gpus)} GPU(s), {len(config.spec.rules)} rule(s)"]
    for gpu in inv.gpus:
        s = nodeconfig.setting_for(config, labels, gpu)
        detail = [f"sharing={s.sharing}"]
        if s.offers_shares:
            detail.append(f"memoryStep={s.memory_step // nodeconfig.MIB}Mi memoryDefault={s.memory_default}")
            if s.sharing == "mpsShares":
                detail.append(f"computeStep={s.compute_step}%")
            if s.max_shares:
                detail.append(f"maxShares={s.max_shares}")
        if s.sharing == "timeSlicing":
            detail.append(f"timeSliceInterval={s.time_slice_interval}")
        detail.append(f"mig={s.mig or '(publisher default)'}")
        detail.append(f"healthTaintEffect={s.health_taint_effect or '(publisher default)'}")
        decided = f"rule {s.rule!r}" if s.rule else "no rule matched (default)"
        lines.append(f"  {gpu.name} ({gpu.product_name}): {' '.join(detail)}  <- {decided}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = nodeconfig.load(args.config)
        labels = nodeconfig.parse_labels(args.labels)
        with open(args.inventory, "rb") as f:
            inv = msgspec.json.decode(f.read(), type=NodeInventory)
    except (nodeconfig.NodeConfigError, OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        print(f"gpu-dra nodeconfig: {exc}", file=sys.stderr)
        return 2
    if inv.node and inv.node != args.node:
        print(f"gpu-dra nodeconfig: the inventory is node {inv.node!r}, not {args.node!r}", file=sys.stderr)
        return 2
    print("\n".join(explain_lines(config, args.node, labels, inv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
