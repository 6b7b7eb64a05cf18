// One estimate round trip (debounce, send, show the answer or its problems) and the hints
// beside the controls.

import { api } from "./api.js";
import { field, writeField } from "./controls.js";
import { $, $$, el } from "./dom.js";
import { layoutRequest } from "./layout_request.js";
import { stopRing } from "./ring.js";
import { state } from "./state.js";
import { render } from "./views.js";

export function scheduleUpdate(delay = 120) {
  clearTimeout(state.timer);
  state.pending = true;
  state.timer = setTimeout(update, delay);
  document.body.dataset.state = "loading";
}

export async function update() {
  const seq = ++state.seq;
  state.pending = false;
  updateHints();
  $("#status").textContent = "computing…";
  const started = performance.now();
  const answer = await api("/api/estimate", layoutRequest());
  if (seq !== state.seq || state.pending) return; // a newer request is on its way
  $("#card-export").hidden = true;
  if (!answer.ok) {
    showProblems(answer.problems || ["unknown error"]);
    document.body.dataset.state = "invalid";
    $("#status").textContent = "invalid layout";
  } else {
    showProblems([]);
    state.result = answer;
    stopRing();
    state.ring.step = 0;
    render(answer);
    document.body.dataset.state = "ready";
    $("#status").textContent = `planner answered in ${Math.round(performance.now() - started)} ms`;
  }
  document.body.dataset.seq = String(seq);
}

export function showProblems(problems) {
  const box = $("#problems");
  const list = $("#problem-list");
  list.textContent = "";
  for (const p of problems) el("li", {}, list, p);
  box.hidden = problems.length === 0;
  $(".problems-note").hidden = !state.result;
  $("#views").classList.toggle("stale", problems.length > 0);
  $$(".invalid").forEach((n) => n.classList.remove("invalid"));
  for (const p of problems) {
    for (const m of p.matchAll(/\b((?:model|cluster|plan)\.[a-z_]+|global_batch)\b/g)) {
      const input = field(m[1]);
      if (input) input.classList.add("invalid");
    }
  }
}
// ---- hints beside the controls (arithmetic on the inputs, no model) ----------------------------
export function updateHints() {
  const num = (name) => Number(field(name).value);
  const gpus = num("cluster.nodes") * num("cluster.gpus_per_node");
  const axes = state.presets ? state.presets.mesh_order : [];  // outer to inner, as the mesh
  const degrees = axes.map((a) => [a, num(`plan.${a}`)]);
  const product = degrees.reduce((acc, [, v]) => acc * v, 1);
  const hint = $("#degree-product");
  hint.textContent = "";
  el("span", {}, hint, degrees.map(([a, v]) => `${a.replace("dp_", "dp ")} ${v}`).join(" × ") + " = ");
  el("b", { class: product === gpus ? "" : "bad" }, hint, `${product}`);
  el("span", {}, hint, ` of ${gpus} GPUs`);
  // Offer the data-parallel degree that makes the product match, when there is one.
  const others = product / (num("plan.dp_replicate") * num("plan.dp_shard"));
  const axis = num("plan.zero") >= 1 ? "dp_shard" : "dp_replicate";
  const keep = axis === "dp_shard" ? num("plan.dp_replicate") : num("plan.dp_shard");
  const want = gpus / (others * keep);
  if (product !== gpus && Number.isInteger(want) && want >= 1) {
    const fix = el("button", { type: "button", class: "link", id: "fill-dp" }, hint, `set ${axis.replace("_", " ")} = ${want}`);
    fix.addEventListener("click", () => { writeField(`plan.${axis}`, want); scheduleUpdate(0); });
  }
  const gpu = state.presets && state.presets.gpus[field("cluster.gpu").value];
  $("#cluster-facts").textContent = gpu
    ? `${gpus} GPUs · ${gpu.hbm_gib.toFixed(1)} GiB HBM each · ${gpu.peak_tflops.bf16 ? gpu.peak_tflops.bf16.toFixed(0) + " TFLOP/s bf16 dense" : "no catalog peak"}`
    : "";
  const precision = state.presets && state.presets.precisions[field("plan.precision").value];
  $("#precision-facts").textContent = precision || "";
}
