"""The named buffers of one pipeline rank beyond the four tenants (`StageMemory.other_terms`):
CUDA context, logits and loss, gathered ZeRO-3 layers, DP buckets, pipeline slots, SP, CP and
EP buffers; fragmentation is added on top by `stage_memory`.

Derivations: docs/planner.md, section 3 ("Other terms").
"""

from __future__ import annotations

from fivefold.planner.memory.activations import eager_head_loss_bytes, pipeline_boundary_bytes
from fivefold.planner.memory.levers import resting_param_bytes
from fivefold.planner.memory.model_states import (
    chunk_layers,
    chunk_params,
    compute_bytes,
    fp8_gather_saving,
    local_kv_width,
    params_of,
)
from fivefold.planner.memory.options import MemoryOptions
from fivefold.specs.geometry import (
    V_SHAPED,
    dense_shard_degree,
    expert_shard_degree,
    rank_tokens,
)
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe


def other_terms(
    model: ModelSpec,
    plan: ParallelPlan,
    counts: list[int],
    chunks: list[int],
    opts: MemoryOptions,
    inflight: int = 1,
) -> dict[str, float]:
    """Named buffers of one pipeline rank holding `chunks` with `inflight` micro-batches, in
    bytes (fragmentation excluded)."""
    rec = recipe(plan.precision)
    e = rec.activation_bytes
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    out = {"cuda_context": float(opts.cuda_context_bytes)}
    last = len(counts) - 1
    if last in chunks:
        # Fused kernels: every micro-batch in flight on the last stage keeps its fp32
        # log-softmax (4 bytes per logit); the one in its backward also holds the two fp32
        # gradients (docs/planner.md). fivefold's runtime: `eager_head_loss_bytes`. GPipe has
        # all m in flight there; the other schedules run the last stage's backward right after
        # its forward.
        waiting = inflight - 1 if plan.schedule == "gpipe" and plan.pp > 1 else 0
        if opts.eager:  # fivefold's runtime: the head inside the loss, its tensors
            out["logits"] = eager_head_loss_bytes(model, plan, max(0, waiting))
        else:
            per_logit = opts.logits_bytes_per_element + 4 * max(0, waiting)
            out["logits"] = tokens * model.vocab / plan.tp * per_logit
    if opts.eager and plan.pp > 1:
        # torch.distributed.pipelining keeps each in-flight micro-batch's stage output until its
        # backward: the last stage's final hidden states (the head runs in the loss; the other
        # stages' outputs are walked, `_walk`), and per micro-batch a receive slot for the
        # stage input of every chunk but the first (allocated at the first step, or holding
        # the last step's hand-over from a chunk on the same rank); the output gradient's
        # receive slot of every chunk but the last holds memory only from its receive to the
        # end of its backward, one per chunk (`fivefold.parallel.pipeline._grad_buffers`),
        # except in the V-shaped schedules, which keep one per micro-batch.
        if last in chunks:
            out["pipeline_stage_outputs"] = pipeline_boundary_bytes(model, plan) * (
                inflight_of_output(plan, inflight)
            )
        grad_slots = plan.grad_accum if plan.schedule in V_SHAPED else 1
        slots = sum((c > 0) * plan.grad_accum + (c < last) * grad_slots for c in chunks)
        out["pipeline_slots"] = slots * pipeline_boundary_bytes(model, plan)
    if opts.eager:
        if opts.fsdp_wrapped:
            out.update(_fsdp_terms(model, plan, counts, chunks, rec))
    elif plan.zero == 3:
        largest = max(chunk_params(model, plan, counts, c).max_layer for c in chunks)
        gathered = largest * compute_bytes(rec) - fp8_gather_saving(model, plan)
        out["zero3_gathered_layers"] = 2 * gathered + largest * rec.grad_bytes
    elif plan.dp * plan.cp > 1:
        out["dp_grad_buckets"] = 2 * opts.dp_bucket_bytes
    if plan.offload == "all":  # FSDP2 offload: the shards crossing PCIe (`levers`)
        largest = max(chunk_params(model, plan, counts, c).max_layer for c in chunks)
        shard = largest / dense_shard_degree(plan)
        out["offload_staging"] = shard * (2 * resting_param_bytes(rec) + rec.grad_bytes)
    if plan.sp and plan.tp > 1 and not opts.eager:  # eager: counted per layer
        out["sp_gathered_input"] = e * tokens * model.hidden
    if plan.cp > 1:
        out["cp_kv_buffers"] = 2 * e * tokens * 2 * local_kv_width(model, plan.tp)
    if model.is_moe and plan.ep > 1:
        out["ep_dispatch_buffers"] = 2 * e * tokens * model.top_k * model.hidden
    return out


def inflight_of_output(plan: ParallelPlan, inflight: int) -> int:
    """Micro-batches whose last-stage output waits for its backward: all of GPipe's, one in the
    schedules that run the last stage's backward right after its forward."""
    return inflight if plan.schedule == "gpipe" else 1


def _fsdp_terms(model, plan, counts, chunks, rec) -> dict[str, float]:
    """fivefold's runtime wraps every chunk in FSDP2 (`replicate` for ZeRO-0), whatever the
    data-parallel degree: there are no DDP buckets. ZeRO-3 keeps the chunk roots' parameters
    (embedding, final norm, head: not re-sharded after forward) gathered through the step; the
    blocks' are gathered one at a time and freed before the loss's backward. ZeRO-0/1/2 gather
    every parameter once per step; with an fp32 compute dtype that gathered copy is the
    recipe's parameter tenant and the sharded fp32 weights at rest come on top, the routed
    experts' sharded over their own data-parallel group (`expert_shard_degree`; bf16 recipes:
    the shards are the fp32 master copy, already an optimizer tenant). ZeRO-3
    under pipelining keeps whole chunks gathered for the step (their unsharded gradients are
    the gradients at the peak, `eager_accumulated_grads`)."""
    out: dict[str, float] = {}
    if plan.zero == 3 and plan.pp > 1:
        # torch's pipeline stages keep each chunk gathered from its first forward to the end of
        # the step (and skip the gradient reduce-scatter until the last micro-batch, so the
        # gradients they hold are unsharded: `eager_accumulated_grads`).
        local = sum(
            chunk_params(model, plan, counts, c).dense
            + chunk_params(model, plan, counts, c).experts
            for c in chunks
        )
        out["zero3_gathered_chunks"] = local * compute_bytes(rec)
    elif plan.zero == 3:
        root = 0.0
        for c in chunks:
            cp = chunk_params(model, plan, counts, c)
            n_dense, n_moe = chunk_layers(model, counts, c)
            layers = params_of(
                model, plan.tp, plan.ep, n_dense, n_moe, False, False, False, plan.etp
            )
            root += cp.dense + cp.experts - layers.dense - layers.experts
        out["zero3_gathered_roots"] = root * compute_bytes(rec)
    elif rec.compute_dtype == "fp32":
        zero = plan.zero >= 1
        dense_shard = dense_shard_degree(plan) if zero else 1
        expert_shard = expert_shard_degree(plan) if zero else 1
        held = [chunk_params(model, plan, counts, c) for c in chunks]
        shards = sum(cp.dense / dense_shard + cp.experts / expert_shard for cp in held)
        out["fsdp_param_shards"] = shards * rec.param_bytes
    return out
