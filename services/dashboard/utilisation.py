"""The dashboard's utilisation rings: the last 10 minutes of every device's telemetry, bounded.

Fed by `dra.v1.telemetry.<node>` (one `NodeTelemetry` per node per interval, core NATS). Each device keeps its
latest sample and a ring of at most `POINTS` points, one per `RESOLUTION_S` slot (a faster producer's samples
in one slot replace each other: the memory does not depend on the nodes' interval), in typed arrays: 12 bytes
a point (time 4, in whole seconds; SM % 1; memory 4, in MiB; power 2, in W; temperature 1), 732 bytes for a
full ring; with the arrays' headers and the latest sample about 1.3 KB per device in all (measured: 1,305
bytes; tests/dashboard/test_utilisation.py holds it under 1.6 KB), so 1,000 nodes of 8 GPUs keep ~10 MB.
A node's devices are replaced by what its newest message names; a node silent for `WINDOW_S` is forgotten.
"""

from __future__ import annotations

from array import array
from typing import Any

from shared.events.telemetry import DeviceSample, NodeTelemetry

WINDOW_S = 600.0
RESOLUTION_S = 10.0
POINTS = int(WINDOW_S / RESOLUTION_S) + 1  # a point per slot, both ends of the window included
MISSING = -1  # a figure NVML gave none of (a MIG device's SM %, power, temperature)


def _or_missing(value: int | None) -> int:
    return MISSING if value is None else value


def _or_none(value: int) -> int | None:
    return None if value == MISSING else value


class Ring:
    """One device: its latest sample and its recent points, oldest first."""

    __slots__ = ("latest", "mem", "power", "sm", "t", "temp")

    def __init__(self) -> None:
        self.latest: DeviceSample | None = None
        self.t = array("I")  # s (Unix)
        self.sm = array("b")  # %
        self.mem = array("i")  # MiB
        self.power = array("h")  # W
        self.temp = array("b")  # °C

    def add(self, observed_at: float, sample: DeviceSample) -> None:
        at = int(observed_at)  # whole seconds, as the ring keeps them
        self.latest = sample
        used, power = sample.memory_used_bytes, sample.power_mw
        values = (
            at,
            _or_missing(sample.sm_percent),
            MISSING if used is None else used >> 20,
            MISSING if power is None else round(power / 1000),
            _or_missing(sample.temperature_c),
        )
        columns: tuple[array[Any], ...] = (self.t, self.sm, self.mem, self.power, self.temp)
        if self.t and self.t[-1] // RESOLUTION_S >= at // RESOLUTION_S:
            if at < self.t[-1]:
                return  # older than what the ring holds: out of order, dropped
            for column, value in zip(columns, values, strict=True):
                column[-1] = value
            return
        for column, value in zip(columns, values, strict=True):
            column.append(value)
        drop = 0
        while drop < len(self.t) and (len(self.t) - drop > POINTS or self.t[drop] < at - WINDOW_S):
            drop += 1
        if drop:
            for column in columns:
                del column[:drop]

    def spark(self) -> list[int]:
        """The SM % points (-1: none), for the tile's sparkline."""
        return self.sm.tolist()

    def view(self) -> dict[str, Any]:
        latest = self.latest
        assert latest is not None
        return {
            "uuid": latest.uuid,
            "smPercent": latest.sm_percent,
            "memoryUsedBytes": latest.memory_used_bytes,
            "memoryTotalBytes": latest.memory_total_bytes,
            "powerW": None if latest.power_mw is None else round(latest.power_mw / 1000),
            "temperatureC": latest.temperature_c,
            "ring": {
                "t": self.t.tolist(),
                "smPercent": [_or_none(v) for v in self.sm],
                "memoryUsedBytes": [None if v == MISSING else v << 20 for v in self.mem],
                "powerW": [_or_none(v) for v in self.power],
                "temperatureC": [_or_none(v) for v in self.temp],
            },
        }

    def tile(self, with_spark: bool) -> list[Any]:
        """[time, SM %, memory used, memory total, power W, temperature °C] (+ the SM % points): the page's
        compact form."""
        latest = self.latest
        assert latest is not None
        out: list[Any] = [
            self.t[-1],
            latest.sm_percent,
            latest.memory_used_bytes,
            latest.memory_total_bytes,
            None if latest.power_mw is None else round(latest.power_mw / 1000),
            latest.temperature_c,
        ]
        if with_spark:
            out.append(self.spark())
        return out


class NodeRings:
    __slots__ = ("devices", "interval_s", "observed_at")

    def __init__(self) -> None:
        self.devices: dict[str, Ring] = {}
        self.interval_s = 0.0
        self.observed_at = 0.0


class TelemetryStore:
    """Every node's rings; `add` one message, read per node."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRings] = {}
        self._next_sweep = 0.0

    def add(self, message: NodeTelemetry) -> bool:
        """Keep a node's message; False (nothing kept) when it is older than the one before."""
        rings = self.nodes.get(message.node)
        if rings is None:
            rings = self.nodes[message.node] = NodeRings()
        elif message.observed_at < rings.observed_at:
            return False
        rings.interval_s = message.interval_s
        rings.observed_at = message.observed_at
        named = {d.device for d in message.devices}
        for gone in [name for name in rings.devices if name not in named]:
            del rings.devices[gone]
        for sample in message.devices:
            ring = rings.devices.get(sample.device)
            if ring is None:
                ring = rings.devices[sample.device] = Ring()
            ring.add(message.observed_at, sample)
        self._forget_silent(message.observed_at)
        return True

    def _forget_silent(self, now: float) -> None:
        """Drop the nodes silent for a window (checked once a minute of sample time, not per message)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + 60.0
        for node in [n for n, r in self.nodes.items() if r.observed_at < now - WINDOW_S]:
            del self.nodes[node]

    def node_view(self, node: str) -> dict[str, Any] | None:
        rings = self.nodes.get(node)
        if rings is None:
            return None
        return {
            "node": node,
            "intervalS": rings.interval_s,
            "observedAt": rings.observed_at,
            "windowS": WINDOW_S,
            "resolutionS": RESOLUTION_S,
            "devices": {name: ring.view() for name, ring in rings.devices.items() if ring.latest is not None},
        }

    def tiles(self, nodes: list[str] | None = None, *, with_spark: bool) -> dict[str, dict[str, list[Any]]]:
        """node -> device -> its compact tile figures, for `nodes` (all when None)."""
        names = list(self.nodes) if nodes is None else nodes
        out: dict[str, dict[str, list[Any]]] = {}
        for node in names:
            rings = self.nodes.get(node)
            if rings is not None:
                out[node] = {d: r.tile(with_spark) for d, r in rings.devices.items() if r.latest is not None}
        return out
