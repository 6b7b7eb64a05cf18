"""The `[train]` and `[data]` sections of a recipe as typed, validated dataclasses.

`TrainConfig` holds the optimizer, schedule, logging and checkpoint settings; `DataConfig` says
where the tokens come from (the embedded corpus by default). Both are built with
`fivefold.specs.recipe.build`, so unknown fields and wrong types are reported like any other
recipe problem, and every cross-field check runs at load time: one `ConfigError` lists them all.

Batch sizes are in sequences. `train.global_batch` is optional: when given it must equal
`plan.micro_batch * dp * plan.grad_accum`, the batch the plan actually runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fivefold.checkpoint.elastic import resume_mode
from fivefold.errors import ConfigError
from fivefold.parallel.device import DEVICE_SETTINGS as DEVICES
from fivefold.specs.batch import grad_accum_for
from fivefold.specs.optimizer import OPTIMIZERS, optimizer_plan_problems
from fivefold.specs.recipe import Recipe, build, unknown_field
from fivefold.train.sources import SourceConfig, parse_sources
from fivefold.train.spikes import spike_problems
from fivefold.train.trackers import tracker_problems

LR_SCHEDULES = ("cosine", "linear", "constant")
PROFILE_KEYS = ("start_step", "steps")
MUON_LR_SCALES = ("match_rms_adamw", "original")
MUON_NS_DTYPES = ("bf16", "fp32")
MAX_NS_STEPS = 99  # torch.optim.Muon refuses 100 or more


@dataclass
class TrainConfig:
    """Settings of one training run (`[train]` in a recipe). Times in seconds."""

    name: str = "run"  # the run is written to <runs_dir>/<name>/ unless run_dir is set
    runs_dir: str = "runs"
    run_dir: str = ""  # explicit run directory; overrides runs_dir/name
    steps: int = 100  # optimizer steps (the LR schedule's length)
    stop_at: int = 0  # stop (and checkpoint) after this step, keeping the schedule; 0 = at steps
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # floor the schedule decays to
    warmup_steps: int = 10  # linear warmup from lr/warmup_steps to lr
    lr_schedule: str = "cosine"  # after warmup: cosine | linear | constant
    weight_decay: float = 0.1  # decoupled (AdamW); matrices only, not norms
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping (the norm is still logged)
    global_batch: int = 0  # sequences per step; 0 = the plan's micro_batch * dp * grad_accum
    seed: int = 0  # weights, data order and every torch random stream
    device: str = "auto"  # auto = cuda when available, else cpu
    log_every: int = 1  # console/TensorBoard every N steps (JSONL gets every step)
    eval_every: int = 0  # held-out loss every N steps; 0 = never
    eval_batches: int = 4  # held-out micro-batches per evaluation
    ckpt_every: int = 0  # checkpoint every N steps; 0 = only at the end (if save_final)
    save_final: bool = True  # checkpoint after the last step
    keep_checkpoints: int = 2  # newest checkpoints kept; 0 keeps all
    # "auto": continue from the newest valid checkpoint in <run_dir>/ckpt when there is one;
    # true: the same, and say so when there is none; false: start over, deleting old checkpoints
    resume: bool | str = "auto"
    ckpt_async: bool = False  # write checkpoints in a background thread while training goes on
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed
    progress: bool = True  # rich progress bar on the console
    max_time_s: float = 0.0  # stop (and checkpoint) after this much wall time; 0 = no limit
    memory_step: int = 2  # CPU: the step whose peak memory is measured by tracking allocations
    # Python's cyclic garbage collector runs every N steps on all ranks at once (not whenever its
    # thresholds trip, at a different moment on each rank); 0 = Python's automatic collection
    gc_every: int = 50
    # torch.compile (inductor) each transformer block; on CPU it needs a C++ compiler (g++)
    compile: bool = False
    # {start_step = N, steps = K}: a torch.profiler trace of steps N..N+K-1 into <run_dir>/profile
    profile: dict[str, int] = field(default_factory=dict)
    trackers: list[str] = field(default_factory=list)  # also log to: "wandb", "mlflow"
    # -- optimizer (`fivefold.train.muon`, docs/internals.md): "adamw", or "muon" = Muon for the
    # blocks' 2-D matrices and AdamW (lr, betas, eps) for embeddings, head, norms and biases
    optimizer: str = "adamw"
    muon_lr: float = 0.0  # Muon's peak lr (the same schedule); 0 = train.lr
    muon_momentum: float = 0.95  # Nesterov momentum of Muon's one buffer
    muon_ns_steps: int = 5  # Newton-Schulz iterations per matrix and step
    # lr scale per matrix [A, B]: "match_rms_adamw" 0.2 * sqrt(max(A, B)) (Moonshot; AdamW's lr
    # carries over) or "original" sqrt(max(1, A / B)) (Keller Jordan; lr about 0.02)
    muon_adjust_lr: str = "match_rms_adamw"
    muon_ns_dtype: str = "bf16"  # Newton-Schulz in bf16 (torch.optim.Muon's) or fp32 (exact)
    # ---- long runs (docs/long-runs.md): loss spikes and stragglers ----
    # A spike: the loss or gradient norm above the median of the last spike_window steps by more
    # than spike_threshold robust standard deviations (1.4826 x MAD). off | warn (log it) | skip
    # (no update for that step, same on every rank) | rollback (to the last checkpoint, its batch
    # never taken again; needs train.ckpt_every)
    on_spike: str = "warn"
    spike_window: int = 100  # steps in the running window
    spike_threshold: float = 7.0  # robust standard deviations above the window's median
    spike_min_steps: int = 20  # checks start once the window holds this many post-warm-up steps
    # A rank whose compute time per step exceeds the ranks' median by more than this fraction at
    # straggler_log_steps consecutive log steps is named once (log, events.jsonl, summary)
    straggler_threshold: float = 0.25
    straggler_log_steps: int = 3

    @property
    def beta1(self) -> float:
        return float(self.betas[0])

    @property
    def beta2(self) -> float:
        return float(self.betas[1])

    def path(self) -> Path:
        """The run directory: `run_dir` if set, else `runs_dir/name`."""
        return Path(self.run_dir) if self.run_dir else Path(self.runs_dir) / self.name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def problems(self) -> list[str]:
        """Every inconsistency, each naming the field and the fix."""
        out: list[str] = []
        if self.steps < 1:
            out.append(f"train.steps = {self.steps}: must be at least 1.")
        if not self.lr > 0 or not math.isfinite(self.lr):
            out.append(
                f"train.lr = {self.lr}: the learning rate must be a positive number, e.g. 3e-4."
            )
        lr_ok = self.lr > 0 and math.isfinite(self.lr)
        if self.min_lr < 0 or (lr_ok and self.min_lr > self.lr):
            out.append(f"train.min_lr = {self.min_lr}: must be between 0 and train.lr = {self.lr}.")
        if self.stop_at < 0:
            out.append(f"train.stop_at = {self.stop_at}: must be >= 0 (0 = run to train.steps).")
        if self.warmup_steps < 0:
            out.append(f"train.warmup_steps = {self.warmup_steps}: must be >= 0.")
        elif self.steps >= 1 and self.warmup_steps > self.steps:
            out.append(
                f"train.warmup_steps = {self.warmup_steps} exceeds train.steps = {self.steps}: "
                "the learning rate would never reach its peak; lower warmup_steps."
            )
        if self.lr_schedule not in LR_SCHEDULES:
            out.append(
                f"train.lr_schedule = {self.lr_schedule!r}: choose one of "
                f"{', '.join(LR_SCHEDULES)}."
            )
        if self.weight_decay < 0:
            out.append(f"train.weight_decay = {self.weight_decay}: must be >= 0.")
        out += self._beta_problems()
        if self.eps <= 0:
            out.append(f"train.eps = {self.eps}: must be positive, e.g. 1e-8.")
        if self.grad_clip < 0:
            out.append(f"train.grad_clip = {self.grad_clip}: must be >= 0 (0 disables clipping).")
        if self.global_batch < 0:
            out.append(
                f"train.global_batch = {self.global_batch}: must be >= 1 (or 0 for the plan's)."
            )
        if not 0 <= self.seed < 2**63:
            out.append(f"train.seed = {self.seed}: must be a whole number >= 0, e.g. 0.")
        if self.device not in DEVICES:
            out.append(f"train.device = {self.device!r}: choose one of {', '.join(DEVICES)}.")
        for name in ("log_every", "eval_batches", "memory_step"):
            if getattr(self, name) < 1:
                out.append(f"train.{name} = {getattr(self, name)}: must be at least 1.")
        for name in ("eval_every", "ckpt_every", "keep_checkpoints", "gc_every"):
            if getattr(self, name) < 0:
                out.append(f"train.{name} = {getattr(self, name)}: must be >= 0 (0 turns it off).")
        try:
            resume_mode(self.resume)
        except ConfigError as err:
            out += err.problems
        if self.max_time_s < 0:
            out.append(f"train.max_time_s = {self.max_time_s}: must be >= 0 (0 = no limit).")
        if not self.name or "/" in self.name or self.name in (".", ".."):
            out.append(
                f"train.name = {self.name!r}: must be a plain directory name such as 'small-cpu'."
            )
        out += self._profile_problems()
        out += self._optimizer_problems()
        out += tracker_problems(self.trackers)
        out += self._long_run_problems()
        where = "train.run_dir" if self.run_dir else "train.runs_dir"
        out += directory_problems(self.path(), where)
        return out

    def _profile_problems(self) -> list[str]:
        """`train.profile` ({} = off): only start_step and steps, whole numbers >= 1, reached."""
        if not self.profile:
            return []
        example = "e.g. train.profile = {start_step = 3, steps = 2}"
        out = [
            f"{unknown_field('train.profile', key, PROFILE_KEYS)} A profile reads {example[5:]}."
            for key in self.profile
            if key not in PROFILE_KEYS
        ]
        for key in PROFILE_KEYS:
            value = self.profile.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(
                    f"train.profile.{key} = {value!r}: must be a whole number >= 1, {example} "
                    "(the first steps include warm-up)."
                )
        start = self.profile.get("start_step")
        if not out and self.steps >= 1 and start > self.steps:
            out.append(
                f"train.profile.start_step = {start} is after the last step (train.steps = "
                f"{self.steps}), so nothing would be profiled; lower it."
            )
        return out

    def _optimizer_problems(self) -> list[str]:
        """`train.optimizer` and the Muon settings (checked whichever optimizer is chosen)."""
        out = []
        if self.optimizer not in OPTIMIZERS:
            out.append(
                f"train.optimizer = {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}."
            )
        if not 0 <= self.muon_lr < math.inf:
            out.append(f"train.muon_lr = {self.muon_lr}: must be a positive number (0 = train.lr).")
        if not 0 <= self.muon_momentum < 1:
            out.append(f"train.muon_momentum = {self.muon_momentum}: must be in [0, 1), e.g. 0.95.")
        if not 1 <= self.muon_ns_steps <= MAX_NS_STEPS:
            out.append(
                f"train.muon_ns_steps = {self.muon_ns_steps}: must be 1 to {MAX_NS_STEPS}, e.g. 5."
            )
        if self.muon_adjust_lr not in MUON_LR_SCALES:
            out.append(
                f"train.muon_adjust_lr = {self.muon_adjust_lr!r}: choose one of "
                f"{', '.join(MUON_LR_SCALES)}."
            )
        if self.muon_ns_dtype not in MUON_NS_DTYPES:
            out.append(
                f"train.muon_ns_dtype = {self.muon_ns_dtype!r}: choose one of "
                f"{', '.join(MUON_NS_DTYPES)}."
            )
        return out

    def _long_run_problems(self) -> list[str]:
        """`train.on_spike`, `train.spike_*` and `train.straggler_*` (docs/long-runs.md)."""
        out = spike_problems(
            self.on_spike, self.spike_window, self.spike_threshold, self.spike_min_steps
        )
        if self.on_spike == "rollback" and not self.ckpt_every:
            out.append(
                "train.on_spike = 'rollback' returns to the last checkpoint, but train.ckpt_every "
                "= 0 saves none during the run: set train.ckpt_every (e.g. 100) or choose "
                "train.on_spike = 'skip'."
            )
        threshold = self.straggler_threshold
        if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold > 0):
            out.append(
                f"train.straggler_threshold = {threshold}: must be a positive fraction of the "
                "median compute time, e.g. 0.25 (25 % slower)."
            )
        if self.straggler_log_steps < 1:
            out.append(
                f"train.straggler_log_steps = {self.straggler_log_steps}: must be at least 1 "
                "(consecutive log steps a rank must lag before it is named), e.g. 3."
            )
        return out

    def _beta_problems(self) -> list[str]:
        ok = len(self.betas) == 2 and all(
            isinstance(b, int | float) and not isinstance(b, bool) for b in self.betas
        )
        if not ok or not all(0 <= b < 1 for b in self.betas):
            return [f"train.betas = {self.betas!r}: write two numbers in [0, 1), e.g. [0.9, 0.95]."]
        return []


@dataclass
class DataConfig:
    """Where the tokens come from (`[data]` in a recipe)."""

    shards: str = ""  # a directory written by prepare_shards; "" = the embedded corpus
    inputs: list[str] = field(default_factory=list)  # .txt/.jsonl files to tokenize into shards
    tokenizer: str = ""  # a tokenizer.json; "" = the default tokenizer of the embedded corpus
    cache_dir: str = ""  # where shards of data.inputs are cached; "" = the fivefold cache
    val_fraction: float = 0.02  # the corpus tail held out for evaluation; 0 = none
    text_field: str = "text"  # the JSONL field / Parquet or Arrow column of inputs' documents
    # a weighted mixture instead of shards/inputs: tables {name, shards|inputs, weight, max_epochs}
    sources: list[Any] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mixture(self) -> list[SourceConfig]:
        """`sources` parsed (`fivefold.train.sources`); empty for the one-source form."""
        return parse_sources(self.sources, [])

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.sources and (self.shards or self.inputs):
            out.append(
                "data.sources and data.shards/data.inputs are both set: list every source in "
                "data.sources, or give one source as data.shards or data.inputs."
            )
        sources = parse_sources(self.sources, out)
        if self.shards and self.inputs:
            out.append(
                "data.shards and data.inputs are both set: give prepared shards or raw inputs, "
                "not both."
            )
        if not 0 <= self.val_fraction < 1:
            out.append(f"data.val_fraction = {self.val_fraction}: must be in [0, 1), e.g. 0.02.")
        inputs = [*self.inputs, *(name for s in sources for name in s.inputs)]
        if self.cache_dir and inputs:
            out += directory_problems(Path(self.cache_dir), "data.cache_dir")
        for name in inputs:
            path = Path(name)
            if path.is_file():
                try:
                    path.open("rb").close()
                except OSError as err:
                    out.append(f"data.inputs: {name!r} cannot be read ({err.strerror}).")
        return out


def directory_problems(path: Path, field: str) -> list[str]:
    """Why `path` cannot be a directory this run writes into (created if missing): an existing
    file on the way, or an existing directory we may not write to. Checked before anything
    starts, so a run never dies on its first save."""
    if path.is_dir():
        existing = path
    else:
        existing = next((p for p in path.parents if p.exists()), Path("/"))
        if not existing.is_dir() or path.exists():
            blocker = path if path.exists() else existing
            return [
                f"{field}: {str(blocker)!r} is a file, not a directory, so {str(path)!r} cannot "
                "be created; choose another directory."
            ]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{field}: {str(existing)!r} is not writable; choose a directory you can write."]
    return []


@dataclass
class RunConfig:
    """A recipe with its train and data sections parsed: everything a run needs."""

    recipe: Recipe
    train: TrainConfig
    data: DataConfig

    @property
    def global_batch(self) -> int:
        return self.recipe.plan.global_batch


def parse_train_config(recipe: Recipe) -> RunConfig:
    """Build and cross-check `[train]` and `[data]`; one ConfigError lists every problem."""
    problems: list[str] = []
    train, data = _build_sections(recipe.sections, problems)
    if train is not None:
        if train.global_batch and train.global_batch != recipe.plan.global_batch:
            plan = recipe.plan
            accum = grad_accum_for(train.global_batch, plan.micro_batch, plan.dp)
            fix = (
                f"set plan.grad_accum = {accum}"
                if accum is not None
                else f"make it a multiple of micro_batch * dp = {plan.micro_batch * plan.dp}"
            )
            problems.append(
                f"train.global_batch = {train.global_batch} does not match the plan's "
                f"micro_batch {plan.micro_batch} x dp {plan.dp} x grad_accum {plan.grad_accum} "
                f"= {plan.global_batch} sequences; {fix}, or drop train.global_batch."
            )
        problems += optimizer_plan_problems(train.optimizer, recipe.plan)
        if train.eval_every and data is not None and data.val_fraction == 0:
            problems.append(
                f"train.eval_every = {train.eval_every} needs held-out data: set "
                "data.val_fraction (e.g. 0.02) or train.eval_every = 0."
            )
    if problems:
        raise ConfigError(problems)
    assert train is not None and data is not None
    return RunConfig(recipe, train, data)


def parse_train_section(sections: dict[str, Any]) -> TrainConfig:
    """The `[train]` table alone, typed and checked (one ConfigError naming each field): what a
    caller reads before the plan exists (`--plan auto`'s batch, optimizer and compile)."""
    problems: list[str] = []
    table = sections.get("train") or {}
    if not isinstance(table, dict):
        raise ConfigError(f"train = {table!r}: expected a [train] table of settings.")
    train = build(TrainConfig, table, "train", problems)
    problems += train.problems() if train is not None else []
    if problems or train is None:
        raise ConfigError(problems)
    return train


def train_device(sections: dict[str, Any]) -> str:
    """`train.device` as the `[train]` table types it, before the recipe is built (the device
    decides the precision default and the cluster of a run without one): "auto" when unset or
    mistyped, which `load_run` then reports beside the recipe's other problems."""
    table = sections.get("train") or {}
    train = build(TrainConfig, table if isinstance(table, dict) else {}, "train", [])
    return train.device if train is not None else TrainConfig.device


def recipe_compile(sections: dict[str, Any]) -> bool:
    """A recipe's `train.compile` (fivefold's runtime then compiles its blocks), checked: what
    `fivefold plan` reads of [train] (a run reads its parsed `TrainConfig.compile`)."""
    train = sections.get("train", {})
    value = train.get("compile", False) if isinstance(train, dict) else False
    if not isinstance(value, bool):
        raise ConfigError(f"train.compile = {value!r}: expected true or false.")
    return value


def section_problems(sections: dict[str, Any]) -> list[str]:
    """The problems of the `[train]` and `[data]` tables on their own (unknown fields with the
    closest name, types, ranges): reported beside a recipe's other problems when the recipe
    itself does not load, so one error lists them all."""
    problems: list[str] = []
    _build_sections(sections, problems)
    return problems


def _build_sections(
    sections: dict[str, Any], problems: list[str]
) -> tuple[TrainConfig | None, DataConfig | None]:
    tables = {name: sections.get(name) or {} for name in ("train", "data")}
    if not all(isinstance(table, dict) for table in tables.values()):
        return None, None  # reported by the recipe's own check
    train = build(TrainConfig, tables["train"], "train", problems)
    data = build(DataConfig, tables["data"], "data", problems)
    problems += train.problems() if train is not None else []
    problems += data.problems() if data is not None else []
    return train, data
