"""The bubblewrap command line one container runs under: the host's root read-only, a private writable /tmp and
work dir, its own PID namespace, no network, an unprivileged user unless the pod asks for root.

Owns only the argv (no process handling: `containers.py` runs it). Images are not pulled: the command runs on the
host's userland, seen read-only; what the container writes lands in its work dir under the node's data dir.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

NOBODY = 65534
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHIM_DIR = "/run/gpu-dra/bin"  # where the nvidia-smi shim is seen inside, first on PATH
SIM_STATE = "/run/gpu-dra/simnvml.json"  # the node's simulated NVML state, read-only, for the shim
WORK_DIR = "/run/pod"  # the container's work dir and HOME (/run is a private tmpfs: the host root has no free spot)


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


def find_bwrap() -> str:
    """The bwrap binary, or SandboxUnavailable saying how to get it."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed: `apt-get install -y bubblewrap` "
                                 "(or run the cluster with `--runtime none`: containers are then not executed)")
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
    return inside.startswith(("/tmp/", "/run/", "/dev/", WORK_DIR + "/")) or Path(inside).exists()


def bwrap_argv(bwrap: str, argv: list[str], *, work: Path, tmp: Path, shim_dir: Path, uid: int,
               env: dict[str, str], binds: list[tuple[str, str]] | None = None, sim_state: str = "") -> list[str]:
    """`bwrap ... -- argv`: `env` is the whole environment (cleared first); `binds` are read-only host:container
    mounts from the CDI edits (ones whose host path is missing are skipped, as the simulated devices are files)."""
    out = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/run",
           "--bind", str(tmp), "/tmp", "--bind", str(work), WORK_DIR, "--chdir", WORK_DIR,
           "--ro-bind", str(shim_dir), SHIM_DIR, *(["--ro-bind", sim_state, SIM_STATE] if sim_state else []),
           "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--hostname", "pod",
           "--unshare-user", "--uid", str(uid), "--gid", str(uid),
           "--die-with-parent", "--new-session", "--clearenv"]
    for host, wanted in binds or []:
        inside = _mount_point(wanted) if wanted else wanted
        if _can_bind(host, inside):
            out += ["--ro-bind", host, inside]
    for key, value in env.items():
        out += ["--setenv", key, value]
    return [*out, "--", *argv]
