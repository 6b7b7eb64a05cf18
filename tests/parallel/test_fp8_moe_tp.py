"""FP8 + MoE + TP: tensorwise FP8 on the attention and shared-expert linears of a tiny MoE
model under TP2 + SP with expert parallelism over the TP pair (geometry's expert rule: each TP
rank routes its own tokens to whole experts; the routed experts' grouped GEMMs and the router
stay in high precision), against the single-process FP8 run of the same weights and tokens,
at the tolerance of the dense FP8 TP case (tests/parallel/test_fp8_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from harness import spawn_ranks
from test_fp8_tensor_parallel import _gloo_carries_fp8

from fivefold.model import build_model
from fivefold.specs import ModelSpec

pytest.importorskip("torchao")

# every converted linear a multiple of 16 (FP8's GEMM rule); 4 experts, top-2, a shared expert
SPEC = ModelSpec(
    "f8moe", 2, 64, 4, kv_heads=2, ffn=96, vocab=256, seq_len=32, rope_theta=1e4,
    experts=4, top_k=2, expert_ffn=32, shared_experts=1,
)  # fmt: skip


def _run(rank: int, world: int) -> dict:
    """Cross-entropy loss and full gradients of one forward and backward (the load-balancing
    loss left out: its weighting is the runtime's, not this check's); on 2 ranks TP2+SP and EP2
    over the same 2 ranks."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from fivefold.parallel.expert_parallel import apply_expert_parallel
    from fivefold.parallel.float8 import convert_linears
    from fivefold.parallel.tensor_parallel import apply_tensor_parallel

    gathered = _gloo_carries_fp8() if world > 1 else []
    with torch.device("meta"):
        model = build_model(SPEC)
    converted = convert_linears(model, "tensorwise", fsdp=False, skip_small=False)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        apply_tensor_parallel(model, mesh, SPEC, True)
        apply_expert_parallel(model, mesh, aux_group=mesh.get_group(), expert_grad_scale=1.0)
    model.to_empty(device="cpu")
    model.init_weights(3)
    tokens = torch.randint(
        0, SPEC.vocab, (2, SPEC.seq_len), generator=torch.Generator().manual_seed(1)
    )
    logits = model(tokens)
    with loss_parallel() if world > 1 else torch.enable_grad():
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
    }
    full = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss
    w1 = model.layers["0"].moe.experts.w1
    experts = (w1.to_local() if isinstance(w1, DTensor) else w1).shape[0]
    out = {"loss": full.item(), "grads": grads, "converted": converted, "gathered": gathered}
    return {**out, "local_experts": experts}


@pytest.mark.slow  # 64 s at load average 16 on the 2 cores
@pytest.mark.timeout(900)
def test_fp8_moe_tp2_sp_ep2_computes_the_single_process_fp8_loss_and_gradients():
    reference = _run(0, 1)
    ranks = spawn_ranks(2, _run, (), pass_rank=True, timeout_s=850)
    assert reference["converted"], "no linear was converted to FP8"
    assert not any("experts.w" in name or "router" in name for name in reference["converted"])
    for out in ranks:
        assert out["converted"] == reference["converted"]
        assert out["local_experts"] == 2  # EP2: two of the 4 experts per rank
        assert out["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        for name, grad in reference["grads"].items():
            scale = float(grad.abs().max())
            assert float((out["grads"][name] - grad).abs().max()) <= 1e-5 * scale, name
        assert any("float8" in dtype for dtype, _ in out["gathered"])  # FP8 all-gathers ran
