"""The dense decoder: shapes, parameter counts, masking, RoPE, init and a tiny overfit run."""

from __future__ import annotations

import math

import pytest
import torch

from attention_reference import (
    DenseReferenceCore,
    dense_reference_attention,
    packed_doc_ids,
    positions_from_docs,
)
from fivefold.errors import ConfigError
from fivefold.model import (
    AttentionCore,
    Block,
    Chunk,
    DocumentLayout,
    Span,
    apply_rope,
    build_model,
    cross_entropy_loss,
    document_blocks,
    init_module_weights,
    rope_cos_sin,
)
from fivefold.specs import ModelSpec, model_preset, param_count
from tiny_models import TINY, make


def shrink(spec: ModelSpec, **extra) -> ModelSpec:
    """A small variant that keeps the preset's structure (GQA ratio, MLP kind, tying, MoE)."""
    heads = 4
    kv_heads = heads // min(heads, spec.heads // spec.kv_heads)
    changes = dict(
        layers=3 if spec.dense_layers else 2,
        hidden=64,
        heads=heads,
        kv_heads=kv_heads,
        ffn=96,
        vocab=256,
        head_dim=0,
    )
    if spec.is_moe:
        changes.update(
            experts=4,
            top_k=min(spec.top_k, 4),
            expert_ffn=32,
            dense_layers=min(spec.dense_layers, 1),
        )
    changes.update(extra)
    return spec.with_(**changes)


# ---- shapes --------------------------------------------------------------------------------
def test_logits_shape_dtype_and_gqa_weight_shapes():
    model = make(TINY)
    logits = model(torch.randint(0, 128, (3, 10)))
    assert logits.shape == (3, 10, 128) and logits.dtype == torch.float32
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (4 * 8, 32)
    assert attn.wk.weight.shape == (2 * 8, 32) and attn.wv.weight.shape == (2 * 8, 32)
    assert attn.wo.weight.shape == (32, 4 * 8)
    assert list(model.layers.keys()) == ["0", "1"]


def test_tied_embeddings_survive_to_empty():
    spec = TINY.with_(tied_embeddings=True)
    model = make(spec)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.device.type == "cpu"
    assert sum(p.numel() for p in model.parameters()) == param_count(spec)
    assert model(torch.randint(0, 128, (1, 5))).shape == (1, 5, 128)


def test_tied_head_on_its_own_stage_gets_the_embedding_values():
    spec = TINY.with_(tied_embeddings=True)
    full = make(spec, seed=2)
    last = build_model(spec)
    last.tok_embeddings = None
    last.to_empty(device="cpu")
    last.init_weights(2)
    assert torch.equal(last.output.weight, full.tok_embeddings.weight)
    untied = make(TINY, seed=2)  # untied heads are drawn independently
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


def test_stage_without_ends_maps_hidden_to_hidden():
    full = make(TINY)
    tokens = torch.randint(0, 128, (2, 12))
    reference = full(tokens)
    first, last = make(TINY), make(TINY)
    del first.layers["1"]
    first.norm, first.output = None, None
    del last.layers["0"]
    last.tok_embeddings = None
    hidden = first(tokens)
    assert hidden.shape == (2, 12, 32)
    assert torch.equal(last(hidden), reference)


def test_invalid_spec_raises_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="kv_heads"):
        build_model(TINY.with_(kv_heads=3))


# ---- parameter counts --------------------------------------------------------------------
@pytest.mark.parametrize(
    "preset", ["tiny", "tiny-moe", "small", "gpt3-175b", "llama3-8b", "mixtral-8x7b", "deepseek-v3"]
)
def test_param_count_matches_spec(preset):
    base = model_preset(preset)
    spec = base if preset in ("tiny", "tiny-moe", "small") else shrink(base)
    if preset == "deepseek-v3":
        spec = spec.with_(head_dim=12)  # head_dim != hidden / heads, as in the preset
    model = build_model(spec)  # counting on the meta device costs no memory
    assert sum(p.numel() for p in model.parameters()) == param_count(spec)


def test_shrunk_variants_keep_structure():
    gpt3 = shrink(model_preset("gpt3-175b"))
    assert gpt3.tied_embeddings and gpt3.mlp == "gelu"
    model = build_model(gpt3)
    assert model.layers["0"].feed_forward.w3 is None
    ds = shrink(model_preset("deepseek-v3"))
    model = build_model(ds)
    assert model.layers["0"].moe is None and model.layers["1"].moe is not None
    assert model.layers["1"].moe.shared_expert is not None


# ---- attention over documents ------------------------------------------------------------------
def test_document_blocks_for_context_parallel_chunks():
    # one row, documents [0, 3) and [3, 8); queries hold global tokens 4..7 at local 0..3,
    # keys hold global 0..3 (at local 0) and 4..7 (at local 4)
    docs = DocumentLayout(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]), 1, 8)
    blocks = document_blocks([Chunk(0, 4, 4)], [Chunk(0, 0, 4), Chunk(4, 4, 4)], docs)
    rows = slice(0, 1)
    assert blocks == [
        Block(slice(0, 4), slice(0, 4), (Span(rows, slice(0, 4), slice(3, 4), False),)),
        Block(slice(0, 4), slice(4, 8), (Span(rows, slice(0, 4), slice(0, 4), True),)),
    ]
    # keys after the queries give no block; identical rows share one span
    two = DocumentLayout(torch.tensor([[0, 0, 1, 1]] * 2), 2, 4)
    assert document_blocks([Chunk(0, 0, 2)], [Chunk(2, 2, 2)], two) == []
    whole = document_blocks([Chunk(0, 0, 4)], [Chunk(0, 0, 4)], two)
    assert [s.rows for s in whole[0].spans] == [slice(0, 2)] * 2


def test_core_matches_explicit_softmax_with_gqa_and_documents():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])
    out = AttentionCore()(q, k, v, DocumentLayout(docs, 2, 6))
    expected = torch.empty_like(out)
    for b in range(2):
        for h in range(4):
            kv = h // 2  # query heads 0,1 share kv head 0; 2,3 share kv head 1
            scores = q[b, h] @ k[b, kv].T / math.sqrt(8)
            for i in range(6):
                for j in range(6):
                    if j > i or docs[b, i] != docs[b, j]:
                        scores[i, j] = -math.inf
            expected[b, h] = torch.softmax(scores, dim=-1) @ v[b, kv]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


DOC_CASES = {
    "packed": lambda g: packed_doc_ids(3, 48, g),
    "packed-rows-alike": lambda g: packed_doc_ids(1, 48, g).expand(3, 48),
    "one-document": lambda g: torch.zeros(3, 48, dtype=torch.long),
    "no-doc-ids": lambda g: None,
}


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # GQA groups 1, 2, 4
@pytest.mark.parametrize("case", list(DOC_CASES))
def test_core_equals_dense_mask_reference_with_gradients(case, kv_heads):
    g = torch.Generator().manual_seed(5)
    docs = DOC_CASES[case](g)
    shapes = [(3, 48, heads, 16) for heads in (4, kv_heads, kv_heads)]  # [B, T, H, Dh] memory
    inputs = [torch.randn(*shape, generator=g) for shape in shapes]
    dout = torch.randn(3, 4, 48, 16, generator=g)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*(x.transpose(1, 2) for x in leaves))
        out.backward(dout)
        return [out.detach()] + [x.grad for x in leaves]

    layout = None if docs is None else DocumentLayout(docs, 3, 48)
    got = run(lambda q, k, v: AttentionCore()(q, k, v, layout))
    want = run(lambda q, k, v: dense_reference_attention(q, k, v, docs))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=name)


def test_model_equals_dense_mask_reference_model():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (2, 40), generator=g)
    docs = packed_doc_ids(2, 40, g, p=0.1)
    positions = positions_from_docs(docs)
    model, reference = make(TINY), make(TINY)
    for block in reference.layers.values():
        block.attention.core = DenseReferenceCore()
    results = []
    for m in (model, reference):
        logits = m(tokens, positions, docs)
        cross_entropy_loss(logits, tokens).backward()
        results.append((logits, {n: p.grad for n, p in m.named_parameters()}))
    (logits, grads), (ref_logits, ref_grads) = results
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def _saved_bytes_of_attention(docs: torch.Tensor | None) -> tuple[int, int]:
    """(bytes autograd saves for one attention layer, counting each storage once; the same
    counting every saved tensor separately) excluding parameters."""
    model = make(TINY)
    attention = model.layers["0"].attention
    x = torch.randn(2, 24, 32, requires_grad=True)
    rope = rope_cos_sin(torch.arange(24).expand(2, 24), 8, 10_000.0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    total = [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
            total[0] += storage.nbytes()
        return t

    layout = None if docs is None else DocumentLayout(docs, 2, 24)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x, rope, layout).sum().backward()
    return sum(seen.values()), total[0]


@pytest.mark.parametrize("packed", [False, True])
def test_attention_saves_each_tensor_once(packed):
    # hand count, fp32, B=2 T=24 D=32 Hq=4 Hkv=2 Dh=8: the input x (read by wq, wk, wv), cos and
    # sin, rotated q and k, v, the attention output (= the input of wo) and its fp32 LSE; packed,
    # also the batch's own int64 doc ids (saved by reference, not copied)
    docs = torch.tensor([[0] * 10 + [1] * 14] * 2) if packed else None
    unique, total = _saved_bytes_of_attention(docs)
    b, t = 2, 24
    expected = 4 * b * t * (32 + 2 * 8 + 4 * 8 + 2 * 2 * 8 + 4 * 8) + 4 * b * 4 * t
    expected += 8 * b * t if packed else 0
    assert unique == expected
    assert total >= unique  # several saves of one storage are fine; copies are not


def test_cuda_varlen_path_forward_shapes_under_fake_tensors():
    # no GPU here: FakeTensorMode runs the CUDA branch (varlen_attn) for shapes and dtypes only
    from torch._subclasses.fake_tensor import FakeTensorMode

    docs = DocumentLayout(torch.tensor([[0] * 5 + [1] * 11, [0] * 16]), 2, 16)
    assert docs.row_groups == ((slice(0, 1), (0, 5)), (slice(1, 2), (0,)))  # read on the host
    offsets, longest = docs.cu_seqlens(torch.device("cpu"))
    assert offsets.tolist() == [0, 5, 16, 32] and longest == 16
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(2, 16, 4, 8, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        kv = torch.randn(2, 16, 2, 8, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        out = AttentionCore()(q, kv, kv, docs)
        cu_seqlens, max_len = docs.cu_seqlens(q.device)
    assert out.shape == (2, 4, 16, 8) and out.dtype == torch.bfloat16
    assert out.device.type == "cuda" and out.transpose(1, 2).is_contiguous()
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (4,) and max_len == 16


def test_rope_tables_and_document_layout_are_built_once_per_forward(monkeypatch):
    import fivefold.model.document_layout as layout_module
    import fivefold.model.transformer as transformer_module

    calls = {"rope": 0, "host": 0}
    real_rope, real_groups = transformer_module.rope_cos_sin, layout_module._row_groups

    def counting_rope(*args):
        calls["rope"] += 1
        return real_rope(*args)

    def counting_groups(*args):
        calls["host"] += 1
        return real_groups(*args)

    monkeypatch.setattr(transformer_module, "rope_cos_sin", counting_rope)
    monkeypatch.setattr(layout_module, "_row_groups", counting_groups)
    model = make(TINY.with_(layers=4))
    docs = torch.tensor([[0] * 10 + [1] * 6])
    model(torch.randint(0, 128, (1, 16)), positions_from_docs(docs), docs).sum().backward()
    assert calls == {"rope": 1, "host": 1}


def test_document_mask_isolates_documents():
    model = make(TINY)
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (1, 24))
    docs = torch.tensor([[0] * 9 + [1] * 15])
    positions = torch.cat([torch.arange(9), torch.arange(15)]).unsqueeze(0)
    packed = model(tokens, positions, docs)

    changed = tokens.clone()
    changed[0, :9] = torch.randint(0, 128, (9,))
    assert not torch.equal(changed[0, :9], tokens[0, :9])
    packed_changed = model(changed, positions, docs)
    assert torch.equal(packed_changed[0, 9:], packed[0, 9:])  # doc B bit-identical
    assert not torch.allclose(packed_changed[0, :9], packed[0, :9])

    alone = model(tokens[:, 9:])  # doc B on its own, positions 0..14
    torch.testing.assert_close(packed[0, 9:], alone[0], atol=1e-5, rtol=1e-5)
    unmasked = model(tokens, positions)  # same positions, no document mask: B sees A
    assert (unmasked[0, 9:] - alone[0]).abs().max() > 1e-3


def test_causality():
    model = make(TINY)
    tokens = torch.randint(0, 128, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (tokens[:, 10] + 1) % 128
    before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert (before[:, 10:] - after[:, 10:]).abs().amax(dim=-1).min() > 1e-6


def test_rope_hand_values():
    # head_dim 4, theta 100: pairs (0, 2) and (1, 3) rotate at 1 and 0.1 rad per position.
    x = torch.tensor([1.0, 2.0, 0.0, 0.0]).view(1, 1, 1, 4)
    cos, sin = rope_cos_sin(torch.tensor([[3]]), head_dim=4, theta=100.0)
    rotated = apply_rope(x, cos, sin).flatten()
    expected = torch.tensor([math.cos(3.0), 2 * math.cos(0.3), math.sin(3.0), 2 * math.sin(0.3)])
    torch.testing.assert_close(rotated, expected)


def test_rope_scores_depend_on_relative_positions_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        qc, qs = rope_cos_sin(torch.tensor([[q_pos]]), 16, 10_000.0)
        kc, ks = rope_cos_sin(torch.tensor([[k_pos]]), 16, 10_000.0)
        return (apply_rope(q, qc, qs) * apply_rope(k, kc, ks)).sum(-1)

    torch.testing.assert_close(score(7, 3), score(1007, 1003), atol=1e-4, rtol=1e-4)
    assert (score(7, 3) - score(3, 7)).abs().max() > 1e-2


def test_model_is_shift_invariant_in_positions():
    model = make(TINY)
    tokens = torch.randint(0, 128, (1, 12))
    shifted = model(tokens, positions=torch.arange(1000, 1012).unsqueeze(0))
    torch.testing.assert_close(shifted, model(tokens), atol=2e-4, rtol=1e-4)


# ---- init -------------------------------------------------------------------------------------
def test_init_is_deterministic_and_layout_independent():
    a, b, c = make(TINY, seed=3), make(TINY, seed=3), make(TINY, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers["1"].attention.wq.weight, c.layers["1"].attention.wq.weight)
    assert torch.equal(a(torch.arange(8).unsqueeze(0)), b(torch.arange(8).unsqueeze(0)))

    stage = build_model(TINY)  # a pipeline stage: layer 1 and the head only
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(3)
    full = dict(a.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, full[name]), name

    block = build_model(TINY).layers["1"]  # one block alone, told its FQN
    block.to_empty(device="cpu")
    init_module_weights(block, seed=3, layers=TINY.layers, prefix="layers.1.")
    assert torch.equal(block.feed_forward.w2.weight, a.layers["1"].feed_forward.w2.weight)


def test_init_distribution():
    spec = TINY.with_(hidden=128, heads=4, kv_heads=4, ffn=512, vocab=512, layers=8)
    model = make(spec)
    layer = model.layers["3"]
    assert abs(model.tok_embeddings.weight.std().item() - 0.02) < 0.001
    assert abs(layer.feed_forward.w1.weight.std().item() - 0.02) < 0.001
    scaled = 0.02 / math.sqrt(2 * 8)
    assert abs(layer.feed_forward.w2.weight.std().item() - scaled) < 0.0005
    assert abs(layer.attention.wo.weight.std().item() - scaled) < 0.0005
    assert torch.equal(layer.attention_norm.weight, torch.ones(128))
    assert torch.equal(model.norm.weight, torch.ones(128))
    # distinct FQNs draw distinct values
    assert not torch.equal(layer.attention.wq.weight[:128], layer.attention.wk.weight)


# ---- loss and training ------------------------------------------------------------------------
def test_cross_entropy_uniform_logits_and_ignore_index():
    logits = torch.zeros(2, 3, 10)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert cross_entropy_loss(logits, labels).item() == pytest.approx(math.log(10))
    logits[0, 0, 1] = 5.0  # one confident correct token among the three counted
    first = -torch.log_softmax(logits[0, 0], dim=-1)[1].item()
    expected = (first + 2 * math.log(10)) / 3
    assert cross_entropy_loss(logits, labels).item() == pytest.approx(expected, rel=1e-6)
    assert cross_entropy_loss(logits, labels, reduction="sum").item() == pytest.approx(3 * expected)


def test_overfits_a_repeated_batch():
    torch.manual_seed(0)
    model = make(TINY)
    tokens = torch.randint(0, 128, (4, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = cross_entropy_loss(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(128), abs=0.1)  # near-uniform at init
    assert losses[-1] < 0.3 * losses[0]


# ---- init on sharded (DTensor) parameters, 2 gloo ranks ---------------------------------------
def _sharded_init_worker(rank: int, world: int, port: int) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    reference = make(TINY, seed=5)
    model = build_model(TINY)  # shard on the meta device, then materialise and init the shards
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(5)
    for (name, param), expected in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        assert isinstance(param, DTensor), name
        assert torch.equal(param.full_tensor(), expected), name
    tokens = torch.arange(24).view(2, 12)
    assert torch.equal(model(tokens), reference(tokens))
    dist.destroy_process_group()
    os._exit(0)  # avoids the rare abort at interpreter exit of spawned workers


@pytest.mark.timeout(120)
def test_init_after_fsdp_sharding_equals_single_process():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_sharded_init_worker, args=(2, port), nprocs=2)
