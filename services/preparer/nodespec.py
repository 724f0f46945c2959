"""`gpu-dra cdi generate`: the node's CDI spec, to check a node against NVIDIA's `nvidia-ctk cdi generate`.

Owns the command: settings (flags, else the preparer's `GPU_DRA_DRIVER_ROOT`, `GPU_DRA_CONTAINER_DRIVER_ROOT`,
`GPU_DRA_DEV_ROOT`, `GPU_DRA_CDI_HOOK_PATH`, so it runs as-is in the preparer's container), and the spec of
kind `k8s.gpu.nvidia.com/device`: the common edits every claim spec gets (`commonedits`, the same code
the preparer uses) plus one device per GPU by index and by UUID, one per MIG device by
`<gpu index>:<mig index>` and by UUID (the names nvidia-ctk uses; the MIG index is the device's position
in NVML's handle order) and `all`. GPUs come from discovery's NVML layer (`discovery.nvml` +
`discovery.inventory`): real NVML from the driver root, or `--simulate SPEC` / `--machine FILE` for
tests. Output is stable: keys sorted, devices by name. Exit codes: 0 ok, 1 failed, 2 bad settings or
an unusable driver root (no libnvidia-ml.so.1, mixed versions, NVML reporting another version),
3 NVML unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from services.discovery import inventory
from services.discovery.config import DiscoveryConfig
from services.discovery.machine import MachineError
from services.discovery.nvml import NodeFacts, NvmlUnavailable
from services.discovery.service import open_nvml
from services.preparer.gpu.commonedits import DEFAULT_CDI_HOOK, build_driver_files, control_nodes, edits_of
from services.preparer.host.cdi import CdiDevice, DeviceNode, build_node_spec, gpu_device_nodes
from services.preparer.host.checkpoint import atomic_write
from shared.driverroot import DriverRoot, DriverRootError
from shared.events.inventory import NodeInventory
from shared.logs import setup_logging

PROG = "gpu-dra cdi generate"


class _Exit(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Print this node's CDI spec (kind k8s.gpu.nvidia.com/device): the driver userspace every GPU claim "
            "gets plus one device per GPU and MIG device. Compare it with `nvidia-ctk cdi generate`."
        ),
    )
    p.add_argument(
        "--driver-root",
        default=env("GPU_DRA_DRIVER_ROOT") or "/",
        help="host path of the driver root (env GPU_DRA_DRIVER_ROOT; default /)",
    )
    p.add_argument(
        "--container-driver-root",
        default=env("GPU_DRA_CONTAINER_DRIVER_ROOT", ""),
        help="where this process sees the driver root (env GPU_DRA_CONTAINER_DRIVER_ROOT)",
    )
    p.add_argument(
        "--dev-root",
        default=env("GPU_DRA_DEV_ROOT", ""),
        help="host root of /dev (env GPU_DRA_DEV_ROOT; default: the driver root)",
    )
    p.add_argument(
        "--cdi-hook-path",
        default=env("GPU_DRA_CDI_HOOK_PATH") or DEFAULT_CDI_HOOK,
        help=f"host path of nvidia-cdi-hook (env GPU_DRA_CDI_HOOK_PATH; default {DEFAULT_CDI_HOOK})",
    )
    p.add_argument("--simulate", default="", help="GPUs from the simulated NVML, e.g. h100x2 (tests)")
    p.add_argument("--machine", default="", help="GPUs from a simulated machine file (tests)")
    p.add_argument("--output", default="", help="write the spec to this file (default: stdout)")
    p.add_argument(
        "--format",
        choices=("json", "yaml"),
        default="",
        help="output format (default: from the --output suffix, else json)",
    )
    return p


async def _read_gpus(ns: argparse.Namespace, root: DriverRoot, workdir: Path) -> tuple[NodeFacts, NodeInventory]:
    """NVML facts and the inventory built from them (device names, MIG capability nodes)."""
    simulated = bool(ns.simulate or ns.machine)
    cfg = DiscoveryConfig(
        node="cdi-generate",
        simulate=ns.simulate,
        machine=ns.machine,
        driver_root="" if simulated else ns.driver_root,
        container_driver_root="" if simulated else ns.container_driver_root,
        dev_root=str(workdir) if simulated else "/",
    ).resolved()
    nvml = open_nvml(cfg)
    await nvml.start()
    try:
        facts = await nvml.call(nvml.read)
    finally:
        await nvml.close()
    dev = Path(root.dev_local("/"))
    return facts, inventory.build(cfg.node, facts, dev_root=dev, sys_root=dev, simulated=simulated)


def devices_of(facts: NodeFacts, inv: NodeInventory, root: DriverRoot) -> list[CdiDevice]:
    """One device per GPU (index, UUID) and MIG device (`<gpu>:<mig>`, UUID), and `all`; sorted by name."""
    mig_order = {m.uuid: j for g in facts.gpus for j, m in enumerate(g.mig)}
    devices: list[CdiDevice] = []
    everything: dict[str, DeviceNode] = {}
    for gpu in sorted(inv.gpus, key=lambda g: g.index):
        nodes = gpu_device_nodes(gpu.minor, root.dev_host)
        devices += [CdiDevice(str(gpu.index), nodes), CdiDevice(gpu.uuid, nodes)]
        everything.update((n.path, n) for n in nodes)
        for mig in gpu.mig_devices:
            nodes = gpu_device_nodes(gpu.minor, root.dev_host, mig.device_path_caps)
            devices += [CdiDevice(f"{gpu.index}:{mig_order.get(mig.uuid, 0)}", nodes), CdiDevice(mig.uuid, nodes)]
            everything.update((n.path, n) for n in nodes)
    if everything:
        devices.append(CdiDevice("all", list(everything.values())))
    return sorted(devices, key=lambda d: d.device)


async def generate(ns: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The node spec and the warnings to show."""
    for flag in ("driver_root", "container_driver_root", "dev_root", "cdi_hook_path"):
        value = getattr(ns, flag)
        if value and not os.path.isabs(value):
            raise _Exit(2, f"--{flag.replace('_', '-')} must be an absolute path, got {value!r}")
    if ns.simulate and ns.machine:
        raise _Exit(2, "give either --simulate SPEC or --machine FILE, not both")
    root = DriverRoot.of(ns.driver_root, ns.container_driver_root, ns.dev_root)
    try:
        files = await asyncio.to_thread(build_driver_files, root, ns.cdi_hook_path)
    except DriverRootError as exc:
        raise _Exit(2, str(exc)) from None
    nodes = await asyncio.to_thread(control_nodes, root)
    with tempfile.TemporaryDirectory(prefix="gpu-dra-cdi-") as workdir:
        try:
            facts, inv = await _read_gpus(ns, root, Path(workdir))
        except MachineError as exc:
            raise _Exit(2, str(exc)) from None
        except NvmlUnavailable as exc:
            raise _Exit(3, str(exc)) from None
    if facts.driver_version != files.version:
        raise _Exit(
            2,
            f"NVML reports driver {facts.driver_version} but driver root {root.local('/')} holds "
            f"{files.version}: point --driver-root at the driver the kernel runs (or reboot after "
            "an upgrade)",
        )
    devices = devices_of(facts, inv, root)
    if not devices:
        raise _Exit(1, "NVML reports no GPUs on this node; nothing to generate")
    return build_node_spec(devices, edits_of(files, nodes)), list(files.warnings)


def render(spec: dict[str, Any], fmt: str) -> str:
    if fmt == "yaml":
        return str(yaml.safe_dump(spec, sort_keys=True, default_flow_style=False))
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: gpu-dra cdi generate [options] (see '{PROG} --help')"
    if args[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not args or args[0] != "generate":
        print(usage, file=sys.stderr)
        return 2
    try:
        ns = _parser().parse_args(args[1:])
    except SystemExit as exc:  # argparse printed why
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    setup_logging("cdi-generate", "warning")
    fmt = ns.format or ("yaml" if ns.output.endswith((".yaml", ".yml")) else "json")
    try:
        spec, warnings = asyncio.run(generate(ns))
    except _Exit as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    for warning in warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    text = render(spec, fmt)
    if not ns.output or ns.output == "-":
        sys.stdout.write(text)
        return 0
    try:
        atomic_write(Path(ns.output), text.encode())
    except OSError as exc:
        print(f"{PROG}: error: cannot write {ns.output}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
