"""Rebuild the embedded corpus from Debian's `r-cran-janeaustenr` package (not used at run time).

The package ships Jane Austen's six novels as R character vectors (one element per line) inside a
lazy-load database `data/Rdata.rdb`: a sequence of records, each a 4-byte big-endian length
followed by a zlib stream holding one R object in R's XDR serialisation. This script reads those
records without R, cuts each novel into chapters (one document each), unwraps the hard-wrapped
paragraphs, drops the few editorial notes of the digital edition, and writes one gzipped JSONL
file per novel with records `{"text", "title", "part"}`. The output is byte-for-byte reproducible.

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    python scripts/build_corpus.py pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb OUT_DIR
"""

from __future__ import annotations

import gzip
import json
import re
import struct
import sys
import zlib
from pathlib import Path

_STRSXP = 16
_HEADING = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$")
_VOLUME = re.compile(r"^(VOLUME|Volume) [0-9IVXLC]+$")
_EDITORIAL = ("[End volume one of this edition.", "[At this point in the first and second")
_NOTE_ON_TEXT = "A NOTE ON THE TEXT"
_SLUGS = {
    "EMMA": ("emma", "Emma"),
    "MANSFIELD PARK": ("mansfield_park", "Mansfield Park"),
    "NORTHANGER ABBEY": ("northanger_abbey", "Northanger Abbey"),
    "PERSUASION": ("persuasion", "Persuasion"),
    "PRIDE AND PREJUDICE": ("pride_and_prejudice", "Pride and Prejudice"),
    "SENSE AND SENSIBILITY": ("sense_and_sensibility", "Sense and Sensibility"),
}


def read_lazyload_records(rdb: bytes) -> list[bytes]:
    """Split an R lazy-load database into its decompressed serialised objects."""
    records, pos = [], 0
    while pos < len(rdb):
        inflater = zlib.decompressobj()
        records.append(inflater.decompress(rdb[pos + 4 :]))
        pos = len(rdb) - len(inflater.unused_data)
    return records


def parse_character_vector(blob: bytes) -> list[str] | None:
    """Decode an XDR-serialised R object if it is a character vector, else None."""
    if blob[:2] != b"X\n":
        return None
    pos = 2

    def read_int() -> int:
        nonlocal pos
        (value,) = struct.unpack(">i", blob[pos : pos + 4])
        pos += 4
        return value

    version = read_int()
    read_int(), read_int()  # writer and minimum reader R versions
    if version == 3:
        encoding_name_length = read_int()
        pos += encoding_name_length
    if read_int() & 0xFF != _STRSXP:
        return None
    lines = []
    for _ in range(read_int()):
        read_int()  # CHARSXP flags
        length = read_int()
        lines.append("" if length < 0 else blob[pos : pos + length].decode("utf-8"))
        pos += max(length, 0)
    return lines


def paragraphs(lines: list[str]) -> list[str]:
    """Blank-line separated blocks, hard wraps joined; indented lines (verse, letters) kept."""
    blocks, current = [], []
    for line in [*lines, ""]:
        if not line.strip():
            if current:
                blocks.append("".join(current).strip())
            current = []
        elif line.startswith(" ") and current:
            current.append("\n" + line.strip())
        else:
            current.append((" " if current else "") + line.strip())
    return [b for b in blocks if not b.startswith(_EDITORIAL)]


def _label(heading: str) -> str:
    """'CHAPTER XII' -> 'Chapter XII'."""
    word, number = heading.rstrip(".").split()
    return f"{word.title()} {number}"


def split_novel(lines: list[str]) -> tuple[str, str, list[dict[str, str]]]:
    """Cut one novel into documents: the front matter, then one per chapter."""
    key = lines[0].strip().upper()
    slug, title = _SLUGS[key]
    if _NOTE_ON_TEXT in lines:
        lines = lines[: lines.index(_NOTE_ON_TEXT)]
    docs: list[dict[str, str]] = []
    part, volume, body = "front matter", "", []

    def flush() -> None:
        text = "\n\n".join(paragraphs(body))
        if text:
            docs.append({"text": text, "title": title, "part": part})

    for line in lines:
        stripped = line.strip()
        if _VOLUME.match(stripped):
            volume = _label(stripped) + ", "
            continue
        if _HEADING.match(stripped):
            flush()
            part, body = volume + _label(stripped), [stripped]
            continue
        body.append(line)
    flush()
    return slug, title, docs


def write_jsonl_gz(path: Path, docs: list[dict[str, str]]) -> None:
    payload = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(payload)


def main(rdb_path: str, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for blob in read_lazyload_records(Path(rdb_path).read_bytes()):
        lines = parse_character_vector(blob)
        if lines is None or lines[0].strip().upper() not in _SLUGS:
            continue
        slug, title, docs = split_novel(lines)
        write_jsonl_gz(out / f"austen_{slug}.jsonl.gz", docs)
        chars = sum(len(d["text"]) for d in docs)
        print(f"{title}: {len(docs)} documents, {chars} characters")


if __name__ == "__main__":
    main(*sys.argv[1:3])
