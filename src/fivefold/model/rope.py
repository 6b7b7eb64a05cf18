"""Rotary position embeddings computed from explicit positions.

Angles come from the `positions` tensor, never from a token's index in the tensor, so positions
that restart at each packed document and context-parallel shards that carry their own positions
rotate exactly like the single-process run. The model computes the (cos, sin) tables once per
forward (`rope_cos_sin`) and every layer rotates its q and k with them (`apply_rope`), so
autograd keeps one pair of tables per forward, not one per layer. Nothing is cached in buffers,
which keeps meta-device construction trivial.

Convention: "rotate half" (the first and second halves of each head form the rotated pairs).
"""

from __future__ import annotations

import torch

from fivefold.model.rope_scaling import scaled_frequencies


def rope_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i/head_dim) for i in [0, head_dim/2): fp32 [head_dim / 2]."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each fp32 [B, T, 1, head_dim] for positions [B, T];
    `scaling`: a `fivefold.model.rope_scaling.RopeScaling`, None for plain RoPE."""
    attention = 1.0
    if scaling is None:
        inv_freq = rope_inverse_frequencies(head_dim, theta, device=positions.device)
    else:
        inv_freq, attention = scaled_frequencies(head_dim, theta, scaling, positions)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [B, T, 1, head_dim]
    if attention == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention, angles.sin() * attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, head_dim] by `rope_cos_sin` angles; fp32 math, result in x's dtype.

    Autograd saves only cos and sin (shared by every layer), never x.
    """
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).type_as(x)
