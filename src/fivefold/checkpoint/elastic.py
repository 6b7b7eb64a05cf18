"""Elastic restart: when to resume.

Under `torchrun --max-restarts N`, when a rank dies (even by SIGKILL) the elastic agent stops the
other ranks and starts the whole group again, with `TORCHELASTIC_RESTART_COUNT` > 0. A restarted
run must resume, never start over: `should_resume` says yes whenever this is a restart or
`train.resume` is true/"auto"/"always", and a valid checkpoint exists; the loop then loads the
newest valid one (a save cut short by the failure was never committed). Starting the process
group of a restarted job and turning stuck collectives into messages is
`fivefold.parallel.process_group`'s.
"""

from __future__ import annotations

from fivefold.errors import ConfigError
from fivefold.parallel.process_group import restart_count

_RESUME_WORDS = {
    "auto": "auto",
    "always": "always",
    "never": "never",
    "true": "always",
    "false": "never",
}


def resume_mode(setting: bool | str) -> str:
    """`train.resume` as "auto" | "always" | "never" (true = always, false = never)."""
    if isinstance(setting, bool):
        return "always" if setting else "never"
    mode = _RESUME_WORDS.get(str(setting).strip().lower())
    if mode is None:
        raise ConfigError(
            f'train.resume = {setting!r}: use "auto" (resume when a valid checkpoint exists), '
            "true or false."
        )
    return mode


def should_resume(setting: bool | str, has_valid_checkpoint: bool) -> bool:
    """Whether to load the newest valid checkpoint at start-up.

    "never" starts over, except after an elastic restart, which always resumes: a restarted job
    that started over would discard the work the checkpoints hold.
    """
    if not has_valid_checkpoint:
        return False
    return resume_mode(setting) != "never" or restart_count() > 0
