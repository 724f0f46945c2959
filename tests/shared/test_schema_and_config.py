"""Schema export validates as draft 2020-12; config errors name the setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import msgspec
import pytest

from shared.config import CommonConfig, ConfigError, load_config
from shared.events.catalog import CATALOG
from shared.events.schema import write_schemas


def test_schema_export_cli_writes_valid_schemas(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shared.cli", "events", "schema", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote" in out.stdout
    index = json.loads((tmp_path / "index.json").read_text())
    assert {e["subject"] for e in index["subjects"]} == {e.subject for e in CATALOG}
    for item in index["subjects"]:
        schema = json.loads((tmp_path / item["schema"]).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$schema"].endswith("2020-12/schema")


def test_schema_accepts_real_messages_and_rejects_wrong_types(tmp_path: Path) -> None:
    write_schemas(tmp_path)
    schema = json.loads((tmp_path / "DeviceHealth.json").read_text())
    from shared.events.health import DeviceHealth

    good = json.loads(msgspec.json.encode(DeviceHealth(node="n", device="gpu-0", state="Unhealthy", xid=79)))
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "xid": "79"}, schema)


class _Cfg(CommonConfig, kw_only=True):
    node_name: str = ""
    period_s: float = 30.0


def test_config_flags_env_and_errors() -> None:
    cfg = load_config(_Cfg, ["--period-s", "5"], prog="t", env={"GPU_DRA_NODE_NAME": "n1"})
    assert (cfg.node_name, cfg.period_s) == ("n1", 5.0)
    with pytest.raises(ConfigError, match="GPU_DRA_NODE_NAMES"):
        load_config(_Cfg, [], prog="t", env={"GPU_DRA_NODE_NAMES": "x"})
    with pytest.raises(ConfigError, match="--period-s"):
        load_config(_Cfg, ["--period-s", "soon"], prog="t", env={})
    with pytest.raises(ConfigError, match="one of debug"):
        load_config(_Cfg, [], prog="t", env={"GPU_DRA_LOG_LEVEL": "loud"})
    # the shipped telemetry ConfigMap sets GPU_DRA_OTEL_PERIODIC_RATIO for every service
    assert load_config(_Cfg, [], prog="t", env={"GPU_DRA_OTEL_PERIODIC_RATIO": "0.25"}).otel_periodic_ratio == 0.25
    with pytest.raises(ConfigError, match="GPU_DRA_OTEL_PERIODIC_RATIO"):
        load_config(_Cfg, [], prog="t", env={"GPU_DRA_OTEL_PERIODIC_RATIO": "2"})
