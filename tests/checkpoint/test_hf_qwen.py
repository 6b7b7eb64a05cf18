"""Qwen2 (Q/K/V biases) and Qwen3 (QK-norm) through `import --hf` and `export --hf`: tiny random
`transformers` models made here (nothing downloaded). Imported, fivefold's logits equal
transformers' and `sample --greedy` equals transformers' greedy `generate` token for token;
exported again, transformers loads the directory as the same family, with the same tensors
bitwise and the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from fivefold.checkpoint import Checkpointer
from fivefold.checkpoint.hf import export_hf, read_hf
from fivefold.cli.main import main
from fivefold.errors import CheckpointError
from fivefold.model import build_model
from fivefold.specs.model import param_count
from fivefold.specs.presets import model_preset
from fivefold.train.data.tokenizer import default_tokenizer

LOGIT_ATOL = 1e-5  # fp32, as tests/checkpoint/test_hf.py
PROMPT = "It is a truth universally acknowledged"
_SIZES = {
    "vocab_size": 4096,  # the default tokenizer's
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
}


def tiny_hf_model(family: str, directory):
    """A random transformers model of `family` saved with the default tokenizer; its 1-D
    tensors (norms, biases) moved off their initial ones and zeros."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(3)
    model = model_cls(config_cls(**_SIZES, **extra)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape))
    model.save_pretrained(str(directory))
    default_tokenizer().save(directory / "tokenizer.json")
    return model


def imported_model(run):
    checkpoint = run / "ckpt" / "step_0"
    spec, _ = read_hf_spec(checkpoint)
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    Checkpointer(checkpoint.parent).load(checkpoint, [model], None, model_spec=spec.to_dict())
    return spec, model.eval()


def read_hf_spec(checkpoint):
    from fivefold.checkpoint.state import read_state
    from fivefold.specs.model import ModelSpec

    fields = read_state(checkpoint).model_spec
    return ModelSpec(**{k: v for k, v in fields.items() if k != "notes"}), fields


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_imports_samples_and_exports_like_transformers(tmp_path, capsys, family):
    theirs = tiny_hf_model(family, tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    spec, ours = imported_model(run)
    assert (spec.qkv_bias, spec.qk_norm) == (family == "qwen2", family == "qwen3")
    assert sum(p.numel() for p in ours.parameters()) == param_count(spec)
    assert param_count(spec) == sum(p.numel() for p in theirs.parameters())
    tokens = torch.randint(0, spec.vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ours(tokens) - theirs(tokens).logits).abs().max()) <= LOGIT_ATOL

    capsys.readouterr()
    tokenizer = ["--tokenizer", str(run / "tokenizer.json")]
    sample = ["sample", str(run), "--prompt", PROMPT, "--greedy", "--max-tokens", "16"]
    assert main([*sample, *tokenizer]) == 0
    text = capsys.readouterr().out
    tok = default_tokenizer()
    prompt = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        generated = theirs.generate(
            prompt, max_new_tokens=16, do_sample=False, eos_token_id=tok.eod_id
        )[0, prompt.shape[1] :]
    assert text == PROMPT + tok.decode(generated.tolist(), skip_special_tokens=True) + "\n"

    out = tmp_path / "exported"
    assert main(["export", "--hf", str(out), "--from", str(run), *tokenizer]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), local_files_only=True, dtype=torch.float32
    ).eval()
    assert type(again) is type(theirs)
    written, original = load_file(str(out / "model.safetensors")), theirs.state_dict()
    assert sorted(written) == sorted(original)
    for name, value in written.items():
        assert torch.equal(value, original[name]), name
    with torch.no_grad():
        assert float((ours(tokens) - again(tokens).logits).abs().max()) <= LOGIT_ATOL


def test_biases_with_qk_norm_have_no_hf_form(tmp_path):
    spec = model_preset("tiny").with_(qkv_bias=True, qk_norm=True)
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(0)
    path = Checkpointer(tmp_path).save(1, [model], None, model_spec=spec.to_dict(), plan={})
    with pytest.raises(CheckpointError, match=r"qkv_bias and model\.qk_norm together"):
        export_hf(path, tmp_path / "hf")


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3", {"attention_bias": True}, "attention_bias = true"),
        ("qwen2", {"attention_bias": False}, "unknown field.s. attention_bias"),
    ],
)
def test_what_fivefold_does_not_build_is_named(tmp_path, family, change, message):
    tiny_hf_model(family, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        read_hf(tmp_path)
