"""The example ledger left idle: it must outlive N seconds (default 120) of an empty stream.

Starts an embedded nats-server with the streams provisioned, runs `python -m examples.ledger` as a
process with its default fetch timeout, waits, and checks it still runs; then publishes one claim's
prepared/unprepared pair and checks that SIGTERM prints a report that counted it. Writes
bench/results/ledger_idle.json. (The suite's short variant: tests/examples/test_ledger.py's idle test.)

    .venv/bin/python bench/ledger_idle.py [--seconds 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.bus import Bus  # noqa: E402
from shared.events import catalog  # noqa: E402
from shared.events.claims import ClaimLifecycle, PreparedDeviceRef  # noqa: E402
from shared.events.schema import write_schemas  # noqa: E402
from shared.natsserver import EmbeddedNats  # noqa: E402


async def run(seconds: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_schemas(work / "schemas")
        nats = EmbeddedNats(store_dir=work / "nats")
        await nats.start()
        bus = await Bus.connect(nats.url, name="bench")
        await bus.provision()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "examples.ledger",
            "--schemas",
            str(work / "schemas"),
            "--nats",
            nats.url,
            "--state",
            str(work / "ledger.json"),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        started = time.monotonic()
        try:
            await asyncio.wait_for(proc.wait(), seconds)
            alive = False
        except TimeoutError:
            alive = True
        idle_s = time.monotonic() - started
        now = time.time()
        for event, at in (("prepared", now - 10), ("unprepared", now)):
            message = ClaimLifecycle(
                event=event,
                node="n1",
                driver="gpu.nvidia.com",
                claim_uid="u1",
                claim_namespace="team-a",
                claim_name="c",
                event_id=f"n1/u1/1/{event}",
                devices=[PreparedDeviceRef(request="gpu", pool="n1", device="gpu-0")],
                observed_at=at,
            )
            await bus.publish(catalog.CLAIM, message, namespace="team-a", node="n1", event=event)
        await asyncio.sleep(3)  # a bench, not a test: give the ledger a few fetch cycles
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        output = (await proc.communicate())[0].decode()
        await bus.close()
        await nats.close()
        return {
            "idle_seconds": round(idle_s, 1),
            "alive_after_idle": alive,
            "exit_code": proc.returncode,
            "counted_after_idle": "team-a" in output,
            "output_tail": output[-400:],
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    result = asyncio.run(run(args.seconds))
    print(json.dumps(result, indent=2))
    (ROOT / "bench/results/ledger_idle.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["alive_after_idle"] and result["counted_after_idle"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
