"""`gpu-dra up` flags: the command lines the local cluster builds are ones its services accept."""
from __future__ import annotations

import pytest

from embedded.cluster.local import ClusterConfig, publisher_argv
from services.publisher.config import PublisherConfig
from shared.config import load_config


@pytest.mark.parametrize(("dynamic", "expected"), [(True, "dynamic"), (False, "static")])
def test_dynamic_mig_reaches_the_publisher_as_its_mig_mode(dynamic: bool, expected: str) -> None:
    prog, *argv = publisher_argv(ClusterConfig(dynamic_mig=dynamic))
    assert prog == "publisher"
    cfg = load_config(PublisherConfig, argv, prog=prog, env={})
    assert cfg.mig_mode == expected
