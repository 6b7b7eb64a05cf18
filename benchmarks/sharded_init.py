"""Start-up memory of a 1B+ model on 4 CPU ranks with ZeRO-3: no rank holds a full tensor.

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_init.py [--preset wide-1b] [--ranks 4]

Each rank builds the real `DistributedRuntime` (meta model -> FSDP2 `fully_shard` per block and
at the root -> `to_empty` -> `init_weights`, which draws only the rank's own shards; see
`fivefold.model.init`) and measures, during that construction:
- peak live tensor storage: every storage an operator returns, counted from its creation to its
  release (`fivefold.train.memory_counter.StorageCounter`, the runtime's CPU memory counter);
- peak RSS growth (`ru_maxrss` after minus before; pages the allocator touched, a cross-check
  that sees allocations outside operators too);
and compares the peak with its budget, (this rank's parameter shard + one full layer) in fp32:
the target is peak <= 1.3 x budget. Memory figures are deterministic; the time is not (it is
printed for information: drawing ~N/ranks normal numbers per rank on shared cores).
Needs about (model bytes / ranks + 0.5 GB) of RAM per rank: ~1.6 GB each for wide-1b.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ranks import run_ranks

from fivefold.train.config import parse_train_config

TARGET = 1.3


def measure(rank: int, world: int, preset: str, zero: int) -> dict:
    """One rank: construct the runtime under the storage counter; its memory figures."""
    import resource

    from fivefold.specs.model import layer_params, param_count
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.memory_counter import StorageCounter
    from fivefold.train.runtime import distributed_runtime

    plan = {"precision": "fp32", "dp_shard": world, "zero": zero, "micro_batch": 1}
    recipe = recipe_from_dict(
        {
            "model": {"preset": preset},
            "plan": plan,
            "train": {"steps": 1, "warmup_steps": 0, "device": "cpu"},
        },
        default_world=world,
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    counter = StorageCounter()
    start = time.perf_counter()
    with counter:
        runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    seconds = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.to_local().numel() * 4 for part in runtime.model_parts for p in part.parameters())
    spec = recipe.model
    result = {
        "rank": rank,
        "params": param_count(spec),
        "shard_bytes": shard,
        "layer_bytes": layer_params(spec, moe=False) * 4,
        "peak_bytes": counter.peak_bytes,
        "rss_growth_bytes": rss_after - rss_before,
        "seconds": seconds,
    }
    runtime.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="wide-1b")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--zero", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    rows = run_ranks(args.ranks, measure, args.preset, args.zero)
    gib = 2**30
    full = rows[0]["params"] * 4
    print(
        f"{args.preset}: {rows[0]['params'] / 1e9:.3f}B parameters ({full / gib:.2f} GiB fp32), "
        f"{args.ranks} ranks, ZeRO-{args.zero}; one layer {rows[0]['layer_bytes'] / gib:.3f} GiB"
    )
    worst = 0.0
    for r in rows:
        budget = r["shard_bytes"] + r["layer_bytes"]
        r["ratio"] = r["peak_bytes"] / budget
        worst = max(worst, r["ratio"])
        print(
            f"rank {r['rank']}: shard {r['shard_bytes'] / gib:.3f} GiB, peak live tensors "
            f"{r['peak_bytes'] / gib:.3f} GiB = {r['ratio']:.2f}x (shard + one layer), "
            f"{r['peak_bytes'] / r['shard_bytes']:.3f}x shard; peak RSS growth "
            f"{r['rss_growth_bytes'] / gib:.3f} GiB; {r['seconds']:.1f} s"
        )
    verdict = "meets" if worst <= TARGET else "MISSES"
    print(f"worst rank: {worst:.2f}x (shard + one layer) -- {verdict} the {TARGET}x target")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
