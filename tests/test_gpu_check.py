"""`benchmarks/gpu_check.py` without a GPU: its dry run builds and checks every command, and its
targets and readers judge hand-made figures as the issue's targets say."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dry_run_checks_every_command():
    """Every command with its budget; each fivefold run's batches one document per row of its
    length (single 32K / 128K documents for the long rows); the HF loop as many parameters and
    FLOPs per token as fivefold, on fivefold's own batches."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    gpu_check = _module()
    lines = done.stdout.splitlines()
    for run in gpu_check.RUNS:  # one command line each, with its budget
        assert any(line.startswith(f"{run.name:<14} ({run.budget_s:.0f} s)") for line in lines)
    assert f"dry run: {len(gpu_check.RUNS)} commands checked" in done.stdout
    assert "= 560 s" in lines[0]
    rows = [line.strip() for line in lines if line.strip().startswith("batches:")]
    assert rows == [
        *["batches: 4 row(s) of one 4,096-token document each"] * 3,
        "batches: 1 row(s) of one 32,768-token document each",
        "batches: 1 row(s) of one 131,072-token document each",
    ]
    hf = [line.strip() for line in lines if line.strip().startswith("HF loop:")]
    assert len(hf) == 2  # eager and compiled blocks
    if importlib.util.find_spec("transformers"):
        assert "1.104B parameters and 7.04 GFLOP per token as fivefold's" in hf[0]
        assert hf[0].endswith("on fivefold's batches")
    else:
        assert "skipped (transformers is not installed)" in hf[0]


def test_the_budgets_add_up_with_room_for_a_cold_compile():
    """The runs' budgets are the total (the default of --budget), which fits one 10-minute
    device call with a minute to spare; each compiled run has `COLD_COMPILE_S` more than its
    eager twin."""
    gpu_check = _module()
    budgets = {run.name: run.budget_s for run in gpu_check.RUNS}
    assert sum(budgets.values()) == gpu_check.TOTAL_BUDGET_S == 560
    cold = gpu_check.COLD_COMPILE_S
    assert budgets["compile"] >= budgets["eager"] + cold
    assert budgets["fp8-compile"] >= budgets["eager"] + cold
    assert budgets["hf-compile"] >= budgets["hf-eager"] + cold - 10  # no fivefold start-up
    assert all(b >= gpu_check.STARTUP_S + 15 for n, b in budgets.items() if "seq" in n)


def test_a_packed_run_fails_the_dry_run(capsys, tmp_path):
    """A run whose rows hold several documents (here of about 60 tokens each) is not the HF
    loop's work: the dry run refuses it."""
    gpu_check = _module()
    recipe = tmp_path / "r.toml"
    recipe.write_text(gpu_check.recipe_text(gpu_check.write_document(tmp_path / "doc.txt")))
    words = (tmp_path / "doc.txt").read_text().split()[:40_000]
    docs = [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    short = tmp_path / "short.txt"
    short.write_text("\n<|endoftext|>\n".join(docs))
    inputs = f"data.inputs=[{str(short)!r}]"
    packed = gpu_check.Run("packed", "train", [inputs, "model.seq_len=512"], 10)
    assert gpu_check.dry_run([packed], recipe, tmp_path) == 1
    out = capsys.readouterr().out
    assert "packed: ValueError: rows of 512 tokens are not one document each" in out


def test_the_hf_loop_counts_its_own_flops():
    """What the HF model does per token, from its own config: 6 x (16 layers x (Q, K, V, O
    2048 x 3072 + 2048^2, SwiGLU 3 x 2048 x 8192) + the head 32000 x 2048) = 6,231,687,168, plus
    the causal scores over one 4,096-token document per row: 3 passes x 2 matmuls x 2 FLOPs x 16
    layers x 2048 wide x 2048 keys on average = 805,306,368."""
    gpu_check = _module()
    pytest.importorskip("transformers")
    matmuls = 6 * (16 * (2048 * 3072 + 2048**2 + 3 * 2048 * 8192) + 32000 * 2048)
    assert matmuls == 6_231_687_168
    expected = matmuls + 3 * 2 * 2 * 16 * 2048 * 2048
    assert gpu_check.hf_flops_per_token(4096) == expected == 7_036_993_536


def test_a_bad_recipe_fails_the_dry_run(monkeypatch, capsys, tmp_path):
    gpu_check = _module()
    bad = gpu_check.Run("bad", "train", ['plan.recompute="sometimes"'], 10)
    recipe = tmp_path / "r.toml"
    recipe.write_text(gpu_check.recipe_text(tmp_path / "doc.txt"))
    assert gpu_check.dry_run([bad], recipe, tmp_path) == 1
    assert "bad: ConfigError" in capsys.readouterr().out


def test_train_result_reads_the_medians_after_warm_up_and_the_layout_report(tmp_path):
    gpu_check = _module()
    steps = [  # two warm-up steps left out of the medians
        {"step": i, "tokens_per_s": tps, "mfu": mfu, "peak_memory_bytes": peak}
        for i, (tps, mfu, peak) in enumerate(
            [(1e3, 0.1, 5), (2e3, 0.2, 9), (50e3, 0.40, 7), (52e3, 0.42, 7), (54e3, 0.44, 8)], 1
        )
    ]
    steps[2]["plan_vs_run"] = {
        "note": "n",
        "stages": [{"memory_error": -0.02, "step_error": 0.08}],
    }
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    got = gpu_check.train_result(tmp_path)
    assert got["tokens_per_s"] == 52e3 and got["mfu"] == 0.42 and got["peak_bytes"] == 9
    assert (got["memory_error"], got["step_error"]) == (-0.02, 0.08)


def test_targets_judge_the_figures():
    gpu_check = _module()

    def train(name, tps, mfu, mem, step):
        return {"run": name, "kind": "train", "status": "ok", "tokens_per_s": tps, "mfu": mfu,
                "memory_error": mem, "step_error": step}  # fmt: skip

    rows = {
        "eager": train("eager", 54e3, 0.39, -0.02, -0.05),
        "compile": train("compile", 60e3, 0.42, 0.04, 0.09),
        "fp8-compile": {
            "run": "fp8-compile",
            "kind": "train",
            "status": "skipped: torchao is not installed",
        },
        "seq128k-full": train("seq128k-full", 42e3, 1.38, -0.02, 4.33),
        "hf-eager": {"run": "hf-eager", "kind": "hf", "status": "ok", "tokens_per_s": 51.3e3},
        "hf-compile": {"run": "hf-compile", "kind": "hf", "status": "ok", "tokens_per_s": 59.4e3},
        "calibrate": {"run": "calibrate", "kind": "calibrate", "status": "ok", "wall_s": 85.0},
        "tune": {"run": "tune", "kind": "tune", "status": "ok", "first_trial_s": 25.0},
    }
    met = {what: ok for what, ok, _ in gpu_check.targets(rows)}
    assert met["eager >= 1.05x HF eager"] is True  # 54 / 51.3 = 1.053
    assert met["compile >= 1.0x HF compiled blocks"] is True  # 60 / 59.4
    assert met["FP8 faster than bf16 compile"] is True  # skipped, with its reason
    assert met["MFU <= 100 %"] is False  # 138 %
    assert met["predicted peak within 5%"] is True
    assert met["predicted step within 10%"] is False  # +433 %
    assert met["calibrate --quick < 60 s"] is False
    assert met["tune: first trial line < 30 s"] is True
    rows["eager"]["tokens_per_s"] = 53e3  # 1.033x
    assert dict((w, ok) for w, ok, _ in gpu_check.targets(rows))["eager >= 1.05x HF eager"] is False
    text = gpu_check.table(list(rows.values()), gpu_check.targets(rows))
    assert "[MISS] MFU <= 100 %" in text and "[met ] predicted peak within 5%" in text


@pytest.mark.parametrize("line", ["none           1    0.0164", "full  2 OOM"])
def test_tune_rows_are_timed_as_they_come(line):
    gpu_check = _module()
    lines = [(3.0, "tune: building the model and data once on cuda ..."), (21.5, line)]
    assert gpu_check.tune_result(lines) == {"first_trial_s": 21.5, "trials": 1}
