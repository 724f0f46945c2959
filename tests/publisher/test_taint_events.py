"""What TaintEvents reports between two syncs of a node: added and removed taints, and no news for a device that
left the pool."""

from __future__ import annotations

from typing import Any

from services.publisher.slices import DesiredPool
from services.publisher.split import SliceContent
from services.publisher.taintevents import ADDED, REMOVED, TaintEvents

XID = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}


def pools(**devices: list[dict[str, Any]]) -> dict[str, DesiredPool]:
    """One gpu.nvidia.com pool on n1 whose devices are named by the keywords, each with its taints."""
    content = SliceContent(devices=[{"name": name, "taints": taints} for name, taints in devices.items()])
    return {"gpu.nvidia.com": DesiredPool(driver="gpu.nvidia.com", node="n1", slices=[content])}


def test_the_first_sync_only_records() -> None:
    events = TaintEvents(api_client=None)
    assert events.changes("n1", pools(gpu_0=[XID])) == []
    assert events.changes("n1", pools(gpu_0=[XID])) == []


def test_a_taint_added_then_removed_is_reported_each_time() -> None:
    events = TaintEvents(api_client=None)
    events.changes("n1", pools(gpu_0=[], gpu_1=[]))
    assert events.changes("n1", pools(gpu_0=[], gpu_1=[XID])) == [
        (ADDED, "gpu.nvidia.com/gpu_1", "gpu.nvidia.com/xid=79:NoExecute")
    ]
    assert events.changes("n1", pools(gpu_0=[], gpu_1=[])) == [
        (REMOVED, "gpu.nvidia.com/gpu_1", "gpu.nvidia.com/xid=79:NoExecute")
    ]
    assert events.changes("n1", pools(gpu_0=[], gpu_1=[])) == []


def test_a_tainted_device_that_leaves_the_pool_is_no_news() -> None:
    events = TaintEvents(api_client=None)
    events.changes("n1", pools(gpu_0=[], gpu_1=[]))
    events.changes("n1", pools(gpu_0=[], gpu_1=[XID]))
    assert events.changes("n1", pools(gpu_0=[])) == []
