"""CEL selectors: the DRA `device` environment, the Kubernetes extensions, errors, caching and cost."""

from __future__ import annotations

import time
from typing import Any

import pytest

from embedded.scheduler.cel import CelError, DeviceEnv, compile_selector, evaluate
from embedded.scheduler.values import parse_quantity, parse_semver

GPU = "gpu.nvidia.com"
DEVICE: dict[str, Any] = {
    "name": "gpu-0",
    "attributes": {
        "type": {"string": "gpu"},
        "productName": {"string": "NVIDIA A100-SXM4-40GB"},
        "driverVersion": {"version": "550.163.1"},
        "cudaComputeCapability": {"version": "8.0.0"},
        "numaNode": {"int": 1},
        "mig": {"bool": False},
        "resource.kubernetes.io/pciBusID": {"string": "0000:07:00.0"},
    },
    "capacity": {"memory": {"value": "40Gi"}, "example.com/slots": {"value": "1500m"}},
}


@pytest.mark.parametrize(
    "expression",
    [
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
        "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')",
        "device.attributes['gpu.nvidia.com'].numaNode == 1 && !device.attributes['gpu.nvidia.com'].mig",
        "device.attributes['resource.kubernetes.io'].pciBusID.startsWith('0000:07')",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) == 0",
        "device.capacity['gpu.nvidia.com'].memory == quantity('40960Mi')",
        "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('39.5Gi'))",
        "device.capacity['gpu.nvidia.com'].memory.asInteger() == 42949672960",
        "device.capacity['example.com'].slots.isLessThan(quantity('2'))"
        " && !device.capacity['example.com'].slots.isInteger()",
        "device.capacity['gpu.nvidia.com'].memory.sub(quantity('8Gi')).compareTo(quantity('32Gi')) == 0",
        "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.54.15'))",
        "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('550.163.1')) == 0",
        "device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() == 8",
        "semver('1.0.0-rc.1').isLessThan(semver('1.0.0')) && isSemver('1.2.3') && !isSemver('v1.2')"
        " && !isSemver(' 1.2.3') && !isSemver('1.2.3\\n') && !isSemver('1١.2.3')",
        "isQuantity('1e3') && !isQuantity('lots') && quantity('1k') == quantity('1e3')",
        "device.attributes['other.example.com'].size() == 0 && !('x' in device.attributes['gpu.nvidia.com'])",
        "has(device.attributes['gpu.nvidia.com'].productName) && !has(device.attributes['gpu.nvidia.com'].index)",
        "'NVIDIA A100'.split(' ').join('-') == 'NVIDIA-A100' && ' x '.trim() == 'x' && 'abc'.indexOf('c') == 2",
        "'a.b.c'.replace('.', '/') == 'a/b/c' && 'hello'.substring(1, 3) == 'el' && 'ab'.upperAscii() == 'AB'",
        "[3, 1, 2].max() == 3 && [1, 2].isSorted() && [1, 2, 3].sum() == 6 && [4, 5].indexOf(5) == 1",
        "device.allowMultipleAllocations == false",
        "['a100', 'h100'].exists(p, device.attributes['gpu.nvidia.com'].productName.lowerAscii().contains(p))",
    ],
)
def test_true_selectors(expression: str) -> None:
    assert evaluate(expression, GPU, DEVICE) is True


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("device.attributes['gpu.nvidia.com'].index == 0", "no such key: index"),
        ("device.attributes['gpu.nvidia.com'].numaNode", "must return a bool"),
        ("quantity('lots').isInteger()", "'lots' is not a quantity"),
        ("semver('v1').major() == 1", "'v1' is not a semantic version"),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(semver('1.0.0')) == 0", "needs a quantity"),
        ("device.driver ==", "CEL syntax error"),
        ("", "empty CEL expression"),
    ],
)
def test_errors_say_what_was_wrong(expression: str, message: str) -> None:
    with pytest.raises(CelError) as err:
        evaluate(expression, GPU, DEVICE)
    assert message in err.value.message and err.value.expression == expression


def test_programs_compile_once_and_results_are_cached_per_device() -> None:
    expression = "device.attributes['gpu.nvidia.com'].type == 'gpu'"
    assert compile_selector(expression) is compile_selector(expression)
    env = DeviceEnv(GPU, DEVICE)
    assert env.matches(compile_selector(expression))
    assert env.results == {expression: True}


def test_values() -> None:
    assert parse_quantity("40Gi") == 40 * 2**30 and parse_quantity("100m") * 10 == 1
    assert parse_quantity("1.5e3") == 1500
    assert parse_semver("v1.02", normalize=True) == (1, 2, 0, ())
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity("12 GB")


def test_evaluation_cost_is_microseconds() -> None:
    """Warm evaluations against a prepared device environment (the allocator's case); reported in the docs."""
    selectors = [
        compile_selector(e)
        for e in (
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
        )
    ]
    env = DeviceEnv(GPU, DEVICE)
    env.matches(selectors[0])
    rounds = 2000
    start = time.perf_counter()
    for _ in range(rounds):
        for s in selectors:
            env._evaluate(s)  # bypass the result cache: measure CEL itself
    per_eval = (time.perf_counter() - start) / (rounds * len(selectors))
    assert per_eval < 500e-6, f"{per_eval * 1e6:.1f} µs per evaluation"


@pytest.mark.parametrize(
    ("expression", "refs"),
    [
        (
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
            (("driver", "", ""), ("attributes", GPU, "type")),
        ),
        (
            'device.capacity["gpu.nvidia.com"]["memory"].compareTo(quantity("40Gi")) >= 0',
            (("capacity", GPU, "memory"),),
        ),
        (
            "has(device.attributes['resource.kubernetes.io'].pciBusID) && device.allowMultipleAllocations",
            (("attributes", "resource.kubernetes.io", "pciBusID"), ("allowMultipleAllocations", "", "")),
        ),
        # Whole maps, a computed key, a method on the map, `device` itself: the result may depend on more.
        ("'x' in device.attributes['gpu.nvidia.com']", None),
        ("device.attributes['gpu.nvidia.com'].size() == 0", None),
        ("device.attributes['gpu.nvidia.com'][device.driver] == 1", None),
        ("device.attributes[device.driver].type == 'gpu'", None),
        ("'device' == 'device'", None),
        ("[1].all(x, x == 1)", ()),
    ],
)
def test_selectors_name_the_fields_they_read(expression: str, refs: tuple[Any, ...] | None) -> None:
    assert compile_selector(expression).refs == refs


def _variant(name: str, **attributes: Any) -> dict[str, Any]:
    return {**DEVICE, "name": name, "attributes": {**DEVICE["attributes"], **attributes}}


def test_results_are_shared_between_devices_that_agree_on_the_fields_read(monkeypatch: pytest.MonkeyPatch) -> None:
    expression = "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA A100') && device.driver != 'x'"
    selector = compile_selector(expression)
    evaluated: list[str] = []
    full = DeviceEnv._evaluate

    def counting(env: DeviceEnv, sel: Any) -> Any:
        evaluated.append(env.device["name"])
        return full(env, sel)

    monkeypatch.setattr(DeviceEnv, "_evaluate", counting)
    same = [DeviceEnv(GPU, _variant(f"gpu-{i}", uuid={"string": f"GPU-{i}"})) for i in range(50)]
    assert all(env.matches(selector) for env in same)
    assert evaluated == ["gpu-0"]  # one evaluation for 50 devices that differ only in fields not read
    other = DeviceEnv(GPU, _variant("h100", productName={"string": "NVIDIA H100"}))
    assert other.matches(selector) is False
    assert evaluated == ["gpu-0", "h100"]


@pytest.mark.parametrize("value", [{"int": 1}, {"bool": True}, {"string": "1"}, {"ints": [1]}, {"int": "1"}, {}])
def test_shared_results_equal_a_full_evaluation(value: dict[str, Any]) -> None:
    for expression in (
        "device.attributes['gpu.nvidia.com'].v == 1",
        "has(device.attributes['gpu.nvidia.com'].v)",
        "device.attributes['gpu.nvidia.com'].v == true",
    ):
        selector = compile_selector(expression)
        for device in (_variant("a", v=value), _variant("b", v=value, uuid={"string": "GPU-b"})):
            expected = DeviceEnv(GPU, device)._evaluate(selector)
            env = DeviceEnv(GPU, device)
            try:
                got: Any = env.matches(selector)
            except CelError as exc:
                got = exc
            if isinstance(expected, CelError):
                assert isinstance(got, CelError) and got.message == expected.message
            else:
                assert got is expected


def test_the_later_of_two_spellings_wins_as_in_a_full_evaluation() -> None:
    selector = compile_selector("device.attributes['gpu.nvidia.com'].kind == 'b'")
    first = {**DEVICE, "attributes": {"kind": {"string": "a"}, "gpu.nvidia.com/kind": {"string": "b"}}}
    second = {**DEVICE, "attributes": {"gpu.nvidia.com/kind": {"string": "b"}, "kind": {"string": "a"}}}
    assert DeviceEnv(GPU, first).matches(selector) is True
    assert DeviceEnv(GPU, second).matches(selector) is False


def test_a_malformed_device_fails_even_when_its_fields_read_match_a_good_one() -> None:
    selector = compile_selector("device.attributes['gpu.nvidia.com'].type == 'gpu' && device.driver != 'y'")
    assert DeviceEnv(GPU, DEVICE).matches(selector)
    bad = DeviceEnv(GPU, _variant("bad", driverVersion={"version": "not-a-version"}))
    with pytest.raises(CelError, match="malformed attribute"):
        bad.matches(selector)
    no_value = DeviceEnv(GPU, {**DEVICE, "capacity": {"memory": {}}})
    with pytest.raises(CelError, match="malformed attribute"):
        no_value.matches(selector)
