"""The temporary directories of `gpu-dra up` (its runtime dir and, without --data-dir, its data dir): their
names, which carry the pid of the `up` that made them, and the sweep that removes those whose `up` is gone."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from shared.logs import get_logger

log = get_logger(__name__)

# Temporary dirs are named <prefix><pid of gpu-dra up>-<random>, so that the ones an `up` killed with
# SIGKILL left behind can be told apart from those of an `up` still running, and removed.
RUNTIME_PREFIX, DATA_PREFIX = "gdra-", "gpu-dra-cluster-"
_OWNED = re.compile(rf"(?:{RUNTIME_PREFIX}|{DATA_PREFIX})(\d+)-[a-z0-9_]+")


def sweep_orphaned_dirs() -> list[Path]:
    """Remove the temporary dirs of `gpu-dra up`s that are gone (killed before they could); the removed."""
    removed: list[Path] = []
    for root in {Path("/tmp"), Path(tempfile.gettempdir())}:
        for path in [*root.glob(f"{RUNTIME_PREFIX}*-*"), *root.glob(f"{DATA_PREFIX}*-*")]:
            owned = _OWNED.fullmatch(path.name)
            if owned is None or not path.is_dir() or _alive(int(owned[1])):
                continue
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed a dir a killed gpu-dra up left behind", path=str(path), pid=int(owned[1]))
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
