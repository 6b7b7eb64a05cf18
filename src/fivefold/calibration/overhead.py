"""The fixed cost of one layer (Python, autograd, dispatch) and the extra of TP, EP and DP units."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fivefold.calibration.bandwidth import OPTIMIZER_MAX_PARAMS
from fivefold.calibration.timing import (
    Budget,
    backward_time_s,
    clock,
    flush_caches,
    measured_device,
    typical_time_s,
)
from fivefold.model.transformer import Transformer, TransformerBlock
from fivefold.parallel.expert_parallel import apply_expert_parallel
from fivefold.parallel.tensor_parallel import apply_tensor_parallel
from fivefold.specs.model import ModelSpec
from fivefold.specs.profile import Overhead


# ---- fixed per-layer overhead ----------------------------------------------------------------
def tiny_like(model: ModelSpec, layers: int) -> ModelSpec:
    """`model` shrunk until its arithmetic is negligible (width 16, 8 tokens, 64 words) with the
    same op structure: MLP kind, experts, top-k and shared experts (a MoE layer's routing and
    its loop over experts cost per op, not per byte)."""
    return ModelSpec(
        f"tiny-{model.name}", layers, 16, 2, kv_heads=1, ffn=16, vocab=64, seq_len=8,
        mlp=model.mlp, experts=model.experts, top_k=model.top_k,
        expert_ffn=16 if model.is_moe else 0, shared_experts=model.shared_experts,
    )  # fmt: skip


def moe_like(model: ModelSpec) -> ModelSpec:
    """`model` when it is MoE, else its layer made a MoE one with the `tiny-moe` preset's
    routing (4 experts, top-2, one shared expert): a profile calibrated on a dense model then
    prices a MoE layer's fixed cost (router, token dispatch, grouped experts, load-balancing
    loss) as measured, not as a dense layer's. The cost is per op, not per expert (the experts
    run as one grouped matmul), so one MoE structure serves MoE models of any expert count."""
    if model.is_moe:
        return model
    return replace(model, experts=4, top_k=2, expert_ffn=model.ffn, shared_experts=1)


@contextlib.contextmanager
def local_group() -> Iterator[DeviceMesh]:
    """A one-rank gloo process group (made here unless one exists) and its 1-D mesh: tensor
    parallelism and FSDP2 on it run the dispatch and hooks of a real run with no transfers."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if made:
            dist.destroy_process_group()


def model_passes(model: nn.Module, batch: int, seq: int, budget: Budget) -> tuple[float, float]:
    """(forward, backward) seconds of a whole model on `batch` x `seq` tokens."""
    tokens = torch.zeros(batch, seq, dtype=torch.long, device=measured_device())

    def forward() -> torch.Tensor:
        out = model(tokens)
        return (out.to_local() if isinstance(out, DTensor) else out).sum()

    return typical_time_s(forward, budget), backward_time_s(
        forward, torch.tensor(1.0, device=measured_device()), budget
    )


def per_layer_s(
    build: Callable[[ModelSpec], nn.Module], spec: ModelSpec, budget: Budget, batch: int = 1
):
    """(forward, backward) seconds one more layer adds: a 3-layer model less a 1-layer one,
    halved (the embedding, head and loss cancel)."""
    device, seq = measured_device(), spec.seq_len
    one = model_passes(build(replace(spec, layers=1)).to(device), batch, seq, budget)
    three = model_passes(build(replace(spec, layers=3)).to(device), batch, seq, budget)
    return max(0.0, (three[0] - one[0]) / 2), max(0.0, (three[1] - one[1]) / 2)


def tp_extra_s(
    tp: Callable[[ModelSpec], nn.Module], dense: ModelSpec, budget: Budget, batch: int
) -> tuple[float, float]:
    """(forward, backward) seconds tensor parallelism adds to one layer, at the model's own
    shape (DTensor's redistributions copy activations, so part of the extra grows with them)
    when three layers fit under `OPTIMIZER_MAX_PARAMS`, else at the tiny shape."""
    layer = sum(p.numel() for p in TransformerBlock(0, dense).parameters())
    spec, b = (dense, batch) if 3 * layer <= OPTIMIZER_MAX_PARAMS else (tiny_like(dense, 1), 1)
    return paired_extra_s(Transformer, tp, spec, budget, b)


def paired_extra_s(
    base: Callable[[ModelSpec], nn.Module],
    variant: Callable[[ModelSpec], nn.Module],
    spec: ModelSpec,
    budget: Budget,
    batch: int = 1,
) -> tuple[float, float]:
    """(forward, backward) seconds `variant` adds to one layer over `base`, at `spec`'s shape:
    1- and 3-layer models of each, timed one pass each in turn, round after round; per round
    ((variant 3 - variant 1) - (base 3 - base 1)) / 2, and the median over the rounds. Other
    work on the machine slows the four alike within a round, so its drifts cancel (two
    separate per-layer figures subtracted swung by several ms per layer under load)."""
    tokens = torch.zeros(batch, spec.seq_len, dtype=torch.long, device=measured_device())
    models = [build(replace(spec, layers=n)) for build in (base, variant) for n in (1, 3)]

    def one_pass(model: nn.Module) -> tuple[float, float]:
        now = clock()
        tick = now()
        out = model(tokens)
        loss = (out.to_local() if isinstance(out, DTensor) else out).sum()
        forward = now() - tick
        flush_caches()
        tick = now()
        loss.backward()
        return forward, now() - tick

    for model in models:  # warm-up
        one_pass(model)
    rounds = []
    for _ in range(max(7, budget.min_repeats)):
        b1, b3, v1, v3 = (one_pass(m) for m in models)
        rounds.append(tuple(((v3[i] - v1[i]) - (b3[i] - b1[i])) / 2 for i in (0, 1)))
    fwd, bwd = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    return max(0.0, fwd), max(0.0, bwd)


def measure_overhead(
    model: ModelSpec,
    threads: int,
    budget: Budget,
    moe: ModelSpec | None = None,
    batch: int = 1,
) -> Overhead:
    """The fixed seconds of one layer, at a shape where its arithmetic is negligible: Python,
    autograd and the dispatch of each op (`per_layer_s`). Dense and MoE layers apart; and the
    extra of tensor parallelism (DTensor dispatch, sharding propagation and redistribution
    copies with sequence parallelism, `tp_extra_s`, at `batch` sequences) and of a
    data-parallel unit wrapped as the runtime wraps it for ZeRO-3, ZeRO-0 (`replicate`) and
    ZeRO-1/2 (`fully_shard` kept gathered after forward): their hooks; the copies around the
    collectives are counted by bytes in the planner; and of a MoE layer under expert
    parallelism (the all-to-all dispatcher, DTensor expert shards, the global load-balancing
    loss). Each extra paired against the plain model (`paired_extra_s`), all on a one-rank
    mesh, so no transfer is timed. The MoE layer is `moe`'s (default `model`'s), as a MoE
    layer (`moe_like`) when it is dense."""
    full = replace(model, experts=0, top_k=0, shared_experts=0, expert_ffn=0, dense_layers=0)
    dense = tiny_like(full, 1)
    torch.manual_seed(0)
    plain_f, plain_b = per_layer_s(Transformer, dense, budget)
    moe = moe_like(moe if moe is not None else model)
    moe_f, moe_b = per_layer_s(Transformer, tiny_like(moe, 1), budget)
    with local_group() as mesh:

        def tp(spec: ModelSpec) -> nn.Module:
            net = Transformer(spec)
            apply_tensor_parallel(net, mesh, spec, sequence_parallel=True)
            return net

        def wrapped(zero: int) -> Callable[[ModelSpec], nn.Module]:
            def build(spec: ModelSpec) -> nn.Module:
                net = Transformer(spec)
                for block in net.layers.values():
                    _wrap_unit(block, mesh, zero, reshard=zero == 3)
                _wrap_unit(net, mesh, zero, reshard=False)
                return net

            return build

        def ep(spec: ModelSpec) -> nn.Module:
            net = Transformer(spec)
            apply_expert_parallel(net, mesh, aux_group=mesh.get_group(), expert_grad_scale=1.0)
            return net

        tp_f, tp_b = tp_extra_s(tp, full, budget, batch)
        units = [paired_extra_s(Transformer, wrapped(z), dense, budget) for z in (3, 0, 1)]
        ep_extra = paired_extra_s(Transformer, ep, tiny_like(moe, 1), budget)
    extra = [t for unit in units for t in unit]
    return Overhead(threads, plain_f, plain_b, moe_f, moe_b, tp_f, tp_b, *extra, *ep_extra)


def _wrap_unit(module: nn.Module, mesh: DeviceMesh, zero: int, reshard: bool) -> None:
    """Wrap `module` as the runtime does for ZeRO `zero` (`fivefold.parallel.data_parallel`):
    FSDP2's `replicate` for ZeRO-0, else `fully_shard`."""
    if zero == 0:
        # lazily: a torch feature some supported versions lack (fivefold.model.torch_features);
        # a GPU's calibration never wraps a unit
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=mesh)
    else:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)


def measure_launch_overhead(model: ModelSpec, moe: ModelSpec, budget: Budget) -> Overhead:
    """A GPU's fixed seconds of a dense and a MoE layer (`per_layer_s` on tiny models: kernel
    launches and the host's dispatch); the parallel extras are not measured there (0)."""
    dense = tiny_like(replace(model, experts=0, top_k=0, shared_experts=0, dense_layers=0), 1)
    torch.manual_seed(0)
    plain = per_layer_s(Transformer, dense, budget)
    moe_s = per_layer_s(Transformer, tiny_like(moe_like(moe), 1), budget)
    return Overhead(1, *plain, *moe_s, *([0.0] * 10))
