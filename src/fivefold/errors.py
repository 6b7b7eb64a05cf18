"""User-facing errors: each message names the field at fault and the fix.

`assert` is for internal invariants only; anything a user can cause raises one of these, and the
CLI prints the message as one paragraph instead of a traceback.
"""


class FivefoldError(Exception):
    """Base of every error meant to be read by a user; `exit_code` is the process's status."""

    exit_code = 2


class ConfigError(FivefoldError):
    """A bad model, cluster or plan setting; carries every problem found at once."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        lines = [f"{len(self.problems)} problems in the configuration:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class WorldSizeProblem(str):
    """A ConfigError problem (its text) saying that the plan's degrees do not multiply to the
    cluster's world size: the one a launcher can fix by starting another number of processes."""


class DataError(FivefoldError):
    """A missing, empty or malformed data file or tokenizer."""


class CheckpointError(FivefoldError):
    """A missing, partial, corrupt or incompatible checkpoint."""


class TrainingError(FivefoldError):
    """A run that cannot continue (non-finite loss, a stuck rank)."""


class CollectiveError(TrainingError):
    """A collective that timed out waiting for a stuck rank, or lost a dead one: the job, not
    the recipe, failed, so a restart (torchrun --max-restarts) may cure it. Exit status 75
    (EX_TEMPFAIL of sysexits.h, "try again later"), apart from a user error's 2."""

    exit_code = 75
