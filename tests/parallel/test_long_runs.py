"""Loss spikes and stragglers on 2 gloo ranks (data parallel, ZeRO-3): the policies of
`train.on_spike` with a poisoned batch on one rank and on both, and a rank slowed on purpose.

The recipe and the poison are those of tests/test_spikes.py (one process), on 2 ranks of
2 sequences each: the global batch, and so the global data order, are the same.
"""

from __future__ import annotations

import pytest
from harness import spawn_ranks

from fivefold.train.spikes import SKIP_FILE, SkipList
from test_spikes import POISON, POISONED_STEP, RECIPE

PLAN = ["plan.dp_shard=2", "plan.zero=3", "plan.micro_batch=2"]
ON_2 = [*RECIPE, *PLAN]
CKPT = ["train.ckpt_every=4", "train.log_every=3"]


def spike_runs(tmp_path, poison_ranks: tuple[int, ...]) -> list[dict]:
    (tmp_path / "never").mkdir()
    SkipList(tmp_path / "never" / SKIP_FILE).add(*POISON, POISONED_STEP, write=True)
    runs = {
        "never": [*ON_2, *CKPT, "train.on_spike='off'"],
        "skip": [*ON_2, "train.on_spike='skip'"],
        "rollback": [*ON_2, *CKPT, "train.on_spike='rollback'"],
    }
    args = (str(tmp_path), runs, POISON[0], poison_ranks)
    return spawn_ranks(2, train_ranks_fn(), args, pass_rank=True, timeout_s=600)


def train_ranks_fn():
    from longrun_workers import train_ranks

    return train_ranks


def check_policies(out: list[dict]) -> None:
    never = out[0]["never"]["losses"]
    for rank in (0, 1):  # every rank decided alike, from all-reduced values
        skip, roll = out[rank]["skip"], out[rank]["rollback"]
        assert [e["step"] for e in skip["events"]] == [POISONED_STEP], rank
        assert skip["events"][0]["action"].startswith("update skipped")
        assert skip["losses"][POISONED_STEP:] == never[POISONED_STEP - 1 : 11]
        assert [e["step"] for e in roll["events"]] == [POISONED_STEP], rank
        assert "step_8" in roll["events"][0]["action"]
        assert roll["losses"] == never  # rolled back: equal to the run that never saw it
        assert out[rank]["never"]["losses"] == never


def test_spike_policies_with_the_poison_on_one_rank(tmp_path):
    check_policies(spike_runs(tmp_path, (1,)))


@pytest.mark.slow
def test_spike_policies_with_the_poison_on_both_ranks(tmp_path):
    check_policies(spike_runs(tmp_path, (0, 1)))


STRAGGLER_STEPS = ["train.steps=4", "train.log_every=1", "train.straggler_log_steps=2"]


def check_named_once(out: list[dict], root, name: str) -> None:
    """Rank 1, and only rank 1, named once on both ranks, in events.jsonl and the summary."""
    for rank in (0, 1):
        named = [e for e in out[rank][name]["events"] if e["event"] == "straggler"]
        assert [e["rank"] for e in named] == [1], named
        assert named[0]["local_device"] == 1 and named[0]["host"]
        assert named[0]["lag_s"] > 0.3
    lines = (root / name / "events.jsonl").read_text()
    assert lines.count('"straggler"') == 1
    summary = (root / name / "summary.json").read_text()
    assert '"straggler"' in summary


def test_a_slowed_rank_is_named_once(tmp_path):
    # Rank 1 sleeps 1 s before each batch: rank 0 waits for it in the step's first collective.
    # With 2 ranks the median is their mean, so rank 1 is named whenever a step computes in
    # under 1.5 s (0.375 x 1 s > 0.25 x compute), and rank 0 never is: no timing assumption
    # beyond that.
    runs = {"slow": [*ON_2, *STRAGGLER_STEPS, "train.on_spike='off'"]}
    out = spawn_ranks(
        2,
        train_ranks_fn(),
        (str(tmp_path), runs),
        {"slow_rank": 1, "sleep_s": 1.0},
        pass_rank=True,
        timeout_s=600,
    )
    check_named_once(out, tmp_path, "slow")


def test_a_rank_slow_inside_its_forward_is_named_under_zero3_and_tp(tmp_path):
    # Rank 1 sleeps 2 s inside its first block's forward: under ZeRO-3 rank 0 waits for it in
    # FSDP's next all-gather, under TP2 in the block's own collectives; neither is the
    # runtime's own. With 2 ranks the median is their mean, so at a threshold of 0.1 rank 1
    # is named while its compute exceeds rank 0's by 22 %: while a step computes in under 9 s
    # and the load's scatter between the ranks stays under the 2 s; rank 0 cannot be.
    steps = [*STRAGGLER_STEPS, "train.steps=5", "train.straggler_threshold=0.1"]
    runs = {
        "zero3": [*ON_2, *steps, "train.on_spike='off'"],
        "tp2": [*RECIPE, "plan.tp=2", "plan.micro_batch=4", *steps, "train.on_spike='off'"],
    }
    out = spawn_ranks(
        2,
        train_ranks_fn(),
        (str(tmp_path), runs),
        {"slow_rank": 1, "forward_sleep_s": 2.0},
        pass_rank=True,
        timeout_s=600,
    )
    for name in runs:
        check_named_once(out, tmp_path, name)
