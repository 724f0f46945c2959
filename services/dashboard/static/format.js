// The fleet page's words and numbers, pure (no page state): HTML escaping, sizes, ages, a device's sharing mode.
// util.js, tiles.js and app.js take them from window.gpuFmt.
"use strict";
window.gpuFmt = (() => {
  const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
  function gib(bytes) {
    if (!bytes) return "";
    const g = bytes / 2 ** 30;
    return `${g >= 10 ? Math.round(g) : g.toFixed(1)} GiB`;
  }
  function age(since) {
    const t = Date.parse(since);
    if (!since || Number.isNaN(t)) return "";
    const s = Math.max(0, Math.round((Date.now() - t) / 1000));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m`;
    if (s < 86400) return `${Math.floor(s / 3600)}h`;
    return `${Math.floor(s / 86400)}d`;
  }
  function sharing(sh) {
    if (!sh || !sh.mode || sh.mode === "exclusive") return "exclusive";
    if (sh.mode === "time-slicing") return `time-slice${sh.interval ? ` ${sh.interval}` : ""}`;
    if (sh.mode === "mps") {
      const pct = sh.threadPercentage == null ? "" : ` ${sh.threadPercentage}%`;
      return `MPS${pct}${sh.pinnedMemory ? ` · ${sh.pinnedMemory} pinned` : ""}`;
    }
    return sh.mode;
  }
  const shortProduct = (p) => String(p || "GPU").replace(/^NVIDIA\s+/, "");
  return { esc, gib, age, sharing, shortProduct };
})();
