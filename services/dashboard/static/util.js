// The fleet page's utilisation drawing, pure (no page state): a device's figures and its 10-minute SM %
// sparkline (inline SVG), the merge of a `telemetry` event into what the page holds, and a GPU-hours entry.
// app.js calls these as window.gpuUtil; the tests read the [data-util] spans they draw (docs/dashboard.md).
"use strict";
window.gpuUtil = (() => {
  const SLOT_S = 10; // one sparkline point per 10 s slot, 61 of them: the server's ring (utilisation.py)
  const POINTS = 61;
  const { esc, gib } = window.gpuFmt;

  // device -> [time, SM %, memory used, memory total, W, °C(, SM % points)] merged into `had` (a Map): a full
  // event brings the points; a live one adds a point, or replaces the newest when in the same 10 s slot.
  function merge(had, devices) {
    const next = new Map();
    for (const [name, v] of Object.entries(devices)) {
      const [t, sm, memUsed, memTotal, powerW, tempC, spark] = v;
      const old = had.get(name);
      let points = spark || (old ? old.spark.slice() : []);
      if (!spark && old && Math.floor(t / SLOT_S) === Math.floor(old.t / SLOT_S) && points.length) {
        points[points.length - 1] = sm ?? -1;
      } else if (!spark) points.push(sm ?? -1);
      if (points.length > POINTS) points = points.slice(-POINTS);
      next.set(name, { t, sm, memUsed, memTotal, powerW, tempC, spark: points });
    }
    return next;
  }

  function sparkPath(points, w, h) {
    const step = w / (POINTS - 1);
    let d = "";
    let pen = false;
    points.forEach((v, i) => {
      if (v == null || v < 0) { pen = false; return; }
      const x = (w - (points.length - 1 - i) * step).toFixed(1);
      const y = (h - (v / 100) * (h - 1)).toFixed(1);
      d += `${pen ? "L" : "M"}${x} ${y}`;
      pen = true;
    });
    return d;
  }

  function utilText(u) {
    if (!u) return "";
    return [u.sm != null ? `SM ${u.sm}%` : "", u.memTotal ? `memory ${gib(u.memUsed) || "0 GiB"} of ${gib(u.memTotal)}` : "",
      u.powerW != null ? `${u.powerW} W` : "", u.tempC != null ? `${u.tempC} °C` : ""].filter(Boolean).join(" · ");
  }

  // The tile foot's figures (without a sample: `plain`, the memory size), the sparkline drawn behind the tile.
  function utilHtml(name, u, plain = "") {
    if (!u) return `<span class="t-util" data-util="${esc(name)}" data-plain="${esc(plain)}">${plain}</span>`;
    const mem = u.memTotal ? `${Math.round(u.memUsed / 2 ** 30)}/${Math.round(u.memTotal / 2 ** 30)}G` : "";
    const figs = [u.sm != null ? `${u.sm}%` : "", mem, u.powerW != null ? `${u.powerW}W` : "",
      u.tempC != null ? `${u.tempC}°C` : ""].filter(Boolean);
    const path = sparkPath(u.spark, 140, 16);
    const spark = path ? `<svg class="spark" viewBox="0 0 140 16" preserveAspectRatio="none" aria-hidden="true"><path d="${path}"/></svg>` : "";
    return `<span class="t-util" data-util="${esc(name)}" data-plain="${esc(plain)}" data-sm="${esc(u.sm ?? "")}"`
      + ` data-mem="${esc(u.memUsed ?? "")}" data-mem-total="${esc(u.memTotal ?? "")}" data-power="${esc(u.powerW ?? "")}"`
      + ` data-temp="${esc(u.tempC ?? "")}" title="${esc(`SM % over the last 10 min; now ${utilText(u).replaceAll(" · ", ", ")}`)}">`
      + `${esc(figs.join(" "))}${spark}</span>`;
  }

  function hoursHtml(n) {
    const h = (x) => (x >= 10 ? x.toFixed(0) : x.toFixed(1));
    const mig = Object.entries(n.migHours || {}).map(([p, x]) => ` · ${esc(p)} ${h(x)} h`).join("");
    return `<li data-ns="${esc(n.namespace)}" data-gpu-hours="${n.gpuHours}"><b>${esc(n.namespace)}</b> ${h(n.gpuHours)} GPU-h${mig}`
      + `${n.claimsOpen ? ` <span class="muted">(${n.claimsOpen} running)</span>` : ""}</li>`;
  }

  return { merge, sparkPath, utilHtml, utilText, hoursHtml };
})();
