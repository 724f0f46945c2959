"""The ledger file: read at start, replaced atomically after each batch (write, fsync, rename).

A crash leaves either the old file or the new one, never a torn one; file I/O runs off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from .accounting import Ledger, LedgerFileError


def _read(path: Path, retention_s: float) -> Ledger:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Ledger(retention_s)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LedgerFileError(f"{path}: not JSON ({exc}); move it aside to rebuild from the stream") from None
    if not isinstance(data, dict):
        raise LedgerFileError(f"{path}: expected a JSON object")
    return Ledger.from_json(data, retention_s, where=str(path))


def _write(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


async def load(path: Path, retention_s: float) -> Ledger:
    return await asyncio.to_thread(_read, path, retention_s)


async def save(path: Path, ledger: Ledger) -> None:
    payload = (json.dumps(ledger.to_json(), indent=1, sort_keys=True) + "\n").encode()
    await asyncio.to_thread(_write, path, payload)
