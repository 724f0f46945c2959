"""Feature gates: the one registry of the driver's optional features, each with its stage and default.

Every service reads `--feature-gates Name=true,...` (env `GPU_DRA_FEATURE_GATES`) through the common
config (`shared/config.py`), which calls `parse` at start: an unknown gate, a value other than
true/false, a GA gate turned off, or a broken dependency stops the service with a message naming it.

    gates = cfg.gates                      # FeatureGates, parsed once per text
    if gates.enabled(DYNAMIC_MIG): ...

Gates named here with no consumer yet (VFIO passthrough, device metadata, NVLink partitions) are
registered so that settings naming them are accepted and listed by `gpu-dra features`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Literal

import msgspec
from prometheus_client import Gauge

Stage = Literal["Alpha", "Beta", "GA"]

DYNAMIC_MIG = "DynamicMIG"
CONSUMABLE_SHARES = "ConsumableShares"
PASSTHROUGH_SUPPORT = "PassthroughSupport"
DEVICE_METADATA = "DeviceMetadata"
FABRIC_MANAGER_PARTITIONING = "FabricManagerPartitioning"


class FeatureGateError(ValueError):
    """A `--feature-gates` value names an unknown gate, a bad value, or breaks a dependency."""


class Gate(msgspec.Struct, frozen=True, kw_only=True):
    """One gate: its stage, its default, what it needs on, and what it cannot run beside."""

    name: str
    stage: Stage
    default: bool
    description: str
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()


# Names and stages follow NVIDIA's driver where it has the feature. DynamicMIG and ConsumableShares are
# Beta and on by default here (NVIDIA: Alpha, off): both have run by default in this driver since they
# landed, and shares are offered only where a NodeConfig asks for them.
GATES: dict[str, Gate] = {
    g.name: g
    for g in (
        Gate(
            name=DYNAMIC_MIG,
            stage="Beta",
            default=True,
            description="partitionable GPUs whose MIG devices are created on prepare (publisher --mig-mode dynamic, "
            "NodeConfig mig: dynamic)",
        ),
        Gate(
            name=CONSUMABLE_SHARES,
            stage="Beta",
            default=True,
            description="GPUs offered as consumable shares (NodeConfig shares / mpsShares, KEP-5075)",
        ),
        Gate(
            name=PASSTHROUGH_SUPPORT,
            stage="Alpha",
            default=False,
            description=(
                "whole GPUs handed to VMs through vfio-pci (device class vfio.gpu.nvidia.com, VfioDeviceConfig)"
            ),
        ),
        Gate(
            name=DEVICE_METADATA,
            stage="Alpha",
            default=False,
            description="a JSON file per prepared request in the workload (UUID, PCI bus id, IOMMU group, MIG parent, "
            "share id; KEP-5304)",
        ),
        Gate(
            name=FABRIC_MANAGER_PARTITIONING,
            stage="Alpha",
            default=False,
            description="Fabric Manager NVLink partitions activated on prepare (shared NVSwitch mode)",
        ),
    )
}


class FeatureGates(Mapping[str, bool]):
    """Each registered gate's state: the defaults, overridden by what the setting names."""

    def __init__(self, overrides: Mapping[str, bool] | None = None, registry: Mapping[str, Gate] | None = None):
        self.registry = dict(GATES if registry is None else registry)
        self.overrides = dict(overrides or {})
        self._state = {name: self.overrides.get(name, gate.default) for name, gate in self.registry.items()}

    def enabled(self, name: str) -> bool:
        """Whether gate `name` is on; KeyError for a name the registry does not hold (a programming error)."""
        return self._state[name]

    def __getitem__(self, name: str) -> bool:
        return self._state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def text(self) -> str:
        """The overrides as a `--feature-gates` value (what another process needs to run the same way)."""
        return ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(self.overrides.items()))


def parse(text: str, registry: Mapping[str, Gate] | None = None) -> FeatureGates:
    """`Name=true,Other=false` -> FeatureGates; FeatureGateError naming the first thing wrong."""
    registry = GATES if registry is None else registry
    overrides: dict[str, bool] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            raise FeatureGateError(f"feature gate setting {item!r} is not Name=true|false")
        if name not in registry:
            raise FeatureGateError(f"unknown feature gate {name!r}; known: {', '.join(sorted(registry))}")
        if value.lower() not in ("true", "false"):
            raise FeatureGateError(f"feature gate {name}: value {value!r} is not true or false")
        if name in overrides:
            raise FeatureGateError(f"feature gate {name} is set twice")
        enabled = value.lower() == "true"
        gate = registry[name]
        if gate.stage == "GA" and not enabled:
            raise FeatureGateError(f"feature gate {name} is GA and always on; it cannot be turned off")
        overrides[name] = enabled
    gates = FeatureGates(overrides, registry)
    check_dependencies(gates)
    return gates


def check_dependencies(gates: FeatureGates) -> None:
    """FeatureGateError naming the first gate that is on while one it needs is off, or beside one it excludes."""
    for name, gate in gates.registry.items():
        if not gates.enabled(name):
            continue
        for needed in gate.requires:
            if not gates.enabled(needed):
                raise FeatureGateError(
                    f"feature gate {name} requires {needed} to be enabled too (set {needed}=true, or {name}=false)"
                )
        for other in gate.conflicts:
            if gates.enabled(other):
                raise FeatureGateError(
                    f"feature gates {name} and {other} cannot both be enabled (set {name}=false or {other}=false)"
                )


@functools.lru_cache(maxsize=32)
def parsed(text: str) -> FeatureGates:
    """`parse` of the registry's gates, once per distinct text (a config's `gates` property)."""
    return parse(text)


FEATURE_ENABLED = Gauge(
    "gpu_dra_feature_enabled", "1 while a feature gate is on in this process, else 0", ["name", "stage"]
)


def export(gates: FeatureGates) -> None:
    """Set `gpu_dra_feature_enabled{name,stage}` for every gate."""
    for name, gate in gates.registry.items():
        FEATURE_ENABLED.labels(name, gate.stage).set(1 if gates.enabled(name) else 0)
