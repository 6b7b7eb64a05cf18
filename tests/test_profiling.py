"""`train.profile`: a Chrome/Perfetto trace of the chosen steps that names the model's modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from fivefold.errors import ConfigError
from fivefold.train.entry import load_run
from fivefold.train.start import train

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
QUIET = ["train.progress=false", "train.tensorboard=false", "train.save_final=false"]
SHORT = ["train.steps=4", "train.warmup_steps=1"]


def tiny_run(tmp_path: Path, *overrides: str):
    base = [f"train.runs_dir={str(tmp_path)!r}", "train.name='prof'", *QUIET, *SHORT]
    return load_run(TINY, [*base, *overrides], world_size=1)


def test_trace_names_steps_and_modules(tmp_path):
    run = tiny_run(tmp_path, "train.profile={start_step=2, steps=2}")
    summary = train(run, console=Console(quiet=True))
    assert summary.end_step == 4
    trace = tmp_path / "prof" / "profile" / "trace-rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    # Steps 2 and 3 only: the window, 1-based as in metrics.jsonl.
    assert {n for n in names if n.startswith("fivefold step")} == {
        "fivefold step 2",
        "fivefold step 3",
    }
    layers = run.recipe.model.layers
    for i in range(layers):
        assert f"layers.{i}" in names
    assert any(n.startswith("layers.0.") and "attention" in n for n in names)
    assert any(n.startswith("layers.0.") and "feed_forward" in n for n in names)
    # One range per forward call: 2 steps x plan.grad_accum micro-batches.
    forwards = 2 * run.recipe.plan.grad_accum
    assert run.recipe.plan.recompute == "none"
    assert sum(e.get("name") == "layers.0" for e in events) == forwards
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the ops themselves
    assert not (tmp_path / "prof" / "profile" / "memory-rank0.pickle").exists()  # CUDA only


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("{start_step=0, steps=2}", "train.profile.start_step = 0"),
        ("{start_step=2}", "train.profile.steps = None"),
        ("{start_step=2, steps=1, every=3}", "train.profile.every is not a setting"),
        ("{start_step=9, steps=1}", "after the last step"),
        ("{start_step=2, steps=true}", "train.profile.steps = True"),
    ],
)
def test_bad_profile_settings_are_config_errors(tmp_path, value, words):
    with pytest.raises(ConfigError, match=r"train\.profile") as err:
        tiny_run(tmp_path, f"train.profile={value}")
    assert words in str(err.value)
