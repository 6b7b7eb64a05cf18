"""A `${...}` placeholder only works inside a JavaScript template literal (backticks); inside a
plain "..." or '...' string it reaches the page as raw text. Scan the explorer's script for it."""

from __future__ import annotations

from pathlib import Path

APP_JS = Path(__file__).resolve().parents[2] / "src" / "fivefold" / "explore" / "static" / "app.js"

REGEX_BEFORE = set("(,=:[!&|?{};+-*%<>~^") | {""}


def placeholders_in_plain_strings(source: str) -> list[int]:
    """Line numbers (1-based) of plain-quoted strings that hold `${`.

    A small scanner: comments, regex literals, "..." and '...' strings, and template literals
    with nested `${ expression }` (which may hold strings and templates of their own).
    """
    hits: list[int] = []
    i, line, n = 0, 1, len(source)
    braces: list[int] = []  # per open template expression: its `{` depth
    depth = 0
    last = ""  # the last significant code character, to tell a regex from a division

    def skip_template(i: int) -> int:
        nonlocal line
        while i < n:
            c = source[i]
            if c == "\\":
                i += 2
                continue
            if c == "\n":
                line += 1
            if c == "`":
                return i + 1
            if source.startswith("${", i):
                braces.append(depth)
                return -(i + 2)  # back to code inside the expression
            i += 1
        return i

    while i < n:
        c = source[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif source.startswith("//", i):
            i = source.find("\n", i)
            i = n if i < 0 else i
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            line += source.count("\n", i, end)
            i = end + 2
        elif c in "\"'":
            j = i + 1
            while source[j] != c:
                j += 2 if source[j] == "\\" else 1
            if "${" in source[i:j]:
                hits.append(line)
            i, last = j + 1, c
        elif c == "`" or (c == "}" and braces and braces[-1] == depth):
            if c == "}":
                braces.pop()
            j = skip_template(i + 1)
            i, last = abs(j), "`"
        elif c == "/" and last in REGEX_BEFORE:
            j, in_class = i + 1, False
            while in_class or source[j] != "/":
                in_class = (in_class or source[j] == "[") and source[j] != "]"
                j += 2 if source[j] == "\\" else 1
            i, last = j + 1, "/"
        else:
            depth += {"{": 1, "}": -1}.get(c, 0)
            last = c if not (c.isalnum() or c in "_$") else "a"
            i += 1
    return hits


def test_the_scanner_finds_a_placeholder_in_a_plain_string():
    src = 'const a = `x ${f("${")} y`;\nconst b = "ok" + "within ${x}%";\nconst r = /\\$\\{/g;\n'
    assert placeholders_in_plain_strings(src) == [1, 2]
    assert placeholders_in_plain_strings("const t = `${a ? `${b}` : 'c'}`; // '${'\n") == []


def test_app_js_has_no_placeholder_in_a_plain_string():
    hits = placeholders_in_plain_strings(APP_JS.read_text(encoding="utf-8"))
    assert hits == [], f"app.js lines {hits}: `${{` inside a plain string reaches the page as text"
