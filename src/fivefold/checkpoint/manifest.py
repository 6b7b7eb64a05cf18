"""Checkpoint directories, their manifest, atomic commit, retention and verification.

Details: docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "fivefold-ckpt-manifest-v1"
STAGING_PREFIX = ".staging_"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_HASH_CHUNK_BYTES = 8 << 20


# ---- names -------------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step}"


def step_of(directory: Path) -> int | None:
    match = _STEP_DIR.match(Path(directory).name)
    return int(match.group(1)) if match else None


def staging_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{STAGING_PREFIX}{step_dir_name(step)}"


def resolve_root(path: Path) -> Path:
    """A run directory (holding `ckpt/`) or a checkpoint root -> the checkpoint root."""
    path = Path(path)
    return path / "ckpt" if (path / "ckpt").is_dir() else path


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed `step_<n>` directories under `root` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step_of(child), child) for child in root.iterdir() if child.is_dir()]
    return sorted((step, child) for step, child in found if step is not None)


def list_staging(root: Path) -> list[Path]:
    """Staging directories of saves that are running or crashed."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX))


# ---- checksums ---------------------------------------------------------------------------------
def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of one file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(Path(directory) / name) for name in sorted(names)}


def data_files(directory: Path) -> list[str]:
    """Every regular file of a checkpoint directory except the manifest itself."""
    return sorted(
        p.name for p in Path(directory).iterdir() if p.is_file() and p.name != MANIFEST_FILE
    )


# ---- manifest ----------------------------------------------------------------------------------
def write_manifest(
    directory: Path, step: int, files: dict[str, dict[str, Any]], world_size: int
) -> Path:
    """Write `manifest.json` (fsynced) listing `files` with their sizes and checksums."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "world_size": world_size,
        "created_unix_s": time.time(),
        "total_bytes": sum(f["bytes"] for f in files.values()),
        "files": files,
    }
    path = Path(directory) / MANIFEST_FILE
    with open(path, "w") as handle:
        handle.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory; CheckpointError if missing or malformed."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{str(directory)!r} has no {MANIFEST_FILE}: it is not a complete fivefold "
            "checkpoint (a save may have been interrupted, or it predates the manifest)."
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({err}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a {MANIFEST_FORMAT} manifest.")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and {"bytes", "sha256"} <= set(v) for v in files.values()
    ):
        raise CheckpointError(f"{str(path)!r} has a malformed file list.")
    return manifest


# ---- verification ------------------------------------------------------------------------------
@dataclass
class Verification:
    """Outcome of checking one checkpoint directory against its manifest."""

    path: Path
    step: int | None
    ok: bool
    problems: list[str] = field(default_factory=list)  # why it is unusable
    warnings: list[str] = field(default_factory=list)  # harmless oddities (extra files)
    total_bytes: int = 0
    files: int = 0
    checked: str = "full"  # "quick" (sizes) or "full" (sizes and SHA-256)

    def summary(self) -> str:
        if self.ok:
            return f"ok ({self.files} files, {self.total_bytes / 2**20:.1f} MiB, {self.checked})"
        return "INVALID: " + "; ".join(self.problems)


def check_files(
    directory: Path, expected: dict[str, dict[str, Any]], names: Iterable[str], full: bool
) -> list[str]:
    """Problems of the files `names` (a subset of `expected`) of `directory`."""
    problems = []
    for name in names:
        want = expected[name]
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"file {name} is missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"file {name} has {size} bytes, the manifest says {want['bytes']}")
            continue
        if full and file_digest(path)["sha256"] != want["sha256"]:
            problems.append(f"file {name} fails its SHA-256 checksum (corrupt)")
    return problems


def verify_checkpoint(
    directory: Path, full: bool = True, shard: tuple[int, int] = (0, 1)
) -> Verification:
    """Check `directory` against its manifest; `shard` = (index, count) checks only every
    count-th file starting at index (ranks verifying a checkpoint in parallel)."""
    directory = Path(directory)
    checked = "full" if full else "quick"
    result = Verification(directory, step_of(directory), ok=False, checked=checked)
    if not directory.is_dir():
        result.problems.append("directory does not exist")
        return result
    try:
        manifest = read_manifest(directory)
    except CheckpointError as err:
        result.problems.append(str(err))
        return result
    expected = manifest["files"]
    result.total_bytes = int(manifest.get("total_bytes", 0))
    result.files = len(expected)
    if result.step is not None and manifest.get("step") != result.step:
        result.problems.append(
            f"the manifest is for step {manifest.get('step')}, the directory for {result.step}"
        )
    index, count = shard
    mine = [name for i, name in enumerate(sorted(expected)) if i % count == index]
    result.problems += check_files(directory, expected, mine, full)
    extra = sorted(set(data_files(directory)) - set(expected))
    if extra:
        result.warnings.append(f"files not in the manifest (ignored): {', '.join(extra)}")
    result.ok = not result.problems
    return result


# ---- commit, retention, clean-up ---------------------------------------------------------------
def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (creations, renames) durable; a no-op where unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(staging: Path, final: Path) -> Path:
    """Atomically publish a complete staging directory as `final` (replacing an older one)."""
    staging, final = Path(staging), Path(final)
    fsync_dir(staging)
    if final.exists():  # re-saving a step (e.g. a resumed run that did no step): swap it out
        retired = final.with_name(f"{STAGING_PREFIX}retired_{final.name}")
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(final, retired)
        os.rename(staging, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, final)
    fsync_dir(final.parent)
    return final


def prune(root: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints (0 keeps all); returns the deleted."""
    if keep <= 0:
        return []
    found = list_checkpoints(root)
    doomed = [path for _, path in found[:-keep] if protect is None or path != Path(protect)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_staging(root: Path) -> list[Path]:
    """Delete leftover staging directories (call only when no save is running)."""
    removed = list_staging(root)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# ---- choosing a checkpoint ---------------------------------------------------------------------
@dataclass
class Selection:
    """The newest valid checkpoint of a root (None if there is none) and why newer were skipped."""

    path: Path | None
    skipped: list[Verification] = field(default_factory=list)

    def describe_skipped(self) -> str:
        return "; ".join(f"{v.path.name}: {v.summary()}" for v in self.skipped)


def newest_valid(root: Path, full: bool = True) -> Selection:
    """Walk checkpoints newest first and return the first that verifies."""
    skipped = []
    for _, path in reversed(list_checkpoints(resolve_root(root))):
        result = verify_checkpoint(path, full=full)
        if result.ok:
            return Selection(path, skipped)
        skipped.append(result)
    return Selection(None, skipped)
