"""Deterministic, layout-independent weight initialisation.

Every parameter is drawn from its own `torch.Generator` seeded by a hash of (seed, FQN), where the
FQN is the parameter's name inside the full `Transformer` (wrapper prefixes such as
`_checkpoint_wrapped_module.` removed). The values therefore do not depend on which sub-modules
exist (pipeline stages delete layers), on the order of initialisation, or on the device.

Rules: RMSNorm weights 1; every other weight normal(0, 0.02), except the projections that write
into the residual stream (attention `wo`, MLP and expert `w2`), whose std is 0.02 / sqrt(2 L)
with L = the model's total number of layers.

Parallel code: initialise the full tensors before sharding, or shard first and call this on
DTensor parameters (each rank draws the full tensor on CPU and keeps its own shard; no
communication). Plain local shards cut by hand must be initialised before cutting.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch
from torch import nn

from fivefold.model.norms import RMSNorm

INIT_STD = 0.02
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_RESIDUAL_OUTPUT_SUFFIXES = ("attention.wo.weight", ".w2.weight", "experts.w2")


def canonical_fqn(name: str) -> str:
    """Parameter name with wrapper prefixes (activation checkpointing, compile) removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed from (seed, FQN), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{canonical_fqn(fqn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _fill_full(fqn: str, shape: torch.Size, is_norm: bool, seed: int, layers: int) -> torch.Tensor:
    """The full fp32 CPU value of one parameter."""
    if is_norm:
        return torch.ones(shape)
    std = INIT_STD
    if canonical_fqn(fqn).endswith(_RESIDUAL_OUTPUT_SUFFIXES):
        std = INIT_STD / math.sqrt(2 * layers)
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` into `param`, keeping only this rank's shard when `param` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_module_weights(
    module: nn.Module,
    seed: int,
    layers: int,
    prefix: str = "",
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Initialise every parameter of `module` (materialised, e.g. after `to_empty`).

    `prefix` is the module's FQN inside the full Transformer ("" for the Transformer itself,
    e.g. "layers.3." for one block), `layers` the full model's number of layers. `aliases` maps
    an FQN to the one whose values it must share (a tied LM head on its own pipeline stage).
    """
    aliases = aliases or {}
    seen: set[int] = set()  # a tied weight is drawn once, under its first FQN
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            fqn = prefix + (f"{module_name}.{param_name}" if module_name else param_name)
            fqn = aliases.get(canonical_fqn(fqn), fqn)
            full = _fill_full(fqn, param.shape, isinstance(sub, RMSNorm), seed, layers)
            _assign(param, full.to(dtype=param.dtype))
