"""Data: the embedded corpus, a byte-level BPE tokenizer, token shards, packing and sampling.

    tok = default_tokenizer(max_vocab=spec.vocab)     # trained on the embedded corpus, cached
    data = TokenShards(default_shards(tok), tokenizer=tok, max_vocab=spec.vocab)
    seqs = PackedSequences(data, spec.seq_len)            # or split="val"
    sampler = GlobalSampler(len(seqs), seed=0)
    for micro_batches in batch_iterator(seqs, sampler, global_batch, micro_batch, r, d): ...

For evaluation, iterate the val split in order:
`batch_iterator(val, GlobalSampler(len(val), shuffle=False), gb, mb, r, d, steps=len(val) // gb)`.

Everything but `Batch`/`batch_iterator` works without torch; those import it when called.
"""

from fivefold.train.data.batching import Batch, batch_iterator, collate, grad_accum_steps
from fivefold.train.data.cache import cache_dir
from fivefold.train.data.corpus import embedded_corpus_files
from fivefold.train.data.documents import iter_documents, read_documents
from fivefold.train.data.packing import PackedSample, PackedSequences
from fivefold.train.data.prepare import default_shards, prepare_shards
from fivefold.train.data.sampler import GlobalSampler
from fivefold.train.data.shards import TokenShards
from fivefold.train.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOD_TOKEN,
    TextTokenizer,
    default_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "EOD_TOKEN",
    "Batch",
    "GlobalSampler",
    "PackedSample",
    "PackedSequences",
    "TextTokenizer",
    "TokenShards",
    "batch_iterator",
    "cache_dir",
    "collate",
    "default_shards",
    "default_tokenizer",
    "embedded_corpus_files",
    "grad_accum_steps",
    "iter_documents",
    "load_tokenizer",
    "prepare_shards",
    "read_documents",
    "train_tokenizer",
]
