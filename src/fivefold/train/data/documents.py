"""Reading documents from the files a user gives: text, JSON lines, Parquet or Arrow.

- `.txt` (or `.txt.gz`): the whole file is one document, unless it contains lines that are exactly
  the end-of-document marker `<|endoftext|>`, which then separate documents.
- `.jsonl` (or `.jsonl.gz`): one JSON object per line; its string field `text_field` (default
  `"text"`) is a document.
- `.parquet`, `.arrow` (Arrow IPC, file or stream format, as Hugging Face `datasets` saves):
  each row's string column `text_field` is a document (null rows skipped). Read with `pyarrow`
  one record batch at a time, never a whole file.

Empty documents are skipped; a file with no text at all is a `DataError`, as is a missing file, a
line that is not JSON, a record without the text field, or a table without that column (the
message lists the columns it has).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from fivefold.errors import DataError

DOCUMENT_SEPARATOR = "<|endoftext|>"
SUPPORTED_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet", ".arrow")
TEXT_FIELD = "text"
_ARROW_ROWS = 1024  # rows per record batch read from Parquet


def input_kind(path: Path) -> str:
    """'txt', 'jsonl', 'parquet' or 'arrow' from the file name; DataError for anything else."""
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
        raise DataError(
            "no input files given; name at least one .txt, .jsonl, .parquet or .arrow file."
        )
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


def read_documents(path: Path, text_field: str = TEXT_FIELD) -> Iterator[str]:
    """Yield the non-empty documents of one input file, in file order."""
    found = False
    for doc in raw_documents(path, text_field):
        found = True
        yield doc
    if not found:
        raise DataError(
            f"input file {str(path)!r} is empty (it holds no text); remove it from the inputs "
            "or fill it."
        )


def raw_documents(path: Path, text_field: str = TEXT_FIELD) -> Iterator[str]:
    """The non-empty documents of one input file (none at all is not an error here)."""
    path = Path(path)
    kind = input_kind(path)
    readers = {"jsonl": _jsonl_documents, "parquet": _parquet_documents, "arrow": _arrow_documents}
    docs = readers[kind](path, text_field) if kind in readers else _text_documents(path)
    return (doc for doc in docs if doc.strip())


def iter_documents(paths: list[Path], text_field: str = TEXT_FIELD) -> Iterator[str]:
    """All documents of all inputs, file after file."""
    for path in check_inputs(paths):
        yield from read_documents(path, text_field)


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


def _jsonl_documents(path: Path, text_field: str = TEXT_FIELD) -> Iterator[str]:
    for number, line in enumerate(_lines(path), start=1):
        if line.strip():
            yield _record_text(line, f"line {number}", path, text_field)


def jsonl_range(path: Path, start: int, stop: int, text_field: str = TEXT_FIELD) -> Iterator[str]:
    """The documents of the lines of an uncompressed JSONL file that begin at byte offsets in
    `[start, stop)` (so adjacent ranges split a file without losing or repeating a line)."""
    try:
        with Path(path).open("rb") as handle:
            if start > 0:
                handle.seek(start - 1)
                handle.readline()  # the rest of the line that began before `start`
            number = 0
            while (offset := handle.tell()) < stop:
                raw = handle.readline()
                number += 1
                if not raw:
                    break
                if raw.strip():
                    where = f"line {number}" if start == 0 else f"the line at byte {offset}"
                    yield _record_text(raw.decode("utf-8"), where, path, text_field)
    except UnicodeDecodeError as err:
        raise DataError(
            f"input file {str(path)!r} is not UTF-8 text ({err.reason}); convert it to UTF-8."
        ) from None
    except OSError as err:
        raise DataError(f"cannot read input file {str(path)!r}: {err}.") from None


def _record_text(line: str, where: str, path: Path, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            f"input file {str(path)!r} {where} is not valid JSON ({err.msg}); each "
            'line must be one JSON object such as {"text": "..."}.'
        ) from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        keys = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
        raise DataError(
            f'input file {str(path)!r} {where} has no string "{text_field}" field (its '
            f"keys: {keys}); each line must be a JSON object with the document in "
            f'"{text_field}", or name the field with --text-field.'
        )
    return text


def _column_problem(path: Path, names: list[str], text_field: str) -> DataError:
    return DataError(
        f"input file {str(path)!r} has no column {text_field!r} (its columns: "
        f"{', '.join(map(repr, names)) or 'none'}); name the text column with --text-field."
    )


def _strings(column, path: Path, text_field: str) -> Iterator[str]:
    """The non-null values of one record batch's text column (a pyarrow array)."""
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(
            f"input file {str(path)!r}: column {text_field!r} holds {column.type}, not text; "
            "name the text column with --text-field."
        )
    yield from (text for text in column.to_pylist() if text is not None)


def _parquet_documents(path: Path, text_field: str = TEXT_FIELD) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"cannot read Parquet file {str(path)!r}: {err}.") from None
    names = table.schema_arrow.names
    if text_field not in names:
        raise _column_problem(path, names, text_field)
    for batch in table.iter_batches(batch_size=_ARROW_ROWS, columns=[text_field]):
        yield from _strings(batch.column(0), path, text_field)


def _arrow_documents(path: Path, text_field: str = TEXT_FIELD) -> Iterator[str]:
    """Arrow IPC, file format or stream format (Hugging Face `datasets` writes streams), memory
    mapped, one record batch at a time."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid as err:
                raise DataError(f"{str(path)!r} is not an Arrow IPC file ({err}).") from None
            batches = iter(reader)
        names = reader.schema.names
        if text_field not in names:
            raise _column_problem(path, names, text_field)
        index = names.index(text_field)
        for batch in batches:
            yield from _strings(batch.column(index), path, text_field)
