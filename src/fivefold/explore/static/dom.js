// Small DOM and SVG helpers: find, make, label and fill elements; chart axis steps.

export const SVG_NS = "http://www.w3.org/2000/svg";
export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

export function el(tag, attrs = {}, parent = null, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

export function svg(tag, attrs = {}, parent = null, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

export function titled(node, text) { svg("title", {}, node, text); return node; }

export function setValue(id, value, text) {
  const node = document.getElementById(id);
  node.textContent = text;
  if (value === null || value === undefined) node.removeAttribute("data-value");
  else node.dataset.value = String(value);
}

export function niceStep(span, target) {
  const raw = span / Math.max(1, target);
  const mag = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
  return 10 * mag;
}
export function legend(container, entries) {
  container.textContent = "";
  for (const [colour, label] of entries) {
    const item = el("span", {}, container);
    el("span", { class: "swatch" }, item).style.background = colour;
    item.appendChild(document.createTextNode(label));
  }
}
