"""A resumed run continues the exact global sample order when the data-parallel size changes.

The data position travels through the checkpoint's state.json (global samples consumed), so a
run checkpointed with 4 data-parallel ranks and resumed with 2 (or 3 -> 1 ... ) sees exactly the
global batches an uninterrupted single-rank run sees: no sample skipped, none repeated.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from fivefold.checkpoint import Checkpointer
from fivefold.train.data import GlobalSampler, batch_iterator
from fivefold.train.data.packing import PackedSample

GLOBAL_BATCH = 12
NUM_SAMPLES = 50  # not a multiple of the batch: steps straddle epoch boundaries


class IndexSamples:
    """Sample i is the window [i, i, ..., i] (so a batch's tokens name its samples)."""

    split = "train"

    def __init__(self, count: int, seq_len: int = 4):
        self.count, self.seq_len = count, seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> PackedSample:
        window = np.full(self.seq_len + 1, index, dtype=np.int64)
        return PackedSample(window, np.zeros_like(window), np.arange(self.seq_len + 1))


def global_batches(dp_size: int, steps: int, micro_batch: int, state: dict | None = None):
    """Per step, the samples of every dp rank in rank order (= the step's global batch)."""
    seqs = IndexSamples(NUM_SAMPLES)
    samplers = [GlobalSampler(NUM_SAMPLES, seed=3) for _ in range(dp_size)]
    for sampler in samplers:
        if state is not None:
            sampler.load_state_dict(state)
    iterators = [
        batch_iterator(seqs, samplers[r], GLOBAL_BATCH, micro_batch, r, dp_size)
        for r in range(dp_size)
    ]
    out = []
    for _ in range(steps):
        per_rank = [next(it) for it in iterators]
        out.append(
            [
                int(b.tokens[row, 0])
                for micro in per_rank
                for b in micro
                for row in range(b.tokens.shape[0])
            ]
        )
    return out, samplers[0]


@pytest.mark.parametrize("before, after", [(4, 2), (2, 3), (3, 1), (1, 4)])
def test_dp_size_change_keeps_the_global_sample_sequence(tmp_path, before, after):
    reference, _ = global_batches(1, 8, micro_batch=2)
    first, sampler = global_batches(before, 3, micro_batch=1)
    assert first == reference[:3]

    holder = nn.Linear(2, 2)  # the checkpoint needs a model; the data state is what is tested
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, [holder], None, model_spec={}, plan={"dp_replicate": before}, sampler=sampler)
    resumed_sampler = GlobalSampler(NUM_SAMPLES, seed=3)
    state = ckpt.load(
        ckpt.select().path, [nn.Linear(2, 2)], None, model_spec={}, sampler=resumed_sampler
    )
    assert state.sampler["consumed"] == 3 * GLOBAL_BATCH == resumed_sampler.consumed

    second, _ = global_batches(after, 5, micro_batch=1, state=state.sampler)
    assert second == reference[3:]
    seen = [s for batch in first + second for s in batch]
    epoch_of = np.arange(len(seen)) // NUM_SAMPLES
    for epoch in set(epoch_of[:-1].tolist()) - {int(epoch_of[-1])}:
        # every complete epoch holds each sample exactly once
        assert sorted(np.asarray(seen)[epoch_of == epoch].tolist()) == list(range(NUM_SAMPLES))
