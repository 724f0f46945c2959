"""NodeConfig: rule matching and precedence, bad rules refused naming the field, the shipped examples
load and validate (types and the CRD schema), and `gpu-dra nodeconfig explain`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml

from shared import cli, nodeconfig
from shared.events.inventory import Gpu, NodeInventory

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "node-config").glob("*.yaml"))
CRD = ROOT / "deploy" / "kubernetes" / "base" / "crds" / "nodeconfigs.yaml"
GIB = 1 << 30


def gpu(minor: int = 0, product: str = "NVIDIA H100 80GB HBM3", arch: str = "Hopper", gib: int = 80) -> Gpu:
    return Gpu(
        name=f"gpu-{minor}",
        index=minor,
        minor=minor,
        uuid=f"GPU-{minor:04d}",
        product_name=product,
        brand="Nvidia",
        architecture=arch,
        cuda_compute_capability="9.0.0",
        memory_bytes=gib * GIB,
        pci_bus_id=f"0000:{minor:02x}:00.0",
    )


def config(*rules: dict[str, Any]) -> nodeconfig.NodeConfig:
    return nodeconfig.from_obj(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "NodeConfig",
            "metadata": {"name": "t"},
            "spec": {"rules": list(rules)},
        }
    )


def test_no_rules_means_every_gpu_exclusive_decided_by_no_rule() -> None:
    [(name, s)] = nodeconfig.resolve(nodeconfig.DEFAULT, {"pool": "a"}, [gpu()]).items()
    assert name == "gpu-0" and s == nodeconfig.GpuSetting(gpu="gpu-0") and s.rule is None
    assert s.sharing == "exclusive" and not s.offers_shares and s.mig is None


def test_the_most_specific_rule_wins_and_ties_go_to_the_earlier_rule() -> None:
    cfg = config(
        {"name": "everyone", "sharing": "timeSlicing"},
        {"name": "dev", "nodeSelector": {"matchLabels": {"pool": "dev"}}, "sharing": "shares"},
        {
            "name": "dev-too",
            "nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["dev"]}]},
            "sharing": "exclusive",
        },
        {
            "name": "dev-hopper-big",
            "nodeSelector": {"matchLabels": {"pool": "dev"}},
            "gpus": {"architecture": "Hopper", "memory": {"min": "40Gi"}},
            "sharing": "mpsShares",
            "memoryStep": "10Gi",
            "computeStep": 20,
        },
    )
    big, small, ampere = gpu(0), gpu(1, gib=24), gpu(2, "NVIDIA A100-SXM4-40GB", "Ampere", 40)
    dev = nodeconfig.resolve(cfg, {"pool": "dev"}, [big, small, ampere])
    assert {k: v.rule for k, v in dev.items()} == {"gpu-0": "dev-hopper-big", "gpu-1": "dev", "gpu-2": "dev"}
    assert (dev["gpu-0"].sharing, dev["gpu-0"].memory_step, dev["gpu-0"].compute_step) == ("mpsShares", 10 * GIB, 20)
    assert dev["gpu-0"].memory_default == "step"  # mpsShares: one step unless a claim asks for more
    assert dev["gpu-1"].memory_default == "all" and dev["gpu-1"].memory_step == 1 << 20
    other = nodeconfig.resolve(cfg, {"pool": "prod"}, [big])
    assert other["gpu-0"].rule == "everyone" and other["gpu-0"].sharing == "timeSlicing"
    assert nodeconfig.resolve(cfg, {}, [big])["gpu-0"].rule == "everyone"


@pytest.mark.parametrize(
    ("expr", "labels", "hit"),
    [
        ({"key": "zone", "operator": "NotIn", "values": ["a"]}, {"zone": "b"}, True),
        ({"key": "zone", "operator": "NotIn", "values": ["a"]}, {"zone": "a"}, False),
        ({"key": "zone", "operator": "NotIn", "values": ["a"]}, {}, True),
        ({"key": "gpu", "operator": "Exists"}, {"gpu": ""}, True),
        ({"key": "gpu", "operator": "Exists"}, {}, False),
        ({"key": "gpu", "operator": "DoesNotExist"}, {}, True),
        ({"key": "zone", "operator": "In", "values": ["a", "b"]}, {"zone": "c"}, False),
    ],
)
def test_match_expressions_follow_kubernetes_label_selector_semantics(expr, labels, hit) -> None:
    cfg = config({"name": "r", "nodeSelector": {"matchExpressions": [expr]}, "sharing": "shares"})
    assert (nodeconfig.setting_for(cfg, labels, gpu()).rule == "r") is hit


def test_gpu_attributes_product_name_and_memory_bounds_select() -> None:
    cfg = config(
        {"name": "small", "gpus": {"memory": {"max": "24Gi"}}, "sharing": "shares"},
        {"name": "a100", "gpus": {"productName": "NVIDIA A100-SXM4-40GB"}, "sharing": "timeSlicing"},
    )
    got = nodeconfig.resolve(cfg, {}, [gpu(0), gpu(1, gib=24), gpu(2, "NVIDIA A100-SXM4-40GB", "Ampere", 40)])
    assert {k: v.rule for k, v in got.items()} == {"gpu-0": None, "gpu-1": "small", "gpu-2": "a100"}


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"name": "r", "sharing": "sliced"}, "spec.rules[0].sharing"),
        ({"name": "r", "sharing": "shares", "maxShares": 0}, "spec.rules[0].maxShares"),
        ({"name": "r", "sharing": "mpsShares", "computeStep": 101}, "spec.rules[0].computeStep"),
        ({"name": "r", "sharing": "mpsShares", "computeStep": 30}, "spec.rules[0].computeStep"),
        ({"name": "r", "sharing": "shares", "computeStep": 10}, "spec.rules[0].computeStep"),
        ({"name": "r", "sharing": "shares", "memoryStep": "ten gigs"}, "spec.rules[0].memoryStep"),
        ({"name": "r", "sharing": "shares", "memoryStep": "1500Ki"}, "spec.rules[0].memoryStep"),
        ({"name": "r", "sharing": "exclusive", "memoryStep": "1Gi"}, "spec.rules[0].memoryStep"),
        ({"name": "r", "memoryStep": "1Gi"}, "spec.rules[0].memoryStep"),
        ({"name": "r", "sharing": "shares", "timeSliceInterval": "Short"}, "spec.rules[0].timeSliceInterval"),
        ({"name": "r", "sharing": "shares", "memorySizes": ["20Gi", "10Gi"]}, "spec.rules[0].memorySizes[1]"),
        ({"name": "r", "sharing": "shares", "memorySizes": ["10Gi", "1500Ki"]}, "spec.rules[0].memorySizes[1]"),
        ({"name": "r", "sharing": "shares", "memorySizes": [f"{n}Gi" for n in range(1, 12)]}, "memorySizes"),
        ({"name": "r", "sharing": "shares", "memorySizes": []}, "spec.rules[0].memorySizes"),
        ({"name": "r", "sharing": "shares", "memorySizes": ["10Gi"], "memoryStep": "1Gi"}, "spec.rules[0].memoryStep"),
        ({"name": "r", "sharing": "exclusive", "memorySizes": ["10Gi"]}, "spec.rules[0].memorySizes"),
        ({"name": "r", "sharing": "shares", "maxShares": 4, "memoryDefault": "all"}, "spec.rules[0].memoryDefault"),
        ({"name": "r", "gpus": {"memory": {"min": "80Gi", "max": "40Gi"}}}, "spec.rules[0].gpus.memory"),
        ({"name": "r", "gpus": {"memory": {"min": "lots"}}}, "spec.rules[0].gpus.memory.min"),
        ({"name": "r", "gpus": {"vendor": "nvidia"}}, "spec.rules[0].gpus"),
        ({"name": "r", "healthTaintEffect": "Evict"}, "spec.rules[0].healthTaintEffect"),
        (
            {"name": "r", "nodeSelector": {"matchExpressions": [{"key": "k", "operator": "In"}]}},
            "spec.rules[0].nodeSelector.matchExpressions[0].values",
        ),
        ({"sharing": "shares"}, "spec.rules[0]"),
    ],
)
def test_a_bad_rule_is_refused_naming_the_field(rule: dict[str, Any], field: str) -> None:
    with pytest.raises(nodeconfig.NodeConfigError) as err:
        config(rule)
    assert field in str(err.value), str(err.value)


def test_memory_sizes_resolve_to_bytes_smallest_first() -> None:
    cfg = config({"name": "r", "sharing": "mpsShares", "memorySizes": ["10Gi", "20Gi", "40Gi"]})
    [setting] = nodeconfig.resolve(cfg, {}, [gpu(0)]).values()
    assert setting.memory_sizes == (10 * GIB, 20 * GIB, 40 * GIB)


@pytest.mark.parametrize("sharing", ["shares", "mpsShares"])
def test_dynamic_mig_takes_either_kind_of_share(sharing: str) -> None:
    cfg = config({"name": "r", "sharing": sharing, "mig": "dynamic", "memoryStep": "5Gi"})
    [setting] = nodeconfig.resolve(cfg, {}, [gpu(0)]).values()
    assert (setting.sharing, setting.mig, setting.memory_step) == (sharing, "dynamic", 5 << 30)


def test_duplicate_rule_names_are_refused() -> None:
    with pytest.raises(nodeconfig.NodeConfigError, match=r"spec.rules\[1\].name: duplicate 'r'"):
        config({"name": "r"}, {"name": "r"})


def test_objects_merge_in_name_order_with_their_rules_named_after_them() -> None:
    pool = {"nodeSelector": {"matchLabels": {"pool": "dev"}}}
    b = config({"name": "dev", **pool, "sharing": "timeSlicing"}, {"name": "all", "sharing": "shares"})
    a = config({"name": "dev", **pool, "sharing": "shares", "maxShares": 4})
    merged = nodeconfig.merge({"b": b, "a": a})
    assert [r.name for r in merged.spec.rules] == ["a/dev", "b/dev", "b/all"]
    assert nodeconfig.validate(merged) is merged  # names stay unique across objects
    [dev] = nodeconfig.resolve(merged, {"pool": "dev"}, [gpu()]).values()
    assert (dev.rule, dev.max_shares) == ("a/dev", 4)  # a tie: the object whose name sorts first
    [prod] = nodeconfig.resolve(merged, {"pool": "prod"}, [gpu()]).values()
    assert prod.rule == "b/all"
    assert (
        nodeconfig.merge({}) is nodeconfig.DEFAULT and nodeconfig.merge({"x": nodeconfig.DEFAULT}) is nodeconfig.DEFAULT
    )


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    assert crd["spec"]["group"] == nodeconfig.GROUP and version["name"] == nodeconfig.VERSION
    assert crd["spec"]["names"]["kind"] == nodeconfig.KIND and version["subresources"] == {"status": {}}
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    assert "conditions" in schema["properties"]["status"]["properties"]
    return schema


def test_the_crd_schema_knows_every_rule_field_of_the_types() -> None:
    props = _crd_schema()["properties"]["spec"]["properties"]["rules"]["items"]["properties"]
    assert set(props) == set(nodeconfig.Rule.__struct_fields__)
    enum = props["sharing"]["enum"]
    assert enum == ["exclusive", "timeSlicing", "mpsShares", "shares"]


def test_there_is_an_example_per_mode() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "exclusive.yaml",
        "time-slicing.yaml",
        "mps-shares.yaml",
        "shares.yaml",
        "nvidia-consumable-shares-memory.yaml",
        "nvidia-consumable-shares-unlimited.yaml",
        "nvidia-consumable-shares-count.yaml",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_loads_validates_and_fits_the_crd(path: Path) -> None:
    cfg = nodeconfig.load(path)
    assert cfg.spec.rules and cfg.metadata.name == path.stem
    errors = list(jsonschema.Draft202012Validator(_crd_schema()).iter_errors(yaml.safe_load(path.read_text())))
    assert errors == [], [e.message for e in errors]


def test_the_mps_shares_example_puts_every_gpu_into_10gib_and_10_percent_steps() -> None:
    cfg = nodeconfig.load(ROOT / "examples/node-config/mps-shares.yaml")
    for g in (gpu(0), gpu(1, "NVIDIA A100-SXM4-40GB", "Ampere", 40)):
        s = nodeconfig.setting_for(cfg, {"any": "node"}, g)
        assert (s.sharing, s.memory_step, s.compute_step) == ("mpsShares", 10 * GIB, 10)


def test_a_broken_file_is_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: resource.nvidia.com/v1beta1\nkind: NodeConfig\nspec:\n  rules:\n"
        "  - name: r\n    sharing: shares\n    maxShares: -2\n"
    )
    with pytest.raises(nodeconfig.NodeConfigError, match=r"bad.yaml: .*spec.rules\[0\].maxShares"):
        nodeconfig.load(bad)


def test_explain_prints_each_gpus_setting_and_the_deciding_rule(tmp_path: Path, capsys) -> None:
    inv = NodeInventory(
        node="dev-1", driver_version="580.65.06", cuda_driver_version="13.0", gpus=[gpu(0), gpu(1, gib=24)]
    )
    inv_file = tmp_path / "inv.json"
    inv_file.write_bytes(msgspec.json.encode(inv))
    rc = cli.main(
        [
            "nodeconfig",
            "explain",
            "dev-1",
            "--config",
            str(ROOT / "examples/node-config/shares.yaml"),
            "--inventory",
            str(inv_file),
            "--labels",
            "pool=dev,zone=a",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert rc == 0, out
    assert out[0] == "node dev-1: 2 GPU(s), 2 rule(s)"
    assert out[1].startswith("  gpu-0 (NVIDIA H100 80GB HBM3): sharing=shares memoryStep=4096Mi memoryDefault=all")
    assert "healthTaintEffect=NoExecute" in out[1] and out[1].endswith("<- rule 'dev-pool-big-gpus'")
    assert "sharing=exclusive" in out[2] and out[2].endswith("<- rule 'dev-pool'")
    rc = cli.main(
        [
            "nodeconfig",
            "explain",
            "dev-1",
            "--config",
            str(ROOT / "examples/node-config/shares.yaml"),
            "--inventory",
            str(inv_file),
        ]
    )
    assert rc == 0 and capsys.readouterr().out.splitlines()[1].endswith("<- no rule matched (default)")
    assert (
        cli.main(
            [
                "nodeconfig",
                "explain",
                "other",
                "--config",
                str(ROOT / "examples/node-config/shares.yaml"),
                "--inventory",
                str(inv_file),
            ]
        )
        == 2
    )
