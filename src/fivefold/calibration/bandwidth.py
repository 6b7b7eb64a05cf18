"""Memory-bound work in the planner's byte accounting: element-wise, the loss, the optimizer."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from fivefold.calibration.timing import (
    Budget,
    backward_time_s,
    flush_caches,
    lower_quartile,
    measured_device,
    randn_on_device,
    timed_s,
    typical_time_s,
)
from fivefold.model.loss import cross_entropy_loss
from fivefold.model.norms import RMSNorm
from fivefold.model.rope import apply_rope, rope_cos_sin
from fivefold.model.torch_features import adamw_kernel
from fivefold.model.transformer import TransformerBlock
from fivefold.planner.step_time.compute import (
    ComputeOptions,
    layer_elementwise_bytes,
    optimizer_bytes_per_param,
)
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.profile import Bandwidth


# ---- element-wise work, loss, optimizer ------------------------------------------------------
def elementwise_passes(model: ModelSpec, batch: int, budget: Budget) -> tuple[float, float]:
    """(forward, backward) seconds of one block's non-matmul, non-attention work as the model
    runs it: two RMSNorms, RoPE on q and k (tables shared by the layers, made once), SwiGLU
    (or GeLU), two residual adds; `batch` sequences of the model's length."""
    b, s, h, d = batch, model.seq_len, model.hidden, model.head_dim
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return randn_on_device(gen, *shape).requires_grad_(True)

    norm1, norm2 = (RMSNorm(h, model.norm_eps).to(measured_device()) for _ in range(2))
    x, attn, mlp = leaf(b, s, h), leaf(b, s, h), leaf(b, s, h)
    q, k = leaf(b, s, model.heads, d), leaf(b, s, model.kv_heads, d)
    gate, up = leaf(b, s, model.ffn), leaf(b, s, model.ffn)
    cos, sin = rope_cos_sin(
        torch.arange(s, device=measured_device()).expand(b, s), d, model.rope_theta
    )

    def forward() -> list[torch.Tensor]:
        xn = norm1(x)
        qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        hidden = x + attn
        hn = norm2(hidden)
        act = F.silu(gate) * up if model.mlp == "swiglu" else F.gelu(gate)
        return [xn, qr, kr, hn, act, hidden + mlp]

    outs = forward()
    grads = [torch.randn_like(o) for o in outs]
    fwd = typical_time_s(forward, budget)
    times = []
    for _ in range(max(budget.min_repeats, 2) + 1):
        outs = forward()
        flush_caches()
        times.append(timed_s(lambda outs=outs: torch.autograd.backward(outs, grads)))
    return fwd, lower_quartile(times[1:])


def loss_passes(tokens: int, vocab: int, budget: Budget) -> tuple[float, float]:
    """(forward, backward) seconds of the fp32 cross entropy over [tokens, vocab] logits."""
    gen = torch.Generator().manual_seed(0)
    logits = randn_on_device(gen, 1, tokens, vocab).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen).to(measured_device())
    fwd = typical_time_s(lambda: cross_entropy_loss(logits, labels), budget)
    return fwd, backward_time_s(
        lambda: cross_entropy_loss(logits, labels),
        torch.tensor(1.0, device=measured_device()),
        budget,
    )


OPTIMIZER_MAX_PARAMS = 16_000_000  # cap on the parameters the optimizer benchmark allocates


def optimizer_time_s(model: ModelSpec, budget: Budget) -> tuple[float, int]:
    """(seconds, parameters) of AdamW with gradient clipping and zeroing, its kernel chosen as
    training chooses it (`adamw_kernel`: fused on a CPU too; until 2026-11-28 foreach there,
    3.5x the fused step's time), over tensors shaped like the model's: the embedding, the head
    and as many blocks as fit under `OPTIMIZER_MAX_PARAMS` (per-tensor costs matter for small
    models)."""
    block = [tuple(p.shape) for p in TransformerBlock(0, model).parameters()]
    per_block = sum(math.prod(s) for s in block)
    ends = [(model.vocab, model.hidden), (model.vocab, model.hidden), (model.hidden,)]
    room = OPTIMIZER_MAX_PARAMS - sum(math.prod(s) for s in ends)
    blocks = max(1, min(model.layers, room // per_block))
    gen = torch.Generator().manual_seed(0)
    params = [randn_on_device(gen, *s) for s in ends + block * blocks]
    for p in params:
        p.requires_grad_(True)
        p.grad = randn_on_device(gen, *p.shape)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **adamw_kernel(params))

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for p in params:  # zero_grad(set_to_none=False) keeps the grads for the next repeat
            p.grad.zero_()

    return typical_time_s(step, budget), sum(p.numel() for p in params)


def measure_bandwidth(
    model: ModelSpec, plan: ParallelPlan, threads: int, budget: Budget, processes: int = 1
) -> list[Bandwidth]:
    """Bandwidths in the planner's byte accounting (`planner.step_time.compute`); `processes`:
    how many local processes run this at once (`fivefold.calibration.comm` runs it on
    every rank of its worlds, so the rows see memory bandwidth shared as a run shares it)."""
    dense = replace(model, experts=0, top_k=0, shared_experts=0, dense_layers=0)
    one = ParallelPlan(micro_batch=plan.micro_batch, precision="fp32")
    elem_bytes = layer_elementwise_bytes(dense, one, False, ComputeOptions())
    fwd, bwd = elementwise_passes(dense, plan.micro_batch, budget)
    tokens = plan.micro_batch * model.seq_len
    loss_f, loss_b = loss_passes(tokens, model.vocab, budget)
    logits = tokens * model.vocab
    opt_s, params = optimizer_time_s(dense, budget)
    return [
        Bandwidth("elementwise_forward", threads, processes, elem_bytes / fwd),
        Bandwidth("elementwise_backward", threads, processes, 2 * elem_bytes / bwd),
        Bandwidth("loss_forward", threads, processes, 10 * logits / loss_f),
        Bandwidth("loss_backward", threads, processes, 14 * logits / loss_b),
        Bandwidth("optimizer", threads, processes, params * optimizer_bytes_per_param(one) / opt_s),
    ]
