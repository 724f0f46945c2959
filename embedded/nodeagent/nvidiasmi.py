"""The `nvidia-smi` a sandboxed container finds at /usr/bin/nvidia-smi: answers from the node's simulated NVML state for
exactly the devices its CDI edits made visible.

Owns the visibility rule (a GPU is visible when its `/dev/nvidia<minor>` node was given; a MIG device when its
CI access cap `/dev/nvidia-caps/nvidia-cap<N>` was too, else every MIG device of a visible GPU) and the output of
`-L`, the default table, `--query-gpu=...` (csv, noheader, nounits) and `-q`'s sharing lines (compute mode,
time-slice interval, MPS daemon). Reads the state file named by GPU_DRA_SIM_STATE and the device nodes listed in
GPU_DRA_DEVICE_NODES (the kubelet emulator sets both).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.discovery import devtree, profiles

STATE_ENV = "GPU_DRA_SIM_STATE"
NODES_ENV = "GPU_DRA_DEVICE_NODES"
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
TIMESLICES = {0: "Default", 1: "Short", 2: "Medium", 3: "Long"}


@dataclass
class Mig:
    uuid: str
    profile: str
    gi: int
    ci: int
    memory_mib: int


@dataclass
class Visible:
    index: int
    gpu: dict[str, Any]
    product: str
    memory_mib: int
    migs: list[Mig] = field(default_factory=list)


def visible_devices(state: dict[str, Any], device_nodes: list[str]) -> list[Visible]:
    """The GPUs (and MIG devices) the given device node paths expose, numbered from 0 as inside a container."""
    names = {Path(n).name for n in device_nodes}
    out: list[Visible] = []
    for gpu in sorted(state.get("gpus") or [], key=lambda g: g["minor"]):
        if f"nvidia{gpu['minor']}" not in names:
            continue
        prof = profiles.lookup(gpu["profile"])
        specs = {m.profile_index: m for m in prof.mig}
        all_migs: list[Mig] = []
        for gi in gpu.get("gis") or []:
            spec = specs.get(gi["profile_index"])
            for ci in gi.get("cis") or []:
                all_migs.append(
                    Mig(ci["uuid"], spec.name if spec else "?", gi["id"], ci["id"], spec.memory_mib if spec else 0)
                )
        chosen = [m for m in all_migs if f"nvidia-cap{devtree.mig_cap_minors(gpu['minor'], m.gi, m.ci)[1]}" in names]
        out.append(
            Visible(
                len(out),
                gpu,
                prof.product_name,
                prof.memory_bytes >> 20,
                chosen or (all_migs if gpu.get("mig_enabled") else []),
            )
        )
    return out


def visible_uuids(devices: list[Visible]) -> list[str]:
    """What CUDA_VISIBLE_DEVICES names: the MIG devices where a GPU has them, else the GPU."""
    return [u for d in devices for u in ([m.uuid for m in d.migs] or [d.gpu["uuid"]])]


def _mps_of(state: dict[str, Any], uuid: str) -> dict[str, Any] | None:
    return next((m for m in (state.get("mps") or {}).values() if uuid in m.get("gpu_uuids", [])), None)


def list_lines(devices: list[Visible]) -> list[str]:
    lines = []
    for d in devices:
        lines.append(f"GPU {d.index}: {d.product} (UUID: {d.gpu['uuid']})")
        lines += [f"  MIG {m.profile:<12} Device {i:>2}: (UUID: {m.uuid})" for i, m in enumerate(d.migs)]
    return lines


def sharing_lines(state: dict[str, Any], d: Visible) -> list[str]:
    gpu = d.gpu
    out = [
        f"    Compute Mode                          : {COMPUTE_MODES.get(gpu.get('compute_mode', 0), '?')}",
        f"    Time Slice Interval                   : {TIMESLICES.get(gpu.get('timeslice', 0), '?')}",
    ]
    mps = _mps_of(state, gpu["uuid"])
    if mps is not None:
        pct = mps.get("active_thread_percentage")
        limits = ",".join(f"{k}={v}" for k, v in sorted((mps.get("pinned_device_memory_limits") or {}).items()))
        out.append(
            f"    MPS Server                            : Running (daemon {mps['daemon_id']}, "
            f"active thread percentage {pct if pct is not None else 'default'}"
            f"{', pinned memory limits ' + limits if limits else ''})"
        )
    else:
        out.append("    MPS Server                            : Not Running")
    return out


def table(state: dict[str, Any], devices: list[Visible]) -> list[str]:
    cuda = int(state.get("cuda_version") or 0)
    bar = "+-----------------------------------------+------------------------+----------------------+"
    lines = [
        bar,
        f"| NVIDIA-SMI (gpu-dra simulated)   Driver Version: {state.get('driver_version', '?'):<14} "
        f"CUDA Version: {cuda // 1000}.{cuda % 1000 // 10:<6}|",
        bar,
        "| GPU  Name                               | Bus-Id         Disp.A  | Compute M.  MIG M.   |",
        bar,
    ]
    for d in devices:
        mode = COMPUTE_MODES.get(d.gpu.get("compute_mode", 0), "?")
        mig = "Enabled" if d.gpu.get("mig_enabled") else "Disabled"
        lines.append(
            f"| {d.index:>3}  {d.product[:34]:<34} | {d.gpu['bus_id'][:16]:<16} Off  | {mode[:11]:<11} {mig:<8} |"
        )
        lines.append(f"|      {'0MiB / ' + str(d.memory_mib) + 'MiB':<34} | {'':<22} | {'':<20} |")
    lines.append(bar)
    migs = [(d, m) for d in devices for m in d.migs]
    if migs:
        lines += ["| MIG devices:  GPU  GI  CI  MIG Dev  Profile    Memory-Usage            UUID", bar]
        lines += [
            f"|               {d.index:>3} {m.gi:>3} {m.ci:>3} {i:>8}  {m.profile:<10} 0MiB / {m.memory_mib}MiB"
            f"  {m.uuid}"
            for d in devices
            for i, m in enumerate(d.migs)
        ]
        lines.append(bar)
    for d in devices:
        lines.append(f"GPU {d.index} sharing:")
        lines += sharing_lines(state, d)
    return lines


def _query_value(state: dict[str, Any], d: Visible, name: str, units: bool, count: int) -> str:
    gpu = d.gpu

    def mib(v: int) -> str:
        return f"{v} MiB" if units else str(v)

    values = {
        "name": d.product,
        "gpu_name": d.product,
        "uuid": gpu["uuid"],
        "gpu_uuid": gpu["uuid"],
        "index": str(d.index),
        "count": str(count),
        "pci.bus_id": gpu["bus_id"],
        "memory.total": mib(d.memory_mib),
        "memory.used": mib(0),
        "memory.free": mib(d.memory_mib),
        "compute_mode": COMPUTE_MODES.get(gpu.get("compute_mode", 0), "?"),
        "mig.mode.current": "Enabled" if gpu.get("mig_enabled") else "Disabled",
        "driver_version": str(state.get("driver_version", "")),
        "minor_number": str(gpu["minor"]),
        "serial": gpu["uuid"][-12:],
    }
    if name not in values:
        raise KeyError(name)
    return str(values[name])


def query(state: dict[str, Any], devices: list[Visible], fields: list[str], fmt: set[str]) -> list[str]:
    units = "nounits" not in fmt
    lines = []
    if "noheader" not in fmt:
        lines.append(", ".join(f"{f} [MiB]" if f.startswith("memory.") and units else f for f in fields))
    for d in devices:
        lines.append(", ".join(_query_value(state, d, f.strip(), units, len(devices)) for f in fields))
    return lines


def run(argv: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    path = env.get(STATE_ENV, "")
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 9, [
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            f"(gpu-dra: no simulated NVML state at {path or '$' + STATE_ENV})"
        ]
    devices = visible_devices(state, [n for n in env.get(NODES_ENV, "").split(":") if n])
    if not devices:
        return 6, ["No devices were found"]
    fields: list[str] = []
    fmt: set[str] = set()
    for arg in argv:
        if arg.startswith("--query-gpu="):
            fields = [f for f in arg.split("=", 1)[1].split(",") if f]
        elif arg.startswith("--format="):
            fmt = {f.strip() for f in arg.split("=", 1)[1].split(",")}
    if "-L" in argv or "--list-gpus" in argv:
        return 0, list_lines(devices)
    if fields:
        try:
            return 0, query(state, devices, fields, fmt)
        except KeyError as exc:
            return 2, [f'Field "{exc.args[0]}" is not a valid field to query.']
    if "-q" in argv:
        out = []
        for d in devices:
            out += [
                f"GPU {d.gpu['bus_id']}",
                f"    Product Name                          : {d.product}",
                f"    GPU UUID                              : {d.gpu['uuid']}",
                *sharing_lines(state, d),
            ]
        return 0, out
    return 0, table(state, devices)


def main() -> None:
    code, lines = run(sys.argv[1:], dict(os.environ))
    print("\n".join(lines), file=sys.stdout if code == 0 else sys.stderr)
    sys.exit(code)


# Inside a sandbox the shim runs from fixed paths, whatever the checkout's: its interpreter, this repo and the
# site-packages are mounted read-only under /run/gpu-dra (the host's /tmp, where a checkout or venv may live, is
# the sandbox's own private /tmp there).
PYTHON_MOUNT = "/run/gpu-dra/python"  # the interpreter's installation (sys.base_prefix)
CODE_MOUNT = "/run/gpu-dra/code"  # this repo
SITE_MOUNT = "/run/gpu-dra/site"  # <SITE_MOUNT>/<n>: the n-th site-packages dir of this interpreter


@dataclass(frozen=True)
class Launcher:
    """How the shim runs inside a sandbox: `interpreter` and `path` (sys.path) are sandbox paths, `mounts` the
    read-only host:sandbox binds that make them exist."""

    interpreter: str
    path: tuple[str, ...]
    mounts: tuple[tuple[str, str], ...]

    def script(self) -> str:
        return (
            f"#!{self.interpreter} -S\nimport sys\nsys.path[:0] = {list(self.path)!r}\n"
            "from embedded.nodeagent.nvidiasmi import main\nmain()\n"
        )


def launcher() -> Launcher:
    """This interpreter, this repo and its site-packages, as a sandbox sees them once `mounts` are made."""
    real = Path(os.path.realpath(sys.executable))
    prefix = Path(os.path.realpath(sys.base_prefix))
    mounts = [(str(Path(__file__).resolve().parents[2]), CODE_MOUNT)]
    if real.is_relative_to(prefix):
        mounts.append((str(prefix), PYTHON_MOUNT))
        interpreter = f"{PYTHON_MOUNT}/{real.relative_to(prefix)}"
    else:  # an interpreter outside its own prefix: used where it is (seen through the read-only host root)
        interpreter = str(real)
    sites = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    mounts += [(os.path.realpath(site), f"{SITE_MOUNT}/{n}") for n, site in enumerate(sites)]
    return Launcher(interpreter, (CODE_MOUNT, *(f"{SITE_MOUNT}/{n}" for n in range(len(sites)))), tuple(mounts))


def install(bin_dir: Path) -> Path:
    """Write the `nvidia-smi` launcher into `bin_dir` and return its path; it names sandbox paths only
    (`launcher()`), so it runs in a sandbox from any checkout, venv or interpreter location."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    text = launcher().script()
    if not script.exists() or script.read_text() != text:
        tmp = script.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, script)
    return script


if __name__ == "__main__":
    main()
