"""shared.kube.client against the embedded API server over real TLS (its self-signed certificate): an https
URL is verified (against the system store when no CA file is given, so this server is refused), the CA
file makes it trusted, and skipping verification is an explicit, logged opt-in. The publisher's flags
refuse TLS settings that would be ignored."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio.client import ApiClient, VersionApi

from embedded.apiserver.testing import running_apiserver
from services.publisher import config
from shared.config import ConfigError
from shared.kube.client import kube_api_client


async def _version(api: ApiClient) -> str:
    try:
        return str((await VersionApi(api).get_code()).git_version)
    finally:
        await api.close()


async def test_https_is_verified_unless_skipping_is_asked_for_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_apiserver(tmp_path) as server:
        assert server.url.startswith("https://")
        ca = tmp_path / "ca.pem"
        ca.write_bytes(server.server.ca_pem)

        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await _version(await kube_api_client(url=server.url, token=server.token))

        assert await _version(await kube_api_client(url=server.url, token=server.token, ca_file=str(ca)))
        assert not [r for r in caplog.records if "TLS verification" in r.getMessage()]

        with caplog.at_level(logging.WARNING, logger="shared.kube.client"):
            assert await _version(
                await kube_api_client(url=server.url, token=server.token, insecure_skip_tls_verify=True)
            )
        warned = [r for r in caplog.records if "TLS verification of the API server is OFF" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING


async def test_skipping_verification_without_a_url_is_refused() -> None:
    with pytest.raises(ValueError, match="applies to an API URL only"):
        await kube_api_client(insecure_skip_tls_verify=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-insecure-skip-tls-verify"], "need --api-url"),
        (["--api-ca-file", "/etc/ca.pem"], "need --api-url"),
        (["--api-url", "https://k:6443", "--api-ca-file", "/ca", "--api-insecure-skip-tls-verify"], "not both"),
    ],
)
def test_publisher_refuses_tls_settings_that_would_be_ignored(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.parse(argv)


def test_publisher_takes_the_explicit_opt_in() -> None:
    cfg = config.parse(["--api-url", "https://k:6443", "--api-insecure-skip-tls-verify"])
    assert cfg.api_insecure_skip_tls_verify is True and config.parse([]).api_insecure_skip_tls_verify is False


async def test_requests_skip_environment_lookups_unless_a_proxy_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No proxy variable: the session does no .netrc/proxy lookups per request (they cost a thread hop
    each). HTTPS_PROXY set: requests go through that proxy, as client-go's do."""
    import asyncio

    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readline())
        writer.close()

    listener = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with running_apiserver(tmp_path) as server, listener:
        for name in (
            "HTTPS_PROXY",
            "HTTP_PROXY",
            "ALL_PROXY",
            "https_proxy",
            "http_proxy",
            "all_proxy",
            "NO_PROXY",
            "no_proxy",
        ):
            monkeypatch.delenv(name, raising=False)
        api = await kube_api_client(url=server.url, token=server.token, insecure_skip_tls_verify=True)
        assert api.rest_client.pool_manager.trust_env is False
        assert await _version(api)
        assert seen == []

        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
        with pytest.raises(aiohttp.ClientError):
            await _version(await kube_api_client(url=server.url, token=server.token, insecure_skip_tls_verify=True))
        assert seen and seen[0].startswith(b"CONNECT 127.0.0.1:")
