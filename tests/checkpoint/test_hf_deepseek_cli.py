"""DeepSeek-V3 through `import --hf` and `export --hf`: a tiny random `DeepseekV3ForCausalLM`
made here (nothing downloaded: latent attention with yarn RoPE and its softmax mscale, a dense
leading layer, a shared expert, 8 routed experts in 4 groups of which 2 are kept, the
score-correction bias off zero). Imported, fivefold's logits equal transformers' and `sample
--greedy` equals transformers' greedy `generate` token for token; exported again,
transformers loads it as the same class with the same logits, the tokenizer carried along.
Also both expert layouts (per expert, transformers 5's fused `gate_up_proj`) on import."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_hf_deepseek import SIZES as DEEPSEEK_SIZES
from test_hf_moe import PROMPT, _greedy, imported_model, tiny_hf_model

from fivefold.checkpoint.hf import read_hf
from fivefold.cli.main import main
from fivefold.model import build_model
from fivefold.specs.model import ModelSpec, param_count
from fivefold.train.data.tokenizer import default_tokenizer

LOGIT_ATOL = 1e-5  # fp32, as tests/checkpoint/test_hf.py
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}
SIZES = {  # the in-memory comparison's model, at the default tokenizer's vocabulary
    **DEEPSEEK_SIZES,
    "vocab_size": 4096,
    "num_hidden_layers": 2,
    "q_lora_rank": 32,
    "rope_scaling": YARN,
}


def tiny_hf_deepseek(directory):
    """A random transformers DeepSeek-V3 saved with the default tokenizer: norms and router
    biases off their initial values, router rows far enough apart that no choice is a tie."""
    torch.manual_seed(5)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SIZES)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape))
    model.save_pretrained(str(directory))
    default_tokenizer().save(directory / "tokenizer.json")
    return model


@pytest.mark.slow  # one MoE round trip in CI: Mixtral's (test_hf_moe.py)
def test_deepseek_imports_samples_and_exports_like_transformers(tmp_path, capsys):
    theirs = tiny_hf_deepseek(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    spec, ours = imported_model(run)
    assert (spec.attention, spec.experts, spec.shared_experts, spec.dense_layers) == (
        "mla", 8, 1, 1
    )  # fmt: skip
    assert (spec.router_groups, spec.router_top_groups, spec.rope_scaling_type) == (4, 2, "yarn")
    assert spec.rope_mscale_all_dim == 0.7
    assert sum(p.numel() for p in theirs.parameters()) == param_count(spec)
    tokens = torch.randint(0, spec.vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert float((ours(tokens) - expected).abs().max()) <= LOGIT_ATOL

    capsys.readouterr()
    tokenizer = ["--tokenizer", str(run / "tokenizer.json")]
    sample = ["sample", str(run), "--prompt", PROMPT, "--greedy", "--max-tokens", "8"]
    assert main([*sample, *tokenizer]) == 0
    text = capsys.readouterr().out
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 1
    assert text == _greedy(theirs, default_tokenizer(), 8) + "\n"

    out = tmp_path / "exported"
    assert main(["export", "--hf", str(out), "--from", str(run), *tokenizer]) == 0
    assert (out / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["rope_interleave"]) == ("deepseek_v3", False)
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), local_files_only=True, dtype=torch.float32
    ).eval()
    assert type(again) is type(theirs)
    written = load_file(str(out / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(written) == sorted(original)  # per-expert names, as published checkpoints
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(written[bias], original[bias])
    with torch.no_grad():
        assert float((ours(tokens) - again(tokens).logits).abs().max()) <= LOGIT_ATOL


def test_fused_experts_of_transformers_5_import_as_per_expert_ones(tmp_path):
    """transformers 5 holds experts fused (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj`,
    the router at `mlp.gate`): its in-memory state written as is imports to the same tensors as
    the per-expert files `save_pretrained` writes (transformers 4.x's layout)."""
    theirs = tiny_hf_model("mixtral", tmp_path)
    fused = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused  # transformers 5's layout
    _, per_expert = read_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    spec, got = read_hf(tmp_path)
    assert sorted(got) == sorted(per_expert)
    for name, value in per_expert.items():
        assert torch.equal(got[name], value), name
    experts = theirs.model.layers[1].mlp.experts
    width = experts.gate_up_proj.shape[1] // 2
    assert torch.equal(got["layers.1.moe.experts.w3"], experts.gate_up_proj[:, width:])
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.load_state_dict(got)
    tokens = torch.randint(0, spec.vocab, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (model.eval()(tokens) - theirs(tokens).logits).abs().max()
    assert float(diff) <= LOGIT_ATOL


def test_latent_attention_without_experts_exports_as_deepseek_v3(tmp_path):
    """A dense MLA model (yarn, its mscale) as DeepSeek-V3 whose every layer is a leading dense
    one: transformers loads it with fivefold's logits, and import reads it back unchanged."""
    from fivefold.checkpoint import Checkpointer
    from fivefold.checkpoint.hf import export_hf

    spec = ModelSpec(
        name="mla", layers=2, hidden=64, heads=4, head_dim=24, ffn=96, vocab=512, seq_len=64,
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
        rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_seq_len=16,
        rope_mscale_all_dim=0.7, norm_eps=1e-6,
    )  # fmt: skip
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    path = Checkpointer(tmp_path / "ckpt").save(
        1, [model], None, model_spec=spec.to_dict(), plan={}
    )
    export_hf(path, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32
    ).eval()
    assert type(theirs) is transformers.DeepseekV3ForCausalLM
    assert theirs.config.first_k_dense_replace == 2
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (model.eval()(tokens) - theirs(tokens).logits).abs().max()
    assert float(diff) <= LOGIT_ATOL
    assert read_hf(tmp_path / "hf")[0] == spec
