// fivefold explore: the page's start-up (the controls filled from /api/presets, the default
// layout, the event wiring). The modules it imports hold one concept each, named on their first
// line; all are hand-written ES modules (no libraries, no network beyond this server). Every
// figure drawn comes from the server's JSON, which is the planner's estimate().to_json(); the
// page only lays numbers out. Elements that show a planner figure carry it, unrounded, in a
// data-value attribute (the browser tests compare those with `fivefold plan estimate --json`).

import { api } from "./api.js";
import { field, fillSelect, writeField } from "./controls.js";
import { $, $$ } from "./dom.js";
import { fmt } from "./format.js";
import { BATCH_MODEL_FIELDS, applyClusterPreset, applyModelPreset, applyPlan } from "./layout_request.js";
import { applyProfile, buildPlannerControls } from "./planner_table.js";
import { renderRanks } from "./rank_grid.js";
import { exportRecipe, recommend } from "./recommend.js";
import { ringStep, stopRing } from "./ring.js";
import { state } from "./state.js";
import { scheduleUpdate, showProblems, update } from "./update.js";
import { render } from "./views.js";

const DEFAULT_LAYOUT = {
  modelPreset: "llama3-8b", seqLen: 8192, clusterPreset: "dgx-h100", nodes: 2, globalBatch: 64,
  plan: { tp: 2, sp: true, pp: 2, schedule: "1f1b", vpp: 1, dp_replicate: 1, dp_shard: 4, zero: 1, cp: 1, cp_kind: "ring", ep: 1, micro_batch: 1, recompute: "selective", precision: "bf16-mixed" },
};

/** Every choice the controls offer, from /api/presets. */
function fillControls(presets) {
  const modelNames = Object.keys(presets.models);
  fillSelect($("#model-preset"), [...modelNames, "custom"], Object.fromEntries(modelNames.map((n) => [n, `${n} (${fmt.count(presets.models[n].params)})`])));
  fillSelect($("#cluster-preset"), [...Object.keys(presets.clusters), "custom"]);
  fillSelect(field("cluster.gpu"), Object.keys(presets.gpus));
  fillSelect(field("plan.schedule"), presets.schedules);
  fillSelect(field("plan.cp_kind"), presets.cp_kinds);
  fillSelect(field("plan.recompute"), presets.recompute);
  fillSelect(field("plan.precision"), Object.keys(presets.precisions));
  buildPlannerControls(presets);
}

/** The layout the page opens with. */
function applyDefaults(presets) {
  const d = DEFAULT_LAYOUT;
  $("#model-preset").value = d.modelPreset;
  applyModelPreset(d.modelPreset);
  writeField("model.seq_len", d.seqLen);
  $("#cluster-preset").value = d.clusterPreset;
  writeField("cluster.nodes", d.nodes);
  writeField("cluster.gpus_per_node", 8);
  applyClusterPreset(d.clusterPreset);
  applyPlan({ ...d.plan, grad_accum: 1 });
  writeField("global_batch", d.globalBatch);
  field("planner.profile").value = presets.default_profile;
  applyProfile(presets.default_profile);
}

/** The controls' and buttons' listeners, and a redraw on resize. */
function wireEvents() {
  const form = $("#form");
  // "input" fires for every edit of a box, select or checkbox; "change" would fire again on blur.
  form.addEventListener("input", (ev) => onControl(ev.target));
  $("#recommend").addEventListener("click", recommend);
  $("#export").addEventListener("click", exportRecipe);
  $("#export-copy").addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText($("#export-toml").textContent));
  $("#ring-prev").addEventListener("click", () => { stopRing(); ringStep(-1); });
  $("#ring-next").addEventListener("click", () => { stopRing(); ringStep(1); });
  $("#ring-play").addEventListener("click", () => {
    if (state.ring.timer) { stopRing(); return; }
    $("#ring-play").textContent = "Pause";
    state.ring.timer = setInterval(() => ringStep(1), 700);
  });
  $$('input[name="colour-by"]').forEach((radio) => radio.addEventListener("change", () => {
    state.colourBy = radio.value;
    if (state.result) renderRanks(state.result.ranks);
  }));
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (state.result) render(state.result); }, 150);
  });
}

async function start() {
  const presets = await api("/api/presets");
  if (!presets.models) {
    showProblems(presets.problems || ["cannot load the presets from the server."]);
    document.body.dataset.state = "error";
    return;
  }
  state.presets = presets;
  fillControls(presets);
  applyDefaults(presets);
  wireEvents();
  await update();
}

function onControl(target) {
  if (target.id === "model-preset") {
    if (target.value !== "custom") applyModelPreset(target.value);
  } else if (target.id === "hf-file") {
    const file = target.files && target.files[0];
    if (file) file.text().then((text) => { $("#hf-config").value = text; scheduleUpdate(); });
    return;
  } else if (target.name && target.name.startsWith("model.") && !BATCH_MODEL_FIELDS.includes(target.name)) {
    $("#model-preset").value = "custom"; // an edited dimension makes the model custom
    if (target.name === "model.hidden" || target.name === "model.heads") {
      const heads = Number(field("model.heads").value);
      if (heads >= 1) writeField("model.head_dim", Math.floor(Number(field("model.hidden").value) / heads));
    }
  } else if (target.name === "planner.profile") {
    applyProfile(target.value);
  } else if (target.id === "cluster-preset") {
    if (target.value !== "custom") applyClusterPreset(target.value);
  } else if (target.name && target.name.startsWith("cluster.") && target.name !== "cluster.nodes") {
    $("#cluster-preset").value = "custom";
  }
  if (target.name === "colour-by") return;
  scheduleUpdate();
}

document.addEventListener("DOMContentLoaded", start);
