"""Resume across the memory levers: an offloaded run on a non-offloaded layout and back, and
a run with 8-bit Adam states on fp32 states and back (converted through the checkpoint).

Offload keeps AdamW's state keys and layout, so the chain is bitwise: what one layout wrote is
exactly what the other holds after the load, and its continuation matches to the parity
tolerance. 8-bit states are written dequantised (fp32), so fp32 AdamW loads them bitwise; an
8-bit optimizer loading fp32 states quantises them again, within the 8-bit code's error.
"""

from __future__ import annotations

import pytest
from ckpt_harness import run_ranks
from ckpt_workers import Trainee, reshard_chain, save_then_continue
from test_reshard import check_case

STEPS_BEFORE, STEPS_AFTER = 2, 2
ZERO3_OFFLOAD_ALL = {"dp_shard": 2, "zero": 3, "micro_batch": 4, "offload": "all"}
ZERO1 = {"dp_shard": 2, "zero": 1, "micro_batch": 4}
ZERO1_OFFLOAD_OPTIMIZER = {**ZERO1, "offload": "optimizer"}
ZERO3_8BIT = {"dp_shard": 2, "zero": 3, "micro_batch": 4, "optimizer_states": "8bit"}
TP2_8BIT = {"tp": 2, "micro_batch": 8, "optimizer_states": "8bit"}


def test_offloaded_run_resumes_without_offload_and_back(tmp_path):
    cases = [(ZERO3_OFFLOAD_ALL, ZERO1, False), (ZERO1, ZERO1_OFFLOAD_OPTIMIZER, False)]
    ranks = run_ranks(
        2, reshard_chain, cases, str(tmp_path), STEPS_BEFORE, STEPS_AFTER, timeout_s=300
    )
    for index, name in enumerate(["offload all -> none", "none -> offload optimizer"]):
        check_case(name, [out[index] for out in ranks])


def load_other_states(rank, world, plan, root) -> dict:
    """Resume `plan` from the checkpoint in `root`; the live state against the written one."""
    from ckpt_workers import full_state

    from fivefold.checkpoint.dcp_io import read_full_tensors
    from fivefold.parallel.lowbit import state_bytes

    trainee = Trainee(plan, world)
    ckpt = trainee.checkpointer(root)
    step = trainee.load(ckpt)
    saved = read_full_tensors(ckpt.select().path, prefix="")
    live = full_state(trainee.runtime.model_parts, trainee.optimizer)
    deviation = {}
    for key, value in live.items():
        ref = saved[key]
        scale = float(ref.abs().max()) or 1.0
        deviation[key] = float((value.float() - ref.float()).abs().max()) / scale
    losses = trainee.train(STEPS_AFTER)
    out = {"step": step, "deviation": deviation, "losses": losses}
    out["state_bytes"] = state_bytes(trainee.optimizer)
    out["quantised"] = sum(
        hasattr(v.to_local() if hasattr(v, "to_local") else v, "codes")
        for s in trainee.optimizer.state.values()
        for v in s.values()
    )
    trainee.close()
    return out


def test_8bit_states_resume_as_fp32_and_back(tmp_path):
    """ZeRO-3 with 8-bit states writes fp32 m and v; ZeRO-1 with fp32 AdamW loads them bitwise
    and trains on close to the 8-bit run; TP2 with 8-bit states loads them again, quantised."""
    first = tmp_path / "a"
    saved = run_ranks(
        2, save_then_continue, ZERO3_8BIT, str(first), STEPS_BEFORE, STEPS_AFTER, timeout_s=300
    )
    assert all(out["check"]["differ"] == [] for out in saved)  # dequantised, deterministic
    as_fp32 = run_ranks(2, load_other_states, ZERO1, str(first), timeout_s=300)
    for out in as_fp32:
        assert out["step"] == STEPS_BEFORE and out["quantised"] == 0
        assert max(out["deviation"].values()) == 0.0  # bitwise: fp32 loads fp32
    for a, b in zip(saved[0]["losses_after"], as_fp32[0]["losses"], strict=True):
        assert abs(a - b) <= 2e-3 * a  # 8-bit vs fp32 updates for two steps
    as_8bit = run_ranks(2, load_other_states, TP2_8BIT, str(first), timeout_s=300)
    for out in as_8bit:
        assert out["quantised"] > 0
        states = {k: v for k, v in out["deviation"].items() if k.startswith("optim.state.")}
        model = {k: v for k, v in out["deviation"].items() if k.startswith("model.")}
        assert max(model.values()) == 0.0
        # the dynamic 8-bit map's coarsest step near the block maximum is ~1/64 of it
        assert 0 < max(states.values()) < 0.05


@pytest.mark.slow
def test_offloaded_8bit_states_resume_on_fsdp_offload_with_fp32(tmp_path):
    """The host optimizer over torchao's 8-bit AdamW writes fp32 m and v keyed by the model's
    parameters; ZeRO-3 with FSDP2's offload and fp32 AdamW loads them bitwise."""
    plan = {**ZERO1_OFFLOAD_OPTIMIZER, "optimizer_states": "8bit"}
    saved = run_ranks(
        2, save_then_continue, plan, str(tmp_path), STEPS_BEFORE, STEPS_AFTER, timeout_s=300
    )
    assert all(out["check"]["differ"] == [] for out in saved)
    loaded = run_ranks(2, load_other_states, ZERO3_OFFLOAD_ALL, str(tmp_path), timeout_s=300)
    for out in loaded:
        assert out["step"] == STEPS_BEFORE and out["quantised"] == 0
        assert max(out["deviation"].values()) == 0.0
    for a, b in zip(saved[0]["losses_after"], loaded[0]["losses"], strict=True):
        assert abs(a - b) <= 2e-3 * a
