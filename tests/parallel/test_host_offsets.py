"""Pipeline and context parallel steps read nothing back from the device when the batch brings
its host-side document offsets (`Batch.cu_seqlens`, as the data loader makes them): every stage
and every CP rank derives its documents from them, instead of reading doc ids back (PP: per
stage and micro-batch) or all-gathering and reading them back (CP). Counted on 2 gloo ranks
with `host_reads.HostReads` over a whole training step after the first; the losses with and
without the offsets are the same.
"""

from __future__ import annotations

import dataclasses

import pytest
from harness import ParityCase, rank_micro_batches, recipe_dict, run_ranks, synthetic_global_batch

from fivefold.train.config import parse_train_config

CASES = {
    "pp2": ParityCase("PP2", {"pp": 2, "micro_batch": 2, "grad_accum": 4}),
    "cp2": ParityCase("CP2", {"cp": 2, "micro_batch": 4, "grad_accum": 2}),
}
MODEL = {"preset": "tiny", "layers": 2, "seq_len": 64, "vocab": 512}


def _rank(rd: dict, world: int) -> dict:
    from fivefold.model.loss import IGNORE_INDEX
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.data.batching import document_offsets
    from fivefold.train.runtime import distributed_runtime
    from host_reads import HostReads

    recipe = recipe_from_dict(rd, default_world=world)
    runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    batch = synthetic_global_batch(0, recipe.model.vocab, recipe.model.seq_len)
    plain = rank_micro_batches(batch, runtime.dp_rank, runtime.dp_size, recipe.plan.grad_accum)
    hosted = [  # as the data loader makes them: offsets and label counts from the host
        dataclasses.replace(
            mb,
            cu_seqlens=document_offsets(mb.doc_ids.numpy()),
            label_count=int((mb.labels != IGNORE_INDEX).sum()),
        )
        for mb in plain
    ]
    out = {"eval": [runtime.eval_loss(plain), runtime.eval_loss(hosted)]}
    runtime.train_step(hosted)  # the first step: shape inference, set-up
    with HostReads() as reads:
        runtime.train_step(hosted)
    out["reads"] = reads.reads
    runtime.close()
    return out


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> tuple[str, list[dict]]:
    rd = recipe_dict(CASES[request.param])
    rd["model"] = dict(MODEL)
    return request.param, run_ranks(2, _rank, rd, 2)


def test_a_step_reads_nothing_back_given_host_offsets(case):
    key, ranks = case
    for rank in ranks:
        assert rank["reads"] == [], f"{key}: {rank['reads']}"


def test_host_offsets_give_the_losses_doc_ids_give(case):
    key, ranks = case
    for rank in ranks:
        plain, hosted = rank["eval"]
        assert hosted == pytest.approx(plain, rel=1e-6), key
