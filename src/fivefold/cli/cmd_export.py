"""`fivefold export --hf OUT --from CKPT`: any checkpoint as a Hugging Face Llama, Mistral,
Qwen2, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fivefold.checkpoint.manifest import MANIFEST_FILE, newest_valid, step_of, verify_checkpoint
from fivefold.errors import CheckpointError
from fivefold.specs.recipe import read_toml

# torch, numpy and tokenizers are imported inside the functions: `fivefold --help`
# imports every command module (fivefold.cli.main) and must stay quick.


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint as a Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, "
        "Qwen3-MoE or DeepSeek-V3 model",
        description="Write a self-contained Hugging Face LlamaForCausalLM directory (Mistral "
        "for a window in every layer, Qwen2 for a model with model.qkv_bias, Qwen3 for one "
        "with model.qk_norm; a mixture of experts as Mixtral, or as Qwen3-MoE with "
        "model.qk_norm; latent attention as DeepSeek-V3; one tensor per expert as published "
        "checkpoints have them) "
        "(config.json, model.safetensors sharded above 5 GiB, tokenizer.json, "
        "tokenizer_config.json and generation_config.json with <|endoftext|> as bos/eos/pad, "
        "all mode 0644) from a fivefold checkpoint written under any layout and world size; "
        "the full tensors are read in this one process (no torchrun). CKPT may be a run "
        "directory or checkpoint root (its newest valid checkpoint is used, and newer corrupt "
        "ones are named) or one step_<n> directory. The tokenizer is the run's (data.tokenizer "
        "of its recipe.toml, else the default one) unless --tokenizer names another. SwiGLU "
        "models only; what no family holds (shared experts without latent attention, leading "
        "dense layers without QK-norm or latent attention, a window in some MoE layers only) "
        "is refused by name. Load the result with "
        "`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)`.",
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
        help="the tokenizer.json to export (default: the run's, from its recipe.toml; e.g. the "
        "one `fivefold data tokenizer` wrote)",
    )
    parser.set_defaults(handler=_export)


def select_checkpoint(path: Path) -> tuple[Path, str]:
    """(checkpoint, note): a step directory as given, or the newest valid checkpoint under a
    run dir / root; the note names newer checkpoints that were skipped as corrupt ("" if none)."""

    if not path.exists():
        raise CheckpointError(f"--from {str(path)!r} does not exist.")
    if step_of(path) is not None or (path / MANIFEST_FILE).is_file():
        result = verify_checkpoint(path)
        if not result.ok:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is not usable: {'; '.join(result.problems)}. Pick "
                "another one (`fivefold ckpt verify` lists the valid ones)."
            )
        return path, ""
    choice = newest_valid(path)
    if choice.path is None:
        why = f" ({choice.describe_skipped()})" if choice.skipped else ""
        raise CheckpointError(f"--from {str(path)!r} holds no valid checkpoint{why}.")
    note = (
        f"warning: newer checkpoint(s) are corrupt and were skipped ({choice.describe_skipped()})"
        f"; exporting the newest valid one, {choice.path.name}. Pass --from "
        f"{choice.path} to choose it explicitly."
        if choice.skipped
        else ""
    )
    return choice.path, note


# A run directory's recipe: written by `train` when it starts, or by `import --hf`.
RUN_RECIPES = ("recipe.toml", "imported.toml")


def run_tokenizer(checkpoint: Path, vocab: int, explicit: Path | None):
    """The tokenizer to export: `explicit`, else the one the checkpoint's run trained with
    (its recipe's data.tokenizer, `RUN_RECIPES` in order, else the default tokenizer); None
    if the run directory has neither recipe."""
    from fivefold.train.data.tokenizer import default_tokenizer, load_tokenizer

    if explicit is not None:
        return load_tokenizer(explicit, max_vocab=vocab)
    found = [checkpoint.parent.parent / name for name in RUN_RECIPES]
    recipe = next((path for path in found if path.is_file()), None)
    if recipe is None:
        return None
    data = read_toml(recipe).get("data", {})
    name = data.get("tokenizer") if isinstance(data, dict) else None
    if name:
        return load_tokenizer(Path(name), max_vocab=vocab)
    return default_tokenizer(max_vocab=vocab)


def _export(args: argparse.Namespace) -> int:
    from fivefold.checkpoint.hf import export_hf
    from fivefold.checkpoint.state import read_state

    source, note = select_checkpoint(args.source)
    if note:
        print(note, file=sys.stderr)
    vocab = int(read_state(source).model_spec["vocab"])
    tokenizer = run_tokenizer(source, vocab, args.tokenizer)
    summary = export_hf(source, args.hf, args.dtype, tokenizer)
    print(
        f"exported {source} (model {summary['model']}, step {summary['step']}, "
        f"{summary['parameters']:,} parameters, {args.dtype}) to {args.hf}: "
        f"{', '.join(summary['files'])} ({summary['bytes'] / 2**20:.1f} MiB)"
    )
    if tokenizer is None:
        print(
            f"warning: no tokenizer exported: {source.parent.parent} has no recipe.toml or "
            "imported.toml to say which one the run used; pass --tokenizer PATH (the run's "
            "data.tokenizer) so the directory is self-contained.",
            file=sys.stderr,
        )
    return 0
