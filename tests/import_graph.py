"""Every import in a package's source, read with `ast` (lazy ones inside functions included).

Shared by the house test (no import circles) and the layering test (imports point down). Counted:
`import a.b`; `from a import b` (as module `a.b` when that is a module of the package, else `a`);
relative imports (`from . import x`, `from .x import y`, `from .. import z`) resolved against the
importing module; and `importlib.import_module(...)`, `import_module(...)` and `__import__(...)`
calls whose module is a string literal (relative ones with their `package` argument), a name in
a module-level dict of string literals, or an f-string (every module its constant prefix starts).
"""

from __future__ import annotations

import ast
from pathlib import Path

IMPORT_CALLS = {"import_module", "__import__"}


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the file `path` inside the package directory `root`."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package `root` (a directory with __init__.py) by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, level: int, importer: str, is_package: bool) -> str:
    """The absolute module of `from {'.' * level}{name} import ...` written in `importer`."""
    if level == 0:
        return name
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _string_dicts(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level `NAME = {key: "module", ...}` tables: their string values by name."""
    out = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, ast.Dict) and len(targets) == 1 and isinstance(targets[0], ast.Name):
            strings = [v.value for v in value.values if isinstance(v, ast.Constant)]
            out[targets[0].id] = [s for s in strings if isinstance(s, str)]
    return out


def _call_targets(call: ast.Call, tables: dict[str, list[str]], known: set[str]) -> list[str]:
    """The modules an import_module-like `call` may import ([] when it cannot be told)."""
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name):
        return tables.get(arg.value.id, [])
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return sorted(m for m in known if m.startswith(prefix)) or [prefix.rsplit(".", 1)[0]]
    return []


def _call_package(call: ast.Call, importer: str, is_package: bool) -> str:
    """The `package` argument of `import_module(".x", package)`: a literal, or `__package__`."""
    given = call.args[1] if len(call.args) > 1 else None
    given = given or next((k.value for k in call.keywords if k.arg == "package"), None)
    if isinstance(given, ast.Constant) and isinstance(given.value, str):
        return given.value
    return importer if is_package else importer.rpartition(".")[0]


def _dynamic(call: ast.Call, tables, known, importer: str, is_package: bool) -> list[str]:
    out = []
    for target in _call_targets(call, tables, known):
        dots = len(target) - len(target.lstrip("."))
        if dots:
            package = _call_package(call, importer, is_package)
            target = _resolve(target[dots:], dots, package, True)
        out.append(target)
    return out


def _is_import_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in IMPORT_CALLS


def imports_of(path: Path, root: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `path`, a file of the package `root`."""
    importer = module_name(path, root)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    tables = _string_dicts(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, importer, is_package)
            names = {f"{base}.{alias.name}" for alias in node.names}
            out += [(node.lineno, m) for m in sorted({n if n in known else base for n in names})]
        elif _is_import_call(node):
            out += [(node.lineno, m) for m in _dynamic(node, tables, known, importer, is_package)]
    return out
