"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

Details: docs/internals.md (`fivefold.train.trackers`).
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fivefold.specs.recipe import Recipe
from fivefold.train.metrics import StepMetrics, TensorBoardWriter, scalars

OPTIONAL = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the package (and the extra)


def tracker_problems(names: list) -> list[str]:
    """What is wrong with `train.trackers`: unknown or repeated names, packages not installed."""
    out = []
    for name in names:
        if name == "tensorboard":
            out.append(
                "train.trackers: TensorBoard is train.tensorboard (true by default); drop "
                "'tensorboard' from train.trackers."
            )
        elif name not in OPTIONAL:
            out.append(
                f"train.trackers: {name!r} is not a tracker; choose from {', '.join(OPTIONAL)}."
            )
        elif importlib.util.find_spec(OPTIONAL[name]) is None:
            out.append(
                f"train.trackers: {name!r} needs the {OPTIONAL[name]} package, which is not "
                f"installed; pip install 'fivefold[{name}]', or drop it from train.trackers."
            )
    if "wandb" in names and not _wandb_can_log():
        out.append(
            "train.trackers: 'wandb' has no W&B credentials here (no WANDB_API_KEY, no entry "
            "for the W&B host in ~/.netrc): run `wandb login`, or set WANDB_MODE=offline to log "
            "into the run directory (`wandb sync` uploads later)."
        )
    if len({str(n) for n in names}) != len(names):
        out.append(f"train.trackers = {names!r}: name each tracker once.")
    return out


def _wandb_can_log() -> bool:
    """Whether wandb.init will start without asking for a key: offline or disabled mode, an API
    key in the environment, or `wandb login`'s entry for the W&B host in the netrc file."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    def __init__(self, run_dir: Path, recipe: Recipe, name: str, run_id: str | None):
        import wandb  # optional dependency (the wandb extra)

        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fivefold"),
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=str(run_dir),
            config=recipe_params(recipe),
        )
        self.run_id = self._run.id

    def write(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, recipe: Recipe, name: str, run_id: str | None):
        from mlflow import MlflowClient  # optional dependency (the mlflow extra)

        run_dir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve()}/mlflow.db"
        self._client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "fivefold")
            found = self._client.get_experiment_by_name(experiment_name)
            experiment = (
                found.experiment_id if found else self._client.create_experiment(experiment_name)
            )
            run_id = self._client.create_run(experiment, run_name=name).info.run_id
            for key, value in recipe_params(recipe).items():
                self._client.log_param(run_id, key, value)
        self.run_id = run_id

    def write(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # optional, as above

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


OPENERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """TensorBoard (when on) and the optional trackers of `train.trackers`, written together."""

    def __init__(self, run_dir: Path, recipe: Recipe, cfg: Any, start_step: int):
        self._board = TensorBoardWriter(run_dir / "tb") if cfg.tensorboard else None
        ids_path = run_dir / "trackers.json"
        ids = json.loads(ids_path.read_text()) if start_step and ids_path.is_file() else {}
        self._open = [OPENERS[n](run_dir, recipe, cfg.name, ids.get(n)) for n in cfg.trackers]
        if self._open:
            kept = {n: t.run_id for n, t in zip(cfg.trackers, self._open, strict=True)}
            ids_path.write_text(json.dumps(kept, indent=2) + "\n")

    def write(self, m: StepMetrics) -> None:
        if self._board is not None:
            self._board.write(m)
        values = scalars(m)
        for tracker in self._open:
            tracker.write(values, m.step)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
        for tracker in self._open:
            tracker.close()


def recipe_params(recipe: Recipe) -> dict[str, Any]:
    """The model and plan settings, flat (`model.hidden`, `plan.tp`), as tracker parameters."""
    out: dict[str, Any] = {}
    for section, values in (("model", recipe.model.to_dict()), ("plan", recipe.plan.to_dict())):
        for key, value in values.items():
            ok = isinstance(value, bool | int | float | str)
            out[f"{section}.{key}"] = value if ok else json.dumps(value)
    return out
