"""The efficiency model's parameters, as data, with where each one came from.

The planner turns FLOPs and bytes into seconds with a handful of physical constants:

- `gemm_peak_fraction[arch]`: the fraction of the dense peak a large bf16 GEMM reaches on that
  micro-architecture (fitted).
- `gemm_half_intensity`: the arithmetic intensity (FLOP/byte, in units of the device's ridge
  point peak/HBM-bandwidth) at which a GEMM reaches half of that fraction; a smooth roofline
  (fitted).
- `attention_peak_fraction`: the fraction of peak a fused (flash) attention forward reaches
  (fitted); its backward runs `attention_backward_ratio` = 2.5 times the forward time, because
  it recomputes QK^T and runs five matmuls for the forward's two (Dao 2023, FlashAttention-2).
- `hbm_fraction`: the fraction of HBM bandwidth that memory-bound element-wise kernels reach
  (fitted).
- `layer_overhead_s`: a fixed time per transformer layer per micro-batch forward (twice that in
  the backward): kernel launches and tails that do not shrink with the work (fitted).
- `stream_fraction`: the fraction of HBM bandwidth a long contiguous pass over a large tensor
  reaches (classic attention's s^2 scores: softmax, dropout, the score GEMMs' output), fixed at
  0.8 from streaming benchmarks (copy/triad kernels reach about 80-90 % of the datasheet HBM
  figure on A100 and H100); the small element-wise kernels' `hbm_fraction` is fitted well below
  it, since launches and short rows are in it.
- `nvlink_fraction`, `ib_fraction`: achieved bus bandwidth of ring collectives against the link
  rate, fixed from nccl-tests reference numbers (8x A100 NVLink3: 230-250 GB/s bus bandwidth of
  300 GB/s per direction; InfiniBand NDR/HDR: about 90 % of line rate).

`scripts/calibrate.py` fits the fitted ones on every published run in
`planner/data/published_runs.json` and writes `planner/data/efficiency.json`, which this module
reads. The JSON also records the leave-one-source-out check: for each source, the error of a
fit on all the other sources for each of its rows (`held_out_errors()`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

DATA_DIR = Path(__file__).parents[1] / "data"
EFFICIENCY_FILE = DATA_DIR / "efficiency.json"
PUBLISHED_RUNS_FILE = DATA_DIR / "published_runs.json"

# Parameters the calibration script fits (the rest are fixed from the literature).
FITTED = (
    "gemm_peak_fraction.ampere",
    "gemm_peak_fraction.hopper",
    "gemm_half_intensity",
    "attention_peak_fraction",
    "hbm_fraction",
    "layer_overhead_s",
)


@dataclass(frozen=True)
class EfficiencyModel:
    """Achieved fractions of the hardware's peaks; see the module docstring for each field."""

    gemm_peak_fraction: tuple[tuple[str, float], ...] = (("ampere", 0.80), ("hopper", 0.75))
    gemm_half_intensity: float = 0.5
    attention_peak_fraction: float = 0.5
    attention_backward_ratio: float = 2.5
    hbm_fraction: float = 0.7
    layer_overhead_s: float = 20e-6
    stream_fraction: float = 0.8
    nvlink_fraction: float = 0.8
    ib_fraction: float = 0.9
    source: str = field(default="defaults (uncalibrated)", compare=False)

    def gemm_fraction(self, arch: str) -> float:
        """Large-GEMM fraction of peak for `arch`; an architecture without calibration data uses
        the newest calibrated one (stated in docs/planner.md)."""
        table = dict(self.gemm_peak_fraction)
        if arch in table:
            return table[arch]
        return table.get("hopper", next(iter(table.values())))

    def with_(self, **changes) -> EfficiencyModel:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["gemm_peak_fraction"] = dict(self.gemm_peak_fraction)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> EfficiencyModel:
        values = dict(data)
        values["gemm_peak_fraction"] = tuple(sorted(values["gemm_peak_fraction"].items()))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in values.items() if k in known})


@lru_cache(maxsize=1)
def efficiency_model() -> EfficiencyModel:
    """The calibrated model from `data/efficiency.json` (defaults if the file is missing)."""
    if not EFFICIENCY_FILE.is_file():
        return EfficiencyModel()
    data = json.loads(EFFICIENCY_FILE.read_text())
    return EfficiencyModel.from_dict(data["parameters"])


def calibration_record() -> dict:
    """Everything `scripts/calibrate.py` wrote: parameters, fitted/held-out rows, errors."""
    if not EFFICIENCY_FILE.is_file():
        return {}
    return json.loads(EFFICIENCY_FILE.read_text())


def published_runs() -> list[dict]:
    """The published measurements the model is calibrated and checked against."""
    return json.loads(PUBLISHED_RUNS_FILE.read_text())["runs"]


def skipped_runs() -> list[dict]:
    """Rows of the shared table the planner cannot express, each with its reason."""
    return json.loads(PUBLISHED_RUNS_FILE.read_text()).get("skipped", [])


def held_out_errors() -> dict[str, list[tuple[str, float]]]:
    """Leave-one-source-out residuals from `data/efficiency.json`: {source: [(row id,
    predicted/measured - 1 of step time by a fit on all the other sources), ...]}."""
    loso = calibration_record().get("loso", {})
    return {
        source: [(h["row"], h["error"]) for h in entry["held_out"]]
        for source, entry in loso.items()
    }
