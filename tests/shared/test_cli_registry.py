"""`gpu-dra` finds its commands through one registration point: each package's table, registered in
pyproject.toml's `gpu_dra.commands` entry-point group. Checked against a distribution made on disk (its
metadata and its tables, as an install lays them out), and against this repository's own registrations."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import EntryPoint, distributions, entry_points
from pathlib import Path

import pytest

from shared import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_modules() -> Iterator[None]:
    """Each test's fake packages are its own: none stays imported for the next."""
    yield
    for name in [n for n in sys.modules if n.startswith(("fakeprod", "fakelocal"))]:
        del sys.modules[name]


def _installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, extra_package: bool) -> list[EntryPoint]:
    """A distribution `fake` with a base table (`fakeprod`) and a table of its `local` extra (`fakelocal`), whose
    `boom` command needs a module nobody has; `extra_package=False`: fakelocal left out, as a production image."""
    info = tmp_path / "fake-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake\nVersion: 1.0\nProvides-Extra: local\n")
    (info / "entry_points.txt").write_text(
        f"[{cli.GROUP}]\nlocal = fakelocal.commands:COMMANDS\nprod = fakeprod.commands:COMMANDS\n"
    )
    packages = {"fakeprod": {"hello": ("fakeprod.hello", "says hello")}}
    if extra_package:
        packages["fakelocal"] = {"up": ("fakelocal.up", "a local cluster"), "boom": ("fakelocal.boom", "needs more")}
    for package, table in packages.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "commands.py").write_text(f"COMMANDS = {table!r}\n")
        for _, (module, _) in table.items():
            body = "import not_installed_anywhere\n" if module.endswith("boom") else ""
            body += f"def main(argv):\n    print('ran {module}', argv)\n    return 0\n"
            (tmp_path / Path(*module.split("."))).with_suffix(".py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    (dist,) = distributions(path=[str(tmp_path)])
    return list(dist.entry_points.select(group=cli.GROUP))


def test_help_lists_the_base_install_first_and_runs_a_command(tmp_path, monkeypatch, capsys) -> None:
    points = _installed(tmp_path, monkeypatch, extra_package=True)
    assert cli.main(["--help"], points=points) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == ["hello", "up", "boom"]
    assert cli.main(["up", "-x"], points=points) == 0
    assert capsys.readouterr().out == "ran fakelocal.up ['-x']\n"


def test_a_base_command_reads_only_its_own_table(tmp_path, monkeypatch) -> None:
    points = _installed(tmp_path, monkeypatch, extra_package=True)
    assert list(cli.registry(points, until="hello").commands) == ["hello"]


def test_without_the_extras_package_the_base_commands_run_and_the_extra_is_named(tmp_path, monkeypatch, capsys) -> None:
    points = _installed(tmp_path, monkeypatch, extra_package=False)
    assert cli.main(["--help"], points=points) == 0
    out = capsys.readouterr().out
    assert "hello" in out and "pip install 'gpu-dra[local]'" in out
    assert cli.main(["hello"], points=points) == 0
    assert cli.main(["up"], points=points) == 2
    err = capsys.readouterr().err
    assert "no command 'up' in this install" in err and "pip install 'gpu-dra[local]'" in err, err


def test_a_command_whose_extra_requirements_are_missing_names_the_extra(tmp_path, monkeypatch, capsys) -> None:
    points = _installed(tmp_path, monkeypatch, extra_package=True)
    assert cli.main(["boom"], points=points) == 2
    err = capsys.readouterr().err
    assert "needs the 'local' extra" in err and "no module 'not_installed_anywhere'" in err, err


def test_no_registration_at_all_says_to_reinstall(capsys) -> None:
    assert cli.main(["--help"], points=[]) == 0
    assert "pip install -e ." in capsys.readouterr().out
    assert cli.main(["preparer"], points=[]) == 2


def _declared() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][cli.GROUP]


def test_every_package_registers_its_table_and_each_command_has_a_module() -> None:
    declared = _declared()
    assert set(declared) == {"services", "shared", "embedded"}
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "embedded" in extras, "the local cluster's registration is named after its extra"
    names: list[str] = []
    for package, value in declared.items():
        table = EntryPoint(package, value, cli.GROUP).load()
        for name, (module, summary) in table.items():
            assert module.split(".")[0] == package, f"{package} registers {name} of another package"
            assert importlib.util.find_spec(module) is not None, module
            assert summary and "\n" not in summary
        names += table
    assert len(names) == len(set(names)), "a command registered twice"


def test_the_installed_metadata_registers_what_pyproject_declares() -> None:
    """A stale install (pyproject.toml changed since `pip install -e .`) would miss commands: reinstall."""
    installed = {point.name: point.value for point in entry_points(group=cli.GROUP)}
    assert installed == _declared(), "the installed metadata is stale: run pip install -e '.[dev,embedded]'"


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`gpu-dra --help | head -1` with head gone before gpu-dra writes: exit 0 and nothing on stderr (Python
    itself would print "Exception ignored ... BrokenPipeError" and exit 120)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from shared.cli import main; sys.exit(main())", "--help"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first byte
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (0, b"")


def _commands() -> list[str]:
    names: list[str] = []
    for package, value in _declared().items():
        names += EntryPoint(package, value, cli.GROUP).load()
    return names


@pytest.mark.parametrize("name", _commands())
def test_every_command_answers_help_with_its_usage_and_exit_0(name: str) -> None:
    """`gpu-dra <command> --help`, a real process each: the command's usage on stdout, nothing on stderr, exit 0,
    and nothing started (discovery's help once raised on a literal `%`; pipeline-demo's ran the demo)."""
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli", name, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: gpu-dra {name}"), done.stdout[:300]
