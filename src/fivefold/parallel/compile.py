"""`train.compile = true`: `torch.compile` (inductor) on each transformer block.

Applied to a chunk after tensor/expert/context parallelism and activation checkpointing and
before FSDP/DDP wrap the blocks, the order torchtitan uses: each block (checkpoint wrapper
included) is replaced in `layers` by its compiled form, so the compiled graph sees the DTensor
and checkpointing code and FSDP's hooks stay outside it. Graph breaks are allowed (not
`fullgraph`): host-side code such as the expert-parallel all-to-all split sizes runs eagerly,
and so does the attention core, whose per-document spans are Python values that change with
every batch (compiled, each new packing of documents would recompile the block).
The compiled module keeps the block's parameters under `_orig_mod.`, which the deterministic
initialisation and torch's distributed state dicts strip, so names, initial values and
checkpoints are those of the uncompiled model.

On CPU inductor generates C++ and needs a compiler (g++ or $CXX). Compilation happens at the
first forward of each block; `compile_seconds()` is the time torch spent compiling so far.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from fivefold.errors import ConfigError


def check_compiler(device: torch.device) -> None:
    """`ConfigError` when inductor cannot build kernels for `device` (CPU without g++/$CXX)."""
    if device.type != "cpu":
        return
    compilers = [os.environ.get("CXX"), "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        raise ConfigError(
            "train.compile = true on CPU needs a C++ compiler for inductor (g++, clang++ or "
            "$CXX) and none was found; install one (e.g. apt-get install g++) or set "
            "train.compile = false."
        )


def _eager_attention_core(block: nn.Module) -> None:
    """Run the attention core outside the compiled graph (a graph break on each side).

    The core reads each batch's document boundaries as Python values (`DocumentLayout`); traced,
    every new packing of documents would recompile the block. Eager, it runs SDPA per document
    span as in the uncompiled model while the projections, RoPE, norms and MLP stay compiled.
    """
    for name, module in block.named_modules():
        if name == "attention.core" or name.endswith(".attention.core"):
            module.forward = torch.compiler.disable(module.forward)


def apply_compile(chunk: nn.Module) -> None:
    """Replace each of `chunk.layers` by `torch.compile(block)`, in place."""
    for name, block in list(chunk.layers.named_children()):
        _eager_attention_core(block)
        chunk.layers.register_module(name, torch.compile(block))


def compile_seconds() -> tuple[float, int]:
    """(seconds torch.compile has spent compiling in this process, graphs compiled)."""
    from torch._dynamo.utils import compilation_time_metrics

    times = compilation_time_metrics.get("_compile.compile_inner", [])
    return float(sum(times)), len(times)
