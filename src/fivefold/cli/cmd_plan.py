"""`fivefold plan`: search the fastest layout that fits; `fivefold plan estimate`: cost one layout.

Inputs are read here and handed to the planner (`fivefold.planner.search.search` and
`fivefold.planner.estimate.estimate`); nothing here imports torch. Sizes accept binary suffixes:
128K = 131,072, 4M = 4,194,304 (2^20), 1G = 2^30; a plain number is taken as is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.request import (
    MAX_BATCH_SEQUENCES,
    PlanRequest,
    grad_accum_for,
    require_hbm,
    resolve_headroom,
    resolve_request,
)

_DESCRIPTION = """\
Find the layout (tensor, pipeline with its schedule, data with its ZeRO stage, context and
expert parallelism, micro-batch, gradient accumulation, recompute, precision) that trains the
model fastest on the cluster without running out of memory, and say why. Prints the layout, the
per-GPU memory of the worst pipeline stage against HBM, step time, tokens/s, MFU, HFU, the
pipeline bubble and the reasoning; with --out PATH it also writes the layout as a complete
TOML recipe ([train] and [data] at their defaults, each marked so) that `fivefold train` and
`fivefold launch --slurm` take. Layout flags (--tp, --pp, ...) pin those fields in the search.

`fivefold plan estimate` costs one given layout instead of searching.

The model comes from a preset (--model llama3-8b), a TOML file (--model my.toml, a [model]
table or a recipe), a Hugging Face config (--hf-config config.json: Llama, Mistral, Qwen2/3,
Mixtral, DeepSeek-V3) or flags (--layers --hidden --heads ...); flags override the preset. The
cluster from a preset and a GPU count (--cluster dgx-h100 --gpus 64) or a description
(--gpu h100 --gpus-per-node 8 --nvlink-gbps 900 --ib-gbps 50 --gpus 64). A positional recipe
(e.g. configs/llama3-8b-dgx-h100.toml) gives model, cluster and, for `estimate`, the layout
and its batch: grad_accum as the recipe sets it (its default, 1, when unset), the batch
`fivefold train` runs, unless --global-batch or --global-batch-tokens is given.

What the training software achieves (attention kernel, overlap of TP and DP communication,
fused kernels, collective granularity) is an efficiency profile: --profile megatron-2022,
nemo-2024, torchtitan or fivefold (the default: this runtime on the cluster's device). Each
planner option flag replaces the profile's value (the output says so), as does a recipe's
[planner] table (profile = "torchtitan", attention_kernel = "classic", headroom = 0.1, ...);
flags win over the recipe. --json echoes the profile and every option in force.
"""

_EPILOG = """\
examples:
  fivefold plan --model vizz-7b --cluster dgx-h100 --gpus 64 --seq 131072 \\
      --global-batch-tokens 4M
  fivefold plan --model llama3-405b --cluster dgx-h100 --gpus 16384 --global-batch-tokens 16M
  fivefold plan --model llama3-70b --gpus 64 --tp 8 --json        # pin TP, print JSON
  fivefold plan --hf-config config.json --gpus 64 --seq 8K --global-batch-tokens 4M \
      --tokens 1T --gpu-hour-price 2.5                            # time, cost, failures
  fivefold plan estimate --model llama3-8b --gpus 64 --tp 8 --zero 3 --mbs 1 \\
      --global-batch 128 --recompute selective
  fivefold plan estimate configs/llama3-8b-dgx-h100.toml
  fivefold plan estimate --model llama3-70b --cluster dgx-a100 --gpus 64 --tp 8 --pp 4 \\
      --mbs 1 --global-batch 128 --recompute full --profile megatron-2022
"""

SIZE_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
DEFAULT_CLUSTER = "dgx-h100"
DEFAULT_GPUS = 8
GBPS = 1e9  # --nvlink-gbps / --ib-gbps are gigabytes per second per GPU
MAX_BATCH_TOKENS = 1 << 30  # tokens per step: 64x Llama 3's 16M; bounds the search


# ---- argument parsing ----------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="find the fastest parallel layout that fits, and explain it",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(parser)
    parser.set_defaults(handler=_plan_handler)


def _plan_handler(args: argparse.Namespace) -> int:
    """`plan [RECIPE] ...` searches; `plan estimate [RECIPE] ...` costs one layout."""
    items = list(args.items or [])
    if items and items[0] == "estimate":
        args.items = items[1:]
        _refuse_search_flags(args)
        return _estimate_handler(args)
    if items and items[0] == "check":
        return _check_handler(items[1:], args.json)
    return _search_handler(args)


def _check_handler(items: list[str], as_json: bool) -> int:
    """`plan check RECIPE [OVERRIDE ...]`: the layout built at full scale under fake tensors."""
    from fivefold.cli.plan_check_report import run_check
    from fivefold.spec.recipe import load_recipe

    if not items or "=" in items[0]:
        raise ConfigError(
            "plan check needs a recipe: fivefold plan check RECIPE.toml [section.field=value ...]"
        )
    return run_check(load_recipe(items[0], items[1:]), as_json)


def _refuse_search_flags(args: argparse.Namespace) -> None:
    """`plan estimate` costs the given layout: a search-only flag would be silently ignored."""
    given = [
        flag
        for flag, value in (
            ("--top", args.top),
            ("--risk", args.risk),
            ("--out", args.out),
            ("--batch-tolerance", args.batch_tolerance),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: only a search uses {'it' if len(given) == 1 else 'them'}; "
            "`plan estimate` costs the one layout given. Drop the flag, or run `fivefold plan` "
            "(without estimate) to search."
        )


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "items",
        nargs="*",
        metavar="[estimate|check] [RECIPE] [OVERRIDE ...]",
        help="'estimate' to cost one layout instead of searching, 'check' to build the "
        "recipe's layout at full scale under fake tensors and measure its memory beside the "
        "prediction; then an optional TOML recipe (its [model], [cluster] and, for estimate "
        "and check, [plan]) and section.field=value overrides (plan.tp=4)",
    )
    m = parser.add_argument_group("model (a preset or TOML file, and/or flags)")
    m.add_argument("--model", metavar="PRESET|FILE", help="preset name or TOML file")
    m.add_argument(
        "--hf-config",
        metavar="CONFIG.json",
        help="a Hugging Face config.json (llama, mistral, qwen2, qwen3, mixtral, deepseek_v3): "
        "the model it describes, flags on top (as [model] hf_config = ...)",
    )
    for flag, help_text in (
        ("--layers", "transformer layers"),
        ("--hidden", "hidden size"),
        ("--heads", "attention (query) heads"),
        ("--kv-heads", "key/value heads (GQA; default: heads)"),
        ("--ffn", "MLP width (default: 4*hidden for gelu, 8/3*hidden rounded to 256 for swiglu)"),
        ("--vocab", "vocabulary size (default 32000)"),
        ("--experts", "routed experts per MoE layer (0 = dense)"),
        ("--top-k", "experts per token"),
        ("--expert-ffn", "width of one expert"),
        ("--shared-experts", "always-on experts per MoE layer"),
    ):
        m.add_argument(flag, metavar="N", help=help_text)
    m.add_argument("--seq", metavar="TOKENS", help="sequence length, e.g. 8192, 128K")
    m.add_argument(
        "--doc-len",
        metavar="TOKENS",
        help="mean document length of the training data (token-weighted, as `fivefold data "
        "prepare` prints it; [model] doc_len): attention is priced per document; default one "
        "document per sequence",
    )
    m.add_argument("--mlp", choices=("swiglu", "gelu"), help="MLP kind (default swiglu)")
    m.add_argument(
        "--tied-embeddings", action="store_true", default=None, help="LM head tied to embedding"
    )
    c = parser.add_argument_group("cluster")
    c.add_argument(
        "--cluster",
        metavar="PRESET|PROFILE.toml",
        help=f"dgx-a100, dgx-h100, ... (default {DEFAULT_CLUSTER} unless --gpu is given), or a "
        "device profile written by `fivefold calibrate` (--gpus: its local ranks)",
    )
    c.add_argument("--gpus", metavar="N", help=f"total GPUs (default {DEFAULT_GPUS})")
    c.add_argument("--gpu", metavar="TYPE", help="GPU type: a100-40gb, a100-80gb, h100-sxm, ...")
    c.add_argument("--gpus-per-node", metavar="N", help="GPUs per node (default 8)")
    c.add_argument("--nvlink-gbps", metavar="GB/s", help="NVLink GB/s per GPU (e.g. 900)")
    c.add_argument("--ib-gbps", metavar="GB/s", help="inter-node GB/s per GPU (e.g. 50)")
    c.add_argument(
        "--nvlink-domain",
        metavar="N",
        help="GPUs one NVLink fabric joins across nodes (gb200-nvl72: 72; default one node): "
        "TP and the groups inside it stay on NVLink",
    )
    lay = parser.add_argument_group("layout (for estimate; a search keeps given fields fixed)")
    for flag, help_text in (
        ("--tp", "tensor-parallel degree (inside a node)"),
        ("--pp", "pipeline stages"),
        ("--vpp", "virtual stages (chunks) per pipeline rank"),
        ("--dp", "data-parallel degree"),
        ("--dp-shard", "ZeRO-3 shard group size for HSDP (the rest replicates)"),
        ("--cp", "context-parallel degree"),
        ("--ep", "expert-parallel degree"),
        ("--zero", "ZeRO stage 0-3"),
        ("--mbs", "micro-batch size in sequences"),
        ("--grad-accum", "micro-batches per step"),
    ):
        lay.add_argument(flag, metavar="N", help=help_text)
    lay.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"),
        help="pipeline schedule",
    )
    lay.add_argument("--recompute", choices=("none", "selective", "full"), help="recompute")
    lay.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism in the TP group",
    )
    for flag, choices, help_text in (
        (
            "--offload",
            ("none", "optimizer", "all"),
            "CPU offload (default none): the optimizer state (zero <= 2), or parameters, "
            "gradients and optimizer state (zero 3); a search tries it only when nothing fits",
        ),
        (
            "--optimizer-states",
            ("fp32", "8bit", "fp8"),
            "Adam's m and v (default fp32): torchao's 8bit/fp8, 1 byte + a scale per 256; a "
            "search tries 8bit only when nothing fits",
        ),
        (
            "--fp8",
            ("none", "tensorwise", "rowwise"),
            "FP8 linears through torchao float8 (default none; GPUs with FP8, e.g. h100-sxm); "
            "a search uses it only when given",
        ),
    ):
        lay.add_argument(flag, choices=choices, help=help_text)
    lay.add_argument(
        "--precision",
        metavar="RECIPE[,RECIPE]",
        help="precision recipe (bf16-mixed, fp8-mixed, ...; a comma list to search several)",
    )
    b = parser.add_argument_group("batch and output")
    b.add_argument("--global-batch", metavar="SEQS", help="sequences per optimizer step")
    b.add_argument("--global-batch-tokens", metavar="TOKENS", help="tokens per step, e.g. 4M")
    b.add_argument(
        "--headroom",
        metavar="FRACTION",
        help="share of HBM left free (default 0.10, or the recipe's [planner] headroom; 10%% "
        "also accepted)",
    )
    b.add_argument(
        "--batch-tolerance",
        metavar="FRACTION",
        help="search: how far the reached global batch may miss the target (default 0.05)",
    )
    b.add_argument("--top", metavar="N", help="search: alternatives to show (5)")
    b.add_argument(
        "--risk",
        choices=("pessimistic", "expected"),
        help="search: rank by the slow end of each layout's error band (pessimistic, the "
        "default) or by the prediction itself (expected)",
    )
    b.add_argument(
        "--out",
        metavar="PATH",
        help="search: also write the chosen layout as a complete recipe ([train] and [data] "
        "at their defaults) to PATH, in an existing directory (default: no file is written)",
    )
    b.add_argument("--json", action="store_true", help="print JSON (stable key names)")
    _add_budget_options(parser)
    _add_planner_options(parser)


def _add_budget_options(parser: argparse.ArgumentParser) -> None:
    """The token-budget flags (`fivefold.planner.budget`); each also a [planner] field."""
    from fivefold.planner.budget import DEFAULT_RESTART_S

    g = parser.add_argument_group(
        "token budget (days, GPU-hours, cost, failures and checkpoint interval for a number of "
        "tokens; each also a [planner] field: tokens, gpu_hour_price, failure_rate, "
        "ckpt_bandwidth in bytes/s per node, restart_overhead_s)"
    )
    g.add_argument(
        "--tokens",
        metavar="N",
        help="tokens to train, decimal suffixes: 500B = 5e11 (K, M, B or G, T; or 5e11)",
    )
    g.add_argument(
        "--gpu-hour-price", metavar="USD", help="price of one GPU-hour (default: no cost shown)"
    )
    g.add_argument(
        "--failure-rate",
        metavar="PER_GPU_HOUR",
        help="interruptions per GPU-hour (default 1.97e-5: Llama 3's 419 in 54 days on 16,384 "
        "H100s)",
    )
    g.add_argument(
        "--ckpt-bandwidth",
        metavar="GB/s",
        help="checkpoint storage write bandwidth per node (default 0.98: Llama 3's 2 TB/s over "
        "2,048 nodes)",
    )
    g.add_argument(
        "--restart-overhead",
        metavar="SECONDS",
        help=f"time each restart costs before training resumes (default {DEFAULT_RESTART_S:g})",
    )


def _add_planner_options(parser: argparse.ArgumentParser) -> None:
    """--profile and one flag per `PlannerOptions` field (help: `options.OPTION_HELP`)."""
    from fivefold.planner.options import CHOICES, OPTION_HELP, PlannerOptions
    from fivefold.planner.profiles import DEFAULT_PROFILE, profiles

    g = parser.add_argument_group(
        "planner options (what the software achieves; a flag replaces the profile's value; "
        "defaults shown are the fivefold profile's on a GPU)"
    )
    g.add_argument(
        "--profile",
        metavar="NAME",
        help=f"efficiency profile: {', '.join(profiles())} (default {DEFAULT_PROFILE})",
    )
    defaults = PlannerOptions()
    for name, text in OPTION_HELP.items():
        flag, default = "--" + name.replace("_", "-"), getattr(defaults, name)
        if isinstance(default, bool):
            shown = "on" if default else "off"
            g.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{text} (default {shown})",
            )
        elif name in CHOICES:
            g.add_argument(flag, choices=CHOICES[name], help=f"{text} (default {default})")
        else:
            unit = "FRACTION" if name == "fragmentation_fraction" else "BYTES"
            shown = f"{default:g}" if unit == "FRACTION" else f"{default / 2**20:g}M"
            g.add_argument(flag, metavar=unit, help=f"{text} (default {shown})".replace("%", "%%"))


# ---- values ----------------------------------------------------------------------------------
def parse_size(text: Any, flag: str, minimum: int = 1) -> int:
    """'128K' -> 131072, '4M' -> 4194304, '1.5K' -> 1536, '4096' -> 4096 (binary suffixes)."""
    raw = str(text).strip()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)", raw)
    if not match and re.fullmatch(r"-\s*[0-9.]+.*", raw):
        raise ConfigError(f"{flag} = {raw}: must be at least {minimum}.")
    if not match:
        raise ConfigError(
            f"{flag} = {raw!r} is not a size; write a whole number, optionally with K, M or G "
            "(binary: 128K = 131072, 4M = 4194304)."
        )
    value = float(match.group(1)) * SIZE_SUFFIXES[match.group(2).upper()]
    if value != int(value):
        raise ConfigError(f"{flag} = {raw}: must be a whole number (got {value:g}).")
    if value < minimum:
        raise ConfigError(f"{flag} = {raw}: must be at least {minimum}.")
    return int(value)


def parse_fraction(text: str, flag: str) -> float:
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ConfigError(f"{flag} = {raw!r}: write a fraction such as 0.1 or 10%.") from None
    if not 0 <= value < 1:
        raise ConfigError(f"{flag} = {raw}: must be at least 0 and below 1 (100%).")
    return value


def parse_gbps(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{flag} = {text!r}: give GB/s per GPU as a number, e.g. 900.") from None
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{flag} = {text}: must be a positive number of GB/s per GPU.")
    return value * GBPS


def planner_from_args(args: argparse.Namespace, cluster: Any, recipe_data: dict[str, dict]) -> Any:
    """The profile and options in force (`fivefold.planner.profiles.planner_settings`): the
    recipe's [planner] table, then --profile and the option flags."""
    from fivefold.planner.options import OPTION_HELP
    from fivefold.planner.profiles import planner_settings

    flags: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # the flag as typed, for the note saying it replaced a value
    for name in OPTION_HELP:
        raw, flag = getattr(args, name), "--" + name.replace("_", "-")
        spelled[name] = "--no-" + flag[2:] if raw is False else flag
        if raw is None or isinstance(raw, bool) or name not in _NUMERIC_OPTIONS:
            flags[name] = raw
        elif name == "fragmentation_fraction":
            flags[name] = parse_fraction(raw, flag)
        else:
            flags[name] = float(parse_size(raw, flag, minimum=int(name == "dp_bucket_bytes")))
    section = recipe_data.get("planner", {})
    if not isinstance(section, dict):
        raise ConfigError(f"planner = {section!r}: expected a [planner] table of settings.")
    return planner_settings(cluster.device, section, flags, args.profile, spelled)


_NUMERIC_OPTIONS = ("cuda_context_bytes", "fragmentation_fraction", "dp_bucket_bytes")


# ---- token budget ----------------------------------------------------------------------------
TOKEN_SUFFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_tokens(text: Any, flag: str = "--tokens") -> float:
    """'500B' -> 5e11, '2T' -> 2e12, '5e11' -> 5e11 (decimal suffixes, as token counts are
    quoted; sizes elsewhere are binary)."""
    raw = str(text).strip()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)", raw)
    if not match:
        raise ConfigError(
            f"{flag} = {raw!r} is not a token count; write e.g. 500B, 2T or 5e11 (decimal)."
        )
    value = float(match.group(1)) * TOKEN_SUFFIXES[match.group(2).upper()]
    if not 1 <= value < 1e18:
        raise ConfigError(f"{flag} = {raw}: give between 1 and 1e18 tokens.")
    return value


def _positive_number(text: Any, flag: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{flag} = {text!r}: give a number ({unit}).") from None
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{flag} = {text}: must be a number >= 0 ({unit}).")
    return value


def budget_from_args(args: argparse.Namespace, recipe_data: dict[str, dict]) -> Any:
    """The token-budget inputs (`fivefold.planner.budget.BudgetInputs`) from the flags and the
    recipe's [planner] table, or None when no token count is given."""
    from fivefold.planner.budget import budget_inputs

    flags: dict[str, Any] = {}
    if args.tokens is not None:
        flags["tokens"] = parse_tokens(args.tokens)
    for attr, key, unit in (
        ("gpu_hour_price", "gpu_hour_price", "USD per GPU-hour"),
        ("failure_rate", "failure_rate", "interruptions per GPU-hour"),
        ("ckpt_bandwidth", "ckpt_bandwidth", "GB/s per node"),
        ("restart_overhead", "restart_overhead_s", "seconds"),
    ):
        raw = getattr(args, attr)
        if raw is not None:
            flags[key] = _positive_number(raw, "--" + attr.replace("_", "-"), unit)
    if "ckpt_bandwidth" in flags:
        flags["ckpt_bandwidth"] *= GBPS
    section = recipe_data.get("planner", {})
    return budget_inputs(section if isinstance(section, dict) else {}, flags)


def budget_of(est: Any, inputs: Any) -> Any:
    """The token-budget answer (`fivefold.planner.budget.Budget`) of one estimate; None without
    a token count."""
    from fivefold.planner.budget import budget

    if inputs is None:
        return None
    return budget(est.model, est.cluster, est.plan, est.step_time_s, inputs)


def _brief_budget(b: Any) -> str:
    """'  41.2 d  63,258 GPU-h  goodput 97.1%' for an alternative's line ('' without one)."""
    from fivefold.planner.budget import DAY_S

    if b is None:
        return ""
    if not b.progresses:
        return "  never finishes"
    return f"  {b.wall_s / DAY_S:6.1f} d  {b.gpu_hours:>9,.0f} GPU-h  goodput {b.goodput:.1%}"


# ---- model -----------------------------------------------------------------------------------
_MODEL_FLAGS = {
    "layers": "layers",
    "hidden": "hidden",
    "heads": "heads",
    "kv_heads": "kv_heads",
    "ffn": "ffn",
    "vocab": "vocab",
    "experts": "experts",
    "top_k": "top_k",
    "expert_ffn": "expert_ffn",
    "shared_experts": "shared_experts",
}


def model_from_args(args: argparse.Namespace, recipe_data: dict[str, dict]) -> Any:
    """The model from --model (a preset or TOML file) or the recipe's [model], with the flags as
    overrides; expanded and validated by the recipe code (`fivefold.spec.recipe`), so
    `--model X --kv-heads N` and `[model] preset = "X"  kv_heads = N` are the same model."""
    from fivefold.spec.presets import MODEL_PRESETS
    from fivefold.spec.recipe import model_from_dict, read_toml

    values: dict[str, Any] = dict(recipe_data.get("model", {}))
    if args.hf_config:
        if args.model:
            raise ConfigError("--model and --hf-config both name a model; give one of them.")
        values = {"hf_config": args.hf_config}
    elif args.model:
        if args.model in MODEL_PRESETS:
            values = {"preset": args.model}
        elif args.model.endswith(".toml") or Path(args.model).is_file():
            data = read_toml(args.model)
            values = dict(data["model"]) if isinstance(data.get("model"), dict) else dict(data)
        else:
            raise ConfigError(
                f"--model = {args.model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
                "nor a TOML file; check the name or the path."
            )
    flags = model_flags(args)
    if not values:
        missing = [f"--{f}" for f in ("layers", "hidden", "heads") if f not in flags]
        if missing:
            raise ConfigError(
                f"no model: give --model PRESET|FILE, or describe it with {', '.join(missing)} "
                "(and optionally --kv-heads --ffn --vocab --seq --mlp)."
            )
        values = dict(CUSTOM_MODEL)
    return model_from_dict({**values, **flags})


CUSTOM_MODEL = {"name": "custom", "vocab": 32000, "seq_len": 4096}  # flags-only model defaults


def model_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The model flags given, as [model] fields (`--kv-heads 8` -> {"kv_heads": 8})."""
    flags: dict[str, Any] = {}
    for attr, name in _MODEL_FLAGS.items():
        raw = getattr(args, attr)
        if raw is not None:
            minimum = 0 if name in ("experts", "top_k", "expert_ffn", "shared_experts") else 1
            flags[name] = parse_size(raw, "--" + attr.replace("_", "-"), minimum)
    if args.seq is not None:
        flags["seq_len"] = parse_size(args.seq, "--seq")
    if args.doc_len is not None:
        flags["doc_len"] = parse_size(args.doc_len, "--doc-len")
    if args.mlp is not None:
        flags["mlp"] = args.mlp
    if args.tied_embeddings:
        flags["tied_embeddings"] = True
    return flags


# ---- cluster ---------------------------------------------------------------------------------
def cluster_from_args(args: argparse.Namespace, recipe_data: dict[str, dict]) -> Any:
    from fivefold.spec.cluster import CLUSTER_PRESETS, ClusterSpec, cluster_preset
    from fivefold.spec.hardware import gpu as gpu_lookup

    section = dict(recipe_data.get("cluster", {}))
    gpus = parse_size(args.gpus, "--gpus") if args.gpus is not None else None
    per_node = (
        parse_size(args.gpus_per_node, "--gpus-per-node")
        if args.gpus_per_node is not None
        else None
    )
    if args.gpu is not None:
        gpu_lookup(args.gpu)  # ConfigError naming the catalog when unknown
    if _profile_path(args.cluster):  # a machine measured by `fivefold calibrate`
        from fivefold.spec.profile import profile_cluster

        cluster = profile_cluster(args.cluster, gpus)
    elif args.cluster is not None or (args.gpu is None and not section):
        name = args.cluster or DEFAULT_CLUSTER
        if name not in CLUSTER_PRESETS:
            raise ConfigError(
                f"--cluster = {name!r} is not a preset; choose one of "
                f"{', '.join(CLUSTER_PRESETS)} or describe it with --gpu, --gpus-per-node, "
                "--nvlink-gbps and --ib-gbps."
            )
        total = gpus or DEFAULT_GPUS
        cluster = cluster_preset(name, total)
        if total > cluster.gpus_per_node and total % cluster.gpus_per_node:
            raise ConfigError(
                f"--gpus = {total} is not a whole number of {name} nodes of "
                f"{cluster.gpus_per_node} GPUs; use a multiple of {cluster.gpus_per_node}."
            )
        if args.gpu is not None:
            cluster = cluster.with_(gpu=args.gpu)
        if per_node is not None:
            cluster = _regroup(cluster, total, per_node)
    elif args.gpu is not None:
        per_node = per_node or min(8, gpus or 8)
        total = gpus or per_node
        cluster = _regroup(ClusterSpec(name="custom", gpu=args.gpu), total, per_node)
    else:  # from the recipe, through the recipe code
        from fivefold.spec.recipe import cluster_from_dict

        cluster = cluster_from_dict({**section, **({"gpus": gpus} if gpus else {})})
    if args.nvlink_gbps is not None:
        cluster = cluster.with_(intra_node_bw=parse_gbps(args.nvlink_gbps, "--nvlink-gbps"))
    if args.ib_gbps is not None:
        cluster = cluster.with_(inter_node_bw=parse_gbps(args.ib_gbps, "--ib-gbps"))
    if getattr(args, "nvlink_domain", None) is not None:
        cluster = cluster.with_(nvlink_domain=parse_size(args.nvlink_domain, "--nvlink-domain"))
    problems = cluster.problems()
    if problems:
        raise ConfigError(problems)
    require_hbm(cluster)
    return cluster


def _profile_path(name: str | None) -> str | None:
    """`--cluster` naming a device profile (a .toml file) rather than a preset."""
    if name and (name.endswith(".toml") or Path(name).is_file()):
        return name
    return None


def _regroup(cluster: Any, total: int, per_node: int) -> Any:
    if total < per_node:
        per_node = total
    if total % per_node:
        raise ConfigError(
            f"--gpus = {total} is not a multiple of --gpus-per-node = {per_node}; every node "
            "must be full."
        )
    return cluster.with_(nodes=total // per_node, gpus_per_node=per_node)


# ---- layout ----------------------------------------------------------------------------------
_LAYOUT_INTS = {
    "tp": "tp",
    "pp": "pp",
    "vpp": "vpp",
    "cp": "cp",
    "ep": "ep",
    "mbs": "micro_batch",
    "grad_accum": "grad_accum",
}


def pinned_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Plan fields given on the command line (what the search keeps fixed)."""
    out: dict[str, Any] = {}
    for attr, name in _LAYOUT_INTS.items():
        raw = getattr(args, attr)
        if raw is not None:
            out[name] = parse_size(raw, "--" + attr.replace("_", "-"))
    if args.zero is not None:
        zero = parse_size(args.zero, "--zero", minimum=0)
        if zero > 3:
            raise ConfigError(f"--zero = {zero}: ZeRO stage must be 0, 1, 2 or 3.")
        out["zero"] = zero
    for name in ("schedule", "recompute", "sp", "offload", "optimizer_states", "fp8"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    if args.dp is not None:
        out["dp"] = parse_size(args.dp, "--dp")
    if args.dp_shard is not None:
        out["dp_shard"] = parse_size(args.dp_shard, "--dp-shard")
    return out


def precisions_from_args(args: argparse.Namespace) -> list[str]:
    from fivefold.spec.precision import RECIPES

    if not args.precision:
        return ["bf16-mixed"]
    names = [p.strip() for p in args.precision.split(",") if p.strip()]
    unknown = [p for p in names if p not in RECIPES]
    if unknown or not names:
        raise ConfigError(
            f"--precision = {args.precision!r}: unknown recipe {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(RECIPES)}."
        )
    return names


def batch_from_args(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(global batch tokens, global batch sequences); at most one is set."""
    tokens = (
        parse_size(args.global_batch_tokens, "--global-batch-tokens")
        if args.global_batch_tokens is not None
        else None
    )
    seqs = (
        parse_size(args.global_batch, "--global-batch") if args.global_batch is not None else None
    )
    if tokens is not None and seqs is not None:
        raise ConfigError(
            "give the batch once: --global-batch (sequences) or --global-batch-tokens, not both."
        )
    if tokens is not None and tokens > MAX_BATCH_TOKENS:
        raise ConfigError(
            f"--global-batch-tokens = {tokens:,}: at most {MAX_BATCH_TOKENS:,} tokens per step "
            "(published runs use 1M to 16M); check the value."
        )
    if seqs is not None and seqs > MAX_BATCH_SEQUENCES:
        raise ConfigError(
            f"--global-batch = {seqs:,} sequences: at most {MAX_BATCH_SEQUENCES:,} per step; "
            "check the value."
        )
    return tokens, seqs


def layout_from_args(
    args: argparse.Namespace, model: Any, cluster: Any, recipe_plan: dict[str, Any]
) -> Any:
    """The one layout `plan estimate` costs, from the recipe's [plan] and the flags."""
    from fivefold.planner.outcomes import batch_target
    from fivefold.spec.plan import ParallelPlan
    from fivefold.spec.recipe import build

    pins = pinned_fields(args)
    problems: list[str] = []
    typed = build(ParallelPlan, dict(recipe_plan), "plan", problems)
    if problems or typed is None:
        raise ConfigError(problems or ["[plan]: cannot build the layout."])
    values = {k: getattr(typed, k) for k in recipe_plan}  # the fields the recipe sets, typed
    for name in (
        "tp",
        "pp",
        "vpp",
        "cp",
        "ep",
        "micro_batch",
        "grad_accum",
        "zero",
        "schedule",
        "recompute",
        "sp",
        "offload",
        "optimizer_states",
        "fp8",
    ):
        if name in pins:
            values[name] = pins[name]
    if args.precision:
        precisions = precisions_from_args(args)
        if len(precisions) > 1:
            raise ConfigError("plan estimate costs one layout: give one --precision recipe.")
        values["precision"] = precisions[0]
    tp, pp, cp = (values.get(k, 1) for k in ("tp", "pp", "cp"))
    if "dp" in pins or not ({"dp_replicate", "dp_shard"} & set(values)):
        inner = tp * pp * cp
        if cluster.world_size % inner:
            raise ConfigError(
                f"tp {tp} x pp {pp} x cp {cp} = {inner} does not divide the "
                f"{cluster.world_size} GPUs; change a degree or --gpus."
            )
        dp = pins.get("dp", cluster.world_size // inner)
        zero = values.setdefault("zero", 1 if dp * cp > 1 else 0)
        shard = pins.get("dp_shard", dp if zero else 1)
        if dp % shard:
            raise ConfigError(f"--dp-shard = {shard} must divide the data-parallel degree {dp}.")
        values["dp_shard"], values["dp_replicate"] = shard, dp // shard
    values.setdefault("sp", values.get("tp", 1) > 1)
    if values.get("pp", 1) > 1 and values.get("schedule") in ("zbv", "dualpipev"):
        values.setdefault("vpp", 2)
    tokens, seqs = batch_from_args(args)
    if "grad_accum" not in values and tokens is None and seqs is None and has_recipe(args):
        # A recipe's batch is the one `fivefold train` runs: grad_accum at its default.
        values["grad_accum"] = ParallelPlan().grad_accum
    if "grad_accum" not in values:
        target = batch_target(model, tokens, seqs)
        mbs = values.get("micro_batch", 1)
        dp = values["dp_replicate"] * values["dp_shard"]
        accum = grad_accum_for(target.sequences, mbs, dp)
        if accum is None and (tokens is not None or seqs is not None):
            raise ConfigError(
                f"global batch {target.sequences:g} sequences is not a whole number of "
                f"micro-batches: mbs {mbs} x dp {dp} = {mbs * dp} per micro-step; pick a "
                f"batch that is a multiple of {mbs * dp} or set --grad-accum."
            )
        values["grad_accum"] = accum or max(1, round(target.sequences / (mbs * dp)))
    plan = build(ParallelPlan, values, "plan", problems)
    if problems or plan is None:
        raise ConfigError(problems or ["[plan]: cannot build the layout."])
    plan.validate(model, cluster)
    return plan


# ---- recipes ----------------------------------------------------------------------------------
def has_recipe(args: argparse.Namespace) -> bool:
    """Whether the command names a recipe file (its first item is not an override)."""
    items = args.items or []
    return bool(items) and "=" not in items[0]


def recipe_items(args: argparse.Namespace) -> dict[str, dict]:
    """The positional recipe and overrides as raw sections (validated later, field by field)."""
    from fivefold.spec.recipe import SECTIONS, merge, parse_overrides, read_toml

    items = list(args.items or [])
    data: dict[str, dict] = {}
    if items and "=" not in items[0]:
        data = read_toml(items.pop(0))
    bad = [i for i in items if "=" not in i]
    if bad:
        raise ConfigError(
            f"{bad[0]!r}: only the first argument may be a recipe file; the others must be "
            "section.field=value overrides (plan.tp=4)."
        )
    data = merge(data, parse_overrides(items))
    unknown = [name for name in data if name not in SECTIONS]
    if unknown:
        raise ConfigError(
            f"[{unknown[0]}] is not a recipe section; known sections: {', '.join(SECTIONS)}."
        )
    return data


def out_path(args: argparse.Namespace, model: Any, cluster: Any) -> Path | None:
    """Where the search writes its recipe (None without --out), checked before searching."""
    if not args.out:
        return None
    path = Path(args.out)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"--out {str(path)!r} is a directory; name a file such as plan.toml.")
    if not parent.is_dir():
        raise ConfigError(
            f"--out {str(path)!r}: the directory {str(parent)!r} does not exist; create it or "
            "choose another path."
        )
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {str(path)!r}: {str(parent)!r} is not writable.")
    return path


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def write_recipe(
    path: Path, model: Any, cluster: Any, plan: Any, header: str, planner: dict[str, Any]
) -> Path:
    """The layout as a recipe, with the [planner] table (profile and options) it was chosen by,
    and [train] and [data] at their defaults, written out."""
    from fivefold.cli.recipe_text import data_section, train_section
    from fivefold.spec.recipe import Recipe, dump_recipe

    whole = {k: _whole(v) for k, v in planner.items()}  # 10485760, not 10485760.0
    text = dump_recipe(Recipe(model, cluster, plan, {"planner": whole}), header=header)
    run = ["", *train_section({"name": model.name}), "", *data_section({})]
    text += "\n".join(run) + "\n"  # complete: `fivefold train` and `launch --slurm` take it
    try:
        path.write_text(text)
    except OSError as err:
        raise ConfigError(f"--out {str(path)!r}: cannot write the recipe ({err}).") from None
    return path


# ---- printing ---------------------------------------------------------------------------------
def memory_bar(memory: dict[str, float], hbm_gib: float, headroom: float, width: int = 50) -> str:
    """One line: the worst stage's tenants as letters against HBM, '|' where headroom starts."""
    cells = []
    for key, letter in (
        ("params", "P"),
        ("grads", "G"),
        ("optimizer", "O"),
        ("activations", "A"),
        ("other", "x"),
    ):
        cells += [letter] * round(width * memory.get(key, 0.0) / hbm_gib)
    cells = cells[:width] + ["."] * max(0, width - len(cells))
    mark = round(width * (1 - headroom))
    if 0 < mark < width:
        cells[mark] = "|" if cells[mark] == "." else cells[mark]
    over = memory["total"] > hbm_gib
    return f"[{''.join(cells)}]{'>' if over else ''} {memory['total']:.1f} / {hbm_gib:.0f} GiB"


def summary_lines(est_json: dict[str, Any], headroom: float) -> list[str]:
    mem = est_json["memory_gib"]
    lines = [
        f"step time   {est_json['step_time_s'] * 1e3:,.0f} ms   "
        f"tokens/s {est_json['tokens_per_s']:,.0f}   MFU {est_json['mfu']:.1%}   "
        f"HFU {est_json['hfu']:.1%}   bubble {est_json['bubble_fraction']:.1%}",
        f"memory per GPU, worst stage {est_json.get('worst_stage', 0)} "
        f"({_recipe_words(est_json)}):",
        "  " + memory_bar(mem, est_json["hbm_gib"], headroom),
        "  P params {params:.2f}  G grads {grads:.2f}  O optimizer {optimizer:.2f}  "
        "A activations {activations:.2f}  x other {other:.2f}  (GiB)".format(**mem),
    ]
    host = est_json.get("host_memory")
    if host:
        lines.append(
            f"  host memory (offloaded): {host['per_gpu_gib']:.1f} GiB per GPU, "
            f"{host['per_node_gib']:,.0f} GiB per node of {host['usable_gib']:,.0f} GiB usable "
            f"({host['system']}, {host['node_ram_gib']:,.0f} GiB)"
            + ("" if host["fits"] else "  DOES NOT FIT")
        )
    exposed = [c for c in est_json.get("comm", []) if c.get("exposed_s", 0) > 0]
    if exposed:
        parts = [
            f"{c['kind']} {c['exposed_s'] * 1e3:,.1f} ms "
            + (f"({c['link_model']})" if c.get("link_model") else f"on {c['link']}")
            for c in sorted(exposed, key=lambda c: -c["exposed_s"])
        ]
        lines.append("exposed communication per step: " + ", ".join(parts))
    sharing = est_json.get("breakdown_s", {}).get("core_sharing_s", 0.0)
    if sharing < 0:
        lines.append(
            "ranks outnumber the cores: a rank waiting for a neighbour or a collective leaves "
            f"its core to the others; the step is {-sharing * 1e3:,.1f} ms shorter than its "
            "compute and communication added up"
        )
    return lines


def _recipe_words(est_json: dict[str, Any]) -> str:
    """'bf16-mixed', with the plan's memory levers: 'bf16-mixed, 8bit Adam states, offload all'."""
    plan = est_json.get("plan", {})
    words = [est_json.get("precision", "")]
    if plan.get("optimizer_states", "fp32") != "fp32":
        words.append(f"{plan['optimizer_states']} Adam states")
    if plan.get("offload", "none") != "none":
        words.append(f"offload {plan['offload']}")
    if plan.get("fp8", "none") != "none":
        words.append(f"fp8 {plan['fp8']}")
    return ", ".join(words)


def _describe(plan_dict: dict[str, Any]) -> str:
    from fivefold.spec.plan import ParallelPlan

    return ParallelPlan(**plan_dict).describe()


# ---- handlers ---------------------------------------------------------------------------------
def _inputs(args: argparse.Namespace) -> tuple[Any, Any, dict[str, dict], float, Any]:
    """Model, cluster, the recipe's sections, the headroom and the planner settings.

    Headroom: --headroom when given, else the recipe's [planner] headroom, else 0.10."""
    data = recipe_items(args)
    model = model_from_args(args, data)
    cluster = cluster_from_args(args, data)
    settings = planner_from_args(args, cluster, data)
    given = None if args.headroom is None else parse_fraction(args.headroom, "--headroom")
    return model, cluster, data, resolve_headroom(given, settings), settings


def _estimate_handler(args: argparse.Namespace) -> int:
    from fivefold.planner.budget import budget_lines
    from fivefold.planner.estimate import estimate
    from fivefold.planner.explain import confidence_line
    from fivefold.planner.uncertainty import band_json

    model, cluster, data, headroom, settings = _inputs(args)
    inputs = budget_from_args(args, data)
    plan = layout_from_args(args, model, cluster, data.get("plan", {}))
    est = estimate(model, cluster, plan, settings.options)
    answer = budget_of(est, inputs)
    out = est.to_json()
    out["band"] = band_json(est)
    out["budget"] = answer.to_json() if answer else None
    usable = out["hbm_gib"] * (1 - headroom)
    out["fits_with_headroom"] = out["memory_gib"]["total"] <= usable and est.host_fits
    out["headroom"] = headroom
    out["planner"] = settings.to_json()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{model.name} on {cluster.world_size} x {cluster.gpu}: {plan.describe()}")
    _print_profile(cluster)
    print(settings.describe())
    for line in summary_lines(out, headroom):
        print(line)
    verdict = "fits" if out["fits_with_headroom"] else "DOES NOT FIT"
    print(
        f"{verdict}: worst stage {out['memory_gib']['total']:.1f} GiB against "
        f"{usable:.1f} GiB usable ({out['hbm_gib']:.0f} GiB HBM less {headroom:.0%} headroom)"
    )
    for line in budget_lines(answer) if answer else []:
        print(line)
    print(confidence_line(est))
    return 0


def _search_handler(args: argparse.Namespace) -> int:
    from fivefold.planner.budget import budget_lines
    from fivefold.planner.explain import explain
    from fivefold.planner.search import search
    from fivefold.planner.uncertainty import band_json

    model, cluster, data, headroom, settings = _inputs(args)
    inputs = budget_from_args(args, data)
    tokens, seqs = batch_from_args(args)
    path = out_path(args, model, cluster)
    recipe_batch = None
    if tokens is None and seqs is None and "plan" in data:
        recipe_batch = _recipe_global_batch(data["plan"])
    request = PlanRequest(
        model,
        cluster,
        settings,
        pins=pinned_fields(args),
        global_batch=seqs,
        global_batch_tokens=tokens,
        recipe_batch=recipe_batch,
        headroom=headroom,
        top=parse_size(args.top, "--top") if args.top else None,
        batch_tolerance=(
            parse_fraction(args.batch_tolerance, "--batch-tolerance")
            if args.batch_tolerance
            else None
        ),
        precisions=tuple(precisions_from_args(args)) if args.precision else None,
        risk=args.risk,
    )
    resolved = resolve_request(request)
    started = time.perf_counter()
    result = search(model, cluster, **resolved.search_kwargs())
    explanation = [settings.describe(), *explain(result)]
    elapsed_s = time.perf_counter() - started
    best = result.best.to_json(timeline=args.json)  # the timeline only where it is printed
    answer = budget_of(result.best, inputs)
    alt_budgets = [budget_of(a, inputs) for a in result.alternatives]
    recipe_path = None
    if path is not None:
        header = (
            f"Written by `fivefold plan` for {model.name} on {cluster.world_size} x "
            f"{cluster.gpu}.\nPredicted: step {best['step_time_s']:.3f} s, "
            f"{best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}, worst-stage memory "
            f"{best['memory_gib']['total']:.1f} GiB of {best['hbm_gib']:.0f} GiB."
        )
        section = settings.section(headroom) | _budget_section(data)
        section |= {"tokens": inputs.tokens} if inputs else {}
        recipe_path = write_recipe(path, model, cluster, result.best_plan, header, section)
    if args.json:
        out = dict(best)
        out["budget"] = answer.to_json() if answer else None
        out["alternatives"] = [
            _brief(a.to_json()) | {"budget": b.to_json() if b else None}
            for a, b in zip(result.alternatives, alt_budgets, strict=True)
        ]
        out["rejected"] = [{"plan": p.to_dict(), "reason": r} for p, r in result.rejected]
        out["explanation"] = explanation
        out["band"] = band_json(result.best)  # fivefold.planner.uncertainty
        out["search"] = {
            "evaluated": result.evaluated,
            "considered": result.considered,
            "elapsed_s": elapsed_s,
            "target_sequences": result.target.sequences,
            "target_tokens": result.target.tokens,
            "batch_tolerance": result.target.tolerance,
            "headroom": headroom,
            "risk": result.risk,
        }
        out["recipe_path"] = str(recipe_path) if recipe_path else None
        out["planner"] = settings.to_json()
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{model.name} on {cluster.world_size} x {cluster.gpu} "
        f"({cluster.nodes} nodes x {cluster.gpus_per_node}), global batch "
        f"{result.target.sequences:g} sequences = {result.target.tokens:,.0f} tokens"
    )
    _print_profile(cluster)
    print(f"best layout: {_describe(best['plan'])}")
    for line in summary_lines(best, headroom):
        print(line)
    for line in budget_lines(answer) if answer else []:
        print(line)
    if "plan" in data:
        print(_recipe_comparison(args, model, cluster, data, result, settings.options))
    print("\nwhy:")
    for line in explanation:
        print(f"  - {line}")
    if result.alternatives:
        print("\nnext best:")
        for alt, alt_budget in zip(result.alternatives, alt_budgets, strict=True):
            j = alt.to_json(timeline=False)
            print(
                f"  {j['tokens_per_s']:>12,.0f} tok/s  MFU {j['mfu']:5.1%}  "
                f"{j['memory_gib']['total']:5.1f} GiB{_brief_budget(alt_budget)}  "
                f"{_describe(j['plan'])}"
            )
    print(
        f"\nsearched {result.considered:,} layouts ({result.evaluated:,} costed in full) in "
        f"{elapsed_s:.2f} s"
    )
    if recipe_path:
        print(f"recipe written to {recipe_path} (fivefold train {recipe_path})")
    else:
        print("write this layout as a recipe for `fivefold train` with --out PATH")
    return 0


def _budget_section(data: dict[str, dict]) -> dict[str, Any]:
    """The recipe's token-budget [planner] fields, kept in a recipe written by --out."""
    from fivefold.planner.budget import BUDGET_KEYS

    section = data.get("planner", {})
    return {k: section[k] for k in BUDGET_KEYS if isinstance(section, dict) and k in section}


def _print_profile(cluster: Any) -> None:
    """Say which device profile a measured machine's figures come from, and when it was made."""
    if not cluster.profile:
        return
    from fivefold.spec.profile import load_profile

    created = load_profile(cluster.profile).created
    print(f"device profile: {cluster.profile}" + (f" (measured {created})" if created else ""))


def _recipe_global_batch(plan_values: dict[str, Any]) -> int:
    """The global batch (sequences) a recipe's [plan] implies: the search's default target."""
    from fivefold.spec.plan import ParallelPlan
    from fivefold.spec.recipe import build

    problems: list[str] = []
    plan = build(ParallelPlan, dict(plan_values), "plan", problems)
    if problems or plan is None:
        raise ConfigError(problems or ["[plan]: cannot build the layout."])
    return plan.global_batch


def _recipe_comparison(
    args: argparse.Namespace, model: Any, cluster: Any, data: dict, result: Any, options: Any
) -> str:
    """One line on the recipe's own layout against the search's best."""
    from fivefold.planner.estimate import estimate
    from fivefold.planner.explain import slower_because

    try:
        plan = layout_from_args(args, model, cluster, data["plan"])
        est = estimate(model, cluster, plan, options)
    except ConfigError as err:
        return f"the recipe's own layout is not valid: {err}"
    fit = "fits" if est.fits_with(result.headroom) else "does NOT fit"
    return (
        f"the recipe's layout ({plan.describe()}): {est.tokens_per_s:,.0f} tokens/s, "
        f"{est.peak_memory_bytes / 2**30:.1f} GiB, {fit}; "
        f"against the best: {slower_because(est, result.best, result.risk)}"
    )


def _brief(j: dict[str, Any]) -> dict[str, Any]:
    keys = ("fits", "step_time_s", "tokens_per_s", "mfu", "hfu", "bubble_fraction", "plan")
    out = {k: j[k] for k in keys}
    out["memory_gib"] = j["memory_gib"]
    return out
