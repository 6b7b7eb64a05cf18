"""Elastic restart after SIGKILL, stuck-rank timeouts, and the resume decision."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_harness import run_ranks

from fivefold.checkpoint import elastic
from fivefold.errors import CollectiveError, ConfigError, TrainingError
from fivefold.parallel import process_group

HERE = Path(__file__).parent


# ---- the resume decision ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "setting, restarts, has_valid, expected",
    [
        ("auto", "0", True, True),
        ("auto", "0", False, False),
        (True, "0", True, True),
        (False, "0", True, False),
        (False, "2", True, True),  # an elastic restart always resumes
        ("never", "1", False, False),  # ... when there is something to resume from
    ],
)
def test_should_resume(monkeypatch, setting, restarts, has_valid, expected):
    monkeypatch.setenv(process_group.RESTART_COUNT_ENV, restarts)
    assert elastic.should_resume(setting, has_valid) is expected


def test_resume_setting_and_timeout_errors(monkeypatch):
    with pytest.raises(ConfigError, match=r"train\.resume = 'sometimes'"):
        elastic.resume_mode("sometimes")
    monkeypatch.setenv(process_group.PG_TIMEOUT_ENV, "-3")
    with pytest.raises(ConfigError, match="FIVEFOLD_PG_TIMEOUT_S = '-3'"):
        process_group.pg_timeout_s()
    monkeypatch.setenv(process_group.PG_TIMEOUT_ENV, "45")
    assert process_group.pg_timeout_s() == 45.0


def test_collective_errors_become_messages(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    lost = pytest.raises(TrainingError, match="rank 3: step 7 lost its connection")
    with lost, process_group.collective_guard("step 7"):
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(ValueError, match="unrelated"), process_group.collective_guard("step 7"):
        raise ValueError("unrelated")


# ---- a stuck rank -----------------------------------------------------------------------------
def stuck_rank(rank: int, world: int, timeout_s: float) -> dict:
    """Rank 1 hangs; rank 0's all-reduce must end in a TrainingError within the PG timeout."""
    import torch
    import torch.distributed as dist

    os.environ[process_group.PG_TIMEOUT_ENV] = str(timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 2.0)  # long enough to be stuck, short enough for CI
        return {"rank": 1}
    start = time.monotonic()
    try:
        with process_group.collective_guard("step 12 (gradient all-reduce)"):
            dist.all_reduce(torch.ones(4))
    except TrainingError as err:
        return {"rank": 0, "message": str(err), "waited_s": time.monotonic() - start}
    return {"rank": 0, "message": None, "waited_s": time.monotonic() - start}


def test_stuck_rank_times_out_with_a_message():
    timeout_s = 3.0
    out = run_ranks(2, stuck_rank, timeout_s, pg_timeout_s=timeout_s, timeout_s=60)
    message = out[0]["message"]
    assert message is not None, "the collective did not time out"
    assert message.startswith("rank 0: step 12 (gradient all-reduce) waited longer than the")
    assert "(3 s, FIVEFOLD_PG_TIMEOUT_S)" in message and "Timed out" in message
    assert timeout_s - 0.5 <= out[0]["waited_s"] < 3 * timeout_s


# ---- SIGKILL under torchrun --max-restarts ------------------------------------------------------
PLAN = {"dp_shard": 2, "zero": 3, "tp": 2, "micro_batch": 4}  # FSDP x TP on 4 ranks
STEPS = 6
TORCHRUN_4 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]


def torchrun(args: list[str], env_extra: dict, timeout_s: float) -> subprocess.CompletedProcess:
    # torchrun shares its rendezvous store with the workers' process group by default, and a
    # restarted group then reads the dead group's addresses (pytorch/pytorch#135712): the
    # restart fails with "connectFullMesh ... Connection refused". Not sharing it fixes that.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        **env_extra,
    }
    return subprocess.run(
        [*TORCHRUN_4, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # CI runs the same restart through `fivefold train` (the next test)
def test_sigkill_one_rank_restarts_and_resumes(tmp_path):
    rng = random.Random(int(time.time()))
    kill_step, kill_rank = rng.randrange(1, STEPS - 1), rng.randrange(1, 4)
    where = f"(killed rank {kill_rank} in step {kill_step + 1})"
    worker = str(HERE / "elastic_worker.py")
    common = ["--plan", json.dumps(PLAN), "--steps", str(STEPS)]

    straight = tmp_path / "straight.jsonl"
    ref = torchrun(
        [worker, *common, "--root", str(tmp_path / "a"), "--loss-log", str(straight)], {}, 300
    )
    assert ref.returncode == 0, ref.stderr[-3000:]

    killed = tmp_path / "killed.jsonl"
    run = torchrun(
        [
            "--max-restarts",
            "1",
            worker,
            *common,
            "--root",
            str(tmp_path / "b"),
            "--loss-log",
            str(killed),
            "--kill-step",
            str(kill_step),
            "--kill-rank",
            str(kill_rank),
        ],
        {},
        400,
    )
    assert run.returncode == 0, f"{where}\n{run.stderr[-3000:]}"
    reference = {e["step"]: e["loss"] for e in read_log(straight)}
    entries = read_log(killed)
    first = [e for e in entries if e["attempt"] == 0]
    second = [e for e in entries if e["attempt"] == 1]
    assert [e["step"] for e in first] == list(range(1, kill_step + 1)), where
    # the restart resumed from the newest checkpoint (step kill_step) and went on from there
    assert [e["step"] for e in second] == list(range(kill_step + 1, STEPS + 1)), where
    for entry in first + second:
        assert entry["loss"] == reference[entry["step"]], (where, entry)


# ---- the same through `fivefold.train` itself ----------------------------------------------
TRAIN_OVERRIDES = [
    "plan.tp=2",
    "plan.dp_shard=2",
    "plan.zero=3",
    "plan.micro_batch=2",
    "plan.grad_accum=2",
    "train.steps=7",
    "train.ckpt_every=1",
    "train.warmup_steps=2",
    "train.progress=false",
    "train.tensorboard=false",
    "train.log_every=1",
    "train.device=cpu",
]


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def losses_by_step(metrics: Path) -> list[tuple[int, float]]:
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(row["step"], row["loss"]) for row in rows]


def test_fivefold_train_survives_sigkill_of_a_rank(tmp_path):
    """`torchrun --max-restarts 1 -m fivefold.train`: one worker is SIGKILLed (chosen at random,
    after a random step); the job restarts, resumes from the newest valid checkpoint by itself,
    and every loss it logs equals the uninterrupted run's at that step."""
    recipe = str(Path(__file__).parents[2] / "configs" / "tiny-cpu.toml")
    command = [*TORCHRUN_4, "--max-restarts", "1", "-m", "fivefold.train", recipe]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)

    straight = subprocess.run(
        [*command, *TRAIN_OVERRIDES, f"train.run_dir={tmp_path / 'straight'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = dict(losses_by_step(tmp_path / "straight" / "metrics.jsonl"))
    assert sorted(reference) == list(range(1, 8))

    rng = random.Random(int(time.time()))
    kill_after = rng.randrange(2, 6)
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [*command, *TRAIN_OVERRIDES, f"train.run_dir={run_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = None
    deadline = time.monotonic() + 300
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        if any(step >= kill_after for step, _ in losses_by_step(run_dir / "metrics.jsonl")):
            workers = children(proc.pid)
            victim = rng.choice(workers)
            os.kill(victim, 9)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=400)
    where = f"(SIGKILLed worker pid {victim} after step {kill_after})"
    assert victim is not None, f"never reached step {kill_after}: {err[-3000:]}"
    assert proc.returncode == 0, f"{where}\n{err[-3000:]}"
    assert "resumed from" in out, where
    logged = losses_by_step(run_dir / "metrics.jsonl")
    assert sorted({step for step, _ in logged}) == list(range(1, 8)), (where, logged)
    for step, loss in logged:
        assert loss == reference[step], (where, step, loss, reference[step])


# ---- which ranks arrived --------------------------------------------------------------------
def stopped_rank(rank: int, world: int, timeout_s: float) -> dict:
    """Rank 2 stops itself (SIGSTOP) instead of joining the all-reduce; ranks 0 and 1 time out,
    and rank 0 lets rank 2 go on (SIGCONT) once both have their messages."""
    import signal

    import torch
    import torch.distributed as dist

    os.environ[process_group.PG_TIMEOUT_ENV] = str(timeout_s)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"rank": 2}
    start = time.monotonic()
    try:
        with process_group.collective_guard("step 7: the gradient-norm all-reduce"):
            dist.all_reduce(torch.ones(4))
    except CollectiveError as err:
        message, code = str(err), err.exit_code
    waited_s = time.monotonic() - start
    dist.distributed_c10d._get_default_store().add("done", 1)
    if rank == 0:
        while dist.distributed_c10d._get_default_store().add("done", 0) < 2:
            time.sleep(0.1)
        os.kill(pids[2], signal.SIGCONT)
    return {"message": message, "code": code, "waited_s": waited_s}


def test_a_stopped_rank_is_named_and_the_others_exit_75():
    timeout_s = 3.0
    out = run_ranks(3, stopped_rank, timeout_s, pg_timeout_s=timeout_s, timeout_s=90)
    messages = [out[0]["message"], out[1]["message"]]
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: step 7: the gradient-norm all-reduce waited")
        assert "not arrived, stuck or dead: rank 2 " in message
        assert f"Arrived: rank {rank}" in message or "Arrived: ranks 0, 1;" in message
    # the rank that timed out last saw the other's report (posted before its own)
    assert any("Arrived: ranks 0, 1;" in m for m in messages)
    assert out[0]["code"] == out[1]["code"] == 75
    # the timeout, then a bounded wait for the other ranks' reports (min(5 s, the timeout)); the
    # upper bound is loose so that a loaded machine cannot fail it, and still far from a hang
    assert all(timeout_s - 0.5 <= o["waited_s"] < 60 for o in out[:2])


def test_the_launcher_keeps_exit_75_for_a_stuck_rank():
    from fivefold.launch.rank_report import RankReport, summarize

    message = "rank 0: step 7: the gradient-norm all-reduce waited longer ..."
    reports = [RankReport(0, "error", message, 75), RankReport(1, "error", message, 75)]
    text, code = summarize(reports, 3, 75, {0: 75, 1: 75, 2: 143})
    assert code == 75 and text.startswith(message) and "found by rank 0, 1" in text
