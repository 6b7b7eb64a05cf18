"""A `${...}` placeholder only works inside a JavaScript template literal (backticks); inside a
plain "..." or '...' string it reaches the page as raw text. Scan the explorer's scripts for it
(the scanner is tests/js_source.py, shared with the house test's function lengths)."""

from __future__ import annotations

from pathlib import Path

from js_source import placeholders_in_plain_strings

STATIC = Path(__file__).resolve().parents[2] / "src" / "fivefold" / "explore" / "static"


def test_the_scanner_finds_a_placeholder_in_a_plain_string():
    src = 'const a = `x ${f("${")} y`;\nconst b = "ok" + "within ${x}%";\nconst r = /\\$\\{/g;\n'
    assert placeholders_in_plain_strings(src) == [1, 2]
    assert placeholders_in_plain_strings("const t = `${a ? `${b}` : 'c'}`; // '${'\n") == []


def test_the_scripts_have_no_placeholder_in_a_plain_string():
    scripts = sorted(STATIC.glob("*.js"))
    assert len(scripts) > 1, "the explorer's scripts moved: point STATIC at them"
    hits = {
        path.name: lines
        for path in scripts
        if (lines := placeholders_in_plain_strings(path.read_text(encoding="utf-8")))
    }
    assert hits == {}, f"`${{` inside a plain string reaches the page as text: {hits}"
