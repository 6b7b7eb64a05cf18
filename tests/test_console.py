"""The console talks: a line after the first step and at least every 30 s (terminal or not),
`--dry-run` predicts and exits, and the thread settings follow the cores this process has."""

from __future__ import annotations

import io
import os
from pathlib import Path

from rich.console import Console

from fivefold.cli.main import main
from fivefold.launch import threads
from fivefold.specs import profile
from fivefold.train.metrics import ConsoleReporter, StepMetrics

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(
        step=step, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=1024, step_time_s=0.1,
        tokens_per_s=1e4, mfu=None, hfu=None, peak_memory_bytes=0, elapsed_s=1.0,
    )  # fmt: skip


def test_log_lines_come_first_step_then_every_log_every_or_30_s_when_not_a_terminal() -> None:
    """The demo used to print nothing for minutes off a terminal (first line at step 25)."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    now = [0.0]
    reporter = ConsoleReporter(console, 1000, 0, 25, progress=True, clock=lambda: now[0])
    logged = []
    for step, at in [(1, 5), (2, 20), (3, 34), (4, 50), (5, 64), (25, 70), (26, 71)]:
        now[0] = at
        before = out.getvalue().count("\n")
        reporter.update(_metrics(step))
        if out.getvalue().count("\n") > before:
            logged.append(step)
    # step 1: the first; 3: 29 s after step 1 -> no, 34 - 5 = 29 < 30; 4: 45 s after -> yes;
    # 5: 14 s after 4 -> no; 25: log_every; 26: 1 s after -> no
    assert logged == [1, 4, 25]
    reporter.stop()


def test_dry_run_prints_recipe_layout_and_prediction_and_starts_nothing(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    args = ["train", str(CONFIGS / "small-dp2-tp2-pp2.toml"), "--nproc", "8", "--dry-run"]
    assert main([*args, f'train.run_dir="{run_dir}"']) == 0
    out = capsys.readouterr().out
    assert "[model]" in out and "[plan]" in out  # the resolved recipe
    assert "on 8 process(es): mesh pp=2 x dp_replicate=2" in out
    assert "stage 0: peak memory" in out and "stage 1: peak memory" in out
    assert "step time:" in out and "dry run: nothing started" in out
    assert not run_dir.exists()


def test_dry_run_refuses_a_layout_that_does_not_fit(capsys) -> None:
    args = ["train", str(CONFIGS / "small-dp2-tp2-pp2.toml"), "--nproc", "4", "--dry-run"]
    assert main(args) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cgroup_quota_caps_the_threads(tmp_path, monkeypatch) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert profile.cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert profile.cgroup_cpu_limit(tmp_path) is None
    monkeypatch.setattr(profile.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(profile, "cgroup_cpu_limit", lambda: 2.5)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert profile.available_cores() == 3  # 8 cores visible, 2.5 CPUs of quota
    from fivefold.launch.launcher import threads_per_rank

    assert threads_per_rank(2) == 1 and threads_per_rank(1) == 3


def test_threads_wait_passively_unless_told() -> None:
    env = {}
    threads.passive_wait(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    threads.passive_wait(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_one_measured_peak_per_run_even_past_30_s(tmp_path, monkeypatch) -> None:
    """The header's "MFU against" peak is the footer's: the CPU peak is measured once, however
    long the run (it used to be re-measured every 30 s, so header and footer disagreed)."""
    import time

    import fivefold.train.loop as loop
    import fivefold.train.start as start
    from fivefold.train.entry import load_run
    from fivefold.train.peak import DevicePeak

    calls = []

    def fake_peak(device, dtype, **kwargs) -> DevicePeak:
        calls.append(dtype)
        return DevicePeak(1e9 * len(calls), dtype, f"fake peak #{len(calls)}", "test")

    real = time.perf_counter
    ticks = iter(range(10**9))
    monkeypatch.setattr(loop, "device_peak", fake_peak)
    monkeypatch.setattr(time, "perf_counter", lambda: real() + 31.0 * next(ticks))  # 31 s/call
    out = io.StringIO()
    run = load_run(
        str(CONFIGS / "tiny-cpu.toml"),
        ["train.steps=4", "train.warmup_steps=1", f'train.run_dir="{tmp_path}"',
         "train.progress=false", "train.tensorboard=false", "train.save_final=false"],
    )  # fmt: skip
    summary = start.train(run, console=Console(file=out, width=300))
    assert len(calls) == 1 and summary.peak_label == "fake peak #1"
    text = out.getvalue()
    assert "MFU against: fake peak #1" in text and "(vs fake peak #1)" in text


def test_the_progress_bar_runs_a_clock_inside_each_step() -> None:
    """The bar moved once per step: a long step looked hung. It shows the seconds in the step."""
    now = [100.0]
    reporter = ConsoleReporter(
        Console(file=io.StringIO(), force_terminal=True, width=200),
        1000, 0, 25, progress=True, clock=lambda: now[0],
    )  # fmt: skip

    def shown() -> str:
        progress = reporter._progress
        out = Console(file=io.StringIO(), width=200, color_system=None)
        out.print(progress.make_tasks_table(progress.tasks))
        return out.file.getvalue()

    try:
        now[0] = 175.0
        assert "step 1: 75 s" in shown()
        reporter.update(_metrics(1))
        now[0] = 187.4
        assert "step 2: 12 s" in shown()
    finally:
        reporter.stop()


def test_the_header_says_which_device_profile_and_where_it_came_from(tmp_path, monkeypatch, capsys):
    """A profile at the default location changed every later CPU run's predictions and MFU
    basis without a word. The header names it and its origin, or says there is none."""
    import fivefold.train.start as start
    from fivefold.specs.profile import parse_profile
    from fivefold.train.entry import load_run
    from fivefold.train.summary import profile_origin

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "planner"))
    from test_profile import synthetic

    text = parse_profile(synthetic()).to_toml()
    installed, named = tmp_path / "default.toml", tmp_path / "named.toml"
    installed.write_text(text)
    named.write_text(text)
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(tmp_path / "absent.toml"))
    assert profile_origin("").startswith("none (step time is not predicted; MFU is against a")
    assert profile_origin(str(named)).startswith(f"{named} (named by the recipe")
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(installed))
    assert profile_origin(str(installed)).startswith(f"{installed} (the default location")

    def header(*overrides: str) -> str:
        out = io.StringIO()
        run = load_run(
            str(CONFIGS / "tiny-cpu.toml"),
            ["train.steps=1", "train.warmup_steps=0", f'train.run_dir="{tmp_path / "run"}"',
             "train.progress=false", "train.tensorboard=false", "train.save_final=false",
             "train.resume=false", *overrides],
        )  # fmt: skip
        start.train(run, console=Console(file=out, width=400))
        return out.getvalue()

    # `plan` on a measured machine says which profile its figures come from, too.
    assert main(["plan", "estimate", str(CONFIGS / "tiny-cpu.toml"), "--cluster", str(named),
                 "--gpus", "1"]) == 0  # fmt: skip
    assert f"device profile: {named}" in capsys.readouterr().out
    shown = header()  # no [cluster]: the profile at the default location, said so
    assert f"device profile: {installed} (the default location, used by every CPU run" in shown
    assert "MFU against: calibrated CPU fp32 matmul peak" in shown
    # A step time predicted for the idle machine, measured on a busy one: said at the start.
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    shown = header()
    from fivefold.specs.profile import available_cores

    cores = available_cores()
    assert (f"note: this machine was busy at the start (load average 9.0 on {cores} core(s)" in
            shown) is (cores < 9)  # fmt: skip
    assert cores >= 9 or "the measured step times will be slower" in shown
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(tmp_path / "absent.toml"))
    shown = header()
    assert "device profile: none (step time is not predicted" in shown
    assert "MFU against: fixed CPU reference" in shown
    assert "note: this machine was busy" not in shown  # no step time predicted, nothing to say
