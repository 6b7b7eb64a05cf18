"""Saving and resuming a run: sharded parallel writes, atomic commit, retention, fallback.

Details: docs/checkpoints.md.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fivefold.checkpoint import manifest
from fivefold.checkpoint.dcp_io import (
    Optimizers,
    async_writer,
    collect_state,
    group_hparams,
    load_into,
    save_tensors,
    save_tensors_async,
    ungroup_hparams,
)
from fivefold.checkpoint.state import (
    TrainingState,
    capture_rng,
    check_model_spec,
    read_state,
    restore_rng,
    rng_for_rank,
    write_state,
)
from fivefold.errors import CheckpointError

DIGEST_SUFFIX = ".digest.json"
FaultHook = Callable[[str], None]  # called with a phase name; tests raise or die there


# ---- process-group helpers (all no-ops in a single process) -------------------------------------
def _dist():
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def barrier() -> None:
    dist = _dist()
    if dist:
        dist.barrier()


def all_gather(obj: Any) -> list[Any]:
    dist = _dist()
    if not dist:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj: Any) -> list[Any] | None:
    dist = _dist()
    if not dist:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_from_main(obj: Any) -> Any:
    dist = _dist()
    if not dist:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- per-rank digests ---------------------------------------------------------------------------
def _rank_files(directory: Path, rank: int) -> list[str]:
    prefix = f"__{rank}_"
    return [p.name for p in Path(directory).iterdir() if p.is_file() and p.name.startswith(prefix)]


def write_rank_digest(directory: Path, rank: int) -> None:
    """Record this rank's files (size + SHA-256) for rank 0's manifest; written atomically."""
    digest = manifest.describe_files(directory, _rank_files(directory, rank))
    path = Path(directory) / f"__{rank}{DIGEST_SUFFIX}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(digest))
    tmp.replace(path)


def _collect_digests(directory: Path, world: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Wait for every rank's digest file and merge them (rank 0)."""
    deadline = time.monotonic() + timeout_s
    paths = [Path(directory) / f"__{r}{DIGEST_SUFFIX}" for r in range(world)]
    while True:
        missing = [r for r, p in enumerate(paths) if not p.is_file()]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint {str(directory)!r}: ranks {missing} did not finish writing within "
                f"{timeout_s:.0f} s; the checkpoint was not committed (the previous one stays)."
            )
        time.sleep(0.01)
    files: dict[str, dict[str, Any]] = {}
    for path in paths:
        files.update(json.loads(path.read_text()))
        path.unlink()
    return files


def commit_staging(
    staging: Path,
    final: Path,
    step: int,
    world: int,
    keep: int,
    timeout_s: float,
    before_rename: Callable[[], None] | None = None,
) -> Path:
    """Rank 0: manifest over every file of `staging` (ranks' digests + the rest), then rename."""
    files = _collect_digests(staging, world, timeout_s)
    rest = [name for name in manifest.data_files(staging) if name not in files]
    files.update(manifest.describe_files(staging, rest))
    manifest.write_manifest(staging, step, files, world)
    if before_rename is not None:
        before_rename()
    path = manifest.commit(staging, final)
    manifest.prune(final.parent, keep, protect=path)
    return path


# ---- the checkpointer ---------------------------------------------------------------------------
@dataclass
class _Pending:
    """An asynchronous save whose data or commit may still be running."""

    step: int
    final: Path
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Checkpointer:
    """Collective save/select/load of checkpoints under `root` (`<run_dir>/ckpt`).

    keep: newest checkpoints kept (0 keeps all). async_save: write in the background.
    commit_timeout_s: how long rank 0 waits for the other ranks' files before giving up.
    fault_hook: called with "written" (data and state written, nothing committed) and
    "manifest" (manifest written, not yet renamed): tests inject crashes there.
    """

    def __init__(
        self,
        root: Path,
        keep: int = 2,
        async_save: bool = False,
        commit_timeout_s: float = 600.0,
        fault_hook: FaultHook | None = None,
    ):
        self.root = Path(root)
        self.keep = keep
        self.async_save = async_save
        self.commit_timeout_s = commit_timeout_s
        self.fault_hook = fault_hook
        self.last_saved: Path | None = None
        self._pending: _Pending | None = None
        self._async_group = None
        self._async_writer = None
        dist = _dist()
        if async_save and dist:
            self._async_group = dist.new_group(backend="gloo")  # collective

    # ---- save ---------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model_parts: Sequence[nn.Module],
        optimizers: Optimizers,
        *,
        model_spec: dict[str, Any],
        plan: dict[str, Any],
        scheduler: Any = None,
        sampler: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Checkpoint step `step`; returns its final directory (committed when sync)."""
        self.wait()
        rank, world = rank_and_world()
        staging = manifest.staging_dir(self.root, step)
        final = self.root / manifest.step_dir_name(step)
        tensors, hparams = collect_state(model_parts, optimizers)
        per_rank = gather_to_main({"rng": capture_rng(), "hparams": hparams})
        if rank == 0:
            assert per_rank is not None
            merged: dict[str, dict[str, Any]] = {}
            for item in per_rank:
                merged.update(ungroup_hparams(item["hparams"]))
            state = TrainingState(
                step=step,
                model_spec=dict(model_spec),
                plan=dict(plan),
                world_size=world,
                contents=["model", "optimizer"] if optimizers is not None else ["model"],
                scheduler=_plain(scheduler.state_dict()) if scheduler is not None else None,
                sampler=_plain(sampler.state_dict()) if sampler is not None else None,
                rng=[item["rng"] for item in per_rank],
                optimizer_hparams=group_hparams(merged),
                extra=dict(extra or {}),
            )
            self._prepare_staging(staging, state)
        barrier()
        if self.async_save:
            self._save_async(tensors, step, staging, final, rank, world)
        else:
            self._save_sync(tensors, step, staging, final, rank, world)
        self.last_saved = final
        return final

    def _prepare_staging(self, staging: Path, state: TrainingState) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            write_state(staging, state)
        except OSError as err:
            raise CheckpointError(
                f"cannot write checkpoint {str(staging)!r} ({err.strerror}); check free disk "
                "space and the permissions of train.run_dir."
            ) from None

    def _fault(self, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase)

    def _save_sync(self, tensors, step: int, staging: Path, final: Path, rank: int, world: int):
        save_tensors(tensors, staging)
        write_rank_digest(staging, rank)
        barrier()
        if rank == 0:
            self._fault("written")
            self._commit(staging, final, step, world)
        barrier()

    def _commit(self, staging: Path, final: Path, step: int, world: int) -> None:
        commit_staging(
            staging,
            final,
            step,
            world,
            self.keep,
            self.commit_timeout_s,
            before_rename=lambda: self._fault("manifest"),
        )

    def _save_async(self, tensors, step: int, staging: Path, final: Path, rank: int, world: int):
        pending = _Pending(step, final)
        if self._async_writer is None:
            self._async_writer = async_writer()  # None on CPU: a fresh writer per save
        future = save_tensors_async(tensors, staging, self._async_group, self._async_writer)

        def finish(fut) -> None:
            try:
                fut.result()
                write_rank_digest(staging, rank)
                if rank == 0:
                    self._fault("written")
                    self._commit(staging, final, step, world)
            except BaseException as err:  # surfaced by wait() in the training thread
                pending.error = err
            finally:
                pending.done.set()

        self._pending = pending
        future.add_done_callback(finish)

    def wait(self) -> Path | None:
        """Block until an asynchronous save is written (and, on rank 0, committed)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.done.wait()
        if pending.error is not None:
            err = pending.error
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(
                f"the asynchronous save of step {pending.step} failed ({type(err).__name__}: "
                f"{err}); it was not committed and the previous checkpoint stays the newest."
            ) from err
        return pending.final

    def close(self) -> None:
        """Finish a pending asynchronous save (call before the process group is destroyed)."""
        self.wait()
        barrier()

    # ---- choose and load ----------------------------------------------------------------------
    def select(self, full: bool = True, clean_staging: bool = True) -> manifest.Selection:
        """The newest checkpoint every file of which verifies (collective; ranks split files).

        Also deletes staging directories left by crashed saves (`clean_staging`), so call it
        only when no save is running (at start-up).
        """
        rank, world = rank_and_world()
        candidates = None
        if rank == 0:
            if clean_staging:
                manifest.remove_staging(self.root)
            candidates = [str(p) for _, p in reversed(manifest.list_checkpoints(self.root))]
        candidates = broadcast_from_main(candidates)
        skipped: list[manifest.Verification] = []
        for name in candidates:
            result = manifest.verify_checkpoint(Path(name), full=full, shard=(rank, world))
            problems = sorted({p for ps in all_gather(result.problems) for p in ps})
            if not problems:
                result.ok, result.problems = True, []
                return manifest.Selection(Path(name), skipped)
            result.ok, result.problems = False, problems
            skipped.append(result)
        return manifest.Selection(None, skipped)

    def load(
        self,
        directory: Path,
        model_parts: Sequence[nn.Module],
        optimizers: Optimizers,
        *,
        model_spec: dict[str, Any],
        scheduler: Any = None,
        sampler: Any = None,
        restore_rng_state: bool = True,
    ) -> TrainingState:
        """Restore weights, optimizer, scheduler, sampler and RNG from `directory` (collective).

        The model spec must match (CheckpointError naming the fields otherwise). A weights-only
        checkpoint (e.g. imported from Hugging Face) leaves the optimizer, scheduler and sampler
        as they are.
        """
        directory = Path(directory)
        state = read_state(directory)
        check_model_spec(state, model_spec, directory)
        optim = optimizers if state.has_optimizer else None
        load_into(model_parts, optim, directory, state.optimizer_hparams)
        if scheduler is not None and state.scheduler is not None:
            scheduler.load_state_dict(state.scheduler)
        if sampler is not None and state.sampler is not None:
            sampler.load_state_dict(state.sampler)
        rng = rng_for_rank(state, rank_and_world()[0])
        if restore_rng_state and rng is not None:
            restore_rng(rng)
        return state


def _plain(value: Any) -> Any:
    """A state dict as JSON values (tensors as numbers or lists; tuples as lists)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if callable(value):
        raise CheckpointError(
            f"cannot store {value!r} in a checkpoint's state.json: schedulers and samplers must "
            "keep plain numbers in their state_dict."
        )
    return value


# ---- one-call forms -----------------------------------------------------------------------------
def save_checkpoint(
    root: Path, step: int, model_parts: Sequence[nn.Module], optimizers: Optimizers, **kwargs: Any
) -> Path:
    """Synchronous save with the default retention (see `Checkpointer.save` for the kwargs)."""
    keep = kwargs.pop("keep", 2)
    return Checkpointer(root, keep=keep).save(step, model_parts, optimizers, **kwargs)


def load_checkpoint(
    directory: Path, model_parts: Sequence[nn.Module], optimizers: Optimizers, **kwargs: Any
) -> TrainingState:
    return Checkpointer(Path(directory).parent).load(directory, model_parts, optimizers, **kwargs)
