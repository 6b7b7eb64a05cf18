"""The fivefold-eager runtime's activation peak on one rank: the walk along a pipeline rank's
action list, the gradients live at the peak, what a split backward keeps, and the
block-backward candidate of ZeRO-3 with full recompute.

Derivations: docs/planner.md, section 3, and docs/plan-check.md (the block backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fivefold.planner.memory.activations import (
    LayerTokens,
    eager_norm_bytes,
    eager_rope_bytes,
    layer_activation_bytes,
    layer_tokens,
)
from fivefold.planner.memory.levers import state_recipe
from fivefold.planner.memory.model_states import (
    chunk_params,
    chunk_state_bytes,
    compute_bytes,
    eager_state_recipe,
    embedding_params_per_rank,
    fp8_gather_saving,
    layer_params_per_rank,
    local_kv_width,
)
from fivefold.planner.memory.options import EAGER, MemoryOptions
from fivefold.planner.schedule.actions import build_schedule
from fivefold.specs.geometry import (
    chunk_rank,
    dense_shard_degree,
    expert_shard_degree,
    moe_token_split,
)
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe

# The forward's buffers that are free by the time a block runs its backward.
FORWARD_BUFFERS = ("logits", "ep_dispatch_buffers", "cp_kv_buffers")


@dataclass(frozen=True)
class AtTheLoss:
    """What `stage_memory` counts at the loss, which the backward's peak candidates compare
    against: the stage's layers per chunk (`counts`) and its other tenants in bytes (`other`,
    the forward's buffers among them)."""

    model: ModelSpec
    plan: ParallelPlan
    counts: list[int]
    opts: MemoryOptions
    other: dict[str, float]

    def forward_buffers_freed(self, layer: LayerTokens) -> float:
        """Bytes free by a block's backward: the forward's buffers and the final norm's."""
        return sum(self.other.get(n, 0.0) for n in FORWARD_BUFFERS) + eager_norm_bytes(layer)

    def head_grads(self) -> float:
        """Bytes of the head's and the final norm's unsharded gradients (compute dtype), made
        before any block's backward."""
        weight_bytes = compute_bytes(recipe(self.plan.precision))
        return (
            embedding_params_per_rank(self.model, self.plan.tp) + self.model.hidden
        ) * weight_bytes


def eager_blocks(opts: MemoryOptions) -> bool:
    """The blocks run eager and FSDP2-wrapped (fivefold's multi-process runtime, uncompiled)."""
    return opts.eager and opts.fsdp_wrapped and not opts.compiled


def has_block_backward_peak(model: ModelSpec, plan: ParallelPlan, opts: MemoryOptions) -> bool:
    """fivefold-eager, FSDP2 without a pipeline, full recompute in eager blocks, ZeRO-3 or
    (dense blocks, one micro-batch: each block reshards and reduces its gradients right after
    its backward) ZeRO-0/1/2: the peak may sit in a block's backward
    (`eager_block_backward_excess`) rather than at the loss."""
    eager = eager_blocks(opts)
    full = plan.recompute == "full" and opts.activation_model == "korthikanti"
    resharded = plan.zero == 3 or (plan.grad_accum == 1 and not model.is_moe)
    return eager and full and resharded and plan.pp * plan.vpp == 1


def eager_block_backward_excess(at: AtTheLoss) -> float:
    """Bytes by which the peak inside the backward of the second-to-last block exceeds the
    tensors `stage_memory` counts at the loss: at its recomputed MLP activation's backward (the
    block's saved tensors and gradients in flight, its gathered weights, the prefetched block
    before it, the reduce-scatter input of the block after it) or, with routed experts wrapped
    apart, at their gradient reduction (`_experts_reduce_bytes`); either with the head's
    gradient, less the forward's buffers, the final norm and the last block's input
    (`has_block_backward_peak`; derivation: docs/plan-check.md)."""
    model, plan, counts, opts = at.model, at.plan, at.counts, at.opts
    rec = recipe(plan.precision)
    layer = layer_tokens(model, plan)
    e, sb, rdiv, weight_bytes = layer.e, layer.sb, layer.rdiv, compute_bytes(rec)
    t, h, moe = plan.tp, model.hidden, model.is_moe
    behind = counts[-1] > 1  # a block ran its backward before this one, one waits before it
    freed = at.forward_buffers_freed(layer)
    if behind:
        layers = counts[-1]
        freed += layer_activation_bytes(model, plan, moe, opts)
        freed += eager_rope_bytes(model, plan, opts, layers)
        freed -= eager_rope_bytes(model, plan, opts, layers - 1)
    # MoE: whole experts on the rank's own 1/tp of the tokens (geometry's expert rule)
    width, copies = (model.expert_ffn / plan.etp, model.top_k) if moe else (model.ffn / t, 1)
    rows = sb / moe_token_split(plan) if moe else sb
    inputs = 2 if moe or model.mlp == "swiglu" else 1  # the activation's inputs (gate, up)
    # The block's recomputed tensors, the gradient reaching its output, and under MoE less the
    # k combined copies (their combine ran its backward).
    saved = layer_activation_bytes(model, plan, moe, opts, recompute="none")
    saved += e * sb * h / rdiv - (copies * e * rows * h if moe else 0.0)
    # The gradients of the down projection's input and of the activation's inputs are made
    # (1 + inputs), the down projection's input is freed (-1).
    block = saved + inputs * e * rows * width * copies
    block += h * width * (model.experts / plan.ep if moe else 1) * weight_bytes  # down proj.
    lp = layer_params_per_rank(model, moe, t, plan.ep, plan.etp)
    unit = lp.dense + lp.replicated  # the block's own FSDP unit (routed experts: their own)
    gathered = unit * weight_bytes - fp8_gather_saving(model, plan)
    units = gathered * (2 if behind else 1)  # this block's, and the prefetched one before it
    if plan.zero < 3:  # gathered for the step (the stage's parameters), less the block after
        units = -gathered if behind else 0.0
        units += _resharded_grads(plan, unit) if behind else 0.0
    at_activation = block + units + lp.experts * weight_bytes
    at_activation += unit * EAGER.fsdp_reduce_bytes if behind else 0.0
    at_reduce = 0.0
    if moe and (plan.ep > 1 or t > 1):  # routed experts are an FSDP unit of their own
        expert_saved = copies * EAGER.swiglu_saved * e * rows * width  # freed by their backward
        at_reduce = saved - expert_saved + units + _experts_reduce_bytes(plan, lp.experts, rec)
    return max(at_activation, at_reduce) + at.head_grads() - freed


def _resharded_grads(plan: ParallelPlan, unit: float) -> float:
    """The gradient shard FSDP2 makes for a block of `unit` parameters per rank when it reduces
    it after the block's backward (reduce dtype, 1/S of them)."""
    grad_bytes = eager_state_recipe(state_recipe(plan), plan).grad_bytes
    return unit * grad_bytes / dense_shard_degree(plan)


def eager_block_prebackward_excess(at: AtTheLoss) -> float:
    """Bytes by which the peak in the second-to-last block's backward (fivefold-eager, ZeRO-3
    without a pipeline, no full recompute, dense blocks) exceeds the tensors `stage_memory`
    counts at the loss: as FSDP2 gathers the block, its all-gather output and the
    per-parameter tensors it is copied out to (two gathered units), or in its MLP backward the
    block's gathered weights, the one before it prefetched and the MLP's gradients in flight;
    with either, the last block's reduce-scatter input (reduce dtype) and, with
    no accumulation, its new gradient shard, the head's and final norm's unsharded gradients
    and the gradient reaching the block's output, less the forward's buffers, the final norm
    and the last block's activations (its backward ran). 0 where it does not apply; a shallow
    model with a large vocabulary peaks here (docs/planner.md, section 3)."""
    model, plan, counts, opts = at.model, at.plan, at.counts, at.opts
    eager = eager_blocks(opts)
    if not eager or plan.zero != 3 or plan.pp * plan.vpp != 1 or plan.recompute == "full":
        return 0.0
    if counts[-1] < 2 or model.is_moe:
        return 0.0
    rec = recipe(plan.precision)
    layer = layer_tokens(model, plan)
    e, sb, rdiv, weight_bytes = layer.e, layer.sb, layer.rdiv, compute_bytes(rec)
    lp = layer_params_per_rank(model, False, plan.tp, plan.ep, plan.etp)
    unit = lp.dense + lp.replicated
    gathered = unit * weight_bytes - fp8_gather_saving(model, plan)
    # In the block's MLP backward (SwiGLU's `silu_mul`): the down projection's input gradient,
    # silu recomputed, its gradient and one product, less the down projection's input (the
    # activation's inputs + 1 of the rank's ffn width), and the down projection's weight
    # gradient; beside the block, the one before it prefetched (none before the first block).
    width = model.ffn / plan.tp
    inputs = 2 if model.mlp == "swiglu" else 1
    mlp = (inputs + 1) * e * sb * width + model.hidden * width * weight_bytes
    made = max(2 * gathered, gathered * min(2, counts[-1] - 1) + mlp)
    made += unit * EAGER.fsdp_reduce_bytes
    if plan.grad_accum == 1:  # with accumulation the shards are live already (grads_at_peak)
        made += _resharded_grads(plan, unit)
    made += at.head_grads()
    made += e * sb * model.hidden / rdiv
    freed = at.forward_buffers_freed(layer)
    freed += layer_activation_bytes(model, plan, False, opts)
    layers = counts[-1]
    freed += eager_rope_bytes(model, plan, opts, layers)
    freed -= eager_rope_bytes(model, plan, opts, layers - 1)
    return made - freed


def eager_experts_reduce_excess(at: AtTheLoss) -> float:
    """Bytes by which the peak while FSDP2 reduces the last block's routed experts (ZeRO-2/3
    without a pipeline or full recompute, the experts an FSDP unit of their own: its first
    gradient reduction of the backward, `_experts_reduce_bytes`) exceeds the tensors
    `stage_memory` counts at the loss: with the head's and final norm's unsharded gradients and
    the gradient reaching the block's output, less the forward's buffers, the final norm's
    tensors and the experts' saved tensors (their backward ran). 0 where it does not apply."""
    model, plan, opts = at.model, at.plan, at.opts
    wrapped_apart = model.is_moe and (plan.ep > 1 or plan.tp > 1)
    last_is_moe = wrapped_apart and model.layers - 1 >= model.dense_layers
    if not last_is_moe or keeps_unsharded_grads(plan, opts) or plan.recompute == "full":
        return 0.0
    rec = recipe(plan.precision)
    layer = layer_tokens(model, plan, moe=True)
    e, sb, rdiv = layer.e, layer.sb, layer.rdiv
    t, h = plan.tp, model.hidden
    rows, width = sb / moe_token_split(plan), model.expert_ffn / plan.etp
    freed = at.forward_buffers_freed(layer)
    freed += model.top_k * e * rows * (EAGER.swiglu_saved * width + h)  # and combined copies
    lp = layer_params_per_rank(model, True, t, plan.ep, plan.etp)
    made = _experts_reduce_bytes(plan, lp.experts, rec) + at.head_grads() + e * sb * h / rdiv
    return made - freed


def _experts_reduce_bytes(plan: ParallelPlan, experts: float, rec) -> float:
    """FSDP2's transient while it reduces a block's `experts` (parameters on the rank before
    ZeRO): its reduce-dtype input (all of them), beside the unsharded gradients while they are
    copied in, then beside its output (1/n of them over the n ranks of the expert ZeRO group),
    and on one rank a third copy (`EagerProfile.fsdp_single_rank_divide_copy`). The gathered
    experts are resharded and the block after's reduce-scatter input released before it."""
    n = expert_shard_degree(plan)
    reduce = EAGER.fsdp_reduce_bytes
    after = reduce * (1 + 1 / n)
    if n == 1 and EAGER.fsdp_single_rank_divide_copy:
        after += reduce
    return experts * max(compute_bytes(rec) + reduce, after)


def eager_peak_activations(
    plan: ParallelPlan,
    rank: int,
    chunks: list[int],
    per_chunk: list[float],
    grads: list[float] | None = None,
    retained: list[float] | None = None,
    boundary: float = 0.0,
) -> tuple[float, tuple[int, ...]]:
    """fivefold-eager: (peak activation bytes of pipeline rank `rank`, the chunks whose
    gradients exist at that peak). Without a pipeline: one micro-batch, after grad_accum - 1
    backwards. In a pipeline, the rank's action list is walked (`_walk`) with each
    (micro-batch, chunk) weighing its own chunk's bytes (chunks of one rank may hold different
    layer counts); a chunk's gradients exist at the peak when it had a weight-gradient action
    before it; the peak is that of the activations plus the `grads` (per chunk) of the chunks
    that have them (never in GPipe). `retained`: per chunk, what a split input-gradient
    backward keeps for its weight-gradient action (`split_backward_bytes`); `boundary`: bytes
    of one stage-boundary tensor (a micro-batch's hidden states or their gradient,
    `pipeline_boundary_bytes`)."""
    if plan.pp == 1:
        return max(per_chunk), tuple(chunks) if plan.grad_accum > 1 else ()
    last = plan.pp * plan.vpp - 1
    kept = retained or [0.0] * len(chunks)
    grads = grads or [0.0] * len(chunks)
    table = []
    for c, acts, keep, grad in zip(chunks, per_chunk, kept, grads, strict=True):
        remote_next = c < last and chunk_rank(plan.schedule, plan.pp, c + 1) != rank
        remote_prev = c > 0 and chunk_rank(plan.schedule, plan.pp, c - 1) != rank
        slot = boundary if c > 0 else 0.0
        sent_out = boundary if remote_next else 0.0
        sent_grad = boundary if remote_prev else 0.0
        table.append((c, acts, keep, slot, sent_out, sent_grad, grad))
    return _walk(plan.schedule, plan.pp, plan.vpp, plan.grad_accum, rank, tuple(table))


@lru_cache(maxsize=4096)
def _walk(
    name: str, pp: int, vpp: int, m: int, rank: int, table: tuple
) -> tuple[float, tuple[int, ...]]:
    """The rank's activation peak along its action list. Per chunk, `table` holds (chunk,
    activations, kept by a split input-gradient backward, receive slot, sent output, sent input
    gradient, its gradients once allocated) in bytes, the mechanisms of torch's stages:

    - F adds the chunk's activations; its input is the micro-batch's receive slot, counted
      apart (`pipeline_slot_bytes`), so not twice; an output sent to another rank stays
      referenced by the schedule's pending sends until the step ends;
    - a split input-gradient B adds what it keeps for W; an input gradient sent to another rank
      is the receive buffer's `.grad`, kept until the next step clears it;
    - the release (W, or the full backward: B, or dualpipev's "B" right before the "W" of the
      same micro-batch and chunk) frees the activations and what B kept, but not the slot."""
    schedule = build_schedule(name, pp, vpp, m)
    split = schedule.split_backward
    release = "W" if split else "B"
    rows = {row[0]: row[1:] for row in table}
    actions = schedule.actions[rank]
    alive, best, acts, with_grads, graded = 0.0, -1.0, 0.0, (), set()
    pending: dict[tuple[int, int], float] = {}  # what each B kept, until its W
    for i, action in enumerate(actions):
        a, keep, slot, sent_out, sent_grad, _ = rows[action.chunk]
        key = (action.microbatch, action.chunk)
        if action.kind == "F":
            alive += a - slot + sent_out
        elif action.kind == "B":
            nxt = actions[i + 1] if i + 1 < len(actions) else None
            # dualpipev writes its full backwards as a "B" right before the "W" of the same
            # micro-batch and chunk (`fivefold.planner.schedule.actions`); zbv's are all split.
            full = name == "dualpipev" and nxt is not None and nxt[1:] == action[1:]
            full = full and nxt.kind == "W"
            pending[key] = 0.0 if full or not split else keep
            alive += sent_grad + pending[key]
        if action.kind in ("F", "B"):
            total = alive + sum(rows[c][-1] for c in graded)
            if total >= best - 1e-6:  # the last time the peak is reached counts
                best, acts, with_grads = max(best, total), alive, tuple(sorted(graded))
        if action.kind == release:
            alive -= a - slot + pending.pop(key, 0.0)
            graded.add(action.chunk)
    return acts, with_grads


def keeps_unsharded_grads(plan: ParallelPlan, opts: MemoryOptions) -> bool:
    """fivefold-eager: whether the gradients accumulate unsharded across micro-batches (no
    FSDP, ZeRO-0/1, or any stage under pipelining: torch's pipeline stages skip FSDP2's
    reduce-scatter until the last micro-batch); ZeRO-2/3 otherwise reduce-scatter each one."""
    return not opts.fsdp_wrapped or plan.zero <= 1 or plan.pp > 1


def eager_accumulated_grads(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int, opts: MemoryOptions
) -> float:
    """fivefold-eager: the gradient bytes virtual stage `chunk` holds once its first backward
    has run: the sharded gradients, or, where they accumulate unsharded
    (`keeps_unsharded_grads`), the chunk's local parameters in the gradient dtype (the
    vocab-parallel embedding's V/t x h: `fivefold.parallel.tensor_parallel`)."""
    state = chunk_state_bytes(model, plan, counts, chunk, eager=True)
    if not keeps_unsharded_grads(plan, opts):
        return state.grads
    grad_bytes = eager_state_recipe(state_recipe(plan), plan).grad_bytes
    cp = chunk_params(model, plan, counts, chunk)
    return (cp.dense + cp.experts) * grad_bytes


def split_backward_bytes(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int, e: float
) -> float:
    """fivefold-eager, zbv/dualpipev: what one micro-batch's input-gradient backward of virtual
    stage `chunk` keeps for its weight-gradient backward. torch's `stage_backward_input` holds the
    gradient of every weight's output (read by `stage_backward_weight`): per layer Q, K, V
    (q + 2k)/t, the attention and MLP outputs (h each, region /tp under SP), SwiGLU's gate and
    up (2f/t) and the two RMSNorm outputs (2h); no MoE layers (dense only here)."""
    t, layer = plan.tp, layer_tokens(model, plan)
    per_layer = model.q_width / t + 2 * local_kv_width(model, t) + 2 * model.ffn / t
    per_layer += 4 * model.hidden / layer.rdiv
    return counts[chunk] * e * layer.sb * per_layer
