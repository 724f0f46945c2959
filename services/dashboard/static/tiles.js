// A node's GPU tiles as HTML: state and XID, who holds the GPU (or each of its shares, and what is left), its MIG
// layout, the utilisation foot (util.js). app.js makes them with window.gpuTiles({ ns, util }): `ns()` is the
// namespace chosen (names of other namespaces are hidden too), `util(node, d, plain)` a tile's utilisation foot.
"use strict";
window.gpuTiles = ({ ns, util }) => {
  const { esc, gib, age, sharing, shortProduct } = window.gpuFmt;
  const ICON = { free: "○", claimed: "●", tainted: "⚠" };
  // An allocation of another tenant carries no names (server side); with a namespace chosen the page
  // hides names of other namespaces too.
  const visibleAlloc = (a) => a.namespace && a.claim && (!ns() || a.namespace === ns());
  const claimKey = (a) => (visibleAlloc(a) ? `${a.namespace}/${a.claim}` : "");

  // The devices drawn as tiles (a MIG device or partition is drawn inside its parent's tile).
  function topDevices(node) {
    const names = new Set((node.devices || []).map((d) => d.name));
    return (node.devices || []).filter((d) => !(d.parent && names.has(d.parent)));
  }

  function allocText(allocs) {
    if (!allocs.length) return "";
    const a = allocs[0];
    const more = allocs.length > 1 ? ` <span class="muted">+${allocs.length - 1}</span>` : "";
    if (!visibleAlloc(a)) return `<div class="t-alloc"><span class="claim">claimed (other tenant)</span>${more}</div>`;
    const pod = (a.pods || []).length ? `<span class="pod">${esc(a.pods[0].split("/").pop())}</span> · ` : "";
    return `<div class="t-alloc"><span class="claim">${esc(a.namespace)}/${esc(a.claim)}</span>${more}</div>`
      + `<div class="t-alloc">${pod}<span class="age">${esc(age(a.since))}</span></div>`;
  }

  // A device offered in shares: who holds each share (another tenant's without names) and what is left.
  const shareSize = (sh) => [sh.memoryBytes ? gib(sh.memoryBytes) : "", sh.compute != null ? `${sh.compute}%` : "",
    sh.shares != null ? `${sh.shares} sh` : ""].filter(Boolean).join(" · ");
  const shareShort = (sh) => [sh.memoryBytes ? gib(sh.memoryBytes).replace(" GiB", "G") : "",
    sh.compute != null ? `${sh.compute}%` : "", sh.shares != null ? `${sh.shares}sh` : ""].filter(Boolean).join(" ");
  const shareWho = (a) => (visibleAlloc(a) ? `${a.namespace}/${a.claim}` : "another tenant");
  function leftText(d) {
    const c = d.capacityLeft;
    if (!c) return "";
    const parts = [c.memoryBytes != null ? (gib(c.memoryBytes) || "0 GiB") : "", c.compute != null ? `${c.compute}%` : "",
      c.shares != null ? `${c.shares} shares` : ""].filter(Boolean);
    return parts.length ? `left ${parts.join(" · ")}` : "";
  }
  function sharesHtml(d) {
    const shares = (d.allocations || []).filter((a) => a.share);
    const seg = (a) => `<span class="seg${visibleAlloc(a) ? "" : " other"}" style="width:${Math.min(100, (100 * a.share.memoryBytes) / d.memoryBytes)}%"></span>`;
    const bar = d.memoryBytes ? `<div class="share-bar" aria-hidden="true">${shares.map(seg).join("")}</div>` : "";
    const lines = shares.slice(0, 2).map((a) => `<div class="t-alloc" data-share="${esc(shareWho(a))}">`
      + `<span class="claim">${esc(shareWho(a))}</span> <span class="muted" title="${esc(shareSize(a.share))}">${esc(shareShort(a.share))}</span></div>`).join("");
    const more = shares.length > 2 ? ` <span class="muted">+${shares.length - 2} shares</span>` : "";
    return bar + lines + `<div class="t-alloc share-left" data-left="${esc(leftText(d))}">${esc(leftText(d))}${more}</div>`;
  }

  function deviceAttrs(node, d) {
    const allocs = d.allocations || [];
    const claim = allocs.map(claimKey).find(Boolean) || "";
    const label = [`${d.name} on ${node.name}`, d.product, gib(d.memoryBytes), d.state,
      d.xid != null ? `XID ${d.xid}` : "", allocs.length ? sharing(allocs[0].sharing) : "",
      ...allocs.map((a) => (a.share ? `share of ${shareWho(a)}, ${shareSize(a.share)}`
        : visibleAlloc(a) ? `claim ${a.namespace}/${a.claim}${(a.pods || []).length ? `, pod ${a.pods.join(", ")}` : ""}, ${age(a.since)}` : "claimed by another tenant")),
      leftText(d)]
      .filter(Boolean).join(", ");
    return `data-device="${esc(node.name)}/${esc(d.name)}" data-state="${esc(d.state)}"`
      + `${d.xid != null ? ` data-xid="${esc(d.xid)}"` : ""}${claim ? ` data-claim="${esc(claim)}"` : ""}`
      + ` tabindex="0" role="button" aria-label="${esc(label)}" title="${esc(label)}"`;
  }

  function migBar(node, d, kids) {
    const slots = d.migSlots;
    // Static MIG devices never overlap; dynamic partitions are every possible placement, so only the
    // claimed ones are drawn and the rest counted.
    const placed = kids.filter((k) => k.mig && (k.type === "mig" || k.state !== "free"));
    const freeOptions = kids.filter((k) => k.mig && k.type === "partition" && k.state === "free").length;
    const cells = placed.map((k) => {
      const m = k.mig;
      return `<div class="slot st-${esc(k.state)}" data-mig-slot ${deviceAttrs(node, k)} data-profile="${esc(m.profile)}"`
        + ` data-start="${m.start}" data-size="${m.size}" style="grid-column:${m.start + 1} / span ${m.size}">`
        + `<i aria-hidden="true">${ICON[k.state] || ""}</i>${esc(m.profile.split(".")[0])}</div>`;
    }).join("");
    const ticks = Array.from({ length: slots }, (_, i) => `<span class="tick" style="grid-column:${i + 1}"></span>`).join("");
    return `<div class="mig-bar" role="group" aria-label="MIG layout, ${slots} slots" style="grid-template-columns:repeat(${slots},1fr)">${ticks}${cells}</div>`
      + (freeOptions ? `<div class="muted small">${freeOptions} free placements</div>` : "");
  }

  function tileHtml(node, d, kids) {
    const allocs = d.allocations || [];
    const xid = d.xid != null ? `<span class="xid">XID ${esc(d.xid)}</span>` : "";
    const share = allocs.length ? `<div class="share">${esc(sharing(allocs[0].sharing))}</div>` : "";
    const kidsLoose = d.migSlots ? [] : kids;
    if (d.shared) {
      return `<div class="tile shared st-${esc(d.state)}" ${deviceAttrs(node, d)}>`
        + `<div class="t-head"><span class="t-name">${esc(d.name)}</span><span class="t-state"><i aria-hidden="true">${ICON[d.state] || ""}</i> ${esc(d.state)}</span></div>`
        + `<div class="t-foot">${util(node, d, `<span class="t-prod">${esc(shortProduct(d.product))}</span><span class="mem">${esc(gib(d.memoryBytes))}</span>`)}${xid}</div>`
        + `${sharesHtml(d)}</div>`;
    }
    return `<div class="tile st-${esc(d.state)}" ${deviceAttrs(node, d)}>`
      + `<div class="t-head"><span class="t-name">${esc(d.name)}</span><span class="t-state"><i aria-hidden="true">${ICON[d.state] || ""}</i> ${esc(d.state)}</span></div>`
      + `<div class="t-prod">${esc(shortProduct(d.product))}</div>`
      + (d.migSlots ? migBar(node, d, kids) : "")
      + (kidsLoose.length ? `<div class="muted small">${kidsLoose.length} partitions</div>` : "")
      + `<div class="t-foot">${util(node, d, `<span class="mem">${esc(gib(d.memoryBytes))}</span>`)}${xid}</div>${share}`
      + `${allocText(allocs)}</div>`;
  }

  return { ICON, visibleAlloc, topDevices, tileHtml, shareSize, leftText };
};
