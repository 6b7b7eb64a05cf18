"""Checks before any process starts: memory (the planner's prediction against what this machine
has free), the paths a recipe names, the checkpoint it resumes, and the batch against the data.
Each used to be found only after the ranks had started (or never: a rank killed by the kernel).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.launch import machine_memory
from fivefold.parallel.report import predictions_for
from fivefold.train.entry import load_run
from fivefold.train.prestart import GIB, MemoryFit

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml")
FOUR_RANKS = ["--nproc", "4", "plan.dp_replicate=4", "plan.grad_accum=1"]


def refuse_starts(monkeypatch) -> None:
    """Fail the test if anything would start: the checks must refuse first."""

    def started(*args, **kwargs):
        raise AssertionError("the run was started")

    monkeypatch.setattr("fivefold.launch.launcher.launch_local", started)
    monkeypatch.setattr("fivefold.train.start.train", started)


@pytest.fixture(name="no_launch")
def _no_launch(monkeypatch) -> None:
    refuse_starts(monkeypatch)


def _train(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", TINY, "train.progress=false", *args])
    return code, capsys.readouterr().err


# ---- memory --------------------------------------------------------------------------------
def test_a_run_that_cannot_fit_is_refused_with_the_planners_numbers(
    monkeypatch, capsys, tmp_path, no_launch
):
    """4 ranks of mbs 256 against 1 GiB free: the prediction x 4 ranks is the need; refused
    before anything starts, naming both figures and the levers for activations."""
    monkeypatch.setattr(machine_memory, "available_bytes", lambda: GIB)
    overrides = ["plan.micro_batch=256", f'train.run_dir="{tmp_path}"']
    code, err = _train(capsys, *FOUR_RANKS, *overrides)
    assert code == 2
    run = load_run(TINY, [*FOUR_RANKS[2:], *overrides, "plan.precision='fp32'"], world_size=4)
    memory, _, _ = predictions_for(run.recipe, False, fsdp_wrapped=True)
    per_rank = memory[0]["total"]
    assert per_rank * 4 > 1.0  # the case is one that cannot fit
    assert f"a peak of {per_rank:,.2f} GiB per rank, {4 * per_rank:,.1f} GiB for the 4 ranks" in err
    assert "more than the 1.0 GiB of memory free" in err
    assert "lower plan.micro_batch (raise plan.grad_accum" in err and "fewer ranks" in err


def test_a_dry_run_prints_the_prediction_then_what_is_wrong(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(machine_memory, "available_bytes", lambda: GIB)
    code = main(["train", TINY, *FOUR_RANKS, "plan.micro_batch=256", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "stage 0: peak memory" in out and "this run does not fit" in err


def _one_rank_need(tmp_path) -> float:
    """The planner's peak (bytes) for the tiny recipe on one host rank, mbs 64."""
    run = load_run(TINY, ["plan.micro_batch=64", f'train.run_dir="{tmp_path}"'], world_size=1)
    return predictions_for(run.recipe, False, fsdp_wrapped=False)[0][0]["total"] * GIB


@pytest.mark.parametrize("headroom", [0.99, 1.01])
def test_one_rank_is_refused_just_below_its_peak_and_started_just_above(
    monkeypatch, capsys, tmp_path, headroom
):
    """One host rank: the whole prediction against the memory free, with 1 % either way."""
    need = _one_rank_need(tmp_path)
    monkeypatch.setattr(machine_memory, "available_bytes", lambda: int(need * headroom))
    started = []
    summary = types.SimpleNamespace(exit_code=0)
    monkeypatch.setattr("fivefold.train.start.train", lambda *a, **k: started.append(1) or summary)
    code, err = _train(capsys, "plan.micro_batch=64", f'train.run_dir="{tmp_path}"')
    if headroom < 1:
        assert code == 2 and not started
        assert f"predicts a peak of {need / GIB:,.2f} GiB, more than the " in err
        assert "for the 1 ranks" not in err and "fewer ranks" not in err
    else:
        assert started == [1] and "does not fit" not in err


def test_the_cuda_memory_fit_takes_one_rank_against_the_emptiest_of_its_gpus(
    monkeypatch, tmp_path
) -> None:
    """`memory_fit` on CUDA: the per-rank prediction (fsdp-wrapped for 2 ranks) against the
    least free of the ranks' GPUs, as NVML reports them."""
    from fivefold.train.prestart import memory_fit

    run = load_run(TINY, [*FOUR_RANKS[2:], f'train.run_dir="{tmp_path}"'], world_size=4)
    per_rank = predictions_for(run.recipe, True, fsdp_wrapped=True)[0][0]["total"] * GIB
    free = [int(per_rank * 3), int(per_rank * 0.9), int(per_rank * 2), int(per_rank * 3)]
    monkeypatch.setattr(machine_memory, "gpu_free_bytes", lambda n, in_process=False: free[:n])
    monkeypatch.setattr(machine_memory, "available_bytes", lambda: 0)  # the host: not asked
    fit = memory_fit(run, 4, cuda=True)
    assert fit.free_bytes == free[1] and fit.need_bytes == pytest.approx(per_rank)
    (problem,) = fit.problems()
    assert f"a peak of {per_rank / GIB:,.2f} GiB per rank, more than the " in problem
    assert "free on the emptiest GPU" in problem
    free[1] = int(per_rank * 1.01)
    assert memory_fit(run, 4, cuda=True).problems() == []


def test_memory_fit_on_gpus_compares_one_rank_with_the_emptiest_gpu() -> None:
    """GPU memory is per rank: 3 GiB of weights and state per rank against 2 GiB free."""
    fit = MemoryFit([(3 * GIB, "optimizer")], ranks=2, cuda=True, free_bytes=2 * GIB)
    (problem,) = fit.problems()
    assert "a peak of 3.00 GiB per rank, more than the 2.00 GiB free on the emptiest GPU" in problem
    assert "plan.zero = 3" in problem and "fewer ranks" not in problem
    assert MemoryFit([(3 * GIB, "optimizer")], 2, True, 4 * GIB).problems() == []
    # on the host every rank counts: two stages of 2 and 4 GiB on 4 ranks (2 per stage) = 12
    host = MemoryFit([(2 * GIB, "activations"), (4 * GIB, "params")], 4, False, 11 * GIB)
    assert host.need_bytes == 12 * GIB
    assert "(pipeline stage 1), 12.0 GiB for the 4 ranks" in host.problems()[0]
    assert MemoryFit([(GIB, "params")], 1, False, None).problems() == []  # unknown: no check


def test_gpu_free_memory_comes_from_nvml_without_a_cuda_context(monkeypatch) -> None:
    import torch

    props = types.SimpleNamespace(total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda i: (i + 1) * GIB)

    def no_context(*args):
        raise AssertionError("mem_get_info creates a CUDA context in the launcher")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    assert machine_memory.gpu_free_bytes(2) == [79 * GIB, 78 * GIB]
    assert machine_memory.gpu_free_bytes(3) is None  # more ranks than GPUs: not this check's


# ---- /proc and the memory cgroup ------------------------------------------------------------
def _fake_linux(tmp_path: Path, monkeypatch, cgroup_line: str) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    (proc / "meminfo").write_text("MemTotal:  24000000 kB\nMemAvailable:  20000000 kB\n")
    (proc / "vmstat").write_text("pgfault 12\noom_kill 7\n")
    monkeypatch.setattr(machine_memory, "PROC", proc)
    monkeypatch.setattr(machine_memory, "CGROUP_ROOT", root)
    return proc, root


def test_available_memory_is_the_least_of_memavailable_and_the_cgroup_limit(
    tmp_path, monkeypatch
) -> None:
    _, root = _fake_linux(tmp_path, monkeypatch, "0::/job")
    job = root / "job"
    job.mkdir(parents=True)
    (job / "memory.max").write_text("max\n")  # no limit: MemAvailable
    (job / "memory.current").write_text(str(5 * GIB))
    assert machine_memory.available_bytes() == 20000000 * 1024
    (job / "memory.max").write_text(str(8 * GIB))  # 8 - 5 GiB left under the limit
    assert machine_memory.available_bytes() == 3 * GIB
    (job / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert machine_memory.oom_kill_count() == 2


def test_cgroup_v1_and_the_machine_wide_count(tmp_path, monkeypatch) -> None:
    _, root = _fake_linux(tmp_path, monkeypatch, "4:memory:/process_api/abc")
    assert machine_memory.oom_kill_count() == 7  # no cgroup files: /proc/vmstat's
    group = root / "memory" / "process_api" / "abc"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (group / "memory.usage_in_bytes").write_text(str(GIB))
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert machine_memory.available_bytes() == 20000000 * 1024
    assert machine_memory.oom_kill_count() == 1


# ---- paths ---------------------------------------------------------------------------------
def test_every_missing_path_is_reported_before_any_rank_starts(capsys, tmp_path, no_launch):
    shards, tokenizer = tmp_path / "no-shards", tmp_path / "no-tokenizer.json"
    empty = tmp_path / "empty-shards"
    empty.mkdir()
    code, err = _train(
        capsys, *FOUR_RANKS, f'data.shards="{shards}"', f'data.tokenizer="{tokenizer}"',
        f'train.run_dir="{tmp_path / "run"}"',
    )  # fmt: skip
    assert code == 2
    assert "2 problems in the configuration:" in err
    assert f"data.shards = {str(shards)!r} is not a directory" in err
    assert f"data.tokenizer: tokenizer file {str(tokenizer)!r} does not exist" in err
    assert "found by rank" not in err
    code, err = _train(
        capsys, *FOUR_RANKS, f'data.shards="{empty}"', f'train.run_dir="{tmp_path / "run"}"'
    )
    assert code == 2 and "is not a shard directory" in err
    code, err = _train(
        capsys, *FOUR_RANKS, f'data.inputs=["{tmp_path / "a.txt"}"]',
        f'train.run_dir="{tmp_path / "run"}"',
    )  # fmt: skip
    assert code == 2 and f"data.inputs: {str(tmp_path / 'a.txt')!r} does not exist" in err


def test_the_checkpoint_to_resume_must_hold_this_model(capsys, tmp_path, monkeypatch) -> None:
    run_dir = f'train.run_dir="{tmp_path}"'
    assert (
        main(["train", TINY, "--steps", "1", "train.warmup_steps=1", "--no-progress", run_dir]) == 0
    )
    capsys.readouterr()
    refuse_starts(monkeypatch)
    code, err = _train(capsys, *FOUR_RANKS, "model.layers=3", run_dir)
    assert code == 2
    assert "holds a different model: model.layers = 3 (checkpoint: 2)" in err
    assert "found by" not in err


# ---- the batch against the data -------------------------------------------------------------
def test_a_batch_larger_than_the_data_is_warned_about(tmp_path) -> None:
    from fivefold.train.inputs import load_train_data

    run = load_run(TINY, ["plan.micro_batch=4", f'train.run_dir="{tmp_path}"'])
    data = load_train_data(run)
    assert data.repeat_note() is None  # 8 sequences a step
    samples = len(data.train)
    data.global_batch = 2 * samples + 1
    note = data.repeat_note()
    assert note.startswith(f"warning: a step takes {2 * samples + 1:,} sequences but the data")
    assert f"holds {samples:,} training samples" in note and "(2.0 epochs per step)" in note


def test_the_memory_check_predicts_the_run_as_it_compiles(monkeypatch) -> None:
    """The pre-launch check uses the prediction `--dry-run` prints, for the run's
    train.compile (the lean eager blocks now keep what the compiled ones keep, so the two
    predictions are told apart by the argument the check passes, not by their values)."""
    import fivefold.parallel.report as report
    from fivefold.train.prestart import memory_fit

    monkeypatch.setattr(machine_memory, "available_bytes", lambda: 64 * GIB)
    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs.get("compiled"))
        return predictions_for(*args, **kwargs)

    monkeypatch.setattr(report, "predictions_for", recording)
    for compiled in (False, True):
        run = load_run(TINY, [f"train.compile={str(compiled).lower()}"], 1)
        memory, _, _ = predictions_for(run.recipe, False, fsdp_wrapped=False, compiled=compiled)
        fit = memory_fit(run, 1, cuda=False)
        assert [peak for peak, _ in fit.stages] == [m["total"] * GIB for m in memory]
    assert asked == [False, True]
