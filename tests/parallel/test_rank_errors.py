"""Errors found on the ranks of `fivefold train --nproc 2` are printed once, by the launcher,
with exit status 2 and no torchrun traceback (they used to come once per rank inside ~40 lines
of `ChildFailedError`, exit status 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fivefold.parallel.rank_report import RankReport, summarize

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = str(CONFIGS / "tiny-cpu.toml")
QUIET = ["train.progress=false", "train.tensorboard=false", "train.eval_every=0"]


def _fivefold(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fivefold", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_one_message(result: subprocess.CompletedProcess, needle: str) -> None:
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert out.count(needle) == 1, out[-3000:]
    assert out.count("error:") == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]


def test_missing_data_directory_on_two_ranks_is_one_message(tmp_path) -> None:
    missing = tmp_path / "no-such-shards"
    result = _fivefold(
        "train", "--nproc", "2", TINY, "plan.tp=2", *QUIET,
        f'data.shards="{missing}"', f'train.run_dir="{tmp_path / "run"}"',
    )  # fmt: skip
    _assert_one_message(result, str(missing))


def test_checkpoint_of_another_model_on_two_ranks_is_one_message(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = _fivefold(
        "train", TINY, "train.steps=1", "train.warmup_steps=0", *QUIET,
        f'train.run_dir="{run_dir}"',
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    result = _fivefold(
        "train", "--nproc", "2", TINY, "plan.tp=2", "model.layers=3", "train.resume=true",
        *QUIET, f'train.run_dir="{run_dir}"',
    )  # fmt: skip
    _assert_one_message(result, "layers")


def test_summary_names_the_ranks_and_prefers_the_dead_rank() -> None:
    same = [RankReport(r, "error", "data.shards: missing", 2) for r in (0, 1)]
    assert summarize(same, 2, 1) == ("data.shards: missing (found by every rank)", 2)
    assert summarize(same[1:], 4, 1) == ("data.shards: missing (found by rank 1)", 2)
    lost = [RankReport(0, "error", "rank 0: lost its connection", 2)]
    message, code = summarize(lost, 2, 137, {0: 2, 1: 137})
    assert code == 137 and "rank 1 was killed by SIGKILL" in message
    assert summarize([RankReport(0, "interrupted", "x", 130)], 2, 130) == (None, 130)
    assert summarize([], 2, 0) == (None, 0)


def test_ranks_ended_by_an_interrupt_are_not_failures() -> None:
    assert summarize([], 2, 130, {0: 130, 1: 143}) == (None, 130)
