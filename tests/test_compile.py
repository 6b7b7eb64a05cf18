"""`train.compile = true` in one process: blocks compiled, the compile time reported once, the
losses those of the eager run (inductor reorders float arithmetic, hence a tolerance); and the
attention core under dynamo (no inductor, fast): packed documents through one custom op with no
graph break and no recompile per packing, one-document rows SDPA inside the graph.

The end-to-end test is slow: a cold inductor compile takes tens of seconds on CPU. The
multi-rank cases are in tests/parallel/test_parity_compile.py (two of them in CI).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from attention_reference import dense_reference_attention
from fivefold.model.attention import AttentionCore, document_attention
from fivefold.model.document_layout import DocumentLayout
from fivefold.train.entry import load_run
from fivefold.train.start import train

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"


def _run(tmp_path: Path, name: str, compile: bool):
    overrides = [
        f"train.runs_dir={str(tmp_path)!r}",
        f"train.name={name!r}",
        "train.progress=false",
        "train.tensorboard=false",
        "train.steps=3",
        "train.warmup_steps=0",
        "train.save_final=false",
        f"train.compile={'true' if compile else 'false'}",
    ]
    out = io.StringIO()
    summary = train(load_run(TINY, overrides, world_size=1), console=Console(file=out))
    return summary, out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_blocks_train_like_eager_and_report_compile_time(tmp_path):
    from fivefold.parallel.compile import compile_seconds

    eager, _ = _run(tmp_path, "eager", compile=False)
    before = compile_seconds()
    compiled, printed = _run(tmp_path, "compiled", compile=True)
    seconds, graphs = compile_seconds()
    assert graphs > before[1] and seconds > before[0]
    assert printed.count("torch.compile: ") == 1 and "graph(s) compiled in" in printed
    for a, b in zip(compiled.losses, eager.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def _packed_docs(lengths: list[list[int]]) -> torch.Tensor:
    """doc ids [B, T] from per-row document lengths."""
    return torch.stack(
        [torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths]
    )


def test_document_attention_op_passes_torch_opcheck():
    # the fake (meta) implementation's shapes and strides, the autograd registration and the
    # schema, as torch.compile relies on them
    torch.manual_seed(0)
    q = torch.randn(2, 12, 4, 8).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 12, 2, 8).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 12, 2, 8).transpose(1, 2).requires_grad_()
    docs = _packed_docs([[5, 7], [3, 4, 5]])
    torch.library.opcheck(document_attention, (q, k, v, docs))


def test_packed_attention_compiles_in_graph_without_recompiling_per_packing():
    # fullgraph: no graph break around attention; a new packing of documents reuses the graph;
    # output and gradients those of eager, checked against the dense-mask reference
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()  # no cache entries left by other tests
    core = AttentionCore()
    counter = CompileCounter()
    compiled = torch.compile(core, backend=counter, fullgraph=True)
    torch.manual_seed(0)
    for lengths in ([[5, 7], [12]], [[3, 4, 5], [6, 6]]):
        docs_ids = _packed_docs(lengths)
        q = torch.randn(2, 12, 4, 8).transpose(1, 2).requires_grad_()
        k = torch.randn(2, 12, 2, 8).transpose(1, 2).requires_grad_()
        v = torch.randn(2, 12, 2, 8).transpose(1, 2).requires_grad_()
        docs = DocumentLayout(docs_ids, 2, 12)
        assert not docs.single_document  # read eagerly, as the block's pre-hook does
        out = compiled(q, k, v, docs)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        expected = dense_reference_attention(q, k, v, docs_ids)
        ref_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1  # one graph for both packings


def test_one_document_rows_run_sdpa_inside_the_compiled_graph():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(AttentionCore(), backend=counter, fullgraph=True)
    q = torch.randn(2, 4, 12, 8)
    kv = torch.randn(2, 2, 12, 8)
    docs = DocumentLayout(torch.zeros(2, 12, dtype=torch.long), 2, 12)
    assert docs.single_document
    out = compiled(q, kv, kv, docs)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, kv, kv, is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out, expected)
    assert counter.frame_count == 1 and counter.op_count >= 1


def test_compiled_blocks_stay_compiled_after_a_step_under_a_dispatch_mode():
    # the loop measures one step's memory under a TorchDispatchMode; torch 2.13's dynamo would
    # then skip the blocks' code for good (every later step eager): calls under a mode must
    # bypass dynamo, and later calls run the compiled graph
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.parallel.compile import apply_compile
    from tiny_models import TINY, make

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    runs = {"compiled": 0}

    def backend(gm, example_inputs):
        def run(*args):
            runs["compiled"] += 1
            return gm(*args)

        return run

    torch._dynamo.reset()
    model = make(TINY.with_(layers=2))
    apply_compile(model, backend=backend)
    tokens = torch.randint(0, 128, (2, 16))
    with PassThrough():
        eager = model(tokens)
    assert runs["compiled"] == 0
    compiled = model(tokens)
    again = model(tokens)
    assert runs["compiled"] == 4  # two blocks, two calls
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(again, eager)
