"""The house's shape, read from the source: no import circles between modules (Python's lazy,
relative and `importlib.import_module` imports included, and the explorer's ES modules), units
small enough to read (Python and the explorer's JavaScript: functions <= 80 lines; files <= 500
lines unless a Python module docstring's first paragraph says why, in a sentence starting
"Longer than 500 lines"), and text that says what it does rather than where it came from (no
source-material or ticket numbers, anywhere in the repository). See docs/architecture.md."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from import_graph import imports_of, package_modules
from js_source import functions, imported_files

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "fivefold"
STATIC = SRC / "explore" / "static"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500


def circles(root: Path = SRC) -> list[list[str]]:
    """Groups of modules of the package `root` that import each other in a circle."""
    mods = package_modules(root)
    known = set(mods)
    return strongly_connected(
        {m: {t for _, t in imports_of(p, root, known) if t in known} - {m} for m, p in mods.items()}
    )


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node of `graph` (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
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

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(found)


def test_no_import_circles():
    assert circles() == []


def test_no_import_circles_between_the_explorer_scripts():
    graph = {
        p.name: set(imported_files(p.read_text(encoding="utf-8"))) for p in STATIC.glob("*.js")
    }
    assert sum(map(len, graph.values())) > 10, "the scripts import nothing: is the pattern stale?"
    assert strongly_connected(graph) == []
    graph["format.js"] = {"app.js"}  # the check itself: a circle through the start-up is found
    assert [{"app.js", "format.js"} <= set(group) for group in strongly_connected(graph)] == [True]


FAKE_PACKAGE = {
    # specs -> planner -> planner.cost -> specs.shape: `from .. import`, `from .x import y`,
    # `from ..x.y import z`
    "__init__.py": "",
    "specs/__init__.py": "",
    "specs/shape.py": "from .. import planner\n",
    "planner/__init__.py": "from .cost import price\n",
    "planner/cost.py": "def price():\n    from ..specs.shape import Shape\n",
    # train.loop <-> train.steps: `from . import x` and `from .x import y`
    "train/__init__.py": "",
    "train/loop.py": "from . import steps\n",
    "train/steps.py": "from .loop import run\n",
    # model.a <-> model.b: import_module with an absolute and with a relative name
    "model/__init__.py": "",
    "model/a.py": "import importlib\n\ndef b():\n    importlib.import_module('fake.model.b')\n",
    "model/b.py": "from importlib import import_module\nA = import_module('.a', __package__)\n",
    # cli -> cli.cmd_x -> cli: an f-string module name and a dict of module names
    "cli/__init__.py": "import importlib\nimportlib.import_module(f'fake.cli.cmd_{1}')\n",
    "cli/cmd_x.py": "import importlib\nT = {'k': 'fake.cli'}\nimportlib.import_module(T['k'])\n",
    "clean.py": "from .specs import shape\nimport importlib\nimportlib.import_module('fake')\n",
}


def test_circle_search_sees_relative_and_dynamic_imports(tmp_path):
    """Each circle of the fake package is made only of relative or import_module imports."""
    for name, text in FAKE_PACKAGE.items():
        (tmp_path / "fake" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / name).write_text(text)
    assert circles(tmp_path / "fake") == [
        ["fake.cli", "fake.cli.cmd_x"],
        ["fake.model.a", "fake.model.b"],
        ["fake.planner", "fake.planner.cost", "fake.specs.shape"],
        ["fake.train.loop", "fake.train.steps"],
    ]


def long_python_units() -> list[str]:
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


def long_js_units() -> list[str]:
    out = []
    for path in sorted(STATIC.rglob("*.js")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(SRC.parent)
        if text.count("\n") > MAX_FILE_LINES:
            out.append(f"{where}: {text.count(chr(10))} lines")
        for name, first, last in functions(text):
            if last - first + 1 > MAX_FUNCTION_LINES:
                out.append(f"{where}:{first} {name}: {last - first + 1} lines")
    return out


def test_units_are_small():
    assert long_python_units() == []


def test_javascript_units_are_small():
    assert sorted(STATIC.glob("*.js")), "the explorer's scripts moved: point STATIC at them"
    assert long_js_units() == []


JS_SNIPPET = """\
// a comment with { braces and "quotes
function outer(a, b) {
  const s = "}}}";
  const t = `x ${ a ? `}` : "{" } y`;
  const re = /[{]/g;
  const inner = (x) => {
    return x + 1;
  };
  if (a) { b(); }
  return { s, t };
}
const fmt = {
  time(s) {
    return s;
  },
};
const later = async x => {
  /* } */
};
export function last() { return [1, 2].map((v) => { return v; }); }
"""


def test_the_javascript_reader_finds_every_function_and_its_extent():
    assert functions(JS_SNIPPET) == [
        ("outer", 2, 11),
        ("inner", 6, 8),
        ("time", 13, 15),
        ("later", 17, 19),
        ("last", 20, 20),
        ("(arrow)", 20, 20),
    ]


# Text that names where something came from instead of what it is: the source texts by number
# ("seed 000", test_seed003_...), the source's scenario and company, ticket numbers.
JARGON = re.compile(
    r"(?<![a-z])seeds?[ _-]?0\d\d(?!\d)|(?<![a-z])seed[ _-](?:case|scenario)"
    r"|\bthe seeds\b|\bseeds'|\bthe seed's\b|\bthe seed (?:says|prints|pairs|gives)\b"
    r"|\bissue ?#?\d+|\bissues \d+[-,]|\(#\d+\b|(?<![a-z])vizz(?![a-z])",
    re.I,
)
# Names users type are API, not jargon: kept out of the check until renamed on purpose.
USER_FACING_NAMES = (
    "vizz-7b",  # the 7B long-context model preset: `fivefold plan --model vizz-7b`
)


SELF = Path(__file__).resolve()  # holds the check's own examples of jargon


def tracked_text_files() -> list[Path]:
    """Every file git tracks in the repository but this one (without git: all but dot-folders)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, text=True
        ).stdout
        paths = [REPO / p for p in listed.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in REPO.rglob("*") if not any(s.startswith(".") for s in p.parts)]
    return [p for p in paths if p.is_file() and p.resolve() != SELF]


def jargon_in(name: str, text: str) -> list[str]:
    """`name:line: text` of each line of `text` (line 0: the name itself) that holds jargon."""
    found = []
    for n, line in enumerate([name, *text.splitlines()]):
        plain = line
        for allowed in USER_FACING_NAMES:
            plain = re.sub(re.escape(allowed), "", plain, flags=re.I)
        if JARGON.search(plain):
            found.append(f"{name}:{n}: {line.strip()[:120]}")
    return found


def test_the_jargon_check_catches_each_kind():
    text = "Seed 000's table\ntest_seed003_x\nthe Vizz scenario\n(#13 item 7)\nissue 11\nvizz-7b\n"
    assert [hit.split(":")[1] for hit in jargon_in("tests/test_seed_cases_x.py", text)] == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
    ]
    fine = "seed = 0\nthe seed and the position\n--seed 3\npytorch/pytorch#135712\n#888\nvizz-7b\n"
    fine += "a rank issues 3 + 2 roots\n"
    assert jargon_in("docs/x.md", fine) == []


def test_the_repository_names_what_it_does_not_where_it_came_from():
    found = []
    for path in tracked_text_files():
        raw = path.read_bytes()
        if b"\0" in raw:
            continue  # not text
        try:
            found += jargon_in(path.relative_to(REPO).as_posix(), raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    assert found == []
