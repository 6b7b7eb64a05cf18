"""Packing the token stream into fixed-length training samples.

Details: docs/internals.md (`fivefold.train.data.packing`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fivefold.errors import DataError
from fivefold.train.data.shards import TokenShards

SPLITS = ("train", "val")
DEFAULT_VAL_FRACTION = 0.02


class PackedSample(NamedTuple):
    """One window of `T + 1` stream tokens; each field int64 `[T + 1]`."""

    tokens: np.ndarray
    doc_ids: np.ndarray
    positions: np.ndarray


def split_sizes(total: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) sample counts: the last round(total * val_fraction) samples, at least 1."""
    if val_fraction <= 0:
        return total, 0
    val = min(max(1, round(total * val_fraction)), total - 1)
    return total - val, val


class PackedSequences:
    """The train or val samples of a shard set, for sequences of `seq_len` tokens.

    `len(seqs)` samples; `seqs[i]` is a `PackedSample` (tokens, doc_ids, positions), each
    int64 `[seq_len + 1]`.
    """

    def __init__(
        self,
        data: TokenShards,
        seq_len: int,
        split: str = "train",
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ):
        if split not in SPLITS:
            raise DataError(f"split {split!r} is unknown; choose 'train' or 'val'.")
        if seq_len < 1:
            raise DataError(f"sequence length {seq_len} must be at least 1.")
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction {val_fraction} must be in [0, 1).")
        self.data = data
        self.seq_len = seq_len
        self.split = split
        total = (data.num_tokens - 1) // seq_len
        minimum = 2 if val_fraction > 0 else 1
        if total < minimum:
            raise DataError(
                f"shards in {str(data.path)!r} hold {data.num_tokens} tokens, too few for "
                f"{minimum} samples of {seq_len} tokens (need {minimum * seq_len + 1}); use a "
                "shorter sequence length or more text."
            )
        self.num_train, self.num_val = split_sizes(total, val_fraction)
        if split == "val" and self.num_val == 0:
            raise DataError("the val split is empty because val_fraction is 0; set it above 0.")
        self._first = 0 if split == "train" else self.num_train
        self._count = self.num_train if split == "train" else self.num_val

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> PackedSample:
        if not 0 <= index < self._count:
            raise IndexError(f"sample {index} outside [0, {self._count}) of the {self.split} split")
        start = (self._first + index) * self.seq_len
        stop = start + self.seq_len + 1
        tokens = self.data.tokens(start, stop)
        stream_positions = np.arange(start, stop, dtype=np.int64)
        docs = self.data.document_of(stream_positions)
        doc_begin = np.maximum(self.data.doc_starts[docs], start)
        return PackedSample(tokens, docs - docs[0], stream_positions - doc_begin)

    def __repr__(self) -> str:
        return f"PackedSequences({self.split}, samples={len(self)}, seq_len={self.seq_len})"
