"""Parameters, gradients and optimizer state per GPU: the parameters each rank holds per layer
and per virtual stage (after TP, EP and the pipeline split), in bytes from the precision recipe
and divided by the ZeRO degree (Rajbhandari et al. 2020), with the plan's memory levers.

Derivations: docs/planner.md, section 3 ("Model state").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from fivefold.errors import ConfigError
from fivefold.planner.memory.levers import (
    fp8_linear_params,
    gathers_fp8,
    master_bytes,
    split_state,
    state_recipe,
)
from fivefold.planner.memory.options import EAGER
from fivefold.specs.geometry import dense_shard_degree, expert_shard_degree
from fivefold.specs.model import (
    ModelSpec,
    attention_extra_params,
    attention_params,
    dense_mlp_params,
    expert_params,
)
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import PrecisionRecipe, recipe

MUON_SAVED_BYTES = 4.0  # per Muon parameter: Adam's second fp32 moment, which Muon does not keep


@dataclass(frozen=True)
class Tenants:
    """Bytes per GPU of the four tenants."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def __add__(self, other: Tenants) -> Tenants:
        return Tenants(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.activations + other.activations,
        )


def zero_divisors(zero: int, shard: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) divisors for ZeRO stage `zero` over `shard` ranks."""
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"plan.zero = {zero!r}: ZeRO stage must be 0, 1, 2 or 3.")
    if shard < 1:
        raise ConfigError(f"ZeRO sharding degree = {shard}: must be >= 1.")
    return (shard if zero >= 3 else 1, shard if zero >= 2 else 1, shard if zero >= 1 else 1)


def model_state_bytes(
    n_params: float, precision: PrecisionRecipe | str, zero: int = 0, shard: int = 1
) -> Tenants:
    """Parameter, gradient and optimizer bytes per GPU for `n_params` parameters held by a group
    of `shard` ranks with ZeRO stage `zero` (Rajbhandari et al. 2020)."""
    if n_params < 0:
        raise ConfigError(f"parameter count = {n_params}: must be >= 0.")
    rec = recipe(precision) if isinstance(precision, str) else precision
    dp, dg, do = zero_divisors(zero, shard)
    return Tenants(
        n_params * rec.param_bytes / dp,
        n_params * rec.grad_bytes / dg,
        n_params * rec.optimizer_bytes / do,
    )


@dataclass(frozen=True)
class LayerParams:
    """Parameters one rank holds for one layer: `dense` (TP-sharded matrices), `replicated`
    (norms, router) and `experts` (routed experts after EP and TP)."""

    dense: float
    replicated: float
    experts: float

    @property
    def total(self) -> float:
        return self.dense + self.replicated + self.experts


def local_kv_width(model: ModelSpec, tp: int) -> float:
    """Key (or value) width per TP rank: kv heads split by tp, one replicated head when tp
    exceeds them (MLA: the mean of a key and a value head, `ModelSpec.kv_head_width`)."""
    return max(model.kv_heads / tp, 1.0) * model.kv_head_width


def attention_params_per_rank(model: ModelSpec, tp: int) -> tuple[float, float]:
    """(TP-sharded, replicated) attention parameters of one layer on one TP rank: Q and O split
    by heads, K and V by kv heads (one replicated head when tp exceeds them); with MLA the
    per-head up projections and O split, the down projections (query and key/value latents)
    replicated. Q/K/V biases split with their weights (`fivefold.parallel.tensor_parallel`);
    norms replicated."""
    h = model.hidden
    extra = attention_extra_params(model)
    if model.is_mla:
        down = model.hidden * (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim)
        return (attention_params(model) - down) / tp, down + extra
    attn = attention_params(model) - 2 * h * model.kv_width  # wq and wo
    kv = local_kv_width(model, tp)
    bias = model.q_width / tp + 2 * kv if model.qkv_bias else 0.0
    norms = extra - (model.q_width + 2 * model.kv_width if model.qkv_bias else 0)
    return attn / tp + 2 * h * kv + bias, float(norms)


def layer_params_per_rank(
    model: ModelSpec, moe: bool, tp: int, ep: int, etp: int = 1
) -> LayerParams:
    """One layer's parameters on one rank; routed experts whole (`etp` 1, geometry's expert
    rule) or split over `etp` TP ranks (Megatron's expert tensor parallelism)."""
    h = model.hidden
    attn, replicated = attention_params_per_rank(model, tp)
    norms = 2 * h + replicated
    if not moe:
        return LayerParams(attn + dense_mlp_params(model) / tp, norms, 0.0)
    shared = model.shared_experts * expert_params(model) / tp
    routed = model.experts / ep * expert_params(model) / etp
    return LayerParams(attn + shared, norms + h * model.experts, routed)


def muon_params_per_rank(model: ModelSpec, moe: bool, tp: int) -> float:
    """Parameters of one layer's Muon matrices on one TP rank (`layer_params_per_rank`'s
    TP-sharded matrices plus the replicated router)."""
    lp = layer_params_per_rank(model, moe, tp, 1)
    return lp.dense + (model.hidden * model.experts if moe else 0.0)


def stage_muon_params(model: ModelSpec, tp: int, n_dense: int, n_moe: int) -> float:
    """Muon parameters one TP rank holds for `n_dense` dense and `n_moe` MoE layers."""
    out = n_dense * muon_params_per_rank(model, False, tp)
    return out + (n_moe * muon_params_per_rank(model, True, tp) if n_moe else 0.0)


def embedding_params_per_rank(model: ModelSpec, tp: int) -> float:
    return model.vocab * model.hidden / tp


def head_params_per_rank(model: ModelSpec, tp: int, pipelined: bool) -> tuple[float, float]:
    """(TP-sharded LM head, replicated final norm) on the last stage; a tied head is the
    embedding itself unless the model is pipelined, when the last stage keeps its own copy."""
    head = 0.0 if model.tied_embeddings and not pipelined else model.vocab * model.hidden / tp
    return head, float(model.hidden)


def chunk_layers(model: ModelSpec, counts: list[int], chunk: int) -> tuple[int, int]:
    """(dense layers, MoE layers) in virtual stage `chunk` given the per-chunk layer counts."""
    start = sum(counts[:chunk])
    stop = start + counts[chunk]
    first_moe = model.dense_layers if model.is_moe else model.layers
    dense = max(0, min(stop, first_moe) - start)
    return dense, counts[chunk] - dense


@dataclass(frozen=True)
class ChunkParams:
    """Parameters one rank holds for one virtual stage: shardable over the dense ZeRO group
    (`dense`, including replicated norms) and over the expert ZeRO group (`experts`)."""

    dense: float
    experts: float
    max_layer: float  # the largest layer's local parameters (ZeRO-3 gather buffer)


def chunk_params(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int
) -> ChunkParams:
    n_dense, n_moe = chunk_layers(model, counts, chunk)
    last = len(counts) - 1
    first, is_last = chunk == 0, chunk == last
    return params_of(model, plan.tp, plan.ep, n_dense, n_moe, first, is_last, last > 0, plan.etp)


@lru_cache(maxsize=65536)
def params_of(
    model: ModelSpec,
    tp: int,
    ep: int,
    n_dense: int,
    n_moe: int,
    first: bool,
    last: bool,
    pipelined: bool,
    etp: int = 1,
) -> ChunkParams:
    """Parameters of a virtual stage with `n_dense` dense and `n_moe` MoE layers on one rank,
    holding the embedding when `first` and the head when `last`."""
    dl = layer_params_per_rank(model, False, tp, ep)
    dense = n_dense * (dl.dense + dl.replicated)
    experts = 0.0
    largest = dl.total if n_dense else 0.0
    if n_moe:
        ml = layer_params_per_rank(model, True, tp, ep, etp)
        dense += n_moe * (ml.dense + ml.replicated)
        experts = n_moe * ml.experts
        largest = max(largest, ml.total)
    if first:
        dense += embedding_params_per_rank(model, tp)
    if last:
        head, norm = head_params_per_rank(model, tp, pipelined)
        dense += head + norm
    return ChunkParams(dense, experts, largest)


def chunk_state_bytes(
    model: ModelSpec,
    plan: ParallelPlan,
    counts: list[int],
    chunk: int,
    eager: bool = False,
    optimizer: str = "adamw",
) -> Tenants:
    """Parameter, gradient and optimizer bytes of one virtual stage on one rank's device."""
    return chunk_state(model, plan, counts, chunk, eager, optimizer)[0]


def eager_state_recipe(rec: PrecisionRecipe, plan: ParallelPlan) -> PrecisionRecipe:
    """The bytes per parameter fivefold's runtime holds for a recipe with an fp32 master copy
    and a narrower compute dtype: FSDP2's `MixedPrecisionPolicy(reduce_dtype=fp32)` leaves fp32
    gradient shards (4 B, `EagerProfile.fsdp_reduce_bytes`), and under ZeRO-3 the fp32 shard
    *is* the master, with no resting compute-dtype copy (parameters 4 B, optimizer the moments
    only; ZeRO-1/2 keep the gathered compute-dtype copy through the step, the recipe's
    parameter tenant). Other recipes, and offloaded state, as the recipe says."""
    return _eager_state_recipe(rec, plan.zero == 3, plan.offload != "none")


@lru_cache(maxsize=256)
def _eager_state_recipe(rec: PrecisionRecipe, zero3: bool, offloaded: bool) -> PrecisionRecipe:
    master = master_bytes(rec)
    if master <= 0 or rec.compute_dtype == "fp32" or offloaded:
        return rec
    out = replace(rec, grad_bytes=EAGER.fsdp_reduce_bytes)
    if zero3:
        out = replace(out, param_bytes=master, optimizer_bytes=rec.optimizer_bytes - master)
    return out


def chunk_state(
    model: ModelSpec,
    plan: ParallelPlan,
    counts: list[int],
    chunk: int,
    eager: bool = False,
    optimizer: str = "adamw",
) -> tuple[Tenants, float]:
    """(device tenants, offloaded host bytes) of one virtual stage's model state on one rank,
    with the plan's optimizer states and offload (`fivefold.planner.memory.levers`); `eager`: as
    fivefold's runtime holds it (`eager_state_recipe`); `optimizer` "muon": one moment fewer
    for the blocks' matrices (`fivefold.planner.step_time.muon`)."""
    cp = chunk_params(model, plan, counts, chunk)
    rec = state_recipe(plan)
    held = eager_state_recipe(rec, plan) if eager else rec
    dense_shard, expert_shard = dense_shard_degree(plan), expert_shard_degree(plan)
    total = model_state_bytes(cp.dense, held, plan.zero, dense_shard)
    total = total + model_state_bytes(cp.experts, held, plan.zero, expert_shard)
    if plan.zero in (1, 2) and gathers_fp8(plan):  # the gathered copy held for the step
        n_dense, n_moe = chunk_layers(model, counts, chunk)
        saving = n_dense * fp8_gather_saving(model, plan, False)
        saving += n_moe * fp8_gather_saving(model, plan, True)
        total = replace(total, params=total.params - saving)
    if optimizer == "muon":
        muon = stage_muon_params(model, plan.tp, *chunk_layers(model, counts, chunk))
        saved = muon * MUON_SAVED_BYTES / zero_divisors(plan.zero, dense_shard)[2]
        total = replace(total, optimizer=total.optimizer - saved)
    if plan.offload == "none":
        return total, 0.0
    host_params = 0.0  # "optimizer" offload of a recipe without a master copy
    if master_bytes(rec) <= 0:
        for n, shard in ((cp.dense, dense_shard), (cp.experts, expert_shard)):
            host_params += n * rec.param_bytes / zero_divisors(plan.zero, shard)[2]
    device, host = split_state(total.params, total.grads, total.optimizer, host_params, plan)
    return Tenants(*device), host


def fp8_gather_saving(model: ModelSpec, plan: ParallelPlan, moe: bool | None = None) -> float:
    """Bytes by which FP8 all-gather shrinks one gathered layer (`moe`: a MoE layer; default
    the model's kind): its converted linears (`levers.fp8_linear_params`, 1/tp each) at 1 byte
    instead of the compute dtype's."""
    if not gathers_fp8(plan):
        return 0.0
    moe = model.is_moe if moe is None else moe
    converted = fp8_linear_params(model, moe, plan.fp8) / plan.tp
    return converted * (compute_bytes(recipe(plan.precision)) - 1)


def compute_bytes(rec: PrecisionRecipe) -> int:
    """Bytes per element of the compute dtype (what ZeRO-3 gathers and matmuls read)."""
    return {"fp8": 1, "bf16": 2, "fp16": 2}.get(rec.compute_dtype, 4)
