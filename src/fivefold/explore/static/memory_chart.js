// Memory per pipeline stage: the four tenants stacked, the HBM line.

import { $, legend, niceStep, svg, titled } from "./dom.js";
import { fmt } from "./format.js";

export const TENANTS = ["params", "grads", "optimizer", "activations", "other"];
export const TENANT_LABEL = {
  params: "parameters", grads: "gradients", optimizer: "optimizer state",
  activations: "activations", other: "other (buffers, context, fragmentation)",
};
export const TENANT_COLOUR = {
  params: "#4c78a8", grads: "#72b7b2", optimizer: "#f58518", activations: "#e45756", other: "#9d755d",
};
export function renderMemory(est) {
  const stages = est.memory_per_stage_gib;
  const host = $("#memory-chart");
  host.textContent = "";
  const top = Math.max(est.hbm_gib || 0, ...stages.map((s) => s.total)) * 1.12 || 1;
  const width = Math.max(420, host.clientWidth || 520);
  const height = 260;
  const pad = { l: 48, r: 12, t: 16, b: 34 };
  const plotW = width - pad.l - pad.r;
  const plotH = height - pad.t - pad.b;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, id: "memory-svg", role: "img" }, host);
  const y = (gib) => pad.t + plotH - (gib / top) * plotH;
  const step = niceStep(top, 5);
  for (let v = 0; v <= top + 1e-9; v += step) {
    svg("line", { class: "gridline", x1: pad.l, x2: width - pad.r, y1: y(v), y2: y(v) }, root);
    svg("text", { class: "axis", x: pad.l - 6, y: y(v) + 4, "text-anchor": "end" }, root, `${+v.toFixed(1)}`);
  }
  svg("text", { class: "axis", x: 12, y: pad.t + plotH / 2, transform: `rotate(-90 12 ${pad.t + plotH / 2})`, "text-anchor": "middle" }, root, "GiB per GPU");
  const slot = plotW / stages.length;
  const barW = Math.min(70, slot * 0.7);
  const labelEvery = Math.ceil(stages.length / 24);
  stages.forEach((stage, i) => {
    const x = pad.l + slot * i + (slot - barW) / 2;
    let base = 0;
    const group = svg("g", { class: "stage-bar", "data-stage": i, "data-total": String(stage.total) }, root);
    for (const tenant of TENANTS) {
      const gib = stage[tenant];
      if (!(gib > 0)) { base += gib || 0; continue; }
      const rect = svg("rect", {
        x, width: barW, y: y(base + gib), height: Math.max(0, y(base) - y(base + gib)),
        fill: TENANT_COLOUR[tenant], "data-tenant": tenant, "data-value": String(gib),
      }, group);
      titled(rect, `stage ${i}: ${TENANT_LABEL[tenant]} ${fmt.gib(gib)}`);
      base += gib;
    }
    if (i === est.worst_stage) {
      svg("rect", { class: "worst", x: x - 2, width: barW + 4, y: y(stage.total) - 2, height: y(0) - y(stage.total) + 4 }, root);
    }
    if (barW >= 34 || i === est.worst_stage) {
      svg("text", { class: "bar-total", x: x + barW / 2, y: y(stage.total) - 5, "text-anchor": "middle" }, root, stage.total.toFixed(1));
    }
    if (i % labelEvery === 0) {
      const layers = est.layers_per_stage && stages.length <= 8 && est.plan.vpp === 1 ? ` · ${est.layers_per_stage[i]} layers` : "";
      svg("text", { class: "axis", x: x + barW / 2, y: height - pad.b + 15, "text-anchor": "middle" }, root, `${i}${layers}`);
    }
  });
  svg("text", { class: "axis", x: pad.l + plotW / 2, y: height - 4, "text-anchor": "middle" }, root,
    stages.length > 1 ? "pipeline stage (worst outlined)" : "every GPU (no pipeline)");
  if (est.hbm_gib) {
    svg("line", { class: "hbm", x1: pad.l, x2: width - pad.r, y1: y(est.hbm_gib), y2: y(est.hbm_gib) }, root);
    svg("text", { class: "hbm-label", x: width - pad.r - 4, y: y(est.hbm_gib) - 5, "text-anchor": "end", id: "hbm-label", "data-value": String(est.hbm_gib) }, root, `HBM ${est.hbm_gib.toFixed(1)} GiB`);
  }
  const worst = est.memory_gib;
  const other = Object.entries(est.other_gib || {}).map(([k, v]) => `${k} ${v.toFixed(2)}`).join(", ");
  $("#memory-sub").textContent = `Worst stage ${est.worst_stage}: ${fmt.gib(worst.total)} of ${fmt.gib(est.hbm_gib)} · ` +
    `${est.precision}` + (other ? ` · other = ${other} GiB` : "");
  legend($("#memory-legend"), TENANTS.map((t) => [TENANT_COLOUR[t], TENANT_LABEL[t]]));
}
