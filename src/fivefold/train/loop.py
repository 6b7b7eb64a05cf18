"""The training loop: data -> runtime step -> NaN guard -> clip -> AdamW -> LR schedule -> metrics.

`Trainer` is the same for every layout: the Runtime (`make_runtime`) owns the model and the
parallelism; the trainer owns the optimizer, schedule, data order, checkpoints and metrics
(`fivefold.train.start.train` starts a run with it). Rank 0
prints and writes files; every rank checkpoints its own state. Beside it: `resume` (the step a
run starts from), `guard` (the NaN guard), `step_log` (each step's records) and `summary` (the
console header and footer, `TrainSummary`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from fivefold.parallel.report import layout_report_record
from fivefold.specs.flops import training_flops_per_token
from fivefold.specs.precision import recipe
from fivefold.specs.recipe import dump_recipe
from fivefold.train.checkpoint import RunCheckpoints, RunState, step_dir
from fivefold.train.collect import ScheduledCollection
from fivefold.train.config import RunConfig
from fivefold.train.evaluation import held_out_losses
from fivefold.train.guard import check_finite
from fivefold.train.inputs import TrainData, load_train_data
from fivefold.train.interrupt import StopRequest
from fivefold.train.lr_schedule import build_scheduler
from fivefold.train.memory_counter import PeakReading, measure_step
from fivefold.train.metrics import StepMetrics, ThroughputMeter, attention_keys, utilization
from fivefold.train.optim import build_optimizer
from fivefold.train.peak import DevicePeak, cuda_fp8_peak, device_peak
from fivefold.train.profiling import StepProfiler
from fivefold.train.resume import choose_start
from fivefold.train.runtime import Runtime
from fivefold.train.spike_policy import SpikePolicy
from fivefold.train.step_log import StepLog
from fivefold.train.stragglers import StragglerWatch
from fivefold.train.summary import (
    TrainSummary,
    compile_note,
)

__all__ = ["Trainer"]


@dataclass
class _Pending:
    """A step whose loss, aux loss and gradient norm (0-d device tensors) wait for the next
    read-back; `values` are the three floats once read."""

    step: int
    lr: float
    loss: torch.Tensor
    aux: torch.Tensor
    norm: torch.Tensor
    values: tuple[float, float, float] | None = None
    plan_vs_run: dict | None = None
    keys: float | None = None  # keys per query of its documents (`attention_keys`)
    samples: tuple[int, int] = (0, 0)  # its batch: [start, end) of the global sample order
    skipped: bool = False  # its update was skipped (a loss spike, train.on_spike = "skip")


class Trainer:
    """One run's steps on a Runtime: optimizer, LR schedule, data, checkpoints, step records."""

    def __init__(self, run: RunConfig, runtime: Runtime, console: Console | None = None):
        self.run = run
        self.cfg = run.train
        self.recipe = run.recipe
        self.runtime = runtime
        self.console = console or Console(
            soft_wrap=True, highlight=False, quiet=not runtime.is_main
        )
        self.run_dir = self.cfg.path()
        self.data: TrainData = load_train_data(run, runtime.dp_rank, runtime.dp_size)
        self.optimizer = build_optimizer(runtime.model_parts, self.cfg, self.recipe.plan)
        self.scheduler = build_scheduler(self.optimizer, self.cfg)
        self.step = 0
        self.last_checkpoint: Path | None = None
        self.checkpoints = RunCheckpoints(
            self.run_dir, self.cfg.keep_checkpoints, self.cfg.ckpt_async
        )
        # Measured once (CPU) and kept: the header, every step's MFU and the footer use it.
        self.peak: DevicePeak = device_peak(
            runtime.device, self._compute_dtype(), cluster=self.recipe.cluster
        )
        if self.recipe.plan.fp8 != "none":  # refused off CUDA (fivefold.parallel.float8)
            name = torch.cuda.get_device_name(runtime.device)
            self.peak = cuda_fp8_peak(name, self.recipe.model, self.recipe.plan)
        self.tokens_per_step = run.global_batch * self.recipe.model.seq_len
        self._count_flops(None)
        self.cpu_peak = PeakReading()
        self.stop = StopRequest()  # `train` installs it as the SIGINT/SIGTERM handler
        self.eval_by_source: dict[str, float] | None = None
        self.spikes = SpikePolicy(self.cfg, self.run_dir, runtime.is_main, self.data.sampler)
        self.stragglers = StragglerWatch(runtime, self.cfg)

    def _count_flops(self, keys: float | None) -> None:
        """Model and hardware (what checkpoint runs) FLOPs per token, attention per document
        with `keys` keys per query (a step's own documents, `attention_keys`; None: the
        model's `doc_len`)."""
        model, seq = self.recipe.model, self.recipe.model.seq_len
        self.model_flops_per_token = training_flops_per_token(model, seq, keys=keys)
        self.hardware_flops_per_token = training_flops_per_token(
            model, seq, self.recipe.plan.recompute, early_stop=True, keys=keys
        )

    def _compute_dtype(self) -> str:
        precision = getattr(self.runtime, "precision", None)
        if precision is not None:
            return precision.compute_dtype
        return recipe(self.recipe.plan.precision).compute_dtype

    # ---- set-up ---------------------------------------------------------------------------
    def run_state(self) -> RunState:
        """What a checkpoint of this run saves and restores (`fivefold.train.checkpoint`)."""
        return RunState(
            self.runtime.model_parts, self.optimizer, self.scheduler, self.data.sampler, self.recipe
        )

    def prepare_run_dir(self) -> None:
        """Resume or start over (`fivefold.train.resume.choose_start`); a run already at its
        last step is left alone (`is_complete`). Collective: every rank calls it."""
        start = choose_start(
            self.checkpoints,
            self.run_state(),
            self.cfg,
            self.last_step,
            self.runtime.is_main,
            self.console,
        )
        self.step, self.last_checkpoint = start.step, start.checkpoint
        self.spikes.detector.load_state_dict(start.extra.get("spikes"))
        if start.complete:
            return
        if self.runtime.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            header = "Recipe of this run, as resolved (presets expanded, overrides applied)."
            (self.run_dir / "recipe.toml").write_text(dump_recipe(self.recipe, header))

    @property
    def is_complete(self) -> bool:
        """True when a resumed checkpoint is already at (or past) this invocation's last step."""
        return self.step >= self.last_step

    # ---- checkpoints ----------------------------------------------------------------------
    def save(self, extra: dict[str, Any]) -> Path:
        """Checkpoint this step and the spike windows (collective; fivefold.train.checkpoint)."""
        extra = {**extra, "spikes": self.spikes.detector.state_dict()}
        self.last_checkpoint = self.checkpoints.save(self.run_state(), self.step, extra)
        return self.last_checkpoint

    # ---- one step -------------------------------------------------------------------------
    def train_one_step(self, micro_batches: list) -> tuple[float, float, float]:
        """Forward/backward, guard, clip, optimizer and schedule; returns (loss, aux, grad norm)
        read back from the device (one host sync)."""
        done = self._device_step(micro_batches, [])
        assert done.values is not None
        return done.values

    def _device_step(
        self, micro_batches: list, pending: list[_Pending] | None, samples=(0, 0)
    ) -> _Pending:
        """One step whose loss, aux loss and gradient norm stay on the device, unless
        `pending` is not None: then they are read back with the `pending` steps' (one host
        sync, `_read_back`) and guarded before the optimizer step, which a spike may skip."""
        lr = float(self.optimizer.param_groups[0]["lr"])  # torchao keeps a tensor
        res = self.runtime.train_step(micro_batches)
        norm = self.runtime.clip_grads(self.cfg.grad_clip)
        done = _Pending(self.step + 1, lr, res.loss_tensor, res.aux_tensor, norm, samples=samples)
        if pending is not None:
            self._read_back([*pending, done])
        if not (done.skipped or self.spikes.rollback_due):
            self.optimizer.step()
            self.runtime.balance_routers()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return done

    def _read_back(self, steps: list[_Pending]) -> None:
        """Read the steps' values from the device in one copy and guard them in order (the
        last one before its optimizer step when it has not taken it yet)."""
        stacked = torch.stack([v.double() for p in steps for v in (p.loss, p.aux, p.norm)])
        flat = stacked.tolist()
        for i, p in enumerate(steps):
            p.values = (flat[3 * i], flat[3 * i + 1], flat[3 * i + 2])
            ahead = i == len(steps) - 1 and p.step == self.step + 1
            check_finite(
                p.values[0],
                p.values[2],
                p.lr,
                self.cfg,
                self.step + 1,
                self.last_checkpoint,
                None if ahead else p.step,
            )
            p.skipped = self.spikes.observe(
                p.step, p.values, p.samples, ahead, self.last_checkpoint
            )

    def _reads_back(self, index: int, measured: int) -> bool:
        """Whether step `index` (0-based within this invocation) reads its values back from the
        device, the loop's only host syncs: log steps, the last step, checkpoints, evaluations,
        the first three (compile and layout reports), the measured step and the one before it
        (not metered), the distributed runtime's report step. The same on every rank (a stop
        request is agreed after the next read-back)."""
        step, cfg = self.step + 1, self.cfg
        return bool(
            index <= 2
            or step >= self.last_step
            or step % cfg.log_every == 0
            or (cfg.ckpt_every and step % cfg.ckpt_every == 0)
            or (cfg.eval_every and step % cfg.eval_every == 0)
            or index in (measured - 1, measured)
            or step == getattr(self.runtime, "_report_at", 0)
            or self.spikes.every_step
        )

    # ---- the loop -------------------------------------------------------------------------
    @property
    def last_step(self) -> int:
        """The step this invocation stops after: train.stop_at if set, else train.steps."""
        stop_at = self.cfg.stop_at
        return min(stop_at, self.cfg.steps) if stop_at else self.cfg.steps

    def fit(self) -> TrainSummary:
        """Train from `self.step` to `last_step`, or until a stop (interrupt, train.max_time_s);
        checkpoints as asked and at the end. Rank 0 writes the step records."""
        start_step = self.step
        log = StepLog(self.console, self.run, start_step, self.runtime.is_main)
        profiler = StepProfiler(
            self.cfg.profile,
            self.run_dir,
            self.runtime.model_parts,
            getattr(self.runtime, "rank", 0),
            self.console.print,
        )
        collector = ScheduledCollection(self.cfg.gc_every)  # gc between steps, all ranks alike
        collector.start()
        try:
            stop_reason = self._run_steps(log, profiler, collector, start_step)
            if (self.cfg.save_final or stop_reason == "interrupted") and log.losses:
                self._save_final(log.losses[-1])
            self.checkpoints.close()  # an asynchronous save is committed before the run ends
        finally:
            collector.stop()
            profiler.close()
            log.close()
        return self._summary(log, start_step, stop_reason)

    def _run_steps(
        self,
        log: StepLog,
        profiler: StepProfiler,
        collector: ScheduledCollection,
        start_step: int,
    ) -> str:
        """The steps; returns why they ended: "completed", "interrupted" or "max_time_s".
        Host syncs only at read-backs: between them the host queues the next steps while the
        device works, and step times are measured between read-backs."""
        batches = self.data.batches(self.recipe.plan.micro_batch)
        measured = min(self.cfg.memory_step - 1, self.last_step - start_step - 1)
        pending: list[_Pending] = []  # steps whose values are still on the device
        stop_reason = "completed"
        self.stragglers.restart(self.step)
        while self.step < self.last_step:
            if self.stop.agreed(self.runtime, not pending, self.step + 1):
                stop_reason = "interrupted"
                break
            index = self.step - start_step  # 0-based within this invocation
            reads_back = self._reads_back(index, measured)
            collector.step(self.step + 1)
            micro_batches, samples = self.spikes.next_batch(batches, self.data.sampler)
            keys = attention_keys(micro_batches, self.recipe.model.seq_len)
            with profiler.step(self.step + 1):
                if index == measured:
                    done = self._measured_step(micro_batches, pending, samples)
                else:
                    done = self._device_step(
                        micro_batches, pending if reads_back else None, samples
                    )
            self.spikes.log_events(log)
            if self.spikes.rollback_due is not None:  # collective: every rank saw the spike
                self.step = self.spikes.roll_back(
                    self.checkpoints, self.run_state(), self.last_checkpoint, log, start_step
                )
                self.stragglers.restart(self.step)
                pending = []
                continue
            pending.append(self._taken(done, keys))
            if not reads_back and index != measured:
                continue
            out_of_time = self._after_read_back(log, pending, index, measured)
            pending = []
            if out_of_time:
                return "max_time_s"
        if pending:  # a stop between read-backs
            self._read_back(pending)
            self.spikes.log_events(log)
            self._emit(log, pending, None, self.step - start_step - 1, measured)
        return stop_reason

    def _taken(self, done: _Pending, keys: float | None) -> _Pending:
        """`done` with its documents' keys per query and the runtime's layout-report record
        of the step, if it made one."""
        done.keys = keys
        done.plan_vs_run = getattr(self.runtime, "plan_vs_run", None)
        if done.plan_vs_run is not None:
            self.runtime.plan_vs_run = None
        return done

    def _after_read_back(
        self, log: StepLog, pending: list[_Pending], index: int, measured: int
    ) -> bool:
        """What follows a read-back: the compile report (first step), evaluation, the step
        records, a periodic checkpoint; returns whether train.max_time_s has passed."""
        if index == 0 and self.cfg.compile:
            self.console.print(compile_note(time.perf_counter() - log.since))
        eval_loss = self._maybe_eval()
        if eval_loss is not None:
            log.evals[self.step] = eval_loss
        self._emit(log, pending, eval_loss, index, measured)
        if self.step % self.cfg.log_every == 0:
            for late in self.stragglers.at_log_step(self.step):
                log.event(late.record(), late.line())
        if self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0:
            self.save({"loss": log.losses[-1]})
        return bool(self.cfg.max_time_s and time.perf_counter() - log.started > self.cfg.max_time_s)

    def _emit(
        self,
        log: StepLog,
        done: list[_Pending],
        eval_loss: float | None,
        index: int,
        measured: int,
    ) -> None:
        """The records of the steps just read back (`index`: the last one's, within this
        invocation); the throughput meter counts neither the first nor the measured step."""
        step_s = log.lap(len(done))
        counted = index > 0 and index != measured
        for p in done:
            if counted:
                log.meter.add(self.tokens_per_step, step_s)
            assert p.values is not None
            loss, aux, grad_norm = p.values
            last = p is done[-1]
            self._count_flops(p.keys)  # the step's own documents
            metrics = self._metrics(
                loss, aux, grad_norm, p.lr, step_s, log.started, eval_loss if last else None
            )
            metrics.step, metrics.plan_vs_run = p.step, p.plan_vs_run
            if self.data.is_mixture:  # tokens drawn per source so far, held-out loss per source
                skips = self.spikes.skips.ranges
                metrics.tokens_by_source = self.data.tokens_drawn(p.samples[1], skips)
                metrics.eval_loss_by_source = self.eval_by_source if last else None
            if last and metrics.plan_vs_run is None:
                metrics.plan_vs_run = self._plan_vs_run(index, log.meter, step_s)
            log.write(metrics)

    def _save_final(self, loss: float) -> None:
        """Checkpoint the last step unless the last checkpoint is already of it."""
        if self.last_checkpoint is None or (
            step_dir(self.run_dir, self.step) != self.last_checkpoint
        ):
            self.save({"loss": loss})

    def _summary(self, log: StepLog, start_step: int, stop_reason: str) -> TrainSummary:
        rate = log.tokens_per_s(self.tokens_per_step)
        return TrainSummary(
            run_dir=str(self.run_dir),
            start_step=start_step,
            end_step=self.step,
            losses=log.losses,
            tokens_per_s=rate,
            mfu=utilization(
                rate, self.model_flops_per_token, self.peak.flops_per_s, self.runtime.world_size
            ),
            peak_label=self.peak.label,
            peak_memory_bytes=self._peak_memory(),
            wall_s=time.perf_counter() - log.started,
            stop_reason=stop_reason,
            last_checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            eval_losses=log.evals,
            tokens_by_source=self.data.tokens_by_source(self.spikes.skips.ranges),
            exit_code=self.stop.exit_code() if stop_reason == "interrupted" else 0,
            events=log.events,
        )

    def _measured_step(
        self, micro_batches: list, pending: list[_Pending], samples: tuple[int, int]
    ) -> _Pending:
        """The step whose peak memory is measured (its values read back; `measure_step`)."""
        done, self.cpu_peak = measure_step(
            self.runtime, self.optimizer, lambda: self._device_step(micro_batches, pending, samples)
        )
        return done

    def _plan_vs_run(self, index: int, meter: ThroughputMeter, step_s: float) -> dict | None:
        """The planner-vs-measured record of this step, if it is the layout-report step (the
        third, or the last if sooner; `layout_report_record`)."""
        timed = meter.seconds / meter.steps if meter.steps else step_s
        report_step = index + 1 == min(3, self.last_step)
        return layout_report_record(
            self.runtime, report_step, timed, self.console.print, self.cfg.optimizer
        )

    def _peak_memory(self) -> int:
        return self.runtime.peak_memory_bytes() or self.cpu_peak.peak_bytes

    def _maybe_eval(self) -> float | None:
        """The held-out loss at eval steps (a mixture's per source: `self.eval_by_source`)."""
        every, self.eval_by_source = self.cfg.eval_every, None
        if not every or (self.step % every and self.step != self.last_step):
            return None
        loss, self.eval_by_source = held_out_losses(
            self.runtime, self.data, self.cfg.eval_batches, self.recipe.plan.micro_batch
        )
        return loss

    def _metrics(self, loss, aux, grad_norm, lr, step_s, started, eval_loss) -> StepMetrics:
        rate = self.tokens_per_step / step_s if step_s > 0 else 0.0
        devices = self.runtime.world_size
        return StepMetrics(
            step=self.step,
            loss=loss,
            aux_loss=aux,
            grad_norm=grad_norm,
            lr=lr,
            tokens=self.tokens_per_step,
            step_time_s=step_s,
            tokens_per_s=rate,
            mfu=utilization(rate, self.model_flops_per_token, self.peak.flops_per_s, devices),
            hfu=utilization(rate, self.hardware_flops_per_token, self.peak.flops_per_s, devices),
            peak_memory_bytes=self._peak_memory(),
            peak_reserved_bytes=getattr(self.runtime, "peak_reserved_bytes", 0) or None,
            elapsed_s=time.perf_counter() - started,
            eval_loss=eval_loss,
        )
