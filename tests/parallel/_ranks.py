"""Run a function on N spawned CPU ranks joined in one gloo process group (for the PP/CP/EP tests).

`run_ranks(fn, world_size, *args)` returns every rank's return value (rank order). A rank that
raises makes the call fail at once with that rank's traceback; the other ranks are killed.
`fn(rank, world_size, *args)` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world_size: int, port: int, results, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)  # avoids the occasional abort at interpreter exit after spawn


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; returns the results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, object] = {}
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(values))} timed out")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"ranks {dead} died without a result") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]
