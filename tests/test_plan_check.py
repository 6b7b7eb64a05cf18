"""`fivefold plan check` on two small cases: fivefold's runtime built for 8 ranks under a fake
process group and fake tensors, one step per stage, its counted peak beside the planner's
prediction: a pipelined dense model (TP 2 with SP, 1F1B over 2 stages, FSDP2 ZeRO-3 over 2
ranks, bf16 compute) and an MoE model under ZeRO-3 with full recompute, whose peak sits in a
block's backward."""

from __future__ import annotations

from pathlib import Path

from fivefold.specs.recipe import load_recipe
from fivefold.train.plan_check import check_plan, micro_batches_to_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG = CONFIGS / "llama3-8b-dgx-h100.toml"
# Llama 3 8B's widths at 8 layers: every per-layer term of the prediction, a fast step.
OVERRIDES = [
    "cluster.gpus=8",
    "plan.tp=2",
    "plan.pp=2",
    "plan.dp_shard=2",
    "model.seq_len=4096",
    "plan.grad_accum=4",
    "model.layers=8",
]


def test_pipelined_plan_runs_both_stages_within_five_percent():
    recipe = load_recipe(str(CONFIG), OVERRIDES)
    # 4 micro-batches: rank 0's forward of micro-batch 2 meets the gradients of micro-batch 0
    # (with 2 it would not), so the check runs all of them.
    assert micro_batches_to_run(recipe.plan) == 4
    checks = check_plan(recipe)
    assert [(c.stage, c.rank) for c in checks] == [(0, 0), (1, 4)]
    for check in checks:
        assert not check.problem, check.problem
        assert check.counted_bytes > 2**30  # both stages ran a step of GiB-sized tensors
        assert abs(check.error) <= 0.05, (check.stage, check.predicted_gib, check.counted_bytes)


def test_moe_full_recompute_peak_in_a_block_backward_within_five_percent():
    # Mixtral 8x7B's widths at 4 layers, EP4 and ZeRO-3 over 8 ranks (two experts per rank,
    # sharded over 2): the peak is in the recomputed backward of the third block, not at the
    # loss (`fivefold.planner.eager_memory.eager_block_backward_excess`).
    overrides = ["cluster.gpus=8", "plan.dp_shard=8", "plan.ep=4", "model.layers=4"]
    recipe = load_recipe(str(CONFIGS / "mixtral-8x7b-dgx-h100.toml"), overrides)
    (check,) = check_plan(recipe)
    assert not check.problem, check.problem
    assert abs(check.error) <= 0.05, (check.predicted_gib, check.counted_bytes)
