"""shared.heap.settle: survivors are frozen out of full passes; a cycle among them is freed by the next settle.
A `gpu-dra` command's import (its process's start-up) is frozen the same way. The C heap's free pages go back
to the kernel where the C library is glibc."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import heap
from shared.heap import settle


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_a_frozen_cycle_waits_for_the_next_settle() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    settle()
    assert gc.get_freeze_count() > 0
    del a, b
    gc.collect()
    assert gone() is not None  # frozen: a full pass does not look at it
    settle()
    assert gone() is None


def test_collection_is_paused_inside_the_block_only() -> None:
    import shared.heap as heap

    with heap.collection_paused():
        assert not gc.isenabled()
        with heap.collection_paused():  # nested: the outer block decides
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with heap.collection_paused():
            pass
        assert not gc.isenabled()  # a caller's own disable is left alone
    finally:
        gc.enable()


def test_freed_memory_goes_back_to_the_kernel_on_glibc() -> None:
    on_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert heap.release_free_memory() is on_glibc


def test_burst_trim_waits_for_the_last_request_and_enough_work(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[int] = []

    def release() -> bool:
        released.append(1)
        return True

    monkeypatch.setattr(heap, "release_free_memory", release)
    trim = heap.BurstTrim(after=3)
    for _ in range(2):
        with trim.request():
            pass
    assert released == []  # 2 claims, one at a time: not enough work yet
    with trim.request(), trim.request(5):  # a burst: two calls in flight
        pass
    assert released == [1] and trim.trims == 1 and trim.done == 0  # once, when the last one ended
    with trim.request():
        with trim.request(4):
            pass
        assert released == [1]  # one still in flight: later
    assert released == [1, 1]
    with pytest.raises(RuntimeError), trim.request(3):  # a call that fails still ends
        raise RuntimeError
    assert released == [1, 1, 1] and trim.in_flight == 0


_ARENAS = r"""
import ctypes, sys, threading
from shared import heap
if sys.argv[1] == "one":
    assert heap.one_malloc_arena()
def work():
    kept = [bytes(2048) for _ in range(200)]  # over 512 bytes: glibc's malloc, in this thread
    del kept
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's arenas")
@pytest.mark.parametrize(("mode", "one"), [("one", True), ("default", False)])
def test_threads_allocate_from_the_main_arena_when_asked(mode: str, one: bool) -> None:
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _ARENAS, mode],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    arenas = out.stderr.count("Arena ")
    assert (arenas == 1) if one else (arenas > 1), out.stderr


PROBE_COMMAND = """
import gc

PASSES_BEFORE = sum(g["collections"] for g in gc.get_stats())  # collector passes run so far

class Loaded:  # made at import: lives as long as the process
    pass

LOADED = Loaded()
TABLES = [[] for _ in range(20_000)]  # as much as a young pass would walk after a service's import, and more

def main(argv):
    tracked = {id(o) for o in gc.get_objects()}  # what the collector's passes still walk
    passes = sum(g["collections"] for g in gc.get_stats()) - PASSES_BEFORE  # since this import began
    print(gc.isenabled(), gc.get_freeze_count() > 0, id(LOADED) in tracked, id(Loaded) in tracked, passes)
"""

RUN_PROBE = """
import sys
from importlib.metadata import EntryPoint
from shared import cli
sys.argv = ["gpu-dra", "probe"]
point = EntryPoint("probe", "probecmds:COMMANDS", cli.GROUP)
sys.exit(cli.main(None if {own} else ["probe"], points=[point]))
"""


@pytest.mark.parametrize("own", [True, False])
def test_a_commands_import_is_frozen_out_of_the_collectors_passes(tmp_path, own: bool) -> None:
    (tmp_path / "probecmds.py").write_text("COMMANDS = {'probe': ('probecmd', 'reports the collector')}\n")
    (tmp_path / "probecmd.py").write_text(PROBE_COMMAND)
    repo = Path(__file__).resolve().parents[2]
    enabled, frozen, loaded_tracked, class_tracked, passes = subprocess.run(
        [sys.executable, "-c", RUN_PROBE.format(own=own)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{repo}"},
    ).stdout.split()
    assert enabled == "True"  # collection runs again once the command does
    if own:  # the process's own command line: its import walked by no pass, then frozen before any could run
        assert (frozen, loaded_tracked, class_tracked, passes) == ("True", "False", "False", "0")
    else:  # a command run from Python code (a test): left alone, its import collected as any other
        assert (frozen, loaded_tracked, class_tracked) == ("False", "True", "True") and int(passes) > 0
