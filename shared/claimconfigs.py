"""Opaque device configs for `gpu.nvidia.com` (`resource.nvidia.com/v1beta1`): types, strict decoding,
validation, and which config applies to which allocated device.

Owns the user-visible config rules: class configs before claim configs, later over earlier, a
config naming a request or its parent request (`req` matches `req/sub`), type compatibility
(GpuConfig -> full GPU, MigDeviceConfig -> MIG, VfioDeviceConfig -> VFIO passthrough GPU). An unknown field is an error
naming it.

Owns the input limits of opaque configs too (docs/security.md, "Input limits"), all checked before
any work that grows with the input: parameters at most `MAX_PARAMETERS_BYTES` of JSON, at most
`MAX_CONFIGS` config entries per claim and `MAX_REQUESTS_PER_CONFIG` request names per entry,
quantities through the bounded `shared.quantity` parser, a pinned-memory limit at most the GPU's
memory, an active-thread percentage within 0..100, an interval one of the four names.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from shared import featuregates
from shared.numbers import decimal_int
from shared.quantity import MAX_VALUE, QuantityError, parse_bytes, parse_quantity

API_GROUP_VERSION = "resource.nvidia.com/v1beta1"
MIB = 1024 * 1024
# Upstream limits of resource.k8s.io (opaque parameters <= 10 KiB, <= 64 allocation configs, <= 32
# requests), enforced here too: a claim written to another API server, or an old one, gets no further.
MAX_PARAMETERS_BYTES = 10 * 1024
MAX_CONFIGS = 64
MAX_REQUESTS_PER_CONFIG = 32

Interval = Literal["Default", "Short", "Medium", "Long"]
INTERVALS = ("Default", "Short", "Medium", "Long")


class ClaimConfigError(ValueError):
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


IommuBackendPolicy = Literal["LegacyOnly", "PreferIommuFD"]


class IommuConfig(_Strict):
    """NVIDIA's `iommu` of a VfioDeviceConfig: which IOMMU interface the workload gets."""

    backendPolicy: IommuBackendPolicy = "LegacyOnly"  # noqa: N815 - PreferIommuFD: iommufd when the node has it
    enableAPIDevice: bool = False  # noqa: N815 - also /dev/vfio/vfio (legacy) or /dev/iommu (iommufd)


class VfioDeviceConfig(_Strict):
    apiVersion: str = API_GROUP_VERSION
    kind: Literal["VfioDeviceConfig"] = "VfioDeviceConfig"
    iommu: IommuConfig | None = None

    @property
    def sharing(self) -> None:
        """A passthrough GPU is never shared."""
        return None


DeviceConfig = GpuConfig | MigDeviceConfig | VfioDeviceConfig
_KINDS: dict[str, type[DeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
    "VfioDeviceConfig": VfioDeviceConfig,
}
_DEVICE_KIND = {"GpuConfig": "gpu", "MigDeviceConfig": "mig", "VfioDeviceConfig": "vfio"}
_CONFIG_FOR_KIND = {kind: name for name, kind in _DEVICE_KIND.items()}
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?")
_AT = re.compile(r"^(.*) - at `\$\.?([^`]*)`\Z")


_LONG_VALUE = re.compile(r"'([^']{40})[^']{8,}'")


def _explain(exc: msgspec.ValidationError, kind: str) -> str:
    text = _LONG_VALUE.sub(lambda m: f"'{m.group(1)}...'", str(exc))  # an input value is never echoed whole
    if text.startswith("Invalid enum value") and text.endswith("interval`"):
        return f'invalid {kind}: field "sharing.timeSlicingConfig.interval" must be one of {", ".join(INTERVALS)}'
    if text.startswith("Invalid enum value") and text.endswith("backendPolicy`"):
        return f'invalid {kind}: field "iommu.backendPolicy" must be one of LegacyOnly, PreferIommuFD'
    m = _UNKNOWN_FIELD.match(text)
    if m:
        path = ".".join(p for p in (m.group(2) or "", m.group(1)) if p)
        path = path if len(path) <= 80 else f"{path[:60]}... ({len(path)} characters)"
        return f'strict decoding error: unknown field "{path}" in {kind}'
    m = _AT.match(text)
    if m:
        return f'invalid {kind}: {m.group(1)} at field "{m.group(2)}"'
    return f"invalid {kind}: {text}"


def parameters_size(parameters: Any) -> int:
    """Bytes of `parameters` as compact JSON; ClaimConfigError for what JSON cannot hold or nests too deeply."""
    try:
        return len(msgspec.json.encode(parameters))
    except RecursionError:
        raise ClaimConfigError("opaque parameters nest too deeply; a config is a few levels of objects") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise ClaimConfigError(f"opaque parameters are not JSON: {exc}") from None


def decode_config(parameters: Any) -> DeviceConfig:
    """Strictly decode one opaque `parameters` object (already parsed JSON) and validate it."""
    if not isinstance(parameters, dict):
        raise ClaimConfigError(
            f"opaque parameters must be an object with apiVersion and kind, got {type(parameters).__name__}"
        )
    size = parameters_size(parameters)
    if size > MAX_PARAMETERS_BYTES:
        raise ClaimConfigError(
            f"opaque parameters are {size} bytes of JSON, more than the {MAX_PARAMETERS_BYTES} allowed"
        )
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != API_GROUP_VERSION:
        raise ClaimConfigError(f"unsupported opaque config apiVersion {_short(api_version)}; use {API_GROUP_VERSION!r}")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ClaimConfigError(f"unknown opaque config kind {_short(kind)}; supported: {', '.join(_KINDS)}")
    try:
        config = msgspec.convert(parameters, cls)
    except msgspec.ValidationError as exc:
        raise ClaimConfigError(_explain(exc, str(kind))) from None
    validate(config)
    return config


def _short(value: Any) -> str:
    """`value` for an error message, clipped: an input is never echoed whole."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit
        return "a very large number"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _pinned_limit(text: str, where: str, maximum: int = MAX_VALUE) -> int:
    """Normalised like upstream: whole MiB, and more than zero; at most `maximum` bytes (the GPU's memory)."""
    try:
        mib = parse_bytes(text, what="pinned memory limit", maximum=maximum) // MIB
    except QuantityError as exc:
        raise ClaimConfigError(f"{where}: {exc}") from None
    if mib <= 0:
        raise ClaimConfigError(f"{where}: pinned memory limit {text!r} must be at least 1Mi")
    return mib * MIB


def _validate_mps(mps: MpsConfig, where: str) -> None:
    pct = mps.defaultActiveThreadPercentage
    if pct is not None and not 0 <= pct <= 100:
        shown = pct if abs(pct) < 10**6 else "a larger number"
        raise ClaimConfigError(f"{where}.mpsConfig.defaultActiveThreadPercentage must be within 0..100, got {shown}")
    if mps.defaultPinnedDeviceMemoryLimit is not None:
        _pinned_limit(mps.defaultPinnedDeviceMemoryLimit, f"{where}.mpsConfig.defaultPinnedDeviceMemoryLimit")
    for key, value in mps.defaultPerDevicePinnedMemoryLimit.items():
        _pinned_limit(value, f"{where}.mpsConfig.defaultPerDevicePinnedMemoryLimit[{_short(key)}]")


def validate(config: DeviceConfig) -> None:
    sharing = config.sharing
    if sharing is None:
        return
    if sharing.strategy not in ("TimeSlicing", "MPS"):
        raise ClaimConfigError(f"unknown GPU sharing strategy: {_short(sharing.strategy)}; use TimeSlicing or MPS")
    if sharing.strategy == "TimeSlicing" and sharing.mpsConfig is not None:
        raise ClaimConfigError("cannot use MpsConfig with the 'TimeSlicing' strategy")
    if isinstance(sharing, GpuSharing) and sharing.strategy == "MPS" and sharing.timeSlicingConfig is not None:
        raise ClaimConfigError("cannot use TimeSlicingConfig with the 'MPS' strategy")
    if sharing.mpsConfig is not None:
        _validate_mps(sharing.mpsConfig, "sharing")


def strategy(config: DeviceConfig) -> str:
    return config.sharing.strategy if config.sharing is not None else ""


def interval(config: DeviceConfig) -> Interval:
    if isinstance(config, GpuConfig) and config.sharing and config.sharing.strategy == "TimeSlicing":
        return config.sharing.timeSlicingConfig.interval if config.sharing.timeSlicingConfig else "Default"
    return "Default"


def pinned_limits(mps: MpsConfig | None, uuids: list[str], memory: dict[str, int] | None = None) -> dict[str, int]:
    """Per-GPU pinned memory limits in bytes; keys are UUIDs of the group or indexes into its sorted UUIDs.

    `memory` is each GPU's memory in bytes (from the inventory): no limit may exceed its GPU's memory.
    """
    if mps is None:
        return {}
    ordered = sorted(uuids)
    memory = memory or {}
    limits: dict[str, int] = {}
    if mps.defaultPinnedDeviceMemoryLimit is not None:
        for uuid in ordered:
            limits[uuid] = _pinned_limit(
                mps.defaultPinnedDeviceMemoryLimit, "defaultPinnedDeviceMemoryLimit", memory.get(uuid) or MAX_VALUE
            )
    for key, text in mps.defaultPerDevicePinnedMemoryLimit.items():
        if key in ordered:
            uuid = key
        elif (index := decimal_int(key)) is not None and index < len(ordered):
            uuid = ordered[index]
        else:
            raise ClaimConfigError(
                f"defaultPerDevicePinnedMemoryLimit key {_short(key)} is neither a UUID of the claim's "
                f"devices nor an index below {len(ordered)}"
            )
        limits[uuid] = _pinned_limit(text, f"defaultPerDevicePinnedMemoryLimit[{uuid}]", memory.get(uuid) or MAX_VALUE)
    return limits


def mps_daemon_id(claim_uid: str, uuids: list[str]) -> str:
    digest = hashlib.sha256(",".join(sorted(uuids)).encode()).hexdigest()[:5]
    return f"{claim_uid}-{digest}"


@functools.lru_cache(maxsize=1024)  # a node's GPUs: a hash per GPU, not per share's prepare
def share_daemon_id(gpu_uuid: str) -> str:
    """The id of a GPU's one MPS daemon serving all its shares (KEP-5075): named by the GPU, not a claim."""
    return f"gpu-{hashlib.sha256(gpu_uuid.encode()).hexdigest()[:12]}"


# A share consuming `compute` is served through MPS: only a GPU in mpsShares publishes it (the publisher's
# shares.py). A share consuming only `memory` and/or `shares` (NodeConfig `shares`, NVIDIA's
# --consumable-shares) is a plain share: prepared like a shared GPU, with nothing enforced.
SHARE_MPS_CAPACITIES = ("compute",)


@dataclass(frozen=True)
class ShareLimits:
    """What a share's consumedCapacity limits for its MPS clients: pinned memory (bytes), SM percent."""

    memory: int | None = None
    compute: int | None = None


def share_limits(consumed: dict[str, str], gpu_memory: int = 0) -> ShareLimits:
    """The MPS client limits of a share's consumedCapacity (`memory` in bytes, whole MiB, at most the GPU's
    memory; `compute` a percent of the SMs, 1..100); ClaimConfigError naming a value that does not fit.
    `memory: 0` (a claim naming no amount under `memoryDefault: none`, NVIDIA's unlimited and integer
    modes) reserves no memory, so it sets no client memory limit: the daemon's default applies."""
    memory, compute = consumed.get("memory"), consumed.get("compute")
    return _share_limits(None if memory is None else str(memory), None if compute is None else str(compute), gpu_memory)


@functools.lru_cache(maxsize=1024)  # a node's shares repeat few sizes: parsed once, not per share's prepare
def _share_limits(memory_text: str | None, compute_text: str | None, gpu_memory: int) -> ShareLimits:
    memory = compute = None
    if memory_text is not None and not _is_zero(memory_text):
        memory = _pinned_limit(memory_text, "consumedCapacity memory", gpu_memory or MAX_VALUE)
    if compute_text is not None:
        try:
            value = parse_quantity(compute_text)
        except QuantityError as exc:
            raise ClaimConfigError(f"consumedCapacity compute: {exc}") from None
        if value.denominator != 1 or not 1 <= value <= 100:
            raise ClaimConfigError(
                f"consumedCapacity compute {_short(compute_text)} must be a whole "
                "percent of the GPU's SMs within 1..100"
            )
        compute = int(value)
    return ShareLimits(memory=memory, compute=compute)


def _is_zero(text: str) -> bool:
    try:
        return parse_quantity(text) == 0
    except QuantityError:
        return False  # _pinned_limit names the bad value


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


def _mismatch(config: DeviceConfig, request: str, device_kind: str) -> str:
    """Why `config` cannot apply to a device of `device_kind`, naming the config type that would."""
    text = (
        f"cannot apply {config.kind} to request {request!r}: its device is of type {device_kind!r} "
        f"(use {_CONFIG_FOR_KIND.get(device_kind, 'no config')})"
    )
    if device_kind == "vfio" and config.sharing is not None:
        text += (
            f'; field "sharing.strategy": {_short(config.sharing.strategy)} sharing does not apply to a GPU '
            "passed through to a VM, which is handed over whole"
        )
    return text


def check_gates(device_kind: str, *, share: bool, dynamic_mig: bool, enabled: Callable[[str], bool]) -> None:
    """ClaimConfigError when a device needs a feature whose gate is off (`enabled(name)` says which are on):
    a VFIO device (PassthroughSupport), a share (ConsumableShares), a dynamic MIG device (DynamicMIG)."""
    needs = [
        (device_kind == "vfio", featuregates.PASSTHROUGH_SUPPORT, "VFIO (passthrough) devices"),
        (share, featuregates.CONSUMABLE_SHARES, "consumable shares"),
        (dynamic_mig, featuregates.DYNAMIC_MIG, "dynamic MIG devices"),
    ]
    for needed, gate, what in needs:
        if needed and not enabled(gate):
            raise ClaimConfigError(f"{what} are turned off here (feature gate {gate}=false)")


def _matches(names: list[str], request: str) -> bool:
    parent = request.split("/", 1)[0]
    return request in names or parent in names


def select(driver: str, entries: list[RawConfig], results: list[tuple[str, str]]) -> list[Selected]:
    """Configs for our `results` (request name, device kind "gpu"|"mig"|"vfio"), grouped by config object.

    Raises ClaimConfigError for a config that does not decode or a request-named config that does not
    fit its device's type.
    """
    if len(entries) > MAX_CONFIGS:
        raise ClaimConfigError(f"the claim carries {len(entries)} config entries, more than the {MAX_CONFIGS} allowed")
    for position, entry in enumerate(entries):
        if len(entry.requests) > MAX_REQUESTS_PER_CONFIG:
            raise ClaimConfigError(
                f"config entry {position} names {len(entry.requests)} requests, more than the "
                f"{MAX_REQUESTS_PER_CONFIG} allowed"
            )
    ordered = [e for e in entries if e.source == "FromClass"] + [e for e in entries if e.source != "FromClass"]
    decoded: list[tuple[list[str], DeviceConfig, bool]] = [
        ([], VfioDeviceConfig(), False),
        ([], MigDeviceConfig(), False),
        ([], GpuConfig(), False),
    ]  # defaults
    for position, entry in enumerate(ordered):
        if not entry.has_opaque:
            raise ClaimConfigError(
                f"only opaque parameters are supported by this driver (config entry {position} has no 'opaque')"
            )
        if entry.driver != driver:
            continue
        try:
            decoded.append((entry.requests, decode_config(entry.parameters), True))
        except ClaimConfigError as exc:
            where = (
                f"{_short(entry.source)} config for requests {_short(entry.requests)}"
                if entry.requests
                else f"{_short(entry.source)} config"
            )
            raise ClaimConfigError(f"{where}: {exc}") from None
    groups: dict[int, Selected] = {}
    for index, (request, device_kind) in enumerate(results):
        chosen: tuple[list[str], DeviceConfig, bool] | None = None
        for names, config, explicit in reversed(decoded):
            if names and _matches(names, request):
                if _DEVICE_KIND[config.kind] != device_kind:
                    raise ClaimConfigError(_mismatch(config, request, device_kind))
                chosen = (names, config, explicit)
                break
        if chosen is None:
            for names, config, explicit in reversed(decoded):
                if not names and _DEVICE_KIND[config.kind] == device_kind:
                    chosen = (names, config, explicit)
                    break
        if chosen is None:  # a kind no config type covers: nothing to apply
            continue
        group = groups.setdefault(id(chosen[1]), Selected(config=chosen[1], explicit=chosen[2]))
        group.results.append(index)
    return list(groups.values())
