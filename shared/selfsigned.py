"""Self-signed serving certificates made with the `openssl` tool, and the TLS server context for them.

The certificate is its own CA (basicConstraints CA:TRUE), so its PEM is the `caBundle` a client
verifies it with. Used by the embedded API server and by `gpu-dra webhook --self-signed`.

    cert, key = make_pair(directory, "webhook", common_name="gpu-dra-webhook", sans=["DNS:localhost"])
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Sequence
from pathlib import Path


class TlsUnavailable(RuntimeError):
    """No `openssl` tool, or it failed: the message says which and what to do instead."""


def make_pair(
    directory: Path, stem: str, *, common_name: str, sans: Sequence[str], days: int = 3650
) -> tuple[Path, Path]:
    """(`<stem>.crt`, `<stem>.key`) in `directory`, made when missing (atomically; the key 0600).
    `sans`: subjectAltName entries (`IP:127.0.0.1`, `DNS:name`). Blocking: call via asyncio.to_thread."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
    if cert.exists() and key.exists():
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TlsUnavailable(
            f"the 'openssl' tool is needed to make the {common_name} certificate; install it, "
            "or give a certificate and key made elsewhere"
        )
    tmp_key, tmp_cert = key.with_suffix(".key.tmp"), cert.with_suffix(".crt.tmp")
    cmd = [
        openssl,
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        str(days),
        "-subj",
        f"/CN={common_name}",
        "-addext",
        "subjectAltName=" + ",".join(sans),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-keyout",
        str(tmp_key),
        "-out",
        str(tmp_cert),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TlsUnavailable(f"openssl could not make a certificate: {done.stderr.strip()}")
    tmp_key.chmod(0o600)
    tmp_key.replace(key)
    tmp_cert.replace(cert)
    return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS 1.2+ server context serving `cert` (HTTP/1.1)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
