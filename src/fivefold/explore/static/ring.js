// The ring all-reduce step-through, with the planner's bytes and time for it.

import { $, el, svg } from "./dom.js";
import { fmt } from "./format.js";
import { state } from "./state.js";

export const MAX_RING_GPUS = 16;
/**
 * Which all-reduce to animate: the DP gradient reduction when DP > 1, else the TP collective.
 * Returns {kind, n, entry} with the planner's comm entry for it (or null when the layout has none).
 */
export function ringSubject(result) {
  const plan = result.plan;
  const comm = result.estimate.comm || [];
  const dp = plan.dp_replicate * plan.dp_shard;
  if (dp > 1) return { kind: "dp", n: dp, entry: comm.find((r) => r.kind === "dp") || null };
  if (plan.tp > 1) return { kind: "tp", n: plan.tp, entry: comm.find((r) => r.kind === "tp") || null };
  return { kind: null, n: 4, entry: null };
}

export function stopRing() {
  clearInterval(state.ring.timer);
  state.ring.timer = null;
  $("#ring-play").textContent = "Play";
}

/** The chunk GPU `g` sends at `step` (1..2(n-1)): reduce-scatter step s sends (g - s + 1) mod n,
 * all-gather step s forwards the reduced chunk (g - s + 2) mod n. */
function sentChunk(g, step, n) {
  const shift = step <= n - 1 ? step - 1 : step - (n - 1) - 2;
  return (((g - shift) % n) + n) % n;
}

/** have[g][c] after `step` steps: how many GPUs' contributions chunk c on GPU g holds (1..n). */
export function ringHoldings(n, step) {
  let have = Array.from({ length: n }, () => Array.from({ length: n }, () => 1));
  for (let s = 1; s <= step; s++) {
    const next = have.map((row) => row.slice());
    for (let g = 0; g < n; g++) {
      const to = (g + 1) % n;
      const c = sentChunk(g, s, n);
      next[to][c] = s <= n - 1 ? have[to][c] + have[g][c] : n;
    }
    have = next;
  }
  return have;
}

/** Sizes of the drawing for n GPUs in `host`: the circle, each GPU's box and chunk width. */
function ringGeometry(host, n) {
  const width = Math.max(340, Math.min(host.clientWidth || 420, 520));
  const height = n > 8 ? 400 : 300;
  const radius = Math.min(width, height) / 2 - 30;
  const boxW = Math.min(120, 15 * n + 16, Math.floor((0.8 * 2 * Math.PI * radius) / n));
  const cx = width / 2;
  const cy = height / 2;
  const pos = (g) => {
    const a = -Math.PI / 2 + (2 * Math.PI * g) / n;
    return [cx + radius * Math.cos(a), cy + radius * Math.sin(a)];
  };
  return { width, height, cx, cy, boxW, chunkW: (boxW - 8) / n, pos };
}

/** One arrow per GPU to its successor, with the chunk in flight written beside it. */
function drawRingArrows(root, geo, n, step) {
  const defs = svg("defs", {}, root);
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto" }, defs);
  svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#2f5fa7" }, marker);
  if (step === 0) return;
  for (let g = 0; g < n; g++) {
    const [x1, y1] = geo.pos(g);
    const [x2, y2] = geo.pos((g + 1) % n);
    const dx = x2 - x1;
    const dy = y2 - y1;
    const shrink = Math.min(0.42, (geo.boxW / 2 + 6) / Math.hypot(dx, dy));
    svg("line", {
      class: "ring-arrow", x1: x1 + dx * shrink, y1: y1 + dy * shrink, x2: x2 - dx * shrink, y2: y2 - dy * shrink,
      "marker-end": "url(#arrow)",
    }, root);
    // The chunk in flight, written just outside the ring beside its arrow.
    const mx = (x1 + x2) / 2 + ((x1 + x2) / 2 - geo.cx) * 0.16;
    const my = (y1 + y2) / 2 + ((y1 + y2) / 2 - geo.cy) * 0.16;
    svg("text", { class: "ring-chunk-label", x: mx, y: my + 3, "text-anchor": "middle" }, root, `c${sentChunk(g, step, n)}`);
  }
}

/** Each GPU as a box of n chunks shaded by how much of the sum they hold (green: all of it). */
function drawRingGpus(root, geo, n, have) {
  const { boxW, chunkW } = geo;
  for (let g = 0; g < n; g++) {
    const [x, y] = geo.pos(g);
    svg("rect", { class: "ring-gpu", x: x - boxW / 2, y: y - 22, width: boxW, height: 44, rx: 5 }, root);
    svg("text", { class: "ring-gpu-label", x, y: y - 8, "text-anchor": "middle" }, root, boxW >= 50 ? `GPU ${g}` : `${g}`);
    for (let c = 0; c < n; c++) {
      const frac = have[g][c] / n;
      svg("rect", {
        class: "ring-chunk", x: x - boxW / 2 + 4 + c * chunkW, y: y - 1, width: Math.max(1, chunkW - 2), height: 17, rx: 2,
        fill: frac >= 1 ? "#1e7d3a" : `rgba(47, 95, 167, ${0.15 + 0.75 * frac})`,
        "data-gpu": g, "data-chunk": c, "data-have": have[g][c],
      }, root);
    }
  }
}

/** One line of planner figures for a comm entry: bytes and time per GPU per step, exposed part. */
function ringFigure(numbers, label, entry, id) {
  if (!entry) return;
  const line = el("div", {}, numbers);
  line.appendChild(document.createTextNode(`${label}: `));
  el("b", { id: `${id}-bytes`, "data-value": String(entry.bytes_per_step) }, line, fmt.bytes(entry.bytes_per_step));
  line.appendChild(document.createTextNode(` per GPU per step over ${entry.link === "ib" ? "InfiniBand" : "NVLink"} in `));
  el("b", { id: `${id}-time`, "data-value": String(entry.time_s) }, line, fmt.time(entry.time_s));
  line.appendChild(document.createTextNode(`, ${fmt.time(entry.exposed_s)} of it exposed.`));
}

/** The caption and the planner's figures for the collective drawn (n of subject.n GPUs). */
function describeRing(subject, n) {
  const sub = $("#ring-sub");
  const numbers = $("#ring-numbers");
  numbers.textContent = "";
  if (!subject.kind) {
    sub.textContent = "This layout has no all-reduce (DP = 1 and TP = 1); shown with 4 GPUs to illustrate the algorithm.";
    return;
  }
  sub.textContent = `The ${subject.kind === "dp" ? "data-parallel gradient" : "tensor-parallel"} all-reduce over ${subject.n} GPUs` +
    (subject.n > n ? ` (first ${n} drawn)` : "") + ": each chunk is 1/n of the buffer; shade = how many GPUs' contributions it holds, green = fully reduced.";
  const plan = state.result.plan;
  const comm = state.result.estimate.comm || [];
  if (subject.kind === "dp" && plan.zero >= 1) {
    el("div", {}, numbers, `With ZeRO-${plan.zero} the two halves run apart (planner):`);
    ringFigure(numbers, "reduce-scatter of the gradients", subject.entry, "ring");
    ringFigure(numbers, "all-gather of the parameters", comm.find((r) => r.kind === "zero-gather"), "ring-gather");
  } else {
    ringFigure(numbers, subject.kind === "dp" ? "Planner, the gradient all-reduce" : "Planner, all TP collectives", subject.entry, "ring");
  }
  const halfSteps = subject.n - 1;
  el("div", { class: "muted" }, numbers, `A ring moves (n−1)/n of the buffer per GPU in each half: n−1 = ${halfSteps} step${halfSteps > 1 ? "s" : ""} of 1/n each.`);
}

export function renderRing() {
  const host = $("#ring-chart");
  host.textContent = "";
  if (!state.result) return;
  const subject = ringSubject(state.result);
  const n = Math.min(subject.n, MAX_RING_GPUS);
  const steps = 2 * (n - 1);
  const step = Math.max(0, Math.min(state.ring.step, steps));
  state.ring.step = step;
  const geo = ringGeometry(host, n);
  const root = svg("svg", { width: geo.width, height: geo.height, viewBox: `0 0 ${geo.width} ${geo.height}`, id: "ring-svg" }, host);
  drawRingArrows(root, geo, n, step);
  drawRingGpus(root, geo, n, ringHoldings(n, step));
  const phase = step === 0 ? "start: every GPU holds its own gradients" :
    step <= n - 1 ? `reduce-scatter step ${step} of ${n - 1}` : `all-gather step ${step - (n - 1)} of ${n - 1}`;
  $("#ring-step").textContent = `step ${step} / ${steps} · ${phase}`;
  describeRing(subject, n);
}

export function ringStep(delta) {
  if (!state.result) return;
  const n = Math.min(ringSubject(state.result).n, MAX_RING_GPUS);
  const steps = 2 * (n - 1);
  state.ring.step = (state.ring.step + delta + steps + 1) % (steps + 1);
  renderRing();
}
