"""The explorer's JSON API: parse and check a request, call the planner, shape the answer.

Every request body is a JSON object using the spec's own field names (the same names as a TOML
recipe): {"model": {...}, "cluster": {...}, "plan": {...}, "planner": {...}, "global_batch":
sequences}. `model` and `cluster` may name a preset (`{"preset": "llama3-8b", "seq_len": 8192}`)
and override any field; `model.hf_config` may hold a Hugging Face config.json's contents.
`planner` is the [planner] table: an efficiency `profile` (`fivefold.planner.frameworks`) and
options on top (`{"profile": "torchtitan", "attention_kernel": "classic"}`), all echoed back.
A search takes `risk` ("pessimistic", the default, or "expected") as `plan --risk` does. A
`planner` table with `tokens` (and optionally `gpu_hour_price`, `failure_rate`, ...) adds the
token-budget answer (`planner.budget.token_budget`): `budget` beside an estimate, and `budgets`
(best first, as `describe`) beside a search; null without `tokens`.
Bandwidths are bytes/s, as in `ClusterSpec`. When `global_batch` is given, the number of
micro-batches per step (`plan.grad_accum`) is derived from it, as `fivefold plan estimate
--global-batch` does: grad_accum = global_batch / (micro_batch * dp).

Every mistake becomes an `ApiError` carrying one sentence per problem (naming the field and the
fix); the server turns it into a 400 answer that the page shows. The numbers come from
`fivefold.planner` and are passed through unchanged: the page displays `estimate().to_json()`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from fivefold.errors import ConfigError
from fivefold.explore.rank_grid import rank_grid
from fivefold.planner.budget.token_budget import budget, budget_inputs
from fivefold.planner.budget.uncertainty import risk_problems
from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import explain
from fivefold.planner.frameworks import (
    DEFAULT_PROFILE,
    SECTION_KEYS,
    PlannerSettings,
    planner_settings,
    profiles,
)
from fivefold.planner.options import CHOICES, OPTION_HELP, PlannerOptions
from fivefold.planner.request import (
    MAX_BATCH_SEQUENCES,
    PlanRequest,
    resolve_request,
)
from fivefold.planner.search.layouts import search
from fivefold.planner.search.outcomes import TIE_FRACTION
from fivefold.specs.batch import grad_accum_for, grad_accum_problem
from fivefold.specs.cluster import CLUSTER_PRESETS, ClusterSpec
from fivefold.specs.geometry import MESH_ORDER, RECOMPUTE_POLICIES
from fivefold.specs.hardware import GPU_ALIASES, GPUS, gpu
from fivefold.specs.model import ModelSpec, param_count
from fivefold.specs.plan import CP_KINDS, SCHEDULES, ParallelPlan
from fivefold.specs.precision import RECIPES
from fivefold.specs.presets import MODEL_PRESETS
from fivefold.specs.recipe import (
    Recipe,
    cluster_from_dict,
    dump_recipe,
    model_from_dict,
    recipe_from_dict,
)
from fivefold.units import GiB

# What the explorer accepts: generous for real clusters, small enough that one request stays
# interactive (the pipeline timeline has 3 * pp * vpp * grad_accum events to draw).
LIMITS: dict[str, int] = {
    "world_size": 32768,
    "grad_accum": 1024,
    "micro_batch": 1024,
    "virtual_stages": 512,
    "seq_len": 4 * 1024 * 1024,
    "layers": 1024,
    "global_batch": MAX_BATCH_SEQUENCES,
    "top": 20,
}
SEARCH_LIMIT_WORLD = 32768
LAYOUT_KEYS = ("model", "cluster", "plan", "planner", "global_batch")
SEARCH_KEYS = (
    "model",
    "cluster",
    "planner",
    "global_batch",
    "global_batch_tokens",
    "headroom",
    "top",
    "precisions",
    "risk",
)


class ApiError(Exception):
    """A request the explorer cannot answer; `problems` are sentences for the page."""

    def __init__(self, problems: list[str] | str, status: int = 400):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.status = status
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class Layout:
    model: ModelSpec
    cluster: ClusterSpec
    plan: ParallelPlan
    planner: PlannerSettings

    @property
    def recipe(self) -> Recipe:
        return Recipe(self.model, self.cluster, self.plan, {"planner": self.planner.section()})


# ---- request checking --------------------------------------------------------------------------
def _require_object(body: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError('the request body must be a JSON object such as {"model": {...}}.')
    unknown = sorted(set(body) - set(keys))
    if unknown:
        raise ApiError(
            f"unknown request field(s) {', '.join(map(repr, unknown))}; "
            f"known fields: {', '.join(keys)}."
        )
    return body


def _section(body: dict[str, Any], name: str, problems: list[str]) -> dict[str, Any]:
    """A `model` / `cluster` / `plan` table of plain scalars (model.hf_config: a JSON object)."""
    value = body.get(name, {})
    if not isinstance(value, dict):
        problems.append(f"{name} = {value!r}: expected an object of {name} settings.")
        return {}
    out = {}
    for key, item in value.items():
        plain = isinstance(item, bool | int | str) or (name, key) == ("model", "hf_config")
        if plain or (isinstance(item, float) and math.isfinite(item)):
            out[key] = item
        else:
            problems.append(f"{name}.{key} = {item!r}: expected a number, true/false or a text.")
    if "preset" in out and not isinstance(out["preset"], str):
        problems.append(f"{name}.preset = {out.pop('preset')!r}: expected a preset name (text).")
    return out


def _planner(body: dict[str, Any], cluster: ClusterSpec) -> PlannerSettings:
    """The request's `planner` table resolved (profile, then its options), or an ApiError."""
    values = body.get("planner", {})
    if not isinstance(values, dict):
        raise ApiError(f"planner = {values!r}: expected an object such as {{'profile': ...}}.")
    try:
        return planner_settings(cluster.device, values)
    except ConfigError as err:
        raise ApiError(err.problems) from None


def _whole(value: Any, field: str, low: int, high: int, problems: list[str]) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{field} = {value!r}: expected a whole number.")
        return None
    if not low <= value <= high:
        problems.append(f"{field} = {value}: must be between {low} and {high:,}.")
        return None
    return value


def _derive_grad_accum(plan_values: dict[str, Any], global_batch: Any, problems: list[str]) -> None:
    """Set plan.grad_accum = global_batch / (micro_batch * dp), or say why it cannot be."""
    batch = _whole(global_batch, "global_batch", 1, LIMITS["global_batch"], problems)
    if batch is None:
        return
    if "grad_accum" in plan_values:
        problems.append(
            "give either global_batch (sequences per step) or plan.grad_accum, not both: "
            "the number of micro-batches follows from the global batch."
        )
        return
    degrees = [plan_values.get(k, 1) for k in ("micro_batch", "dp_replicate", "dp_shard")]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in degrees):
        return  # the plan's own checks name the bad degree
    accum = grad_accum_for(batch, degrees[0], degrees[1] * degrees[2])
    if accum is None:
        problems.append(
            grad_accum_problem(batch, degrees[0], degrees[1] * degrees[2], "global_batch")
        )
        return
    plan_values["grad_accum"] = accum


def _limit_problems(layout: Layout) -> list[str]:
    m, c, p = layout.model, layout.cluster, layout.plan
    checks = [
        ("cluster size (nodes x gpus_per_node)", c.world_size, LIMITS["world_size"]),
        ("plan.grad_accum (micro-batches per step)", p.grad_accum, LIMITS["grad_accum"]),
        ("plan.micro_batch", p.micro_batch, LIMITS["micro_batch"]),
        ("plan.pp * plan.vpp (virtual stages)", p.virtual_stages, LIMITS["virtual_stages"]),
        ("model.seq_len", m.seq_len, LIMITS["seq_len"]),
        ("model.layers", m.layers, LIMITS["layers"]),
    ]
    return [
        f"{name} = {value:,} is more than the explorer draws (at most {high:,}); "
        "use `fivefold plan estimate` for larger layouts."
        for name, value, high in checks
        if value > high
    ]


def parse_layout(body: Any) -> Layout:
    """Check a request and build its model, cluster and plan, or raise one `ApiError`."""
    body = _require_object(body, LAYOUT_KEYS)
    problems: list[str] = []
    model = _section(body, "model", problems)
    cluster = _section(body, "cluster", problems)
    plan = _section(body, "plan", problems)
    if not cluster:
        problems.append(
            'cluster is missing: give a preset ({"preset": "dgx-h100", "gpus": 16}) or '
            "gpu, nodes and gpus_per_node."
        )
    if "global_batch" in body:
        _derive_grad_accum(plan, body["global_batch"], problems)
    if problems:
        raise ApiError(problems)
    try:
        recipe = recipe_from_dict({"model": model, "cluster": cluster, "plan": plan})
    except ConfigError as err:
        raise ApiError(err.problems) from None
    layout = Layout(recipe.model, recipe.cluster, recipe.plan, _planner(body, recipe.cluster))
    too_big = _limit_problems(layout)
    if too_big:
        raise ApiError(too_big)
    return layout


# ---- answers -------------------------------------------------------------------------------------
def json_safe(value: Any) -> Any:
    """`value` with non-finite floats replaced by None (JSON has no inf or NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _budget_inputs(body: dict[str, Any]) -> Any:
    """The request's token-budget inputs (its `planner` table), or None without `tokens`."""
    table = body.get("planner", {})
    try:
        return budget_inputs(table if isinstance(table, dict) else {}, {})
    except ConfigError as err:
        raise ApiError(err.problems) from None


def _budget_json(est: Any, inputs: Any) -> dict[str, Any] | None:
    """The token-budget answer of one estimate (None without a token count)."""
    if inputs is None:
        return None
    return budget(est.model, est.cluster, est.plan, est.step_time_s, inputs).to_json()


def _estimate(layout: Layout) -> Any:
    try:
        return estimate(layout.model, layout.cluster, layout.plan, layout.planner.options)
    except ConfigError as err:
        raise ApiError(err.problems) from None


def layout_summary(layout: Layout) -> dict[str, Any]:
    """Facts about the layout that the page prints beside the planner's figures."""
    m, p = layout.model, layout.plan
    return {
        "describe": p.describe(),
        "world_size": p.world_size,
        "dp": p.dp,
        "grad_accum": p.grad_accum,
        "global_batch": p.global_batch,
        "tokens_per_step": p.global_batch * m.seq_len,
        "params": param_count(m),
        "active_params": param_count(m, active_only=True),
    }


def estimate_view(body: Any) -> dict[str, Any]:
    """POST /api/estimate: the planner's estimate of one layout, plus its rank grid."""
    layout = parse_layout(body)
    inputs = _budget_inputs(body)
    est = _estimate(layout)
    return json_safe(
        {
            "ok": True,
            "estimate": est.to_json(),
            "budget": _budget_json(est, inputs),
            "layout": layout_summary(layout),
            "ranks": rank_grid(layout.plan, layout.cluster),
            "model": layout.model.to_dict(),
            "cluster": layout.cluster.to_dict(),
            "plan": layout.plan.to_dict(),
            "planner": layout.planner.to_json(),
        }
    )


def recipe_filename(layout: Layout) -> str:
    p = layout.plan
    parts = [layout.model.name, f"{layout.cluster.world_size}gpu", f"tp{p.tp}", f"pp{p.pp}"]
    parts += (
        [f"dp{p.dp}"] + ([f"cp{p.cp}"] if p.cp > 1 else []) + ([f"ep{p.ep}"] if p.ep > 1 else [])
    )
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in "-".join(parts))
    return safe + ".toml"


def recipe_view(body: Any) -> dict[str, Any]:
    """POST /api/recipe: the current layout as a TOML recipe for `fivefold train`."""
    layout = parse_layout(body)
    header = (
        f"fivefold recipe exported by `fivefold explore`: {layout.plan.describe()}\n"
        f"Train it with: fivefold train {recipe_filename(layout)}"
    )
    return {
        "ok": True,
        "toml": dump_recipe(layout.recipe, header),
        "filename": recipe_filename(layout),
    }


def _search_settings(body: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The request's headroom, top, risk and precisions that it gives (`PlanRequest` fields)."""
    kwargs: dict[str, Any] = {}
    if "headroom" in body:  # absent: the planner table's, else the default
        headroom = body["headroom"]
        if isinstance(headroom, bool) or not isinstance(headroom, int | float):
            problems.append(f"headroom = {headroom!r}: expected a fraction such as 0.1.")
        elif not 0.0 <= headroom < 0.9:
            problems.append(f"headroom = {headroom}: must be a fraction in [0, 0.9), e.g. 0.1.")
        else:
            kwargs["headroom"] = float(headroom)
    if "top" in body:
        kwargs["top"] = _whole(body["top"], "top", 1, LIMITS["top"], problems)
    if "risk" in body:  # as `fivefold plan --risk`
        risk_found = risk_problems(
            body["risk"] if isinstance(body["risk"], str) else repr(body["risk"])
        )
        problems += risk_found
        if not risk_found:
            kwargs["risk"] = body["risk"]
    if "precisions" in body:
        precisions = body["precisions"]
        if (
            not isinstance(precisions, list)
            or not precisions
            or not all(isinstance(p, str) and p in RECIPES for p in precisions)
        ):
            problems.append(
                f"precisions = {precisions!r}: expected a list of recipe names from "
                f"{', '.join(RECIPES)}."
            )
        else:
            kwargs["precisions"] = tuple(precisions)
    return kwargs


def _parse_search(body: Any) -> tuple[PlanRequest, dict[str, Any]]:
    """The request's model, cluster, planner settings and search settings, or an ApiError."""
    body = _require_object(body, SEARCH_KEYS)
    problems: list[str] = []
    model = _section(body, "model", problems)
    cluster = _section(body, "cluster", problems)
    kwargs: dict[str, Any] = {}
    if "global_batch" in body:
        kwargs["global_batch"] = _whole(
            body["global_batch"], "global_batch", 1, LIMITS["global_batch"], problems
        )
    if "global_batch_tokens" in body:
        kwargs["global_batch_tokens"] = _whole(
            body["global_batch_tokens"], "global_batch_tokens", 1, 1 << 40, problems
        )
    if len(kwargs) != 1:
        problems.append(
            "give the target batch as exactly one of global_batch (sequences per step) or "
            "global_batch_tokens."
        )
    kwargs |= _search_settings(body, problems)
    if not cluster:
        problems.append("cluster is missing: give a preset or gpu, nodes and gpus_per_node.")
    if problems:
        raise ApiError(problems)
    problems = []
    built = []
    for build, values in ((model_from_dict, model), (cluster_from_dict, cluster)):
        try:
            built.append(build(values))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ApiError(problems)
    spec_model, spec_cluster = built
    if spec_cluster.world_size > SEARCH_LIMIT_WORLD:
        raise ApiError(
            f"cluster size {spec_cluster.world_size:,} GPUs is more than the explorer searches "
            f"(at most {SEARCH_LIMIT_WORLD:,}); use `fivefold plan`."
        )
    return PlanRequest(spec_model, spec_cluster, _planner(body, spec_cluster), **kwargs), body


def search_view(body: Any) -> dict[str, Any]:
    """POST /api/search: the best layouts for a model, cluster and batch target, explained."""
    request, body = _parse_search(body)
    resolved = resolve_request(request)
    inputs = _budget_inputs(body)
    started = time.perf_counter()
    try:
        result = search(resolved.model, resolved.cluster, **resolved.search_kwargs())
    except ConfigError as err:
        raise ApiError(err.problems) from None
    explanation = [request.settings.describe(), *explain(result)]
    elapsed_s = time.perf_counter() - started
    best = result.best
    return json_safe(
        {
            "ok": True,
            "best": None if best is None else best.to_json(),
            "alternatives": [alt.to_json() for alt in result.alternatives],
            "budgets": [_budget_json(e, inputs) for e in [best, *result.alternatives] if e],
            "describe": [est.plan.describe() for est in [best, *result.alternatives] if est],
            "rejected": [
                {"plan": plan.to_dict(), "describe": plan.describe(), "reason": reason}
                for plan, reason in result.rejected
            ],
            "explanation": explanation,
            "evaluated": result.evaluated,
            "search_time_s": elapsed_s,
            "tie_fraction": TIE_FRACTION,
            "risk": result.risk,
            "planner": request.settings.to_json(),
        }
    )


# ---- reference data for the controls -------------------------------------------------------------
def presets_view() -> dict[str, Any]:
    """GET /api/presets: every choice the controls offer, straight from the spec."""
    return json_safe(
        {
            "models": {
                name: {**m.to_dict(), "params": param_count(m), "notes": m.notes}
                for name, m in MODEL_PRESETS.items()
            },
            "clusters": {name: make(8).to_dict() for name, make in CLUSTER_PRESETS.items()},
            "gpus": {
                name: {
                    "hbm_gib": g.hbm_bytes / GiB,
                    "peak_tflops": {k: v / 1e12 for k, v in g.peak_flops.items()},
                    "source": g.source,
                }
                for name, g in GPUS.items()
            },
            "gpu_aliases": dict(GPU_ALIASES),
            "schedules": list(SCHEDULES),
            "mesh_order": [axis.value for axis in MESH_ORDER],
            "cp_kinds": list(CP_KINDS),
            "recompute": list(RECOMPUTE_POLICIES),
            "precisions": {name: r.description for name, r in RECIPES.items()},
            "limits": dict(LIMITS),
            "profiles": {
                name: {
                    "framework": p.framework,
                    "summary": p.summary,
                    "source": p.source,
                    "options": p.options,  # None: fivefold's own, set by the device
                }
                for name, p in profiles().items()
            },
            "default_profile": DEFAULT_PROFILE,
            "planner_options": _option_controls(),
            "planner_keys": list(SECTION_KEYS),
        }
    )


def _option_controls() -> dict[str, dict[str, Any]]:
    """Per planner option: its one-line help, its choices (or kind), its default under the
    fivefold profile on a GPU (`default`: fivefold's runtime) and the field's own default,
    which the framework profiles keep for the fields they do not list (`base`)."""
    defaults, base = PlannerOptions.for_device(gpu("h100")), PlannerOptions()
    out = {}
    for name, text in OPTION_HELP.items():
        default = getattr(defaults, name)
        kind = "choice" if name in CHOICES else "bool" if isinstance(default, bool) else "number"
        out[name] = {"help": text, "kind": kind, "default": default, "base": getattr(base, name)}
        if kind == "choice":
            out[name]["choices"] = list(CHOICES[name])
    return out
