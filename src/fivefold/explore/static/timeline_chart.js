// The pipeline schedule: each rank's forward, backward and weight-gradient blocks.

import { $, el, legend, niceStep, svg, titled } from "./dom.js";
import { fmt } from "./format.js";

export const KIND_COLOUR = { F: "#4c78a8", B: "#54a24b", W: "#eeca3b" };
export const KIND_LABEL = { F: "forward", B: "backward", W: "weight gradient" };
export function renderTimeline(est) {
  const host = $("#timeline-chart");
  host.textContent = "";
  const ranks = est.timeline || [];
  const end = Math.max(1e-30, ...ranks.flat().map((e) => e.end_s));
  const width = Math.max(700, host.clientWidth || 900);
  const rowH = ranks.length > 16 ? 14 : 24;
  const pad = { l: 62, r: 14, t: 8, b: 30 };
  const height = pad.t + pad.b + rowH * ranks.length;
  const plotW = width - pad.l - pad.r;
  const x = (s) => pad.l + (s / end) * plotW;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, id: "timeline-svg" }, host);
  const tick = niceStep(end * 1e3, 10);
  for (let ms = 0; ms <= end * 1e3 + 1e-9; ms += tick) {
    svg("line", { class: "gridline", x1: x(ms / 1e3), x2: x(ms / 1e3), y1: pad.t, y2: height - pad.b }, root);
    svg("text", { class: "axis", x: x(ms / 1e3), y: height - pad.b + 14, "text-anchor": "middle" }, root, `${+ms.toFixed(3)}`);
  }
  svg("text", { class: "axis", x: pad.l + plotW / 2, y: height - 3, "text-anchor": "middle" }, root, "time in the step (ms)");
  const pp = ranks.length;
  ranks.forEach((events, rank) => {
    const top = pad.t + rank * rowH + 2;
    const h = rowH - 4;
    svg("rect", { class: "idle", x: pad.l, width: plotW, y: top, height: h }, root);
    svg("text", { class: "rank-label", x: pad.l - 8, y: top + h / 2 + 4, "text-anchor": "end" }, root, `rank ${rank}`);
    const row = svg("g", { class: "timeline-rank", "data-rank": rank, "data-events": events.length }, root);
    for (const e of events) {
      const w = Math.max(0.5, x(e.end_s) - x(e.start_s));
      const later = pp > 0 && e.chunk >= pp; // a rank's later chunk (interleaved / V): lighter
      const rect = svg("rect", {
        class: `event ${e.kind}`, x: x(e.start_s), width: w, y: top, height: h,
        fill: KIND_COLOUR[e.kind] || "#888", "fill-opacity": later ? 0.62 : 1,
        "data-kind": e.kind, "data-mb": e.microbatch, "data-chunk": e.chunk,
      }, row);
      titled(rect, `rank ${rank}: ${KIND_LABEL[e.kind] || e.kind} of micro-batch ${e.microbatch}, chunk ${e.chunk}, ` +
        `${fmt.time(e.start_s)} – ${fmt.time(e.end_s)}`);
      if (w >= 14 && h >= 14) {
        svg("text", {
          class: later ? "event-label dark" : "event-label", x: x(e.start_s) + w / 2, y: top + h / 2 + 3.5, "text-anchor": "middle",
        }, row, `${e.microbatch}`);
      }
    }
  });
  const bubble = est.bubble_fraction;
  const sub = $("#timeline-sub");
  sub.textContent = "";
  sub.appendChild(document.createTextNode(`${ranks.length} pipeline rank${ranks.length > 1 ? "s" : ""}, ` +
    `${est.plan.grad_accum} micro-batches, ${est.plan.pp > 1 ? est.plan.schedule : "no pipeline"}` +
    `${est.plan.vpp > 1 ? `, v = ${est.plan.vpp}` : ""} · bubble `));
  el("b", { id: "timeline-bubble", "data-value": String(bubble) }, sub, fmt.pct(bubble));
  sub.appendChild(document.createTextNode(" of the step is idle (grey) · numbers are micro-batches; lighter blocks are a rank's later model chunk"));
  legend($("#timeline-legend"), [
    [KIND_COLOUR.F, "forward (F)"], [KIND_COLOUR.B, "backward (B)"], [KIND_COLOUR.W, "weight gradient (W)"], ["#eef0f3", "idle"],
  ]);
}
