"""Cutting the global order into per-rank micro-batches of tensors.

A step consumes `global_batch` consecutive samples of the sampler's global order. Data-parallel
rank `r` of `d` takes the `r`-th contiguous slice of `global_batch / d` samples and cuts it into
`grad_accum = global_batch / (micro_batch * d)` micro-batches of `micro_batch` samples.

The iterator is lazy: it advances the sampler only when a step's batches are requested, so the
sampler's state saved after training step `k` is exactly `k * global_batch` samples consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fivefold.errors import ConfigError
from fivefold.specs.batch import grad_accum_for, grad_accum_problem
from fivefold.train.data.packing import PackedSequences
from fivefold.train.data.sampler import GlobalSampler

# torch (and fivefold.model, which needs it) is imported lazily, inside `collate`: `fivefold
# data` uses this package without torch.
if TYPE_CHECKING:
    import torch


@dataclass
class Batch:
    """One micro-batch; every tensor field a LongTensor `[B, T]` except `sample_ids` `[B]`.

    `labels` are the next tokens of the stream (the end-of-document token separates documents),
    `positions` restart at 0 at each document start, `doc_ids` number the documents within each
    row, `sample_ids` are the samples' indices in their split (for checks and debugging).
    Computed here, on the host, so that no step reads them back from the device:
    `cu_seqlens` (a NumPy int32 array `[N + 1]`: host memory, which `batch_to` leaves there)
    are the cumulative offsets of the batch's N documents in its tokens flattened to
    `[B * T]` (0 first, B * T last; every row starts a document), and `label_count` is the
    number of labels that count in the loss (not `IGNORE_INDEX`).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    sample_ids: torch.Tensor | None = None
    cu_seqlens: np.ndarray | None = None
    label_count: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def document_offsets(doc_ids: np.ndarray) -> np.ndarray:
    """int32 `[N + 1]` cumulative offsets of the documents of `doc_ids` `[B, T]` (runs of equal
    ids; every row starts one) in the tokens flattened to `[B * T]`."""
    rows, seq = doc_ids.shape
    starts = np.ones((rows, seq), dtype=bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    offsets = np.flatnonzero(starts.reshape(-1))
    return np.append(offsets, rows * seq).astype(np.int32)


def collate(seqs: PackedSequences, sample_ids: np.ndarray) -> Batch:
    """Stack samples `sample_ids` of `seqs` into a `Batch` of `len(sample_ids)` rows."""
    import torch

    from fivefold.model.loss import IGNORE_INDEX

    samples = [seqs[int(i)] for i in sample_ids]
    windows = np.stack([s.tokens for s in samples])  # [B, T+1]
    doc_ids = np.stack([s.doc_ids for s in samples])[:, :-1]
    positions = np.stack([s.positions for s in samples])
    labels = windows[:, 1:]
    return Batch(
        tokens=torch.from_numpy(windows[:, :-1].copy()),
        labels=torch.from_numpy(labels.copy()),
        positions=torch.from_numpy(positions[:, :-1].copy()),
        doc_ids=torch.from_numpy(doc_ids.copy()),
        sample_ids=torch.from_numpy(np.asarray(sample_ids, dtype=np.int64)),
        cu_seqlens=document_offsets(doc_ids),
        label_count=int(np.count_nonzero(labels != IGNORE_INDEX)),
    )


def grad_accum_steps(global_batch: int, micro_batch: int, dp_size: int) -> int:
    """`global_batch / (micro_batch * dp_size)`; ConfigError unless it divides exactly."""
    problems = []
    if micro_batch < 1:
        problems.append(f"plan.micro_batch = {micro_batch} must be at least 1.")
    if dp_size < 1:
        problems.append(f"the data-parallel size {dp_size} must be at least 1.")
    accum = None if problems else grad_accum_for(global_batch, micro_batch, dp_size)
    if not problems and accum is None:
        problems.append(grad_accum_problem(global_batch, micro_batch, dp_size, "the global batch"))
    if problems:
        raise ConfigError(problems)
    return accum


def rank_slice(step_samples: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """Data-parallel rank `dp_rank`'s contiguous share of one step's global samples."""
    per_rank = len(step_samples) // dp_size
    return step_samples[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def batch_iterator(
    seqs: PackedSequences,
    sampler: GlobalSampler,
    global_batch: int,
    micro_batch: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    steps: int | None = None,
) -> Iterator[list[Batch]]:
    """Yield, per optimizer step, this rank's `grad_accum` micro-batches (forever, or `steps`)."""
    accum = grad_accum_steps(global_batch, micro_batch, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"data-parallel rank {dp_rank} is outside [0, {dp_size}).")
    if sampler.num_samples != len(seqs):
        raise ConfigError(
            f"the sampler covers {sampler.num_samples} samples but the {seqs.split} split has "
            f"{len(seqs)}; build it as GlobalSampler(len(seqs))."
        )
    step = 0
    while steps is None or step < steps:
        mine = rank_slice(sampler.take(global_batch), dp_rank, dp_size)
        yield [collate(seqs, mine[m * micro_batch : (m + 1) * micro_batch]) for m in range(accum)]
        step += 1
