"""Publisher settings and API version discovery: bad input is refused with the setting named."""

from __future__ import annotations

import pytest

from services.publisher import apiversion, config
from shared.config import ConfigError


def test_bad_settings_name_the_setting():
    with pytest.raises(ConfigError, match="--lease-seconds"):
        config.parse(["--lease-seconds", "0.5", "--heartbeat-seconds", "1"])
    with pytest.raises(ConfigError, match="--probe-seconds must be >= 0"):
        config.parse(["--probe-seconds", "-1"])
    assert config.parse(["--probe-seconds", "0"]).probe_seconds == 0
    with pytest.raises(ConfigError, match=r"--mig-mode"):
        config.parse(["--mig-mode", "sometimes"])
    with pytest.raises(ConfigError, match="--api-token needs --api-url"):
        config.parse(["--api-token", "t"])
    assert config.parse(["--replica-id", "r1"]).replica_id == "r1"


def test_version_choice_and_layout_follow_the_server():
    group: dict[str, object] = {"versions": [{"version": "v1beta1"}, {"version": "v1"}]}
    p = apiversion.profile_from(group, {"major": "1", "minor": "35+", "gitVersion": "v1.35.1"})
    assert (p.api_version, p.minor, p.counter_layout) == ("v1", 35, "counters-only-slice")
    assert p.max_devices(True) == 64 and p.max_devices(False) == 128
    old = apiversion.profile_from({"versions": [{"version": "v1beta1"}]}, {"major": "1", "minor": "33"})
    assert (old.api_version, old.counter_layout, old.max_devices(True)) == ("v1beta1", "beside-devices", 128)
    with pytest.raises(apiversion.ApiDiscoveryError, match="needs v1"):
        apiversion.profile_from({"versions": [{"version": "v1alpha3"}]}, {"minor": "31"})
    with pytest.raises(apiversion.ApiDiscoveryError, match="--api-version v1 asked for"):
        apiversion.choose_version(["v1beta1"], "v1")
