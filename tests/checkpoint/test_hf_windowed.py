"""Sliding-window families through `import --hf` and `export --hf`: tiny random `transformers`
models made here (nothing downloaded). Mistral (a window in every layer): imported, fivefold's
logits equal transformers' and `sample --greedy` equals transformers' greedy `generate` token
for token; exported again, transformers loads the directory as Mistral with the same tensors
bitwise and the same logits. Windowed Qwen2 and Qwen3 (`layer_types`: the last layers, and
alternating layers) import and export with equal logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_hf_qwen import _SIZES, LOGIT_ATOL, PROMPT, imported_model

from fivefold.cli.main import main
from fivefold.errors import CheckpointError
from fivefold.specs.model import param_count
from fivefold.train.data.tokenizer import default_tokenizer

WINDOW = 8  # keys per query: well inside the 40-token rows and the generated text
TYPES = ["sliding_attention", "full_attention"]


def _tiny(config_cls, model_cls, directory, **extra):
    torch.manual_seed(5)
    model = model_cls(config_cls(**(_SIZES | extra))).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape))
    model.save_pretrained(str(directory))
    default_tokenizer().save(directory / "tokenizer.json")
    return model


def _logit_gap(ours, theirs, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((ours(tokens) - theirs(tokens).logits).abs().max())


def _export(run, out, theirs):
    tokenizer = ["--tokenizer", str(run / "tokenizer.json")]
    assert main(["export", "--hf", str(out), "--from", str(run), *tokenizer]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), local_files_only=True, dtype=torch.float32
    ).eval()
    assert type(again) is type(theirs)
    written, original = load_file(str(out / "model.safetensors")), theirs.state_dict()
    assert sorted(written) == sorted(original)
    for name, value in written.items():
        assert torch.equal(value, original[name]), name
    return again, json.loads((out / "config.json").read_text())


def test_mistral_imports_samples_and_exports_like_transformers(tmp_path, capsys):
    theirs = _tiny(
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        tmp_path / "hf",
        sliding_window=WINDOW,
    )
    run = tmp_path / "run"
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    spec, ours = imported_model(run)
    assert (spec.sliding_window, spec.windowed_layers) == (WINDOW, spec.layers)
    assert param_count(spec) == sum(p.numel() for p in theirs.parameters())
    assert _logit_gap(ours, theirs, spec.vocab) <= LOGIT_ATOL
    for layer in ours.layers.values():  # the window matters at this length
        layer.attention.core.window = 0
    assert _logit_gap(ours, theirs, spec.vocab) > 1e-3
    for layer in ours.layers.values():
        layer.attention.core.window = WINDOW

    capsys.readouterr()
    tokenizer = ["--tokenizer", str(run / "tokenizer.json")]
    sample = ["sample", str(run), "--prompt", PROMPT, "--greedy", "--max-tokens", "16"]
    assert main([*sample, *tokenizer]) == 0
    text = capsys.readouterr().out
    tok = default_tokenizer()
    prompt = torch.tensor([tok.encode(PROMPT)])
    assert prompt.shape[1] + 16 > 2 * WINDOW
    with torch.no_grad():
        generated = theirs.generate(
            prompt, max_new_tokens=16, do_sample=False, eos_token_id=tok.eod_id
        )[0, prompt.shape[1] :]
    assert text == PROMPT + tok.decode(generated.tolist(), skip_special_tokens=True) + "\n"

    again, config = _export(run, tmp_path / "exported", theirs)
    assert (config["model_type"], config["sliding_window"]) == ("mistral", WINDOW)
    assert _logit_gap(ours, again, spec.vocab) <= LOGIT_ATOL


@pytest.mark.parametrize(
    "family, layer_types, fields",
    [
        ("qwen2", ["full_attention", "sliding_attention"], {"sliding_layers": 1}),
        ("qwen3", TYPES * 2, {"sliding_pattern": "sf"}),
    ],
)
def test_windowed_qwen_imports_and_exports_like_transformers(tmp_path, family, layer_types, fields):
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    sizes = {"num_hidden_layers": len(layer_types), "use_sliding_window": True}
    extra = {"sliding_window": WINDOW, "layer_types": layer_types, **sizes}
    theirs = _tiny(config_cls, model_cls, tmp_path / "hf", **extra)
    run = tmp_path / "run"
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    spec, ours = imported_model(run)
    assert spec.sliding_window == WINDOW
    assert {key: getattr(spec, key) for key in fields} == fields
    assert [spec.layer_window(i) > 0 for i in range(spec.layers)] == [
        kind == "sliding_attention" for kind in layer_types
    ]
    assert _logit_gap(ours, theirs, spec.vocab) <= LOGIT_ATOL
    again, config = _export(run, tmp_path / "exported", theirs)
    assert config["layer_types"] == layer_types
    assert _logit_gap(ours, again, spec.vocab) <= LOGIT_ATOL


def test_unknown_layer_type_is_named(tmp_path):
    from fivefold.checkpoint.hf import read_hf

    _tiny(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "layer_types": ["full_attention", "chunked_attention"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((CheckpointError,), match=r"layer_types = .*chunked_attention"):
        read_hf(tmp_path)


WINDOWED_MOE = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {"use_sliding_window": True, "moe_intermediate_size": 32, "head_dim": 16},
    ),
}


@pytest.mark.slow  # one MoE round trip in CI: Mixtral's (test_hf_moe.py)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_windowed_moe_imports_and_exports_like_transformers(tmp_path, family):
    """Mixtral and Qwen3-MoE with a window in every layer: imported with transformers'
    logits, exported with the window written back (transformers' logits equal again; the same
    weights without the window give other logits)."""
    from fivefold.checkpoint.hf import export_hf, import_hf

    config_cls, model_cls, extra = WINDOWED_MOE[family]
    experts = {"num_local_experts": 4} if family == "mixtral" else {"num_experts": 4}
    fields = _SIZES | {"intermediate_size": 64, "num_experts_per_tok": 2} | extra | experts
    torch.manual_seed(6)
    theirs = model_cls(config_cls(**fields, sliding_window=WINDOW)).eval()
    theirs.save_pretrained(str(tmp_path / "hf"))
    path = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    spec, ours = imported_model(tmp_path)
    assert (spec.sliding_window, spec.windowed_layers) == (WINDOW, 2)
    assert _logit_gap(ours, theirs, spec.vocab) <= LOGIT_ATOL
    export_hf(path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["sliding_window"] == WINDOW
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), local_files_only=True, dtype=torch.float32
    ).eval()
    assert again.config.sliding_window == WINDOW
    assert _logit_gap(ours, again, spec.vocab) <= LOGIT_ATOL
    fields.pop("use_sliding_window", None)
    unwindowed = model_cls(config_cls(**fields)).eval()  # no window: other logits
    unwindowed.load_state_dict(again.state_dict())
    assert _logit_gap(ours, unwindowed, spec.vocab) > 1e-3
