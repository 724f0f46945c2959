"""The `gpu-dra` console script: one subcommand per service and tool, dispatched lazily; `--version`; the
operator's errors (a bad file, a server out of reach) as one line (shared/clierrors.py).

The commands are not listed here: each package declares its own (services/commands.py, shared/commands.py,
embedded/commands.py: name -> (module with a `main(argv)`, one-line summary)) and registers that table in
pyproject.toml's `gpu_dra.commands` entry-point group, which this module reads from the installed package's
metadata. A registration named after one of the package's extras (`embedded`) belongs to that extra: when its
package or the extra's requirements are missing (a production image leaves both out), the message names the
extra to install. Listing the commands imports only the tables, never a command's module."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from shared import clierrors

GROUP = "gpu_dra.commands"


@dataclass(frozen=True)
class Command:
    module: str
    summary: str
    extra: str = ""  # the extra that brings it ("": the base install)


@dataclass
class Registry:
    commands: dict[str, Command] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)  # extra -> the missing module, for registrations not here


def _extra(point: EntryPoint) -> str:
    """The registration's name when its distribution declares an extra of that name, else ""."""
    extras = (point.dist.metadata.get_all("Provides-Extra") or []) if point.dist is not None else []
    return point.name if point.name in extras else ""


def registry(points: list[EntryPoint] | None = None, until: str = "") -> Registry:
    """The registered commands (`points`: the group's entry points, those of the installed metadata when None),
    the base install's first, the first registration of a name winning; a registration of an extra whose module
    is missing is noted as absent. With `until`, the tables are read until one has that command (a service's
    start reads its own table only)."""
    found = Registry()
    registered = [(_extra(point), point) for point in (entry_points(group=GROUP) if points is None else points)]
    for extra, point in sorted(registered, key=lambda pair: (pair[0] != "", pair[1].name)):
        try:
            table = point.load()
        except ModuleNotFoundError as exc:
            if not extra:
                raise
            found.absent[extra] = exc.name or point.module
            continue
        for name, (module, summary) in table.items():
            found.commands.setdefault(name, Command(module, summary, extra))
        if until and until in found.commands:
            break
    return found


def usage(found: Registry) -> str:
    lines = ["usage: gpu-dra <command> [options]   (gpu-dra --version: the version)", "", "commands:"]
    lines += [f"  {name:<14} {command.summary}" for name, command in found.commands.items()]
    if not found.commands:
        lines += [f"  (none registered: the package's metadata has no {GROUP!r} group; reinstall it: pip install -e .)"]
    lines += [f"  (more with: pip install 'gpu-dra[{extra}]')" for extra in found.absent]
    lines += ["", "Run 'gpu-dra <command> --help' for a command's options."]
    return "\n".join(lines)


def _lacking(extra: str, missing: str) -> str:
    return (
        f"the {extra!r} extra, which this install lacks (no module {missing!r}); install it with: "
        f"pip install 'gpu-dra[{extra}]' (a production image runs only the services)"
    )


def main(argv: list[str] | None = None, *, points: list[EntryPoint] | None = None) -> int:
    """Run the command `argv` names; with argv None, this process's own command line (the console script,
    `python -m shared.cli`), whose command's import is then the process's start-up (`_import`)."""
    try:
        status = _dispatch(sys.argv[1:] if argv is None else argv, points, start_up=argv is None)
        sys.stdout.flush()  # here, not at the interpreter's exit, so a reader gone away is seen below
        return status
    except BrokenPipeError:  # the reader went away (`gpu-dra --help | head -3`): the end, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush too
        return 0


def _import(module: str, *, start_up: bool) -> Any:
    """The command's module. As the process's start-up, its import makes the modules and classes (~90,000
    objects for a service) that live as long as the process: no collector pass walks them meanwhile, and none
    after (`heap.freeze_start_up`)."""
    if not start_up:
        return importlib.import_module(module)
    from shared import heap  # and with it shared.logs: every command's module imports both

    with heap.collection_paused():
        imported = importlib.import_module(module)
        heap.freeze_start_up()  # before collection resumes: no pass ever walks what import made
    return imported


def _dispatch(args: list[str], points: list[EntryPoint] | None, *, start_up: bool = False) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(registry(points)))
        return 0
    if args[0] in ("--version", "version"):
        from shared.telemetry import package_version

        print(f"gpu-dra {package_version()}")
        return 0
    name, rest = args[0], args[1:]
    found = registry(points, until=name)
    command = found.commands.get(name)
    if command is None:
        if found.absent:
            extras = " or ".join(_lacking(extra, missing) for extra, missing in found.absent.items())
            print(f"gpu-dra: no command {name!r} in this install; it may come with {extras}", file=sys.stderr)
        else:
            print(f"gpu-dra: unknown command {name!r}\n\n{usage(found)}", file=sys.stderr)
        return 2
    try:
        module = _import(command.module, start_up=start_up)
    except ModuleNotFoundError as exc:
        if command.extra:
            print(f"gpu-dra: command {name!r} needs {_lacking(command.extra, exc.name or '')}", file=sys.stderr)
        else:
            print(f"gpu-dra: command {name!r} is not available in this build ({exc})", file=sys.stderr)
        return 2
    if not clierrors.long_running(args):
        # a one-shot command's retries (NATS dials, ...) are not news; its result or its one-line error are
        from shared.logs import setup_logging

        setup_logging(f"gpu-dra-{name}", "error")
    try:
        result = module.main(rest)
    except Exception as exc:  # noqa: BLE001 - the operator's errors become one line; the rest re-raised
        line = clierrors.one_line(exc)
        if line is None:
            raise
        print(f"gpu-dra {name}: {line}", file=sys.stderr)
        return clierrors.exit_status(exc, args)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
