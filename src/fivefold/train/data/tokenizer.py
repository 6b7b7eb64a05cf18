"""Byte-level BPE tokenizer with one special token that ends every document.

Built with HuggingFace `tokenizers` (training and encoding are Rust, fast and deterministic: the
same corpus and vocabulary size give the same tokenizer, byte for byte, in any process). The
default tokenizer is trained on the embedded corpus on first use (about a second) and cached under
`${FIVEFOLD_CACHE:-~/.cache/fivefold}/tokenizers/`, keyed by the corpus digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fivefold.errors import DataError
from fivefold.train.data.cache import atomic_write_text, cache_dir, cache_lock
from fivefold.train.data.documents import TEXT_FIELD, check_inputs, iter_documents
from fivefold.train.data.embedded_corpus import embedded_corpus_files, files_digest

EOD_TOKEN = "<|endoftext|>"
# The end-of-document tokens of published tokenizers, tried in order when a tokenizer has no
# EOD_TOKEN: Llama 3, then Llama 2 / Mistral, then Gemma.
OTHER_EOD_TOKENS = ("<|end_of_text|>", "</s>", "<eos>")
DEFAULT_VOCAB_SIZE = 4096
MIN_VOCAB_SIZE = 257  # 256 byte symbols + the end-of-document token
_RECIPE_VERSION = 1  # bump when the training recipe below changes, to invalidate caches


class TextTokenizer:
    """A trained byte-level BPE: `encode` text to ids in `[0, vocab_size)`, `decode` back.

    Lossless: `decode(encode(text)) == text` for any Unicode string. `eod_id` is the id of the
    end-of-document token that the packer appends to every document.
    """

    def __init__(self, backend, path: Path | None = None):
        self.backend = backend  # tokenizers.Tokenizer
        self.path = path
        ids = (backend.token_to_id(t) for t in (EOD_TOKEN, *OTHER_EOD_TOKENS))
        eod = next((i for i in ids if i is not None), None)
        if eod is None:
            where = f"tokenizer {str(path)!r}" if path else "the tokenizer"
            raise DataError(
                f"{where} has no {EOD_TOKEN} token (nor {', '.join(OTHER_EOD_TOKENS)}) to end "
                "documents with; train one with `fivefold data tokenizer`."
            )
        self.eod_id: int = eod
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.hash: str = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once (in parallel threads). With `encode_batch_fast` where
        `tokenizers` has it: the same ids without the character offsets, which cost about a
        third of `encode_batch`'s CPU time (benchmarks/data_prepare.py)."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.backend.to_str())
        self.path = path
        return path

    def check_fits(self, model_vocab: int, field: str = "model.vocab") -> None:
        """DataError unless every token id is a valid row of a `model_vocab`-row embedding."""
        if self.vocab_size > model_vocab:
            where = f"tokenizer {str(self.path)!r}" if self.path else "the tokenizer"
            raise DataError(
                f"{where} has {self.vocab_size} tokens but {field} = {model_vocab}; token ids "
                f"would not fit the embedding. Set {field} >= {self.vocab_size} or train a "
                f"smaller tokenizer with `fivefold data tokenizer ... --vocab {model_vocab}`."
            )

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, hash={self.hash[:12]})"


def tokenizer_from_text(text: str) -> TextTokenizer:
    """A tokenizer from its JSON text (`TextTokenizer.backend.to_str()`), e.g. in a worker."""
    return TextTokenizer(Tokenizer.from_str(text))


def train_tokenizer(
    inputs: list[Path],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    out: Path | None = None,
    text_field: str = TEXT_FIELD,
) -> TextTokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens on the documents of `inputs`
    (JSONL field / Parquet or Arrow column `text_field`).

    A corpus too small to support `vocab_size` merges yields fewer tokens; `vocab_size` is an
    upper bound. Saved to `out` when given.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"vocab size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} tokens (256 bytes + {EOD_TOKEN}); use e.g. --vocab 4096."
        )
    from fivefold.specs.model import MODEL_LIMITS  # here: a `data prepare` worker starts lean

    if vocab_size > MODEL_LIMITS["vocab"]:  # `tokenizers` aborts the process on sizes near 1e9
        raise DataError(
            f"--vocab {vocab_size:,} is too large: at most {MODEL_LIMITS['vocab']:,} tokens "
            "(the largest vocabulary a model may have); published models use 32K-256K, "
            "e.g. --vocab 32000."
        )
    inputs = check_inputs(inputs)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(iter_documents(inputs, text_field), trainer=trainer)
    tokenizer = TextTokenizer(backend)
    if out is not None:
        tokenizer.save(out)
    return tokenizer


def load_tokenizer(path: Path, max_vocab: int | None = None) -> TextTokenizer:
    """Load a tokenizer JSON saved by `train_tokenizer`/`fivefold data tokenizer`.

    With `max_vocab` (the model's vocabulary), a tokenizer with more tokens is a DataError.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"tokenizer file {str(path)!r} does not exist; train one with "
            f"`fivefold data tokenizer INPUTS... --out {path}`."
        )
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(
            f"tokenizer file {str(path)!r} is not a valid tokenizer ({err}); train it again "
            "with `fivefold data tokenizer`."
        ) from None
    tokenizer = TextTokenizer(backend, path)
    if max_vocab is not None:
        tokenizer.check_fits(max_vocab)
    return tokenizer


def default_tokenizer_path(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Cache path of the default tokenizer: keyed by corpus digest, recipe and vocab size."""
    key = files_digest(embedded_corpus_files())[:16]
    name = f"embedded-{key}-bpe{vocab_size}-r{_RECIPE_VERSION}.json"
    return cache_dir() / "tokenizers" / name


def default_tokenizer(
    max_vocab: int | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> TextTokenizer:
    """The byte-level BPE trained on the embedded corpus, loaded from the cache or trained now."""
    path = default_tokenizer_path(vocab_size)
    with cache_lock(path.stem):
        tokenizer = _load_cached(path)
        if tokenizer is None:
            tokenizer = train_tokenizer(embedded_corpus_files(), vocab_size, out=path)
    if max_vocab is not None:
        tokenizer.check_fits(max_vocab)
    return tokenizer


def _load_cached(path: Path) -> TextTokenizer | None:
    """The cached tokenizer, or None if absent or unreadable (it is then rebuilt)."""
    if not path.is_file():
        return None
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return load_tokenizer(path)
    except (DataError, ValueError, OSError):
        return None
