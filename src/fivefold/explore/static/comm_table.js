// Communication per GPU per step, grouped by link, exposed against overlapped.

import { $, el } from "./dom.js";
import { fmt } from "./format.js";

export const COMM_LABEL = {
  tp: "TP/SP collectives", dp: "DP gradient reduce", "zero-gather": "ZeRO param gather",
  pp: "PP send/receive", cp: "CP ring exchange", ep: "EP all-to-all",
};
export const LINK_LABEL = { nvlink: "NVLink · in a node", ib: "InfiniBand · across nodes" };
export function renderComm(est) {
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
