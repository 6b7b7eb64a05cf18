"""Llama 3.1-style RoPE scaling ("llama3" rope type): longer context from the same frequencies.

Details: docs/internals.md (`fivefold.model.rope_scaling`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    factor: float  # s >= 1
    low_freq_factor: float  # a
    high_freq_factor: float  # b > a
    original_seq_len: int  # L, tokens


def rope_scaling_of(spec) -> RopeScaling | None:
    """The scaling a ModelSpec asks for, or None for plain RoPE."""
    factor = getattr(spec, "rope_scaling_factor", 1.0)
    if factor == 1.0:
        return None
    return RopeScaling(
        factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor, spec.rope_original_seq_len
    )


def scale_inverse_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Apply the llama3 rule (module docstring) to fp32 inverse frequencies [head_dim / 2]."""
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
