"""Hugging Face interop: transformers' LlamaForCausalLM on exported weights gives fivefold's
logits (tiny preset, fp32), and import -> checkpoint -> export round-trips bitwise. Nothing is
downloaded: the config is written locally and loaded with local_files_only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from fivefold.checkpoint import Checkpointer
from fivefold.checkpoint.hf import export_hf, import_hf, read_hf, spec_from_llama_config
from fivefold.cli.main import main
from fivefold.errors import CheckpointError
from fivefold.model import build_model
from fivefold.specs.presets import model_preset
from fivefold.train.data.tokenizer import default_tokenizer

TINY_RECIPE = str(Path(__file__).parents[2] / "configs" / "tiny-cpu.toml")
QUIET = ["--no-progress", "train.tensorboard=false", "train.log_every=1"]

LOGIT_ATOL = 1e-5  # fp32; measured 0 (the same operations in the same order)


def trained_like_model(tied: bool):
    """The tiny preset with random (not unit) norm weights, so every tensor is exercised."""
    spec = model_preset("tiny").with_(tied_embeddings=tied)
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=11)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=g))
    return spec, model


@pytest.mark.parametrize("tied", [False, True])
def test_llama_logits_match_and_round_trip(tmp_path, tied):
    spec, model = trained_like_model(tied)
    path = Checkpointer(tmp_path / "ckpt").save(
        7, [model], None, model_spec=spec.to_dict(), plan={}
    )
    summary = export_hf(path, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is tied
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32
    ).eval()
    assert summary["parameters"] == sum(p.numel() for p in hf.parameters())
    tokens = torch.randint(0, spec.vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.shape == theirs.shape == (2, 48, spec.vocab)
    assert float((ours - theirs).abs().max()) <= LOGIT_ATOL

    imported = import_hf(tmp_path / "hf", tmp_path / "run" / "ckpt")
    again = build_model(spec)
    again.to_empty(device="cpu")
    again.init_weights(seed=0)
    state = Checkpointer(imported.parent).load(imported, [again], None, model_spec=spec.to_dict())
    assert state.contents == ["model"] and state.step == 0
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_export_halves_the_size(tmp_path):
    spec, model = trained_like_model(False)
    path = Checkpointer(tmp_path / "ckpt").save(
        1, [model], None, model_spec=spec.to_dict(), plan={}
    )
    fp32 = export_hf(path, tmp_path / "a", "fp32")
    bf16 = export_hf(path, tmp_path / "b", "bf16")
    assert abs(bf16["bytes"] / fp32["bytes"] - 0.5) < 0.01
    _, tensors = read_hf(tmp_path / "b")
    assert torch.equal(tensors["norm.weight"], model.norm.weight.detach().bfloat16().float())


def test_moe_without_a_hugging_face_form_is_refused(tmp_path):
    """tiny-moe has a shared expert, which neither Mixtral nor Qwen3-MoE has."""
    spec = model_preset("tiny-moe")
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(0)
    path = Checkpointer(tmp_path).save(1, [model], None, model_spec=spec.to_dict(), plan={})
    with pytest.raises(CheckpointError, match=r"model.shared_experts = 1 \(Mixtral and Qwen3-MoE"):
        export_hf(path, tmp_path / "hf")


@pytest.mark.parametrize(
    "change, says",
    [
        ({}, "quantization_config (fp8 weights with block scales)"),
        ({"quantization_config": None, "scoring_func": "softmax"}, "scoring_func = 'softmax'"),
        ({"quantization_config": None, "qk_head_dim": 64}, "qk_head_dim = 64 is not"),
        ({"quantization_config": None, "rms_norm_eps": 1e-5}, "rms_norm_eps = 1e-05 (transf"),
    ],
)
def test_what_deepseek_v3_import_does_not_read_is_named(change, says):
    """The published DeepSeek-V3 config (fp8 weights) and a config whose router scores or head
    width transformers' model would not build: named, never "remove the fields"."""
    path = Path(__file__).parents[1] / "data" / "hf_configs" / "deepseek-v3.json"
    config = json.loads(path.read_text()) | change
    with pytest.raises(CheckpointError) as err:
        spec_from_llama_config(config)
    assert says in str(err.value) and "remove them" not in str(err.value)
    if not change:  # without the quantization, the same config imports
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        assert spec_from_llama_config(config).attention == "mla"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 5e5}},
            "RoPE type 'longrope' .*longrope is a deliberate limit: .*short_factor, long_factor",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "yarn .* without factor"),
        (  # a key that changes the frequencies and is not read: named, never dropped
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "partial_rotary_factor": 0.5,
                }
            },
            "linear RoPE key.s. partial_rotary_factor",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "llama3 RoPE scaling without",
        ),
        (  # the two spellings of the same settings disagree
            {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
            "conflicting RoPE settings",
        ),
        (
            {
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
                "rope_parameters": {"rope_type": "llama3", "factor": 4.0},
            },
            "factor: rope_parameters says 4.0, rope_scaling/rope_theta say 8.0",
        ),
        ({"hidden_size": "sixty-four"}, "hidden_size = 'sixty-four' is not an integer"),
        ({"hidden_size": "64"}, "hidden_size = '64' is not an integer"),  # a quoted number
        ({"num_hidden_layers": 2.5}, "num_hidden_layers = 2.5 is not an integer"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps = '1e-5' is not a number"),
        ({"attention_dropout": "0.1"}, "attention_dropout = '0.1' is not a number"),
        ({"rope_theta": "5e5"}, "rope_theta = '5e5' is not a number"),
        ({"num_attention_heads": 0}, "num_attention_heads = 0 must be at least 1"),
        ({"attention_bias": True}, "attention_bias = true"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"model_type": "gemma"}, "model_type = 'gemma'"),
        ({"sliding_window": 4096}, "unknown field.s. sliding_window"),  # would change attention
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        (  # experts belong to a MoE family's config
            {"num_local_experts": 4},
            "num_local_experts = 4 makes it a mixture-of-experts model, which model_type = "
            "'llama' is not; fivefold imports experts as mixtral, qwen3_moe, deepseek_v3",
        ),
    ],
)
def test_unsupported_llama_configs_are_named(change, message):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        **change,
    }
    with pytest.raises(CheckpointError, match=message):
        spec_from_llama_config(config)


def test_cli_export_import_round_trip(tmp_path, capsys):
    spec, model = trained_like_model(False)
    run_dir = tmp_path / "run"
    Checkpointer(run_dir / "ckpt").save(4, [model], None, model_spec=spec.to_dict(), plan={})
    # no recipe.toml beside the checkpoint: the tokenizer is unknown, and the export says so
    assert main(["export", "--hf", str(tmp_path / "bare"), "--from", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "exported" in captured.out and "no tokenizer exported" in captured.err
    assert main(["import", "--hf", str(tmp_path / "bare"), "--out", str(tmp_path / "x")]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    tokenizer = str(default_tokenizer().path)
    args = ["export", "--hf", str(tmp_path / "hf"), "--from", str(run_dir)]
    assert main([*args, "--tokenizer", tokenizer]) == 0
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")]) == 0
    recipe = (tmp_path / "new" / "imported.toml").read_text()
    assert "hidden = 64" in recipe and "resume = true" in recipe
    assert f'tokenizer = "{tmp_path / "new" / "tokenizer.json"}"' in recipe
    # Complete: the batch and the training settings are written out, each default said to be
    # one (a run from it once used mbs 1 x accum 1 and lr 3e-4 without a word), and it loads.
    import tomllib

    from fivefold.cli.recipe_text import TRAIN_FIELDS
    from fivefold.train.config import TrainConfig
    from fivefold.train.entry import load_run

    sections = tomllib.loads(recipe)
    assert sections["plan"] == {"micro_batch": 1, "grad_accum": 1}
    assert set(TRAIN_FIELDS) | {"run_dir", "resume"} == set(sections["train"])
    assert sections["train"]["lr"] == TrainConfig().lr
    assert "lr = 0.0003  # default: peak learning rate" in recipe
    assert "grad_accum = 1  # default: micro-batches per optimizer step" in recipe
    run = load_run(tmp_path / "new" / "imported.toml", [], world_size=1)
    assert run.recipe.model.hidden == 64 and run.train.run_dir == str(tmp_path / "new")
    assert (tmp_path / "new" / "ckpt" / "step_0" / "manifest.json").is_file()
    # `sample` right after the import reads the tokenizer it copied (imported.toml says which)
    capsys.readouterr()
    sample = ["sample", str(tmp_path / "new"), "--prompt", "It is", "--max-tokens", "3"]
    assert main([*sample, "--greedy"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("It is")
    # a second import into the same run directory is refused with exit status 2
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_training_starts_from_an_imported_model(tmp_path, capsys):
    """train -> export -> import -> `fivefold train imported.toml`: the new run resumes from the
    imported weights (its first loss is the trained model's, far below a fresh model's ln V)."""
    recipe = str(Path(__file__).parents[2] / "configs" / "tiny-cpu.toml")
    quiet = ["--no-progress", "train.tensorboard=false", "train.log_every=1"]
    trained = tmp_path / "trained"
    assert main(["train", recipe, "--steps", "25", f"train.run_dir={trained}", *quiet]) == 0
    last = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()][-1]
    assert main(["export", "--hf", str(tmp_path / "hf"), "--from", str(trained)]) == 0
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")]) == 0
    capsys.readouterr()
    imported = str(tmp_path / "new" / "imported.toml")
    assert main(["train", imported, "--steps", "1", "train.warmup_steps=0", *quiet]) == 0
    assert "resumed from" in capsys.readouterr().out
    first = json.loads((tmp_path / "new" / "metrics.jsonl").read_text().splitlines()[0])
    fresh = math.log(4096)
    assert first["step"] == 1
    assert first["loss"] < fresh - 1.0 and abs(first["loss"] - last["loss"]) < 0.5


def test_an_imported_model_trains_on_the_users_text_with_its_own_tokenizer(
    trained_run, tmp_path, capsys
):
    """import --inputs: the recipe's [data] names the user's file and the model's tokenizer, so
    training continues from the imported weights on that text (it used to train on the
    embedded corpus with whatever tokenizer the defaults gave)."""
    import tomllib

    assert main(["export", "--hf", str(tmp_path / "hf"), "--from", str(trained_run)]) == 0
    text = tmp_path / "mine.txt"
    text.write_text("The ship left the harbour at dawn, and the sea was calm. " * 400)
    args = ["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")]
    assert main([*args, "--inputs", str(text)]) == 0
    recipe = tomllib.loads((tmp_path / "new" / "imported.toml").read_text())
    assert recipe["data"]["inputs"] == [str(text.resolve())]
    kept = Path(recipe["data"]["tokenizer"])
    assert kept.read_text() == (tmp_path / "hf" / "tokenizer.json").read_text()
    capsys.readouterr()
    imported = str(tmp_path / "new" / "imported.toml")
    cache = f'data.cache_dir="{tmp_path / "cache"}"'
    assert main(["train", imported, "--steps", "2", "train.warmup_steps=0", cache, *QUIET]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and str(tmp_path / "cache") in out  # the user's text, tokenized
    losses = [
        json.loads(x)["loss"] for x in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """The tiny recipe trained 3 steps in one process, a checkpoint per step."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    args = ["train", TINY_RECIPE, "--steps", "3", f"train.run_dir={run_dir}", *QUIET]
    assert main([*args, "train.ckpt_every=1", "train.warmup_steps=0"]) == 0
    return run_dir


class ForceEndOfDocument(transformers.LogitsProcessor):
    """Makes the end-of-document token the only choice once `after` tokens were generated."""

    def __init__(self, prompt_len: int, after: int, eod: int):
        self.at, self.eod = prompt_len + after, eod

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.at:
            scores = torch.full_like(scores, -math.inf)
            scores[:, self.eod] = 0.0
        return scores


def test_export_is_self_contained_and_generate_stops_at_the_end_of_document(
    trained_run, tmp_path, capsys
):
    """No --tokenizer: the run's tokenizer is found from its recipe.toml; transformers loads
    model and tokenizer from the directory alone, encodes like fivefold, and `generate` stops at
    <|endoftext|> (it used to run to max_new_tokens: no eos id was exported)."""
    out = tmp_path / "hf"
    assert main(["export", "--hf", str(out), "--from", str(trained_run)]) == 0
    assert "step 3" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json",
    }  # fmt: skip
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name
    ours = default_tokenizer()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = "It is a truth universally acknowledged"
    assert hf_tok(text)["input_ids"] == ours.encode(text)
    assert hf_tok.eos_token_id == ours.eod_id
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), local_files_only=True, dtype=torch.float32
    ).eval()
    assert model.generation_config.eos_token_id == ours.eod_id
    prompt = torch.tensor([ours.encode(text)])
    force = transformers.LogitsProcessorList([ForceEndOfDocument(prompt.shape[1], 3, ours.eod_id)])
    with torch.no_grad():
        stopped = model.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=force)
    assert stopped.shape[1] == prompt.shape[1] + 4  # 3 tokens, then <|endoftext|>, then stop
    assert int(stopped[0, -1]) == ours.eod_id


def test_export_names_the_checkpoint_and_skips_a_corrupt_newest(trained_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / "ckpt" / "step_3"
    victim = next(p for p in sorted(newest.rglob("*.distcp")))
    victim.write_bytes(victim.read_bytes()[:-7])
    assert main(["export", "--hf", str(tmp_path / "hf"), "--from", str(run)]) == 0
    captured = capsys.readouterr()
    assert "step_3" in captured.err and "corrupt" in captured.err
    assert "exporting the newest valid one, step_2" in captured.err
    assert f"exported {run / 'ckpt' / 'step_2'}" in captured.out and "step 2" in captured.out


def test_import_refuses_shards_of_another_tokenizer(trained_run, tmp_path, capsys):
    from fivefold.train.data import prepare_shards
    from fivefold.train.data.tokenizer import train_tokenizer

    assert main(["export", "--hf", str(tmp_path / "hf"), "--from", str(trained_run)]) == 0
    text = tmp_path / "mine.txt"
    text.write_text("A corpus of my own, about ships and the sea. " * 200)
    other = train_tokenizer([text], vocab_size=300, out=tmp_path / "other.json")
    prepare_shards([text], tmp_path / "shards", other)
    args = ["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new")]
    capsys.readouterr()
    assert main([*args, "--shards", str(tmp_path / "shards")]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "new" / "ckpt").exists()  # refused before anything was written


def _hf_llama3(tmp_path: Path, tied: bool) -> tuple[Path, transformers.LlamaForCausalLM]:
    """A tiny Llama with Llama 3.1 RoPE scaling, built and saved locally (no download)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tied,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "src")
    return tmp_path / "src", model


@pytest.mark.parametrize("tied", [False, True])
def test_llama31_rope_scaling_imports_and_exports_with_equal_logits(tmp_path, tied):
    """Scaled RoPE (wavelengths from 6 to 20,000 tokens against an original context of 32, so
    all three regimes of the rule occur) gives transformers' logits after import, and again
    after export; with the scaling dropped the logits differ (the test can fail)."""
    source, theirs = _hf_llama3(tmp_path, tied)
    spec, tensors = read_hf(source)
    assert (spec.rope_scaling_factor, spec.rope_original_seq_len) == (8.0, 32)
    assert spec.tied_embeddings is tied
    ours = build_model(spec)
    ours.to_empty(device="cpu")
    ours.load_state_dict(tensors)
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert float((ours(tokens) - expected).abs().max()) <= LOGIT_ATOL
        plain = build_model(spec.with_(rope_scaling_factor=1.0))
        plain.to_empty(device="cpu")
        plain.load_state_dict(tensors)
        assert float((plain(tokens) - expected).abs().max()) > 1e-3
    path = import_hf(source, tmp_path / "run" / "ckpt")
    export_hf(path, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert config["rope_parameters"]["original_max_position_embeddings"] == 32
    again = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path / "back"), local_files_only=True, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        assert float((again(tokens).logits - expected).abs().max()) <= LOGIT_ATOL


@pytest.mark.parametrize("weights", [b"garbage", b"\x08" + b"\x00" * 7 + b"{}"])
def test_a_corrupt_safetensors_file_is_a_message(tmp_path, weights):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176}
    config |= {"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(weights)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_hf(tmp_path)
