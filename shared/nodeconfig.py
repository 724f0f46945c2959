"""NodeConfig: how each node pool's GPUs are shared, as one typed object (the `NodeConfig` CRD's spec).

Owns the rule types, their validation (msgspec types, then cross-field checks that name the field),
rule matching and precedence, and the effective setting per GPU (`resolve`, a pure function). The
publisher turns an effective setting into what a device offers (`services.publisher.shares`); the
preparer will read the same types to set a GPU up.

Precedence: every rule whose node selector matches the node's labels and whose GPU selector matches
the GPU applies; the most specific one decides. Specificity is the number of selector terms: each
`matchLabels` entry, each `matchExpressions` entry, and each GPU constraint (`productName`,
`architecture`, `memory.min`, `memory.max`) counts one. On a tie the earlier rule wins. The winning
rule decides the GPU's whole setting; what it leaves unset takes the built-in default, never a value
from a less specific rule, so one rule explains the result.

Several NodeConfig objects (the publisher watches them all; `services.publisher.nodeconfigs`) combine
into one config by `merge`: every object's rules, the objects in name order, each rule renamed
`<object>/<rule>` (rule names stay unique). Precedence then works on the merged list as above: the
most specific rule wins; on a tie the rule of the object whose name sorts first, then the earlier
rule in it. Each object is validated on its own; a refused one contributes its last accepted rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from shared.events.inventory import Gpu
from shared.quantity import QuantityError, parse_bytes

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "NodeConfig"

Sharing = Literal["exclusive", "timeSlicing", "mpsShares", "shares"]
MigPolicy = Literal["none", "static", "dynamic"]
TimeSliceInterval = Literal["Default", "Short", "Medium", "Long"]
TaintEffect = Literal["NoSchedule", "NoExecute"]
MemoryDefault = Literal["step", "all", "none"]
Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]

MIB = 1 << 20
DEFAULT_MEMORY_STEP = "1Mi"  # NVIDIA's ConsumableShares granularity
DEFAULT_COMPUTE_STEP = 10
MAX_VALID_VALUES = 10  # the API's limit on a capacity's validValues (CapacityRequestPolicyDiscreteMaxOptions)
SHARED_MODES = ("mpsShares", "shares")


class NodeConfigError(ValueError):
    """A NodeConfig that cannot be used; the message names the field (`spec.rules[1].memoryStep`)."""


class SelectorRequirement(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    key: str
    operator: Operator
    values: list[str] = msgspec.field(default_factory=list)


class LabelSelector(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A Kubernetes label selector (metav1.LabelSelector)."""

    matchLabels: dict[str, str] = msgspec.field(default_factory=dict)  # noqa: N815
    matchExpressions: list[SelectorRequirement] = msgspec.field(default_factory=list)  # noqa: N815

    def terms(self) -> int:
        return len(self.matchLabels) + len(self.matchExpressions)

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.matchLabels.items()):
            return False
        for req in self.matchExpressions:
            present = req.key in labels
            if req.operator == "In" and not (present and labels[req.key] in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


class MemoryRange(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    min: str | None = None
    max: str | None = None


class GpuSelector(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """GPU attributes a rule applies to; every given one must match."""

    productName: str | None = None  # noqa: N815
    architecture: str | None = None
    memory: MemoryRange | None = None

    def terms(self) -> int:
        mem = self.memory or MemoryRange()
        return sum(x is not None for x in (self.productName, self.architecture, mem.min, mem.max))

    def matches(self, gpu: Gpu) -> bool:
        if self.productName is not None and gpu.product_name != self.productName:
            return False
        if self.architecture is not None and gpu.architecture != self.architecture:
            return False
        if self.memory is not None:
            if self.memory.min is not None and gpu.memory_bytes < parse_bytes(self.memory.min):
                return False
            if self.memory.max is not None and gpu.memory_bytes > parse_bytes(self.memory.max):
                return False
        return True


class Rule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Which nodes and GPUs, and how they are shared."""

    name: str
    nodeSelector: LabelSelector | None = None  # noqa: N815
    gpus: GpuSelector | None = None
    sharing: Sharing | None = None
    memoryStep: str | None = None  # noqa: N815
    # the only sizes a memory share may have (validValues), smallest first; instead of memoryStep's range
    memorySizes: list[str] | None = None  # noqa: N815
    memoryDefault: MemoryDefault | None = None  # noqa: N815
    computeStep: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = None  # noqa: N815
    maxShares: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None  # noqa: N815
    mig: MigPolicy | None = None
    timeSliceInterval: TimeSliceInterval | None = None  # noqa: N815
    healthTaintEffect: TaintEffect | None = None  # noqa: N815
    passthrough: bool | None = None  # also offer the GPUs for VFIO passthrough (gpu-vfio-<minor>)

    def specificity(self) -> int:
        return (self.nodeSelector.terms() if self.nodeSelector else 0) + (self.gpus.terms() if self.gpus else 0)


class NodeConfigSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    rules: list[Rule] = msgspec.field(default_factory=list)


class ObjectMeta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    annotations: dict[str, str] = msgspec.field(default_factory=dict)


class NodeConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The whole object as the CRD stores it (status is the controller's, not read here)."""

    apiVersion: str = API_VERSION  # noqa: N815
    kind: str = KIND
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: NodeConfigSpec = msgspec.field(default_factory=NodeConfigSpec)


class GpuSetting(msgspec.Struct, frozen=True, kw_only=True):
    """The effective setting of one GPU and the rule that decided it (None: the built-in default)."""

    gpu: str
    rule: str | None = None
    sharing: Sharing = "exclusive"
    memory_step: int = MIB  # bytes
    memory_sizes: tuple[int, ...] = ()  # bytes, ascending: a share's memory is one of them (memorySizes)
    memory_default: MemoryDefault = "all"
    compute_step: int = DEFAULT_COMPUTE_STEP  # percent
    max_shares: int | None = None
    mig: MigPolicy | None = None  # None: the publisher's --mig-mode
    time_slice_interval: TimeSliceInterval = "Default"
    health_taint_effect: TaintEffect | None = None  # None: the publisher's --taint-effect
    passthrough: bool | None = None  # None: the publisher's --passthrough

    @property
    def offers_shares(self) -> bool:
        return self.sharing in SHARED_MODES


DEFAULT = NodeConfig()


def _check_rule(i: int, rule: Rule) -> None:
    where = f"spec.rules[{i}]"
    for field, text in (
        ("memoryStep", rule.memoryStep),
        ("gpus.memory.min", rule.gpus.memory.min if rule.gpus and rule.gpus.memory else None),
        ("gpus.memory.max", rule.gpus.memory.max if rule.gpus and rule.gpus.memory else None),
    ):
        if text is None:
            continue
        try:
            value = parse_bytes(text, what=field)
        except QuantityError as exc:
            raise NodeConfigError(f"{where}.{field}: {exc}") from None
        if field == "memoryStep" and (value < MIB or value % MIB):
            raise NodeConfigError(
                f"{where}.memoryStep: {text!r} must be a positive whole number of Mi (e.g. 1Mi, 10Gi)"
            )
    _check_sizes(where, rule)
    if rule.gpus and rule.gpus.memory and rule.gpus.memory.min and rule.gpus.memory.max:
        if parse_bytes(rule.gpus.memory.min) > parse_bytes(rule.gpus.memory.max):
            raise NodeConfigError(f"{where}.gpus.memory: min {rule.gpus.memory.min} exceeds max {rule.gpus.memory.max}")
    sharing = rule.sharing or "exclusive"
    if sharing not in SHARED_MODES:
        for field in ("memoryStep", "memorySizes", "memoryDefault", "computeStep", "maxShares"):
            if getattr(rule, field) is not None:
                raise NodeConfigError(
                    f"{where}.{field}: only meaningful with sharing mpsShares or shares (the rule says {sharing})"
                )
    if sharing != "mpsShares" and rule.computeStep is not None:
        raise NodeConfigError(f"{where}.computeStep: only MPS enforces a compute share; use sharing mpsShares")
    if rule.computeStep is not None and 100 % rule.computeStep:
        raise NodeConfigError(f"{where}.computeStep: {rule.computeStep} must divide 100 (e.g. 5, 10, 25)")
    if sharing != "timeSlicing" and rule.timeSliceInterval is not None:
        raise NodeConfigError(f"{where}.timeSliceInterval: only meaningful with sharing timeSlicing")
    if rule.passthrough and (sharing != "exclusive" or rule.mig == "dynamic"):
        raise NodeConfigError(
            f"{where}.passthrough: a passthrough GPU is given whole to one VM; it cannot be "
            f"shared ({sharing}) or partitioned by dynamic MIG"
        )
    if rule.maxShares is not None and rule.memoryDefault not in (None, "none"):
        raise NodeConfigError(
            f"{where}.memoryDefault: with maxShares a claim's default memory request is 0 "
            "(NVIDIA's <count> shares); leave memoryDefault unset or none"
        )


def _check_sizes(where: str, rule: Rule) -> None:
    """memorySizes: 1 to MAX_VALID_VALUES whole-Mi sizes, ascending, not with memoryStep or a memoryDefault (a claim
    naming no memory takes the smallest) nor with maxShares (whose memory default is 0)."""
    if rule.memorySizes is None:
        return
    field = f"{where}.memorySizes"
    if not 1 <= len(rule.memorySizes) <= MAX_VALID_VALUES:
        raise NodeConfigError(f"{field}: give 1 to {MAX_VALID_VALUES} sizes (the API's limit on validValues)")
    for other in ("memoryStep", "memoryDefault", "maxShares"):
        if getattr(rule, other) is not None:
            raise NodeConfigError(
                f"{where}.{other}: not with memorySizes (a share's memory is one of the sizes, a claim naming "
                "none takes the smallest)"
            )
    sizes: list[int] = []
    for j, text in enumerate(rule.memorySizes):
        try:
            size = parse_bytes(text, what=f"memorySizes[{j}]")
        except QuantityError as exc:
            raise NodeConfigError(f"{field}[{j}]: {exc}") from None
        if size < MIB or size % MIB:
            raise NodeConfigError(f"{field}[{j}]: {text!r} must be a positive whole number of Mi (e.g. 10Gi)")
        if sizes and size <= sizes[-1]:
            raise NodeConfigError(f"{field}[{j}]: {text!r} must be larger than the size before it (smallest first)")
        sizes.append(size)


def validate(config: NodeConfig) -> NodeConfig:
    """Cross-field checks the types cannot make; NodeConfigError naming the field."""
    if config.apiVersion != API_VERSION or config.kind != KIND:
        raise NodeConfigError(f"apiVersion/kind: want {API_VERSION} {KIND}, got {config.apiVersion} {config.kind}")
    seen: set[str] = set()
    for i, rule in enumerate(config.spec.rules):
        if not rule.name or rule.name in seen:
            raise NodeConfigError(
                f"spec.rules[{i}].name: {'empty' if not rule.name else 'duplicate ' + repr(rule.name)}"
            )
        seen.add(rule.name)
        _check_rule(i, rule)
        for j, req in enumerate(rule.nodeSelector.matchExpressions if rule.nodeSelector else []):
            has_values = bool(req.values)
            if has_values != (req.operator in ("In", "NotIn")):
                raise NodeConfigError(
                    f"spec.rules[{i}].nodeSelector.matchExpressions[{j}].values: operator "
                    f"{req.operator} {'needs' if not has_values else 'takes no'} values"
                )
    return config


def from_obj(obj: Any) -> NodeConfig:
    """A decoded YAML/JSON object -> a validated NodeConfig; NodeConfigError naming the bad field."""
    try:
        config = msgspec.convert(obj, NodeConfig)
    except msgspec.ValidationError as exc:
        raise NodeConfigError(str(exc)) from None
    return validate(config)


def load(path: str | Path) -> NodeConfig:
    """A NodeConfig YAML file (one document) -> a validated NodeConfig."""
    import yaml  # only a process given a file reads YAML (the preparer watches objects)

    try:
        obj = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise NodeConfigError(f"{path}: {exc}") from None
    try:
        return from_obj(obj)
    except NodeConfigError as exc:
        raise NodeConfigError(f"{path}: {exc}") from None


def merge(configs: Mapping[str, NodeConfig]) -> NodeConfig:
    """Object name -> its (validated) config => one config (module doc): all rules, objects in name order,
    each rule named `<object>/<rule>`; DEFAULT when there are none."""
    rules = [
        msgspec.structs.replace(rule, name=f"{name}/{rule.name}")
        for name in sorted(configs)
        for rule in configs[name].spec.rules
    ]
    return NodeConfig(spec=NodeConfigSpec(rules=rules)) if rules else DEFAULT


def winning_rule(config: NodeConfig, labels: Mapping[str, str], gpu: Gpu) -> Rule | None:
    """The most specific matching rule (ties: the earliest), or None."""
    best: Rule | None = None
    for rule in config.spec.rules:
        if rule.nodeSelector is not None and not rule.nodeSelector.matches(labels):
            continue
        if rule.gpus is not None and not rule.gpus.matches(gpu):
            continue
        if best is None or rule.specificity() > best.specificity():
            best = rule
    return best


def setting_for(config: NodeConfig, labels: Mapping[str, str], gpu: Gpu) -> GpuSetting:
    rule = winning_rule(config, labels, gpu)
    if rule is None:
        return GpuSetting(gpu=gpu.name)
    return GpuSetting(
        gpu=gpu.name,
        rule=rule.name,
        sharing=rule.sharing or "exclusive",
        memory_step=parse_bytes(rule.memoryStep) if rule.memoryStep else MIB,
        memory_sizes=tuple(parse_bytes(t) for t in rule.memorySizes or ()),
        memory_default=rule.memoryDefault
        or ("none" if rule.maxShares else "step" if rule.sharing == "mpsShares" else "all"),
        compute_step=rule.computeStep or DEFAULT_COMPUTE_STEP,
        max_shares=rule.maxShares,
        mig=rule.mig,
        time_slice_interval=rule.timeSliceInterval or "Default",
        health_taint_effect=rule.healthTaintEffect,
        passthrough=rule.passthrough,
    )


def resolve(config: NodeConfig, labels: Mapping[str, str], gpus: Iterable[Gpu]) -> dict[str, GpuSetting]:
    """GPU name -> its effective setting on a node with these labels (pure)."""
    return {gpu.name: setting_for(config, labels, gpu) for gpu in gpus}


def parse_labels(text: str) -> dict[str, str]:
    """`k=v,k2=v2` -> a dict; NodeConfigError for an item without `=`."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise NodeConfigError(f"--labels: {item!r} is not key=value")
        out[key] = value
    return out
