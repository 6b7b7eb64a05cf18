"""Pipeline parallelism: every schedule's losses, gradients, MoE aux losses and forward-only
evaluation against the single-process model.

One group of 4 gloo ranks: the pp = 2 cases run on two pairs of ranks at once (each pair takes
half of them), the pp = 4 cases on all four. The reference is the full model run on the same
micro-batches with loss = mean over micro-batches of (cross entropy + MoE aux loss). Each case
evaluates, trains one step, then evaluates again, so both switches between torch's forward-only
and training modes (each re-runs its shape inference) are covered.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from harness import run_ranks

from fivefold.errors import ConfigError
from fivefold.model import build_model, cross_entropy_loss
from fivefold.parallel.pipeline import (
    PipelineRunner,
    split_model_for_pipeline,
    stage_layer_ranges,
)
from fivefold.planner.schedule.actions import build_schedule
from fivefold.specs.geometry import chunks_of_rank, least_microbatches
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.train.data import Batch

WORLD = 4
TOL = 1e-5
EVAL_RTOL = 1e-6
MICRO_BATCHES, MB_SIZE, T = 8, 1, 16
EVAL_MICRO_BATCHES = 11  # not a multiple of MICRO_BATCHES: eval runs a padded second round
DENSE = ModelSpec(
    name="tiny-pp", layers=8, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=97, seq_len=T
)
MOE = DENSE.with_(
    name="tiny-pp-moe", experts=4, top_k=2, expert_ffn=16, dense_layers=1, router_aux_loss_coef=0.1
)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}  # -> vpp
CASES_PP2 = [("dense", s) for s in SCHEDULES] + [("moe", "1f1b"), ("moe", "zbv")]
CASES_PP4 = [("dense", s) for s in SCHEDULES] + [("moe", "interleaved-1f1b")]
CI_CASES_PP2 = [("dense", "1f1b"), ("moe", "zbv")]  # the rest of CASES_PP2 is marked slow


def _micro_batches(spec: ModelSpec, count: int = MICRO_BATCHES) -> list[Batch]:
    """Packed micro-batches with two documents each (positions restart at the boundary); the
    first n of a longer list are the n of a shorter one."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(count):
        stream = torch.randint(0, spec.vocab, (MB_SIZE, T + 1), generator=g)
        cut = int(torch.randint(3, T - 3, (1,), generator=g))
        index = torch.arange(T).expand(MB_SIZE, T)
        doc_ids = (index >= cut).long()
        positions = torch.where(index >= cut, index - cut, index)
        out.append(Batch(stream[:, :-1], stream[:, 1:], positions, doc_ids))
    return out


@dataclasses.dataclass
class _Reference:
    losses: list[torch.Tensor]  # per micro-batch mean cross entropy
    grads: dict[str, torch.Tensor]  # of the mean over micro-batches of (loss + aux)
    eval_loss: float  # mean token cross entropy over all micro-batches
    eval_loss_more: float  # the same over EVAL_MICRO_BATCHES micro-batches
    aux: dict[str, list[float]]  # MoE layer index -> its aux loss per micro-batch


def _reference(spec: ModelSpec, batches: list[Batch]) -> _Reference:
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    losses, token_loss_sum, tokens = [], 0.0, 0
    aux: dict[str, list[float]] = {n: [] for n, b in model.layers.items() if b.moe is not None}
    for mb in batches:
        logits = model(mb.tokens, mb.positions, mb.doc_ids)
        loss = cross_entropy_loss(logits, mb.labels)
        losses.append(loss.detach())
        token_loss_sum += cross_entropy_loss(logits, mb.labels, reduction="sum").item()
        tokens += int((mb.labels != -100).sum())
        for name in aux:
            aux[name].append(model.layers[name].moe.aux_loss.item())
        ((loss + model.aux_loss()) / len(batches)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    with torch.no_grad():
        more = _micro_batches(spec, EVAL_MICRO_BATCHES)
        logits = [model(mb.tokens, mb.positions, mb.doc_ids) for mb in more]
        more_sum = sum(
            cross_entropy_loss(x, mb.labels, reduction="sum")
            for x, mb in zip(logits, more, strict=True)
        )
        more_tokens = sum(int((mb.labels != -100).sum()) for mb in more)
    return _Reference(losses, grads, token_loss_sum / tokens, more_sum.item() / more_tokens, aux)


def _expected_aux(chunks, reference: _Reference) -> list[float]:
    """The aux values this rank should record in a step: per (MoE chunk, micro-batch), the sum
    of the chunk's MoE layers' single-process aux losses on that micro-batch (sorted)."""
    out = []
    for chunk in chunks:
        names = [n for n, b in chunk.layers.items() if b.moe is not None]
        if names:
            per_mb = zip(*(reference.aux[n] for n in names), strict=True)
            out += [sum(values) for values in per_mb]
    return sorted(out)


@dataclasses.dataclass
class _Deviations:
    """Max deviations from the single-process run over the ranks of a case."""

    loss: float = 0.0  # |micro-batch loss - reference| (last stage)
    grad: float = 0.0  # |grad - reference| over every parameter element
    eval_rel: float = 0.0  # |eval loss - reference| / reference, before and after the step
    aux: float = 0.0  # |recorded aux - reference| per (chunk, micro-batch), inf if NaN
    aux_count_ok: bool = True  # one aux value per (MoE chunk, micro-batch), none extra

    def merge(self, other: _Deviations) -> _Deviations:
        return _Deviations(
            max(self.loss, other.loss),
            max(self.grad, other.grad),
            max(self.eval_rel, other.eval_rel),
            max(self.aux, other.aux),
            self.aux_count_ok and other.aux_count_ok,
        )


def _pp_case(group, pp_rank: int, pp: int, model_kind: str, schedule: str) -> _Deviations:
    """This rank's deviations: eval, one training step, eval again (also on more
    micro-batches than the pipeline's count)."""
    spec = DENSE if model_kind == "dense" else MOE
    batches = _micro_batches(spec)
    ref = _reference(spec, batches)
    plan = ParallelPlan(pp=pp, vpp=SCHEDULES[schedule], schedule=schedule, grad_accum=MICRO_BATCHES)
    chunks = split_model_for_pipeline(build_model(spec), plan, pp_rank)
    for chunk in chunks:
        chunk.to_empty(device="cpu")
        chunk.init_weights(seed=0)
    runner = PipelineRunner(chunks, plan, group, cross_entropy_loss, "cpu")
    dev = _Deviations()
    evals = [runner.eval(batches)]
    assert runner.aux_losses() == [], "a forward-only pass recorded aux losses"
    losses = runner.step(batches)
    recorded = sorted(v.item() for v in runner.aux_losses())
    evals.append(runner.eval(batches))
    dev.eval_rel = max(abs(e - ref.eval_loss) / ref.eval_loss for e in evals)
    more = runner.eval(_micro_batches(spec, EVAL_MICRO_BATCHES))
    dev.eval_rel = max(dev.eval_rel, abs(more - ref.eval_loss_more) / ref.eval_loss_more)
    expected = _expected_aux(chunks, ref)
    dev.aux_count_ok = len(recorded) == len(expected) == len(runner.aux_losses())
    if recorded:
        finite = all(math.isfinite(v) for v in recorded)
        dev.aux = (
            max(abs(a - b) for a, b in zip(recorded, expected, strict=True)) if finite else math.inf
        )
    if runner.has_last:
        dev.loss = max(abs(a - b).item() for a, b in zip(losses, ref.losses, strict=True))
    else:
        assert losses == []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            dev.grad = max(dev.grad, (p.grad - ref.grads[name]).abs().max().item())
    runner.close()
    return dev


def _pp_worker(pp: int, cases: list[tuple[str, str]]) -> dict:
    """pp = 2: each pair of ranks runs half of the cases; pp = 4: all ranks run every case."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    if pp == 2:
        group, pp_rank, cases = pairs[rank // 2], rank % 2, cases[rank // 2 :: 2]
    else:
        group, pp_rank = dist.group.WORLD, rank
    return {
        f"pp{pp}-{model_kind}-{schedule}": _pp_case(group, pp_rank, pp, model_kind, schedule)
        for model_kind, schedule in cases
    }


def _merge(per_rank: list[dict]) -> dict[str, _Deviations]:
    merged: dict[str, _Deviations] = {}
    for result in per_rank:
        for key, dev in result.items():
            merged[key] = merged.get(key, _Deviations()).merge(dev)
    return merged


@pytest.fixture(scope="module")
def deviations_pp2_ci() -> dict:
    return _merge(run_ranks(WORLD, _pp_worker, 2, CI_CASES_PP2, timeout_s=300))


@pytest.fixture(scope="module")
def deviations_pp2() -> dict:
    slow = [c for c in CASES_PP2 if c not in CI_CASES_PP2]
    return _merge(run_ranks(WORLD, _pp_worker, 2, slow, timeout_s=300))


@pytest.fixture(scope="module")
def deviations_pp4() -> dict:
    return _merge(run_ranks(WORLD, _pp_worker, 4, CASES_PP4, timeout_s=300))


def _check(dev: _Deviations, moe: bool) -> None:
    assert dev.loss < TOL and dev.grad < TOL, f"loss {dev.loss:.3g}, grads {dev.grad:.3g}"
    assert dev.eval_rel <= EVAL_RTOL, f"eval loss deviates by {dev.eval_rel:.3g} (relative)"
    assert dev.aux_count_ok, "aux losses recorded other than one per (MoE chunk, micro-batch)"
    if moe:
        assert dev.aux < TOL, f"aux losses of step 1 deviate by {dev.aux:.3g}"


@pytest.mark.parametrize(("model_kind", "schedule"), CI_CASES_PP2)
def test_pp2_schedule_matches_single_process_ci(deviations_pp2_ci, model_kind, schedule):
    _check(deviations_pp2_ci[f"pp2-{model_kind}-{schedule}"], model_kind == "moe")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_kind", "schedule"), [c for c in CASES_PP2 if c not in CI_CASES_PP2]
)
def test_pp2_schedule_matches_single_process(deviations_pp2, model_kind, schedule):
    _check(deviations_pp2[f"pp2-{model_kind}-{schedule}"], model_kind == "moe")


@pytest.mark.slow
@pytest.mark.parametrize(("model_kind", "schedule"), CASES_PP4)
def test_pp4_schedule_matches_single_process(deviations_pp4, model_kind, schedule):
    _check(deviations_pp4[f"pp4-{model_kind}-{schedule}"], model_kind == "moe")


def test_split_covers_every_parameter_once_with_original_names():
    full = {n for n, _ in build_model(MOE).named_parameters()}
    for schedule, vpp in SCHEDULES.items():
        plan = ParallelPlan(pp=2, vpp=vpp, schedule=schedule, grad_accum=MICRO_BATCHES)
        names = [
            n
            for rank in range(2)
            for chunk in split_model_for_pipeline(build_model(MOE), plan, rank)
            for n, _ in chunk.named_parameters()
        ]
        assert sorted(names) == sorted(full), schedule


def test_stage_placement_and_layer_ranges():
    assert [chunks_of_rank("zbv", 4, 2, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    loop = [chunks_of_rank("interleaved-1f1b", 4, 2, r) for r in range(4)]
    assert loop == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # The LM head (2 * 97 * 32 FLOPs/token) is small next to a layer here: 8 layers over 2
    # stages split 4 + 4; a big vocabulary moves layers off the last stage.
    assert [len(r) for r in stage_layer_ranges(DENSE, ParallelPlan(pp=2))] == [4, 4]
    big_head = DENSE.with_(vocab=65536)
    assert [len(r) for r in stage_layer_ranges(big_head, ParallelPlan(pp=2))] == [7, 1]


def test_tied_head_on_the_last_stage_keeps_its_own_copy_of_the_embedding():
    spec = DENSE.with_(tied_embeddings=True)
    assert ParallelPlan(pp=2).problems(spec) == []  # once refused: no longer
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    first, last = (split_model_for_pipeline(model, ParallelPlan(pp=2), r)[0] for r in (0, 1))
    assert first.output is None and last.tok_embeddings is None
    assert last.output.weight is not model.tok_embeddings.weight  # a copy of its own
    assert torch.equal(last.output.weight, first.tok_embeddings.weight)


def test_runner_refuses_too_few_micro_batches_for_dualpipev_before_touching_the_group():
    plan = ParallelPlan(pp=2, vpp=2, schedule="dualpipev", grad_accum=3)
    with pytest.raises(ConfigError, match="needs at least 4"):
        plan.validate()
    with pytest.raises(AssertionError, match="needs at least 4"):
        PipelineRunner([], plan, None, cross_entropy_loss, "cpu")


def _torch_zbv_order(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's own ZBV order for one rank: (F | B | W, micro-batch, stage), B = its input pass."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    zbv = object.__new__(ScheduleZBVZeroBubble)  # the order only: no stages, no process group
    zbv.pp_group_size, zbv._n_microbatches, zbv.num_stages = pp, m, 2 * pp
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    order = zbv._calculate_single_rank_operations(rank)
    return [(kinds[a.computation_type.name], a.microbatch_index, a.stage_index) for a in order if a]


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_zbv_least_micro_batches_and_order_are_torchs(pp):
    """From 2 pp - 1 micro-batches on, the planner's ZBV actions are torch's, rank by rank; one
    fewer and torch fills its 2 pp - 1 order with idle slots, which the plan refuses."""
    least = least_microbatches("zbv", pp)
    assert least == 2 * pp - 1
    for m in (least, least + 1, least + 4):
        planned = build_schedule("zbv", pp, 2, m).actions
        for rank in range(pp):
            ours = [(a.kind, a.microbatch, a.chunk) for a in planned[rank]]
            assert ours == _torch_zbv_order(pp, m, rank), (pp, m, rank)
    assert ParallelPlan(pp=pp, vpp=2, schedule="zbv", grad_accum=least).problems() == []
    (problem,) = ParallelPlan(pp=pp, vpp=2, schedule="zbv", grad_accum=least - 1).problems()
    assert f"needs at least {least}" in problem
    with pytest.raises(ConfigError, match=f"needs at least {least}"):
        build_schedule("zbv", pp, 2, least - 1)
