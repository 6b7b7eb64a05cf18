"""FLOPs per token of a `ModelSpec`: one multiply-add is 2 FLOPs; attention scores are counted
per document and causally (L^2/2 query-key pairs per document of L tokens, `ATTENTION_CONVENTION`),
a sliding window over its w keys. Pure Python, like the rest of `fivefold.specs`.
"""

from __future__ import annotations

from fivefold.specs.geometry import RECOMPUTE_POLICIES
from fivefold.specs.model import (
    ModelSpec,
    attention_params,
    dense_mlp_params,
    moe_mlp_params,
)

ATTENTION_CONVENTION = "per document, causal pairs (L^2/2 per document)"


def causal_pairs_per_sequence(seq_len: float, doc_len: float = 0) -> float:
    """Query-key pairs a document-causal mask keeps in one packed sequence of `seq_len` tokens,
    L^2/2 per document of L tokens (the dense causal count, s^2/2, when a row is one document).

    `doc_len` 0: one document per sequence. Else documents of `doc_len` tokens packed back to
    back and cut by sequence windows at any offset: two tokens d apart share a document with
    probability max(0, 1 - d/D), so the expected sum of L^2 is
    2 * integral_0^m (s - x)(1 - x/D) dx = 2(s m - m^2/2 - s m^2/(2D) + m^3/(3D)), m = min(s, D)
    (sD - D^2/3 when D <= s; s^2 - s^3/(3D) when D >= s). For lengths that vary, D is their
    token-weighted mean E[L^2]/E[L] (what `fivefold data prepare` records).
    """
    s = float(seq_len)
    if doc_len <= 0:
        return s * s / 2
    d = float(doc_len)
    m = min(s, d)
    return s * m - m * m / 2 - s * m * m / (2 * d) + m**3 / (3 * d)


def attention_keys_per_query(seq_len: float, window: int = 0, causal: bool = True) -> float:
    """Keys one query meets on average: s/2 causal (s without a mask); in a causal window of w
    keys s/2 while s <= w, else w - w^2 / 2s (the first w tokens ramp up, the rest see w)."""
    if not causal:
        return float(min(seq_len, window) if window else seq_len)
    if not window or seq_len <= window:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def attention_keys_per_token(m: ModelSpec, seq_len: int, causal: bool = True) -> float:
    """Keys each query of a full-attention layer meets on average, per document: pairs per
    sequence / seq_len (s/2 for one causal document per sequence, s when not causal)."""
    if not causal:
        return float(seq_len)
    return causal_pairs_per_sequence(seq_len, m.doc_len) / seq_len


def attention_score_flops_per_token(
    m: ModelSpec, seq_len: int, causal: bool = True, keys: float | None = None
) -> float:
    """Forward FLOPs per token of one full-attention layer's QK^T and softmax(.)V (scores, not
    projections).

    Each query meets `keys` keys on average (default `attention_keys_per_token`: per document,
    `seq_len/2` with one document per sequence); each pair costs 2 FLOPs per query/key element
    for QK^T and 2 per value element for AV (head_dim each, MLA: head_dim and v_head_dim).
    """
    keys = attention_keys_per_token(m, seq_len, causal) if keys is None else keys
    return 2.0 * m.heads * (m.head_dim + m.value_dim) * keys


def attention_flops_all_layers(
    m: ModelSpec, seq_len: int, causal: bool = True, keys: float | None = None
) -> float:
    """Forward attention-score FLOPs per token summed over the layers, sliding-window layers
    counted over their window (or their documents, when those are shorter on average)."""
    full = attention_score_flops_per_token(m, seq_len, causal, keys)
    if not m.windowed_layers:
        return m.layers * full
    window = attention_keys_per_query(seq_len, m.sliding_window, causal)
    dense = attention_score_flops_per_token(m, seq_len, causal, seq_len / 2 if causal else None)
    windowed = min(full, dense * window / attention_keys_per_query(seq_len, 0, causal))
    return (m.layers - m.windowed_layers) * full + m.windowed_layers * windowed


def layer_matmul_flops_per_token(m: ModelSpec, moe: bool) -> float:
    """Forward FLOPs per token of one layer's weight matmuls (active experts only)."""
    weights = attention_params(m)
    weights += moe_mlp_params(m, active_only=True) if moe else dense_mlp_params(m)
    return 2.0 * weights


def head_flops_per_token(m: ModelSpec) -> float:
    """Forward FLOPs per token of the LM head projection (the embedding lookup is free)."""
    return 2.0 * m.vocab * m.hidden


def forward_flops_per_token(
    m: ModelSpec, seq_len: int | None = None, causal: bool = True, keys: float | None = None
) -> float:
    """Model forward FLOPs per token at sequence length `seq_len` (default: m.seq_len), each
    query meeting `keys` keys (default `attention_keys_per_token`)."""
    s = seq_len or m.seq_len
    dense = m.layers - m.moe_layers
    total = dense * layer_matmul_flops_per_token(m, moe=False)
    total += m.moe_layers * layer_matmul_flops_per_token(m, moe=True)
    total += attention_flops_all_layers(m, s, causal, keys)
    return total + head_flops_per_token(m)


def early_stop_skipped_flops_per_token(m: ModelSpec) -> float:
    """Forward FLOPs per token that full recompute under torch's non-reentrant checkpoint does
    not repeat, summed over the layers.

    Early stop ends the recomputation once every tensor the backward saved exists again, so the
    block's last matmul, whose output only feeds the residual add (which saves nothing), never
    re-runs: the MLP's `w2` in a dense layer (2 h ffn FLOPs per token, SwiGLU or GeLU), the
    shared expert's `w2` in a MoE layer with shared experts (2 h shared * expert_ffn); a MoE
    layer without them ends in the routed combine, which saves the experts' outputs, so all of
    its matmuls re-run. Checked against `torch.utils.flop_counter` in tests/planner.
    """
    dense = (m.layers - m.moe_layers) * 2.0 * m.hidden * m.ffn
    return dense + m.moe_layers * 2.0 * m.hidden * m.shared_experts * m.expert_ffn


def training_flops_per_token(
    m: ModelSpec,
    seq_len: int | None = None,
    recompute: str = "none",
    causal: bool = True,
    early_stop: bool = False,
    keys: float | None = None,
) -> float:
    """FLOPs per trained token: forward + backward (2x forward) + what recompute repeats.

    `keys`: the keys each query meets (a batch's own documents, `fivefold.train.metrics`);
    default from `seq_len` and `m.doc_len` (`attention_keys_per_token`).

    recompute="none" gives model FLOPs (the MFU numerator). "full" re-runs every layer's forward
    (not the head), less `early_stop_skipped_flops_per_token` with `early_stop` (what torch's
    non-reentrant checkpoint, the fivefold runtime's, really runs); "selective" re-runs only the
    attention scores (Korthikanti et al. 2022).
    """
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_POLICIES}, got {recompute!r}")
    s = seq_len or m.seq_len
    fwd = forward_flops_per_token(m, s, causal, keys)
    extra = 0.0
    if recompute == "full":
        extra = fwd - head_flops_per_token(m)
        extra -= early_stop_skipped_flops_per_token(m) if early_stop else 0.0
    elif recompute == "selective":
        extra = attention_flops_all_layers(m, s, causal, keys)
    return 3.0 * fwd + extra
