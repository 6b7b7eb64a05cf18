"""Rank functions of the long-run tests (loss spikes and stragglers on N gloo ranks): each
trains the tiny recipe with the real loop and `DistributedRuntime` in the harness's group."""

from __future__ import annotations

import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def poisoned(batches_of, start: int, dp_ranks: tuple[int, ...], sleep_s: float = 0.0):
    """`TrainData.batches` whose batch at `start` of the global order has every label set to
    the vocabulary's last token on `dp_ranks`, and which sleeps `sleep_s` before each batch."""
    import torch

    def batches(self, micro_batch):
        inner = batches_of(self, micro_batch)
        while True:
            at = self.sampler.consumed
            if sleep_s:
                time.sleep(sleep_s)
            micro_batches = next(inner)
            if at == start and self.dp_rank in dp_ranks:
                for batch in micro_batches:
                    batch.labels = torch.full_like(batch.labels, 4095)
            yield micro_batches

    return batches


def train_ranks(
    rank: int,
    world: int,
    root: str,
    runs: dict[str, list[str]],
    poison_start: int = -1,
    poison_ranks: tuple[int, ...] = (),
    slow_rank: int = -1,
    sleep_s: float = 0.0,
    forward_sleep_s: float = 0.0,
) -> dict:
    """Train every run of `runs` (name -> overrides) in turn; returns name -> (losses, events).
    Rank `slow_rank` sleeps `sleep_s` before each batch and `forward_sleep_s` inside each
    forward of its first block (after FSDP has gathered its weights, before its TP
    collectives)."""
    from rich.console import Console

    from fivefold.train.entry import load_run
    from fivefold.train.inputs import TrainData
    from fivefold.train.runtime import distributed_runtime
    from fivefold.train.start import train

    TrainData.batches = poisoned(
        TrainData.batches, poison_start, poison_ranks, sleep_s if rank == slow_rank else 0.0
    )
    out = {}
    for name, overrides in runs.items():
        base = [f"train.runs_dir={root!r}", f"train.name={name!r}"]
        run = load_run(TINY, [*base, *overrides], world_size=world)
        runtime = distributed_runtime(run.recipe, run.train)
        if forward_sleep_s and rank == slow_rank:
            block = next(iter(runtime.model_parts[0].layers.values()))
            block.register_forward_pre_hook(lambda *_: time.sleep(forward_sleep_s))
        summary = train(run, runtime=runtime, console=Console(quiet=True))
        out[name] = {"losses": summary.losses, "events": summary.events}
    return out
