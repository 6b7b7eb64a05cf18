"""CPU offload (`plan.offload`): parameters, gradients and optimizer state in host memory.

- "all" (ZeRO-3 only): FSDP2's own `CPUOffloadPolicy` (`offload_policy`): the sharded fp32
  parameters, their gradients and so the optimizer state live on the host, are copied to the
  device for each block's all-gather and the gradients back after its reduce-scatter (pinned
  memory on CUDA); the optimizer steps on the host. Nothing is hand-written for it.
- "optimizer" (ZeRO 0-2): the optimizer step on the host (ZeRO-Offload, DeepSpeed's
  `offload_optimizer`). FSDP2 offloads parameters, gradients and state only together, so this
  is written here: `HostOffloadOptimizer` keeps an fp32 master copy of every (local shard of a)
  parameter and its Adam state in host memory, copies the gradients device-to-host after the
  backward (non-blocking on CUDA, one synchronisation before the step), runs the inner
  optimizer (torch AdamW, or torchao's low-bit one) on the host and copies the updated
  parameters back host-to-device. On CPU the "host" is the same memory, but the copies, the
  separate master tensors and the state layout are real, so the parity matrix runs the path.

Checkpoints: the optimizer state is keyed by the model's parameters with AdamW's own names
(step, exp_avg, exp_avg_sq), host tensors of the model's layout, so an offloaded run resumes on a
non-offloaded layout and back (the masters are refreshed from the loaded parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from fivefold.parallel.dtensors import as_dtensor
from fivefold.parallel.dtensors import local_tensor as _local
from fivefold.parallel.lowbit import dense_state_dict, requantize

HOST = torch.device("cpu")


def cpu_offload_policy(device: torch.device):
    """FSDP2's offload policy for plan.offload = "all" (pinned host memory on CUDA)."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A separate host copy (DTensors keep their mesh and placements; on CUDA, pinned)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    host = torch.empty_like(local, device=HOST, pin_memory=local.is_cuda)
    host.copy_(local.detach())
    if isinstance(tensor, DTensor):
        return as_dtensor(host, tensor)
    return host


class HostOffloadOptimizer(torch.optim.Optimizer):
    """An optimizer over the model's (device) parameters whose step runs on host copies.

    `param_groups` hold the model's parameters (so LR schedulers, `zero_grad` and
    `torch.distributed.checkpoint.state_dict` see the usual optimizer); `make_inner(groups)`
    builds the real optimizer over the host masters. Hyperparameters set on the outer groups
    (the scheduler's lr) are passed to the inner ones before each step.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_inner: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    ):
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        host_groups = []
        for group in groups:
            masters = []
            for param in group["params"]:
                master = _host_copy(param)
                self.masters[param] = master
                masters.append(master)
            host_groups.append({**group, "params": masters})
        self.inner = make_inner(host_groups)
        outer = [
            {**inner_group, "params": list(group["params"])}
            for group, inner_group in zip(groups, self.inner.param_groups, strict=True)
        ]
        super().__init__(outer, dict(self.inner.defaults))
        self._link_state()

    def _sync_hyperparameters(self) -> None:
        """The outer groups' lr, betas, ... (set by schedulers and loads) into the inner ones."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({key: value for key, value in outer.items() if key != "params"})

    def _link_state(self) -> None:
        """The outer state is the inner state, keyed by the model's parameters."""
        for param, master in self.masters.items():
            if master in self.inner.state:
                self.state[param] = self.inner.state[master]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "HostOffloadOptimizer.step takes no closure"
        self._sync_hyperparameters()
        self._gradients_to_host()
        self.inner.step()
        self._parameters_to_device()
        self._link_state()

    def _gradients_to_host(self) -> None:
        copies = False
        for param, master in self.masters.items():
            if param.grad is None:
                master.grad = None
                continue
            local_grad = _local(param.grad)
            if master.grad is None:
                host = torch.empty_like(local_grad, device=HOST, pin_memory=local_grad.is_cuda)
                master.grad = as_dtensor(host, param.grad) if isinstance(master, DTensor) else host
            _local(master.grad).copy_(local_grad, non_blocking=local_grad.is_cuda)
            copies |= local_grad.is_cuda
        if copies:
            torch.cuda.current_stream().synchronize()  # the host step reads the copies

    def _parameters_to_device(self) -> None:
        for param, master in self.masters.items():
            local = _local(param)
            local.copy_(_local(master), non_blocking=local.is_cuda)

    def held_tensors(self) -> list[torch.Tensor]:
        """The host masters and their gradients (the memory tracker's "optimizer" tenant)."""
        out = []
        for master in self.masters.values():
            out += [t for t in (master, master.grad) if t is not None]
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self._link_state()
        return dense_state_dict(super().state_dict())

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load (states keyed by the model's parameters), move the state to the host and refresh
        the masters from the model's parameters, which the caller loaded first."""
        super().load_state_dict(state_dict)
        for param, master in self.masters.items():
            _local(master).copy_(_local(param).detach())
            state = self.state.get(param)
            if state:
                self.inner.state[master] = {key: _to_host(v) for key, v in state.items()}
        self._sync_hyperparameters()
        requantize(self.inner)
        self._link_state()


def _to_host(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or _local(value).device == HOST:
        return value
    if isinstance(value, DTensor):
        return as_dtensor(_local(value).to(HOST), value)
    return value.to(HOST)
