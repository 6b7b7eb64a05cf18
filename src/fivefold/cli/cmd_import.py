"""`fivefold import --hf DIR --out RUN_DIR`: start training from a Hugging Face Llama, Mistral,
Qwen2, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fivefold.checkpoint.manifest import list_checkpoints
from fivefold.cli.recipe_text import batch_lines, data_section, toml_value, train_section
from fivefold.errors import CheckpointError, DataError

# torch, numpy and tokenizers are imported inside the functions: `fivefold --help`
# imports every command module (fivefold.cli.main) and must stay quick.


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "import",
        help="start a run from a Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE "
        "or DeepSeek-V3 model",
        description="Turn a Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or "
        "DeepSeek-V3 directory (config.json + *.safetensors, experts one per expert or fused as "
        "transformers 5 holds them; no download, no pickled .bin files) into a weights-only "
        "fivefold checkpoint RUN_DIR/ckpt/step_0 and a recipe RUN_DIR/imported.toml whose [model] "
        "section is the imported architecture (with train.run_dir = RUN_DIR and train.resume = "
        "true) and whose [data] section trains with the model's own tokenizer "
        "(DIR/tokenizer.json, or --tokenizer; copied to RUN_DIR/tokenizer.json) on --shards or "
        "--inputs (default: the embedded corpus, tokenized with that tokenizer). Shards made "
        "with another tokenizer are refused. Then train from it with any layout: `fivefold "
        "train RUN_DIR/imported.toml [overrides]` (the run resumes from step_0 with the "
        "imported weights and a fresh optimizer, LR schedule and data order). What fivefold's "
        "model would not reproduce is refused by name (biases other than Qwen2's on Q, K and V, "
        "layer types other than sliding and full attention, RoPE scalings other than llama3, "
        "linear, dynamic and yarn (longrope: a deliberate limit), RoPE keys it does not read, "
        "Qwen3-MoE sparse layers other than all but a leading dense run, router jitter noise, "
        "DeepSeek-V3's fp8 quantization or an rms_norm_eps other than 1e-6); tensors whose "
        "names or shapes disagree with config.json are named.",
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
    parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="the model's tokenizer.json when DIR has none (it must end documents with "
        "<|endoftext|>, as `fivefold data tokenizer` makes them)",
    )
    data = parser.add_mutually_exclusive_group()
    data.add_argument(
        "--shards",
        type=Path,
        metavar="DIR",
        help="train on these prepared shards (`fivefold data prepare --tokenizer` with the "
        "model's tokenizer)",
    )
    data.add_argument(
        "--inputs",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="train on these .txt/.jsonl files, tokenized with the model's tokenizer",
    )
    parser.set_defaults(handler=_import)


def _import(args: argparse.Namespace) -> int:
    from fivefold.checkpoint.hf import import_hf

    root = args.out / "ckpt"
    if list_checkpoints(root):
        raise CheckpointError(
            f"--out {str(args.out)!r} already holds checkpoints in {str(root)!r}; choose a new "
            "run directory so the imported weights are its only checkpoint."
        )
    if args.seq_len is not None and args.seq_len < 1:
        raise CheckpointError(f"--seq-len {args.seq_len}: must be a positive number of tokens.")
    from fivefold.checkpoint.hf import read_hf

    spec, _ = read_hf(args.hf)  # refuses what cannot be imported before anything is written
    tokenizer = _model_tokenizer(args, spec.vocab)
    data = _data_section(args, tokenizer, spec.vocab)
    path = import_hf(args.hf, root, seq_len=args.seq_len)
    kept = tokenizer.save(args.out / "tokenizer.json")
    from fivefold.checkpoint.state import read_state

    model = read_state(path).model_spec
    train = {"run_dir": str(args.out.resolve()), "resume": True}  # resumes from step_0
    lines = [
        f"# Imported from {args.hf.resolve()} by `fivefold import`.",
        f"# Train with: fivefold train {args.out / 'imported.toml'} [section.field=value ...]",
        "# Defaults are written out (marked `default:`); change them for your run.",
        "",
        "[model]",
        *(f"{key} = {toml_value(value)}" for key, value in model.items()),
        "",
        "[plan]  # the layout: add tp, pp, dp_shard, zero, ... (`fivefold plan` picks one)",
        *batch_lines({}),
        "",
        *train_section(train),
        "",
        *data_section(data),
    ]
    lines.insert(
        lines.index("[data]") + 1,
        f"tokenizer = {toml_value(str(kept.resolve()))}  # the model's own: its ids are the "
        "weights'",
    )
    (args.out / "imported.toml").write_text("\n".join(lines) + "\n")
    trains_on = "your data" if {"shards", "inputs"} & set(data) else "the embedded corpus"
    print(
        f"imported {args.hf} as {path} (model {model['name']}: {model['layers']} layers, hidden "
        f"{model['hidden']}, vocab {model['vocab']}); tokenizer: {kept}; recipe: "
        f"{args.out / 'imported.toml'} (trains on {trains_on} with the model's tokenizer)"
    )
    return 0


def _model_tokenizer(args: argparse.Namespace, vocab: int):
    """The imported model's tokenizer (DIR/tokenizer.json or --tokenizer), checked to fit."""
    from fivefold.train.data.tokenizer import EOD_TOKEN, load_tokenizer

    path = args.tokenizer or args.hf / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"{str(args.hf)!r} has no tokenizer.json: without the model's own tokenizer the "
            "run would train on token ids that mean nothing to these weights. Pass "
            "--tokenizer PATH (the tokenizer the model was trained with)."
        )
    try:
        return load_tokenizer(path, max_vocab=vocab)
    except DataError as err:
        if EOD_TOKEN not in str(err):
            raise
        raise DataError(
            f"tokenizer {str(path)!r} has no {EOD_TOKEN} token, which fivefold's data pipeline "
            "ends every document with, so it cannot train this model on new data; pass "
            "--tokenizer with a tokenizer that has it (e.g. one `fivefold export` wrote)."
        ) from None


def _data_section(args: argparse.Namespace, tokenizer, vocab: int) -> dict[str, Any]:
    """[data] values for --shards / --inputs; shards of another tokenizer are refused here."""

    if args.shards is not None:
        from fivefold.train.data.shards import TokenShards

        if not args.shards.is_dir():
            raise DataError(f"--shards {str(args.shards)!r} is not a directory.")
        TokenShards(args.shards, tokenizer=tokenizer, max_vocab=vocab)  # DataError on mismatch
        return {"shards": str(args.shards.resolve())}
    if args.inputs:
        missing = [str(p) for p in args.inputs if not p.is_file()]
        if missing:
            raise DataError(f"--inputs: {', '.join(missing)} does not exist.")
        return {"inputs": [str(p.resolve()) for p in args.inputs]}
    return {}
