"""A fake NVIDIA driver root for tests of the real-node paths (no GPU, nothing read outside the test's dir).

`make_driver_root(base)` lays out what a host driver root holds (facts from NVIDIA's container toolkit,
copied into this fixture): versioned driver libraries as real ELF shared objects with their real
SONAMEs plus the SONAME links ldconfig makes, an `etc/ld.so.cache` naming them (or none), the driver's
binaries as stub executables, GSP firmware, IPC sockets and `/dev/nvidia*` stand-ins (regular files).

Every stub appends one JSON line per call to `<root>/.fake/calls.jsonl` (`bin`, `argv`, `stdin`, the
`CUDA_*`/`LD_*` env, `pid`) and acts like the real binary as far as tests need:
  nvidia-smi                 `compute-policy -i UUID --set-timeslice N` stores N in .fake/timeslice/UUID
  nvidia-cuda-mps-control    `-d` starts a daemon (pid file and `control` fifo in CUDA_MPS_PIPE_DIRECTORY,
                             control.log in CUDA_MPS_LOG_DIRECTORY); without `-d` it reads commands from
                             stdin, logs them to control.log, answers `get_*` queries, and `quit` ends
                             the daemon; it fails when no daemon is running
  nvidia-imex                runs until SIGTERM/SIGINT; SIGHUP is recorded as {"signal": "SIGHUP"}
  nvidia-imex-ctl            `-q` prints .fake/imex-status (default READY)
  fmpm                       Fabric Manager's partition tool (only when `binaries` names it): `-l` prints the
                             partitions of .fake/fabric.json (`fake.set_partitions`) as fmpm's JSON; `-a ID`
                             and `-d ID` (de)activate one, refused as Fabric Manager refuses them (unknown id,
                             already in that state, a GPU shared with an active partition)
  anything else              records and exits 0
Faults: `fake.fail(bin, msg)` makes a stub print msg and exit 1; `fake.hang(bin, when="")` makes it sleep
(only the calls with `when` as one of their arguments, if given);
`fake.fail_once(bin, msg, when=...)` fails only the next call (the next with `when` as one of its arguments or
in its stdin).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.driverroot import build_ld_cache

DRIVER_VERSION = "550.54.15"
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
# (file name pattern, SONAME pattern): {v} is the driver version. The compute libraries a CUDA container
# needs, and graphics-only ones the toolkit leaves out.
DRIVER_LIBRARIES = (
    ("libcuda.so.{v}", "libcuda.so.1"),
    ("libcudadebugger.so.{v}", "libcudadebugger.so.1"),
    ("libnvidia-ml.so.{v}", "libnvidia-ml.so.1"),
    ("libnvidia-ptxjitcompiler.so.{v}", "libnvidia-ptxjitcompiler.so.1"),
    ("libnvidia-nvvm.so.{v}", "libnvidia-nvvm.so.4"),
    ("libnvidia-cfg.so.{v}", "libnvidia-cfg.so.1"),
    ("libnvidia-opencl.so.{v}", "libnvidia-opencl.so.1"),
    ("libnvidia-allocator.so.{v}", "libnvidia-allocator.so.1"),
    ("libnvidia-gpucomp.so.{v}", "libnvidia-gpucomp.so.{v}"),
    ("libnvidia-pkcs11-openssl3.so.{v}", "libnvidia-pkcs11-openssl3.so.{v}"),
    ("libnvidia-nvvm70.so.4", "libnvidia-nvvm70.so.4"),
)
GRAPHICS_LIBRARIES = (
    ("libEGL_nvidia.so.{v}", "libEGL_nvidia.so.0"),
    ("libGLX_nvidia.so.{v}", "libGLX_nvidia.so.0"),
    ("libGLESv2_nvidia.so.{v}", "libGLESv2_nvidia.so.2"),
    ("libnvidia-api.so.1", "libnvidia-api.so.1"),
    ("libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland.so.1"),
)
OTHER_LIBRARIES = (("libc.so.6", "libc.so.6"),)  # in the ld cache but not the driver's
DRIVER_BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
    "nvidia-cdi-hook",
)
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")


def elf_shared_object(soname: str, *, machine: int = 62) -> bytes:
    """A minimal valid ELF64 little-endian shared object whose dynamic section names `soname`."""
    ehdr, phdr, dyn = struct.Struct("<16sHHIQQQIHHHHHH"), struct.Struct("<IIQQQQQQ"), struct.Struct("<qQ")
    strtab = b"\0" + soname.encode() + b"\0"
    dyn_off = ehdr.size + 2 * phdr.size
    entries = [(5, 0), (10, len(strtab)), (14, 1), (0, 0)]  # DT_STRTAB (patched), DT_STRSZ, DT_SONAME, DT_NULL
    str_off = dyn_off + len(entries) * dyn.size
    entries[0] = (5, str_off)
    size = str_off + len(strtab)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    out = ehdr.pack(ident, 3, machine, 1, 0, ehdr.size, 0, 0, ehdr.size, phdr.size, 2, 64, 0, 0)
    out += phdr.pack(1, 5, 0, 0, 0, size, size, 0x1000)  # PT_LOAD of the whole file at vaddr 0
    out += phdr.pack(2, 6, dyn_off, dyn_off, dyn_off, len(entries) * dyn.size, len(entries) * dyn.size, 8)
    out += b"".join(dyn.pack(tag, val) for tag, val in entries)
    return out + strtab


STUB = r'''#!{python}
import json, os, signal, sys, time
NAME = os.path.basename(sys.argv[0])
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[0]))))
FAKE = os.path.join(ROOT, ".fake")


def record(**extra):
    os.makedirs(FAKE, exist_ok=True)
    env = {{k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "LD_", "NVIDIA_"))}}
    line = json.dumps({{"bin": NAME, "argv": sys.argv[1:], "env": env, "pid": os.getpid(), "time": time.time(),
                       **extra}}) + "\n"
    fd = os.open(os.path.join(FAKE, "calls.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def arg(flag):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv[:-1] else None


def alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{{pid}}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def faults():
    fail_once()
    fail = os.path.join(FAKE, "fail", NAME)
    if os.path.exists(fail):
        with open(fail) as f:
            sys.stderr.write(f.read() + "\n")
        sys.exit(1)
    hang = os.path.join(FAKE, "hang", NAME)
    if os.path.exists(hang):
        with open(hang) as f:
            when = f.read()
        if not when or when in sys.argv[1:]:  # an argument, not part of one (a temp path may hold "-a")
            time.sleep(3600)


def fail_once():
    """`FakeDriver.fail_once`: the first call (whose argv or stdin holds `when`) fails; the marker is consumed."""
    marker = os.path.join(FAKE, "fail-once", NAME)
    try:
        with open(marker) as f:
            fault = json.load(f)
    except (OSError, ValueError):
        return
    if fault["when"]:
        mine = {{}}
        with open(os.path.join(FAKE, "calls.jsonl")) as f:  # this call, as record() wrote it
            for line in f:
                call = json.loads(line)
                mine = call if call["pid"] == os.getpid() else mine
        # one of its arguments (not part of one: a temp path may hold "-a"), or anywhere in what stdin said
        if fault["when"] not in mine.get("argv", []) and fault["when"] not in mine.get("stdin", ""):
            return
    try:
        os.unlink(marker)
    except OSError:
        return  # another call took it
    sys.stderr.write(fault["message"] + "\n")
    sys.exit(1)


def mps_control():
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    logs = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    pidfile = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
    state = os.path.join(pipe, ".fake-state.json")

    def log(text):
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, "control.log"), "a") as f:
            f.write(f"[{{time.time():.3f}}] {{text}}\n")

    def daemon_pid():
        try:
            with open(pidfile) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return 0
        return pid if alive(pid) else 0

    if "-d" in sys.argv:
        record()
        faults()
        if daemon_pid():
            sys.stderr.write("An instance of this daemon is already running\n")
            sys.exit(1)
        os.makedirs(pipe, exist_ok=True)
        if os.fork():
            sys.exit(0)  # the parent returns at once, as the real -d does
        os.setsid()
        if os.fork():
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        fifo = os.path.join(pipe, "control")
        if not os.path.exists(fifo):
            os.mkfifo(fifo)
        log("Starting control daemon")
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        while True:
            time.sleep(1)
    commands = sys.stdin.read()
    record(stdin=commands)
    faults()
    pid = daemon_pid()
    if not pid:
        sys.stderr.write("Cannot find MPS control daemon process\n")
        sys.exit(1)
    try:
        with open(state) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        settings = {{}}
    for line in commands.splitlines():
        words = line.split()
        if not words:
            continue
        log(line.strip())
        if words[0].startswith("set_"):
            settings[words[0][4:]] = words[1:]
        elif words[0].startswith("get_"):
            print(" ".join(settings.get(words[0][4:], [])))
        elif words[0] == "quit":
            os.kill(pid, signal.SIGTERM)
            for _ in range(200):
                if not alive(pid):
                    break
                time.sleep(0.01)
            for p in (pidfile, os.path.join(pipe, "control")):
                if os.path.exists(p):
                    os.unlink(p)
            log("Exit")
    with open(state, "w") as f:
        json.dump(settings, f)


def imex():
    record()
    faults()
    signal.signal(signal.SIGHUP, lambda *_: record(signal="SIGHUP"))
    signal.signal(signal.SIGUSR1, lambda *_: record(signal="SIGUSR1"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    while True:
        time.sleep(1)


def fmpm():
    record()
    faults()
    path = os.path.join(FAKE, "fabric.json")
    with open(path) as f:
        table = json.load(f)
    if "-l" in sys.argv:
        print(json.dumps(table, indent=3))
        return
    parts = table["partitionInfo"]
    for flag, active in (("-a", 1), ("-d", 0)):
        pid = arg(flag)
        if pid is None:
            continue
        target = [p for p in parts if p["partitionId"] == int(pid)]
        if not target:
            print(f"Invalid partition Id {{pid}} was given.")
            sys.exit(2)
        modules = {{g["physicalId"] for g in target[0]["gpuInfo"]}}
        busy = [p for p in parts if p["isActive"] and modules & {{g["physicalId"] for g in p["gpuInfo"]}}]
        if target[0]["isActive"] == active or (active and busy):
            print(f"Failed to {{'activate' if active else 'deactivate'}} partition. fmReturn: -14")
            sys.exit(242)
        target[0]["isActive"] = active
        with open(path + ".tmp", "w") as f:
            json.dump(table, f)
        os.replace(path + ".tmp", path)


def main():
    if NAME == "fmpm":
        return fmpm()
    if NAME == "nvidia-cuda-mps-control":
        return mps_control()
    if NAME == "nvidia-imex":
        return imex()
    record()
    faults()
    if NAME == "nvidia-smi" and "--set-timeslice" in sys.argv:
        uuid, value = arg("-i"), arg("--set-timeslice")
        os.makedirs(os.path.join(FAKE, "timeslice"), exist_ok=True)
        with open(os.path.join(FAKE, "timeslice", uuid or "all"), "w") as f:
            f.write(value or "")
    elif NAME == "nvidia-imex-ctl" and "-q" in sys.argv:
        status = os.path.join(FAKE, "imex-status")
        print(open(status).read().strip() if os.path.exists(status) else "READY")


main()
'''


@dataclass
class FakeDriver:
    """A fake driver root and what its stubs recorded."""

    root: Path
    version: str
    lib_dir: str

    @property
    def fake(self) -> Path:
        return self.root / ".fake"

    def calls(self, binary: str | None = None) -> list[dict[str, Any]]:
        path = self.fake / "calls.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        # Only whole lines: a stub may be appending its record right now, and a read can see part of it.
        complete = text[: text.rfind("\n") + 1]
        out = [json.loads(line) for line in complete.splitlines() if line.strip()]
        return [c for c in out if binary is None or c["bin"] == binary]

    def fail(self, binary: str, message: str = "injected failure") -> None:
        (self.fake / "fail").mkdir(parents=True, exist_ok=True)
        (self.fake / "fail" / binary).write_text(message)

    def hang(self, binary: str, when: str = "") -> None:
        (self.fake / "hang").mkdir(parents=True, exist_ok=True)
        (self.fake / "hang" / binary).write_text(when)

    def heal(self, binary: str) -> None:
        for kind in ("fail", "hang"):
            (self.fake / kind / binary).unlink(missing_ok=True)

    def timeslice(self, uuid: str) -> str | None:
        path = self.fake / "timeslice" / uuid
        return path.read_text() if path.exists() else None

    def set_imex_status(self, status: str) -> None:
        self.fake.mkdir(parents=True, exist_ok=True)
        (self.fake / "imex-status").write_text(status)

    # -- Fabric Manager (fmpm) -----------------------------------------------------------------
    def set_partitions(
        self, partitions: list[tuple[int, list[int]]], gpus: list[tuple[int, str, str]], active: tuple[int, ...] = ()
    ) -> None:
        """Fabric Manager's table: (partition id, module ids) each, over `gpus` as (module id, NVML PCI bus
        id, UUID); the `active` ones start active. Written in fmpm's JSON (`fmpm -l` prints it)."""
        by_module = {module: (bus, uuid) for module, bus, uuid in gpus}
        info = [
            {
                "partitionId": pid,
                "isActive": int(pid in active),
                "numGpus": len(modules),
                "gpuInfo": [
                    {
                        "physicalId": m,
                        "uuid": by_module[m][1],
                        "pciBusId": by_module[m][0],
                        "numNvLinksAvailable": 18,
                        "maxNumNvLinks": 18,
                        "nvlinkLineRateMBps": 50000,
                    }
                    for m in modules
                ],
            }
            for pid, modules in partitions
        ]
        self.fake.mkdir(parents=True, exist_ok=True)
        (self.fake / "fabric.json").write_text(
            json.dumps({"version": 1, "numPartitions": len(info), "maxNumPartitions": 31, "partitionInfo": info})
        )

    def active_partitions(self) -> list[int]:
        table = json.loads((self.fake / "fabric.json").read_text())
        return [p["partitionId"] for p in table["partitionInfo"] if p["isActive"]]

    def library(self, name: str) -> Path:
        return self.root / self.lib_dir.lstrip("/") / name

    # -- added for the time-slice and MPS tests ------------------------------------------------
    def fail_once(self, binary: str, message: str = "injected failure", *, when: str = "") -> None:
        """The next call of `binary` (with `when` as one of its arguments or in its stdin, if given) prints
        `message` and exits 1; the calls after it behave."""
        (self.fake / "fail-once").mkdir(parents=True, exist_ok=True)
        (self.fake / "fail-once" / binary).write_text(json.dumps({"message": message, "when": when}))


def _bind_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(path))
        finally:
            s.close()
    except OSError:  # a path too long for sun_path: a stand-in file does for existence checks
        path.write_text("")


def make_driver_root(
    base: Path,
    *,
    version: str = DRIVER_VERSION,
    ld_cache: bool = True,
    lib_dir: str = LIB_DIR,
    binaries: tuple[str, ...] = DRIVER_BINARIES,
    gpus: int = 2,
    firmware: bool = True,
    sockets: bool = True,
    nvml: bool = True,
) -> FakeDriver:
    """Lay a driver root out under `base` (created); see the module doc."""
    root = Path(base)
    libs = root / lib_dir.lstrip("/")
    libs.mkdir(parents=True, exist_ok=True)
    cache: list[tuple[str, str]] = []
    for file_pattern, soname_pattern in DRIVER_LIBRARIES + GRAPHICS_LIBRARIES + OTHER_LIBRARIES:
        name, soname = file_pattern.format(v=version), soname_pattern.format(v=version)
        if not nvml and name.startswith("libnvidia-ml."):
            continue
        (libs / name).write_bytes(elf_shared_object(soname))
        if soname != name:
            (libs / soname).symlink_to(name)
        cache.append((soname, f"{lib_dir}/{soname}"))
    if ld_cache:
        (root / "etc").mkdir(parents=True, exist_ok=True)
        (root / "etc" / "ld.so.cache").write_bytes(build_ld_cache(cache))
    bindir = root / "usr" / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    stub = STUB.format(python=sys.executable)
    for name in binaries:
        path = bindir / name
        path.write_text(stub)
        path.chmod(0o755)
    dev = root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    for name in (*CONTROL_NODES, *(f"nvidia{i}" for i in range(gpus))):
        (dev / name).write_text("")
    (dev / "nvidia-caps").mkdir(exist_ok=True)
    (dev / "nvidia-caps-imex-channels").mkdir(exist_ok=True)
    if firmware:
        fw = root / "lib" / "firmware" / "nvidia" / version
        fw.mkdir(parents=True, exist_ok=True)
        for name in FIRMWARE:
            (fw / name).write_bytes(b"GSP")
    if sockets:
        for socket_path in SOCKETS:
            _bind_socket(root / socket_path.lstrip("/"))
    (root / ".fake").mkdir(exist_ok=True)
    return FakeDriver(root=root, version=version, lib_dir=lib_dir)
