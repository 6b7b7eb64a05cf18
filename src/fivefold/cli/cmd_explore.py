"""`fivefold explore`: serve the interactive planner page on 127.0.0.1."""

from __future__ import annotations

import argparse
import webbrowser

# The server (and the planner behind it) is imported inside the functions: `fivefold --help`
# imports every command module (fivefold.cli.main) and must stay quick.

DEFAULT_PORT = 8765


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535)")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "explore",
        help="open the interactive explorer: memory, pipeline, ranks and comms of any layout",
        description=(
            "Serve a local web page (http://127.0.0.1:PORT/) where you pick a model, a cluster and "
            "a layout (TP, PP with its schedule, DP with ZeRO, CP, EP, micro-batch, recompute, "
            "precision; an efficiency profile and every planner option, as `fivefold plan "
            "--profile ...`) and see the planner's per-GPU memory per pipeline stage against "
            "HBM, the "
            "pipeline timeline, the rank grid mapped onto nodes, communication per link, a ring "
            "all-reduce step by step, step time, tokens/s and MFU. Recommend runs the layout "
            "search; Export writes the layout as a TOML recipe for `fivefold train`. Every "
            "number comes from the same planner as `fivefold plan`. The memory levers "
            "(plan.offload, optimizer_states, fp8) have no control on the page yet: its JSON "
            "API (POST /api/estimate) takes them in `plan`. The server listens on "
            "127.0.0.1 only and needs no network."
        ),
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"TCP port on 127.0.0.1 (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    parser.add_argument(
        "--open", action="store_true", help="also open the page in the default web browser"
    )
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    parser.set_defaults(handler=run_explore)


def run_explore(args: argparse.Namespace) -> int:
    from fivefold.explore.server import ExploreServer

    server = ExploreServer(args.port, verbose=args.verbose)
    print(f"fivefold explore: serving {server.url} (Ctrl-C to stop)", flush=True)
    if args.open and not webbrowser.open(server.url):
        print("fivefold explore: no web browser found; open the address above.", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("fivefold explore: stopped", flush=True)
    finally:
        server.server_close()
    return 0
