"""JavaScript source read without a JavaScript parser: enough for the explorer's hand-written code.

`scan` blanks every comment, string, regex literal and template-literal text (keeping newlines, so
line numbers stay), leaving only code, with each plain "..." / '...' string listed beside it.
`functions` finds every function body in that code (declarations, methods, `function`
expressions, arrow functions with a block body) and its extent by counting braces.
`imported_files` lists the sibling modules an ES module imports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REGEX_BEFORE = set("(,=:[!&|?{};+-*%<>~^") | {""}  # a `/` after these starts a regex literal
NOT_FUNCTIONS = {"if", "for", "while", "switch", "catch", "with"}  # `word (...) {` that is no body
IDENT = re.compile(r"[A-Za-z_$][\w$]*$")


@dataclass
class Scan:
    source: str
    chars: list[str]
    strings: list[tuple[int, str]] = field(default_factory=list)  # (line, text) of "..." / '...'
    braces: list[int] = field(default_factory=list)  # per open template `${`: the code depth
    depth: int = 0
    last: str = ""  # the last code character ("a" for a word), to tell a regex from a division

    def blank(self, start: int, end: int) -> None:
        for k in range(start, min(end, len(self.chars))):
            if self.chars[k] != "\n":
                self.chars[k] = " "

    def template_text(self, i: int) -> int:
        """Blank the template text opened at `i` (a backtick or an expression's `}`) to its end."""
        src, j = self.source, i + 1
        while j < len(src):
            if src[j] == "\\":
                j += 2
            elif src[j] == "`":
                self.blank(i, j + 1)
                return j + 1
            elif src.startswith("${", j):
                self.blank(i, j + 2)
                self.braces.append(self.depth)
                return j + 2
            else:
                j += 1
        self.blank(i, j)
        return j

    def quoted(self, i: int) -> int:
        src, j = self.source, i + 1
        while j < len(src) and src[j] != src[i]:
            j += 2 if src[j] == "\\" else 1
        self.strings.append((src.count("\n", 0, i) + 1, src[i + 1 : j]))
        self.blank(i, j + 1)
        return j + 1

    def regex(self, i: int) -> int:
        src, j, in_class = self.source, i + 1, False
        while j < len(src) and (in_class or src[j] != "/"):
            in_class = (in_class or src[j] == "[") and src[j] != "]"
            j += 2 if src[j] == "\\" else 1
        self.blank(i, j + 1)
        return j + 1

    def comment(self, i: int) -> int:
        src = self.source
        if src.startswith("//", i):
            end = src.find("\n", i)
            end = len(src) if end < 0 else end
        else:
            end = src.find("*/", i + 2)
            end = len(src) if end < 0 else end + 2
        self.blank(i, end)
        return end


def scan(source: str) -> Scan:
    """`source` with comments, strings, regexes and template text blanked (`"".join(s.chars)`)."""
    s = Scan(source, list(source))
    i = 0
    while i < len(source):
        c = source[i]
        if c.isspace():
            i += 1
        elif source.startswith(("//", "/*"), i):
            i = s.comment(i)
        elif c in "\"'":
            i, s.last = s.quoted(i), c
        elif c == "`" or (c == "}" and s.braces and s.braces[-1] == s.depth):
            if c == "}":
                s.braces.pop()
            i, s.last = s.template_text(i), "`"
        elif c == "/" and s.last in REGEX_BEFORE:
            i, s.last = s.regex(i), "/"
        else:
            s.depth += {"{": 1, "}": -1}.get(c, 0)
            s.last = "a" if (c.isalnum() or c in "_$") else c
            i += 1
    return s


def _close(code: str, i: int, opener: str, closer: str, step: int) -> int:
    """The index of the `closer` that balances the `opener` at `i`, scanning by `step`."""
    depth = 0
    while 0 <= i < len(code):
        depth += (code[i] == opener) - (code[i] == closer)
        if depth == 0:
            return i
        i += step
    return -1


def _word_before(code: str, end: int) -> tuple[str, int]:
    """The identifier ending just before `end` (spaces skipped) and where it starts."""
    head = code[:end].rstrip()
    match = IDENT.search(head)
    return (match.group(), match.start()) if match else ("", len(head))


def _arrow_name(code: str, start: int) -> str:
    """`const NAME = (...) =>`, `NAME: (...) =>` or `NAME = async x =>`; else "(arrow)"."""
    head = code[:start].rstrip()
    head = head.removesuffix("async").rstrip()
    if head.endswith(("=", ":")) and not head.endswith(("==", "=>")):
        name, _ = _word_before(code, len(head) - 1)
        return name or "(arrow)"
    return "(arrow)"


def _head(code: str, brace: int) -> tuple[str, int] | None:
    """(name, index where the function starts) when the `{` at `brace` opens a function body."""
    before = code[:brace].rstrip()
    if before.endswith("=>"):
        params_end = len(before[:-2].rstrip()) - 1
        if code[params_end] == ")":
            start = _close(code, params_end, ")", "(", -1)
        else:
            _, start = _word_before(code, params_end + 1)
        return _arrow_name(code, start), start
    if before.endswith(")"):
        opening = _close(code, len(before) - 1, ")", "(", -1)
        name, start = _word_before(code, opening)
        if name and name not in NOT_FUNCTIONS:
            return name, start
    return None


def functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of every function body in `source`, in order of appearance."""
    code = "".join(scan(source).chars)
    out = []
    for brace in (i for i, c in enumerate(code) if c == "{"):
        head = _head(code, brace)
        if head is None:
            continue
        end = _close(code, brace, "{", "}", 1)
        first = code.count("\n", 0, head[1]) + 1
        out.append((head[0], first, code.count("\n", 0, end) + 1))
    return out


def placeholders_in_plain_strings(source: str) -> list[int]:
    """Lines (1-based) of plain-quoted strings holding `${`: text only a template literal fills."""
    return [line for line, text in scan(source).strings if "${" in text]


IMPORT_LINE = re.compile(r'^import .* from "\./([\w.]+\.js)";$', re.M)


def imported_files(source: str) -> list[str]:
    """The sibling files an ES module imports (`import {...} from "./name.js";` lines)."""
    return IMPORT_LINE.findall(source)
