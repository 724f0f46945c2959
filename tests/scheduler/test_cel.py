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


@pytest.mark.parametrize("expression", [
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')",
    "device.attributes['gpu.nvidia.com'].numaNode == 1 && !device.attributes['gpu.nvidia.com'].mig",
    "device.attributes['resource.kubernetes.io'].pciBusID.startsWith('0000:07')",
    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) == 0",
    "device.capacity['gpu.nvidia.com'].memory == quantity('40960Mi')",
    "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('39.5Gi'))",
    "device.capacity['gpu.nvidia.com'].memory.asInteger() == 42949672960",
    "device.capacity['example.com'].slots.isLessThan(quantity('2')) && !device.capacity['example.com'].slots.isInteger()",
    "device.capacity['gpu.nvidia.com'].memory.sub(quantity('8Gi')).compareTo(quantity('32Gi')) == 0",
    "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.54.15'))",
    "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('550.163.1')) == 0",
    "device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() == 8",
    "semver('1.0.0-rc.1').isLessThan(semver('1.0.0')) && isSemver('1.2.3') && !isSemver('v1.2')",
    "isQuantity('1e3') && !isQuantity('lots') && quantity('1k') == quantity('1e3')",
    "device.attributes['other.example.com'].size() == 0 && !('x' in device.attributes['gpu.nvidia.com'])",
    "has(device.attributes['gpu.nvidia.com'].productName) && !has(device.attributes['gpu.nvidia.com'].index)",
    "'NVIDIA A100'.split(' ').join('-') == 'NVIDIA-A100' && ' x '.trim() == 'x' && 'abc'.indexOf('c') == 2",
    "'a.b.c'.replace('.', '/') == 'a/b/c' && 'hello'.substring(1, 3) == 'el' && 'ab'.upperAscii() == 'AB'",
    "[3, 1, 2].max() == 3 && [1, 2].isSorted() && [1, 2, 3].sum() == 6 && [4, 5].indexOf(5) == 1",
    "device.allowMultipleAllocations == false",
    "['a100', 'h100'].exists(p, device.attributes['gpu.nvidia.com'].productName.lowerAscii().contains(p))",
])
def test_true_selectors(expression: str) -> None:
    assert evaluate(expression, GPU, DEVICE) is True


@pytest.mark.parametrize(("expression", "message"), [
    ("device.attributes['gpu.nvidia.com'].index == 0", "no such key: index"),
    ("device.attributes['gpu.nvidia.com'].numaNode", "must return a bool"),
    ("quantity('lots').isInteger()", "'lots' is not a quantity"),
    ("semver('v1').major() == 1", "'v1' is not a semantic version"),
    ("device.capacity['gpu.nvidia.com'].memory.compareTo(semver('1.0.0')) == 0", "needs a quantity"),
    ("device.driver ==", "CEL syntax error"),
    ("", "empty CEL expression"),
])
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
    selectors = [compile_selector(e) for e in (
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
    )]
    env = DeviceEnv(GPU, DEVICE)
    env.matches(selectors[0])
    rounds = 2000
    start = time.perf_counter()
    for _ in range(rounds):
        for s in selectors:
            env._evaluate(s)  # bypass the result cache: measure CEL itself
    per_eval = (time.perf_counter() - start) / (rounds * len(selectors))
    assert per_eval < 500e-6, f"{per_eval * 1e6:.1f} µs per evaluation"
