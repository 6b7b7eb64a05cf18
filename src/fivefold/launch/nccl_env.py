"""NCCL's error handling, set where the ranks' environment is made.

torchrun's agent exports `TORCH_NCCL_ASYNC_ERROR_HANDLING` into every worker (its default 1:
abort the communicator, then tear down), so a worker that sets it only when absent never
changes it. fivefold wants 3 (end the process without NCCL's abort, which can itself hang), so
the launchers set it before torchrun starts: `fivefold train --nproc` in the agent's
environment, the sbatch script in the shell that runs torchrun. A value the user set stays.
"""

from __future__ import annotations

from collections.abc import MutableMapping

ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
TEAR_DOWN_WITHOUT_CLEANUP = "3"  # torch's values: 0 nothing, 1 abort and tear down, 2 abort only


def set_error_handling(env: MutableMapping[str, str]) -> str:
    """Give `env` (the environment torchrun will start in) fivefold's NCCL error handling
    unless it has one; returns the value it has."""
    return env.setdefault(ASYNC_ERROR_HANDLING_ENV, TEAR_DOWN_WITHOUT_CLEANUP)


def error_handling_export() -> str:
    """The shell line that does `set_error_handling` in a job script."""
    name = ASYNC_ERROR_HANDLING_ENV
    return f'export {name}="${{{name}:-{TEAR_DOWN_WITHOUT_CLEANUP}}}"'
