"""A layout given in part (a recipe's [plan], `plan estimate`'s flags) completed as the planner
completes one: data parallelism fills the GPUs that tp x pp x cp leave, ZeRO-1 sharded over
every data-parallel rank when there is more than one data-parallel or context rank, sequence
parallelism with tp > 1, two chunks per rank for the V schedules, and the micro-batch count
from the batch (a stated batch exactly, the default one to the nearest count)."""

from __future__ import annotations

import math
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.search.outcomes import batch_target
from fivefold.specs.batch import grad_accum_for, grad_accum_problem
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import is_v_shaped
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan


def complete_layout(
    values: dict[str, Any],
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    dp: int | None = None,
    dp_shard: int | None = None,
    batch: tuple[int | None, int | None] = (None, None),
    recipe_batch: bool = False,
) -> dict[str, Any]:
    """`values` (ParallelPlan fields) with the fields left out filled in, in place and returned.

    `dp` / `dp_shard` are data-parallel degrees asked for explicitly; `batch` is the global
    batch asked for, (tokens, sequences), at most one given; `recipe_batch` keeps a recipe's
    own batch (grad_accum at its default) when none is asked for.
    """
    if dp is not None or not ({"dp_replicate", "dp_shard"} & set(values)):
        _fill_data_parallel(values, cluster, dp, dp_shard)
    values.setdefault("sp", values.get("tp", 1) > 1)
    if is_v_shaped(values.get("schedule", ""), values.get("pp", 1)):
        values.setdefault("vpp", 2)
    tokens, seqs = batch
    if "grad_accum" not in values and tokens is None and seqs is None and recipe_batch:
        values["grad_accum"] = ParallelPlan().grad_accum
    if "grad_accum" not in values:
        target = batch_target(model, tokens, seqs)
        mbs = values.get("micro_batch", 1)
        ranks = values["dp_replicate"] * values["dp_shard"]
        stated = tokens is not None or seqs is not None
        accum = grad_accum_for(target.sequences, mbs, ranks, 0.0 if stated else math.inf)
        if accum is None:
            raise ConfigError(grad_accum_problem(target.sequences, mbs, ranks, "the global batch"))
        values["grad_accum"] = accum
    return values


def _fill_data_parallel(
    values: dict[str, Any], cluster: ClusterSpec, dp: int | None, dp_shard: int | None
) -> None:
    tp, pp, cp = (values.get(k, 1) for k in ("tp", "pp", "cp"))
    inner = tp * pp * cp
    if cluster.world_size % inner:
        raise ConfigError(
            f"tp {tp} x pp {pp} x cp {cp} = {inner} does not divide the "
            f"{cluster.world_size} GPUs; change a degree or --gpus."
        )
    dp = cluster.world_size // inner if dp is None else dp
    zero = values.setdefault("zero", 1 if dp * cp > 1 else 0)
    shard = (dp if zero else 1) if dp_shard is None else dp_shard
    if dp % shard:
        raise ConfigError(f"--dp-shard = {shard} must divide the data-parallel degree {dp}.")
    values["dp_shard"], values["dp_replicate"] = shard, dp // shard
