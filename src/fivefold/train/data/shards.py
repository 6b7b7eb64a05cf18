"""Token shards: documents tokenised once into flat memory-mapped arrays, boundaries kept.

Details: docs/internals.md (`fivefold.train.data.shards`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from fivefold.errors import DataError
from fivefold.train.data.tokenizer import TextTokenizer

FORMAT_NAME = "fivefold-token-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
OFFSET_DTYPE = np.dtype("<i8")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32 (little-endian)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def document_length_stats(lengths: np.ndarray) -> dict[str, float]:
    """Mean, mean square, max and token-weighted mean (E[L^2]/E[L]) of document `lengths`."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.size == 0:
        return {"mean": 0.0, "mean_square": 0.0, "max": 0, "token_weighted_mean": 0}
    mean, mean_square = float(lengths.mean()), float(np.mean(lengths * lengths))
    return {
        "mean": round(mean, 3),
        "mean_square": round(mean_square, 3),
        "max": int(lengths.max()),
        "token_weighted_mean": round(mean_square / mean),
    }


def _fix_hint(directory: Path) -> str:
    return f"re-create it with `fivefold data prepare INPUTS... --out {directory} --force`"


class TokenShards:
    """Read-only view of a shard directory as one token stream with document boundaries.

    Validates on open: the manifest parses and has this format, every file exists with the size
    the manifest implies, offsets run from 0 to the shard's token count without empty documents,
    and (with `verify=True`) the token files match their checksums. With `tokenizer`, the shards
    must have been made by that exact tokenizer; with `max_vocab`, their vocabulary must fit.
    """

    def __init__(
        self,
        path: Path,
        tokenizer: TextTokenizer | None = None,
        max_vocab: int | None = None,
        verify: bool = True,
    ):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eod_id: int = self.manifest["eod_id"]
        self.tokenizer_hash: str = self.manifest["tokenizer_hash"]
        self.num_tokens: int = self.manifest["num_tokens"]
        self.num_documents: int = self.manifest["num_documents"]
        dtype = np.dtype(self.manifest["token_dtype"]).newbyteorder("<")
        self._tokens = [self._open_tokens(s, dtype, verify) for s in self.manifest["shards"]]
        local_offsets = [self._open_offsets(s, verify) for s in self.manifest["shards"]]
        sizes = [len(t) for t in self._tokens]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [S+1]
        # Global document start offsets into the whole stream, [num_documents + 1].
        self.doc_starts = np.concatenate(
            [off[:-1] + base for off, base in zip(local_offsets, self.shard_starts, strict=False)]
            + [np.asarray([self.shard_starts[-1]], dtype=np.int64)]
        ).astype(np.int64)
        self._check_totals()
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)
        if max_vocab is not None:
            self.check_fits(max_vocab)

    def document_lengths(self) -> dict[str, float]:
        """`document_length_stats` of these shards (recorded by prepare; computed for shards
        prepared before it recorded them)."""
        return self.manifest.get("document_lengths") or document_length_stats(
            np.diff(self.doc_starts)
        )

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of the stream as int64, read from the memory maps."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        first = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pieces, position = [], start
        for shard in range(max(first, 0), len(self._tokens)):
            if position >= stop:
                break
            base = int(self.shard_starts[shard])
            end = min(stop, int(self.shard_starts[shard + 1]))
            pieces.append(self._tokens[shard][position - base : end - base])
            position = end
        if not pieces:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(pieces).astype(np.int64)

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index`, ending with the end-of-document token."""
        return self.tokens(int(self.doc_starts[index]), int(self.doc_starts[index + 1]))

    def document_of(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document holding each stream position (int64, same shape)."""
        return np.searchsorted(self.doc_starts, positions, side="right").astype(np.int64) - 1

    def check_tokenizer(self, tokenizer: TextTokenizer) -> None:
        if tokenizer.hash != self.tokenizer_hash:
            made_with = self.manifest.get("tokenizer_path") or "another tokenizer"
            raise DataError(
                f"shards in {str(self.path)!r} were made with {made_with} (hash "
                f"{self.tokenizer_hash[:12]}) but the tokenizer in use has hash "
                f"{tokenizer.hash[:12]}; use the same tokenizer, or {_fix_hint(self.path)} "
                "--tokenizer PATH`."
            )

    def check_fits(self, model_vocab: int, field: str = "model.vocab") -> None:
        if self.vocab_size > model_vocab:
            raise DataError(
                f"shards in {str(self.path)!r} use a {self.vocab_size}-token vocabulary but "
                f"{field} = {model_vocab}; set {field} >= {self.vocab_size} or prepare the data "
                f"with a tokenizer of at most {model_vocab} tokens."
            )

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.path)!r}, tokens={self.num_tokens}, "
            f"documents={self.num_documents}, vocab={self.vocab_size})"
        )

    def _file(self, name: str) -> Path:
        path = self.path / name
        if not path.is_file():
            raise DataError(f"shard file {str(path)!r} is missing; {_fix_hint(self.path)}.")
        return path

    def _open_tokens(self, shard: dict, dtype: np.dtype, verify: bool) -> np.ndarray:
        path = self._file(shard["tokens"])
        _check_size(path, shard["num_tokens"] * dtype.itemsize, self.path)
        if verify and _blake2b(path) != shard["tokens_blake2b"]:
            raise DataError(
                f"shard file {str(path)!r} does not match its checksum in the manifest (it was "
                f"modified or damaged); {_fix_hint(self.path)}."
            )
        if shard["num_tokens"] == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=(shard["num_tokens"],))

    def _open_offsets(self, shard: dict, verify: bool) -> np.ndarray:
        path = self._file(shard["offsets"])
        count = shard["num_documents"] + 1
        _check_size(path, count * OFFSET_DTYPE.itemsize, self.path)
        expected = shard.get("offsets_blake2b")  # recorded since parallel preparation
        if verify and expected and _blake2b(path) != expected:
            raise DataError(
                f"shard file {str(path)!r} does not match its checksum in the manifest (it was "
                f"modified or damaged); {_fix_hint(self.path)}."
            )
        offsets = np.fromfile(path, dtype=OFFSET_DTYPE).astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != shard["num_tokens"] or np.any(np.diff(offsets) < 1):
            raise DataError(
                f"shard file {str(path)!r} holds invalid document offsets (they must rise from 0 "
                f"to {shard['num_tokens']}); {_fix_hint(self.path)}."
            )
        return offsets

    def _check_totals(self) -> None:
        if self.shard_starts[-1] != self.num_tokens or len(self.doc_starts) != (
            self.num_documents + 1
        ):
            raise DataError(
                f"manifest {str(self.path / MANIFEST_NAME)!r} disagrees with its shards "
                f"(token or document counts); {_fix_hint(self.path)}."
            )
        if self.num_tokens == 0:
            raise DataError(
                f"shard directory {str(self.path)!r} holds no tokens; "
                f"{_fix_hint(self.path)} with non-empty inputs."
            )


_MANIFEST_KEYS = (
    "token_dtype",
    "vocab_size",
    "eod_id",
    "tokenizer_hash",
    "num_tokens",
    "num_documents",
    "shards",
)


def read_manifest(directory: Path) -> dict:
    """The manifest of a shard directory, checked (DataError naming the fix otherwise)."""
    if not directory.is_dir():
        raise DataError(
            f"shard directory {str(directory)!r} does not exist; create it with "
            f"`fivefold data prepare INPUTS... --out {directory}`."
        )
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise DataError(
            f"{str(path)!r} is missing, so {str(directory)!r} is not a shard directory; "
            f"create it with `fivefold data prepare INPUTS... --out {directory}`."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(
            f"manifest {str(path)!r} is not valid JSON ({err}); {_fix_hint(directory)}."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise DataError(f"{str(path)!r} is not a fivefold shard manifest; {_fix_hint(directory)}.")
    if manifest.get("version") != FORMAT_VERSION:
        raise DataError(
            f"manifest {str(path)!r} has format version {manifest.get('version')}, this fivefold "
            f"reads version {FORMAT_VERSION}; {_fix_hint(directory)}."
        )
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        raise DataError(
            f"manifest {str(path)!r} lacks {', '.join(missing)}; {_fix_hint(directory)}."
        )
    return manifest


def _check_size(path: Path, expected_bytes: int, directory: Path) -> None:
    actual = path.stat().st_size
    if actual != expected_bytes:
        raise DataError(
            f"shard file {str(path)!r} has {actual} bytes but the manifest implies "
            f"{expected_bytes} (truncated or corrupt); {_fix_hint(directory)}."
        )


def _blake2b(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
