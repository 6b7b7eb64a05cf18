"""FP8 linears (`plan.fp8 = "tensorwise"`) under tensor and sequence parallelism: the runtime
shards torchao's Float8Linear with torchao's float8 styles, and a TP2 run computes the loss and
gradients of the single-process FP8 run.

The CPU runs FP8 GEMMs through `torch._scaled_mm`'s CPU kernel (the runtime itself refuses FP8
on a CPU, `fivefold.parallel.float8.float8_problems`: no FP8 units). gloo has no float8 dtype,
so the test carries the FP8 all-gathers' bytes as uint8 (`_gloo_carries_fp8`), byte for byte
what NCCL moves.
"""

from __future__ import annotations

import pytest
import torch
from harness import spawn_ranks

from fivefold.model import build_model
from fivefold.specs import ModelSpec

pytest.importorskip("torchao")

# every linear but the LM head a multiple of 16 (FP8's GEMM rule) and converted (skip_small off)
SPEC = ModelSpec("f8", 2, 64, 4, kv_heads=2, ffn=96, vocab=256, seq_len=32, rope_theta=1e4)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _gloo_carries_fp8() -> list[tuple]:
    """gloo cannot all-gather float8 tensors: gather their bytes as uint8 (this rank only);
    returns the list the (dtype, shape) of each FP8 all-gather is appended to."""
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    funcol = torch.ops._c10d_functional
    gathered: list[tuple] = []

    def all_gather(aten_op, args, kwargs=None):
        fp8 = args[0]
        data = aten_op(fp8._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
        data = funcol.wait_tensor(data).view(fp8._data.dtype)
        gathered.append((str(data.dtype), tuple(data.shape)))
        role = (fp8._linear_mm_config, fp8._gemm_input_role)
        return Float8TrainingTensor(data, fp8._scale, fp8._orig_dtype, *role)

    float8_ops.FLOAT8_OPS_TABLE[funcol.all_gather_into_tensor.default] = all_gather
    return gathered


def _tokens() -> torch.Tensor:
    return torch.randint(
        0, SPEC.vocab, (2, SPEC.seq_len), generator=torch.Generator().manual_seed(1)
    )


def _fp8_run(rank: int, world: int, sp: bool) -> dict:
    """Loss, full gradients and the TP styles' module types of one forward/backward."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from fivefold.parallel.float8 import convert_linears
    from fivefold.parallel.tensor_parallel import apply_tensor_parallel

    with torch.device("meta"):
        model = build_model(SPEC)
    converted = convert_linears(model, "tensorwise", fsdp=False, skip_small=False)
    gathered: list[tuple] = []
    if world > 1:
        gathered = _gloo_carries_fp8()
        apply_tensor_parallel(model, init_device_mesh("cpu", (world,)), SPEC, sp)
    model.to_empty(device="cpu")
    model.init_weights(3)
    tokens = _tokens()
    logits = model(tokens)
    with loss_parallel() if world > 1 else torch.enable_grad():
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
    }
    weight = model.layers["0"].attention.wq.weight
    return {
        "loss": (loss.detach().full_tensor() if isinstance(loss, DTensor) else loss).item(),
        "grads": grads,
        "converted": converted,
        "gathered": gathered,
        "weight": (type(weight).__name__, tuple(weight.to_local().shape)) if world > 1 else None,
    }


def _reference(sp: bool) -> dict:
    return _fp8_run(0, 1, sp)


def test_the_runtime_shards_float8_linears_with_torchaos_float8_styles():
    """Each Float8Linear gets torchao's float8 colwise/rowwise style; a module's input is cast
    to FP8 before its all-gather only where every linear reading it is FP8 (here the MLP's, not
    the attention's: its key/value projections stay in high precision)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from fivefold.parallel.float8 import convert_linears
    from fivefold.parallel.tensor_parallel import _block_plan

    with torch.device("meta"):
        model = build_model(SPEC)
    convert_linears(model, "tensorwise", fsdp=False, skip_small=False)
    block = model.layers["0"]
    with torch.device("meta"):
        block.attention.wk = torch.nn.Linear(64, 32, bias=False)
        block.attention.wv = torch.nn.Linear(64, 32, bias=False)
    assert isinstance(block.attention.wq, Float8Linear)
    styles = {name: type(style) for name, style in _block_plan(block, True, None).items()}
    assert styles["attention"] is PrepareModuleInput  # wk, wv read it in high precision
    assert styles["attention.wq"] is Float8ColwiseParallel
    assert styles["attention.wk"] is ColwiseParallel
    assert styles["attention.wo"] is Float8RowwiseParallel
    assert styles["feed_forward"] is PrepareFloat8ModuleInput
    assert styles["feed_forward.w1"] is styles["feed_forward.w3"] is Float8ColwiseParallel
    assert styles["feed_forward.w2"] is Float8RowwiseParallel


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sp", [pytest.param(True, id="tp2-sp"), pytest.param(False, id="tp2", marks=pytest.mark.slow)]
)
def test_tp2_fp8_computes_the_single_process_fp8_loss_and_gradients(sp):
    """TP2 (+SP) with every block linear in FP8 (tensorwise) against the single-process FP8 run
    of the same weights and tokens: scales are global amaxes of the DTensors (the same scale as
    one process), so the FP8 operands are equal and only the partial sums' order differs. With
    SP each layer all-gathers its attention and MLP inputs in FP8 (e4m3) forward and the
    gradients of its two rowwise outputs in FP8 (e5m2) backward: 8 gathers for 2 layers."""
    reference = _reference(sp)
    ranks = spawn_ranks(2, _fp8_run, (sp,), pass_rank=True, timeout_s=280)
    assert len(reference["converted"]) == 2 * 7  # wq, wk, wv, wo, w1, w2, w3 per layer
    for out in ranks:
        assert out["converted"] == reference["converted"]
        assert out["weight"] == ("DTensor", (32, 64))  # wq [64, 64] split by rows
        assert out["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        for name, grad in reference["grads"].items():
            scale = float(grad.abs().max())
            assert float((out["grads"][name] - grad).abs().max()) <= 1e-5 * scale, name
        # each gather stacks the two ranks' halves [2, 16, 64] of the [2, 32, 64] activation
        shape = (2 * 2, SPEC.seq_len // 2, SPEC.hidden)
        expected = [("torch.float8_e4m3fn", shape)] * 4 + [("torch.float8_e5m2", shape)] * 4
        assert sorted(out["gathered"]) == (sorted(expected) if sp else [])


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b"])
def test_the_planner_prices_the_gathers_the_runtime_casts(name):
    """`fp8_tensor_parallel` (the planner's rule) names the module inputs and output gradients
    the runtime's styles gather in FP8, and its counts of converted colwise / rowwise linears
    (8B: K and V stay in bf16, so the attention input is gathered in bf16; 70B: all in FP8)."""
    from dataclasses import replace

    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from fivefold.parallel.float8 import convert_linears
    from fivefold.parallel.tensor_parallel import _block_plan
    from fivefold.specs.float8 import fp8_tensor_parallel
    from fivefold.specs.presets import model_preset

    spec = replace(model_preset(name), layers=1)
    with torch.device("meta"):
        model = build_model(spec)
    convert_linears(model, "tensorwise", fsdp=False)
    styles = {k: type(v) for k, v in _block_plan(model.layers["0"], True, None).items()}
    planned = fp8_tensor_parallel(spec, "tensorwise", moe=False)
    gathered = tuple(styles[m] is PrepareFloat8ModuleInput for m in ("attention", "feed_forward"))
    assert gathered == planned.gathered_inputs
    rowwise = ("attention.wo", "feed_forward.w2")
    assert tuple(styles[m] is Float8RowwiseParallel for m in rowwise) == planned.gathered_grads
    assert sum(s is Float8ColwiseParallel for s in styles.values()) == planned.colwise
    assert sum(s is Float8RowwiseParallel for s in styles.values()) == planned.rowwise
    assert planned.gathered_inputs == ((False, True) if name == "llama3-8b" else (True, True))
