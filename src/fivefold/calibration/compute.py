"""`fivefold calibrate`: measure the machine at hand into a device profile (specs/profile.py).

What is measured, in one process per thread count (1 and all cores on a CPU), each kernel timed
as the lower quartile of repeats after a warm-up (`typical_time_s`: on a machine shared with
other work the slow repeats are the other work's, not the kernel's), each repeat starting from
cold caches (`flush_caches`: in a training step the rest of the model passes through the caches
between two uses of a weight; warm-cache GEMMs of these sizes run about 10 % faster than in the
model):
- matmul: every GEMM the model runs (wq, wk, wv, wo, w1, w3, w2, the LM head; the router and
  shared experts for MoE) at the recipe's tokens per micro-batch (and half of them, what context
  parallelism leaves) and at each tensor-parallel split up to the ranks, in all three passes with
  the operand layouts autograd uses: forward x W^T, input gradient g W, weight gradient g^T x;
  per dtype (fp32; bf16 only where the CPU has native bf16, `bf16_support`);
- grouped matmul: a MoE layer's experts as `torch._grouped_mm` runs them (w1, w3, w2; all
  three passes) at each expert-parallel split, at the model's expert shapes;
- attention: the model's own attention core (causal SDPA with native GQA, one document per
  row), forward and backward, at each TP split; the grid's shapes again as packed rows of four
  documents through the kernels runs use there (`packed_kernel`: the `document_attention` op on
  a CPU, `varlen_attn` and compiled FlexAttention on a GPU; rows with their `kernel`, read
  beside the one-document rows, not by the planner); and one rank's share of context-parallel
  attention at each CP split (the runtime's block kernels over its load-balanced chunks, with
  their log-sum-exp merges);
- bandwidth: the block's element-wise work (norms, RoPE, SwiGLU, residual adds), the
  cross-entropy loss and AdamW (with clipping and zeroing), each in the byte accounting of
  `planner.step_time.compute`, so the planner's bytes over these rates give time; alone here,
  and on every rank at once in the collective benchmark's worlds (`comm`), since
  the ranks of a run share the memory bandwidth;
- overhead: what one more layer adds at a shape where its arithmetic is negligible (Python,
  autograd, each op's dispatch): dense and MoE layers, and the extra of tensor parallelism
  (DTensor), of expert parallelism on a MoE layer and of a data-parallel unit (FSDP2's hooks
  for ZeRO-3, ZeRO-1/2 and `replicate` for ZeRO-0), measured on a one-rank mesh.
The collectives run over real process groups (`fivefold.calibration.comm`).
Besides the model's own shapes, a model-independent grid of GEMM and attention shapes
(`DEVICE_GRID`, `ATTENTION_GRID`) that the planner interpolates any model among.

On a GPU (`use_device("cuda")`, `cuda_steps`) kernels are timed by CUDA events after an L2
flush: GEMMs in bf16 and FP8 (compute capability 8.9+; the forward with fast accumulation as
torchao runs it), grouped experts and attention in bf16,
the bandwidths in HBM (fused AdamW), a layer's launch cost; the rows carry threads = 1.

Written by hand: PyTorch has benchmark utilities but nothing that measures a machine into the
planner's terms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fivefold.calibration.attention import (
    measure_attention,
    measure_attention_grid,
    measure_packed_attention_grid,
)
from fivefold.calibration.bandwidth import measure_bandwidth
from fivefold.calibration.machine import thread_counts
from fivefold.calibration.matmul import (
    device_grid_shapes,
    fp8_supported,
    gemm_shapes,
    grouped_shapes,
    measure_grouped,
    measure_matmul,
)
from fivefold.calibration.overhead import measure_launch_overhead, measure_overhead
from fivefold.calibration.timing import (
    GRID,
    QUICK,
    Budget,
    measured_device,
)
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.profile import available_cores


def at_threads(fn: Callable[[], list], threads: int) -> Callable[[], list]:
    """`fn` run with torch set to `threads` intra-op threads."""

    def run() -> list:
        torch.set_num_threads(threads)
        return fn()

    return run


def compute_steps(
    model: ModelSpec,
    plan: ParallelPlan,
    ranks: int,
    quick: bool,
    bf16: str,
    also: tuple[ModelSpec, ...] = (),
):
    """The measurements to make, as (description, thunk returning rows) in order. `also`:
    further models whose GEMM shapes, attention and (MoE) layer overhead are measured too,
    for runs of several models on one profile; the bandwidths are `model`'s."""
    if measured_device().type == "cuda":
        return cuda_steps(model, plan, ranks, quick, also)
    budget = QUICK if quick else Budget()
    cores = available_cores()
    dtypes = ["fp32"] + (["bf16"] if bf16 == "native" and not quick else [])
    models = [model, *also]
    own = {s for m in models for s in gemm_shapes(m, plan, ranks, quick)}
    shapes = sorted(own | set(device_grid_shapes("cpu", quick)))
    grouped = sorted({s for m in models for s in grouped_shapes(m, plan, ranks, quick)})
    moe = next((m for m in models if m.is_moe), model)
    steps: list[tuple[str, Callable[[], list]]] = []
    for threads in thread_counts(cores):

        def at(fn: Callable[[], list], n: int = threads) -> Callable[[], list]:
            return at_threads(fn, n)

        for dtype in dtypes:
            for shape in shapes:
                label = f"matmul {dtype} {shape[0]}x{shape[1]}x{shape[2]} {shape[3]}, {threads}t"
                steps.append(
                    (
                        label,
                        at(
                            lambda s=shape, d=dtype, t=threads: [
                                measure_matmul(s, d, t, budget if s in own else GRID)
                            ]
                        ),
                    )
                )
            for shape in grouped:
                label = f"grouped matmul {dtype} {shape[0]} x {shape[1]}x{shape[2]}x{shape[3]}"
                steps.append(
                    (
                        f"{label}, {threads}t",
                        at(lambda s=shape, d=dtype, t=threads: measure_grouped(s, d, t, budget)),
                    )
                )
        steps += [
            (f"{label}, {threads}t", at(fn))
            for label, fn in attention_grid_steps("cpu", threads, GRID, quick, "fp32")
        ]
        for m in models:
            steps.append(
                (
                    f"attention {m.name}, {threads}t",
                    at(
                        lambda t=threads, m=m: list(
                            measure_attention(m, plan, ranks, t, budget, quick)
                        )
                    ),
                )
            )
        steps.append(
            (
                f"bandwidth, {threads}t",
                at(lambda t=threads: measure_bandwidth(model, plan, t, budget)),
            )
        )
        steps.append(
            (
                f"overhead, {threads}t",
                at(lambda t=threads: [measure_overhead(model, t, budget, moe, plan.micro_batch)]),
            )
        )
    return steps


def attention_grid_steps(
    kind: str, threads: int, budget: Budget, quick: bool, dtype: str
) -> list[tuple[str, Callable[[], list]]]:
    """The attention grid's two steps: one document per row (SDPA), then packed rows through
    the kernels runs use (`measure_packed_attention_grid`)."""
    return [
        (
            "attention grid",
            lambda: list(measure_attention_grid(kind, threads, budget, quick, dtype)),
        ),
        (
            "packed attention grid",
            lambda: list(measure_packed_attention_grid(kind, threads, budget, quick, dtype)),
        ),
    ]


def cuda_steps(
    model: ModelSpec, plan: ParallelPlan, ranks: int, quick: bool, also: tuple = ()
) -> list[tuple[str, Callable[[], list]]]:
    """`compute_steps` on a GPU (rows at threads = 1; training there runs bf16-mixed): the
    device grid and the models' GEMMs in bf16 and, where it runs natively, FP8; the experts'
    grouped matmuls in bf16; attention (the grid and each model's, bf16, SDPA as the model
    calls it); the element-wise, loss and optimizer bandwidths (fused AdamW) in HBM; the
    fixed cost of a dense and a MoE layer (kernel launches of a tiny model). Not measured
    there: CP block attention and the extra of TP, ZeRO and EP units (0 in the profile)."""
    budget = QUICK if quick else Budget()
    models = [model, *also]
    shapes = sorted(
        {s for m in models for s in gemm_shapes(m, plan, ranks, quick)}
        | set(device_grid_shapes("cuda", quick))
    )
    grouped = sorted({s for m in models for s in grouped_shapes(m, plan, ranks, quick)})
    moe = next((m for m in models if m.is_moe), model)
    steps: list[tuple[str, Callable[[], list]]] = []
    for dtype in ["bf16"] + (["fp8"] if fp8_supported() else []):
        for shape in shapes:
            if dtype == "fp8" and any(x % 16 for x in shape[:3]):  # `_scaled_mm`'s rule
                continue
            steps.append(
                (
                    f"matmul {dtype} {shape[0]}x{shape[1]}x{shape[2]} {shape[3]}",
                    lambda s=shape, d=dtype: [measure_matmul(s, d, 1, budget)],
                )
            )
    for shape in grouped:
        steps.append(
            (
                f"grouped matmul bf16 {shape[0]} x {shape[1]}x{shape[2]}x{shape[3]}",
                lambda s=shape: measure_grouped(s, "bf16", 1, budget),
            )
        )
    steps += attention_grid_steps("cuda", 1, budget, quick, "bf16")
    for m in models:
        steps.append(
            (
                f"attention {m.name}",
                lambda m=m: list(measure_attention(m, plan, ranks, 1, budget, quick, "bf16")),
            )
        )
    steps.append(("bandwidth", lambda: measure_bandwidth(model, plan, 1, budget)))
    steps.append(("overhead", lambda: [measure_launch_overhead(model, moe, budget)]))
    return steps
