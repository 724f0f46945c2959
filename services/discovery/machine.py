"""Simulated machine descriptions: `--simulate` specs (`h100x4+l40sx2`, `a100-40gbx8:mig`) and YAML machine files.

Owns parsing and validation only; the simulated NVML turns a MachineSpec into devices.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import yaml

from services.discovery import profiles
from shared.numbers import decimal_int


class MachineError(ValueError):
    """A simulate spec or machine file was malformed; the message names the valid choices."""


class MigDeviceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A MIG device to pre-create: a profile name from the GPU's table at a placement start."""

    profile: str
    placement: int


class FabricSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster_uuid: str = profiles.DEFAULT_CLUSTER_UUID
    clique_id: int = profiles.DEFAULT_CLIQUE_ID


class GpuSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One simulated GPU (or `count` identical ones)."""

    profile: str
    count: int = 1
    mig_enabled: bool = False
    mig_devices: list[MigDeviceSpec] = msgspec.field(default_factory=list)
    fabric: FabricSpec | None = None  # defaults to the simulated rack for fabric-capable profiles
    clique_id: int | None = None  # shorthand for fabric.clique_id


class MachineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A whole simulated node."""

    gpus: list[GpuSpec]
    driver_version: str | None = None  # defaults to the first GPU profile's driver
    cuda_version: str | None = None  # "12.4"

    def expanded(self) -> list[GpuSpec]:
        """One GpuSpec per physical GPU, in index order."""
        out: list[GpuSpec] = []
        for g in self.gpus:
            out.extend([msgspec.structs.replace(g, count=1)] * g.count)
        return out

    def fingerprint(self) -> str:
        return msgspec.json.encode(self).decode()


_PART = re.compile(r"^(?P<profile>[a-z0-9.\-]+?)(?:x(?P<count>\d+))?(?::(?P<opts>[a-z0-9=,]+))?\Z", re.ASCII)
MAX_GPUS = 16


def parse_spec(spec: str) -> MachineSpec:
    """Parse `h100x8`, `a100-40gbx8:mig`, `gb200x4:clique=7`, `h100x4+l40sx2`."""
    gpus: list[GpuSpec] = []
    text = spec.strip().lower()
    if not text:
        raise MachineError(f"empty --simulate spec; use e.g. h100x8 (profiles: {', '.join(profiles.choices())})")
    for part in text.split("+"):
        m = _PART.match(part.strip())
        if not m:
            raise MachineError(
                f"malformed --simulate part {part!r}: use <profile>x<count>[:mig][,clique=N], "
                f"profiles: {', '.join(profiles.choices())}"
            )
        mig = False
        clique: int | None = None
        for opt in filter(None, (m.group("opts") or "").split(",")):
            if opt == "mig":
                mig = True
            elif opt.startswith("clique="):
                value = opt.split("=", 1)[1]
                number = decimal_int(value)
                if number is None:
                    raise MachineError(f"clique={value!r} in {part!r}: the clique is a number, e.g. clique=7")
                clique = number
            else:
                raise MachineError(f"unknown --simulate option {opt!r} in {part!r}; valid: mig, clique=N")
        gpus.append(
            GpuSpec(profile=m.group("profile"), count=int(m.group("count") or 1), mig_enabled=mig, clique_id=clique)
        )
    machine = MachineSpec(gpus=gpus)
    validate(machine)
    return machine


def load_file(path: str | Path) -> MachineSpec:
    """Load a YAML machine file (see docs/discovery.md for the format)."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise MachineError(f"cannot read machine file {p}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise MachineError(f"machine file {p} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise MachineError(f"machine file {p} must be a mapping with a 'gpus' list")
    try:
        machine = msgspec.convert(raw, MachineSpec, strict=False)
    except msgspec.ValidationError as exc:
        raise MachineError(
            f"machine file {p}: {exc}; expected keys: gpus[] (profile, count, mig_enabled, "
            f"mig_devices[{{profile, placement}}], fabric{{cluster_uuid, clique_id}}, clique_id), "
            f"driver_version, cuda_version"
        ) from exc
    validate(machine, source=str(p))
    return machine


def validate(machine: MachineSpec, source: str = "--simulate") -> None:
    """Check profiles, counts and MIG layouts; raise MachineError naming what is valid."""
    if not machine.gpus:
        raise MachineError(f"{source}: no GPUs given")
    total = 0
    for g in machine.gpus:
        try:
            prof = profiles.lookup(g.profile)
        except KeyError as exc:
            raise MachineError(f"{source}: {exc.args[0]}") from None
        if g.count < 1:
            raise MachineError(f"{source}: count for {g.profile} must be >= 1")
        total += g.count
        if (g.mig_enabled or g.mig_devices) and not prof.mig_capable:
            capable = [k for k, p in profiles.PROFILES.items() if p.mig_capable]
            raise MachineError(f"{source}: {prof.product_name} is not MIG-capable; MIG-capable: {', '.join(capable)}")
        if g.mig_devices and not g.mig_enabled:
            raise MachineError(f"{source}: {g.profile} lists mig_devices but mig_enabled is false")
        used: set[int] = set()
        by_name = {m.name: m for m in prof.mig}
        for dev in g.mig_devices:
            mp = by_name.get(dev.profile)
            if mp is None:
                raise MachineError(
                    f"{source}: MIG profile {dev.profile!r} does not exist on {prof.product_name}; "
                    f"valid: {', '.join(by_name)}"
                )
            if dev.placement not in mp.starts:
                raise MachineError(
                    f"{source}: placement {dev.placement} is not valid for {dev.profile} on "
                    f"{prof.product_name}; valid starts: {list(mp.starts)}"
                )
            span = set(range(dev.placement, dev.placement + mp.size))
            if span & used:
                raise MachineError(f"{source}: MIG device {dev.profile}@{dev.placement} overlaps another one")
            used |= span
    if total > MAX_GPUS:
        raise MachineError(f"{source}: {total} GPUs is more than the {MAX_GPUS} a node may simulate")
    if machine.driver_version is not None and not re.match(r"^\d+\.\d+(\.\d+)?\Z", machine.driver_version, re.ASCII):
        raise MachineError(f"{source}: driver_version {machine.driver_version!r} must look like 550.163.01")
    if machine.cuda_version is not None and not re.match(r"^\d+\.\d+\Z", machine.cuda_version, re.ASCII):
        raise MachineError(f"{source}: cuda_version {machine.cuda_version!r} must look like 12.4")
