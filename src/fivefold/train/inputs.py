"""The recipe's `[data]` section turned into the loop's data: tokens, sampler, batches.

Three sources, in order of precedence: `data.shards` (a directory written by `prepare_shards` /
`fivefold data prepare`), `data.inputs` (.txt/.jsonl files, tokenized once into a cached shard
directory keyed by their contents and the tokenizer), or the embedded corpus (the default).
The tokenizer is `data.tokenizer` or the default one trained on the embedded corpus. The last
`data.val_fraction` of samples is the held-out split for `train.eval_every`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fivefold.errors import DataError
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
from fivefold.train.data.corpus import files_digest
from fivefold.train.data.shards import read_manifest


@dataclass
class TrainData:
    """The train split with its resumable sampler, and the held-out split (None if disabled)."""

    shards: TokenShards
    train: PackedSequences
    val: PackedSequences | None
    sampler: GlobalSampler
    global_batch: int
    dp_rank: int
    dp_size: int

    def batches(self, micro_batch: int) -> Iterator[list[Batch]]:
        """Per step, this rank's micro-batches, continuing from the sampler's state (forever)."""
        return batch_iterator(
            self.train, self.sampler, self.global_batch, micro_batch, self.dp_rank, self.dp_size
        )

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
        """The first `count` micro-batches of the held-out split (the same every evaluation)."""
        if self.val is None:
            return []
        available = len(self.val) // micro_batch
        return [
            collate(self.val, np.arange(i * micro_batch, (i + 1) * micro_batch))
            for i in range(min(count, max(1, available)))
            if (i + 1) * micro_batch <= len(self.val)
        ]

    def eval_note(self, eval_every: int, val_fraction: float) -> str | None:
        """A warning for held-out losses on a user corpus: the split is the corpus tail (the end
        of the last input file), which may be unlike the rest (a licence, an index)."""
        if self.val is None or not eval_every or _is_default(self.shards):
            return None
        inputs = self.shards.manifest.get("inputs") or []
        last = f" (the end of {inputs[-1]['path']})" if inputs else ""
        return (
            f"eval: the held-out split is the last {val_fraction:.0%} of the corpus, "
            f"{len(self.val)} samples{last}; if the corpus ends with text unlike the rest (a "
            "licence, an index), the eval loss stays flat: put a representative file last, or "
            "change data.val_fraction."
        )

    def describe(self) -> str:
        source = self.shards.manifest.get("inputs") or []
        name = "embedded corpus" if _is_default(self.shards) else str(self.shards.path)
        val = f", {len(self.val)} held out (the tail)" if self.val is not None else ""
        return (
            f"{name} ({self.shards.num_tokens:,} tokens, {self.shards.num_documents} documents"
            f"{f', {len(source)} files' if source else ''}; {len(self.train)} training samples"
            f"{val})"
        )


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
    if data.shards:
        path = Path(data.shards)
        if not path.is_dir():
            out.append(
                f"data.shards = {str(path)!r} is not a directory; prepare one with "
                "`fivefold data prepare INPUTS... --out DIR` or leave data.shards empty for the "
                "embedded corpus."
            )
        else:
            try:
                read_manifest(path)
            except DataError as err:
                out.append(f"data.shards: {err}")
    out += [
        f"data.inputs: {name!r} does not exist; check the path."
        for name in data.inputs
        if not Path(name).is_file()
    ]
    if data.tokenizer:
        try:
            load_tokenizer(Path(data.tokenizer), max_vocab=run.recipe.model.vocab)
        except DataError as err:
            out.append(f"data.tokenizer: {err}")
    return out


def shards_for(run: RunConfig, tokenizer: TextTokenizer) -> TokenShards:
    vocab = run.recipe.model.vocab
    if run.data.shards:
        return TokenShards(Path(run.data.shards), tokenizer=tokenizer, max_vocab=vocab)
    if run.data.inputs:
        return TokenShards(
            _cached_input_shards(run, tokenizer), tokenizer=tokenizer, max_vocab=vocab
        )
    return TokenShards(default_shards(tokenizer), tokenizer=tokenizer, max_vocab=vocab)


def _cached_input_shards(run: RunConfig, tokenizer: TextTokenizer) -> Path:
    """Tokenize `data.inputs` once; later runs with the same files and tokenizer reuse it."""
    inputs = [Path(p) for p in run.data.inputs]
    root = Path(run.data.cache_dir) if run.data.cache_dir else cache_dir() / "shards"
    out_dir = root / f"inputs-{files_digest(inputs)[:12]}-{tokenizer.hash[:12]}"
    with cache_lock(out_dir.name):
        try:
            TokenShards(out_dir, tokenizer=tokenizer)
        except DataError:
            prepare_shards(inputs, out_dir, tokenizer, overwrite=True)
    return out_dir


def load_train_data(run: RunConfig, dp_rank: int = 0, dp_size: int = 1) -> TrainData:
    """Tokenizer, shards, train/val packing and the sampler for `run` (DataError if unusable)."""
    if problems := path_problems(run):
        raise DataError("; ".join(problems))
    tokenizer = load_tokenizer_for(run)
    shards = shards_for(run, tokenizer)
    seq_len = run.recipe.model.seq_len
    fraction = run.data.val_fraction
    train = PackedSequences(shards, seq_len, "train", val_fraction=fraction)
    val = PackedSequences(shards, seq_len, "val", val_fraction=fraction) if fraction > 0 else None
    sampler = GlobalSampler(len(train), seed=run.train.seed)
    return TrainData(shards, train, val, sampler, run.global_batch, dp_rank, dp_size)
