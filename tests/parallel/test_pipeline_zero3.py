"""ZeRO-3 under pipeline parallelism gathers each FSDP unit once per step, not per micro-batch.

PP2 (1F1B) x ZeRO-3 x2 with 4 micro-batches: each rank's chunk has 4 blocks and a chunk root,
five FSDP units. Re-sharding after every forward would all-gather each block 4 times in forward
and 4 times in backward; kept gathered across the micro-batches (torchtitan's FSDP-under-PP
behaviour) it is one all-gather per unit and step, and the units are sharded again after the
step and after a forward-only evaluation. Losses still match the single-process run (the PP x
ZeRO-3 parity cases).
"""

from __future__ import annotations

from harness import ParityCase, recipe_dict, reference_for, run_ranks, synthetic_global_batch

from fivefold.train.config import parse_train_config

CASE = ParityCase(
    "PP2 1f1b x ZeRO-3 x2 accum 4",
    {"pp": 2, "dp_shard": 2, "zero": 3, "micro_batch": 1, "grad_accum": 4},
    steps=2,
)


def _count_all_gathers(rd: dict, world: int) -> dict:
    import torch.distributed as dist
    from harness import rank_micro_batches
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.runtime import distributed_runtime

    recipe = recipe_from_dict(rd, default_world=world)
    runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    calls = {"n": 0}
    original = dist.all_gather_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counting
    units = [m for part in runtime.model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    losses, gathers = [], []
    for step in range(2):  # the first step also runs torch's shape inference
        batch = synthetic_global_batch(step, recipe.model.vocab, recipe.model.seq_len)
        mine = rank_micro_batches(batch, runtime.dp_rank, runtime.dp_size, 4)
        calls["n"] = 0
        losses.append(runtime.train_step(mine).loss)
        gathers.append(calls["n"])
        for part in runtime.model_parts:
            part.zero_grad(set_to_none=True)
    sharded_after_step = all(isinstance(p, DTensor) for u in units for p in u.parameters())
    runtime.eval_loss(mine)
    sharded_after_eval = all(isinstance(p, DTensor) for u in units for p in u.parameters())
    dist.all_gather_single = original
    runtime.close()
    return {
        "units": len(units),
        "gathers": gathers,
        "losses": losses,
        "sharded": (sharded_after_step, sharded_after_eval),
    }


def test_zero3_chunk_gathered_once_per_step() -> None:
    reference = reference_for(CASE)
    ranks = run_ranks(4, _count_all_gathers, recipe_dict(CASE), 4, timeout_s=180)
    for out in ranks:
        assert out["units"] == 5
        assert out["gathers"][1] == out["units"], out
        assert out["sharded"] == (True, True)
        ref = reference["losses"][0]  # same weights at step 1 (no optimizer step here)
        assert abs(out["losses"][0] - ref) <= 1e-5 * ref
