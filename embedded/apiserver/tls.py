"""The serving certificate: a self-signed one for 127.0.0.1/localhost, made with the `openssl` tool.

TLS is not optional in practice: kubectl (client-go's clientcmd) sends a kubeconfig's bearer
token only over TLS, so a plain-HTTP server could not authenticate kubectl at all. The pair is
kept in the data directory when there is one (stable across restarts), else made once per
process in a private temporary directory.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import tempfile
from pathlib import Path

_process_dir: Path | None = None


class TlsUnavailable(RuntimeError):
    pass


def ensure_pair(directory: Path | None) -> tuple[Path, Path]:
    """(cert, key) paths, generating them when missing. Blocking: call via asyncio.to_thread."""
    global _process_dir
    if directory is None:
        if _process_dir is None:
            _process_dir = Path(tempfile.mkdtemp(prefix="gpu-dra-apiserver-tls-"))
        directory = _process_dir
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    if cert.exists() and key.exists():
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TlsUnavailable(
            "the 'openssl' tool is needed to make the API server's certificate; install it, or run with "
            "--insecure-http (kubectl will then not send the token, so --token must be empty)"
        )
    tmp_key, tmp_cert = key.with_suffix(".key.tmp"), cert.with_suffix(".crt.tmp")
    cmd = [
        openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-days", "3650", "-subj", "/CN=gpu-dra-apiserver",
        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-keyout", str(tmp_key), "-out", str(tmp_cert),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TlsUnavailable(f"openssl could not make a certificate: {done.stderr.strip()}")
    tmp_key.chmod(0o600)
    tmp_key.replace(key)
    tmp_cert.replace(cert)
    return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
