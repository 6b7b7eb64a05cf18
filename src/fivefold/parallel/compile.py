"""`train.compile = true`: `torch.compile` (inductor) on each transformer block.

Details: docs/internals.md (`fivefold.parallel.compile`).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch._functorch.config
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack

from fivefold.errors import ConfigError
from fivefold.model.attention import AttentionCore
from fivefold.model.document_layout import DocumentLayout
from fivefold.model.sliding_window import effective_window


def has_cpu_compiler() -> bool:
    """Whether inductor can build C++ kernels on this machine (g++, clang++ or $CXX found)."""
    return any(c and shutil.which(c) for c in (os.environ.get("CXX"), "g++", "clang++"))


def check_compiler(device: torch.device) -> None:
    """`ConfigError` when inductor cannot build kernels for `device` (CPU without g++/$CXX)."""
    if device.type == "cpu" and not has_cpu_compiler():
        raise ConfigError(
            "train.compile = true on CPU needs a C++ compiler for inductor (g++, clang++ or "
            "$CXX) and none was found; install one (e.g. apt-get install g++) or set "
            "train.compile = false."
        )


def _eager_context_parallel_core(block: nn.Module) -> None:
    """Run a context-parallel attention core outside the compiled graph (a graph break on each
    side): it exchanges K/V blocks with hand-written collectives over per-batch document spans
    (Python values; traced, every new packing of documents would recompile the block)."""
    for name, module in block.named_modules():
        is_core = name == "attention.core" or name.endswith(".attention.core")
        if is_core and not isinstance(module, AttentionCore):
            module.forward = torch.compiler.disable(module.forward)


class _WaitCollective(torch.autograd.Function):
    """An `AsyncCollectiveTensor` [any shape] -> the same values as a plain tensor, waited;
    the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        waited = x.trigger_wait()
        return waited.view_as(waited)  # a new tensor object: the wrapper's own stays untouched

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait_async_inputs(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: hand the compiled block plain tensors, never `AsyncCollectiveTensor`s.

    Tensor parallelism's output styles redistribute asynchronously, so an eager producer (the
    embedding) hands the first block its activations wrapped in an `AsyncCollectiveTensor`.
    torch 2.13's AOTAutograd unwraps such a graph input with `trigger_wait()`, whose result
    does not require grad, and traces the block as if its input needed no gradient: the
    gradient to the producer was silently dropped (pytorch/pytorch#191113). Waiting here,
    inside an autograd function, keeps the edge.
    """
    return tuple(
        _WaitCollective.apply(a) if isinstance(a, AsyncCollectiveTensor) else a for a in args
    )


def _read_documents(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: read the batch's document layout eagerly (once per forward, cached on
    the `DocumentLayout`), so the compiled block branches on a plain bool: one-document rows
    run SDPA inside the graph, packed rows the `document_attention` op (CPU) or FlexAttention
    (CUDA), whose `BlockMask` is built here, on the host, before the graph runs (within the
    layer's sliding window, if any)."""
    docs = args[2] if len(args) > 2 else None
    if not isinstance(docs, DocumentLayout) or docs.single_document:  # computed and cached
        return
    if args[0].device.type == "cuda":
        layer_window = getattr(getattr(module, "attention", None), "window", 0)
        window = effective_window(layer_window, docs.seq_len)
        docs.flex_block_mask(args[0].device, window)


def _single_process_core(block: nn.Module) -> bool:
    return any(isinstance(m, AttentionCore) for m in block.modules())


def _eager_under_dispatch_modes(compiled: nn.Module, block: nn.Module) -> None:
    """Call `block` itself, bypassing dynamo, while a TorchDispatchMode is active.

    The loop measures one step's CPU memory under a dispatch mode, where dynamo runs the frame
    eagerly anyway; but torch 2.13's dynamo then marks the code object as skipped for good, so
    every later step ran eagerly too (pytorch/pytorch#190286). Not entering dynamo keeps the
    compiled blocks compiled after the measured step.
    """
    compiled_forward = compiled.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if _dispatch_mode_stack():
            return block(*args, **kwargs)
        return compiled_forward(*args, **kwargs)

    compiled.forward = forward


def _no_autograd_cache_across_ranks() -> None:
    """Turn off AOTAutograd's on-disk cache when this process is one rank of several (see the
    module docstring); a single process keeps it."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch._functorch.config.enable_autograd_cache = False


def apply_compile(chunk: nn.Module, backend: Any = "inductor") -> None:
    """Replace each of `chunk.layers` by `torch.compile(block, backend=backend)`, in place."""
    _no_autograd_cache_across_ranks()
    for name, block in list(chunk.layers.named_children()):
        _eager_context_parallel_core(block)
        compiled = torch.compile(block, backend=backend)
        _eager_under_dispatch_modes(compiled, block)
        compiled.register_forward_pre_hook(_wait_async_inputs)
        if _single_process_core(block):
            compiled.register_forward_pre_hook(_read_documents)
        chunk.layers.register_module(name, compiled)


def compile_seconds() -> tuple[float, int]:
    """(seconds torch.compile has spent compiling in this process, graphs compiled)."""
    from torch._dynamo.utils import compilation_time_metrics  # here: seconds to import

    times = compilation_time_metrics.get("_compile.compile_inner", [])
    return float(sum(times)), len(times)
