"""The explorer's JSON API without a browser: figures equal the planner's, every bad input is a
clear 4xx message, and the server survives whatever it is sent."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time

import pytest

from fivefold.explore.api import json_safe
from fivefold.explore.rank_grid import rank_grid
from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import explain
from fivefold.planner.frameworks import planner_settings, profile, profiles
from fivefold.planner.options import PlannerOptions
from fivefold.planner.search.layouts import search
from fivefold.specs import (
    GPUS,
    MODEL_PRESETS,
    ClusterSpec,
    ModelSpec,
    ParallelPlan,
    cluster_preset,
    load_recipe,
    model_preset,
)

from .http_client import Client

LLAMA_16 = {
    "model": {"preset": "llama3-8b", "seq_len": 8192},
    "cluster": {"preset": "dgx-h100", "gpus": 16},
    "plan": {"tp": 2, "pp": 2, "dp_shard": 4, "zero": 1, "recompute": "selective"},
    "global_batch": 64,
}
LLAMA_16_PLAN = ParallelPlan(tp=2, pp=2, dp_shard=4, zero=1, recompute="selective", grad_accum=16)


def test_presets_offer_every_spec_choice(client):
    status, data = client.get_json("/api/presets")
    assert status == 200
    assert list(data["models"]) == list(MODEL_PRESETS)
    assert set(data["gpus"]) == set(GPUS)
    assert data["models"]["llama3-8b"]["params"] == 8_030_261_248
    assert data["clusters"]["dgx-h100"]["intra_node_bw"] == 900e9
    assert data["gpus"]["h100-sxm"]["hbm_gib"] == 80.0
    assert data["schedules"] == ["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"]
    assert data["mesh_order"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]  # the hint's order


def test_estimate_equals_the_planner(client):
    status, data = client.post("/api/estimate", LLAMA_16)
    assert status == 200, data
    model = model_preset("llama3-8b")
    cluster = cluster_preset("dgx-h100", 16)
    expected = json_safe(estimate(model, cluster, LLAMA_16_PLAN).to_json())
    assert data["estimate"] == expected
    assert data["plan"] == LLAMA_16_PLAN.to_dict()
    # 64 sequences = micro_batch 1 x dp 4 x 16 micro-batches; 64 * 8192 tokens.
    assert data["layout"]["grad_accum"] == 16
    assert data["layout"]["tokens_per_step"] == 64 * 8192
    assert data["layout"]["world_size"] == 16


def test_custom_model_and_cluster_fields(client):
    body = {
        "model": {
            "name": "custom",
            "layers": 4,
            "hidden": 256,
            "heads": 8,
            "kv_heads": 4,
            "ffn": 688,
            "vocab": 4096,
            "seq_len": 512,
        },
        "cluster": {
            "gpu": "a100-80gb",
            "nodes": 2,
            "gpus_per_node": 4,
            "intra_node_bw": 600e9,
            "inter_node_bw": 25e9,
        },
        "plan": {"tp": 4, "dp_replicate": 2, "micro_batch": 2},
        "global_batch": 16,
    }
    status, data = client.post("/api/estimate", body)
    assert status == 200, data
    cluster = ClusterSpec("dgx-h100", "a100-80gb", 2, 4, 600e9, 25e9)  # name is the default
    assert data["cluster"] == cluster.to_dict()
    plan = ParallelPlan(tp=4, dp_replicate=2, micro_batch=2, grad_accum=4)  # 16 / (2 * 2)
    assert data["plan"] == plan.to_dict()
    model = ModelSpec("custom", 4, 256, 8, kv_heads=4, ffn=688, vocab=4096, seq_len=512)
    assert data["model"] == model.to_dict()
    assert data["estimate"] == json_safe(estimate(model, cluster, plan).to_json())


@pytest.mark.parametrize(
    ("change", "expected_fragment"),
    [
        (
            {"plan": {"tp": 3, "dp_shard": 4, "pp": 2, "zero": 1}},
            "plan.tp = 3 must divide model.heads = 32",
        ),
        (
            {"plan": {"tp": 2, "pp": 2, "dp_shard": 2, "zero": 1}},
            "but the cluster has 16 GPUs (2 nodes x 8); change a degree so the product equals 16",
        ),
        ({"plan": {"tp": 16, "dp_shard": 1}}, "must divide the 8 GPUs of a node"),
        ({"plan": {"tp": 2, "pp": 2, "dp_shard": 4, "zero": 0}}, "stage 0 shards nothing"),
        (
            {"plan": {"tp": 2, "pp": 2, "dp_shard": 4, "zero": 1, "schedule": "warp"}},
            "plan.schedule = 'warp': choose one of",
        ),
        (
            {"global_batch": 62},
            "global_batch = 62 sequences is not a whole number of micro-batches of "
            "micro_batch x dp = 1 x 4 = 4; choose a multiple such as 60 or 64",
        ),
        (
            {"plan": {"tp": "two", "pp": 2, "dp_shard": 4, "zero": 1}},
            "plan.tp = 'two': expected a whole number",
        ),
        ({"model": {"preset": "llama9"}}, "model.preset = 'llama9' is unknown"),
        (
            {"cluster": {"preset": "dgx-h100", "gpus": 16, "gpu": "tpu"}},
            "cluster.gpu = 'tpu' is not in the catalog",
        ),
        (
            {"plan": {"tp": 2, "pp": 2, "dp_shard": 4, "zero": 1, "warp": 9}},
            "plan.warp is not a setting",
        ),
        ({"model": {"preset": "llama3-8b", "seq_len": -5}}, "model.seq_len = -5"),
        ({"global_batch": 2.5}, "global_batch = 2.5: expected a whole number"),
        (
            {
                "plan": {
                    "tp": 2,
                    "pp": 2,
                    "dp_shard": 4,
                    "zero": 1,
                    "micro_batch": 1,
                    "grad_accum": 3,
                }
            },
            "give either global_batch",
        ),
        (
            {
                "cluster": {"preset": "dgx-h100", "gpus": 65536},
                "plan": {"tp": 8, "pp": 8, "dp_shard": 1024, "zero": 1},
                "global_batch": 1024,
            },
            "cluster size (nodes x gpus_per_node) = 65,536 is more than the explorer draws",
        ),
        ({"model": [1, 2]}, "model = [1, 2]: expected an object"),
        ({"plan": {"tp": {"x": 1}}}, "plan.tp = {'x': 1}: expected a number"),
    ],
)
def test_invalid_layouts_explain_themselves(client, change, expected_fragment):
    body = {**LLAMA_16, **change}
    status, data = client.post("/api/estimate", body)
    assert status == 400
    assert data["ok"] is False
    assert any(expected_fragment in p for p in data["problems"]), data["problems"]


def test_invalid_plan_reports_the_specs_own_messages(client):
    plan = {"tp": 3, "pp": 3, "dp_shard": 2, "zero": 1}  # 18 GPUs, TP 3 divides neither
    status, data = client.post("/api/estimate", {**LLAMA_16, "plan": plan, "global_batch": 64})
    assert status == 400
    expected = ParallelPlan(**plan, grad_accum=32).problems(
        model_preset("llama3-8b"), cluster_preset("dgx-h100", 16)
    )
    assert len(expected) >= 3
    assert data["problems"] == expected


@pytest.mark.parametrize(
    ("raw", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"global_batch": NaN}', 400, "not valid JSON"),
        (b'{"global_batch": Infinity}', 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'"text"', 400, "must be a JSON object"),
        (b'{"modle": {}}', 400, "unknown request field(s) 'modle'"),
        (b'{"model": {"preset": "tiny"}}', 400, "cluster is missing"),
        (b"x" * (64 * 1024 + 1), 413, "the limit is 65,536"),
    ],
)
def test_malformed_requests(client, raw, status, fragment):
    got, data = client.post("/api/estimate", raw)
    assert got == status
    assert any(fragment in p for p in data["problems"]), data


def test_http_edges(client, server):
    assert client.request("GET", "/nothing")[0] == 404
    assert client.request("POST", "/api/nothing", b"{}")[0] == 404
    assert client.request("GET", "/static/../api.py")[0] == 404
    status, headers, body = client.request("GET", "/")
    assert status == 200 and b"fivefold explore" in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    status, headers, _ = client.request("GET", "/static/app.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    # A foreign Host header (DNS rebinding) is refused.
    assert client.request("GET", "/api/presets", headers={"Host": "evil.example:80"})[0] == 403
    # No Content-Length: 411, and the server keeps answering afterwards.
    port = server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /api/estimate HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b" 411 " in sock.recv(4096).split(b"\r\n", 1)[0]
    assert client.get_json("/api/presets")[0] == 200


def test_server_survives_random_garbage(client):
    """Seeded random bodies: every answer is 200 or 400, never a 500, and the server lives."""
    rng = random.Random(6)
    values = [0, -1, 1, 2, 3, 8, 1.5, 1e308, -1e308, "", "x", "1f1b", True, None, [], {}, "a" * 300]
    keys = {
        "model": [
            "preset",
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "ffn",
            "seq_len",
            "experts",
            "top_k",
            "expert_ffn",
            "head_dim",
            "mlp",
        ],
        "cluster": ["preset", "gpus", "gpu", "nodes", "gpus_per_node", "intra_node_bw"],
        "plan": [
            "tp",
            "pp",
            "vpp",
            "schedule",
            "dp_replicate",
            "dp_shard",
            "zero",
            "cp",
            "ep",
            "micro_batch",
            "recompute",
            "precision",
            "sp",
            "cp_kind",
        ],
    }
    statuses = set()
    for _ in range(120):
        body = json.loads(json.dumps(LLAMA_16))
        for _ in range(rng.randint(1, 3)):
            section = rng.choice([*keys, "global_batch"])
            if section == "global_batch":
                body["global_batch"] = rng.choice(values)
            else:
                body[section][rng.choice(keys[section])] = rng.choice(values)
        status, data = client.post(rng.choice(["/api/estimate", "/api/recipe"]), body)
        statuses.add(status)
        assert status in (200, 400), (body, data)
        if status == 400:
            assert data["problems"] and all(isinstance(p, str) and p for p in data["problems"])
    assert statuses == {200, 400}
    assert client.get_json("/api/presets")[0] == 200


def test_recipe_export_round_trips(client, tmp_path):
    status, data = client.post("/api/recipe", LLAMA_16)
    assert status == 200, data
    path = tmp_path / data["filename"]
    assert data["filename"] == "llama3-8b-16gpu-tp2-pp2-dp4.toml"
    path.write_text(data["toml"])
    recipe = load_recipe(path)
    assert recipe.model == model_preset("llama3-8b")
    assert recipe.cluster == cluster_preset("dgx-h100", 16)
    assert recipe.plan == LLAMA_16_PLAN


def test_search_equals_the_planner(client):
    body = {
        "model": {"preset": "llama3-8b", "seq_len": 8192},
        "cluster": {"preset": "dgx-h100", "gpus": 16},
        "global_batch": 64,
        "top": 3,
        "precisions": ["bf16-mixed", "fp8-mixed"],
    }
    status, data = client.post("/api/search", body)
    assert status == 200, data
    result = search(
        model_preset("llama3-8b"),
        cluster_preset("dgx-h100", 16),
        global_batch=64,
        top=3,
        precisions=("bf16-mixed", "fp8-mixed"),
    )
    assert data["best"] == json_safe(result.best.to_json())
    assert data["alternatives"] == [json_safe(a.to_json()) for a in result.alternatives]
    profile_line = planner_settings(cluster_preset("dgx-h100", 16).device).describe()
    assert profile_line.startswith("Efficiency profile fivefold:")
    assert data["explanation"] == [profile_line, *explain(result)]
    assert data["planner"]["profile"] == "fivefold"
    assert data["describe"] == [e.plan.describe() for e in [result.best, *result.alternatives]]
    assert data["evaluated"] == result.evaluated
    assert data["tie_fraction"] == 0.005  # what the Recommend table's caption states
    assert [r["reason"] for r in data["rejected"]] == [reason for _, reason in result.rejected]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({}, "give the target batch as exactly one of"),
        ({"global_batch": 64, "global_batch_tokens": 524288}, "exactly one of"),
        ({"global_batch": 64, "headroom": 2}, "headroom = 2: must be a fraction"),
        ({"global_batch": 64, "top": 0}, "top = 0: must be between 1 and 20"),
        ({"global_batch": 64, "plan": {}}, "unknown request field(s) 'plan'"),
        ({"global_batch": 64, "precisions": ["fp9"]}, "precisions = ['fp9']: expected a list"),
        ({"global_batch": 64, "precisions": "bf16-mixed"}, "expected a list of recipe names"),
    ],
)
def test_search_rejects_bad_requests(client, change, fragment):
    body = {"model": {"preset": "tiny"}, "cluster": {"preset": "dgx-h100", "gpus": 8}, **change}
    status, data = client.post("/api/search", body)
    assert status == 400
    assert any(fragment in p for p in data["problems"]), data


def test_rank_grid_by_hand():
    # pp 2 x dp_shard 2 x tp 2 on 2 nodes of 4: rank = 4 pp + 2 dp + tp (tp innermost).
    plan = ParallelPlan(tp=2, pp=2, dp_shard=2, zero=1)
    grid = rank_grid(plan, ClusterSpec(nodes=2, gpus_per_node=4))
    assert grid["node"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert grid["coords"]["pp"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert grid["coords"]["dp_shard"] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert grid["coords"]["tp"] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert grid["groups"]["tp"] == [0, 0, 1, 1, 2, 2, 3, 3]  # {0,1} {2,3} {4,5} {6,7}
    assert grid["groups"]["dp"] == [0, 1, 0, 1, 2, 3, 2, 3]  # {0,2} {1,3} {4,6} {5,7}
    assert grid["groups"]["pp"] == [0, 1, 2, 3, 0, 1, 2, 3]  # {0,4} {1,5} {2,6} {3,7}
    assert grid["group_counts"] == {"tp": 4, "cp": 8, "dp": 4, "pp": 4, "ep": 8}


def test_rank_grid_expert_groups_borrow_dp_shard_cp_and_tp():
    # dp_shard 2 x cp 2 x tp 2 = 8 ranks route different tokens; ep 4 takes the inner 4 of
    # them (a cp pair of TP pairs), so the EP groups are {0..3} and {4..7}.
    plan = ParallelPlan(tp=2, dp_shard=2, cp=2, ep=4, zero=1)
    grid = rank_grid(plan, ClusterSpec(nodes=1, gpus_per_node=8))
    assert grid["groups"]["ep"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert grid["groups"]["cp"] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_cli_serves_the_page():
    """`fivefold explore --port 0` prints its address and serves the page until stopped."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fivefold", "explore", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("fivefold explore: serving http://127.0.0.1:"), line
        url = line.split()[3]
        status, _, body = Client(url).request("GET", "/")
        assert status == 200 and b"<title>fivefold explore</title>" in body
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_port_errors():
    bad = subprocess.run(
        [sys.executable, "-m", "fivefold", "explore", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "70000 is not a port number" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        start = time.monotonic()
        busy = subprocess.run(
            [sys.executable, "-m", "fivefold", "explore", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert time.monotonic() - start < 60
    assert busy.returncode == 2
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert "Traceback" not in busy.stderr


# ---- efficiency profiles and planner options ------------------------------------------------
def test_presets_list_profiles_and_every_planner_option(client):
    status, data = client.get_json("/api/presets")
    assert status == 200
    assert list(data["profiles"]) == list(profiles())
    assert data["default_profile"] == "fivefold"
    assert data["profiles"]["torchtitan"]["options"]["fused_elementwise"] is False
    assert data["profiles"]["fivefold"]["options"] is None  # set by the device
    fields = set(PlannerOptions.__dataclass_fields__)
    assert set(data["planner_options"]) == fields
    assert data["planner_options"]["attention_kernel"]["choices"] == ["flash", "classic"]
    assert data["planner_options"]["dropout"] == {
        "help": data["planner_options"]["dropout"]["help"],
        "kind": "bool",
        "default": False,
        "base": False,
    }
    # the fivefold profile is fivefold's runtime (eager memory); the framework profiles keep
    # the fields' own defaults (the fused-kernel model) where they list nothing
    assert data["planner_options"]["runtime"]["default"] == "fivefold-eager"
    assert data["planner_options"]["runtime"]["base"] == "fused"


def test_estimate_with_a_profile_and_an_option_on_top(client):
    body = {**LLAMA_16, "planner": {"profile": "megatron-2022", "dropout": False}}
    status, data = client.post("/api/estimate", body)
    assert status == 200, data
    options = PlannerOptions(**{**profile("megatron-2022").options, "dropout": False})
    cluster = cluster_preset("dgx-h100", 16)
    expected = estimate(model_preset("llama3-8b"), cluster, LLAMA_16_PLAN, options)
    assert data["estimate"] == json_safe(expected.to_json())
    default = estimate(model_preset("llama3-8b"), cluster, LLAMA_16_PLAN, PlannerOptions())
    # Against the fused-kernel model with flash attention: classic attention writes and reads
    # the s^2 scores in HBM, slower than flash (its memory is the same here: selective
    # recompute does not keep the scores).
    assert expected.step_time_s > default.step_time_s
    assert expected.peak_memory_bytes == default.peak_memory_bytes
    assert data["planner"]["profile"] == "megatron-2022"
    assert data["planner"]["options"]["attention_kernel"] == "classic"
    assert data["planner"]["overrides"] == {"dropout": False}
    assert data["planner"]["notes"] == [
        "dropout = false (planner.dropout, replacing megatron-2022's true)"
    ]


def test_search_with_a_profile_costs_with_its_options(client):
    body = {
        "model": {"preset": "llama3-8b", "seq_len": 8192},
        "cluster": {"preset": "dgx-h100", "gpus": 16},
        "global_batch": 64,
        "top": 2,
        "planner": {"profile": "torchtitan", "headroom": 0.2},
    }
    status, data = client.post("/api/search", body)
    assert status == 200, data
    options = profile("torchtitan").planner_options(cluster_preset("dgx-h100", 16).device)
    result = search(
        model_preset("llama3-8b"),
        cluster_preset("dgx-h100", 16),
        global_batch=64,
        top=2,
        headroom=0.2,
        options=options,
    )
    assert data["best"] == json_safe(result.best.to_json())
    assert data["explanation"][0].startswith("Efficiency profile torchtitan:")
    assert data["planner"]["options"] == json_safe(
        {k: getattr(options, k) for k in PlannerOptions.__dataclass_fields__}
    )


@pytest.mark.parametrize(
    ("planner", "words"),
    [
        ({"profile": "megatron-2099"}, "planner.profile = 'megatron-2099' is not an efficiency"),
        ({"attention_kernel": "sparse"}, "planner.attention_kernel = 'sparse': choose one of"),
        ({"dropout": "yes"}, "planner.dropout = 'yes': expected true or false"),
        ({"dp_bucket_bytes": -1}, "planner.dp_bucket_bytes = -1.0: must be a finite number >= 0"),
        ({"bucket": 1}, "planner.bucket is not a setting"),
        ("torchtitan", "planner = 'torchtitan': expected an object"),
    ],
)
def test_bad_planner_options_name_the_field(client, planner, words):
    status, data = client.post("/api/estimate", {**LLAMA_16, "planner": planner})
    assert status == 400
    assert any(words in p for p in data["problems"]), data


# ---- token budget ------------------------------------------------------------------------------
def test_estimate_and_search_carry_the_token_budget(client):
    from fivefold.planner.budget.token_budget import BudgetInputs, budget

    table = {"tokens": 5e11, "gpu_hour_price": 2.5}
    status, data = client.post("/api/estimate", {**LLAMA_16, "planner": table})
    assert status == 200, data
    est = estimate(model_preset("llama3-8b"), cluster_preset("dgx-h100", 16), LLAMA_16_PLAN)
    expected = budget(est.model, est.cluster, est.plan, est.step_time_s, BudgetInputs(5e11, 2.5))
    assert data["budget"] == json_safe(expected.to_json())
    # 5e11 tokens / (64 x 8192 tokens per step) = 953,674.3 -> 953,675 steps
    assert data["budget"]["steps"] == 953_675
    assert data["budget"]["cost_usd"] == pytest.approx(2.5 * data["budget"]["gpu_hours"])
    status, data = client.post("/api/estimate", LLAMA_16)
    assert data["budget"] is None
    # the 7B long-context case: vizz-7b on 64 H100s, 128K tokens, 4M-token batch, 500B tokens
    body = {
        "model": {"preset": "vizz-7b", "seq_len": 131072},
        "cluster": {"preset": "dgx-h100", "gpus": 64},
        "global_batch": 32,
        "top": 2,
        "planner": {"tokens": 5e11},
    }
    status, data = client.post("/api/search", body)
    assert status == 200, data
    assert len(data["budgets"]) == len(data["describe"]) == 2  # top 2: best and one more
    first = data["budgets"][0]
    assert first["steps"] == 119_210 and first["step_time_s"] == data["best"]["step_time_s"]
    assert first["mtbf_hours"] == pytest.approx(791.83, abs=0.01)
    assert 0.99 < first["goodput"] < 1 and first["cost_usd"] is None
    status, data = client.post("/api/estimate", {**LLAMA_16, "planner": {"tokens": "lots"}})
    assert status == 400 and any("planner.tokens = 'lots'" in p for p in data["problems"])


def test_the_budget_carries_tokens_and_epochs_per_source(client):
    table = {
        "tokens": 5e11,
        "sources": [{"name": "web", "weight": 3, "tokens": 1e11}, {"name": "code", "weight": 1}],
    }
    status, data = client.post("/api/estimate", {**LLAMA_16, "planner": table})
    assert status == 200, data
    got = [(s["name"], s["tokens"], s["epochs"]) for s in data["budget"]["sources"]]
    assert got == [("web", 3.75e11, 3.75), ("code", 1.25e11, None)]  # 3:1 of 500B
    table["sources"][0]["weight"] = -1
    status, data = client.post("/api/estimate", {**LLAMA_16, "planner": table})
    assert status == 400 and any("('web'): weight = -1" in p for p in data["problems"])


def test_estimate_takes_a_pasted_hf_config_and_a_document_length(client):
    """The explorer had no way in for a Hugging Face config or `doc_len`: both are request
    fields now, and their figures are the planner's for the same model."""
    from pathlib import Path

    from fivefold.specs.hf_config import spec_from_hf_config

    path = Path(__file__).parents[1] / "data" / "hf_configs" / "mistral-7b.json"
    config = json.loads(path.read_text())
    body = {**LLAMA_16, "model": {"hf_config": config, "seq_len": 8192, "doc_len": 1024}}
    status, data = client.post("/api/estimate", body)
    assert status == 200, data
    model = spec_from_hf_config(config).with_(seq_len=8192, doc_len=1024)
    expected = estimate(model, cluster_preset("dgx-h100", 16), LLAMA_16_PLAN)
    assert data["estimate"] == json_safe(expected.to_json())
    whole = estimate(model.with_(doc_len=0), cluster_preset("dgx-h100", 16), LLAMA_16_PLAN)
    assert expected.step_time_s < whole.step_time_s  # attention priced per 1,024-token document
    status, data = client.post("/api/estimate", {**body, "model": {"hf_config": {"x": 1}}})
    assert status == 400 and "model_type" in json.dumps(data)


def test_the_page_has_the_document_length_and_hf_config_inputs():
    from pathlib import Path

    static = Path(__file__).parents[2] / "src" / "fivefold" / "explore" / "static"
    page = (static / "index.html").read_text()
    assert 'name="model.doc_len"' in page and 'id="hf-config"' in page and 'id="hf-file"' in page
    script = "\n".join(p.read_text() for p in sorted(static.glob("*.js")))
    assert 'body.model.doc_len = readField(field("model.doc_len"))' in script
    assert "body.model.hf_config = hf.config" in script


def test_every_module_the_page_imports_is_served_as_javascript(client):
    """The page is ES modules (a browser refuses a module served with a non-JavaScript type)."""
    from pathlib import Path

    from js_source import imported_files

    static = Path(__file__).parents[2] / "src" / "fivefold" / "explore" / "static"
    page = (static / "index.html").read_text()
    assert '<script type="module" src="/static/app.js">' in page
    imported = {"app.js"}
    for script in static.glob("*.js"):
        imported |= set(imported_files(script.read_text()))
    assert imported == {p.name for p in static.glob("*.js")}  # each file imported, none missing
    for name in sorted(imported):
        status, headers, _ = client.request("GET", f"/static/{name}")
        assert status == 200 and headers["Content-Type"].startswith("text/javascript"), name
