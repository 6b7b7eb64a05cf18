"""Rank functions of the multi-rank checkpoint tests (module level so ranks can import them).

A layout is a ParallelPlan dict run by the real `DistributedRuntime` on a small model. Training
uses a fixed synthetic global batch per step (random tokens, one document per row), cut into the
rank's data-parallel slice and micro-batches like the loop does; the optimizer and LR schedule
are the loop's own (`build_optimizer`, `build_scheduler`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GLOBAL_BATCH = 8
MODEL = {"preset": "tiny", "layers": 4, "seq_len": 32, "vocab": 256}
MOE_MODEL = {"preset": "tiny-moe", "layers": 4, "seq_len": 32, "vocab": 256}
TIED_MODEL = {**MODEL, "tied_embeddings": True}
MIXTRAL_MODEL = {**MOE_MODEL, "layers": 2, "shared_experts": 0}  # a Hugging Face Mixtral's shape
# a Hugging Face DeepSeek-V3's shape: latent attention, a dense first layer, the sigmoid router
# with 2 groups (1 kept) and its score biases balanced
DEEPSEEK_MODEL = {
    **MOE_MODEL,
    "layers": 2,
    "kv_heads": 4,
    "attention": "mla",
    "head_dim": 24,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "dense_layers": 1,
    "router_score": "sigmoid",
    "router_groups": 2,
    "router_top_groups": 1,
    "routed_scaling": 2.5,
    "router_bias_update_speed": 0.01,
    "norm_eps": 1e-6,  # transformers' latent norms' (`hf_families.LATENT_NORM_EPS`)
}
# a case's `moe` field picks the model: False (dense), True (MoE), "tied" (tied embeddings),
# "mixtral" (MoE without shared experts) or "deepseek"
MODELS = {False: MODEL, True: MOE_MODEL, "tied": TIED_MODEL, "mixtral": MIXTRAL_MODEL}
MODELS["deepseek"] = DEEPSEEK_MODEL
TRAIN = {
    "lr": 3e-3,
    "warmup_steps": 1,
    "lr_schedule": "cosine",
    "grad_clip": 1.0,
    "weight_decay": 0.1,
    "seed": 0,
    "steps": 8,
    "device": "cpu",
}


def recipe_dict(plan: dict, moe: bool = False, train: dict | None = None) -> dict:
    """`train`: [train] fields beside TRAIN (e.g. the optimizer)."""
    return {
        "model": dict(MODELS[moe]),
        "plan": {"precision": "fp32", **plan},
        "train": {**TRAIN, **(train or {})},
    }


def global_batch(step: int, vocab: int, seq_len: int):
    """The synthetic global batch of optimizer step `step` (0-based): [GLOBAL_BATCH, seq_len]."""
    import torch

    from fivefold.train.data import Batch

    g = torch.Generator().manual_seed(1000 + step)
    stream = torch.randint(0, vocab, (GLOBAL_BATCH, seq_len + 1), generator=g)
    positions = torch.arange(seq_len).expand(GLOBAL_BATCH, seq_len).contiguous()
    return Batch(
        tokens=stream[:, :-1].contiguous(),
        labels=stream[:, 1:].contiguous(),
        positions=positions,
        doc_ids=torch.zeros(GLOBAL_BATCH, seq_len, dtype=torch.long),
    )


def rank_micro_batches(batch, dp_rank: int, dp_size: int, grad_accum: int) -> list:
    from fivefold.train.data import Batch

    per_rank = GLOBAL_BATCH // dp_size
    micro = per_rank // grad_accum
    out = []
    for m in range(grad_accum):
        lo = dp_rank * per_rank + m * micro
        fields = [
            getattr(batch, f)[lo : lo + micro] for f in ("tokens", "labels", "positions", "doc_ids")
        ]
        out.append(Batch(*fields))
    return out


class Trainee:
    """A runtime, its optimizer and scheduler: what the loop owns, reduced to the step."""

    def __init__(self, plan: dict, world: int, moe: bool = False, train: dict | None = None):
        from fivefold.specs.recipe import recipe_from_dict
        from fivefold.train.config import parse_train_config
        from fivefold.train.lr_schedule import build_scheduler
        from fivefold.train.optim import build_optimizer

        self.recipe = recipe_from_dict(recipe_dict(plan, moe, train), default_world=world)
        self.cfg = parse_train_config(self.recipe).train
        if world == 1:
            from fivefold.train.runtime import LocalRuntime

            self.runtime = LocalRuntime(self.recipe, self.cfg)
        else:
            from fivefold.train.runtime import distributed_runtime

            self.runtime = distributed_runtime(self.recipe, self.cfg)
        self.optimizer = build_optimizer(self.runtime.model_parts, self.cfg, self.recipe.plan)
        self.scheduler = build_scheduler(self.optimizer, self.cfg)
        self.step = 0

    def train(self, steps: int) -> list[float]:
        plan, model = self.recipe.plan, self.recipe.model
        losses = []
        for _ in range(steps):
            batch = global_batch(self.step, model.vocab, model.seq_len)
            micro = rank_micro_batches(
                batch, self.runtime.dp_rank, self.runtime.dp_size, plan.grad_accum
            )
            result = self.runtime.train_step(micro)
            self.runtime.clip_grad_norm(self.cfg.grad_clip)
            self.optimizer.step()
            self.runtime.balance_routers()  # as the loop: score biases (none without them)
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            losses.append(result.loss)
        return losses

    def checkpointer(self, root: str, **kwargs: Any):
        from fivefold.checkpoint import Checkpointer

        return Checkpointer(Path(root), **kwargs)

    def save(self, ckpt) -> str:
        path = ckpt.save(
            self.step,
            self.runtime.model_parts,
            self.optimizer,
            model_spec=self.recipe.model.to_dict(),
            plan=self.recipe.plan.to_dict(),
            scheduler=self.scheduler,
        )
        return str(path)

    def load(self, ckpt, path: str | None = None) -> int:
        chosen = Path(path) if path else ckpt.select().path
        assert chosen is not None, "no valid checkpoint"
        state = ckpt.load(
            chosen,
            self.runtime.model_parts,
            self.optimizer,
            model_spec=self.recipe.model.to_dict(),
            scheduler=self.scheduler,
        )
        self.step = state.step
        return state.step

    def close(self) -> None:
        self.runtime.close()


def full_state(parts, optimizer) -> dict:
    """Every tensor this rank's checkpoint share holds, as full tensors (collective per stage)."""
    from torch.distributed.tensor import DTensor

    from fivefold.checkpoint.dcp_io import collect_state

    tensors, _ = collect_state(parts, optimizer)
    out = {}
    for key in sorted(tensors):
        value = tensors[key]
        out[key] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    return out


def compare_with_checkpoint(parts, optimizer, directory: str) -> dict:
    """Bitwise comparison of this rank's live state with the checkpoint's full tensors."""
    import torch

    from fivefold.checkpoint.dcp_io import read_full_tensors

    saved = read_full_tensors(Path(directory), prefix="")
    live = full_state(parts, optimizer)
    differ = [
        key
        for key, value in live.items()
        if key not in saved
        or value.shape != saved[key].shape
        or value.dtype != saved[key].dtype
        or not torch.equal(value, saved[key])
    ]
    return {"keys": sorted(live), "differ": differ, "saved_keys": sorted(saved)}


# ---- rank functions ----------------------------------------------------------------------------
def save_then_continue(
    rank, world, plan, root, steps_before, steps_after, moe=False, train=None
) -> dict:
    """Train, checkpoint, compare the live state with what was written, train on."""
    trainee = Trainee(plan, world, moe, train)
    trainee.train(steps_before)
    path = trainee.save(trainee.checkpointer(root))
    check = compare_with_checkpoint(trainee.runtime.model_parts, trainee.optimizer, path)
    after = trainee.train(steps_after)
    trainee.close()
    return {"path": path, "check": check, "losses_after": after}


def save_and_forward(rank, world, plan, root, moe, tokens: list) -> dict:
    """Train a step, checkpoint, and the live model's fp32 logits of `tokens` [B, T] (the same
    on every rank), as nested lists."""
    import torch

    trainee = Trainee(plan, world, moe)
    trainee.train(1)
    path = trainee.save(trainee.checkpointer(root))
    (model,) = trainee.runtime.model_parts  # no pipeline: one part, the whole model
    model.eval()
    model.head_in_loss = False  # logits out, not the hidden states the training loss reads
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).tolist()
    trainee.close()
    return {"path": path, "logits": logits}


def load_then_continue(rank, world, plan, root, steps_after, moe=False, train=None) -> dict:
    """Resume from the newest valid checkpoint, compare bitwise with it, train on."""
    trainee = Trainee(plan, world, moe, train)
    ckpt = trainee.checkpointer(root)
    step = trainee.load(ckpt)
    path = str(ckpt.select().path)
    check = compare_with_checkpoint(trainee.runtime.model_parts, trainee.optimizer, path)
    lr = trainee.optimizer.param_groups[0]["lr"]
    after = trainee.train(steps_after)
    trainee.close()
    return {"step": step, "check": check, "losses_after": after, "lr": lr}


def reshard_chain(rank, world, cases, root, steps_before, steps_after) -> list[dict]:
    """Several (save layout, load layout, moe[, train fields]) cases in one process group, one
    directory each."""
    out = []
    for index, (save_plan, load_plan, moe, *train) in enumerate(cases):
        case_root = str(Path(root) / f"case{index}")
        extra = train[0] if train else None
        saved = save_then_continue(
            rank, world, save_plan, case_root, steps_before, steps_after, moe, extra
        )
        loaded = load_then_continue(rank, world, load_plan, case_root, steps_after, moe, extra)
        out.append({"saved": saved, "loaded": loaded})
    return out


def async_save_overlapping_training(rank, world, plan, root) -> dict:
    """Save asynchronously, keep training while it is written, then check what was written is
    the state of the saving step (bitwise) and that the checkpoint verifies."""
    import torch

    from fivefold.checkpoint import manifest as mf
    from fivefold.checkpoint.dcp_io import read_full_tensors

    trainee = Trainee(plan, world)
    trainee.train(1)
    ckpt = trainee.checkpointer(root, async_save=True)
    at_save = full_state(trainee.runtime.model_parts, trainee.optimizer)
    path = trainee.save(ckpt)
    trainee.train(2)  # overlaps the background write
    ckpt.close()
    written = read_full_tensors(Path(path), prefix="")
    differ = [k for k, v in at_save.items() if not torch.equal(v, written[k])]
    moved = full_state(trainee.runtime.model_parts, trainee.optimizer)
    trainee.close()
    return {
        "differ": differ,
        "keys": sorted(at_save),
        "changed_since": sum(not torch.equal(moved[k], at_save[k]) for k in at_save),
        "valid": mf.verify_checkpoint(Path(path)).ok,
    }
