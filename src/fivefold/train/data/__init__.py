"""Data: the embedded corpus, a byte-level BPE tokenizer, token shards, packing and sampling.

    tok = default_tokenizer(max_vocab=spec.vocab)     # trained on the embedded corpus, cached
    data = TokenShards(default_shards(tok), tokenizer=tok, max_vocab=spec.vocab)
    seqs = PackedSequences(data, spec.seq_len)            # or split="val"
    sampler = GlobalSampler(len(seqs), seed=0)
    for micro_batches in batch_iterator(seqs, sampler, global_batch, micro_batch, r, d): ...

For evaluation, iterate the val split in order:
`batch_iterator(val, GlobalSampler(len(val), shuffle=False), gb, mb, r, d, steps=len(val) // gb)`.

Everything but `Batch`/`batch_iterator` works without torch; those import it when called. Names
are imported lazily, so that a `data prepare` worker (`fivefold.train.data.prepare_piece`)
starts without numpy or the rest of this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Batch": "batching",
    "batch_iterator": "batching",
    "collate": "batching",
    "grad_accum_steps": "batching",
    "cache_dir": "cache",
    "embedded_corpus_files": "embedded_corpus",
    "iter_documents": "documents",
    "read_documents": "documents",
    "PackedSample": "packing",
    "PackedSequences": "packing",
    "default_shards": "prepare",
    "prepare_shards": "prepare",
    "GlobalSampler": "sampler",
    "TokenShards": "shards",
    "DEFAULT_VOCAB_SIZE": "tokenizer",
    "EOD_TOKEN": "tokenizer",
    "TextTokenizer": "tokenizer",
    "default_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fivefold.train.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fivefold.train.data.{_EXPORTS[name]}"), name)
