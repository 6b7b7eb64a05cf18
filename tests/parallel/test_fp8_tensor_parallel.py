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


def _model(world: int, sp: bool, fp8: bool):
    """SPEC's model (its block linears in FP8 with `fp8`), TP over `world` ranks, initialised."""
    from torch.distributed.device_mesh import init_device_mesh

    from fivefold.parallel.float8 import convert_linears
    from fivefold.parallel.tensor_parallel import apply_tensor_parallel

    with torch.device("meta"):
        model = build_model(SPEC)
    converted = convert_linears(model, "tensorwise", fsdp=False, skip_small=False) if fp8 else []
    if world > 1:
        apply_tensor_parallel(model, init_device_mesh("cpu", (world,)), SPEC, sp)
    model.to_empty(device="cpu")
    model.init_weights(3)
    return model, converted


def _storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(data pointer, bytes) of the plain tensors inside `t` (a DTensor's local tensor, an FP8
    tensor's data and scale)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__"):
        return [s for name in t.__tensor_flatten__()[0] for s in _storages(getattr(t, name))]
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())]


def _saved_bytes(model, world: int, sp: bool) -> int:
    """Bytes of the distinct storages block 0 saves for its backward on this rank (parameters,
    the block input and the shared RoPE tables excluded), as tests/test_saved_activations.py."""
    from fivefold.model.document_layout import DocumentLayout
    from fivefold.model.rope import rope_cos_sin

    b, seq = 2, SPEC.seq_len
    x = torch.randn(b, seq // world if sp else seq, SPEC.hidden, requires_grad=True)
    rope = rope_cos_sin(torch.arange(seq).expand(b, seq), SPEC.head_dim, SPEC.rope_theta)
    skip = {ptr for p in model.parameters() for ptr, _ in _storages(p)}
    skip |= {ptr for t in (x, *rope) for ptr, _ in _storages(t)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.update((ptr, n) for ptr, n in _storages(t) if ptr not in skip)
        return t

    layout = DocumentLayout(torch.zeros(b, seq, dtype=torch.long), b, seq)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, rope, layout)
    return sum(saved.values())


def _fp8_run(rank: int, world: int, sp: bool, compile: bool = False) -> dict:
    """Loss and full gradients of one forward/backward with FP8 linears (`compile`: each block
    through torch.compile, as `train.compile`); on several ranks also the FP8 all-gathers and
    (eager) block 0's saved bytes with and without FP8."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from fivefold.parallel.compile import apply_compile

    gathered = _gloo_carries_fp8() if world > 1 else []
    model, converted = _model(world, sp, fp8=True)
    saved = {}
    if compile:
        apply_compile(model)
    elif world > 1:
        saved = {"fp8": _saved_bytes(model, world, sp)}
        saved["none"] = _saved_bytes(_model(world, sp, fp8=False)[0], world, sp)
        gathered.clear()  # the gathers of one forward and backward of the model only
    tokens = _tokens()
    logits = model(tokens)
    with loss_parallel() if world > 1 else torch.enable_grad():
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    grads = {
        name.replace("._orig_mod", ""): p.grad.full_tensor()
        if isinstance(p.grad, DTensor)
        else p.grad
        for name, p in model.named_parameters()
    }
    weight = model.layers["0"].attention.wq.weight
    return {
        "loss": (loss.detach().full_tensor() if isinstance(loss, DTensor) else loss).item(),
        "grads": grads,
        "converted": converted,
        "gathered": gathered,
        "saved": saved,
        "weight": (type(weight).__name__, tuple(weight.to_local().shape)) if world > 1 else None,
    }


def _planned_saving(sp: bool) -> float:
    """The planner's eager activations of block 0 (fp32, 2 x 32 tokens) without minus with FP8,
    with every block linear converted as here (the planner's size rule would keep these tiny
    ones in fp32). By hand (e = 4, s b = 64 gathered tokens, h 64, q / tp 32, f / tp 48): the
    two gathered inputs saved in FP8, 2 x 3 s b h; the MLP down projection's input, 3 s b f / tp;
    the output projection's FP8 copy beside the attention output, - s b q / tp; 4 fp32 scales.
    The blocks here are sharded by `apply_tensor_parallel` alone, without the runtime's
    re-gather of the high-precision gathered inputs (`fivefold.parallel.sp_regather`, measured
    by tests/test_sp_regather.py), so the planner's term for it is left out on both sides."""
    from fivefold.planner.memory import activations
    from fivefold.planner.memory.activations import layer_activation_bytes
    from fivefold.planner.memory.options import MemoryOptions
    from fivefold.specs.float8 import Fp8TensorParallel
    from fivefold.specs.plan import ParallelPlan

    every = Fp8TensorParallel((True, True), (True, True), colwise=5, rowwise=2)
    plan = ParallelPlan(tp=2, sp=sp, micro_batch=2, precision="fp32", fp8="tensorwise")
    eager = MemoryOptions(runtime="fivefold-eager")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(activations, "sp_regathered_inputs", lambda *args: 0)
        none = layer_activation_bytes(SPEC, plan.with_(fp8="none"), False, eager)
        patch.setattr(activations, "fp8_tensor_parallel", lambda *args: every)
        saving = none - layer_activation_bytes(SPEC, plan, False, eager)
    assert saving == 2 * 3 * 64 * 64 + 3 * 64 * 48 - 64 * 32 - 4 * 4
    return saving


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


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("sp", "compile"),
    [
        pytest.param(True, False, id="tp2-sp"),
        pytest.param(False, False, id="tp2", marks=pytest.mark.slow),
        pytest.param(True, True, id="tp2-sp-compiled", marks=pytest.mark.slow),
    ],
)
def test_tp2_fp8_computes_the_single_process_fp8_loss_and_gradients(sp, compile):
    """TP2 (+SP) with every block linear in FP8 (tensorwise) against the single-process FP8 run
    of the same weights and tokens: scales are global amaxes of the DTensors (the same scale as
    one process), so the FP8 operands are equal and only the partial sums' order differs. With
    SP each layer all-gathers its attention and MLP inputs in FP8 (e4m3) forward and the
    gradients of its two rowwise outputs in FP8 (e5m2) backward: 8 gathers for 2 layers."""
    reference = _reference(sp)
    ranks = spawn_ranks(2, _fp8_run, (sp, compile), pass_rank=True, timeout_s=850)
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
        if compile:  # dynamo's tracing passes through the gathers too: their kinds only
            assert {g[0] for g in out["gathered"]} == {g[0] for g in expected}
        else:
            assert sorted(out["gathered"]) == (sorted(expected) if sp else [])
        if not compile:  # the compiled blocks' saved tensors are not measured here
            assert out["saved"]["none"] - out["saved"]["fp8"] == _planned_saving(sp)


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
