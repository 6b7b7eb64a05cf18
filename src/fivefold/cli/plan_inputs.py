"""What `fivefold plan` plans: the model, cluster, planner settings, budget and layout read from
its flags and recipe (flags win over the recipe); nothing here imports torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fivefold.cli.plan_args import (
    DEFAULT_CLUSTER,
    DEFAULT_GPUS,
    GBPS,
    parse_fraction,
    parse_gbps,
    parse_size,
    parse_tokens,
    positive_number,
)
from fivefold.cli.plan_mixture import plan_mixture
from fivefold.errors import ConfigError
from fivefold.planner.budget.token_budget import budget_inputs
from fivefold.planner.frameworks import planner_settings
from fivefold.planner.options import OPTION_HELP
from fivefold.planner.request import (
    MAX_BATCH_SEQUENCES,
    PlanRequest,
)
from fivefold.planner.search.layout_defaults import complete_layout
from fivefold.specs.cluster import (
    CLUSTER_PRESETS,
    ClusterSpec,
    cluster_preset,
    node_split,
    profile_cluster,
    require_hbm,
)
from fivefold.specs.hardware import gpu as gpu_lookup
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import RECIPES
from fivefold.specs.presets import MODEL_PRESETS
from fivefold.specs.recipe import (
    SECTIONS,
    build,
    cluster_from_dict,
    merge,
    model_from_dict,
    parse_overrides,
    read_toml,
)
from fivefold.train.config import recipe_compile

MAX_BATCH_TOKENS = 1 << 30  # tokens per step: 64x Llama 3's 16M; bounds the search


def planner_from_args(args: argparse.Namespace, cluster: Any, recipe_data: dict[str, dict]) -> Any:
    """The profile and options in force (`fivefold.planner.frameworks.planner_settings`): the
    recipe's [planner] table, then --profile and the option flags."""
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
    compiled = recipe_compile(recipe_data)
    return planner_settings(cluster.device, section, flags, args.profile, spelled, compiled)


_NUMERIC_OPTIONS = ("cuda_context_bytes", "fragmentation_fraction", "dp_bucket_bytes")


def budget_from_args(args: argparse.Namespace, recipe_data: dict[str, dict]) -> Any:
    """The token-budget inputs (`planner.budget.token_budget.BudgetInputs`) from the flags and the
    recipe's [planner] table, or None when no token count is given."""
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
            flags[key] = positive_number(raw, "--" + attr.replace("_", "-"), unit)
    if "ckpt_bandwidth" in flags:
        flags["ckpt_bandwidth"] *= GBPS
    mixture = plan_mixture(args, recipe_data)
    if mixture:
        flags["sources"] = mixture
    section = recipe_data.get("planner", {})
    return budget_inputs(section if isinstance(section, dict) else {}, flags)


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
    overrides; expanded and validated by the recipe code (`fivefold.specs.recipe`), so
    `--model X --kv-heads N` and `[model] preset = "X"  kv_heads = N` are the same model."""
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
        if args.gpu is not None:
            cluster = cluster.with_(gpu=args.gpu)
        if per_node is not None:
            cluster = _regroup(cluster, total, per_node)
    elif args.gpu is not None:
        per_node = per_node or min(8, gpus or 8)
        total = gpus or per_node
        cluster = _regroup(ClusterSpec(name="custom", gpu=args.gpu), total, per_node)
    else:  # from the recipe, through the recipe code
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
    nodes, local = node_split(total, per_node, per_node_field="--gpus-per-node")
    return cluster.with_(nodes=nodes, gpus_per_node=local)


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
    args: argparse.Namespace,
    model: Any,
    cluster: Any,
    recipe_plan: dict[str, Any],
    runtime: bool = True,
) -> Any:
    """The one layout `plan estimate` costs, from the recipe's [plan] and the flags; fivefold's
    runtime rules bind it when `runtime` (the options describe that runtime)."""
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
    complete_layout(
        values,
        model,
        cluster,
        dp=pins.get("dp"),
        dp_shard=pins.get("dp_shard"),
        batch=batch_from_args(args),
        recipe_batch=has_recipe(args),
    )
    plan = build(ParallelPlan, values, "plan", problems)
    if problems or plan is None:
        raise ConfigError(problems or ["[plan]: cannot build the layout."])
    plan.validate(model, cluster, runtime=runtime)
    return plan


# ---- recipes ----------------------------------------------------------------------------------
def has_recipe(args: argparse.Namespace) -> bool:
    """Whether the command names a recipe file (its first item is not an override)."""
    items = args.items or []
    return bool(items) and "=" not in items[0]


def recipe_items(args: argparse.Namespace) -> dict[str, dict]:
    """The positional recipe and overrides as raw sections (validated later, field by field)."""
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


def _recipe_global_batch(plan_values: dict[str, Any]) -> int:
    """The global batch (sequences) a recipe's [plan] implies: the search's default target."""
    problems: list[str] = []
    plan = build(ParallelPlan, dict(plan_values), "plan", problems)
    if problems or plan is None:
        raise ConfigError(problems or ["[plan]: cannot build the layout."])
    return plan.global_batch


def request_from_args(
    args: argparse.Namespace,
    model: Any,
    cluster: Any,
    recipe_data: dict[str, dict],
    settings: Any,
    headroom: float,
    tokens: int | None,
    seqs: int | None,
) -> PlanRequest:
    """The search's request (`fivefold.planner.request`): the pinned fields, the batch target
    (the flags', else the recipe's own global batch) and the search flags given."""
    recipe_batch = None
    if tokens is None and seqs is None and "plan" in recipe_data:
        recipe_batch = _recipe_global_batch(recipe_data["plan"])
    pins = pinned_fields(args)
    top = parse_size(args.top, "--top") if args.top else None
    tolerance = None
    if args.batch_tolerance:
        tolerance = parse_fraction(args.batch_tolerance, "--batch-tolerance")
    return PlanRequest(
        model,
        cluster,
        settings,
        pins=pins,
        global_batch=seqs,
        global_batch_tokens=tokens,
        recipe_batch=recipe_batch,
        headroom=headroom,
        top=top,
        batch_tolerance=tolerance,
        precisions=tuple(precisions_from_args(args)) if args.precision else None,
        risk=args.risk,
    )
