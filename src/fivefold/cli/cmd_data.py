"""`fivefold data`: train a tokenizer and turn text into token shards.

fivefold data tokenizer INPUTS... --out PATH [--vocab N] [--text-field F]
fivefold data prepare INPUTS... --out DIR [--tokenizer PATH] [--workers N] [--text-field F]
fivefold data info DIR
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fivefold.errors import ConfigError, DataError

# fivefold.train.data (numpy, tokenizers) is imported inside the functions: `fivefold --help`
# imports every command module (fivefold.cli.main) and must stay quick.

_INPUTS_HELP = (
    "text files: .txt (one document per file, or documents separated by lines that read "
    '<|endoftext|>) or .jsonl (one JSON object per line with the document in its "text" field); '
    "either may be gzipped (.txt.gz, .jsonl.gz); or tables: .parquet and .arrow (Arrow IPC, as "
    'Hugging Face datasets saves them) with the documents in a "text" column'
)
_TEXT_FIELD_HELP = (
    "the JSONL field or Parquet/Arrow column that holds the documents (default: text)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data",
        help="train a tokenizer and prepare token shards",
        description="Train a byte-level BPE tokenizer and turn text, JSONL, Parquet or Arrow "
        "files into memory-mapped token shards that keep document boundaries. Without them, "
        "training uses the embedded corpus (Jane Austen's six novels, public domain), tokenised "
        "on first use into ${FIVEFOLD_CACHE:-~/.cache/fivefold}.",
    )
    parser.set_defaults(handler=lambda args: (parser.print_help(), 0)[1])
    commands = parser.add_subparsers(dest="data_command", metavar="ACTION")

    tok = commands.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on your text",
        description="Train a byte-level BPE tokenizer (with an <|endoftext|> token that ends "
        "every document) on INPUTS and save it as a tokenizers JSON file. Training is "
        "deterministic: the same inputs and --vocab give the same file.",
    )
    tok.add_argument("inputs", nargs="+", type=Path, metavar="INPUTS", help=_INPUTS_HELP)
    tok.add_argument(
        "--out", required=True, type=Path, metavar="PATH", help="where to write the tokenizer JSON"
    )
    tok.add_argument(
        "--vocab",
        type=int,
        default=4096,
        metavar="N",
        help="vocabulary size, at most the model's vocab (default: 4096, the "
        "tiny/small presets' vocab; at least 257, at most 2^24)",
    )
    tok.add_argument("--text-field", default="text", metavar="NAME", help=_TEXT_FIELD_HELP)
    tok.set_defaults(handler=_tokenizer)

    _add_prepare_parser(commands)

    info = commands.add_parser(
        "info",
        help="describe and verify a shard directory",
        description="Check a shard directory (files, sizes, checksums) and print its counts.",
    )
    info.add_argument("directory", type=Path, metavar="DIR", help="shard directory")
    info.set_defaults(handler=_info)


def _add_prepare_parser(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser(
        "prepare",
        help="tokenise text into memory-mapped shards",
        description="Tokenise INPUTS into DIR: uint16 (uint32 past 65,536 tokens) token files "
        "with every document followed by the end-of-document token, document offsets, and a "
        "manifest.json recording the tokenizer hash, counts and each file's checksum. Worker "
        "processes tokenise in parallel; DIR appears only when complete (pieces are staged in "
        ".DIR.partial, and a killed preparation rerun with the same arguments resumes there). "
        "The shards are checked against the tokenizer and the model's vocabulary when training "
        "opens them.",
    )
    prep.add_argument("inputs", nargs="+", type=Path, metavar="INPUTS", help=_INPUTS_HELP)
    prep.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="output shard directory (created; must be new or empty)",
    )
    prep.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="tokenizer JSON from `fivefold data tokenizer` (default: the "
        "4096-token tokenizer trained on the embedded corpus)",
    )
    prep.add_argument("--force", action="store_true", help="replace the shards already in DIR")
    prep.add_argument("--text-field", default="text", metavar="NAME", help=_TEXT_FIELD_HELP)
    prep.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenising processes (default: the cores there are); a large uncompressed JSONL "
        "file is cut into 64 MiB pieces, other files are one piece each",
    )
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 28,
        metavar="N",
        help="start a new shard file after N tokens (default: 2^28)",
    )
    prep.set_defaults(handler=_prepare)


def _tokenizer(args: argparse.Namespace) -> int:
    from fivefold.train.data import train_tokenizer

    parent = args.out.parent
    if args.out.is_dir() or not parent.is_dir():
        problem = "is a directory" if args.out.is_dir() else f"{str(parent)!r} does not exist"
        raise ConfigError(
            f"--out {str(args.out)!r}: {problem}; name a file in an existing directory "
            "(e.g. tokenizer.json)."
        )
    started = time.perf_counter()
    tok = train_tokenizer(args.inputs, args.vocab, out=args.out, text_field=args.text_field)
    print(
        f"tokenizer: {tok.vocab_size} tokens (end-of-document id {tok.eod_id}), hash "
        f"{tok.hash[:12]}, trained in {time.perf_counter() - started:.1f} s -> {args.out}"
    )
    if tok.vocab_size < args.vocab:  # the text held fewer merges than asked for
        print(
            f"note: {tok.vocab_size} of the {args.vocab} tokens asked for (--vocab): the inputs "
            f"hold no more distinct merges; a model trained with it needs only model.vocab = "
            f"{tok.vocab_size} (a larger vocab leaves {args.vocab - tok.vocab_size} embedding "
            "rows unused), or train it on more text"
        )
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from fivefold.cli.data_progress import prepare_progress
    from fivefold.train.data import (
        TokenShards,
        default_tokenizer,
        load_tokenizer,
        prepare_shards,
    )
    from fivefold.train.data.documents import check_inputs

    if args.shard_tokens < 1:
        raise DataError(f"--shard-tokens {args.shard_tokens} must be at least 1.")
    if args.workers is not None and args.workers < 1:
        raise DataError(f"--workers {args.workers} must be at least 1.")
    inputs = check_inputs(args.inputs)  # fail fast, before training the default tokenizer
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else default_tokenizer()
    started = time.perf_counter()
    with prepare_progress(sum(p.stat().st_size for p in inputs)) as progress:
        out = prepare_shards(
            inputs,
            args.out,
            tok,
            shard_tokens=args.shard_tokens,
            overwrite=args.force,
            workers=args.workers,
            text_field=args.text_field,
            progress=progress,
            notify=print,
        )
    elapsed = time.perf_counter() - started
    shards = TokenShards(out, tokenizer=tok)
    print(
        f"prepared {shards.num_documents} documents, {shards.num_tokens} tokens in "
        f"{len(shards.manifest['shards'])} shard(s) ({shards.num_tokens / elapsed:,.0f} tokens/s, "
        f"{elapsed:.1f} s) -> {out}"
    )
    print(_doc_len_line(shards.document_lengths()))
    return 0


def _doc_len_line(stats: dict) -> str:
    """What the planner takes from the documents' lengths (`fivefold.specs.model.doc_len`)."""
    return (
        f"  doc length mean {stats['mean']:,.0f} tokens, token-weighted "
        f"{stats['token_weighted_mean']:,} (attention is priced per document: fivefold plan "
        f"--doc-len {stats['token_weighted_mean']}, or [model] doc_len in a recipe)"
    )


def _info(args: argparse.Namespace) -> int:
    from fivefold.train.data import TokenShards

    shards = TokenShards(args.directory)
    lengths = shards.doc_starts[1:] - shards.doc_starts[:-1]
    manifest = shards.manifest
    checked = sum(1 + bool(s.get("offsets_blake2b")) for s in manifest["shards"])
    print(f"{args.directory}: verified ({checked} file checksums match the manifest)")
    print(f"  tokens     {shards.num_tokens} ({manifest['token_dtype']})")
    print(
        f"  documents  {shards.num_documents} (tokens each: min {lengths.min()}, "
        f"median {int(sorted(lengths)[len(lengths) // 2])}, max {lengths.max()})"
    )
    print(_doc_len_line(shards.document_lengths()))
    print(f"  vocab      {shards.vocab_size} (end-of-document id {shards.eod_id})")
    print(f"  tokenizer  {manifest.get('tokenizer_path') or '?'} ({shards.tokenizer_hash[:12]})")
    print(
        f"  shards     {len(manifest['shards'])}; inputs: "
        + ", ".join(i["path"] for i in manifest["inputs"])
    )
    return 0
