"""TLS options of every client (GPU_DRA_NATS_TLS_CA/_CERT/_KEY through shared.runtime.nats_tls) against
a real nats-server on the shipped config plus a `tls {verify: true}` block, with certificates made
by openssl for this test: the CA and a client certificate get in, a missing certificate or another
CA does not, and half a certificate is a clear error before any connect."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from shared.bus import Bus, BusError, NatsTLS
from shared.config import CommonConfig
from shared.runtime import nats_tls
from tests.deploy.conftest import ShippedConfigNats, nats_layout, server_env, test_password


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        pytest.skip("openssl is not installed: it makes the test certificates")
    subprocess.run([binary, *args], check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(cert),
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
    )
    return key, cert


def _signed(directory: Path, name: str, ca: tuple[Path, Path], san: str) -> tuple[Path, Path]:
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca[1]),
        "-CAkey",
        str(ca[0]),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca = _ca(root, "gpu-dra-ca")
    other_ca = _ca(root, "other-ca")
    server = _signed(root, "gpu-dra-nats", ca, "IP:127.0.0.1,DNS:localhost")
    client = _signed(root, "preparer", ca, "DNS:preparer")
    stranger = _signed(root, "stranger", other_ca, "DNS:stranger")
    return {
        "ca": ca[1],
        "other_ca": other_ca[1],
        "server_key": server[0],
        "server_cert": server[1],
        "client_key": client[0],
        "client_cert": client[1],
        "stranger_key": stranger[0],
        "stranger_cert": stranger[1],
    }


@pytest.fixture
async def tls_server(tmp_path: Path, pki: dict[str, Path]) -> AsyncIterator[str]:
    config_dir = nats_layout(tmp_path, ["gpu-a"])
    (config_dir / "nats-tls-test.conf").write_text(
        'include "nats.conf"\n'
        f'tls {{ cert_file: "{pki["server_cert"]}", key_file: "{pki["server_key"]}", '
        f'ca_file: "{pki["ca"]}", verify: true, timeout: 2 }}\n'
    )
    store = tmp_path / "js"
    server = ShippedConfigNats(config_dir / "nats-tls-test.conf", server_env("tls-test", store), store, gate=False)
    await server.start()
    try:
        yield f"tls://127.0.0.1:{server.port}"
    finally:
        await server.close()


def _settings(pki: dict[str, Path], **overrides: str) -> CommonConfig:
    values: dict[str, Any] = {
        "nats_tls_ca": str(pki["ca"]),
        "nats_tls_cert": str(pki["client_cert"]),
        "nats_tls_key": str(pki["client_key"]),
    }
    return CommonConfig(
        nats_user="preparer.gpu-a", nats_password=test_password("preparer.gpu-a"), **(values | overrides)
    )


async def _connect(url: str, config: CommonConfig) -> Bus:
    return await Bus.connect(
        url,
        name="tls-test",
        user=config.nats_user,
        password=config.nats_password,
        tls=nats_tls(config),
        initial_attempts=1,
    )


async def test_the_ca_and_a_client_certificate_get_in(tls_server: str, pki: dict[str, Path]) -> None:
    bus = await _connect(tls_server, _settings(pki))
    try:
        assert bus.connected and bus.nc.connected_url is not None and bus.nc.connected_url.scheme == "tls"
        await bus.nc.flush()
    finally:
        await bus.close()


@pytest.mark.parametrize(
    "overrides",
    [
        {"nats_tls_cert": "", "nats_tls_key": ""},  # the server verifies clients: no certificate, no entry
        {"nats_tls_ca": "other_ca"},  # the server's certificate is not from the CA the client trusts
        {"nats_tls_cert": "stranger_cert", "nats_tls_key": "stranger_key"},  # a client cert of another CA
    ],
)
async def test_without_the_right_certificates_the_connect_fails(
    tls_server: str, pki: dict[str, Path], overrides: dict[str, str]
) -> None:
    config = _settings(pki, **{k: str(pki[v]) if v else "" for k, v in overrides.items()})
    options, _ = await nats_tls(config).connect_options()  # what Bus.connect passes
    with pytest.raises((nats.errors.Error, OSError, ssl.SSLError, TimeoutError)):
        await nats.connect(
            tls_server,
            user=config.nats_user,
            password=config.nats_password,
            allow_reconnect=False,
            connect_timeout=2,
            **options,
        )


async def test_half_a_client_certificate_is_a_clear_error(pki: dict[str, Path]) -> None:
    with pytest.raises(BusError, match="needs both GPU_DRA_NATS_TLS_CERT and GPU_DRA_NATS_TLS_KEY"):
        await NatsTLS(cert_file=str(pki["client_cert"])).connect_options()
    with pytest.raises(BusError, match="cannot load the NATS TLS files"):
        await NatsTLS(ca_file="/nonexistent/ca.crt").connect_options()
