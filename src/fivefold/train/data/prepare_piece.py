"""One piece of a `data prepare`, tokenised in a worker process (or in the parent for one).

A worker starts lean: neither numpy (token ids are packed with `array`) nor the planner's specs
are imported, so a spawned worker costs a Python start-up and `tokenizers`, about 0.1
CPU-second, not 0.5.
Each piece's shard files are written under temporary names, renamed when whole, and committed by
a small JSON record (`piece-N.json`): the record is the only proof that a piece is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from fivefold.train.data.documents import jsonl_range, raw_documents

ENCODE_BATCH_CHARS = 1 << 22  # characters encoded at once by a worker
OFFSET_CODE = "q"  # the shards' offsets: little-endian int64 (shards.OFFSET_DTYPE)
_ARRAY_CODES = {2: "H", 4: "I"}  # the shards' token dtypes (bytes per id) as `array` codes
_SWAP = sys.byteorder != "little"  # shards are little-endian on every machine


@dataclass(frozen=True)
class Piece:
    """Piece `index` of the work: `path`, or its lines beginning in bytes `[start, stop)`."""

    index: int
    path: str
    start: int = 0
    stop: int = -1

    @property
    def size(self) -> int:
        return (self.stop if self.stop >= 0 else Path(self.path).stat().st_size) - self.start


def _little_endian(values: array) -> array:
    if _SWAP:
        values.byteswap()
    return values


class _ShardWriter:
    """Appends tokenised documents to one piece's shard files (a new file past `shard_tokens`),
    each written under a temporary name and renamed when complete. `dtype`: the tokens' numpy
    dtype string ('<u2' or '<u4')."""

    def __init__(self, directory: Path, stem: str, dtype: str, shard_tokens: int):
        self.directory, self.stem, self.shard_tokens = directory, stem, shard_tokens
        self.code = _ARRAY_CODES[int(dtype[-1])]
        assert array(self.code).itemsize == int(dtype[-1]) and array(OFFSET_CODE).itemsize == 8
        self.shards: list[dict] = []
        self.lengths = [0, 0.0, 0]  # documents' count, sum of squares, max (tokens)
        self._file = None
        self._offsets: list[int] = [0]

    def add(self, ids: list[int], eod_id: int) -> int:
        """Write one document (`ids`, then `eod_id`); returns its length in tokens."""
        length = len(ids) + 1
        if self._file is not None and self._offsets[-1] + length > self.shard_tokens:
            self._close_shard()
        if self._file is None:
            part = len(self.shards)
            self._name = self.stem + (f"-{part:03d}" if part else "")
            self._file = (self.directory / f"{self._name}.tokens.bin.tmp").open("wb")
            self._hasher = hashlib.blake2b(digest_size=16)
            self._offsets = [0]
        data = array(self.code, ids)
        data.append(eod_id)
        data = _little_endian(data)
        self._file.write(data)
        self._hasher.update(data)
        self._offsets.append(self._offsets[-1] + length)
        count, squares, longest = self.lengths
        self.lengths = [count + 1, squares + float(length) ** 2, max(longest, length)]
        return length

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_shard()
        return self.shards

    def _close_shard(self) -> None:
        self._file.close()
        offsets = _little_endian(array(OFFSET_CODE, self._offsets)).tobytes()
        names = {"tokens": f"{self._name}.tokens.bin", "offsets": f"{self._name}.offsets.bin"}
        (self.directory / f"{names['offsets']}.tmp").write_bytes(offsets)
        for name in names.values():
            os.replace(self.directory / f"{name}.tmp", self.directory / name)
        self.shards.append(
            names
            | {
                "num_tokens": self._offsets[-1],
                "num_documents": len(self._offsets) - 1,
                "tokens_blake2b": self._hasher.hexdigest(),
                "offsets_blake2b": hashlib.blake2b(offsets, digest_size=16).hexdigest(),
            }
        )
        self._file = None


_WORKER: dict = {}  # per process: the tokenizer and where progress goes


def init_worker(tokenizer_text: str, queue) -> None:
    """A spawned worker's start: one encoding thread, the tokenizer rebuilt from its JSON."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # read by `tokenizers` when it first encodes
    from fivefold.train.data.tokenizer import tokenizer_from_text

    set_worker(tokenizer_from_text(tokenizer_text), queue.put)


def set_worker(tokenizer, report: Callable[[tuple[int, int]], None] | None) -> None:
    """This process's tokenizer (`encode_batch(texts) -> ids`, `eod_id`: a `TextTokenizer`)
    and where progress goes (`report((bytes, tokens))`), for `prepare_piece`."""
    _WORKER.update(tokenizer=tokenizer, report=report or (lambda item: None))


def clear_worker() -> None:
    _WORKER.clear()


def _documents(piece: Piece, text_field: str) -> Iterator[str]:
    if piece.stop < 0:
        return raw_documents(Path(piece.path), text_field)
    docs = jsonl_range(Path(piece.path), piece.start, piece.stop, text_field)
    return (doc for doc in docs if doc.strip())


def prepare_piece(piece: Piece, staging: Path, dtype: str, shard_tokens: int, text_field: str):
    """Tokenise one piece into `staging`; returns (and commits, as `piece-N.json`) its record.
    Progress: tokens as encoded; bytes as characters encoded (at most the piece's size), the
    rest once the piece is committed."""
    writer = _ShardWriter(staging, f"shard-{piece.index:05d}", dtype, shard_tokens)
    batch: list[str] = []
    size, chars, reported = piece.size, 0, 0
    for doc in _documents(piece, text_field):
        batch.append(doc)
        chars += len(doc)
        if chars >= ENCODE_BATCH_CHARS:
            reported += _encode(writer, batch, min(chars, size - reported))
            batch, chars = [], 0
    reported += _encode(writer, batch, min(chars, size - reported))
    record = {"piece": asdict(piece), "shards": writer.close(), "lengths": writer.lengths}
    atomic_json(staging / f"piece-{piece.index:05d}.json", record)  # the piece is done
    _WORKER["report"]((size - reported, 0))
    return record


def _encode(writer: _ShardWriter, texts: list[str], size: int) -> int:
    """Encode and write `texts`; reports their tokens and `size` bytes, returns `size`."""
    tokenizer = _WORKER["tokenizer"]
    ids = tokenizer.encode_batch(texts) if texts else []
    _WORKER["report"]((size, sum(writer.add(doc, tokenizer.eod_id) for doc in ids)))
    return size


def atomic_json(path: Path, value: dict) -> None:
    """Write `value` as JSON to `path` whole or not at all (a temporary file renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
