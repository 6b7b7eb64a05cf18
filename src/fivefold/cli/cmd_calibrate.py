"""`fivefold calibrate`: measure this machine into a device profile the planner and runs read.

The measurements are `fivefold.calibration` (kernels: `compute`; collectives over spawned
ranks: `comm`); the profile format is `fivefold.specs.profile`.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.launch.host_memory import keep_freed_memory
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import model_preset
from fivefold.specs.profile import (
    PROFILE_ENV,
    available_cores,
    default_profile_path,
    parse_profile,
)
from fivefold.specs.recipe import merge, model_from_dict, parse_overrides, read_toml

# torch, rich and fivefold.calibration and .parallel (torch) are imported inside the functions:
# `fivefold --help` imports every command module (fivefold.cli.main) and must stay quick and
# torch-free.

DEFAULT_OUT = "device-profile.toml"

_DESCRIPTION = """\
Measure the machine at hand and write a device profile (TOML) that `fivefold plan --cluster
PROFILE.toml`, recipes (`[cluster] profile = "PROFILE.toml"`) and CPU training runs (the
default location, with --install) use to predict step time, and against whose measured matmul
peak MFU and HFU are reported (without a profile a CPU run's MFU is against a fixed reference).

Measured: matmul throughput over the GEMM shapes of the recipe's model (q/k/v/o, MLP, LM head,
router; forward and both backward passes; each tensor-parallel split up to --nproc; fp32, and
bf16 where the CPU has native bf16) and over a grid of shapes independent of the model (the
planner interpolates any model's shapes among them, so one profile serves every model), the
experts' grouped matmuls at each expert-parallel split, its attention core (causal, forward
and backward; and over a grid of lengths, head widths and batches) and each context-parallel
split's block attention, element-wise, loss and optimizer bandwidth (alone and with every process of
a run streaming at once), the fixed cost of a layer (dense, MoE, and the extra of tensor and
expert parallelism and of a ZeRO-3, ZeRO-1/2 and ZeRO-0 unit), and every
collective the runtime uses (all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) at
several sizes over --nproc real processes (gloo on CPU; NCCL among the local GPUs, up to
1 GiB), each issued as a step issues it (back to back,
and after each model's MLP GEMM on every rank: on a CPU a collective costs more after
compute), printed like nccl-tests and fitted to the planner's alpha-beta model. Where torch
sees a GPU, the GPU is measured (CUDA events; GEMMs in bf16 and, on compute capability 8.9+,
FP8; attention in bf16; HBM bandwidths; NCCL when there are 2 or more GPUs): written, not yet
run on one by us. The defaults
cost about 65 s of CPU time on two cores with native bf16 (42 s before the grids, which took
25 s of wall time idle): expect about 40 s idle; measured only under a load average of 15-19,
where they took 5-8 min. --quick measures fewer shapes and sizes for a fast, rougher profile
(18 s of CPU time; 48 s under that load). Calibrate on an idle machine: other
work slows the multi-threaded and collective measurements (one-thread kernels are timed on the
thread's CPU clock and are robust to it).

The profile is written to --out (default ./device-profile.toml) and used where it is named.
--install writes it to the default location instead, which every CPU run without a [cluster]
then uses (each run's header says which profile it uses and where it came from). Before it
starts, calibrate prints its time estimate; a progress bar shows the time left.
"""

_EPILOG = """\
examples:
  fivefold calibrate                                  # small preset, 2 ranks, ./device-profile.toml
  fivefold calibrate configs/tiny-cpu.toml --nproc 4 --out tiny-4.toml
  fivefold calibrate --install                        # CPU runs without [cluster] then use it
  fivefold calibrate configs/small-cpu.toml plan.micro_batch=2 --also tiny-moe --nproc 4
  fivefold plan estimate configs/small-cpu.toml --cluster tiny-4.toml --gpus 2
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure this machine (kernels, collectives) into a device profile",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "items",
        nargs="*",
        metavar="RECIPE|OVERRIDE",
        help="a recipe whose model and micro-batch set the shapes measured (default: the small "
        "preset, micro-batch 1) and section.field=value overrides (e.g. plan.micro_batch=4)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="local ranks for the collectives, measured among 2, 4, ... up to NPROC processes "
        "in turn (default 2)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help=f"where to write the profile (default: {DEFAULT_OUT} in the current directory); "
        'name it with --cluster PATH or [cluster] profile = "PATH"',
    )
    where.add_argument(
        "--install",
        action="store_true",
        help=f"write it to the default location (${PROFILE_ENV}, else "
        "$XDG_CACHE_HOME/fivefold/device-profile.toml), which every CPU run without a "
        "[cluster] then uses",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="PRESET",
        help="also measure this model preset's matmul shapes, attention, MoE layer overhead "
        "and collectives after its MLP GEMM (repeatable; e.g. --also tiny-moe for "
        "benchmarks/plan_vs_run.py's MoE rows)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and sizes (seconds)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=handle, imports=("torch",))


def model_and_plan(items: list[str]) -> tuple[Any, Any]:
    """The recipe's model and its micro-batch (only these set the shapes measured)."""
    paths = [i for i in items if "=" not in i]
    if len(paths) > 1:
        raise ConfigError(f"more than one recipe given ({', '.join(paths)}); name one.")
    data = read_toml(paths[0]) if paths else {"model": {"preset": "small"}}
    data = merge(data, parse_overrides([i for i in items if "=" in i]))
    model = model_from_dict(data.get("model", {}))
    mb = data.get("plan", {}).get("micro_batch", 1)
    if not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
        raise ConfigError(f"plan.micro_batch = {mb!r}: must be a whole number >= 1.")
    return model, ParallelPlan(micro_batch=mb, precision="fp32")


def handle(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: the number of ranks must be at least 1.")
    out = default_profile_path() if args.install else Path(args.out or DEFAULT_OUT).expanduser()
    if out.exists() and out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a directory; name a .toml file.")
    model, plan = model_and_plan(args.items)
    also = tuple(model_preset(name) for name in args.also)  # ConfigError naming the choices
    console = Console(highlight=False, soft_wrap=True)
    keep_freed_memory()  # as training runs keep it: kernels timed without fresh page faults
    profile = run_calibration(
        model, plan, args.nproc, args.quick, console, not args.no_progress, also
    )
    text = profile.to_toml()
    parse_profile(tomllib.loads(text))  # what we write must read back
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print_summary(console, profile)
    use = (
        "every CPU run without a [cluster] now uses it (its header says so)"
        if args.install
        else f'recipes: [cluster] profile = "{out}" (CPU runs use no profile unless named)'
    )
    console.print(
        f"wrote {out}\nuse it: fivefold plan estimate RECIPE --cluster {out} --gpus N; {use}",
        markup=False,
    )
    return 0


def duration(seconds: float) -> str:
    """12 s, 3 min 20 s, 1 h 05 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def run_calibration(
    model, plan, ranks: int, quick: bool, console, progress: bool, also: tuple = ()
):
    """`fivefold.calibration.session`'s measurements, printed as they come, into a profile."""
    from fivefold.calibration.session import LOADED, plan_calibration
    from fivefold.calibration.session import run_calibration as measure

    cal = plan_calibration(model, plan, ranks, quick, also)
    announce_device(console, cal)
    console.print(
        f"calibrate: {len(cal.kernels)} kernel measurements and {cal.collectives} collective "
        f"ones over up to {cal.ranks} rank(s) on {available_cores()} core(s): about "
        f"{duration(cal.idle_s)} on idle cores, up to {duration(cal.idle_s * LOADED)} on a "
        "loaded machine"
    )
    bar = progress_bar(console, progress)
    with bar:
        task = bar.add_task("calibrate", total=len(cal.kernels) + cal.collectives, what="")
        rows_seen = []

        def on_row(s) -> None:
            if not rows_seen:
                print_collective_header(console, cal.ranks)
            rows_seen.append(s)
            console.print(
                f"{s.op:>15} {s.ranks:>5} {s.world:>5} {s.gap_s * 1e3:>7.2f} {s.size_bytes:>10} "
                f"{s.time_s * 1e6:>10.1f} "
                f"{s.algbw_bytes_per_s / 1e9:>12.3f} {s.busbw_bytes_per_s / 1e9:>12.3f}"
            )
            bar.update(task, what=f"{s.op} {s.ranks} ranks {s.size_bytes} B")
            bar.advance(task)

        profile = measure(
            cal, lambda label: bar.update(task, what=label), lambda: bar.advance(task), on_row
        )
    if cal.ranks < 2:
        why = "one GPU here" if cal.cuda else "--nproc 1"
        console.print(f"collectives: not measured with {why} (plans then need one rank).")
    return profile


def announce_device(console, cal) -> None:
    """Say what is measured: the GPU, or the CPU's bf16."""
    from fivefold.calibration.machine import measured_device_name
    from fivefold.calibration.matmul import fp8_supported

    if cal.cuda:
        fp8 = "bf16 and fp8" if fp8_supported() else "bf16 (no native fp8 here)"
        console.print(
            f"measuring the GPU {measured_device_name()}: {fp8} matmuls, timed by CUDA events"
        )
    elif cal.bf16 != "native":
        console.print(
            "bf16: this CPU has neither amx_bf16 nor avx512_bf16, so torch emulates bf16 "
            "matmuls (often many times slower than fp32): bf16 is not measured; plan fp32."
        )
    elif cal.quick:
        console.print("bf16: native on this CPU, but --quick measures fp32 only.")


def progress_bar(console, progress: bool):
    """The calibration's progress bar (a rich Progress; disabled unless `progress`)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]calibrate"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[what]}"),
        console=console,
        transient=True,
        disable=not progress,
    )


def print_collective_header(console, ranks: int) -> None:
    """The legend and column heads of the nccl-tests-like collective rows."""
    console.print(
        f"collectives over {ranks} rank(s) "
        "(gap: each rank's compute before each call; size: bytes; time: what one call adds, "
        "the slowest rank's mean; algbw = size / time; busbw as nccl-tests)"
    )
    console.print(
        f"{'op':>15} {'ranks':>5} {'procs':>5} {'gap(ms)':>7} {'size':>10} {'time(us)':>10} "
        f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
    )


def print_summary(console, profile) -> None:
    """Peaks, bandwidths, overheads and the alpha-beta fits, one line each."""
    threads = sorted({m.threads for m in profile.matmul})
    for t in threads:
        for dtype in sorted({m.dtype for m in profile.matmul}):
            rates = [m.flops_per_s for m in profile.matmul if (m.threads, m.dtype) == (t, dtype)]
            if rates:
                console.print(
                    f"matmul {dtype}, {t} thread(s): best {max(rates) / 1e9:.1f} GFLOP/s, "
                    f"worst {min(rates) / 1e9:.1f} GFLOP/s over {len(rates)} shapes"
                )
        for g in (g for g in profile.grouped_matmul if g.threads == t):
            console.print(
                f"grouped matmul {g.dtype} {g.groups} experts x {g.tokens} rows x {g.n} x {g.k} "
                f"{g.layout}, {t} thread(s): {g.flops_per_s / 1e9:.1f} GFLOP/s"
            )
        for a in (a for a in profile.attention if a.threads == t):
            console.print(
                f"attention {a.heads}/{a.kv_heads} heads x seq {a.seq} x {a.head_dim}"
                f"{f' (CP{a.cp} blocks)' if a.cp > 1 else ''}, {t} "
                f"thread(s): forward {a.forward_flops_per_s / 1e9:.1f}, backward "
                f"{a.backward_flops_per_s / 1e9:.1f} GFLOP/s"
            )
        for n in sorted({b.processes for b in profile.bandwidth if b.threads == t}):
            bws = ", ".join(
                f"{b.kind} {b.bytes_per_s / 1e9:.2f}"
                for b in profile.bandwidth
                if (b.threads, b.processes) == (t, n)
            )
            console.print(f"bandwidth (GB/s), {t} thread(s), {n} process(es) at once: {bws}")
        for o in (o for o in profile.overhead if o.threads == t):
            console.print(
                f"layer overhead (ms forward / backward), {t} thread(s): dense "
                f"{o.layer_forward_s * 1e3:.3f} / {o.layer_backward_s * 1e3:.3f}, MoE "
                f"{o.moe_forward_s * 1e3:.3f} / {o.moe_backward_s * 1e3:.3f}, TP extra "
                f"{o.tp_forward_s * 1e3:.3f} / {o.tp_backward_s * 1e3:.3f}, ZeRO-3 extra "
                f"{o.fsdp_forward_s * 1e3:.3f} / {o.fsdp_backward_s * 1e3:.3f}, ZeRO-1/2 "
                f"extra {o.shard_forward_s * 1e3:.3f} / {o.shard_backward_s * 1e3:.3f}, "
                f"ZeRO-0 extra {o.replicate_forward_s * 1e3:.3f} / "
                f"{o.replicate_backward_s * 1e3:.3f}, EP extra (MoE) "
                f"{o.ep_forward_s * 1e3:.3f} / {o.ep_backward_s * 1e3:.3f}"
            )
    for c in profile.collective:
        console.print(
            f"{c.op} over {c.ranks} ranks ({c.world} processes, after "
            f"{c.gap_s * 1e3:.2f} ms of compute): alpha "
            f"{c.alpha_s * 1e6:.1f} us, beta "
            f"{c.beta_bytes_per_s / 1e9:.3f} GB/s"
        )
