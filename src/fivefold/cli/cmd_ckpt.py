"""`fivefold ckpt`: list (`ls`) and verify checkpoints.

fivefold ckpt ls DIR                 one line per checkpoint: step, size, files, valid?, saved by
fivefold ckpt verify DIR [--quick]   check every file against manifest.json (sizes, SHA-256)

DIR is a run directory (holding `ckpt/`), a checkpoint root, or one `step_<n>` directory. Both
commands read only the manifests and files (no torch import, no process group).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fivefold.checkpoint.manifest import (
    MANIFEST_FILE,
    list_checkpoints,
    list_staging,
    resolve_root,
    step_of,
    verify_checkpoint,
)
from fivefold.errors import CheckpointError

_DIR_HELP = (
    "a run directory (e.g. runs/small-cpu, holding ckpt/), a checkpoint root (ckpt/) or one "
    "step_<n> checkpoint directory"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ckpt",
        help="checkpoints: `ckpt ls DIR` lists them, `ckpt verify DIR` checks them",
        description="Inspect fivefold checkpoints. Each step_<n> directory holds DCP tensor "
        "shards written by every rank, state.json (step, schedule, data position, RNG, model "
        "and plan) and manifest.json (size and SHA-256 of every file). A save becomes visible "
        "only when complete; .staging_* directories are saves that are running or crashed.",
    )
    parser.set_defaults(handler=lambda args: (parser.print_help(), 0)[1])
    commands = parser.add_subparsers(dest="ckpt_command", metavar="ACTION")

    ls = commands.add_parser(
        "ls",
        aliases=["list"],
        help="list the checkpoints of a run (also `list`)",
        description="List the checkpoints under DIR, oldest first: step, size, number of "
        "files, whether the files match the manifest (sizes only, fast), the world size and "
        "plan that wrote it, and any staging directories of unfinished saves.",
    )
    ls.add_argument("dir", type=Path, metavar="DIR", help=_DIR_HELP)
    ls.set_defaults(handler=_ls)

    verify = commands.add_parser(
        "verify",
        help="check checkpoints against their manifests",
        description="Check every file of each checkpoint under DIR (or of the one checkpoint "
        "DIR) against manifest.json: present, of the recorded size, and with the recorded "
        "SHA-256. Prints one line per checkpoint and names the newest valid one, which is the "
        "one a resumed run would load. Exit status: 0 if the newest checkpoint is valid, 1 if "
        "any checkpoint is invalid, 2 if DIR holds no checkpoint.",
    )
    verify.add_argument("dir", type=Path, metavar="DIR", help=_DIR_HELP)
    verify.add_argument(
        "--quick", action="store_true", help="check presence and sizes only (skip SHA-256)"
    )
    verify.set_defaults(handler=_verify)


def _targets(path: Path) -> list[Path]:
    """The checkpoint directories DIR names (one, or all under a root), oldest first."""

    if not path.exists():
        raise CheckpointError(f"{str(path)!r} does not exist; give a run or checkpoint directory.")
    if step_of(path) is not None or (path / MANIFEST_FILE).is_file():
        return [path]
    found = [p for _, p in list_checkpoints(resolve_root(path))]
    if not found:
        raise CheckpointError(
            f"{str(path)!r} holds no checkpoints (no step_<n> directories under it or under "
            f"{str(path / 'ckpt')!r})."
        )
    return found


def _describe_writer(directory: Path) -> str:
    try:
        state = json.loads((directory / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "state.json unreadable"
    plan = state.get("plan") or {}
    degrees = [
        f"{k}{plan[k]}"
        for k in ("tp", "pp", "dp_replicate", "dp_shard", "cp", "ep")
        if plan.get(k, 1) > 1
    ]
    layout = " ".join(degrees) or "single"
    contents = "+".join(state.get("contents", []))
    return f"{state.get('world_size', '?')} rank(s), {layout}, {contents}"


def _ls(args: argparse.Namespace) -> int:

    targets = _targets(args.dir)
    print(f"{'step':>10}  {'MiB':>9}  {'files':>5}  {'sizes':<8}  written by")
    for path in targets:
        result = verify_checkpoint(path, full=False)
        status = "ok" if result.ok else "INVALID"
        print(
            f"{result.step if result.step is not None else '?':>10}  "
            f"{result.total_bytes / 2**20:>9.1f}  {result.files:>5}  {status:<8}  "
            f"{_describe_writer(path)}"
        )
        for problem in result.problems:
            print(f"{'':>10}  {problem}")
    for staging in list_staging(resolve_root(args.dir)):
        print(f"{'':>10}  {staging.name}: unfinished save (ignored; removed at the next start)")
    print(
        "(ls checks that every file of the manifest is there with its size; "
        "`fivefold ckpt verify` also checks the SHA-256 of each.)"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:

    results = [verify_checkpoint(path, full=not args.quick) for path in _targets(args.dir)]
    for result in results:
        print(f"{result.path}: {result.summary()}")
        for warning in result.warnings:
            print(f"  warning: {warning}")
    valid = [r for r in results if r.ok]
    if valid:
        print(f"newest valid checkpoint: {valid[-1].path}")
    else:
        print("no valid checkpoint: a resumed run would start from step 0")
    return 0 if all(r.ok for r in results) else 1
