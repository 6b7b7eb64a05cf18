"""Run a function on N real gloo ranks on CPU, and the parity cases built on it.

Processes come from a `forkserver` whose process imported torch and fivefold once and did no
compute, so each rank starts in a fraction of a second (fork) without inheriting a computing
parent's thread pools (which can hang forked children). Each call gets a fresh process group
over a FileStore (no TCP port to collide on), ranks run one thread each, results come back
through a queue, and every worker ends with `os._exit(0)` (a normal exit can abort in gloo's
destructors). If any rank fails or the deadline passes, all ranks are killed and the first
traceback is raised. The checkpoint tests spawn their ranks through `spawn_ranks` too
(tests/checkpoint/ckpt_harness.py).

Parity (the contract of `fivefold train`): a case is (plan, model preset, steps, micro-batches);
every rank trains with `DistributedRuntime` on a fixed synthetic corpus of packed documents, and
the losses of every step and the final full parameters are compared with the single-process run
(`LocalRuntime`, the same recipe with every degree 1), computed once per configuration.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from fivefold.train.config import parse_train_config

# One forkserver serves the whole session (multiprocessing keeps a single one per process), so
# it preloads what the parallel and the checkpoint tests import.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "fivefold.model",
    "fivefold.checkpoint.checkpointer",
    "fivefold.parallel.distributed_runtime",
    "fivefold.parallel.parallelize",
    "fivefold.train.runtime",
    "fivefold.train.optim",
]

_CONTEXT: Any = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _pack(value: Any) -> bytes:
    """Serialise a result to plain bytes: torch would otherwise pass tensors as shared-memory
    handles, which die with the worker."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


class RankFailure(AssertionError):
    """A rank raised, died or timed out; the message holds its traceback."""


def _worker(
    rank: int,
    world: int,
    store_path: str,
    results,
    pg_timeout_s: float,
    pass_rank: bool,
    fn,
    args: tuple,
    kwargs: dict,
) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    status, payload = "ok", None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        if pass_rank:
            args = (rank, world, *args)
        payload = _pack(fn(*args, **kwargs))
    except BaseException:
        status, payload = "error", traceback.format_exc()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    os._exit(0)


def spawn_ranks(
    world: int,
    fn,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    pass_rank: bool = False,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 90.0,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world` ranks of one gloo group; returns results by rank.

    With `pass_rank` each rank calls `fn(rank, world, *args, **kwargs)`. `timeout_s` bounds the
    whole call, `pg_timeout_s` each collective. `fn` must be importable (module level). Raises
    `RankFailure` with the first rank's traceback.
    """
    ctx = _context()
    results = ctx.Queue()
    call = (pg_timeout_s, pass_rank, fn, args, kwargs or {})
    with tempfile.TemporaryDirectory(prefix="fivefold-pg-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world, store_path, results, *call), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankFailure(
                        f"{fn.__name__} on {world} ranks timed out after {timeout_s:.0f} s "
                        f"(ranks done: {sorted(out)})"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        raise RankFailure(
                            f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
                    continue
                if status == "error":
                    raise RankFailure(f"rank {rank} of {world} failed:\n{payload}")
                out[rank] = _unpack(payload)
        finally:
            for p in procs:
                p.join(timeout=5 if len(out) == world else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [out[r] for r in range(world)]


def run_ranks(world: int, fn, *args, timeout_s: float = 180.0, **kwargs) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world` ranks inside a gloo group; returns results by rank."""
    return spawn_ranks(world, fn, args, kwargs, timeout_s=timeout_s)


# ---- parity cases ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ParityCase:
    """One layout to compare with the single-process run.

    `plan`: ParallelPlan fields (precision fp32 is added); the global batch is always
    `GLOBAL_BATCH` sequences, so micro_batch * dp * grad_accum must equal it.
    """

    name: str
    plan: dict
    model: str = "parity"  # a key of MODELS
    steps: int = 10
    compile: bool = False  # train.compile, here and in its single-process reference
    train: dict = field(default_factory=dict)  # more [train] fields, here and in its reference

    @property
    def world(self) -> int:
        p = self.plan
        return (
            p.get("pp", 1)
            * p.get("dp_replicate", 1)
            * p.get("dp_shard", 1)
            * p.get("cp", 1)
            * p.get("tp", 1)
        )


GLOBAL_BATCH = 8
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4
NORM_RTOL = 1e-4  # the gradient norms (not part of the contract; a sharper diagnosis)
AUX_ATOL = 1e-6  # the reported MoE load-balancing loss (about 0.02 here)

# The latent-attention fields the MLA and DeepSeek parity models share.
_LATENT_ATTENTION = {
    "seq_len": 64,
    "vocab": 512,
    "kv_heads": 4,
    "attention": "mla",
    "head_dim": 24,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
}

# Small enough for 8 ranks on 2 cores; 8 layers so PP4 x vpp2 has a layer per stage, kv heads
# (2) fewer than TP4 so kv-head replication is exercised, seq 64 divisible by 2*cp*tp.
MODELS: dict[str, dict] = {
    "parity": {"preset": "tiny", "layers": 8, "seq_len": 64, "vocab": 512},
    # one kv head: TP2 already replicates it (the cheap CI check of kv-head replication)
    "parity-mqa": {"preset": "tiny", "layers": 2, "kv_heads": 1, "seq_len": 64, "vocab": 512},
    "parity-tied": {
        "preset": "tiny",
        "layers": 2,
        "seq_len": 64,
        "vocab": 512,
        "tied_embeddings": True,
    },
    # Qwen's attention variants: Q/K/V biases (Qwen2) and per-head QK-norm (Qwen3) together
    "parity-qwen": {
        "preset": "tiny",
        "layers": 2,
        "seq_len": 64,
        "vocab": 512,
        "qkv_bias": True,
        "qk_norm": True,
    },
    # a sliding window of 12 keys in the first layer (the second attends fully) over packed
    # documents: the windowed spans and ring steps of every layout
    "parity-window": {
        "preset": "tiny",
        "layers": 2,
        "seq_len": 64,
        "vocab": 512,
        "sliding_window": 12,
        "sliding_pattern": "sf",
    },
    # 4 layers: a layer for each of the 4 virtual stages of PP2 x vpp 2
    "parity-tied4": {
        "preset": "tiny",
        "layers": 4,
        "seq_len": 64,
        "vocab": 512,
        "tied_embeddings": True,
    },
    "parity-moe": {"preset": "tiny-moe", "layers": 4, "seq_len": 64, "vocab": 512},
    # DeepSeek's latent attention (q and kv ranks, a RoPE part of 8 in heads of 24, values 12
    # wide), dense
    "parity-mla": {"preset": "tiny", "layers": 2, **_LATENT_ATTENTION},
    # DeepSeek-V3's shape: MLA, a dense first layer, shared and routed experts, the sigmoid
    # router with its groups, routed scaling and the balancing of its score bias
    "parity-deepseek": {
        "preset": "tiny-moe",
        "layers": 3,
        **_LATENT_ATTENTION,
        "dense_layers": 1,
        "router_score": "sigmoid",
        "router_groups": 2,
        "router_top_groups": 1,
        "routed_scaling": 2.5,
        "router_bias_update_speed": 0.01,
    },
    "parity-moe-2e": {
        "preset": "tiny-moe",
        "layers": 2,
        "seq_len": 64,
        "vocab": 512,
        "experts": 2,
        "top_k": 1,
    },
}
TRAIN = {
    "lr": 2e-3,
    "warmup_steps": 0,
    "lr_schedule": "constant",
    "grad_clip": 1.0,
    "weight_decay": 0.1,
    # Adam's eps above fp32's rounding noise on a gradient (~1e-9 here): with 1e-8 an element
    # whose exact gradient is ~1e-9 (parity-mqa's tok_embeddings[421, 36] at step 1) moves by
    # lr * g / (|g| + eps), so 1e-9 of rounding, in any two correct fp32 runs, became 1e-4 of
    # parameter; typical gradients (1e-5..1e-2) still take Adam's sign-like steps
    "eps": 1e-6,
    "seed": 0,
    "steps": 10,
    "device": "cpu",
}


def recipe_dict(case: ParityCase) -> dict:
    plan = {"precision": "fp32", **case.plan}
    return {
        "model": dict(MODELS[case.model]),
        "plan": plan,
        "train": {
            **TRAIN,
            "steps": case.steps,
            "compile": case.compile,
            **case.train,
        },
    }


def reference_key(case: ParityCase) -> tuple:
    """Cases that share a reference: same model, steps, micro-batch grouping (the grouping
    matters only to MoE models, whose load-balancing loss is per global micro-batch),
    train.compile and the case's other [train] fields."""
    dp = case.plan.get("dp_replicate", 1) * case.plan.get("dp_shard", 1)
    moe = MODELS[case.model]["preset"] == "tiny-moe"
    grouping = (case.plan.get("grad_accum", 1), dp if moe else None)
    return (case.model, case.steps, *grouping, case.compile, *sorted(case.train.items()))


def synthetic_global_batch(step: int, vocab: int, seq_len: int, rows: int = GLOBAL_BATCH):
    """The fixed global batch of `step`: rows of packed documents (lengths 5..40 tokens).

    Returns a Batch of [rows, seq_len] tokens, next-token labels, positions restarting at each
    document and per-row document ids.
    """
    import torch

    from fivefold.train.data import Batch

    g = torch.Generator().manual_seed(10_000 + step % 3)  # three batches, seen in turn
    stream = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    positions = torch.empty(rows, seq_len + 1, dtype=torch.long)
    doc_ids = torch.empty(rows, seq_len + 1, dtype=torch.long)
    for row in range(rows):
        start, doc = 0, 0
        while start < seq_len + 1:
            length = int(torch.randint(5, 41, (1,), generator=g))
            end = min(start + length, seq_len + 1)
            positions[row, start:end] = torch.arange(end - start)
            doc_ids[row, start:end] = doc
            start, doc = end, doc + 1
    return Batch(
        tokens=stream[:, :-1].contiguous(),
        labels=stream[:, 1:].contiguous(),
        positions=positions[:, :-1].contiguous(),
        doc_ids=doc_ids[:, :-1].contiguous(),
    )


def _rows(batch, start: int, stop: int):
    from fivefold.train.data import Batch

    return Batch(
        batch.tokens[start:stop],
        batch.labels[start:stop],
        batch.positions[start:stop],
        batch.doc_ids[start:stop],
    )


def rank_micro_batches(batch, dp_rank: int, dp_size: int, grad_accum: int) -> list:
    """Data-parallel rank r takes the r-th contiguous slice, cut into `grad_accum` pieces."""
    per_rank = batch.tokens.shape[0] // dp_size
    micro = per_rank // grad_accum
    base = dp_rank * per_rank
    return [_rows(batch, base + m * micro, base + (m + 1) * micro) for m in range(grad_accum)]


def global_micro_batches(batch, dp_size: int, grad_accum: int) -> list:
    """Micro-batch m of the whole data-parallel group: every rank's m-th piece, rank order."""
    import torch

    from fivefold.train.data import Batch

    pieces = [rank_micro_batches(batch, r, dp_size, grad_accum) for r in range(dp_size)]
    out = []
    for m in range(grad_accum):
        parts = [pieces[r][m] for r in range(dp_size)]
        out.append(
            Batch(
                *(
                    torch.cat([getattr(p, f) for p in parts])
                    for f in ("tokens", "labels", "positions", "doc_ids")
                )
            )
        )
    return out


def _train(runtime, recipe, steps: int, micro_batches_of) -> dict:
    """The loop of `fivefold train` reduced to what parity needs: step, clip, AdamW."""
    from fivefold.train.config import parse_train_config
    from fivefold.train.optim import build_optimizer

    cfg = parse_train_config(recipe).train
    optimizer = build_optimizer(runtime.model_parts, cfg, recipe.plan)
    losses, norms, aux = [], [], []
    for step in range(steps):
        batch = synthetic_global_batch(step, recipe.model.vocab, recipe.model.seq_len)
        result = runtime.train_step(micro_batches_of(batch))
        norms.append(runtime.clip_grad_norm(cfg.grad_clip))
        optimizer.step()
        runtime.balance_routers()
        optimizer.zero_grad(set_to_none=True)
        losses.append(result.loss)
        aux.append(result.aux_loss)
    return {"losses": losses, "norms": norms, "aux": aux}


def reference_run(rd: dict, steps: int, dp_size: int, grad_accum: int) -> dict:
    """The single-process run (rank 0 of a 1-rank group; LocalRuntime touches no group)."""
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.runtime import LocalRuntime

    single = {
        **rd,
        "plan": {
            "precision": "fp32",
            "grad_accum": grad_accum,
            "micro_batch": GLOBAL_BATCH // grad_accum,
        },
    }
    recipe = recipe_from_dict(single, default_world=1)
    runtime = LocalRuntime(recipe, parse_train_config(recipe).train)
    out = _train(runtime, recipe, steps, lambda b: global_micro_batches(b, dp_size, grad_accum))
    # named_parameters lists a tied weight once, under its first name, as the parallel run does
    from fivefold.model.init import canonical_fqn

    params = [*runtime.model.named_parameters(), *_score_biases(runtime.model)]
    out["params"] = {canonical_fqn(k): v.detach().clone() for k, v in params}
    return out


def _score_biases(part) -> list:
    """The sigmoid routers' score-correction biases (buffers the balancing updates)."""
    return [(k, v) for k, v in part.named_buffers() if k.endswith("score_bias")]


def full_parameters(runtime) -> dict:
    """Every parameter of this rank's chunks as full tensors (collective within a stage)."""
    from torch.distributed.tensor import DTensor

    from fivefold.model.init import canonical_fqn

    out = {}
    for part in runtime.model_parts:
        for name, param in [*part.named_parameters(), *_score_biases(part)]:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[canonical_fqn(name)] = full.detach().clone()
    return out


def parallel_run(rd: dict, steps: int, world: int) -> dict:
    """One rank of the layout: train `steps` steps, then gather the full parameters."""
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.runtime import distributed_runtime

    recipe = recipe_from_dict(rd, default_world=world)
    runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    plan = recipe.plan
    out = _train(
        runtime,
        recipe,
        steps,
        lambda b: rank_micro_batches(b, runtime.dp_rank, runtime.dp_size, plan.grad_accum),
    )
    params = full_parameters(runtime)
    c = runtime.coordinates
    holds_copy = c["dp_replicate"] == c["dp_shard"] == c["cp"] == c["tp"] == 0
    out["params"] = params if holds_copy else {}
    runtime.close()
    return out


@dataclass
class ParityResult:
    case: ParityCase
    loss_rel_dev: float  # max over steps of |loss - reference| / reference
    param_abs_dev: float  # max over all parameter elements of |final - reference|
    norm_rel_dev: float  # max over steps of the relative gradient-norm deviation
    losses: list[float]
    reference_losses: list[float]
    seconds: float = 0.0
    missing: list[str] = field(default_factory=list)
    aux_abs_dev: float = 0.0  # max over steps of the MoE load-balancing loss deviation

    def line(self) -> str:
        moe = MODELS[self.case.model]["preset"] == "tiny-moe"
        aux = f"max |daux| {self.aux_abs_dev:.1e}  " if moe else ""
        return (
            f"{self.case.name:<30} ranks {self.case.world}  max |dloss|/loss "
            f"{self.loss_rel_dev:.1e}  max |dparam| {self.param_abs_dev:.1e}  "
            f"max |dnorm|/norm {self.norm_rel_dev:.1e}  {aux}"
            f"loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}  ({self.seconds:.0f} s)"
        )


RESULTS: list[ParityResult] = []  # every case run in this session, for the summary


_REFERENCES: dict[tuple, dict] = {}


def reference_for(case: ParityCase) -> dict:
    key = reference_key(case)
    if key not in _REFERENCES:
        dp = case.plan.get("dp_replicate", 1) * case.plan.get("dp_shard", 1)
        (_REFERENCES[key],) = run_ranks(
            1,
            reference_run,
            recipe_dict(case),
            case.steps,
            dp,
            case.plan.get("grad_accum", 1),
            timeout_s=600.0 if case.compile else 180.0,
        )
    return _REFERENCES[key]


def run_parity(case: ParityCase, timeout_s: float = 240.0) -> ParityResult:
    """Run `case` on its ranks and measure its deviations from the single-process run (compiled
    cases get 600 s: each rank compiles its blocks, cold, on shared cores)."""
    timeout_s = max(timeout_s, 600.0) if case.compile else timeout_s
    reference = reference_for(case)
    start = time.monotonic()
    ranks = run_ranks(
        case.world, parallel_run, recipe_dict(case), case.steps, case.world, timeout_s=timeout_s
    )
    losses = ranks[0]["losses"]
    for r, out in enumerate(ranks):
        assert out["losses"] == losses, f"rank {r} reports other losses: {out['losses']}"
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"], strict=True))
    aux_dev = max(abs(a - b) for a, b in zip(ranks[0]["aux"], reference["aux"], strict=True))
    norm_rel = max(
        abs(a - b) / abs(b) for a, b in zip(ranks[0]["norms"], reference["norms"], strict=True)
    )
    params: dict = {}
    for out in ranks:
        params.update(out["params"])
    ref_params = dict(reference["params"])
    if "output.weight" not in ref_params and "output.weight" in params:
        # tied embeddings: the last pipeline stage's copy must match the one matrix too
        ref_params["output.weight"] = ref_params["tok_embeddings.weight"]
    missing = sorted(set(ref_params) ^ set(params))
    dev = max(
        float((params[k].float() - ref_params[k].float()).abs().max())
        for k in ref_params
        if k in params
    )
    result = ParityResult(
        case,
        rel,
        dev,
        norm_rel,
        losses,
        reference["losses"],
        time.monotonic() - start,
        missing,
        aux_dev,
    )
    RESULTS.append(result)
    return result


def assert_parity(case: ParityCase, timeout_s: float = 240.0) -> ParityResult:
    result = run_parity(case, timeout_s)
    print(result.line())
    assert not result.missing, f"parameters not matched by name: {result.missing}"
    assert result.loss_rel_dev <= LOSS_RTOL, (
        f"{case.name}: losses {result.losses} vs single-process {result.reference_losses}"
    )
    assert result.param_abs_dev <= PARAM_ATOL, f"{case.name}: max |dparam| {result.param_abs_dev}"
    assert result.aux_abs_dev <= AUX_ATOL, f"{case.name}: aux loss deviates {result.aux_abs_dev}"
    assert result.norm_rel_dev <= NORM_RTOL, (
        f"{case.name}: grad norms deviate {result.norm_rel_dev}"
    )
    return result


def mixed_precision_run(rd: dict, steps: int, world: int) -> dict:
    """One rank: train, then report the parameters' dtypes and the dtype forward computed in."""
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.runtime import distributed_runtime

    recipe = recipe_from_dict(rd, default_world=world)
    runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    seen = []
    block = runtime.model_parts[0].layers["0"]
    block.attention.wq.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = _train(
        runtime,
        recipe,
        steps,
        lambda b: rank_micro_batches(b, runtime.dp_rank, runtime.dp_size, recipe.plan.grad_accum),
    )
    out["param_dtypes"] = sorted({str(p.dtype) for p in runtime.model_parts[0].parameters()})
    out["compute_dtypes"] = sorted({str(d) for d in seen})
    runtime.close()
    return out


def eval_and_report_run(rd: dict, world: int) -> dict:
    """One rank: eval_loss and train_step on the same batch at the same weights, four steps
    (the layout report comes after the first step no memory counter slowed: the fourth), and
    the global gradient norm."""
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.runtime import distributed_runtime

    recipe = recipe_from_dict(rd, default_world=world)
    runtime = distributed_runtime(recipe, parse_train_config(recipe).train)
    plan = recipe.plan
    batch = synthetic_global_batch(0, recipe.model.vocab, recipe.model.seq_len)
    mine = rank_micro_batches(batch, runtime.dp_rank, runtime.dp_size, plan.grad_accum)
    out = {"eval": runtime.eval_loss(mine), "train": [], "norm": []}
    for _ in range(4):
        out["train"].append(runtime.train_step(mine).loss)
        out["norm"].append(runtime.clip_grad_norm(0.0))
        for part in runtime.model_parts:
            part.zero_grad(set_to_none=True)
    out["report"] = runtime.last_report
    runtime.close()
    return out
