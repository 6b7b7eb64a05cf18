"""Tiny model specs and a materialised-model helper shared by the single-process model tests."""

from __future__ import annotations

from fivefold.model import Transformer, build_model
from fivefold.specs import ModelSpec

TINY = ModelSpec(
    "t",
    layers=2,
    hidden=32,
    heads=4,
    kv_heads=2,
    ffn=64,
    vocab=128,
    seq_len=32,
    rope_theta=10_000.0,
)
# TINY with 4 experts (top-2, 16-wide) and one shared expert in every layer
TINY_MOE = TINY.with_(name="tm", experts=4, top_k=2, expert_ffn=16, shared_experts=1)


def make(spec: ModelSpec, seed: int = 0) -> Transformer:
    """The model of `spec` on CPU with its weights initialised from `seed`."""
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model
