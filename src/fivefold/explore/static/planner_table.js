// The planner table: its option controls and profiles, the request's planner part, and the
// planner and token-budget facts of an answer.

import { field, fillSelect, readField, writeField } from "./controls.js";
import { $, el } from "./dom.js";
import { fmt } from "./format.js";
import { state } from "./state.js";

// Planner options shown in MiB (the API takes bytes, as PlannerOptions does).
export const PLANNER_MIB = ["dp_bucket_bytes", "cuda_context_bytes"];

/** One control per planner option, from /api/presets (its help as the tooltip). */
export function buildPlannerControls(presets) {
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
export function applyProfile(name) {
  const profile = state.presets.profiles[name];
  if (!profile) return;
  for (const [key, o] of Object.entries(state.presets.planner_options)) {
    const own = !profile.options ? o.default : key in profile.options ? profile.options[key] : o.base;
    writeField(`planner.${key}`, own);
  }
}

/** The request's planner table: the profile and every option as the controls show it. */
export function plannerRequest() {
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
export function readMixture(text) {
  return text.split(",").map((s) => s.trim()).filter(Boolean).map((entry) => {
    const [name, rest = ""] = entry.split("=");
    const [weight, tokens] = rest.split(":");
    const table = { name: name.trim(), weight: Number(weight) };
    if (tokens !== undefined && tokens.trim() !== "") table.tokens = Number(tokens);
    return table;
  });
}

/** Tokens and epochs per source of the mixture, as `fivefold plan` prints them. */
export function mixtureText(sources) {
  if (!sources || !sources.length) return "";
  return " Data: " + sources.map((s) => `${s.name} ${fmt.int(s.tokens)} tokens` +
    (s.epochs === null ? "" : ` (${s.epochs.toFixed(2)} epochs` +
      (s.epochs > s.max_epochs ? `, over ${s.max_epochs}: repeated too often` : "") + ")")).join("; ") + ".";
}

// The token-budget fields of the planner table (fivefold.planner.budget.token_budget); empty =
// not sent.
export const BUDGET_FIELDS = ["tokens", "gpu_hour_price"];

/** The token-budget answer (days, GPU-hours, cost, failures, checkpoint interval, goodput). */
export function renderBudget(b) {
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

export function renderPlanner(planner) {
  const node = $("#planner-facts");
  if (!planner) { node.textContent = ""; return; }
  const summary = state.presets.profiles[planner.profile]?.summary || "";
  node.textContent = `${planner.profile}: ${summary}.` +
    (planner.notes.length ? ` Replaced: ${planner.notes.join("; ")}.` : "");
  node.dataset.profile = planner.profile;
}
