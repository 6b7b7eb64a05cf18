"""Preparing token shards: inputs cut into pieces, tokenised by worker processes, published whole.

The inputs are cut into pieces (`Piece`): a file, or a byte range of `PIECE_BYTES` of an
uncompressed JSONL file (a range owns the lines that begin in it). Each piece is tokenised by one
worker process (a `spawn` pool; each worker encodes on one thread) into its own shard files,
written under temporary names, renamed, and then committed by a small JSON record: the record is
the only proof that a piece is done. Pieces go into the staging directory `.DIR.partial` beside
`DIR`, which names the inputs, tokenizer and settings it holds pieces of (`plan.json`); a rerun of
the same preparation after a kill resumes there (done pieces are kept, the rest redone), any
other preparation starts it afresh. When every piece is done the manifest is written and the
staging directory renamed to `DIR`, so a shard directory exists only complete. The token stream
is the pieces' documents in input order: the same for any number of workers. Memory stays flat in
the corpus size: a worker holds one encoding batch; the parent holds one record per piece.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from fivefold.errors import DataError
from fivefold.train.data.cache import cache_dir, cache_lock
from fivefold.train.data.corpus import embedded_corpus_files, file_sha256, files_digest
from fivefold.train.data.documents import (
    TEXT_FIELD,
    check_inputs,
    input_kind,
    jsonl_range,
    raw_documents,
)
from fivefold.train.data.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    OFFSET_DTYPE,
    TokenShards,
    token_dtype,
)
from fivefold.train.data.tokenizer import TextTokenizer, tokenizer_from_text

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard file
PIECE_BYTES = 64 << 20  # a worker's share of a large uncompressed JSONL file
ENCODE_BATCH_CHARS = 1 << 22  # characters encoded at once by a worker
PLAN_NAME = "plan.json"
Progress = Callable[[int, int], None]  # (input bytes, tokens) done since the last call


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


def pieces_of(inputs: list[Path], piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """The pieces of `inputs`, in input order."""
    out: list[Piece] = []
    for path in inputs:
        size = path.stat().st_size
        if input_kind(path) == "jsonl" and not path.name.lower().endswith(".gz"):
            for start in range(0, max(size, 1), piece_bytes):
                out.append(Piece(len(out), str(path), start, min(start + piece_bytes, size)))
        else:
            out.append(Piece(len(out), str(path)))
    return out


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---- one piece, in a worker -----------------------------------------------------------------


class _ShardWriter:
    """Appends tokenised documents to one piece's shard files (a new file past `shard_tokens`),
    each written under a temporary name and renamed when complete."""

    def __init__(self, directory: Path, stem: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.stem, self.dtype, self.shard_tokens = (
            directory,
            stem,
            dtype,
            shard_tokens,
        )
        self.shards: list[dict] = []
        self.lengths = [0, 0.0, 0]  # documents' count, sum of squares, max (tokens)
        self._file = None
        self._offsets: list[int] = [0]

    def add(self, ids: list[int], eod_id: int) -> int:
        length = len(ids) + 1
        if self._file is not None and self._offsets[-1] + length > self.shard_tokens:
            self._close_shard()
        if self._file is None:
            part = len(self.shards)
            self._name = self.stem + (f"-{part:03d}" if part else "")
            self._file = (self.directory / f"{self._name}.tokens.bin.tmp").open("wb")
            self._hasher = hashlib.blake2b(digest_size=16)
            self._offsets = [0]
        data = np.asarray([*ids, eod_id], dtype=self.dtype).tobytes()
        self._file.write(data)
        self._hasher.update(data)
        self._offsets.append(self._offsets[-1] + length)
        self.lengths = [
            self.lengths[0] + 1,
            self.lengths[1] + float(length) ** 2,
            max(self.lengths[2], length),
        ]
        return length

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_shard()
        return self.shards

    def _close_shard(self) -> None:
        self._file.close()
        offsets = np.asarray(self._offsets, dtype=OFFSET_DTYPE).tobytes()
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


_WORKER: dict = {}  # per worker process: the tokenizer and the progress queue


def _init_worker(tokenizer_text: str, queue, one_thread: bool) -> None:
    if one_thread:  # read by `tokenizers` when it first encodes in parallel
        os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER["tokenizer"] = tokenizer_from_text(tokenizer_text)
    _WORKER["queue"] = queue


def _documents(piece: Piece, text_field: str) -> Iterator[str]:
    if piece.stop < 0:
        return raw_documents(Path(piece.path), text_field)
    docs = jsonl_range(Path(piece.path), piece.start, piece.stop, text_field)
    return (doc for doc in docs if doc.strip())


def prepare_piece(piece: Piece, staging: Path, dtype: str, shard_tokens: int, text_field: str):
    """Tokenise one piece into `staging`; returns (and commits, as `piece-N.json`) its record.
    Progress: tokens as encoded; bytes as characters encoded (at most the piece's size), the
    rest once the piece is committed."""
    tokenizer: TextTokenizer = _WORKER["tokenizer"]
    queue = _WORKER.get("queue")
    writer = _ShardWriter(staging, f"shard-{piece.index:05d}", np.dtype(dtype), shard_tokens)
    batch: list[str] = []
    size, chars, reported = piece.size, 0, 0
    for doc in _documents(piece, text_field):
        batch.append(doc)
        chars += len(doc)
        if chars >= ENCODE_BATCH_CHARS:
            reported += _encode(writer, tokenizer, batch, queue, min(chars, size - reported))
            batch, chars = [], 0
    reported += _encode(writer, tokenizer, batch, queue, min(chars, size - reported))
    record = {"piece": asdict(piece), "shards": writer.close(), "lengths": writer.lengths}
    _atomic_json(staging / f"piece-{piece.index:05d}.json", record)  # the piece is done
    _report(queue, size - reported, 0)
    return record


def _encode(
    writer: _ShardWriter, tokenizer: TextTokenizer, texts: list[str], queue, size: int
) -> int:
    """Encode and write `texts`; reports their tokens and `size` bytes, returns `size`."""
    ids = tokenizer.encode_batch(texts) if texts else []
    _report(queue, size, sum(writer.add(doc, tokenizer.eod_id) for doc in ids))
    return size


def _report(queue, size: int, tokens: int) -> None:
    if queue is not None:
        queue.put((size, tokens))
    elif "progress" in _WORKER:
        _WORKER["progress"](size, tokens)


def _atomic_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# ---- the whole preparation, in the parent ---------------------------------------------------


def prepare_shards(
    inputs: list[Path],
    out_dir: Path,
    tokenizer: TextTokenizer,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    workers: int | None = None,
    text_field: str = TEXT_FIELD,
    progress: Progress | None = None,
    notify: Callable[[str], None] | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> Path:
    """Tokenise the documents of `inputs` (.txt, .jsonl, optionally .gz; .parquet, .arrow) into
    `out_dir` with `workers` processes (default: the cores there are; 1: in this process).

    Each document becomes its tokens followed by `tokenizer.eod_id`. `progress(bytes, tokens)`
    hears of the work as it is done; `notify` gets a line when an interrupted preparation is
    resumed or restarted. Returns `out_dir`, which appears complete or not at all.
    """
    inputs = check_inputs(inputs)
    out_dir = Path(out_dir)
    _check_destination(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    pieces = pieces_of(inputs, piece_bytes)
    dtype = token_dtype(tokenizer.vocab_size).str
    plan = {
        "inputs": [_input_identity(p) for p in inputs],
        "tokenizer_hash": tokenizer.hash,
        "token_dtype": dtype,
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "pieces": [asdict(p) for p in pieces],
    }
    with _staging(staging, plan, notify) as done:
        started = time.perf_counter()
        todo = [p for p in pieces if p.index not in done]
        args = (staging, dtype, shard_tokens, text_field)
        done |= _run_pieces(todo, tokenizer, args, workers, progress)
        manifest = _manifest(inputs, [done[p.index] for p in pieces], tokenizer, dtype, plan)
        manifest["prepare_time_s"] = round(time.perf_counter() - started, 3)
        for leftover in [PLAN_NAME, *(f"piece-{p.index:05d}.json" for p in pieces)]:
            (staging / leftover).unlink(missing_ok=True)
        _atomic_json(staging / MANIFEST_NAME, manifest)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    return out_dir


def _input_identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@contextlib.contextmanager
def _staging(staging: Path, plan: dict, notify: Callable[[str], None] | None):
    """The staging directory, locked, with the records of the pieces already done there by an
    interrupted run of the same `plan` ({index: record}); anything else there is removed."""
    say = notify or (lambda line: None)
    staging.mkdir(exist_ok=True)
    with (staging.parent / f"{staging.name}.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(
                f"another `fivefold data prepare` is writing {str(staging)!r}; wait for it to "
                "finish or stop it."
            ) from None
        done = _resumable(staging, plan, say)
        try:
            yield done
        except DataError:  # a bad input: nothing worth resuming (an interrupt keeps the pieces)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            (staging.parent / f"{staging.name}.lock").unlink(missing_ok=True)
            fcntl.flock(lock, fcntl.LOCK_UN)


def _resumable(staging: Path, plan: dict, say: Callable[[str], None]) -> dict[int, dict]:
    previous = staging / PLAN_NAME
    old = None
    if previous.is_file():
        with contextlib.suppress(ValueError, OSError):
            old = json.loads(previous.read_text())
    if old != plan:
        if any(staging.iterdir()):
            say(
                f"restarting: {str(staging)!r} holds pieces of another preparation (other "
                "inputs, tokenizer or settings); they are removed."
            )
        shutil.rmtree(staging)
        staging.mkdir()
        _atomic_json(previous, plan)
        return {}
    done = {}
    for piece in plan["pieces"]:
        record = _committed(staging, piece["index"])
        if record is not None:
            done[piece["index"]] = record
    for path in staging.iterdir():  # half-written files of pieces not committed
        if path.name.endswith(".tmp") or (
            path.name.startswith("shard-") and int(path.name[6:11]) not in done
        ):
            path.unlink()
    say(
        f"resuming an interrupted preparation in {str(staging)!r}: {len(done)} of "
        f"{len(plan['pieces'])} pieces already done (--force does not restart it; delete the "
        "directory to start over)."
    )
    return done


def _committed(staging: Path, index: int) -> dict | None:
    """The record of piece `index` if it was committed and its shard files are whole."""
    path = staging / f"piece-{index:05d}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for shard in record["shards"]:
        tokens, offsets = staging / shard["tokens"], staging / shard["offsets"]
        if not (tokens.is_file() and offsets.is_file()):
            return None
    return record


def _run_pieces(
    pieces: list[Piece],
    tokenizer: TextTokenizer,
    args: tuple,
    workers: int | None,
    progress: Progress | None,
) -> dict[int, dict]:
    """Each piece's record, from a pool of `workers` processes (in this process for one)."""
    workers = min(workers or default_workers(), max(len(pieces), 1))
    if workers <= 1:
        _WORKER.update(tokenizer=tokenizer, queue=None, progress=progress or (lambda b, t: None))
        try:
            return {p.index: prepare_piece(p, *args) for p in pieces}
        finally:
            _WORKER.clear()
    ctx = get_context("spawn")
    queue = ctx.Queue()
    text = tokenizer.backend.to_str()
    out: dict[int, dict] = {}
    with ctx.Pool(workers, initializer=_init_worker, initargs=(text, queue, True)) as pool:
        pending = [pool.apply_async(prepare_piece, (p, *args)) for p in pieces]
        while pending:
            _drain(queue, progress, timeout=0.2)
            for result in [r for r in pending if r.ready()]:
                record = result.get()  # re-raises a worker's DataError here
                out[record["piece"]["index"]] = record
                pending.remove(result)
        _drain(queue, progress, timeout=0)
    return out


def _drain(queue, progress: Progress | None, timeout: float) -> None:
    import queue as queues

    try:
        item = queue.get(timeout=timeout) if timeout else queue.get_nowait()
        while True:
            if progress is not None:
                progress(*item)
            item = queue.get_nowait()
    except queues.Empty:
        return


def _manifest(
    inputs: list[Path], records: list[dict], tokenizer: TextTokenizer, dtype: str, plan: dict
) -> dict:
    shards = [s for r in records for s in r["shards"]]
    count = sum(r["lengths"][0] for r in records)
    tokens = sum(s["num_tokens"] for s in shards)
    per_input: dict[str, int] = {}
    for r in records:
        path = r["piece"]["path"]
        per_input[path] = per_input.get(path, 0) + sum(s["num_documents"] for s in r["shards"])
    for path in inputs:
        if not per_input.get(str(path)):
            raise DataError(
                f"input file {str(path)!r} is empty (it holds no text); remove it from the "
                "inputs or fill it."
            )
    mean = tokens / count if count else 0.0
    square = sum(r["lengths"][1] for r in records) / count if count else 0.0
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "token_dtype": np.dtype(dtype).name,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "tokenizer_hash": tokenizer.hash,
        "tokenizer_path": str(tokenizer.path) if tokenizer.path else None,
        "num_tokens": tokens,
        "num_documents": count,
        "document_lengths": {
            "mean": round(mean, 3),
            "mean_square": round(square, 3),
            "max": int(max((r["lengths"][2] for r in records), default=0)),
            "token_weighted_mean": round(square / mean) if mean else 0,
        },
        "text_field": plan["text_field"],
        "inputs": [
            i | {"sha256": file_sha256(Path(i["path"])), "num_documents": per_input[i["path"]]}
            for i in plan["inputs"]
        ],
        "shards": shards,
    }


def _check_destination(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {str(out_dir)!r} is a file; choose a directory for --out.")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not (out_dir / MANIFEST_NAME).is_file():
        raise DataError(
            f"output directory {str(out_dir)!r} is not empty and holds no shards; choose a new "
            "or empty directory for --out."
        )
    if not overwrite:
        raise DataError(
            f"output directory {str(out_dir)!r} already holds shards; pass --force to replace "
            "them or choose another --out."
        )


def default_shards(tokenizer: TextTokenizer) -> Path:
    """The embedded corpus prepared with `tokenizer`, built into the cache on first use."""
    key = f"{files_digest(embedded_corpus_files())[:12]}-{tokenizer.hash[:12]}"
    out_dir = cache_dir() / "shards" / f"embedded-{key}"
    with cache_lock(out_dir.name):
        if _is_valid(out_dir, tokenizer):
            return out_dir
        prepare_shards(embedded_corpus_files(), out_dir, tokenizer, overwrite=True, workers=1)
    return out_dir


def _is_valid(directory: Path, tokenizer: TextTokenizer) -> bool:
    if not (directory / MANIFEST_NAME).is_file():
        return False
    try:
        TokenShards(directory, tokenizer=tokenizer)
    except DataError:
        return False
    return True
