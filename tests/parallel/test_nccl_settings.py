"""NCCL as the field runs it, checked without a GPU: the error-handling and flight-recorder
variables set before the group exists, the start-up timeout shortened after the first step on
NCCL groups only, and gloo left as it was."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.launch import launcher
from fivefold.launch.nccl_env import (
    ASYNC_ERROR_HANDLING_ENV,
    error_handling_export,
    set_error_handling,
)
from fivefold.parallel import process_group as pg
from fivefold.parallel.distributed_runtime import _comm_trace_dir
from fivefold.train.config import TrainConfig

NCCL_VARS = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    pg.FLIGHT_RECORDER_DIR_ENV,
    pg.PG_TIMEOUT_ENV,
    pg.STEP_TIMEOUT_ENV,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in NCCL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pg, "_shortened_to_s", None)


def test_nccl_env_before_the_group_exists(monkeypatch, tmp_path):
    seen = {}

    def fake_init(backend, timeout_s=None, device_id=None):
        seen.update(
            backend=backend, device=device_id, env={n: pg.os.environ.get(n) for n in NCCL_VARS}
        )

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg, "init_process_group", fake_init)
    traces = tmp_path / "run" / "comm_traces"
    assert pg.init_distributed(torch.device("cuda", 0), trace_dir=traces)
    env = seen["env"]
    assert seen["backend"] == "nccl" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"] == "20000"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(traces / "rank_") and traces.is_dir()


def test_nccl_communicators_are_made_for_the_groups_a_run_uses(monkeypatch):
    """The default group is not bound to the GPU: bound, torch's `new_group` would connect an
    NCCL communicator for every group at creation (every mesh dimension and flattened mesh,
    size-1 and unused ones included), GPU memory each; unbound, at a group's first collective."""
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.update(k))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert pg.init_distributed(torch.device("cuda", 3))
    assert seen.get("device_id") is None and "timeout" in seen


def test_gloo_gets_no_nccl_settings(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        pg, "init_process_group", lambda backend, t=None, **k: calls.append(backend)
    )
    assert pg.init_distributed(torch.device("cpu"))
    assert calls == ["gloo"] and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in pg.os.environ


def test_what_the_user_set_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv(pg.FLIGHT_RECORDER_DIR_ENV, str(tmp_path / "mine"))
    env = pg.set_nccl_env(tmp_path / "run")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "mine" / "rank_")


def test_traces_go_to_the_run_directory(tmp_path):
    train = TrainConfig(runs_dir=str(tmp_path), name="r1")
    assert _comm_trace_dir(train) == tmp_path / "r1" / "comm_traces"


def test_nccl_groups_get_the_shorter_timeout_after_the_first_step(monkeypatch):
    nccl_a, nccl_b, gloo = object(), object(), object()
    backends = {nccl_a: "nccl", nccl_b: "nccl", gloo: "gloo"}
    set_to, order = {}, []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(pg, "process_groups", lambda: [nccl_a, gloo, nccl_b])
    monkeypatch.setattr(dist, "get_backend", lambda group: backends[group])
    monkeypatch.setattr(dist, "barrier", lambda device_ids=None: order.append("barrier"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("sync"))

    def set_timeout(timeout, group):
        order.append("set")
        set_to[group] = timeout

    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", set_timeout)
    assert pg.current_timeout_s() == 600.0
    assert pg.shorten_timeout_after_first_step(torch.device("cuda", 0)) == 300.0
    assert set_to == {nccl_a: timedelta(seconds=300), nccl_b: timedelta(seconds=300)}
    assert order[:2] == ["barrier", "sync"]  # every rank is past the first step first
    assert pg.current_timeout_s() == 300.0
    message = pg.describe_collective_failure(RuntimeError("Watchdog timed out"), "step 7", 3)
    assert "(300 s, FIVEFOLD_PG_STEP_TIMEOUT_S)" in message
    assert pg.shorten_timeout_after_first_step(torch.device("cuda", 0)) is None  # once only


def test_a_cpu_run_keeps_its_gloo_timeout(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=600)
    )
    try:
        assert pg.process_groups() == [dist.group.WORLD]
        assert pg.shorten_timeout_after_first_step(torch.device("cpu")) is None
        assert pg.current_timeout_s() == 600.0
    finally:
        dist.destroy_process_group()


def test_step_timeout_settings(monkeypatch):
    monkeypatch.setenv(pg.PG_TIMEOUT_ENV, "120")
    assert pg.step_timeout_s() == 120.0  # never above the start-up timeout
    monkeypatch.setenv(pg.STEP_TIMEOUT_ENV, "45")
    assert pg.step_timeout_s() == 45.0
    monkeypatch.setenv(pg.STEP_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match="FIVEFOLD_PG_STEP_TIMEOUT_S = 'soon'"):
        pg.step_timeout_s()


# ---- the ranks' environment under torchrun ---------------------------------------------------
# torchrun's agent exports TORCH_NCCL_ASYNC_ERROR_HANDLING (its default 1) into every worker
# unless its own environment has it: the ranks below report what they were started with.
RANK_ENV_SCRIPT = (
    "import os, sys\n"
    "name = 'TORCH_NCCL_ASYNC_ERROR_HANDLING'\n"
    "with open(os.path.join(sys.argv[1], os.environ['RANK']), 'w') as f:\n"
    "    f.write(os.environ.get(name, 'unset'))\n"
)
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def _rank_env_script(tmp_path: Path) -> tuple[Path, Path]:
    script, seen = tmp_path / "rank_env.py", tmp_path / "seen"
    script.write_text(RANK_ENV_SCRIPT)
    seen.mkdir()
    return script, seen


def _seen_by_ranks(seen: Path) -> list[str]:
    return [(seen / str(rank)).read_text() for rank in range(2)]


def test_ranks_of_fivefold_train_nproc_get_the_error_handling(monkeypatch, tmp_path):
    """`fivefold train --nproc 2`: the launcher and torchrun's agent as they run, the ranks
    replaced by a script that reports its environment."""
    script, seen = _rank_env_script(tmp_path)
    real = launcher.torchrun_command

    def reporting_ranks(nproc, recipe_path, overrides, max_restarts=0):
        command = real(nproc, recipe_path, overrides, max_restarts)
        return [*command[: command.index("fivefold.train") - 1], str(script), str(seen)]

    monkeypatch.setattr(launcher, "torchrun_command", reporting_ranks)
    code = main(["train", "--nproc", "2", str(TINY), "plan.dp_replicate=2", "plan.grad_accum=1"])
    assert code == 0
    assert _seen_by_ranks(seen) == ["3", "3"]


@pytest.mark.slow  # the same torchrun agent as above; here the script's shell sets the value
def test_ranks_of_the_sbatch_script_get_the_error_handling(capsys, tmp_path):
    """The sbatch script's exports, then torchrun as the script runs it (one node)."""
    script, seen = _rank_env_script(tmp_path)
    assert (
        main(["launch", "--slurm", "--gpus-per-node", "2", str(TINY), "plan.dp_replicate=2"]) == 0
    )
    exports = [line for line in capsys.readouterr().out.splitlines() if line.startswith("export")]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run = " ".join([*torchrun, "--nproc-per-node=2", str(script), str(seen)])
    env = {k: v for k, v in pg.os.environ.items() if k != ASYNC_ERROR_HANDLING_ENV}
    result = subprocess.run(["bash", "-c", "\n".join([*exports, run])], env=env, timeout=300)
    assert result.returncode == 0
    assert _seen_by_ranks(seen) == ["3", "3"]


def test_a_value_the_user_set_reaches_the_ranks_unchanged():
    env = {ASYNC_ERROR_HANDLING_ENV: "1"}
    assert set_error_handling(env) == "1" and env == {ASYNC_ERROR_HANDLING_ENV: "1"}
    assert set_error_handling({}) == "3"
    line = error_handling_export()
    script = f"{ASYNC_ERROR_HANDLING_ENV}=2\n{line}\necho ${ASYNC_ERROR_HANDLING_ENV}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout
    assert out.strip() == "2"


def test_the_sbatch_script_sets_it_before_torchrun(capsys):
    assert (
        main(["launch", "--slurm", "--gpus-per-node", "2", str(TINY), "plan.dp_replicate=2"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines.index(error_handling_export()) < next(
        i for i, line in enumerate(lines) if "torch.distributed.run" in line
    )
