"""Resume on a different layout: weights and optimizer state bitwise equal after the load.

Each case trains 2 steps under layout A with the real `DistributedRuntime`, saves, checks that
the live state equals what was written, and trains 2 more steps; then layout B loads the
checkpoint, must hold exactly the written tensors (every global FQN, bitwise, model and AdamW
state), resumes at step 2 with the same learning rate, and its next losses match A's
continuation to the parity tolerance (different layouts sum in different orders).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from ckpt_harness import run_ranks
from ckpt_workers import (
    Trainee,
    async_save_overlapping_training,
    compare_with_checkpoint,
    reshard_chain,
    save_then_continue,
)

from fivefold.checkpoint.hf import export_hf, read_hf

LOSS_RTOL = 1e-5
STEPS_BEFORE, STEPS_AFTER = 2, 2

DP4 = {"dp_replicate": 4, "micro_batch": 2}
TP2_PP2 = {"tp": 2, "pp": 2, "schedule": "1f1b", "grad_accum": 2, "micro_batch": 4}
ZERO3_DP4 = {"dp_shard": 4, "zero": 3, "micro_batch": 2}
PP4_1F1B = {"pp": 4, "schedule": "1f1b", "grad_accum": 4, "micro_batch": 2}
PP2_INTERLEAVED = {
    "pp": 2,
    "vpp": 2,
    "schedule": "interleaved-1f1b",
    "dp_replicate": 2,
    "grad_accum": 2,
    "micro_batch": 2,
}
CP2_DP2 = {"cp": 2, "dp_replicate": 2, "micro_batch": 4}
EP2 = {"dp_shard": 4, "zero": 1, "ep": 2, "micro_batch": 2}
EP4 = {"dp_shard": 4, "zero": 3, "ep": 4, "micro_batch": 2}
HSDP2x2 = {"dp_replicate": 2, "dp_shard": 2, "zero": 3, "micro_batch": 2}
ZERO2_DP4 = {"dp_shard": 4, "zero": 2, "micro_batch": 1, "grad_accum": 2}

MATRIX = {
    "DP4->TP2xPP2": (DP4, TP2_PP2, False),
    "TP2xPP2->ZeRO3-DP4": (TP2_PP2, ZERO3_DP4, False),
    "PP4-1F1B->PP2-interleaved": (PP4_1F1B, PP2_INTERLEAVED, False),
    "CP2xDP2->DP4": (CP2_DP2, DP4, False),
    "EP2->EP4-MoE": (EP2, EP4, True),
    "HSDP2x2->ZeRO2-DP4": (HSDP2x2, ZERO2_DP4, False),
}
# tied embeddings: both ends of a V on one rank (ZeRO-3 shards) -> an embedding group over PP4
PP2_DUALPIPEV_ZERO3 = {
    "pp": 2,
    "vpp": 2,
    "schedule": "dualpipev",
    "dp_shard": 2,
    "zero": 3,
    "grad_accum": 4,
    "micro_batch": 1,
}
TIED_MATRIX = {"Tied PP2-dualpipev-ZeRO3->PP4-1F1B": (PP2_DUALPIPEV_ZERO3, PP4_1F1B, "tied")}
# Muon's momentum buffers (and AdamW's m, v for the rest), Newton-Schulz in fp32 so that the
# continuation on another layout matches to the parity tolerance (bf16: tests/parallel)
MUON = {"optimizer": "muon", "muon_ns_dtype": "fp32"}
ZERO3_DP2_TP2 = {"dp_shard": 2, "zero": 3, "tp": 2, "micro_batch": 4}
# All five folds (16 ranks) -> TP2 x ZeRO-3 over 8 with EP4: every fold changes but TP
FIVE_FOLDS = {
    "tp": 2,
    "pp": 2,
    "schedule": "1f1b",
    "cp": 2,
    "dp_shard": 2,
    "zero": 1,
    "ep": 4,
    "micro_batch": 2,
    "grad_accum": 2,
}
TP2_ZERO3_DP8_EP4 = {"tp": 2, "dp_shard": 8, "zero": 3, "ep": 4, "micro_batch": 1}
MUON_MATRIX = {
    "Muon ZeRO3-DP2xTP2->TP2xPP2": (ZERO3_DP2_TP2, TP2_PP2, False, MUON),
    "Muon TP2xPP2->ZeRO1-DP4": (TP2_PP2, {"dp_shard": 4, "zero": 1, "micro_batch": 2}, False, MUON),
}


def check_case(name: str, ranks: list[dict]) -> None:
    """`ranks`: every rank's {"saved": ..., "loaded": ...} result of one case."""
    saved, loaded = ranks[0]["saved"], ranks[0]["loaded"]
    for rank, case in enumerate(ranks):
        assert case["saved"]["check"]["differ"] == [], (name, rank, "live state != written")
        assert case["loaded"]["check"]["differ"] == [], (name, rank, "loaded != written")
        assert case["loaded"]["step"] == STEPS_BEFORE
    covered = set().union(*(set(case["loaded"]["check"]["keys"]) for case in ranks))
    assert covered == set(loaded["check"]["saved_keys"]), f"{name}: keys not restored"
    assert any(k.startswith("optim.state.") for k in covered)
    if name.startswith("Muon"):  # one buffer per block matrix, AdamW's two for the rest
        assert any(k.endswith(".momentum_buffer") for k in covered), name
        assert any(k.endswith(".exp_avg_sq") for k in covered), name
    for a, b in zip(saved["losses_after"], loaded["losses_after"], strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (
            name,
            saved["losses_after"],
            loaded["losses_after"],
        )


def run_matrix(names: list[str], root) -> None:
    cases = [{**MATRIX, **MUON_MATRIX, **TIED_MATRIX}[name] for name in names]
    ranks = run_ranks(4, reshard_chain, cases, str(root), STEPS_BEFORE, STEPS_AFTER, timeout_s=600)
    for index, name in enumerate(names):
        check_case(name, [out[index] for out in ranks])


def test_reshard_tp2_pp2_to_zero3_dp4(tmp_path):
    run_matrix(["TP2xPP2->ZeRO3-DP4"], tmp_path)


@pytest.mark.parametrize("name", [n for n in MATRIX if n != "TP2xPP2->ZeRO3-DP4"])
def test_reshard_matrix(tmp_path, name):
    run_matrix([name], tmp_path)


@pytest.mark.slow
def test_reshard_all_five_folds_to_tp2_zero3_ep4(tmp_path):
    cases = [(FIVE_FOLDS, TP2_ZERO3_DP8_EP4, True)]
    args = (cases, str(tmp_path), STEPS_BEFORE, STEPS_AFTER)
    ranks = run_ranks(16, reshard_chain, *args, timeout_s=1500, pg_timeout_s=600)
    check_case("5-D->TP2xZeRO3-DP8xEP4", [out[0] for out in ranks])


@pytest.mark.slow
def test_muon_state_reshards_zero3_tp2_to_tp2_pp2(tmp_path):
    run_matrix(["Muon ZeRO3-DP2xTP2->TP2xPP2"], tmp_path)


@pytest.mark.slow
def test_muon_state_reshards_tp2_pp2_to_zero1_dp4(tmp_path):
    run_matrix(["Muon TP2xPP2->ZeRO1-DP4"], tmp_path)


@pytest.mark.slow
def test_tied_embeddings_reshard_dualpipev_zero3_to_pp4(tmp_path):
    run_matrix(["Tied PP2-dualpipev-ZeRO3->PP4-1F1B"], tmp_path)


def test_tied_embeddings_pp2_to_one_process(tmp_path):
    """A tied model's two pipeline copies load bitwise into the one matrix of one process (the
    LM head's optimizer state saved under the embedding's name) and resume there."""
    plan = {"pp": 2, "schedule": "1f1b", "grad_accum": 2, "micro_batch": 4}
    saved = run_ranks(2, save_then_continue, plan, str(tmp_path), STEPS_BEFORE, STEPS_AFTER, "tied")
    assert all(out["check"]["differ"] == [] for out in saved)
    trainee = Trainee({"micro_batch": 8}, world=1, moe="tied")
    assert trainee.load(trainee.checkpointer(str(tmp_path))) == STEPS_BEFORE
    check = compare_with_checkpoint(
        trainee.runtime.model_parts, trainee.optimizer, saved[0]["path"]
    )
    assert check["differ"] == [] and check["keys"] == check["saved_keys"]
    assert "optim.state.output.weight.exp_avg" not in check["saved_keys"]  # saved once
    export_hf(Path(saved[0]["path"]), tmp_path / "hf")  # the HF export keeps it tied
    spec, hf = read_hf(tmp_path / "hf")
    assert spec.tied_embeddings and "output.weight" in hf
    assert torch.equal(hf["tok_embeddings.weight"], trainee.runtime.model.tok_embeddings.weight)
    losses = trainee.train(STEPS_AFTER)
    for a, b in zip(saved[1]["losses_after"], losses, strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(a)


def test_world_size_change_4_to_1(tmp_path):
    """A 4-rank ZeRO-3 checkpoint loads bitwise into one plain process (and resumes there)."""
    saved = run_ranks(
        4, save_then_continue, ZERO3_DP4, str(tmp_path), STEPS_BEFORE, STEPS_AFTER, timeout_s=300
    )
    assert all(out["check"]["differ"] == [] for out in saved)
    trainee = Trainee({"micro_batch": 8}, world=1)
    ckpt = trainee.checkpointer(str(tmp_path))
    assert trainee.load(ckpt) == STEPS_BEFORE
    check = compare_with_checkpoint(
        trainee.runtime.model_parts, trainee.optimizer, saved[0]["path"]
    )
    assert check["differ"] == [] and check["keys"] == check["saved_keys"]
    losses = trainee.train(STEPS_AFTER)
    for a, b in zip(saved[0]["losses_after"], losses, strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(a)


def test_world_size_change_1_to_8(tmp_path):
    """A single-process checkpoint resumes on 8 ranks (DP2 x TP2 x PP2), bitwise."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    trainee = Trainee({"micro_batch": 8}, world=1)
    trainee.train(STEPS_BEFORE)
    path = trainee.save(trainee.checkpointer(str(tmp_path)))
    expected = trainee.train(STEPS_AFTER)
    plan = {"dp_replicate": 2, "tp": 2, "pp": 2, "grad_accum": 2, "micro_batch": 2}
    from ckpt_workers import load_then_continue

    ranks = run_ranks(8, load_then_continue, plan, str(tmp_path), STEPS_AFTER, timeout_s=600)
    assert all(out["check"]["differ"] == [] for out in ranks)
    covered = set().union(*(set(out["check"]["keys"]) for out in ranks))
    assert covered == set(ranks[0]["check"]["saved_keys"]) and path.endswith("step_2")
    for a, b in zip(expected, ranks[0]["losses_after"], strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(a)


def test_async_save_on_4_ranks(tmp_path):
    """TP2 x ZeRO-3 DP2: the background write holds the saving step's state, committed."""
    plan = {"tp": 2, "dp_shard": 2, "zero": 3, "micro_batch": 4}
    ranks = run_ranks(4, async_save_overlapping_training, plan, str(tmp_path), timeout_s=300)
    for out in ranks:
        assert out["differ"] == [] and out["valid"]
        assert out["changed_since"] > 0  # training went on meanwhile
