"""The planner's `fivefold-eager` per-layer activations are what autograd saves for this model.

Runs one block of the model forward under `torch.autograd.graph.saved_tensors_hooks` and counts
the distinct storages it saves (parameters excluded), then compares with
`planner.memory.layer_activation_bytes(..., runtime="fivefold-eager")`: exact, in fp32, for the
dense and MoE presets, with and without selective recompute (the core re-runs in backward), on
packed documents.
"""

from __future__ import annotations

import pytest
import torch

from fivefold.model import build_model
from fivefold.model.attention import DocumentLayout
from fivefold.model.rope import rope_cos_sin
from fivefold.parallel.checkpointing import apply_recompute
from fivefold.planner.memory import MemoryOptions, layer_activation_bytes
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.presets import MODEL_PRESETS

EAGER = MemoryOptions(runtime="fivefold-eager")


def saved_bytes(preset: str, layer: int, batch: int, recompute: str) -> int:
    """Bytes of the distinct non-parameter storages one block saves for its backward."""
    spec = MODEL_PRESETS[preset]
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(0)
    apply_recompute(model, recompute)
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

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params | shared:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
