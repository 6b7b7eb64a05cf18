"""Run a function on N gloo ranks on CPU for the checkpoint tests.

Ranks are forked from a `forkserver` that imported torch and fivefold once and did no compute
(fast start without inheriting a computing parent's thread pools); each call gets its own
FileStore-backed group with a short timeout, every rank runs one thread and ends with
`os._exit(0)`. A rank that raises or dies fails the call at once with its traceback; the other
ranks are killed. Results must be plain Python values (numbers, strings, lists, dicts).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "fivefold.model",
    "fivefold.checkpoint.checkpointer",
]
_CONTEXT: Any = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


class RankFailure(AssertionError):
    """A rank raised, died or timed out; the message holds its traceback."""


def _worker(rank, world, store_path, results, pg_timeout_s, fn, args) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world))
    status, payload = "ok", None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        payload = fn(rank, world, *args)
    except BaseException:
        status, payload = "error", traceback.format_exc()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(
    world: int, fn, *args: Any, timeout_s: float = 180.0, pg_timeout_s: float = 90.0
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` ranks of one gloo group; results in rank order."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fivefold-ckpt-pg-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, store_path, results, pg_timeout_s, fn, args),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankFailure(
                        f"{fn.__name__} on {world} ranks timed out after {timeout_s:.0f} s "
                        f"(ranks done: {sorted(out)})"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        raise RankFailure(f"rank(s) {dead} died without a result") from None
                    continue
                if status == "error":
                    raise RankFailure(f"rank {rank} of {world} failed:\n{payload}")
                out[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5 if len(out) == world else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [out[r] for r in range(world)]
