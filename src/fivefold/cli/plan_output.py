"""What `fivefold plan` prints: the summary of one estimate, its memory bar, budgets in brief."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.planner.budget.token_budget import (
    BUDGET_KEYS,
    DAY_S,
    KEEP_CHECKPOINTS,
    MIXTURE_KEY,
    budget,
    budget_lines,
)
from fivefold.planner.budget.uncertainty import band_json
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.profile import load_profile


def budget_of(est: Any, inputs: Any) -> Any:
    """The token-budget answer (`planner.budget.token_budget.Budget`) of one estimate; None without
    a token count."""
    if inputs is None:
        return None
    return budget(est.model, est.cluster, est.plan, est.step_time_s, inputs)


def budget_train(b: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The [train] fields a token budget (`Budget`) sets in a written recipe, and why each:
    its steps, Young's checkpoint interval and the checkpoints its storage figure keeps."""
    if b is None:
        return {}, {}
    given = {"steps": b.steps, "ckpt_every": b.interval_steps, "keep_checkpoints": KEEP_CHECKPOINTS}
    notes = {
        "steps": f"the token budget: {b.tokens:,.0f} tokens / {b.tokens_per_step:,} per step",
        "ckpt_every": f"Young's interval: {b.save_s:,.1f} s per save, MTBF {b.mtbf_s / 3600:,.1f} h"
        if b.interval_steps
        else "no failures expected (planner.failure_rate = 0): only at the end",
        "keep_checkpoints": f"{KEEP_CHECKPOINTS} kept and one being written: "
        f"{KEEP_CHECKPOINTS + 1} x {b.checkpoint_bytes / 1e9:,.1f} GB = "
        f"{b.storage_bytes / 1e9:,.1f} GB of checkpoint storage at the peak",
    }
    return given, notes


def _brief_budget(b: Any) -> str:
    """'  41.2 d  63,258 GPU-h  goodput 97.1%' for an alternative's line ('' without one)."""
    if b is None:
        return ""
    if not b.progresses:
        return "  never finishes"
    return f"  {b.wall_s / DAY_S:6.1f} d  {b.gpu_hours:>9,.0f} GPU-h  goodput {b.goodput:.1%}"


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
    return ParallelPlan(**plan_dict).describe()


def budget_section(data: dict[str, dict]) -> dict[str, Any]:
    """The recipe's token-budget [planner] fields, kept in a recipe written by --out."""
    section = data.get("planner", {})
    keys = (*BUDGET_KEYS, MIXTURE_KEY)
    return {k: section[k] for k in keys if isinstance(section, dict) and k in section}


def print_profile(cluster: Any) -> None:
    """Say which device profile a measured machine's figures come from, and when it was made."""
    if not cluster.profile:
        return

    created = load_profile(cluster.profile).created
    print(f"device profile: {cluster.profile}" + (f" (measured {created})" if created else ""))


def _brief(j: dict[str, Any]) -> dict[str, Any]:
    keys = ("fits", "step_time_s", "tokens_per_s", "mfu", "hfu", "bubble_fraction", "plan")
    out = {k: j[k] for k in keys}
    out["memory_gib"] = j["memory_gib"]
    return out


@dataclass(frozen=True)
class SearchShown:
    """A search's answer as `fivefold plan` shows it."""

    result: Any  # fivefold.planner.search.outcomes.SearchResult
    best: dict[str, Any]  # result.best.to_json()
    explanation: list[str]  # the planner settings' line, then `planner.explain.explain`
    elapsed_s: float  # search and explanation
    headroom: float
    inputs: Any  # fivefold.planner.budget.token_budget.BudgetInputs, or None
    recipe_path: Path | None


def recipe_header(model: Any, cluster: Any, best: dict[str, Any]) -> str:
    """The comment on top of the recipe `--out` writes."""
    return (
        f"Written by `fivefold plan` for {model.name} on {cluster.world_size} x "
        f"{cluster.gpu}.\nPredicted: step {best['step_time_s']:.3f} s, "
        f"{best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}, worst-stage memory "
        f"{best['memory_gib']['total']:.1f} GiB of {best['hbm_gib']:.0f} GiB."
    )


def search_json(shown: SearchShown, planner: dict[str, Any]) -> dict[str, Any]:
    """`fivefold plan --json`: the best estimate with budgets, alternatives, rejections, the
    explanation, the band and the search's own figures."""
    result, inputs = shown.result, shown.inputs
    answer = budget_of(result.best, inputs)
    out = dict(shown.best)
    out["budget"] = answer.to_json() if answer else None
    out["alternatives"] = [
        _brief(a.to_json()) | {"budget": b.to_json() if b else None}
        for a, b in zip(result.alternatives, _alt_budgets(shown), strict=True)
    ]
    out["rejected"] = [{"plan": p.to_dict(), "reason": r} for p, r in result.rejected]
    out["explanation"] = shown.explanation
    out["band"] = band_json(result.best)  # fivefold.planner.budget.uncertainty
    out["search"] = {
        "evaluated": result.evaluated,
        "considered": result.considered,
        "elapsed_s": shown.elapsed_s,
        "target_sequences": result.target.sequences,
        "target_tokens": result.target.tokens,
        "batch_tolerance": result.target.tolerance,
        "headroom": shown.headroom,
        "risk": result.risk,
    }
    out["recipe_path"] = str(shown.recipe_path) if shown.recipe_path else None
    out["planner"] = planner
    return out


def print_search(shown: SearchShown, comparison: str | None) -> None:
    """`fivefold plan` in text: the best layout, why, the next best and what was searched;
    `comparison` is the line on the recipe's own layout, when a recipe gave one."""
    result, best = shown.result, shown.best
    model, cluster = result.model, result.cluster
    print(
        f"{model.name} on {cluster.world_size} x {cluster.gpu} "
        f"({cluster.nodes} nodes x {cluster.gpus_per_node}), global batch "
        f"{result.target.sequences:g} sequences = {result.target.tokens:,.0f} tokens"
    )
    print_profile(cluster)
    print(f"best layout: {_describe(best['plan'])}")
    for line in summary_lines(best, shown.headroom):
        print(line)
    answer = budget_of(result.best, shown.inputs)
    for line in budget_lines(answer) if answer else []:
        print(line)
    if comparison is not None:
        print(comparison)
    print("\nwhy:")
    for line in shown.explanation:
        print(f"  - {line}")
    if result.alternatives:
        print("\nnext best:")
        for alt, alt_budget in zip(result.alternatives, _alt_budgets(shown), strict=True):
            j = alt.to_json(timeline=False)
            print(
                f"  {j['tokens_per_s']:>12,.0f} tok/s  MFU {j['mfu']:5.1%}  "
                f"{j['memory_gib']['total']:5.1f} GiB{_brief_budget(alt_budget)}  "
                f"{_describe(j['plan'])}"
            )
    print(
        f"\nsearched {result.considered:,} layouts ({result.evaluated:,} costed in full) in "
        f"{shown.elapsed_s:.2f} s"
    )
    if shown.recipe_path:
        print(f"recipe written to {shown.recipe_path} (fivefold train {shown.recipe_path})")
    else:
        print("write this layout as a recipe for `fivefold train` with --out PATH")


def _alt_budgets(shown: SearchShown) -> list[Any]:
    return [budget_of(a, shown.inputs) for a in shown.result.alternatives]
