"""Long context on CPU: peak memory and time of one training step of the `tiny` preset vs T.

    .venv/bin/python benchmarks/long_context.py [--single 4096 8192 16384 32768]
        [--cp4 65536 131072] [--docs packed one] [--doc-len 3000] [--time] [--json FILE]

Each case is one sequence (micro-batch 1, fp32) of T tokens, either packed documents of
`--doc-len` tokens (the last one cut by the window) or one document spanning the whole sequence.
Single-process cases run `LocalRuntime` (what `fivefold train` runs in one process); the CP
cases run `DistributedRuntime` with `cp = 4` (ring attention) on 4 gloo processes.

Memory is measured the way the runtime's layout report does it (`DistributedRuntime.
_memory_tracker`): the live tensor storages of one `train_step` (forward + backward) counted by
`fivefold.train.memory_counter.track_cpu_peak` from the parameters on, plus AdamW's m and v (8 bytes
per parameter). It is deterministic. The prediction is the planner's, through the function the
layout report uses (`fivefold.parallel.report.predictions`: the memory model of fivefold's
eager runtime, no CUDA context, no fragmentation on CPU); the error is
(predicted - measured) / measured. Per doubling of T the measured
peak should grow at most 2.2x (linear memory, no T x T term).

With `--time`, a second, untracked step is timed (wall clock; CP: rank 0, between barriers).
On a shared or loaded machine the times are only indicative.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fivefold.train.config import parse_train_config

GiB = 2**30
DOC_KINDS = ("packed", "one")


def recipe_for(seq_len: int, cp: int = 1):
    """The tiny preset at `seq_len` tokens, micro-batch 1, fp32 (ring CP over `cp` ranks)."""
    from fivefold.specs.recipe import recipe_from_dict

    plan = {"precision": "fp32", "micro_batch": 1, "cp": cp}
    train = {"steps": 2, "device": "cpu", "warmup_steps": 1}
    model = {"preset": "tiny", "seq_len": seq_len}
    return recipe_from_dict({"model": model, "plan": plan, "train": train}, default_world=cp)


def batch_for(seq_len: int, vocab: int, docs: str, doc_len: int):
    """One row of T tokens: `packed` documents of doc_len tokens or `one` document."""
    import torch

    from fivefold.train.data import Batch

    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, vocab, (1, seq_len + 1), generator=g)
    index = torch.arange(seq_len)[None]
    length = doc_len if docs == "packed" else seq_len
    return Batch(stream[:, :-1], stream[:, 1:], index % length, index // length)


def predicted_bytes(runtime) -> float:
    """The planner's peak for this rank's stage, from the function the layout report uses."""
    from fivefold.parallel.report import predictions

    memory, _, _ = predictions(runtime)
    return memory[0]["total"] * GiB


def measured_step(runtime, batch, with_time: bool) -> tuple[int, float | None]:
    """(peak bytes of one train_step with AdamW's m and v added, seconds of an untracked step)."""
    import torch.distributed as dist

    from fivefold.train.memory_counter import track_cpu_peak

    parts = runtime.model_parts
    params = sum(
        getattr(p, "_local_tensor", p).numel() for part in parts for p in part.parameters()
    )
    with track_cpu_peak(parts, None) as reading:
        runtime.train_step([batch])
    peak = reading.peak_bytes + 2 * 4 * params
    for part in parts:
        part.zero_grad(set_to_none=True)
    seconds = None
    if with_time:
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        runtime.train_step([batch])
        if dist.is_initialized():
            dist.barrier()
        seconds = time.perf_counter() - start
    return peak, seconds


def measure_single(seq_len: int, docs: str, doc_len: int = 3000, with_time: bool = False) -> dict:
    """One single-process case (this process): measured and predicted peak, step time."""
    from fivefold.train.runtime import LocalRuntime

    recipe = recipe_for(seq_len)
    runtime = LocalRuntime(recipe, parse_train_config(recipe).train)
    peak, seconds = measured_step(
        runtime, batch_for(seq_len, recipe.model.vocab, docs, doc_len), with_time
    )
    return _row(runtime, 1, docs, peak, seconds)


def _row(runtime, cp: int, docs: str, peak: int, seconds: float | None) -> dict:
    predicted = predicted_bytes(runtime)
    recipe = runtime.recipe
    return {
        "seq_len": recipe.model.seq_len,
        "cp": cp,
        "docs": docs,
        "measured_bytes": peak,
        "predicted_bytes": predicted,
        "error": (predicted - peak) / peak,
        "step_s": seconds,
    }


def _measure_cp(
    rank: int, world: int, seq_len: int, docs: str, doc_len: int, with_time: bool
) -> dict:
    """One rank of a CP case (`DistributedRuntime` shards the full batch itself)."""
    from fivefold.train.runtime import distributed_runtime

    recipe = recipe_for(seq_len, cp=world)
    runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    batch = batch_for(seq_len, recipe.model.vocab, docs, doc_len)
    peak, seconds = measured_step(runtime, batch, with_time)
    row = _row(runtime, world, docs, peak, seconds)
    runtime.close()
    return row


def measure_cp(seq_len: int, docs: str, doc_len: int, with_time: bool, world: int = 4) -> dict:
    """A CP case on `world` spawned gloo ranks: rank 0's row with the largest rank's peak."""
    from _ranks import run_ranks

    rows = run_ranks(world, _measure_cp, seq_len, docs, doc_len, with_time, timeout_s=4 * 3600.0)
    row = dict(rows[0])
    row["measured_bytes"] = max(r["measured_bytes"] for r in rows)
    row["error"] = (row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
    return row


def growth(rows: list[dict]) -> list[float | None]:
    """Measured peak over the previous row's, for rows of the same doc kind and CP degree."""
    out, last = [], {}
    for row in rows:
        key = (row["docs"], row["cp"])
        prev = last.get(key)
        doubling = prev is not None and row["seq_len"] == 2 * prev["seq_len"]
        out.append(row["measured_bytes"] / prev["measured_bytes"] if doubling else None)
        last[key] = row
    return out


def format_row(row: dict, ratio: float | None) -> str:
    mib = 2**20
    time_s = f"{row['step_s']:8.2f} s" if row["step_s"] is not None else "       -  "
    growth_text = f"{ratio:5.2f}x" if ratio is not None else "    -"
    return (
        f"T={row['seq_len']:>7,}  cp={row['cp']}  {row['docs']:<6}  "
        f"measured {row['measured_bytes'] / mib:9.1f} MiB  x{growth_text}  "
        f"predicted {row['predicted_bytes'] / mib:9.1f} MiB  error {row['error']:+6.1%}  {time_s}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--cp4", type=int, nargs="*", default=[65536, 131072])
    parser.add_argument("--docs", nargs="+", default=list(DOC_KINDS), choices=DOC_KINDS)
    parser.add_argument("--doc-len", type=int, default=3000, help="packed document length")
    parser.add_argument("--time", action="store_true", help="also time an untracked step")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    print(
        "tiny preset, micro-batch 1, fp32; measured = live tensor storages of one train_step + "
        "AdamW m, v; predicted = planner (report.predictions)",
        flush=True,
    )
    rows: list[dict] = []
    for docs in args.docs:
        for seq_len in args.single:
            rows.append(measure_single(seq_len, docs, args.doc_len, args.time))
            print(format_row(rows[-1], growth(rows)[-1]), flush=True)
        for seq_len in args.cp4:
            rows.append(measure_cp(seq_len, docs, args.doc_len, args.time))
            print(format_row(rows[-1], growth(rows)[-1]), flush=True)
    ratios = [r for r in growth(rows) if r is not None]
    worst = max(abs(r["error"]) for r in rows)
    print(
        f"largest growth per doubling {max(ratios, default=float('nan')):.2f}x (target <= 2.2); "
        f"largest |prediction error| {worst:.1%} (target <= 10%)",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
