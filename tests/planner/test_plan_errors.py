"""Bad inputs to `fivefold plan`: each ends in one message naming the field and the fix (exit 2)."""

from pathlib import Path

import pytest

from fivefold.cli.main import main

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "llama3-8b-dgx-h100.toml")
V = ["--model", "vizz-7b"]
E = ["plan", "estimate", "--model", "vizz-7b", "--gpus", "64"]

CASES = [
    # sizes: zero and negative
    (["plan", *V, "--gpus", "0"], "--gpus = 0: must be at least 1"),
    (["plan", *V, "--gpus", "-8"], "--gpus = -8: must be at least 1"),
    (["plan", *V, "--seq", "0"], "--seq = 0: must be at least 1"),
    (["plan", *V, "--hidden", "-5"], "--hidden = -5: must be at least 1"),
    (["plan", "--layers", "0", "--hidden", "64", "--heads", "4"], "--layers = 0"),
    (["plan", *V, "--global-batch-tokens", "0"], "--global-batch-tokens = 0: must be at least 1"),
    (["plan", *V, "--global-batch", "0"], "--global-batch = 0: must be at least 1"),
    (["plan", *V, "--mbs", "0"], "--mbs = 0: must be at least 1"),
    (["plan", *V, "--seq", "lots"], "is not a size"),
    (["plan", *V, "--headroom", "1.5"], "--headroom = 1.5: must be at least 0 and below 1"),
    (["plan", *V, "--nvlink-gbps", "-900"], "--nvlink-gbps = -900: must be a positive"),
    # unknown things
    (
        ["plan", *V, "--gpu", "tpu-v5", "--gpus", "8"],
        "cluster.gpu = 'tpu-v5' is not in the catalog",
    ),
    (["plan", *V, "--cluster", "dgx-z9"], "--cluster = 'dgx-z9' is not a preset"),
    (["plan", "--model", "gpt5"], "--model = 'gpt5' is neither a preset"),
    (["plan", "--model", "missing.toml"], "recipe file 'missing.toml' does not exist"),
    (["plan", *V, "--precision", "fp7"], "unknown recipe fp7"),
    (["plan", "estimate", *V, "--gpu", "cpu", "--gpus", "8"], "has no HBM capacity"),
    (["plan", "--hidden", "64", "--heads", "4"], "no model: give --model"),
    # impossible layouts
    ([*E, "--tp", "3"], "tp 3 x pp 1 x cp 1 = 3 does not divide the 64 GPUs"),
    ([*E, "--tp", "16"], "plan.tp = 16 must divide the 8 GPUs of a node"),
    ([*E, "--pp", "64"], "exceed model.layers = 32"),
    ([*E, "--pp", "2", "--schedule", "interleaved-1f1b", "--vpp", "1"], "needs plan.vpp >= 2"),
    ([*E, "--pp", "2", "--schedule", "zbv", "--grad-accum", "2"], "needs at least 3"),
    ([*E, "--ep", "2"], "plan.ep = 2 needs a MoE model"),
    ([*E, "--zero", "4"], "ZeRO stage must be 0, 1, 2 or 3"),
    ([*E, "--cp", "3"], "does not divide the 64 GPUs"),
    ([*E, "--global-batch", "33"], "is not a whole number of micro-batches"),
    ([*E, "--kv-heads", "5"], "model.kv_heads = 5 must divide model.heads = 32"),
    (["plan", *V, "--gpus", "12"], "--gpus = 12"),
    (["plan", *V, "--global-batch", "10", "--global-batch-tokens", "4M"], "not both"),
    (
        ["plan", "--model", "llama3-405b", "--gpus", "8"],
        "no layout of llama3-405b fits 8 x h100-sxm",
    ),
    (["plan", "estimate", "nope.toml", *V], "recipe file 'nope.toml' does not exist"),
    (["plan", "estimate", RECIPE, "plan.tp", *V], "must be section.field=value overrides"),
    (["plan", "estimate", RECIPE, "plan.tp=three"], "plan.tp = 'three': expected a whole number"),
]


@pytest.mark.parametrize(("argv", "fragment"), CASES, ids=[" ".join(c[0][1:]) for c in CASES])
def test_bad_input_is_one_message(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    assert "Traceback" not in err
    assert err.startswith("fivefold plan: error: ")
