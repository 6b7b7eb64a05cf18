"""Reading documents from the files a user gives: plain text or JSON lines, optionally gzipped.

- `.txt` (or `.txt.gz`): the whole file is one document, unless it contains lines that are exactly
  the end-of-document marker `<|endoftext|>`, which then separate documents.
- `.jsonl` (or `.jsonl.gz`): one JSON object per line; its string field `"text"` is a document.

Empty documents are skipped; a file with no text at all is a `DataError`, as is a missing file, a
line that is not JSON, or a record without a string `"text"` field.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from fivefold.errors import DataError

DOCUMENT_SEPARATOR = "<|endoftext|>"
SUPPORTED_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")


def input_kind(path: Path) -> str:
    """'txt' or 'jsonl' from the file name; DataError for anything else."""
    name = path.name.lower()
    for suffix in SUPPORTED_SUFFIXES:
        if name.endswith(suffix):
            return suffix.removesuffix(".gz").lstrip(".")
    raise DataError(
        f"input file {str(path)!r} has an unsupported type; give text files ending in "
        f"{', '.join(SUPPORTED_SUFFIXES)}."
    )


def check_inputs(paths: list[Path]) -> list[Path]:
    """Every input exists, is a file and has a supported type; returns them as Paths."""
    if not paths:
        raise DataError("no input files given; name at least one .txt or .jsonl file.")
    checked = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            raise DataError(
                f"input {str(path)!r} is a directory; pass its files instead, e.g. "
                f"{str(path / '*.jsonl')!r}."
            )
        if not path.is_file():
            raise DataError(f"input file {str(path)!r} does not exist; check the path.")
        input_kind(path)
        checked.append(path)
    return checked


def read_documents(path: Path) -> Iterator[str]:
    """Yield the non-empty documents of one input file, in file order."""
    path = Path(path)
    kind = input_kind(path)
    found = False
    for doc in _jsonl_documents(path) if kind == "jsonl" else _text_documents(path):
        if doc.strip():
            found = True
            yield doc
    if not found:
        raise DataError(
            f"input file {str(path)!r} is empty (it holds no text); remove it from the inputs "
            "or fill it."
        )


def iter_documents(paths: list[Path]) -> Iterator[str]:
    """All documents of all inputs, file after file."""
    for path in check_inputs(paths):
        yield from read_documents(path)


def _lines(path: Path) -> Iterator[str]:
    """The file's lines with their endings, decoded as UTF-8 (gzip by suffix), streamed."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as handle:
            yield from handle
    except UnicodeDecodeError as err:
        raise DataError(
            f"input file {str(path)!r} is not UTF-8 text ({err.reason}); convert it to UTF-8."
        ) from None
    except (OSError, EOFError) as err:
        raise DataError(f"cannot read input file {str(path)!r}: {err}.") from None


def _text_documents(path: Path) -> Iterator[str]:
    current: list[str] = []
    for line in _lines(path):
        if line.strip() == DOCUMENT_SEPARATOR:
            yield "".join(current)
            current = []
        else:
            current.append(line)
    yield "".join(current)


def _jsonl_documents(path: Path) -> Iterator[str]:
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"input file {str(path)!r} line {number} is not valid JSON ({err.msg}); each "
                'line must be one JSON object such as {"text": "..."}.'
            ) from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            keys = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
            raise DataError(
                f'input file {str(path)!r} line {number} has no string "text" field (its keys: '
                f'{keys}); each line must be a JSON object with the document in "text".'
            )
        yield text
