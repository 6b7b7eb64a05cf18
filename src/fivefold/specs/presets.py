"""Model presets: published architectures for planning, tiny and small ones that train on CPU.

Details: docs/internals.md (`fivefold.specs.presets`).
"""

from __future__ import annotations

from fivefold.errors import ConfigError
from fivefold.specs.model import ModelSpec

_LLAMA3 = {"vocab": 128_256, "rope_theta": 500_000.0, "kv_heads": 8, "seq_len": 8192}

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama3-8b", 32, 4096, 32, ffn=14336, **_LLAMA3),
        ModelSpec("llama3-70b", 80, 8192, 64, ffn=28672, **_LLAMA3),
        ModelSpec("llama3-405b", 126, 16384, 128, ffn=53248, **_LLAMA3),
        ModelSpec(
            "vizz-7b",
            32,
            4096,
            32,
            kv_heads=32,
            ffn=11008,
            vocab=32000,
            seq_len=131072,
            rope_theta=500_000.0,
        ),
        ModelSpec(
            "gpt3-175b",
            96,
            12288,
            96,
            ffn=49152,
            vocab=50257,
            seq_len=2048,
            mlp="gelu",
            tied_embeddings=True,
        ),
        ModelSpec(
            "mixtral-8x7b",
            32,
            4096,
            32,
            kv_heads=8,
            ffn=14336,
            vocab=32000,
            seq_len=32768,
            rope_theta=1e6,
            experts=8,
            top_k=2,
            expert_ffn=14336,
        ),
        ModelSpec(
            "deepseek-v3",
            61,
            7168,
            128,
            kv_heads=128,
            head_dim=51,
            ffn=18432,
            vocab=129_280,
            seq_len=4096,
            rope_theta=10_000.0,
            experts=256,
            top_k=8,
            expert_ffn=2048,
            shared_experts=1,
            dense_layers=3,
            router_aux_loss_coef=0.0001,
        ),
        ModelSpec(
            "tiny", 2, 64, 4, kv_heads=2, ffn=176, vocab=4096, seq_len=128, rope_theta=10_000.0
        ),
        ModelSpec(
            "tiny-moe",
            2,
            64,
            4,
            kv_heads=2,
            ffn=176,
            vocab=4096,
            seq_len=128,
            rope_theta=10_000.0,
            experts=4,
            top_k=2,
            expert_ffn=64,
            shared_experts=1,
        ),
        ModelSpec(
            "small", 6, 256, 8, kv_heads=4, ffn=688, vocab=4096, seq_len=256, rope_theta=10_000.0
        ),
        ModelSpec(
            "wide-1b",
            4,
            4096,
            32,
            kv_heads=8,
            ffn=14336,
            vocab=32000,
            seq_len=2048,
            rope_theta=500_000.0,
        ),
    )
}


def model_preset(name: str) -> ModelSpec:
    if name not in MODEL_PRESETS:
        raise ConfigError(
            f"model preset {name!r} is unknown; choose one of {', '.join(MODEL_PRESETS)} "
            "(`fivefold presets` lists them with parameter counts)."
        )
    return MODEL_PRESETS[name]
