"""The explorer in a real browser (headless Chromium via Playwright): the page loads, controls
move, and every figure it displays equals the planner's JSON for the same layout.

Each test saves a screenshot under test-artifacts/explore/. Figures are read from the elements'
data-value attributes (the unrounded planner value) and their visible text (the rounded value,
checked against the same format written in Python in `formatting.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys

from fivefold.explore.api import json_safe
from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import explain
from fivefold.planner.frameworks import planner_settings
from fivefold.planner.search.layouts import search
from fivefold.planner.search.outcomes import TIE_FRACTION
from fivefold.specs import (
    ClusterSpec,
    ModelSpec,
    ParallelPlan,
    cluster_preset,
    dump_recipe,
    load_recipe,
    model_preset,
)
from fivefold.specs.recipe import Recipe

from .conftest import screenshot, unfilled_placeholders
from .formatting import fmt_bytes, fmt_gib, fmt_int, fmt_pct, fmt_time

TENANTS = ("params", "grads", "optimizer", "activations", "other")

# What the page reads back: every planner figure it shows, with its text.
READ_FIGURES = """() => {
  const fig = (id) => {
    const n = document.getElementById(id);
    return { value: n.dataset.value === undefined ? null : n.dataset.value, text: n.textContent };
  };
  const kpis = {};
  for (const id of ["kpi-step-time", "kpi-tokens-per-s", "kpi-mfu", "kpi-hfu", "kpi-bubble",
                    "kpi-memory", "kpi-hbm", "kpi-fits", "timeline-bubble", "grad-accum"]) {
    kpis[id] = fig(id);
  }
  const stages = Array.from(document.querySelectorAll("#memory-svg g.stage-bar")).map((g) => ({
    stage: Number(g.dataset.stage), total: g.dataset.total,
    tenants: Object.fromEntries(Array.from(g.querySelectorAll("rect[data-tenant]"))
      .map((r) => [r.dataset.tenant, r.dataset.value])),
  }));
  const comm = Array.from(document.querySelectorAll("#comm-table tr.comm-row")).map((tr) => ({
    kind: tr.dataset.kind, link: tr.dataset.link,
    linkModel: tr.querySelector(".link-model")?.textContent ?? null,
    cells: Object.fromEntries(Array.from(tr.querySelectorAll("td[data-field]"))
      .map((td) => [td.dataset.field, { value: td.dataset.value, text: td.textContent }])),
  }));
  const timeline = Array.from(document.querySelectorAll("#timeline-svg g.timeline-rank")).map(
    (g) => Array.from(g.querySelectorAll("rect.event")).map((r) => [r.dataset.kind,
      Number(r.dataset.mb), Number(r.dataset.chunk)]));
  return { kpis, stages, comm, timeline, hbm: document.getElementById("hbm-label")?.dataset.value };
}"""


def set_controls(page, values: dict[str, object]) -> None:
    """Move the page's controls (by field name) and wait for the planner's answer."""
    before = int(page.evaluate("() => Number(document.body.dataset.seq || 0)"))
    for name, value in values.items():
        selector = f'[name="{name}"]' if "#" not in name else name
        node = page.locator(selector)
        tag = node.evaluate("n => n.tagName + ':' + (n.type || '')")
        if tag.startswith("SELECT"):
            node.select_option(str(value))
        elif tag == "INPUT:checkbox":
            node.set_checked(bool(value))
        else:
            node.fill(str(value))
    page.wait_for_function(
        f"() => Number(document.body.dataset.seq) > {before} && "
        "['ready', 'invalid'].includes(document.body.dataset.state)"
    )


def assert_page_shows(page, expected: dict) -> None:
    """Every figure on the page equals `expected` (an `estimate().to_json()`, JSON-safe)."""
    shown = page.evaluate(READ_FIGURES)
    k = shown["kpis"]
    pairs = [
        ("kpi-step-time", expected["step_time_s"], fmt_time),
        ("kpi-tokens-per-s", expected["tokens_per_s"], fmt_int),
        ("kpi-mfu", expected["mfu"], fmt_pct),
        ("kpi-hfu", expected["hfu"], fmt_pct),
        ("kpi-bubble", expected["bubble_fraction"], fmt_pct),
        ("timeline-bubble", expected["bubble_fraction"], fmt_pct),
        ("kpi-memory", expected["memory_gib"]["total"], fmt_gib),
        ("kpi-hbm", expected["hbm_gib"], fmt_gib),
    ]
    for element_id, value, formatter in pairs:
        assert float(k[element_id]["value"]) == value, element_id
        assert k[element_id]["text"] == formatter(value), element_id
    assert k["kpi-fits"]["value"] == ("true" if expected["fits"] else "false")
    # Memory: one stacked bar per pipeline stage, each tenant exactly the planner's GiB.
    per_stage = expected["memory_per_stage_gib"]
    assert len(shown["stages"]) == len(per_stage) == expected["plan"]["pp"]
    for bar, stage in zip(shown["stages"], per_stage, strict=True):
        assert float(bar["total"]) == stage["total"]
        drawn = {t: float(v) for t, v in bar["tenants"].items()}
        assert drawn == {t: stage[t] for t in TENANTS if stage[t] > 0}
    assert float(shown["hbm"]) == expected["hbm_gib"]
    # Communication: one row per planner entry, same order within each link.
    rows = sorted(shown["comm"], key=lambda r: (r["link"], r["kind"]))
    entries = sorted(expected["comm"], key=lambda e: (e["link"], e["kind"]))
    assert [(r["kind"], r["link"]) for r in rows] == [(e["kind"], e["link"]) for e in entries]
    for row, entry in zip(rows, entries, strict=True):
        assert row["linkModel"] == entry["link_model"]  # how the planner priced that link
        cells = row["cells"]
        assert float(cells["bytes_per_step"]["value"]) == entry["bytes_per_step"]
        assert cells["bytes_per_step"]["text"] == fmt_bytes(entry["bytes_per_step"])
        for key in ("time_s", "exposed_s"):
            assert float(cells[key]["value"]) == entry[key]
            assert cells[key]["text"] == fmt_time(entry[key])
    # Timeline: every simulated event of every pipeline rank, in order.
    assert shown["timeline"] == [
        [[e["kind"], e["microbatch"], e["chunk"]] for e in rank] for rank in expected["timeline"]
    ]


def planner_json(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan) -> dict:
    return json_safe(estimate(model, cluster, plan).to_json())


def cli_estimate_json(args: list[str]) -> dict:
    """`fivefold plan estimate ... --json`, run as a user would."""
    out = subprocess.run(
        [sys.executable, "-m", "fivefold", "plan", "estimate", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json_safe(json.loads(out.stdout))


DEFAULT_MODEL = model_preset("llama3-8b")
DEFAULT_CLUSTER = cluster_preset("dgx-h100", 16)
DEFAULT_PLAN = ParallelPlan(tp=2, pp=2, dp_shard=4, zero=1, recompute="selective", grad_accum=16)


DEFAULT_FLAGS = [
    "--model", "llama3-8b", "--seq", "8192", "--cluster", "dgx-h100", "--gpus", "16",
    "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--dp", "4", "--zero", "1",
    "--mbs", "1", "--global-batch", "64", "--recompute", "selective",
    "--precision", "bf16-mixed",
]  # fmt: skip


def test_page_loads_and_matches_plan_estimate_cli(page):
    """The page's opening layout equals `fivefold plan estimate --json` for the same flags."""
    expected = cli_estimate_json(DEFAULT_FLAGS)
    in_process = planner_json(DEFAULT_MODEL, DEFAULT_CLUSTER, DEFAULT_PLAN)
    assert {key: expected[key] for key in in_process} == in_process  # the CLI adds headroom keys
    assert page.locator("#layout-describe").text_content() == DEFAULT_PLAN.describe()
    assert_page_shows(page, expected)
    assert page.locator("#problems").is_hidden()
    screenshot(page, "01-default-layout")


def test_efficiency_profile_and_an_option_match_the_cli(page):
    """Choosing a profile, then replacing one of its options, shows what `plan estimate
    --profile ... --no-dropout` prints, and the page names the profile and the replacement."""
    assert page.locator("#planner-facts").get_attribute("data-profile") == "fivefold"
    set_controls(page, {"planner.profile": "megatron-2022"})
    expected = cli_estimate_json([*DEFAULT_FLAGS, "--profile", "megatron-2022"])
    assert_page_shows(page, expected)
    assert page.locator('[name="planner.attention_kernel"]').input_value() == "classic"
    assert page.locator("#planner-facts").get_attribute("data-profile") == "megatron-2022"
    page.click("#planner-details summary")
    set_controls(page, {"planner.dropout": False})
    expected = cli_estimate_json([*DEFAULT_FLAGS, "--profile", "megatron-2022", "--no-dropout"])
    assert_page_shows(page, expected)
    assert "dropout = false (planner.dropout, replacing megatron-2022's true)" in (
        page.locator("#planner-facts").text_content()
    )
    screenshot(page, "02b-profile-megatron-2022")


def test_moving_controls_updates_every_figure(page):
    set_controls(
        page,
        {
            "plan.tp": 4,
            "plan.dp_shard": 1,
            "plan.zero": 0,
            "plan.pp": 4,
            "plan.schedule": "interleaved-1f1b",
            "plan.vpp": 2,
            "plan.recompute": "full",
            "global_batch": 32,
        },
    )
    plan = ParallelPlan(
        tp=4, pp=4, vpp=2, schedule="interleaved-1f1b", recompute="full", grad_accum=32
    )
    expected = planner_json(DEFAULT_MODEL, DEFAULT_CLUSTER, plan)
    assert_page_shows(page, expected)
    # Interleaved: rank r holds chunks r and r + 4 (chunk c on rank c % pp).
    chunks = page.evaluate(
        "() => Array.from(document.querySelectorAll('#timeline-svg g.timeline-rank')).map("
        "g => [...new Set(Array.from(g.querySelectorAll('rect.event')).map(r => "
        "Number(r.dataset.chunk)))].sort((a, b) => a - b))"
    )
    assert chunks == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert page.locator("#grad-accum").get_attribute("data-value") == "32"
    screenshot(page, "02-interleaved-tp4-pp4")


def test_custom_model_moe_with_cp_and_ep(page):
    set_controls(
        page,
        {
            "#model-preset": "mixtral-8x7b",
            "model.seq_len": 32768,
            "plan.tp": 1,  # MoE layers are not tensor-parallel in fivefold's runtime
            "plan.pp": 1,
            "plan.dp_shard": 4,
            "plan.zero": 3,
            "plan.cp": 4,
            "plan.ep": 8,
            "plan.recompute": "full",
            "global_batch": 16,
        },
    )
    model = model_preset("mixtral-8x7b")
    plan = ParallelPlan(tp=1, dp_shard=4, zero=3, cp=4, ep=8, recompute="full", grad_accum=4)
    assert_page_shows(page, planner_json(model, DEFAULT_CLUSTER, plan))
    # Now edit a dimension: the model becomes custom with the preset's other sizes.
    set_controls(page, {"model.layers": 8})
    assert page.locator("#model-preset").input_value() == "custom"
    custom = model.with_(name="custom", layers=8)
    assert_page_shows(page, planner_json(custom, DEFAULT_CLUSTER, plan))
    screenshot(page, "03-custom-moe-cp-ep")


def test_invalid_layout_shows_the_plans_own_message(page):
    set_controls(page, {"plan.tp": 3})
    assert page.evaluate("() => document.body.dataset.state") == "invalid"
    problems = page.locator("#problem-list li").all_text_contents()
    plan = DEFAULT_PLAN.with_(tp=3)
    expected = plan.problems(DEFAULT_MODEL, DEFAULT_CLUSTER)
    assert problems == expected
    assert any("plan.tp = 3 must divide model.heads = 32" in p for p in problems)
    assert "invalid" in page.locator('[name="plan.tp"]').get_attribute("class")
    assert page.locator("#problems").is_visible()
    screenshot(page, "04-invalid-tp3")
    # A global batch that does not split evenly is explained too.
    set_controls(page, {"plan.tp": 2, "global_batch": 62})
    problems = page.locator("#problem-list li").all_text_contents()
    assert problems == [
        "global_batch = 62 sequences is not a whole number of micro-batches of "
        "micro_batch x dp = 1 x 4 = 4; choose a multiple such as 60 or 64, or set grad_accum, "
        "the micro-batch or the DP degree."
    ]
    # Fixing it brings the figures back.
    set_controls(page, {"global_batch": 64})
    assert page.locator("#problems").is_hidden()
    assert_page_shows(page, planner_json(DEFAULT_MODEL, DEFAULT_CLUSTER, DEFAULT_PLAN))


def test_recommend_runs_the_search_and_applies_a_layout(page):
    page.click("#recommend")
    page.wait_for_function("() => document.body.dataset.search === 'ready'")
    result = search(
        DEFAULT_MODEL, DEFAULT_CLUSTER, global_batch=64, top=5, precisions=("bf16-mixed",)
    )
    layouts = [result.best, *result.alternatives]
    rows = page.locator("#recommend-table tbody tr")
    assert rows.count() == len(layouts)
    for i, est in enumerate(layouts):
        expected = json_safe(est.to_json())
        assert rows.nth(i).locator("td.describe").text_content() == est.plan.describe()
        cells = rows.nth(i).locator("td.num")
        assert float(cells.nth(0).get_attribute("data-value")) == expected["step_time_s"]
        assert cells.nth(0).text_content() == fmt_time(expected["step_time_s"])
        assert float(cells.nth(1).get_attribute("data-value")) == expected["tokens_per_s"]
        assert float(cells.nth(3).get_attribute("data-value")) == expected["memory_gib"]["total"]
    # The sentence under the table fills in the tie threshold (it once showed "${...}").
    assert unfilled_placeholders(page) == []
    sub = page.locator("#recommend-sub").text_content()
    assert f"within {100 * TIE_FRACTION:.1f}% of it (a tie)" in sub
    profile_line = planner_settings(DEFAULT_CLUSTER.device).describe()
    shown = page.locator("#explanation li").all_text_contents()
    assert shown == [profile_line, *explain(result)]
    screenshot(page, "05-recommend")
    # Apply the best layout: the controls take it and the page shows its estimate.
    before = int(page.evaluate("() => Number(document.body.dataset.seq)"))
    rows.nth(0).locator("button.apply").click()
    page.wait_for_function(
        f"() => Number(document.body.dataset.seq) > {before} && "
        "document.body.dataset.state === 'ready'"
    )
    best = result.best.to_json()["plan"]
    assert page.locator('[name="plan.tp"]').input_value() == str(best["tp"])
    assert page.locator('[name="plan.pp"]').input_value() == str(best["pp"])
    assert_page_shows(page, planner_json(DEFAULT_MODEL, DEFAULT_CLUSTER, ParallelPlan(**best)))


def test_export_writes_a_recipe_fivefold_train_reads(page, tmp_path):
    page.click("#export")
    page.wait_for_selector("#card-export:not([hidden])")
    text = page.locator("#export-toml").text_content()
    planner = {"planner": {"profile": "fivefold"}}  # the default profile, stated
    recipe = Recipe(DEFAULT_MODEL, DEFAULT_CLUSTER, DEFAULT_PLAN, planner)
    assert text.split("\n", 2)[2].lstrip("\n") == dump_recipe(recipe)  # after two header lines
    with page.expect_download() as download:
        page.click("#export-download")
    path = tmp_path / download.value.suggested_filename
    download.value.save_as(path)
    assert path.name == "llama3-8b-16gpu-tp2-pp2-dp4.toml"
    loaded = load_recipe(path)
    assert (loaded.model, loaded.cluster, loaded.plan) == (
        DEFAULT_MODEL,
        DEFAULT_CLUSTER,
        DEFAULT_PLAN,
    )
    screenshot(page, "06-export")


def ring_state(page) -> list[list[int]]:
    return page.evaluate(
        "() => { const out = []; for (const r of document.querySelectorAll('#ring-svg "
        "rect.ring-chunk')) { const g = Number(r.dataset.gpu); (out[g] = out[g] || [])"
        "[Number(r.dataset.chunk)] = Number(r.dataset.have); } return out; }"
    )


def test_ring_all_reduce_step_through(page):
    n = DEFAULT_PLAN.dp  # the DP gradient all-reduce over 4 GPUs
    assert ring_state(page) == [[1] * n for _ in range(n)]
    for _ in range(n - 1):
        page.click("#ring-next")
    # After the reduce-scatter GPU g holds chunk (g + 1) % n summed over all n GPUs.
    state = ring_state(page)
    for g in range(n):
        assert state[g][(g + 1) % n] == n
        assert sum(state[g]) == n + sum(range(1, n))  # the others hold 1..n-1 contributions
    assert page.locator("#ring-step").text_content().startswith(f"step {n - 1} / {2 * (n - 1)}")
    screenshot(page, "07-ring-reduce-scatter-done")
    for _ in range(n - 1):
        page.click("#ring-next")
    assert ring_state(page) == [[n] * n for _ in range(n)]
    dp_entry = next(
        e
        for e in planner_json(DEFAULT_MODEL, DEFAULT_CLUSTER, DEFAULT_PLAN)["comm"]
        if e["kind"] == "dp"
    )
    assert (
        float(page.locator("#ring-bytes").get_attribute("data-value")) == dp_entry["bytes_per_step"]
    )
    assert float(page.locator("#ring-time").get_attribute("data-value")) == dp_entry["time_s"]


def test_rank_grid_colours_groups_and_maps_nodes(page):
    cells = page.locator("#rank-svg rect.cell")
    assert cells.count() == 16
    # TP groups (default colouring): ranks {0,1}, {2,3}, ... share a colour.
    groups = page.evaluate(
        "() => Array.from(document.querySelectorAll('#rank-svg rect.cell'))"
        ".map(r => [Number(r.dataset.rank), Number(r.dataset.node), Number(r.dataset.group), "
        "r.getAttribute('fill')])"
    )
    assert [node for _, node, _, _ in groups] == [0] * 8 + [1] * 8
    assert [g for _, _, g, _ in groups] == [r // 2 for r in range(16)]
    page.check('input[name="colour-by"][value="dp"]')
    dp_groups = page.evaluate(
        "() => Array.from(document.querySelectorAll('#rank-svg rect.cell'))"
        ".map(r => Number(r.dataset.group))"
    )
    # rank = 8 pp + 2 dp + tp: a DP group is the 4 ranks with the same pp and tp.
    assert dp_groups == [(r // 8) * 2 + r % 2 for r in range(16)]
    fills = {}
    for rank, colour in zip(
        dp_groups,
        page.locator("#rank-svg rect.cell").evaluate_all(
            "cells => cells.map(c => c.getAttribute('fill'))"
        ),
        strict=True,
    ):
        fills.setdefault(rank, set()).add(colour)
    assert all(len(colours) == 1 for colours in fills.values())
    assert len({next(iter(c)) for c in fills.values()}) == 4  # four groups, four colours
    page.hover('#rank-svg rect.cell[data-rank="13"]')
    info = page.locator("#rank-info").text_content()
    assert info.startswith("rank 13 on node 1 · pp 1 · dp 0/2 · cp 0 · tp 1")
    assert "DP group 3: ranks 9,11,13,15" in info
    screenshot(page, "08-rank-grid-dp")


def test_cluster_controls(page):
    """A custom cluster (A100s, 4 nodes, slower InfiniBand) from the cluster controls."""
    set_controls(
        page, {"cluster.gpu": "a100-80gb", "cluster.nodes": 4, "cluster.inter_node_bw": 25}
    )
    # 2 x 2 x 4 = 16 of 32 GPUs: the page says so and offers the DP degree that fills them.
    assert page.locator("#degree-product b").text_content() == "16"
    assert page.locator("#fill-dp").text_content() == "set dp shard = 8"
    before = int(page.evaluate("() => Number(document.body.dataset.seq)"))
    page.click("#fill-dp")
    page.wait_for_function(
        f"() => Number(document.body.dataset.seq) > {before} && "
        "document.body.dataset.state === 'ready'"
    )
    cluster = ClusterSpec("custom", "a100-80gb", 4, 8, 900e9, 25e9)
    plan = DEFAULT_PLAN.with_(dp_shard=8, grad_accum=8)
    assert_page_shows(page, planner_json(DEFAULT_MODEL, cluster, plan))
    assert page.locator("#rank-svg rect.cell").count() == 32
    screenshot(page, "09-custom-cluster")


def test_a_16384_gpu_layout_renders(page):
    """Llama 3 405B on 2,048 nodes: the page stays whole and its figures equal the planner's."""
    set_controls(
        page,
        {
            "#model-preset": "llama3-405b",
            "cluster.nodes": 2048,
            "plan.tp": 8,
            "plan.pp": 16,
            "plan.schedule": "interleaved-1f1b",
            "plan.vpp": 2,
            "plan.dp_shard": 128,
            "global_batch": 2048,
        },
    )
    plan = DEFAULT_PLAN.with_(
        tp=8, pp=16, schedule="interleaved-1f1b", vpp=2, dp_shard=128, grad_accum=16
    )
    cluster = cluster_preset("dgx-h100", 16384)
    assert_page_shows(page, planner_json(model_preset("llama3-405b"), cluster, plan))
    assert page.locator("#rank-svg rect.cell").count() == 4096  # the first 512 nodes
    assert "first 4096 ranks drawn" in page.locator("#ranks-sub").text_content()
    assert page.locator("#ring-sub").text_content().count("over 128 GPUs (first 16 drawn)") == 1
    screenshot(page, "10-llama3-405b-16384-gpus")


def test_token_budget_line_matches_the_cli(page):
    """Tokens and a GPU-hour price give the budget line `plan estimate --tokens` answers."""
    assert page.locator("#budget-facts").text_content() == ""
    set_controls(page, {"planner.tokens": 5e11, "planner.gpu_hour_price": 2.5})
    flags = [*DEFAULT_FLAGS, "--tokens", "5e11", "--gpu-hour-price", "2.5"]
    budget = cli_estimate_json(flags)["budget"]
    node = page.locator("#budget-facts")
    node.wait_for(state="visible")
    assert float(node.get_attribute("data-days")) == budget["days"]
    text = node.text_content()
    assert f"{budget['steps']:,} steps" in text and f"{budget['days']:.1f} days" in text
    assert f"${round(budget['cost_usd']):,}" in text and "goodput" in text


def test_data_mixture_shows_tokens_and_epochs_per_source_as_the_cli(page):
    """A mixture beside the tokens: the page shows each source's tokens and epochs as
    `plan estimate --source` answers them."""
    set_controls(page, {"planner.tokens": 5e11, "planner.sources": "web=3:1e11, code=1"})
    flags = [*DEFAULT_FLAGS, "--tokens", "5e11", "--source", "web=3:1e11", "--source", "code=1"]
    sources = cli_estimate_json(flags)["budget"]["sources"]
    node = page.locator("#budget-facts")
    node.wait_for(state="visible")
    assert json.loads(node.get_attribute("data-sources")) == sources
    assert "web 375,000,000,000 tokens (3.75 epochs)" in node.text_content()
