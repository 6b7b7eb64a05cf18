"""The token-budget answer (`fivefold.planner.budget.token_budget`): arithmetic checked by hand."""

import json
import math
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.cli.plan_args import parse_tokens
from fivefold.errors import ConfigError
from fivefold.planner.budget.token_budget import (
    DEFAULT_CKPT_BANDWIDTH,
    DEFAULT_FAILURE_RATE,
    BudgetInputs,
    budget,
    budget_inputs,
    checkpoint_bytes,
    checkpoint_suggestion,
)
from fivefold.specs import model_preset
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.model import ModelSpec, param_count
from fivefold.specs.plan import ParallelPlan

# 2 layers, hidden 64, 4 heads, ffn 172, vocab 4096: embedding 262,144 + head 262,144 + final
# norm 64 + 2 x (attention 16,384 + SwiGLU 33,024 + norms 128) = 623,424 parameters.
SMALL = ModelSpec(layers=2, hidden=64, heads=4, ffn=172, vocab=4096, seq_len=128)
SMALL_PARAMS = 623_424
ONE_NODE = ClusterSpec(nodes=1, gpus_per_node=8)
DP8 = ParallelPlan(dp_shard=8, zero=3)  # 8 sequences x 128 tokens = 1,024 tokens per step


def test_checkpoint_bytes_per_recipe():
    assert param_count(SMALL) == SMALL_PARAMS
    # bf16-mixed: bf16 weights 2 + fp32 master 4 + Adam m 4 + v 4 = 14 bytes per parameter
    assert checkpoint_bytes(SMALL, DP8) == SMALL_PARAMS * 14
    # fp32: weights 4 + m 4 + v 4
    assert checkpoint_bytes(SMALL, DP8.with_(precision="fp32")) == SMALL_PARAMS * 12
    # 8-bit Adam states: 2 + master 4 + 2 x (1 + 4/256)
    eight = DP8.with_(optimizer_states="8bit")
    assert checkpoint_bytes(SMALL, eight) == pytest.approx(SMALL_PARAMS * (6 + 2 * 1.015625))


def test_small_case_by_hand():
    """Save 10 s, MTBF 20,000 s, step 10 s, 1,000 steps, restart 600 s, $2 per GPU-hour."""
    bandwidth = SMALL_PARAMS * 14 / 10  # bytes/s for the one node: a 10 s save
    rate = 3600 / (8 * 20_000)  # per GPU-hour: 8 GPUs fail once per 20,000 s
    inputs = BudgetInputs(1_024_000, 2.0, rate, bandwidth, 600.0)
    b = budget(SMALL, ONE_NODE, DP8, 10.0, inputs)
    assert b.steps == 1000 and b.useful_s == 10_000
    assert b.save_s == pytest.approx(10.0)
    assert b.mtbf_s == pytest.approx(20_000)
    # Young: sqrt(2 x 10 x 20,000) = 632.5 s = 63.2 steps -> 63 steps = 630 s
    assert b.interval_steps == 63 and b.interval_s == pytest.approx(630)
    # saving: 10,000 / 630 x 10 = 158.73 s; lost per failure 600 + 315 = 915 s
    # T = 10,158.73 / (1 - 915 / 20,000) = 10,158.73 / 0.95425 = 10,645.77 s
    assert b.checkpoint_lost_s == pytest.approx(158.730, abs=1e-3)
    assert b.wall_s == pytest.approx(10_645.77, abs=0.01)
    assert b.interruptions == pytest.approx(0.532289, abs=1e-6)  # T / 20,000
    assert b.restart_lost_s == pytest.approx(319.373, abs=1e-3)  # n x 600
    assert b.recompute_lost_s == pytest.approx(167.671, abs=1e-3)  # n x 315
    assert b.goodput == pytest.approx(0.939340, abs=1e-6)  # 10,000 / T = 9,542.5 / 10,158.73
    assert b.gpu_hours == pytest.approx(23.65728, abs=1e-4)  # 8 x T / 3600
    assert b.cost_usd == pytest.approx(2 * 23.65728, abs=1e-4)
    parts = b.useful_s + b.checkpoint_lost_s + b.restart_lost_s + b.recompute_lost_s
    assert parts == pytest.approx(b.wall_s)
    j = b.to_json()
    assert j["days"] == pytest.approx(10_645.77 / 86_400, abs=1e-6)
    assert j["checkpoint_interval_steps"] == 63 and j["failure_rate_source"] == "given"


def test_no_failures_and_no_progress():
    b = budget(SMALL, ONE_NODE, DP8, 10.0, BudgetInputs(1_024_000, failure_rate=0.0))
    assert b.interval_steps == 0 and b.wall_s == 10_000 and b.goodput == 1.0
    assert b.interruptions == 0 and b.cost_usd is None
    # MTBF 450 s with a 600 s restart: failures come faster than the run recovers
    hopeless = BudgetInputs(1_024_000, failure_rate=1.0)
    b = budget(SMALL, ONE_NODE, DP8, 10.0, hopeless)
    assert not b.progresses and b.to_json()["days"] is None


def test_inputs_from_table_and_flags():
    assert budget_inputs({}, {}) is None
    got = budget_inputs({"tokens": 5e11, "gpu_hour_price": 2}, {"gpu_hour_price": 3.0})
    assert got == BudgetInputs(5e11, 3.0, DEFAULT_FAILURE_RATE, DEFAULT_CKPT_BANDWIDTH, 600.0)
    with pytest.raises(ConfigError, match="without a token count"):
        budget_inputs({"failure_rate": 1e-5}, {})
    with pytest.raises(ConfigError, match=r"planner\.tokens"):
        budget_inputs({"tokens": "lots"}, {})
    with pytest.raises(ConfigError, match=r"planner\.failure_rate"):
        budget_inputs({"tokens": 1e9, "failure_rate": -1}, {})
    assert parse_tokens("500B") == 5e11 and parse_tokens("2T") == 2e12
    assert parse_tokens("5e11") == 5e11 and parse_tokens("1.5M") == 1.5e6
    with pytest.raises(ConfigError, match="--tokens"):
        parse_tokens("many")


def test_catalog_defaults():
    # 419 interruptions / (54 days x 24 h x 16,384 GPUs) = 419 / 21,233,664 per GPU-hour
    assert pytest.approx(1.97328e-5, rel=1e-5) == DEFAULT_FAILURE_RATE
    assert pytest.approx(0.9765625e9) == DEFAULT_CKPT_BANDWIDTH  # 2 TB/s / 2,048 nodes


def test_train_suggestion_line():
    table = {"failure_rate": 0.0225, "ckpt_bandwidth": SMALL_PARAMS * 14 / 10}
    line = checkpoint_suggestion(SMALL, ONE_NODE, DP8, 10.0, table)
    # MTBF 20,000 s = 5.6 h, a 10 s save: sqrt(2 x 10 x 20,000) = 632.5 s = 63 steps of 10 s
    assert "train.ckpt_every = 63 " in line and "10.0 s save" in line and "5.6 h" in line
    # at the catalog bandwidth the save takes 8,727,936 / 0.9765625e9 = 0.0089 s and the
    # interval sqrt(2 x 0.0089 x 20,000) = 18.9 s = 2 steps
    assert "train.ckpt_every = 2 " in checkpoint_suggestion(
        SMALL, ONE_NODE, DP8, 10.0, {"failure_rate": 0.0225}
    )


def _plan_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


LONG_7B_PLAN = [
    "plan",
    "--model",
    "vizz-7b",
    "--cluster",
    "dgx-h100",
    "--gpus",
    "64",
    "--seq",
    "128K",
    "--global-batch-tokens",
    "4M",
]


def test_long_context_7b_budget(capsys):
    """vizz-7b, 64 H100s, 128K tokens, a 4M-token batch, 500B tokens at $2.50 per GPU-hour."""
    data = _plan_json(
        capsys, [*LONG_7B_PLAN, "--tokens", "500B", "--gpu-hour-price", "2.5", "--json"]
    )
    b = data["budget"]
    step = data["step_time_s"]
    # 500e9 / 4,194,304 tokens per step = 119,209.3 -> 119,210 steps
    assert b["steps"] == 119_210 and b["gpus"] == 64
    # MTBF = 54 x 24 x 16,384 / (64 x 419) = 791.83 h
    assert b["mtbf_hours"] == pytest.approx(791.83, abs=0.01)
    params = param_count(model_preset("vizz-7b"))
    assert b["checkpoint_gb"] == pytest.approx(params * 14 / 1e9)  # bf16-mixed, 14 B/param
    save = params * 14 / (8 * 2e12 / 2048)  # 8 nodes at 0.977 GB/s each
    assert b["checkpoint_save_s"] == pytest.approx(save)
    tau = math.sqrt(2 * save * 791.83 * 3600)
    assert b["checkpoint_interval_steps"] == round(tau / step)
    useful_days = 119_210 * step / 86_400
    assert b["failure_free_days"] == pytest.approx(useful_days)
    assert useful_days < b["days"] < useful_days * 1.01  # goodput above 99 % at this scale
    assert b["interruptions"] == pytest.approx(b["days"] * 24 / 791.83, rel=1e-3)
    assert b["gpu_hours"] == pytest.approx(64 * 24 * b["days"])
    assert b["cost_usd"] == pytest.approx(2.5 * b["gpu_hours"])
    assert b["goodput"] == pytest.approx(useful_days / b["days"])
    assert data["alternatives"]
    for alt in data["alternatives"]:
        per_step = ParallelPlan(**alt["plan"]).global_batch * 131_072
        assert alt["budget"]["steps"] == math.ceil(5e11 / per_step)
        assert alt["budget"]["step_time_s"] == alt["step_time_s"]
    text_argv = [*LONG_7B_PLAN, "--tokens", "500B"]
    assert main(text_argv) == 0
    text = capsys.readouterr().out
    assert "budget: 500B tokens = 119,210 steps" in text
    assert "cost: give --gpu-hour-price" in text and "goodput" in text


def test_recipe_carries_tokens(capsys, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\npreset = "dgx-h100"\ngpus = 64\n'
        "[planner]\ntokens = 1e12\nfailure_rate = 0.0\n"
    )
    data = _plan_json(capsys, ["plan", str(recipe), "--global-batch-tokens", "4M", "--json"])
    assert data["budget"]["tokens"] == 1e12 and data["budget"]["goodput"] == 1.0
    out = tmp_path / "out.toml"
    main(["plan", str(recipe), "--global-batch-tokens", "4M", "--out", str(out)])
    assert "tokens = 1000000000000" in Path(out).read_text()


def test_a_run_without_ckpt_every_prints_the_suggestion():
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.summary import checkpoint_suggestion_line

    recipe = recipe_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"preset": "dgx-h100", "gpus": 8},
            "plan": {"dp_shard": 8, "zero": 3},
        }
    )
    # 8,030,261,248 params x 14 B = 112.4 GB saved by one node at 0.9765625 GB/s = 115.1 s;
    # MTBF 1 / (8 x 1.9733e-5) h = 6,334.6 h; sqrt(2 x 115.1 s x 22.80e6 s) = 72,462 s = 36,231
    # steps of 2 s
    save = 8_030_261_248 * 14 / 0.9765625e9
    mtbf = 3600 * 54 * 24 * 16384 / (8 * 419)
    steps = round(math.sqrt(2 * save * mtbf) / 2.0)
    assert steps == 36_231
    assert f"train.ckpt_every = {steps} " in checkpoint_suggestion_line(recipe, 2.0)
    assert "none (no step-time prediction)" in checkpoint_suggestion_line(recipe, None)


def test_a_short_run_gets_no_interval_longer_than_itself_and_a_readable_save_time():
    """A CPU run of 100 steps was told `train.ckpt_every = 7242 (... 0.0 s save ...)`."""
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.summary import checkpoint_suggestion_line

    recipe = recipe_from_dict({"model": {"preset": "tiny"}})  # this CPU, one process
    save = checkpoint_bytes(recipe.model, recipe.plan) / (DEFAULT_CKPT_BANDWIDTH * 1)
    mtbf = 3600 * 54 * 24 * 16384 / (1 * 419)
    steps = round(math.sqrt(2 * save * mtbf) / 0.01)  # at 10 ms per step
    assert save < 0.05 and steps > 100
    line = checkpoint_suggestion_line(recipe, 0.01, 100)
    assert line.startswith("checkpoint suggestion: none before the final one")
    assert f"{steps:,} steps, no shorter than this run's 100" in line
    assert f"{save * 1e3:.2g} ms save" in line and "0.0 s" not in line
    assert f"train.ckpt_every = {steps} " in checkpoint_suggestion_line(recipe, 0.01, steps + 1)
