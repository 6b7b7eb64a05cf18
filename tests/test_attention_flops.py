"""Attention FLOPs per document: the planner's pairs per packed sequence, a batch's own pairs
behind MFU and HFU, the document lengths `data prepare` records, and MFU never above 100 %."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fivefold.model.document_layout import Chunk, DocumentLayout, document_blocks
from fivefold.planner.step_time.compute import attention_flops
from fivefold.specs.flops import (
    attention_score_flops_per_token,
    causal_pairs_per_sequence,
    training_flops_per_token,
)
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.train.data import TokenShards, prepare_shards
from fivefold.train.data.batching import Batch
from fivefold.train.data.shards import document_length_stats
from fivefold.train.metrics import StepMetrics, attention_keys, document_pairs, utilization
from test_data import CharTokenizer, private_cache, write_jsonl  # noqa: F401

LLAMA_1B = ModelSpec(
    name="llama-1.1b", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=32000
)


# ---- the planner: pairs per packed sequence ------------------------------------------------------
def test_one_document_per_sequence_is_the_dense_causal_count():
    assert causal_pairs_per_sequence(4096) == 4096**2 / 2
    m = LLAMA_1B.with_(seq_len=4096)
    # 4 FLOPs per pair per head_dim element, 2048 keys per query on average
    assert attention_score_flops_per_token(m, 4096) == 4.0 * 32 * 64 * 2048


def test_short_documents_cut_by_windows_hand_derived():
    # s = 8, documents of 4 at offset u ~ U[0, 4): pieces 4-u, 4, u; E[sum L^2] =
    # 16/3 + 16 + 16/3 = 80/3, so 40/3 pairs (the dense count: 32)
    assert causal_pairs_per_sequence(8, 4) == pytest.approx(40 / 3)
    # s = 4, documents of 8: u <= 4 one piece of 4 (16); u > 4 pieces w, 4-w with w ~ U(0, 4):
    # E = 32/3; mean (16 + 32/3)/2 = 40/3, so 20/3 pairs (dense: 8)
    assert causal_pairs_per_sequence(4, 8) == pytest.approx(20 / 3)
    # documents far longer than the sequence: one document per sequence in the limit
    assert causal_pairs_per_sequence(4096, 10**9) == pytest.approx(4096**2 / 2, rel=1e-5)


def test_planner_prices_attention_per_document():
    dense = LLAMA_1B.with_(seq_len=131072)
    docs = dense.with_(doc_len=3600)
    plan = ParallelPlan(micro_batch=1)
    ratio = attention_flops(docs, plan) / attention_flops(dense, plan)
    # (s D - D^2/3) / s^2 with s = 131072, D = 3600
    s, d = 131072, 3600
    assert ratio == pytest.approx((s * d - d * d / 3) / s**2)
    assert ratio < 1 / 35  # the 128K run of 3.6K documents does ~36x less attention
    # the model FLOPs behind the planner's MFU follow
    assert training_flops_per_token(docs) < 0.5 * training_flops_per_token(dense)


# ---- a batch's own documents ---------------------------------------------------------------------
def test_document_pairs_hand_derived():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]])
    # row 0: documents of 3 and 5 -> 9/2 + 25/2 = 17 pairs; row 1: one of 8 -> 32
    assert document_pairs(ids) == (17 + 32, 16)
    batch = Batch(tokens=ids, labels=ids, positions=ids, doc_ids=ids)
    assert attention_keys([batch], 8) == pytest.approx(49 / 16)
    plain = Batch(tokens=ids, labels=ids, positions=ids, doc_ids=None)
    assert attention_keys([plain], 8) == 4.0  # one document per row: s/2


def _packed_128k(rng: np.random.Generator) -> tuple[torch.Tensor, list[int]]:
    """doc_ids [1, 131072] of documents ~3.6K tokens long (lengths 1K-6.2K)."""
    seq, lengths = 131072, []
    while sum(lengths) < seq:
        lengths.append(int(rng.integers(1000, 6200)))
    lengths[-1] -= sum(lengths) - seq
    ids = np.repeat(np.arange(len(lengths)), lengths)[None]
    return torch.from_numpy(ids), lengths


def test_mfu_never_above_one_on_a_packed_128k_batch():
    """The fastest a device of peak P can run a step is the FLOPs its kernels do over P: the
    matmuls plus, per layer, the document-causal pairs the attention kernel evaluates (read
    from the kernel's own spans, L(L+1)/2 each). MFU at that time must not exceed 1."""
    model = LLAMA_1B.with_(seq_len=131072)
    doc_ids, lengths = _packed_128k(np.random.default_rng(0))
    layout = DocumentLayout(doc_ids, 1, model.seq_len)
    whole = [Chunk(0, 0, model.seq_len)]
    spans = [s for b in document_blocks(whole, whole, layout) for s in b.spans]
    assert len(spans) == len(lengths) and all(s.causal for s in spans)
    kernel_pairs = sum((s.q.stop - s.q.start) * (s.q.stop - s.q.start + 1) / 2 for s in spans)
    tokens = model.seq_len
    no_attention = training_flops_per_token(model, keys=0.0) * tokens
    performed = no_attention + 3 * model.layers * 4.0 * model.heads * model.head_dim * kernel_pairs
    peak = 2e11  # FLOP/s: a CPU-sized fake device
    fastest_step_s = performed / peak
    rate = tokens / fastest_step_s

    batch = Batch(tokens=doc_ids, labels=doc_ids, positions=doc_ids, doc_ids=doc_ids)
    keys = attention_keys([batch], model.seq_len)
    mfu = utilization(rate, training_flops_per_token(model, keys=keys), peak, 1)
    hfu = utilization(rate, training_flops_per_token(model, recompute="full", keys=keys), peak, 1)
    assert 0.99 < mfu <= 1.0
    assert hfu > mfu  # HFU counts the recomputed forward (the run's extra work) on the same basis
    # the dense count (s^2/2 per sequence) reads several times the peak on the same batch
    assert utilization(rate, training_flops_per_token(model), peak, 1) > 4.0
    assert StepMetrics(1, 0, 0, 0, tokens, 1, rate, mfu, hfu, 0, 1).to_json()["attention"] == (
        "per document, causal pairs (L^2/2 per document)"
    )


# ---- data prepare records the lengths ------------------------------------------------------------
def test_prepare_records_document_lengths(tmp_path):
    inputs = write_jsonl(tmp_path / "docs.jsonl", ["ab", "cdef", "g"])
    shards = TokenShards(prepare_shards([inputs], tmp_path / "shards", CharTokenizer()))
    # lengths with the end-of-document token: 3, 5, 2 -> mean 10/3, mean square 38/3,
    # token-weighted 38/10 = 3.8 -> 4
    stats = json.loads((tmp_path / "shards" / "manifest.json").read_text())["document_lengths"]
    assert stats == {"mean": 3.333, "mean_square": 12.667, "max": 5, "token_weighted_mean": 4}
    assert shards.document_lengths() == stats
    assert document_length_stats(np.array([3600, 3600]))["token_weighted_mean"] == 3600


# ---- fivefold plan --doc-len ---------------------------------------------------------------------
def _plan_json(capsys, *extra: str) -> dict:
    from fivefold.cli.main import main

    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--seq",
            "128K", "--tp", "8", "--pp", "1", "--mbs", "1", "--global-batch", "8",
            "--recompute", "full", "--json", *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_doc_len_prices_attention_per_document(capsys):
    dense, docs = _plan_json(capsys), _plan_json(capsys, "--doc-len", "3600")
    assert docs["model"]["doc_len"] == 3600 and dense["model"]["doc_len"] == 0
    # the 128K step is mostly attention: per document it is several times shorter, and MFU
    # (model FLOPs per document) stays of the same order
    assert docs["step_time_s"] < 0.5 * dense["step_time_s"]
    assert 0.5 < docs["mfu"] / dense["mfu"] < 2


def test_the_h200_128k_run_reads_below_100_percent_per_document():
    # measured 2026-11-26 on one H200 (989 TFLOP/s bf16): 1.10B Llama, seq 128K of ~3.6K-token
    # documents, 42.8k tokens/s, printed MFU 138.5 % with the dense count
    model = LLAMA_1B.with_(seq_len=131072)
    dense = utilization(42.8e3, training_flops_per_token(model), 989e12, 1)
    per_document = utilization(
        42.8e3, training_flops_per_token(model.with_(doc_len=3600)), 989e12, 1
    )
    assert dense == pytest.approx(1.385, abs=5e-4)
    assert per_document == pytest.approx(0.300, abs=5e-4)


def test_doc_len_does_not_change_what_a_checkpoint_holds():
    from fivefold.checkpoint.state import spec_mismatches

    saved = LLAMA_1B.to_dict()
    saved.pop("doc_len")  # a checkpoint written before the field existed
    assert spec_mismatches(saved, LLAMA_1B.with_(doc_len=3600).to_dict()) == []


def test_measured_attention_rate_read_at_the_document_length():
    from fivefold.planner.step_time.compute import attention_span

    model, plan = LLAMA_1B.with_(seq_len=131072), ParallelPlan(cp=4)
    assert attention_span(model, plan) == 32768  # one document per sequence: the local chunk
    assert attention_span(model.with_(doc_len=3600), plan) == 3600
    assert attention_span(model.with_(doc_len=65536), plan) == 32768


# ---- sliding windows: the planner's count is the kernel's ------------------------------------
def test_windowed_flops_count_the_pairs_the_kernel_keeps():
    """One document of s = 2048 tokens, a window of w = 256 keys in 3 of 4 layers: the pairs
    the kernel's trimmed spans keep (counted from their masks) are s w - w^2/2 + w/2 per
    windowed layer, and the planner's attention FLOPs (s w - w^2/2 pairs, half a pair per query
    below the kernel's count, as s^2/2 is below s(s+1)/2) follow them: 3/4 of the layers cost
    (w - w^2/2s) / (s/2) of a full one."""
    from fivefold.model.sliding_window import span_mask
    from fivefold.specs.flops import attention_flops_all_layers

    s, w = 2048, 256
    layout = DocumentLayout(None, 1, s)
    whole = [Chunk(0, 0, s)]
    spans = [span for b in document_blocks(whole, whole, layout, w) for span in b.spans]
    kept = 0
    for span in spans:
        tq, tk = span.q.stop - span.q.start, span.k.stop - span.k.start
        kept += int(span_mask(span.shift, span.window, tq, tk, "cpu").sum()) if span.window else 0
    assert kept == s * w - w * w // 2 + w // 2
    model = LLAMA_1B.with_(seq_len=s, layers=4, sliding_window=w, sliding_layers=3)
    full = attention_flops_all_layers(model.with_(sliding_window=0, sliding_layers=0), s)
    windowed = attention_flops_all_layers(model, s)
    per_layer = full / 4
    assert windowed == pytest.approx(per_layer + 3 * per_layer * (s * w - w * w / 2) / (s * s / 2))
    assert windowed < 0.5 * full
