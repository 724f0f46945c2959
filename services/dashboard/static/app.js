// The fleet page: one EventSource on /api/stream, node rows virtualized (each row's height follows from its
// GPU count and the window's width: tiles wrap onto as many lines as they need), GPU tiles.
// Plain JS, no framework, no build step. Contract: docs/dashboard.md and the DOM hooks tests use
// ([data-node], [data-device] with data-state/data-xid/data-claim, [data-mig-slot], [data-util] with data-sm/
// data-mem/data-power/data-temp and its .spark, #counters, #ns-filter, #drilldown, #gpu-hours).
"use strict";
(() => {
  // Row geometry; app.css reads the same numbers from the custom properties set below.
  const TILE_W = 150;
  const TILE_H = 100;
  const GAP = 6; // between tiles, across and down
  const ROW_PAD = 4; // above and below the tiles
  const ROW_BORDER = 1; // the line under a row
  const ROW_SIDE = 14 + 14 + 132 + 10; // row padding, node head, gap to the tiles
  const ROW_H = TILE_H + 2 * ROW_PAD + ROW_BORDER; // a row of one line of tiles
  const GROUP_H = 30;
  const OVERSCAN = 3;
  const S = {
    nodes: new Map(), groups: [], counters: {}, namespaces: [], version: 0, traceUrlTemplate: "",
    ns: "", query: "", layout: [], offsets: [], rendered: new Map(), es: null, retry: 0,
    perLine: 1, pending: [], util: new Map(), gpuHours: [], openKey: "", lastFocus: null, firstEventMs: null, firstRenderMs: null, firstTelemetryMs: null, fulls: 0, deltas: 0,
  };
  window.__dash = S; // read by the browser tests and the bench

  const $ = (sel) => document.querySelector(sel);
  const viewport = $("#viewport");
  const spacer = $("#spacer");
  for (const [k, v] of Object.entries({ "--tile-w": TILE_W, "--tile-h": TILE_H, "--gap": GAP, "--row-pad": ROW_PAD })) {
    document.documentElement.style.setProperty(k, `${v}px`);
  }
  const { esc, gib, age, sharing, shortProduct } = window.gpuFmt;
  const { ICON, visibleAlloc, topDevices, tileHtml, shareSize, leftText } = window.gpuTiles({
    ns: () => S.ns,
    util: (node, d, plain) => tileUtil(node, d, plain), // defined below, with the telemetry it draws
  });

  // ---- identity: ?token= is kept in sessionStorage and sent as a header (and on the stream URL,
  // since EventSource cannot send headers) ----
  const params = new URLSearchParams(location.search);
  if (params.get("token")) {
    sessionStorage.setItem("gpu-dra-token", params.get("token"));
    params.delete("token");
    history.replaceState(null, "", location.pathname + (params.toString() ? `?${params}` : ""));
  }
  const token = () => sessionStorage.getItem("gpu-dra-token") || "";
  S.ns = params.get("namespace") || "";

  async function api(path) {
    const headers = token() ? { Authorization: `Bearer ${token()}` } : {};
    const resp = await fetch(path, { headers });
    const body = await resp.json().catch(() => ({ error: `${resp.status} ${resp.statusText}` }));
    if (!resp.ok) throw new Error(body.error || `${resp.status} ${resp.statusText}`);
    return body;
  }

  // ---- data ----
  function applyFull(f) {
    S.nodes = new Map((f.nodes || []).map((n) => [n.name, n]));
    S.groups = f.groups || [];
    S.counters = f.counters || {};
    S.namespaces = f.namespaces || [];
    S.traceUrlTemplate = f.traceUrlTemplate || "";
    S.version = f.version || 0;
    S.pending = f.pending || [];
    S.fulls += 1;
    renderPending();
    renderNamespaces();
    renderCounters();
    relayout();
    redraw([...S.rendered.keys()]);
    markApplied();
    if (S.firstRenderMs === null) {
      requestAnimationFrame(() => { S.firstRenderMs = performance.now(); document.body.dataset.rendered = "1"; });
    }
    if (S.openKey) refreshDrill();
  }

  function applyDelta(d) {
    let shape = Boolean(d.groups);
    const changed = new Set();
    for (const n of d.nodes || []) {
      const before = S.nodes.get(n.name);
      if (!before || topDevices(before).length !== topDevices(n).length) shape = true;
      S.nodes.set(n.name, n);
      changed.add(n.name);
    }
    for (const name of d.removed || []) {
      if (S.nodes.delete(name)) shape = true;
      changed.add(name);
    }
    if (d.groups) S.groups = d.groups;
    if (d.counters) { S.counters = d.counters; renderCounters(); }
    if (d.pending) { S.pending = d.pending; renderPending(); }
    if (!S.ns) renderNamespaces();
    if (d.version) S.version = d.version;
    S.deltas += 1;
    if ((d.nodes || []).length) soonGpuHours();
    if (shape || S.query) relayout();
    redraw([...changed].map((name) => `n:${name}`));
    markApplied();
    if (S.openKey && changed.has(S.openKey.split("/")[0])) refreshDrill();
  }

  // Rows `keys` are drawn anew; keyboard focus inside one moves to the same device in its new row.
  function redraw(keys) {
    const active = document.activeElement;
    const focused = active && active.closest ? active.closest("[data-device]") : null;
    let refocus = "";
    for (const key of keys) {
      const el = S.rendered.get(key);
      if (!el) continue;
      if (focused && el.contains(focused)) refocus = focused.dataset.device;
      el.remove();
      S.rendered.delete(key);
    }
    render();
    if (refocus) {
      const again = viewport.querySelector(`[data-device="${CSS.escape(refocus)}"]`);
      if (again) again.focus({ preventScroll: true });
    }
  }

  function markApplied() { document.body.dataset.version = String(S.version); }

  // ---- live stream ----
  function connect() {
    if (S.es) S.es.close();
    const q = new URLSearchParams();
    if (S.ns) q.set("namespace", S.ns);
    if (token()) q.set("token", token());
    const es = new EventSource(`/api/stream${q.toString() ? `?${q}` : ""}`);
    S.es = es;
    setConn("connecting", "connecting");
    es.addEventListener("fleet", (ev) => { S.retry = 0; if (S.firstEventMs === null) S.firstEventMs = performance.now(); applyFull(JSON.parse(ev.data)); setConn("live", "live"); });
    es.addEventListener("delta", (ev) => applyDelta(JSON.parse(ev.data)));
    es.addEventListener("telemetry", (ev) => {
      // the rings (up to ~2 MB at 1,000 nodes) wait until the fleet is drawn: the first render is not theirs
      const apply = () => applyTelemetry(JSON.parse(ev.data));
      if (S.firstRenderMs === null) requestAnimationFrame(() => setTimeout(apply, 0)); else apply();
    });
    loadGpuHours();
    es.onerror = () => {
      if (es !== S.es) return;
      if (es.readyState !== EventSource.CLOSED) { setConn("reconnecting", "reconnecting…"); return; }
      // The server refused the stream (e.g. 401): say why, then retry with back-off.
      const wait = Math.min(30, 2 ** S.retry++);
      api(`/api/fleet${S.ns ? `?namespace=${encodeURIComponent(S.ns)}` : ""}`)
        .then(() => setConn("reconnecting", `stream closed; retrying in ${wait}s`))
        .catch((e) => setConn("error", `${e.message}; retrying in ${wait}s`));
      setTimeout(() => { if (es === S.es) connect(); }, wait * 1000);
    };
  }
  function setConn(state, text) { const el = $("#conn"); el.dataset.conn = state; el.textContent = text; }

  // ---- utilisation (util.js draws it) and GPU-hours ----
  const U = window.gpuUtil;
  function applyTelemetry(m) {
    for (const [node, devices] of Object.entries(m.nodes || {})) {
      const next = U.merge(m.full ? new Map() : (S.util.get(node) || new Map()), devices);
      S.util.set(node, next);
      const row = S.rendered.get(`n:${node}`);
      if (!row) continue;
      for (const el of row.querySelectorAll("[data-util]")) { // patched in place: no row is redrawn
        const u = next.get(el.dataset.util);
        if (u) el.outerHTML = U.utilHtml(el.dataset.util, u, el.dataset.plain);
      }
    }
    if (S.firstTelemetryMs === null) S.firstTelemetryMs = performance.now();
  }
  const tileUtil = (node, d, plain) => U.utilHtml(d.name, (S.util.get(node.name) || new Map()).get(d.name), plain);

  async function loadGpuHours() { // asked on connect, within 2 s of changed rows, and every minute
    let r;
    try { r = await api(`/api/gpu-hours${S.ns ? `?namespace=${encodeURIComponent(S.ns)}` : ""}`); } catch { return; }
    S.gpuHours = r.namespaces || [];
    $("#gh-list").innerHTML = S.gpuHours.map(U.hoursHtml).join("");
    $("#gpu-hours").dataset.count = String(S.gpuHours.length);
  }
  setInterval(loadGpuHours, 60000);
  let gpuHoursTimer = 0;
  function soonGpuHours() {
    if (!gpuHoursTimer) gpuHoursTimer = setTimeout(() => { gpuHoursTimer = 0; loadGpuHours(); }, 2000);
  }

  // ---- header ----
  function renderCounters() {
    const parts = Object.keys(S.counters).sort().map((product) => {
      const c = S.counters[product];
      const st = ["free", "claimed", "tainted"].map((k) =>
        `<span class="cnt st-${k}" data-state="${k}" data-count="${c[k] || 0}"><i aria-hidden="true">${ICON[k]}</i> ${c[k] || 0} ${k}</span>`).join("");
      return `<div class="product" data-product="${esc(product)}"><b>${esc(shortProduct(product))}</b>${st}</div>`;
    });
    $("#counters").innerHTML = parts.join("") || "<span>no devices</span>";
  }

  // Pods waiting for GPUs: what they ask for and why they wait (explain's plan, from the server).
  function renderPending() {
    const box = $("#pending");
    box.dataset.count = String(S.pending.length);
    $("#pending-count").textContent = String(S.pending.length);
    $("#pending-list").innerHTML = S.pending.map((p) => {
      const key = `${p.namespace}/${p.pod}`;
      return `<li data-pending="${esc(key)}"><b class="p-pod">${esc(key)}</b>`
        + `<span class="p-asks" title="what its claims ask for">${esc(p.asks || "…")}</span>`
        + `<span class="p-reason">${esc(p.reason || "not explained yet")}</span>`
        + `<span class="age" title="waiting since ${esc(p.since)}">${esc(age(p.since))}</span>`
        + `<button type="button" data-explain="${esc(key)}">explain</button></li>`;
    }).join("");
  }

  function renderNamespaces() {
    const sel = $("#ns-filter");
    // the server's list comes with a full Fleet; deltas add the namespaces of claims that appear since
    const seen = new Set([...S.namespaces, ...(S.ns ? [S.ns] : [])]);
    for (const n of S.nodes.values()) {
      for (const d of n.devices || []) for (const a of d.allocations || []) if (a.namespace) seen.add(a.namespace);
    }
    const names = [...seen].sort();
    const want = ["", ...names].join("\n");
    if (sel.dataset.options !== want) {
      sel.innerHTML = `<option value="">all namespaces</option>${names.map((n) => `<option value="${esc(n)}">${esc(n)}</option>`).join("")}`;
      sel.dataset.options = want;
    }
    sel.value = S.ns;
  }

  // ---- layout: flat list of group headers and node rows with their offsets ----
  function nodeMatches(node, q) {
    if (node.name.toLowerCase().includes(q)) return true;
    for (const d of node.devices || []) {
      if (`${d.name} ${d.uuid} ${d.product}`.toLowerCase().includes(q)) return true;
      for (const a of d.allocations || []) {
        if (!visibleAlloc(a)) continue;
        if (`${a.namespace}/${a.claim}`.toLowerCase().includes(q)) return true;
        if ((a.pods || []).some((p) => p.toLowerCase().includes(q))) return true;
      }
    }
    return false;
  }

  // Tiles per line at the viewport's width, and the height of a row of `count` tiles.
  const perLine = () => Math.max(1, Math.floor((viewport.clientWidth - ROW_SIDE + GAP) / (TILE_W + GAP)));
  function rowHeight(count) {
    const lines = Math.max(1, Math.ceil(count / S.perLine));
    return lines * TILE_H + (lines - 1) * GAP + 2 * ROW_PAD + ROW_BORDER;
  }

  function relayout() {
    S.perLine = perLine();
    const q = S.query.trim().toLowerCase();
    const seen = new Set();
    const groups = S.groups.map((g) => ({ name: g.name, nodes: g.nodes.filter((n) => S.nodes.has(n)) }));
    for (const g of groups) g.nodes.forEach((n) => seen.add(n));
    const rest = [...S.nodes.keys()].filter((n) => !seen.has(n)).sort();
    if (rest.length) {
      const ung = groups.find((g) => g.name === "ungrouped");
      if (ung) ung.nodes.push(...rest); else groups.push({ name: "ungrouped", nodes: rest });
    }
    const layout = [];
    const offsets = [];
    let y = 0;
    for (const g of groups) {
      const names = q ? g.nodes.filter((n) => nodeMatches(S.nodes.get(n), q)) : g.nodes;
      if (!names.length) continue;
      layout.push({ kind: "g", key: `g:${g.name}:${names.length}`, name: g.name, count: names.length });
      offsets.push(y); y += GROUP_H;
      for (const n of names) {
        const h = rowHeight(topDevices(S.nodes.get(n)).length);
        layout.push({ kind: "n", key: `n:${n}`, name: n, h });
        offsets.push(y);
        y += h;
      }
    }
    S.layout = layout;
    S.offsets = offsets;
    spacer.style.height = `${y}px`;
    const empty = $("#empty");
    if (!layout.length) {
      empty.hidden = false;
      empty.textContent = !S.nodes.size ? "No nodes publish devices yet." : /^[^/\s]+\/[^/\s]+$/.test(S.query.trim())
        ? `No node, GPU or claim matches. Press Enter to explain pod ${S.query.trim()}.`
        : "No node, GPU, claim or pod matches the search.";
    } else empty.hidden = true;
    // drawn rows move to their new place; rows no longer listed go
    const at = new Map(layout.map((r, i) => [r.key, i]));
    for (const [key, el] of S.rendered) {
      const i = at.get(key);
      if (i === undefined) { el.remove(); S.rendered.delete(key); continue; }
      if (el.dataset.top !== String(offsets[i])) { el.style.top = `${offsets[i]}px`; el.dataset.top = String(offsets[i]); }
      if (layout[i].h && el.style.height !== `${layout[i].h}px`) el.style.height = `${layout[i].h}px`;
    }
  }

  function indexOf(key) { return S.layout.findIndex((r) => r.key === key); }

  function firstVisible(top) {
    let lo = 0;
    let hi = S.offsets.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (S.offsets[mid] <= top) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  function render() {
    const top = viewport.scrollTop;
    const bottom = top + viewport.clientHeight;
    const from = Math.max(0, firstVisible(top) - OVERSCAN);
    const want = new Set();
    const frag = document.createDocumentFragment();
    for (let i = from; i < S.layout.length && S.offsets[i] < bottom + OVERSCAN * ROW_H; i++) {
      const row = S.layout[i];
      want.add(row.key);
      if (S.rendered.has(row.key)) continue;
      const el = row.kind === "g" ? groupEl(row) : nodeEl(S.nodes.get(row.name));
      el.style.top = `${S.offsets[i]}px`;
      el.dataset.top = String(S.offsets[i]);
      if (row.h) el.style.height = `${row.h}px`;
      S.rendered.set(row.key, el);
      frag.appendChild(el);
    }
    for (const [key, el] of S.rendered) {
      if (!want.has(key) && !el.contains(document.activeElement)) { el.remove(); S.rendered.delete(key); }
    }
    viewport.appendChild(frag);
  }

  function groupEl(row) {
    const el = document.createElement("div");
    el.className = "group";
    el.setAttribute("role", "listitem");
    el.dataset.group = row.name;
    el.innerHTML = `<h2>${esc(row.name)}</h2><span class="muted">${row.count} node${row.count === 1 ? "" : "s"}</span>`;
    return el;
  }

  function nodeEl(node) {
    const el = document.createElement("div");
    el.className = `row${node.ready === false ? " not-ready" : ""}`;
    el.setAttribute("role", "listitem");
    el.dataset.node = node.name;
    const children = new Map();
    const top = topDevices(node);
    const tops = new Set(top);
    for (const d of node.devices || []) {
      if (tops.has(d)) continue;
      if (!children.has(d.parent)) children.set(d.parent, []);
      children.get(d.parent).push(d);
    }
    const meta = [node.ready === false ? "⚠ not ready" : "ready", node.clique ? `clique ${node.clique}` : "",
      ...(node.domains || []).map((d) => `domain ${d}`)].filter(Boolean).join(" · ");
    el.setAttribute("aria-label", `node ${node.name}, ${top.length} GPUs, ${meta}`);
    el.innerHTML = `<div class="node-head"><span class="node-name" title="${esc(node.name)}">${esc(node.name)}</span>`
      + `<span class="muted">${esc(meta)}</span></div>`
      + `<div class="tiles">${top.map((d) => tileHtml(node, d, children.get(d.name) || [])).join("")}</div>`;
    return el;
  }

  // ---- drill-down ----
  const drill = $("#drilldown");
  const ddBody = $("#dd-body");

  function openDrill(key, opener) {
    S.openKey = key;
    S.lastFocus = opener || null;
    const [node, dev] = key.split("/");
    $("#dd-title").textContent = `${dev} on ${node}`;
    ddBody.innerHTML = "<p class=\"muted\">loading…</p>";
    drill.hidden = false;
    $("#dd-close").focus();
    refreshDrill();
  }

  async function refreshDrill() {
    const key = S.openKey;
    const [node, dev] = key.split("/");
    let res;
    try {
      res = await api(`/api/device/${encodeURIComponent(node)}/${encodeURIComponent(dev)}`);
    } catch (e) {
      if (S.openKey === key) ddBody.innerHTML = `<p class="error">${esc(e.message)}</p>`;
      return;
    }
    if (S.openKey !== key) return;
    const d = res.device;
    const rows = [["product", d.product], ["memory", gib(d.memoryBytes)], ["type", d.type], ["UUID", d.uuid],
      ["parent", d.parent], ["MIG", d.mig ? `${d.mig.profile} at slot ${d.mig.start} (size ${d.mig.size})` : ""],
      ["state", `${ICON[d.state] || ""} ${d.state}`], ["XID", d.xid == null ? "" : String(d.xid)],
      ["capacity", leftText(d)], ["utilisation", U.utilText((S.util.get(node) || new Map()).get(dev))]].filter((r) => r[1]);
    const taints = (d.taints || []).map((t) => `<li>${esc(t.key)}=${esc(t.value)} <span class="muted">${esc(t.effect)} since ${esc(t.timeAdded)}</span></li>`).join("");
    const allocs = (d.allocations || []).map((a) => {
      const sh = a.share ? ` · share ${shareSize(a.share)}` : "";
      if (!visibleAlloc(a)) return `<li>${a.share ? "share of another tenant" : "claimed (other tenant)"}${esc(sh)}</li>`;
      const pods = (a.pods || []).map((p) => `<li>${esc(p)} <button type="button" data-explain="${esc(p)}">explain</button></li>`).join("");
      return `<li data-alloc="${esc(a.namespace)}/${esc(a.claim)}"><b>${esc(a.namespace)}/${esc(a.claim)}</b> · ${esc(sharing(a.sharing))}${esc(sh)} · ${esc(age(a.since))}`
        + `<ul>${pods}</ul><div class="claim-detail" data-claim-detail="${esc(a.namespace)}/${esc(a.claim)}"></div></li>`;
    }).join("");
    const events = (res.events || []).map((e) => `<li><time>${esc(e.time)}</time> <b>${esc(e.type)}</b> ${esc(e.summary)}</li>`).join("");
    ddBody.innerHTML = `<dl>${rows.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("")}</dl>`
      + (taints ? `<h3>Taints</h3><ul>${taints}</ul>` : "")
      + `<h3>Claims</h3>${allocs ? `<ul>${allocs}</ul>` : "<p class=\"muted\">none</p>"}`
      + `<h3>History</h3>${events ? `<ol class="events">${events}</ol>` : "<p class=\"muted\">no recent events</p>"}`
      + "<div id=\"dd-explain\"></div>";
    for (const el of ddBody.querySelectorAll("[data-claim-detail]")) loadClaim(el, key);
  }

  async function loadClaim(el, key) {
    const [ns, name] = el.dataset.claimDetail.split("/");
    let c;
    try { c = await api(`/api/claim/${encodeURIComponent(ns)}/${encodeURIComponent(name)}`); } catch (e) {
      el.innerHTML = `<p class="error">${esc(e.message)}</p>`;
      return;
    }
    if (S.openKey !== key) return;
    const devs = (c.claim.devices || []).map((d) => `${d.node}/${d.device}`).join(", ");
    el.innerHTML = `<div class="muted">devices: ${esc(devs)}</div>`
      + (c.traceUrl ? `<a class="trace" href="${esc(c.traceUrl)}" target="_blank" rel="noopener">trace ${esc(c.traceId)}</a>`
        : c.traceId ? `<span class="muted">trace ${esc(c.traceId)}</span>` : "")
      + (c.waterfall ? `<pre class="waterfall">${esc(c.waterfall)}</pre>` : "");
  }

  async function explain(pod) {
    if (drill.hidden) {
      S.openKey = "";
      $("#dd-title").textContent = `pod ${pod}`;
      ddBody.innerHTML = "<div id=\"dd-explain\"></div>";
      drill.hidden = false;
      S.lastFocus = document.activeElement;
    }
    const out = $("#dd-explain");
    out.innerHTML = `<h3>Explain ${esc(pod)}</h3><p class="muted">loading…</p>`;
    const [ns, name] = pod.split("/");
    try {
      const r = await api(`/api/pod/${encodeURIComponent(ns)}/${encodeURIComponent(name)}/explain`);
      out.innerHTML = `<h3>Explain ${esc(pod)}</h3><pre class="explain">${esc(r.text)}</pre>`;
    } catch (e) { out.innerHTML = `<h3>Explain ${esc(pod)}</h3><p class="error">${esc(e.message)}</p>`; }
  }

  function closeDrill() {
    drill.hidden = true;
    const key = S.openKey;
    S.openKey = "";
    let back = S.lastFocus && document.contains(S.lastFocus) ? S.lastFocus : null;
    if (!back && key) back = viewport.querySelector(`[data-device="${CSS.escape(key)}"]`);
    if (back) back.focus();
  }

  // ---- keyboard and pointer ----
  function moveRow(from, step) {
    const rowEl = from.closest("[data-node]");
    const col = [...rowEl.querySelectorAll("[data-device]")].indexOf(from);
    let i = indexOf(`n:${rowEl.dataset.node}`);
    do { i += step; } while (i >= 0 && i < S.layout.length && S.layout[i].kind !== "n");
    if (i < 0 || i >= S.layout.length) return;
    const y = S.offsets[i];
    const h = S.layout[i].h;
    if (y < viewport.scrollTop) viewport.scrollTop = y - GROUP_H;
    else if (y + h > viewport.scrollTop + viewport.clientHeight) viewport.scrollTop = y + h - viewport.clientHeight;
    render();
    const target = S.rendered.get(S.layout[i].key);
    const devs = target ? [...target.querySelectorAll("[data-device]")] : [];
    if (devs.length) devs[Math.min(col, devs.length - 1)].focus();
  }

  viewport.addEventListener("keydown", (ev) => {
    const el = ev.target.closest && ev.target.closest("[data-device]");
    if (!el) return;
    if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); openDrill(el.dataset.device, el); return; }
    if (ev.key === "ArrowLeft" || ev.key === "ArrowRight") {
      const devs = [...el.closest("[data-node]").querySelectorAll("[data-device]")];
      const next = devs[devs.indexOf(el) + (ev.key === "ArrowRight" ? 1 : -1)];
      if (next) next.focus();
      ev.preventDefault();
    } else if (ev.key === "ArrowDown" || ev.key === "ArrowUp") {
      moveRow(el, ev.key === "ArrowDown" ? 1 : -1);
      ev.preventDefault();
    }
  });
  viewport.addEventListener("click", (ev) => {
    const el = ev.target.closest("[data-device]");
    if (el) openDrill(el.dataset.device, el);
  });
  for (const el of [ddBody, $("#pending")]) {
    el.addEventListener("click", (ev) => {
      const b = ev.target.closest("[data-explain]");
      if (b) explain(b.dataset.explain);
    });
  }
  $("#dd-close").addEventListener("click", closeDrill);
  document.addEventListener("keydown", (ev) => { if (ev.key === "Escape" && !drill.hidden) closeDrill(); });

  let scheduled = false;
  const schedule = () => {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => { scheduled = false; render(); });
  };
  viewport.addEventListener("scroll", schedule, { passive: true });
  // a new width may fit more or fewer tiles per line: the rows get their new heights and places
  window.addEventListener("resize", () => {
    if (perLine() !== S.perLine) relayout();
    schedule();
  });

  const search = $("#search");
  search.addEventListener("input", () => { S.query = search.value; relayout(); render(); });
  search.addEventListener("keydown", (ev) => {
    const q = search.value.trim();
    if (ev.key === "Enter" && !S.layout.length && /^[^/\s]+\/[^/\s]+$/.test(q)) explain(q);
  });
  $("#ns-filter").addEventListener("change", (ev) => {
    S.ns = ev.target.value;
    const p = new URLSearchParams(location.search);
    if (S.ns) p.set("namespace", S.ns); else p.delete("namespace");
    history.replaceState(null, "", location.pathname + (p.toString() ? `?${p}` : ""));
    connect();
  });

  // ages on the visible rows move on
  setInterval(() => {
    for (const [key, el] of S.rendered) {
      if (key.startsWith("n:") && !el.contains(document.activeElement)) { el.remove(); S.rendered.delete(key); }
    }
    render();
    renderPending();
  }, 30000);

  connect();
})();
