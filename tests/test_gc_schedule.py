"""Scheduled garbage collection: the automatic collector off for the run, a generation-1 pass
at the start and every `train.gc_every` steps on every rank alike, and gc on again after."""

from __future__ import annotations

import gc

import pytest
from rich.console import Console

from fivefold.errors import ConfigError
from fivefold.train import collect
from fivefold.train.collect import ScheduledCollection
from fivefold.train.entry import load_run
from fivefold.train.start import train


@pytest.fixture
def passes(monkeypatch):
    """The generations gc.collect was asked for, with whether gc was enabled at the time."""
    seen: list[tuple[int, bool]] = []
    monkeypatch.setattr(
        collect.gc, "collect", lambda generation=2: seen.append((generation, gc.isenabled()))
    )
    return seen


def test_collects_at_start_and_every_n_steps(passes):
    assert gc.isenabled()
    collector = ScheduledCollection(50)
    collector.start()
    for step in range(1, 121):
        collector.step(step)
    assert not gc.isenabled()
    collector.stop()
    assert gc.isenabled()
    assert passes == [(1, False)] * 3  # start, step 50, step 100


def test_zero_leaves_python_alone(passes):
    collector = ScheduledCollection(0)
    collector.start()
    collector.step(50)
    assert gc.isenabled() and passes == []
    collector.stop()
    assert gc.isenabled()


def test_a_training_run_collects_on_schedule_and_restores_gc(tmp_path, passes):
    run = load_run(
        None,
        [
            "model.preset='tiny'",
            "train.steps=4",
            "train.warmup_steps=1",
            "train.gc_every=2",
            "train.progress=false",
            "train.tensorboard=false",
            f"train.runs_dir={str(tmp_path)!r}",
        ],
        world_size=1,
    )
    summary = train(run, console=Console(quiet=True))
    assert summary.end_step == 4
    assert passes == [(1, False)] * 3  # start, before step 2, before step 4
    assert gc.isenabled()


def test_gc_every_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"train\.gc_every = -1: must be >= 0"):
        load_run(None, ["model.preset='tiny'", "train.gc_every=-1"], world_size=1)
