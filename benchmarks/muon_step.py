"""Muon's step against AdamW's on the same model, on CPU (`train.optimizer`).

Two single-process runtimes (`LocalRuntime`) of one preset start from the same weights and
train on the same synthetic batches, one with AdamW, one with Muon (its Newton-Schulz in bf16,
as torch.optim.Muon, or in fp32 with --ns-dtype fp32). Each round times, for each of the two in
turn (the order alternates every round, so drifts of a shared machine fall on both alike),
the forward and backward of the step (`train_step`, gradient clipping included) and the
optimizer step alone. Printed: the medians over the rounds after `--warmup`, the optimizer step
of Muon over AdamW's, and Muon's extra time as a share of AdamW's whole step.

    PYTHONPATH=src .venv/bin/python benchmarks/muon_step.py                     # small, ~1 min
    PYTHONPATH=src .venv/bin/python benchmarks/muon_step.py --preset tiny --rounds 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fivefold.train.config import parse_train_config


def batch(step: int, rows: int, seq_len: int, vocab: int):
    import torch

    from fivefold.train.data import Batch

    g = torch.Generator().manual_seed(step)
    stream = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    return Batch(
        tokens=stream[:, :-1].contiguous(),
        labels=stream[:, 1:].contiguous(),
        positions=torch.arange(seq_len).expand(rows, seq_len).contiguous(),
        doc_ids=torch.zeros(rows, seq_len, dtype=torch.long),
    )


def trainee(preset: str, optimizer: str, ns_dtype: str, micro_batch: int):
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.optim import build_optimizer
    from fivefold.train.runtime import LocalRuntime

    recipe = recipe_from_dict(
        {
            "model": {"preset": preset},
            "plan": {"precision": "fp32", "micro_batch": micro_batch},
            "train": {"optimizer": optimizer, "muon_ns_dtype": ns_dtype, "device": "cpu"},
        },
        default_world=1,
    )
    cfg = parse_train_config(recipe).train
    runtime = LocalRuntime(recipe, parse_train_config(recipe).train)
    return runtime, build_optimizer(runtime.model_parts, cfg, recipe.plan), cfg


def one_step(runtime, optimizer, cfg, micro) -> tuple[float, float]:
    """(forward + backward + clipping seconds, optimizer step seconds)."""
    start = time.perf_counter()
    runtime.train_step([micro])
    runtime.clip_grad_norm(cfg.grad_clip)
    middle = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return middle - start, time.perf_counter() - middle


def measure(preset: str, rounds: int, warmup: int, ns_dtype: str, micro_batch: int) -> dict:
    import torch

    torch.manual_seed(0)
    runs = {name: trainee(preset, name, ns_dtype, micro_batch) for name in ("adamw", "muon")}
    spec = runs["adamw"][0].recipe.model
    times: dict[str, dict[str, list[float]]] = {n: {"fwd_bwd": [], "opt": []} for n in runs}
    for r in range(warmup + rounds):
        micro = batch(r, micro_batch, spec.seq_len, spec.vocab)
        order = ("adamw", "muon") if r % 2 == 0 else ("muon", "adamw")
        for name in order:
            fwd_bwd, opt = one_step(*runs[name], micro)
            if r >= warmup:
                times[name]["fwd_bwd"].append(fwd_bwd)
                times[name]["opt"].append(opt)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    adamw_step = med["adamw"]["fwd_bwd"] + med["adamw"]["opt"]
    return {
        "preset": preset,
        "params": sum(p.numel() for p in runs["adamw"][0].model.parameters()),
        "rounds": rounds,
        "ns_dtype": ns_dtype,
        "median_s": med,
        "optimizer_ratio": med["muon"]["opt"] / med["adamw"]["opt"],
        "extra_share_of_adamw_step": (med["muon"]["opt"] - med["adamw"]["opt"]) / adamw_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--ns-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = measure(args.preset, args.rounds, args.warmup, args.ns_dtype, args.micro_batch)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    med = out["median_s"]
    print(f"{out['preset']} ({out['params'] / 1e6:.2f}M parameters), {out['rounds']} rounds")
    for name in ("adamw", "muon"):
        print(
            f"  {name:<6} forward+backward {med[name]['fwd_bwd'] * 1e3:8.1f} ms   "
            f"optimizer step {med[name]['opt'] * 1e3:8.1f} ms (medians)"
        )
    print(
        f"  Muon's optimizer step / AdamW's: {out['optimizer_ratio']:.2f}x; its extra time is "
        f"{out['extra_share_of_adamw_step']:.1%} of AdamW's whole step "
        f"(Newton-Schulz in {out['ns_dtype']})"
    )


if __name__ == "__main__":
    main()
