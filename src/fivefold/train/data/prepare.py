"""Preparing token shards: inputs cut into pieces, tokenised by worker processes, published whole.

The inputs are cut into pieces (`Piece`): a file, or a byte range of `PIECE_BYTES` of an
uncompressed JSONL file (a range owns the lines that begin in it). Each piece is tokenised by one
worker process (a `spawn` pool of lean workers, each encoding on one thread:
`fivefold.train.data.prepare_piece`) into its own shard files, written under temporary names,
renamed, and then committed by a small JSON record: the record is the only proof that a piece is
done. Pieces go into the staging directory `.DIR.partial` beside
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
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from fivefold.errors import DataError
from fivefold.train.data.cache import cache_dir, cache_lock
from fivefold.train.data.documents import TEXT_FIELD, check_inputs, input_kind
from fivefold.train.data.embedded_corpus import embedded_corpus_files, file_sha256, files_digest
from fivefold.train.data.prepare_piece import (
    Piece,
    atomic_json,
    clear_worker,
    init_worker,
    prepare_piece,
    set_worker,
)
from fivefold.train.data.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TokenShards,
    token_dtype,
)
from fivefold.train.data.tokenizer import TextTokenizer

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard file
PIECE_BYTES = 64 << 20  # a worker's share of a large uncompressed JSONL file
PLAN_NAME = "plan.json"
Progress = Callable[[int, int], None]  # (input bytes, tokens) done since the last call


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
        atomic_json(staging / MANIFEST_NAME, manifest)
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
        atomic_json(previous, plan)
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
        set_worker(tokenizer, progress and (lambda item: progress(*item)))
        try:
            return {p.index: prepare_piece(p, *args) for p in pieces}
        finally:
            clear_worker()
    ctx = get_context("spawn")
    # A SimpleQueue writes each report before `put` returns, so a piece's reports are all in
    # the pipe before its result is sent (a Queue's feeder thread could still hold them).
    queue = ctx.SimpleQueue()
    start = (tokenizer.backend.to_str(), queue)
    out: dict[int, dict] = {}
    with ctx.Pool(workers, initializer=init_worker, initargs=start) as pool:
        pending = [pool.apply_async(prepare_piece, (p, *args)) for p in pieces]
        while pending:
            pending[0].wait(0.2)
            _drain(queue, progress)
            for result in [r for r in pending if r.ready()]:
                record = result.get()  # re-raises a worker's DataError here
                out[record["piece"]["index"]] = record
                pending.remove(result)
        _drain(queue, progress)
    return out


def _drain(queue, progress: Progress | None) -> None:
    """Hand every report waiting in `queue` to `progress`."""
    while not queue.empty():
        item = queue.get()
        if progress is not None:
            progress(*item)


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
