"""The serving certificate: a self-signed one for 127.0.0.1/localhost, made with the `openssl` tool.

TLS is not optional in practice: kubectl (client-go's clientcmd) sends a kubeconfig's bearer
token only over TLS, so a plain-HTTP server could not authenticate kubectl at all. The pair is
kept in the data directory when there is one (stable across restarts), else made once per
process in a private temporary directory, removed when the process exits.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from shared.selfsigned import TlsUnavailable, make_pair, server_context

__all__ = ["TlsUnavailable", "ensure_pair", "server_context"]

_process_dir: Path | None = None


def ensure_pair(directory: Path | None) -> tuple[Path, Path]:
    """(cert, key) paths, generating them when missing. Blocking: call via asyncio.to_thread."""
    global _process_dir
    if directory is None:
        if _process_dir is None:
            _process_dir = Path(tempfile.mkdtemp(prefix="gpu-dra-apiserver-tls-"))
            atexit.register(shutil.rmtree, _process_dir, ignore_errors=True)  # its key stays nowhere after
        directory = _process_dir
    try:
        return make_pair(
            directory, "apiserver", common_name="gpu-dra-apiserver", sans=["IP:127.0.0.1", "DNS:localhost"]
        )
    except TlsUnavailable as exc:
        raise TlsUnavailable(
            f"{exc} (or run with --insecure-http: kubectl will then not send the token, so --token must be empty)"
        ) from None
