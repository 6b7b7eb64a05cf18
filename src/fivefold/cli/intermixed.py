"""Options written after a command's positional arguments (`fivefold train R plan.x=1 --steps 5`).

argparse stops at the first positional when it is `REMAINDER`; the commands that allow options
anywhere re-parse that remainder, intermixed, with a parser holding the same options, and keep
what it found over the first parse's defaults.
"""

from __future__ import annotations

import argparse


def merge_intermixed(
    args: argparse.Namespace, inner: argparse.ArgumentParser, positional: str
) -> argparse.Namespace:
    """`args` with the options found in `args.<positional>` by `inner` (which declares
    `positional` with nargs="*" and the command's options) merged in; the positional list
    becomes what remains once those options are taken out."""
    later = inner.parse_intermixed_args(getattr(args, positional))
    merged = argparse.Namespace(**vars(args))
    for key, value in vars(later).items():
        if key == positional or value != inner.get_default(key):
            setattr(merged, key, value)
    return merged
