"""Memory per GPU, per pipeline rank: the four tenants (parameters, gradients, optimizer state,
activations) and the named other terms summed into `StageMemory`, in bytes (GiB only at the
edges), for one rank (`stage_memory`) or every rank of a plan (`all_stage_memory`).

Derivations: docs/planner.md, section 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from fivefold.errors import ConfigError
from fivefold.planner.memory.activations import (
    chunk_activation_bytes,
    layer_activation_bytes,
    pipeline_boundary_bytes,
)
from fivefold.planner.memory.buffers import other_terms
from fivefold.planner.memory.eager import (
    AtTheLoss,
    eager_accumulated_grads,
    eager_block_backward_excess,
    eager_block_prebackward_excess,
    eager_experts_reduce_excess,
    eager_peak_activations,
    has_block_backward_peak,
    split_backward_bytes,
)
from fivefold.planner.memory.model_states import Tenants, chunk_state
from fivefold.planner.memory.options import MemoryOptions
from fivefold.specs.geometry import chunks_of_rank
from fivefold.specs.model import ModelSpec
from fivefold.specs.partition import stage_layer_counts
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe
from fivefold.units import GiB


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one pipeline rank: the four tenants and the named "other" terms."""

    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    other_terms: dict[str, float] = field(default_factory=dict)
    # fivefold-eager: the share of the gradient bytes live at the activation peak, those of
    # the chunks that ran a backward of the step before it (FSDP2 allocates them then; above 1
    # where they accumulate unsharded while the state shards them, `eager_accumulated_grads`); the
    # optimizer step is a second candidate peak (parameters, gradients and state, activations
    # freed).
    grads_at_peak: float = 1.0
    optimizer_phase: float = 0.0
    host_bytes: float = 0.0  # model state offloaded to host memory (`levers`), not in `total`

    @property
    def other(self) -> float:
        return sum(self.other_terms.values())

    @property
    def total(self) -> float:
        grads = self.grads * self.grads_at_peak
        during = self.params + grads + self.optimizer + self.activations + self.other
        return max(during, self.optimizer_phase)

    def gib(self) -> dict[str, float]:
        """The summary in GiB with the stable key names of `fivefold plan --json`."""
        return {
            "params": self.params / GiB,
            "grads": self.grads / GiB,
            "optimizer": self.optimizer / GiB,
            "activations": self.activations / GiB,
            "other": self.other / GiB,
            "total": self.total / GiB,
        }

    def other_gib(self) -> dict[str, float]:
        return {k: v / GiB for k, v in self.other_terms.items()}


def stage_memory(
    model: ModelSpec,
    plan: ParallelPlan,
    rank: int,
    inflight: int,
    options: MemoryOptions | None = None,
    counts: list[int] | None = None,
) -> StageMemory:
    """Memory of pipeline rank `rank` holding `inflight` micro-batches of chunk activations."""
    opts = options or MemoryOptions()
    problems = opts.problems()
    if problems:
        raise ConfigError(problems)
    counts = counts or stage_layer_counts(model, plan.pp * plan.vpp)
    chunks = list(chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank))
    state = Tenants(0.0, 0.0, 0.0)
    host = 0.0
    for c in chunks:
        on_device, on_host = chunk_state(model, plan, counts, c, opts.eager, opts.optimizer)
        state, host = state + on_device, host + on_host
    per_chunk = [chunk_activation_bytes(model, plan, counts, c, opts) for c in chunks]
    acts = max(per_chunk) * inflight
    grads_at_peak = 1.0
    if opts.eager:
        e = recipe(plan.precision).activation_bytes
        kept = [split_backward_bytes(model, plan, counts, c, e) for c in chunks]
        grads = [eager_accumulated_grads(model, plan, counts, c, opts) for c in chunks]
        boundary = pipeline_boundary_bytes(model, plan)
        acts, with_grads = eager_peak_activations(
            plan, rank, chunks, per_chunk, grads, kept, boundary
        )
        # FSDP2 allocates a chunk's gradients in its first weight-gradient backward.
        live = sum(g for c, g in zip(chunks, grads, strict=True) if c in with_grads)
        grads_at_peak = live / state.grads if state.grads else 0.0
    other = other_terms(model, plan, counts, chunks, opts, inflight)
    at_loss = AtTheLoss(model, plan, counts, opts, other)
    if plan.recompute == "full" and opts.activation_model == "korthikanti":
        working = layer_activation_bytes(model, plan, model.is_moe, opts, recompute="none")
        if opts.eager and len(counts) - 1 in chunks:
            # The last layer is recomputed after the loss's backward has freed the logits.
            working = max(0.0, working - other.get("logits", 0.0))
        if has_block_backward_peak(model, plan, opts):
            working = max(working, eager_block_backward_excess(at_loss))
        acts += working
    if opts.eager and len(counts) - 1 in chunks:
        acts += max(0.0, eager_experts_reduce_excess(at_loss))
        acts += max(0.0, eager_block_prebackward_excess(at_loss))
    if not opts.eager:
        tensors = state.total + acts + sum(other.values())
        other["fragmentation"] = opts.fragmentation_fraction * tensors
        return StageMemory(
            rank, state.params, state.grads, state.optimizer, acts, other, host_bytes=host
        )
    at_rest = other.get("fsdp_param_shards", state.params)  # the weights between steps
    rest = at_rest + state.grads + state.optimizer
    tensors = state.total + acts + sum(other.values()) - (1 - grads_at_peak) * state.grads
    other["fragmentation"] = opts.fragmentation_fraction * max(tensors, rest)
    return StageMemory(
        rank,
        state.params,
        state.grads,
        state.optimizer,
        acts,
        other,
        grads_at_peak,
        rest * (1 + opts.fragmentation_fraction) + opts.cuda_context_bytes,
        host,
    )


def memory_key(plan: ParallelPlan) -> ParallelPlan:
    """The plan with the fields stage memory does not depend on reset (a cache key): the
    micro-batch count enters only through the in-flight count, dp_replicate only through
    whether there is data parallelism at all."""
    return replace(plan, grad_accum=1, dp_replicate=min(plan.dp_replicate, 2))


@lru_cache(maxsize=65536)
def _cached_stage_memory(model, key, rank, inflight, options, counts) -> StageMemory:
    return stage_memory(model, key, rank, inflight, options, list(counts))


def rank_signature(plan: ParallelPlan, counts: tuple[int, ...], rank: int) -> tuple:
    """What a rank's costs depend on: per chunk, its layer count and whether it is the first or
    the last virtual stage. Ranks with equal signatures hold equal work and memory."""
    last = len(counts) - 1
    chunks = chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank)
    return tuple((counts[c], c == 0, c == last) for c in chunks)


def all_stage_memory(
    model: ModelSpec,
    plan: ParallelPlan,
    inflight: list[int] | tuple[int, ...],
    options: MemoryOptions | None = None,
    ranks: tuple[int, ...] | None = None,
) -> list[StageMemory]:
    """Memory of every pipeline rank (or of `ranks`) given the peak in-flight micro-batches
    per rank."""
    opts = options or MemoryOptions()
    counts = tuple(stage_layer_counts(model, plan.pp * plan.vpp))
    key = memory_key(plan)
    if opts.eager:  # whether gradients are live at the peak depends on the micro-batch count
        key = replace(key, grad_accum=plan.grad_accum)
    first_rank: dict[tuple, int] = {}
    out = []
    for r in range(plan.pp) if ranks is None else ranks:
        sig = (rank_signature(plan, counts, r), int(inflight[r]))
        if model.is_moe or opts.eager:  # MoE: layers differ by position; eager: by schedule
            sig = (sig, r)
        rep = first_rank.setdefault(sig, r)
        mem = _cached_stage_memory(model, key, rep, int(inflight[r]), opts, counts)
        out.append(mem if rep == r else replace(mem, stage=r))
    return out
