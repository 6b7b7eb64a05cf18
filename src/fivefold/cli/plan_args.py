"""The arguments of `fivefold plan`: the help texts, the flags, and their values parsed.

Sizes accept binary suffixes: 128K = 131,072, 4M = 4,194,304 (2^20), 1G = 2^30; token counts
decimal ones (500B = 5e11); a plain number is taken as is. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.budget.token_budget import DEFAULT_RESTART_S
from fivefold.planner.frameworks import DEFAULT_PROFILE, profiles
from fivefold.planner.options import CHOICES, OPTION_HELP, PlannerOptions
from fivefold.specs.geometry import OFFLOAD_KINDS, RECOMPUTE_POLICIES, SCHEDULES
from fivefold.specs.hardware import gpu
from fivefold.specs.plan import FP8_RECIPES, OPTIMIZER_STATES

DESCRIPTION = """\
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
Mixtral, Qwen3-MoE, DeepSeek-V3) or flags (--layers --hidden --heads ...); flags override the
preset. The cluster from a preset and a GPU count (--cluster dgx-h100 --gpus 64) or a description
(--gpu h100 --gpus-per-node 8 --nvlink-gbps 900 --ib-gbps 50 --gpus 64). A positional recipe
(e.g. configs/llama3-8b-dgx-h100.toml) gives model, cluster and, for `estimate`, the layout
and its batch: grad_accum as the recipe sets it (its default, 1, when unset), the batch
`fivefold train` runs, unless --global-batch or --global-batch-tokens is given.

What the training software achieves (attention kernel, overlap of TP and DP communication,
fused kernels, collective granularity, the memory it keeps) is an efficiency profile. The
default, fivefold, is fivefold's own runtime as `fivefold train` runs the recipe on the
cluster's device (eager, or compiled blocks under the recipe's train.compile or --compile),
bound by the layouts that runtime runs. --profile megatron-2022, nemo-2024 or torchtitan plans
that other software instead (the output says so), which fivefold's runtime rules do not bind.
Each planner option flag replaces the profile's value (the output says so), as does a recipe's
[planner] table (profile = "torchtitan", attention_kernel = "classic", headroom = 0.1, ...);
flags win over the recipe. --json echoes the profile and every option in force.
"""

EPILOG = """\
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every argument of `fivefold plan`, by group."""
    parser.add_argument(
        "items",
        nargs="*",
        metavar="[estimate|check] [RECIPE] [OVERRIDE ...]",
        help="'estimate' to cost one layout instead of searching, 'check' to build the "
        "recipe's layout at full scale under fake tensors and measure its memory beside the "
        "prediction; then an optional TOML recipe (its [model], [cluster] and, for estimate "
        "and check, [plan]) and section.field=value overrides (plan.tp=4)",
    )
    _add_model_args(parser)
    _add_cluster_args(parser)
    _add_layout_args(parser)
    _add_batch_args(parser)
    _add_budget_options(parser)
    _add_planner_options(parser)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model (a preset or TOML file, and/or flags)")
    m.add_argument("--model", metavar="PRESET|FILE", help="preset name or TOML file")
    m.add_argument(
        "--hf-config",
        metavar="CONFIG.json",
        help="a Hugging Face config.json (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, "
        "deepseek_v3): "
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


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
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


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
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
        choices=SCHEDULES,
        help="pipeline schedule",
    )
    lay.add_argument("--recompute", choices=RECOMPUTE_POLICIES, help="recompute")
    lay.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism in the TP group",
    )
    for flag, choices, help_text in (
        (
            "--offload",
            OFFLOAD_KINDS,
            "CPU offload (default none): the optimizer state (zero <= 2), or parameters, "
            "gradients and optimizer state (zero 3); a search tries it only when nothing fits",
        ),
        (
            "--optimizer-states",
            OPTIMIZER_STATES,
            "Adam's m and v (default fp32): torchao's 8bit/fp8, 1 byte + a scale per 256; a "
            "search tries 8bit only when nothing fits",
        ),
        (
            "--fp8",
            FP8_RECIPES,
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


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
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
        "at their defaults; with --tokens, the budget's steps, checkpoint interval and "
        "checkpoints kept) to PATH, in an existing directory (default: no file is written)",
    )
    b.add_argument("--json", action="store_true", help="print JSON (stable key names)")


def _add_budget_options(parser: argparse.ArgumentParser) -> None:
    """The token-budget flags (`planner.budget.token_budget`); each also a [planner] field."""
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
        "--source",
        action="append",
        metavar="NAME=WEIGHT[:TOKENS]",
        help="a source of the data mixture, repeated per source (e.g. --source web=0.6:300B "
        "--source books=0.15:20B): tokens and epochs of each beside the budget; TOKENS is its "
        "size (default: the recipe's [planner] sources, else its [data] sources)",
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
    g = parser.add_argument_group(
        "planner options (what the software achieves; a flag replaces the profile's value; "
        "defaults shown are the fivefold profile's on a GPU)"
    )
    g.add_argument(
        "--profile",
        metavar="NAME",
        help=f"efficiency profile: {', '.join(profiles())} (default {DEFAULT_PROFILE})",
    )
    defaults = PlannerOptions.for_device(gpu("h100"))  # the fivefold profile on a GPU
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


def positive_number(text: Any, flag: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{flag} = {text!r}: give a number ({unit}).") from None
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{flag} = {text}: must be a number >= 0 ({unit}).")
    return value
