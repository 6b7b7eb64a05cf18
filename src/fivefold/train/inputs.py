"""The recipe's `[data]` section turned into the loop's data: tokens, sampler, batches.

Three sources, in order of precedence: `data.shards` (a directory written by `prepare_shards` /
`fivefold data prepare`), `data.inputs` (.txt/.jsonl files, tokenized once into a cached shard
directory keyed by their contents and the tokenizer), or the embedded corpus (the default).
Or several, weighted: `data.sources` (`fivefold.train.sources`; sampled by
`fivefold.train.data.mixture`). The tokenizer is `data.tokenizer` or the default one trained on
the embedded corpus; every source must be tokenised with it. The last `data.val_fraction` of each
source's samples is its held-out split for `train.eval_every`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fivefold.errors import DataError
from fivefold.specs.mixture import EPOCH_WARN_LIMIT, SourceDraw
from fivefold.train.config import RunConfig
from fivefold.train.data import (
    Batch,
    GlobalSampler,
    PackedSequences,
    TextTokenizer,
    TokenShards,
    batch_iterator,
    cache_dir,
    collate,
    default_shards,
    default_tokenizer,
    load_tokenizer,
    prepare_shards,
)
from fivefold.train.data.cache import cache_lock
from fivefold.train.data.embedded_corpus import files_digest
from fivefold.train.data.mixture import MixedSequences, MixtureSampler
from fivefold.train.data.shards import read_manifest


@dataclass
class SourceData:
    """One source of the run's tokens: its shards, train and held-out (tail) samples."""

    name: str
    shards: TokenShards
    train: PackedSequences
    val: PackedSequences | None
    max_epochs: float = EPOCH_WARN_LIMIT


@dataclass
class TrainData:
    """The train samples with their resumable sampler, per source its held-out split.

    One source (`data.shards`/`data.inputs`/the embedded corpus): `train` is its samples and
    `sampler` a `GlobalSampler`. A mixture (`data.sources`): `train` is every source's samples
    in one `MixedSequences` and `sampler` a `MixtureSampler`.
    """

    sources: list[SourceData]
    train: PackedSequences | MixedSequences
    sampler: GlobalSampler | MixtureSampler
    global_batch: int
    dp_rank: int
    dp_size: int

    @property
    def shards(self) -> TokenShards:
        return self.sources[0].shards

    @property
    def val(self) -> PackedSequences | None:
        return self.sources[0].val

    @property
    def is_mixture(self) -> bool:
        return isinstance(self.sampler, MixtureSampler)

    def batches(self, micro_batch: int) -> Iterator[list[Batch]]:
        """Per step, this rank's micro-batches, continuing from the sampler's state (forever)."""
        return batch_iterator(
            self.train, self.sampler, self.global_batch, micro_batch, self.dp_rank, self.dp_size
        )

    def batch_sources(self, start: int, end: int) -> dict[str, int]:
        """Samples of each source among positions `[start, end)` of the global order (a step's
        batch: `SpikePolicy.next_batch`'s range), by source name; the same on every rank."""
        if isinstance(self.sampler, MixtureSampler):
            return self.sampler.sources(start, end - start)
        return {self.sources[0].name: end - start}

    def tokens_drawn(self, position: int, skipped: Iterable[Sequence[int]] = ()) -> dict[str, int]:
        """Training tokens drawn from each source among positions `[0, position)` of the global
        order, by name, less the `skipped` ranges (`[start, end, ...]`, a `SkipList`'s: the
        loop jumps over each whole, so only those ending by `position` were passed)."""
        seq = self.train.seq_len
        if isinstance(self.sampler, MixtureSampler):
            counts = self.sampler.drawn(position)
        else:
            counts = {self.sources[0].name: position}
        for start, end, *_ in skipped:
            if end <= position:
                for name, count in self.batch_sources(start, end).items():
                    counts[name] -= count
        return {name: count * seq for name, count in counts.items()}

    def tokens_by_source(self, skipped: Iterable[Sequence[int]] = ()) -> dict[str, int]:
        """A mixture's `tokens_drawn` up to the sampler's position ({} for one source)."""
        return self.tokens_drawn(self.sampler.consumed, skipped) if self.is_mixture else {}

    def plan_draws(self, steps: int) -> list[SourceDraw]:
        """What `steps` steps draw of each source: tokens and epochs of its training samples."""
        drawn = self.tokens_drawn(steps * self.global_batch)
        weights = [1.0]
        if isinstance(self.sampler, MixtureSampler):
            weights = self.sampler.weights
        return [
            SourceDraw(
                s.name,
                weight,
                drawn[s.name],
                len(s.train) * s.train.seq_len,
                s.max_epochs,
            )
            for s, weight in zip(self.sources, weights, strict=True)
        ]

    def repeat_note(self) -> str | None:
        """A warning when one step takes more sequences than the train split holds."""
        samples = len(self.train)
        if self.global_batch <= samples:
            return None
        return (
            f"warning: a step takes {self.global_batch:,} sequences but the data holds "
            f"{samples:,} training samples, so every step repeats samples "
            f"({self.global_batch / samples:.1f} epochs per step); lower the batch "
            "(plan.micro_batch, plan.grad_accum) or give more data."
        )

    def eval_batches(self, count: int, micro_batch: int) -> list[Batch]:
        """The first `count` micro-batches of the (first) held-out split (the same every
        evaluation)."""
        return _val_batches(self.val, count, micro_batch)

    def eval_sets(self, count: int, micro_batch: int) -> dict[str, list[Batch]]:
        """Per source with a held-out split, its first `count` micro-batches, by name."""
        return {
            s.name: _val_batches(s.val, count, micro_batch)
            for s in self.sources
            if s.val is not None
        }

    def eval_note(self, eval_every: int, val_fraction: float) -> str | None:
        """A warning for held-out losses on a user corpus: the split is the corpus tail (the end
        of the last input file), which may be unlike the rest (a licence, an index); a mixture
        holds out each source's tail."""
        if self.val is None or not eval_every or _is_default(self.shards):
            return None
        if not self.is_mixture:
            held, last = len(self.val), _last_input(self.shards)
            where = f"the last {val_fraction:.0%} of the corpus, {held} samples"
            where += f" (the end of {last})" if last else ""
        else:
            parts = [
                f"{s.name}: {len(s.val) if s.val else 0} samples"
                + (f", the end of {_last_input(s.shards)}" if _last_input(s.shards) else "")
                for s in self.sources
            ]
            where = f"the last {val_fraction:.0%} of each source ({'; '.join(parts)})"
        return (
            f"eval: the held-out split is {where}; if the corpus ends with text unlike the rest "
            "(a licence, an index), the eval loss stays flat: put a representative file last, "
            "or change data.val_fraction."
        )

    def describe(self) -> str:
        if self.is_mixture:
            return f"a mixture of {len(self.sources)} sources ({len(self.train)} training samples)"
        source = self.shards.manifest.get("inputs") or []
        name = "embedded corpus" if _is_default(self.shards) else str(self.shards.path)
        val = f", {len(self.val)} held out (the tail)" if self.val is not None else ""
        return (
            f"{name} ({self.shards.num_tokens:,} tokens, {self.shards.num_documents} documents"
            f"{f', {len(source)} files' if source else ''}; {len(self.train)} training samples"
            f"{val})"
        )


def _val_batches(val: PackedSequences | None, count: int, micro_batch: int) -> list[Batch]:
    if val is None:
        return []
    available = len(val) // micro_batch
    return [
        collate(val, np.arange(i * micro_batch, (i + 1) * micro_batch))
        for i in range(min(count, max(1, available)))
        if (i + 1) * micro_batch <= len(val)
    ]


def _last_input(shards: TokenShards) -> str:
    inputs = shards.manifest.get("inputs") or []
    return inputs[-1]["path"] if inputs else ""


def _is_default(shards: TokenShards) -> bool:
    return shards.path.name.startswith("embedded-")


def load_tokenizer_for(run: RunConfig) -> TextTokenizer:
    vocab = run.recipe.model.vocab
    if run.data.tokenizer:
        return load_tokenizer(Path(run.data.tokenizer), max_vocab=vocab)
    return default_tokenizer(max_vocab=vocab)


def path_problems(run: RunConfig) -> list[str]:
    """Every `[data]` path that cannot be used as named: shards that are not a shard directory,
    inputs that do not exist, a tokenizer that is missing, unreadable or larger than
    model.vocab. The launcher checks them before any process starts; `load_train_data` again."""
    data, out = run.data, []
    places = [("data", data.shards, data.inputs)] + [
        (f"data.sources[{i}] ({s.label!r})", s.shards, s.inputs)
        for i, s in enumerate(data.mixture())
    ]
    for where, shards, inputs in places:
        if shards:
            out += _shards_problems(Path(shards), f"{where}.shards")
        out += [
            f"{where}.inputs: {name!r} does not exist; check the path."
            for name in inputs
            if not Path(name).is_file()
        ]
    if data.tokenizer:
        try:
            load_tokenizer(Path(data.tokenizer), max_vocab=run.recipe.model.vocab)
        except DataError as err:
            out.append(f"data.tokenizer: {err}")
    return out


def _shards_problems(path: Path, field: str) -> list[str]:
    if not path.is_dir():
        return [
            f"{field} = {str(path)!r} is not a directory; prepare one with "
            "`fivefold data prepare INPUTS... --out DIR` or leave data.shards empty for the "
            "embedded corpus."
        ]
    try:
        read_manifest(path)
    except DataError as err:
        return [f"{field}: {err}"]
    return []


def shards_for(
    run: RunConfig, tokenizer: TextTokenizer, shards: str = "", inputs: list[str] | None = None
) -> TokenShards:
    """The shards of one source (`shards` or `inputs`; default: `[data]`'s own or the embedded
    corpus), checked against `tokenizer` and model.vocab."""
    vocab = run.recipe.model.vocab
    shards, inputs = (
        (shards, inputs or []) if shards or inputs else (run.data.shards, run.data.inputs)
    )
    if shards:
        return TokenShards(Path(shards), tokenizer=tokenizer, max_vocab=vocab)
    if inputs:
        return TokenShards(
            _cached_input_shards(run, tokenizer, inputs), tokenizer=tokenizer, max_vocab=vocab
        )
    return TokenShards(default_shards(tokenizer), tokenizer=tokenizer, max_vocab=vocab)


def _cached_input_shards(run: RunConfig, tokenizer: TextTokenizer, names: list[str]) -> Path:
    """Tokenize `names` once; later runs with the same files and tokenizer reuse it."""
    inputs = [Path(p) for p in names]
    root = Path(run.data.cache_dir) if run.data.cache_dir else cache_dir() / "shards"
    field = run.data.text_field
    key = files_digest(inputs)[:12] + (f"-{field}" if field != "text" else "")
    out_dir = root / f"inputs-{key}-{tokenizer.hash[:12]}"
    with cache_lock(out_dir.name):
        try:
            TokenShards(out_dir, tokenizer=tokenizer)
        except DataError:
            prepare_shards(inputs, out_dir, tokenizer, overwrite=True, text_field=field)
    return out_dir


def _source(
    run: RunConfig, name: str, shards: TokenShards, max_epochs: float = EPOCH_WARN_LIMIT
) -> SourceData:
    seq_len, fraction = run.recipe.model.seq_len, run.data.val_fraction
    train = PackedSequences(shards, seq_len, "train", val_fraction=fraction)
    val = PackedSequences(shards, seq_len, "val", val_fraction=fraction) if fraction > 0 else None
    return SourceData(name, shards, train, val, max_epochs)


def _mixture_sources(run: RunConfig, tokenizer: TextTokenizer) -> list[SourceData]:
    """Each `data.sources` entry opened; a DataError names the source at fault."""
    out = []
    for i, cfg in enumerate(run.data.mixture()):
        try:
            shards = shards_for(run, tokenizer, cfg.shards, cfg.inputs)
            out.append(_source(run, cfg.label, shards, cfg.max_epochs))
        except DataError as err:
            raise DataError(f"data.sources[{i}] ({cfg.label!r}): {err}") from None
    return out


def load_train_data(run: RunConfig, dp_rank: int = 0, dp_size: int = 1) -> TrainData:
    """Tokenizer, shards, train/val packing and the sampler for `run` (DataError if unusable)."""
    if problems := path_problems(run):
        raise DataError("; ".join(problems))
    tokenizer = load_tokenizer_for(run)
    if not run.data.sources:
        source = _source(run, "data", shards_for(run, tokenizer))
        sampler = GlobalSampler(len(source.train), seed=run.train.seed)
        return TrainData([source], source.train, sampler, run.global_batch, dp_rank, dp_size)
    sources = _mixture_sources(run, tokenizer)
    weights = [cfg.weight for cfg in run.data.mixture()]
    sampler = MixtureSampler(
        [s.name for s in sources], [len(s.train) for s in sources], weights, run.train.seed
    )
    train = MixedSequences([s.train for s in sources])
    return TrainData(sources, train, sampler, run.global_batch, dp_rank, dp_size)
