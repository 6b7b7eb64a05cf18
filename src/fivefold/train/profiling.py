"""`train.profile`: a torch.profiler trace of chosen steps, and on CUDA a memory snapshot.

Details: docs/internals.md (`fivefold.train.profiling`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept for the snapshot


class StepProfiler:
    """Profiles the steps of `window` ({} = none) on this rank; `step(n)` wraps step n."""

    def __init__(
        self,
        window: dict,
        run_dir: Path,
        model_parts: list[nn.Module],
        rank: int,
        report: Callable[[str], None] = print,
    ):
        self.first = int(window.get("start_step", 0))
        self.last = self.first + int(window.get("steps", 0)) - 1
        self.directory = Path(run_dir) / "profile"
        self.model_parts = model_parts
        self.rank = rank
        self.report = report  # told each file written
        self._profiler: torch.profiler.profile | None = None
        self._hooks: list = []
        self._cuda = False
        self.written: list[Path] = []

    @property
    def trace_path(self) -> Path:
        return self.directory / f"trace-rank{self.rank}.json"

    @property
    def snapshot_path(self) -> Path:
        return self.directory / f"memory-rank{self.rank}.pickle"

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Run step `n` (1-based), profiled when it lies in the window."""
        if not self.first or not self.first <= n <= self.last:
            yield
            return
        if self._profiler is None:
            self._start()
        with record_function(f"fivefold step {n}"):
            yield
        if n == self.last:
            self.close()

    def _start(self) -> None:
        self._cuda = any(p.device.type == "cuda" for m in self.model_parts for p in m.parameters())
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._hooks = name_modules(self.model_parts)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def close(self) -> None:
        """Stop and write the files (a run that ends inside the window writes what it has)."""
        if self._profiler is None:
            return
        if self._cuda:
            torch.cuda.synchronize()
        self._profiler.stop()
        for hook in self._hooks:
            hook.remove()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.trace_path))
        self.written.append(self.trace_path)
        if self._cuda:
            torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(self.snapshot_path)
        self._profiler, self._hooks = None, []
        what = "trace and memory snapshot" if self._cuda else "trace"
        self.report(f"profile of steps {self.first}-{self.last} ({what}): {self.directory}")


def name_modules(model_parts: list[nn.Module]) -> list:
    """Hooks that put each submodule's forward in a profiler range named by its qualified name
    (`layers.0.attention`); returns the handles to remove."""
    handles = []
    for part in model_parts:
        for name, module in part.named_modules():
            if not name:
                continue
            ranges: list[record_function] = []

            def enter(_module, _args, name=name, ranges=ranges):
                ranges.append(record_function(name))
                ranges[-1].__enter__()

            def leave(_module, _args, _output, ranges=ranges):
                if ranges:
                    ranges.pop().__exit__(None, None, None)

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
    return handles
