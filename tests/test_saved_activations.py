"""The planner's `fivefold-eager` per-layer activations are what autograd saves for this model.

Runs one block of the model forward under `torch.autograd.graph.saved_tensors_hooks` and counts
the distinct storages it saves (parameters excluded), then compares with
`planner.activations.layer_activation_bytes(..., runtime="fivefold-eager")`: exact, in fp32, for the
dense and MoE presets, with and without selective recompute (the core re-runs in backward), on
packed documents. The same for a block compiled by inductor (`train.compile`,
`MemoryOptions(compiled=True)`): in fp32, under bf16 autocast, and with torchao's FP8
tensorwise linears (emulated casts: the CPU has no FP8 matmul), on a model whose attention
width differs from its hidden size so that every saved tensor is told apart by its shape.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fivefold.model import build_model
from fivefold.model.document_layout import DocumentLayout
from fivefold.model.rope import rope_cos_sin
from fivefold.parallel.activation_checkpoint import apply_recompute
from fivefold.planner.memory.activations import layer_activation_bytes
from fivefold.planner.memory.options import MemoryOptions
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import MODEL_PRESETS

EAGER = MemoryOptions(runtime="fivefold-eager")
# One process (no FSDP2): under bf16 autocast the compiled block keeps its weight copies.
COMPILED = MemoryOptions(runtime="fivefold-eager", compiled=True, fsdp_wrapped=False)
# q = 8 x 32 = 256 wide, hidden 192, k and v 128, ffn 512: no two saved widths coincide.
WIDE_Q = dataclasses.replace(
    MODEL_PRESETS["small"], hidden=192, heads=8, kv_heads=4, head_dim=32, ffn=512, seq_len=128
)


def saved_bytes(
    preset, layer: int, batch: int, recompute: str, compiled: bool = False, autocast=None, fp8=""
) -> int:
    """Bytes of the distinct non-parameter storages one block saves for its backward; `preset`
    a name or a `ModelSpec`; `compiled`: the block compiled (one warm-up step first, outside
    the hooks); `autocast`: a CPU autocast dtype; `fp8`: torchao's recipe, emulated."""
    spec = MODEL_PRESETS[preset] if isinstance(preset, str) else preset
    model = build_model(spec)
    if fp8:  # as the runtime converts (its filter), with emulated FP8 matmuls
        from fivefold.parallel import float8

        real = float8.float8_config
        emulated = lambda *a: dataclasses.replace(real(*a), emulate=True)  # noqa: E731
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(float8, "float8_config", emulated)
            float8.convert_linears(model, fp8, fsdp=False)
    model.to_empty(device="cpu")
    model.init_weights(0)
    apply_recompute(model, recompute)
    if compiled:
        from fivefold.parallel.compile import apply_compile

        apply_compile(model)
    block = model.layers[str(layer)]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seq = spec.seq_len
    x = torch.randn(batch, seq, spec.hidden, requires_grad=True)
    positions = torch.arange(seq).expand(batch, seq)
    # Packed data: two documents per row (the per-document attention path).
    doc_ids = (torch.arange(seq) >= seq // 3).long().expand(batch, seq)
    # The RoPE tables are built once per forward by the model and shared by its layers: the
    # planner counts them once per chunk, not here.
    rope = rope_cos_sin(positions, spec.head_dim, spec.rope_theta)
    # The doc ids are the batch's own tensor, saved by reference by the attention op.
    shared = {x.data_ptr(), doc_ids.untyped_storage().data_ptr()}
    shared |= {t.untyped_storage().data_ptr() for t in rope}
    saved: dict[int, int] = {}
    context = torch.autocast("cpu", dtype=autocast, enabled=autocast is not None)
    if compiled:  # compile outside the hooks
        with context:
            block(x, rope, DocumentLayout(doc_ids, batch, seq)).sum().backward()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params | shared:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        block(x, rope, DocumentLayout(doc_ids, batch, seq))
    # The block input is the previous layer's output: the planner counts it as the norm's
    # fp32 input (the same storage in fp32).
    return sum(saved.values()) + x.numel() * 4


@pytest.mark.parametrize(("preset", "layer"), [("small", 0), ("tiny", 1), ("tiny-moe", 1)], ids=str)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_eager_layer_bytes_equal_autograds_saved_tensors(preset, layer, recompute) -> None:
    spec = MODEL_PRESETS[preset]
    plan = ParallelPlan(precision="fp32", micro_batch=2, recompute=recompute)
    moe = spec.is_moe and layer >= spec.dense_layers
    predicted = layer_activation_bytes(spec, plan, moe, EAGER)
    assert predicted == saved_bytes(preset, layer, 2, recompute)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_qk_norm_and_bias_layer_bytes_equal_autograds_saved_tensors(recompute) -> None:
    """Qwen's variants: the biases keep nothing; each QK-norm keeps its input (fp32 here; q 256
    and k 128 wide, s b = 256 tokens) and an fp32 reciprocal RMS per head and token (8 query
    and 4 key heads)."""
    spec = dataclasses.replace(WIDE_Q, qk_norm=True, qkv_bias=True)
    plan = ParallelPlan(precision="fp32", micro_batch=2, recompute=recompute)
    measured = saved_bytes(spec, 0, 2, recompute)
    assert layer_activation_bytes(spec, plan, False, EAGER) == measured
    plain = layer_activation_bytes(WIDE_Q, plan, False, EAGER)
    assert measured - plain == 256 * (4 * (256 + 128) + 4 * (8 + 4))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "autocast"), [("fp32", None), ("bf16-mixed", torch.bfloat16)]
)
def test_compiled_qk_norm_layer_bytes_equal_the_compiled_blocks_saved_tensors(precision, autocast):
    """Compiled, each QK-norm keeps only its input (activation dtype) and the per-head rstd."""
    spec = dataclasses.replace(WIDE_Q, ffn=2048, qk_norm=True, qkv_bias=True)
    plan = ParallelPlan(precision=precision, micro_batch=2)
    measured = saved_bytes(spec, 0, 2, "none", True, autocast)
    assert layer_activation_bytes(spec, plan, False, COMPILED) == measured
    plain = layer_activation_bytes(dataclasses.replace(spec, qk_norm=False), plan, False, COMPILED)
    e = 2 if autocast else 4
    assert measured - plain == 256 * (e * (256 + 128) + 4 * (8 + 4))


@pytest.mark.parametrize(
    ("precision", "autocast", "fp8"),
    [
        ("fp32", None, "none"),
        ("bf16-mixed", torch.bfloat16, "none"),
        ("fp32", None, "tensorwise"),
        ("fp32", None, "rowwise"),
    ],
    ids=["fp32", "bf16-autocast", "fp8-tensorwise", "fp8-rowwise"],
)
def test_compiled_layer_bytes_equal_the_compiled_blocks_saved_tensors(precision, autocast, fp8):
    if fp8 != "none":
        pytest.importorskip("torchao.float8")
    plan = ParallelPlan(precision=precision, micro_batch=2, fp8=fp8)
    spec = dataclasses.replace(WIDE_Q, ffn=2048)
    predicted = layer_activation_bytes(spec, plan, False, COMPILED)
    measured = saved_bytes(spec, 0, 2, "none", True, autocast, "" if fp8 == "none" else fp8)
    assert predicted == measured
    # By hand (s b = 256 tokens, h 192, q 256, k = v 128, f 2048, 8 heads; e = 4 fp32, 2 bf16):
    # block input 4 sbh + output projection's output e sbh + 2 x (rstd 4 sb + norm output
    # e sbh) + q, k, v, attention output e sb (2q + 2k) + LSE 4 sb heads + 3 e sb f; bf16
    # autocast adds the seven weights' bf16 copies. FP8 converts only what gains (the runtime's
    # filter): tensorwise w1 and w3 (2048 x 192; the others have N <= 1024 and K <= 4096), whose
    # shared input, the MLP norm's output, is then recomputed in the backward, and keeps one
    # fp32 scale for each; rowwise converts nothing at these widths.
    sb, h, f, e = 256, 192, 2048, 2 if autocast else 4
    by_hand = 4 * sb * h + e * sb * h + 2 * (4 * sb + e * sb * h)
    by_hand += e * sb * (2 * 256 + 2 * 128) + 4 * sb * 8 + 3 * e * sb * f
    if autocast:
        by_hand += e * (192 * (256 + 2 * 128) + 256 * 192 + 3 * 192 * f)
    if fp8 == "tensorwise":
        by_hand -= e * sb * h - 2 * 4
    assert measured == by_hand


def test_the_planners_compile_option_counts_compiled_blocks() -> None:
    """`[planner] compile` / `plan --compile` reach the memory model. The eager runtime's norms
    and SwiGLU keep what the compiled block keeps (input and reciprocal RMS; three ffn-wide
    tensors), so in fp32 the two are equal; in bf16 a compiled block keeps its input in fp32
    (`CompiledProfile.norm_inputs_fp32`), eager in bf16: 2 sbh bytes more per dense layer,
    hand-derived from the profiles."""
    from fivefold.planner.memory.stage import all_stage_memory
    from fivefold.planner.options import PlannerOptions

    spec = MODEL_PRESETS["small"]
    eager = PlannerOptions(runtime="fivefold-eager").memory()
    compiled = PlannerOptions(runtime="fivefold-eager", compile=True).memory()
    assert (eager.compiled, compiled.compiled) == (False, True)
    sb = 2 * spec.seq_len
    for precision, more in (("fp32", 0), ("bf16-mixed", 2)):
        plan = ParallelPlan(precision=precision, micro_batch=2)
        before = all_stage_memory(spec, plan, [1], eager)[0].activations
        after = all_stage_memory(spec, plan, [1], compiled)[0].activations
        assert after - before == spec.layers * more * sb * spec.hidden
    plan = ParallelPlan(precision="fp32", micro_batch=2)
    fused = PlannerOptions(compile=True).memory()  # the fused model already counts fusion
    assert all_stage_memory(spec, plan, [1], fused) == all_stage_memory(
        spec, plan, [1], PlannerOptions().memory()
    )
