"""`train.compile = true` in one process: blocks compiled, the compile time reported once, the
losses those of the eager run (inductor reorders float arithmetic, hence a tolerance).

Slow: a cold inductor compile takes tens of seconds on CPU. The multi-rank cases are in
tests/parallel/test_parity_compile.py (one of them in CI).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from fivefold.train.entry import load_run
from fivefold.train.loop import train

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"


def _run(tmp_path: Path, name: str, compile: bool):
    overrides = [
        f"train.runs_dir={str(tmp_path)!r}",
        f"train.name={name!r}",
        "train.progress=false",
        "train.tensorboard=false",
        "train.steps=3",
        "train.warmup_steps=0",
        "train.save_final=false",
        f"train.compile={'true' if compile else 'false'}",
    ]
    out = io.StringIO()
    summary = train(load_run(TINY, overrides, world_size=1), console=Console(file=out))
    return summary, out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_blocks_train_like_eager_and_report_compile_time(tmp_path):
    from fivefold.parallel.compile import compile_seconds

    eager, _ = _run(tmp_path, "eager", compile=False)
    before = compile_seconds()
    compiled, printed = _run(tmp_path, "compiled", compile=True)
    seconds, graphs = compile_seconds()
    assert graphs > before[1] and seconds > before[0]
    assert printed.count("torch.compile: ") == 1 and "graph(s) compiled in" in printed
    for a, b in zip(compiled.losses, eager.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
