"""`PlannerOptions`: the assumptions behind one estimate that are not part of the plan.

They describe the software a run uses rather than the layout: the attention kernel, whether the
framework overlaps tensor-parallel communication with GEMMs (Megatron's `--tp-comm-overlap`;
PyTorch's DTensor TP does not) and data-parallel gradient reduction with the backward (DDP and
FSDP do), the activation model, and the fixed memory terms. The field defaults describe
fused-kernel software (the framework profiles start from them): flash attention, no dropout,
exposed TP collectives, overlapped DP reduction, fused element-wise kernels, and "selective"
recompute meaning the attention core (Korthikanti et al.
2022, what `fivefold.parallel.activation_checkpoint` does). `selective_policy="alternate-matmul"`
describes torchtitan's op-level selective checkpointing instead: in each layer every second matmul
(wk, wo and w3 of a Llama block) and every element-wise op are recomputed, the attention output
is kept.
`fused_elementwise=False` describes eager PyTorch, whose unfused norms, RoPE and activations move
about three times the bytes of fused kernels (see `compute.UNFUSED_TRAFFIC_FACTOR`).
`collective_granularity` says how the framework issues data-parallel collectives: one per
transformer layer ("layer", the default: FSDP/FSDP2, and Megatron's distributed optimizer whose
buckets of max(40M, 1M x dp) parameters hold about a layer of the calibration rows' sharded
models), in buckets of `dp_bucket_bytes` ("bucket": torch DDP, 25 MiB) or one per tensor
("parameter": per-parameter hooks); each collective pays its own latency, and ZeRO-3 gathers at
least a layer at a time (`planner/step_time/comm.py`).
`ep_dispatch="deepep"` prices the MoE dispatch and combine as DeepEP sends them: one network
copy of a token per remote node reached, not one per expert (`planner/step_time/comm.py`).
`param_gather_overlap=False` exposes the all-gather of ZeRO-1/2's updated parameters in full:
nanotron's ZeRO-1 runs it synchronously at the end of the optimizer step; Megatron's
`--overlap-param-gather` and FSDP2's prefetch hide it behind the next forward (the default).
`runtime="fivefold-eager"` makes the memory model count what fivefold's own eager runtime keeps
(`fivefold.planner.memory.options.EagerProfile`); "fused" counts what fused kernels keep (the
field defaults, which the framework profiles start from). `for_device` is fivefold's own runtime
on a device, the default of every estimate, search and run report. `compile=True` says the
blocks run under torch.compile (`train.compile`): with `runtime="fivefold-eager"` the memory
model counts what inductor's compiled blocks keep (`memory_options.CompiledProfile`, with FP8
tensorwise inputs in one byte); the "fused" model already counts fused kernels and is
unchanged by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from fivefold.errors import ConfigError
from fivefold.planner.memory.options import (
    ACTIVATION_MODELS,
    ATTENTION_KERNELS,
    RUNTIMES,
    MemoryOptions,
)
from fivefold.planner.rates.device import rates_for
from fivefold.planner.step_time.comm import EP_DISPATCHES, GRANULARITIES
from fivefold.planner.step_time.compute import SELECTIVE_POLICIES, ComputeOptions
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.optimizer import OPTIMIZERS
from fivefold.units import GiB, MiB


@dataclass(frozen=True)
class PlannerOptions:
    activation_model: str = "korthikanti"  # or "simple" (k = 12 per block)
    attention_kernel: str = "flash"  # or "classic" (s^2 scores in HBM, Megatron 2021)
    dropout: bool = False
    tp_comm_overlap: bool = False
    dp_overlap: bool = True
    param_gather_overlap: bool = True  # ZeRO-1/2 gather behind the next forward (rank_tail.py)
    fused_elementwise: bool = True
    selective_policy: str = "attention"  # or "alternate-matmul" (torchtitan's op-level SAC)
    cuda_context_bytes: float = 0.75 * GiB
    fragmentation_fraction: float = 0.05
    dp_bucket_bytes: float = 25 * MiB
    collective_granularity: str = (
        "layer"  # or "bucket" (DDP) or "parameter" (planner/step_time/comm.py)
    )
    ep_dispatch: str = (
        "alltoall"  # or "deepep": one network copy per node (planner/step_time/comm.py)
    )
    runtime: str = "fused"  # memory: "fivefold-eager" is what fivefold's own runtime keeps
    checkpoint_early_stop: bool = False
    compile: bool = False  # memory: the blocks run under torch.compile (train.compile)
    optimizer: str = "adamw"  # or "muon" (train.optimizer; `fivefold.planner.step_time.muon`)

    @classmethod
    def for_device(cls, device: GPUSpec, compile: bool = False) -> PlannerOptions:
        """fivefold's own runtime on `device` as a recipe runs it (`RUNTIME_FACTS`): eager
        blocks, or with `compile` (`train.compile`) blocks compiled by inductor, whose
        element-wise work is fused; and the device's own facts (`DeviceRates.runtime_options`:
        on a CPU no CUDA context, no fragmentation, no overlap)."""
        facts = {**RUNTIME_FACTS, "compile": compile, "fused_elementwise": compile}
        return cls(**(facts | rates_for(device).runtime_options()))

    @property
    def fivefold_runtime(self) -> bool:
        """Whether these options describe fivefold's own runtime (its memory model), whose
        rules (`ParallelPlan.runtime_problems`) then bind the layout; other software's
        profiles plan what that software runs."""
        return self.runtime == "fivefold-eager"

    def memory(self) -> MemoryOptions:
        return MemoryOptions(
            activation_model=self.activation_model,
            attention_kernel=self.attention_kernel,
            dropout=self.dropout,
            cuda_context_bytes=self.cuda_context_bytes,
            fragmentation_fraction=self.fragmentation_fraction,
            dp_bucket_bytes=self.dp_bucket_bytes,
            selective_policy=self.selective_policy,
            runtime=self.runtime,
            compiled=self.compile,
            optimizer=self.optimizer,
        )

    def compute(self) -> ComputeOptions:
        return ComputeOptions(
            attention_kernel=self.attention_kernel,
            dropout=self.dropout,
            fused_elementwise=self.fused_elementwise,
            selective_policy=self.selective_policy,
            checkpoint_early_stop=self.checkpoint_early_stop,
        )

    def problems(self, where: str = "planner") -> list[str]:
        """Every wrong value, each naming `where.field` and what it may be."""
        out = []
        for f in fields(self):
            value, name = getattr(self, f.name), f"{where}.{f.name}"
            if f.name in CHOICES and value not in CHOICES[f.name]:
                out.append(f"{name} = {value!r}: choose one of {', '.join(CHOICES[f.name])}.")
            elif f.type == "bool" and not isinstance(value, bool):
                out.append(f"{name} = {value!r}: expected true or false.")
            elif f.type == "float":
                ok = isinstance(value, int | float) and not isinstance(value, bool)
                upper = 1.0 if f.name == "fragmentation_fraction" else math.inf
                if not (ok and math.isfinite(value) and 0 <= value < upper):
                    bound = "in [0, 1)" if upper == 1.0 else "a finite number >= 0"
                    out.append(f"{name} = {value!r}: must be {bound}.")
                elif f.name == "dp_bucket_bytes" and value == 0:
                    out.append(f"{name} = 0: a bucket must hold some bytes, e.g. 25M (25 MiB).")
        return out + self._runtime_problems(where)

    def _runtime_problems(self, where: str) -> list[str]:
        """What fivefold's runtime (`fivefold_runtime`) does not run: classic attention with
        its s^2 scores, dropout. Its memory model has no such terms, so the setting would be
        silently ignored; other software is planned with its profile or `runtime = fused`."""
        if not self.fivefold_runtime:
            return []
        given = [
            (name, value)
            for name, value, runs in (
                ("attention_kernel", self.attention_kernel, "flash"),
                ("dropout", self.dropout, False),
            )
            if value != runs
        ]
        return [
            f"{where}.{name} = {_shown(value)} with {where}.runtime = 'fivefold-eager': "
            "fivefold's runtime runs flash-type attention without dropout; to plan other "
            "software choose its profile (--profile megatron-2022) or runtime = 'fused'."
            for name, value in given
        ]

    def validate(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)


# What fivefold's runtime is, whatever the device: its memory as autograd keeps it (eager, or
# compiled under `compile`), flash-type attention (SDPA's flash kernel, `varlen_attn` on CUDA,
# the per-document op on CPU: each keeps the output and the log-sum-exp, never s^2 scores), no
# dropout, DTensor TP collectives exposed, FSDP2's per-block collectives overlapped with the
# backward, `torch.utils.checkpoint`'s early stop.
RUNTIME_FACTS: dict[str, object] = {
    "runtime": "fivefold-eager",
    "attention_kernel": "flash",
    "dropout": False,
    "tp_comm_overlap": False,
    "checkpoint_early_stop": True,
}


def _shown(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


CHOICES: dict[str, tuple[str, ...]] = {
    "activation_model": ACTIVATION_MODELS,
    "attention_kernel": ATTENTION_KERNELS,
    "selective_policy": SELECTIVE_POLICIES,
    "collective_granularity": GRANULARITIES,
    "ep_dispatch": EP_DISPATCHES,
    "runtime": RUNTIMES,
    "optimizer": OPTIMIZERS,
}

# One line per option: what it means (the CLI's --help, the explorer's tooltips, the docs).
OPTION_HELP: dict[str, str] = {
    "attention_kernel": "flash keeps no s^2 scores; classic stores them in HBM (Megatron pre-2023)",
    "dropout": "dropout after attention and MLP (GPT-3 style masks kept for the backward)",
    "tp_comm_overlap": "TP collectives hidden behind the GEMMs (Megatron --tp-comm-overlap)",
    "dp_overlap": "DP/ZeRO gradient reduction overlapped with the backward (DDP, FSDP)",
    "param_gather_overlap": "ZeRO-1/2 parameter all-gather overlapped with the next forward "
    "(Megatron --overlap-param-gather); false: after the optimizer step (nanotron, DeepSpeed)",
    "fused_elementwise": "fused norm/RoPE/activation kernels (false: eager PyTorch, ~3x bytes)",
    "selective_policy": "what selective recompute redoes: attention (Megatron) or "
    "alternate-matmul (torchtitan op-level SAC)",
    "dp_bucket_bytes": "gradient bucket size for DP reduction (bytes, e.g. 25M)",
    "collective_granularity": "DP/ZeRO collectives issued per layer (FSDP, Megatron; default), "
    "per bucket of dp_bucket_bytes (DDP) or per parameter; each pays its ring/tree latency",
    "ep_dispatch": "EP token dispatch: alltoall (one copy per expert) or deepep (one network "
    "copy per node reached, forwarded over NVLink)",
    "activation_model": "activation memory: korthikanti (per tensor) or simple "
    "(k * L * B * S * d * bytes, k=12)",
    "runtime": "memory counted as fused kernels keep it, or as fivefold's eager runtime does",
    "cuda_context_bytes": "per-GPU CUDA context and library workspaces (bytes, e.g. 768M)",
    "fragmentation_fraction": "allocator fragmentation added to every stage's memory (0.05 = 5%)",
    "checkpoint_early_stop": "recompute stops at the last tensor the backward needs (PyTorch)",
    "optimizer": "adamw, or muon (train.optimizer): one momentum buffer for the blocks' "
    "matrices, Newton-Schulz on whole matrices and their all-gathers in the step",
    "compile": "blocks run under torch.compile (train.compile): with runtime fivefold-eager, "
    "memory counts what inductor keeps (and FP8 tensorwise inputs in 1 byte)",
}
