// fivefold explore: the page's logic, hand-written (no libraries, no network beyond this server).
// Every figure drawn here comes from the server's JSON, which is the planner's estimate().to_json();
// this file only lays numbers out. Elements that show a planner figure carry it, unrounded, in a
// data-value attribute (the browser tests compare those with `fivefold plan estimate --json`).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const TENANTS = ["params", "grads", "optimizer", "activations", "other"];
const TENANT_LABEL = {
  params: "parameters", grads: "gradients", optimizer: "optimizer state",
  activations: "activations", other: "other (buffers, context, fragmentation)",
};
const TENANT_COLOUR = {
  params: "#4c78a8", grads: "#72b7b2", optimizer: "#f58518", activations: "#e45756", other: "#9d755d",
};
const KIND_COLOUR = { F: "#4c78a8", B: "#54a24b", W: "#eeca3b" };
const KIND_LABEL = { F: "forward", B: "backward", W: "weight gradient" };
const COMM_LABEL = {
  tp: "TP/SP collectives", dp: "DP gradient reduce", "zero-gather": "ZeRO param gather",
  pp: "PP send/receive", cp: "CP ring exchange", ep: "EP all-to-all",
};
const LINK_LABEL = { nvlink: "NVLink · in a node", ib: "InfiniBand · across nodes" };
const BREAKDOWN = [
  ["compute_s", "compute", "#4c78a8"],
  ["in_stage_comm_s", "TP/CP/EP comm. in the stages", "#e45756"],
  ["pipeline_bubble_s", "pipeline bubble", "#c9ced6"],
  ["dp_grad_exposed_s", "exposed DP gradient reduce", "#f58518"],
  ["param_gather_exposed_s", "exposed ZeRO gathers", "#b279a2"],
  ["optimizer_s", "optimizer step", "#54a24b"],
];
const GROUP_LABEL = { tp: "TP", pp: "PP", dp: "DP", cp: "CP", ep: "EP" };
const MAX_GRID_CELLS = 4096;
const MAX_RING_GPUS = 16;

const state = {
  presets: null,
  result: null, // last valid /api/estimate answer
  seq: 0,
  timer: null,
  pending: false, // a control moved and its request has not been sent yet
  modelBase: {}, // a custom model's settings that have no control, from the last preset
  colourBy: "tp",
  ring: { step: 0, timer: null },
};

// ---- formatting (mirrored by tests/explore/formatting.py) ------------------------------------
const fmt = {
  time(s) {
    if (s === null || s === undefined) return "—";
    if (s === 0) return "0";
    if (s >= 1) return `${s.toFixed(3)} s`;
    if (s >= 1e-3) return `${(s * 1e3).toFixed(1)} ms`;
    return `${(s * 1e6).toFixed(1)} µs`;
  },
  pct(x) { return x === null || x === undefined ? "—" : `${(x * 100).toFixed(1)} %`; },
  gib(x) { return x === null || x === undefined ? "—" : `${x.toFixed(2)} GiB`; },
  int(x) { return x === null || x === undefined ? "—" : Math.round(x).toLocaleString("en-US"); },
  bytes(b) {
    if (b === null || b === undefined) return "—";
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, size] of units) if (b >= size) return `${(b / size).toFixed(2)} ${unit}`;
    return `${Math.round(b)} B`;
  },
  count(n) {
    if (n >= 1e12) return `${(n / 1e12).toFixed(2)}T`;
    if (n >= 1e9) return `${(n / 1e9).toFixed(2)}B`;
    if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
    return n.toLocaleString("en-US");
  },
};

// ---- small DOM helpers ------------------------------------------------------------------------
const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

function el(tag, attrs = {}, parent = null, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function svg(tag, attrs = {}, parent = null, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function titled(node, text) { svg("title", {}, node, text); return node; }

function setValue(id, value, text) {
  const node = document.getElementById(id);
  node.textContent = text;
  if (value === null || value === undefined) node.removeAttribute("data-value");
  else node.dataset.value = String(value);
}

function niceStep(span, target) {
  const raw = span / Math.max(1, target);
  const mag = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

function groupColour(id, count) {
  if (count <= 1) return "#a7b8d6";
  const hue = (id * 137.508 + 210) % 360;
  const light = 58 + (id % 3) * 8;
  return `hsl(${hue.toFixed(1)}, 55%, ${light}%)`;
}

// ---- the form <-> request ---------------------------------------------------------------------
function field(name) { return document.querySelector(`[name="${name}"]`); }

function readField(input) {
  if (input.type === "checkbox") return input.checked;
  const raw = input.value.trim();
  if (input.tagName === "SELECT" && !/^-?\d+$/.test(raw)) return raw;
  if (raw === "") return null;
  let num = Number(raw);
  if (!Number.isFinite(num)) return raw;
  if (input.dataset.scale) num *= Number(input.dataset.scale);
  return num;
}

function writeField(name, value) {
  const input = field(name);
  if (!input) return;
  if (input.type === "checkbox") input.checked = Boolean(value);
  else if (input.dataset.scale) input.value = String(value / Number(input.dataset.scale));
  else input.value = String(value);
}

const MODEL_DIMS = [
  "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "mlp", "tied_embeddings",
  "experts", "top_k", "expert_ffn", "shared_experts", "dense_layers",
];
const BATCH_MODEL_FIELDS = ["model.seq_len", "model.doc_len"]; // not the model's dimensions
const HIDDEN_MODEL_FIELDS = ["norm_eps", "rope_theta", "router_aux_loss_coef"];
const CLUSTER_FIELDS = ["gpu", "nodes", "gpus_per_node", "intra_node_bw", "inter_node_bw"];
const PLAN_FIELDS = [
  "tp", "sp", "pp", "schedule", "vpp", "dp_replicate", "dp_shard", "zero", "cp", "cp_kind", "ep",
  "micro_batch", "recompute", "precision",
];

// Planner options shown in MiB (the API takes bytes, as PlannerOptions does).
const PLANNER_MIB = ["dp_bucket_bytes", "cuda_context_bytes"];

/** One control per planner option, from /api/presets (its help as the tooltip). */
function buildPlannerControls(presets) {
  fillSelect(field("planner.profile"), Object.keys(presets.profiles));
  const box = $("#planner-options");
  for (const [name, o] of Object.entries(presets.planner_options)) {
    const words = name.replaceAll("_", " ");
    const label = el("label", { title: o.help }, box);
    if (o.kind === "bool") {
      label.className = "check";
      el("input", { type: "checkbox", name: `planner.${name}` }, label);
      label.append(` ${words}`);
      continue;
    }
    const mib = PLANNER_MIB.includes(name);
    label.append(mib ? `${words.replace(" bytes", "")} (MiB) ` : `${words} `);
    if (o.kind === "choice") {
      fillSelect(el("select", { name: `planner.${name}` }, label), o.choices);
    } else {
      const attrs = { type: "number", name: `planner.${name}`, min: "0", step: "any" };
      if (mib) attrs["data-scale"] = String(2 ** 20);
      el("input", attrs, label);
    }
  }
}

/** Set every planner option control to the profile's value (fivefold: its runtime's on a GPU;
 * a framework profile: its own, else the field's default, `base`). */
function applyProfile(name) {
  const profile = state.presets.profiles[name];
  if (!profile) return;
  for (const [key, o] of Object.entries(state.presets.planner_options)) {
    const own = !profile.options ? o.default : key in profile.options ? profile.options[key] : o.base;
    writeField(`planner.${key}`, own);
  }
}

/** The request's planner table: the profile and every option as the controls show it. */
function plannerRequest() {
  const out = { profile: field("planner.profile").value };
  for (const key of Object.keys(state.presets.planner_options)) {
    out[key] = readField(field(`planner.${key}`));
  }
  const tokens = readField(field("planner.tokens"));
  for (const key of BUDGET_FIELDS) {  // a price alone means nothing without tokens
    const value = readField(field(`planner.${key}`));
    if (value !== null && tokens !== null) out[key] = value;
  }
  const sources = readMixture(field("planner.sources").value);
  if (sources.length && tokens !== null) out.sources = sources;
  return out;
}

/** "web=0.6:3e11, books=0.15" as the planner's mixture tables (the server checks them). */
function readMixture(text) {
  return text.split(",").map((s) => s.trim()).filter(Boolean).map((entry) => {
    const [name, rest = ""] = entry.split("=");
    const [weight, tokens] = rest.split(":");
    const table = { name: name.trim(), weight: Number(weight) };
    if (tokens !== undefined && tokens.trim() !== "") table.tokens = Number(tokens);
    return table;
  });
}

/** Tokens and epochs per source of the mixture, as `fivefold plan` prints them. */
function mixtureText(sources) {
  if (!sources || !sources.length) return "";
  return " Data: " + sources.map((s) => `${s.name} ${fmt.int(s.tokens)} tokens` +
    (s.epochs === null ? "" : ` (${s.epochs.toFixed(2)} epochs` +
      (s.epochs > s.max_epochs ? `, over ${s.max_epochs}: repeated too often` : "") + ")")).join("; ") + ".";
}

// The token-budget fields of the planner table (fivefold.planner.budget.token_budget); empty = not sent.
const BUDGET_FIELDS = ["tokens", "gpu_hour_price"];

/** The token-budget answer (days, GPU-hours, cost, failures, checkpoint interval, goodput). */
function renderBudget(b) {
  const node = $("#budget-facts");
  if (!b) { node.textContent = ""; delete node.dataset.days; return; }
  if (b.days === null) { node.textContent = "Token budget: the run never finishes at this failure rate."; return; }
  const cost = b.cost_usd === null ? "no price given" : `$${fmt.int(b.cost_usd)}`;
  node.dataset.days = String(b.days);
  node.textContent = `Token budget: ${fmt.int(b.steps)} steps, ${b.days.toFixed(1)} days, ` +
    `${fmt.int(b.gpu_hours)} GPU-hours, ${cost}; ${b.interruptions.toFixed(1)} expected ` +
    `interruptions; checkpoint ${b.checkpoint_gb.toFixed(1)} GB every ` +
    `${fmt.int(b.checkpoint_interval_steps)} steps; goodput ${fmt.pct(b.goodput)}.` +
    mixtureText(b.sources);
  node.dataset.sources = JSON.stringify(b.sources || []);
}

function renderPlanner(planner) {
  const node = $("#planner-facts");
  if (!planner) { node.textContent = ""; return; }
  const summary = state.presets.profiles[planner.profile]?.summary || "";
  node.textContent = `${planner.profile}: ${summary}.` +
    (planner.notes.length ? ` Replaced: ${planner.notes.join("; ")}.` : "");
  node.dataset.profile = planner.profile;
}

/** The request body for /api/estimate and /api/recipe, in the spec's own field names. */
function layoutRequest() {
  const body = { model: {}, cluster: {}, plan: {} };
  const preset = $("#model-preset").value;
  const hf = hfConfig();
  if (hf.problem) body.problems = [hf.problem];
  if (hf.config) body.model.hf_config = hf.config; // a pasted config.json replaces the preset
  else if (preset !== "custom") body.model.preset = preset;
  else {
    // Settings without a control (RoPE base, norm epsilon, ...) stay those of the last preset.
    body.model = { ...state.modelBase, name: "custom" };
    for (const dim of MODEL_DIMS) body.model[dim] = readField(field(`model.${dim}`));
  }
  body.model.seq_len = readField(field("model.seq_len"));
  body.model.doc_len = readField(field("model.doc_len"));
  const clusterPreset = $("#cluster-preset").value;
  body.cluster.name = clusterPreset === "custom" ? "custom" : clusterPreset;
  for (const f of CLUSTER_FIELDS) body.cluster[f] = readField(field(`cluster.${f}`));
  for (const f of PLAN_FIELDS) body.plan[f] = readField(field(`plan.${f}`));
  body.global_batch = readField(field("global_batch"));
  body.planner = plannerRequest();
  // An empty box is a mistake the server words for us; send it as-is rather than guessing.
  return body;
}

function searchRequest() {
  const body = layoutRequest();
  return {
    model: body.model, cluster: body.cluster, global_batch: body.global_batch, top: 5,
    precisions: [body.plan.precision], planner: body.planner, problems: body.problems,
  };
}

/** The pasted Hugging Face config.json: {config} when there is one, {problem} when it is not a
 * JSON object, {} when the box is empty. */
function hfConfig() {
  const text = $("#hf-config").value.trim();
  if (!text) return {};
  try {
    const config = JSON.parse(text);
    if (config && typeof config === "object" && !Array.isArray(config)) return { config };
  } catch (err) {
    return { problem: `the pasted config.json is not valid JSON (${err.message}).` };
  }
  return { problem: "the pasted config.json must be a JSON object ({\"model_type\": ...})." };
}

function applyModelPreset(name) {
  const m = state.presets.models[name];
  if (!m) return;
  state.modelBase = Object.fromEntries(HIDDEN_MODEL_FIELDS.map((k) => [k, m[k]]));
  for (const dim of MODEL_DIMS) writeField(`model.${dim}`, m[dim]);
  writeField("model.seq_len", m.seq_len);
  writeField("model.doc_len", m.doc_len || 0);
}

function applyClusterPreset(name) {
  const c = state.presets.clusters[name];
  if (!c) return;
  const gpus = Number(field("cluster.nodes").value) * Number(field("cluster.gpus_per_node").value);
  writeField("cluster.gpu", c.gpu);
  writeField("cluster.gpus_per_node", c.gpus_per_node);
  writeField("cluster.intra_node_bw", c.intra_node_bw);
  writeField("cluster.inter_node_bw", c.inter_node_bw);
  if (Number.isFinite(gpus) && gpus >= 1) writeField("cluster.nodes", Math.max(1, Math.ceil(gpus / c.gpus_per_node)));
}

/** Put a plan (ParallelPlan.to_dict()) into the controls. */
function applyPlan(plan) {
  for (const f of PLAN_FIELDS) writeField(`plan.${f}`, plan[f]);
  writeField("global_batch", plan.micro_batch * plan.dp_replicate * plan.dp_shard * plan.grad_accum);
}

function fillSelect(select, options, labels = {}) {
  select.textContent = "";
  for (const value of options) el("option", { value }, select, labels[value] || value);
}

// ---- talking to the server --------------------------------------------------------------------
async function api(path, body) {
  if (body && body.problems) return { ok: false, problems: body.problems }; // found here
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    return { ok: false, problems: [`the explorer server does not answer (${err.message}); is \`fivefold explore\` still running?`] };
  }
  try {
    return await response.json();
  } catch (err) {
    return { ok: false, problems: [`the server sent an unreadable answer (HTTP ${response.status}).`] };
  }
}

function scheduleUpdate(delay = 120) {
  clearTimeout(state.timer);
  state.pending = true;
  state.timer = setTimeout(update, delay);
  document.body.dataset.state = "loading";
}

async function update() {
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

function showProblems(problems) {
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
function updateHints() {
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

// ---- rendering ---------------------------------------------------------------------------------
function render(answer) {
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
function renderBreakdown(est) {
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

function renderKpis(est) {
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

function legend(container, entries) {
  container.textContent = "";
  for (const [colour, label] of entries) {
    const item = el("span", {}, container);
    el("span", { class: "swatch" }, item).style.background = colour;
    item.appendChild(document.createTextNode(label));
  }
}

function renderMemory(est) {
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

function renderComm(est) {
  const body = $("#comm-table tbody");
  body.textContent = "";
  const rows = est.comm || [];
  const longest = Math.max(1e-30, ...rows.map((r) => r.time_s));
  const byLink = {};
  for (const r of rows) (byLink[r.link] = byLink[r.link] || []).push(r);
  let exposedTotal = 0;
  for (const link of Object.keys(byLink).sort()) {
    const list = byLink[link];
    const sum = (k) => list.reduce((acc, r) => acc + r[k], 0);
    const total = el("tr", { class: "link-total", "data-link": link }, body);
    el("td", {}, total, LINK_LABEL[link] || link);
    el("td", { class: "num", "data-value": String(sum("bytes_per_step")) }, total, fmt.bytes(sum("bytes_per_step")));
    el("td", { class: "num", "data-value": String(sum("time_s")) }, total, fmt.time(sum("time_s")));
    el("td", { class: "num", "data-value": String(sum("exposed_s")) }, total, fmt.time(sum("exposed_s")));
    el("td", { class: "num" }, total, fmt.time(sum("time_s") - sum("exposed_s")));
    el("td", {}, total, "");
    for (const r of list) {
      exposedTotal += r.exposed_s;
      const tr = el("tr", { class: "comm-row", "data-kind": r.kind, "data-link": r.link }, body);
      const what = el("td", { class: "indent" }, tr, COMM_LABEL[r.kind] || r.kind);
      if (r.link_model) el("div", { class: "link-model" }, what, r.link_model);  // how it is priced
      el("td", { class: "num", "data-field": "bytes_per_step", "data-value": String(r.bytes_per_step) }, tr, fmt.bytes(r.bytes_per_step));
      el("td", { class: "num", "data-field": "time_s", "data-value": String(r.time_s) }, tr, fmt.time(r.time_s));
      el("td", { class: "num", "data-field": "exposed_s", "data-value": String(r.exposed_s) }, tr, fmt.time(r.exposed_s));
      el("td", { class: "num" }, tr, fmt.time(r.time_s - r.exposed_s));
      const bar = el("div", { class: "split-bar" }, el("td", {}, tr));
      bar.title = `exposed ${fmt.time(r.exposed_s)}, overlapped ${fmt.time(r.time_s - r.exposed_s)}`;
      el("div", { class: "exposed" }, bar).style.width = `${(100 * r.exposed_s) / longest}%`;
      el("div", { class: "overlapped" }, bar).style.width = `${(100 * (r.time_s - r.exposed_s)) / longest}%`;
    }
  }
  if (!rows.length) {
    const tr = el("tr", {}, body);
    el("td", { colspan: "6" }, tr, "No communication: a single GPU holds the whole model.");
  }
  $("#comm-sub").textContent = `Per GPU per optimizer step. Exposed time adds to the step (${fmt.time(exposedTotal)} in all); ` +
    `overlapped time hides behind compute (${fmt.time(est.compute_time_s)} of compute per step).`;
}

function renderTimeline(est) {
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

function renderRanks(ranks) {
  const host = $("#rank-grid");
  host.textContent = "";
  const axis = state.colourBy;
  const world = ranks.world_size;
  const perNode = ranks.gpus_per_node;
  const shown = Math.min(world, MAX_GRID_CELLS);
  const nodesShown = Math.ceil(shown / perNode);
  const width = Math.max(360, host.clientWidth || 480);
  const cols = perNode <= 8 ? perNode : Math.ceil(Math.sqrt(perNode * 2));
  const rowsPerNode = Math.ceil(perNode / cols);
  // The largest cell (44 px down to 3 px) whose node boxes, wrapped to the card's width, fit
  // the height budget; small cells drop the node labels and most of the padding.
  const budgetH = 420;
  const box = (cell) => {
    const pad = cell >= 8 ? 8 : 2;
    const gap = cell >= 8 ? 6 : 2;
    const labelH = cell >= 12 ? 14 : 0;
    const nodeW = cols * cell + pad;
    const nodeH = rowsPerNode * cell + pad + labelH;
    const nodesPerRow = Math.max(1, Math.floor((width - 4) / (nodeW + gap)));
    const h = Math.ceil(nodesShown / nodesPerRow) * (nodeH + gap) + 4;
    return { cell, pad, gap, labelH, nodeW, nodeH, nodesPerRow, h };
  };
  let layout = box(3);
  for (let cell = 44; cell >= 3; cell--) {
    const candidate = box(cell);
    if (candidate.h <= budgetH && candidate.nodeW + 4 <= width) { layout = candidate; break; }
  }
  const { cell, pad, gap, labelH, nodeW, nodeH, nodesPerRow } = layout;
  const height = layout.h;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, id: "rank-svg" }, host);
  const groups = ranks.groups[axis];
  const count = ranks.group_counts[axis];
  const cells = [];
  for (let node = 0; node < nodesShown; node++) {
    const nx = 2 + (node % nodesPerRow) * (nodeW + gap);
    const ny = 2 + Math.floor(node / nodesPerRow) * (nodeH + gap);
    svg("rect", { class: "node-box", x: nx, y: ny, width: nodeW, height: nodeH, rx: 5 }, root);
    if (labelH) svg("text", { class: "node-label", x: nx + 5, y: ny + 11 }, root, `node ${node}`);
    for (let slot = 0; slot < perNode; slot++) {
      const rank = node * perNode + slot;
      if (rank >= shown) break;
      const cx = nx + pad / 2 + (slot % cols) * cell;
      const cy = ny + pad / 2 + labelH + Math.floor(slot / cols) * cell;
      const rect = svg("rect", {
        class: cell >= 8 ? "cell" : "cell small", x: cx, y: cy, width: cell, height: cell, rx: cell >= 8 ? 2 : 0,
        fill: groupColour(groups[rank], count), "data-rank": rank, "data-node": ranks.node[rank],
        "data-group": groups[rank],
      }, root);
      cells.push(rect);
      if (cell >= 20) svg("text", { class: "cell-label", x: cx + cell / 2, y: cy + cell / 2 + 3.5, "text-anchor": "middle" }, root, `${rank}`);
    }
  }
  root.addEventListener("mouseover", (ev) => {
    const target = ev.target.closest("rect.cell");
    if (!target) return;
    const rank = Number(target.dataset.rank);
    for (const c of cells) {
      c.classList.toggle("hover", c === target);
      c.classList.toggle("peer", c !== target && Number(c.dataset.group) === groups[rank]);
    }
    showRankInfo(ranks, rank);
  });
  const size = ranks.group_sizes[axis];
  $("#ranks-sub").textContent = `${world} GPUs on ${ranks.nodes} node${ranks.nodes > 1 ? "s" : ""} of ${perNode} · ` +
    `${count} ${GROUP_LABEL[axis]} group${count > 1 ? "s" : ""} of ${size} rank${size > 1 ? "s" : ""} (one colour per group)` +
    (shown < world ? ` · first ${shown} ranks drawn` : "");
}

function showRankInfo(ranks, rank) {
  const c = ranks.coords;
  const members = (axis) => {
    const out = [];
    const gid = ranks.groups[axis][rank];
    for (let r = 0; r < ranks.world_size && out.length < 9; r++) if (ranks.groups[axis][r] === gid) out.push(r);
    return out.length > 8 ? `${out.slice(0, 8).join(",")},…` : out.join(",");
  };
  $("#rank-info").textContent = `rank ${rank} on node ${ranks.node[rank]} · pp ${c.pp[rank]} · dp ${c.dp_replicate[rank]}/${c.dp_shard[rank]} · ` +
    `cp ${c.cp[rank]} · tp ${c.tp[rank]}\n${GROUP_LABEL[state.colourBy]} group ${ranks.groups[state.colourBy][rank]}: ranks ${members(state.colourBy)}`;
}

// ---- ring all-reduce step-through ----------------------------------------------------------------
/**
 * Which all-reduce to animate: the DP gradient reduction when DP > 1, else the TP collective.
 * Returns {kind, n, entry} with the planner's comm entry for it (or null when the layout has none).
 */
function ringSubject(result) {
  const plan = result.plan;
  const comm = result.estimate.comm || [];
  const dp = plan.dp_replicate * plan.dp_shard;
  if (dp > 1) return { kind: "dp", n: dp, entry: comm.find((r) => r.kind === "dp") || null };
  if (plan.tp > 1) return { kind: "tp", n: plan.tp, entry: comm.find((r) => r.kind === "tp") || null };
  return { kind: null, n: 4, entry: null };
}

function stopRing() {
  clearInterval(state.ring.timer);
  state.ring.timer = null;
  $("#ring-play").textContent = "Play";
}

function renderRing() {
  const host = $("#ring-chart");
  host.textContent = "";
  if (!state.result) return;
  const subject = ringSubject(state.result);
  const n = Math.min(subject.n, MAX_RING_GPUS);
  const steps = 2 * (n - 1);
  const step = Math.max(0, Math.min(state.ring.step, steps));
  state.ring.step = step;
  const width = Math.max(340, Math.min(host.clientWidth || 420, 520));
  const height = n > 8 ? 400 : 300;
  const cx = width / 2;
  const cy = height / 2;
  const radius = Math.min(width, height) / 2 - 30;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, id: "ring-svg" }, host);
  // Chunk c on GPU g after `step` steps: the number of GPUs whose contribution it holds.
  // Reduce-scatter step s (1..n-1): GPU g sends chunk (g - s + 1) mod n to g + 1, which adds it.
  // All-gather step s: GPU g forwards the fully reduced chunk (g - s + 2) mod n to g + 1.
  const have = [];
  for (let g = 0; g < n; g++) have.push(Array.from({ length: n }, () => 1));
  for (let s = 1; s <= step; s++) {
    const next = have.map((row) => row.slice());
    for (let g = 0; g < n; g++) {
      const to = (g + 1) % n;
      if (s <= n - 1) {
        const c = (((g - s + 1) % n) + n) % n;
        next[to][c] = have[to][c] + have[g][c];
      } else {
        const c = (((g - (s - (n - 1)) + 2) % n) + n) % n;
        next[to][c] = n;
      }
    }
    for (let g = 0; g < n; g++) have[g] = next[g];
  }
  const pos = (g) => {
    const a = -Math.PI / 2 + (2 * Math.PI * g) / n;
    return [cx + radius * Math.cos(a), cy + radius * Math.sin(a)];
  };
  const defs = svg("defs", {}, root);
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto" }, defs);
  svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#2f5fa7" }, marker);
  const boxW = Math.min(120, 15 * n + 16, Math.floor((0.8 * 2 * Math.PI * radius) / n));
  const chunkW = (boxW - 8) / n;
  const sent = (g) => (step <= n - 1 ? (((g - step + 1) % n) + n) % n : (((g - (step - (n - 1)) + 2) % n) + n) % n);
  if (step > 0) {
    for (let g = 0; g < n; g++) {
      const [x1, y1] = pos(g);
      const [x2, y2] = pos((g + 1) % n);
      const dx = x2 - x1;
      const dy = y2 - y1;
      const len = Math.hypot(dx, dy);
      const shrink = Math.min(0.42, (boxW / 2 + 6) / len);
      svg("line", {
        class: "ring-arrow", x1: x1 + dx * shrink, y1: y1 + dy * shrink, x2: x2 - dx * shrink, y2: y2 - dy * shrink,
        "marker-end": "url(#arrow)",
      }, root);
      // The chunk in flight, written just outside the ring beside its arrow.
      const mx = (x1 + x2) / 2 + ((x1 + x2) / 2 - cx) * 0.16;
      const my = (y1 + y2) / 2 + ((y1 + y2) / 2 - cy) * 0.16;
      svg("text", { class: "ring-chunk-label", x: mx, y: my + 3, "text-anchor": "middle" }, root, `c${sent(g)}`);
    }
  }
  for (let g = 0; g < n; g++) {
    const [x, y] = pos(g);
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
  const phase = step === 0 ? "start: every GPU holds its own gradients" :
    step <= n - 1 ? `reduce-scatter step ${step} of ${n - 1}` : `all-gather step ${step - (n - 1)} of ${n - 1}`;
  $("#ring-step").textContent = `step ${step} / ${steps} · ${phase}`;
  const sub = $("#ring-sub");
  const numbers = $("#ring-numbers");
  if (!subject.kind) {
    sub.textContent = "This layout has no all-reduce (DP = 1 and TP = 1); shown with 4 GPUs to illustrate the algorithm.";
    numbers.textContent = "";
    return;
  }
  sub.textContent = `The ${subject.kind === "dp" ? "data-parallel gradient" : "tensor-parallel"} all-reduce over ${subject.n} GPUs` +
    (subject.n > n ? ` (first ${n} drawn)` : "") + ": each chunk is 1/n of the buffer; shade = how many GPUs' contributions it holds, green = fully reduced.";
  numbers.textContent = "";
  const plan = state.result.plan;
  const comm = state.result.estimate.comm || [];
  const show = (label, entry, id) => {
    if (!entry) return;
    const line = el("div", {}, numbers);
    line.appendChild(document.createTextNode(`${label}: `));
    el("b", { id: `${id}-bytes`, "data-value": String(entry.bytes_per_step) }, line, fmt.bytes(entry.bytes_per_step));
    line.appendChild(document.createTextNode(` per GPU per step over ${entry.link === "ib" ? "InfiniBand" : "NVLink"} in `));
    el("b", { id: `${id}-time`, "data-value": String(entry.time_s) }, line, fmt.time(entry.time_s));
    line.appendChild(document.createTextNode(`, ${fmt.time(entry.exposed_s)} of it exposed.`));
  };
  if (subject.kind === "dp" && plan.zero >= 1) {
    el("div", {}, numbers, `With ZeRO-${plan.zero} the two halves run apart (planner):`);
    show("reduce-scatter of the gradients", subject.entry, "ring");
    show("all-gather of the parameters", comm.find((r) => r.kind === "zero-gather"), "ring-gather");
  } else {
    show(subject.kind === "dp" ? "Planner, the gradient all-reduce" : "Planner, all TP collectives", subject.entry, "ring");
  }
  const halfSteps = subject.n - 1;
  el("div", { class: "muted" }, numbers, `A ring moves (n−1)/n of the buffer per GPU in each half: n−1 = ${halfSteps} step${halfSteps > 1 ? "s" : ""} of 1/n each.`);
}

function ringStep(delta) {
  if (!state.result) return;
  const n = Math.min(ringSubject(state.result).n, MAX_RING_GPUS);
  const steps = 2 * (n - 1);
  state.ring.step = (state.ring.step + delta + steps + 1) % (steps + 1);
  renderRing();
}

// ---- recommend and export ------------------------------------------------------------------------
async function recommend() {
  const button = $("#recommend");
  button.disabled = true;
  button.textContent = "Searching…";
  const card = $("#card-recommend");
  const answer = await api("/api/search", searchRequest());
  button.disabled = false;
  button.textContent = "Recommend a layout";
  card.hidden = false;
  const body = $("#recommend-table tbody");
  body.textContent = "";
  $("#explanation").textContent = "";
  $("#rejected").textContent = "";
  if (!answer.ok) {
    $("#recommend-sub").textContent = "The search cannot run: " + (answer.problems || []).join(" ");
    document.body.dataset.search = "invalid";
    return;
  }
  const layouts = [answer.best, ...answer.alternatives].filter(Boolean);
  $("#recommend-sub").textContent = `${fmt.int(answer.evaluated)} layouts evaluated in ${fmt.time(answer.search_time_s)}` +
    (answer.best ? `; the recommended first: the fastest, or among layouts within ${(100 * answer.tie_fraction).toFixed(1)}% of it (a tie) the one with the least memory per GPU; the rest by predicted tokens/s. Apply puts a layout into the controls.` : "; none fits.");
  layouts.forEach((est, i) => {
    const tr = el("tr", { class: i === 0 ? "best" : "", "data-rank": i }, body);
    el("td", {}, tr, String(i + 1));
    el("td", { class: "describe" }, tr, answer.describe[i]);
    el("td", { class: "num", "data-value": String(est.step_time_s) }, tr, fmt.time(est.step_time_s));
    el("td", { class: "num", "data-value": String(est.tokens_per_s) }, tr, fmt.int(est.tokens_per_s));
    el("td", { class: "num", "data-value": String(est.mfu) }, tr, fmt.pct(est.mfu));
    el("td", { class: "num", "data-value": String(est.memory_gib.total) }, tr, fmt.gib(est.memory_gib.total));
    const apply = el("button", { type: "button", class: "apply" }, el("td", {}, tr), "Apply");
    apply.addEventListener("click", () => { applyPlan(est.plan); scheduleUpdate(0); });
  });
  for (const line of answer.explanation) el("li", {}, $("#explanation"), line);
  for (const r of answer.rejected.slice(0, 6)) {
    const li = el("li", {}, $("#rejected"));
    el("code", {}, li, r.describe);
    li.appendChild(document.createTextNode(` — ${r.reason}`));
  }
  document.body.dataset.search = "ready";
  card.scrollIntoView({ behavior: "instant", block: "start" });
}

async function exportRecipe() {
  const answer = await api("/api/recipe", layoutRequest());
  const card = $("#card-export");
  card.hidden = false;
  if (!answer.ok) {
    $("#export-toml").textContent = "Cannot export: " + (answer.problems || []).join(" ");
    $("#export-download").hidden = true;
    return;
  }
  $("#export-download").hidden = false;
  $("#export-toml").textContent = answer.toml;
  $("#export-filename").textContent = answer.filename;
  const link = $("#export-download");
  if (link.href.startsWith("blob:")) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(new Blob([answer.toml], { type: "application/toml" }));
  link.download = answer.filename;
  card.scrollIntoView({ behavior: "instant", block: "start" });
}

// ---- start-up ---------------------------------------------------------------------------------------
const DEFAULT_LAYOUT = {
  modelPreset: "llama3-8b", seqLen: 8192, clusterPreset: "dgx-h100", nodes: 2, globalBatch: 64,
  plan: { tp: 2, sp: true, pp: 2, schedule: "1f1b", vpp: 1, dp_replicate: 1, dp_shard: 4, zero: 1, cp: 1, cp_kind: "ring", ep: 1, micro_batch: 1, recompute: "selective", precision: "bf16-mixed" },
};

async function start() {
  const presets = await api("/api/presets");
  if (!presets.models) {
    showProblems(presets.problems || ["cannot load the presets from the server."]);
    document.body.dataset.state = "error";
    return;
  }
  state.presets = presets;
  const modelNames = Object.keys(presets.models);
  fillSelect($("#model-preset"), [...modelNames, "custom"], Object.fromEntries(modelNames.map((n) => [n, `${n} (${fmt.count(presets.models[n].params)})`])));
  fillSelect($("#cluster-preset"), [...Object.keys(presets.clusters), "custom"]);
  fillSelect(field("cluster.gpu"), Object.keys(presets.gpus));
  fillSelect(field("plan.schedule"), presets.schedules);
  fillSelect(field("plan.cp_kind"), presets.cp_kinds);
  fillSelect(field("plan.recompute"), presets.recompute);
  fillSelect(field("plan.precision"), Object.keys(presets.precisions));
  buildPlannerControls(presets);

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
