"""The explanation: the reason given for "Y % slower", units, the staircase on real searches."""

import re
from types import SimpleNamespace

import pytest

from fivefold.planner.explain.result import explain, gib, seconds, slower_because
from fivefold.planner.search.layouts import search
from fivefold.specs import ParallelPlan, cluster_preset, model_preset

GiB = 2**30


def _est(tokens_per_s, memory_gib=10.0, bubble=0.0, recompute="none", **breakdown):
    parts = {
        "compute_s": 10.0,
        "in_stage_comm_s": 1.0,
        "pipeline_bubble_s": 0.0,
        "dp_grad_exposed_s": 0.0,
        "param_gather_exposed_s": 0.0,
        "optimizer_s": 0.1,
    }
    parts.update(breakdown)
    return SimpleNamespace(
        tokens_per_s=tokens_per_s,
        breakdown_s=parts,
        bubble_fraction=bubble,
        plan=ParallelPlan(recompute=recompute),
        peak_memory_bytes=memory_gib * GiB,
    )


def test_slower_because_names_the_largest_growth():
    best = _est(1000.0)
    bubbly = _est(800.0, bubble=0.2, pipeline_bubble_s=2.5, in_stage_comm_s=1.5)
    text = slower_because(bubbly, best)
    # 1 - 800/1000 = 20 %; the bubble grew by 2.5 s, communication only by 0.5 s
    assert text.startswith("20.0% slower because its pipeline bubble is 2.50 s longer")
    assert "bubble 20.0% against 0.0%" in text
    chatty = _est(900.0, in_stage_comm_s=2.2)
    assert "exposed in-stage communication" in slower_because(chatty, best)
    assert "1.20 s longer" in slower_because(chatty, best)
    heavy = _est(750.0, recompute="full", compute_s=13.3)
    assert "(recompute full against none)" in slower_because(heavy, best)


def test_slower_because_same_speed_and_ties():
    best = _est(1000.0, memory_gib=30.0)
    assert slower_because(_est(1000.2), best) == "the same speed"
    faster = slower_because(_est(1004.0, memory_gib=62.5), best)
    assert faster.startswith("0.4% faster, within the 0.5% tie band")
    assert "+32.5 GiB per GPU" in faster


def test_units_adapt_to_the_size():
    assert seconds(27.7) == "27.70 s"
    assert seconds(0.0123) == "12.3 ms"
    assert seconds(3.1e-5) == "31 us"
    assert gib(12.55 * GiB) == "12.55 GiB"
    assert gib(3.5 * 2**20) == "3.5 MiB"


@pytest.fixture(scope="module")
def llama70b():
    model, cluster = model_preset("llama3-70b"), cluster_preset("dgx-h100", 64)
    return search(model, cluster, global_batch_tokens=2**21)


def test_staircase_lines_carry_numbers(llama70b):
    lines = explain(llama70b)
    plan = llama70b.best_plan
    tp = next(x for x in lines if x.startswith("Tensor parallelism"))
    assert f"TP = {plan.tp}" in tp or "TP = 1" in tp
    assert re.search(r"TP = \d+: (\d+\.\d% slower|nothing fits|the same speed)", tp)
    batch = next(x for x in lines if x.startswith("Batch"))
    assert f"= {plan.global_batch} sequences = {plan.global_batch * 8192:,} tokens" in batch
    dp = next(x for x in lines if x.startswith("Data parallelism"))
    assert f"= {plan.dp}" in dp and f"ZeRO-{plan.zero}" in dp
    # every other ZeRO stage is argued: slower, the same speed, or out of memory
    for zero in {0, 1, 2, 3} - {plan.zero}:
        assert re.search(rf"ZeRO-{zero}: (\d+\.\d% slower|the same speed|out of memory by)", dp)
    mem = next(x for x in lines if x.startswith("Memory on the worst stage"))
    total = llama70b.best.peak_memory_bytes / GiB
    assert f"= {total:.1f} GiB of 80 GiB HBM" in mem


def test_moe_explanation_argues_expert_parallelism():
    model, cluster = model_preset("tiny-moe"), cluster_preset("dgx-h100", 8)
    result = search(model, cluster, global_batch_tokens=2**16)
    line = next(x for x in explain(result) if x.startswith("Expert parallelism"))
    ep = result.best_plan.ep
    assert f"EP = {ep} puts {4 // ep} of the 4 experts on each rank" in line
    assert re.search(r"EP = \d: (\d+\.\d% (slower|faster)|the same speed|nothing fits)", line)


def test_dense_model_says_ep_is_not_needed(llama70b):
    line = next(x for x in explain(llama70b) if x.startswith("Expert parallelism"))
    assert "not needed" in line and "dense" in line


def test_interleaved_pipeline_counts_chunks_not_stages(capsys):
    from fivefold.cli.main import main

    argv = ["plan", "--model", "llama3-8b", "--gpus", "16", "--pp", "2", "--vpp", "2"]
    argv += ["--global-batch-tokens", "1M"]  # mbs 1: fivefold's runtime fits it
    assert main([*argv, "--schedule", "zbv", "--grad-accum", "16"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "Pipeline: PP" in x)
    # 2 stages x v=2 = 4 chunks; the layer split has one entry per chunk
    split = re.search(r"PP = 2 stages in 4 chunks \(([\d/]+) layers each\), 2 per rank", line)
    assert split is not None, line
    assert len(split.group(1).split("/")) == 4
