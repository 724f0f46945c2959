"""CDI specs for prepared claims: one file per claim in the CDI dir, written atomically, removed on unprepare.

Owns the spec layout per driver (`CdiKind`: `k8s.gpu.nvidia.com/claim` for GPUs,
`k8s.compute-domain.nvidia.com/claim` for IMEX channels, as upstream; device names
`<claimUID>-<device>`, file `<vendor>-claim_<uid>.json`; `k8s.gpu.nvidia.com/device` for the node
spec of `gpu-dra cdi generate`), the minimum `cdiVersion` for the features used, the spec-level
edits (`ContainerEdits`: for GPU claims the node's driver userspace from `commonedits`: device
nodes, mounts, hooks, env) and per-device edits (device nodes, char-device major/minor/mode for
nodes a runtime creates, MPS mounts and env). A device mount wins over a spec-level mount at the
same container path (a claim's MPS pipe dir over a node-wide one). A spec is written whole (temp
file, rename) before the claim's `PrepareCompleted` checkpoint write, which orders it; where the node
has a boot id it has no fsync of its own (`durable`): a power loss is a reboot that drops every
prepared claim, and the kubelet's next prepare writes the spec again (the crash argument is in
`checkpoint`'s module doc). There a removed spec is not unlinked but renamed to a spare (a
dot-named `.tmp` file, which no CDI registry reads), and the next write fills a spare in place and
renames it to its claim's name: no file created or freed per claim (each costs a journal
transaction). At start, `sweep` removes the specs (and temp and spare files) of claims the checkpoint
does not hold: a spec is written after its claim's `PrepareStarted` entry and removed before the
entry is, so such a spec belongs to no claim (one left by a reboot, or torn by a power loss).

Shares (claims that hold every device as a KEP-5075 share) get edits that no claim of their own changes: the
device's nodes, its MPS daemon's pipe and the share's limits. Claims with the same edits use one spec,
`k8s.gpu.nvidia.com/share` (file `<vendor>-share_<digest>.json`, device names `<digest>-<device>`), named by a
digest of its content, so a name never stands for two contents (`spec_digest`; `sharedspecs` keeps its users).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import re
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from services.preparer.host.checkpoint import atomic_write
from shared.files import fill_in_place

VENDOR = "k8s.gpu.nvidia.com"
CLASS = "claim"
SHARE_CLASS = "share"  # the specs shares use together (module doc)
KIND = f"{VENDOR}/{CLASS}"
MPS_PIPE_IN_CONTAINER = "/tmp/nvidia-mps"  # noqa: S108 - the path CUDA's MPS client looks in
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?\Z")
# Removed specs kept as files for the next writes (module doc): a burst of up to this many claims prepared
# at once (a kubelet starting many pods) then creates and frees no file; each costs ~2 KB of disk.
SPARES = 64


class CdiError(ValueError):
    """A spec could not be built or written."""


@dataclass(frozen=True)
class CdiKind:
    """One driver's CDI vendor and class."""

    vendor: str
    cls: str = CLASS

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{self.cls}"


GPU_CDI = CdiKind(VENDOR, CLASS)
CHANNEL_CDI = CdiKind("k8s.compute-domain.nvidia.com", CLASS)
NODE_CDI = CdiKind(VENDOR, "device")  # the node spec `gpu-dra cdi generate` prints (as nvidia-ctk's)


@dataclass
class DeviceNode:
    path: str  # in the container
    host_path: str
    type: str = ""  # "c" for a char device the runtime creates from major/minor
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "hostPath": self.host_path}
        if self.type:
            out["type"] = self.type
        if self.major is not None:
            out["major"] = self.major
        if self.minor is not None:
            out["minor"] = self.minor
        if self.file_mode is not None:
            out["fileMode"] = self.file_mode
        if self.permissions:
            out["permissions"] = self.permissions
        return out


@dataclass
class Mount:
    host_path: str
    container_path: str
    options: list[str] = field(default_factory=lambda: ["rw", "nosuid", "nodev", "bind"])

    def to_json(self) -> dict[str, Any]:
        return {"hostPath": self.host_path, "containerPath": self.container_path, "options": self.options}


READ_ONLY = ["ro", "nosuid", "nodev", "rbind", "rprivate"]  # driver files in a container (as the toolkit)


@dataclass
class Hook:
    """An OCI hook the runtime runs (e.g. `nvidia-cdi-hook update-ldcache`); args[0] is the program name."""

    path: str
    args: list[str]
    hook_name: str = "createContainer"
    env: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hookName": self.hook_name, "path": self.path, "args": list(self.args)}
        if self.env:
            out["env"] = list(self.env)
        return out


@dataclass
class ContainerEdits:
    """Spec-level edits: what every container that uses any device of the spec gets."""

    nodes: list[DeviceNode] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)
    hooks: list[Hook] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return _edits(self.nodes, list(dict.fromkeys(self.env)), self.mounts, self.hooks)


@dataclass
class CdiDevice:
    device: str  # canonical device name, e.g. gpu-0
    nodes: list[DeviceNode] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)


def gpu_device_nodes(minor: int, host_path: Callable[[str], str], caps: Sequence[str] = ()) -> list[DeviceNode]:
    """A GPU's device node (for a MIG device: its parent's) plus the MIG GI/CI capability nodes."""
    return [DeviceNode(p, host_path(p)) for p in (f"/dev/nvidia{minor}", *caps)]


def spec_file_name(claim_uid: str, cdi_kind: CdiKind = GPU_CDI) -> str:
    return f"{cdi_kind.vendor}-{cdi_kind.cls}_{claim_uid}.json".replace("/", "_")


def device_name(claim_uid: str, device: str) -> str:
    return f"{claim_uid}-{device}"


def device_id(claim_uid: str, device: str, cdi_kind: CdiKind = GPU_CDI) -> str:
    return f"{cdi_kind.kind}={device_name(claim_uid, device)}"


def mps_edits(pipe_dir: str, shm_dir: str) -> tuple[list[str], list[Mount]]:
    """Env and mounts a container needs to reach an MPS control daemon."""
    return (
        [f"CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_IN_CONTAINER}"],
        [Mount(pipe_dir, MPS_PIPE_IN_CONTAINER), Mount(shm_dir, "/dev/shm")],
    )


@functools.lru_cache(maxsize=256)  # a node's shares repeat few limits: built once, not per share's prepare
def mps_share_env(pinned_memory: int | None, active_thread_percentage: int | None) -> tuple[str, ...]:
    """A share's MPS client limits as env (NVIDIA's MPS client variables). The memory limit names the
    device by index, as NVIDIA's device plugin does (a limit keyed by UUID is not applied by every
    driver): a share's container reaches one GPU through its daemon, so it is device 0 there."""
    env = []
    if pinned_memory is not None:
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={max(1, pinned_memory >> 20)}M")
    if active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={active_thread_percentage}")
    return tuple(env)


def _edits(
    nodes: list[DeviceNode], env: list[str], mounts: list[Mount], hooks: list[Hook] | None = None
) -> dict[str, Any]:
    edits: dict[str, Any] = {}
    if env:
        edits["env"] = list(env)
    if nodes:
        edits["deviceNodes"] = [n.to_json() for n in nodes]
    if mounts:
        edits["mounts"] = [m.to_json() for m in mounts]
    if hooks:
        edits["hooks"] = [h.to_json() for h in hooks]
    return edits


def build_spec(
    claim_uid: str, devices: list[CdiDevice], common: ContainerEdits, cdi_kind: CdiKind = GPU_CDI
) -> dict[str, Any]:
    """The claim's CDI spec as a JSON-ready dict (validated like the CDI loader validates)."""
    if not devices:
        raise CdiError(f"claim {claim_uid} has no devices for a CDI spec")
    named = [CdiDevice(device_name(claim_uid, d.device), d.nodes, d.env, d.mounts) for d in devices]
    return _document(cdi_kind, named, common)


def common_digest(common: ContainerEdits) -> bytes:
    """A digest of spec-level edits, for `spec_digest` (kept by the caller while they are the same object)."""
    return hashlib.blake2b(msgspec.json.encode(common.to_json()), digest_size=16).digest()


def spec_digest(devices: list[CdiDevice], common: bytes, cdi_kind: CdiKind) -> str:
    """The name of the spec of `devices` with the spec-level edits of digest `common` (module doc): a digest of
    all that decides the spec's content (`build_spec(<digest>, devices, common edits, cdi_kind)`)."""
    h = hashlib.blake2b(cdi_kind.kind.encode(), digest_size=10)
    h.update(common)
    h.update(msgspec.json.encode([(d.device, _edits(d.nodes, d.env, d.mounts)) for d in devices]))
    return h.hexdigest()


def build_node_spec(devices: list[CdiDevice], common: ContainerEdits, cdi_kind: CdiKind = NODE_CDI) -> dict[str, Any]:
    """A node-wide spec whose device names are used as given (`0`, `GPU-<uuid>`, `0:1`, `all`)."""
    if not devices:
        raise CdiError("no devices for a CDI spec")
    return _document(cdi_kind, devices, common)


def _document(cdi_kind: CdiKind, devices: list[CdiDevice], common: ContainerEdits) -> dict[str, Any]:
    out_devices = []
    seen: set[str] = set()
    device_mounts: set[str] = set()
    for dev in devices:
        name = dev.device
        if not _NAME.match(name):
            raise CdiError(f"CDI device name {name!r} is not valid (letters, digits, _.:- inside)")
        if name in seen:
            continue
        seen.add(name)
        edits = _edits(dev.nodes, dev.env, dev.mounts)
        if not edits:
            raise CdiError(f"CDI device {name} would have no container edits")
        device_mounts.update(m.container_path for m in dev.mounts)
        out_devices.append({"name": name, "containerEdits": edits})
    spec: dict[str, Any] = {
        # 0.5.0: deviceNodes[].hostPath and device names that may start with a digit (claim UIDs).
        # Spec-level mounts and hooks exist since 0.3.0.
        "cdiVersion": "0.5.0",
        "kind": cdi_kind.kind,
        "devices": out_devices,
    }
    mounts = [m for m in common.mounts if m.container_path not in device_mounts]
    edits = ContainerEdits(common.nodes, common.env, mounts, common.hooks).to_json()
    if edits:
        spec["containerEdits"] = edits
    return spec


class CdiWriter:
    """Writes and removes per-claim specs, and the specs shares use together, in one CDI directory."""

    def __init__(self, cdi_dir: Path, cdi_kind: CdiKind = GPU_CDI, *, durable: bool = True) -> None:
        self.dir = Path(cdi_dir)
        self._dir = str(self.dir)
        self.cdi_kind = cdi_kind
        self.share_kind = CdiKind(cdi_kind.vendor, SHARE_CLASS)
        self.durable = durable  # False where the checkpoint's boot id makes a power loss moot (module doc)
        self._spares: list[Path] = []  # files of removed specs, refilled in place by the next writes
        prefix = spec_file_name("", cdi_kind)[: -len(".json")]  # the sweep's: it removes spares left by a crash
        self._shared_prefix = spec_file_name("", self.share_kind)[: -len(".json")]
        self._prefixes = {prefix: False, self._shared_prefix: True}  # -> whether its specs are shared (the sweep's)
        self._spare_names = [self.dir / f".{prefix}spare-{n}.tmp" for n in range(SPARES)]  # free ones: bounded

    def path_for(self, claim_uid: str) -> Path:
        return Path(self._file(claim_uid))

    def _file(self, claim_uid: str, cdi_kind: CdiKind | None = None) -> str:
        """The claim's spec file (or, with the share kind, a shared spec's by digest), as a str: pathlib interns
        each part of a path it parses (`sys.intern`), and a name per claim through it grows the interpreter's
        table of interned strings, which resizes (by ~1-2 MB) after some thousands of claims."""
        return os.path.join(self._dir, spec_file_name(claim_uid, cdi_kind or self.cdi_kind))

    def device_id(self, claim_uid: str, device: str) -> str:
        return device_id(claim_uid, device, self.cdi_kind)

    def shared_device_id(self, digest: str, device: str) -> str:
        return device_id(digest, device, self.share_kind)

    def shared_file_name(self, digest: str) -> str:
        return spec_file_name(digest, self.share_kind)

    def shared_digest(self, file_name: str) -> str:
        """The digest of a shared spec's file name (a record's `cdi_spec`); "" for any other name."""
        prefix = self._shared_prefix
        return file_name[len(prefix) : -len(".json")] if file_name.startswith(prefix) else ""

    def _write_sync(self, path: str, spec: dict[str, Any]) -> str:
        data = msgspec.json.format(msgspec.json.encode(spec), indent=2)
        try:
            return self._place(path, data)
        except FileNotFoundError:  # no CDI dir yet (or removed): made here, not checked on every write
            self.dir.mkdir(parents=True, exist_ok=True)
            return self._place(path, data)

    def _place(self, path: str, data: bytes) -> str:
        while not self.durable and self._spares:
            spare = self._spares.pop()
            try:
                fill_in_place(spare, data)
                os.replace(spare, path)
            except FileNotFoundError:
                self._spare_names.append(spare)
                continue  # removed by someone else: the next spare, or a new file
            except OSError:
                self._spares.append(spare)  # still a spare (its content is nobody's)
                raise
            self._spare_names.append(spare)
            return os.path.basename(path)
        atomic_write(path, data, sync_dir=self.durable, sync_file=self.durable)
        return os.path.basename(path)

    async def write(self, claim_uid: str, spec: dict[str, Any]) -> str:
        """Write the claim's spec; its file name in the CDI directory. Without fsync (`durable` False) it is a few KB
        into the page cache, a bounded step done on the event loop: cheaper than the hop to a worker thread and back."""
        return await self._write(self._file(claim_uid), spec, f"claim {claim_uid}")

    async def write_shared(self, digest: str, spec: dict[str, Any]) -> str:
        """Write a shared spec (`spec_digest`) as `write` does a claim's; its file name."""
        return await self._write(self._file(digest, self.share_kind), spec, f"shares ({digest})")

    async def _write(self, path: str, spec: dict[str, Any], what: str) -> str:
        try:
            if self.durable:
                return await asyncio.to_thread(self._write_sync, path, spec)
            return self._write_sync(path, spec)
        except OSError as exc:
            raise CdiError(f"cannot write CDI spec for {what} in {self.dir}: {exc}") from exc

    def _remove_sync(self, path: str) -> bool:
        with contextlib.suppress(FileNotFoundError):
            if self.durable or not self._spare_names:
                os.unlink(path)
                return True
            spare = self._spare_names.pop()
            try:
                os.replace(path, spare)
            except OSError:
                self._spare_names.append(spare)
                raise
            self._spares.append(spare)
            return True
        return False

    def _sweep_sync(self, keep: Set[str], keep_shared: Set[str]) -> list[str]:
        removed = []
        for prefix, shared in self._prefixes.items():
            for path in self.dir.glob(f"*{prefix}*"):
                name = path.name
                if name.startswith(prefix) and name.endswith(".json"):
                    key = name[len(prefix) : -len(".json")]
                elif name.startswith(f".{prefix}") and name.endswith(".tmp"):
                    key = ""  # a temp file a crash left mid-write
                else:
                    continue
                if key in (keep_shared if shared else keep):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(name)
        return removed

    async def sweep(self, keep: Set[str], keep_shared: Set[str] = frozenset()) -> list[str]:
        """At start: remove this kind's specs of claims not in `keep` (the checkpoint's), the shared specs whose
        digests are not in `keep_shared` (those its claims use), and temp files."""
        return await asyncio.to_thread(self._sweep_sync, keep, keep_shared)

    async def remove(self, claim_uid: str) -> bool:
        """Delete the claim's spec; an absent spec is fine. One unlink: bounded, done on the event loop."""
        return self._remove_sync(self._file(claim_uid))

    def remove_shared(self, digest: str) -> bool:
        """Delete a shared spec, at once (no await: `sharedspecs` decides and removes in one step)."""
        return self._remove_sync(self._file(digest, self.share_kind))
