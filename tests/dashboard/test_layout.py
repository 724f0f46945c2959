"""The fleet page's geometry in headless Chromium at common desktop widths: every GPU tile lies inside its node
row (tiles wrap onto more lines instead of scrolling out of sight), rows do not overlap, and the virtualized
row heights follow the width. Against the fixture server (tests/dashboard/fixtureserver.py) with 8-GPU and
10-GPU nodes beside the fixture fleet.

Screenshots at 1280 and 1920 px go to the test's tmp dir, or to $DASHBOARD_SCREENSHOTS (e.g. docs/images) when
set: `DASHBOARD_SCREENSHOTS=docs/images pytest tests/dashboard/test_layout.py` renews the ones in the docs.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.dashboard import fixtureserver as fx
from tests.dashboard.cdp import Browser

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

HEIGHT = 900
PENDING = [
    {
        "namespace": "team-a",
        "pod": "train-big",
        "since": "2026-12-04T14:02:00Z",
        "asks": "16 x gpu.nvidia.com where device.attributes['gpu.nvidia.com'].productName.contains('H100')",
        "reason": "not enough capacity: claim team-a/train-big-gpu request gpu wants 16 gpu.nvidia.com, no node has "
        "more than 8 that it can have (2 already allocated to claim team-b/serve-0)",
    },
    {
        "namespace": "team-b",
        "pod": "notebook-7",
        "since": "2026-12-04T14:20:00Z",
        "asks": "1 x mig.nvidia.com where device.attributes['gpu.nvidia.com'].profile == '3g.20gb'",
        "reason": "0/5 nodes can allocate the pod's claims: node node-a: claim team-b/notebook-7-mig request mig: 0 of "
        "1 devices eligible, 1 wanted; 1 already allocated to claim team-a/infer-2",
    },
]


def layout_fleet() -> dict[str, Any]:
    """The fixture fleet plus a clique of two 8-GPU nodes and a 10-GPU node (more than fit a 1920 px line)."""
    fleet = fx.load_fleet()
    big = fx.synthetic_fleet(3, 10)["nodes"]
    for i, row in enumerate(big):
        row.update(name=f"dgx-{i}", pool=f"dgx-{i}", clique="c2")
        if i < 2:
            row["devices"] = row["devices"][:8]
    fleet["nodes"] += big
    fleet["groups"].insert(0, {"name": "clique c2", "nodes": [r["name"] for r in big]})
    fleet["pending"] = PENDING
    return fleet


def telemetry(fleet: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """Plausible figures for every top-level GPU: busy when claimed, idle when not, 10 minutes of SM %."""
    out: dict[str, dict[str, list[Any]]] = {}
    for row in fleet["nodes"]:
        for k, d in enumerate(x for x in row["devices"] if not x.get("parent")):
            busy = d.get("state") == "claimed"
            spark = [(70 + (i * 7 + k * 13) % 30) if busy else (i + k) % 3 for i in range(61)]
            total = d.get("memoryBytes") or 80 << 30
            out.setdefault(row["name"], {})[d["name"]] = [
                1_800_000_000.0, spark[-1], total * 6 // 10 if busy else total // 200, total,
                560 if busy else 72, 68 if busy else 33, spark,
            ]  # fmt: skip
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[tuple[Browser, fx.FixtureFleet]]:
    state = fx.FixtureFleet(layout_fleet())
    runner, url = await fx.start(fx.make_fixture_app(state))
    try:
        await browser.navigate(url + "/")
        await browser.wait_for("document.body.dataset.version")
        state.push_telemetry(telemetry(state.fleet), full=True)  # every tile with its figures and sparkline
        await browser.wait_for("document.querySelector('[data-util][data-sm]')")
        yield browser, state
    finally:
        await browser.resize(1440, HEIGHT)
        await fx.stop(state, runner)


GEOMETRY = """(() => {
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  return [...document.querySelectorAll('[data-node]')].map((row) => ({
    node: row.dataset.node, row: box(row), tiles: box(row.querySelector('.tiles')),
    devices: [...row.querySelectorAll('.tile')].map((t) => [t.dataset.device, box(t)]) }));
})()"""


async def at_width(b: Browser, width: int) -> list[dict[str, Any]]:
    """Resize to `width` and wait until the page has laid its rows out for it; the rows' geometry."""
    await b.resize(width, HEIGHT)
    await b.wait_for(f"window.innerWidth === {width} && document.querySelector('[data-node=\"dgx-0\"]')")
    # the page lays out on the resize event and draws on the next animation frame: two frames on, it has
    await b.evaluate("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
    return list(await b.evaluate(GEOMETRY))


def outside(inner: list[float], outer: list[float]) -> bool:
    return (
        inner[0] < outer[0] - 0.5 or inner[1] < outer[1] - 0.5 or inner[2] > outer[2] + 0.5 or inner[3] > outer[3] + 0.5
    )


@pytest.mark.parametrize("width", [1280, 1400, 1920])
async def test_every_tile_fits_inside_its_node_row(page, width: int) -> None:
    b, _ = page
    rows = await at_width(b, width)
    drawn = {d for r in rows for d, _ in r["devices"]}
    assert {f"dgx-{i}/gpu-{g}" for i in range(2) for g in range(8)} <= drawn
    for r in rows:
        for device, tile in r["devices"]:
            assert not outside(tile, r["tiles"]), f"{device} at {width} px: {tile} leaves its tile area {r['tiles']}"
            assert not outside(tile, r["row"]), f"{device} at {width} px: {tile} leaves its row {r['row']}"
            assert tile[2] <= width, f"{device} at {width} px ends at {tile[2]}"
    by_top = sorted(rows, key=lambda r: r["row"][1])
    for upper, lower in itertools.pairwise(by_top):
        assert upper["row"][3] <= lower["row"][1] + 0.5, f"{upper['node']} overlaps {lower['node']} at {width} px"
    lines = {r["node"]: len({round(t[1]) for _, t in r["devices"]}) for r in rows}
    # 7 tiles to a line at 1280 and 1400 px, 11 at 1920 px
    assert lines["dgx-0"] == (1 if width >= 1920 else 2) and lines["dgx-2"] == (1 if width >= 1920 else 2)
    assert lines["node-c"] == 1


async def test_screenshots_at_1280_and_1920(page, tmp_path: Path) -> None:
    b, _ = page
    out = Path(os.environ.get("DASHBOARD_SCREENSHOTS") or tmp_path)
    for width in (1280, 1920):
        await at_width(b, width)
        drawn = await b.evaluate(
            "document.querySelector('main').offsetTop + document.getElementById('spacer').offsetHeight + 12"
        )
        path = await b.screenshot(out / f"fleet-{width}.png", height=drawn)
        print(f"\nfleet page at {width} px: {path}")
