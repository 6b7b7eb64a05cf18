"""`ModelSpec`: what is trained, and the exact parameter and FLOP counts it implies.

Everything here is pure Python (no torch) so the planner can call it millions of times.
Conventions:
- Llama-style blocks: pre-norm RMSNorm (one weight vector each, no biases), attention with
  `heads` query heads and `kv_heads` key/value heads of `head_dim` each, then an MLP that is
  SwiGLU (three `hidden x ffn` matrices) or GELU (two matrices; biases are not counted).
- A MoE layer replaces the MLP by `experts` routed SwiGLU experts of width `expert_ffn`, of which
  `top_k` run per token, plus `shared_experts` always-on experts of the same width and a linear
  router `hidden x experts`. The first `dense_layers` layers keep the dense MLP.
- Attention variants read from Hugging Face configs (`fivefold.spec.hf_config`): biases on Q, K
  and V (`qkv_bias`, Qwen2), RMSNorm of each query and key head (`qk_norm`, Qwen3), a sliding
  window of `sliding_window` keys in `sliding_layers` of the layers (Mistral, Qwen2), and
  DeepSeek's multi-head latent attention (`attention = "mla"`): queries through a rank
  `q_lora_rank` bottleneck (0: one projection), keys and values from a shared rank
  `kv_lora_rank` latent plus a `qk_rope_head_dim` RoPE key shared by all heads; each head's
  query/key is `qk_nope_head_dim + qk_rope_head_dim` wide (= `head_dim`) and its value
  `v_head_dim` (`value_dim`). Biases and norm weights count as parameters, not as matmul FLOPs.
- FLOPs count one multiply-add as 2 FLOPs. Attention scores are counted causally: a token at
  position t attends to t+1 keys, so a sequence of length s costs s(s+1)/2 score pairs per head
  (we use s/2 pairs per token, the large-s value used by Megatron and the seeds, divided by two);
  inside a window of w keys a token meets min(t, w) keys, s/2 per token while s <= w and
  w - w^2 / 2s beyond. Packed documents (`doc_len`) are counted per document, L^2/2 pairs each
  (`causal_pairs_per_sequence`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

MLP_KINDS = ("swiglu", "gelu")
ATTENTION_KINDS = ("gqa", "mla")
# RoPE scalings a config may name (how a factor > 1 stretches the frequencies); the runtime
# implements "llama3" (fivefold.model.rope_scaling), the planner counts them all alike.
ROPE_SCALING_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")
# Upper bounds of the sizes (counts): well beyond any published model, small enough that a typo
# (hidden = 1e12) is refused at once instead of overflowing a tensor or a search.
MODEL_LIMITS = {
    "layers": 4096,
    "hidden": 1 << 18,
    "heads": 1 << 14,
    "kv_heads": 1 << 14,
    "ffn": 1 << 21,
    "vocab": 1 << 24,
    "seq_len": 1 << 24,
    "experts": 1 << 14,
    "expert_ffn": 1 << 21,
    "shared_experts": 1 << 10,
    "sliding_window": 1 << 24,
    "q_lora_rank": 1 << 18,
    "kv_lora_rank": 1 << 18,
}


# Attention-variant fields at the values that mean "Llama's attention" (`ModelSpec.to_dict`).
_PLAIN_VARIANTS = {
    "rope_scaling_type": "llama3",
    "qkv_bias": False,
    "qk_norm": False,
    "sliding_window": 0,
    "sliding_layers": 0,
    "attention": "gqa",
    "q_lora_rank": 0,
    "kv_lora_rank": 0,
    "qk_rope_head_dim": 0,
    "v_head_dim": 0,
}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Sizes are counts (not bytes); `seq_len` is in tokens."""

    name: str = "custom"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 0  # 0 means "same as heads" (multi-head attention)
    ffn: int = 172
    vocab: int = 4096
    seq_len: int = 128
    mlp: str = "swiglu"
    tied_embeddings: bool = False
    head_dim: int = 0  # 0 means hidden // heads
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    # Llama 3.1-style RoPE scaling (fivefold.model.rope_scaling); factor 1 = plain RoPE
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_len: int = 0  # the pre-training context the scaling extends
    rope_scaling_type: str = "llama3"  # how a factor > 1 scales (ROPE_SCALING_TYPES)
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head (Qwen3)
    sliding_window: int = 0  # keys a query sees in a sliding-window layer; 0 = full attention
    sliding_layers: int = 0  # layers with the window (0 with a window: all of them)
    attention: str = "gqa"  # "gqa" (Llama) or "mla" (DeepSeek multi-head latent attention)
    q_lora_rank: int = 0  # MLA: query bottleneck rank (0 = one hidden x heads*head_dim matrix)
    kv_lora_rank: int = 0  # MLA: rank of the shared key/value latent
    qk_rope_head_dim: int = 0  # MLA: RoPE part of each query/key head (shared key across heads)
    v_head_dim: int = 0  # MLA: value width per head (0 = head_dim; `value_dim`)
    experts: int = 0  # routed experts per MoE layer; 0 = dense model
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers that keep the dense MLP in a MoE model
    router_aux_loss_coef: float = 0.01
    # token-weighted mean document length of the training data (`causal_pairs_per_sequence`);
    # 0 = one document per sequence
    doc_len: int = 0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0 and self.heads > 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    # ---- shape helpers -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def q_width(self) -> int:
        """Width of the concatenated query heads: heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def value_dim(self) -> int:
        """Width of one value head: v_head_dim under MLA when set, else head_dim."""
        return self.v_head_dim if self.is_mla and self.v_head_dim else self.head_dim

    @property
    def windowed_layers(self) -> int:
        """Layers attending in the sliding window (sliding_layers, 0 meaning all of them)."""
        if not self.sliding_window:
            return 0
        return self.sliding_layers or self.layers

    @property
    def kv_head_width(self) -> float:
        """Mean width of one key head and one value head: head_dim, or with MLA (where values
        are `value_dim` wide) (head_dim + value_dim) / 2, so 2 x kv_width = K + V."""
        return (self.head_dim + self.value_dim) / 2 if self.is_mla else self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the concatenated key (or value) heads: kv_heads * head_dim (MLA: the mean
        of the key and value widths, `kv_head_width`)."""
        width = self.kv_heads * self.kv_head_width
        return int(width) if float(width).is_integer() else width  # type: ignore[return-value]

    def with_(self, **changes) -> ModelSpec:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field, less the attention variants a Llama-style model leaves at their plain
        values (so recipes and checkpoint metadata of such models list only what they use)."""
        data = asdict(self)
        data.pop("notes")
        plain = _PLAIN_VARIANTS
        return {k: v for k, v in data.items() if k not in plain or plain[k] != v}

    # ---- validation ------------------------------------------------------------------------
    def _attention_problems(self) -> list[str]:
        out = []
        if self.attention not in ATTENTION_KINDS:
            return [f"model.attention = {self.attention!r}: choose one of gqa, mla."]
        if self.sliding_layers > self.layers:
            out.append(
                f"model.sliding_layers = {self.sliding_layers}: at most model.layers = "
                f"{self.layers}."
            )
        if self.sliding_layers and not self.sliding_window:
            out.append("model.sliding_layers needs model.sliding_window > 0 (keys per query).")
        if not self.is_mla:
            if self.q_lora_rank or self.kv_lora_rank or self.qk_rope_head_dim:
                out.append(
                    "model.q_lora_rank / kv_lora_rank / qk_rope_head_dim describe multi-head "
                    'latent attention: set model.attention = "mla" or leave them at 0.'
                )
            if self.v_head_dim:
                out.append(
                    f'model.v_head_dim = {self.v_head_dim}: only model.attention = "mla" has '
                    "its own value width; leave it at 0 (= head_dim)."
                )
            return out
        if self.kv_heads != self.heads:
            out.append(
                f"model.kv_heads = {self.kv_heads}: multi-head latent attention has one key and "
                f"value per query head (kv_heads = heads = {self.heads})."
            )
        if self.kv_lora_rank <= 0 or not 0 < self.qk_rope_head_dim < self.head_dim:
            out.append(
                "model.attention = 'mla' needs kv_lora_rank > 0 and 0 < qk_rope_head_dim < "
                "head_dim (= qk_nope_head_dim + qk_rope_head_dim), e.g. DeepSeek-V3's 512, 64 "
                "and 192."
            )
        if self.qkv_bias or self.qk_norm:
            out.append("model.qkv_bias / qk_norm are not defined for multi-head latent attention.")
        return out

    def runtime_problems(self) -> list[str]:
        """What fivefold's runtime does not build, though `fivefold plan` plans it (checked
        when a run is loaded, `fivefold.train.entry.load_run`, and by `build_model`)."""
        out = []
        for present, what in (
            (self.is_mla, 'model.attention = "mla" (multi-head latent attention)'),
            (self.sliding_window > 0, f"model.sliding_window = {self.sliding_window}"),
            (self.qk_norm, "model.qk_norm = true (RMSNorm of query and key heads)"),
            (self.qkv_bias, "model.qkv_bias = true (Q, K and V biases)"),
            (
                self.rope_scaling_factor != 1.0 and self.rope_scaling_type != "llama3",
                f"model.rope_scaling_type = {self.rope_scaling_type!r}",
            ),
        ):
            if present:
                out.append(
                    f"{what}: fivefold's runtime does not implement it (its decoder is "
                    "Llama's: full causal GQA attention, llama3 RoPE scaling); `fivefold plan` "
                    "plans such a model, but train a model without it."
                )
        return out

    def _rope_scaling_problems(self) -> list[str]:
        factor, low, high = (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
        )
        if not (factor >= 1.0 and factor < float("inf")):
            return [f"model.rope_scaling_factor = {factor}: must be >= 1 (1 = no scaling)."]
        if self.rope_scaling_type not in ROPE_SCALING_TYPES:
            return [
                f"model.rope_scaling_type = {self.rope_scaling_type!r}: choose one of "
                f"{', '.join(ROPE_SCALING_TYPES)}."
            ]
        if factor == 1.0:
            return []
        out = []
        if self.rope_scaling_type == "llama3" and not 0 < low < high < float("inf"):
            out.append(
                f"model.rope_low_freq_factor = {low}, rope_high_freq_factor = {high}: need "
                "0 < low < high (Llama 3.1: 1 and 4)."
            )
        if self.rope_scaling_type in ("llama3", "yarn") and self.rope_original_seq_len <= 0:
            out.append(
                "model.rope_original_seq_len must be the pre-training context (e.g. 8192) when "
                "model.rope_scaling_factor > 1."
            )
        return out

    def problems(self) -> list[str]:
        """Every inconsistency, each as a sentence naming the field and the fix."""
        out: list[str] = []
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "head_dim"):
            if getattr(self, f) <= 0:
                out.append(f"model.{f} = {getattr(self, f)}: must be a positive integer.")
        for f in (
            "experts",
            "top_k",
            "expert_ffn",
            "shared_experts",
            "dense_layers",
            "sliding_window",
            "sliding_layers",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "doc_len",
        ):
            if getattr(self, f) < 0:
                out.append(f"model.{f} = {getattr(self, f)}: must be >= 0.")
        for f, high in MODEL_LIMITS.items():
            if getattr(self, f) > high:
                out.append(
                    f"model.{f} = {getattr(self, f):,} is beyond any model fivefold plans or "
                    f"trains (at most {high:,}); check the value (sizes are counts, e.g. "
                    "hidden = 4096)."
                )
        for f in ("norm_eps", "rope_theta", "router_aux_loss_coef"):
            if not math.isfinite(getattr(self, f)):
                out.append(f"model.{f} = {getattr(self, f)}: must be a finite number.")
        if out:
            return out
        if self.mlp not in MLP_KINDS:
            out.append(f"model.mlp = {self.mlp!r}: choose one of {', '.join(MLP_KINDS)}.")
        if self.heads % self.kv_heads:
            out.append(
                f"model.kv_heads = {self.kv_heads} must divide model.heads = {self.heads} "
                "(grouped-query attention shares each key/value head among whole query groups)."
            )
        if self.norm_eps <= 0:
            out.append(f"model.norm_eps = {self.norm_eps}: must be positive, e.g. 1e-5.")
        if self.rope_theta <= 0:
            out.append(f"model.rope_theta = {self.rope_theta}: must be positive, e.g. 500000.")
        if self.router_aux_loss_coef < 0:
            out.append(
                f"model.router_aux_loss_coef = {self.router_aux_loss_coef}: must be >= 0, "
                "e.g. 0.01."
            )
        out += self._rope_scaling_problems()
        out += self._attention_problems()
        if self.is_moe:
            if not 1 <= self.top_k <= self.experts:
                out.append(
                    f"model.top_k = {self.top_k}: a MoE model needs 1 <= top_k <= experts "
                    f"(= {self.experts})."
                )
            if self.expert_ffn <= 0:
                out.append("model.expert_ffn must be positive when model.experts > 0.")
            if not 0 <= self.dense_layers < self.layers:
                out.append(
                    f"model.dense_layers = {self.dense_layers}: must be in [0, layers) so at "
                    "least one layer is MoE."
                )
        elif self.top_k or self.shared_experts or self.dense_layers:
            out.append(
                "model.top_k / shared_experts / dense_layers are MoE settings: set model.experts "
                "> 0 or leave them at 0."
            )
        if self.shared_experts < 0:
            out.append("model.shared_experts must be >= 0.")
        return out


# ---- parameter counts ------------------------------------------------------------------------
def attention_matrices(m: ModelSpec) -> list[tuple[int, int]]:
    """(out, in) of one layer's attention projections: Q, K, V, O, or with MLA the query
    down/up (or one query matrix), the joint key/value down projection (latent + RoPE key), the
    key/value up projection and O."""
    h = m.hidden
    if not m.is_mla:
        return [(m.q_width, h), (m.kv_width, h), (m.kv_width, h), (h, m.q_width)]
    nope = m.head_dim - m.qk_rope_head_dim
    query = [(m.q_lora_rank, h), (m.q_width, m.q_lora_rank)] if m.q_lora_rank else [(m.q_width, h)]
    return [
        *query,
        (m.kv_lora_rank + m.qk_rope_head_dim, h),
        (m.heads * (nope + m.value_dim), m.kv_lora_rank),
        (h, m.heads * m.value_dim),
    ]


def attention_params(m: ModelSpec) -> int:
    """Weights of one layer's attention projections (`attention_matrices`; no biases)."""
    return sum(rows * cols for rows, cols in attention_matrices(m))


def attention_extra_params(m: ModelSpec) -> int:
    """One layer's attention parameters outside its matrices: Q/K/V biases, per-head query and
    key norms, MLA's norms of the query and key/value latents."""
    out = m.q_width + 2 * m.kv_width if m.qkv_bias else 0
    out += 2 * m.head_dim if m.qk_norm else 0
    return int(out + (m.q_lora_rank + m.kv_lora_rank if m.is_mla else 0))


def dense_mlp_params(m: ModelSpec) -> int:
    matrices = 3 if m.mlp == "swiglu" else 2
    return matrices * m.hidden * m.ffn


def expert_params(m: ModelSpec) -> int:
    """One SwiGLU expert of width expert_ffn."""
    return 3 * m.hidden * m.expert_ffn


def moe_mlp_params(m: ModelSpec, active_only: bool = False) -> int:
    routed = m.top_k if active_only else m.experts
    router = m.hidden * m.experts
    return (routed + m.shared_experts) * expert_params(m) + router


def layer_params(m: ModelSpec, moe: bool, active_only: bool = False) -> int:
    norms = 2 * m.hidden + attention_extra_params(m)
    mlp = moe_mlp_params(m, active_only) if moe else dense_mlp_params(m)
    return attention_params(m) + mlp + norms


def embedding_params(m: ModelSpec) -> int:
    return m.vocab * m.hidden


def head_params(m: ModelSpec) -> int:
    """LM head (0 when tied to the embedding) plus the final norm."""
    return (0 if m.tied_embeddings else m.vocab * m.hidden) + m.hidden


def param_count(m: ModelSpec, active_only: bool = False) -> int:
    """Exact parameter count; `active_only` counts only top_k routed experts per MoE layer."""
    dense = m.layers - m.moe_layers
    body = dense * layer_params(m, moe=False)
    body += m.moe_layers * layer_params(m, moe=True, active_only=active_only)
    return embedding_params(m) + body + head_params(m)


# ---- FLOPs -------------------------------------------------------------------------------------
RECOMPUTE_POLICIES = ("none", "selective", "full")


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


def default_ffn(hidden: int, mlp: str = "swiglu") -> int:
    """4h for GeLU; SwiGLU's 8h/3 rounded up to a multiple of 256 (the Llama rule)."""
    if mlp == "gelu":
        return 4 * hidden
    return 256 * math.ceil(8 * hidden / 3 / 256)

