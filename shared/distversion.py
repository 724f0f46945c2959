"""An installed distribution's version without `importlib.metadata`.

`importlib.metadata` brings `zipfile`, `csv`, `email` and `importlib.resources` with it: ~1.1 MB of a
preparer's RSS, for two version strings (ours, for `service.version` and `gpu_dra_build_info`, and
nats-py's, which it reads at import for its CONNECT). `version()` reads the version from the name of
the distribution's `<name>-<version>.dist-info` directory, the first on `sys.path`, as
`importlib.metadata` finds it; `metadata_stand_in()` lets a third-party import that calls
`importlib.metadata.version` at its top (nats-py) use it, and leaves `sys.modules` as it was.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import types
from collections.abc import Iterator

_SEPARATORS = re.compile(r"[-_.]+")


class PackageNotFoundError(ModuleNotFoundError):
    """No such distribution is installed (as `importlib.metadata.PackageNotFoundError`)."""


def _normal(name: str) -> str:
    return _SEPARATORS.sub("_", name).lower()  # PEP 503 names; dist-info directories use `_`


def version(distribution: str) -> str:
    """The version of `distribution` (`gpu-dra`, `nats-py`), from the first `<name>-<version>.dist-info`
    directory on `sys.path` whose name normalises to it."""
    found = _installed().get(_normal(distribution))
    if found is None:
        raise PackageNotFoundError(distribution)
    return found


@functools.cache
def _installed() -> dict[str, str]:
    """Normalised distribution name -> version, the first of each on `sys.path` (read once per process)."""
    versions: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info"):
                project, _, found = name[: -len(".dist-info")].rpartition("-")
                if project:
                    versions.setdefault(_normal(project), found)
    return versions


@contextlib.contextmanager
def metadata_stand_in() -> Iterator[None]:
    """Within: `importlib.metadata` is a module offering `version` and `PackageNotFoundError` only (from
    here), unless the real one is loaded already; after, `sys.modules` has no `importlib.metadata` of ours."""
    if "importlib.metadata" in sys.modules:
        yield
        return
    stand_in = types.ModuleType("importlib.metadata", __doc__)
    stand_in.version = version  # type: ignore[attr-defined]
    stand_in.PackageNotFoundError = PackageNotFoundError  # type: ignore[attr-defined]
    sys.modules["importlib.metadata"] = stand_in
    try:
        yield
    finally:
        if sys.modules.get("importlib.metadata") is stand_in:
            del sys.modules["importlib.metadata"]
