"""Mixtral and Qwen3-MoE through `import --hf` and `export --hf`: tiny random `transformers`
models made here (nothing downloaded). Imported, fivefold's logits equal transformers' and
`sample --greedy` equals transformers' greedy `generate` token for token; exported again, the
directory holds the same per-expert tensors bitwise, transformers loads it as the same class
with the same logits, and the tokenizer comes along. Bad inputs are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fivefold.checkpoint import Checkpointer
from fivefold.checkpoint.hf import export_hf, read_hf, spec_from_llama_config
from fivefold.checkpoint.hf_experts import ExpertNames, experts_from_hf, experts_to_hf
from fivefold.checkpoint.state import read_state
from fivefold.cli.main import main
from fivefold.errors import CheckpointError
from fivefold.model import build_model
from fivefold.specs.model import ModelSpec, param_count
from fivefold.train.data.tokenizer import default_tokenizer

LOGIT_ATOL = 1e-5  # fp32, as tests/checkpoint/test_hf.py
PROMPT = "It is a truth universally acknowledged"
_SIZES = {
    "vocab_size": 4096,  # the default tokenizer's
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
}
FAMILIES = {
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"intermediate_size": 96, "num_hidden_layers": 2, "num_local_experts": 4},
    ),
    # softmax gates kept as they are (norm_topk_prob false), a leading dense layer, QK-norm
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "intermediate_size": 160,
            "moe_intermediate_size": 48,
            "num_hidden_layers": 3,
            "num_experts": 6,
            "head_dim": 32,
            "mlp_only_layers": [0],
            "norm_topk_prob": False,
            "tie_word_embeddings": True,
        },
    ),
}
_ROUTER = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate"}


def tiny_hf_model(family: str, directory):
    """A random transformers model of `family` saved with the default tokenizer: norms moved
    off their initial ones, routers wide enough apart that no top-k choice is a near tie."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(3)
    model = model_cls(config_cls(**_SIZES, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape))
            elif "gate.weight" in name and "experts" not in name:
                param.copy_(0.5 * torch.randn(param.shape))
    model.save_pretrained(str(directory))
    default_tokenizer().save(directory / "tokenizer.json")
    return model


def imported_model(run):
    checkpoint = run / "ckpt" / "step_0"
    fields = read_state(checkpoint).model_spec
    spec = ModelSpec(**{k: v for k, v in fields.items() if k != "notes"})
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    Checkpointer(checkpoint.parent).load(checkpoint, [model], None, model_spec=spec.to_dict())
    return spec, model.eval()


def _greedy(theirs, tok, max_new: int) -> str:
    prompt = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        out = theirs.generate(
            prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=tok.eod_id
        )
    return PROMPT + tok.decode(out[0, prompt.shape[1] :].tolist(), skip_special_tokens=True)


# CI keeps the fastest MoE round trip (Mixtral, ~7 s under load); the others run with `make
# parity` (Qwen3-MoE ~20 s, the EP2 export ~20 s, DeepSeek-V3's in test_hf_deepseek*.py)
@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_moe_imports_samples_and_exports_like_transformers(tmp_path, capsys, family):
    theirs = tiny_hf_model(family, tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    spec, ours = imported_model(run)
    assert (spec.experts, spec.top_k, spec.qk_norm) == (
        (4, 2, False) if family == "mixtral" else (6, 2, True)
    )
    assert (spec.dense_layers, spec.router_norm_topk) == (
        (0, True) if family == "mixtral" else (1, False)
    )
    assert sum(p.numel() for p in ours.parameters()) == param_count(spec)
    assert param_count(spec) == sum(p.numel() for p in theirs.parameters())
    tokens = torch.randint(0, spec.vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert float((ours(tokens) - expected).abs().max()) <= LOGIT_ATOL
        if family == "qwen3_moe":  # the gates renormalised, as Mixtral's: other logits
            other = build_model(spec.with_(router_norm_topk=True))
            other.to_empty(device="cpu")
            other.load_state_dict(ours.state_dict())
            assert float((other(tokens) - expected).abs().max()) > 1e-3

    capsys.readouterr()
    tokenizer = ["--tokenizer", str(run / "tokenizer.json")]
    sample = ["sample", str(run), "--prompt", PROMPT, "--greedy", "--max-tokens", "12"]
    assert main([*sample, *tokenizer]) == 0
    text = capsys.readouterr().out
    tok = default_tokenizer()
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 1
    assert text == _greedy(theirs, tok, 12) + "\n"

    out = tmp_path / "exported"
    assert main(["export", "--hf", str(out), "--from", str(run), *tokenizer]) == 0
    assert (out / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), local_files_only=True, dtype=torch.float32
    ).eval()
    assert type(again) is type(theirs)
    written = load_file(str(out / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(written) == sorted(original)  # per-expert names, as published checkpoints
    for name, value in written.items():
        assert torch.equal(value, original[name]), name
    with torch.no_grad():
        assert float((ours(tokens) - again(tokens).logits).abs().max()) <= LOGIT_ATOL


def _rewrite(directory, change):
    """Apply `change` to the tensors of directory's model.safetensors."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_expert_tensors_that_disagree_with_the_config_are_named(tmp_path):
    tiny_hf_model("qwen3_moe", tmp_path)
    expert = "model.layers.2.mlp.experts.3.up_proj.weight"
    _rewrite(tmp_path, lambda t: t.update({expert: torch.zeros(40, 64)}))
    with pytest.raises(CheckpointError, match=rf"wrong shape: {expert} is \[40, 64\], config"):
        read_hf(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.5.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.mlp\.experts\.5\.down"):
        read_hf(tmp_path)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\]"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 32}, "unknown field.s. shared_expert_"),
        ("qwen3_moe", {"num_experts": "six"}, "num_experts = 'six' is not an integer"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1"),
        ("mixtral", {"moe_intermediate_size": 32}, "unknown field.s. moe_intermediate_size"),
    ],
)
def test_what_fivefold_does_not_build_is_named(tmp_path, family, change, message):
    tiny_hf_model(family, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        read_hf(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, cls, w1",
    [
        ("mixtral", transformers.MixtralForCausalLM, "block_sparse_moe.experts.{}.w1"),
        ("deepseek", transformers.DeepseekV3ForCausalLM, "mlp.experts.{}.gate_proj"),
    ],
)
def test_an_expert_parallel_checkpoint_exports_whole(tmp_path, model, cls, w1):
    """EP2 over 2 ranks, each holding 2 of the 4 experts of each layer: the export gathers
    them (DCP -> per-expert safetensors), and transformers' logits on it equal the live
    expert-parallel model's on both ranks (DeepSeek-V3: its score biases balanced by the step
    exported with it)."""
    from ckpt_harness import run_ranks
    from ckpt_workers import save_and_forward

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))
    plan = {"dp_shard": 2, "zero": 1, "ep": 2, "micro_batch": 4}
    ranks = run_ranks(2, save_and_forward, plan, str(tmp_path / "ckpt"), model, tokens.tolist())
    export_hf(Path(ranks[0]["path"]), tmp_path / "hf")
    theirs = cls.from_pretrained(
        str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32
    ).eval()
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    experts = [written[f"model.layers.1.{w1.format(e)}.weight"] for e in range(4)]
    assert all(not torch.equal(experts[0], other) for other in experts[1:])
    if model == "deepseek":
        bias = written["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.abs().min() > 0  # balanced once, +-0.01 per expert
    with torch.no_grad():
        expected = theirs(tokens).logits
    for rank in ranks:
        assert float((torch.tensor(rank["logits"]) - expected).abs().max()) <= LOGIT_ATOL


@pytest.mark.parametrize(
    "name, parameters",
    [("mixtral-8x7b", 46_702_792_704), ("qwen3-30b-a3b", 30_532_122_624)],  # tests/test_hf_config
)
def test_published_moe_configs_are_importable_with_exact_counts(name, parameters):
    """The published config.json files (every field they carry known) read by `import --hf`
    as by `plan --hf-config`, with transformers' parameter count."""
    config = json.loads(
        (Path(__file__).parents[1] / "data" / "hf_configs" / f"{name}.json").read_text()
    )
    spec = spec_from_llama_config(config)
    assert spec.is_moe and param_count(spec) == parameters
    assert spec.router_norm_topk  # Mixtral always, Qwen3-30B-A3B's norm_topk_prob = true


def test_expert_mapping_splits_and_stacks_back():
    """`hf_experts` as another family reuses it: routed experts split per expert and stacked
    back bitwise; a DeepSeek-V3-like naming with shared experts and a router bias."""
    names = ExpertNames(
        block="mlp",
        gate="gate_proj",
        up="up_proj",
        down="down_proj",
        shared="shared_experts",
        extra=(("router.score_bias", "gate.e_score_correction_bias"),),
    )
    w2 = torch.randn(3, 8, 5)  # [E, D, F]
    split = experts_to_hf(names, 4, "w2", w2)
    assert list(split) == [f"model.layers.4.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    assert torch.equal(split["model.layers.4.mlp.experts.1.down_proj.weight"], w2[1])
    assert torch.equal(experts_from_hf(names, 4, "w2", split), w2)
    assert names.other_tensors() == {
        "router.weight": "mlp.gate.weight",
        "router.score_bias": "mlp.gate.e_score_correction_bias",
        "shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
        "shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
    }


@pytest.mark.parametrize(
    "change, message",
    [
        ({"shared_experts": 1}, r"model.shared_experts = 1 \(Mixtral and Qwen3-MoE have none\)"),
        ({"dense_layers": 1}, "model.dense_layers = 1 without model.qk_norm"),
        ({"router_norm_topk": False}, "model.router_norm_topk = false"),
        ({"qkv_bias": True}, "model.qkv_bias with experts"),
        ({"sliding_window": 16, "sliding_layers": 1}, "a sliding window in 1 of 2 layers"),
    ],
)
def test_experts_without_a_hugging_face_form_are_named(change, message):
    """What neither Mixtral nor Qwen3-MoE can hold is refused by name, never written wrong."""
    from fivefold.checkpoint.hf_families import hf_family

    mixtral = ModelSpec(layers=2, experts=4, top_k=2, expert_ffn=32)
    assert hf_family(mixtral) == "mixtral"
    assert hf_family(mixtral.with_(qk_norm=True, dense_layers=1)) == "qwen3_moe"
    with pytest.raises(CheckpointError, match=message):
        hf_family(mixtral.with_(**change))
