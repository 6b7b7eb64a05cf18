"""The training loop's checkpoints: when a run resumes, starts over or has nothing to do.

`train.resume` = "auto" (default) resumes from the newest valid checkpoint, true insists, false
(`--fresh`) starts over and deletes the old checkpoints; a finished run re-run under "auto" says
it is complete and exits 0. The checkpoint format itself is tested in tests/checkpoint/.
Every run is the tiny preset (0.62M parameters, seq 128, 8 sequences a step) in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console

from fivefold.checkpoint import manifest as mf
from fivefold.cli.main import main
from fivefold.train import checkpoint as ckpt
from fivefold.train.entry import load_run
from fivefold.train.entry import main as entry_main
from fivefold.train.runtime import LocalRuntime
from fivefold.train.start import train

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml")
QUIET = ["train.progress=false", "train.tensorboard=false", "train.warmup_steps=1"]


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"train.run_dir={str(run_dir)!r}", *QUIET, *extra]


def run_quietly(run_dir: Path, *extra: str):
    """Train in a LocalRuntime we keep; returns (summary, final parameters)."""
    run = load_run(TINY, overrides(run_dir, *extra), world_size=1)
    runtime = LocalRuntime(run.recipe, run.train)
    summary = train(run, runtime=runtime, console=Console(quiet=True))
    return summary, {n: p.detach().clone() for n, p in runtime.model.named_parameters()}


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["train", TINY, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]


def test_periodic_checkpoints_are_committed_and_pruned(tmp_path):
    summary, _ = run_quietly(
        tmp_path, "train.steps=4", "train.ckpt_every=1", "train.keep_checkpoints=2"
    )
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert summary.last_checkpoint == str(tmp_path / "ckpt" / "step_4")
    for _, directory in ckpt.list_checkpoints(tmp_path):
        assert mf.verify_checkpoint(directory).ok
    state = json.loads((tmp_path / "ckpt" / "step_4" / "state.json").read_text())
    assert state["step"] == 4
    assert state["sampler"]["consumed"] == 4 * 8  # 4 steps of 8 sequences
    assert state["scheduler"]["last_epoch"] == 4


def test_auto_resume_is_bit_identical_to_a_straight_run(tmp_path):
    """6 steps straight == 3 steps, then a plain re-run ("auto") for the other 3."""
    steps = ["train.steps=6", "train.warmup_steps=2"]
    straight, straight_params = run_quietly(tmp_path / "straight", *steps)
    first, _ = run_quietly(tmp_path / "split", *steps, "train.stop_at=3")
    second, second_params = run_quietly(tmp_path / "split", *steps)  # train.resume = "auto"
    assert (first.end_step, second.start_step, second.end_step) == (3, 3, 6)
    assert first.losses + second.losses == straight.losses  # exact float equality
    assert straight_params.keys() == second_params.keys()
    for name, value in straight_params.items():
        assert torch.equal(value, second_params[name]), name
    assert logged_steps(tmp_path / "split") == [1, 2, 3, 4, 5, 6]


def test_async_checkpoints_resume_bit_identically(tmp_path):
    steps = ["train.steps=4", "train.ckpt_async=true"]
    straight, _ = run_quietly(tmp_path / "straight", *steps)
    first, _ = run_quietly(tmp_path / "split", *steps, "train.stop_at=2")
    assert mf.verify_checkpoint(tmp_path / "split" / "ckpt" / "step_2").ok
    second, _ = run_quietly(tmp_path / "split", *steps)
    assert first.losses + second.losses == straight.losses


def test_finished_run_under_auto_says_complete_and_exits_0(tmp_path, capsys):
    run_dir = tmp_path / "done"
    code, _, _ = cli([*overrides(run_dir), "--steps", "2"], capsys)
    assert code == 0
    manifest = (run_dir / "ckpt" / "step_2" / "manifest.json").read_bytes()
    recipe = (run_dir / "recipe.toml").read_text()
    code, out, err = cli([*overrides(run_dir), "--steps", "2", "train.lr=1e-2"], capsys)
    assert code == 0, err
    assert out.strip() == (
        f"run {run_dir} is complete at step 2; nothing to do — train further with "
        "train.steps=4, or start over with --fresh"
    )
    assert logged_steps(run_dir) == [1, 2]  # nothing trained, nothing rewritten
    assert (run_dir / "ckpt" / "step_2" / "manifest.json").read_bytes() == manifest
    assert (run_dir / "recipe.toml").read_text() == recipe
    # ... and raising train.steps as the line says continues the same run
    code, out, _ = cli([*overrides(run_dir), "--steps", "4"], capsys)
    assert code == 0 and "done: steps 2 -> 4" in out
    assert logged_steps(run_dir) == [1, 2, 3, 4]


def test_run_stopped_at_stop_at_names_stop_at(tmp_path, capsys):
    args = [*overrides(tmp_path), "--steps", "4", "train.stop_at=2"]
    assert cli(args, capsys)[0] == 0
    code, out, _ = cli(args, capsys)
    assert code == 0
    assert f"run {tmp_path} stopped at step 2 (train.stop_at = 2); nothing to do" in out
    assert "train.stop_at=0" in out


def test_fresh_starts_over_and_deletes_old_checkpoints(tmp_path, capsys):
    base = [*overrides(tmp_path), "--steps", "3"]
    assert cli([*base, "train.ckpt_every=1", "train.keep_checkpoints=0"], capsys)[0] == 0
    first = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").open()]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2, 3]
    code, out, _ = cli([*base, "--steps", "2", "--fresh"], capsys)
    assert code == 0
    assert (
        f"note: starting over in {tmp_path} as asked (--fresh / train.resume = false): "
        "deleting its 3 earlier checkpoint(s), newest step 3"
    ) in out
    assert "done: steps 0 -> 2" in out
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    again = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").open()]
    assert again == first[:2]  # same seed, same data order: the same first two steps


def test_module_entry_fresh_and_contradictory_flags(tmp_path, capsys):
    args = [TINY, *overrides(tmp_path), "train.steps=1"]
    assert entry_main(args) == 0
    assert entry_main([*args, "--fresh"]) == 0
    assert "as asked (--fresh / train.resume = false)" in capsys.readouterr().out
    assert entry_main([*args, "--fresh", "--resume"]) == 2
    assert "--resume and --fresh contradict each other" in capsys.readouterr().err


def test_resume_true_without_checkpoint_says_so_and_starts_at_0(tmp_path, capsys):
    code, out, _ = cli([*overrides(tmp_path), "--steps", "1", "--resume"], capsys)
    assert code == 0
    assert f"resume: no valid checkpoint in {tmp_path / 'ckpt'}; starting at step 0" in out
    assert "done: steps 0 -> 1" in out


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    base = [*overrides(tmp_path), "train.ckpt_every=1", "train.keep_checkpoints=0"]
    assert cli([*base, "--steps", "2"], capsys)[0] == 0
    shard = next((tmp_path / "ckpt" / "step_2").glob("*.distcp"))
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])  # same size, different bytes
    code, out, _ = cli([*base, "--steps", "3"], capsys)
    assert code == 0
    assert "checkpoints not usable, skipped: step_2:" in out and "SHA-256" in out
    assert f"resumed from {tmp_path / 'ckpt' / 'step_1'} (step 1" in out
    assert "done: steps 1 -> 3" in out
    assert logged_steps(tmp_path) == [1, 2, 3]
