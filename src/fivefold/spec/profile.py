"""Device profiles: what `fivefold calibrate` measured on a machine, as data the planner reads.

A profile is a TOML file (written by `fivefold.calibration`, read here without torch):

    format = 1
    [device]      name, kind ("cpu" | "cuda"), cores, memory_bytes (host memory or HBM),
                  backend ("gloo" | "nccl"), ranks (processes the collectives ran on),
                  bf16 ("native" | "emulated" | "skipped"), model (whose shapes were measured),
                  torch, created
    [[matmul]]    dtype, threads, m, n, k, layout ("nt" forward x W^T, "nn" input gradient
                  g W, "tn" weight gradient g^T x), flops_per_s (2mnk / best time)
    [[grouped_matmul]] dtype, threads, groups, tokens, n, k, layout, flops_per_s: a MoE layer's
                  experts as the model runs them, one `torch._grouped_mm` over `groups`
                  experts of equal share of `tokens` routed rows, for the projection of forward
                  shape (tokens x k) @ (k x n) per expert; layout "nt" forward, "nn" input
                  gradient, "tn" weight gradient (per-expert g^T x), each 2 tokens n k FLOPs
    [[attention]] dtype, threads, batch, heads, kv_heads, seq, head_dim, cp,
                  forward_flops_per_s, backward_flops_per_s: cp = 1, the model's own attention
                  core on `seq` tokens (causal: forward 4 * batch * heads * seq^2/2 * head_dim
                  FLOPs, backward twice that, over its measured seconds); cp > 1, one rank's
                  share of context-parallel attention with `seq` = its tokens (the sequence
                  over cp): the runtime's block kernels over the load-balanced chunks and their
                  log-sum-exp merges, 4 * batch * heads * seq * (cp * seq / 2) * head_dim FLOPs
    [[bandwidth]] kind, threads, processes, bytes_per_s, measured while `processes` local
                  processes ran the same work at once (1: alone; more: memory bandwidth
                  shared by the ranks of a run as they share it). "elementwise_forward" /
                  "elementwise_backward": the bytes
                  `fivefold.planner.compute.layer_elementwise_bytes` counts (once forward,
                  twice backward) over the measured time of the block's norms, RoPE,
                  activation and residual adds; "loss_forward" / "loss_backward": 10 and 14
                  bytes per fp32 logit (`compute.LOSS_BYTES_PER_LOGIT` = 24 split as there)
                  over the measured cross-entropy; "optimizer": AdamW's bytes per parameter
                  (`compute.optimizer_bytes_per_param`) over its measured step, gradient
                  clipping and zeroing included.
    [[overhead]]  threads, layer_forward_s, layer_backward_s, moe_forward_s, moe_backward_s:
                  what one more dense (MoE) layer adds to a model at a shape where the
                  arithmetic is negligible (Python, autograd, each op's dispatch; a MoE layer's
                  routing and loop over experts); tp_forward_s, tp_backward_s and
                  fsdp_forward_s, fsdp_backward_s: the extra of a tensor-parallel layer (DTensor
                  dispatch, sequence parallel) and of a ZeRO-3 FSDP2 unit (hooks, gathers,
                  reduce-scatter); replicate_forward_s, replicate_backward_s and
                  shard_forward_s, shard_backward_s: the extra of a ZeRO-0 unit (FSDP2's
                  `replicate`) and of a ZeRO-1/2 unit (`fully_shard` kept gathered after
                  forward); ep_forward_s, ep_backward_s: the extra of a MoE layer under expert
                  parallelism (the all-to-all dispatcher's Python and host syncs, the experts
                  as DTensor shards, the global load-balancing loss); all measured on a
                  one-rank mesh so no transfer is in them.
    [[collective]] op, ranks, world, gap_s, alpha_s, beta_bytes_per_s: time(S) = alpha + S /
                  beta fitted by least squares to the samples, S in nccl-tests' convention
                  (all_reduce: the buffer; all_gather / reduce_scatter / all_to_all: the whole
                  buffer of ranks x the per-rank part; send_recv: the message); measured with
                  `world` local processes running, every group of `ranks` at once (a 2-rank
                  group is slower among 4 processes on 2 cores than alone), each collective
                  issued after `gap_s` seconds of a GEMM on every rank (0: back to back), as
                  a step issues them (`fivefold.calibration.comm.issued_time_s`): on a
                  CPU a collective costs more the longer the ranks computed before it.
    [[collective_sample]] op, ranks, world, gap_s, size_bytes, time_s, algbw_bytes_per_s,
                  busbw_bytes_per_s

The matmul and attention rows hold the model's shapes and a model-independent grid of shapes
(`fivefold.calibration.matmul.DEVICE_GRID`, `attention.ATTENTION_GRID`); the planner reads rates as
functions of shape, interpolated among the rows in log space (`log_shape_interp`), so one
profile serves every model. A CUDA profile (kind "cuda") has bf16 and, where the GPU has it,
fp8 ("fp8": `torch._scaled_mm`) matmul rows, all at threads = 1.

Loading one yields a `GPUSpec` whose peak is the best measured matmul rate per dtype (the source
says "measured"; nothing is guessed) and a `ClusterSpec` of one node with the local ranks.

On a CPU, processes share the machine's cores: a run of R ranks gives each max(1, cores // R)
threads (`threads_per_rank`, the launcher's rule; $OMP_NUM_THREADS when set, as torch does)
and, when R x threads exceeds the cores, each rank a cores / (R x threads) share of the
machine. The device for R ranks reads the rows measured at that thread count (or scales the
nearest linearly in threads) and multiplies compute rates by the share.
"""

from __future__ import annotations

import itertools
import math
import os
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.spec.hardware import GPUSpec

FORMAT = 5  # 2: overhead per layer kind, clipping in the optimizer; 3: ZeRO-0/1/2 units;
# 4: collectives timed as issued, after a GEMM of `gap_s`; 5: a model-independent grid of GEMM
# shapes (`DEVICE_GRID`), CUDA profiles (kind "cuda", fp8 rows)
READS = (4, 5)  # format 4 has the same tables; its GEMM rates cover one model's shapes only
PROFILE_ENV = "FIVEFOLD_PROFILE"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
LAYOUTS = ("nt", "nn", "tn")
BANDWIDTH_KINDS = (
    "elementwise_forward",
    "elementwise_backward",
    "loss_forward",
    "loss_backward",
    "optimizer",
)
NEIGHBOURS = 4  # measured GEMM shapes a rate is interpolated from (`Measured.gemm_flops_per_s`)


def default_profile_path() -> Path:
    """$FIVEFOLD_PROFILE, else $XDG_CACHE_HOME/fivefold/device-profile.toml (~/.cache/...)."""
    if os.environ.get(PROFILE_ENV):
        return Path(os.environ[PROFILE_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fivefold" / "device-profile.toml"


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by a cgroup v2 quota (`cpu.max` = "quota period"), None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def available_cores() -> int:
    """Cores this process can run on: its affinity mask, capped by the cgroup quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def threads_per_rank(ranks: int, cores: int) -> int:
    """CPU threads each of `ranks` local processes uses: $OMP_NUM_THREADS when set (torch reads
    it at start-up), else cores // ranks (the launcher's rule, so ranks do not oversubscribe)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return int(env)
    return max(1, cores // max(1, ranks))


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for `op` on `n` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "send_recv":
        return 1.0
    return (n - 1) / n


# ---- the rows -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Matmul:
    dtype: str
    threads: int
    m: int
    n: int
    k: int
    layout: str
    flops_per_s: float


@dataclass(frozen=True)
class GroupedMatmul:
    """One pass of a `torch._grouped_mm` projection: `tokens` rows split evenly over `groups`
    experts, each (tokens / groups x k) @ (k x n) in its forward shape; 2 tokens n k FLOPs."""

    dtype: str
    threads: int
    groups: int
    tokens: int
    n: int
    k: int
    layout: str
    flops_per_s: float


@dataclass(frozen=True)
class Attention:
    dtype: str
    threads: int
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    cp: int
    forward_flops_per_s: float
    backward_flops_per_s: float


@dataclass(frozen=True)
class Bandwidth:
    kind: str
    threads: int
    processes: int
    bytes_per_s: float


@dataclass(frozen=True)
class Overhead:
    """Fixed seconds per layer and micro-batch (at a shape with negligible arithmetic): a dense
    and a MoE layer, and the extra of tensor parallelism, of expert parallelism (`ep_*`, MoE
    layers) and of a data-parallel unit: ZeRO-3 (`fsdp_*`, FSDP2 re-sharding after forward),
    ZeRO-1/2 (`shard_*`, kept gathered) and ZeRO-0 (`replicate_*`, FSDP2's `replicate`)."""

    threads: int
    layer_forward_s: float
    layer_backward_s: float
    moe_forward_s: float
    moe_backward_s: float
    tp_forward_s: float
    tp_backward_s: float
    fsdp_forward_s: float
    fsdp_backward_s: float
    replicate_forward_s: float
    replicate_backward_s: float
    shard_forward_s: float
    shard_backward_s: float
    ep_forward_s: float
    ep_backward_s: float

    def data_parallel_s(self, zero: int) -> tuple[float, float]:
        """(forward, backward) extra of one data-parallel unit wrapped for ZeRO `zero`."""
        if zero >= 3:
            return self.fsdp_forward_s, self.fsdp_backward_s
        if zero >= 1:
            return self.shard_forward_s, self.shard_backward_s
        return self.replicate_forward_s, self.replicate_backward_s


@dataclass(frozen=True)
class Collective:
    """`op` over groups of `ranks` while `world` local processes run (all their groups at once),
    each issued after `gap_s` seconds of compute on every rank."""

    op: str
    ranks: int
    world: int
    gap_s: float
    alpha_s: float
    beta_bytes_per_s: float


@dataclass(frozen=True)
class CollectiveSample:
    op: str
    ranks: int
    world: int
    gap_s: float
    size_bytes: int
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float


_ROWS: dict[str, type] = {
    "matmul": Matmul,
    "grouped_matmul": GroupedMatmul,
    "attention": Attention,
    "bandwidth": Bandwidth,
    "overhead": Overhead,
    "collective": Collective,
    "collective_sample": CollectiveSample,
}


@dataclass(frozen=True)
class DeviceProfile:
    """A whole profile file; `device(ranks)` is the machine as one of `ranks` processes sees it."""

    name: str
    kind: str
    cores: int
    memory_bytes: int
    backend: str
    ranks: int
    bf16: str = "skipped"
    model: str = ""
    torch: str = ""
    created: str = ""
    matmul: tuple[Matmul, ...] = ()
    grouped_matmul: tuple[GroupedMatmul, ...] = ()
    attention: tuple[Attention, ...] = ()
    bandwidth: tuple[Bandwidth, ...] = ()
    overhead: tuple[Overhead, ...] = ()
    collective: tuple[Collective, ...] = ()
    collective_sample: tuple[CollectiveSample, ...] = ()
    path: str = field(default="", compare=False)

    def device(self, ranks: int = 1, threads: int | None = None) -> GPUSpec:
        """A `GPUSpec` for one of `ranks` local processes using `threads` threads each
        (default `threads_per_rank`), with its `Measured` tables."""
        measured = Measured(self, max(1, ranks), threads)
        peaks = {dt: measured.peak(dt) for dt in sorted({m.dtype for m in self.matmul})}
        src = self.path or "a device profile"
        per_rank = self.memory_bytes if self.kind == "cuda" else self.memory_bytes // max(1, ranks)
        return GPUSpec(
            name=self.name,
            hbm_bytes=per_rank,  # a GPU's HBM is each rank's own; host memory is shared
            peak_flops=peaks,
            hbm_bw_bytes_per_s=measured.bandwidth("elementwise_forward"),
            nvlink_bw_bytes_per_s=0.0,
            source=f"measured by `fivefold calibrate` ({src}): best matmul rate per dtype at "
            f"{measured.threads} thread(s) per rank, {ranks} rank(s) on {self.cores} core(s)",
            measured=measured,
        )

    def to_toml(self) -> str:
        """The profile as TOML text that `parse_profile` reads back to an equal profile."""
        from fivefold.spec.recipe import _toml_value

        lines = [
            "# fivefold device profile, written by `fivefold calibrate`; read by `fivefold plan",
            "# --cluster THIS.toml`, recipes' cluster.profile and CPU training runs.",
            f"format = {FORMAT}",
            "",
            "[device]",
        ]
        for key in ("name", "kind", "cores", "memory_bytes", "backend", "ranks", "bf16"):
            lines.append(f"{key} = {_toml_value(getattr(self, key))}")
        for key in ("model", "torch", "created"):
            lines.append(f"{key} = {_toml_value(getattr(self, key))}")
        for table, cls in _ROWS.items():
            for row in getattr(self, table):
                lines += ["", f"[[{table}]]"]
                lines += [
                    f"{name} = {_toml_value(getattr(row, name))}"
                    for name in cls.__dataclass_fields__
                ]
        return "\n".join(lines) + "\n"


# ---- reading and validating ---------------------------------------------------------------------
def _field_problems(table: str, index: int, cls: type, row: Any) -> tuple[dict, list[str]]:
    where = f"{table}[{index}]"
    if not isinstance(row, dict):
        return {}, [f"profile {where}: expected a table of fields."]
    out, problems = {}, []
    for name, f in cls.__dataclass_fields__.items():
        if name not in row:
            problems.append(f"profile {where}.{name} is missing; re-run `fivefold calibrate`.")
            continue
        value = row[name]
        if f.type == "str":
            ok = isinstance(value, str)
        elif f.type == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and value >= 0
            value = float(value) if ok else value
        if not ok:
            kind = {"str": "a string", "int": "a whole number >= 0"}.get(f.type, "a number >= 0")
            problems.append(f"profile {where}.{name} = {value!r}: expected {kind}.")
        out[name] = value
    unknown = sorted(set(row) - set(cls.__dataclass_fields__))
    if unknown:
        problems.append(f"profile {where}: unknown field(s) {', '.join(unknown)}.")
    return out, problems


def _rows(data: dict, table: str, cls: type, problems: list[str]) -> tuple:
    raw = data.get(table, [])
    if not isinstance(raw, list):
        problems.append(f"profile {table}: expected an array of tables ([[{table}]]).")
        return ()
    rows = []
    for i, row in enumerate(raw):
        values, bad = _field_problems(table, i, cls, row)
        problems += bad
        if not bad:
            rows.append(cls(**values))
    return tuple(rows)


def _positive(rows: tuple, attrs: tuple[str, ...], table: str, problems: list[str]) -> None:
    for i, row in enumerate(rows):
        for attr in attrs:
            if getattr(row, attr) <= 0:
                problems.append(
                    f"profile {table}[{i}].{attr} = {getattr(row, attr)}: must be positive."
                )


def _check_choices(rows, attr, choices, table, problems) -> None:
    for i, row in enumerate(rows):
        if getattr(row, attr) not in choices:
            problems.append(
                f"profile {table}[{i}].{attr} = {getattr(row, attr)!r}: choose one of "
                f"{', '.join(choices)}."
            )


def parse_profile(data: dict[str, Any], path: str = "") -> DeviceProfile:
    """A validated `DeviceProfile` from parsed TOML; one ConfigError names every bad field."""
    problems: list[str] = []
    if data.get("format") not in READS:
        problems.append(
            f"profile format = {data.get('format')!r}: this fivefold reads formats "
            f"{', '.join(map(str, READS))}; re-run `fivefold calibrate`."
        )
    dev = data.get("device")
    if not isinstance(dev, dict):
        raise ConfigError([*problems, "profile [device] table is missing; re-run calibrate."])
    head: dict[str, Any] = {}
    for key, kind in (
        ("name", str),
        ("kind", str),
        ("cores", int),
        ("memory_bytes", int),
        ("backend", str),
        ("ranks", int),
    ):
        value = dev.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"profile device.{key} = {value!r}: expected a {kind.__name__}.")
        elif kind is int and value < 1:
            problems.append(f"profile device.{key} = {value}: must be at least 1.")
        head[key] = value
    for key in ("bf16", "model", "torch", "created"):
        if key in dev:
            head[key] = str(dev[key])
    tables = {name: _rows(data, name, cls, problems) for name, cls in _ROWS.items()}
    _check_choices(tables["matmul"], "layout", LAYOUTS, "matmul", problems)
    _check_choices(tables["grouped_matmul"], "layout", LAYOUTS, "grouped_matmul", problems)
    _positive(
        tables["grouped_matmul"],
        ("threads", "groups", "tokens", "n", "k", "flops_per_s"),
        "grouped_matmul",
        problems,
    )
    _check_choices(tables["bandwidth"], "kind", BANDWIDTH_KINDS, "bandwidth", problems)
    _check_choices(tables["collective"], "op", COLLECTIVES, "collective", problems)
    _positive(tables["matmul"], ("threads", "m", "n", "k", "flops_per_s"), "matmul", problems)
    _positive(
        tables["attention"],
        ("threads", "seq", "head_dim", "cp", "forward_flops_per_s", "backward_flops_per_s"),
        "attention",
        problems,
    )
    _positive(tables["bandwidth"], ("threads", "processes", "bytes_per_s"), "bandwidth", problems)
    _positive(tables["collective"], ("beta_bytes_per_s",), "collective", problems)
    for i, row in enumerate(tables["collective"]):
        if row.ranks < 2:
            problems.append(f"profile collective[{i}].ranks = {row.ranks}: must be at least 2.")
        if row.world < row.ranks:
            problems.append(
                f"profile collective[{i}].world = {row.world}: must be at least its ranks "
                f"({row.ranks})."
            )
    for table in ("matmul", "attention", "bandwidth", "overhead"):
        if not tables[table]:
            problems.append(f"profile has no [[{table}]] rows; re-run `fivefold calibrate`.")
    kinds = {b.kind for b in tables["bandwidth"]}
    for kind in BANDWIDTH_KINDS:
        if tables["bandwidth"] and kind not in kinds:
            problems.append(f"profile bandwidth has no {kind!r} row; re-run `fivefold calibrate`.")
    if problems:
        where = f" {path!r}" if path else ""
        raise ConfigError([f"device profile{where}: {p}" for p in problems])
    return DeviceProfile(**head, **tables, path=path)


def read_profile(path: str | Path) -> DeviceProfile:
    """Read and validate a profile file (ConfigError when missing or malformed)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(
            f"cluster.profile = {str(path)!r} does not exist; write one with `fivefold calibrate "
            f"--out {path}` or name an existing profile."
        )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"device profile {str(p)!r} is not valid TOML: {err}.") from None
    return parse_profile(data, str(p))


@lru_cache(maxsize=32)
def _cached(path: str, mtime_ns: int) -> DeviceProfile:
    return read_profile(path)


def load_profile(path: str | Path) -> DeviceProfile:
    """`read_profile`, cached per file and modification time."""
    p = Path(path).expanduser()
    mtime = p.stat().st_mtime_ns if p.is_file() else 0
    return _cached(str(p), mtime)


@lru_cache(maxsize=64)
def _cached_device(path: str, mtime_ns: int, ranks: int, threads: int) -> GPUSpec:
    return _cached(path, mtime_ns).device(ranks, threads)


def profile_device(path: str | Path, ranks: int = 1) -> GPUSpec:
    """The measured device of the profile at `path` for one of `ranks` processes (cached)."""
    p = Path(path).expanduser()
    mtime = p.stat().st_mtime_ns if p.is_file() else 0
    cores = _cached(str(p), mtime).cores
    return _cached_device(str(p), mtime, max(1, ranks), threads_per_rank(ranks, cores))


def profile_cluster(path: str | Path, ranks: int | None = None, **overrides) -> Any:
    """The `ClusterSpec` of a profile: one node of `ranks` local processes (default: the
    ranks its collectives were measured on)."""
    from fivefold.spec.cluster import ClusterSpec

    prof = load_profile(path)
    n = ranks or prof.ranks
    values = {
        "name": f"profile:{Path(path).name}",
        "gpu": prof.name,
        "nodes": 1,
        "gpus_per_node": n,
        "profile": str(path),
        **overrides,
    }
    return ClusterSpec(**values)


# ---- what the planner asks a measured device ---------------------------------------------------
def log_shape_interp(
    shape: tuple[float, ...], points: list[tuple[tuple[float, ...], float]]
) -> float:
    """A positive value at `shape` from measured (shape, value) points: each coordinate first
    clamped into the points' range (beyond the measured shapes, the edge's values), then the
    value of an equal shape, else exp of the mean log value of the `NEIGHBOURS` nearest points
    by Euclidean distance in log coordinates, weighted by 1 / distance^2."""
    lows = [min(p[0][i] for p in points) for i in range(len(shape))]
    highs = [max(p[0][i] for p in points) for i in range(len(shape))]
    where = [math.log(min(max(x, lo), hi)) for x, lo, hi in zip(shape, lows, highs, strict=True)]
    near = []
    for point, value in points:
        d2 = sum((math.log(p) - w) ** 2 for p, w in zip(point, where, strict=True))
        if d2 < 1e-18:
            return value
        near.append((d2, value))
    near.sort()
    near = near[:NEIGHBOURS]
    weights = [1.0 / d2 for d2, _ in near]
    logs = sum(w * math.log(v) for w, (_, v) in zip(weights, near, strict=True))
    return math.exp(logs / sum(weights))


class Measured:
    """The profile's tables as one of `ranks` local processes sees them (rates already scaled by
    the rank's share of the cores). Rates in FLOP/s and bytes/s, times in seconds."""

    def __init__(self, profile: DeviceProfile, ranks: int, threads: int | None = None):
        self.profile = profile
        self.ranks = ranks
        if profile.kind == "cuda":  # each rank has its own GPU: no thread count, no share
            self.threads, self.share = 1, 1.0
            return
        self.threads = threads or threads_per_rank(ranks, profile.cores)
        self.share = min(1.0, profile.cores / (ranks * self.threads))

    def _scale(self, measured_threads: int) -> float:
        """Rate factor from rows measured at `measured_threads` to this rank."""
        return self.threads / measured_threads * self.share

    def _at_threads(self, rows) -> tuple[list, float]:
        """Rows measured at the thread count nearest this rank's, and their rate factor."""
        if not rows:
            return [], 1.0
        best = min({r.threads for r in rows}, key=lambda t: (abs(t - self.threads), -t))
        return [r for r in rows if r.threads == best], self._scale(best)

    def peak(self, dtype: str) -> float:
        rows, scale = self._at_threads([m for m in self.profile.matmul if m.dtype == dtype])
        return max(r.flops_per_s for r in rows) * scale

    def _dtype(self, dtype: str, rows) -> str:
        """`dtype` when the rows have it, else the first of bf16, fp32 they have."""
        have = {r.dtype for r in rows}
        return dtype if dtype in have else next((d for d in ("bf16", "fp32") if d in have), dtype)

    def gemm_flops_per_s(self, m: float, n: float, k: float, dtype: str, layout: str) -> float:
        """The rate of an (m x k) @ (k x n) matmul, a function of its shape: the measured rate
        at this shape, else interpolated from the `NEIGHBOURS` nearest measured shapes of the
        dtype and layout (every layout when it has none) in log space: log rate weighted by
        1 / d^2, d the distance of (log m, log n, log k). The model-independent grid
        (`DEVICE_GRID`) makes every model's shapes fall among measured ones; a shape beyond
        the grid takes the rates at its edge (`log_shape_interp`)."""
        dtype = self._dtype(dtype, self.profile.matmul)
        rows, scale = self._at_threads([r for r in self.profile.matmul if r.dtype == dtype])
        same = [r for r in rows if r.layout == layout] or rows
        return (
            log_shape_interp(
                (max(1.0, m), max(1.0, n), max(1.0, k)),
                [((r.m, r.n, r.k), r.flops_per_s) for r in same],
            )
            * scale
        )

    def grouped_time_s(
        self, groups: float, tokens: float, n: float, k: float, dtype: str, layout: str
    ) -> float:
        """Seconds of one pass ("nt", "nn", "tn") of a grouped projection: `tokens` rows over
        `groups` experts, forward shape (tokens / groups x k) @ (k x n) each. From the measured
        grouped rate at the nearest shape of that layout (log distance in groups, tokens, n,
        k); a profile without grouped rows times `groups` separate matmuls instead."""
        flops = 2.0 * tokens * n * k
        if flops <= 0:
            return 0.0
        dtype = dtype if any(r.dtype == dtype for r in self.profile.grouped_matmul) else "fp32"
        rows = [r for r in self.profile.grouped_matmul if r.dtype == dtype]
        rows, scale = self._at_threads([r for r in rows if r.layout == layout])
        if rows:

            def distance(r: GroupedMatmul) -> float:
                pairs = ((r.groups, groups), (r.tokens, tokens), (r.n, n), (r.k, k))
                return sum(abs(math.log(a / max(b, 1e-9))) for a, b in pairs)

            return flops / (min(rows, key=distance).flops_per_s * scale)
        m = tokens / groups
        shape = {"nt": (m, n, k), "nn": (m, k, n), "tn": (n, k, m)}[layout]
        return groups * 2.0 * m * n * k / self.gemm_flops_per_s(*shape, dtype, layout)

    def attention_flops_per_s(
        self, seq: float, head_dim: float, dtype: str, cp: int = 1, rows: float = 0.0
    ) -> tuple[float, float]:
        """(forward, backward) rate of attention on `seq` local tokens as a function of its
        shape: the rows of the nearest measured cp (context parallelism's block attention over
        `cp` ranks; cp = 1 the single-process core, over the device grid and the calibrated
        models), interpolated in log space over (seq, head_dim, batch x heads) as GEMM rates
        are (`log_shape_interp`); `rows` = batch x heads of the query (0: not used)."""
        table = [a for a in self.profile.attention if a.dtype == dtype] or list(
            self.profile.attention
        )
        near = min({a.cp for a in table}, key=lambda c: (abs(c - cp), c))
        table, scale = self._at_threads([a for a in table if a.cp == near])

        def shape(a: Attention) -> tuple[float, ...]:
            return (a.seq, a.head_dim, a.batch * a.heads)[: 3 if rows > 0 else 2]

        where = (max(1.0, seq), max(1.0, head_dim), max(1.0, rows))[: 3 if rows > 0 else 2]
        fwd = log_shape_interp(where, [(shape(a), a.forward_flops_per_s) for a in table])
        bwd = log_shape_interp(where, [(shape(a), a.backward_flops_per_s) for a in table])
        return fwd * scale, bwd * scale

    def bandwidth(self, kind: str) -> float:
        """Bytes/s of `kind` for this rank: the rows at the nearest thread count measured with
        as many processes streaming at once as this run has ranks (else the nearest)."""
        rows, scale = self._at_threads([b for b in self.profile.bandwidth if b.kind == kind])
        near = min({r.processes for r in rows}, key=lambda n: (abs(n - self.ranks), n))
        return max(r.bytes_per_s for r in rows if r.processes == near) * scale

    def layer_overhead_s(
        self,
        moe: bool = False,
        tp: bool = False,
        zero: int | None = None,
        units: int = 1,
        ep: bool = False,
    ) -> tuple[float, float]:
        """(forward, backward) fixed seconds of one layer and micro-batch: a dense or MoE
        layer, plus tensor parallelism's extra, expert parallelism's on a MoE layer (`ep`)
        and, when `zero` is given, that of `units` data-parallel units wrapped for that ZeRO
        level (the runtime wraps every block, and under EP a MoE block's experts apart: two);
        a share of the cores stretches them (they run on one thread)."""
        rows, _ = self._at_threads(list(self.profile.overhead))
        row = rows[0]
        fwd = row.moe_forward_s if moe else row.layer_forward_s
        bwd = row.moe_backward_s if moe else row.layer_backward_s
        if tp:
            fwd, bwd = fwd + row.tp_forward_s, bwd + row.tp_backward_s
        if ep and moe:
            fwd, bwd = fwd + row.ep_forward_s, bwd + row.ep_backward_s
        if zero is not None:
            dp_f, dp_b = row.data_parallel_s(zero)
            fwd, bwd = fwd + units * dp_f, bwd + units * dp_b
        return fwd / self.share, bwd / self.share

    def collective(self, op: str, n: int, gap_s: float | None = None) -> tuple[float, float]:
        """(alpha s, beta bytes/s) of `op` over `n` ranks, each issued after `gap_s` seconds of
        compute (None: the longest gap measured), measured with as many local processes running
        as this run has (else the nearest): linear in the gap between the two measured gaps
        around it, clamped at the ends. An unmeasured group size scales the nearest measured
        one as a ring does: alpha with the n - 1 steps, beta so that the bus bandwidth stays
        the same."""
        rows = [c for c in self.profile.collective if c.op == op]
        if not rows:
            raise ConfigError(
                f"device profile {self.profile.path!r} has no {op} measurement; re-run "
                "`fivefold calibrate` with --nproc 2 or more."
            )
        near = min(rows, key=lambda c: (abs(c.ranks - n), abs(c.world - self.ranks), -c.ranks))
        rows = sorted(
            (c for c in rows if (c.ranks, c.world) == (near.ranks, near.world)),
            key=lambda c: c.gap_s,
        )
        gap = rows[-1].gap_s if gap_s is None else gap_s
        alpha, beta = _between(gap, rows)
        if near.ranks == n:
            return alpha, beta
        steps = (n - 1) / (near.ranks - 1)
        beta *= bus_factor(op, near.ranks) / bus_factor(op, n)
        return alpha * (1 if op == "send_recv" else steps), beta


def _between(gap: float, rows: list[Collective]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) at `gap` seconds of compute: alpha and 1 / beta linear between
    the two rows (ascending in gap) around it, a row's own values at or beyond the ends."""
    if gap <= rows[0].gap_s:
        return rows[0].alpha_s, rows[0].beta_bytes_per_s
    for lo, hi in itertools.pairwise(rows):
        if gap < hi.gap_s:
            w = (gap - lo.gap_s) / (hi.gap_s - lo.gap_s)
            alpha = lo.alpha_s + w * (hi.alpha_s - lo.alpha_s)
            inv = 1 / lo.beta_bytes_per_s + w * (1 / hi.beta_bytes_per_s - 1 / lo.beta_bytes_per_s)
            return alpha, 1.0 / inv
    return rows[-1].alpha_s, rows[-1].beta_bytes_per_s
