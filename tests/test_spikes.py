"""Loss spikes (`train.on_spike`): the robust running test, and the three policies on one process.

A poisoned batch (every label the same token, the last of the 4,096-token vocabulary) sits at a
fixed place in the global data order, as a bad batch in a corpus would: its gradient norm is
about 7 times the window's (8.5 against a median of 1.2 for the recipe below). The multi-rank
cases (poison on one and on both ranks) are in tests/parallel/test_spikes_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fivefold.errors import ConfigError
from fivefold.train.entry import load_run
from fivefold.train.inputs import TrainData
from fivefold.train.resume import _start_over
from fivefold.train.runtime import LocalRuntime
from fivefold.train.spike_policy import SpikePolicy
from fivefold.train.spikes import SKIP_FILE, SkipList, SpikeDetector
from fivefold.train.start import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny-cpu.toml"
# 4 sequences of 32 tokens a step; a constant learning rate that brings the loss from 8.3 to
# 6.8 in 9 steps, so that the poisoned batch stands out; a window of 8 steps, checks from 5.
RECIPE = [
    "train.progress=false",
    "train.tensorboard=false",
    "train.steps=12",
    "train.warmup_steps=0",
    "train.lr_schedule='constant'",
    "train.lr=1e-2",
    "model.layers=1",
    "model.seq_len=32",
    "plan.micro_batch=4",
    "plan.grad_accum=1",
    "train.spike_window=8",
    "train.spike_min_steps=5",
]
GLOBAL_BATCH = 4
POISONED_STEP = 10
POISON = ((POISONED_STEP - 1) * GLOBAL_BATCH, POISONED_STEP * GLOBAL_BATCH)  # its samples


def poison_batches(monkeypatch, start: int, dp_ranks: tuple[int, ...] = (0,)) -> None:
    """The batch whose samples start at `start` of the global order has every label set to the
    vocabulary's last token on the data-parallel ranks `dp_ranks`."""
    clean = TrainData.batches

    def batches(self, micro_batch):
        inner = clean(self, micro_batch)
        while True:
            at = self.sampler.consumed  # the generator takes from the sampler when resumed
            micro_batches = next(inner)
            if at == start and self.dp_rank in dp_ranks:
                for batch in micro_batches:
                    batch.labels = torch.full_like(batch.labels, 4095)
            yield micro_batches

    monkeypatch.setattr(TrainData, "batches", batches)


def run(tmp_path: Path, name: str, *overrides: str):
    cfg = load_run(
        TINY,
        [f"train.runs_dir={str(tmp_path)!r}", f"train.name={name!r}", *RECIPE, *overrides],
        world_size=1,
    )
    runtime = LocalRuntime(cfg.recipe, cfg.train)
    summary = train(cfg, runtime=runtime, console=Console(quiet=True))
    params = {k: v.detach().clone() for k, v in runtime.model.named_parameters()}
    return summary, params


def spikes(summary) -> list[dict]:
    return [e for e in summary.events if e["event"] == "spike"]


# ---- the running test ---------------------------------------------------------------------------
def test_detector_median_and_mad_by_hand():
    det = SpikeDetector(window=5, threshold=3.0, min_steps=4, warmup_steps=1)
    assert det.check(1, 100.0, 1.0) is None  # the warm-up step never enters the window
    for step, loss in zip(range(2, 6), [2.0, 2.2, 1.8, 2.4], strict=True):
        assert det.check(step, loss, 1.0) is None
    # window [2.0, 2.2, 1.8, 2.4]: median 2.1, MAD median(|.1|, |.1|, |.3|, |.3|) = 0.2,
    # sigma = 1.4826 * 0.2 = 0.29652, threshold 2.1 + 3 * 0.29652 = 2.98956
    threshold, median = det.limit("loss")
    assert median == pytest.approx(2.1) and threshold == pytest.approx(2.98956)
    assert det.check(6, 2.98, 1.0) is None  # below: joins the window
    metric, at, _ = det.check(7, 3.5, 1.0)
    assert metric == "loss" and at == pytest.approx(det.limit("loss")[0])
    assert list(det.values["loss"]) == [2.0, 2.2, 1.8, 2.4, 2.98]  # the spike did not join
    # a flat window: the spread counts as 1e-3 of the median, so round-off is no spike
    flat = SpikeDetector(window=4, threshold=7.0, min_steps=4)
    for step in range(4):
        flat.check(step + 1, 5.0, 1.0)
    assert flat.check(5, 5.0 + 1e-6, 1.0) is None
    assert flat.check(6, 5.04, 1.0)[0] == "loss"  # above 5 + 7 * 0.005


def test_skip_list_advances_past_chained_ranges(tmp_path):
    skips = SkipList(tmp_path / SKIP_FILE)
    skips.add(8, 12, 3, write=True)
    skips.add(12, 16, 4, write=True)
    assert skips.advance(4) == 4 and skips.advance(8) == 16
    assert SkipList.read(tmp_path / SKIP_FILE).ranges == [[8, 12, 3], [12, 16, 4]]


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.spike_threshold=0", "train.spike_threshold = 0"),
        ("train.spike_threshold=-2.5", "train.spike_threshold = -2.5"),
        ("train.straggler_threshold=0", "train.straggler_threshold = 0"),
        ("train.spike_window=0", "train.spike_window = 0"),
        ("train.straggler_log_steps=0", "train.straggler_log_steps = 0"),
        ("train.on_spike='panic'", "train.on_spike = 'panic'"),
        ("train.on_spike='rollback'", "train.ckpt_every = 0 saves none"),
    ],
)
def test_bad_settings_name_the_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as err:
        load_run(TINY, [f"train.runs_dir={str(tmp_path)!r}", override], world_size=1)
    assert field in str(err.value)


def test_bad_setting_exits_2_without_traceback(tmp_path, capsys):
    from fivefold.cli.main import main

    code = main(["train", str(TINY), f"train.runs_dir={str(tmp_path)!r}", "train.on_spike=roll"])
    err = capsys.readouterr().err
    assert code == 2 and "train.on_spike = 'roll'" in err and "Traceback" not in err


# ---- the policies ----------------------------------------------------------------------------
def test_warn_logs_the_spike_and_changes_nothing(tmp_path, monkeypatch):
    poison_batches(monkeypatch, POISON[0])
    off_poisoned, _ = run(tmp_path, "off-poisoned", "train.on_spike='off'")
    warned, _ = run(tmp_path, "warn", "train.on_spike='warn'")
    assert spikes(off_poisoned) == []
    assert warned.losses == off_poisoned.losses  # warn only: the same run, bit for bit
    first = spikes(warned)[0]
    assert first["step"] == POISONED_STEP and first["metric"] == "grad_norm"
    assert first["value"] > first["threshold"] > first["median"]
    assert first["samples"] == list(POISON) and first["sources"] is None
    assert warned.losses[POISONED_STEP - 1] > max(warned.losses[: POISONED_STEP - 1]) + 1.5
    lines = (tmp_path / "warn" / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == first
    assert json.loads((tmp_path / "warn" / "summary.json").read_text())["events"][0] == first


def test_skip_drops_the_update_and_moves_on(tmp_path, monkeypatch):
    # A run that never meets the poisoned samples (they are on its skip list from the start)
    # takes at its step t - 1 the batch the skipping run takes at step t > 10, with the same
    # number of updates before it: their losses and final weights are equal, bit for bit.
    (tmp_path / "never").mkdir()
    SkipList(tmp_path / "never" / SKIP_FILE).add(*POISON, POISONED_STEP, write=True)
    never, never_params = run(tmp_path, "never", "train.on_spike='off'", "train.steps=11")
    poison_batches(monkeypatch, POISON[0])
    skipped, skipped_params = run(tmp_path, "skip", "train.on_spike='skip'", "train.log_every=5")
    (event,) = spikes(skipped)
    assert event["step"] == POISONED_STEP and event["action"].startswith("update skipped")
    assert skipped.losses[: POISONED_STEP - 1] == never.losses[: POISONED_STEP - 1]
    assert skipped.losses[POISONED_STEP:] == never.losses[POISONED_STEP - 1 :]
    assert skipped_params.keys() == never_params.keys()
    for key in never_params:
        assert torch.equal(skipped_params[key], never_params[key]), key


def test_rollback_returns_and_never_meets_the_batch_again(tmp_path, monkeypatch):
    ckpt = ["train.ckpt_every=4", "train.log_every=3"]  # the spike is read back at step 12
    (tmp_path / "never").mkdir()
    SkipList(tmp_path / "never" / SKIP_FILE).add(*POISON, POISONED_STEP, write=True)
    never, never_params = run(tmp_path, "never", "train.on_spike='off'", *ckpt)
    poison_batches(monkeypatch, POISON[0])
    rolled, rolled_params = run(tmp_path, "rollback", "train.on_spike='rollback'", *ckpt)
    (event,) = spikes(rolled)
    assert event["step"] == POISONED_STEP and "step_8" in event["action"]
    assert rolled.losses == never.losses  # steps 9.. taken again without the poisoned batch
    for key in never_params:
        assert torch.equal(rolled_params[key], never_params[key]), key
    steps = [json.loads(x)["step"] for x in (tmp_path / "rollback" / "metrics.jsonl").open()]
    assert steps == list(range(1, 13))  # the rolled-back records left metrics.jsonl
    # the list is kept for a restarted run; --fresh forgets it (rank 0 deletes it)
    assert SkipList.read(tmp_path / "rollback" / SKIP_FILE).ranges == [[*POISON, 10]]
    again = load_run(TINY, [f"train.run_dir={str(tmp_path / 'rollback')!r}", *RECIPE, *ckpt])
    assert SpikePolicy(again.train, again.train.path(), True).skips.ranges == [[*POISON, 10]]
    fresh = load_run(TINY, [f"train.run_dir={str(tmp_path / 'rollback')!r}", "train.resume=false"])
    assert SpikePolicy(fresh.train, fresh.train.path(), True).skips.ranges == []
    _start_over(fresh.train, Console(quiet=True))
    assert not (tmp_path / "rollback" / SKIP_FILE).exists()


def test_footer_line_names_every_event():
    from fivefold.train.summary import events_line

    events = [
        {"event": "spike", "step": 10, "policy": "skip"},
        {"event": "straggler", "rank": 3, "host": "n1", "local_device": 3, "lag_s": 0.12},
    ]
    assert events_line(events, Path("runs/x/events.jsonl")) == (
        "events: 1 loss spike(s) at step 10 (skip); straggler rank 3 (host n1, local device 3, "
        "lag 120.0 ms per step) -- runs/x/events.jsonl"
    )
