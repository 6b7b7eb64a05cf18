"""W&B and MLflow log the same metric names and values as metrics.jsonl (offline, in tmp_path).

Each test trains the tiny preset for 3 steps with one tracker on and reads back what the
tracker stored: W&B's offline run file (`.wandb`, read with wandb's own DataStore), MLflow's
file store. Skipped where the package is not installed (CI installs `.[dev]` only).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from fivefold.errors import ConfigError
from fivefold.train.entry import load_run
from fivefold.train.start import train

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
QUIET = ["train.progress=false", "train.tensorboard=false"]
SHORT = ["train.steps=3", "train.warmup_steps=1", "train.log_every=1"]


def tiny_run(tmp_path: Path, *overrides: str):
    base = [f"train.runs_dir={str(tmp_path)!r}", "train.name='tracked'", *QUIET, *SHORT]
    return load_run(TINY, [*base, *overrides], world_size=1)


def jsonl_scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    """Step -> {train/<field>: value} from metrics.jsonl: the names every tracker must use."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = {
            f"train/{k}": v
            for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
    return out


def test_mlflow_logs_the_jsonl_metrics(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 guards its file store
    run = tiny_run(tmp_path, "train.trackers=['mlflow']")
    train(run, console=Console(quiet=True))
    expected = jsonl_scalars(run.train.path())
    assert sorted(expected) == [1, 2, 3] and "train/loss" in expected[1]
    run_id = json.loads((run.train.path() / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    logged = client.get_run(run_id)
    assert set(logged.data.metrics) == set(expected[1])
    for name in expected[1]:
        history = {m.step: m.value for m in client.get_metric_history(run_id, name)}
        assert history == pytest.approx({s: expected[s][name] for s in expected}), name
    assert logged.data.params["model.hidden"] == str(run.recipe.model.hidden)
    assert logged.info.status == "FINISHED"


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B offline run file: a 7-byte header (":W&B", magic, version), then
    LevelDB's log format: 32 KiB blocks of chunks (crc32c 4 B, length 2 B LE, type 1 B: 1 full,
    2 first, 3 middle, 4 last), a block tail under 7 bytes being padding. wandb >= 0.31 reads
    it only in its Go core, so the test reads it here."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind, chunk = data[pos + 6], data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue  # zero padding
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def test_wandb_offline_logs_the_jsonl_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tiny_run(tmp_path, "train.trackers=['wandb']")
    train(run, console=Console(quiet=True))
    wandb.teardown()  # the run file is complete once W&B's service stops (as at process exit)
    expected = jsonl_scalars(run.train.path())
    run_id = json.loads((run.train.path() / "trackers.json").read_text())["wandb"]
    (log_file,) = (run.train.path() / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    logged: dict[int, dict[str, float]] = {}
    for data in wandb_records(log_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            logged[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert sorted(logged) == sorted(expected) == [1, 2, 3]
    for step, values in expected.items():
        assert logged[step] == pytest.approx(values), step


def test_unknown_or_missing_tracker_is_a_config_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        tiny_run(tmp_path, "train.trackers=['wandb', 'comet', 'tensorboard']")
    text = str(err.value)
    assert "pip install 'fivefold[wandb]'" in text
    assert "'comet' is not a tracker" in text
    assert "train.tensorboard" in text


def test_mlflow_resumed_run_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    first = tiny_run(tmp_path, "train.trackers=['mlflow']", "train.stop_at=2")
    train(first, console=Console(quiet=True))
    ids = json.loads((first.train.path() / "trackers.json").read_text())
    second = tiny_run(tmp_path, "train.trackers=['mlflow']")
    assert train(second, console=Console(quiet=True)).start_step == 2  # resumed
    assert json.loads((second.train.path() / "trackers.json").read_text()) == ids
    expected = jsonl_scalars(second.train.path())
    history = MlflowClient(tracking_uri=uri).get_metric_history(ids["mlflow"], "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(
        {s: v["train/loss"] for s, v in expected.items()}
    )
    assert sorted(expected) == [1, 2, 3]
