"""The CEL worker: a process that evaluates selectors under a CPU-time limit per evaluation.

Owns the worker's wire format and its main loop (`python -m embedded.scheduler.celworker`), and the
one-off evaluation for synchronous callers (`evaluate_once`). Why a process: the `cel` package
evaluates in Rust holding the GIL, with no cost hook and nothing another thread can interrupt,
and `find`/`findAll` run Python's backtracking `re`. Kubernetes bounds each evaluation by its
actual cost (`CELSelectorExpressionMaxCost`); this worker bounds it by CPU time instead:
before each evaluation it arms ITIMER_PROF with `cpu_s`, whose SIGPROF (default action) ends the
process the moment the evaluation has used that much CPU, whatever it is doing. The parent sees
the worker end by SIGPROF and reports upstream's "actual cost limit exceeded" for that selector.

Wire format (JSON lines): the worker first writes `"ready"`; then for each batch it reads a header
`{"expression": ..., "count": n, "cpu_s": s}` and n device variables, and writes one line per
device: `{"value": true|false}` or `{"error": "..."}`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import cel as _cel
import msgspec

from embedded.scheduler.cel import COST_LIMIT_MESSAGE, CelError, Selector, context_of, run

READY = b'"ready"\n'
CPU_LIMIT_S = 0.25  # per evaluation; cel-go spends ~50 ns a cost unit: 1M units is ~0.05 s of CPU
ONE_OFF_WALL_S = 60.0  # a one-off worker's start and evaluation, however loaded the machine
_encode = msgspec.json.Encoder().encode


class Header(msgspec.Struct):
    expression: str
    count: int
    cpu_s: float


class Result(msgspec.Struct, omit_defaults=True):
    value: bool | None = None
    error: str | None = None


def argv() -> list[str]:
    return [sys.executable, "-m", "embedded.scheduler.celworker"]


def header(expression: str, count: int, cpu_s: float) -> bytes:
    """The line announcing `count` evaluations of `expression`, each allowed `cpu_s` of CPU."""
    return _encode(Header(expression, count, cpu_s)) + b"\n"


def device_line(variables: dict[str, Any]) -> bytes:
    """The line carrying one device variable."""
    return _encode(variables) + b"\n"


def outcome(line: bytes, expression: str) -> bool | CelError:
    """A result line -> True/False or a CelError."""
    result = msgspec.json.decode(line, type=Result)
    if result.error is not None or result.value is None:
        return CelError(expression, result.error or "the CEL worker sent no result")
    return result.value


def ended_message(returncode: int | None, cpu_s: float) -> str:
    """Why the worker ended in the middle of an evaluation."""
    if returncode == -signal.SIGPROF:
        return f"{COST_LIMIT_MESSAGE} (the evaluation used more than {cpu_s:g} s of CPU)"
    return f"{COST_LIMIT_MESSAGE} (the CEL worker ended with status {returncode} during the evaluation)"


def evaluate_once(selector: Selector, variables: dict[str, Any], cpu_s: float = CPU_LIMIT_S) -> bool | CelError:
    """One evaluation in a worker of its own, for synchronous callers (tools, tests): bool or CelError.
    Blocks for the worker's start (~0.2 s) and at most `cpu_s` of CPU: never call it on an event loop."""
    try:
        done = subprocess.run(
            argv(),
            input=header(selector.expression, 1, cpu_s) + device_line(variables),
            capture_output=True,
            timeout=ONE_OFF_WALL_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return CelError(selector.expression, f"the CEL worker did not answer within {ONE_OFF_WALL_S:g} s")
    lines = done.stdout.splitlines()
    if len(lines) == 2:
        return outcome(lines[1], selector.expression)
    return CelError(selector.expression, ended_message(done.returncode, cpu_s))


def main() -> int:
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # a spent CPU budget ends the process, mid-evaluation
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler decides when this worker ends
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(READY)
    stdout.flush()
    while True:
        line = stdin.readline()
        if not line:
            return 0
        header = msgspec.json.decode(line, type=Header)
        try:
            program = _cel.compile(header.expression)
        except Exception as exc:  # checked by the parent already; answer every device the same
            program, failure = None, f"CEL syntax error: {exc}"
        for _ in range(header.count):
            raw = stdin.readline()
            if not raw:  # the scheduler went away mid-batch
                return 0
            variables = msgspec.json.decode(raw)
            if program is None:
                result = Result(error=failure)
            else:
                signal.setitimer(signal.ITIMER_PROF, header.cpu_s)
                value = run(header.expression, program, context_of(variables))
                signal.setitimer(signal.ITIMER_PROF, 0)
                result = Result(value=value) if isinstance(value, bool) else Result(error=value.message)
            stdout.write(_encode(result) + b"\n")
            stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
