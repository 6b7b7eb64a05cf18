"""`python -m fivefold.launch.agent [torchrun options] -m fivefold.train ...`: torchrun, minus
the noise.

It is torchrun's own elastic agent (`torch.distributed.run.run`, same options, same restarts),
with two differences: a job stopped by a signal or ended by a failed rank exits with a status
and no Python traceback (SIGINT/SIGTERM: 128 + the signal number; a failed rank: its exit
status), and the agent's per-worker log lines are off, since the ranks (or the launcher, see
`fivefold.launch.rank_report`) say what went wrong. On SIGINT/SIGTERM the agent forwards the
signal to every worker, waits `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (default 30) for them to
checkpoint and exit, then kills the ones left.
"""

from __future__ import annotations

import sys

from fivefold.launch.shielded_import import hold_signals, signals_held

if __name__ == "__main__":
    hold_signals()  # before any other import: a signal waits for `main`, which handles it

# The other imports are inside the functions: as a program's entry this module holds signals
# before importing anything else, and fivefold.launch imports torch only lazily.

QUIET_LOGGERS = "torch.distributed.elastic"


def _quiet_elastic_logs() -> None:
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(QUIET_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def exit_status(code: int | None) -> int:
    """A shell exit status from a torchrun worker's exit code (negative: killed by -code)."""
    if not code:
        return 1
    return code if code > 0 else 128 - code


def root_exit_code(failures: dict) -> int:
    """The exit status of the first rank that failed (1 when it died without one)."""
    first = min(failures.values(), key=lambda f: f.timestamp, default=None)
    return exit_status(getattr(first, "exitcode", 1))


def main(argv: list[str] | None = None) -> int:
    try:
        with signals_held():
            import torch.distributed.run  # noqa: F401
        return _run(argv)
    except KeyboardInterrupt:  # SIGINT before torchrun installed its handlers: no worker yet
        return 128 + 2


def _run(argv: list[str] | None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from fivefold.launch.rank_report import write_failures

    args = get_args_parser().parse_args(argv)
    _quiet_elastic_logs()
    try:
        run(args)
    except SignalException as err:
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        write_failures({rank: exit_status(f.exitcode) for rank, f in err.failures.items()})
        return root_exit_code(err.failures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
