"""Data pipeline: tokenizer, shards, packing, sampler and DP-layout-independent batching."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.cli.main import main as cli_main
from fivefold.errors import ConfigError, DataError
from fivefold.train.data import (
    EOD_TOKEN,
    GlobalSampler,
    PackedSequences,
    TokenShards,
    batch_iterator,
    default_shards,
    default_tokenizer,
    embedded_corpus_files,
    load_tokenizer,
    prepare_shards,
    read_documents,
    train_tokenizer,
)
from fivefold.train.data.sampler import splitmix64

CORPUS = embedded_corpus_files()
PERSUASION = next(p for p in CORPUS if "persuasion" in p.name)


class CharTokenizer:
    """Hand-checkable stand-in: 'a' -> 1, 'b' -> 2, ... and the end-of-document id 0."""

    vocab_size = 27
    eod_id = 0
    hash = "char-tokenizer"
    path = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[ord(c) - ord("a") + 1 for c in text] for text in texts]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Keep every test away from the user's ~/.cache/fivefold."""
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A 512-token BPE trained on one novel (a fraction of a second)."""
    out = tmp_path_factory.mktemp("tok") / "tok512.json"
    return train_tokenizer([PERSUASION], vocab_size=512, out=out)


@pytest.fixture(scope="module")
def char_shards(tmp_path_factory):
    """Documents of 2, 4 and 1 letters: with end-of-document tokens, lengths 3, 5, 2."""
    root = tmp_path_factory.mktemp("char")
    inputs = write_jsonl(root / "docs.jsonl", ["ab", "cdef", "g"])
    return TokenShards(prepare_shards([inputs], root / "shards", CharTokenizer()))


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trip_is_lossless(small_tokenizer):
    text = 'Anne Elliot, said she.  "£5 — naïve café 東京 🙂"\n\n\tend'
    ids = small_tokenizer.encode(text)
    assert all(0 <= i < 512 for i in ids)
    assert small_tokenizer.decode(ids) == text
    assert small_tokenizer.vocab_size == 512
    assert small_tokenizer.eod_id == 0  # the only special token comes first
    assert small_tokenizer.decode([small_tokenizer.eod_id]) == EOD_TOKEN
    # A merged vocabulary compresses English: far fewer tokens than bytes.
    chapter = list(read_documents(CORPUS[0]))[1]  # Emma, chapter I: not seen in training
    assert len(small_tokenizer.encode(chapter)) < 0.5 * len(chapter.encode())


def test_tokenizer_training_is_deterministic_across_processes(small_tokenizer, tmp_path):
    again = train_tokenizer([PERSUASION], vocab_size=512)
    assert again.hash == small_tokenizer.hash
    code = (
        "import sys; from fivefold.train.data import train_tokenizer; "
        "print(train_tokenizer([sys.argv[1]], 512).hash)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(PERSUASION)],
        capture_output=True,
        text=True,
        check=True,
        env={"RAYON_NUM_THREADS": "1", "PATH": ""},
    )
    assert other.stdout.strip() == small_tokenizer.hash
    assert train_tokenizer([PERSUASION], vocab_size=500).hash != small_tokenizer.hash


def test_saved_tokenizer_loads_identically_and_checks_model_vocab(small_tokenizer):
    loaded = load_tokenizer(small_tokenizer.path, max_vocab=512)
    assert loaded.hash == small_tokenizer.hash
    assert loaded.encode("Captain Wentworth") == small_tokenizer.encode("Captain Wentworth")
    with pytest.raises(DataError, match=r"has 512 tokens but model.vocab = 256"):
        load_tokenizer(small_tokenizer.path, max_vocab=256)


def test_default_tokenizer_and_shards_are_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))  # a fresh cache: trains from scratch
    tok = default_tokenizer(max_vocab=4096)
    assert (tok.vocab_size, tok.eod_id) == (4096, 0)
    assert tok.path.parent == tmp_path / "tokenizers"
    stamp = tok.path.stat().st_mtime_ns
    assert default_tokenizer().hash == tok.hash
    assert tok.path.stat().st_mtime_ns == stamp  # loaded, not retrained
    with pytest.raises(DataError, match=r"4096 tokens but model.vocab = 4000"):
        default_tokenizer(max_vocab=4000)

    shards = TokenShards(default_shards(tok), tokenizer=tok, max_vocab=4096)
    assert shards.num_documents == 275  # 6 novels: front matter + 269 chapters (corpus/README)
    assert 900_000 < shards.num_tokens < 1_100_000
    first = next(read_documents(CORPUS[0]))
    assert first.startswith("EMMA")
    assert shards.document(0).tolist() == [*tok.encode(first), tok.eod_id]
    assert default_shards(tok) == shards.path  # second call reuses the cache

    train, val = PackedSequences(shards, 256), PackedSequences(shards, 256, split="val")
    assert len(train) + len(val) == (shards.num_tokens - 1) // 256
    assert len(val) == round((shards.num_tokens - 1) // 256 * 0.02)


# --- documents and shards ----------------------------------------------------------------------


def test_shard_round_trip_keeps_every_document(small_tokenizer, tmp_path):
    docs_a = ["First document.\nTwo lines.", "Second one, with “quotes”."]
    docs_b = ["Third, from text.\n", "Fourth after a separator."]
    jsonl = tmp_path / "a.jsonl.gz"
    with gzip.open(jsonl, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs_a))
    text = tmp_path / "b.txt"
    text.write_text(f"{docs_b[0]}{EOD_TOKEN}\n{docs_b[1]}")
    out = prepare_shards([jsonl, text], tmp_path / "shards", small_tokenizer, shard_tokens=16)

    shards = TokenShards(out, tokenizer=small_tokenizer, max_vocab=512)
    expected = [[*small_tokenizer.encode(d), small_tokenizer.eod_id] for d in docs_a + docs_b]
    assert shards.num_documents == 4
    assert shards.num_tokens == sum(map(len, expected))
    assert len(shards.manifest["shards"]) > 1  # documents were spread over several files
    assert shards.manifest["token_dtype"] == "uint16"
    for i, ids in enumerate(expected):
        assert shards.document(i).tolist() == ids
    assert shards.tokens(0, shards.num_tokens).tolist() == [t for ids in expected for t in ids]
    assert shards.doc_starts.tolist() == np.cumsum([0] + [len(e) for e in expected]).tolist()
    assert small_tokenizer.decode(shards.document(1)[:-1]) == docs_a[1]


def test_shards_with_char_tokenizer_match_hand_derived_stream(char_shards):
    assert char_shards.tokens(0, 10).tolist() == [1, 2, 0, 3, 4, 5, 6, 0, 7, 0]
    assert char_shards.doc_starts.tolist() == [0, 3, 8, 10]
    assert char_shards.document_of(np.arange(10)).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]


# --- packing -----------------------------------------------------------------------------------


def test_packing_restarts_positions_and_doc_ids_at_document_boundaries(char_shards):
    seqs = PackedSequences(char_shards, seq_len=4, val_fraction=0.0)
    assert len(seqs) == 2  # (10 - 1) // 4
    first, second = seqs[0], seqs[1]
    # window [0, 5): docs (1 2 0)(3 4 ...
    assert first.tokens.tolist() == [1, 2, 0, 3, 4]
    assert first.doc_ids.tolist() == [0, 0, 0, 1, 1]
    assert first.positions.tolist() == [0, 1, 2, 0, 1]
    # window [4, 9): the second document began before the window, the third starts at 8
    assert second.tokens.tolist() == [4, 5, 6, 0, 7]
    assert second.doc_ids.tolist() == [0, 0, 0, 0, 1]
    assert second.positions.tolist() == [0, 1, 2, 3, 0]

    sampler = GlobalSampler(len(seqs), shuffle=False)
    (batch,) = next(batch_iterator(seqs, sampler, global_batch=2, micro_batch=2))
    assert batch.tokens.tolist() == [[1, 2, 0, 3], [4, 5, 6, 0]]
    assert batch.labels.tolist() == [[2, 0, 3, 4], [5, 6, 0, 7]]
    assert batch.positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert batch.doc_ids.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]
    assert batch.tokens.dtype == torch.int64


def test_packing_on_real_text_changes_doc_ids_exactly_after_each_eod(small_tokenizer, tmp_path):
    docs = [" ".join(["word"] * n) for n in (3, 40, 7, 1, 25, 60, 2)]
    out = prepare_shards(
        [write_jsonl(tmp_path / "d.jsonl", docs)], tmp_path / "s", small_tokenizer, shard_tokens=30
    )
    seqs = PackedSequences(TokenShards(out), seq_len=16, val_fraction=0.0)
    eod = small_tokenizer.eod_id
    for i in range(len(seqs)):
        tokens, doc_ids, positions = seqs[i]
        after_eod = np.concatenate([[False], tokens[:-1] == eod])
        assert np.array_equal(np.diff(doc_ids) == 1, after_eod[1:])
        assert np.all(np.diff(doc_ids) >= 0)
        assert np.array_equal(positions == 0, np.concatenate([[True], after_eod[1:]]))
        step_ok = (np.diff(positions) == 1) | (positions[1:] == 0)
        assert step_ok.all()


def test_validation_split_is_the_last_two_percent(char_shards, small_tokenizer, tmp_path):
    out = prepare_shards([PERSUASION], tmp_path / "p", small_tokenizer)
    data = TokenShards(out)
    train = PackedSequences(data, seq_len=64)
    val = PackedSequences(data, seq_len=64, split="val")
    total = (data.num_tokens - 1) // 64
    assert len(train) + len(val) == total
    assert len(val) == round(total * 0.02)
    assert val[0].tokens.tolist() == data.tokens(len(train) * 64, len(train) * 64 + 65).tolist()
    with pytest.raises(DataError, match="too few for 2 samples of 8 tokens"):
        PackedSequences(char_shards, seq_len=8)


# --- sampler and batching ----------------------------------------------------------------------


def test_splitmix64_matches_the_published_reference_outputs():
    # Vigna's splitmix64.c: state 0 gives 0xE220A8397B1DCDAF first; state 1234567 gives the
    # sequence below (each call adds the golden gamma to the state before mixing).
    assert int(splitmix64(np.uint64(0))) == 0xE220A8397B1DCDAF
    states = np.uint64(1234567) + np.arange(3, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    assert splitmix64(states).tolist() == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
    ]


def test_sampler_is_deterministic_and_each_epoch_is_a_permutation():
    a, b = GlobalSampler(50, seed=3), GlobalSampler(50, seed=3)
    order = a.take(120)
    assert order.tolist() == b.order(0, 120).tolist()
    for epoch in range(2):
        assert sorted(order[epoch * 50 : (epoch + 1) * 50].tolist()) == list(range(50))
    assert order[:50].tolist() != order[50:100].tolist()  # reshuffled per epoch
    assert order[:50].tolist() != GlobalSampler(50, seed=4).order(0, 50).tolist()
    assert GlobalSampler(5, shuffle=False).order(3, 4).tolist() == [3, 4, 0, 1]
    assert (a.consumed, a.epoch) == (120, 2)


def test_dp_ranks_partition_each_global_batch(char_shards, small_tokenizer, tmp_path):
    out = prepare_shards([PERSUASION], tmp_path / "p", small_tokenizer)
    seqs = PackedSequences(TokenShards(out), seq_len=32)
    global_batch, steps = 16, 3
    reference = GlobalSampler(len(seqs), seed=7).order(0, global_batch * steps).reshape(steps, -1)
    for dp_size, micro in ((1, 4), (2, 2), (4, 1), (4, 4)):
        per_rank = []
        for rank in range(dp_size):
            steps_of_rank = list(
                batch_iterator(
                    seqs,
                    GlobalSampler(len(seqs), seed=7),
                    global_batch,
                    micro,
                    rank,
                    dp_size,
                    steps=steps,
                )
            )
            assert [len(mbs) for mbs in steps_of_rank] == [global_batch // (micro * dp_size)] * 3
            assert all(b.tokens.shape == (micro, 32) for mbs in steps_of_rank for b in mbs)
            per_rank.append(
                [torch.cat([b.sample_ids for b in mbs]).tolist() for mbs in steps_of_rank]
            )
        for step in range(steps):
            joined = [i for r in range(dp_size) for i in per_rank[r][step]]
            assert joined == reference[step].tolist()  # ranks in order = the global slice
            assert len(set(joined)) == global_batch  # no overlap


def _run(seqs, sampler, steps, dp_size, global_batch=8, micro=1):
    """Per step: the global batch's token rows in rank order, from `dp_size` rank iterators."""
    states = [GlobalSampler(len(seqs), seed=sampler.seed) for _ in range(dp_size)]
    for s in states:
        s.load_state_dict(sampler.state_dict())
    iters = [
        batch_iterator(seqs, states[r], global_batch, micro, r, dp_size, steps=steps)
        for r in range(dp_size)
    ]
    out = [
        torch.cat([b.tokens for rank_step in step for b in rank_step])
        for step in zip(*iters, strict=True)
    ]
    sampler.load_state_dict(states[0].state_dict())
    return out


def test_resume_and_dp_change_continue_the_exact_global_sequence(small_tokenizer, tmp_path):
    out = prepare_shards([PERSUASION], tmp_path / "p", small_tokenizer)
    seqs = PackedSequences(TokenShards(out), seq_len=32)
    reference = _run(seqs, GlobalSampler(len(seqs), seed=1), steps=6, dp_size=1)

    sampler = GlobalSampler(len(seqs), seed=1)
    first = _run(seqs, sampler, steps=3, dp_size=4)  # dp 4 for three steps ...
    state = json.loads(json.dumps(sampler.state_dict()))  # survives a checkpoint round trip
    assert state["consumed"] == 3 * 8
    resumed = GlobalSampler(len(seqs), seed=1)
    resumed.load_state_dict(state)
    rest = _run(seqs, resumed, steps=3, dp_size=2)  # ... then dp 2 with the same global batch
    for got, want in zip(first + rest, reference, strict=True):
        assert torch.equal(got, want)

    with pytest.raises(DataError, match="resume with the same data"):
        GlobalSampler(len(seqs) + 1, seed=1).load_state_dict(state)


def test_batch_geometry_errors_are_config_errors(char_shards):
    seqs = PackedSequences(char_shards, seq_len=4, val_fraction=0.0)
    with pytest.raises(
        ConfigError,
        match=r"the global batch = 6 sequences is not a whole number of micro-batches of "
        r"micro_batch x dp = 2 x 2 = 4; choose a multiple such as 4 or 8",
    ):
        next(batch_iterator(seqs, GlobalSampler(len(seqs)), 6, 2, 0, 2))
    with pytest.raises(ConfigError, match="sampler covers 3 samples"):
        next(batch_iterator(seqs, GlobalSampler(3), 2, 1))


# --- user mistakes -----------------------------------------------------------------------------


def test_bad_inputs_are_data_errors_naming_the_file(small_tokenizer, tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=r"'.*nope.txt' does not exist"):
        prepare_shards([missing], tmp_path / "o1", small_tokenizer)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match=r"'.*empty.txt' is empty"):
        prepare_shards([empty], tmp_path / "o2", small_tokenizer)
    no_text = tmp_path / "bad.jsonl"
    no_text.write_text('{"text": "fine"}\n{"body": "oops"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl' line 2 has no string \"text\" field"):
        prepare_shards([no_text], tmp_path / "o3", small_tokenizer)
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text("{oops\n")
    with pytest.raises(DataError, match=r"broken.jsonl' line 1 is not valid JSON"):
        train_tokenizer([not_json], 300)
    with pytest.raises(DataError, match=r"vocab size 100 is too small.*at least 257"):
        train_tokenizer([PERSUASION], vocab_size=100)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt' is not UTF-8 text"):
        prepare_shards([latin1], tmp_path / "o5", small_tokenizer)
    table = tmp_path / "x.csv"
    table.write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"x.csv' has an unsupported type.*\.jsonl"):
        prepare_shards([table], tmp_path / "o4", small_tokenizer)
    assert not any(p.name.startswith((".o", "o")) for p in tmp_path.iterdir())  # nothing left


def test_damaged_or_mismatched_shards_are_data_errors(small_tokenizer, tmp_path):
    docs = write_jsonl(tmp_path / "d.jsonl", ["one two three", "four five"])
    out = prepare_shards([docs], tmp_path / "s", small_tokenizer)
    with pytest.raises(DataError, match="already holds shards; pass --force"):
        prepare_shards([docs], out, small_tokenizer)
    other = train_tokenizer([PERSUASION], vocab_size=300)
    with pytest.raises(DataError, match=r"were made with .* but the tokenizer in use"):
        TokenShards(out, tokenizer=other)
    with pytest.raises(DataError, match=r"512-token vocabulary but model\.vocab = 300"):
        TokenShards(out, max_vocab=300)

    tokens_file = out / "shard-00000.tokens.bin"
    raw = bytearray(tokens_file.read_bytes())
    raw[0] ^= 1
    tokens_file.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"shard-00000.tokens.bin' does not match its checksum"):
        TokenShards(out)
    tokens_file.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=r"tokens.bin' has \d+ bytes but the manifest implies"):
        TokenShards(out)
    (out / "manifest.json").write_text("{")
    with pytest.raises(DataError, match=r"manifest.json' is not valid JSON.*--force"):
        TokenShards(out)
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match="is not a shard directory"):
        TokenShards(out)
    with pytest.raises(DataError, match=r"'.*absent' does not exist; create it with"):
        TokenShards(tmp_path / "absent")


def test_cli_prepare_tokenizer_and_errors(small_tokenizer, tmp_path, capsys):
    docs = write_jsonl(tmp_path / "d.jsonl", ["alpha beta", "gamma"])
    tok_path = tmp_path / "t.json"
    assert (
        cli_main(["data", "tokenizer", str(PERSUASION), "--out", str(tok_path), "--vocab", "300"])
        == 0
    )
    assert load_tokenizer(tok_path).vocab_size == 300
    out = tmp_path / "shards"
    assert (
        cli_main(["data", "prepare", str(docs), "--out", str(out), "--tokenizer", str(tok_path)])
        == 0
    )
    assert "prepared 2 documents" in capsys.readouterr().out
    assert TokenShards(out, tokenizer=load_tokenizer(tok_path)).num_documents == 2
    assert cli_main(["data", "info", str(out)]) == 0
    assert "documents  2" in capsys.readouterr().out

    assert cli_main(["data", "prepare", str(tmp_path / "gone.jsonl"), "--out", str(out)]) == 2
    assert "gone.jsonl' does not exist" in capsys.readouterr().err
    assert cli_main(["data", "tokenizer", str(docs), "--out", str(tok_path), "--vocab", "10"]) == 2
    assert "too small" in capsys.readouterr().err
    # A huge vocabulary used to abort the process inside `tokenizers` (SIGABRT).
    huge = ["data", "tokenizer", str(docs), "--out", str(tok_path), "--vocab", "1000000000"]
    assert cli_main(huge) == 2
    assert "--vocab 1,000,000,000 is too large: at most 16,777,216" in capsys.readouterr().err
    missing = tmp_path / "no-such-dir" / "tok.json"  # used to be created silently
    assert cli_main(["data", "tokenizer", str(docs), "--out", str(missing)]) == 2
    assert "no-such-dir' does not exist" in capsys.readouterr().err
    assert not missing.parent.exists()
    # Two short documents hold far fewer merges than asked for: said, with the model.vocab
    # that matches (it used to print the smaller count without a word).
    assert cli_main(["data", "tokenizer", str(docs), "--out", str(tok_path)]) == 0
    got = load_tokenizer(tok_path).vocab_size
    out = capsys.readouterr().out
    assert got < 4096 and f"note: {got} of the 4096 tokens asked for (--vocab)" in out
    assert f"model.vocab = {got}" in out
