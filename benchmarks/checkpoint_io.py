"""Checkpoint save/load time and size for the small preset at 1, 4 and 8 ranks (CPU, gloo).

    .venv/bin/python benchmarks/checkpoint_io.py [--ranks 1 4 8] [--repeats 3] [--dir DIR]

Each world size runs the real `DistributedRuntime` (one process: the plain model) with the
layout below, takes one AdamW step so the optimizer state exists, saves once to warm up, then
measures (median of --repeats):
- save: `Checkpointer.save` until committed (DCP write by every rank, SHA-256 of every file,
  manifest, rename, barrier);
- async: the time `save(async_save=True)` blocks training (copy to host memory), and the time
  until the background write is committed;
- verify: `select()` (every file's SHA-256, split over the ranks);
- load: `select()` + `load()` into the live model and optimizer;
and the checkpoint's size (model fp32 + AdamW m, v, step + state.json + DCP index).

Baseline, measured in the same run before the rank counts: one process (the 1-rank setup above,
same step) writes the same full state, `{"model": state_dict, "optimizer": state_dict}`, with
plain `torch.save` into the same directory tree and reads it back with
`torch.load(weights_only=True)` followed by `load_state_dict` into the live model and optimizer
(median of --repeats after one warm-up; no fsync, no checksums, no manifest). Each rank count
then prints its save, load and size as ratios to the baseline (fivefold / torch).
Ranks share the machine's cores, so on a 2-core machine times grow with the rank count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _ranks import run_ranks

from fivefold.train.config import parse_train_config

LAYOUTS = {
    1: {},
    4: {"dp_shard": 4, "zero": 3},
    8: {"dp_shard": 8, "zero": 3},
}
TRAIN = {"steps": 10, "device": "cpu", "warmup_steps": 1}


def _recipe(world: int):
    from fivefold.specs.recipe import recipe_from_dict

    plan = {"precision": "fp32", "micro_batch": 1, **LAYOUTS[world]}
    return recipe_from_dict(
        {"model": {"preset": "small"}, "plan": plan, "train": TRAIN}, default_world=world
    )


def _batch(recipe, dp_rank: int, dp_size: int):
    import torch

    from fivefold.train.data import Batch

    seq, vocab = recipe.model.seq_len, recipe.model.vocab
    g = torch.Generator().manual_seed(dp_rank)
    stream = torch.randint(0, vocab, (1, seq + 1), generator=g)
    return [
        Batch(
            stream[:, :-1],
            stream[:, 1:],
            torch.arange(seq)[None],
            torch.zeros(1, seq, dtype=torch.long),
        )
    ]


def measure_baseline(world: int, root: str, repeats: int) -> dict:
    """Plain `torch.save` / `torch.load(weights_only=True)` of the single-process full state."""
    import torch

    from fivefold.train.optim import build_optimizer
    from fivefold.train.runtime import LocalRuntime

    recipe = _recipe(1)
    runtime = LocalRuntime(recipe, parse_train_config(recipe).train)
    optimizer = build_optimizer(runtime.model_parts, parse_train_config(recipe).train)
    runtime.train_step(_batch(recipe, 0, 1))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    directory = Path(root) / "torch"
    directory.mkdir(parents=True, exist_ok=True)

    def state() -> dict:
        return {
            "model": [part.state_dict() for part in runtime.model_parts],
            "optimizer": optimizer.state_dict(),
        }

    def load(path: Path) -> None:
        loaded = torch.load(path, weights_only=True)
        for part, part_state in zip(runtime.model_parts, loaded["model"], strict=True):
            part.load_state_dict(part_state)
        optimizer.load_state_dict(loaded["optimizer"])

    torch.save(state(), directory / "step0.pt")  # warm-up
    load(directory / "step0.pt")
    saves, loads = [], []
    for step in range(1, repeats + 1):
        path = directory / f"step{step}.pt"
        start = time.perf_counter()
        torch.save(state(), path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        load(path)
        loads.append(time.perf_counter() - start)
    size = path.stat().st_size
    runtime.close()
    return {
        "bytes": size,
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
    }


def _timed(fn) -> tuple[float, object]:
    from fivefold.checkpoint.checkpointer import barrier

    barrier()
    start = time.perf_counter()
    value = fn()
    barrier()
    return time.perf_counter() - start, value


def measure(world: int, root: str, repeats: int) -> dict:
    """One rank's part of the benchmark; rank 0's dict is the result."""
    from fivefold.checkpoint import Checkpointer
    from fivefold.train.optim import build_optimizer
    from fivefold.train.runtime import LocalRuntime

    recipe = _recipe(world)
    if world == 1:
        runtime = LocalRuntime(recipe, parse_train_config(recipe).train)
    else:
        from fivefold.train.runtime import distributed_runtime

        runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    optimizer = build_optimizer(runtime.model_parts, parse_train_config(recipe).train)
    runtime.train_step(_batch(recipe, runtime.dp_rank, runtime.dp_size))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    kwargs = {"model_spec": recipe.model.to_dict(), "plan": recipe.plan.to_dict()}
    sync = Checkpointer(Path(root) / "sync", keep=1)
    sync.save(0, runtime.model_parts, optimizer, **kwargs)  # warm-up
    saves, verifies, loads, blocks, commits = [], [], [], [], []
    for step in range(1, repeats + 1):
        seconds, path = _timed(
            lambda s=step: sync.save(s, runtime.model_parts, optimizer, **kwargs)
        )
        saves.append(seconds)
        verifies.append(_timed(sync.select)[0])
        loads.append(
            _timed(
                lambda: sync.load(
                    sync.select().path,
                    runtime.model_parts,
                    optimizer,
                    model_spec=recipe.model.to_dict(),
                )
            )[0]
        )
    asynchronous = Checkpointer(Path(root) / "async", keep=1, async_save=True)
    asynchronous.save(0, runtime.model_parts, optimizer, **kwargs)
    asynchronous.wait()
    for step in range(1, repeats + 1):
        blocked, _ = _timed(
            lambda s=step: asynchronous.save(s, runtime.model_parts, optimizer, **kwargs)
        )
        waited, _ = _timed(asynchronous.wait)
        blocks.append(blocked)
        commits.append(blocked + waited)
    asynchronous.close()
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    runtime.close()
    return {
        "ranks": world,
        "layout": recipe.plan.describe(),
        "bytes": manifest["total_bytes"],
        "files": len(manifest["files"]),
        "save_s": statistics.median(saves),
        "verify_s": statistics.median(verifies),
        "load_s": statistics.median(loads),
        "async_block_s": statistics.median(blocks),
        "async_commit_s": statistics.median(commits),
    }


# ---- launching ranks ---------------------------------------------------------------------------
def _on_rank(rank: int, world: int, target, root: str, repeats: int) -> dict:
    return target(world, root, repeats)


def run(world: int, root: str, repeats: int, timeout_s: float = 1800.0, target=measure) -> dict:
    """`target` on `world` spawned gloo ranks (`_ranks.run_ranks`); rank 0's result."""
    return run_ranks(world, _on_rank, target, root, repeats, timeout_s=timeout_s)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 8], choices=sorted(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = run(1, str(Path(tmp) / "baseline"), args.repeats, target=measure_baseline)
        print(
            f"baseline (torch.save / torch.load, 1 process): {base['bytes'] / 2**20:.1f} MiB in "
            f"1 file; save {base['save_s']:.3f} s, load {base['load_s']:.3f} s",
            flush=True,
        )
        for world in args.ranks:
            rows.append(run(world, str(Path(tmp) / f"w{world}"), args.repeats))
            r = rows[-1]
            print(
                f"{r['ranks']} rank(s) [{r['layout'].split(', mbs')[0]}]: "
                f"{r['bytes'] / 2**20:.1f} MiB in {r['files']} files; save {r['save_s']:.3f} s, "
                f"verify {r['verify_s']:.3f} s, load {r['load_s']:.3f} s; async: blocks "
                f"{r['async_block_s']:.3f} s, committed after {r['async_commit_s']:.3f} s",
                flush=True,
            )
            r["vs_torch"] = {key: r[key] / base[key] for key in ("save_s", "load_s", "bytes")}
            print(
                f"  vs torch.save/torch.load: save {r['vs_torch']['save_s']:.2f}x, "
                f"load {r['vs_torch']['load_s']:.2f}x, size {r['vs_torch']['bytes']:.3f}x",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
