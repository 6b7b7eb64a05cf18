"""The `fivefold` command: one subcommand per `fivefold.cli.cmd_*` module.

Each command module defines `register(subparsers)`, which adds its parser and sets `handler`
(a function of the parsed arguments returning an exit code). Modules import torch only inside
their handlers, and `main` imports only the module of the command asked for (all of them for
`fivefold --help` or an unknown command), so `fivefold plan` stays fast. The parser is built,
and the modules a command names in `imports` (torch, the model package) imported first, with
Ctrl-C held until they have loaded (`fivefold.launch.shielded_import`: a Ctrl-C inside a C
extension's import, DTensor's for one, otherwise ends the process with SIGINT even after the
interrupt was handled). A `FivefoldError` is printed as one paragraph and exits with status 2;
an interrupt exits with 130; neither is ever a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

from fivefold.launch.shielded_import import hold_signals, signals_held

if TYPE_CHECKING:
    import argparse

# The other imports are inside the functions, after main's `hold_signals()`: the `fivefold`
# script imports this module before `main` runs, and a Ctrl-C while they (and torch) load must
# reach main's handler, not print a traceback (fivefold.launch.shielded_import).


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `fivefold` parser: every command, or only `command` when it names one."""
    import argparse
    import pkgutil

    import fivefold.cli as cli_package
    from fivefold import __version__

    parser = argparse.ArgumentParser(
        prog="fivefold",
        description="Plan and run 5D-parallel LLM training (data, tensor, pipeline, context, "
        "expert parallelism).",
    )
    parser.add_argument("--version", action="version", version=f"fivefold {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = sorted(
        info.name[4:]
        for info in pkgutil.iter_modules(cli_package.__path__)
        if info.name.startswith("cmd_")
    )
    for name in [command] if command in names else names:
        importlib.import_module(f"fivefold.cli.cmd_{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    hold_signals()  # until the parser and torch have loaded (kept if `python -m` began it)
    from fivefold.errors import FivefoldError
    from fivefold.launch.threads import passive_wait

    passive_wait()  # before any command imports torch (see fivefold.launch.threads)
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else "command"
    try:
        return _run(argv)
    except FivefoldError as err:
        print(f"fivefold {command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # the reader went away (e.g. `| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"fivefold {command}: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str]) -> int:
    with signals_held():  # ends the hold main began
        parser = build_parser(argv[0] if argv else None)
        args = parser.parse_args(argv)
        for module in getattr(args, "imports", ()):
            importlib.import_module(module)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
