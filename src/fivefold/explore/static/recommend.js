// Recommend (the planner's search) and export (the TOML recipe).

import { api } from "./api.js";
import { $, el } from "./dom.js";
import { fmt } from "./format.js";
import { applyPlan, layoutRequest, searchRequest } from "./layout_request.js";
import { scheduleUpdate } from "./update.js";

export async function recommend() {
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

export async function exportRecipe() {
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
