"""The matmuls of one transformer layer on one rank, as shapes (no time).

A shape (m, n, k, count) is `count` matmuls of (m x k) @ (k x n) in forward; a grouped shape
(groups, tokens, n, k) is one `torch._grouped_mm` over `groups` experts sharing `tokens` rows.
Per micro-batch of b sequences a rank holds T = b * s / cp tokens and 1/tp of each matrix.
"""

from __future__ import annotations

from fivefold.planner.memory.model_states import local_kv_width
from fivefold.specs.geometry import moe_token_split, rank_tokens
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan


def attention_gemms(
    model: ModelSpec, tokens: float, t: int
) -> list[tuple[float, float, float, float]]:
    """Forward attention-projection GEMMs of one layer on one TP rank as (m, n, k, count): the
    fused QKV and O; with MLA (`ModelSpec.attention_matrices`) the key/value latent and query
    down projections replicated, the per-head up projections and O split by heads."""
    h = model.hidden
    if not model.is_mla:
        q, kv = model.q_width / t, local_kv_width(model, t)
        return [(tokens, q + 2 * kv, h, 1.0), (tokens, h, q, 1.0)]
    heads = model.heads / t
    nope = model.head_dim - model.qk_rope_head_dim
    out = [
        (tokens, model.kv_lora_rank + model.qk_rope_head_dim, h, 1.0),
        (tokens, heads * (nope + model.value_dim), model.kv_lora_rank, 1.0),
    ]
    rank = model.q_lora_rank
    if rank:
        out += [(tokens, rank, h, 1.0), (tokens, heads * model.head_dim, rank, 1.0)]
    else:
        out.append((tokens, heads * model.head_dim, h, 1.0))
    return [*out, (tokens, h, heads * model.value_dim, 1.0)]


def layer_gemms(
    model: ModelSpec, plan: ParallelPlan, moe: bool
) -> list[tuple[float, float, float, float]]:
    """Forward GEMMs of one layer on one rank as (m, n, k, count), fused as fast kernels run
    them (QKV as one; a MoE layer's routed experts as `count` matmuls of their share)."""
    t = plan.tp
    h = model.hidden
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    out = attention_gemms(model, tokens, t)
    if not moe:
        f = model.ffn / t
        up = 2 * f if model.mlp == "swiglu" else f
        return [*out, (tokens, up, h, 1.0), (tokens, h, f, 1.0)]
    fe = model.expert_ffn / plan.etp  # whole routed experts on the rank's 1/tp of the tokens
    own = tokens / moe_token_split(plan)
    local_experts = model.experts / plan.ep
    per_expert = own * model.top_k * plan.ep / model.experts
    out += [(own, model.experts, h, 1.0)]  # router (replicated over TP, on the own tokens)
    out += [(per_expert, 2 * fe, h, local_experts), (per_expert, h, fe, local_experts)]
    if model.shared_experts:  # tensor-parallel over the TP group's tokens
        width = model.shared_experts * fe / t
        out += [(tokens, 2 * width, h, 1.0), (tokens, h, width, 1.0)]
    return out


def eager_matmuls(model: ModelSpec, plan: ParallelPlan, moe: bool) -> list:
    """The per-matrix matmuls in execution order as eager code runs them (wq, wk, wv, wo, then
    w1, w3, w2 of a dense layer, or the router and the shared experts' w1, w3, w2 of a MoE
    layer); the routed experts are grouped matmuls apart (`expert_projections`)."""
    gemms = layer_gemms(model, plan, moe)
    t = plan.tp
    tokens, h = gemms[0][0], model.hidden
    kv = local_kv_width(model, t)
    out = [
        (tokens, model.q_width / t, h, 1.0),
        (tokens, kv, h, 1.0),
        (tokens, kv, h, 1.0),
        gemms[1],
    ]
    if moe:
        out.append(gemms[2])  # the router
        width = model.shared_experts * model.expert_ffn / t
        if width:
            out += [(tokens, width, h, 1.0), (tokens, width, h, 1.0), (tokens, h, width, 1.0)]
        return out
    f = model.ffn / t
    if model.mlp == "swiglu":
        return [*out, (tokens, f, h, 1.0), (tokens, f, h, 1.0), gemms[3]]
    return [*out, gemms[2], gemms[3]]


def expert_projections(model: ModelSpec, plan: ParallelPlan) -> list[tuple[float, ...]]:
    """The routed experts' three grouped matmuls (w1, w3, w2) of one MoE layer on one rank as
    (groups, tokens, n, k): the rank's experts / ep groups share tokens x top_k rows (every
    rank's tokens routed to these experts, balanced), forward shape (rows x k) @ (k x n)."""
    groups = model.experts / plan.ep
    rows = rank_tokens(plan.micro_batch, model.seq_len, plan) / moe_token_split(plan) * model.top_k
    fe, h = model.expert_ffn / plan.etp, model.hidden
    return [(groups, rows, fe, h), (groups, rows, fe, h), (groups, rows, h, fe)]


def alternate_matmuls(model: ModelSpec, plan: ParallelPlan, moe: bool) -> list:
    """Every second eager matmul (the 2nd, 4th, ...): what op-level SAC recomputes."""
    return eager_matmuls(model, plan, moe)[1::2]


def last_matmul(model: ModelSpec, plan: ParallelPlan, moe: bool) -> tuple[float, float, float]:
    """(m, n, k) of the block's last matmul, the one checkpoint early stop skips (zero k: none)."""
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    width = model.shared_experts * model.expert_ffn if moe else model.ffn
    return tokens, model.hidden, width / plan.tp
