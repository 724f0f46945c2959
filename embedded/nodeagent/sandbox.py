"""The bubblewrap command line one container runs under: the host's root read-only, a private writable /tmp and
work dir, its own PID namespace, no network, an unprivileged user unless the pod asks for root.

Owns only the argv (no process handling: `containers.py` runs it). Images are not pulled: the command runs on the
host's userland, seen read-only; what the container writes lands in its work dir under the node's data dir.
`nvidia-smi` is at `/usr/bin/nvidia-smi`, where a real node's CDI spec mounts it (a login shell's PATH finds it):
the host's /usr/bin is read-only and bubblewrap 0.8 has no overlays, so the container's /usr/bin is a tmpfs of
links to the host's entries (seen at HOST_BIN; ~1,100 links, ~35 ms more per start than binding /usr/bin as it is)
with the shim bound among them, then made read-only.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from embedded.nodeagent import nvidiasmi

NOBODY = 65534
FALLBACK_BIN = "/run/gpu-dra/bin"  # the shim's dir where the host's /usr/bin is not a plain directory
CONTAINER_PATH = f"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:{FALLBACK_BIN}"
NVIDIA_SMI = "/usr/bin/nvidia-smi"  # where the shim is seen inside, as CDI mounts the driver's on a real node
HOST_BIN = "/run/gpu-dra/host-bin"  # the host's /usr/bin, which the container's /usr/bin entries link to
SIM_STATE = "/run/gpu-dra/simnvml.json"  # the node's simulated NVML state, read-only, for the shim
WORK_DIR = "/run/pod"  # the container's work dir and HOME (/run is a private tmpfs: the host root has no free spot)


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


def find_bwrap() -> str:
    """The bwrap binary, or SandboxUnavailable saying how to get it."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: `apt-get install -y bubblewrap` "
            "(or run the cluster with `--runtime none`: containers are then not executed)"
        )
    return path


def _mount_point(inside: str) -> str:
    """`inside` with the host root's symlinks along it resolved (`/var/run/...` -> `/run/...`): bwrap makes a mount
    point's parents without following links, and the private dirs (/tmp, /run, /dev, the work dir) are the
    sandbox's own."""
    if inside.startswith(("/tmp/", "/run/", "/dev/", WORK_DIR + "/")):
        return inside
    return os.path.realpath(inside)


def _can_bind(host: str, inside: str) -> bool:
    """A CDI mount is made when its host path exists and its mount point can be: on the private tmpfs dirs, or
    an existing path of the read-only host root (no directory can be created there)."""
    if not host or not inside or inside in ("/tmp", WORK_DIR) or not Path(host).exists():
        return False
    return inside.startswith(("/tmp/", "/run/", "/dev/", "/usr/bin/", WORK_DIR + "/")) or Path(inside).exists()


@functools.cache
def _host_bin() -> tuple[str, ...]:
    """The host's /usr/bin entries (read once per process); none where /usr/bin is not a plain directory."""
    if os.path.islink("/usr/bin") or not os.path.isdir("/usr/bin"):
        return ()
    return tuple(sorted(os.listdir("/usr/bin")))


@functools.cache
def _shim_mounts() -> tuple[tuple[str, str], ...]:
    return nvidiasmi.launcher().mounts


def usr_bin_args(shim: Path) -> list[str]:
    """/usr/bin as the host's, with the nvidia-smi shim at NVIDIA_SMI and what the shim runs on mounted; still
    writable for CDI mounts into /usr/bin until `--remount-ro /usr/bin`."""
    out = []
    for host, inside in _shim_mounts():
        out += ["--ro-bind", host, inside]
    entries = _host_bin()
    if not entries:
        return [*out, "--ro-bind", str(shim), f"{FALLBACK_BIN}/nvidia-smi"]
    out += ["--ro-bind", "/usr/bin", HOST_BIN, "--tmpfs", "/usr/bin"]
    name = os.path.basename(NVIDIA_SMI)
    for entry in entries:
        if entry != name:
            out += ["--symlink", f"{HOST_BIN}/{entry}", f"/usr/bin/{entry}"]
    return [*out, "--ro-bind", str(shim), NVIDIA_SMI]


def bwrap_argv(
    bwrap: str,
    argv: list[str],
    *,
    work: Path,
    tmp: Path,
    shim_dir: Path,
    uid: int,
    env: dict[str, str],
    binds: list[tuple[str, str]] | None = None,
    sim_state: str = "",
) -> list[str]:
    """`bwrap ... -- argv`: `env` is the whole environment (cleared first); `binds` are read-only host:container
    mounts from the CDI edits (ones whose host path is missing are skipped, as the simulated devices are files)."""
    out = [
        bwrap,
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/run",
        "--bind",
        str(tmp),
        "/tmp",
        "--bind",
        str(work),
        WORK_DIR,
        "--chdir",
        WORK_DIR,
        *usr_bin_args(shim_dir / "nvidia-smi"),
        *(["--ro-bind", sim_state, SIM_STATE] if sim_state else []),
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        "pod",
        "--unshare-user",
        "--uid",
        str(uid),
        "--gid",
        str(uid),
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]
    for host, wanted in binds or []:
        inside = _mount_point(wanted) if wanted else wanted
        if _can_bind(host, inside):
            out += ["--ro-bind", host, inside]
    if _host_bin():
        out += ["--remount-ro", "/usr/bin"]
    for key, value in env.items():
        out += ["--setenv", key, value]
    return [*out, "--", *argv]


@dataclass
class Runtime:
    """Where and how the sandboxed runtime runs containers (None on the PodRunner: `--runtime none`)."""

    bwrap: str
    work_root: Path  # per pod, per container: private /tmp and work dir
    log_root: Path  # <namespace>_<pod>_<uid>/<container>/<restart>.log
    shim_dir: Path  # holds the nvidia-smi shim
    sim_state: str  # the simulated NVML state file the shim answers from
    backoff_base: float = 10.0
