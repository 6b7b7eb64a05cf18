"""Check a plan at its full scale on one CPU: fivefold's own runtime (the same `parallelize` path:
FSDP2, DTensor TP/SP, `torch.distributed.pipelining`, CP, EP, recompute, precision) built for the
recipe's whole world size under a fake process group and fake tensors, one training step run
on one rank of each pipeline stage, each rank's peak measured beside the planner's prediction.

No arithmetic runs and no memory is held: parameters, activations and collectives are
`FakeTensorMode` tensors on a `"fake"` process group (the route torchtitan documents for
checking a large job on one machine). Each rank runs in its own process (a fresh fake world).

Where the fake world differs from a real one, and what this module does about it (written here
because no library provides it):
- `DeviceMesh` keeps a real tensor of ranks; its methods run with fake tensors switched off.
- Weights are not initialised (values are irrelevant); every label counts in the loss scale.
- DTensor derives output shapes under a fake mode of its own, as in a real run.
- Expert routing is data too: every EP rank sends and receives balanced all-to-all splits.
- Pipelining exchanges a vote and the stages' tensor metadata as values over point-to-point
  messages, which a fake group cannot carry: every stage infers its own metadata, told by
  `_hidden_meta` what its neighbour sends (the hidden states [b, T/cp/tp_sp, hidden] in the
  compute dtype).
- The optimizer state is made first (as a previous step leaves it); then one step is measured.
- On a GPU cluster attention runs the CUDA flash kernels' fake implementations
  (`fivefold.train.plan_check_kernels`); each rank reports the calls per path.
The peak is counted twice: by the runtime's counter (`fivefold.train.memory_counter`) and by torch's
`MemTracker` (`torch.distributed._tools.mem_tracker`), tenant by tenant.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing
import os
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._utils import (
    InferenceMode,
    _StageBackwardMeta,
    _StageForwardMeta,
    _TensorMeta,
)
from torch.distributed.pipelining.stage import PipelineStage
from torch.distributed.tensor import _sharding_prop
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.testing._internal.distributed.fake_pg import FakeStore

import fivefold.model.init as model_init
from fivefold.errors import ConfigError
from fivefold.parallel.distributed_runtime import DistributedRuntime
from fivefold.parallel.expert_parallel import AllToAllDispatcher
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.mixed_precision import resolve_precision
from fivefold.parallel.report import memory_only_prediction
from fivefold.planner.schedule.actions import build_schedule
from fivefold.specs.recipe import Recipe, build
from fivefold.train.config import TrainConfig
from fivefold.train.data.batching import Batch
from fivefold.train.memory_counter import track_cpu_peak
from fivefold.train.optim import build_optimizer
from fivefold.train.plan_check_kernels import gpu_kernels, patch_gpu_attention
from fivefold.train.plan_check_progress import StageProgress, expectation_line
from fivefold.units import GiB as GIB

PIPELINE_TRACKER_NOTE = (
    "torch's MemTracker cannot follow a pipeline stage's backward (its module hooks meet "
    "torch.autograd.grad on the stage's received input); fivefold's counter only"
)


@dataclass
class RankCheck:
    """One checked rank: bytes counted by the runtime and by torch's tracker beside the
    prediction (GiB dict with the keys of `fivefold plan --json`'s memory)."""

    rank: int
    stage: int
    predicted_gib: dict[str, float]
    counted_bytes: int = 0
    counted_tenants: dict[str, int] = field(default_factory=dict)
    tracker_bytes: int = 0
    tracker_tenants: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    host_peak_mib: float = 0.0
    problem: str = ""
    tracker_note: str = ""
    kernels: dict[str, int] = field(default_factory=dict)  # attention calls per path

    @property
    def error(self) -> float | None:
        """Relative error of the prediction against the counted peak (None when unmeasured)."""
        if not self.counted_bytes:
            return None
        return self.predicted_gib["total"] * GIB / self.counted_bytes - 1.0


def representative_ranks(plan: Any, world: int) -> list[tuple[int, int]]:
    """(pipeline stage, global rank) for one rank per stage: the first rank of each stage (the
    other axes place the same shapes on every rank; pp is the outermost mesh axis)."""
    per_stage = world // plan.pp
    return [(stage, stage * per_stage) for stage in range(plan.pp)]


def micro_batches_to_run(plan: Any) -> int:
    """The fewest micro-batches whose step has the full step's peak: without pipelining one
    micro-batch's activations are freed before the next (gradients accumulate in place), so
    two; with it, the fewest (a multiple of pp) for which every rank reaches as many
    micro-batches in flight with the gradients of the same chunks allocated
    (`_inflight_with_grads`: a forward after a chunk's first backward holds its gradients)."""
    if plan.pp == 1:
        return min(plan.grad_accum, 2)
    full = _inflight_with_grads(plan)
    for count in range(plan.pp, plan.grad_accum, plan.pp):
        candidate = plan.with_(grad_accum=count)
        if not candidate.problems() and _inflight_with_grads(candidate) == full:
            return count
    return plan.grad_accum


def _inflight_with_grads(plan: Any) -> list[dict[frozenset, int]]:
    """Per pipeline rank, for each set of chunks whose gradients exist (a backward of theirs
    has ended), the most micro-batches in flight at a forward (`planner.schedule.actions`)."""
    schedule = build_schedule(plan.schedule, plan.pp, plan.vpp, plan.grad_accum)
    release = "W" if schedule.split_backward else "B"
    out = []
    for actions in schedule.actions:
        alive, graded, peaks = 0, frozenset(), {}
        for action in actions:
            if action.kind == "F":
                alive += 1
                peaks[graded] = max(peaks.get(graded, 0), alive)
            elif action.kind == release:
                alive -= 1
                graded = graded | {action.chunk}
        out.append(peaks)
    return out


def check_plan(
    recipe: Recipe, world: int | None = None, timeout_s: float = 600.0
) -> list[RankCheck]:
    """Check every representative rank of `recipe` in a world of `world` ranks (default: the
    cluster's GPUs), each in a fresh process, as many at once as this machine has cores."""
    run = micro_batches_to_run(recipe.plan)
    recipe = replace(recipe, plan=recipe.plan.with_(grad_accum=run))
    optimizer = train_settings(recipe).optimizer
    # Predicted for the micro-batches run: a pipeline keeps per-micro-batch receive slots and
    # its sent outputs until the step ends, so its peak grows with their count.
    predicted = memory_only_prediction(
        recipe.model, recipe.plan, fsdp_wrapped=True, cuda=False, optimizer=optimizer
    )
    out = []
    context = multiprocessing.get_context("spawn")
    world = world or recipe.cluster.world_size
    ranks = representative_ranks(recipe.plan, world)
    workers = max(1, min(len(ranks), os.cpu_count() or 1))
    print(expectation_line(recipe, world, run, workers), file=sys.stderr, flush=True)
    with context.Pool(workers, maxtasksperchild=1) as pool:  # a fresh fake world per rank
        jobs = [pool.apply_async(_check_rank, (recipe, rank, world, s)) for s, rank in ranks]
        for (stage, rank), job in zip(ranks, jobs, strict=True):
            try:
                result = job.get(timeout=timeout_s)
            except multiprocessing.TimeoutError:
                result = {"problem": f"no result within {timeout_s:.0f} s"}
            out.append(RankCheck(rank=rank, stage=stage, predicted_gib=predicted[stage], **result))
    return out


def _check_rank(recipe: Recipe, rank: int, world: int, stage: int = 0) -> dict[str, Any]:
    """Build and step `rank` (of pipeline `stage`) of the fake world (runs in a child process),
    saying each phase on stderr; a dict of RankCheck fields. A component that cannot run under
    fake tensors is reported, not raised."""
    start = time.perf_counter()
    progress = StageProgress(stage, rank)
    try:  # the runtime's layout line goes to stderr: stdout is the table (or --json's JSON)
        with contextlib.redirect_stdout(sys.stderr):
            result = _measure(recipe, rank, world, progress)
        progress("done")
    except Exception as err:  # reported to the user with the component that failed
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result = {"problem": f"{type(err).__name__}: {first[:300]}"}
        progress(f"could not run: {result['problem']}")
    result["seconds"] = time.perf_counter() - start
    result["host_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def _measure(recipe: Recipe, rank: int, world: int, progress: Any = None) -> dict[str, Any]:
    say = progress or (lambda phase: None)
    fake_tensors = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with fake_world(recipe, rank, world) as kernels, fake_tensors:
        say(f"building the runtime for {world} ranks")
        runtime = _CheckedRuntime(recipe)
        optimizer = _optimizer(runtime, recipe)
        batches = _micro_batches(recipe)
        say("making the optimizer state (an optimizer step on zero gradients)")
        _make_optimizer_state(runtime, optimizer)
        say(f"one training step of {len(batches)} micro-batch(es), counting memory")
        with track_cpu_peak(runtime.model_parts, optimizer) as reading:
            # Made inside the counter: MemTracker keeps the `UntypedStorage.resize_` it finds
            # when made and restores it around its own, so FSDP2's frees reach both.
            tracker = _EveryMicroBatchTracker() if recipe.plan.pp == 1 else None
            if tracker is not None:
                tracker.track_external(*runtime.model_parts, optimizer)
            with tracker or contextlib.nullcontext():
                _step(runtime, optimizer, batches)
    result: dict[str, Any] = {
        "counted_bytes": int(reading.peak_bytes),
        "counted_tenants": dict(reading.tenants),
        "kernels": dict(kernels),
    }
    if tracker is None:
        result["tracker_note"] = PIPELINE_TRACKER_NOTE
        return result
    peak = tracker.get_tracker_snapshot("peak")
    tenants = {str(k).split(".")[-1].lower(): int(v) for s in peak.values() for k, v in s.items()}
    result["tracker_bytes"] = tenants.pop("total", 0)
    result["tracker_tenants"] = tenants
    return result


class _EveryMicroBatchTracker(MemTracker):
    """torch's MemTracker, which refuses a root module called twice in one step (it takes it
    for a second iteration): each micro-batch's forward starts that module's statistics anew;
    the whole step's peak is unaffected."""

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        """Only the whole step's peak: torch's per-module peaks walk every module at every op
        (minutes on a 32-layer model), and this check reads none of them."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


def _step(runtime: Any, optimizer: Any, batches: list) -> None:
    """One training step as the loop runs it (the gradient norm and clipping included; no value
    is read back)."""
    runtime.train_step(batches)
    runtime.clip_grads(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _make_optimizer_state(runtime: Any, optimizer: Any) -> None:
    """The optimizer state a previous step leaves (AdamW makes it in its first step)."""
    params = [p for part in runtime.model_parts for p in part.parameters()]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_settings(recipe: Recipe) -> TrainConfig:
    """The recipe's [train] table on its own (a check needs no data): `train.optimizer` and
    its settings; `ConfigError` naming a bad field."""
    problems: list[str] = []
    table = recipe.sections.get("train") or {}
    train = build(TrainConfig, table if isinstance(table, dict) else {}, "train", problems)
    if problems or train is None:
        raise ConfigError(problems)
    return train


def _optimizer(runtime: Any, recipe: Recipe) -> Any:
    """The recipe's optimizer (`train.optimizer`: AdamW, or Muon with AdamW) as the run builds
    it."""
    return build_optimizer(runtime.model_parts, train_settings(recipe), recipe.plan)


def _micro_batches(recipe: Recipe) -> list:
    """grad_accum micro-batches of one document per row (full sequences), on the CPU."""
    b, t = recipe.plan.micro_batch, recipe.model.seq_len
    out = []
    for _ in range(recipe.plan.grad_accum):
        tokens = torch.zeros(b, t, dtype=torch.long)
        positions = torch.arange(t).expand(b, t).clone()
        out.append(Batch(tokens, tokens.clone(), positions, None, label_count=b * t))
    return out


def _settings() -> SimpleNamespace:
    """The [train] settings the runtime reads (`fivefold.parallel.protocol.TrainSettings`)."""
    return SimpleNamespace(device="cpu", seed=0, steps=1, memory_step=0, compile=False)


class _CheckedRuntime(DistributedRuntime):
    """The distributed runtime without its layout report, which gathers measured values over
    the group."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(recipe, _settings())

    def _after_step(self, seconds: float, timed: bool = True) -> None:
        self._steps += 1


@contextlib.contextmanager
def fake_world(recipe: Recipe, rank: int, world: int) -> Iterator[Counter]:
    """This process as `rank` of a fake world of `world` ranks, with the patches the module
    docstring lists, undone on exit; on a GPU cluster attention runs the CUDA kernels' fake
    implementations (`plan_check_kernels`), whose calls per path the yielded tally counts."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    saved: list[tuple[Any, str, Any]] = []
    absent = object()

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, vars(owner).get(name, absent)))
        setattr(owner, name, value)

    try:
        patch(model_init, "init_module_weights", lambda *args, **kwargs: None)
        _patch_device_mesh(patch)
        _patch_sharding_propagation(patch)
        _patch_pipelining(patch, recipe)
        _patch_expert_dispatch(patch)
        kernels: Counter = Counter()
        if gpu_kernels(recipe):
            patch_gpu_attention(patch, kernels)
        yield kernels
    finally:
        for owner, name, value in reversed(saved):
            if value is absent:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        dist.destroy_process_group()


def _real_tensors(fn):
    """`fn` with fake tensors switched off (DeviceMesh's rank tensor is real)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapper


def _patch_device_mesh(patch) -> None:
    patch(ParallelDims, "build_meshes", _real_tensors(ParallelDims.build_meshes))

    for name, attr in list(vars(DeviceMesh).items()):
        if isinstance(attr, property):
            setter = attr.fset and _real_tensors(attr.fset)
            patch(DeviceMesh, name, property(_real_tensors(attr.fget), setter))
        elif isinstance(attr, staticmethod | classmethod):
            patch(DeviceMesh, name, type(attr)(_real_tensors(attr.__func__)))
        elif inspect.isfunction(attr) and name != "__repr__":
            patch(DeviceMesh, name, _real_tensors(attr))


def _patch_sharding_propagation(patch) -> None:
    """DTensor derives output shapes by running ops at the global shape under the active fake
    mode, or a fresh one when none is active (as in a real run, where they hold no memory);
    here the active mode is the check's own, so give the derivation a mode of its own, which
    the counters skip."""
    own_mode = FakeTensorMode(allow_non_fake_inputs=True)
    patch(_sharding_prop, "detect_fake_mode", lambda *args, **kwargs: own_mode)


def _patch_expert_dispatch(patch) -> None:
    """Routing is data a fake tensor does not have: the all-to-all splits become the balanced
    ones (each EP rank sends an equal share of its N*K token copies to every rank)."""

    def balanced(self, counts, recv_counts, copies: int) -> tuple[list[int], list[int]]:
        share = [copies // self.ep + (1 if r < copies % self.ep else 0) for r in range(self.ep)]
        return share, list(share)

    patch(AllToAllDispatcher, "splits", balanced)


def _hidden_meta(recipe: Recipe, requires_grad: bool):
    """What a pipeline stage sends its neighbour: hidden states [b, T/cp/(tp if sp), h] in the
    compute dtype (the last block's output: FSDP2 casts the blocks' inputs, not their outputs)."""
    spec, plan = recipe.model, recipe.plan
    t = spec.seq_len // plan.cp // (plan.tp if plan.sp else 1)
    shape = torch.Size((plan.micro_batch, t, spec.hidden))
    dtype = resolve_precision(plan.precision, torch.device("cpu")).dtype
    return _TensorMeta(shape, (t * spec.hidden, spec.hidden, 1), dtype, requires_grad)


def _patch_pipelining(patch, recipe: Recipe) -> None:
    """Stages infer their metadata locally (see the module docstring)."""

    def local_inference(self, stages, has_backward, p2p_done=False) -> None:
        for each in stages:
            each._inference_mode = InferenceMode.DYNAMIC

    def receive_meta(self, src_stage: int):
        if src_stage < self.stage_index:
            return _StageForwardMeta((_hidden_meta(recipe, True),))
        return _StageBackwardMeta((_hidden_meta(recipe, False),))

    for cls in list(vars(schedules).values()):
        if isinstance(cls, type) and "_warmup_p2p" in vars(cls):
            patch(cls, "_warmup_p2p", local_inference)
    patch(PipelineStage, "_recv_meta", receive_meta)
    patch(PipelineStage, "_send_meta", lambda self, meta, dst_stage: None)


def as_json(checks: list[RankCheck]) -> list[dict[str, Any]]:
    return [{**asdict(c), "error": c.error} for c in checks]
