"""Multi-head latent attention (DeepSeek-V2/V3), chosen from the spec (`model.attention = "mla"`).

Queries: x -> wq_a (D -> q_lora_rank) -> q_norm -> wq_b (-> H x (nope + rope)), or one `wq`
when q_lora_rank is 0. Keys and values: x -> wkv_a (D -> kv_lora_rank + rope): the latent
(normalised by kv_norm, expanded by wkv_b to H x (nope + v)) and one RoPE key shared by every
head. Each head's key is [k_nope, k_rope], its query [q_nope, q_rope]; RoPE rotates only the
`rope` part (the model's tables are qk_rope_head_dim wide, `ModelSpec.rope_dim`). The softmax
scale is 1/sqrt(nope + rope), times yarn's mscale^2 when the spec asks for it (applied to q).

Values are v wide, narrower than keys (DeepSeek-V3: 128 vs 192); the attention kernels (CPU
flash, CUDA flash, the ring blocks of context parallelism) take one head width, so v is
zero-padded to the key width and the output cut back (the padded columns stay zero), as
torchtitan's DeepSeek-V3 does for SDPA.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from fivefold.model.attention import AttentionCore
from fivefold.model.document_layout import DocumentLayout
from fivefold.model.norms import RMSNorm
from fivefold.model.rope import apply_rope
from fivefold.specs.model import ModelSpec


def _local(x: torch.Tensor) -> torch.Tensor:
    """Tensor parallelism keeps the replicated latents as DTensors
    (`fivefold.parallel.tensor_parallel`); the RoPE key joins this rank's heads as a local
    tensor whose gradient is a partial sum (this rank's heads only)."""
    if isinstance(x, DTensor):
        return x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
    return x


def softmax_scale_factor(spec: ModelSpec) -> float:
    """The factor on 1/sqrt(head_dim) DeepSeek's attention takes under yarn RoPE scaling:
    mscale^2, mscale = 0.1 * rope_mscale_all_dim * ln(factor) + 1 (1 without yarn, without
    mscale_all_dim, or at factor <= 1), as `transformers`' DeepseekV3Attention computes it."""
    factor, all_dim = spec.rope_scaling_factor, spec.rope_mscale_all_dim
    if spec.rope_scaling_type != "yarn" or not all_dim or factor <= 1.0:
        return 1.0
    return (0.1 * all_dim * math.log(factor) + 1.0) ** 2


class LatentAttention(nn.Module):
    """x [B, T, D] -> [B, T, D] (module docstring). The number of heads is read from wkv_b's
    output width at forward time, so tensor parallelism can split wq/wq_b, wkv_b and wo by heads.
    """

    def __init__(self, spec: ModelSpec, window: int = 0) -> None:
        super().__init__()
        dim, heads, eps = spec.hidden, spec.heads, spec.norm_eps
        self.rope = spec.qk_rope_head_dim
        self.nope = spec.head_dim - self.rope
        self.v_dim = spec.value_dim
        self.latent = spec.kv_lora_rank
        self.q_scale = softmax_scale_factor(spec)
        rank = spec.q_lora_rank
        self.wq = None if rank else nn.Linear(dim, heads * spec.head_dim, bias=False)
        self.wq_a = nn.Linear(dim, rank, bias=False) if rank else None
        self.q_norm = RMSNorm(rank, eps) if rank else None
        self.wq_b = nn.Linear(rank, heads * spec.head_dim, bias=False) if rank else None
        self.wkv_a = nn.Linear(dim, self.latent + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.latent, eps)
        self.wkv_b = nn.Linear(self.latent, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=False)
        self.window = window  # the layer's sliding window (0: none)
        self.core = AttentionCore(window)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, nope + rope]."""
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        return q.unflatten(-1, (-1, self.nope + self.rope))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        docs: DocumentLayout | None = None,
    ) -> torch.Tensor:
        cos, sin = rope  # [B, T, 1, rope]
        q_nope, q_rope = self._queries(x).split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        latent, k_rope = self.wkv_a(x).split([self.latent, self.rope], dim=-1)
        k_rope = apply_rope(_local(k_rope).unsqueeze(2), cos, sin)  # [B, T, 1, rope]
        kv = self.wkv_b(self.kv_norm(latent)).unflatten(-1, (-1, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, T, H, nope | v]
        k = torch.cat([k_nope, k_rope.expand(-1, -1, kv.shape[2], -1)], dim=-1)
        width = max(self.nope + self.rope, self.v_dim)  # zeros add nothing to q.k or to out
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), docs)
        out = out.transpose(1, 2)[..., : self.v_dim]  # [B, T, H, v]
        return self.wo(out.flatten(2))
