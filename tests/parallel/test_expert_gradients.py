"""The experts' gradients under EP x ZeRO-3 (FSDP2 wraps each MoE's experts on their own),
with and without gradient accumulation, against the single-process run's after one step; and
the experts' output is no view, so FSDP2 has no reason to warn that its pre-backward hook
could be dropped (an in-place op on a view output would skip the all-gather)."""

from __future__ import annotations

import pytest
from harness import (
    GLOBAL_BATCH,
    MODELS,
    TRAIN,
    global_micro_batches,
    rank_micro_batches,
    run_ranks,
    synthetic_global_batch,
)

from fivefold.train.config import parse_train_config

MODEL = MODELS["parity-moe-2e"]  # 2 layers, 2 experts, top-1
GRAD_ATOL = 1e-6  # fp32; the gradients are about 1e-3


def _recipe(plan: dict, world: int):
    from fivefold.specs.recipe import recipe_from_dict

    data = {"model": dict(MODEL), "plan": {"precision": "fp32", **plan}, "train": dict(TRAIN)}
    return recipe_from_dict(data, default_world=world)


def _expert_grads(model_parts) -> dict:
    """{name: full gradient} of every expert weight (collective under DTensor)."""
    from torch.distributed.tensor import DTensor

    from fivefold.model.init import canonical_fqn

    out = {}
    for part in model_parts:
        for name, param in part.named_parameters():
            if ".experts." in name and param.grad is not None:
                grad = param.grad
                grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
                out[canonical_fqn(name)] = grad.detach().clone()
    return out


def reference_grads(grad_accum: int, dp: int) -> dict:
    from fivefold.train.runtime import LocalRuntime

    micro = GLOBAL_BATCH // grad_accum
    recipe = _recipe({"grad_accum": grad_accum, "micro_batch": micro}, 1)
    runtime = LocalRuntime(recipe, parse_train_config(recipe).train)
    batch = synthetic_global_batch(0, recipe.model.vocab, recipe.model.seq_len)
    runtime.train_step(global_micro_batches(batch, dp, grad_accum))
    return _expert_grads(runtime.model_parts)


def zero3_grads(plan: dict, world: int) -> tuple[dict, list[str]]:
    """One rank's step: the experts' full gradients and the warnings FSDP2 gave."""
    import warnings

    from fivefold.train.runtime import distributed_runtime

    recipe = _recipe(plan, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
        batch = synthetic_global_batch(0, recipe.model.vocab, recipe.model.seq_len)
        mine = rank_micro_batches(batch, runtime.dp_rank, runtime.dp_size, plan["grad_accum"])
        runtime.train_step(mine)
    grads = _expert_grads(runtime.model_parts)
    runtime.close()
    return grads, [str(w.message) for w in caught if "view tensor" in str(w.message)]


# with accumulation in CI (each micro-batch's reduce-scatter under ZeRO-3); without, slow
@pytest.mark.parametrize("grad_accum", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_zero3_expert_gradients_equal_the_single_process_run(grad_accum) -> None:
    import torch

    plan = {
        "dp_shard": 2,
        "ep": 2,
        "zero": 3,
        "micro_batch": GLOBAL_BATCH // (2 * grad_accum),
        "grad_accum": grad_accum,
    }
    (expected,) = run_ranks(1, reference_grads, grad_accum, 2)
    ranks = run_ranks(2, zero3_grads, plan, 2)
    for grads, view_warnings in ranks:
        assert not view_warnings, view_warnings[0]
        assert sorted(grads) == sorted(expected) and len(grads) == 6  # 2 layers x w1, w2, w3
        for name, grad in grads.items():
            assert grad.abs().max() > 1e-5, name  # every expert was routed tokens
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=GRAD_ATOL)
