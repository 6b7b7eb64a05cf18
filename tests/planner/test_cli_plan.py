"""`fivefold plan` and `fivefold plan estimate`: inputs, JSON names, the written recipe."""

import json
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.cli.plan_args import parse_fraction, parse_size
from fivefold.errors import ConfigError
from fivefold.planner.estimate import estimate
from fivefold.specs import cluster_preset, load_recipe, model_preset
from fivefold.specs.model import default_ffn

STABLE = ("fits", "step_time_s", "tokens_per_s", "mfu", "hfu", "bubble_fraction", "plan")
MEMORY = ("params", "grads", "optimizer", "activations", "other", "total")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_sizes_and_fractions():
    assert parse_size("128K", "--seq") == 131072
    assert parse_size("4M", "--global-batch-tokens") == 4 * 2**20
    assert parse_size("1.5K", "--seq") == 1536
    assert parse_size("131072", "--seq") == 131072
    assert parse_size("2g", "--x") == 2 * 2**30
    assert parse_fraction("10%", "--headroom") == pytest.approx(0.10)
    assert parse_fraction("0.25", "--headroom") == 0.25
    assert default_ffn(4096, "swiglu") == 11008  # Llama 2 7B's width
    assert default_ffn(768, "gelu") == 3072
    with pytest.raises(ConfigError, match="not a size"):
        parse_size("lots", "--seq")
    with pytest.raises(ConfigError, match="whole number"):
        parse_size("1.5", "--gpus")


def test_long_context_7b_search_json_and_recipe(capsys, tmp_path):
    out = tmp_path / "long-context-7b.toml"
    argv = [
        "plan",
        "--model",
        "vizz-7b",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "64",
        "--seq",
        "131072",
        "--global-batch-tokens",
        "4M",
        "--json",
        "--out",
        str(out),
    ]
    data = _json(capsys, argv)
    for key in STABLE:
        assert key in data
    assert set(MEMORY) <= set(data["memory_gib"])
    assert data["fits"] is True
    assert data["memory_gib"]["total"] <= 0.9 * 80
    assert data["search"]["target_tokens"] == 4 * 2**20
    assert len(data["explanation"]) >= 8
    assert data["recipe_path"] == str(out)
    recipe = load_recipe(out)  # what `fivefold train` reads
    assert recipe.plan.to_dict() == data["plan"]
    assert recipe.model.seq_len == 131072 and recipe.cluster.world_size == 64
    assert recipe.plan.global_batch * 131072 == pytest.approx(4 * 2**20, rel=0.05)


def test_search_text_output(capsys, tmp_path):
    argv = [
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "16",
        "--global-batch",
        "64",
        "--out",
        str(tmp_path / "r.toml"),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "best layout: TP" in text
    assert "memory per GPU, worst stage" in text and "/ 80 GiB" in text
    assert "why:" in text and "Tensor parallelism" in text
    assert "recipe written to" in text
    assert (tmp_path / "r.toml").is_file()


def test_estimate_matches_the_api(capsys):
    argv = [
        "plan",
        "estimate",
        "--model",
        "llama3-8b",
        "--gpus",
        "64",
        "--tp",
        "8",
        "--zero",
        "3",
        "--mbs",
        "1",
        "--global-batch",
        "128",
        "--recompute",
        "selective",
        "--json",
    ]
    data = _json(capsys, argv)
    plan = data["plan"]
    assert (plan["tp"], plan["dp_shard"], plan["zero"], plan["grad_accum"]) == (8, 8, 3, 16)
    est = estimate(model_preset("llama3-8b"), cluster_preset("dgx-h100", 64), load_plan(plan))
    assert data["step_time_s"] == pytest.approx(est.step_time_s)
    assert data["memory_gib"]["total"] == pytest.approx(est.peak_memory_bytes / 2**30)
    assert data["fits_with_headroom"] is True


def load_plan(d):
    from fivefold.specs import ParallelPlan

    return ParallelPlan(**d)


def test_estimate_reads_a_recipe(capsys):
    data = _json(capsys, ["plan", "estimate", str(CONFIGS / "llama3-8b-dgx-h100.toml"), "--json"])
    recipe = load_recipe(CONFIGS / "llama3-8b-dgx-h100.toml")
    assert data["plan"] == recipe.plan.to_dict()
    data = _json(
        capsys,
        [
            "plan",
            "estimate",
            str(CONFIGS / "llama3-8b-dgx-h100.toml"),
            "plan.recompute=full",
            "--json",
        ],
    )
    assert data["plan"]["recompute"] == "full"


def test_model_from_flags_and_from_a_file(capsys, tmp_path):
    argv = [
        "plan",
        "estimate",
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "8",
        "--kv-heads",
        "4",
        "--vocab",
        "4096",
        "--seq",
        "1K",
        "--gpus",
        "8",
        "--tp",
        "2",
        "--json",
    ]
    data = _json(capsys, argv)
    assert data["model"]["layers"] == 4 and data["model"]["seq_len"] == 1024
    assert data["model"]["ffn"] == default_ffn(256, "swiglu")
    model_file = tmp_path / "m.toml"
    model_file.write_text('[model]\npreset = "llama3-8b"\nlayers = 16\n')
    data = _json(
        capsys,
        ["plan", "estimate", "--model", str(model_file), "--gpus", "8", "--tp", "8", "--json"],
    )
    assert data["model"]["layers"] == 16 and data["model"]["hidden"] == 4096
    moe = _json(
        capsys,
        [
            "plan",
            "estimate",
            "--model",
            "llama3-8b",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--expert-ffn",
            "4096",
            "--gpus",
            "8",
            "--ep",
            "2",
            "--zero",
            "1",
            "--json",
        ],
    )
    assert moe["model"]["experts"] == 8 and moe["plan"]["ep"] == 2


def test_cluster_described_by_flags(capsys):
    argv = [
        "plan",
        "estimate",
        "--model",
        "llama3-8b",
        "--gpu",
        "a100-80gb",
        "--gpus-per-node",
        "8",
        "--nvlink-gbps",
        "600",
        "--ib-gbps",
        "25",
        "--gpus",
        "16",
        "--tp",
        "8",
        "--json",
    ]
    data = _json(capsys, argv)
    c = data["cluster"]
    assert (c["gpu"], c["nodes"], c["gpus_per_node"]) == ("a100-80gb", 2, 8)
    assert c["intra_node_bw"] == 600e9 and c["inter_node_bw"] == 25e9
    assert data["hbm_gib"] == pytest.approx(80.0)


def test_search_pins_layout_flags(capsys):
    data = _json(
        capsys,
        [
            "plan",
            "--model",
            "llama3-8b",
            "--gpus",
            "16",
            "--tp",
            "4",
            "--global-batch",
            "64",
            "--json",
        ],
    )
    assert data["plan"]["tp"] == 4
    assert all(a["plan"]["tp"] == 4 for a in data["alternatives"])
    assert data["recipe_path"] is None


def test_search_writes_no_file_unless_asked(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64"]) == 0
    assert list(tmp_path.iterdir()) == []  # used to write plan-llama3-8b-16gpu.toml here
    assert "with --out PATH" in capsys.readouterr().out


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--layers",
        "--hidden",
        "--heads",
        "--kv-heads",
        "--ffn",
        "--vocab",
        "--seq",
        "--mlp",
        "--tied-embeddings",
        "--experts",
        "--top-k",
        "--expert-ffn",
        "--shared-experts",
        "--tp",
        "--pp",
        "--vpp",
        "--schedule",
        "--dp",
        "--cp",
        "--ep",
        "--zero",
        "--mbs",
        "--global-batch",
        "--recompute",
        "--sp",
        "--no-sp",
        "--precision",
        "--cluster",
        "--gpus",
        "--gpu",
        "--gpus-per-node",
        "--nvlink-gbps",
        "--ib-gbps",
        "--json",
        "--global-batch-tokens",
        "estimate",
    ):
        assert flag in text, flag


# ---- planner options and efficiency profiles -------------------------------------------------
LLAMA_ESTIMATE = ["plan", "estimate", "--model", "llama3-8b", "--gpus", "16", "--tp", "2"]
LLAMA_ESTIMATE += ["--mbs", "1", "--global-batch", "64", "--recompute", "none"]

# A value other than the fivefold profile's default for every PlannerOptions field, as a flag.
NON_DEFAULT_FLAGS = {
    "activation_model": (["--activation-model", "simple"], "simple"),
    "attention_kernel": (["--attention-kernel", "classic"], "classic"),
    "dropout": (["--dropout"], True),
    "tp_comm_overlap": (["--tp-comm-overlap"], True),
    "dp_overlap": (["--no-dp-overlap"], False),
    "param_gather_overlap": (["--no-param-gather-overlap"], False),
    "fused_elementwise": (["--fused-elementwise"], True),
    "selective_policy": (["--selective-policy", "alternate-matmul"], "alternate-matmul"),
    "cuda_context_bytes": (["--cuda-context-bytes", "1G"], float(2**30)),
    "fragmentation_fraction": (["--fragmentation-fraction", "10%"], 0.10),
    "dp_bucket_bytes": (["--dp-bucket-bytes", "100M"], float(100 * 2**20)),
    "collective_granularity": (["--collective-granularity", "bucket"], "bucket"),
    "ep_dispatch": (["--ep-dispatch", "deepep"], "deepep"),
    "runtime": (["--runtime", "fused"], "fused"),
    "checkpoint_early_stop": (["--no-checkpoint-early-stop"], False),
    "compile": (["--compile"], True),
    "optimizer": (["--optimizer", "muon"], "muon"),
}


def test_every_planner_option_has_a_flag_and_a_help_line_with_its_default(capsys):
    from fivefold.planner.options import PlannerOptions

    assert set(NON_DEFAULT_FLAGS) == set(PlannerOptions.__dataclass_fields__)
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    from fivefold.cli.main import build_parser

    sub = build_parser("plan")._subparsers._group_actions[0].choices["plan"]
    helps = {a.option_strings[0]: a.help for a in sub._actions if a.option_strings}
    for name in NON_DEFAULT_FLAGS:
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert "(default " in helps[flag], flag
    assert "--profile NAME efficiency profile: megatron-2022, nemo-2024, torchtitan, " in text
    assert "fivefold (default fivefold)" in text


# Settings fivefold's runtime does not run (`PlannerOptions._runtime_problems`): planned with
# the fused-kernel memory model (--runtime fused), as other software.
OTHER_SOFTWARE = {"attention_kernel", "dropout"}


@pytest.mark.parametrize("name", sorted(NON_DEFAULT_FLAGS))
def test_each_option_flag_reaches_the_estimate_and_is_echoed(capsys, name):
    from dataclasses import replace

    from fivefold.planner.options import PlannerOptions
    from fivefold.specs.hardware import gpu

    argv, value = NON_DEFAULT_FLAGS[name]
    changed = {name: value}
    if name in OTHER_SOFTWARE:
        argv, changed = [*argv, "--runtime", "fused"], {name: value, "runtime": "fused"}
    if name == "compile":  # compiled blocks fuse their element-wise work (`for_device`)
        changed = {name: value, "fused_elementwise": True}
    data = _json(capsys, [*LLAMA_ESTIMATE, *argv, "--json"])
    assert data["planner"]["profile"] == "fivefold"
    assert data["planner"]["options"][name] == value
    assert data["planner"]["overrides"] == changed
    options = replace(PlannerOptions.for_device(gpu("h100")), **changed)
    assert data["planner"]["options"] == {
        k: getattr(options, k) for k in PlannerOptions.__dataclass_fields__
    }
    cluster = cluster_preset("dgx-h100", 16)
    est = estimate(model_preset("llama3-8b"), cluster, load_plan(data["plan"]), options)
    assert data["step_time_s"] == est.step_time_s
    assert data["memory_gib"]["total"] == pytest.approx(est.peak_memory_bytes / 2**30)


def test_classic_attention_costs_more_than_flash(capsys):
    fused = [*LLAMA_ESTIMATE, "--runtime", "fused"]  # fivefold's own runtime has no classic
    flash = _json(capsys, [*fused, "--json"])
    classic = _json(capsys, [*fused, "--attention-kernel", "classic", "--json"])
    # Without recompute, classic attention keeps b * heads/tp * s^2 scores per layer.
    assert classic["memory_gib"]["activations"] > 2 * flash["memory_gib"]["activations"]
    assert classic["step_time_s"] > flash["step_time_s"]
    # fivefold's runtime (the default) would silently ignore it: refused, naming the way out
    assert main([*LLAMA_ESTIMATE, "--attention-kernel", "classic"]) == 2
    assert "runtime = 'fused'" in capsys.readouterr().err


def test_profile_recipe_and_flag_precedence_is_stated(capsys, tmp_path):
    from fivefold.planner.frameworks import profile
    from fivefold.planner.options import PlannerOptions

    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\npreset = "dgx-h100"\ngpus = 16\n'
        "[plan]\ntp = 2\ndp_shard = 8\nzero = 1\ngrad_accum = 8\n"
        '[planner]\nprofile = "torchtitan"\nattention_kernel = "classic"\ndropout = true\n'
    )
    argv = ["plan", "estimate", str(recipe), "--profile", "nemo-2024", "--attention-kernel"]
    data = _json(capsys, [*argv, "flash", "--json"])
    planner = data["planner"]
    assert planner["profile"] == "nemo-2024"
    expected = PlannerOptions(**{**profile("nemo-2024").options, "dropout": True})
    assert planner["options"] == {
        k: getattr(expected, k) for k in PlannerOptions.__dataclass_fields__
    }
    assert planner["notes"] == [
        "attention_kernel = classic (planner.attention_kernel, replacing nemo-2024's flash)",
        "dropout = true (planner.dropout, replacing nemo-2024's false)",
        "attention_kernel = flash (--attention-kernel, replacing the recipe's classic)",
    ]
    assert main([*argv, "flash"]) == 0
    text = capsys.readouterr().out
    assert "Efficiency profile nemo-2024:" in text and "(--attention-kernel, replacing" in text


def test_search_with_a_profile_and_its_recipe_round_trip(capsys, tmp_path):
    from fivefold.planner.frameworks import profile
    from fivefold.planner.search.layouts import search

    out = tmp_path / "best.toml"
    argv = ["plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "64"]
    argv += ["--profile", "megatron-2022", "--no-dropout", "--headroom", "0.2"]
    data = _json(capsys, [*argv, "--json", "--out", str(out)])
    cluster = cluster_preset("dgx-h100", 16)
    options = profile("megatron-2022").planner_options(cluster.device)
    from dataclasses import replace

    options = replace(options, dropout=False)
    result = search(
        model_preset("llama3-8b"), cluster, global_batch=64, headroom=0.2, options=options
    )
    assert data["plan"] == result.best_plan.to_dict()
    assert data["step_time_s"] == result.best.step_time_s
    assert data["explanation"][0].startswith("Efficiency profile megatron-2022: classic")
    note = "dropout = false (--no-dropout, replacing megatron-2022's true)"
    assert note in data["explanation"][0]
    assert data["planner"]["overrides"] == {"dropout": False}
    written = out.read_text()
    assert '[planner]\nprofile = "megatron-2022"\nheadroom = 0.2\ndropout = false\n' in written
    again = _json(capsys, ["plan", "estimate", str(out), "--json"])
    assert again["planner"]["options"] == data["planner"]["options"]
    assert again["step_time_s"] == data["step_time_s"]
    assert again["headroom"] == 0.2


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--profile", "megatron"], "--profile = 'megatron' is not an efficiency profile"),
        (["--dp-bucket-bytes", "lots"], "--dp-bucket-bytes = 'lots' is not a size"),
        (["--fragmentation-fraction", "2"], "--fragmentation-fraction = 2: must be at least 0"),
        (["--cuda-context-bytes", "-1"], "--cuda-context-bytes = -1: must be at least 0"),
        (["planner.dropout=3"], "planner.dropout = 3: expected true or false"),
        (["planner.headroom=nan"], "planner.headroom = nan: must be a fraction in [0, 1)"),
        (["planner.atention_kernel=flash"], "planner.atention_kernel is not a setting"),
    ],
)
def test_bad_planner_options_exit_2_naming_the_field(capsys, argv, words):
    overrides = [a for a in argv if "=" in a]
    flags = [a for a in argv if "=" not in a]
    head, rest = LLAMA_ESTIMATE[:2], LLAMA_ESTIMATE[2:]
    assert main([*head, *overrides, *rest, *flags]) == 2
    err = capsys.readouterr().err
    assert words in err, err


def test_plan_imports_neither_torch_nor_other_commands():
    """`fivefold plan` loads only its own command module (process start is part of the 1 s)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fivefold.cli.main import main\n"
        "main(['plan', '--model', 'llama3-8b', '--gpus', '8', '--global-batch', '32', '--json'])\n"
        "loaded = [m for m in sys.modules if m.startswith(('torch', 'fivefold.cli.cmd_'))]\n"
        "print(sorted(loaded), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "['fivefold.cli.cmd_plan']"


def test_written_recipe_keeps_whole_byte_counts_whole(capsys, tmp_path):
    out = tmp_path / "plan.toml"
    argv = ["plan", "--model", "llama3-8b", "--gpus", "16", "--dp-bucket-bytes", "10M"]
    data = _json(capsys, [*argv, "--cuda-context-bytes", "1G", "--json", "--out", str(out)])
    written = out.read_text()
    assert "\ndp_bucket_bytes = 10485760\n" in written  # 10 x 2**20, not 10485760.0
    assert "\ncuda_context_bytes = 1073741824\n" in written
    again = _json(capsys, ["plan", "estimate", str(out), "--json"])
    assert again["planner"]["options"] == data["planner"]["options"]
    assert again["step_time_s"] == data["step_time_s"]
