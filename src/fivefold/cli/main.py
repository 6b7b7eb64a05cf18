"""The `fivefold` command: one subcommand per `fivefold.cli.cmd_*` module.

Each command module defines `register(subparsers)`, which adds its parser and sets `handler`
(a function of the parsed arguments returning an exit code). Modules import torch only inside
their handlers, so `fivefold plan` stays fast. A `FivefoldError` is printed as one paragraph
and exits with status 2; it is never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import fivefold.cli as cli_package
from fivefold import __version__
from fivefold.errors import FivefoldError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fivefold",
        description="Plan and run 5D-parallel LLM training (data, tensor, pipeline, context, "
        "expert parallelism).",
    )
    parser.add_argument("--version", action="version", version=f"fivefold {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(cli_package.__path__), key=lambda i: i.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"fivefold.cli.{info.name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fivefold.parallel.threads import passive_wait

    passive_wait()  # before any command imports torch (see fivefold.parallel.threads)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except FivefoldError as err:
        print(f"fivefold {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (e.g. `| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"fivefold {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
