"""DeepSeek-V3 (latent attention, dense leading layer, shared and routed experts, the sigmoid
router with its score-correction bias and group-limited top-k) against `transformers`' own
DeepseekV3ForCausalLM: a tiny random model made here (nothing downloaded), its tensors mapped
to fivefold's (`fivefold.checkpoint.hf_deepseek`), give the same logits and the same greedy
tokens; fivefold's tensors mapped back load into transformers with the same logits."""

from __future__ import annotations

import pytest
import torch
import transformers

from fivefold.checkpoint.hf import check_exportable
from fivefold.checkpoint.hf_deepseek import config_fields, deinterleave_rope_rows, from_hf, to_hf
from fivefold.errors import CheckpointError
from fivefold.model import build_model
from fivefold.model.generate import generate
from fivefold.model.latent_attention import softmax_scale_factor
from fivefold.specs.hf_config import spec_from_hf_config
from fivefold.specs.model import ModelSpec, param_count

LOGIT_ATOL = 1e-5  # fp32, as tests/checkpoint/test_hf.py
SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def tiny_deepseek(q_lora_rank: int | None, interleave: bool = True):
    """A random transformers DeepSeek-V3 whose norms and router biases are off their initial
    values (the bias large enough to change which experts are chosen)."""
    torch.manual_seed(5)
    config = transformers.DeepseekV3Config(
        **SIZES, q_lora_rank=q_lora_rank, rope_interleave=interleave
    )
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape))
    return model


def fivefold_model(spec: ModelSpec):
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.eval()


@pytest.mark.slow  # CI: the mapping back below; the CLI round trip (slow) covers import
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_deepseek_logits_and_greedy_tokens_equal_transformers(q_lora_rank):
    theirs = tiny_deepseek(q_lora_rank)
    spec = spec_from_hf_config(theirs.config.to_dict(), name="tiny-deepseek")
    assert spec.router_score == "sigmoid" and (spec.router_groups, spec.router_top_groups) == (4, 2)
    assert param_count(spec) == sum(p.numel() for p in theirs.parameters())
    ours = fivefold_model(spec)
    ours.load_state_dict(from_hf(theirs.state_dict(), spec, rope_interleave=True))
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)
    prompt = tokens[0, :10].tolist()
    greedy = theirs.generate(
        tokens[:1, :10], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    with torch.no_grad():
        assert generate(ours, prompt, 8, seq_len=64) == greedy[0, 10:].tolist()


def test_deepseek_tensors_mapped_back_load_into_transformers():
    theirs = tiny_deepseek(32)
    spec = spec_from_hf_config(theirs.config.to_dict(), name="tiny-deepseek")
    ours = fivefold_model(spec)
    with torch.no_grad():
        for routing in (moe.routing for moe in ours.moe_layers()):
            routing.score_bias.copy_(0.3 * torch.randn(routing.score_bias.shape))
    config = transformers.DeepseekV3Config(**{**SIZES, **config_fields(spec), "q_lora_rank": 32})
    back = transformers.DeepseekV3ForCausalLM(config).eval()
    back.load_state_dict(to_hf(ours.state_dict(), spec), strict=True)
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ours(tokens), atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sliding_window": 8}, r"model\.sliding_window = 8 \(DeepSeek-V3 has no window\)"),
        ({"router_score": "softmax"}, r"model\.router_score = 'softmax' \(DeepSeek-V3's router"),
        ({"norm_eps": 1e-5}, r"model\.norm_eps = 1e-05 \(transformers' DeepSeek-V3 normalises"),
    ],
)
def test_latent_attention_without_a_deepseek_form_is_refused_by_name(change, message):
    spec = ModelSpec(
        layers=2, hidden=8, heads=2, head_dim=6, attention="mla", kv_lora_rank=2,
        qk_rope_head_dim=4, experts=4, top_k=2, expert_ffn=8, router_score="sigmoid",
        norm_eps=1e-6,
    )  # fmt: skip
    check_exportable(spec)
    with pytest.raises(CheckpointError, match=message):
        check_exportable(spec.with_(**change))


def test_rope_rows_deinterleave_by_hand():
    spec = ModelSpec(
        hidden=8, heads=2, head_dim=6, attention="mla", kv_lora_rank=2, qk_rope_head_dim=4
    )
    rows = torch.arange(12.0).unsqueeze(1)  # head 0: rows 0-5 (rope 2-5), head 1: 6-11
    assert deinterleave_rope_rows(rows, spec, heads=True).flatten().tolist() == [
        0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11,
    ]  # fmt: skip
    kv_rows = torch.arange(6.0).unsqueeze(1)  # latent 0-1, rope 2-5
    assert deinterleave_rope_rows(kv_rows, spec, heads=False).flatten().tolist() == [
        0, 1, 2, 4, 3, 5,
    ]  # fmt: skip


def test_yarn_softmax_scale_factor_by_hand():
    spec = ModelSpec(
        hidden=8, heads=2, head_dim=6, attention="mla", kv_lora_rank=2, qk_rope_head_dim=4,
        rope_scaling_type="yarn", rope_scaling_factor=40.0, rope_original_seq_len=4096,
        rope_mscale_all_dim=1.0,
    )  # fmt: skip
    mscale = 0.1 * 1.0 * 3.6888794541139363 + 1.0  # ln 40 = 3.68887945...
    assert softmax_scale_factor(spec) == pytest.approx(mscale**2, rel=1e-12)
    assert softmax_scale_factor(spec.with_(rope_mscale_all_dim=0.0)) == 1.0


def test_runtime_flops_are_the_planners_plus_the_padded_values():
    """torch's FLOP counter over fivefold's MLA forward (one document per row: SDPA's math
    kernel, which scores every query-key pair) equals the planner's non-causal count plus what
    the values' zero padding to the key width adds: 2 (d - d_v) FLOPs per head and pair."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fivefold.specs.flops import forward_flops_per_token

    spec = ModelSpec(
        layers=2, hidden=64, heads=4, head_dim=24, ffn=96, vocab=512, seq_len=32,
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
    )  # fmt: skip
    model = fivefold_model(spec)
    batch, seq = 2, 32
    math = sdpa_kernel(SDPBackend.MATH)  # matmuls the counter sees (CPU flash has no formula)
    with torch.no_grad(), math, FlopCounterMode(display=False) as counter:
        model(torch.zeros(batch, seq, dtype=torch.long))
    planned = batch * seq * forward_flops_per_token(spec, seq, causal=False)
    padding = spec.layers * 2 * batch * spec.heads * seq * seq * (24 - 12)
    assert counter.get_total_flops() == planned + padding


def test_latent_attention_takes_the_layers_sliding_window():
    """A window in an MLA model is applied, not dropped: its last token's output differs from
    the full-attention model's with the same weights, the first window's tokens do not."""
    spec = ModelSpec(
        layers=1, hidden=64, heads=4, head_dim=24, ffn=96, vocab=128, seq_len=32,
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
    )  # fmt: skip
    full, windowed = fivefold_model(spec), fivefold_model(spec.with_(sliding_window=8))
    assert windowed.layers["0"].attention.core.window == 8
    tokens = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = full(tokens), windowed(tokens)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-4
