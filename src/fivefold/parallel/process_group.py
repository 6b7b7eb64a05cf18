"""The process group and this rank's device: start-up with timeouts that speak.

Restart and the rendezvous store. torchrun shares its rendezvous TCPStore with the workers'
default process group; a restarted group then finds the dead group's gloo/NCCL addresses in it
and fails to connect ("connectFullMesh ... Connection refused", pytorch/pytorch#135712).
`init_process_group` therefore namespaces the store by restart attempt (and
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in torchrun's environment avoids the sharing altogether).

Stuck ranks. A rank that hangs (deadlock, dead peer, lost node) leaves the others waiting in a
collective. The process group is created with a finite timeout (`pg_timeout_s`, from
`FIVEFOLD_PG_TIMEOUT_S`, default 600 s), so the wait ends with gloo's "Timed out waiting ..."
or NCCL's watchdog error; `collective_guard` turns such errors into a `TrainingError` that says
which rank gave up, in what, after how long, and what to do. The elastic agent then restarts the
group (see `fivefold.checkpoint.elastic` for resuming), instead of stalling silently.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

from fivefold.errors import ConfigError, TrainingError

if TYPE_CHECKING:  # torch is imported where it is used: `fivefold train --help` stays light
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
    raw = os.environ.get(PG_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_PG_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(
            f"{PG_TIMEOUT_ENV} = {raw!r}: give the process-group timeout in seconds, e.g. 600."
        )
    return value


def pick_device(name: str) -> torch.device:
    """`train.device` ("auto" | "cpu" | "cuda"): cuda:LOCAL_RANK when CUDA is asked for (or
    "auto" and available; made the current device), else cpu."""
    import torch

    from fivefold.parallel.device import local_rank, uses_cuda

    if not uses_cuda(name):
        return torch.device("cpu")
    device = torch.device("cuda", local_rank())
    torch.cuda.set_device(device)
    return device


def init_distributed(device: torch.device, timeout_s: float | None = None) -> bool:
    """Initialise the default process group from the torchrun env (NCCL on CUDA, gloo on CPU)
    unless one exists; True if this call created it (see `init_process_group`)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if device.type != "cuda":
        init_process_group("gloo", timeout_s)
        return True
    set_flight_recorder_env()
    init_process_group("nccl", timeout_s, device_id=device)
    return True


FLIGHT_RECORDER_DIR_ENV = "FIVEFOLD_COMM_TRACE_DIR"


def set_flight_recorder_env() -> None:
    """NCCL's flight recorder on, dumped on a collective timeout (unless the user set them).

    Keeps the last 20,000 collectives per rank in a ring buffer (`TORCH_FR_BUFFER_SIZE`) and
    writes it to `$FIVEFOLD_COMM_TRACE_DIR/rank_<r>` (default `comm_traces/` under the working
    directory) when the watchdog sees a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT`); analyse the
    files with `python -m torch.distributed.flight_recorder.fr_trace`. Must run before the NCCL
    group exists. Unmeasured here (no GPU).
    """
    trace_dir = os.environ.get(FLIGHT_RECORDER_DIR_ENV, "comm_traces")
    os.makedirs(trace_dir, exist_ok=True)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(trace_dir, "rank_"))


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


def describe_collective_failure(err: BaseException, what: str, rank: int) -> str | None:
    """A user-facing explanation if `err` is a collective timeout or a vanished peer."""
    text = str(err)
    if _TIMEOUT.search(text):
        return (
            f"rank {rank}: {what} waited longer than the process-group timeout "
            f"({pg_timeout_s():.0f} s, {PG_TIMEOUT_ENV}) for another rank, which is stuck or "
            f"dead ({text.strip().splitlines()[0][:200]}). Look at the other ranks' output for "
            "the one that stopped; under torchrun --max-restarts the job restarts and resumes "
            f"from the newest valid checkpoint. If a step legitimately takes longer, raise "
            f"{PG_TIMEOUT_ENV}."
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
    """Re-raise a collective timeout / lost peer inside the block as a TrainingError."""
    try:
        yield
    except TrainingError:
        raise
    except Exception as err:
        rank = int(os.environ.get("RANK", "0"))
        message = describe_collective_failure(err, what, rank)
        if message is None:
            raise
        raise TrainingError(message) from err
