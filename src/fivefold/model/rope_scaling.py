"""RoPE scalings, longer context from the same frequencies, computed as `transformers` computes
them (its `ROPE_INIT_FUNCTIONS`, checked against it in tests/test_rope_scaling.py):

- "llama3" (Llama 3.1): frequencies between two wavelengths blended from f_i to f_i / s;
- "linear": every frequency f_i / s (position interpolation);
- "dynamic" (NTK): theta grows with the forward's length n = max(position) + 1 once n > L,
  theta' = theta (s n / L - (s - 1))^(d / (d - 2)); unchanged while n <= L;
- "yarn": f_i / s below the rotation count beta_slow, f_i above beta_fast, a linear ramp between
  (over dimension indices), and cos and sin multiplied by the attention factor.

Not "longrope" (Phi-3), a deliberate limit (`LONGROPE_LIMIT`); `fivefold plan` plans it.

Details: docs/internals.md (`fivefold.model.rope_scaling`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LONGROPE_LIMIT = (
    "longrope is a deliberate limit: it scales each frequency by its own entry of two lists "
    "(short_factor, long_factor), which are not model fields, and transformers picks the long "
    "list once a forward is longer than original_max_position_embeddings, so a packed training "
    "batch's frequencies would depend on the batch's length, not on the positions"
)


@dataclass(frozen=True)
class RopeScaling:
    factor: float  # s >= 1
    low_freq_factor: float  # llama3: a
    high_freq_factor: float  # llama3: b > a
    original_seq_len: int  # L, tokens (dynamic: the length beyond which theta grows)
    kind: str = "llama3"  # `ModelSpec.rope_scaling_type`
    beta_fast: float = 32.0  # yarn: rotations above which frequencies stay
    beta_slow: float = 1.0  # yarn: rotations below which frequencies are divided by s
    attention_factor: float = 0.0  # yarn: factor on cos and sin; 0 = 0.1 ln(s) + 1
    truncate: bool = True  # yarn: ramp bounds rounded out to whole dimensions


def rope_scaling_of(spec) -> RopeScaling | None:
    """The scaling a ModelSpec asks for, or None for plain RoPE."""
    factor = getattr(spec, "rope_scaling_factor", 1.0)
    if factor == 1.0:
        return None
    return RopeScaling(
        factor,
        spec.rope_low_freq_factor,
        spec.rope_high_freq_factor,
        spec.rope_original_seq_len,
        spec.rope_scaling_type,
        spec.rope_beta_fast,
        spec.rope_beta_slow,
        spec.rope_attention_factor,
        spec.rope_truncate,
    )


def scaled_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling, positions: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """(fp32 inverse frequencies [head_dim / 2], factor on cos and sin) of `scaling`; the
    positions [B, T] matter to "dynamic" only (their maximum, read on the device)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    exponents = exponents / head_dim
    plain = 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        return plain / scaling.factor, 1.0
    if scaling.kind == "dynamic":
        return _dynamic(theta, exponents, plain, scaling, positions), 1.0
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, exponents, scaling)
    return scale_inverse_frequencies(plain, scaling), 1.0


def _dynamic(theta, exponents, plain, scaling: RopeScaling, positions) -> torch.Tensor:
    s, length, dim = scaling.factor, scaling.original_seq_len, 2 * exponents.numel()
    seen = positions.max() + 1  # tokens the forward covers, a device scalar (no read-back)
    grown = theta * ((s * seen / length) - (s - 1)) ** (dim / (dim - 2))
    return torch.where(seen > length, 1.0 / (grown**exponents), plain)


def _yarn(head_dim: int, theta: float, exponents, scaling: RopeScaling):
    s, dim = scaling.factor, head_dim

    def dimension(rotations: float) -> float:  # the dimension index turning `rotations` in L
        turns = scaling.original_seq_len / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against 0 / 0
    index = torch.arange(dim // 2, dtype=torch.float32, device=exponents.device)
    keep = 1 - torch.clamp((index - low) / (high - low), 0, 1)  # share of the unscaled f_i
    wavelengths = theta**exponents  # / 2 pi
    out = 1.0 / (s * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep
    attention = scaling.attention_factor or (0.1 * math.log(s) + 1.0 if s > 1 else 1.0)
    return out, attention


def scale_inverse_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Apply the llama3 rule (docs/internals.md) to fp32 inverse frequencies [head_dim / 2]."""
    s, a, b, length = (
        scaling.factor,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
        scaling.original_seq_len,
    )
    wavelength = 2 * math.pi / inv_freq
    t = (length / wavelength - a) / (b - a)
    medium = (1 - t) * inv_freq / s + t * inv_freq
    out = torch.where(wavelength > length / a, inv_freq / s, medium)
    return torch.where(wavelength < length / b, inv_freq, out)
