"""Peak memory of a training step.

On CUDA, `torch.cuda.max_memory_allocated` is exact and free. On CPU neither it nor tracemalloc
sees torch's allocations and RSS undercounts, so we count tensor storages ourselves: a
`TorchDispatchMode` sees every tensor an operator returns, and each storage is counted once from
the moment it first appears until it is garbage-collected (a weak reference's callback), the way
PyTorch's `MemTracker` does. PyTorch's MemTracker itself cannot be used here: it refuses a module
that is called more than once per step (gradient accumulation, recompute). Tensors that exist
before the step (parameters, gradients, optimizer state) are registered up front. Memory inside
an operator (workspaces) and storages resized in place are not seen, so the figure is the peak
of live tensor storage; the loop measures one step with it and leaves that step out of
throughput, as the bookkeeping slows it down.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind `tensor` (the local shard's for a DTensor); none for meta tensors."""
    local = getattr(tensor, "_local_tensor", None)
    if local is not None:
        tensor = local
    if tensor.device.type == "meta":
        return []
    try:
        return [tensor.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # storage-less tensor subclasses
        return []


class StorageCounter(TorchDispatchMode):
    """Counts live bytes of every storage it has seen; `peak_bytes` is the maximum so far."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current_bytes = 0
        self.peak_bytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        for storage in _storages(tensor):
            if storage in self._seen:
                continue
            size = storage.nbytes()
            self._seen[storage] = weakref.ref(storage, self._freed_callback(size))
            self.current_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _freed_callback(self, size: int):
        def freed(_ref: weakref.ref) -> None:
            self.current_bytes -= size

        return freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)
        return out


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def module_tensors(modules: Iterable[nn.Module]) -> Iterator[torch.Tensor]:
    for module in modules:
        for param in module.parameters():
            yield param
            if param.grad is not None:
                yield param.grad
        yield from module.buffers()


@dataclass
class PeakReading:
    """Set when the tracked block exits: peak bytes of live tensor storage (0 = unmeasured)."""

    peak_bytes: int = 0
    start_bytes: int = 0  # parameters, gradients and optimizer state before the block
    method: str = ""


@contextmanager
def track_cpu_peak(
    modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None
) -> Iterator[PeakReading]:
    """Measure the peak live tensor bytes of the enclosed block, counting the modules' and the
    optimizer's existing tensors from the start."""
    reading = PeakReading(method="tensor storages counted by a dispatch mode, one step")
    counter = StorageCounter()
    for tensor in (*module_tensors(modules), *optimizer_tensors(optimizer)):
        counter.add(tensor)
    reading.start_bytes = counter.current_bytes
    with counter:
        yield reading
    reading.peak_bytes = counter.peak_bytes
