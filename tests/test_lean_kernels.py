"""The lean runtime's kernels against the unfused reference: SwiGLU's `silu_mul`, `rms_norm`
and the chunked `linear_cross_entropy` (fp64 gradients, the bf16 autocast head, what each keeps
for the backward, torch.compile on CPU); and the planner's eager terms that describe them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.model import loss as loss_module
from fivefold.model.feed_forward import silu_mul
from fivefold.model.loss import IGNORE_INDEX, cross_entropy_loss, linear_cross_entropy
from fivefold.model.norms import rms_norm
from fivefold.planner.memory.activations import eager_head_loss_bytes
from fivefold.planner.memory.options import EAGER
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import MODEL_PRESETS


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


def _saved(fn, inputs) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd keeps for `fn`'s backward (inputs' storages included)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*[t.detach().clone().requires_grad_() for t in inputs])
    return shapes


def test_silu_mul_equals_autograd_and_keeps_its_two_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(3, 5, 7, generator=g, dtype=torch.float64) for _ in range(3))
    got = _grads(silu_mul, (gate, up), grad)
    expected = _grads(lambda a, b: F.silu(a) * b, (gate, up), grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
    # eager autograd keeps gate (silu), silu(gate) and up (mul): three [.., F] tensors
    assert _saved(silu_mul, (gate, up)) == [(3, 5, 7), (3, 5, 7)]
    assert len(_saved(lambda a, b: F.silu(a) * b, (gate, up))) == 3
    bf = [t.to(torch.bfloat16) for t in (gate, up, grad)]  # the same bits as autograd's
    for a, b in zip(
        _grads(silu_mul, bf[:2], bf[2]),
        _grads(lambda a, b: F.silu(a) * b, bf[:2], bf[2]),
        strict=True,
    ):
        assert torch.equal(a, b)


def _old_norm(x, w, eps=1e-5):
    """The runtime's RMSNorm before: fp32 `F.rms_norm` times the weight, cast back."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * w.float()).type_as(x)


def test_rms_norm_equals_the_reference_and_keeps_input_and_rstd() -> None:
    g = torch.Generator().manual_seed(1)
    x, grad = (torch.randn(2, 6, 16, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(16, generator=g, dtype=torch.float64)
    got = _grads(lambda x, w: rms_norm(x, w, 1e-5), (x, w), grad)
    expected = _grads(lambda x, w: F.rms_norm(x, (16,), eps=1e-5) * w, (x, w), grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    # the input, the reciprocal RMS per token and the weight; nothing [.., D] in fp32 besides
    assert _saved(lambda x, w: rms_norm(x, w, 1e-5), (x, w)) == [(2, 6, 16), (2, 6, 1), (16,)]
    xb = x.to(torch.bfloat16)  # bf16 activations: the same output bits as before
    assert torch.equal(rms_norm(xb, w.float(), 1e-5), _old_norm(xb, w.float()))
    saved = _saved(lambda x, w: rms_norm(x, w, 1e-5), (xb, w.float()))
    assert saved == [(2, 6, 16), (2, 6, 1), (16,)]


def _reference_ce(h, w, labels, reduction):
    logits = (h @ w.T).flatten(0, 1)
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)


@pytest.mark.parametrize("chunk_logits", [1 << 25, 7 * 50], ids=["one-chunk", "chunks-of-7"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_equals_the_unfused_head(monkeypatch, chunk_logits, reduction):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", chunk_logits)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 30, 16, generator=g, dtype=torch.float64)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (2, 30), generator=g)
    labels[0, :4] = IGNORE_INDEX
    scale = torch.tensor(0.37, dtype=torch.float64)
    got = _grads(lambda h, w: linear_cross_entropy(h, w, labels, reduction, scale), (h, w), None)
    expected = _grads(lambda h, w: _reference_ce(h, w, labels, reduction) * scale, (h, w), None)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_linear_cross_entropy_under_bf16_autocast_has_the_unfused_heads_gradients() -> None:
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(2, 24, 32, generator=g), torch.randn(64, 32, generator=g)
    labels = torch.randint(0, 64, (2, 24), generator=g)

    def unfused(h, w):
        return cross_entropy_loss(F.linear(h, w).float(), labels, "sum")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(lambda h, w: linear_cross_entropy(h, w, labels, "sum"), (h, w), None)
        expected = _grads(unfused, (h, w), None)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0)  # summed in fp32
    for a, b in zip(got[1:], expected[1:], strict=True):  # bf16 matmuls, fp32 gradients
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)


class _Largest(TorchDispatchMode):
    """The largest tensor (elements) any operator makes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_linear_cross_entropy_never_makes_the_full_logits(monkeypatch) -> None:
    """Chunks of at most CHUNK_LOGITS logits: with 10 tokens a chunk (100 x 64 logits whole),
    no operator makes more than 10 x 64 elements (the [64, 16] weight gradient is less)."""
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 10 * 64)
    h = torch.randn(4, 25, 16, requires_grad=True)
    w = torch.randn(64, 16, requires_grad=True)
    labels = torch.randint(0, 64, (4, 25))
    with _Largest() as mode:
        linear_cross_entropy(h, w, labels).backward()
    assert mode.largest == 4 * 25 * 16  # the input gradient; logits chunks are 640
    assert loss_module.chunk_tokens(100, 64) == 10


@pytest.mark.slow  # a cold inductor compile: 30-100 s (the CI compile parity cases cover it)
def test_the_lean_kernels_compile_on_cpu() -> None:
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 8, 16, generator=g), torch.randn(16, generator=g)
    gate, up = torch.randn(2, 8, 24, generator=g), torch.randn(2, 8, 24, generator=g)

    def block(x, w, gate, up):
        return rms_norm(x, w, 1e-5).sum() + silu_mul(gate, up).sum()

    inputs = (x, w, gate, up)
    eager = _grads(block, inputs, None)
    compiled = _grads(torch.compile(block, backend="inductor", fullgraph=True), inputs, None)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_planner_chunk_is_the_runtimes() -> None:
    assert EAGER.loss_chunk_logits == loss_module.CHUNK_LOGITS


def test_eager_head_loss_bytes_by_hand() -> None:
    """Llama 3 70B's head, TP2, 4,096 tokens (16K / CP4), bf16: 32 MiB-logit chunks of 523
    tokens against 64,128 local rows, so several chunks (fp32 weight-gradient sum)."""
    model = dataclasses.replace(MODEL_PRESETS["llama3-70b"], seq_len=16384)
    plan = ParallelPlan(tp=2, sp=True, cp=4, micro_batch=1, precision="bf16-mixed")
    tokens, vocab, h = 4096, 128256 / 2, 8192
    chunk = (1 << 25) // 64128
    assert chunk == 523
    # input gradient and the gathered input (bf16), a chunk's logits (fp32), its softmax (fp32)
    # and that in bf16, and the fp32 weight-gradient sum beside one chunk's bf16 product
    forward = 2 * (2 * tokens * h) + (4 + 4 + 2) * chunk * vocab + (4 + 2) * vocab * h
    kept = 2 * tokens * h + 2 * vocab * h
    assert eager_head_loss_bytes(model, plan) == max(forward, 2 * kept)
    # the unfused head kept 16 bytes per logit under loss_parallel: 3.91 GiB against 3.37 GiB
    unfused = tokens * vocab * 16
    assert eager_head_loss_bytes(model, plan) / unfused == pytest.approx(0.8617, abs=1e-4)
