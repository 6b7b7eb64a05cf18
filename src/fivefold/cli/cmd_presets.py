"""`fivefold presets`: the model and cluster presets a recipe can name, with parameter counts."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from fivefold.specs.cluster import CLUSTER_PRESETS
from fivefold.specs.model import ModelSpec, param_count
from fivefold.specs.presets import MODEL_PRESETS
from fivefold.units import GiB

# rich is imported inside the functions: `fivefold --help`
# imports every command module (fivefold.cli.main) and must stay quick.

if TYPE_CHECKING:
    from rich.table import Table

CLUSTER_EXAMPLE_GPUS = 8  # cluster presets are shown for one node; recipes set `gpus`


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "presets",
        help="list model and cluster presets with parameter counts",
        description="List the model presets (`[model] preset = NAME` in a recipe) with total "
        "and active parameter counts (active: the top_k routed experts a token uses in MoE "
        "models), layers, hidden size, attention heads / key-value heads, MLP width (or "
        "experts), vocabulary and sequence length; and the cluster presets (`[cluster] preset "
        "= NAME`, with `gpus = N`) with their GPU, links and dense bf16 peak.",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the presets as JSON instead of tables"
    )
    parser.set_defaults(handler=handle)


def format_count(count: float) -> str:
    """8_030_261_248 -> '8.03B'; 6_390_000 -> '6.39M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(int(count))


def model_row(m: ModelSpec) -> dict:
    total, active = param_count(m), param_count(m, active_only=True)
    mlp = (
        f"{m.experts}x{m.expert_ffn} top{m.top_k}"
        + (f"+{m.shared_experts}sh" if m.shared_experts else "")
        if m.is_moe
        else f"{m.ffn} {m.mlp}"
    )
    return {
        "name": m.name,
        "params": total,
        "active_params": active,
        "layers": m.layers,
        "hidden": m.hidden,
        "heads": m.heads,
        "kv_heads": m.kv_heads,
        "ffn": mlp,
        "vocab": m.vocab,
        "seq_len": m.seq_len,
    }


def cluster_row(name: str) -> dict:
    cluster = CLUSTER_PRESETS[name](CLUSTER_EXAMPLE_GPUS)
    device = cluster.device
    return {
        "name": name,
        "gpu": cluster.gpu,
        "gpus_per_node": cluster.gpus_per_node,
        "hbm_gib": device.hbm_bytes / GiB,
        "bf16_peak_tflops": device.peak_flops.get("bf16", 0.0) / 1e12,
        "nvlink_gb_per_s": cluster.intra_node_bw / 1e9,
        "ib_gb_per_s": cluster.inter_node_bw / 1e9,
    }


def _table(title: str, columns: tuple[str, ...], left_aligned: tuple[str, ...]) -> Table:
    """A rich Table with `columns` that never wrap: text columns left-aligned, numbers right."""
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(
            column, justify="left" if column in left_aligned else "right", no_wrap=True
        )
    return table


def handle(args: argparse.Namespace) -> int:
    models = [model_row(m) for m in MODEL_PRESETS.values()]
    clusters = [cluster_row(name) for name in CLUSTER_PRESETS]
    if args.json:
        print(json.dumps({"models": models, "clusters": clusters}, indent=2))
        return 0
    from rich.console import Console

    table = _table(
        "Model presets (\\[model] preset = NAME)",
        ("name", "params", "active", "layers", "hidden", "heads/kv", "MLP", "vocab", "seq"),
        left_aligned=("name", "MLP"),
    )
    for r in models:
        table.add_row(
            r["name"],
            format_count(r["params"]),
            format_count(r["active_params"]),
            str(r["layers"]),
            str(r["hidden"]),
            f"{r['heads']}/{r['kv_heads']}",
            r["ffn"],
            f"{r['vocab']:,}",
            f"{r['seq_len']:,}",
        )
    clusters_table = _table(
        "Cluster presets (\\[cluster] preset = NAME, gpus = N)",
        ("name", "GPU", "GPUs/node", "HBM GiB", "bf16 TFLOP/s", "NVLink GB/s", "IB GB/s per GPU"),
        left_aligned=("name", "GPU"),
    )
    for r in clusters:
        clusters_table.add_row(
            r["name"],
            r["gpu"],
            str(r["gpus_per_node"]),
            f"{r['hbm_gib']:.0f}",
            f"{r['bf16_peak_tflops']:.0f}",
            f"{r['nvlink_gb_per_s']:.0f}",
            f"{r['ib_gb_per_s']:.0f}",
        )
    console = Console()
    if not console.is_terminal:  # pipes and files get the whole table, not 80 columns
        console = Console(width=120)
    console.print(table)
    console.print(clusters_table)
    return 0
