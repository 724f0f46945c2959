"""The fleet page in a real headless Chromium against the fixture server (tests/dashboard/fixtureserver.py):
the page logic (rows, tiles, MIG bar, live deltas, tenant filter, drill-down, keyboard, virtualized rows)
without a cluster. tests/dashboard/test_browser.py drives the same page against `gpu-dra up`."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.dashboard import fixtureserver as fx
from tests.dashboard.cdp import Browser

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[tuple[Browser, fx.FixtureFleet, str]]:
    state = fx.FixtureFleet(fx.load_fleet())
    runner, url = await fx.start(fx.make_fixture_app(state))
    try:
        await browser.navigate(url + "/")
        await browser.wait_for("document.body.dataset.version")
        yield browser, state, url
    finally:
        await fx.stop(state, runner)


def q(selector: str) -> str:
    return f"document.querySelector({json.dumps(selector)})"


async def test_rows_tiles_and_counters(page) -> None:
    b, _, _ = page
    assert await b.evaluate("[...document.querySelectorAll('[data-node]')].map(e => e.dataset.node)") == [
        "node-a",
        "node-b",
        "node-c",
    ]
    assert await b.evaluate("[...document.querySelectorAll('[data-group] h2')].map(e => e.textContent)") == [
        "clique c1",
        "ungrouped",
    ]
    tiles = await b.evaluate(
        "Object.fromEntries([...document.querySelectorAll('.tile')].map(e => "
        "[e.dataset.device, [e.dataset.state, e.dataset.claim || '', e.textContent]]))"
    )
    assert set(tiles) == {
        "node-a/gpu-0",
        "node-a/gpu-1",
        "node-a/gpu-2",
        "node-b/gpu-0",
        "node-b/gpu-1",
        "node-c/gpu-0",
    }
    state, claim, text = tiles["node-a/gpu-0"]
    assert (state, claim) == ("claimed", "team-a/train-1") and "exclusive" in text and "80 GiB" in text
    assert "time-slice Short" in tiles["node-b/gpu-0"][2] and "+1" in tiles["node-b/gpu-0"][2]
    assert "MPS 50% · 10Gi pinned" in tiles["node-b/gpu-1"][2]
    # the state is a word and an icon, not only a colour
    assert "⚠ tainted" in tiles["node-a/gpu-1"][2] and "○ free" in tiles["node-c/gpu-0"][2]
    h100 = await b.evaluate(q('#counters [data-product="NVIDIA H100 80GB HBM3"]') + ".textContent")
    assert "1 free" in h100 and "3 claimed" in h100 and "1 tainted" in h100


async def test_tainted_gpu_shows_its_xid(page) -> None:
    b, _, _ = page
    got = await b.evaluate(q('[data-device="node-a/gpu-1"]') + "?.dataset.xid")
    assert got == "79"
    assert "XID 79" in await b.evaluate(q('[data-device="node-a/gpu-1"]') + ".textContent")


async def test_mig_bar_places_slices_to_scale(page) -> None:
    b, state, _ = page
    slots = await b.evaluate("""(() => { const bar = document.querySelector('[data-device="node-a/gpu-2"] .mig-bar');
      const w = bar.getBoundingClientRect().width;
      return [...bar.querySelectorAll('[data-mig-slot]')].map(e => { const r = e.getBoundingClientRect();
        return [e.dataset.profile, +e.dataset.start, +e.dataset.size, e.dataset.state,
                Math.round((r.left - bar.getBoundingClientRect().left) / w * 8),
                Math.round(r.width / w * 8)]; }); })()""")
    want = [
        [d["mig"]["profile"], d["mig"]["start"], d["mig"]["size"], d["state"], d["mig"]["start"], d["mig"]["size"]]
        for d in state.node("node-a")["devices"]
        if d["parent"] == "gpu-2"
    ]
    assert slots == want


async def test_a_delta_updates_one_row_within_a_second(page) -> None:
    b, state, _ = page
    row = copy.deepcopy(state.node("node-c"))
    row["devices"][0].update(
        state="claimed",
        allocations=[
            {
                "namespace": "team-a",
                "claim": "new-1",
                "claimUid": "u",
                "pods": ["team-a/new-1-pod"],
                "since": "2026-12-04T14:31:00Z",
                "sharing": {"mode": "exclusive"},
            }
        ],
    )
    untouched = await b.evaluate("document.querySelector('[data-node=\"node-a\"]').dataset.mark = 'kept'")
    t0 = time.monotonic()
    state.push([row])
    await b.wait_for(q('[data-device="node-c/gpu-0"][data-claim="team-a/new-1"]'), timeout=2)
    assert time.monotonic() - t0 <= 1.0
    assert untouched == "kept" and await b.evaluate(q('[data-node="node-a"]') + ".dataset.mark") == "kept"
    await b.wait_for(
        q('#counters [data-product="NVIDIA H100 80GB HBM3"] [data-state="claimed"]') + ".dataset.count === '4'"
    )


async def test_the_page_reconnects_when_the_stream_ends(page) -> None:
    b, state, _ = page
    fulls = await b.evaluate("window.__dash.fulls")
    state.close()  # as a restarting server does
    await b.wait_for(f"window.__dash.fulls > {fulls} && document.getElementById('conn').dataset.conn === 'live'")
    assert await b.evaluate("document.querySelectorAll('[data-node]').length") == 3


async def test_namespace_filter_hides_other_tenants(page) -> None:
    b, _, _ = page
    fulls = await b.evaluate("window.__dash.fulls")
    await b.evaluate(
        "(() => { const s = document.getElementById('ns-filter'); s.value = 'team-a';"
        " s.dispatchEvent(new Event('change')); })()"
    )
    await b.wait_for(f"window.__dash.fulls > {fulls}")
    claims = await b.evaluate("[...document.querySelectorAll('[data-claim]')].map(e => e.dataset.claim)")
    assert claims and all(c.startswith("team-a/") for c in claims)
    mps = await b.evaluate(q('[data-device="node-b/gpu-1"]') + ".textContent")
    assert "other tenant" in mps and "mps-1" not in mps
    assert await b.evaluate("location.search") == "?namespace=team-a"
    await b.evaluate(
        "(() => { const s = document.getElementById('ns-filter'); s.value = '';"
        " s.dispatchEvent(new Event('change')); })()"
    )
    await b.wait_for(q('[data-claim="team-b/mps-1"]'))


async def test_search_keyboard_and_drilldown(page) -> None:
    b, state, _ = page
    await b.evaluate(
        "(() => { const s = document.getElementById('search'); s.value = 'mps-1';"
        " s.dispatchEvent(new Event('input')); })()"
    )
    await b.wait_for("document.querySelectorAll('[data-node]').length === 1")
    assert await b.evaluate(q("[data-node]") + ".dataset.node") == "node-b"
    await b.evaluate(
        "(() => { const s = document.getElementById('search'); s.value = ''; s.dispatchEvent(new Event('input')); })()"
    )
    await b.wait_for("document.querySelectorAll('[data-node]').length === 3")

    await b.evaluate(q('[data-device="node-a/gpu-0"]') + ".focus()")
    await b.press("ArrowRight")
    assert await b.evaluate("document.activeElement.dataset.device") == "node-a/gpu-1"
    await b.press("ArrowDown")
    assert await b.evaluate("document.activeElement.dataset.device") == "node-b/gpu-1"
    await b.press("Enter")
    await b.wait_for(q("#drilldown:not([hidden]) [data-claim-detail] .trace"))
    detail = await b.evaluate(q("#drilldown") + ".textContent")
    assert "team-b/mps-1" in detail and "claim prepared" in detail
    assert (
        await b.evaluate(q("#drilldown .trace") + ".href")
        == "http://localhost:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736"
    )
    await b.evaluate(q("#drilldown [data-explain]") + ".click()")
    await b.wait_for(q("#drilldown .explain"))
    await b.press("Escape")
    await b.wait_for(q("#drilldown[hidden]"))
    assert await b.evaluate("document.activeElement.dataset.device") == "node-b/gpu-1"
    # a live change of the focused row keeps the keyboard where it was
    state.push([copy.deepcopy(state.node("node-b"))])
    await b.wait_for(f"document.body.dataset.version === '{state.fleet['version']}'")
    assert await b.evaluate("document.activeElement.dataset.device") == "node-b/gpu-1"

    # a pending pod holds no device: the search box explains it
    await b.evaluate(
        "(() => { const s = document.getElementById('search'); s.value = 'team-a/stuck';"
        " s.dispatchEvent(new Event('input')); s.focus(); })()"
    )
    await b.wait_for(q("#empty:not([hidden])"))
    await b.press("Enter")
    await b.wait_for(q("#drilldown:not([hidden]) .explain"))
    assert "pod team-a/stuck" in await b.evaluate(q("#drilldown .explain") + ".textContent")
    await b.press("Escape")
    await b.evaluate(
        "(() => { const s = document.getElementById('search'); s.value = ''; s.dispatchEvent(new Event('input')); })()"
    )


async def test_thousand_nodes_render_virtualized(browser: Browser, tmp_path_factory: pytest.TempPathFactory) -> None:
    shots = tmp_path_factory.mktemp("screenshots")
    state = fx.FixtureFleet(fx.synthetic_fleet(1000, 8))
    runner, url = await fx.start(fx.make_fixture_app(state))
    try:
        await browser.navigate(url + "/")
        ms = await browser.wait_for("window.__dash.firstRenderMs", timeout=10)
        rows = await browser.evaluate("document.querySelectorAll('[data-node]').length")
        assert 3 <= rows <= 30, f"{rows} rows in the DOM: not virtualized"
        path = await browser.screenshot(shots / "fleet-1000-fixture.png")
        await browser.evaluate(
            "(() => { const v = document.getElementById('viewport'); v.scrollTop = v.scrollHeight; })()"
        )
        await browser.wait_for(q('[data-node="node-0999"]'))
        assert await browser.evaluate("document.querySelectorAll('[data-node]').length") <= 30
        print(f"\n1000 nodes x 8 GPUs (fixture): first render {ms:.0f} ms after navigation start; screenshot {path}")
    finally:
        await fx.stop(state, runner)


async def test_a_token_in_the_url_is_kept_for_the_session_and_sent_as_a_header(browser: Browser) -> None:
    state = fx.FixtureFleet(fx.load_fleet(), token="s3cret")
    runner, url = await fx.start(fx.make_fixture_app(state))
    try:
        await browser.navigate(url + "/?token=s3cret&namespace=team-a")
        await browser.wait_for(
            "document.body.dataset.version && document.getElementById('conn').dataset.conn === 'live'"
        )
        assert await browser.evaluate("location.search") == "?namespace=team-a"  # the token leaves the address bar
        await browser.evaluate(q('[data-device="node-a/gpu-0"]') + ".click()")
        await browser.wait_for(q("#drilldown:not([hidden]) dl"))
        assert ("/api/stream", "query") in state.seen_tokens  # EventSource sends no headers
        assert ("/api/device/node-a/gpu-0", "header") in state.seen_tokens
        await browser.press("Escape")
        # a refused token: the page says what the server said
        await browser.evaluate("sessionStorage.setItem('gpu-dra-token', 'wrong')")
        await browser.reload()
        await browser.wait_for("document.getElementById('conn').dataset.conn === 'error'")
        assert "token was refused" in await browser.evaluate("document.getElementById('conn').textContent")
    finally:
        await browser.evaluate("sessionStorage.clear()")
        await fx.stop(state, runner)


async def test_a_shared_gpu_tile_lists_its_shares_and_hides_other_tenants(page, tmp_path_factory) -> None:
    b, state, url = page
    await b.navigate(url + "/")  # other tests took the browser to their own servers
    await b.wait_for("document.body.dataset.version && document.getElementById('conn').dataset.conn === 'live'")
    before = copy.deepcopy(state.node("node-c"))
    row = copy.deepcopy(before)

    def share(ns: str, claim: str, memory_gi: int, compute: int) -> dict:
        return {
            "namespace": ns,
            "claim": claim,
            "claimUid": f"u-{claim}",
            "pods": [f"{ns}/{claim}-pod"],
            "since": "2026-12-04T14:31:00Z",
            "sharing": {"mode": "mps"},
            "share": {"id": f"s-{claim}", "memoryBytes": memory_gi * fx.GI, "compute": compute, "shares": None},
        }

    row["devices"][0].update(
        state="claimed",
        shared=True,
        allocations=[share("team-a", "infer-a", 10, 10), share("team-b", "infer-b", 30, 40)],
        capacityLeft={"memoryBytes": 40 * fx.GI, "compute": 50, "shares": None},
    )
    tile = q('[data-device="node-c/gpu-0"]')
    try:
        state.push([row])
        await b.wait_for(tile + "?.querySelector('[data-share]')", timeout=2)
        shares = await b.evaluate(f"[...{tile}.querySelectorAll('[data-share]')].map(e => e.textContent)")
        assert shares == ["team-a/infer-a 10G 10%", "team-b/infer-b 30G 40%"]
        assert await b.evaluate(tile + ".querySelector('[data-left]').dataset.left") == "left 40 GiB · 50%"
        assert await b.evaluate(tile + ".querySelectorAll('.share-bar .seg').length") == 2
        path = await b.screenshot(tmp_path_factory.mktemp("screenshots") / "shared-gpu.png")
        print(f"\nshared GPU tile: {path}")

        fulls = await b.evaluate("window.__dash.fulls")
        await b.evaluate(
            "(() => { const s = document.getElementById('ns-filter'); s.value = 'team-a';"
            " s.dispatchEvent(new Event('change')); })()"
        )
        await b.wait_for(f"window.__dash.fulls > {fulls}")
        shares = await b.evaluate(f"[...{tile}.querySelectorAll('[data-share]')].map(e => e.textContent)")
        assert shares == ["team-a/infer-a 10G 10%", "another tenant 30G 40%"]
        label = await b.evaluate(tile + ".getAttribute('aria-label')")
        assert "share of another tenant, 30 GiB · 40%" in label and "team-b" not in label and "infer-b" not in label
        assert await b.evaluate(tile + ".querySelectorAll('.share-bar .seg.other').length") == 1
    finally:
        await b.evaluate(
            "(() => { const s = document.getElementById('ns-filter'); s.value = '';"
            " s.dispatchEvent(new Event('change')); })()"
        )
        state.push([before])


async def test_the_pending_panel_lists_waiting_pods_live(page) -> None:
    b, state, _ = page
    assert await b.evaluate(q("#pending") + ".dataset.count") == "0"
    assert await b.evaluate(q("#pending-none") + ".offsetParent !== null")
    waiting = {
        "namespace": "team-a",
        "pod": "big-1",
        "since": "2026-12-04T14:31:00Z",
        "asks": "3 x gpu.nvidia.com",
        "reason": "not enough capacity: claim team-a/big-1-gpu request gpu wants 3 gpu.nvidia.com, no node has "
        "more than 2 that it can have",
    }
    state.push_pending([waiting])
    item = await b.wait_for(q('[data-pending="team-a/big-1"]') + "?.textContent", timeout=2)
    assert "3 x gpu.nvidia.com" in item and "not enough capacity" in item
    assert await b.evaluate(q("#pending-count") + ".textContent") == "1"
    await b.evaluate(q('[data-pending="team-a/big-1"] [data-explain]') + ".click()")
    text = await b.wait_for(q("#dd-explain .explain") + "?.textContent", timeout=5)
    assert "team-a/big-1" in text
    await b.press("Escape")
    state.push_pending([])
    await b.wait_for(q("#pending") + ".dataset.count === '0' && !" + q("[data-pending]"), timeout=2)


UTIL = ".tile[data-device='node-c/gpu-0'] [data-util]"


async def test_a_tile_shows_utilisation_and_a_sparkline_patched_in_place(page) -> None:
    b, state, _ = page
    row = await b.evaluate("(window.__row = document.querySelector('[data-node=\"node-c\"]')) !== null")
    assert row
    assert await b.evaluate(f"[{q(UTIL)}.textContent, {q(UTIL)}.dataset.sm]") == ["80 GiB", None], "no sample yet"
    t0 = 1_800_000_000.0
    spark = [-1] * 50 + [0, 5, 40, 80, 90, 85, 88, 92, 90, 87, 91]
    state.push_telemetry({"node-c": {"gpu-0": [t0, 91, 61 << 30, 80 << 30, 512, 64, spark]}}, full=True)
    await b.wait_for(q(UTIL) + ".dataset.sm === '91'")
    util = await b.evaluate(
        f"(() => {{ const u = {q(UTIL)}; const p = u.querySelector('svg.spark path'); return [u.textContent, "
        "u.dataset.mem, u.dataset.power, u.dataset.temp, p ? p.getAttribute('d') : '', u.title]; })()"
    )
    text, mem, power, temp, path, title = util
    assert text == "91% 61/80G 512W 64°C"
    assert (mem, power, temp) == (str(61 << 30), "512", "64")
    assert path.startswith("M") and path.count("L") == 10, "11 points drawn, the 50 missing ones not"
    assert "SM 91%" in title and "512 W" in title
    # a live sample in the next 10 s slot: figures change, one point more, and the row was not redrawn
    state.push_telemetry({"node-c": {"gpu-0": [t0 + 10, 12, 2 << 30, 80 << 30, 90, 35]}})
    await b.wait_for(q(UTIL) + ".dataset.sm === '12'")
    assert await b.evaluate(q(UTIL) + ".textContent") == "12% 2/80G 90W 35°C"
    assert await b.evaluate(q(UTIL) + ".querySelector('path').getAttribute('d').split('L').length") == 12
    assert await b.evaluate("window.__row === document.querySelector('[data-node=\"node-c\"]')")
    # another sample in the same slot replaces the newest point
    state.push_telemetry({"node-c": {"gpu-0": [t0 + 12, 14, 2 << 30, 80 << 30, 95, 35]}})
    await b.wait_for(q(UTIL) + ".dataset.sm === '14'")
    assert await b.evaluate(q(UTIL) + ".querySelector('path').getAttribute('d').split('L').length") == 12
