"""`data prepare` at scale: Parquet/Arrow inputs, parallel pieces, atomic resumable output,
checksums, and uint32 shards for vocabularies past 65,536 tokens."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from tokenizers import Tokenizer, models, pre_tokenizers

from fivefold.cli.data_progress import prepare_progress
from fivefold.cli.main import main as cli_main
from fivefold.errors import DataError
from fivefold.train.data import TokenShards, prepare_shards, train_tokenizer
from fivefold.train.data.prepare import pieces_of
from fivefold.train.data.prepare_piece import Piece
from fivefold.train.data.tokenizer import TextTokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]


def docs(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 40))) for _ in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    return path


def stream(directory: Path) -> np.ndarray:
    shards = TokenShards(directory)
    return shards.tokens(0, shards.num_tokens)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return train_tokenizer([write_jsonl(root / "t.jsonl", docs(200))], 300, root / "tok.json")


@pytest.fixture(scope="module")
def reference(tok, tmp_path_factory):
    """(the documents, their shards prepared from JSONL in one piece)."""
    root = tmp_path_factory.mktemp("ref")
    texts = docs(300, seed=1)
    out = prepare_shards([write_jsonl(root / "d.jsonl", texts)], root / "ref", tok, workers=1)
    return texts, out


def test_parquet_and_arrow_read_in_batches_give_the_jsonl_stream(tok, reference, tmp_path):
    texts, ref = reference
    table = pa.table({"id": list(range(len(texts) + 1)), "body": [*texts[:7], None, *texts[7:]]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=50)  # 7 row groups
    with (
        pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=64)
    with (
        pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=64)
    jsonl = write_jsonl(tmp_path / "b.jsonl", texts, field="body")
    want = stream(ref)
    for name in ("d.parquet", "file.arrow", "stream.arrow", "b.jsonl"):
        path = tmp_path / name if name != "b.jsonl" else jsonl
        out = prepare_shards([path], tmp_path / f"o-{name}", tok, text_field="body", workers=1)
        assert np.array_equal(stream(out), want), name
        assert TokenShards(out).num_documents == len(texts)
    with pytest.raises(
        DataError, match=r"d.parquet' has no column 'text' \(its columns: 'id', 'body'\)"
    ):
        prepare_shards([tmp_path / "d.parquet"], tmp_path / "bad", tok)
    with pytest.raises(DataError, match=r"stream.arrow' has no column 'text' \(its columns: 'id'"):
        prepare_shards([tmp_path / "stream.arrow"], tmp_path / "bad", tok)
    assert not (tmp_path / "bad").exists() and not (tmp_path / ".bad.partial").exists()


def test_parallel_pieces_give_the_same_stream_and_shards_as_one_process(tok, reference, tmp_path):
    texts, ref = reference
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    pieces = pieces_of([path], piece_bytes=4096)
    assert len(pieces) == -(-path.stat().st_size // 4096) >= 4
    one = prepare_shards([path], tmp_path / "one", tok, workers=1, piece_bytes=4096)
    seen = []
    two = prepare_shards(
        [path],
        tmp_path / "two",
        tok,
        workers=2,
        piece_bytes=4096,
        progress=lambda b, t: seen.append((b, t)),
    )
    assert np.array_equal(stream(one), stream(ref)) and np.array_equal(stream(two), stream(ref))
    shards = lambda d: TokenShards(d).manifest["shards"]  # noqa: E731
    assert shards(one) == shards(two) and len(shards(two)) == len(pieces)
    assert sum(b for b, _ in seen) == path.stat().st_size
    assert sum(t for _, t in seen) == TokenShards(two).num_tokens
    assert (
        TokenShards(two).manifest["document_lengths"]
        == TokenShards(ref).manifest["document_lengths"]
    )


def test_shard_files_hold_each_documents_ids_then_the_end_token_little_endian(
    tok, reference, tmp_path
):
    # The bytes of every shard file and its checksums, derived by hand from `encode`: pieces of
    # 4 KiB (2 workers write the same: the test above), cut into files of at most 400 tokens.
    texts, _ = reference
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    out = prepare_shards([path], tmp_path / "o", tok, workers=1, piece_bytes=4096, shard_tokens=400)
    shards = TokenShards(out).manifest["shards"]
    assert len(shards) > len(pieces_of([path], piece_bytes=4096))  # pieces cut into files
    left = [[*tok.encode(t), tok.eod_id] for t in texts]
    for shard in shards:
        doc_ids, left = left[: shard["num_documents"]], left[shard["num_documents"] :]
        tokens = np.asarray([i for d in doc_ids for i in d], dtype="<u2").tobytes()
        offsets = np.cumsum([0, *map(len, doc_ids)], dtype="<i8").tobytes()
        assert (out / shard["tokens"]).read_bytes() == tokens
        assert (out / shard["offsets"]).read_bytes() == offsets
        assert shard["num_tokens"] == len(tokens) // 2 <= 400
        blake = lambda data: hashlib.blake2b(data, digest_size=16).hexdigest()  # noqa: E731
        assert shard["tokens_blake2b"] == blake(tokens)
        assert shard["offsets_blake2b"] == blake(offsets)
    assert left == []


def test_a_worker_starts_without_numpy_or_the_rest_of_the_package(tok, reference, tmp_path):
    # A spawned worker's imports cost CPU in every worker (numpy and fivefold.specs: ~0.4 CPU-s
    # each); the worker's module needs neither, and writes the in-process piece byte for byte.
    texts, ref = reference
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    code = f"""
import json, sys
from pathlib import Path
from fivefold.train.data.prepare_piece import Piece, init_worker, prepare_piece
class Queue:
    put = staticmethod(lambda item: None)
init_worker(Path({str(tok.path)!r}).read_text(), Queue)
prepare_piece(Piece(0, {str(path)!r}), Path({str(tmp_path)!r}), "<u2", 1 << 28, "text")
print(json.dumps(sorted(sys.modules)))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    modules = json.loads(run.stdout)
    assert "tokenizers" in modules and "fivefold.train.data.prepare_piece" in modules
    heavy = [m for m in modules if m.split(".")[0] in ("numpy", "torch", "pyarrow")]
    heavy += [m for m in modules if m.startswith(("fivefold.specs", "fivefold.train.data.s"))]
    assert heavy == []
    tokens = TokenShards(ref).manifest["shards"][0]["tokens"]
    assert (tmp_path / "shard-00000.tokens.bin").read_bytes() == (ref / tokens).read_bytes()
    assert Piece(0, str(path)).size == path.stat().st_size


def test_a_killed_prepare_leaves_nothing_trainable_and_resumes(tok, reference, tmp_path):
    texts, ref = reference
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    out, calls = tmp_path / "out", []

    pieces = pieces_of([path], piece_bytes=4096)

    def kill_after_two_pieces(done_bytes, tokens):  # a piece's bytes are all in once committed
        calls.append(done_bytes)
        if sum(calls) == pieces[0].size + pieces[1].size:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_shards(
            [path], out, tok, workers=1, piece_bytes=4096, progress=kill_after_two_pieces
        )
    assert not out.exists()
    staging = tmp_path / ".out.partial"
    with pytest.raises(DataError, match="is not a shard directory"):
        TokenShards(staging)
    (staging / "shard-00002.tokens.bin.tmp").write_bytes(b"half")  # a piece cut short
    said: list[str] = []
    prepare_shards([path], out, tok, workers=1, piece_bytes=4096, notify=said.append)
    assert said and said[0].startswith("resuming an interrupted preparation")
    assert "2 of " in said[0]
    assert np.array_equal(stream(out), stream(ref)) and not staging.exists()

    staging.mkdir()
    (staging / "plan.json").write_text("{}")  # another preparation's leftovers
    (staging / "shard-00000.tokens.bin").write_bytes(b"x")
    said.clear()
    prepare_shards([path], tmp_path / "out", tok, workers=1, overwrite=True, notify=said.append)
    assert said[0].startswith("restarting:")


def test_info_verifies_every_checksum(tok, reference, tmp_path, capsys):
    _, ref = reference
    assert cli_main(["data", "info", str(ref)]) == 0
    assert "verified (2 file checksums match the manifest)" in capsys.readouterr().out
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ref.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    offsets = copy / "shard-00000.offsets.bin"
    values = np.fromfile(offsets, dtype="<i8")
    values[1] += 1  # still rising: only the checksum sees it
    values.tofile(offsets)
    assert cli_main(["data", "info", str(copy)]) == 2
    assert "offsets.bin' does not match its checksum" in capsys.readouterr().err


def test_vocabularies_past_65536_tokens_write_uint32_shards(tmp_path):
    vocab = {f"w{i}": i for i in range(131_072)} | {"</s>": 131_072, "[UNK]": 131_073}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "big.json"))
    big = TextTokenizer(Tokenizer.from_file(str(tmp_path / "big.json")))
    assert big.eod_id == 131_072 and big.vocab_size == 131_074  # "</s>" ends documents
    path = write_jsonl(tmp_path / "d.jsonl", ["w5 w70000 w131071", "w65536"])
    out = prepare_shards([path], tmp_path / "o", big, workers=1)
    shards = TokenShards(out, tokenizer=big)
    assert shards.manifest["token_dtype"] == "uint32"
    assert stream(out).tolist() == [5, 70000, 131071, 131072, 65536, 131072]


def test_cli_prepare_reads_parquet_with_a_text_field_in_workers(tok, tmp_path, capsys):
    texts = docs(40, seed=3)
    pq.write_table(pa.table({"content": texts}), tmp_path / "d.parquet")
    args = ["data", "prepare", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "o")]
    code = cli_main(
        [*args, "--tokenizer", str(tok.path), "--text-field", "content", "--workers", "2"]
    )
    assert code == 0
    assert f"prepared {len(texts)} documents" in capsys.readouterr().out
    assert cli_main([*args, "--tokenizer", str(tok.path), "--workers", "0"]) == 2
    assert "--workers 0 must be at least 1" in capsys.readouterr().err


def test_cli_tokenizer_reads_a_text_field(tmp_path, capsys):
    # The same documents under "body" and under "text": the same tokenizer, byte for byte.
    texts = docs(60, seed=4)
    body, text = write_jsonl(tmp_path / "b.jsonl", texts, "body"), tmp_path / "t.jsonl"
    write_jsonl(text, texts)
    args = ["data", "tokenizer", "--vocab", "280", "--out"]
    assert cli_main([*args, str(tmp_path / "b.json"), str(body), "--text-field", "body"]) == 0
    assert cli_main([*args, str(tmp_path / "t.json"), str(text)]) == 0
    trained = (tmp_path / "b.json").read_bytes()
    assert trained == (tmp_path / "t.json").read_bytes()
    assert len(json.loads(trained)["model"]["vocab"]) == 280
    capsys.readouterr()
    assert cli_main([*args, str(tmp_path / "x.json"), str(body)]) == 2  # no "text" field
    assert 'no string "text" field' in capsys.readouterr().err


def test_progress_bar_shows_bytes_and_tokens_per_second_on_a_terminal_only():
    terminal = io.StringIO()
    console = Console(file=terminal, force_terminal=True, width=150, color_system=None)
    with prepare_progress(2_000_000, console) as advance:
        advance(500_000, 1_000)
        advance(1_500_000, 3_000)
    shown = terminal.getvalue()
    assert "2.0/2.0 MB" in shown and re.search(r"[\d.]+ [kMGT]?B/s", shown)
    rates = [float(r.replace(",", "")) for r in re.findall(r"([\d,]+) tokens/s", shown)]
    assert rates and rates[-1] > 0
    piped = io.StringIO()
    with prepare_progress(10, Console(file=piped, force_terminal=False)) as advance:
        advance(10, 5)
    assert piped.getvalue() == ""
