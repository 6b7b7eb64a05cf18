"""Muon (momentum orthogonalised by Newton-Schulz) for the blocks' 2-D matrices, AdamW for the
rest, as one optimizer, on every layout: plain tensors or DTensor shards (ZeRO/FSDP2, TP, both).

The update of a matrix W [A, B] with gradient G is torch.optim.Muon's:
B <- lerp(B, G, 1 - mu); U = lerp(G, B, mu) (Nesterov); O = NS_k(U), k quintic Newton-Schulz
iterations on the whole matrix (bf16, or fp32 with `train.muon_ns_dtype`);
W <- W (1 - lr wd) - lr * scale(A, B) * O. The momentum buffer B (one, fp32, in W's own layout:
a shard stays a shard) and the elementwise steps run on each rank's shard; Newton-Schulz needs
the whole matrix, so U is all-gathered in the iteration's dtype (what NS_k casts it to first, so
the gather changes no bit), every rank holding a shard computes NS_k on the whole matrix and
keeps its own part of O. When this torch has torch.optim.Muon its Newton-Schulz and lr scale
are used (`torch_features` key "muon"); otherwise (a torch without it, or fp32)
`newton_schulz` and `lr_scale` below, a copy of the same arithmetic. In bf16 the rounding of a
different gradient-reduction order can flip (a layout's update differs from one process's by
bf16 rounding); in fp32 layouts agree to fp32 rounding.

Details and the lr conventions: docs/internals.md (`fivefold.train.muon`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from fivefold.model.torch_features import has

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's too
NS_EPS = 1e-7


def newton_schulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The orthogonalised [A, B] matrix (about U V^T of U S V^T = `update`), in `dtype`."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x.div_(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def lr_scale(kind: str, shape: torch.Size) -> float:
    """The lr multiplier of an [A, B] matrix: "original" sqrt(max(1, A / B)) (Keller Jordan),
    "match_rms_adamw" 0.2 sqrt(max(A, B)) (Moonshot: the update's RMS of AdamW's)."""
    rows, cols = shape[:2]
    if kind == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _own_adjusted_lr(lr: float, kind: str, shape: torch.Size) -> float:
    return lr * lr_scale(kind, shape)


def _torch_or_own(ns_dtype: str):
    """(orthogonalise, adjusted lr): torch.optim.Muon's when present and `ns_dtype` is its bf16,
    else this module's (in `ns_dtype`)."""
    if ns_dtype == "bf16" and has("muon"):
        from torch.optim import _muon

        return _muon._zeropower_via_newtonschulz, _muon._adjust_lr
    dtype = NS_DTYPES[ns_dtype]
    return (
        lambda update, coefficients, steps, eps: newton_schulz(
            update, coefficients, steps, eps, dtype
        ),
        _own_adjusted_lr,
    )


def whole(update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole matrix of `update` in `dtype` (an all-gather over its mesh when sharded), a
    tensor of its own (Newton-Schulz scales it in place)."""
    if isinstance(update, DTensor):
        return update.to(dtype).full_tensor()
    return update.to(dtype, copy=True)


def part_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole matrix `full`, laid out as `param` (no communication: every
    rank of the mesh holds the same `full`)."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer: groups marked `muon` step with Muon, the others with a torch AdamW that
    shares this optimizer's groups and state (so LR schedulers, `state_dict` and DCP see one
    ordinary optimizer). State: "momentum_buffer" per Muon matrix; AdamW's per other tensor."""

    def __init__(
        self, adamw: torch.optim.Optimizer, muon_params: list[torch.Tensor], **muon: Any
    ) -> None:
        self.adamw = adamw
        for group in adamw.param_groups:
            group["muon"] = False
        groups = list(adamw.param_groups)
        if muon_params:
            groups.append({"params": muon_params, "muon": True, **muon})
        super().__init__(groups, {})
        self._link()

    def _link(self) -> None:
        """The inner AdamW works on this optimizer's (possibly reloaded) groups and state."""
        self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonAdamW.step takes no closure"
        self.adamw.step()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)

    def _muon_group(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        orthogonalise, adjusted_lr = _torch_or_own(group["ns_dtype"])
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = orthogonalise(
                whole(update, NS_DTYPES[group["ns_dtype"]]),
                group["ns_coefficients"],
                group["ns_steps"],
                group["eps"],
            )
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(
                part_like(ortho, param),
                alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape),
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()
