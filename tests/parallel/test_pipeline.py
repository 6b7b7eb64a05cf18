"""Pipeline parallelism: every schedule's losses and gradients against the single-process model.

One group of 4 gloo ranks: the pp = 2 cases run on two pairs of ranks at once (each pair takes
half of them), the pp = 4 cases on all four. The reference is the full model run on the same
micro-batches with loss = mean over micro-batches of (cross entropy + MoE aux loss).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import run_ranks

from fivefold.errors import ConfigError
from fivefold.model import build_model, cross_entropy_loss
from fivefold.parallel.pipeline import (
    PipelineRunner,
    split_model_for_pipeline,
    stage_indices,
    stage_layer_ranges,
)
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan

WORLD = 4
TOL = 1e-5
MICRO_BATCHES, MB_SIZE, T = 8, 1, 16
DENSE = ModelSpec(
    name="tiny-pp", layers=8, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=97, seq_len=T
)
MOE = DENSE.with_(
    name="tiny-pp-moe", experts=4, top_k=2, expert_ffn=16, dense_layers=1, router_aux_loss_coef=0.1
)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}  # -> vpp
CASES_PP2 = [("dense", s) for s in SCHEDULES] + [("moe", "1f1b"), ("moe", "zbv")]
CASES_PP4 = [("dense", s) for s in SCHEDULES] + [("moe", "interleaved-1f1b")]


@dataclasses.dataclass
class _Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor


def _micro_batches(spec: ModelSpec) -> list[_Batch]:
    """Packed micro-batches with two documents each (positions restart at the boundary)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(MICRO_BATCHES):
        stream = torch.randint(0, spec.vocab, (MB_SIZE, T + 1), generator=g)
        cut = int(torch.randint(3, T - 3, (1,), generator=g))
        index = torch.arange(T).expand(MB_SIZE, T)
        doc_ids = (index >= cut).long()
        positions = torch.where(index >= cut, index - cut, index)
        out.append(_Batch(stream[:, :-1], stream[:, 1:], positions, doc_ids))
    return out


def _reference(spec: ModelSpec, batches: list[_Batch]):
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    losses = []
    for mb in batches:
        logits = model(mb.tokens, mb.positions, mb.doc_ids)
        loss = cross_entropy_loss(logits, mb.labels)
        losses.append(loss.detach())
        ((loss + model.aux_loss()) / len(batches)).backward()
    return losses, {n: p.grad for n, p in model.named_parameters()}


def _pp_case(group, pp_rank: int, pp: int, model_kind: str, schedule: str) -> tuple[float, float]:
    """(max |loss dev| (0 off the last stage), max |grad dev|) of this rank's chunks."""
    spec = DENSE if model_kind == "dense" else MOE
    batches = _micro_batches(spec)
    ref_losses, ref_grads = _reference(spec, batches)
    plan = ParallelPlan(pp=pp, vpp=SCHEDULES[schedule], schedule=schedule, grad_accum=MICRO_BATCHES)
    chunks = split_model_for_pipeline(build_model(spec), plan, pp_rank)
    for chunk in chunks:
        chunk.to_empty(device="cpu")
        chunk.init_weights(seed=0)
    runner = PipelineRunner(chunks, plan, group, cross_entropy_loss, "cpu")
    losses = runner.step(batches)
    loss_dev = 0.0
    if runner.has_last:
        loss_dev = max(abs(a - b).item() for a, b in zip(losses, ref_losses, strict=True))
    else:
        assert losses == []
    grad_dev = 0.0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            grad_dev = max(grad_dev, (p.grad - ref_grads[name]).abs().max().item())
    runner.close()
    return loss_dev, grad_dev


def _pp_worker(pp: int) -> dict:
    """pp = 2: each pair of ranks runs half of the cases; pp = 4: all ranks run every case."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    if pp == 2:
        group, pp_rank, cases = pairs[rank // 2], rank % 2, CASES_PP2[rank // 2 :: 2]
    else:
        group, pp_rank, cases = dist.group.WORLD, rank, CASES_PP4
    return {
        f"pp{pp}-{model_kind}-{schedule}": _pp_case(group, pp_rank, pp, model_kind, schedule)
        for model_kind, schedule in cases
    }


def _merge(per_rank: list[dict]) -> dict:
    merged: dict[str, tuple[float, float]] = {}
    for result in per_rank:
        for key, (loss_dev, grad_dev) in result.items():
            old = merged.get(key, (0.0, 0.0))
            merged[key] = (max(old[0], loss_dev), max(old[1], grad_dev))
    return merged


@pytest.fixture(scope="module")
def deviations_pp2() -> dict:
    return _merge(run_ranks(WORLD, _pp_worker, 2, timeout_s=300))


@pytest.fixture(scope="module")
def deviations_pp4() -> dict:
    return _merge(run_ranks(WORLD, _pp_worker, 4, timeout_s=300))


@pytest.mark.parametrize(("model_kind", "schedule"), CASES_PP2)
def test_pp2_schedule_matches_single_process(deviations_pp2, model_kind, schedule):
    loss_dev, grad_dev = deviations_pp2[f"pp2-{model_kind}-{schedule}"]
    assert loss_dev < TOL and grad_dev < TOL, f"loss {loss_dev:.3g}, grads {grad_dev:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize(("model_kind", "schedule"), CASES_PP4)
def test_pp4_schedule_matches_single_process(deviations_pp4, model_kind, schedule):
    loss_dev, grad_dev = deviations_pp4[f"pp4-{model_kind}-{schedule}"]
    assert loss_dev < TOL and grad_dev < TOL, f"loss {loss_dev:.3g}, grads {grad_dev:.3g}"


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
    v_plan = ParallelPlan(pp=4, vpp=2, schedule="zbv", grad_accum=8)
    assert [stage_indices(v_plan, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    loop = v_plan.with_(schedule="interleaved-1f1b")
    assert [stage_indices(loop, r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # The LM head (2 * 97 * 32 FLOPs/token) is small next to a layer here: 8 layers over 2
    # stages split 4 + 4; a big vocabulary moves layers off the last stage.
    assert [len(r) for r in stage_layer_ranges(DENSE, ParallelPlan(pp=2))] == [4, 4]
    big_head = DENSE.with_(vocab=65536)
    assert [len(r) for r in stage_layer_ranges(big_head, ParallelPlan(pp=2))] == [7, 1]


def test_tied_embeddings_with_pipeline_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="tied_embeddings"):
        split_model_for_pipeline(
            build_model(DENSE.with_(tied_embeddings=True)), ParallelPlan(pp=2), 0
        )


def test_runner_refuses_too_few_micro_batches_for_dualpipev_before_touching_the_group():
    plan = ParallelPlan(pp=2, vpp=2, schedule="dualpipev", grad_accum=3)
    with pytest.raises(ConfigError, match="at least as many micro-batches as stages"):
        PipelineRunner([], plan, None, cross_entropy_loss, "cpu")
