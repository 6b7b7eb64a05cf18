"""Run a function on N fresh gloo ranks (spawned processes) and collect each rank's result.

    results = run_ranks(world, fn, *args, timeout_s=1800)   # fn(rank, world, *args) -> picklable

Used by the benchmarks in this folder. Each rank runs one OpenMP thread, joins a gloo group
over a FileStore, and ends with `os._exit(0)` (a normal exit can abort in gloo's destructors).
A failing rank raises RuntimeError with its traceback; the others are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta


def _worker(rank: int, world: int, store_path: str, results, fn, args: tuple) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if world > 1:
            store = dist.FileStore(store_path, world)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=900)
            )
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(world: int, fn, *args, timeout_s: float = 1800.0) -> list:
    """`fn(rank, world, *args)` on `world` spawned ranks; the results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fivefold-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world, store, results, fn, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < world:
                try:
                    rank, status, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"{world} ranks did not finish in {timeout_s} s") from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world)]
