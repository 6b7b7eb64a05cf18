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
from fivefold.planner.activations import layer_activation_bytes
from fivefold.planner.memory_options import MemoryOptions
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
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(fp8), emulate=True)
        convert_to_float8_training(model, config=config)
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
    predicted = layer_activation_bytes(WIDE_Q, plan, False, COMPILED)
    measured = saved_bytes(WIDE_Q, 0, 2, "none", True, autocast, "" if fp8 == "none" else fp8)
    assert predicted == measured
    # By hand (s b = 256 tokens, h 192, q 256, k = v 128, f 512, 8 heads; e = 4 fp32, 2 bf16):
    # block input 4 sbh + output projection's output e sbh + 2 x (rstd 4 sb + norm output
    # e sbh) + q, k, v, attention output e sb (2q + 2k) + LSE 4 sb heads + 3 e sb f; bf16
    # autocast adds the seven weights' bf16 copies; FP8 drops both norm outputs and the
    # SwiGLU product (recomputed in the backward) and tensorwise keeps one fp32 scale for each
    # of the seven linears.
    sb, h, e = 256, 192, 2 if autocast else 4
    by_hand = 4 * sb * h + e * sb * h + 2 * (4 * sb + e * sb * h)
    by_hand += e * sb * (2 * 256 + 2 * 128) + 4 * sb * 8 + 3 * e * sb * 512
    if autocast:
        by_hand += e * (192 * (256 + 2 * 128) + 256 * 192 + 3 * 192 * 512)
    if fp8 != "none":
        by_hand -= e * sb * (2 * h + 512) - (7 * 4 if fp8 == "tensorwise" else 0)
    assert measured == by_hand


def test_the_planners_compile_option_counts_compiled_blocks() -> None:
    """`[planner] compile` / `plan --compile` reach the memory model: in fp32 a compiled dense
    layer keeps 8 sbh bytes less for its norms (one fp32 tensor per norm instead of two) and one
    fp32 SwiGLU tensor less (4 sbf), hand-derived from the profiles; eager stays as it was."""
    from fivefold.planner.memory import all_stage_memory
    from fivefold.planner.options import PlannerOptions

    spec = MODEL_PRESETS["small"]
    plan = ParallelPlan(precision="fp32", micro_batch=2)
    eager = PlannerOptions(runtime="fivefold-eager").memory()
    compiled = PlannerOptions(runtime="fivefold-eager", compile=True).memory()
    assert (eager.compiled, compiled.compiled) == (False, True)
    before = all_stage_memory(spec, plan, [1], eager)[0].activations
    after = all_stage_memory(spec, plan, [1], compiled)[0].activations
    sb = 2 * spec.seq_len
    assert before - after == spec.layers * 4 * sb * (2 * spec.hidden + spec.ffn)
    fused = PlannerOptions(compile=True).memory()  # the fused model already counts fusion
    assert all_stage_memory(spec, plan, [1], fused) == all_stage_memory(
        spec, plan, [1], PlannerOptions().memory()
    )
