"""`fivefold sample RUN`: generate text from a run's newest valid checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fivefold.cli.cmd_export import run_tokenizer, select_checkpoint
from fivefold.errors import ConfigError
from fivefold.specs.model import ModelSpec

# torch and the model are imported inside the functions: `fivefold --help`
# imports every command module (fivefold.cli.main) and must stay quick.

_DESCRIPTION = """\
Generate text from a run's newest valid checkpoint (or one step_<n> directory), in this one
process, with the tokenizer the run trained with (data.tokenizer of its recipe.toml or, after
`import --hf`, imported.toml, else the default one; --tokenizer overrides). Greedy (--greedy)
or nucleus sampling (--top-p, default 0.9, with --temperature and --seed: the same seed gives
the same text). Generation stops at the
end-of-document token or after --max-tokens. Any layout's checkpoint works (the full tensors are
read without torchrun); no KV cache, so it is meant for small models.
"""

_EPILOG = """\
examples:
  fivefold sample runs/small-cpu --prompt "It is a truth universally acknowledged"
  fivefold sample runs/small-cpu --greedy --max-tokens 50
  fivefold sample runs/small-cpu/ckpt/step_200 --top-p 0.95 --temperature 0.8 --seed 3 -n 3
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sample",
        help="generate text from a run's latest checkpoint",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        type=Path,
        metavar="RUN",
        help="a run directory (runs/NAME), its ckpt/ root, or one step_<n> checkpoint",
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: none)")
    parser.add_argument(
        "--max-tokens", type=int, default=100, metavar="N", help="tokens to generate (100)"
    )
    parser.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    parser.add_argument(
        "--top-p",
        type=float,
        default=0.9,
        metavar="P",
        help="nucleus sampling: draw from the likeliest tokens holding P of the mass (0.9)",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="logit divisor (1.0)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    parser.add_argument("-n", "--num", type=int, default=1, metavar="K", help="samples (1)")
    parser.add_argument(
        "--tokenizer", type=Path, metavar="PATH", help="tokenizer.json (default: the run's)"
    )
    parser.set_defaults(handler=handle, imports=("torch",))


def check_args(args: argparse.Namespace) -> None:
    problems = []
    if args.max_tokens < 1:
        problems.append(f"--max-tokens {args.max_tokens}: generate at least 1 token, e.g. 100.")
    if not 0.0 < args.top_p <= 1.0:
        problems.append(f"--top-p {args.top_p}: must be in (0, 1], e.g. 0.9.")
    if not args.temperature > 0.0 or args.temperature == float("inf"):
        problems.append(f"--temperature {args.temperature}: must be a positive number, e.g. 1.0.")
    if args.num < 1:
        problems.append(f"--num {args.num}: must be at least 1.")
    if args.seed < 0:
        problems.append(f"--seed {args.seed}: must be >= 0.")
    if problems:
        raise ConfigError(problems)


def load_checkpoint_model(checkpoint: Path):
    """(spec, model in eval mode on CPU, fp32) from any checkpoint, without a process group."""
    from fivefold.checkpoint.dcp_io import read_full_tensors
    from fivefold.checkpoint.state import read_state
    from fivefold.model import build_model

    state = read_state(checkpoint)
    spec = ModelSpec(**{k: v for k, v in state.model_spec.items() if k != "notes"})
    model = build_model(spec)
    model.to_empty(device="cpu")
    tensors = read_full_tensors(checkpoint)
    if spec.tied_embeddings:
        tensors.setdefault("output.weight", tensors.get("tok_embeddings.weight"))
    model.load_state_dict(tensors, strict=False)
    return spec, model.eval()


def handle(args: argparse.Namespace) -> int:
    import torch

    from fivefold.model.generate import generate

    check_args(args)
    checkpoint, note = select_checkpoint(args.source)
    if note:
        print(note.replace("exporting", "sampling from"), file=sys.stderr)
    spec, model = load_checkpoint_model(checkpoint)
    tokenizer = run_tokenizer(checkpoint, spec.vocab, args.tokenizer)
    if tokenizer is None:
        raise ConfigError(
            f"{checkpoint.parent.parent} has no recipe.toml or imported.toml to say which "
            "tokenizer the run used; pass --tokenizer PATH."
        )
    prompt = tokenizer.encode(args.prompt) or [tokenizer.eod_id]  # nothing: a document's start
    top_p = None if args.greedy else args.top_p
    how = "greedy" if top_p is None else f"top-p {top_p}, temperature {args.temperature}"
    print(f"# {checkpoint} ({spec.name}), {how}, seed {args.seed}", file=sys.stderr)
    generator = torch.Generator().manual_seed(args.seed)
    for index in range(args.num if top_p is not None else 1):
        tokens = generate(
            model,
            prompt,
            args.max_tokens,
            spec.seq_len,
            tokenizer.eod_id,
            top_p,
            args.temperature,
            generator,
        )
        if index:
            print("---")
        print(args.prompt + tokenizer.decode(tokens, skip_special_tokens=True), flush=True)
    return 0
