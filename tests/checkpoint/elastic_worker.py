"""A training job for the elastic-restart test, run under `torchrun --max-restarts`.

Every rank: build the layout with `DistributedRuntime`, resume from the newest valid checkpoint
when there is one (always after an elastic restart), train to --steps saving every step, and
rank 0 appends one JSON line per step ({"attempt", "step", "loss"}) to --log. On the first
attempt only, rank --kill-rank SIGKILLs itself in the middle of step --kill-step (after its
forward and backward, before the optimizer step), as a crashed node would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True, help="ParallelPlan fields as JSON")
    parser.add_argument("--root", required=True)
    parser.add_argument("--loss-log", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from ckpt_workers import Trainee, global_batch, rank_micro_batches

    from fivefold.checkpoint.elastic import should_resume
    from fivefold.parallel.process_group import collective_guard, restart_count

    # DistributedRuntime creates the process group (fivefold.parallel.process_group's, namespaced by
    # restart attempt) and destroys it in close().
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    trainee = Trainee(json.loads(args.plan), world)
    ckpt = trainee.checkpointer(args.root, keep=2)
    choice = ckpt.select()
    if should_resume("auto", choice.path is not None):
        trainee.load(ckpt, str(choice.path))
    runtime, recipe = trainee.runtime, trainee.recipe
    attempt = restart_count()
    while trainee.step < args.steps:
        batch = global_batch(trainee.step, recipe.model.vocab, recipe.model.seq_len)
        micro = rank_micro_batches(batch, runtime.dp_rank, runtime.dp_size, recipe.plan.grad_accum)
        with collective_guard(f"step {trainee.step + 1}"):
            result = runtime.train_step(micro)
            if attempt == 0 and rank == args.kill_rank and trainee.step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            runtime.clip_grad_norm(trainee.cfg.grad_clip)
        trainee.optimizer.step()
        trainee.optimizer.zero_grad(set_to_none=True)
        trainee.scheduler.step()
        trainee.step += 1
        if rank == 0:
            with open(args.loss_log, "a") as log:
                line = {"attempt": attempt, "step": trainee.step, "loss": result.loss}
                log.write(json.dumps(line) + "\n")
        trainee.save(ckpt)
    ckpt.close()
    trainee.close()


if __name__ == "__main__":
    main()
