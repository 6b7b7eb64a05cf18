"""fivefold.parallel: a `ParallelPlan` run for real on torch.distributed: gloo on CPU, NCCL on GPU.

    runtime = DistributedRuntime(recipe, train_settings)   # under torchrun (`make_runtime`)
    ParallelDims.from_plan(plan, world_size).build_meshes("cpu")   # the 5-D mesh

Modules, one concept each: `mesh` (degrees and the DeviceMesh), `tensor_parallel` (TP + SP),
`data_parallel` (DDP / ZeRO-1/2/3 / HSDP on FSDP2), `activation_checkpoint` (activation recompute),
`pipeline`, `context_parallel` and `expert_parallel` (PP, CP ring attention, MoE all-to-all),
`parallelize` (the fixed order PP -> TP -> EP -> CP -> AC -> FSDP/DDP), `runtime` (the train
step, loss and gradient norm over the whole layout), `protocol` (the Runtime protocol and
`StepResult` the loop speaks), `process_group` (start-up, timeouts), `device`,
`mixed_precision` (the one precision resolution), `grad_norm` and `report` (predicted vs
measured per stage). Starting the processes is `fivefold.launch`; measuring this machine,
`fivefold.calibration`. Names are imported lazily: `import fivefold.parallel` does not import
torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DistributedRuntime": "fivefold.parallel.distributed_runtime",
    "ParallelDims": "fivefold.parallel.mesh",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fivefold.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
