"""One GPU, one command: fivefold's runs beside a plain Hugging Face loop doing the same work,
with the targets they must meet.

    python benchmarks/gpu_check.py [--dry-run] [--torchao-wheel WHEEL] [--json FILE]
        [--only eager,hf-eager,...] [--budget SECONDS]

The model: a 1.10B Llama (16 layers, hidden 2048, 32/8 heads, SwiGLU 8192, vocab 32000), seq
4K x micro-batch 4, bf16-mixed, fused AdamW, no `[cluster]` (fivefold finds the GPU itself).

Equal work. Both sides train on the same batches: the embedded corpus written out as ONE long
document (`data.inputs`, one .txt file), so every row of every batch is one document and both
sides run full causal attention over each row (fivefold: SDPA `is_causal`, its one-document
path; HF: SDPA, no mask). The HF sub-run reads its batches through fivefold's own data pipeline
from the same recipe (`load_train_data`: the same tokens, labels and positions, in the same
order) and computes the same next-token loss. Each side reports its own FLOP count: fivefold's
MFU from its metrics (per document = per row here), the HF loop's from its own config
(`spec_from_hf_config`: what `transformers` builds) at one document per row, against the GPU's
catalogued dense bf16 peak. The 32K and 128K rows (micro-batch 1, full recompute) see single
32K / 128K-token documents, so they test long context. fivefold's usual packed path (several
documents per row, varlen / FlexAttention) is not compared here: there is no HF loop that does
that work with stock kernels on this image (no flash-attn).

Each run is a subprocess with a time budget; a failure or a timeout is a row of the table, not
the end of the check. The budgets add up to the total (`TOTAL_BUDGET_S`, default of --budget,
sized to fit one 10-minute device call with the torchao install), and each compiled run has
`COLD_COMPILE_S` more than its eager twin for a cold Inductor cache:
- fivefold eager, compile (`train.compile=true`), FP8 tensorwise + compile (skipped with the
  reason where torchao or an FP8 GPU is missing), seq 32K and 128K: tokens/s and MFU (median of
  the logged steps after the first two), peak memory, and the layout report's plan-vs-run
  errors (memory, step);
- `fivefold tune` (seconds to its first trial line, and in all) and `fivefold calibrate --quick`
  (seconds);
- `LlamaForCausalLM` (transformers; SDPA, autocast bf16, fused AdamW), eager and with each
  decoder layer `.compile()`d: tokens/s, peak (`max_memory_allocated` over the steps after the
  warm-up), its FLOPs per token and MFU.
Prints a text table and the targets met or missed; writes JSON to --json, else to
$OUT/gpu_check.json when $OUT is set. No install needed: the project runs from its `src` (put
on PYTHONPATH for every sub-run); `--torchao-wheel` installs a carried torchao wheel with
`pip install --no-index --no-deps --target /tmp/site` first (a wheel under `.whl/` is found by
itself). `--dry-run` (CPU): builds every command line, validates each fivefold recipe (as on
an H100, `cluster.preset=dgx-h100` standing in for the GPU this machine lacks), checks that
each run's first batch is one document per row of its sequence length, parses the tune and
calibrate command lines, and builds the HF model on the meta device when transformers is
installed (its parameters and FLOPs per token equal to fivefold's, else says skipped); it runs
nothing else.

No torchtitan baseline: torchtitan is not on the GPU image, and its release on PyPI (0.3.0,
2026-09) does not import its Llama 3 model without `spmd_types` (pinned ==0.2.3; its trainer
also needs torchdata, tyro, datasets, wandb, ...): checked on 2026-11-28 on torch 2.13, where
`import torchtitan.models.llama3` fails with ModuleNotFoundError. Whether the model imports on
the image's torch 2.11 with those carried could not be checked (no GPU was lent to that
session), so a second baseline would be a row that cannot be trusted to run.
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
STARTUP_S = 25.0  # a fivefold run's start on the H200: ~18-20 s before its first step (measured)
COLD_COMPILE_S = 55.0  # what a compiled run gets beyond its eager twin (cold Inductor cache)


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


EAGER_S, HF_EAGER_S = STARTUP_S + 15, 30.0
RUNS = [  # each fivefold run beside the HF loop it is compared with; budgets in seconds
    Run("eager", "train", [], EAGER_S),
    Run("hf-eager", "hf", ["eager"], HF_EAGER_S),
    Run("compile", "train", ["train.compile=true"], EAGER_S + COLD_COMPILE_S),
    Run("hf-compile", "hf", ["compile"], HF_EAGER_S + COLD_COMPILE_S - 10),
    Run("fp8-compile", "train", ['plan.fp8="tensorwise"', "train.compile=true"],
        EAGER_S + COLD_COMPILE_S + 5, fp8=True),
    Run("calibrate", "calibrate", [], 70),
    Run("tune", "tune", [], 45),
    Run("seq32k-full", "train", ["model.seq_len=32768", *LONG], STARTUP_S + 20, steps=5),
    Run("seq128k-full", "train", ["model.seq_len=131072", *LONG], STARTUP_S + 35, steps=4),
]  # fmt: skip
TOTAL_BUDGET_S = sum(run.budget_s for run in RUNS)  # 560 s: one device call with room to spare


# ---- the recipe and the command lines ---------------------------------------------------------
def recipe_text(document: Path) -> str:
    """The 1.10B recipe (no [cluster]: fivefold resolves the GPU) on the one `document`."""
    lines = ["[model]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in MODEL.items()]
    lines += ["", "[plan]", f"micro_batch = {MICRO_BATCH}", 'precision = "bf16-mixed"', ""]
    lines += ["[train]"] + [f"{k} = {json.dumps(v)}" for k, v in TRAIN.items()]
    data = {"inputs": [str(document)], "cache_dir": str(document.parent / "data-cache")}
    lines += ["", "[data]"] + [f"{k} = {json.dumps(v)}" for k, v in data.items()]
    return "\n".join(lines) + "\n"


def write_document(path: Path) -> Path:
    """The embedded corpus (Austen's novels, one document a chapter) as one .txt document of
    about a million tokens: every training row is then one document, on both sides."""
    import gzip

    from fivefold.train.data.embedded_corpus import embedded_corpus_files

    texts = []
    for corpus in embedded_corpus_files():
        with gzip.open(corpus, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    path.write_text("\n\n".join(texts), encoding="utf-8")
    return path


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
    return [*py, str(Path(__file__).resolve()), "--hf", run.overrides[0], "--steps",
            str(run.steps), "--recipe", str(recipe)]  # fmt: skip


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


def hf_flops_per_token(seq: int) -> float:
    """The HF model's own training FLOPs per token (no recompute): its config as `transformers`
    builds it (`spec_from_hf_config`), full causal attention over rows of `seq` tokens (one
    document per row, what its SDPA call computes)."""
    from fivefold.specs.flops import training_flops_per_token
    from fivefold.specs.hf_config import spec_from_hf_config

    config = {**hf_config(seq).to_dict(), "model_type": "llama"}
    spec = spec_from_hf_config(config, "the gpu check's LlamaConfig")
    return training_flops_per_token(spec, seq, "none")


def hf_batches(recipe: Path, steps: int, extra: tuple[str, ...] = ()):
    """The batches fivefold's run of `recipe` trains on (its data pipeline, same order): one
    micro-batch per step (no accumulation), as (tokens, labels, positions) [B, T] each;
    `extra`: overrides (the dry run's stand-in GPU)."""
    from fivefold.train.entry import load_run
    from fivefold.train.inputs import load_train_data

    run = load_run(recipe, [f"train.steps={steps}", *extra], world_size=1)
    assert run.global_batch == MICRO_BATCH, "one micro-batch per step"
    stream = load_train_data(run).batches(MICRO_BATCH)
    for _ in range(steps):
        (batch,) = next(stream)
        yield batch.tokens, batch.labels, batch.positions


def hf_loop(mode: str, steps: int, recipe: Path) -> dict:
    """Train `LlamaForCausalLM` for `steps` steps on fivefold's batches of `recipe`; tokens/s
    (median step of those after the warm-up), the peak allocated over them, its own FLOPs per
    token and the MFU they make against the GPU's catalogued bf16 peak."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from fivefold.model.loss import IGNORE_INDEX
    from fivefold.train.peak import cuda_peak

    seq = MODEL["seq_len"]
    batches = [tuple(t.cuda() for t in b) for b in hf_batches(recipe, steps)]  # before timing
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(seq)).cuda().train()
    if mode == "compile":
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for step, (tokens, labels, positions) in enumerate(batches):
        if step == SKIP_STEPS:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        tick = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=tokens, position_ids=positions).logits
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - tick)
    tokens_per_s = MICRO_BATCH * seq / statistics.median(times[SKIP_STEPS:] or times)
    flops = hf_flops_per_token(seq)
    peak = cuda_peak(torch.cuda.get_device_name(), "bf16").flops_per_s
    return {
        "tokens_per_s": tokens_per_s,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "params": sum(p.numel() for p in model.parameters()),
        "flops_per_token": flops,
        "mfu": tokens_per_s * flops / peak if peak else None,
        "loss": float(loss),
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
    """Build and print every command; validate the recipes and their batches (one document per
    row), the tune and calibrate command lines and the HF model (meta device); 0 when all hold."""
    from fivefold.cli.main import build_parser

    problems = []
    print(f"budgets: {' + '.join(f'{r.budget_s:.0f}' for r in runs)} = "
          f"{sum(r.budget_s for r in runs):.0f} s")  # fmt: skip
    for run in runs:
        cmd = command(run, recipe, work)
        print(f"{run.name:<14} ({run.budget_s:.0f} s) {' '.join(cmd[1:])}")
        try:
            if run.kind == "train":
                print(f"{'':<14} {one_document_rows(recipe, [*run.overrides])}")
            elif run.kind in ("tune", "calibrate"):
                build_parser().parse_args(cmd[3:])
            elif run.kind == "hf":
                print(f"{'':<14} {hf_meta_check(recipe)}")
        except Exception as err:  # report every failing command, then fail
            problems.append(f"{run.name}: {type(err).__name__}: {err}")
    print("\n".join(problems) if problems else f"dry run: {len(runs)} commands checked")
    return 1 if problems else 0


STAND_IN = ['cluster.preset="dgx-h100"', "cluster.gpus=1"]  # the GPU a dry run's CPU lacks


def one_document_rows(recipe: Path, overrides: list[str]) -> str:
    """Validate the run's recipe and check its first batch: every row one document of the
    run's sequence length (ValueError otherwise)."""
    from fivefold.train.entry import load_run
    from fivefold.train.inputs import load_train_data

    run = load_run(recipe, [*overrides, *STAND_IN], world_size=1)
    (batch,) = next(load_train_data(run).batches(run.recipe.plan.micro_batch))
    rows, seq = batch.doc_ids.shape
    if seq != run.recipe.model.seq_len or bool((batch.doc_ids != batch.doc_ids[:, :1]).any()):
        raise ValueError(f"rows of {seq} tokens are not one document each")
    return f"batches: {rows} row(s) of one {seq:,}-token document each"


def hf_meta_check(recipe: Path) -> str:
    """The HF model built on the meta device: its parameters and FLOPs per token beside
    fivefold's (equal work), and its first batch fivefold's."""
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError:
        return "HF loop: skipped (transformers is not installed)"
    from fivefold.specs.flops import training_flops_per_token
    from fivefold.specs.model import param_count
    from fivefold.specs.recipe import model_from_dict
    from fivefold.train.entry import load_run
    from fivefold.train.inputs import load_train_data

    seq = MODEL["seq_len"]
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config(seq))
    hf = sum(p.numel() for p in model.parameters())
    spec = model_from_dict(MODEL)
    if hf != param_count(spec):
        raise ValueError(f"HF model has {hf} parameters, fivefold's {param_count(spec)}")
    ours, theirs = training_flops_per_token(spec, seq), hf_flops_per_token(seq)
    if abs(theirs - ours) > 1e-9 * ours:
        raise ValueError(f"HF does {theirs:.4g} FLOPs per token, fivefold {ours:.4g}")
    tokens = next(hf_batches(recipe, 1, tuple(STAND_IN)))[0]
    (first,) = next(load_train_data(load_run(recipe, STAND_IN, 1)).batches(MICRO_BATCH))
    if not torch.equal(tokens, first.tokens):
        raise ValueError("the HF loop's first batch is not fivefold's")
    return (
        f"HF loop: LlamaForCausalLM builds on meta, {hf / 1e9:.3f}B parameters and "
        f"{theirs / 1e9:.2f} GFLOP per token as fivefold's, on fivefold's batches"
    )


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
    parser.add_argument(
        "--budget", type=float, help=f"seconds for all runs (default: theirs added, "
        f"{TOTAL_BUDGET_S:.0f} for all)")  # fmt: skip
    parser.add_argument("--hf", choices=("eager", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hf:  # a sub-run: the HF loop
        result = hf_loop(args.hf, args.steps, Path(args.recipe))
        print("GPU_CHECK_RESULT " + json.dumps(result), flush=True)
        return 0
    runs = RUNS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {r.name for r in RUNS}
        if unknown:
            parser.error(f"--only: unknown run(s) {', '.join(sorted(unknown))}")
        runs = [r for r in RUNS if r.name in names]
    budget = args.budget or sum(r.budget_s for r in runs)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        recipe = work / "llama-1b.toml"
        recipe.write_text(recipe_text(write_document(work / "one-document.txt")))
        if args.dry_run:
            return dry_run(runs, recipe, work)
        site = install_torchao(args.torchao_wheel)
        started = time.perf_counter()
        rows = []
        for run in runs:
            left = budget - (time.perf_counter() - started)
            rows.append(execute(run, recipe, work, site, left))
            print(f"# {rows[-1]['run']}: {rows[-1]['status']}", flush=True)
    by_name = {r["run"]: r for r in rows}
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
