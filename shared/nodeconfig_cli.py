"""`gpu-dra nodeconfig explain NODE`: the effective sharing setting of each of the node's GPUs and the rule that
decided it.

Live, from the cluster: the NodeConfig objects and the Node's labels from the API server (`--kubeconfig`), the
node's GPUs from discovery's inventory in NATS KV (`--nats-url`/`--creds`, the environment `gpu-dra up` prints,
or a local cluster's `--data-dir`). Offline: `--config FILE` (a NodeConfig YAML) and `--inventory FILE` (what
`gpu-dra discovery --once --output json` prints), with `--labels`. Each source may be given on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import msgspec

from shared import nodeconfig
from shared.events import catalog
from shared.events.inventory import NodeInventory
from shared.kube.client import KubeConfigError, kube_api_client
from shared.kube.resources import NODES, Kube
from shared.kube.rest import ApiError
from shared.natsconn import BusError
from shared.natstarget import TargetError, add_target_flags, connect, resolve_target
from shared.nodeconfig_objects import NODECONFIGS


class ExplainError(ValueError):
    """What could not be read, and where from; the message says it."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-dra nodeconfig", description="NodeConfig tools")
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="the effective setting per GPU of one node, and the deciding rule")
    explain.add_argument("node", help="the node's name")
    explain.add_argument("--config", default="", help="a NodeConfig YAML file (default: the cluster's objects)")
    explain.add_argument(
        "--inventory",
        default="",
        help="the node's inventory JSON, as 'gpu-dra discovery --once --output json' prints it (default: "
        "discovery's, from NATS)",
    )
    explain.add_argument(
        "--labels", default=None, help="the node's labels, k=v,k2=v2 (default: the Node's; none with --config)"
    )
    explain.add_argument("--kubeconfig", default="", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    add_target_flags(explain)  # --nats-url/--creds/--user/--data-dir; else the env or the running local cluster
    return parser


def explain_lines(config: nodeconfig.NodeConfig, node: str, labels: dict[str, str], inv: NodeInventory) -> list[str]:
    """One line per GPU: name, product, effective setting, deciding rule."""
    lines = [f"node {node}: {len(inv.gpus)} GPU(s), {len(config.spec.rules)} rule(s)"]
    for gpu in inv.gpus:
        s = nodeconfig.setting_for(config, labels, gpu)
        detail = [f"sharing={s.sharing}"]
        if s.offers_shares:
            if s.memory_sizes:
                detail.append("memorySizes=" + ",".join(f"{size // nodeconfig.MIB}Mi" for size in s.memory_sizes))
            else:
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


async def _from_cluster(args: argparse.Namespace) -> tuple[nodeconfig.NodeConfig, dict[str, str], list[str]]:
    """The merged config of the cluster's NodeConfig objects, the Node's labels, and a line per refused object."""
    notes: list[str] = []
    async with await kube_api_client(args.kubeconfig) as api:
        kube = Kube(api)
        objects, _ = await kube.list(NODECONFIGS)
        accepted: dict[str, nodeconfig.NodeConfig] = {}
        for obj in objects:
            name = (obj.get("metadata") or {}).get("name", "")
            try:
                accepted[name] = nodeconfig.from_obj(obj)
            except nodeconfig.NodeConfigError as exc:
                notes.append(f"NodeConfig {name} is refused ({exc}); the publisher keeps its last accepted rules")
        try:
            node = await kube.get(NODES, None, args.node)
        except ApiError as exc:
            if exc.not_found:
                raise ExplainError(f"the cluster has no Node {args.node!r}") from None
            raise
    labels = dict((node.get("metadata") or {}).get("labels") or {})
    return nodeconfig.merge(accepted), labels, notes


async def _inventory(args: argparse.Namespace) -> NodeInventory:
    try:
        target = resolve_target(args, dict(os.environ))
    except TargetError as exc:
        raise ExplainError(f"{exc} (or give --inventory FILE)") from None
    bus = await connect(target, f"nodeconfig-explain-{args.node}")
    try:
        inv = await (await bus.kv(catalog.INVENTORY_BUCKET)).get(args.node)
    finally:
        await bus.close()
    if not isinstance(inv, NodeInventory):
        raise ExplainError(f"discovery has published no inventory for node {args.node!r} (is it running there?)")
    return inv


async def _explain(
    args: argparse.Namespace, config: nodeconfig.NodeConfig | None, inv: NodeInventory | None
) -> list[str]:
    """`config` and `inv` as the files gave them; what they leave out comes from the cluster."""
    notes: list[str] = []
    labels = nodeconfig.parse_labels(args.labels or "")
    if config is None:
        config, node_labels, notes = await _from_cluster(args)
        labels = node_labels if args.labels is None else labels
    if inv is None:
        inv = await _inventory(args)
    if inv.node and inv.node != args.node:
        raise ExplainError(f"the inventory is node {inv.node!r}, not {args.node!r}")
    return [*explain_lines(config, args.node, labels, inv), *notes]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = nodeconfig.load(args.config) if args.config else None
        inv = None
        if args.inventory:
            with open(args.inventory, "rb") as f:
                inv = msgspec.json.decode(f.read(), type=NodeInventory)
        lines = asyncio.run(_explain(args, config, inv))
    except (
        ExplainError,
        ApiError,
        KubeConfigError,
        nodeconfig.NodeConfigError,
        OSError,
        BusError,
        msgspec.ValidationError,
        msgspec.DecodeError,
    ) as exc:
        print(f"gpu-dra nodeconfig: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
