"""Counting device-to-host reads of a run, wherever they happen (fivefold, torch's helpers,
NumPy's conversions), for the tests that assert steps without host syncs.

On a GPU each of these makes the host wait for the device: a scalar read
(`aten._local_scalar_dense`: `.item()`, `float(t)`, `bool(t)`, `if t:`), a copy from the device
to the host (`aten._to_copy` / `aten.copy_` into a CPU tensor from another device), an op whose
output size depends on values (`aten.nonzero`, ...). A `TorchDispatchMode` sees them at the
dispatcher, inside torch's own helpers too. On a CPU run a tensor is already on the host: its
`.cpu()`, `.tolist()`, `.numpy()`, `np.asarray(t)` and `.to("cpu")` copy nothing and reach no
dispatcher, so a `TorchFunctionMode` counts those calls (the ones that on the GPU are the
device-to-host copies) at torch's function layer, whoever makes them. On CPU the run's device
is the host too, so a `.to` counts when it names the host as the string "cpu" (the runtime
moves tensors to its device with a `torch.device`).
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that read values back to the host on CUDA (data-dependent output sizes included).
SYNCING_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique_consecutive",
    "aten._unique2",
    "aten.equal",
    "aten.is_nonzero",
}
# Tensor methods that, on a device tensor, copy it to the host.
HOST_COPY_METHODS = {"cpu", "tolist", "numpy", "__array__"}


def _where() -> str:
    """The innermost frame outside torch and this module: who asked for the read."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "/torch/" not in name and not name.endswith("host_reads.py"):
            return f"{name.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "torch"


def _to_host(func, args, kwargs) -> bool:
    """Whether a `to`/`_to_copy`/`copy_` moves a tensor from a device to the host."""
    if func in (torch.ops.aten._to_copy.default,):
        device = kwargs.get("device")
        to_cpu = device is not None and torch.device(device).type == "cpu"
        return to_cpu and args[0].device.type != "cpu"
    if func is torch.ops.aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in SYNCING_OPS or _to_host(func, args, kwargs):
            self.reads.append(f"{name} at {_where()}")
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and _targets_cpu(args, kwargs)
        on_host = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
        if on_host and (name in HOST_COPY_METHODS or to_cpu):  # device tensors: the dispatcher
            self.reads.append(f"Tensor.{name} at {_where()}")
        return func(*args, **kwargs)


def _targets_cpu(args, kwargs) -> bool:
    """A `.to` naming the host: "cpu" (or "cpu:0") as a string."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


class HostReads:
    """Context manager: `reads` lists every device-to-host read made inside, with its caller."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self._modes = (_Function(self.reads), _Dispatch(self.reads))

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
