"""How the ranks of a local run tell the launcher why they stopped, so it says it once.

`fivefold train --nproc N` sets `FIVEFOLD_REPORT_DIR` to a fresh directory; a rank that stops
for a reason a user should read (a `FivefoldError`, an interrupt) writes
`rank_<r>.attempt_<a>.json` there instead of printing, and the launcher prints one message for
the job (`summarize`). Under `--max-restarts` torchrun starts the group again after a failure
(attempt a = `TORCHELASTIC_RESTART_COUNT`): every rank marks the attempt it runs in, rank 0 of
a restarted attempt that finishes says where it resumed, and only the last attempt decides the
job's status; the earlier ones are told as what happened. Without the variable (a rank started
by torchrun or sbatch directly) the rank prints its message itself.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

REPORT_DIR_ENV = "FIVEFOLD_REPORT_DIR"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun in every worker
USER_ERROR_EXIT = 2
SIGKILL_EXIT = 128 + 9
FAILURES_FILE = "failures.json"  # the agent's: {rank: exit status} of the ranks that failed


def attempt() -> int:
    """Which start of the group this process belongs to (0 first, 1 after one restart, ...)."""
    try:
        return int(os.environ.get(RESTART_COUNT_ENV, "0"))
    except ValueError:
        return 0


@dataclass(frozen=True)
class RankReport:
    """`kind`: "error" (a FivefoldError: message for the user), "interrupted" (stopped by a
    signal; the message says where the run can continue) or "resumed" (rank 0 of a restarted
    attempt that finished: where it resumed and where it ended). `exit_code`: the rank's
    status; `attempt`: the group start it belongs to (`attempt()`)."""

    rank: int
    kind: str
    message: str
    exit_code: int
    attempt: int = 0


def report_dir() -> Path | None:
    value = os.environ.get(REPORT_DIR_ENV)
    return Path(value) if value else None


def write_report(report: RankReport) -> bool:
    """Leave `report` for the launcher; False when no launcher listens (print it instead)."""
    directory = report_dir()
    if directory is None or not directory.is_dir():
        return False
    path = directory / f"rank_{report.rank}.attempt_{report.attempt}.json"
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(asdict(report)))
    staging.replace(path)
    return True


def mark_attempt() -> None:
    """Record that this process's attempt started (if a launcher listens)."""
    directory = report_dir()
    if directory is not None and directory.is_dir():
        (directory / f"attempt_{attempt()}.started").touch()


def last_attempt(directory: Path) -> int:
    """The newest attempt that started in `directory` (0 when none is marked)."""
    found = [int(p.name.split("_")[1].split(".")[0]) for p in directory.glob("attempt_*.started")]
    return max(found, default=0)


def write_failures(statuses: dict[int, int]) -> None:
    """The agent's record of which ranks failed with which exit status (if a launcher listens)."""
    directory = report_dir()
    if directory is not None and directory.is_dir():
        (directory / FAILURES_FILE).write_text(json.dumps({str(k): v for k, v in statuses.items()}))


def read_failures(directory: Path) -> dict[int, int]:
    try:
        return {
            int(k): int(v) for k, v in json.loads((directory / FAILURES_FILE).read_text()).items()
        }
    except (OSError, ValueError, AttributeError):
        return {}


def read_reports(directory: Path) -> list[RankReport]:
    """The reports in `directory`, lowest rank first (unreadable files are skipped)."""
    out = []
    for path in sorted(directory.glob("rank_*.json")):
        try:
            out.append(RankReport(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda r: (r.attempt, r.rank))


def summarize(
    reports: list[RankReport],
    world: int,
    exit_code: int,
    failures: dict[int, int] | None = None,
    last: int = 0,
    sigkill_note: str = "",
) -> tuple[str | None, int]:
    """The job's one message and exit status, from the ranks' reports, the agent's record of
    failed ranks of the last attempt (`failures`: rank -> exit status), the agent's status and
    the last attempt that started (`last`; earlier ones were restarted after a failure).

    Only the last attempt decides: when it completed the job succeeded (status 0) and the
    message tells the restarts as information. Within it, a rank killed by a signal, or one
    that failed without a report, is the cause: its status is the job's, and the others'
    reports (they lost their peer) are its consequence; a SIGKILL is explained by
    `sigkill_note` (the out-of-memory killer's count, the predicted peak). Otherwise a user
    error found by any rank is the message, with its status (2 for a user error, 75 for a
    collective that timed out or lost a rank: `fivefold.errors.CollectiveError`; the same
    message from several ranks is printed once, naming them); an interrupt keeps the agent's
    status (128 + signal).
    """
    last = max([last, *(r.attempt for r in reports)])
    history = _restarts(reports, last)
    final = [r for r in reports if r.attempt == last]
    message, code = _final_attempt(final, world, exit_code, failures or {}, sigkill_note)
    if history:
        message = f"{message} Before that, {history}" if message else f"note: {history}"
    return message, code


def _restarts(reports: list[RankReport], last: int) -> str | None:
    """'torchrun restarted the ranks N time(s) ...: attempt 1 stopped (why); attempt 2 resumed
    from step M and completed step N.' (None without a restart)."""
    if last == 0:
        return None
    parts = []
    for number in range(last):
        errors = {r.message for r in reports if r.attempt == number and r.kind == "error"}
        why = "; ".join(sorted(errors)) or "a rank failed without a message (e.g. it was killed)"
        parts.append(f"attempt {number + 1} stopped ({why})")
    resumed = [r.message for r in reports if r.attempt == last and r.kind == "resumed"]
    if resumed:
        parts.append(f"attempt {last + 1} {resumed[0]}")
    times = "time" if last == 1 else "times"
    return f"torchrun restarted the ranks {last} {times} (--max-restarts): {'; '.join(parts)}."


def _final_attempt(
    reports: list[RankReport],
    world: int,
    exit_code: int,
    failures: dict[int, int],
    sigkill_note: str,
) -> tuple[str | None, int]:
    reported = {r.rank for r in reports if r.kind != "resumed"}
    interrupted = {128 + 2, 128 + 15}  # ended by SIGINT / SIGTERM: an interrupt, not a failure
    unexplained = {
        rank: code
        for rank, code in failures.items()
        if rank not in reported and code not in interrupted
    }
    if unexplained:
        rank = min(unexplained)
        code = unexplained[rank]
        how = f"was killed by {_signal_name(code - 128)}" if code > 128 else "failed"
        why = (
            f"{sigkill_note}"
            if code == SIGKILL_EXIT and sigkill_note
            else "Its output above says why"
        )
        return (
            f"a rank failed: rank {rank} {how} (exit status {code}); the other ranks were "
            f"stopped. {why}; the same command resumes from the newest valid checkpoint.",
            code,
        )
    if exit_code == 0:
        return None, 0
    errors = [r for r in reports if r.kind == "error"]
    if errors:
        first = errors[0]
        same = [r.rank for r in errors if r.message == first.message]
        who = "every rank" if len(same) == world else f"rank {', '.join(map(str, same))}"
        return f"{first.message} (found by {who})", first.exit_code or USER_ERROR_EXIT
    if any(r.kind == "interrupted" for r in reports) or exit_code > 128:
        return None, exit_code
    return (
        f"a rank failed (exit status {exit_code}); its output above says why. The other ranks "
        "were stopped.",
        exit_code,
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
