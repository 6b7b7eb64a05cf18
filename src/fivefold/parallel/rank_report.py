"""How the ranks of a local run tell the launcher why they stopped, so it says it once.

`fivefold train --nproc N` sets `FIVEFOLD_REPORT_DIR` to a fresh directory; a rank that stops
for a reason a user should read (a `FivefoldError`, an interrupt) writes `rank_<r>.json` there
instead of printing, and the launcher prints one message for the job (`summarize`). Without the
variable (a rank started by torchrun or sbatch directly) the rank prints its message itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

REPORT_DIR_ENV = "FIVEFOLD_REPORT_DIR"
USER_ERROR_EXIT = 2
FAILURES_FILE = "failures.json"  # the agent's: {rank: exit status} of the ranks that failed


@dataclass(frozen=True)
class RankReport:
    """`kind`: "error" (a FivefoldError: message for the user) or "interrupted" (stopped by a
    signal; the message says where the run can continue). `exit_code`: the rank's status."""

    rank: int
    kind: str
    message: str
    exit_code: int


def report_dir() -> Path | None:
    value = os.environ.get(REPORT_DIR_ENV)
    return Path(value) if value else None


def write_report(report: RankReport) -> bool:
    """Leave `report` for the launcher; False when no launcher listens (print it instead)."""
    directory = report_dir()
    if directory is None or not directory.is_dir():
        return False
    path = directory / f"rank_{report.rank}.json"
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(asdict(report)))
    staging.replace(path)
    return True


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
    return sorted(out, key=lambda r: r.rank)


def summarize(
    reports: list[RankReport], world: int, exit_code: int, failures: dict[int, int] | None = None
) -> tuple[str | None, int]:
    """The job's one message and exit status, from the ranks' reports, the agent's record of
    failed ranks (`failures`: rank -> exit status) and the agent's status.

    A rank killed by a signal, or one that failed without a report, is the cause: its status
    is the job's, and the others' reports (they lost their peer) are its consequence. Otherwise
    a user error found by any rank is the message (exit 2; the same message from several ranks
    is printed once, naming them); an interrupt keeps the agent's status (128 + signal).
    """
    reported = {r.rank for r in reports}
    interrupted = {128 + 2, 128 + 15}  # ended by SIGINT / SIGTERM: an interrupt, not a failure
    unexplained = {
        rank: code
        for rank, code in (failures or {}).items()
        if rank not in reported and code not in interrupted
    }
    if unexplained:
        rank = min(unexplained)
        code = unexplained[rank]
        how = f"was killed by {_signal_name(code - 128)}" if code > 128 else "failed"
        return (
            f"a rank failed: rank {rank} {how} (exit status {code}); the other ranks were "
            "stopped. Its output above says why; the same command resumes from the newest "
            "valid checkpoint.",
            code,
        )
    errors = [r for r in reports if r.kind == "error"]
    if errors:
        first = errors[0]
        same = [r.rank for r in errors if r.message == first.message]
        who = "every rank" if len(same) == world else f"rank {', '.join(map(str, same))}"
        return f"{first.message} (found by {who})", USER_ERROR_EXIT
    if exit_code == 0:
        return None, 0
    if any(r.kind == "interrupted" for r in reports) or exit_code > 128:
        return None, exit_code
    return (
        f"a rank failed (exit status {exit_code}); its output above says why. The other ranks "
        "were stopped.",
        exit_code,
    )


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
