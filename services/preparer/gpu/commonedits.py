"""The node's CDI *common edits*: the driver userspace every GPU claim's containers get.

Owns what NVIDIA's container toolkit puts in every spec beside a device's own nodes (facts from the
toolkit's CDI generation, copied into the constants below):
  device nodes  /dev/nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset where they exist under the
                dev root; type/major/minor from the node when it is a char device (else left to the
                runtime), fileMode 0666, permissions rwm
  libraries     every `*.so.<driverVersion>` in the driver root's library dirs (its ld cache, else the
                standard dirs) but the graphics-only ones, plus `libnvidia-nvvm70.so.*`
  binaries      nvidia-smi, nvidia-debugdump, nvidia-persistenced, the MPS and IMEX tools, where present
  firmware      `nvidia/<driverVersion>/gsp*.bin` under the kernel's firmware search paths
  IPC           the persistenced and fabric-manager sockets (/run or /var/run), a node-wide /tmp/nvidia-mps
  hooks         `nvidia-cdi-hook` (createContainer): create-symlinks (each library's SONAME link and the
                libcuda.so dev link), enable-cuda-compat --host-driver-version, update-ldcache --folder
                (each library dir), disable-device-node-modification, in that order
  env           NVIDIA_VISIBLE_DEVICES=void (a legacy runtime hook must not act again)
Files are mounted read-only (`ro, nosuid, nodev, rbind, rprivate`) at their path inside the driver root;
host paths are under the host driver root, device nodes under the dev root.

`CommonEdits` builds them once in a worker thread at start and serves them from memory to every
prepare (no file scan per prepare). Refresh: at most every `check_interval` seconds a prepare first
resolves the `libnvidia-ml.so.1` link it found (one readlink in a thread); a driver upgrade moves that
link to `libnvidia-ml.so.<newVersion>` and the edits are rebuilt. The same check re-reads the control
device nodes (nvidia-uvm appears once the module loads) and, with no driver found yet, looks again.

Without a driver: with `--driver-root` set, a root without libnvidia-ml.so.1 or with an inconsistent
version is a `DriverRootError` at start. Without it, `/` is probed; when no driver is there (the
simulator, a laptop) the edits hold the device nodes that exist and one warning says containers get
no driver files. `nvidia-cdi-hook`: the configured host path is checked where this process can see it
(under the host driver root); when it is visibly absent the driver root's binary dirs and the GPU
operator's toolkit dir are searched, and when it is nowhere the hooks are left out (with a warning):
a spec naming a hook program that does not exist fails every container at creation, while without
the hooks the files are still mounted. A hook path outside the driver root is trusted as configured.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from dataclasses import dataclass, field

from services.preparer.host.cdi import READ_ONLY, ContainerEdits, DeviceNode, Hook, Mount
from shared.driverroot import NVML_SONAME, DriverRoot, DriverRootError, read_soname
from shared.logs import get_logger

log = get_logger(__name__)

DEFAULT_CDI_HOOK = "/usr/bin/nvidia-cdi-hook"
HOOK_NAME = "nvidia-cdi-hook"
CHECK_INTERVAL_S = 60.0
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
CONTROL_FILE_MODE = 0o666
CONTROL_PERMISSIONS = "rwm"
# Graphics-only libraries a compute container does not get (name prefixes; libGL covers GLES, GLX, GLdispatch).
GRAPHICS_PREFIXES = ("libEGL", "libGL", "libOpenCL", "libOpenGL", "libnvidia-api", "libnvidia-egl-")
EXTRA_LIBRARIES = ("libnvidia-nvvm70.so.*",)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
# Each IPC endpoint: the places it may be, first found wins.
IPC_PATHS = (
    ("/run/nvidia-persistenced/socket", "/var/run/nvidia-persistenced/socket"),
    ("/run/nvidia-fabricmanager/socket", "/var/run/nvidia-fabricmanager/socket"),
    ("/tmp/nvidia-mps",),
)  # noqa: S108 - the node-wide MPS pipe dir, as CUDA looks for it
HOOK_SEARCH_DIRS = ("/usr/local/nvidia/toolkit",)  # the GPU operator's toolkit install, besides the binary dirs


def firmware_dirs(kernel: str) -> tuple[str, ...]:
    """The kernel's firmware search path, in its order."""
    return (f"/lib/firmware/updates/{kernel}", "/lib/firmware/updates", f"/lib/firmware/{kernel}", "/lib/firmware")


@dataclass(frozen=True)
class DriverFiles:
    """What the driver root contributes (no device nodes): found once, mounted by every claim."""

    version: str = ""  # "" when no driver was found
    nvml_path: str = ""  # container path of libnvidia-ml.so.1, re-resolved to notice an upgrade
    nvml_target: str = ""  # the file it resolved to at build time
    libraries: list[str] = field(default_factory=list)
    binaries: list[str] = field(default_factory=list)
    firmware: list[str] = field(default_factory=list)
    ipc: list[str] = field(default_factory=list)
    hook_path: str = ""  # host path of nvidia-cdi-hook; "" = hooks left out
    mounts: list[Mount] = field(default_factory=list)
    hooks: list[Hook] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


NO_DRIVER = DriverFiles()


# ------------------------------------------------------------------------------------ pure-ish builders
def _is_graphics(name: str) -> bool:
    return name.startswith(GRAPHICS_PREFIXES)


def driver_libraries(root: DriverRoot, version: str) -> list[str]:
    """Container paths of the driver's compute libraries (sorted)."""
    found = root.libraries_matching(f"*.so.{version}")
    for pattern in EXTRA_LIBRARIES:
        found += root.libraries_matching(pattern)
    return sorted({p for p in found if not _is_graphics(os.path.basename(p))})


def _check_consistent(root: DriverRoot, version: str, warnings: list[str]) -> None:
    """libcuda.so.1 must belong to the same driver as libnvidia-ml.so.1."""
    cuda = root.find_library("libcuda.so.1")
    if not cuda:
        warnings.append(
            f"no libcuda.so.1 under driver root {root.local('/')}: CUDA containers cannot start; "
            "reinstall the driver's CUDA libraries"
        )
        return
    target = root.local(cuda).resolve().name
    cuda_version = target.removeprefix("libcuda.so.")
    if cuda_version != version:
        raise DriverRootError(
            f"driver root {root.local('/')} mixes driver versions: {NVML_SONAME} is {version} but libcuda.so.1 is "
            f"{target}; reinstall one driver or point --driver-root at a single driver"
        )


def _first_present(root: DriverRoot, candidates: tuple[str, ...]) -> str:
    return next((p for p in candidates if root.local(p).exists()), "")


def resolve_hook(root: DriverRoot, hook_path: str, warnings: list[str]) -> str:
    """The host path of nvidia-cdi-hook to name in specs, or "" to leave the hooks out (see the module doc)."""
    host_root = root.host_root.rstrip("/")
    if host_root and hook_path != host_root and not hook_path.startswith(host_root + "/"):
        log.debug(
            "cdi hook path is outside the driver root; trusted as configured",
            hook=hook_path,
            driver_root=root.host_root,
        )
        return hook_path
    local = root.local(hook_path[len(host_root) :] or "/")
    if local.is_file() and os.access(local, os.X_OK):
        return hook_path
    found = root.find_binary(HOOK_NAME) or _first_present(root, tuple(f"{d}/{HOOK_NAME}" for d in HOOK_SEARCH_DIRS))
    if found:
        warnings.append(
            f"{HOOK_NAME} is not at {hook_path}; using {root.host(found)} found under the driver "
            "root (set --cdi-hook-path to silence this)"
        )
        return root.host(found)
    warnings.append(
        f"{HOOK_NAME} is not at {hook_path} nor under driver root {root.local('/')}: claim specs "
        "leave out its hooks (no SONAME links, ld cache update or CUDA compat in containers, so most "
        "CUDA programs will not load); install the NVIDIA container toolkit or set --cdi-hook-path"
    )
    return ""


def hooks_for(hook_path: str, root: DriverRoot, libraries: list[str], version: str) -> list[Hook]:
    """The nvidia-cdi-hook calls for these libraries (container paths), in the toolkit's order."""
    links: list[str] = []
    for lib in libraries:
        directory, name = os.path.dirname(lib), os.path.basename(lib)
        soname = read_soname(root.local(lib))
        if soname and soname != name:
            links += ["--link", f"{name}::{directory}/{soname}"]
        if soname == "libcuda.so.1":
            links += ["--link", f"libcuda.so.1::{directory}/libcuda.so"]
    folders = [arg for d in dict.fromkeys(os.path.dirname(lib) for lib in libraries) for arg in ("--folder", d)]
    hooks = []
    if links:
        hooks.append(Hook(hook_path, [HOOK_NAME, "create-symlinks", *links]))
    hooks.append(Hook(hook_path, [HOOK_NAME, "enable-cuda-compat", f"--host-driver-version={version}"]))
    if folders:
        hooks.append(Hook(hook_path, [HOOK_NAME, "update-ldcache", *folders]))
    hooks.append(Hook(hook_path, [HOOK_NAME, "disable-device-node-modification"]))
    return hooks


def build_driver_files(root: DriverRoot, hook_path: str = DEFAULT_CDI_HOOK, kernel: str = "") -> DriverFiles:
    """Everything the driver root contributes (blocking: run in a thread). DriverRootError when the root
    has no libnvidia-ml.so.1 or mixes driver versions."""
    nvml = root.nvml_library()
    version = root.driver_version()
    warnings: list[str] = []
    _check_consistent(root, version, warnings)
    missing: list[str] = []
    libraries = driver_libraries(root, version)
    binaries = []
    for name in BINARIES:
        path = root.find_binary(name)
        binaries += [path] if path else []
        missing += [] if path else [name]
    firmware: list[str] = []
    seen: set[str] = set()
    for directory in firmware_dirs(kernel or os.uname().release):
        for p in sorted(root.local(f"{directory}/nvidia/{version}").glob("gsp*.bin")):
            if p.is_file() and p.name not in seen:
                seen.add(p.name)
                firmware.append(f"{directory}/nvidia/{version}/{p.name}")
    missing += [] if firmware else [f"/lib/firmware/nvidia/{version}/gsp*.bin"]
    ipc = []
    for candidates in IPC_PATHS:
        path = _first_present(root, candidates)
        ipc += [path] if path else []
        missing += [] if path else [candidates[0]]
    if missing:
        log.debug("optional driver files absent; skipped", driver_root=str(root.local("/")), missing=missing)
    mounts = [Mount(root.host(p), p, list(READ_ONLY)) for p in (*libraries, *binaries, *firmware, *ipc)]
    hook = resolve_hook(root, hook_path, warnings)
    hooks = hooks_for(hook, root, libraries, version) if hook else []
    return DriverFiles(
        version=version,
        nvml_path=nvml,
        nvml_target=root.local(nvml).resolve().name,
        libraries=libraries,
        binaries=binaries,
        firmware=firmware,
        ipc=ipc,
        hook_path=hook,
        mounts=mounts,
        hooks=hooks,
        warnings=warnings,
    )


def control_nodes(root: DriverRoot) -> list[DeviceNode]:
    """The control device nodes that exist under the root's dev root (blocking: run in a thread)."""
    out: list[DeviceNode] = []
    for path in CONTROL_DEVICES:
        try:
            st = os.stat(root.dev_local(path))
        except OSError:
            log.debug("control device node absent; skipped", path=root.dev_host(path))
            continue
        node = DeviceNode(path, root.dev_host(path), file_mode=CONTROL_FILE_MODE, permissions=CONTROL_PERMISSIONS)
        if stat.S_ISCHR(st.st_mode):
            node.type, node.major, node.minor = "c", os.major(st.st_rdev), os.minor(st.st_rdev)
        out.append(node)
    return out


def edits_of(files: DriverFiles, nodes: list[DeviceNode]) -> ContainerEdits:
    return ContainerEdits(
        nodes=list(nodes), env=[VISIBLE_DEVICES_VOID], mounts=list(files.mounts), hooks=list(files.hooks)
    )


# ------------------------------------------------------------------------------------ the cache
class CommonEdits:
    """The node's common edits, built once and refreshed when the driver changes (see the module doc)."""

    def __init__(
        self,
        *,
        driver_root: str = "",
        container_driver_root: str = "",
        dev_root: str = "",
        cdi_hook_path: str = DEFAULT_CDI_HOOK,
        check_interval: float = CHECK_INTERVAL_S,
    ) -> None:
        self.settings = (driver_root, container_driver_root, dev_root)
        self.explicit = bool(driver_root)
        self.configured = bool(driver_root or container_driver_root or dev_root)
        self.hook_path = cdi_hook_path or DEFAULT_CDI_HOOK
        self.check_interval = check_interval
        self.root = DriverRoot.of(*self.settings)
        self.files = NO_DRIVER
        self._nodes: dict[str, list[DeviceNode]] = {}
        self._edits: dict[str, tuple[DriverFiles, list[DeviceNode], ContainerEdits]] = {}  # per dev root, as built
        self._checked_at = 0.0
        self._lock = asyncio.Lock()

    @property
    def dev_root_override(self) -> str:
        """The dev root these settings name ("" = the one discovery reports)."""
        return self.root.dev_root if self.configured else ""

    def _fresh_root(self) -> DriverRoot:
        return DriverRoot.of(*self.settings)  # library dirs re-read: an upgrade may move them

    async def start(self) -> None:
        """Build the edits (DriverRootError when --driver-root names no usable driver)."""
        try:
            files = await asyncio.to_thread(build_driver_files, self._fresh_root(), self.hook_path)
        except DriverRootError as exc:
            if self.explicit:
                raise
            files = NO_DRIVER
            log.warning(
                "no NVIDIA driver found: claim CDI specs carry device nodes only, so containers get no "
                "driver libraries or binaries; on a GPU node set --driver-root (and "
                "--container-driver-root where this container mounts it)",
                error=str(exc),
            )
        self._use(files)
        self._checked_at = time.monotonic()

    def _use(self, files: DriverFiles) -> None:
        for warning in files.warnings:
            if warning not in self.files.warnings:
                log.warning(warning)
        if files.version:
            log.info(
                "driver userspace for CDI specs ready",
                driver_root=self.root.host_root,
                version=files.version,
                libraries=len(files.libraries),
                binaries=len(files.binaries),
                firmware=len(files.firmware),
                ipc=len(files.ipc),
                hook=files.hook_path or "(none)",
            )
        self.files = files

    def _current_target(self) -> str:
        """The file libnvidia-ml.so.1 resolves to now ("" when there is none); blocking."""
        if self.files.nvml_path:
            link = self.root.local(self.files.nvml_path)
            if link.exists():
                return link.resolve().name
        root = self._fresh_root()
        found = root.find_library(NVML_SONAME)
        return root.local(found).resolve().name if found else ""

    async def refresh(self) -> bool:
        """Check the driver now; rebuild when it changed. True when the driver files were rebuilt."""
        async with self._lock:
            self._checked_at = time.monotonic()
            self._nodes.clear()
            target = await asyncio.to_thread(self._current_target)
            if target == self.files.nvml_target:
                return False
            try:
                files = await asyncio.to_thread(build_driver_files, self._fresh_root(), self.hook_path)
            except DriverRootError as exc:
                log.warning(
                    "driver changed but its files are not usable; claim specs keep the previous driver files",
                    version=self.files.version or "(none)",
                    error=str(exc),
                )
                return False
            log.info("driver changed; common CDI edits rebuilt", old=self.files.version or "(none)", new=files.version)
            self._use(files)
            return True

    async def get(self, dev_root: str = "") -> ContainerEdits:
        """The edits for a claim spec; `dev_root` is discovery's, used when the settings name none. The same
        object while the driver's files and control nodes are (callers read it, never change it): shares' specs
        are named by its digest, computed again only for another object (`sharedspecs`)."""
        if time.monotonic() - self._checked_at >= self.check_interval:
            await self.refresh()
        root = self.root if self.configured else DriverRoot.of("", "", dev_root or "/")
        nodes = self._nodes.get(root.dev_root)
        if nodes is None:
            nodes = await asyncio.to_thread(control_nodes, root)
            self._nodes[root.dev_root] = nodes
        built = self._edits.get(root.dev_root)
        if built is None or built[0] is not self.files or built[1] is not nodes:
            built = self._edits[root.dev_root] = (self.files, nodes, edits_of(self.files, nodes))
        return built[2]


__all__ = ["DEFAULT_CDI_HOOK", "CommonEdits", "DriverFiles", "build_driver_files", "control_nodes", "edits_of"]
