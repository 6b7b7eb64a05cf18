"""Training throughput of `fivefold train` against minimal plain-PyTorch loops (CPU).

    PYTHONPATH=src .venv/bin/python benchmarks/train_throughput.py [--preset small]
        [--repeats 5] [--steps 8] [--only single,compile,bf16,dp2,zero3,tp2]
        [--documents whole|packed] [--json FILE]

Each configuration runs fivefold and its baseline in the same processes, interleaved: R repeats
of (fivefold for S steps, baseline for S steps), tokens/s per repeat, then the medians and their
ratio (fivefold / baseline; target >= 0.95).
- fivefold: a `Trainer` (the loop of `fivefold train`: embedded-corpus data, runtime step, grad
  clipping at 1.0, fused AdamW, LR schedule, metrics) over one runtime built once; each repeat
  is a fresh `fit()` of S steps whose tokens/s is the loop's own meter (its first step and its
  one memory-measuring step do not count).
- baseline: a minimal Llama of the same shapes written here (RMSNorm, RoPE, GQA through SDPA
  with `is_causal=True`, SwiGLU), random tokens of the same batch, cross entropy, clip_grad_norm_
  at 1.0, fused AdamW; tokens/s over its S - 1 steps after the first.
The computation is the same on both sides: by default (`--documents whole`) fivefold's rows are
one document each (positions 0..T-1), so its attention is causal over the whole row like the
baseline's (fivefold then runs SDPA `is_causal=True`, compiled inside each block's graph);
`--documents packed` keeps the corpus's packed documents, where fivefold attends within each
document (`fivefold::document_attention`, per-document SDPA calls) and the baseline does not.
Configurations (the same batch and dtype on both sides):
- single: one process, fp32 eager;
- compile: one process, `train.compile = true` against `torch.compile` of the baseline model;
- bf16: one process, bf16 autocast on both sides, run only where the CPU has native bf16
  (amx_bf16 or avx512_bf16 in /proc/cpuinfo); on AVX2-only CPUs bf16 is emulated (~15x slower
  than fp32), so it says so and skips;
- dp2: 2 processes, plan dp_replicate = 2 against torch DDP;
- zero3: 2 processes, plan dp_shard = 2, zero = 3 against `fully_shard` on each block and root;
- tp2: 2 processes, plan tp = 2 with sequence parallelism against torch's TP styles on the
  baseline (torchtitan's plan: a row-parallel embedding, sequence-parallel norms, each
  attention and MLP input all-gathered once, column/row-parallel projections, the loss under
  `loss_parallel`).
Single-process runs use all cores; 2-process runs one thread per process per core. Timings need
an idle machine: anything else running skews both sides, which interleaving only evens out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ranks import run_ranks

CONFIGS = {
    "single": {"world": 1, "plan": {}, "compile": False, "precision": "fp32"},
    "compile": {"world": 1, "plan": {}, "compile": True, "precision": "fp32"},
    "bf16": {"world": 1, "plan": {}, "compile": False, "precision": "bf16-mixed"},
    "dp2": {"world": 2, "plan": {"dp_replicate": 2}, "compile": False, "precision": "fp32"},
    "zero3": {
        "world": 2,
        "plan": {"dp_shard": 2, "zero": 3},
        "compile": False,
        "precision": "fp32",
    },
    "tp2": {"world": 2, "plan": {"tp": 2, "sp": True}, "compile": False, "precision": "fp32"},
}
TARGET = 0.95


def native_bf16() -> tuple[bool, str]:
    """(True, flag) when /proc/cpuinfo lists a native bf16 instruction set, else (False, why)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False, "no /proc/cpuinfo to check for amx_bf16/avx512_bf16"
    for flag in ("amx_bf16", "avx512_bf16"):
        if flag in flags:
            return True, flag
    return False, "the CPU has neither amx_bf16 nor avx512_bf16 (bf16 would be emulated)"


# ---- the baseline: a minimal Llama and its loop ---------------------------------------------
def plain_model(spec):
    """The preset's decoder in plain PyTorch (SwiGLU MLP, untied head)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    heads, kv_heads, head_dim = spec.heads, spec.kv_heads, spec.head_dim

    def rope(x, cos, sin):  # x [B, H, T, Dh]; rotate-half form
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = spec.hidden
            self.wq = nn.Linear(d, heads * head_dim, bias=False)
            self.wk = nn.Linear(d, kv_heads * head_dim, bias=False)
            self.wv = nn.Linear(d, kv_heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, d, bias=False)

        def forward(self, h, cos, sin):  # heads: the local ones under TP (-1)
            batch, seq = h.shape[0], h.shape[1]
            q = self.wq(h).view(batch, seq, -1, head_dim).transpose(1, 2)
            k = self.wk(h).view(batch, seq, -1, head_dim).transpose(1, 2)
            v = self.wv(h).view(batch, seq, -1, head_dim).transpose(1, 2)
            attn = F.scaled_dot_product_attention(
                rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True, enable_gqa=True
            )
            return self.wo(attn.transpose(1, 2).reshape(batch, seq, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(spec.hidden, spec.ffn, bias=False)
            self.w2 = nn.Linear(spec.ffn, spec.hidden, bias=False)
            self.w3 = nn.Linear(spec.hidden, spec.ffn, bias=False)

        def forward(self, h):
            return self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
            self.attention = Attention()
            self.ffn_norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
            self.feed_forward = FeedForward()

        def forward(self, x, cos, sin):
            x = x + self.attention(self.attention_norm(x), cos, sin)
            return x + self.feed_forward(self.ffn_norm(x))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden)
            self.layers = nn.ModuleList(Block() for _ in range(spec.layers))
            self.norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
            self.output = nn.Linear(spec.hidden, spec.vocab, bias=False)
            inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, head_dim, 2) / head_dim)
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        def forward(self, tokens):
            angles = torch.outer(torch.arange(tokens.shape[1], device=tokens.device), self.inv_freq)
            cos, sin = angles.cos(), angles.sin()  # [T, Dh/2], once per step
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h, cos, sin)
            return self.output(self.norm(h))

    if spec.mlp != "swiglu" or spec.is_moe:
        raise SystemExit(f"the baseline is a dense SwiGLU model; {spec.name} is not")
    model = Llama()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.02)
    return model


def plain_tensor_parallel(model, world: int) -> None:
    """torch's TP styles with sequence parallelism on the baseline, as torchtitan applies them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    parallelize_module(model, mesh, top)
    for block in model.layers:
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, mesh, plan)


def plain_loop(spec, cfg: dict, micro_batch: int, world: int):
    """A `run(steps) -> tokens/s` closure for the configuration's baseline."""
    import torch
    import torch.nn.functional as F

    model = plain_model(spec)
    if cfg["world"] > 1 and "dp_replicate" in cfg["plan"]:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif "tp" in cfg["plan"]:
        plain_tensor_parallel(model, world)
    elif cfg["world"] > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    forward = torch.compile(model) if cfg["compile"] else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, spec.vocab, (micro_batch, spec.seq_len + 1), generator=g)
    tokens, labels = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
    bf16 = cfg["precision"] == "bf16-mixed"
    if "tp" in cfg["plan"]:
        from torch.distributed.tensor.parallel import loss_parallel

        vocab_parallel = loss_parallel
    else:
        vocab_parallel = contextlib.nullcontext

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(tokens)
        with vocab_parallel():
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the loss is read back, as any loop logs it

    replicas = world // cfg["plan"].get("tp", 1)  # TP ranks share their batch

    def run(steps: int) -> float:
        step()  # not counted, like fivefold's first step
        start = time.perf_counter()
        for _ in range(steps - 1):
            step()
        return (steps - 1) * micro_batch * spec.seq_len * replicas / (time.perf_counter() - start)

    return run


# ---- fivefold -----------------------------------------------------------------------------------
class WholeRows:
    """The run's data with every row one document (positions 0..T-1, doc ids 0): attention
    causal over the whole row, the computation of the baseline; the rest delegates."""

    def __init__(self, data) -> None:
        self._data = data

    def __getattr__(self, name: str):
        return getattr(self._data, name)

    def batches(self, micro_batch: int):
        import numpy as np
        import torch

        for step in self._data.batches(micro_batch):
            for batch in step:
                rows, seq = batch.tokens.shape
                batch.positions = torch.arange(seq).expand_as(batch.tokens).contiguous()
                batch.doc_ids = torch.zeros_like(batch.doc_ids)
                batch.cu_seqlens = np.arange(0, rows * seq + 1, seq, dtype=np.int32)
            yield step


def fivefold_loop(
    cfg: dict, preset: str, micro_batch: int, world: int, run_dir: str, documents: str
):
    """A `run(steps) -> tokens/s` closure: a fresh `Trainer.fit()` over one runtime."""
    from rich.console import Console

    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.config import parse_train_config
    from fivefold.train.loop import Trainer
    from fivefold.train.runtime import make_runtime

    def run_config(steps: int):
        plan = {"precision": cfg["precision"], "micro_batch": micro_batch, **cfg["plan"]}
        train = {
            "steps": steps,
            "warmup_steps": 0,
            "device": "cpu",
            "compile": cfg["compile"],
            "run_dir": run_dir,
            "save_final": False,
            "resume": False,
            "tensorboard": False,
            "progress": False,
            "grad_clip": 1.0,
        }
        raw = {"model": {"preset": preset}, "plan": plan, "train": train}
        return parse_train_config(recipe_from_dict(raw, default_world=world))

    warm = run_config(2)
    runtime = make_runtime(warm.recipe, warm.train)

    def run(steps: int) -> float:
        trainer = Trainer(run_config(steps), runtime, Console(quiet=True))
        if documents == "whole":
            trainer.data = WholeRows(trainer.data)
        trainer.prepare_run_dir()
        return trainer.fit().tokens_per_s

    return run


def measure(rank: int, world: int, name: str, args: dict) -> dict:
    """One rank: build both sides once, warm them up, then R interleaved repeats."""
    import torch

    from fivefold.specs.presets import model_preset

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = CONFIGS[name]
    spec = model_preset(args["preset"])
    quiet = contextlib.redirect_stdout(io.StringIO())  # the runtime's layout report
    with quiet, tempfile.TemporaryDirectory(prefix="fivefold-throughput-") as tmp:
        ours = fivefold_loop(
            cfg, args["preset"], args["micro_batch"], world, tmp, args["documents"]
        )
        theirs = plain_loop(spec, cfg, args["micro_batch"], world)
        started = time.perf_counter()
        ours(3), theirs(3)  # warm-up (and cold compile)
        warmup_s = time.perf_counter() - started
        rows = []
        for _ in range(args["repeats"]):
            rows.append((ours(args["steps"]), theirs(args["steps"])))
    return {"rank": rank, "rows": rows, "warmup_s": warmup_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per repeat (>= 3)")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument(
        "--documents",
        choices=("whole", "packed"),
        default="whole",
        help="fivefold's rows: one document each, attention causal over the row as in the "
        "baseline (whole), or the corpus's packed documents, attention within each (packed)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step and the memory step not count)")
    settings = {
        "preset": args.preset,
        "micro_batch": args.micro_batch,
        "repeats": args.repeats,
        "steps": args.steps,
        "documents": args.documents,
    }
    print(
        f"{args.preset}, micro-batch {args.micro_batch} per process, {args.repeats} repeats of "
        f"{args.steps} steps, interleaved; {os.cpu_count()} CPU cores; fivefold's rows: "
        f"{args.documents} documents"
    )
    results = {}
    for name in args.only.split(","):
        cfg = CONFIGS[name]
        if cfg["precision"] == "bf16-mixed":
            ok, why = native_bf16()
            if not ok:
                print(f"{name:>8}: skipped: {why}")
                results[name] = {"skipped": why}
                continue
        ranks = run_ranks(cfg["world"], measure, name, settings, timeout_s=3600)
        rows = ranks[0]["rows"]
        ours = statistics.median(r[0] for r in rows)
        theirs = statistics.median(r[1] for r in rows)
        ratio = ours / theirs
        verdict = "meets" if ratio >= TARGET else "below"
        print(
            f"{name:>8}: fivefold {ours:,.0f} tok/s, baseline {theirs:,.0f} tok/s, ratio "
            f"{ratio:.3f} ({verdict} {TARGET}); per repeat "
            + ", ".join(f"{a / b:.2f}" for a, b in rows)
            + f"; warm-up {ranks[0]['warmup_s']:.0f} s",
            flush=True,
        )
        results[name] = {"fivefold": ours, "baseline": theirs, "ratio": ratio, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
