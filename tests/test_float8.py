"""FP8 compute (`plan.fp8`): which linears torchao's conversion swaps, and the refusals.

Only the conversion runs on CPU (no FP8 matmul): on the meta model, as the runtime does it.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from fivefold.errors import ConfigError
from fivefold.model import build_model
from fivefold.parallel.float8 import (
    convert_linears,
    float8_problems,
    fp8_eager_note,
    keeps_high_precision,
)
from fivefold.specs.float8 import converts_to_fp8, fp8_linears
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import model_preset

pytest.importorskip("torchao")


def _meta_model(name: str, **changes):
    return _meta_model_of(replace(model_preset(name), **changes))


def _meta_model_of(spec):
    with torch.device("meta"):
        return build_model(spec)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_keeps_head_and_odd_dims_in_high_precision(recipe):
    from torchao.float8.float8_linear import Float8Linear

    model = _meta_model("tiny", ffn=168)  # 168 = 10.5 x 16: the MLP stays high precision
    converted = convert_linears(model, recipe, fsdp=True, skip_small=False)
    expected = [f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")]
    assert converted == expected
    assert type(model.output) is torch.nn.Linear
    assert type(model.layers["0"].feed_forward.w1) is torch.nn.Linear
    assert isinstance(model.layers["1"].attention.wo, Float8Linear)
    # parameter names are unchanged, so initialisation and checkpoints are those of the model
    assert [n for n, _ in model.named_parameters()] == [
        n for n, _ in _meta_model("tiny", ffn=168).named_parameters()
    ]
    config = model.layers["0"].attention.wq.config
    assert config.enable_fsdp_float8_all_gather is (recipe == "tensorwise")


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        # weights [N, K] of a hidden-2048 layer: wq, wo 2048 x 2048; wk, wv 512 x 2048;
        # w1, w3 8192 x 2048; w2 2048 x 8192. Tensorwise skips K <= 4096 with N <= 1024 (wk, wv);
        # rowwise skips N <= 2048 (wq, wk, wv, wo, w2) and keeps w1, w3 (N 8192, K 2048)
        ("tensorwise", ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                        "feed_forward.w3")),
        ("rowwise", ("feed_forward.w1", "feed_forward.w3")),
    ],
)  # fmt: skip
def test_linears_too_small_to_gain_stay_in_high_precision(recipe, expected):
    shape = dict(layers=1, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=32000)
    model = _meta_model("tiny", **shape)
    converted = convert_linears(model, recipe, fsdp=False)
    assert sorted(converted) == sorted(f"layers.0.{name}" for name in expected)
    assert type(model.layers["0"].attention.wk) is torch.nn.Linear


def test_the_rule_is_torchaos_filter():
    """`converts_to_fp8` (read by the planner, no torch) agrees with torchao's own filter on every
    shape of a grid across both recipes' thresholds (and odd dimensions)."""
    from torchao.float8 import _auto_filter_for_recipe

    dims = [8, 24, 512, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 14336]
    for recipe in ("tensorwise", "rowwise"):
        theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for n in dims:
            for k in dims:
                linear = torch.nn.Linear(k, n, bias=False, device="meta")
                assert converts_to_fp8(recipe, n, k) == theirs(linear, "w"), (recipe, n, k)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name", ["llama3-8b", "tiny-moe"])
def test_the_planner_counts_the_linears_the_runtime_converts(recipe, name):
    """The planner's `fp8_linears` of each layer are the weights the runtime swaps, shape for
    shape (Llama 3 8B: K and V stay in bf16 under both recipes)."""
    spec = replace(model_preset(name), layers=2, dense_layers=1) if name == "tiny-moe" else (
        replace(model_preset(name), layers=1))  # fmt: skip
    model = _meta_model_of(spec)
    convert_linears(model, recipe, fsdp=False)
    for i, block in model.layers.items():
        moe = spec.is_moe and int(i) >= spec.dense_layers
        from torchao.float8.float8_linear import Float8Linear

        ran = [tuple(m.weight.shape) for m in block.modules() if isinstance(m, Float8Linear)]
        planned = [(w.out_features, w.in_features) for w in fp8_linears(spec, recipe, moe)]
        assert sorted(ran) == sorted(planned)
    if name == "llama3-8b":
        assert sorted(planned) == [(4096, 4096), (4096, 4096), (4096, 14336), *[(14336, 4096)] * 2]


def test_fp8_without_compile_is_said():
    """Eager FP8 pays for its casts unfused and usually runs slower than bf16: the run says so."""
    plan = ParallelPlan(fp8="tensorwise", precision="bf16-mixed")
    assert "train.compile = true" in fp8_eager_note(plan, compile=False)
    assert fp8_eager_note(plan, compile=True) is None
    assert fp8_eager_note(plan.with_(fp8="none"), compile=False) is None


def test_moe_router_and_shared_experts():
    model = _meta_model("tiny-moe")
    converted = convert_linears(model, "rowwise", fsdp=False, skip_small=False)
    assert not any("router" in name or name == "output" for name in converted)
    assert "layers.0.moe.shared_expert.w1" in converted  # 64 x 64: eligible
    assert keeps_high_precision(model.layers["0"].moe.router, "layers.0.moe.router")


def test_refused_on_cpu_before_any_process():
    problems = float8_problems("tensorwise", torch.device("cpu"))
    assert len(problems) == 1 and "plan.fp8" in problems[0] and "8.9" in problems[0]
    assert float8_problems("none", torch.device("cpu")) == []
    from fivefold.train.entry import check_layout

    with pytest.raises(ConfigError, match=re.escape("plan.fp8 = 'rowwise' on cpu")):
        check_layout(
            None,
            [
                "model.preset=tiny",
                "plan.precision=bf16-mixed",
                "plan.fp8=rowwise",
                "train.device=cpu",
            ],
            1,
        )


def test_layout_rules():
    assert ParallelPlan(tp=2, sp=True, precision="bf16-mixed", fp8="tensorwise").problems() == []
    rowwise = ParallelPlan(tp=2, precision="bf16-mixed", fp8="rowwise").problems()
    assert rowwise == [
        "plan.fp8 = 'rowwise' with plan.tp = 2: FP8 linears are tensor-parallel through "
        "torchao's float8 styles, which carry one scale per tensor (tensorwise scaling) across "
        "the FP8 all-gathers; set plan.fp8 = 'tensorwise', or plan.tp = 1 (shard with dp_shard "
        "/ zero 3 instead)."
    ]
    # tp > kv_heads replicates K and V with fivefold's own style: refused where FP8 converts
    # them (Llama 3 70B: 1024 x 8192), not where they stay in bf16 (8B: 1024 x 4096)
    tp16 = ParallelPlan(tp=16, precision="bf16-mixed", fp8="tensorwise")
    kv = tp16.runtime_problems(model_preset("llama3-70b"))
    assert len(kv) == 1 and "plan.tp = 16 > model.kv_heads = 8" in kv[0]
    assert "(1024 x 8192)" in kv[0] and "plan.tp <= 8" in kv[0]
    assert tp16.runtime_problems(model_preset("llama3-8b")) == []
    assert tp16.with_(tp=8).runtime_problems(model_preset("llama3-70b")) == []
    fp32 = ParallelPlan(fp8="rowwise", precision="fp32").problems()
    assert any("bf16 recipe" in p for p in fp32)
    assert ParallelPlan(dp_shard=2, zero=3, precision="bf16-mixed", fp8="rowwise").problems() == []


def test_mfu_peak_counts_the_fp8_share_against_the_fp8_peak():
    """Llama 3 8B on an H100 with rowwise FP8 linears: per token 6 x 32 layers x (Q, O 4096^2
    each, gate/up/down 3 x 4096 x 14,336) = 40,265,318,400 FLOPs run in FP8 (1,978.9 TFLOP/s);
    K and V (1024 x 4096: rowwise skips N <= 2048) stay in bf16 with the attention scores and the
    LM head, 11,205,083,136 of the 51,470,401,536 (989.4 TFLOP/s). MFU's peak is
    total / (F8 / P8 + rest / P16)."""
    from fivefold.train.peak import cuda_fp8_peak

    model = model_preset("llama3-8b")
    plan = ParallelPlan(fp8="rowwise", precision="bf16-mixed")
    fp8, rest = 40_265_318_400, 11_205_083_136
    assert fp8 == 6 * 32 * (2 * 4096**2 + 3 * 4096 * 14336)
    expected = (fp8 + rest) / (fp8 / 1978.9e12 + rest / 989.4e12)
    peak = cuda_fp8_peak("NVIDIA H100 80GB HBM3", model, plan)
    assert peak.flops_per_s == pytest.approx(expected, rel=1e-9)
    assert "fp8 for the converted linears" in peak.label
    assert not cuda_fp8_peak("NVIDIA A100-SXM4-80GB", model, plan).known  # no FP8 peak
