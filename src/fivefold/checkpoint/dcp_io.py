"""Model and optimizer tensors to and from a DCP checkpoint, keyed by global parameter FQN.

Details: docs/internals.md (`fivefold.checkpoint.dcp_io`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fivefold.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from fivefold.errors import CheckpointError

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
_GROUPS = "param_groups."
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# DCP warns on every single-process save/load (also from its async writer thread) that it runs
# without a process group; here that is intended, so the warning is silenced once, by message.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or")


# ---- model parts ------------------------------------------------------------------------------
def merged_view(parts: Sequence[nn.Module]) -> nn.Module:
    """One module whose named parameters are the union of `parts` under their full-model FQNs.

    Children with the same name in several parts (e.g. each pipeline chunk's `layers`) are
    merged into one container; the parts' modules are shared, not copied.
    """
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    _merge_children(view, list(parts), "")
    return view


def _merge_children(target: nn.Module, sources: list[nn.Module], path: str) -> None:
    owners: dict[str, list[nn.Module]] = {}
    for source in sources:
        if source._parameters and any(p is not None for p in source._parameters.values()):
            where = path or "<root>"
            raise ValueError(f"model parts share the module {where!r}, which owns parameters")
        for name, child in source.named_children():
            owners.setdefault(name, []).append(child)
    for name, children in owners.items():
        distinct = list({id(c): c for c in children}.values())
        if len(distinct) == 1:
            target.add_module(name, distinct[0])
        else:
            container = nn.Module()
            _merge_children(container, distinct, f"{path}{name}.")
            target.add_module(name, container)


def _pairs(parts: Sequence[nn.Module], optimizers: Optimizers) -> list[tuple[nn.Module, Any]]:
    """(module, optimizer or None) pairs to take state dicts of."""
    if optimizers is None or isinstance(optimizers, torch.optim.Optimizer):
        return [(merged_view(parts), optimizers)]
    optimizers = list(optimizers)
    if len(optimizers) == 1:
        return [(merged_view(parts), optimizers[0])]
    if len(optimizers) != len(parts):
        raise ValueError(f"{len(optimizers)} optimizers for {len(parts)} model parts")
    return list(zip(parts, optimizers, strict=True))


# ---- hyperparameters (the non-tensor part of the optimizer state) -----------------------------
def _split_groups(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Flattened optimizer dict -> (tensor entries, {fqn: {hyperparameter: value}})."""
    tensors: dict[str, Any] = {}
    hparams: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(_GROUPS):
            fqn, name = key[len(_GROUPS) :].rsplit(".", 1)
            hparams.setdefault(fqn, {})[name] = value
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            raise CheckpointError(
                f"optimizer state {key!r} is a {type(value).__name__}, not a tensor; only "
                "optimizers whose per-parameter state is tensors (AdamW, SGD) are supported."
            )
    return tensors, hparams


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def group_hparams(per_fqn: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """{fqn: hparams} -> [{"hparams": {...}, "params": [fqn, ...]}], one entry per distinct set."""
    groups: dict[str, dict[str, Any]] = {}
    for fqn in sorted(per_fqn):
        values = {k: _jsonable(v) for k, v in sorted(per_fqn[fqn].items())}
        key = repr(values)
        groups.setdefault(key, {"hparams": values, "params": []})["params"].append(fqn)
    return list(groups.values())


def ungroup_hparams(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {fqn: group["hparams"] for group in groups for fqn in group["params"]}


def _like(saved: Any, live: Any) -> Any:
    """A JSON value in the type of the live hyperparameter (tuples stay tuples)."""
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(_like(s, item) for s, item in zip(saved, live, strict=False))
    if isinstance(live, torch.Tensor) and not isinstance(saved, torch.Tensor):
        return torch.tensor(saved, dtype=live.dtype, device=live.device)
    return saved


# ---- tied embeddings ----------------------------------------------------------------------------
# A tied LM head on its own pipeline stage is a copy of the embedding (kept equal by
# `fivefold.parallel.tied_embeddings`); its optimizer state is saved and loaded under the
# embedding's name, as the single-process model (one Parameter) has it. Model weights keep both
# names, as the single-process state dict does.
_TIED_HEAD, _EMBEDDING = "output.weight", "tok_embeddings.weight"


def _is_tied(parts: Sequence[nn.Module]) -> bool:
    spec = getattr(parts[0], "spec", None) if parts else None
    return bool(getattr(spec, "tied_embeddings", False))


def _optim_key(key: str, tied: bool) -> str:
    """The checkpoint key of a flattened optimizer entry ("state.<fqn>.<name>" or
    "param_groups.<fqn>.<name>"): a tied head's is its embedding's."""
    for section in ("state.", _GROUPS):
        if tied and key.startswith(section + _TIED_HEAD + "."):
            return section + _EMBEDDING + key[len(section + _TIED_HEAD) :]
    return key


# ---- collect / apply ----------------------------------------------------------------------------
def collect_state(
    parts: Sequence[nn.Module], optimizers: Optimizers
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """This rank's tensors under global keys, and its optimizer hyperparameter groups."""
    tensors: dict[str, torch.Tensor] = {}
    hparams: dict[str, dict[str, Any]] = {}
    tied = _is_tied(parts)
    for module, optimizer in _pairs(parts, optimizers):
        for fqn, value in get_model_state_dict(module, options=_OPTIONS).items():
            tensors[MODEL_PREFIX + fqn] = value
        if optimizer is not None:
            flat = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
            # both copies on one rank (V schedules): equal, saved once
            flat = {_optim_key(k, tied): v for k, v in flat.items()}
            optim_tensors, optim_hparams = _split_groups(flat)
            tensors.update({OPTIM_PREFIX + k: v for k, v in optim_tensors.items()})
            hparams.update(optim_hparams)
    return tensors, group_hparams(hparams)


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path, process_group=None) -> None:
    """Write this rank's share with DCP (collective over the default or given group)."""
    writer = dcp.FileSystemWriter(str(directory), sync_files=True)
    with translate_dcp_errors(f"saving checkpoint {str(directory)!r}"):
        dcp.save(
            tensors, storage_writer=writer, process_group=process_group, no_dist=not _distributed()
        )


def async_writer() -> dcp.FileSystemWriter | None:
    """With CUDA, a writer for repeated asynchronous saves that keeps its pinned host-memory
    staging buffers between saves; None on CPU (DCP pins those buffers, which needs CUDA)."""
    if not torch.cuda.is_available():
        return None
    return dcp.FileSystemWriter("", sync_files=True, cache_staged_state_dict=True)


def save_tensors_async(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    process_group=None,
    writer: dcp.FileSystemWriter | None = None,
):
    """Copy this rank's share to host memory, then write it in a background thread.

    Returns a future that completes when this rank's files and (on the coordinator) the index
    are written. Collective over `process_group` (use a group dedicated to checkpointing).
    Reusing `writer` (from `async_writer`) requires the previous save to have finished.
    """
    writer = writer or dcp.FileSystemWriter(str(directory), sync_files=True)
    with translate_dcp_errors(f"saving checkpoint {str(directory)!r}"):
        result = dcp.async_save(
            tensors,
            checkpoint_id=str(directory),
            storage_writer=writer,
            process_group=process_group,
            no_dist=not _distributed(),
        )
    return getattr(result, "upload_completion", result)


def load_into(
    parts: Sequence[nn.Module],
    optimizers: Optimizers,
    directory: Path,
    hparam_groups: list[dict[str, Any]] | None,
) -> None:
    """Fill the parts' parameters (and optimizer state unless `optimizers` is None) from DCP.

    Collective: every rank calls it. Each rank reads exactly the slices its layout holds, so the
    result is bitwise the saved values whatever layout wrote them.
    """
    saved_hparams = ungroup_hparams(hparam_groups or [])
    pairs = _pairs(parts, optimizers)
    tied = _is_tied(parts)
    live: list[tuple[nn.Module, Any, dict[str, Any], dict[str, Any] | None]] = []
    request: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, str]] = []  # (a second tied copy, the key that fills it)
    for module, optimizer in pairs:
        model_sd = get_model_state_dict(module, options=_OPTIONS)
        request.update({MODEL_PREFIX + k: v for k, v in model_sd.items()})
        optim_sd = None
        if optimizer is not None:
            optim_sd = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
            optim_tensors, _ = _split_groups(optim_sd)
            for key, value in optim_tensors.items():
                key = OPTIM_PREFIX + _optim_key(key, tied)
                if key in request:
                    copies.append((value, key))
                else:
                    request[key] = value
        live.append((module, optimizer, model_sd, optim_sd))
    _check_against_index(directory, request)
    with translate_dcp_errors(f"loading checkpoint {str(directory)!r}"):
        dcp.load(
            request,
            storage_reader=SafeFileSystemReader(str(directory)),
            planner=SafeLoadPlanner(),
            no_dist=not _distributed(),
        )
    for copy, key in copies:
        copy.copy_(request[key])
    for module, optimizer, model_sd, optim_sd in live:
        # DCP filled these tensors in place; setting them runs the wrappers' load hooks.
        set_model_state_dict(module, model_sd, options=_OPTIONS)
        if optimizer is None or optim_sd is None:
            continue
        for key in list(optim_sd):
            if not key.startswith(_GROUPS):
                continue
            fqn, name = _optim_key(key, tied)[len(_GROUPS) :].rsplit(".", 1)
            if fqn not in saved_hparams:
                raise CheckpointError(
                    f"checkpoint {str(directory)!r} has no optimizer hyperparameters for "
                    f"{fqn!r}; its state.json does not match its tensors."
                )
            if name in saved_hparams[fqn]:
                optim_sd[key] = _like(saved_hparams[fqn][name], optim_sd[key])
        set_optimizer_state_dict(module, optimizer, optim_sd, options=_OPTIONS)


def _check_against_index(directory: Path, request: dict[str, torch.Tensor]) -> None:
    """CheckpointError naming the keys and shapes the checkpoint lacks (before DCP reads)."""
    try:
        metadata = SafeFileSystemReader(str(directory)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has no DCP index (.metadata); it is incomplete."
        ) from None
    index = metadata.state_dict_metadata
    missing = sorted(key for key in request if key not in index)
    wrong = sorted(
        f"{key} {tuple(index[key].size)} (model: {tuple(_global_shape(request[key]))})"
        for key in request
        if key in index
        and isinstance(index[key], TensorStorageMetadata)
        and tuple(index[key].size) != tuple(_global_shape(request[key]))
    )
    not_tensors = sorted(
        key for key in request if key in index and not isinstance(index[key], TensorStorageMetadata)
    )
    problems = []
    if missing:
        problems.append(f"it lacks {len(missing)} tensor(s): {', '.join(missing[:4])}")
    if wrong:
        problems.append(f"shapes differ: {', '.join(wrong[:4])}")
    if not_tensors:
        problems.append(f"it stores non-tensors under {', '.join(not_tensors[:4])}")
    if problems:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} does not fit this model and optimizer: "
            + "; ".join(problems)
            + ". Resume with the recipe it was written by."
        )


def _global_shape(tensor: torch.Tensor) -> torch.Size:
    return tensor.shape  # a DTensor reports its global shape


@contextlib.contextmanager
def translate_dcp_errors(what: str):
    """DCP's CheckpointException (a BaseException carrying every rank's error) as our
    CheckpointError; a CheckpointError raised inside DCP (e.g. by the safe reader) as itself."""
    try:
        yield
    except CheckpointException as err:
        causes = [pair[0] for pair in err.failures.values()]
        for cause in causes:
            if isinstance(cause, CheckpointError):
                raise cause from None
        ranks = sorted(err.failures)
        first = causes[0] if causes else err
        raise CheckpointError(
            f"{what} failed on rank(s) {ranks}: {type(first).__name__}: {first}. For a save, "
            "check free disk space and permissions; for a load, that the checkpoint is intact "
            "(`fivefold ckpt verify`) and fits the recipe's model."
        ) from None


# ---- reading without a process group (export) ---------------------------------------------------
def read_full_tensors(directory: Path, prefix: str = MODEL_PREFIX) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` as a full CPU tensor (no process group needed), keys unprefixed.

    Memory: the whole model in one process (fp32: 4 bytes per parameter).
    """
    reader = SafeFileSystemReader(str(directory))
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"{str(directory)!r} has no DCP index (.metadata); it is not a fivefold checkpoint."
        ) from None
    request: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(meta, "size"):
            request[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not request:
        raise CheckpointError(f"checkpoint {str(directory)!r} holds no tensors under {prefix!r}.")
    with translate_dcp_errors(f"reading {str(directory)!r}"):
        dcp.load(request, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return {key[len(prefix) :]: value for key, value in request.items()}
