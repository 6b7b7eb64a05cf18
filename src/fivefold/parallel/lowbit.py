"""Low-precision Adam states (`plan.optimizer_states` = "8bit" | "fp8") from torchao.

torchao's `AdamW8bit` keeps Adam's m and v as `OptimState8bit` (1 byte per element: codes of a
dynamic quantisation map, plus one fp32 scale per block of 256 elements) and `AdamWFp8` as
`OptimStateFp8` (float8 e4m3 codes plus a scale per block); both step in fp32 and re-quantise.
Tensors under 4096 elements (norm weights) keep fp32 states, as in bitsandbytes. The step is a
`torch.compile`d function per parameter shape: on CPU it needs a C++ compiler, and the first
step compiles (seconds per distinct shape, cached on disk by inductor afterwards).

Checkpoints: `state_dict()` returns m and v dequantised to plain fp32 tensors (DTensors where
the parameter is one) and `load_state_dict()` quantises them again, so a checkpoint has the same
keys and tensors whatever `optimizer_states` wrote it: a run resumes with another setting (8bit
from fp32 states and back) and on another layout through DCP's resharding, at the cost of one
fp32 copy of m and v per save (and re-quantisation error on a load into 8 bits).

torchao is an optional dependency (`pip install fivefold[lowbit]`); it prints "Failed to load
..._C_*.so" lines on import (CUDA kernels this build cannot load; the optimizers do not use
them), silenced here for the import only.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import (
    _disable_current_modes,
    _get_current_dispatch_mode,
)

from fivefold.errors import ConfigError
from fivefold.parallel.compile import has_cpu_compiler
from fivefold.parallel.dtensors import as_dtensor
from fivefold.parallel.dtensors import local_tensor as _local
from fivefold.planner.memory.levers import TORCHAO_BLOCK as BLOCK_SIZE

INSTALL_HINT = "pip install 'fivefold[lowbit]'"
QUANTISED_STATES = ("exp_avg", "exp_avg_sq")  # Adam's m (signed) and v (unsigned)

# torch.compile warns that torchao's state subclasses lack a stable hash for its cache
warnings.filterwarnings("ignore", message=r"OptimState\w+ does not implement _stable_hash")


def torchao_problems(field: str) -> list[str]:
    """[] when torchao can be imported, else the message naming `field` and the install."""
    why = _torchao_import_error()
    if why is None:
        return []
    return [
        f"{field} needs torchao, which {why}: `{INSTALL_HINT}` (torchao 0.18.0), "
        "or set it back to its default."
    ]


def compiler_problems(field: str, device: torch.device) -> list[str]:
    """On CPU torchao's update is compiled by inductor into C++: [] when a compiler is found."""
    if device.type != "cpu" or has_cpu_compiler():
        return []
    return [
        f"{field} on CPU: torchao compiles its optimizer update with a C++ compiler (g++, "
        "clang++ or $CXX) and none was found; install one (e.g. apt-get install g++) or use "
        "plan.optimizer_states = 'fp32'."
    ]


def import_torchao() -> None:
    """Import torchao once with its import-time log lines silenced (ConfigError if missing)."""
    problems = torchao_problems("this plan")
    if problems:
        raise ConfigError(problems)


def _torchao_import_error() -> str | None:
    """None once torchao is imported (its import-time log lines silenced), else why it is not:
    not installed, or installed but failing to import (e.g. built for another PyTorch)."""
    if importlib.util.find_spec("torchao") is None:
        return "is not installed"
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    try:
        for logger in quiet:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao  # noqa: F401
    except Exception as err:  # a broken install fails in many ways; all mean the same here
        return f"is installed but fails to import ({type(err).__name__}: {err}); reinstall it"
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return None


def _dense(value: Any) -> Any:
    """A quantised state (possibly inside a DTensor) as a plain fp32 tensor of the same layout."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if not _quantised(local):
            return value
        return as_dtensor(local.dequantize(torch.float32), value)
    if isinstance(value, torch.Tensor) and _quantised(value):
        return value.dequantize(torch.float32)
    return value


def _quantised(tensor: torch.Tensor) -> bool:
    """torchao's OptimState8bit / OptimStateFp8 (codes and block scales)."""
    return hasattr(tensor, "codes") and hasattr(tensor, "scale")


def dense_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every quantised state as fp32 (see the module docstring)."""
    state = {
        key: {name: _dense(value) for name, value in entry.items()}
        for key, entry in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def requantize(optimizer: torch.optim.Optimizer) -> None:
    """After a load: m and v of each quantisable parameter back into torchao's 8-bit/FP8 form."""
    if not hasattr(optimizer, "_new_buffer"):
        return  # a full-precision optimizer
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for name, signed in zip(QUANTISED_STATES, (True, False), strict=True):
                dense = state.get(name)
                if dense is None or _quantised(_local(dense)):
                    continue
                buffer = optimizer._new_buffer(param, signed)
                buffer.copy_(dense.to(buffer.device))
                state[name] = buffer


MIN_QUANTISED = 4096  # smaller tensors keep fp32 states


QMAP_BYTES = 256 * 4  # the 8-bit dynamic map each 8-bit state carries (256 fp32 values)


def adam_state_bytes(numel: int, states: str) -> float:
    """Bytes of Adam's m and v for one tensor of `numel` elements: fp32 8 per element; 8bit and
    fp8 two one-byte codes plus two fp32 scales per 256-element block (and for 8bit each state's
    map); tensors below 4096 elements, or not a multiple of the block, stay fp32."""
    if states == "fp32" or numel < MIN_QUANTISED or numel % BLOCK_SIZE:
        return 8.0 * numel
    maps = 2 * QMAP_BYTES if states == "8bit" else 0
    return 2.0 * numel + 2 * 4 * numel / BLOCK_SIZE + maps


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in the optimizer's m and v (codes, scales and maps included)."""
    total = 0
    for state in optimizer.state.values():
        for name in QUANTISED_STATES:
            value = state.get(name)
            if value is None:
                continue
            local = _local(value)
            parts = [getattr(local, name, None) for name in ("codes", "scale", "qmap")]
            if parts[0] is None:
                parts = [local]  # a full-precision state
            total += sum(p.numel() * p.element_size() for p in parts if p is not None)
    return total


@functools.cache
def lowbit_adamw_class(states: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW for `states` ("8bit" | "fp8") with checkpoint-neutral state dicts."""
    import_torchao()
    # torchao is optional: imported lazily, only for 8bit/fp8 optimizer states
    from torchao.optim import AdamW8bit, AdamWFp8

    base = {"8bit": AdamW8bit, "fp8": AdamWFp8}[states]

    class DenseCheckpointAdamW(base):
        __doc__ = f"torchao {base.__name__}; state dicts in fp32 (fivefold.parallel.lowbit)."

        def step(self, closure=None):
            """torchao's step; under a dispatch mode (the CPU memory tracker), which its
            compiled update cannot trace through, with that mode paused: the tracker then sees
            the state change in place but not the update's transient buffers."""
            if _get_current_dispatch_mode() is None:
                return super().step(closure)
            with _disable_current_modes():
                return super().step(closure)

        def state_dict(self) -> dict[str, Any]:
            return dense_state_dict(super().state_dict())

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            requantize(self)

    DenseCheckpointAdamW.__name__ = DenseCheckpointAdamW.__qualname__ = base.__name__
    return DenseCheckpointAdamW
