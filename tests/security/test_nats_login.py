"""A refused NATS login ends the connect: wrong password, unknown user or a URL's bad credentials
fail within seconds with what was refused, for whom and what to do, and a service process exits
non-zero with that message (Kubernetes shows CrashLoopBackOff with the reason) instead of waiting
forever. An unreachable server is a different error, tried with backoff. Refused and revoked creds
files: tests/security/test_nats_credentials.py."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from shared.bus import Bus, BusError, LoginRefused
from shared.natsserver import EmbeddedNats
from shared.ports import free_port
from tests.security.conftest import url_as

REFUSED = "refused the login of"
WHAT_TO_DO = "gpu-dra nats credentials"


async def _refused(url: str, **kwargs: object) -> str:
    started = time.monotonic()
    with pytest.raises(LoginRefused) as caught:
        async with asyncio.timeout(10):
            await Bus.connect(url, name="login-test", **kwargs)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5.0, "the refused login was retried too long"
    return str(caught.value)


async def test_a_wrong_password_ends_the_connect_with_a_clear_error(shipped_nats: EmbeddedNats) -> None:
    message = await _refused(shipped_nats.url, user="preparer.gpu-a", password="not-its-password")
    assert f"{REFUSED} user 'preparer.gpu-a' (GPU_DRA_NATS_USER with GPU_DRA_NATS_PASSWORD) 3 times" in message
    assert "Authorization Violation" in message and WHAT_TO_DO in message
    assert "not-its-password" not in message


async def test_an_unknown_user_in_the_url_is_refused_and_the_password_not_shown(shipped_nats: EmbeddedNats) -> None:
    url = shipped_nats.url.replace("nats://", "nats://intruder:secret-pw@", 1)
    message = await _refused(url, login_attempts=1)
    assert f"{REFUSED} user 'intruder' (from GPU_DRA_NATS_URL) 1 times" in message
    assert "secret-pw" not in message and shipped_nats.url in message


async def test_an_anonymous_client_is_told_to_set_credentials(shipped_nats: EmbeddedNats) -> None:
    message = await _refused(shipped_nats.url)
    assert f"{REFUSED} an anonymous client" in message


async def test_the_right_password_still_gets_in(shipped_nats: EmbeddedNats) -> None:
    bus = await Bus.connect(url_as(shipped_nats, "preparer.gpu-a"), name="login-test", initial_attempts=2)
    try:
        assert bus.connected and bus.nc.options["allow_reconnect"] is True  # later losses are redialled
    finally:
        await bus.close()


async def test_an_unreachable_server_is_a_network_error_tried_with_backoff() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(BusError, match=rf"cannot connect to NATS at nats://127.0.0.1:{port} after 4 attempts") as e:
        await Bus.connect(f"nats://127.0.0.1:{port}", name="login-test", initial_attempts=4)
    assert REFUSED not in str(e.value) and not isinstance(e.value, LoginRefused)
    assert time.monotonic() - started >= 0.1 + 0.2 + 0.4  # the backoff between the 4 attempts


async def test_a_service_with_a_wrong_password_exits_non_zero_with_the_reason(
    shipped_nats: EmbeddedNats, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "GPU_DRA_NATS_URL": shipped_nats.url,
        "GPU_DRA_NATS_USER": "cd-agent.gpu-a",
        "GPU_DRA_NATS_PASSWORD": "wrong",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.computedomain",
        "agent",
        "--node",
        "gpu-a",
        "--ip-address",
        "127.0.88.1",
        "--state-dir",
        str(tmp_path / "agent"),
        "--imex-daemon",
        "simulated",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(15):
            _out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 1
    assert f"{REFUSED} user 'cd-agent.gpu-a'" in err.decode(), err.decode()[-2000:]
