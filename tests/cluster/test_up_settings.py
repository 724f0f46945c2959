"""One settings story for `gpu-dra up`: its own settings (GPU_DRA_NODES, GPU_DRA_DATA_DIR, ...) never reach a
service, which would refuse them; every setting a service shares with up reaches every service, flag or
environment. Real `up` subprocesses; each service's environment read from /proc."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import msgspec
import pytest

from embedded.cluster.local import PER_SERVICE, SHARED_SETTINGS
from embedded.cluster.waterfall import read_spans
from shared.config import CommonConfig
from tests.cluster.helpers import Up

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")]


def services_of(pid: int) -> dict[str, dict[str, str]]:
    """The `gpu-dra` children of `pid`: their command line's subcommand -> their environment."""
    out: dict[str, dict[str, str]] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
                environ = Path(f"/proc/{child}/environ").read_bytes().decode().split("\0")
            except OSError:
                continue
            if "shared.cli" in argv:
                name = " ".join(argv[argv.index("shared.cli") + 1 :][:3])
                out[name] = dict(item.split("=", 1) for item in environ if "=" in item)
    return out


def test_every_common_setting_is_given_to_services_or_made_per_service() -> None:
    names = {f.name for f in msgspec.structs.fields(CommonConfig)}
    assert set(SHARED_SETTINGS) | PER_SERVICE == names and not set(SHARED_SETTINGS) & PER_SERVICE


def test_ups_own_settings_stay_its_own_and_service_flags_reach_every_service(tmp_path: Path) -> None:
    data, spans = tmp_path / "cluster", tmp_path / "spans.jsonl"
    own = {
        "GPU_DRA_NODES": "1",
        "GPU_DRA_GPUS": "h100x1",
        "GPU_DRA_DATA_DIR": str(data),
        "GPU_DRA_RUNTIME": "none",
        "GPU_DRA_LOG_LEVEL": "debug",
    }  # the last one a service shares
    up = Up(
        None,
        "--otel-exporter",
        f"file:{spans}",
        "--otel-periodic-ratio",
        "0.5",
        "--health-stall-seconds",
        "42",
        nodes=None,
        env=own,
    )
    try:
        up.wait_ready()
        up.kubeconfig = data / "kubeconfig"
        assert [n["metadata"]["name"] for n in up.json("get", "nodes")["items"]] == ["gpu-node-0"]
        services = services_of(up.proc.pid)
        assert {"apiserver", "publisher", "discovery", "preparer", "kubelet", "scheduler"} <= {
            n.split()[0] for n in services
        }, sorted(services)
        want = {
            "GPU_DRA_OTEL_EXPORTER": f"file:{spans}",
            "GPU_DRA_OTEL_PERIODIC_RATIO": "0.5",
            "GPU_DRA_HEALTH_STALL_SECONDS": "42.0",
            "GPU_DRA_LOG_LEVEL": "debug",
            "GPU_DRA_NATS_REPLICAS": "1",
        }
        assert set(want) == {"GPU_DRA_" + name.upper() for name in SHARED_SETTINGS}
        for name, env in services.items():
            assert {k: env.get(k) for k in want} == want, name
            leaked = sorted(
                k for k in ("GPU_DRA_NODES", "GPU_DRA_GPUS", "GPU_DRA_DATA_DIR", "GPU_DRA_RUNTIME") if k in env
            )
            assert not leaked, f"{name} got up's own settings {leaked}"

        up.signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, "".join(up.output)
        written = {str(span.get("service", "")) for span in read_spans(spans)}
        assert {"gpu-dra-discovery", "gpu-dra-publisher", "gpu-dra-state-gate"} <= written, (
            written
        )  # each flushed its spans at exit
    finally:
        up.kill()
