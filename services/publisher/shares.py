"""A GPU's effective sharing setting -> what its devices offer: `allowMultipleAllocations` and
capacities with a `requestPolicy` (KEP-5075 consumable capacity, resource.k8s.io/v1 on 1.34+).

Pure. Capacity names are NVIDIA's (kubernetes-sigs/dra-driver-nvidia-gpu `--consumable-shares`), so
claims written for that driver work unchanged:

- `memory` with `memorySizes`: the device's value, validValues the sizes that fit in it, the default the
  smallest (a device too small for any stays whole). Otherwise:
- `memory` (bytes): the device's value rounded down to a whole number of memory steps (NVIDIA: 1Mi);
  validRange {min, max = that value, step}; the default a claim that names no amount consumes is
  the whole memory (`memoryDefault: all`, NVIDIA's `memory`; min = step), 0 (`none`, NVIDIA's
  `unlimited` and `<count>`; min = 0), or one step (`step`, the mpsShares default; min = step).
- `shares` (a count, only with `maxShares: N`, NVIDIA's `<count>`): value N, default 1, {1, N, 1}.
- `compute` (percent of the device's SMs, only in mpsShares, where the MPS daemon enforces it):
  value 100, default = computeStep, validRange {computeStep, 100, computeStep}.
- every other capacity (a MIG device's `multiprocessors`, engines and `memorySlice<i>`): kept for selectors,
  consumed by no share (default 0, validValues [0]). Upstream consumes a capacity without a policy whole on
  every allocation, so one share would take them all and the next share would never fit.

Full GPUs and MIG devices are offered, static ones and the partitionable devices of dynamic MIG: a
shared device's counters are consumed once, by its first share (the MIG device is made then, and
destroyed after its last share, its MPS daemon stopped before). A device that cannot hold `min` plus
one step (the API's rule for a validRange) stays exclusive: one share at most would fit.
"""

from __future__ import annotations

from typing import Any

from shared import devicemodel
from shared.nodeconfig import GpuSetting
from shared.quantity import parse_bytes

MEMORY = "memory"
SHARES = "shares"
COMPUTE = "compute"


def _q(value: int) -> str:
    return devicemodel.binary_si(value)


def _policy(default: int, low: int, high: int, step: int) -> dict[str, Any]:
    return {"default": _q(default), "validRange": {"min": _q(low), "max": _q(high), "step": _q(step)}}


def _not_consumed(capacity: dict[str, Any]) -> dict[str, Any]:
    """A capacity that shares do not divide: each consumes 0 of it."""
    return {**capacity, "requestPolicy": {"default": "0", "validValues": ["0"]}}


def offer_shares(device: dict[str, Any], setting: GpuSetting) -> dict[str, Any]:
    """The device with `allowMultipleAllocations` and request policies per the setting (a new dict)."""
    if not setting.offers_shares:
        return device
    capacity = {k: dict(v) if k == MEMORY else _not_consumed(v) for k, v in device.get("capacity", {}).items()}
    if MEMORY in capacity and setting.memory_sizes:
        sizes = [size for size in setting.memory_sizes if size <= parse_bytes(capacity[MEMORY]["value"])]
        if not sizes:
            return device  # not even the smallest size fits: the device stays whole
        policy = {"default": _q(sizes[0]), "validValues": [_q(size) for size in sizes]}
        capacity[MEMORY] = {**capacity[MEMORY], "requestPolicy": policy}
    elif MEMORY in capacity:
        step = setting.memory_step
        top = parse_bytes(capacity[MEMORY]["value"]) // step * step
        low = 0 if setting.memory_default == "none" else step
        if top < low + step:
            return device  # the API requires min + one step within the capacity: at most one share fits
        default = {"none": 0, "all": top}.get(setting.memory_default, step)
        policy = _policy(default, low, top, step)
        capacity[MEMORY] = {"value": _q(top), "requestPolicy": policy}
    out = dict(device)
    out["allowMultipleAllocations"] = True
    if setting.max_shares:
        n = setting.max_shares
        capacity[SHARES] = {"value": str(n), "requestPolicy": _policy(1, 1, n, 1)}
    if setting.sharing == "mpsShares":
        c = setting.compute_step
        capacity[COMPUTE] = {"value": "100", "requestPolicy": _policy(c, c, 100, c)}
    out["capacity"] = capacity
    return out
