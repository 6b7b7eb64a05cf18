"""Errors found on the ranks of `fivefold train --nproc 2` are printed once, by the launcher,
with exit status 2 and no torchrun traceback (they used to come once per rank inside ~40 lines
of `ChildFailedError`, exit status 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fivefold.launch.rank_report import RankReport, summarize

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


def test_only_the_last_attempt_decides_and_the_restart_is_told() -> None:
    """Attempt 0: rank 1 killed, rank 0 lost its peer (an error report); attempt 1 resumed and
    completed: exit 0, and the note names both attempts. Had attempt 1 failed, its own
    reports would decide."""
    lost = RankReport(0, "error", "rank 0: step 98 lost its connection to another rank", 2, 0)
    resumed = RankReport(0, "resumed", "resumed from step 96 and completed step 300", 0, 1)
    message, code = summarize([lost, resumed], 2, 0, last=1)
    assert code == 0
    assert message == (
        "note: torchrun restarted the ranks 1 time (--max-restarts): attempt 1 stopped (rank "
        "0: step 98 lost its connection to another rank); attempt 2 resumed from step 96 and "
        "completed step 300."
    )
    # a restart whose attempt was killed before any report: the last attempt is the marker's
    assert summarize([lost], 2, 0, last=2)[0].endswith(
        "attempt 2 stopped (a rank failed without a message (e.g. it was killed))."
    )
    again = RankReport(1, "error", "data.shards: missing", 2, 1)
    message, code = summarize([lost, again], 2, 2, {1: 2}, last=1)
    assert code == 2 and message.startswith("data.shards: missing (found by rank 1) Before that,")


def test_a_sigkilled_rank_is_explained_by_the_oom_killer_count() -> None:
    from fivefold.launch.launcher import sigkill_cause

    note = "the planner predicted a peak of 22.97 GiB per rank"
    rose = sigkill_cause(3, 4, note)
    assert rose == (
        "The kernel's out-of-memory killer ended it: its kill count rose by 1 during the run; "
        + note
    )
    message, code = summarize([], 2, 137, {0: 137}, sigkill_note=rose)
    assert code == 137
    assert "rank 0 was killed by SIGKILL (exit status 137)" in message
    assert "Its output above says why" not in message and rose in message
    assert sigkill_cause(4, 4, "").startswith("Not the kernel's out-of-memory killer")
    assert sigkill_cause(None, None, "").startswith("The likely cause is the kernel's out-of")
