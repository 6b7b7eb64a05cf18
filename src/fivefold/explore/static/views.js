// The whole answer drawn: layout facts, KPIs and the step-time breakdown, then each chart.

import { renderComm } from "./comm_table.js";
import { $, el, legend, setValue } from "./dom.js";
import { fmt } from "./format.js";
import { renderMemory } from "./memory_chart.js";
import { renderBudget, renderPlanner } from "./planner_table.js";
import { renderRanks } from "./rank_grid.js";
import { renderRing } from "./ring.js";
import { renderTimeline } from "./timeline_chart.js";

export const BREAKDOWN = [
  ["compute_s", "compute", "#4c78a8"],
  ["in_stage_comm_s", "TP/CP/EP comm. in the stages", "#e45756"],
  ["pipeline_bubble_s", "pipeline bubble", "#c9ced6"],
  ["dp_grad_exposed_s", "exposed DP gradient reduce", "#f58518"],
  ["param_gather_exposed_s", "exposed ZeRO gathers", "#b279a2"],
  ["optimizer_s", "optimizer step", "#54a24b"],
];
export function render(answer) {
  const est = answer.estimate;
  const layout = answer.layout;
  $("#layout-describe").textContent = layout.describe;
  $("#model-params").textContent = `${fmt.count(layout.params)} parameters` +
    (layout.active_params !== layout.params ? ` (${fmt.count(layout.active_params)} active per token)` : "");
  $("#batch-facts").textContent = "";
  const facts = $("#batch-facts");
  el("span", {}, facts, `${fmt.int(layout.tokens_per_step)} tokens per step · gradient accumulation `);
  el("b", { id: "grad-accum", "data-value": String(layout.grad_accum) }, facts, String(layout.grad_accum));
  el("span", {}, facts, ` micro-batches of ${answer.plan.micro_batch} on each of ${layout.dp} DP ranks`);
  renderPlanner(answer.planner);
  renderBudget(answer.budget);
  renderKpis(est);
  renderBreakdown(est);
  renderMemory(est);
  renderComm(est);
  renderTimeline(est);
  renderRanks(answer.ranks);
  renderRing();
}

/** Where the step time goes: the planner's breakdown_s as one stacked bar (keys it adds extra too). */
export function renderBreakdown(est) {
  const host = $("#breakdown-bar");
  host.textContent = "";
  const parts = est.breakdown_s || {};
  const known = BREAKDOWN.filter(([key]) => key in parts);
  const extra = Object.keys(parts).filter((k) => !BREAKDOWN.some(([key]) => key === k))
    .map((k, i) => [k, k.replace(/_s$/, "").replace(/_/g, " "), ["#9d755d", "#72b7b2", "#eeca3b"][i % 3]]);
  const all = [...known, ...extra];
  const total = all.reduce((acc, [key]) => acc + Math.max(0, parts[key]), 0) || 1;
  for (const [key, label, colour] of all) {
    const seconds = parts[key];
    if (!(seconds > 0)) continue;
    const seg = el("div", { class: "segment", "data-key": key, "data-value": String(seconds), title: `${label}: ${fmt.time(seconds)}` }, host);
    seg.style.width = `${(100 * seconds) / total}%`;
    seg.style.background = colour;
  }
  legend($("#breakdown-legend"), all.filter(([key]) => parts[key] > 0)
    .map(([key, label, colour]) => [colour, `${label} ${fmt.time(parts[key])}`]));
}

export function renderKpis(est) {
  setValue("kpi-step-time", est.step_time_s, fmt.time(est.step_time_s));
  setValue("kpi-tokens-per-s", est.tokens_per_s, fmt.int(est.tokens_per_s));
  setValue("kpi-mfu", est.mfu, fmt.pct(est.mfu));
  setValue("kpi-hfu", est.hfu, fmt.pct(est.hfu));
  setValue("kpi-bubble", est.bubble_fraction, fmt.pct(est.bubble_fraction));
  setValue("kpi-memory", est.memory_gib.total, fmt.gib(est.memory_gib.total));
  setValue("kpi-hbm", est.hbm_gib, fmt.gib(est.hbm_gib));
  setValue("kpi-fits", est.fits, est.fits ? "yes" : "no — out of memory");
  const box = $("#kpi-fits-box");
  box.classList.toggle("fits", Boolean(est.fits));
  box.classList.toggle("oom", !est.fits);
}
