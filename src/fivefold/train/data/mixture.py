"""Weighted mixtures of sources: which source each position of the global order draws from.

The global order is cut into blocks of `BLOCK` positions. Source `s` owns
`Q_s(m) = apportion(w, m * BLOCK)[s]` of the first `m` blocks (largest remainders, so
`|Q_s(m) - w_s * m * BLOCK| < 1`), and inside a block its positions are spread evenly (its `j`-th
at the ideal time `(j + 1/2) / q_s`). So the samples of source `s` among the first `n` positions
never differ from `w_s * n` by more than `MAX_DEVIATION` (tested), at every step count, and the
source of any position is found without replaying the ones before it. Each source keeps its own
shuffled order (`GlobalSampler`, seeded from the run's seed and the source's index): the `k`-th
sample drawn from source `s` is entry `k` of that order. Nothing but the position is state, so a
resumed run on any layout draws exactly what an uninterrupted one draws.
"""

from __future__ import annotations

import math

import numpy as np

from fivefold.errors import DataError
from fivefold.train.data.packing import PackedSample, PackedSequences
from fivefold.train.data.sampler import GlobalSampler, _as_u64, splitmix64

BLOCK = 1 << 16
MAX_DEVIATION = 2  # samples: |drawn_s(n) - w_s * n| for any n and source s


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer shares of `total` (int64 `[k]`, summing to it) closest to `weights * total`:
    floors, plus one for the largest remainders (ties: the lower index)."""
    exact = np.asarray(weights, dtype=np.float64) * total
    shares = np.floor(exact).astype(np.int64)
    extra = int(total - shares.sum())
    if extra > 0:
        order = np.lexsort((np.arange(len(exact)), -(exact - shares)))
        shares[order[:extra]] += 1
    return shares


def spread(quotas: np.ndarray) -> np.ndarray:
    """The source of each position of a block where source `s` fills `quotas[s]` positions,
    spread evenly (int64 `[sum(quotas)]`)."""
    k = len(quotas)
    src = np.repeat(np.arange(k, dtype=np.int64), quotas)
    nth = np.concatenate([np.arange(q, dtype=np.float64) for q in quotas] or [np.zeros(0)])
    keys = (nth + 0.5) / np.repeat(quotas, quotas).astype(np.float64)
    return src[np.lexsort((src, keys))]


class Interleave:
    """The source of every position of an endless order drawn with `weights` (normalised)."""

    def __init__(self, weights: list[float], names: list[str] | None = None):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0):
            raise DataError(f"mixture weights {weights!r} must be finite numbers >= 0.")
        if w.sum() <= 0:
            raise DataError("every mixture weight is 0; give at least one source a weight.")
        self.weights = w / w.sum()
        small = [i for i, x in enumerate(self.weights) if 0 < x < 1 / BLOCK]
        if small:
            name = names[small[0]] if names else f"source {small[0]}"
            raise DataError(
                f"data.sources: {name!r} has a weight below 1/{BLOCK} of the total, too small to "
                "draw from evenly; raise it or set it to 0."
            )
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def drawn(self, position: int) -> np.ndarray:
        """Samples of each source among positions `[0, position)` (int64 `[k]`)."""
        block, inside = divmod(position, BLOCK)
        pattern, before = self._block(block)
        counts = np.bincount(pattern[:inside], minlength=len(self.weights))
        return before + counts

    def sources(self, start: int, count: int) -> np.ndarray:
        """The source of positions `[start, start + count)` (int64 `[count]`)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            block, inside = divmod(start + filled, BLOCK)
            take = min(count - filled, BLOCK - inside)
            out[filled : filled + take] = self._block(block)[0][inside : inside + take]
            filled += take
        return out

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block `block`'s pattern and the samples of each source in the blocks before it."""
        if block not in self._blocks:
            if len(self._blocks) >= 4:
                self._blocks.pop(next(iter(self._blocks)))
            before = apportion(self.weights, block * BLOCK)
            quotas = apportion(self.weights, (block + 1) * BLOCK) - before
            self._blocks[block] = (spread(quotas), before)
        return self._blocks[block]


def source_seed(seed: int, index: int) -> int:
    """The shuffling seed of source `index` of a run seeded `seed` (a 64-bit integer)."""
    return int(splitmix64(_as_u64(seed * 0x10001 + index + 1)))


class MixtureSampler:
    """The global order over the concatenated train samples of weighted sources: entry `p` is
    a sample of source `Interleave.sources(p)`, the next one of that source's own order.
    Indices are into `MixedSequences` (source `s`'s samples start at `offsets[s]`)."""

    shuffle = True

    def __init__(self, names: list[str], sizes: list[int], weights: list[float], seed: int = 0):
        if min(sizes) < 1:
            raise DataError(f"every mixture source needs training samples, got sizes {sizes}.")
        self.names, self.sizes, self.seed = list(names), list(sizes), seed
        self.interleave = Interleave(weights, names)
        self.weights = [float(w) for w in self.interleave.weights]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_samples = int(self.offsets[-1])
        self.samplers = [GlobalSampler(n, source_seed(seed, i)) for i, n in enumerate(sizes)]
        self.consumed = 0

    def order(self, start: int, count: int) -> np.ndarray:
        """Entries `[start, start + count)` of the global order (int64 `[count]`)."""
        src = self.interleave.sources(start, count)
        before = self.interleave.drawn(start)
        out = np.empty(count, dtype=np.int64)
        for s, sampler in enumerate(self.samplers):
            mine = src == s
            taken = int(mine.sum())
            if taken:
                out[mine] = self.offsets[s] + sampler.order(int(before[s]), taken)
        return out

    def take(self, count: int) -> np.ndarray:
        """The next `count` samples of the global order; advances the state past them."""
        indices = self.order(self.consumed, count)
        self.consumed += count
        return indices

    def drawn(self, position: int | None = None) -> dict[str, int]:
        """Samples drawn from each source by `position` (default: the state's), by name."""
        counts = self.interleave.drawn(self.consumed if position is None else position)
        return {name: int(c) for name, c in zip(self.names, counts, strict=True)}

    def sources(self, start: int, count: int) -> dict[str, int]:
        """Samples of each source among positions `[start, start + count)`, by name."""
        counts = np.bincount(self.interleave.sources(start, count), minlength=len(self.names))
        return {name: int(c) for name, c in zip(self.names, counts, strict=True)}

    def epochs(self, position: int) -> dict[str, float]:
        """Epochs of each source's training samples drawn by `position`."""
        drawn = self.drawn(position)
        return {n: drawn[n] / size for n, size in zip(self.names, self.sizes, strict=True)}

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": True,
            "sources": [
                {"name": n, "samples": size, "weight": w}
                for n, size, w in zip(self.names, self.sizes, self.weights, strict=True)
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; it must describe the same sources, weights and seed."""
        mine = self.state_dict()
        if state.get("seed") != self.seed or not _same(state.get("sources"), mine["sources"]):
            raise DataError(
                f"the saved data-loader state is for sources {_brief(state.get('sources'))} "
                f"with seed {state.get('seed')}, but this run has {_brief(mine['sources'])} with "
                f"seed {self.seed}; resume with the same data.sources, sequence length and data "
                "seed, or start a new run."
            )
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"the saved data-loader state has an invalid position {consumed!r}.")
        self.consumed = consumed

    @property
    def epoch(self) -> int:
        return min(s.epoch for s in self.samplers)

    def __repr__(self) -> str:
        return f"MixtureSampler({self.drawn()}, consumed={self.consumed})"


def _same(saved: object, mine: list[dict]) -> bool:
    """Whether saved sources equal `mine` (names, sizes; weights within float round-off)."""
    if not isinstance(saved, list) or len(saved) != len(mine):
        return False
    return all(
        isinstance(a, dict)
        and (a.get("name"), a.get("samples")) == (b["name"], b["samples"])
        and math.isclose(float(a.get("weight", -1)), b["weight"], rel_tol=1e-12)
        for a, b in zip(saved, mine, strict=True)
    )


def _brief(sources: object) -> str:
    if not isinstance(sources, list):
        return "(one source, no mixture)"
    return ", ".join(
        f"{s.get('name')} ({s.get('samples')} samples, weight {s.get('weight'):.4g})"
        for s in sources
        if isinstance(s, dict)
    )


class MixedSequences:
    """The train samples of several sources as one indexable set: index `offsets[s] + i` is
    sample `i` of source `s` (`PackedSample`, int64 `[seq_len + 1]` each)."""

    def __init__(self, parts: list[PackedSequences]):
        self.parts = parts
        self.split = parts[0].split
        self.seq_len = parts[0].seq_len
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source of each global index (int64, same shape)."""
        return np.searchsorted(self.offsets, indices, side="right").astype(np.int64) - 1

    def __getitem__(self, index: int) -> PackedSample:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside [0, {len(self)}) of the mixture")
        s = int(self.source_of(np.asarray(index)))
        return self.parts[s][index - int(self.offsets[s])]
