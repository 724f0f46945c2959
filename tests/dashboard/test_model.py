from services.dashboard.model import Allocation, build_fleet


def _slice(node: str, devices: list[dict]) -> dict:
    return {"spec": {"nodeName": node, "pool": {"name": node}, "devices": devices}}


def test_claimed_and_tainted_devices_land_on_their_node() -> None:
    slices = [
        _slice("node-b", [{"name": "gpu-0", "attributes": {"productName": {"string": "NVIDIA H100"}},
                           "capacity": {"memory": {"value": "80Gi"}}}]),
        _slice("node-a", [{"name": "gpu-0", "taints": [{"key": "gpu.nvidia.com/xid", "value": "79"}]},
                          {"name": "gpu-1"}]),
    ]
    claims = [{"metadata": {"namespace": "team-a", "name": "c1"},
               "status": {"allocation": {"devices": {"results": [{"pool": "node-b", "device": "gpu-0"}]}}}}]
    fleet = build_fleet(slices, claims)
    assert [n.name for n in fleet] == ["node-a", "node-b"]
    assert fleet[0].devices[0].taints == ["gpu.nvidia.com/xid=79"]
    assert fleet[0].devices[1].allocation is None
    b0 = fleet[1].devices[0]
    assert (b0.product, b0.memory, b0.allocation) == ("NVIDIA H100", "80Gi", Allocation("team-a", "c1"))


def test_counters_by_product_and_state() -> None:
    from services.dashboard.model import counters

    h100 = {"productName": {"string": "NVIDIA H100"}}
    slices = [_slice("n", [{"name": "gpu-0", "attributes": h100},
                           {"name": "gpu-1", "attributes": h100, "taints": [{"key": "xid", "value": "48"}]},
                           {"name": "gpu-2", "attributes": h100}])]
    claims = [{"metadata": {"namespace": "t", "name": "c"},
               "status": {"allocation": {"devices": {"results": [{"pool": "n", "device": "gpu-2"}]}}}}]
    assert counters(build_fleet(slices, claims)) == {"NVIDIA H100": {"free": 1, "claimed": 1, "tainted": 1}}
