"""The demo's log check: what a container's log must name, from claims' allocations and the slices' UUIDs."""

from __future__ import annotations

from typing import Any

from embedded.cluster import democheck

GPU_A, GPU_B, PARENT = "GPU-aaaa-0001", "GPU-bbbb-0002", "GPU-cccc-0003"
MIG_1, MIG_2 = "MIG-1111-0001", "MIG-2222-0002"
SLICES = [
    {
        "spec": {
            "driver": "gpu.nvidia.com",
            "pool": {"name": "n0"},
            "devices": [
                {"name": "gpu-0", "attributes": {"uuid": {"string": GPU_A}}},
                {"name": "gpu-1", "attributes": {"uuid": {"string": GPU_B}}},
                {"name": "gpu-2-mig-a", "attributes": {"uuid": {"string": MIG_1}, "parentUUID": {"string": PARENT}}},
                {"name": "gpu-2-mig-b", "attributes": {"uuid": {"string": MIG_2}, "parentUUID": {"string": PARENT}}},
            ],
        }
    },
    {"spec": {"driver": "compute-domain.nvidia.com", "pool": {"name": "n0"}, "devices": [{"name": "channel-0"}]}},
]


def claim(name: str, results: list[tuple[str, str]], config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": "gpu.nvidia.com", "pool": "n0", "device": d} for r, d in results
                    ],
                    "config": config or [],
                }
            }
        },
    }


def pod(containers: list[dict[str, Any]], claims: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "p"},
        "spec": {
            "containers": containers,
            "resourceClaims": [{"name": k, "resourceClaimTemplateName": "t"} for k in claims],
        },
        "status": {"resourceClaimStatuses": [{"name": k, "resourceClaimName": v} for k, v in claims.items()]},
    }


def line(index: int, uuid: str) -> str:
    return f"GPU {index}: NVIDIA H100 80GB HBM3 (UUID: {uuid})"


def test_whole_gpu_mig_devices_per_request_and_time_slicing() -> None:
    ts = [
        {
            "requests": ["gpu"],
            "opaque": {
                "driver": "gpu.nvidia.com",
                "parameters": {
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
                },
            },
        }
    ]
    claims = {
        "c-gpu": claim("c-gpu", [("gpu", "gpu-0")], ts),
        "c-mig": claim("c-mig", [("mig-a", "gpu-2-mig-a"), ("mig-b", "gpu-2-mig-b")]),
    }
    p = pod(
        [
            {"name": "whole", "resources": {"claims": [{"name": "g"}]}},
            {"name": "mig", "resources": {"claims": [{"name": "m", "request": "mig-b"}]}},
            {"name": "none"},
        ],
        {"g": "c-gpu", "m": "c-mig"},
    )
    whole, mig = democheck.expected(p, claims, democheck.slice_devices(SLICES))
    assert (whole.gpus, whole.migs, whole.sharing) == (frozenset({GPU_A}), frozenset(), ("TimeSlicing:Long",))
    assert (mig.container, mig.gpus, mig.migs) == ("mig", frozenset({PARENT}), frozenset({MIG_2}))

    good = f"{line(0, GPU_A)}\n    Time Slice Interval                   : Long\n"
    assert whole.complete(good) and whole.mismatches(good) == []
    assert not whole.complete(line(0, GPU_A))  # the sharing line may still come
    assert whole.mismatches(line(0, GPU_A)) == [
        "no 'Time Slice Interval : Long' line, though the claim's config asks for time-slicing with interval Long"
    ]
    extra = f"{good}{line(1, GPU_B)}"
    assert whole.mismatches(extra) == [f"names GPU(s) it was not allocated: {GPU_B}"]
    both_migs = f"{line(0, PARENT)}\n  MIG 1g.5gb Device 0: (UUID: {MIG_1})\n  MIG 1g.5gb Device 1: (UUID: {MIG_2})"
    assert mig.mismatches(both_migs) == [f"names MIG device(s) it was not allocated: {MIG_1}"]


def test_a_broken_shim_or_an_unpublished_device_never_passes() -> None:
    claims = {"c": claim("c", [("gpu", "gpu-9")])}  # no slice describes gpu-9
    mps = [{"requests": [], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"sharing": {"strategy": "MPS"}}}}]
    claims["m"] = claim("m", [("gpu", "gpu-1")], mps)
    p = pod(
        [
            {"name": "a", "resources": {"claims": [{"name": "x"}]}},
            {"name": "b", "resources": {"claims": [{"name": "y"}]}},
        ],
        {"x": "c", "y": "m"},
    )
    unknown, shared = democheck.expected(p, claims, democheck.slice_devices(SLICES))
    assert unknown.mismatches(line(0, GPU_A)) == [
        f"names GPU(s) it was not allocated: {GPU_A}",
        "does not name its allocated GPU(s): <no uuid published for n0/gpu-9>",
    ]
    broken = "bash: line 1: /usr/bin/nvidia-smi: cannot execute: required file not found"
    assert shared.mismatches(broken) == [
        f"does not name its allocated GPU(s): {GPU_B}",
        "no 'MPS Server : Running' line, though the claim's config asks for MPS",
    ]


def test_an_mps_share_shows_its_own_limits_and_no_other_tenants() -> None:
    """Two tenants' shares of one GPU: each container must show the MPS client limits of its own claim's
    consumedCapacity (memory in MiB on device 0, compute in percent) and none of the other's."""

    def share(name: str, memory: str, compute: str) -> dict[str, Any]:
        c = claim(name, [("gpu", "gpu-0")])
        result = c["status"]["allocation"]["devices"]["results"][0]
        result.update(shareID=f"share-of-{name}", consumedCapacity={"memory": memory, "compute": compute})
        return c

    claims = {"a": share("a", "8Gi", "20"), "b": share("b", "16Gi", "30")}
    want_a, want_b = (
        democheck.expected(
            pod([{"name": "ctr", "resources": {"claims": [{"name": "gpu"}]}}], {"gpu": n}),
            claims,
            democheck.slice_devices(SLICES),
        )[0]
        for n in ("a", "b")
    )
    assert want_a.sharing == ("MPS",) and want_a.limits == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
    }
    mps = "    MPS Server                            : Running (daemon d, active thread percentage default)"
    own = f"{line(0, GPU_A)}\n{mps}\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M\n"
    assert want_a.complete(own) and want_a.mismatches(own) == []
    others = own.replace("=20", "=30").replace("=8192M", "=16384M")
    assert not want_a.complete(others)
    assert want_a.mismatches(others) == [
        "does not show its share's MPS limits: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20, "
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
        "shows MPS limits that are not its share's: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30, "
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=16384M",
    ]
    assert want_b.mismatches(others) == []
    unlimited = f"{line(0, GPU_A)}\n{mps}\n"
    assert want_a.mismatches(unlimited) == [
        "does not show its share's MPS limits: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20, "
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M"
    ]
    no_daemon = own.replace(mps, "    MPS Server                            : Not Running")
    assert want_a.mismatches(no_daemon) == ["no 'MPS Server : Running' line, though the claim's config asks for MPS"]


def test_a_share_without_compute_expects_no_mps_limits() -> None:
    """A plain share (`shares`: memory only, nothing enforced) gets no MPS env; one showing some is wrong."""
    c = claim("s", [("gpu", "gpu-1")])
    c["status"]["allocation"]["devices"]["results"][0].update(shareID="x", consumedCapacity={"memory": "4Gi"})
    (want,) = democheck.expected(
        pod([{"name": "ctr", "resources": {"claims": [{"name": "gpu"}]}}], {"gpu": "s"}),
        {"s": c},
        democheck.slice_devices(SLICES),
    )
    assert want.sharing == () and want.limits == frozenset()
    assert want.mismatches(line(0, GPU_B)) == []
    assert want.mismatches(f"{line(0, GPU_B)}\nCUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50") == [
        "shows MPS limits that are not its share's: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"
    ]
