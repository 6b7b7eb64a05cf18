"""The single-process training loop on the embedded corpus: learning, resume, recompute,
gradient accumulation, precision, the NaN guard, metrics and the CLI entry.

Every run is the tiny preset (0.62M parameters, seq 128) for a few steps in fp32.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fivefold.cli.main import main
from fivefold.errors import TrainingError
from fivefold.specs.model import param_count
from fivefold.train import summary as run_summary
from fivefold.train.data import Batch
from fivefold.train.entry import load_run
from fivefold.train.inputs import load_train_data
from fivefold.train.lr_schedule import lr_at
from fivefold.train.runtime import LocalRuntime
from fivefold.train.start import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny-cpu.toml"
QUIET = ["train.progress=false", "train.tensorboard=false"]


def tiny_run(tmp_path: Path, name: str, *overrides: str):
    base = [f"train.runs_dir={str(tmp_path)!r}", f"train.name={name!r}", *QUIET]
    return load_run(TINY, [*base, *overrides], world_size=1)


def run_and_keep(run):
    """Train `run` in a LocalRuntime we keep, so its final parameters can be compared."""
    runtime = LocalRuntime(run.recipe, run.train)
    summary = train(run, runtime=runtime, console=Console(quiet=True))
    params = {name: p.detach().clone() for name, p in runtime.model.named_parameters()}
    return summary, params


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_loss_falls_below_threshold_on_embedded_corpus(tmp_path):
    # Uniform prediction over the 4,096-token vocabulary costs ln(4096) = 8.318 nats; 150 steps of
    # 1,024 tokens must bring the mean of the last 10 losses below 6.0.
    summary = tiny_run(tmp_path, "falls", "train.steps=150")
    result = train(summary, console=Console(quiet=True))
    assert result.first_loss == pytest.approx(math.log(4096), abs=0.1)
    assert result.tail_loss(10) < 6.0
    assert result.end_step == 150


def test_resume_continues_bit_identically(tmp_path):
    steps = ["train.steps=6", "train.warmup_steps=2"]
    straight, straight_params = run_and_keep(tiny_run(tmp_path, "straight", *steps))
    first, _ = run_and_keep(tiny_run(tmp_path, "split", *steps, "train.stop_at=3"))
    assert first.end_step == 3
    assert Path(first.last_checkpoint).name == "step_3"
    second, second_params = run_and_keep(tiny_run(tmp_path, "split", *steps, "train.resume=true"))
    assert second.start_step == 3 and second.end_step == 6
    assert first.losses + second.losses == straight.losses  # exact float equality
    assert_same_params(straight_params, second_params)
    # The metrics of both invocations land in one JSONL, one line per step.
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_equals_no_recompute(tmp_path, policy):
    steps = ["train.steps=3", "train.warmup_steps=1"]
    reference, reference_params = run_and_keep(tiny_run(tmp_path, "none", *steps))
    recomputed, params = run_and_keep(
        tiny_run(tmp_path, policy, *steps, f"plan.recompute={policy!r}")
    )
    assert recomputed.losses == reference.losses
    assert_same_params(reference_params, params)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    # The same 8 sequences as one micro-batch of 8 or as 4 micro-batches of 2: the step's loss is
    # the mean over all its tokens and the accumulated gradient is that mean's gradient.
    big_run = tiny_run(tmp_path, "big", "plan.micro_batch=8", "plan.grad_accum=1")
    accum_run = tiny_run(tmp_path, "accum", "plan.micro_batch=2", "plan.grad_accum=4")
    (batch,) = next(load_train_data(big_run).batches(micro_batch=8))
    pieces = [
        Batch(*(getattr(batch, f)[i : i + 2] for f in ("tokens", "labels", "positions", "doc_ids")))
        for i in range(0, 8, 2)
    ]
    big, accum = (
        LocalRuntime(big_run.recipe, big_run.train),
        LocalRuntime(accum_run.recipe, accum_run.train),
    )
    big_loss = big.train_step([batch]).loss
    accum_loss = accum.train_step(pieces).loss
    assert accum_loss == pytest.approx(big_loss, abs=1e-6)
    for (name, p), q in zip(big.model.named_parameters(), accum.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-7, rtol=1e-5, msg=name)
    assert big.clip_grad_norm(0.0) == pytest.approx(accum.clip_grad_norm(0.0), rel=1e-5)


def test_bf16_autocast_runs_close_to_fp32(tmp_path):
    steps = ["train.steps=2", "train.warmup_steps=1"]
    fp32, _ = run_and_keep(tiny_run(tmp_path, "fp32", *steps))
    bf16, _ = run_and_keep(tiny_run(tmp_path, "bf16", *steps, "plan.precision='bf16-mixed'"))
    # bf16 matmuls change the loss in the 3rd-4th significant digit, not more.
    assert bf16.losses != fp32.losses
    assert bf16.losses == pytest.approx(fp32.losses, abs=0.05)


def test_cpu_default_precision_is_fp32_when_the_recipe_names_none(tmp_path):
    run = load_run(None, ["model.preset='tiny'", f"train.runs_dir={str(tmp_path)!r}"], 1)
    assert run.recipe.plan.precision == "fp32"


def test_moe_model_trains_with_aux_loss(tmp_path):
    run = load_run(
        CONFIGS / "tiny-moe-cpu.toml",
        [f"train.runs_dir={str(tmp_path)!r}", "train.steps=3", "train.warmup_steps=1", *QUIET],
        1,
    )
    summary = train(run, console=Console(quiet=True))
    records = [json.loads(line) for line in (tmp_path / "tiny-moe-cpu" / "metrics.jsonl").open()]
    # Balanced routing gives coef * E * sum(f * P) = 0.01 * 1 per layer at best; 2 MoE layers.
    assert all(0.015 < r["aux_loss"] < 0.1 for r in records)
    assert all(math.isfinite(loss) for loss in summary.losses)


def test_nan_guard_names_step_and_last_checkpoint(tmp_path):
    run = tiny_run(tmp_path, "nan", "train.steps=4", "train.warmup_steps=1", "train.ckpt_every=2")
    runtime = LocalRuntime(run.recipe, run.train)
    calls = {"n": 0}

    def poison_from_step_3(module, inputs, output):
        calls["n"] += 1
        return output * float("nan") if calls["n"] > 4 else output  # 2 micro-batches a step

    runtime.model.norm.register_forward_hook(poison_from_step_3)  # the head runs in the loss
    with pytest.raises(TrainingError) as err:
        train(run, runtime=runtime, console=Console(quiet=True))
    message = str(err.value)
    assert message.startswith("step 3: the loss is nan")
    assert str(tmp_path / "nan" / "ckpt" / "step_2") in message
    assert "train.lr" in message and "grad_clip" in message


def test_metrics_jsonl_records_every_step(tmp_path):
    run = tiny_run(tmp_path, "metrics", "train.steps=4", "train.warmup_steps=2")
    summary = train(run, console=Console(quiet=True))
    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, run.train) for s in range(4)])
    assert [r["loss"] for r in records] == summary.losses
    assert all(r["tokens"] == 8 * 128 for r in records)
    for r in records:
        assert r["mfu"] > 0 and r["hfu"] == pytest.approx(r["mfu"])  # no recompute: HFU = MFU
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])
    # Peak (measured on step 2) holds at least fp32 weights, grads, Adam m and v: 16 B/param.
    floor = 16 * param_count(run.recipe.model)
    assert records[1]["peak_memory_bytes"] >= floor
    assert records[1]["peak_memory_bytes"] < floor + 64 * 2**20
    saved = json.loads((tmp_path / "metrics" / "summary.json").read_text())
    assert saved["end_step"] == 4 and saved["losses"] == summary.losses


def test_cli_trains_and_prints_summary(tmp_path, capsys):
    code = main(
        [
            "train",
            str(TINY),
            "--steps",
            "3",
            "train.warmup_steps=1",
            f"train.runs_dir={str(tmp_path)!r}",
            "--name",
            "cli",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "done: steps 0 -> 3" in out and "tokens/s" in out and "MFU" in out
    assert (tmp_path / "cli" / "ckpt" / "step_3" / "manifest.json").is_file()


def test_held_out_loss_is_logged_at_eval_steps(tmp_path):
    run = tiny_run(
        tmp_path,
        "eval",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.eval_every=2",
        "train.eval_batches=2",
    )
    summary = train(run, console=Console(quiet=True))
    records = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").open()]
    assert ["eval_loss" in r for r in records] == [False, True, False, True]
    assert sorted(summary.eval_losses) == [2, 4]
    # Early in training the held-out loss tracks the training loss (both near ln 4096).
    for step, value in summary.eval_losses.items():
        assert abs(value - records[step - 1]["loss"]) < 0.5
    assert summary.eval_losses[4] < summary.eval_losses[2]


def test_module_entry_runs_and_reports_errors(tmp_path, capsys):
    from fivefold.train.entry import main as entry_main

    args = [str(TINY), "train.steps=1", "train.warmup_steps=1", *QUIET]
    assert entry_main([*args, f"train.runs_dir={str(tmp_path)!r}"]) == 0
    assert (tmp_path / "tiny-cpu" / "ckpt" / "step_1").is_dir()
    assert entry_main([*args, "train.lr=0"]) == 2
    assert "fivefold train: error: train.lr = 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("installed", [False, True])
def test_header_warns_of_a_tail_eval_split_and_missing_tensorboard(
    tmp_path, monkeypatch, installed
):
    """A user corpus's held-out split is its tail (once licence text, a flat eval loss), and
    TensorBoard events were silently not written when the package was missing: both are said."""
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(run_summary, "tensorboard_installed", lambda: installed)
    text = (CONFIGS.parent / "README.md").read_text()
    corpus = [tmp_path / "a.txt", tmp_path / "LICENSE.txt"]
    for i, path in enumerate(corpus):
        path.write_text(text[i * 3000 : (i + 1) * 3000])
    inputs = "[" + ",".join(f"{str(p)!r}" for p in corpus) + "]"
    run = tiny_run(
        tmp_path, "tail", f"data.inputs={inputs}", "train.steps=1", "train.eval_every=1",
        "train.tensorboard=true", "model.seq_len=32", "data.val_fraction=0.1",
        "train.warmup_steps=0",
    )  # fmt: skip
    out = io.StringIO()
    train(run, console=Console(file=out, width=400))
    shown = out.getvalue()
    assert "eval: the held-out split is the last 10% of the corpus" in shown
    assert f"(the end of {corpus[-1]})" in shown
    assert ("TensorBoard: no events written" in shown) is not installed
    assert installed or "pip install 'fivefold[tensorboard]'" in shown
