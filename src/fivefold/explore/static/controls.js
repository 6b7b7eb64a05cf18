// Reading and writing the form's controls (numbers scaled, checkboxes, selects).

import { el } from "./dom.js";

export function field(name) { return document.querySelector(`[name="${name}"]`); }

export function readField(input) {
  if (input.type === "checkbox") return input.checked;
  const raw = input.value.trim();
  if (input.tagName === "SELECT" && !/^-?\d+$/.test(raw)) return raw;
  if (raw === "") return null;
  let num = Number(raw);
  if (!Number.isFinite(num)) return raw;
  if (input.dataset.scale) num *= Number(input.dataset.scale);
  return num;
}

export function writeField(name, value) {
  const input = field(name);
  if (!input) return;
  if (input.type === "checkbox") input.checked = Boolean(value);
  else if (input.dataset.scale) input.value = String(value / Number(input.dataset.scale));
  else input.value = String(value);
}
export function fillSelect(select, options, labels = {}) {
  select.textContent = "";
  for (const value of options) el("option", { value }, select, labels[value] || value);
}
