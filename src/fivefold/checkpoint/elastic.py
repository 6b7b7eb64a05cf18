"""Elastic restart and stuck ranks: when to resume, and timeouts that speak.

Restart. Under `torchrun --max-restarts N`, when a rank dies (even by SIGKILL) the elastic agent
stops the other ranks and starts the whole group again, with `TORCHELASTIC_RESTART_COUNT` > 0.
A restarted run must resume, never start over: `should_resume` says yes whenever this is a
restart or `train.resume` is true/"auto"/"always", and a valid checkpoint exists; the loop then
loads the newest valid one (a save cut short by the failure was never committed).

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
group (or the job ends with that message), instead of stalling silently.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from datetime import timedelta

from fivefold.errors import TrainingError

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
PG_TIMEOUT_ENV = "FIVEFOLD_PG_TIMEOUT_S"
DEFAULT_PG_TIMEOUT_S = 600.0
_RESUME_WORDS = {
    "auto": "auto",
    "always": "always",
    "never": "never",
    "true": "always",
    "false": "never",
}
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


def resume_mode(setting: bool | str) -> str:
    """`train.resume` as "auto" | "always" | "never" (true = always, false = never)."""
    if isinstance(setting, bool):
        return "always" if setting else "never"
    mode = _RESUME_WORDS.get(str(setting).strip().lower())
    if mode is None:
        from fivefold.errors import ConfigError

        raise ConfigError(
            f'train.resume = {setting!r}: use "auto" (resume when a valid checkpoint exists), '
            "true or false."
        )
    return mode


def should_resume(setting: bool | str, has_valid_checkpoint: bool) -> bool:
    """Whether to load the newest valid checkpoint at start-up.

    "never" starts over, except after an elastic restart, which always resumes: a restarted job
    that started over would discard the work the checkpoints hold.
    """
    if not has_valid_checkpoint:
        return False
    return resume_mode(setting) != "never" or restart_count() > 0


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
        from fivefold.errors import ConfigError

        raise ConfigError(
            f"{PG_TIMEOUT_ENV} = {raw!r}: give the process-group timeout in seconds, e.g. 600."
        )
    return value


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
