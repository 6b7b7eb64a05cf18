"""What a run on this machine is checked against before any process starts, so that it fails in
a second with every reason, not after the ranks have started (or minutes later, killed):

- the paths the recipe names: `[data]` shards, inputs and tokenizer
  (`fivefold.train.inputs.path_problems`), and the checkpoint it would resume, which must hold
  this model (`fivefold.train.resume.resume_problems`);
- memory: the planner's predicted peak per rank (the figure `--dry-run` prints) times the ranks
  on this machine against the host memory free now (CPU), or per rank against its GPU's free
  memory (CUDA).

`fivefold.train.entry.check_layout` calls `prestart_problems` for a local run.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.launch import machine_memory
from fivefold.train.config import RunConfig
from fivefold.train.inputs import path_problems
from fivefold.units import GiB as GIB

# parallel.report and train.resume load torch: imported lazily, inside the functions, since
# train.entry imports this module where torch is not loaded.


@dataclass(frozen=True)
class MemoryFit:
    """The planner's predicted peak (bytes) against the memory free on this machine.

    `stages`: per pipeline stage, one rank's predicted peak and its largest tenant;
    `free_bytes`: host memory free (CPU; one figure for every rank) or the least free memory
    of the GPUs the ranks use (CUDA), None when unknown."""

    stages: list[tuple[float, str]]
    ranks: int
    cuda: bool
    free_bytes: int | None

    @property
    def per_rank_bytes(self) -> float:
        return max(peak for peak, _ in self.stages)

    @property
    def need_bytes(self) -> float:
        """What must fit in `free_bytes`: every local rank's peak (host) or one rank's (GPU)."""
        if self.cuda:
            return self.per_rank_bytes
        return sum(peak for peak, _ in self.stages) * self.ranks / len(self.stages)

    def describe(self) -> str:
        """'the planner predicted ... with ... free at the start' (for a rank's sudden death)."""
        text = f"the planner predicted a peak of {self.per_rank_bytes / GIB:,.2f} GiB per rank"
        if not self.cuda and self.ranks > 1:
            text += f", {self.need_bytes / GIB:,.1f} GiB for the {self.ranks} ranks"
        if self.free_bytes is not None:
            where = "on the emptiest GPU" if self.cuda else "on this machine"
            text += f", with {self.free_bytes / GIB:,.1f} GiB free {where} at the start"
        return text

    def problems(self) -> list[str]:
        if self.free_bytes is None or self.need_bytes <= self.free_bytes:
            return []
        stage = max(range(len(self.stages)), key=lambda s: self.stages[s][0])
        where = f" (pipeline stage {stage})" if len(self.stages) > 1 else ""
        if self.cuda:
            need = f"{self.per_rank_bytes / GIB:,.2f} GiB per rank{where}"
            free = f"the {self.free_bytes / GIB:,.2f} GiB free on the emptiest GPU"
        else:
            need = f"{self.per_rank_bytes / GIB:,.2f} GiB" + (
                f" per rank{where}, {self.need_bytes / GIB:,.1f} GiB for the {self.ranks} ranks "
                "on this machine"
                if self.ranks > 1
                else ""
            )
            free = (
                f"the {self.free_bytes / GIB:,.1f} GiB of memory free (MemAvailable, or what "
                "the cgroup's limit leaves)"
            )
        return [
            f"this run does not fit: the planner predicts a peak of {need}, more than {free}; "
            f"{_fix(self.stages[stage][1], self.ranks, self.cuda)} (`--dry-run` prints the "
            "prediction)."
        ]


def _fix(largest: str, ranks: int, cuda: bool) -> str:
    """The levers for the tenant that dominates the peak."""
    if largest == "activations":
        fix = (
            "lower plan.micro_batch (raise plan.grad_accum to keep the batch), set "
            'plan.recompute = "full", or shorten model.seq_len'
        )
    else:
        fix = (
            "shard the weights and optimizer state (plan.zero = 3 with plan.dp_shard, or "
            "plan.tp / plan.pp), or make the model smaller"
        )
    if ranks > 1 and not cuda:
        fix += ", or start fewer ranks (--nproc) on this machine"
    return fix


def memory_fit(run: RunConfig, nproc: int, cuda: bool) -> MemoryFit | None:
    """The planner's prediction for `nproc` local ranks against this machine's free memory;
    None when the planner has no prediction for this recipe."""
    from fivefold.parallel.report import predictions_for

    train = run.train  # the same prediction `--dry-run` prints
    memory, _, _ = predictions_for(
        run.recipe,
        cuda,
        fsdp_wrapped=nproc > 1,
        compiled=train.compile,
        optimizer=train.optimizer,
    )
    if not memory:
        return None
    tenants = ("params", "grads", "optimizer", "activations")
    stages = [
        (stage["total"] * GIB, max(tenants, key=lambda t: stage.get(t, 0.0))) for stage in memory
    ]
    if cuda:
        free = machine_memory.gpu_free_bytes(nproc, in_process=nproc == 1)
        free_bytes = min(free) if free else None
    else:
        free_bytes = machine_memory.available_bytes()
    return MemoryFit(stages, nproc, cuda, free_bytes)


def prestart_problems(run: RunConfig, nproc: int, cuda: bool) -> list[str]:
    """Every reason this run cannot start on this machine (paths, checkpoint, memory)."""
    from fivefold.train.resume import resume_problems

    fit = memory_fit(run, nproc, cuda)
    memory = fit.problems() if fit is not None else []
    return path_problems(run) + resume_problems(run) + memory
