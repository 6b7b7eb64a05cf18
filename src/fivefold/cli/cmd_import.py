"""`fivefold import --hf DIR --out RUN_DIR`: start training from a Hugging Face Llama model."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "import",
        help="start a run from a Hugging Face Llama model",
        description="Turn a Hugging Face Llama directory (config.json + *.safetensors; no "
        "download, no pickled .bin files) into a weights-only fivefold checkpoint "
        "RUN_DIR/ckpt/step_0 and a recipe RUN_DIR/imported.toml whose [model] section is the "
        "imported architecture (with train.run_dir = RUN_DIR and train.resume = true). Then "
        "train from it with any layout: `fivefold train RUN_DIR/imported.toml [overrides]` "
        "(the run resumes from step_0 with the imported weights and a fresh optimizer, LR "
        "schedule and data order). Llama models with biases or scaled RoPE (e.g. Llama 3.1's "
        "'llama3' rope type) are refused because fivefold's model would not reproduce them.",
    )
    parser.add_argument(
        "--hf", required=True, type=Path, metavar="DIR", help="the Hugging Face model directory"
    )
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="RUN_DIR",
        help="the run directory to create (its ckpt/ must not hold checkpoints yet)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        help="training sequence length for the recipe (default: the config's "
        "max_position_embeddings)",
    )
    parser.set_defaults(handler=_import)


def _import(args: argparse.Namespace) -> int:
    from fivefold.checkpoint.hf import import_hf
    from fivefold.checkpoint.manifest import list_checkpoints
    from fivefold.errors import CheckpointError

    root = args.out / "ckpt"
    if list_checkpoints(root):
        raise CheckpointError(
            f"--out {str(args.out)!r} already holds checkpoints in {str(root)!r}; choose a new "
            "run directory so the imported weights are its only checkpoint."
        )
    if args.seq_len is not None and args.seq_len < 1:
        raise CheckpointError(f"--seq-len {args.seq_len}: must be a positive number of tokens.")
    path = import_hf(args.hf, root, seq_len=args.seq_len)
    from fivefold.checkpoint.state import read_state

    model = read_state(path).model_spec
    lines = [
        f"# Imported from {args.hf.resolve()} by `fivefold import`.",
        f"# Train with: fivefold train {args.out / 'imported.toml'} [section.field=value ...]",
        "",
        "[model]",
        *(f"{key} = {_toml(value)}" for key, value in model.items()),
        "",
        "[train]",
        f"run_dir = {_toml(str(args.out.resolve()))}",
        "resume = true",
    ]
    (args.out / "imported.toml").write_text("\n".join(lines) + "\n")
    print(
        f"imported {args.hf} as {path} (model {model['name']}: {model['layers']} layers, hidden "
        f"{model['hidden']}, vocab {model['vocab']}); recipe: {args.out / 'imported.toml'}"
    )
    return 0


def _toml(value: object) -> str:
    """A TOML literal for the plain values of a model spec."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))
