"""Per-step metrics and where they go: a rich console (progress bar), JSONL, TensorBoard.

Details: docs/internals.md (`fivefold.train.metrics`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from fivefold.specs.flops import ATTENTION_CONVENTION

LOG_INTERVAL_S = 30.0  # the console never stays silent longer than this while steps complete


@dataclass
class StepMetrics:
    """One optimizer step. Loss in nats per token; times in seconds; memory in bytes."""

    step: int  # 1-based: the number of optimizer steps completed
    loss: float
    grad_norm: float  # global L2 norm before clipping
    lr: float  # the rate this step used
    tokens: int  # tokens in the global batch
    step_time_s: float
    tokens_per_s: float
    mfu: float | None  # fraction of the peak; None when the peak is unknown
    hfu: float | None
    peak_memory_bytes: int  # CUDA: allocated (live tensors) in the measured step
    elapsed_s: float
    peak_reserved_bytes: int | None = None  # CUDA: the allocator's reserved peak + context
    aux_loss: float = 0.0
    eval_loss: float | None = None
    # a mixture (data.sources): training tokens drawn from each source by this step, by name;
    # at eval steps, each source's held-out loss
    tokens_by_source: dict[str, int] | None = None
    eval_loss_by_source: dict[str, float] | None = None
    plan_vs_run: dict | None = None  # the step of the layout report: `parallel.report.record`
    attention: str = ATTENTION_CONVENTION  # how MFU and HFU count attention FLOPs

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def utilization(
    tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float | None, devices: int
) -> float | None:
    """Achieved FLOP/s over the devices' combined peak, or None when the peak is unknown."""
    if not peak_flops_per_s or peak_flops_per_s <= 0 or devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak_flops_per_s * devices)


def document_pairs(doc_ids: Any, offsets: Any = None) -> tuple[float, int]:
    """(causal pairs L^2/2 summed over the documents of every row, tokens) of `doc_ids` [B, T]
    (a tensor or array; documents are runs of equal ids, never spanning rows), or of their
    host-side cumulative offsets [N+1] when given (`Batch.cu_seqlens`: nothing read back)."""
    # here: train.data (tokenizers) stays out of `fivefold --help`, which imports this module
    from fivefold.train.data.batching import document_offsets

    if offsets is None:
        offsets = document_offsets(
            np.asarray(doc_ids.cpu() if hasattr(doc_ids, "cpu") else doc_ids)
        )
    lengths = np.diff(np.asarray(offsets)).astype(np.float64)
    return float(np.sum(lengths * lengths) / 2), int(offsets[-1])


def attention_keys(micro_batches: list, seq_len: int) -> float:
    """Keys each query meets on average over `micro_batches` (objects with `doc_ids` [B, T], or
    None for one document per row): causal pairs per document / tokens (seq_len/2 when every
    row is one document)."""
    pairs, tokens = 0.0, 0
    for batch in micro_batches:
        doc_ids = getattr(batch, "doc_ids", None)
        if doc_ids is None:
            rows = batch.tokens.shape[0]
            pairs, tokens = pairs + rows * seq_len * seq_len / 2, tokens + rows * seq_len
            continue
        p, t = document_pairs(doc_ids, getattr(batch, "cu_seqlens", None))
        pairs, tokens = pairs + p, tokens + t
    return pairs / tokens if tokens else seq_len / 2


@dataclass
class ThroughputMeter:
    """Tokens and seconds summed over the steps that count (warm-up and measured steps do not)."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    losses: list[float] = field(default_factory=list)

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def format_tokens_per_s(rate: float) -> str:
    return (
        f"{rate / 1e6:.2f}M"
        if rate >= 1e6
        else f"{rate / 1e3:.1f}k"
        if rate >= 1e3
        else f"{rate:.0f}"
    )


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the last step.

    Opening keeps only the records of steps <= `keep_through_step` (0: none), so a run resumed
    from a checkpoint at step k drops the lines a crashed attempt wrote after k.
    """

    def __init__(self, path: Path, keep_through_step: int = 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        kept = self._records_through(path, keep_through_step) if keep_through_step else []
        self._file = path.open("w", encoding="utf-8")
        self._file.writelines(line + "\n" for line in kept)
        self._file.flush()

    @staticmethod
    def _records_through(path: Path, step: int) -> list[str]:
        if not path.is_file():
            return []
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut short by a crash
        return kept

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def scalars(m: StepMetrics) -> dict[str, float]:
    """The numbers every tracker logs: `train/<field>` for each finite numeric field of the
    JSONL record but the step (which is the x axis); a mixture's per-source figures as
    `train/<field>/<source>`."""
    out = {
        f"train/{key}": value
        for key, value in m.to_json().items()
        if key != "step" and isinstance(value, int | float) and math.isfinite(value)
    }
    for key in ("tokens_by_source", "eval_loss_by_source"):
        out |= {f"train/{key}/{name}": v for name, v in (getattr(m, key) or {}).items()}
    return out


class TensorBoardWriter:
    """Scalars under `train/` when tensorboard is installed; otherwise `available` is False."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional (tensorboard extra)
        except ImportError:
            self._writer = None
            return
        self._writer = SummaryWriter(log_dir=str(log_dir))

    @property
    def available(self) -> bool:
        return self._writer is not None

    def write(self, m: StepMetrics) -> None:
        if self._writer is None:
            return
        for tag, value in scalars(m).items():
            self._writer.add_scalar(tag, value, m.step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class StepClockColumn(ProgressColumn):
    """Seconds since the last step ended: the bar moves once per step, and a step may take
    minutes; the display refreshes on its own thread, so this clock runs inside the step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._clock = clock

    def render(self, task: Task) -> Text:
        elapsed = self._clock() - task.fields["step_began"]
        return Text(f"step {task.completed + 1}: {elapsed:.0f} s", style="progress.elapsed")


class ConsoleReporter:
    """A rich progress bar with loss, lr, tokens/s and MFU (on a terminal), and log lines
    printed above it, terminal or not: after the first step of the invocation, every
    `log_every` steps, at each evaluation, and whenever `interval_s` passed since the last."""

    def __init__(
        self,
        console: Console,
        total_steps: int,
        start_step: int,
        log_every: int,
        progress: bool,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console = console
        self.log_every = log_every
        self.interval_s = interval_s
        self._clock = clock
        self._last_line_at: float | None = None  # None: no line yet in this invocation
        self._progress: Progress | None = None
        if progress and console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                StepClockColumn(clock),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, status="", step_began=clock()
            )
            self._progress.start()

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.console.print(*args, **kwargs)

    def update(self, m: StepMetrics) -> None:
        status = (
            f"loss {m.loss:.3f}  lr {m.lr:.2e}  {format_tokens_per_s(m.tokens_per_s)} tok/s  "
            f"MFU {format_mfu(m.mfu)}"
        )
        now = self._clock()
        if self._progress is not None:
            self._progress.update(self._task, completed=m.step, status=status, step_began=now)
        due = (
            self._last_line_at is None
            or m.step % self.log_every == 0
            or m.eval_loss is not None
            or now - self._last_line_at >= self.interval_s
        )
        if due:
            line = f"step {m.step:>6}  {status}  |g| {m.grad_norm:.3f}"
            if m.eval_loss is not None:
                line += f"  eval {m.eval_loss:.3f}"
            self.console.print(line, highlight=False)
            self._last_line_at = now

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
