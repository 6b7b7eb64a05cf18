"""Device profiles: what `fivefold calibrate` measured on a machine, as data the planner reads.

The file format (every table and field, with units) is in docs/device-profile.md. This
module holds the format, its reading and validation and the default paths; a profile's
`GPUSpec` (`fivefold.specs.hardware.profile_device`), its `ClusterSpec`
(`fivefold.specs.cluster.profile_cluster`) and the planner's rates
(`planner.rates.device.MeasuredRates`) are built on it. `RankProfile`: one rank's share of a
CPU's cores (`threads_per_rank`, the launcher's rule).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import MISSING, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.specs.toml_text import toml_value

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
    # "sdpa": one document per row; "varlen", "flex", "document_attention": packed documents
    # through that kernel (seq one document's length, batch the documents)
    kernel: str = "sdpa"


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
    host_s: float = 0.0  # the runtime's DTensor path's own CPU per call (`CollectiveSample`)


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
    host_s: float = 0.0
    """Main-thread CPU seconds a DTensor redistribution (tensor parallelism's sequence
    all-gather and reduce-scatter) adds to this raw collective on a CPU: its planning, the
    functional collective's wrapper and wait, the shard's reassembly; 0 when not measured."""


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

    def to_toml(self) -> str:
        """The profile as TOML text that `parse_profile` reads back to an equal profile."""
        lines = [
            "# fivefold device profile, written by `fivefold calibrate`; read by `fivefold plan",
            "# --cluster THIS.toml`, recipes' cluster.profile and CPU training runs.",
            f"format = {FORMAT}",
            "",
            "[device]",
        ]
        for key in ("name", "kind", "cores", "memory_bytes", "backend", "ranks", "bf16"):
            lines.append(f"{key} = {toml_value(getattr(self, key))}")
        for key in ("model", "torch", "created"):
            lines.append(f"{key} = {toml_value(getattr(self, key))}")
        for table, cls in _ROWS.items():
            for row in getattr(self, table):
                lines += ["", f"[[{table}]]"]
                lines += [
                    f"{name} = {toml_value(getattr(row, name))}"
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
        if name not in row and f.default is not MISSING:  # a field added since
            continue
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


# ---- one rank's view ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RankProfile:
    """A profile as one of `ranks` local processes reads it (module doc): its `threads` and its
    `share` of the cores (a CUDA profile: one thread, the whole GPU); `rows` picks what it reads.
    The planner's rates (`fivefold.planner.rates.device.MeasuredRates`) build on it."""

    profile: DeviceProfile
    ranks: int
    threads: int
    share: float

    @classmethod
    def of(cls, profile: DeviceProfile, ranks: int, threads: int | None = None) -> RankProfile:
        """One of `ranks` processes using `threads` threads (default `threads_per_rank`)."""
        ranks = max(1, ranks)
        if profile.kind == "cuda":  # each rank has its own GPU: no thread count, no share
            return cls(profile, ranks, 1, 1.0)
        threads = threads or threads_per_rank(ranks, profile.cores)
        return cls(profile, ranks, threads, min(1.0, profile.cores / (ranks * threads)))

    def rows(self, rows: list) -> tuple[list, float]:
        """Of `rows`, those measured at the thread count nearest this rank's, and the factor
        that scales their rates to this rank (threads over theirs, times the share)."""
        if not rows:
            return [], 1.0
        best = min({r.threads for r in rows}, key=lambda t: (abs(t - self.threads), -t))
        return [r for r in rows if r.threads == best], self.threads / best * self.share

    def peak(self, dtype: str) -> float:
        """The best measured matmul FLOP/s of `dtype` for this rank."""
        rows, scale = self.rows([m for m in self.profile.matmul if m.dtype == dtype])
        return max(r.flops_per_s for r in rows) * scale

    def bandwidth(self, kind: str) -> float:
        """Bytes/s of `kind` for this rank: the rows at the nearest thread count measured with
        as many processes streaming at once as this run has ranks (else the nearest)."""
        rows, scale = self.rows([b for b in self.profile.bandwidth if b.kind == kind])
        near = min({r.processes for r in rows}, key=lambda n: (abs(n - self.ranks), n))
        return max(r.bytes_per_s for r in rows if r.processes == near) * scale
