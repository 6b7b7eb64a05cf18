// The form as a request (model, cluster, plan, batch), and presets or a plan put back into it.

import { field, readField, writeField } from "./controls.js";
import { $ } from "./dom.js";
import { plannerRequest } from "./planner_table.js";
import { state } from "./state.js";

export const MODEL_DIMS = [
  "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "mlp", "tied_embeddings",
  "experts", "top_k", "expert_ffn", "shared_experts", "dense_layers",
];
export const BATCH_MODEL_FIELDS = ["model.seq_len", "model.doc_len"]; // not the model's dimensions
export const HIDDEN_MODEL_FIELDS = ["norm_eps", "rope_theta", "router_aux_loss_coef"];
export const CLUSTER_FIELDS = ["gpu", "nodes", "gpus_per_node", "intra_node_bw", "inter_node_bw"];
export const PLAN_FIELDS = [
  "tp", "sp", "pp", "schedule", "vpp", "dp_replicate", "dp_shard", "zero", "cp", "cp_kind", "ep",
  "micro_batch", "recompute", "precision",
];

/** The request body for /api/estimate and /api/recipe, in the spec's own field names. */
export function layoutRequest() {
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

export function searchRequest() {
  const body = layoutRequest();
  return {
    model: body.model, cluster: body.cluster, global_batch: body.global_batch, top: 5,
    precisions: [body.plan.precision], planner: body.planner, problems: body.problems,
  };
}

/** The pasted Hugging Face config.json: {config} when there is one, {problem} when it is not a
 * JSON object, {} when the box is empty. */
export function hfConfig() {
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

export function applyModelPreset(name) {
  const m = state.presets.models[name];
  if (!m) return;
  state.modelBase = Object.fromEntries(HIDDEN_MODEL_FIELDS.map((k) => [k, m[k]]));
  for (const dim of MODEL_DIMS) writeField(`model.${dim}`, m[dim]);
  writeField("model.seq_len", m.seq_len);
  writeField("model.doc_len", m.doc_len || 0);
}

export function applyClusterPreset(name) {
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
export function applyPlan(plan) {
  for (const f of PLAN_FIELDS) writeField(`plan.${f}`, plan[f]);
  writeField("global_batch", plan.micro_batch * plan.dp_replicate * plan.dp_shard * plan.grad_accum);
}
