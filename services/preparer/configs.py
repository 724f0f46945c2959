"""Opaque device configs for `gpu.nvidia.com` (`resource.nvidia.com/v1beta1`): types, strict decoding,
validation, and which config applies to which allocated device.

Owns the user-visible config rules: class configs before claim configs, later over earlier, a
config naming a request or its parent request (`req` matches `req/sub`), type compatibility
(GpuConfig -> full GPU, MigDeviceConfig -> MIG). An unknown field is an error naming it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

import msgspec

API_GROUP_VERSION = "resource.nvidia.com/v1beta1"
MIB = 1024 * 1024

Interval = Literal["Default", "Short", "Medium", "Long"]


class ConfigError(ValueError):
    """An opaque config is malformed or does not fit the device; the message says what to change."""


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class TimeSlicingConfig(_Strict):
    interval: Interval = "Default"


class MpsConfig(_Strict):
    defaultActiveThreadPercentage: int | None = None
    defaultPinnedDeviceMemoryLimit: str | None = None
    defaultPerDevicePinnedMemoryLimit: dict[str, str] = msgspec.field(default_factory=dict)


class GpuSharing(_Strict):
    strategy: str
    timeSlicingConfig: TimeSlicingConfig | None = None
    mpsConfig: MpsConfig | None = None


class MigSharing(_Strict):
    strategy: str
    mpsConfig: MpsConfig | None = None


class GpuConfig(_Strict):
    apiVersion: str = API_GROUP_VERSION
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing | None = None


class MigDeviceConfig(_Strict):
    apiVersion: str = API_GROUP_VERSION
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigSharing | None = None


DeviceConfig = GpuConfig | MigDeviceConfig
_KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig]] = {"GpuConfig": GpuConfig, "MigDeviceConfig": MigDeviceConfig}
_DEVICE_KIND = {"GpuConfig": "gpu", "MigDeviceConfig": "mig"}
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?")
_AT = re.compile(r"^(.*) - at `\$\.?([^`]*)`$")


def _explain(exc: msgspec.ValidationError, kind: str) -> str:
    text = str(exc)
    m = _UNKNOWN_FIELD.match(text)
    if m:
        path = ".".join(p for p in (m.group(2) or "", m.group(1)) if p)
        return f'strict decoding error: unknown field "{path}" in {kind}'
    m = _AT.match(text)
    if m:
        return f"invalid {kind}: {m.group(1)} at field \"{m.group(2)}\""
    return f"invalid {kind}: {text}"


def decode_config(parameters: Any) -> DeviceConfig:
    """Strictly decode one opaque `parameters` object (already parsed JSON) and validate it."""
    if not isinstance(parameters, dict):
        raise ConfigError(f"opaque parameters must be an object with apiVersion and kind, got {type(parameters).__name__}")
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != API_GROUP_VERSION:
        raise ConfigError(f"unsupported opaque config apiVersion {api_version!r}; use {API_GROUP_VERSION!r}")
    cls = _KINDS.get(str(kind))
    if cls is None:
        raise ConfigError(f"unknown opaque config kind {kind!r}; supported: {', '.join(_KINDS)}")
    try:
        config = msgspec.convert(parameters, cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, str(kind))) from None
    validate(config)
    return config


def parse_quantity(text: str) -> int:
    """A Kubernetes resource quantity ("1Gi", "512M", "1.5G", "1e9") in bytes."""
    m = re.fullmatch(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?\s*", text)
    if not m:
        raise ConfigError(f"invalid memory quantity {text!r}; use e.g. 512Mi, 2Gi or 1G")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ConfigError(f"invalid memory quantity {text!r}") from None
    suffix = m.group(2) or ""
    factor = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
              "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}[suffix]
    return int(number * factor)


def _pinned_limit(text: str, where: str) -> int:
    """Normalised like upstream: whole MiB, and more than zero."""
    mib = parse_quantity(text) // MIB
    if mib <= 0:
        raise ConfigError(f"{where}: pinned memory limit {text!r} must be at least 1Mi")
    return mib * MIB


def _validate_mps(mps: MpsConfig, where: str) -> None:
    pct = mps.defaultActiveThreadPercentage
    if pct is not None and not 0 <= pct <= 100:
        raise ConfigError(f"{where}.mpsConfig.defaultActiveThreadPercentage must be within 0..100, got {pct}")
    if mps.defaultPinnedDeviceMemoryLimit is not None:
        _pinned_limit(mps.defaultPinnedDeviceMemoryLimit, f"{where}.mpsConfig.defaultPinnedDeviceMemoryLimit")
    for key, value in mps.defaultPerDevicePinnedMemoryLimit.items():
        _pinned_limit(value, f"{where}.mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]")


def validate(config: DeviceConfig) -> None:
    sharing = config.sharing
    if sharing is None:
        return
    if sharing.strategy not in ("TimeSlicing", "MPS"):
        raise ConfigError(f"unknown GPU sharing strategy: {sharing.strategy!r}; use TimeSlicing or MPS")
    if sharing.strategy == "TimeSlicing" and sharing.mpsConfig is not None:
        raise ConfigError("cannot use MpsConfig with the 'TimeSlicing' strategy")
    if isinstance(sharing, GpuSharing) and sharing.strategy == "MPS" and sharing.timeSlicingConfig is not None:
        raise ConfigError("cannot use TimeSlicingConfig with the 'MPS' strategy")
    if sharing.mpsConfig is not None:
        _validate_mps(sharing.mpsConfig, "sharing")


def strategy(config: DeviceConfig) -> str:
    return config.sharing.strategy if config.sharing is not None else ""


def interval(config: DeviceConfig) -> Interval:
    if isinstance(config, GpuConfig) and config.sharing and config.sharing.strategy == "TimeSlicing":
        return config.sharing.timeSlicingConfig.interval if config.sharing.timeSlicingConfig else "Default"
    return "Default"


def pinned_limits(mps: MpsConfig | None, uuids: list[str]) -> dict[str, int]:
    """Per-GPU pinned memory limits in bytes; keys are UUIDs of the group or indexes into its sorted UUIDs."""
    if mps is None:
        return {}
    ordered = sorted(uuids)
    limits: dict[str, int] = {}
    if mps.defaultPinnedDeviceMemoryLimit is not None:
        value = _pinned_limit(mps.defaultPinnedDeviceMemoryLimit, "defaultPinnedDeviceMemoryLimit")
        limits = dict.fromkeys(ordered, value)
    for key, text in mps.defaultPerDevicePinnedMemoryLimit.items():
        if key in ordered:
            uuid = key
        elif key.isdigit() and int(key) < len(ordered):
            uuid = ordered[int(key)]
        else:
            raise ConfigError(f"defaultPerDevicePinnedMemoryLimit key {key!r} is neither a UUID of the claim's "
                              f"devices nor an index below {len(ordered)}")
        limits[uuid] = _pinned_limit(text, f"defaultPerDevicePinnedMemoryLimit[{key}]")
    return limits


def mps_daemon_id(claim_uid: str, uuids: list[str]) -> str:
    digest = hashlib.sha256(",".join(sorted(uuids)).encode()).hexdigest()[:5]
    return f"{claim_uid}-{digest}"


# -- selection ------------------------------------------------------------------------------

class RawConfig(msgspec.Struct, kw_only=True):
    """A `status.allocation.devices.config[]` entry as the claim carries it."""

    source: str = "FromClaim"
    requests: list[str] = msgspec.field(default_factory=list)
    driver: str = ""
    parameters: Any = None
    has_opaque: bool = True


@dataclass
class Selected:
    """One config object and the allocation results (by index) it applies to."""

    config: DeviceConfig
    results: list[int] = field(default_factory=list)
    explicit: bool = True  # False for the built-in default


def _matches(names: list[str], request: str) -> bool:
    parent = request.split("/", 1)[0]
    return request in names or parent in names


def select(driver: str, entries: list[RawConfig], results: list[tuple[str, str]]) -> list[Selected]:
    """Configs for our `results` (request name, device kind "gpu"|"mig"), grouped by config object.

    Raises ConfigError for a config that does not decode or a request-named config that does not
    fit its device's type.
    """
    ordered = [e for e in entries if e.source == "FromClass"] + [e for e in entries if e.source != "FromClass"]
    decoded: list[tuple[list[str], DeviceConfig, bool]] = [
        ([], MigDeviceConfig(), False), ([], GpuConfig(), False)]  # defaults: lowest precedence
    for position, entry in enumerate(ordered):
        if not entry.has_opaque:
            raise ConfigError("only opaque parameters are supported by this driver (config entry "
                              f"{position} has no 'opaque')")
        if entry.driver != driver:
            continue
        try:
            decoded.append((entry.requests, decode_config(entry.parameters), True))
        except ConfigError as exc:
            where = f"{entry.source} config for requests {entry.requests}" if entry.requests else f"{entry.source} config"
            raise ConfigError(f"{where}: {exc}") from None
    groups: dict[int, Selected] = {}
    for index, (request, device_kind) in enumerate(results):
        chosen: tuple[list[str], DeviceConfig, bool] | None = None
        for names, config, explicit in reversed(decoded):
            if names and _matches(names, request):
                if _DEVICE_KIND[config.kind] != device_kind:
                    raise ConfigError(f"cannot apply {config.kind} to request {request!r}: its device is of type "
                                      f"{device_kind!r} (use {'GpuConfig' if device_kind == 'gpu' else 'MigDeviceConfig'})")
                chosen = (names, config, explicit)
                break
        if chosen is None:
            for names, config, explicit in reversed(decoded):
                if not names and _DEVICE_KIND[config.kind] == device_kind:
                    chosen = (names, config, explicit)
                    break
        assert chosen is not None  # the defaults cover both kinds
        group = groups.setdefault(id(chosen[1]), Selected(config=chosen[1], explicit=chosen[2]))
        group.results.append(index)
    return list(groups.values())
