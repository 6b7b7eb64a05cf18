"""RoPE scalings against `transformers`: the cos and sin tables of fivefold's `rope_cos_sin`
for a spec equal to those of transformers' Llama rotary embedding (its `ROPE_INIT_FUNCTIONS`)
for the same config, and the spec read from that config (`spec_from_hf_config`)."""

from __future__ import annotations

import pytest
import torch

from fivefold.model.rope import rope_cos_sin
from fivefold.model.rope_scaling import rope_scaling_of
from fivefold.specs.hf_config import spec_from_hf_config

transformers = pytest.importorskip("transformers")

HEAD_DIM, THETA, CONTEXT = 64, 10_000.0, 256
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-betas": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _config(rope: dict) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": 4 * HEAD_DIM,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 100,
        "max_position_embeddings": CONTEXT,
        "rope_parameters": {"rope_theta": THETA, **rope},
    }


def _hf_tables(config: dict, positions: torch.Tensor):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(LlamaConfig(**config))
    x = torch.zeros(1, dtype=torch.float32)
    return rotary(x, positions)


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("length", [48, 300])  # inside and beyond the original context
def test_cos_sin_equal_transformers(name, length):
    config = _config(SCALINGS[name])
    spec = spec_from_hf_config(config)
    assert spec.rope_scaling_type == SCALINGS[name]["rope_type"]
    positions = torch.arange(length).unsqueeze(0)
    cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, rope_scaling_of(spec))
    hf_cos, hf_sin = _hf_tables(config, positions)
    torch.testing.assert_close(cos[:, :, 0], hf_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, :, 0], hf_sin, rtol=0, atol=2e-6)


def test_yarn_attention_factor_by_hand():
    """yarn with factor 4 and no mscale scales cos and sin by 0.1 ln 4 + 1 = 1.1386; with
    mscale 1 / mscale_all_dim 0.8 at factor 40 by (0.1 ln 40 + 1) / (0.08 ln 40 + 1)."""
    import math

    positions = torch.zeros(1, 1, dtype=torch.long)  # angle 0: cos is the factor itself
    for name, factor in (
        ("yarn", 0.1 * math.log(4) + 1),
        ("yarn-mscale", (0.1 * math.log(40) + 1) / (0.08 * math.log(40) + 1)),
    ):
        spec = spec_from_hf_config(_config(SCALINGS[name]))
        cos, _ = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, rope_scaling_of(spec))
        assert cos.flatten()[0].item() == pytest.approx(factor, rel=1e-6)


def test_dynamic_changes_nothing_within_the_context():
    spec = spec_from_hf_config(_config(SCALINGS["dynamic"]))
    positions = torch.arange(CONTEXT).unsqueeze(0)
    scaled = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, rope_scaling_of(spec))
    plain = rope_cos_sin(positions, spec.head_dim, spec.rope_theta)
    assert torch.equal(scaled[0], plain[0]) and torch.equal(scaled[1], plain[1])
    longer = torch.arange(CONTEXT + 1).unsqueeze(0)
    grown = rope_cos_sin(longer, spec.head_dim, spec.rope_theta, rope_scaling_of(spec))[0]
    assert not torch.equal(grown[:, :CONTEXT], plain[0])
