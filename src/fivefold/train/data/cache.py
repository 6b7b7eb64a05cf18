"""Where fivefold keeps what it builds on first use, and how processes share it safely.

`${FIVEFOLD_CACHE:-~/.cache/fivefold}` holds the default tokenizer and the embedded corpus's
token shards. Several ranks of one run may ask for them at the same moment, so each entry is built
under an exclusive file lock and published with an atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from fivefold.errors import DataError


def cache_dir() -> Path:
    """The cache root, created if missing."""
    root = Path(os.environ.get("FIVEFOLD_CACHE") or "~/.cache/fivefold").expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create the cache directory {str(root)!r} ({err.strerror}); set "
            "FIVEFOLD_CACHE to a writable directory."
        ) from None
    return root


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock named `name` across processes on this machine."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(exist_ok=True)
    with (lock_dir / f"{name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
