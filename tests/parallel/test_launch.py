"""`fivefold launch` / `fivefold train --nproc`: the sbatch script, the layout check before
anything starts, and a real 2-process torchrun of the tiny recipe."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.launch import launcher as launch
from fivefold.launch.launcher import launch_local, torchrun_command
from fivefold.train.entry import check_layout

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPE = str(CONFIGS / "small-dp2-tp2-pp2.toml")


def test_slurm_script_runs_torchrun_on_every_node(capsys) -> None:
    code = main(
        [
            "launch",
            "--slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--partition",
            "gpu",
            RECIPE,
            "train.steps=50",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--max-restarts=3",  # the Slurm default: a cluster job restarts after a failure
        '--rdzv-endpoint="$head_node:29500"',
        f"-m fivefold.train {RECIPE} train.steps=50",
    ):
        assert line in out
    assert out.startswith("#!/bin/bash\n")
    assert "2 node(s) x 4 GPU(s) = 8 ranks" in out


def test_slurm_refuses_a_plan_that_does_not_fill_the_allocation(capsys) -> None:
    code = main(["launch", "--slurm", RECIPE, "--nodes", "2", "--gpus-per-node", "8"])
    err = capsys.readouterr().err
    assert code == 2
    assert "multiply to 8 GPUs" in err and "= 16" in err and "use --nodes 1" in err
    assert "Traceback" not in err


def test_launchers_check_the_layout_before_starting(capsys) -> None:
    with pytest.raises(ConfigError, match="16"):
        check_layout(RECIPE, [], 16)
    with pytest.raises(ConfigError, match=r"plan\.zero = 7"):
        check_layout(RECIPE, ["plan.zero=7"], 8)
    for extra, needle in (([], "16"), (["plan.zero=7"], "plan.zero = 7")):
        world = "16" if needle == "16" else "8"
        code = main(["launch", RECIPE, *extra, "--nproc", world])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err


def test_torchrun_command_is_this_python_running_the_agent_and_train_module() -> None:
    cmd = torchrun_command(4, "r.toml", ["plan.tp=2"])
    assert cmd[:3] == [sys.executable, "-m", "fivefold.launch.agent"]
    assert "--standalone" in cmd and "--nproc-per-node=4" in cmd
    assert "--max-restarts=0" in cmd  # no restart unless asked
    assert cmd[-4:] == ["-m", "fivefold.train", "r.toml", "plan.tp=2"]
    assert "--max-restarts=3" in torchrun_command(4, "r.toml", [], max_restarts=3)


def test_slurm_script_takes_max_restarts(capsys) -> None:
    args = ["launch", "--slurm", "--gpus-per-node", "8", "--max-restarts", "5", RECIPE]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "    --max-restarts=5 \\\n" in out and "--max-restarts=3" not in out
    assert main([*args[:-2], "-1", RECIPE]) == 2
    assert "--max-restarts -1: must be >= 0" in capsys.readouterr().err


class RecordedRun:
    """Stands in for run_supervised: records the command instead of starting torchrun."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, command, env=None) -> int:
        self.commands.append(list(command))
        return 0


@pytest.mark.parametrize(
    ("cli_args", "expected_nproc", "expected_restarts"),
    [
        (["launch", "--nproc", "8", "--max-restarts", "2", RECIPE], 8, 2),
        (["launch", "--nproc", "8", RECIPE], 8, 0),
        (["train", "--nproc", "8", "--max-restarts", "4", RECIPE], 8, 4),
        (["train", RECIPE, "--nproc", "8", "--max-restarts", "1"], 8, 1),  # options after it
        # one process with restarts also runs under torchrun, which restarts it
        (["train", str(CONFIGS / "tiny-cpu.toml"), "--max-restarts", "2"], 1, 2),
    ],
)
def test_max_restarts_reaches_the_torchrun_command(
    monkeypatch, cli_args, expected_nproc, expected_restarts
) -> None:
    recorded = RecordedRun()
    monkeypatch.setattr(launch, "run_supervised", recorded)
    assert main(cli_args) == 0
    (command,) = recorded.commands
    assert command[:3] == [sys.executable, "-m", "fivefold.launch.agent"]
    assert f"--nproc-per-node={expected_nproc}" in command
    assert [a for a in command if a.startswith("--max-restarts")] == [
        f"--max-restarts={expected_restarts}"
    ]
    assert command.index(f"--max-restarts={expected_restarts}") < command.index("fivefold.train")


def test_launch_local_refuses_negative_max_restarts() -> None:
    with pytest.raises(ConfigError, match="--max-restarts -2: must be >= 0"):
        launch_local(8, RECIPE, [], max_restarts=-2)


def test_train_nproc_2_runs_torchrun_end_to_end(tmp_path) -> None:
    """`fivefold train --nproc 2` on the tiny recipe with ZeRO-3: 3 steps, finite losses."""
    code = main(
        [
            "train",
            "--nproc",
            "2",
            str(CONFIGS / "tiny-cpu.toml"),
            "plan.dp_shard=2",
            "plan.zero=3",
            "plan.micro_batch=4",
            "plan.grad_accum=1",
            "train.steps=3",
            "train.warmup_steps=1",
            f'train.run_dir="{tmp_path}"',
            "train.save_final=false",
            "train.progress=false",
            "train.tensorboard=false",
        ]
    )
    assert code == 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert len(losses) == 3
    assert all(0.0 < loss < 9.0 for loss in losses)  # ln(4096) = 8.3 at the start


# ---- the sbatch script: nothing a user types reaches a shell or directive unchecked ----------
SBATCH_VALUE = re.compile(r"[A-Za-z0-9._%:,=/-]+")


def sbatch_directives(script: str) -> dict[str, str]:
    """The `#SBATCH --key=value` lines of a script, parsed as sbatch reads them (directives end
    at the first line that is neither a comment nor blank); every value must be one plain word
    (no quotes, spaces, ';', '$' or backquotes)."""
    out = {}
    for line in script.splitlines()[1:]:
        if line and not line.startswith("#"):
            break
        if not line.startswith("#SBATCH"):
            continue
        match = re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(.*))?", line)
        assert match, f"malformed directive: {line!r}"
        value = match.group(2) or ""
        assert not value or SBATCH_VALUE.fullmatch(value), f"unsafe value: {line!r}"
        out[match.group(1)] = value
    return out


def _slurm(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["launch", "--slurm", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _bash_n(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("--job-name", 'x"; touch f; echo "', "--job-name"),
        ("--job-name", "a b", "--job-name"),
        ("--job-name", "x\n#SBATCH --account=theirs", "--job-name"),
        ("--time", "abc", "--time 'abc'"),
        ("--time", "04:00:00; rm -rf /", "--time"),
        ("--partition", "gpu --account=x", "--partition"),
        ("--partition", "$(id)", "--partition"),
    ],
)
def test_slurm_refuses_hostile_values(capsys, option, value, needle) -> None:
    code, out, err = _slurm(capsys, "--gpus-per-node", "8", option, value, RECIPE)
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("time", ["90", "30:00", "04:00:00", "2-00", "2-12:30", "1-00:00:00"])
def test_slurm_accepts_every_sbatch_time_format(capsys, time, tmp_path) -> None:
    code, out, _ = _slurm(capsys, "--gpus-per-node", "8", "--time", time, RECIPE)
    assert code == 0
    assert sbatch_directives(out)["time"] == time
    _bash_n(out, tmp_path)


def test_slurm_quotes_hostile_paths_and_overrides(capsys, tmp_path) -> None:
    """A recipe path and an override holding shell syntax stay single words in the script."""
    hostile_dir = tmp_path / "a b;$(touch pwned)`id`"
    hostile_dir.mkdir()
    recipe = hostile_dir / "r.toml"
    recipe.write_text(Path(RECIPE).read_text())
    code, out, err = _slurm(capsys, "--gpus-per-node", "8", str(recipe), 'train.name="x; y"')
    assert code == 0, err
    _bash_n(out, tmp_path)
    directives = sbatch_directives(out)
    assert directives["job-name"] == "fivefold-x-y"  # the default name, made safe
    assert directives["output"] == "fivefold-x-y-%j.out"
    command = out.split("--rdzv-endpoint", 1)[1].splitlines()[1].strip()
    assert shlex.split(command)[-4:] == ["-m", "fivefold.train", str(recipe), 'train.name="x; y"']
    assert not (tmp_path / "pwned").exists()


def test_slurm_runs_this_python_and_sizes_nodes_from_the_recipe(capsys, tmp_path) -> None:
    code, out, _ = _slurm(capsys, str(CONFIGS / "llama3-8b-dgx-h100.toml"))  # 64 GPUs, 8/node
    assert code == 0
    directives = sbatch_directives(out)
    assert directives["nodes"] == "8" and directives["gpus-per-node"] == "8"
    assert f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m torch" in out
    assert "srun --kill-on-bad-exit=1 python " not in out
    _bash_n(out, tmp_path)


def test_slurm_refuses_a_planner_only_recipe(capsys, tmp_path) -> None:
    recipe = tmp_path / "plan-only.toml"
    recipe.write_text('[model]\npreset = "tiny"\n[plan]\ntp = 2\n')
    code, out, err = _slurm(capsys, "--gpus-per-node", "2", str(recipe))
    assert code == 2 and out == ""
    assert "no [train] or [data] section" in err


# ---- restarts: only the last attempt decides --------------------------------------------------
def _processes_with(token: str, needle: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"FIVEFOLD_TEST_TOKEN={token}".encode() in environ and needle in environ:
            found.append(int(entry.name))
    return found


def _logged_steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line]


def test_a_restart_that_completes_exits_0_and_says_where_it_resumed(tmp_path) -> None:
    """`--nproc 2 --max-restarts 1`, rank 1 SIGKILLed after step 2 (both ranks paused first,
    so the kill lands before the last step): torchrun restarts the group, it resumes from the
    checkpoint of the last finished step and completes. The job succeeded: exit 0, no error,
    and one note saying what happened (the first attempt's error is its history)."""
    import os
    import signal
    import time
    import uuid

    token = uuid.uuid4().hex
    steps = 8
    command = [
        sys.executable, "-m", "fivefold", "train", "--nproc", "2", "--max-restarts", "1",
        str(CONFIGS / "tiny-cpu.toml"), "plan.tp=2", f"train.steps={steps}",
        "train.warmup_steps=1", "train.ckpt_every=1", "train.eval_every=0", "train.log_every=1",
        "train.progress=false", "train.tensorboard=false", f'train.run_dir="{tmp_path}"',
    ]  # fmt: skip
    env = {**os.environ, "FIVEFOLD_TEST_TOKEN": token, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while max(_logged_steps(tmp_path / "metrics.jsonl"), default=0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        ranks = _processes_with(token, b"RANK=0") + _processes_with(token, b"RANK=1")
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        killed_after = max(_logged_steps(tmp_path / "metrics.jsonl"))
        assert killed_after < steps
        for pid in _processes_with(token, b"RANK=1"):
            os.kill(pid, signal.SIGKILL)
        for pid in _processes_with(token, b"RANK=0"):
            os.kill(pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "error:" not in out, out[-4000:]
    match = re.search(r"attempt 2 resumed from step (\d+) and completed step (\d+)", out)
    assert match, out[-4000:]
    resumed, completed = int(match.group(1)), int(match.group(2))
    assert completed == steps and 1 <= resumed <= killed_after + 1  # a step ahead if it saved
    assert out.count("note: torchrun restarted the ranks 1 time (--max-restarts): attempt 1") == 1
    assert _logged_steps(tmp_path / "metrics.jsonl")[-1] == steps
