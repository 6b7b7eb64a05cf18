"""What a run says around its steps: the console header (model, layout, batch, the planner's
prediction) and footer, and the `TrainSummary` that `fivefold.train.start.train` returns."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from fivefold.errors import ConfigError, FivefoldError
from fivefold.launch.machine_load import load_note, read_load
from fivefold.parallel.compile import compile_seconds
from fivefold.parallel.device import unknown_gpu_reason
from fivefold.parallel.float8 import fp8_eager_note
from fivefold.parallel.protocol import Runtime
from fivefold.planner.budget.token_budget import checkpoint_suggestion
from fivefold.planner.estimate import estimate
from fivefold.planner.options import PlannerOptions
from fivefold.specs.flops import ATTENTION_CONVENTION
from fivefold.specs.mixture import count_text, draw_lines
from fivefold.specs.model import param_count
from fivefold.specs.profile import default_profile_path, load_profile
from fivefold.train.config import RunConfig
from fivefold.train.inputs import TrainData
from fivefold.train.metrics import format_mfu, format_tokens_per_s
from fivefold.train.peak import DevicePeak
from fivefold.units import GiB


@dataclass
class TrainSummary:
    """What a run did. Losses in nats/token; rates over the steps after the first."""

    run_dir: str
    start_step: int
    end_step: int
    losses: list[float]  # one per step of this invocation
    tokens_per_s: float
    mfu: float | None
    peak_label: str
    peak_memory_bytes: int
    wall_s: float
    stop_reason: str  # "completed" | "max_time_s" | "interrupted" | "already_complete"
    last_checkpoint: str | None
    eval_losses: dict[int, float] = field(default_factory=dict)
    tokens_by_source: dict[str, int] = field(default_factory=dict)  # a mixture's, by end_step
    prediction: dict[str, Any] | None = None
    exit_code: int = 0  # of the process: 128 + signal number after an interrupt, else 0
    events: list[dict] = field(default_factory=list)  # spikes, stragglers (events.jsonl)

    @property
    def first_loss(self) -> float:
        return self.losses[0]

    @property
    def last_loss(self) -> float:
        return self.losses[-1]

    def tail_loss(self, steps: int = 10) -> float:
        """Mean loss of the last `steps` steps (less noisy than the last one)."""
        tail = self.losses[-steps:]
        return sum(tail) / len(tail)

    @classmethod
    def already_complete(
        cls, run_dir: Path, step: int, peak_label: str, checkpoint: Path | None
    ) -> TrainSummary:
        """What an invocation that found the run complete at `step` did: nothing."""
        return cls(
            run_dir=str(run_dir),
            start_step=step,
            end_step=step,
            losses=[],
            tokens_per_s=0.0,
            mfu=None,
            peak_label=peak_label,
            peak_memory_bytes=0,
            wall_s=0.0,
            stop_reason="already_complete",
            last_checkpoint=str(checkpoint) if checkpoint else None,
        )

    def write_json(self, path: Path) -> None:
        """The summary as JSON (the run directory's summary.json)."""
        payload = asdict(self)
        payload["eval_losses"] = {str(k): v for k, v in self.eval_losses.items()}
        path.write_text(json.dumps(payload, indent=2) + "\n")


def compile_note(first_step_s: float) -> str:
    """Once per run, after the first step (`first_step_s` seconds): how long torch.compile
    took (cold or cached)."""
    seconds, graphs = compile_seconds()
    return (
        f"torch.compile: {graphs} graph(s) compiled in {seconds:.1f} s during the first "
        f"step ({first_step_s:.1f} s in all; later steps reuse them)"
    )


def profile_origin(profile: str) -> str:
    """What a CPU run's header says of its device profile: which file, from where, measured
    when; or that it has none and what that means."""
    if not profile:
        return (
            "none (step time is not predicted; MFU is against a fixed reference): `fivefold "
            "calibrate --out PROFILE.toml` measures this machine, then [cluster] profile = "
            '"PROFILE.toml"'
        )
    try:
        created = load_profile(profile).created
    except ConfigError:
        created = ""
    when = f", measured {created}" if created else ""
    if Path(profile).resolve() == default_profile_path().resolve():
        return (
            f"{profile} (the default location, used by every CPU run without a [cluster]{when}; "
            "name another with [cluster] profile = PATH, or delete it)"
        )
    return f"{profile} (named by the recipe{when})"


def planner_prediction(run: RunConfig) -> tuple[dict[str, Any] | None, str]:
    """The planner's estimate for this recipe, or (None, why not). Never raises."""
    recipe = run.recipe
    if unknown_gpu_reason(recipe.cluster):
        return None, unknown_gpu_reason(recipe.cluster).removeprefix("no step-time prediction: ")
    if recipe.cluster.gpu == "cpu" and not recipe.cluster.profile:
        return None, (
            "no device profile for this CPU; `fivefold calibrate --out PROFILE.toml` writes one, "
            'and runs naming it ([cluster] profile = "PROFILE.toml") predict their step time'
        )
    try:
        options = replace(
            PlannerOptions.for_device(recipe.cluster.device, compile=run.train.compile),
            optimizer=run.train.optimizer,
        )
        return estimate(recipe.model, recipe.cluster, recipe.plan, options=options).to_json(), ""
    except FivefoldError as err:
        return None, str(err).splitlines()[0]
    except Exception as err:  # the planner must never stop a training run
        return None, f"{type(err).__name__}: {err}"


def tensorboard_installed() -> bool:
    """Whether `torch.utils.tensorboard` can write events (the optional `tensorboard` package)."""
    return importlib.util.find_spec("tensorboard") is not None


def print_header(
    out: Console,
    run: RunConfig,
    runtime: Runtime,
    data: TrainData,
    peak: DevicePeak,
    prediction: dict[str, Any] | None,
    why_not: str,
) -> None:
    """The run's opening lines: model, layout, batch, data, MFU reference, device profile,
    the planner's prediction (with a word on a busy machine: the load average at the start)
    and a checkpoint suggestion."""
    load = read_load()  # before this run's own steps add to it
    recipe, cfg = run.recipe, run.train
    model, plan = recipe.model, recipe.plan
    total, active = param_count(model), param_count(model, active_only=True)
    params = f"{total / 1e6:.2f}M params" + (
        f" ({active / 1e6:.2f}M active)" if model.is_moe else ""
    )
    out.print(
        f"[bold]fivefold train[/bold] {cfg.path()}: model {model.name} ({params}, "
        f"{model.layers} layers, hidden {model.hidden}, seq {model.seq_len}, vocab {model.vocab})"
    )
    threads = f", {torch.get_num_threads()} threads" if runtime.device.type == "cpu" else ""
    precision = getattr(runtime, "precision", None)
    out.print(
        f"layout: {plan.describe()} on {runtime.world_size} process(es), device "
        f"{runtime.device}{threads}; precision "
        f"{precision.describe() if precision else plan.precision}"
    )
    out.print(
        f"batch: {run.global_batch} sequences x {model.seq_len} tokens = "
        f"{run.global_batch * model.seq_len:,} tokens/step; {cfg.steps} steps, lr "
        f"{cfg.lr:g} (warmup {cfg.warmup_steps}, {cfg.lr_schedule} to "
        f"{cfg.min_lr:g}); data: {data.describe()}"
    )
    for note in (
        data.eval_note(cfg.eval_every, run.data.val_fraction),
        fp8_eager_note(plan, cfg.compile),
    ):
        if note:
            out.print(note, style="yellow", markup=False, highlight=False)
    if cfg.tensorboard and not tensorboard_installed():
        out.print(
            "TensorBoard: no events written (tensorboard is not installed: pip install "
            "'fivefold[tensorboard]'; train.tensorboard=false silences this)",
            style="dim",
            markup=False,
        )
    out.print(f"MFU against: {peak.label}; attention {ATTENTION_CONVENTION}")
    if recipe.cluster.profile or runtime.device.type == "cpu":
        out.print(f"device profile: {profile_origin(recipe.cluster.profile)}", markup=False)
    if repeat := data.repeat_note():
        out.print(f"[yellow]{repeat}[/yellow]", highlight=False)
    if data.is_mixture:
        out.print(f"data for {cfg.steps} steps, per source:", markup=False)
        for line in draw_lines(data.plan_draws(cfg.steps)):
            out.print(line, markup=False, style="yellow" if "warning" in line else None)
    if prediction is not None:
        mem = prediction.get("memory_gib", {}).get("total")
        out.print(
            f"planner predicts: step {prediction.get('step_time_s', float('nan')):.3f} s, "
            f"{format_tokens_per_s(prediction.get('tokens_per_s', 0.0))} tok/s, MFU "
            f"{format_mfu(prediction.get('mfu'))}, memory {mem:.2f} GiB"
            if mem is not None
            else f"planner predicts: {prediction}"
        )
        if prediction.get("step_time_s") and (busy := load_note(load, "the measured step times")):
            out.print(busy, style="yellow", markup=False, highlight=False)
    else:
        out.print(f"planner: no prediction ({why_not})", style="dim", markup=False)
    if prediction is not None and not cfg.ckpt_every:
        step_s = prediction.get("step_time_s")
        out.print(checkpoint_suggestion_line(recipe, step_s, cfg.steps), markup=False)


def checkpoint_suggestion_line(
    recipe: Any, step_time_s: float | None, run_steps: int | None = None
) -> str:
    """`planner.budget.token_budget.checkpoint_suggestion` for the run of `run_steps` steps, or why
    there is none."""
    if not step_time_s or step_time_s <= 0:
        return "checkpoint suggestion: none (no step-time prediction)"
    try:
        return checkpoint_suggestion(
            recipe.model,
            recipe.cluster,
            recipe.plan,
            step_time_s,
            recipe.section("planner"),
            run_steps,
        )
    except FivefoldError as err:  # a bad [planner] field must not stop the run here
        return f"checkpoint suggestion: none ({str(err).splitlines()[0]})"


def print_footer(out: Console, s: TrainSummary, tokens_per_step: int, reserved: int) -> None:
    """The run's closing lines: steps and losses, throughput and memory (`reserved`: CUDA's
    reserved peak plus context, bytes; 0 elsewhere), planner vs measured, where it saved."""
    stopped = "" if s.stop_reason == "completed" else f" (stopped: {s.stop_reason})"
    if not s.losses:
        out.print(f"[bold]stopped[/bold] before a step{stopped}; nothing saved")
        return
    out.print(
        f"[bold]done[/bold]: steps {s.start_step} -> {s.end_step} in {s.wall_s:.1f} s{stopped}; "
        f"loss {s.first_loss:.3f} -> {s.last_loss:.3f} (mean of last 10: {s.tail_loss():.3f})"
    )
    mem = f"{s.peak_memory_bytes / GiB:.3f} GiB" if s.peak_memory_bytes else "not measured"
    if reserved:  # CUDA: the allocated peak above; the allocator's reservation and context
        mem += f" allocated, {reserved / GiB:.3f} GiB reserved + CUDA context"
    out.print(
        f"throughput {format_tokens_per_s(s.tokens_per_s)} tokens/s, MFU {format_mfu(s.mfu)} "
        f"(vs {s.peak_label}); peak memory {mem}"
    )
    if s.prediction is not None and s.end_step > s.start_step:
        measured_step_s = tokens_per_step / s.tokens_per_s if s.tokens_per_s else float("nan")
        out.print(
            f"planner vs measured: step {s.prediction.get('step_time_s', float('nan')):.3f} s vs "
            f"{measured_step_s:.3f} s"
        )
    if s.tokens_by_source:
        drawn = ", ".join(f"{n} {count_text(t)}" for n, t in s.tokens_by_source.items())
        out.print(f"tokens drawn per source by step {s.end_step}: {drawn}", markup=False)
    if s.events:
        out.print(events_line(s.events, Path(s.run_dir) / "events.jsonl"), markup=False)
    if s.last_checkpoint:
        out.print(f"checkpoint: {s.last_checkpoint}")
    if s.stop_reason == "interrupted":
        out.print(
            f"interrupted after step {s.end_step}: the same command continues from the "
            "checkpoint above (--fresh starts over)"
        )
    out.print(f"metrics: {Path(s.run_dir) / 'metrics.jsonl'}")


def events_line(events: list[dict], path: Path) -> str:
    """'events: 2 loss spike(s) (steps 10 skipped, 31 rolled back); straggler rank 3 (host n1,
    local device 3, lag 120.0 ms per step) -- PATH' from a run's events."""
    spikes = [e for e in events if e["event"] == "spike"]
    late = [e for e in events if e["event"] == "straggler"]
    parts = []
    if spikes:
        steps = ", ".join(f"{e['step']} ({e['policy']})" for e in spikes)
        parts.append(f"{len(spikes)} loss spike(s) at step {steps}")
    parts += [
        f"straggler rank {e['rank']} (host {e['host']}, local device {e['local_device']}, lag "
        f"{e['lag_s'] * 1e3:.1f} ms per step)"
        for e in late
    ]
    return f"events: {'; '.join(parts)} -- {path}"
