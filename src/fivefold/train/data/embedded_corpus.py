"""The embedded default corpus: Jane Austen's six novels, public domain, one document a chapter.

The files live in the `corpus/` folder beside this module (its README.md gives the source and
licence). They are gzipped JSONL, so they go through the same reader as a user's data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


def embedded_corpus_files() -> list[Path]:
    """The corpus files shipped in the package, in a fixed order."""
    return sorted(CORPUS_DIR.glob("*.jsonl.gz"))


def files_digest(paths: list[Path]) -> str:
    """SHA-256 over the names and bytes of `paths` (hex): the identity of a corpus."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).name.encode() + b"\0")
        digest.update(file_sha256(path).encode() + b"\0")
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
