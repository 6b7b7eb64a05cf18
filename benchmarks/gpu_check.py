"""One GPU, one command: fivefold's runs beside a plain Hugging Face loop of the same shape, with
the targets they must meet.

    python benchmarks/gpu_check.py [--dry-run] [--torchao-wheel WHEEL] [--json FILE]
        [--only eager,hf-eager,...] [--budget 355]

The model: a 1.10B Llama (16 layers, hidden 2048, 32/8 heads, SwiGLU 8192, vocab 32000), seq
4K x micro-batch 4, bf16-mixed, fused AdamW, the embedded corpus, no `[cluster]` (fivefold
finds the GPU itself). Each run is a subprocess with a time budget; a failure or a timeout is
a row of the table, not the end of the check:
- fivefold eager, compile (`train.compile=true`), FP8 tensorwise + compile (skipped with the
  reason where torchao or an FP8 GPU is missing), seq 32K and 128K (micro-batch 1, full
  recompute): tokens/s and MFU (median of the logged steps after the first two), peak memory,
  and the layout report's plan-vs-run errors (memory, step);
- `fivefold tune` (seconds to its first trial line, and in all) and `fivefold calibrate --quick`
  (seconds);
- `LlamaForCausalLM` (transformers; SDPA, autocast bf16, fused AdamW, random tokens), eager and
  with each decoder layer `.compile()`d: tokens/s and peak (`max_memory_allocated` over the
  steps after the warm-up), its MFU derived from fivefold eager's (same FLOPs per token).
Prints a text table and the targets met or missed; writes JSON to --json, else to
$OUT/gpu_check.json when $OUT is set. No install needed: the project runs from its `src` (put
on PYTHONPATH for every sub-run); `--torchao-wheel` installs a carried torchao wheel with
`pip install --no-index --no-deps --target /tmp/site` first (a wheel under `.whl/` is found by
itself). `--dry-run` (CPU): builds every command line, validates each fivefold recipe (as on
an H100, `cluster.preset=dgx-h100` standing in for the GPU this machine lacks), parses the
tune and calibrate command lines, and builds the HF model on the meta device when transformers
is installed (else says skipped); it runs nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = "/tmp/site"
MODEL = {
    "preset": "small",  # its tokenizer and defaults; the fields below make it the 1.10B Llama
    "layers": 16,
    "hidden": 2048,
    "heads": 32,
    "kv_heads": 8,
    "ffn": 8192,
    "vocab": 32000,
    "seq_len": 4096,
}
MICRO_BATCH = 4
TRAIN = {
    "steps": 8,
    "warmup_steps": 1,
    "device": "cuda",
    "log_every": 1,
    "eval_every": 0,
    "save_final": False,
    "tensorboard": False,
    "progress": False,
    "resume": False,
}
LONG = ["plan.micro_batch=1", 'plan.recompute="full"']
SKIP_STEPS = 2  # logged steps left out of the medians (warm-up, compilation)


@dataclass
class Run:
    """One sub-run: `kind` "train" (fivefold train + overrides), "hf" (the HF loop), "tune",
    "calibrate"; `budget_s` its time limit."""

    name: str
    kind: str
    overrides: list[str] = field(default_factory=list)
    budget_s: float = 60.0
    steps: int = 8
    fp8: bool = False


RUNS = [  # each fivefold run beside the HF loop it is compared with; budgets in seconds
    Run("eager", "train", [], 35),
    Run("hf-eager", "hf", ["eager"], 25),
    Run("compile", "train", ["train.compile=true"], 55),
    Run("hf-compile", "hf", ["compile"], 40),
    Run("fp8-compile", "train", ['plan.fp8="tensorwise"', "train.compile=true"], 55, fp8=True),
    Run("calibrate", "calibrate", [], 60),
    Run("tune", "tune", [], 40),
    Run("seq32k-full", "train", ["model.seq_len=32768", *LONG], 35, steps=5),
    Run("seq128k-full", "train", ["model.seq_len=131072", *LONG], 45, steps=4),
]


# ---- the recipe and the command lines ---------------------------------------------------------
def recipe_text() -> str:
    """The 1.10B recipe (no [cluster]: fivefold resolves the GPU)."""
    lines = ["[model]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in MODEL.items()]
    lines += ["", "[plan]", f"micro_batch = {MICRO_BATCH}", 'precision = "bf16-mixed"', ""]
    lines += ["[train]"] + [f"{k} = {json.dumps(v)}" for k, v in TRAIN.items()]
    return "\n".join(lines) + "\n"


def command(run: Run, recipe: Path, work: Path) -> list[str]:
    """The sub-run's command line."""
    py = [sys.executable]
    if run.kind == "train":
        items = [*run.overrides, f"train.steps={run.steps}", f"train.run_dir={work / run.name}"]
        return [*py, "-m", "fivefold", "train", str(recipe), *items, "--fresh"]
    if run.kind == "tune":
        return [*py, "-m", "fivefold", "tune", str(recipe), "--policies", "none,full",
                "--max-micro-batch", "4"]  # fmt: skip
    if run.kind == "calibrate":
        out = work / "profile.toml"
        return [*py, "-m", "fivefold", "calibrate", str(recipe), "--quick", "--nproc", "1",
                "--no-progress", "--out", str(out)]  # fmt: skip
    return [*py, str(Path(__file__).resolve()), "--hf", run.overrides[0], "--steps", str(run.steps)]


def sub_env(site: bool) -> dict[str, str]:
    """The sub-runs' environment: the project's src (and the carried torchao) importable."""
    paths = ([SITE] if site else []) + [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "PYTHONUNBUFFERED": "1"}  # fmt: skip


# ---- running one sub-run ----------------------------------------------------------------------
def run_streamed(cmd: list[str], env: dict, budget_s: float) -> tuple[int | None, list, float]:
    """(exit code or None on timeout, [(seconds since start, line)], wall seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    reader.join(timeout=5)
    return code, lines, time.perf_counter() - start


def _median_after_warmup(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records[SKIP_STEPS:] if r.get(key) is not None]
    values = values or [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def train_result(run_dir: Path) -> dict:
    """tokens/s, MFU, peak and plan-vs-run errors from a fivefold run's metrics and summary."""
    out: dict = {}
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [r for r in records if "tokens_per_s" in r]
    out["tokens_per_s"] = _median_after_warmup(steps, "tokens_per_s")
    out["mfu"] = _median_after_warmup(steps, "mfu")
    peaks = [r["peak_memory_bytes"] for r in steps if r.get("peak_memory_bytes")]
    out["peak_bytes"] = max(peaks) if peaks else None
    report = next((r["plan_vs_run"] for r in records if r.get("plan_vs_run")), None)
    if report:
        stage = report["stages"][0]
        out["memory_error"] = stage.get("memory_error")
        out["step_error"] = stage.get("step_error")
        out["plan_note"] = report.get("note", "")
    return out


def hf_result(lines: list) -> dict:
    for _, line in lines:
        if line.startswith("GPU_CHECK_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    return {}


def tune_result(lines: list) -> dict:
    rows = [t for t, line in lines if line.split()[:1] in (["none"], ["full"], ["selective"])]
    return {"first_trial_s": rows[0] if rows else None, "trials": len(rows)}


def skip_reason(run: Run, site: bool) -> str | None:
    """Why an FP8 run cannot run here (None: it can)."""
    if not run.fp8:
        return None
    import importlib.util

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return "FP8 needs a GPU of compute capability 8.9+"
    if importlib.util.find_spec("torchao") is None and not Path(SITE, "torchao").is_dir():
        return "torchao is not installed (give --torchao-wheel)"
    return None


def execute(run: Run, recipe: Path, work: Path, site: bool, left_s: float) -> dict:
    """Run one sub-run within min(its budget, the time left); its row."""
    row: dict = {"run": run.name, "kind": run.kind, "status": "ok"}
    why = skip_reason(run, site)
    if why:
        return {**row, "status": f"skipped: {why}"}
    if left_s < 10:
        return {**row, "status": "skipped: the check's total budget is spent"}
    cmd = command(run, recipe, work)
    code, lines, wall = run_streamed(cmd, sub_env(site), min(run.budget_s, left_s))
    row["wall_s"] = wall
    if code is None:
        row["status"] = f"timed out after {wall:.0f} s"
    elif code != 0:
        tail = next((ln for _, ln in reversed(lines) if ln.strip()), "")
        row["status"] = f"failed (exit {code}): {tail[:160]}"
    if run.kind == "train":
        row.update(train_result(work / run.name))
    elif run.kind == "hf":
        row.update(hf_result(lines))
    elif run.kind == "tune":
        row.update(tune_result(lines))
    return row


# ---- the plain Hugging Face loop (run as a sub-run of this script) ----------------------------
def hf_config(seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=MODEL["vocab"], hidden_size=MODEL["hidden"], intermediate_size=MODEL["ffn"],
        num_hidden_layers=MODEL["layers"], num_attention_heads=MODEL["heads"],
        num_key_value_heads=MODEL["kv_heads"], max_position_embeddings=seq,
        attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip


def hf_loop(mode: str, steps: int) -> dict:
    """Train `LlamaForCausalLM` on random tokens for `steps` steps; tokens/s (median step of
    those after the warm-up) and the peak allocated over them."""
    import torch
    from transformers import LlamaForCausalLM

    seq = MODEL["seq_len"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(seq)).cuda().train()
    if mode == "compile":
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, MODEL["vocab"], (MICRO_BATCH, seq), device="cuda")
    times = []
    for step in range(steps):
        if step == SKIP_STEPS:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        tick = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - tick)
    step_s = statistics.median(times[SKIP_STEPS:] or times)
    return {
        "tokens_per_s": MICRO_BATCH * seq / step_s,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "params": sum(p.numel() for p in model.parameters()),
    }


# ---- targets and the table --------------------------------------------------------------------
def targets(rows: dict[str, dict]) -> list[tuple[str, bool | None, str]]:
    """(target, met (None: not measured), figures)."""

    def tps(name: str) -> float | None:
        return rows.get(name, {}).get("tokens_per_s")

    def ratio(a: str, b: str, least: float, what: str) -> tuple[str, bool | None, str]:
        x, y = tps(a), tps(b)
        if not x or not y:
            return what, None, "not measured"
        return what, x / y >= least, f"{x / y:.3f}x"

    out = [
        ratio("eager", "hf-eager", 1.05, "eager >= 1.05x HF eager"),
        ratio("compile", "hf-compile", 1.0, "compile >= 1.0x HF compiled blocks"),
    ]
    fp8 = rows.get("fp8-compile", {})
    if fp8.get("status", "").startswith("skipped"):
        out.append(("FP8 faster than bf16 compile", True, fp8["status"]))
    else:
        out.append(ratio("fp8-compile", "compile", 1.0 + 1e-9, "FP8 faster than bf16 compile"))
    ff = [r for r in rows.values() if r.get("kind") == "train" and r["status"] == "ok"]
    mfus = [r["mfu"] for r in ff if r.get("mfu") is not None]
    out.append(("MFU <= 100 %", all(m <= 1.0 for m in mfus) if mfus else None,
                ", ".join(f"{m:.1%}" for m in mfus)))  # fmt: skip
    for key, bound, what in (("memory_error", 0.05, "peak"), ("step_error", 0.10, "step")):
        errs = [(r["run"], r.get(key)) for r in ff]
        known = [e for _, e in errs if e is not None]
        met = all(abs(e) <= bound for e in known) and len(known) == len(errs) if errs else None
        figures = ", ".join(f"{n} {'-' if e is None else f'{e:+.1%}'}" for n, e in errs)
        out.append((f"predicted {what} within {bound:.0%}", met, figures))
    cal = rows.get("calibrate", {})
    ok = cal.get("status") == "ok" and cal.get("wall_s") is not None
    out.append(("calibrate --quick < 60 s", cal["wall_s"] < 60 if ok else None,
                f"{cal.get('wall_s', 0):.1f} s, {cal.get('status', '-')}"))  # fmt: skip
    first = rows.get("tune", {}).get("first_trial_s")
    out.append(("tune: first trial line < 30 s", None if first is None else first < 30,
                "-" if first is None else f"{first:.1f} s"))  # fmt: skip
    return out


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    return {"tps": f"{value / 1e3:.1f}k", "pct": f"{value:.1%}", "gib": f"{value / 2**30:.1f}",
            "err": f"{value:+.1%}", "s": f"{value:.0f}"}[kind]  # fmt: skip


def table(rows: list[dict], met: list) -> str:
    head = f"{'run':<14} {'tok/s':>7} {'MFU':>6} {'peak GiB':>8} {'mem err':>8} {'step err':>8} {'wall s':>6}  status"  # noqa: E501
    lines = [head]
    cells = [("tokens_per_s", "tps", 7), ("mfu", "pct", 6), ("peak_bytes", "gib", 8)]
    cells += [("memory_error", "err", 8), ("step_error", "err", 8), ("wall_s", "s", 6)]
    for r in rows:
        text = " ".join(f"{_fmt(r.get(key), kind):>{width}}" for key, kind, width in cells)
        lines.append(f"{r['run']:<14} {text}  {r['status']}")
    lines.append("")
    for what, ok, figures in met:
        mark = "n/a " if ok is None else ("met " if ok else "MISS")
        lines.append(f"[{mark}] {what}: {figures}")
    return "\n".join(lines)


# ---- the dry run ------------------------------------------------------------------------------
def dry_run(runs: list[Run], recipe: Path, work: Path) -> int:
    """Build and print every command; validate the recipes, the tune and calibrate command
    lines and the HF model (meta device); 0 when all hold."""
    from fivefold.cli.main import build_parser
    from fivefold.train.entry import load_run

    stand_in = ['cluster.preset="dgx-h100"', "cluster.gpus=1"]  # the GPU this CPU lacks
    problems = []
    for run in runs:
        cmd = command(run, recipe, work)
        print(f"{run.name:<14} ({run.budget_s:.0f} s) {' '.join(cmd[1:])}")
        try:
            if run.kind == "train":
                items = [*run.overrides, f"train.steps={run.steps}", *stand_in]
                load_run(recipe, items, world_size=1)
            elif run.kind in ("tune", "calibrate"):
                build_parser().parse_args(cmd[3:])
            elif run.kind == "hf":
                print(f"{'':<14} {hf_meta_check()}")
        except Exception as err:  # report every failing command, then fail
            problems.append(f"{run.name}: {type(err).__name__}: {err}")
    print("\n".join(problems) if problems else f"dry run: {len(runs)} commands checked")
    return 1 if problems else 0


def hf_meta_check() -> str:
    """The HF model built on the meta device: its parameters beside fivefold's count."""
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError:
        return "HF loop: skipped (transformers is not installed)"
    from fivefold.specs.model import param_count
    from fivefold.specs.recipe import model_from_dict

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(MODEL["seq_len"]))
    hf = sum(p.numel() for p in model.parameters())
    ours = param_count(model_from_dict(MODEL))
    if hf != ours:
        raise ValueError(f"HF model has {hf} parameters, fivefold's {ours}: shapes differ")
    return f"HF loop: LlamaForCausalLM builds on meta, {hf / 1e9:.3f}B parameters as fivefold's"


# ---- main -------------------------------------------------------------------------------------
def install_torchao(wheel: str | None) -> bool:
    """Install the carried torchao wheel into /tmp/site (no index, no deps); True if there."""
    wheels = [wheel] if wheel else sorted(str(p) for p in (REPO / ".whl").glob("torchao-*.whl"))
    if not wheels:
        return Path(SITE, "torchao").is_dir()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--target", SITE, wheels[-1]]  # fmt: skip
    return subprocess.run(cmd, check=False).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="check the commands on CPU")
    parser.add_argument("--torchao-wheel", help="a torchao wheel to install into /tmp/site")
    parser.add_argument("--json", help="write the rows and targets here")
    parser.add_argument("--only", help=f"comma-separated runs of {', '.join(r.name for r in RUNS)}")
    parser.add_argument("--budget", type=float, default=355.0, help="seconds for all runs")
    parser.add_argument("--hf", choices=("eager", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hf:  # a sub-run: the HF loop
        print("GPU_CHECK_RESULT " + json.dumps(hf_loop(args.hf, args.steps)), flush=True)
        return 0
    runs = RUNS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {r.name for r in RUNS}
        if unknown:
            parser.error(f"--only: unknown run(s) {', '.join(sorted(unknown))}")
        runs = [r for r in RUNS if r.name in names]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        recipe = work / "llama-1b.toml"
        recipe.write_text(recipe_text())
        if args.dry_run:
            return dry_run(runs, recipe, work)
        site = install_torchao(args.torchao_wheel)
        started = time.perf_counter()
        rows = []
        for run in runs:
            left = args.budget - (time.perf_counter() - started)
            rows.append(execute(run, recipe, work, site, left))
            print(f"# {rows[-1]['run']}: {rows[-1]['status']}", flush=True)
    by_name = {r["run"]: r for r in rows}
    hf, ff = by_name.get("hf-eager", {}), by_name.get("eager", {})
    if hf.get("tokens_per_s") and ff.get("tokens_per_s") and ff.get("mfu"):
        for name in ("hf-eager", "hf-compile"):  # same model, same FLOPs per token
            if by_name.get(name, {}).get("tokens_per_s"):
                r = by_name[name]
                r["mfu"] = ff["mfu"] * r["tokens_per_s"] / ff["tokens_per_s"]
    met = targets(by_name)
    print(table(rows, met))
    print(f"total {time.perf_counter() - started:.0f} s")
    out = args.json or (
        str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else None
    )
    if out:
        payload = {
            "rows": rows,
            "targets": [{"target": t, "met": m, "figures": f} for t, m, f in met],
        }
        Path(out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
