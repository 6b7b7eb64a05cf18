"""Collective benchmarks for `fivefold calibrate`: nccl-tests style, over real process groups.

`measure_collectives` spawns `ranks` local processes (gloo on CPU; NCCL on CUDA, written the
same way but not yet measured by us) and times every collective the runtime uses: all-reduce
(DDP, TP without SP), all-gather and reduce-scatter (FSDP, TP with SP), all-to-all (EP,
Ulysses CP) and send/recv (PP, ring CP), at several sizes, on groups of 2, 4, ... ranks (all
groups of one size run at once, as the axes of a parallel layout do), with 2, 4, ... `ranks`
processes running in turn (a 2-rank group among 4 processes sharing 2 cores is slower than
alone, and a run of w ranks sees the former).

Each collective is timed **as a training step issues it** (`issued_time_s`): every rank
computes a GEMM, then the collective; iterations with and without the collective alternate, and
the time of one collective is the mean difference, on the slowest rank. The GEMMs (`gaps`):
none (back to back), and each calibrated model's first MLP projection at the recipe's
micro-batch; each row carries its GEMM's measured seconds (`gap_s`) and the planner
interpolates between them by its own plan's GEMM (`fivefold.planner.step_time.layer_costs.
collective_gap_s`). A step pays the mean, not the best case: on a CPU the ranks
reach each collective at slightly different times and the transport's threads compete with the
peers' compute for the cores, so an issued collective costs several times its back-to-back
time (on 2 cores, a 512 KiB all-gather between GEMMs: about 1.2 ms mean against 0.3 ms
back-to-back; its latency has a tail of 3-4 ms stalls in about one call in twenty). The rows
carry nccl-tests' algorithm bandwidth (size / time) and bus bandwidth (algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for send/recv).
`fit_alpha_beta` fits time = alpha + size / beta by least squares on relative error. On a CPU
each world then runs the memory-bound benchmarks on all its processes at once (`memory`), as
the ranks of a run share the memory bandwidth.

Written by hand: nccl-tests needs CUDA; torch has no collective benchmark.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fivefold.calibration.bandwidth import measure_bandwidth
from fivefold.calibration.timing import QUICK, Budget
from fivefold.errors import ConfigError
from fivefold.launch.host_memory import keep_freed_memory
from fivefold.parallel.device import device_setting_for, pick_device
from fivefold.specs.profile import (
    COLLECTIVES,
    Collective,
    CollectiveSample,
    available_cores,
    bus_factor,
    threads_per_rank,
)

KiB = 1024
FULL_SIZES = tuple(KiB * 4**i for i in range(8))  # 1 KiB .. 16 MiB
QUICK_SIZES = (4 * KiB, 64 * KiB, 1024 * KiB, 16 * 2**20)  # a step's gradient buckets reach MiBs
CUDA_SIZES = {False: tuple(KiB * 4**i for i in range(11)), True: (64 * KiB, 16 * 2**20, 2**30)}
# NCCL among GPUs: up to 1 GiB, where the bus bandwidth saturates (quick: three sizes)


def sizes_for(quick: bool, cuda: bool = False) -> tuple[int, ...]:
    """The message sizes measured: 1 KiB .. 16 MiB over gloo (quick: 4 KiB .. 16 MiB in four),
    1 KiB .. 1 GiB over NCCL."""
    if cuda:
        return CUDA_SIZES[quick]
    return QUICK_SIZES if quick else FULL_SIZES


TIMEOUT_S = 300.0
MIN_ISSUED_S = 1e-6  # floor of a measured difference (noise can make a tiny one negative)
DEFAULT_GEMM = (512, 512, 512)  # (m, n, k) between collectives when no model is given
# A layer-scale gap: about 1 GFLOP, 10-20 ms on one CPU core, as much compute as a mid-sized
# model's layer does between two of its collectives. An issued collective costs more the longer
# the compute before it (the ranks drift further apart): on 2 cores a 64 KiB all-gather took
# about 1.7 ms after 0.8 ms of GEMM and 4-5 ms after 6-23 ms.
LAYER_GAP_GEMM = (512, 1024, 1024)


def group_sizes(ranks: int) -> list[int]:
    """Group sizes measured: 2, 4, ... that divide `ranks`, and `ranks` itself."""
    out = {ranks} if ranks >= 2 else set()
    g = 2
    while g < ranks:
        if ranks % g == 0:
            out.add(g)
        g *= 2
    return sorted(out)


def iterations(size_bytes: int, quick: bool) -> int:
    """Pairs (with and without the collective) timed per size: enough to average the stalls
    (quick: 9 up to 1 MiB, where one stall outweighs the transfer, 6 beyond: at 3 a 16 MiB
    reduce-scatter read 27 to 43 ms from one calibration to the next)."""
    small = size_bytes <= 1024 * KiB
    if quick:
        return 9 if small else 6
    return 24 if small else 8


def worlds(ranks: int) -> list[int]:
    """The numbers of local processes the collectives are measured with: each group size up to
    `ranks` (a run of w ranks crowds the cores as w processes do, so its groups are measured
    among w processes)."""
    return group_sizes(ranks)


def gaps(models: list, micro_batch: int) -> list[tuple[int, int, int] | None]:
    """The GEMM (m, n, k) each rank computes before a collective, in turn: none (back to back),
    then each model's first MLP projection at `micro_batch` sequences, (tokens, ffn, hidden)
    (the compute between two of a layer's collectives grows with it), `DEFAULT_GEMM` when no
    model is given; then `LAYER_GAP_GEMM` unless one of them is as large."""
    out: list[tuple[int, int, int] | None] = [None]
    for model in models:
        shape = (micro_batch * model.seq_len, max(1, model.ffn or model.expert_ffn), model.hidden)
        if shape not in out:
            out.append(shape)
    if len(out) == 1:
        out.append(DEFAULT_GEMM)
    if all(math.prod(s) < math.prod(LAYER_GAP_GEMM) for s in out[1:]):
        out.append(LAYER_GAP_GEMM)
    return out


def steps_count(ranks: int, quick: bool, gemms: int = 2, cuda: bool = False) -> int:
    """How many rows rank 0 reports (for the progress bar), over `gemms` compute gaps."""
    sizes = sizes_for(quick, cuda)
    per_group = [
        (len(COLLECTIVES) if g == 2 else len(COLLECTIVES) - 1)
        for w in worlds(ranks)
        for g in group_sizes(w)
    ]
    return sum(per_group) * len(sizes) * gemms


# ---- one rank ---------------------------------------------------------------------------------
def _op(name: str, size_bytes: int, group: Any, device: Any) -> Callable[[], None]:
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    elems = max(n, size_bytes // 4 // n * n)
    full = torch.ones(elems, device=device)
    part = torch.ones(elems // n, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if name == "all_gather":  # the runtime's FSDP2 and funcol call the same c10d kernels
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return lambda: gather(full, part, group=group)
    if name == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return lambda: scatter(part, full, group=group)
    if name == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    ranks = dist.get_process_group_ranks(group)
    send_to, recv_from = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    inbox = torch.empty_like(full)

    def send_recv() -> None:
        ops = [
            dist.P2POp(dist.isend, full, send_to, group),
            dist.P2POp(dist.irecv, inbox, recv_from, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return send_recv


def _sync(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gemm(shape: tuple[int, int, int] | None, device: Any) -> Callable[[], None]:
    """The GEMM each rank computes before a collective (nothing for `None`)."""
    if shape is None:
        return lambda: None
    m, n, k = shape
    x, w = torch.randn(m, k, device=device), torch.randn(n, k, device=device)
    return lambda: torch.mm(x, w.t())


def _slowest(value: float, device: Any) -> float:
    out = torch.tensor([value], device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item())


def gap_time_s(gemm: Callable[[], None], device: Any, repeats: int = 10) -> float:
    """Mean seconds of `gemm` with every rank computing it at once, on the slowest rank."""
    gemm()
    _sync(device)
    dist.barrier()
    tick = time.perf_counter()
    for _ in range(repeats):
        gemm()
    _sync(device)
    return _slowest((time.perf_counter() - tick) / repeats, device)


def issued_time_s(
    collective: Callable[[], None], gemm: Callable[[], None], pairs: int, device: Any
) -> float:
    """Seconds one collective adds to a rank that computes `gemm` before it, as in a step:
    `pairs` iterations of gemm + collective alternating with gemm alone (after a barrier and a
    warm-up of each), the difference of their means on this rank, then the slowest rank's."""
    gemm()
    collective()
    _sync(device)
    dist.barrier()
    with_op = alone = 0.0
    for _ in range(pairs):
        tick = time.perf_counter()
        gemm()
        collective()
        _sync(device)
        mid = time.perf_counter()
        gemm()
        _sync(device)
        with_op += mid - tick
        alone += time.perf_counter() - mid
    return max(MIN_ISSUED_S, _slowest((with_op - alone) / pairs, device))


HOST_SHARD = (1, 64, 256)  # one rank's sequence shard [batch, tokens, hidden] (64 KiB fp32)
HOST_OPS = ("all_gather", "reduce_scatter")  # tensor parallelism's sequence collectives


def dtensor_host_s(op: str, group: Any, solo: Any, repeats: int) -> float:
    """Main-thread CPU seconds one DTensor redistribution over `group` adds beyond the raw `op`
    it issues and beyond the same redistribution on a one-rank mesh (`solo`, this rank alone:
    where `overhead.tp_extra_s` is measured, DTensor short-cuts every redistribution, so the
    rest is nowhere else in the profile), on the slowest rank: tensor parallelism's sequence
    all-gather (Shard(1) to Replicate) or reduce-scatter (Partial to Shard(1)) of a
    `HOST_SHARD` activation per rank; the median over `repeats` alternating rounds of thread
    CPU time (waits for the peers and gloo's threads are not in it: the collective's
    alpha-beta prices those)."""
    b, s, h = HOST_SHARD
    n = dist.get_world_size(group)
    full = torch.ones(b, s * n, h)
    raw = _op(op, full.numel() * 4, group, full.device)  # nccl-tests: the whole buffer
    real, alone = (_redistribution(op, g, b, s, h) for g in (group, solo))

    def thread_s(fn: Callable[[], None]) -> float:
        tick = time.thread_time()
        fn()
        return time.thread_time() - tick

    raw(), real(), alone()
    dist.barrier(group=group)
    extra = sorted(thread_s(real) - thread_s(raw) - thread_s(alone) for _ in range(repeats))
    return _slowest(max(0.0, extra[len(extra) // 2]), full.device)


def _redistribution(op: str, group: Any, b: int, s: int, h: int) -> Callable[[], None]:
    """Tensor parallelism's sequence `op` as DTensor runs it over `group`: a [b, s, h] shard
    per rank gathered (all_gather), or [b, s x ranks, h] partial sums scattered."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = DeviceMesh.from_group(group, "cpu")
    if op == "all_gather":
        source = DTensor.from_local(torch.ones(b, s, h), mesh, [Shard(1)], run_check=False)
        target: list = [Replicate()]
    else:
        n = dist.get_world_size(group)
        source = DTensor.from_local(torch.ones(b, s * n, h), mesh, [Partial()], run_check=False)
        target = [Shard(1)]

    def run() -> None:
        out = source.redistribute(mesh, target).to_local()
        if hasattr(out, "trigger_wait"):  # a functional collective's result: wait as a step does
            out.trigger_wait()

    return run


def _worker(
    rank: int,
    world: int,
    init_file: str,
    quick: bool,
    out: Any,
    memory: tuple | None = None,
    gemms: tuple = (None, DEFAULT_GEMM),
) -> None:
    try:
        keep_freed_memory()
        device = pick_device(device_setting_for(world), rank)
        cuda = device.type == "cuda"
        if not cuda:
            torch.set_num_threads(threads_per_rank(world, available_cores()))
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
        )
        sizes = sizes_for(quick, cuda)
        groups = {
            g: dist.new_subgroups(g)[0] if g < world else dist.group.WORLD
            for g in group_sizes(world)
        }
        solo = None if cuda else dist.new_subgroups(1)[0]  # each rank alone
        host = {  # a GPU's host runs ahead of its kernels: not measured there
            (op, g): dtensor_host_s(op, group, solo, 20 if quick else 40)
            for g, group in groups.items()
            for op in (() if cuda else HOST_OPS)
        }
        for shape in gemms:
            gemm = _gemm(shape, device)
            gap = gap_time_s(gemm, device) if shape is not None else 0.0
            for g, group in groups.items():
                for op in (op for op in COLLECTIVES if op != "send_recv" or g == 2):
                    for size in sizes:
                        fn = _op(op, size, group, device)
                        seconds = issued_time_s(fn, gemm, iterations(size, quick), device)
                        if rank == 0:
                            out.put(("row", op, g, gap, size, seconds, host.get((op, g), 0.0)))
        if memory is not None and not cuda:
            _shared_bandwidth(rank, world, quick, memory, out)
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            out.put(("done", "nccl" if cuda else "gloo"))
    except Exception as err:  # reported to the parent, which raises
        out.put(("error", rank, f"{type(err).__name__}: {err}"))
    finally:
        out.close()
        out.join_thread()  # flush the queue before the hard exit below
        os._exit(0)  # spawn workers can abort at interpreter exit otherwise (see notes)


def _shared_bandwidth(rank: int, world: int, quick: bool, memory: tuple, out: Any) -> None:
    """Every rank measures the memory-bound work at once (after a barrier, the same sequence
    of kernels), so each sees the bandwidth the others leave it; rank 0 reports its rows."""
    model, plan = memory
    dist.barrier()
    rows = measure_bandwidth(
        model, plan, torch.get_num_threads(), QUICK if quick else Budget(), processes=world
    )
    if rank == 0:
        out.put(("bandwidth", rows))


# ---- the parent -------------------------------------------------------------------------------
def measure_collectives(
    ranks: int,
    quick: bool,
    on_row: Callable[[CollectiveSample], None] | None = None,
    memory: tuple | None = None,
    gemms: tuple = (None, DEFAULT_GEMM),
) -> tuple[str, list[CollectiveSample], list]:
    """(backend, samples, bandwidth rows) over 2, 4, ... `ranks` spawned processes in turn
    (`worlds`), each collective issued after each of `gemms` (`gaps`); `on_row` sees
    each sample as it comes. `memory` = (model, plan): on a CPU every world also measures the
    memory-bound work on all its processes at once
    (`fivefold.calibration.bandwidth.measure_bandwidth`, rows tagged with the world)."""
    backend, samples, bandwidth = "none", [], []
    for world in worlds(ranks):
        backend, more, rows = _measure_world(world, quick, on_row, memory, gemms)
        samples += more
        bandwidth += rows
    return backend, samples, bandwidth


def _measure_world(
    ranks: int,
    quick: bool,
    on_row: Callable[[CollectiveSample], None] | None,
    memory: tuple | None = None,
    gemms: tuple = (None, DEFAULT_GEMM),
) -> tuple[str, list[CollectiveSample], list]:
    """(backend, samples, bandwidth rows) of every group size of `ranks` spawned processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, ranks, init_file, quick, out, memory, gemms),
                daemon=True,
            )
            for r in range(ranks)
        ]
        for p in procs:
            p.start()
        samples: list[CollectiveSample] = []
        bandwidth: list = []
        backend = ""
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not backend:
                try:
                    msg = out.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    dead += [] if any(p.is_alive() for p in procs) else procs
                    if dead or time.monotonic() > deadline:
                        raise ConfigError(
                            f"the collective benchmark over {ranks} ranks stopped (exit codes "
                            f"{[p.exitcode for p in procs]}); try --nproc 2 or check that "
                            "torch.distributed works here."
                        ) from None
                    continue
                if msg[0] == "error":
                    raise ConfigError(
                        f"the collective benchmark failed on rank {msg[1]}: {msg[2]}; try "
                        "--nproc 2."
                    )
                if msg[0] == "done":
                    backend = msg[1]
                    continue
                if msg[0] == "bandwidth":
                    bandwidth = msg[1]
                    continue
                _, op, g, gap, size, seconds, host = msg
                algbw = size / seconds
                sample = CollectiveSample(
                    op, g, ranks, gap, size, seconds, algbw, algbw * bus_factor(op, g), host
                )
                samples.append(sample)
                if on_row is not None:
                    on_row(sample)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return backend, samples, bandwidth


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) minimising the relative error of alpha + size / beta.

    Solves the 2 x 2 normal equations of rows [1/t, S/t] . [alpha, 1/beta] = 1; an alpha below
    zero is refitted at zero (pure bandwidth), a non-positive slope at the largest size's rate.
    """
    rows = [(1 / t, s / t) for s, t in zip(sizes, times, strict=True)]
    a11 = sum(r[0] * r[0] for r in rows)
    a12 = sum(r[0] * r[1] for r in rows)
    a22 = sum(r[1] * r[1] for r in rows)
    b1 = sum(r[0] for r in rows)
    b2 = sum(r[1] for r in rows)
    det = a11 * a22 - a12 * a12
    alpha, inv_beta = (
        ((b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det) if det > 0 else (-1.0, 0.0)
    )
    if alpha < 0 or inv_beta <= 0:
        alpha, inv_beta = 0.0, b2 / a22
    if inv_beta <= 0 or not math.isfinite(inv_beta):
        big = max(range(len(sizes)), key=lambda i: sizes[i])
        return 0.0, sizes[big] / times[big]
    return alpha, 1.0 / inv_beta


def fit_collectives(samples: list[CollectiveSample]) -> list[Collective]:
    """One alpha-beta fit per (op, group size, processes running, compute gap), with the
    median of its samples' DTensor host seconds (`dtensor_host_s`)."""
    keys = sorted(
        {(s.op, s.ranks, s.world, s.gap_s) for s in samples},
        key=lambda k: (COLLECTIVES.index(k[0]), k[1], k[2], k[3]),
    )
    out = []
    for op, n, world, gap in keys:
        rows = [s for s in samples if (s.op, s.ranks, s.world, s.gap_s) == (op, n, world, gap)]
        alpha, beta = fit_alpha_beta([r.size_bytes for r in rows], [r.time_s for r in rows])
        host = statistics.median(r.host_s for r in rows)
        out.append(Collective(op, n, world, gap, alpha, beta, host))
    return out
