"""Peak memory of a training step, counted the way the allocator sees it, tenant by tenant.

On CUDA, `torch.cuda.max_memory_allocated` is exact and free: `track_cuda_peak` resets the
peak statistics before the measured step (so that start-up, checkpoint loading, compilation and
evaluation are not in it) and reads the allocated peak (live tensors, comparable with a
prediction without CUDA context and fragmentation) and the reserved peak plus the context
(comparable with the whole prediction). On CPU neither it nor tracemalloc
sees torch's allocations and RSS undercounts, so we count tensor storages ourselves, as PyTorch's
`MemTracker` does (which cannot be used here: it refuses a module called more than once per step,
as with gradient accumulation or recompute):

- a `TorchDispatchMode` sees every tensor an operator returns; each storage is counted from the
  moment it first appears until it is garbage-collected (a weak reference's callback); DTensor
  operators are left to DTensor, whose local operators it then sees (temporaries included);
- resize-aware: `UntypedStorage.resize_` is not an operator, and FSDP2 frees and re-allocates
  its gathered parameters with `storage.resize_(0)` / `resize_(n)`, so the counter wraps it
  while active and counts each storage at its current size;
- tensors that exist before the step (parameters, gradients, optimizer state) are registered up
  front with their tenant, and so are the tensors a module's owner keeps between steps outside
  its parameters and buffers, which a module lists with a `held_tensors()` attribute (the
  pipeline's receive buffers, `fivefold.parallel.pipeline.PipelineRunner.held_tensors`): they
  are counted from the start until they are freed or replaced.

Each storage's live intervals are kept (start and end on an event counter), so when the step
ends the peak can be split into tenants: `params` (the local parameters at rest), `grads` (the
storages that are a parameter's `.grad` when the optimizer steps, or at the end of the block),
`optimizer` (its state) and `activations` (everything else: saved tensors, gathered parameters,
communication buffers, logits, temporaries). Memory inside an operator (workspaces) is not seen;
the figure is the peak of live tensor storage.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

TENANTS = ("params", "grads", "optimizer", "activations")
try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # a torch build without distributed support
    _DTENSOR = None


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


@dataclass
class _Record:
    """One storage: its tenant and its live intervals [(bytes, start, end or None)]."""

    kind: str
    intervals: list[list] = field(default_factory=list)

    @property
    def size(self) -> int:
        last = self.intervals[-1] if self.intervals else None
        return last[0] if last is not None and last[2] is None else 0


class StorageCounter(TorchDispatchMode):
    """Counts live bytes of every storage it has seen; `peak_bytes` is the maximum so far and
    `peak_tenants()` splits it (see the module docstring). Entering it also wraps
    `UntypedStorage.resize_` so in-place resizes are counted."""

    def __init__(self) -> None:
        super().__init__()
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._all: list[_Record] = []
        self._event = 0
        self._peak_event = 0
        self._original_resize = None
        self.current_bytes = 0
        self.peak_bytes = 0

    # ---- events ------------------------------------------------------------------------------
    def _tick(self, delta: int) -> None:
        self._event += 1
        self.current_bytes += delta
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_event = self._event

    def _open(self, record: _Record, size: int) -> None:
        if size:
            self._tick(size)
            record.intervals.append([size, self._event, None])

    def _close(self, record: _Record) -> None:
        size = record.size
        if size:
            self._tick(-size)
            record.intervals[-1][2] = self._event

    def add(self, tensor: torch.Tensor, kind: str = "activations") -> None:
        """Start counting `tensor`'s storage (once) as tenant `kind`."""
        for storage in _storages(tensor):
            self.add_storage(storage, kind)

    def add_storage(self, storage: torch.UntypedStorage, kind: str = "activations") -> _Record:
        entry = self._records.get(storage)
        if entry is not None:
            return entry[0]
        record = _Record(kind)
        self._records[storage] = (record, weakref.ref(storage, self._freed_callback(record)))
        self._all.append(record)
        self._open(record, storage.nbytes())
        return record

    def mark(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Label the storages of `tensors` (counted already or not) as tenant `kind`."""
        for tensor in tensors:
            for storage in _storages(tensor):
                self.add_storage(storage, kind).kind = kind

    def _freed_callback(self, record: _Record):
        def freed(_ref: weakref.ref) -> None:
            self._close(record)

        return freed

    def _resized(self, storage: torch.UntypedStorage) -> None:
        record = self.add_storage(storage)
        if record.size != storage.nbytes():
            self._close(record)
            self._open(record, storage.nbytes())

    # ---- the dispatch mode and the resize wrapper ---------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTENSOR is not None and any(t is _DTENSOR for t in types):
            # Let DTensor run first and come back as local ops (torch's MemTracker does the
            # same): a handler's temporaries (loss_parallel's backward, redistributions) count.
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            return args[0]  # its fake kernel returns a new tensor; a real wait returns its input
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode_on_entry:
            return out  # DTensor's sharding propagation computing shapes: no memory in a run
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)
        return out

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        counter = self

        def resize_(storage, size):
            result = original(storage, size)
            counter._resized(storage)
            return result

        self._original_resize = original
        self._fake_mode_on_entry = active_fake_mode()
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    # ---- the peak split into tenants ------------------------------------------------------------
    def peak_tenants(self) -> dict[str, int]:
        """Bytes of each tenant live at the moment of the peak."""
        out = dict.fromkeys(TENANTS, 0)
        at = self._peak_event
        for record in self._all:
            for size, start, end in record.intervals:
                if start <= at and (end is None or end > at):
                    out[record.kind] = out.get(record.kind, 0) + size
        return out


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """The optimizer's state tensors (a quantised state as the tensors inside it) and what it
    holds besides (`held_tensors()`: e.g. host master weights under CPU offload)."""
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield from _inner_tensors(value)
    held = getattr(optimizer, "held_tensors", None)
    if callable(held):
        yield from held()


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor subclass without storage of its own (torchao's OptimState8bit) as its parts."""
    local = getattr(tensor, "_local_tensor", tensor)
    flatten = getattr(type(local), "__tensor_flatten__", None)
    if flatten is None or type(local) is torch.Tensor:
        return [tensor]
    names, _ = flatten(local)
    return [getattr(local, name) for name in names]


def parameters(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    return [param for module in modules for param in module.parameters()]


def gradients(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    return [p.grad for p in parameters(modules) if p.grad is not None]


@dataclass
class PeakReading:
    """Set when the tracked block exits: peak bytes of live tensor storage (0 = unmeasured), the
    bytes registered before the block, and the peak split into tenants (`TENANTS`)."""

    peak_bytes: int = 0
    start_bytes: int = 0  # parameters, gradients and optimizer state before the block
    method: str = ""
    tenants: dict[str, int] = field(default_factory=dict)
    # CUDA: the caching allocator's peak reserved bytes plus the CUDA context and libraries
    # (the device's used memory less what the allocator reserves); 0 on CPU.
    reserved_bytes: int = 0


@contextmanager
def track_cpu_peak(
    modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None
) -> Iterator[PeakReading]:
    """Measure the peak live tensor bytes of the enclosed block, counting the modules' and the
    optimizer's existing tensors from the start. Gradients are labelled when the optimizer
    steps (all micro-batches accumulated) and again at the end of the block."""
    modules = list(modules)
    reading = PeakReading(method="tensor storages counted by a dispatch mode, resize-aware")
    counter = StorageCounter()
    counter.mark(parameters(modules), "params")
    counter.mark(gradients(modules), "grads")
    for module in modules:
        counter.mark(module.buffers(), "activations")
        held = getattr(module, "held_tensors", None)
        if callable(held):
            counter.mark(held(), "activations")
    counter.mark(optimizer_tensors(optimizer), "optimizer")
    reading.start_bytes = counter.current_bytes
    hook = None
    if optimizer is not None:
        hook = optimizer.register_step_pre_hook(
            lambda *_: counter.mark(gradients(modules), "grads")
        )
    try:
        with counter:
            yield reading
            counter.mark(gradients(modules), "grads")
    finally:
        if hook is not None:
            hook.remove()
    reading.peak_bytes = counter.peak_bytes
    reading.tenants = counter.peak_tenants()


@contextmanager
def track_cuda_peak(device: torch.device) -> Iterator[PeakReading]:
    """Measure the enclosed block's CUDA peak from freshly reset statistics: `peak_bytes` =
    `max_memory_allocated`, `reserved_bytes` = `max_memory_reserved` plus the memory the
    device uses outside the allocator (CUDA context, cuBLAS/NCCL workspaces; read with
    `mem_get_info`, so other processes on the same GPU count too). Host queries only."""
    reading = PeakReading(method="CUDA allocator peak statistics, reset before the step")
    torch.cuda.reset_peak_memory_stats(device)
    yield reading
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))
    reading.peak_bytes = int(torch.cuda.max_memory_allocated(device))
    reading.reserved_bytes = int(torch.cuda.max_memory_reserved(device)) + outside


def step_peak_tracker(
    device: torch.device, modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer
) -> AbstractContextManager[PeakReading]:
    """How the loop measures one step's peak on `device`: CPU, tensor storages counted
    (`track_cpu_peak`); CUDA, the allocator's statistics reset before it (`track_cuda_peak`), so
    start-up, checkpoint loading, compilation and evaluation are not in its peak; elsewhere
    nothing (an empty reading)."""
    if device.type == "cuda":
        return track_cuda_peak(device)
    if device.type == "cpu":
        return track_cpu_peak(modules, optimizer)
    return nullcontext(PeakReading())


T = TypeVar("T")


def measure_step(
    runtime: Any, optimizer: torch.optim.Optimizer, step: Callable[[], T]
) -> tuple[T, PeakReading]:
    """Run `step` with its peak memory measured (`step_peak_tracker` on `runtime.device`); the
    reading also goes to the runtime's layout report (`record_peak_memory`, when it has one)."""
    tracker = step_peak_tracker(runtime.device, runtime.model_parts, optimizer)
    with tracker as reading:
        result = step()
    record = getattr(runtime, "record_peak_memory", None)
    if record is not None and reading.method:
        record(reading.peak_bytes, reading.tenants, reading.reserved_bytes)
    return result, reading
