"""`fivefold export --hf OUT --from CKPT`: any checkpoint as a Hugging Face Llama model."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint as a Hugging Face Llama model",
        description="Write a Hugging Face LlamaForCausalLM directory (config.json + "
        "model.safetensors, sharded above 5 GiB) from a fivefold checkpoint written under any "
        "layout and world size; the full tensors are read in this one process (no torchrun). "
        "CKPT may be a run directory or checkpoint root (its newest valid checkpoint is "
        "used) or one step_<n> directory. Dense SwiGLU models only (Llama has no MoE and no "
        "GELU MLP). Load the result with "
        "`LlamaForCausalLM.from_pretrained(OUT)`.",
    )
    parser.add_argument(
        "--hf", required=True, type=Path, metavar="OUT", help="output directory (created)"
    )
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        type=Path,
        metavar="CKPT",
        help="a run directory, a checkpoint root or a step_<n> checkpoint directory",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="dtype of the exported weights (default: fp32, the training master weights)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="a tokenizer.json to copy into OUT (e.g. the one `fivefold data tokenizer` wrote)",
    )
    parser.set_defaults(handler=_export)


def resolve_checkpoint(path: Path) -> Path:
    """A step directory as given, or the newest valid checkpoint under a run dir / root."""
    from fivefold.checkpoint.manifest import MANIFEST_FILE, newest_valid, step_of
    from fivefold.errors import CheckpointError

    if not path.exists():
        raise CheckpointError(f"--from {str(path)!r} does not exist.")
    if step_of(path) is not None or (path / MANIFEST_FILE).is_file():
        from fivefold.checkpoint.manifest import verify_checkpoint

        result = verify_checkpoint(path)
        if not result.ok:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is not usable: {'; '.join(result.problems)}. Pick "
                "another one (`fivefold ckpt verify` lists the valid ones)."
            )
        return path
    choice = newest_valid(path)
    if choice.path is None:
        why = f" ({choice.describe_skipped()})" if choice.skipped else ""
        raise CheckpointError(f"--from {str(path)!r} holds no valid checkpoint{why}.")
    return choice.path


def _export(args: argparse.Namespace) -> int:
    import shutil

    from fivefold.checkpoint.hf import export_hf
    from fivefold.errors import CheckpointError

    source = resolve_checkpoint(args.source)
    summary = export_hf(source, args.hf, args.dtype)
    if args.tokenizer is not None:
        if not args.tokenizer.is_file():
            raise CheckpointError(f"--tokenizer {str(args.tokenizer)!r} is not a file.")
        shutil.copyfile(args.tokenizer, args.hf / "tokenizer.json")
        summary["files"].append("tokenizer.json")
    print(
        f"exported {source} (model {summary['model']}, step {summary['step']}, "
        f"{summary['parameters']:,} parameters, {args.dtype}) to {args.hf}: "
        f"{', '.join(summary['files'])} ({summary['bytes'] / 2**20:.1f} MiB)"
    )
    return 0
