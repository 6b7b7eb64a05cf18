"""`ModelSpec`: what is trained (Llama-style dense, MoE or MLA blocks) and the exact parameter
counts it implies; FLOPs are `fivefold.specs.flops`. Pure Python (no torch): the planner calls it
millions of times. The block conventions are in docs/planner.md ("Model conventions").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from fivefold.specs.routing import PLAIN_ROUTER, router_problems, routes_otherwise

MLP_KINDS = ("swiglu", "gelu")
ATTENTION_KINDS = ("gqa", "mla")
# RoPE scalings a config may name (how a factor > 1 stretches the frequencies); the runtime
# implements all but "longrope" (fivefold.model.rope_scaling), the planner counts them all alike.
ROPE_SCALING_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")
RUNTIME_ROPE_SCALINGS = ("llama3", "linear", "dynamic", "yarn")
# `sliding_pattern` letters: a layer attending in the sliding window, or over its whole context
SLIDING_LETTER, FULL_LETTER = "s", "f"
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


# Variant fields at the values that mean "Llama's attention, Mixtral's router"
# (`ModelSpec.to_dict`).
_PLAIN_VARIANTS = {
    "rope_scaling_type": "llama3",
    "rope_mscale_all_dim": 0.0,
    "qkv_bias": False,
    "qk_norm": False,
    "sliding_window": 0,
    "sliding_layers": 0,
    "sliding_pattern": "",
    "rope_beta_fast": 32.0,
    "rope_beta_slow": 1.0,
    "rope_attention_factor": 0.0,
    "rope_truncate": True,
    "attention": "gqa",
    "q_lora_rank": 0,
    "kv_lora_rank": 0,
    "qk_rope_head_dim": 0,
    "v_head_dim": 0,
    "router_norm_topk": True,
    **PLAIN_ROUTER,  # DeepSeek-V3's router settings at the softmax top-k router's values
}


_ROUTER_FIELDS = (
    "router_score",
    "router_groups",
    "router_top_groups",
    "routed_scaling",
    "router_bias_update_speed",
)


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
    # yarn: the rotation counts bounding its ramp, the factor on cos and sin (0 = yarn's
    # 0.1 ln(factor) + 1), whether the ramp's bounds are rounded to whole dimensions
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True
    rope_mscale_all_dim: float = 0.0  # yarn: MLA's softmax scale factor (0 = none)
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head (Qwen3)
    sliding_window: int = 0  # keys a query sees in a sliding-window layer; 0 = full attention
    sliding_layers: int = 0  # the last layers have the window (0 with a window: all of them)
    # or per layer, repeated over the layers: "s" sliding, "f" full (e.g. "sf" alternates)
    sliding_pattern: str = ""
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
    # the top-k gates renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob), else the
    # experts' softmax probabilities as they are
    router_norm_topk: bool = True
    router_score: str = "softmax"  # "sigmoid": DeepSeek-V3's scores, with a correction bias
    router_groups: int = 0  # experts split in groups, top router_top_groups kept (0 = none)
    router_top_groups: int = 0
    routed_scaling: float = 1.0  # the routed experts' gates are multiplied by it
    router_bias_update_speed: float = 0.0  # aux-loss-free balancing step (sigmoid router)
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
    def rope_dim(self) -> int:
        """Width RoPE rotates in each query and key head: qk_rope_head_dim under MLA, else
        head_dim."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_dim(self) -> int:
        """Width of one value head: v_head_dim under MLA when set, else head_dim."""
        return self.v_head_dim if self.is_mla and self.v_head_dim else self.head_dim

    def layer_window(self, layer: int) -> int:
        """Keys a query of layer `layer` (0-based) sees in its window; 0 = full attention.
        `sliding_pattern` when given (repeated over the layers), else the last
        `sliding_layers` layers (all of them when 0)."""
        if not self.sliding_window:
            return 0
        if self.sliding_pattern:
            letter = self.sliding_pattern[layer % len(self.sliding_pattern)]
            return self.sliding_window if letter == SLIDING_LETTER else 0
        first = self.layers - (self.sliding_layers or self.layers)
        return self.sliding_window if layer >= first else 0

    @property
    def windowed_layers(self) -> int:
        """Layers attending in the sliding window (`layer_window`)."""
        if not self.sliding_window:
            return 0
        return sum(1 for layer in range(self.layers) if self.layer_window(layer))

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
        if (self.sliding_layers or self.sliding_pattern) and not self.sliding_window:
            out.append(
                "model.sliding_layers / sliding_pattern need model.sliding_window > 0 (keys "
                "per query)."
            )
        out += self._sliding_pattern_problems()
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

    def _sliding_pattern_problems(self) -> list[str]:
        pattern = self.sliding_pattern
        if not pattern:
            return []
        if set(pattern) - {SLIDING_LETTER, FULL_LETTER} or len(pattern) > self.layers:
            return [
                f"model.sliding_pattern = {pattern!r}: at most model.layers letters, "
                f'"{SLIDING_LETTER}" (sliding window) or "{FULL_LETTER}" (full attention), '
                'repeated over the layers (e.g. "sf" alternates).'
            ]
        if self.sliding_layers:
            return [
                "model.sliding_pattern and model.sliding_layers both say which layers slide: "
                "keep one (sliding_layers = the last layers)."
            ]
        return []

    def runtime_problems(self) -> list[str]:
        """What fivefold's runtime does not build, though `fivefold plan` plans it (checked
        when a run is loaded, `fivefold.train.entry.load_run`, and by `build_model`)."""
        out = []
        if self.rope_scaling_factor != 1.0 and self.rope_scaling_type not in RUNTIME_ROPE_SCALINGS:
            out.append(
                f"model.rope_scaling_type = {self.rope_scaling_type!r}: fivefold's runtime does "
                "not implement it (its decoder is Llama's causal GQA attention with Qwen's Q/K/V "
                "biases and QK-norm, DeepSeek's latent attention, sliding windows and llama3, "
                "linear, dynamic or yarn RoPE scaling); `fivefold plan` plans such a model, but "
                "train a model without it."
            )
        return out

    def _moe_problems(self) -> list[str]:
        """The experts, top-k, dense leading layers and router of a MoE model; none of them set
        in a dense one."""
        out: list[str] = []
        if self.is_moe:
            if not 1 <= self.top_k <= self.experts:
                out.append(
                    f"model.top_k = {self.top_k}: a MoE model needs 1 <= top_k <= experts "
                    f"(= {self.experts})."
                )
            if self.expert_ffn <= 0:
                out.append("model.expert_ffn must be positive when model.experts > 0.")
            out += router_problems(self)
            if not 0 <= self.dense_layers < self.layers:
                out.append(
                    f"model.dense_layers = {self.dense_layers}: must be in [0, layers) so at "
                    "least one layer is MoE."
                )
        elif self.top_k or self.shared_experts or self.dense_layers or routes_otherwise(self):
            out.append(
                "model.top_k / shared_experts / dense_layers and the router_* settings are MoE "
                "settings: set model.experts > 0 or leave them at their defaults."
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
        if (
            self.rope_scaling_type in ("llama3", "yarn", "dynamic")
            and self.rope_original_seq_len <= 0
        ):
            out.append(
                "model.rope_original_seq_len must be the pre-training context (e.g. 8192) when "
                "model.rope_scaling_factor > 1."
            )
        if self.rope_scaling_type == "yarn" and not (
            0 < self.rope_beta_slow < self.rope_beta_fast < float("inf")
            and 0 <= self.rope_attention_factor < float("inf")
        ):
            out.append(
                f"model.rope_beta_fast = {self.rope_beta_fast}, rope_beta_slow = "
                f"{self.rope_beta_slow}, rope_attention_factor = {self.rope_attention_factor}: "
                "yarn needs 0 < beta_slow < beta_fast (default 1 and 32) and an attention "
                "factor >= 0 (0 = 0.1 ln(factor) + 1)."
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
        for f in (
            "norm_eps",
            "rope_theta",
            "router_aux_loss_coef",
            "rope_mscale_all_dim",
            "routed_scaling",
            "router_bias_update_speed",
        ):
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
        out += self._moe_problems()
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


def default_ffn(hidden: int, mlp: str = "swiglu") -> int:
    """4h for GeLU; SwiGLU's 8h/3 rounded up to a multiple of 256 (the Llama rule)."""
    if mlp == "gelu":
        return 4 * hidden
    return 256 * math.ceil(8 * hidden / 3 / 256)
