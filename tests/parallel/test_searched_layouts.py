"""Layouts the search proposes run: `fivefold plan`'s choices for the parity models (dense, MoE,
tied embeddings) on 4 ranks train exactly like the single process.

The search sees a 4-GPU H100 node (the CPU has no HBM figure to plan against); what it proposes
must pass the runtime's checks and then match the single-process losses and weights.
"""

from __future__ import annotations

import pytest
from harness import GLOBAL_BATCH, MODELS, ParityCase, assert_parity

from fivefold.planner.search.layouts import search
from fivefold.specs import cluster_preset
from fivefold.specs.recipe import model_from_dict

PLAN_FIELDS = ("tp", "sp", "pp", "vpp", "schedule", "dp_replicate", "dp_shard", "zero", "cp")
PLAN_FIELDS += ("cp_kind", "ep", "micro_batch", "grad_accum", "recompute")


def searched_cases(model_key: str, count: int) -> list[ParityCase]:
    """Up to `count` layouts the search accepted for `model_key`, one per shape (tp, pp and its
    schedule, cp, ep), the search's best first: what it may propose on 4 ranks."""
    model = model_from_dict(MODELS[model_key])
    result = search(
        model,
        cluster_preset("dgx-h100", 4),
        global_batch=GLOBAL_BATCH,
        top=5,
        precisions=("fp32",),
    )
    accepted = [result.best_plan, *(c.plan for c in result.search_state.candidates)]
    cases, shapes = [], set()
    for plan in accepted:
        shape = (plan.tp, plan.pp, plan.schedule if plan.pp > 1 else "", plan.cp, plan.ep)
        if shape in shapes or plan.world_size != 4:
            continue
        shapes.add(shape)
        fields = {k: getattr(plan, k) for k in PLAN_FIELDS}
        cases.append(ParityCase(f"searched {model_key}: {plan.describe()}", fields, model_key, 2))
        if len(cases) == count:
            break
    return cases


MODEL_KEYS = ("parity", "parity-moe", "parity-tied")
SEARCHED = {key: searched_cases(key, 8) for key in MODEL_KEYS}
CI_CASES = [SEARCHED[key][1] for key in MODEL_KEYS]  # TP2 x DP2, EP2, tied TP2 x DP2
SLOW_CASES = [c for key in MODEL_KEYS for c in SEARCHED[key] if c not in CI_CASES]


@pytest.mark.parametrize("case", CI_CASES, ids=[c.name for c in CI_CASES])
def test_searched_layout_matches_single_process_ci(case):
    assert_parity(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c.name for c in SLOW_CASES])
def test_searched_layout_matches_single_process(case):
    assert_parity(case)
