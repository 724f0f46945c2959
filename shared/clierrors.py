"""The operator's errors as one line: a file that cannot be read or written, a kubeconfig that does not
configure a client, a server (API server, NATS) that cannot be reached. `gpu-dra` (shared/cli.py) prints
`gpu-dra <command>: <line>` for them instead of a traceback; anything else is a bug and keeps its traceback.

Exit status: 2 (fix the input; running again as it is cannot help), except a server that cannot be reached by
a long-running service: 1, so that a supervisor (`gpu-dra up`, which leaves a service that exits 2 stopped)
starts it again once the server is back.
"""

from __future__ import annotations

from collections.abc import Sequence

# Commands that run until stopped; their one-shot actions (`discovery inject-xid`, `nats credentials`) do not.
LONG_RUNNING = frozenset(
    {
        "discovery",
        "publisher",
        "state-gate",
        "preparer",
        "computedomain",
        "dashboard",
        "apiserver",
        "kubelet",
        "scheduler",
        "controllers",
        "webhook",
        "up",
        "demo",
        "nats",
    }
)
ONE_SHOT_ACTIONS = frozenset({"inject-xid", "credentials"})


def _leaf(exc: BaseException) -> BaseException:
    """The one error inside exception groups that hold just one."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _unreachable(exc: BaseException) -> bool:
    from shared.bus import BusError  # noqa: PLC0415 - only once an error is being reported

    if isinstance(exc, BusError) and isinstance(exc.__cause__, OSError) and exc.__cause__.filename:
        return False  # a credentials file it could not read: the operator's file, not the server
    return isinstance(exc, BusError | ConnectionError) or type(exc).__name__ == "ClientConnectorError"


def one_line(exc: BaseException) -> str | None:
    """The line that tells the operator what to fix, or None when `exc` is not theirs to fix."""
    from shared.bus import BusError  # noqa: PLC0415 - only once an error is being reported
    from shared.kube.client import KubeConfigError  # noqa: PLC0415

    exc = _leaf(exc)
    if isinstance(exc, KubeConfigError | BusError) or _unreachable(exc):
        return " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.filename is not None:
        target = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
        return f"{target}: {exc.strerror or exc}"
    return None


def long_running(argv: Sequence[str]) -> bool:
    """Whether `gpu-dra ARGV` runs until stopped (a service, `up`), not a one-shot command."""
    return bool(argv) and argv[0] in LONG_RUNNING and not (len(argv) > 1 and argv[1] in ONE_SHOT_ACTIONS)


def exit_status(exc: BaseException, argv: Sequence[str]) -> int:
    """2, or 1 for a server a long-running command could not reach (its supervisor retries it)."""
    return 1 if long_running(argv) and _unreachable(_leaf(exc)) else 2
