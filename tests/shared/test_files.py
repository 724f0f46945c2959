"""`shared.files.SlotFile`: a file replaced whole through two slot inodes, none created or freed per write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared.files import AppendFile, SlotFile, fill_in_place


def test_writes_alternate_between_two_inodes_and_the_file_is_always_whole(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"first version, long enough to be cut short")
    slots = SlotFile(path)
    slots.open()
    inodes = set()
    for n in range(6):
        body = f"version {n}".encode() * (n + 1)
        slots.write(body)
        assert path.read_bytes() == body  # a shorter body leaves nothing of the longer one before it
        inodes.add(path.stat().st_ino)
    assert len(inodes) == 2 and path.stat().st_nlink == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".state.json.slot-a", ".state.json.slot-b", "state.json"]


def test_a_link_left_by_a_crash_and_a_file_replaced_behind_its_back_are_taken_in(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    slots = SlotFile(path)
    slots.open()  # no file yet: the first write creates it
    slots.write(b"one")
    os.link(slots.slots[0], tmp_path / ".state.json.link")  # killed between its link and its rename
    slots.write(b"two")
    assert path.read_bytes() == b"two"
    path.unlink()
    path.write_bytes(b"written by someone else")  # a new inode, not a slot
    again = SlotFile(path)
    again.open()
    assert path.read_bytes() == b"written by someone else"
    again.write(b"three")
    assert path.read_bytes() == b"three" and path.stat().st_nlink == 2


def test_a_process_killed_while_writing_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    """SIGKILL a process in a loop of large writes: the file it leaves is one of the bodies it wrote."""
    path = tmp_path / "state.json"
    script = (
        "import sys\nfrom pathlib import Path\nfrom shared.files import SlotFile\n"
        "s = SlotFile(Path(sys.argv[1])); s.open()\nn = 0\n"
        "while True:\n    s.write(str(n % 10).encode() * (1 << 20 if n % 2 else 1 << 16)); n += 1\n"
        "    if n == 20: print('writing', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    proc.kill()
    proc.wait()
    body = path.read_bytes()
    assert len(body) in (1 << 20, 1 << 16) and body == body[:1] * len(body)


def test_a_content_filled_in_place_is_cut_only_when_shorter(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fill_in_place(path, b"0123456789", create=True)
    inode = path.stat().st_ino
    fill_in_place(path, b"abc")
    assert path.read_bytes() == b"abc", "a shorter content leaves no tail"
    fill_in_place(path, b"abcdefghijkl")
    assert path.read_bytes() == b"abcdefghijkl"
    assert path.stat().st_ino == inode


def test_appends_share_one_descriptor_until_the_file_is_replaced_and_reopened(tmp_path: Path) -> None:
    path = tmp_path / "log"
    appends = AppendFile(path)
    appends.append(b"a\n")
    appends.append(b"b\n")
    assert path.read_bytes() == b"a\nb\n"
    held = os.stat(path).st_ino
    (tmp_path / "new").write_bytes(b"compacted\n")
    os.replace(tmp_path / "new", path)
    appends.append(b"lost\n")  # still the descriptor of the replaced file: not opened per append
    assert path.read_bytes() == b"compacted\n" and os.stat(path).st_ino != held
    appends.reopen()
    appends.append(b"d\n")
    assert path.read_bytes() == b"compacted\nd\n"
