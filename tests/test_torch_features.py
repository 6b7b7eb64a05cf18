"""The torch range fivefold supports (2.11 to 2.13): the APIs that differ, detected on this
torch, the start-up check that names a missing one, and torch 2.11's varlen_attn without GQA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.varlen as varlen_module
from torch._subclasses.fake_tensor import FakeTensorMode

from fivefold.cli.main import main
from fivefold.model import torch_features as tf
from fivefold.model.attention import AttentionCore
from fivefold.model.document_layout import DocumentLayout
from fivefold.specs import ParallelPlan, model_preset

TORCH_213 = torch.__version__.startswith("2.13")


@pytest.fixture
def missing(monkeypatch):
    """Feature keys this test makes absent; the rest are probed as they are."""
    absent: set[str] = set()
    real = tf.available
    monkeypatch.setattr(tf, "available", lambda key: key not in absent and real(key))
    return absent


def packed_docs(rows: list[list[int]]) -> DocumentLayout:
    """Documents read on the host before fake tensors (as the model does once per forward)."""
    docs = DocumentLayout(torch.tensor(rows), len(rows), len(rows[0]))
    assert docs.row_groups and docs.cu_seqlens(torch.device("cpu"))[1] > 0
    return docs


@pytest.mark.skipif(not TORCH_213, reason="the figures CI checks are torch 2.13's")
def test_torch_213_has_every_feature():
    found = tf.torch_features()
    assert {key for key, f in found.items() if not f.available} == set()
    assert tf.varlen_supports_gqa()
    assert found["varlen_attn_gqa"].api.endswith("varlen_attn(enable_gqa=)")


def test_a_varlen_attn_without_enable_gqa_is_detected(monkeypatch):
    real = varlen_module.varlen_attn

    def varlen_211(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        return real(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    tf.available.cache_clear()
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_211)
    try:
        assert tf.has("varlen_attn") and not tf.varlen_supports_gqa()
    finally:
        monkeypatch.undo()
        tf.available.cache_clear()
    assert tf.varlen_supports_gqa() == TORCH_213


def test_packed_gqa_attention_repeats_kv_where_varlen_lacks_gqa(monkeypatch, missing):
    """torch 2.11 on a GPU (2026-11-26): `varlen_attn() got an unexpected keyword argument
    'enable_gqa'`. Without the argument the kernel gets K/V with one head per query head."""
    missing.add("varlen_attn_gqa")
    real, seen = varlen_module.varlen_attn, []

    def varlen_211(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        seen.append((q.shape, k.shape, v.shape))
        return real(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_211)
    docs = packed_docs([[0] * 5 + [1] * 11, [0] * 16])
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(2, 16, 4, 8, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        kv = torch.randn(2, 16, 2, 8, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        out = AttentionCore()(q, kv, kv, docs)
    assert out.shape == (2, 4, 16, 8)
    assert seen == [((32, 4, 8), (32, 4, 8), (32, 4, 8))]  # 2 KV heads repeated to 4


def test_no_varlen_attn_takes_the_per_document_kernel(monkeypatch, missing):
    missing.add("varlen_attn")
    called = []
    monkeypatch.setattr(varlen_module, "varlen_attn", lambda *a, **k: called.append(1))
    docs = packed_docs([[0] * 5 + [1] * 11])
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(1, 16, 4, 8, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        out = AttentionCore()(q, q, q, docs)
    assert out.shape == (1, 4, 16, 8) and called == []


def test_required_features_follow_the_recipe():
    dense, moe = model_preset("tiny"), model_preset("tiny-moe")
    assert set(tf.required_features(dense, ParallelPlan())) == {"dcp_state_dict"}
    plan = ParallelPlan(pp=2, schedule="dualpipev", dp_shard=2, zero=0)
    assert set(tf.required_features(moe, plan)) == {
        "dcp_state_dict",
        "fully_shard",
        "grouped_mm",
        "replicate_with_fsdp",
        "schedule_dualpipev",
    }


def test_a_missing_api_fails_at_start_up_in_one_line(missing, capsys):
    missing.add("schedule_dualpipev")
    plan = ParallelPlan(pp=2, schedule="dualpipev")
    (line,) = tf.torch_problems(model_preset("tiny"), plan)
    assert line.startswith("plan.schedule = 'dualpipev' needs ")
    assert "ScheduleDualPipeV, which torch " in line and ">=2.11,<2.14" in line
    missing.add("grouped_mm")
    code = main(["train", "model.preset='tiny-moe'", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "model.experts = " in err and "torch._grouped_mm" in err
    assert "Traceback" not in err
