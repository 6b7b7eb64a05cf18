"""A deterministic, resumable global sample order shared by every data-parallel layout.

Details: docs/internals.md (`fivefold.train.data.sampler`).
"""

from __future__ import annotations

import numpy as np

from fivefold.errors import DataError

_U64_MASK = (1 << 64) - 1


def _as_u64(value: int) -> np.ndarray:
    return np.asarray(value & _U64_MASK, dtype=np.uint64)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 output function of state `x + golden` (uint64 in, uint64 out, wrapping)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class GlobalSampler:
    """The global order of `num_samples` samples, shuffled per epoch from `seed`."""

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise DataError(f"the sampler needs at least one sample, got {num_samples}.")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._cached_epoch: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample indices of `epoch`, in order (int64 `[num_samples]`)."""
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            if self.shuffle:
                salt = splitmix64(_as_u64(int(splitmix64(_as_u64(self.seed))) + epoch))
                keys = splitmix64(np.arange(self.num_samples, dtype=np.uint64) ^ salt)
                order = np.argsort(keys).astype(np.int64)
            else:
                order = np.arange(self.num_samples, dtype=np.int64)
            self._cached_epoch = (epoch, order)
        return self._cached_epoch[1]

    def order(self, start: int, count: int) -> np.ndarray:
        """Entries `[start, start + count)` of the global order (int64 `[count]`)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(start + filled, self.num_samples)
            take = min(count - filled, self.num_samples - offset)
            out[filled : filled + take] = self.epoch_order(epoch)[offset : offset + take]
            filled += take
        return out

    def take(self, count: int) -> np.ndarray:
        """The next `count` samples of the global order; advances the state past them."""
        indices = self.order(self.consumed, count)
        self.consumed += count
        return indices

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; it must describe the same data, seed and shuffling."""
        saved = (state.get("num_samples"), state.get("seed"), state.get("shuffle"))
        if saved != (self.num_samples, self.seed, self.shuffle):
            raise DataError(
                f"the saved data-loader state is for {saved[0]} samples with seed {saved[1]} "
                f"(shuffle={saved[2]}), but this run has {self.num_samples} samples with seed "
                f"{self.seed} (shuffle={self.shuffle}); resume with the same data, sequence "
                "length and data seed, or start a new run."
            )
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"the saved data-loader state has an invalid position {consumed!r}.")
        self.consumed = consumed

    def __repr__(self) -> str:
        return (
            f"GlobalSampler(num_samples={self.num_samples}, seed={self.seed}, "
            f"consumed={self.consumed}, epoch={self.epoch})"
        )
