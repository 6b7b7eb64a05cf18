"""Hugging Face configs as the model (`fivefold.specs.hf_config`): parameter counts equal to what
`transformers` builds from the same config, FLOPs equal to what torch counts in its forward,
`fivefold plan --hf-config`, and `train` refusing what its runtime cannot build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.specs.flops import attention_keys_per_query, forward_flops_per_token
from fivefold.specs.hf_config import read_hf_config, spec_from_hf_config
from fivefold.specs.model import attention_params, param_count
from fivefold.specs.recipe import load_recipe, recipe_from_dict

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
FULL = [
    "llama3-8b",
    "mistral-7b",
    "qwen2-7b",
    "qwen3-8b",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "deepseek-v3",
]
TINY = [
    "tiny-llama",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-deepseek-v3",
    "tiny-deepseek-v3-no-q-lora",
]
# Not model shapes: the published weights' FP8 format and bookkeeping transformers needs not see.
_NOT_FOR_TRANSFORMERS = ("quantization_config", "architectures", "model_type", "torch_dtype")


def _spec(name: str):
    return spec_from_hf_config(read_hf_config(CONFIGS / f"{name}.json"), name)


def _transformers_model(name: str, device: str, **extra):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    kwargs = {k: v for k, v in config.items() if k not in _NOT_FOR_TRANSFORMERS}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(hf_config, **extra)


# Published totals, the number each model card states, as a check on the typed-in configs.
PUBLISHED = {
    "llama3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,  # the card's "30.5B"
    "deepseek-v3": 671_026_404_352,  # without the 14B multi-token-prediction module
}


@pytest.mark.parametrize("name", FULL + TINY)
def test_parameter_count_equals_transformers_on_meta(name):
    model = _transformers_model(name, "meta")
    assert param_count(_spec(name)) == sum(p.numel() for p in model.parameters())
    if name in PUBLISHED:
        assert param_count(_spec(name)) == PUBLISHED[name]


@pytest.mark.parametrize("name", FULL + TINY)
def test_rope_base_equals_transformers(name):
    """The RoPE base a config gives or, named nowhere, its family's default (Mixtral's 1e6)."""
    transformers = pytest.importorskip("transformers")
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    kwargs = {k: v for k, v in config.items() if k not in _NOT_FOR_TRANSFORMERS}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    assert _spec(name).rope_theta == hf_config.rope_parameters["rope_theta"]


@pytest.mark.parametrize("name", TINY)
def test_forward_flops_equal_torchs_count(name):
    """torch's FLOP counter over the eager forward (which scores every query against every key
    and masks afterwards, so the count is the full, non-causal one) equals fivefold's count."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    eager = {"attn_implementation": "eager", "experts_implementation": "eager"}  # one F.linear
    model = _transformers_model(name, "cpu", **eager).eval()  # per expert, counted by torch
    batch, seq = 2, 24
    ids = torch.randint(0, 512, (batch, seq))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    spec = _spec(name).with_(sliding_window=0, sliding_layers=0)
    expected = batch * seq * forward_flops_per_token(spec, seq, causal=False)
    assert counter.get_total_flops() == expected


def test_family_features_read_by_hand():
    mistral = _spec("mistral-7b")
    assert (mistral.sliding_window, mistral.windowed_layers) == (4096, 32)
    assert _spec("qwen2-7b").sliding_window == 0  # use_sliding_window = false
    tiny_qwen2 = _spec("tiny-qwen2")  # window in the layers from max_window_layers = 1 on
    assert (tiny_qwen2.sliding_window, tiny_qwen2.windowed_layers) == (16, 2)
    assert tiny_qwen2.qkv_bias and tiny_qwen2.tied_embeddings
    qwen3 = _spec("qwen3-8b")
    assert qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.qkv_bias
    mixtral = _spec("mixtral-8x7b")
    assert (mixtral.experts, mixtral.top_k, mixtral.expert_ffn) == (8, 2, 14336)
    qwen3_moe = _spec("qwen3-30b-a3b")
    assert (qwen3_moe.experts, qwen3_moe.top_k, qwen3_moe.expert_ffn) == (128, 8, 768)
    assert qwen3_moe.qk_norm and qwen3_moe.router_norm_topk and qwen3_moe.dense_layers == 0
    tiny_moe = _spec("tiny-qwen3-moe")  # mlp_only_layers = [0]: one leading dense layer
    assert (tiny_moe.dense_layers, tiny_moe.ffn, tiny_moe.router_norm_topk) == (1, 160, False)
    assert _spec("mixtral-8x7b").router_norm_topk
    v3 = _spec("deepseek-v3")
    assert v3.attention == "mla" and v3.head_dim == 192 and v3.value_dim == 128
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_rope_head_dim) == (1536, 512, 64)
    assert (v3.experts, v3.top_k, v3.shared_experts, v3.dense_layers) == (256, 8, 1, 3)
    assert (v3.router_score, v3.router_groups, v3.router_top_groups) == ("sigmoid", 8, 4)
    assert (v3.routed_scaling, v3.rope_mscale_all_dim) == (2.5, 1.0)
    assert (v3.rope_scaling_type, v3.rope_scaling_factor, v3.rope_original_seq_len) == (
        "yarn",
        40.0,
        4096,
    )
    # MLA by hand: q_a 7168x1536 + q_b 1536x(128x192) + kv_a 7168x(512+64)
    # + kv_b 512x(128x(128+128)) + o (128x128)x7168
    assert attention_params(v3) == (
        7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    )
    llama = _spec("tiny-llama")
    assert llama.rope_scaling_factor == 8.0 and llama.rope_scaling_type == "llama3"


def test_sliding_window_keys_by_hand():
    assert attention_keys_per_query(4096) == 2048
    assert attention_keys_per_query(4096, 4096) == 2048
    assert attention_keys_per_query(32768, 4096) == 4096 - 4096 * 4096 / 65536  # 3840
    assert attention_keys_per_query(8, 4) == 3.0  # 0,1,2,3,4,4,4,4 and 1,2,3,4,4,4,4,4 averaged
    mistral = _spec("mistral-7b")
    # at 32K the windowed layers see 3,840 keys per query instead of 16,384
    full = forward_flops_per_token(mistral.with_(sliding_window=0, sliding_layers=0), 32768)
    saved = 32 * 4 * 32 * 128 * (16384 - 3840)
    assert forward_flops_per_token(mistral, 32768) == pytest.approx(full - saved)


def test_bad_configs_name_the_field(tmp_path):
    base = json.loads((CONFIGS / "tiny-llama.json").read_text())
    for change, words in (
        ({"model_type": "gpt2"}, "model_type = 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"attention_bias": True}, "attention_bias = true"),
        ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "RoPE type 'su'"),
        ({"num_hidden_layers": "two"}, "not a number"),
    ):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
            spec_from_hf_config({**base, **change})
    qwen3_moe = json.loads((CONFIGS / "tiny-qwen3-moe.json").read_text())
    for change, words in (  # sparse layers transformers builds and fivefold cannot place
        ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\]"),
        ({"mlp_only_layers": [0, 2]}, r"mlp_only_layers = \[0, 2\]"),
    ):
        with pytest.raises(ConfigError, match=words):
            spec_from_hf_config({**qwen3_moe, **change})
    deepseek = json.loads((CONFIGS / "tiny-deepseek-v3.json").read_text())
    assert not spec_from_hf_config({**deepseek, "norm_topk_prob": False}).router_norm_topk
    with pytest.raises(ConfigError, match="does not exist"):
        read_hf_config(tmp_path / "missing.json")


def test_plan_with_hf_config_and_recipe_field(capsys, tmp_path):
    path = str(CONFIGS / "deepseek-v3.json")
    argv = ["plan", "estimate", "--hf-config", path, "--seq", "4K", "--gpus", "256"]
    argv += ["--ep", "64", "--pp", "4", "--global-batch", "1024", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["attention"] == "mla" and data["model"]["seq_len"] == 4096
    assert data["step_time_s"] > 0
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[model]\nhf_config = "{path}"\nseq_len = 4096\n')
    assert load_recipe(recipe).model == _spec("deepseek-v3").with_(seq_len=4096)
    with pytest.raises(ConfigError, match="both name a model"):
        recipe_from_dict({"model": {"hf_config": path, "preset": "llama3-8b"}})


def test_train_refuses_what_the_runtime_cannot_build(tmp_path, capsys):
    from fivefold.train.entry import load_run

    for name, words in (("tiny-qwen3", "model.rope_scaling_type = 'longrope'"),):
        recipe = tmp_path / f"{name}.toml"
        recipe.write_text(f'[model]\nhf_config = "{CONFIGS / name}.json"\nseq_len = 64\n')
        if "longrope" in words:  # planned (counted like the others), not built
            recipe.write_text(recipe.read_text() + 'rope_scaling_type = "longrope"\n')
        with pytest.raises(ConfigError, match=words):
            load_run(recipe, [], world_size=1)
        assert main(["train", str(recipe), "--dry-run"]) == 2
        assert "fivefold's runtime does not implement it" in capsys.readouterr().err
    for name in ("qwen2-7b", "qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b"):  # biases, QK-norm, MoE
        assert _spec(name).runtime_problems() == []
    # sliding windows (Mistral in every layer, Qwen2 in its last), yarn RoPE (tiny-qwen3) and
    # DeepSeek's latent attention with yarn (tiny-deepseek-v3) train
    for name in ("tiny-mistral", "tiny-qwen2", "tiny-qwen3", "mistral-7b", "tiny-deepseek-v3"):
        recipe = tmp_path / f"{name}.toml"
        recipe.write_text(f'[model]\nhf_config = "{CONFIGS / name}.json"\nseq_len = 64\n')
        assert load_run(recipe, [], world_size=1).recipe.model.runtime_problems() == []
    assert (
        _spec("tiny-deepseek-v3-no-q-lora").with_(rope_scaling_factor=1.0).runtime_problems() == []
    )
    llama = tmp_path / "llama.toml"  # a Llama config trains
    llama.write_text(f'[model]\nhf_config = "{CONFIGS}/tiny-llama.json"\nseq_len = 64\n')
    assert load_run(llama, [], world_size=1).recipe.model.rope_scaling_factor == 8.0
