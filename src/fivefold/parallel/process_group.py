"""The process group: start-up with timeouts that speak.

Details: docs/internals.md (`fivefold.parallel.process_group`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

from fivefold.errors import CollectiveError, ConfigError, TrainingError
from fivefold.launch.nccl_env import ASYNC_ERROR_HANDLING_ENV, TEAR_DOWN_WITHOUT_CLEANUP

# torch (and fivefold.model, which needs it) is imported lazily, inside the functions:
# `fivefold --help` imports this module (through fivefold.checkpoint.elastic) without torch.
if TYPE_CHECKING:
    import torch

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
PG_TIMEOUT_ENV = "FIVEFOLD_PG_TIMEOUT_S"
DEFAULT_PG_TIMEOUT_S = 600.0
_TIMEOUT = re.compile(r"timed out|timeout|watchdog", re.IGNORECASE)
_PEER_GONE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|socket closed",
    re.IGNORECASE,
)


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this job (0 on the first run)."""
    try:
        return int(os.environ.get(RESTART_COUNT_ENV, "0"))
    except ValueError:
        return 0


def pg_timeout_s() -> float:
    """Seconds a collective may wait for the slowest rank before it fails (the PG timeout)."""
    return _seconds_env(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S, "the process-group timeout", 600)


def _seconds_env(name: str, default: float, what: str, example: int) -> float:
    """A positive number of seconds from environment variable `name` (ConfigError otherwise)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{name} = {raw!r}: give {what} in seconds, e.g. {example}.")
    return value


def init_distributed(
    device: torch.device, timeout_s: float | None = None, trace_dir: str | os.PathLike | None = None
) -> bool:
    """Initialise the default process group from the torchrun env (NCCL on CUDA, gloo on CPU)
    unless one exists; True if this call created it (see `init_process_group`). On CUDA NCCL's
    error handling and flight recorder are set first (`set_nccl_env`, traces in `trace_dir`)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if device.type != "cuda":
        init_process_group("gloo", timeout_s)
        return True
    set_nccl_env(trace_dir)
    # Not bound to the device (`device_id`): a bound default group makes every later group
    # (each DeviceMesh dimension and flattened view, used or not) connect its NCCL
    # communicator, GPU memory each, at creation; unbound, a group's communicator is made at
    # its first collective, on the current device (`pick_device` set it).
    init_process_group("nccl", timeout_s)
    return True


FLIGHT_RECORDER_DIR_ENV = "FIVEFOLD_COMM_TRACE_DIR"


def set_nccl_env(trace_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """NCCL's error handling and flight recorder (what a user already set stays); returns the
    variables as set. Must run before the NCCL group exists.

    - `TORCH_NCCL_ASYNC_ERROR_HANDLING=3`: when the watchdog sees a collective fail or time out
      it ends the process at once, without aborting the communicator (which can itself hang),
      so torchrun's agent sees the failure and restarts the job (torch's documented values:
      0 nothing, 1 abort and tear down, 2 abort only, 3 tear down only). Under torchrun the
      agent has already exported it to every worker (1 unless set before torchrun started), so
      the launchers set it (`fivefold.launch.nccl_env`); here it reaches plain launches.
    - The flight recorder keeps the last 20,000 collectives per rank in a ring buffer
      (`TORCH_FR_BUFFER_SIZE`, and `TORCH_NCCL_TRACE_BUFFER_SIZE` as older torches name it) and
      writes it on a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT`) to `<trace_dir>/rank_<r>`
      (`TORCH_FR_DUMP_TEMP_FILE`, older `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`): `trace_dir` is
      $FIVEFOLD_COMM_TRACE_DIR, else the run directory's `comm_traces/` as the runtime passes
      it, else `comm_traces/` here. Read the files with `python -m
      torch.distributed.flight_recorder.fr_trace`. Unmeasured here (no GPU).
    """
    trace_dir = os.environ.get(FLIGHT_RECORDER_DIR_ENV) or trace_dir or "comm_traces"
    os.makedirs(trace_dir, exist_ok=True)
    prefix = os.path.join(os.fspath(trace_dir), "rank_")
    wanted = {
        ASYNC_ERROR_HANDLING_ENV: TEAR_DOWN_WITHOUT_CLEANUP,
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    return {name: os.environ.setdefault(name, value) for name, value in wanted.items()}


STEP_TIMEOUT_ENV = "FIVEFOLD_PG_STEP_TIMEOUT_S"
DEFAULT_STEP_TIMEOUT_S = 300.0
_shortened_to_s: float | None = None  # the timeout every NCCL group has since the first step


def step_timeout_s() -> float:
    """Seconds a collective may wait once the first step is done ($FIVEFOLD_PG_STEP_TIMEOUT_S,
    default 300 s, never above the start-up timeout)."""
    default = min(DEFAULT_STEP_TIMEOUT_S, pg_timeout_s())
    return _seconds_env(
        STEP_TIMEOUT_ENV, default, "the collective timeout after the first step", 300
    )


def current_timeout_s() -> float:
    """The timeout collectives run under now: the start-up one, or the shorter step one."""
    return _shortened_to_s if _shortened_to_s is not None else pg_timeout_s()


def shorten_timeout_after_first_step(device: torch.device) -> float | None:
    """NCCL groups: from now on a collective waits `step_timeout_s()`, not the start-up timeout
    that covered NCCL's set-up, compile, checkpoint loading and the first step. All ranks meet
    at a barrier first, so none runs a collective under the short timeout while another is
    still inside the first step. Uses torch's `_set_pg_timeout` where this torch has it
    (`fivefold.model.torch_features`); gloo groups (CPU runs) keep their timeout. Returns the
    new timeout, or None when nothing changed."""
    global _shortened_to_s
    import torch
    import torch.distributed as dist

    from fivefold.model.torch_features import has

    if device.type != "cuda" or not dist.is_initialized() or not has("set_pg_timeout"):
        return None
    timeout = step_timeout_s()
    if timeout >= current_timeout_s():
        return None
    nccl = [g for g in process_groups() if "nccl" in str(dist.get_backend(g))]
    if not nccl:
        return None
    dist.barrier(device_ids=[device.index or 0])
    torch.cuda.synchronize(device)
    for group in nccl:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout), group)
    _shortened_to_s = timeout
    return timeout


def process_groups() -> list:
    """Every process group of this process: the default one and the device meshes' (read from
    torch's group registry where present, else the default group alone)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {})
    return groups or [dist.group.WORLD]


def init_process_group(backend: str, timeout_s: float | None = None, device_id=None) -> None:
    """The default process group from torchrun's environment, with a finite timeout.

    `device_id` (a CUDA `torch.device`, or None) binds the group to this rank's GPU, so NCCL
    creates its communicator eagerly for that device (`torch.distributed.init_process_group`).

    Under torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE=True`) the group's keys live
    under `fivefold/attempt_<restart count>/`, so a restarted group never reads the keys of the
    group it replaces (all ranks of a single-node job share the restart count).
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s if timeout_s is not None else pg_timeout_s())
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"fivefold/attempt_{restart_count()}/", agent_store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id
    )


def _timeout_env() -> str:
    return STEP_TIMEOUT_ENV if _shortened_to_s is not None else PG_TIMEOUT_ENV


ARRIVALS_GRACE_S = 5.0  # how long a rank that timed out waits for the others' reports


def arrivals(what: str) -> dict[int, str] | None:
    """After a collective timed out on this rank: post `what` (the step and collective it waited
    in) to the group's store and collect the other ranks' posts for up to `ARRIVALS_GRACE_S`
    seconds (at most the timeout itself: the ranks that arrived time out about together).
    Returns {rank: what it waited in} for every rank that posted, i.e. timed out waiting too:
    a rank missing from it never arrived (stuck or dead). None when there is no store to ask
    (no group, or a torch without `_get_default_store`). Never raises."""
    import torch.distributed as dist

    from fivefold.model.torch_features import has

    if not dist.is_initialized() or not has("default_store"):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        prefix = f"fivefold/stuck/attempt_{restart_count()}/"
        store.set(f"{prefix}rank_{rank}", what)
        store.add(f"{prefix}posted", 1)
        deadline = time.monotonic() + min(ARRIVALS_GRACE_S, current_timeout_s())
        while time.monotonic() < deadline and store.add(f"{prefix}posted", 0) < world:
            time.sleep(0.1)
        return {
            r: store.get(f"{prefix}rank_{r}").decode()
            for r in range(world)
            if store.check([f"{prefix}rank_{r}"])
        }
    except Exception:  # best effort on a path that is already failing
        return None


def describe_arrivals(found: dict[int, str] | None, what: str, world: int) -> str:
    """'Arrived: ranks 0, 2; not arrived (stuck or dead): rank 1.' from `arrivals`."""
    if found is None:
        return "Which ranks arrived is unknown (no store to ask)."
    same = sorted(r for r, w in found.items() if w == what)
    elsewhere = [f"rank {r} in {w!r}" for r, w in sorted(found.items()) if w != what]
    missing = sorted(set(range(world)) - set(found))
    text = f"Arrived: {_ranks(same)}"
    if elsewhere:
        text += f"; waiting in another collective: {', '.join(elsewhere)}"
    if missing:
        text += (
            f"; not arrived, stuck or dead: {_ranks(missing)} (its output, or `py-spy dump "
            "--pid PID`, shows where it is)"
        )
    return text + "."


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def describe_collective_failure(
    err: BaseException, what: str, rank: int, found: dict[int, str] | None = None, world: int = 0
) -> str | None:
    """A user-facing explanation if `err` is a collective timeout (`found`: `arrivals`, of
    `world` ranks) or a vanished peer."""
    text = str(err)
    if _TIMEOUT.search(text):
        return (
            f"rank {rank}: {what} waited longer than the process-group timeout "
            f"({current_timeout_s():.0f} s, {_timeout_env()}) for another rank, which is stuck or "
            f"dead ({text.strip().splitlines()[0][:200]}). "
            f"{describe_arrivals(found, what, world) if world else ''} Under torchrun "
            "--max-restarts the job restarts (exit status 75) and resumes from the newest valid "
            f"checkpoint. If a step legitimately takes longer, raise {_timeout_env()}."
        )
    if _PEER_GONE.search(text):
        return (
            f"rank {rank}: {what} lost its connection to another rank, which has died "
            f"({text.strip().splitlines()[0][:200]}). Under torchrun --max-restarts the job "
            "restarts and resumes from the newest valid checkpoint; otherwise resume it with "
            "train.resume = true."
        )
    return None


@contextlib.contextmanager
def collective_guard(what: str) -> Iterator[None]:
    """Re-raise a collective timeout / lost peer inside the block as a CollectiveError (exit
    status 75); after a timeout the message says which ranks arrived (`arrivals`)."""
    try:
        yield
    except TrainingError:
        raise
    except Exception as err:
        import torch.distributed as dist

        rank = int(os.environ.get("RANK", "0"))
        found, world = None, 0
        if _TIMEOUT.search(str(err)) and dist.is_initialized():
            found, world = arrivals(what), dist.get_world_size()
        message = describe_collective_failure(err, what, rank, found, world)
        if message is None:
            raise
        raise CollectiveError(message) from err
