// The rank grid: every GPU by node, coloured by its group on one mesh axis.

import { $, svg } from "./dom.js";
import { state } from "./state.js";

export const GROUP_LABEL = { tp: "TP", pp: "PP", dp: "DP", cp: "CP", ep: "EP" };
export const MAX_GRID_CELLS = 4096;
export function groupColour(id, count) {
  if (count <= 1) return "#a7b8d6";
  const hue = (id * 137.508 + 210) % 360;
  const light = 58 + (id % 3) * 8;
  return `hsl(${hue.toFixed(1)}, 55%, ${light}%)`;
}
export function renderRanks(ranks) {
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

/** The rank's coordinate on each mesh axis, outer to inner in the server's mesh order
 * (dp_replicate and dp_shard together as "dp r/s"). */
function meshCoords(coords, rank) {
  const parts = [];
  for (const axis of state.presets.mesh_order) {
    if (axis === "dp_shard") continue;
    if (axis === "dp_replicate") parts.push(`dp ${coords.dp_replicate[rank]}/${coords.dp_shard[rank]}`);
    else parts.push(`${axis} ${coords[axis][rank]}`);
  }
  return parts.join(" · ");
}

export function showRankInfo(ranks, rank) {
  const members = (axis) => {
    const out = [];
    const gid = ranks.groups[axis][rank];
    for (let r = 0; r < ranks.world_size && out.length < 9; r++) if (ranks.groups[axis][r] === gid) out.push(r);
    return out.length > 8 ? `${out.slice(0, 8).join(",")},…` : out.join(",");
  };
  $("#rank-info").textContent = `rank ${rank} on node ${ranks.node[rank]} · ${meshCoords(ranks.coords, rank)}\n` +
    `${GROUP_LABEL[state.colourBy]} group ${ranks.groups[state.colourBy][rank]}: ranks ${members(state.colourBy)}`;
}
