"""The house's shape, read from the source: no import circles between modules (lazy imports
included), units small enough to read (functions <= 80 lines; files <= 500 lines unless the
module docstring's first paragraph says why, in a sentence starting "Longer than 500 lines"),
and code that says what it does rather than where it came from (no source-material or
ticket numbers). See docs/architecture.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fivefold"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs or ({node.module} & known)
    return out


def circles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    mods = modules()
    graph = {m: imported_modules(p, set(mods)) - {m} for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for m in graph:
        if m not in index:
            visit(m)
    return found


def test_no_import_circles():
    assert circles() == []


def long_units() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.count("\n")
        doc = (ast.get_docstring(tree) or "").split("\n\n")[0]
        if lines > MAX_FILE_LINES and "Longer than 500 lines" not in doc:
            out.append(f"{path.relative_to(SRC.parent)}: {lines} lines, no reason stated")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
                    out.append(f"{where} {node.name}: {length} lines")
    return out


def test_units_are_small():
    assert long_units() == []


PROVENANCE = re.compile(r"\bseed 0\d\d\b|\bthe seeds\b|\bseeds'|\bissue \d+|\bVizz AI\b", re.I)


def test_source_names_what_it_does_not_where_it_came_from():
    found = [
        f"{path.relative_to(SRC.parent)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PROVENANCE.search(line)
    ]
    assert found == []
