"""Ctrl-C, SIGTERM and a dying rank under `fivefold train --nproc N`: every rank stops within
seconds, the interrupted step is checkpointed on every rank, nothing is left running, and the
exit status is the documented one (128 + signal; a killed rank: its status).

Orphans are found without psutil: every process the run starts inherits a unique token in its
environment, and /proc/*/environ is scanned for it after the run.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fivefold.train.interrupt import StopRequest, acknowledge

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = str(CONFIGS / "tiny-cpu.toml")
LAYOUTS = {
    1: [],
    2: ["plan.tp=2"],  # the hang: a rank left inside a TP collective
    4: ["plan.tp=2", "plan.dp_replicate=2", "plan.grad_accum=1"],
}
STOP_WITHIN_S = 60.0  # bound on signal -> launcher exit on a loaded 2-core machine


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


def _metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            steps.append(json.loads(line)["step"])
    return steps


class Run:
    """`fivefold train --nproc N` on the tiny recipe in a subprocess with a unique env token."""

    def __init__(self, tmp_path: Path, nproc: int, log_every: int = 1):
        self.token = f"fivefold-test-{uuid.uuid4().hex}"
        self.run_dir = tmp_path / f"run-{nproc}"
        command = [
            sys.executable,
            "-m",
            "fivefold",
            "train",
            "--nproc",
            str(nproc),
            TINY,
            *LAYOUTS[nproc],
            "train.steps=100000",
            f"train.log_every={log_every}",
            "train.eval_every=0",
            "train.progress=false",
            "train.tensorboard=false",
            "train.save_final=false",
            f'train.run_dir="{self.run_dir}"',
        ]
        env = {**os.environ, "FIVEFOLD_TEST_TOKEN": self.token, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def wait_for_step(self, step: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while max(_metric_steps(self.run_dir), default=0) < step:
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.monotonic() < deadline, f"no step {step} within {timeout_s} s"
            time.sleep(0.05)

    def finish(self) -> tuple[int, str, float]:
        """(exit status, output, seconds to exit); kills the tree if it hangs (and fails)."""
        start = time.monotonic()
        try:
            out, _ = self.proc.communicate(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            self.kill_everything()
            out, _ = self.proc.communicate()
            pytest.fail(f"the run did not stop within {STOP_WITHIN_S} s:\n{out[-3000:]}")
        return self.proc.returncode, out, time.monotonic() - start

    def leftovers(self) -> list[int]:
        deadline = time.monotonic() + 5.0  # the kernel may need a moment to reap
        while (left := _processes_with(self.token)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def kill_everything(self) -> None:
        for pid in _processes_with(self.token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def pid_of(self, needle: str) -> int:
        for pid in _processes_with(self.token):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle.encode() in cmdline or needle.encode() in environ:
                return pid
        raise AssertionError(f"no process of the run matches {needle!r}")


def _newest_checkpoint_step(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "ckpt").glob("step_*")]
    return max(steps, default=0)


def interrupt_once(
    tmp_path: Path,
    nproc: int,
    at_step: int,
    sig: int,
    target: str,
    early_s: float = 0.0,
    log_every: int = 1,
) -> None:
    """Start a run, signal the launcher (or the agent) after `at_step` (0: `early_s` seconds
    after the start, while processes start up), check the ending. With `log_every` > 1 the
    ranks agree on a stop only at a read-back, and the run must name that step at once."""
    run = Run(tmp_path, nproc, log_every)
    try:
        if at_step:
            run.wait_for_step(at_step)
        else:
            time.sleep(early_s)
        pid = run.proc.pid if target == "launcher" else run.pid_of("fivefold.launch.agent")
        os.kill(pid, sig)
        code, out, seconds = run.finish()
    finally:
        left = run.leftovers()
        run.kill_everything()
    assert not left, f"processes left behind: {left}\n{out[-2000:]}"
    assert code == 128 + sig, out[-3000:]
    assert seconds < STOP_WITHIN_S
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    if not at_step:
        return  # stopped before or during the first steps: nothing more is promised
    last = max(_metric_steps(run.run_dir))
    assert last >= at_step
    assert _newest_checkpoint_step(run.run_dir) == last  # the step it stopped at, on every rank
    assert out.count("interrupted after step") == 1, out[-2000:]
    # Said when the signal came (rank 0 only), not when the step ended; one process names the
    # step at once, N ranks name it when they agree on it (a rank may be asked later than another).
    said = f"{signal.Signals(sig).name} received: stopping "
    assert out.count(said) == 1, out[-2000:]
    stops_after = f"stopping after step {last} with a checkpoint"
    assert out.count(stops_after) == 1, out[-2000:]  # the step it stops after, named once
    if nproc > 1:
        assert f"{said}once every rank has agreed on the step" in out, out[-2000:]
    assert out.index(said) <= out.index(stops_after) < out.index("interrupted after step")
    from fivefold.checkpoint.manifest import step_dir_name, verify_checkpoint

    assert verify_checkpoint(run.run_dir / "ckpt" / step_dir_name(last)).ok


def test_the_first_signal_is_acknowledged_at_once_and_only_once() -> None:
    said: list[int] = []
    request = StopRequest(announce=said.append)
    request.handle(signal.SIGINT)
    request.handle(signal.SIGINT)  # the same Ctrl-C delivered twice (within the grace)
    assert request.signal == signal.SIGINT and said == [signal.SIGINT]
    read, write = os.pipe()
    acknowledge(signal.SIGTERM, 42, fd=write)
    os.close(write)
    text = os.read(read, 1000).decode()
    os.close(read)
    assert text.strip().startswith("SIGTERM received: stopping after step 42 with a checkpoint")


def test_n_ranks_name_the_step_when_they_agree_not_when_asked() -> None:
    """A rank asked just after its read-back still stops at that read-back when another rank
    was asked before it: the step is named only from the agreement."""
    said: list[object] = []

    class Ranks:
        def any_rank(self, flag: bool) -> bool:
            return True  # the other rank was asked

    request = StopRequest()
    request.speak(many_ranks=True)
    request.announce, request.on_agreed = said.append, lambda step: said.append(("after", step))
    assert not request.agreed(Ranks(), at_read_back=False, next_step=7)
    request.handle(signal.SIGINT)
    assert request.agreed(Ranks(), at_read_back=True, next_step=8)
    assert said == [signal.SIGINT, ("after", 7)]


@pytest.mark.parametrize(
    ("nproc", "sig", "target", "log_every"),
    [(2, signal.SIGINT, "launcher", 4), (2, signal.SIGTERM, "agent", 1)],
)
def test_interrupt_stops_every_rank_with_a_checkpoint(
    tmp_path, nproc, sig, target, log_every
) -> None:
    """With log_every=4 the ranks agree on a stop only at a read-back (step 4, 8, ...): the
    message names that step, not the one in flight."""
    at_step = random.Random(nproc).randint(2, 5)
    interrupt_once(tmp_path, nproc, at_step, sig, target, log_every=log_every)


def test_interrupt_one_process_checkpoints_and_exits_130(tmp_path) -> None:
    interrupt_once(tmp_path, 1, 3, signal.SIGINT, "launcher")


@pytest.mark.parametrize("early_s", [0.5, 3.0])
def test_interrupt_during_start_up_leaves_nothing(tmp_path, early_s) -> None:
    """Ctrl-C while the agent or the ranks are still importing torch or meeting."""
    interrupt_once(tmp_path, 2, 0, signal.SIGINT, "launcher", early_s)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_interrupt_at_random_steps_twenty_times(tmp_path, nproc) -> None:
    rng = random.Random(1234 + nproc)
    for attempt in range(20):
        sig = rng.choice([signal.SIGINT, signal.SIGTERM])
        step, early = rng.randint(0, 8), rng.uniform(0.0, 6.0)  # step 0: during start-up
        interrupt_once(tmp_path / str(attempt), nproc, step, sig, "launcher", early)


def test_a_killed_rank_ends_the_job_with_one_message(tmp_path) -> None:
    """SIGKILL on rank 1 mid-run: the other rank leaves its collective, the job ends at once
    with the dead rank's status and one line from the launcher, and nothing is left."""
    run = Run(tmp_path, 2)
    try:
        run.wait_for_step(2)
        os.kill(run.pid_of("RANK=1"), signal.SIGKILL)
        code, out, seconds = run.finish()
    finally:
        left = run.leftovers()
        run.kill_everything()
    assert not left, f"processes left behind: {left}"
    assert code == 128 + signal.SIGKILL, out[-3000:]
    assert seconds < STOP_WITHIN_S
    assert out.count("rank 1 was killed by SIGKILL (exit status 137)") == 1, out[-3000:]
    assert "lost its connection" not in out  # a consequence, not the cause
    assert "ChildFailedError" not in out


# ---- a signal during an entry point's first imports ------------------------------------------
TRIGGER = """
import os, runpy, signal, sys


class Trigger:
    '''SIGINT to this process when {target!r} is first imported: a Ctrl-C that lands there.'''

    def find_spec(self, name, path=None, target=None):
        if name == {target!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, Trigger())
sys.argv = [{module!r}, *{args!r}]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    ("module", "args", "target"),
    [
        ("fivefold.train", [TINY, "train.steps=1"], "rich"),  # a rank: the CI failure
        ("fivefold", ["train", TINY, "--dry-run"], "argparse"),  # the launcher / CLI
        ("fivefold.launch.agent", ["--standalone", "--nproc-per-node=1", "-m", "x"], "logging"),
    ],
)
def test_a_signal_during_the_first_imports_waits_for_the_handler(module, args, target) -> None:
    """Every entry holds SIGINT from its first line: one that lands while it imports (here
    exactly when `target` loads) is acted on where the program handles it: exit 130, no
    traceback, nothing run."""
    code = TRIGGER.format(module=module, args=args, target=target)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    assert done.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert "step" not in done.stdout  # nothing trained


def test_a_hold_begun_by_an_entry_lasts_until_its_first_block_ends() -> None:
    """`hold_signals` at an entry's first line; a block inside the first `signals_held` block
    ends nothing; the outer block's end delivers the signal once, to the handler it replaced."""
    from fivefold.launch.shielded_import import hold_signals, signals_held

    got: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        hold_signals()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert got == []
        with signals_held():
            with signals_held():
                pass
            time.sleep(0.05)
            assert got == []
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def busy_cores(count: int = 2, limit_s: float = 240.0):
    """`count` processes spinning on a CPU each (killed on leaving, or after `limit_s`)."""
    burn = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("early_s", [1.0, 3.0])
def test_interrupt_during_start_up_under_load(tmp_path, early_s) -> None:
    """The start-up interrupt beside two busy processes (CI's loaded machine, where imports
    take longer and the signal lands in them)."""
    with busy_cores():
        interrupt_once(tmp_path, 2, 0, signal.SIGINT, "launcher", early_s)


LATE_IMPORTS = """
import runpy, sys
from fivefold.launch import shielded_import

ended, late = [], []
end = shielded_import._Hold.end


def recording_end(self, deliver):
    ended.append(True)
    return end(self, deliver)


class Late:
    '''Records every module imported after the entry's hold has ended.'''

    def find_spec(self, name, path=None, target=None):
        if ended:
            late.append(name)
        return None


shielded_import._Hold.end = recording_end
sys.meta_path.insert(0, Late())
sys.argv = ["fivefold", *{args!r}]
try:
    runpy.run_module("fivefold", run_name="__main__", alter_sys=True)
finally:
    print("LATE", sorted(late))
"""


def test_the_launcher_imports_torchs_c_extensions_inside_its_hold() -> None:
    """DTensor's import runs C code: a Ctrl-C landing in it once ended `fivefold train` with
    SIGINT (status -2) although the interrupt was handled (CI, under load). The launcher now
    imports the model package, and torch with it, while Ctrl-C is held."""
    code = LATE_IMPORTS.format(args=["train", TINY, "--dry-run"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    late = set(ast.literal_eval(done.stdout.rsplit("LATE", 1)[-1].strip()))
    assert not late & {"torch.distributed.tensor", "fivefold.model", "fivefold.model.norms"}
