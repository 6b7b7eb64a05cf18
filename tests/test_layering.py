"""The import direction of the design, read from the source (every import, lazy ones included).

    errors, units -> specs -> planner    (pure Python: never torch)
                          -> launch      (process start-up and the host: torch only lazily)
                          -> model -> parallel -> calibration, checkpoint -> train -> explore -> cli

A package may import only packages on a lower layer (specs and planner: no torch at all), so
`parallel/` never reaches into `train/` or `checkpoint/`, and the planner stays fast.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fivefold"

LAYERS = {
    "errors": 0,
    "units": 0,
    "specs": 1,
    "planner": 2,
    "model": 2,
    "launch": 2,
    "parallel": 3,
    "calibration": 4,
    "checkpoint": 4,
    "train": 5,
    "explore": 6,
    "cli": 7,
    "__main__": 8,
    "__init__": 8,
}
NO_TORCH = ("errors", "units", "specs", "planner")


def package_of(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return out


def violations() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        package = package_of(path)
        layer = LAYERS[package]
        for line, module in imports_of(path):
            top = module.split(".")[0]
            where = f"{path.relative_to(SRC.parent)}:{line} imports {module}"
            if top == "torch" and package in NO_TORCH:
                out.append(f"{where} ({package} never imports torch)")
            if top != "fivefold" or module == "fivefold":
                continue
            target = module.split(".")[1]
            if target != package and LAYERS[target] >= layer:
                out.append(f"{where} ({package} is below {target})")
    return out


def test_every_package_is_in_a_layer():
    packages = {package_of(p) for p in SRC.rglob("*.py")}
    assert packages <= set(LAYERS), packages - set(LAYERS)


def test_imports_point_down_the_layers():
    assert violations() == []


@pytest.mark.parametrize(
    ("package", "module", "allowed"),
    [
        ("parallel", "fivefold.train.runtime", False),
        ("parallel", "fivefold.checkpoint.elastic", False),
        ("planner", "fivefold.model", False),
        ("train", "fivefold.parallel.protocol", True),
        ("checkpoint", "fivefold.parallel.process_group", True),
    ],
)
def test_the_rule_itself(package, module, allowed):
    """The checker would catch an upward import (guards against a rule that accepts all)."""
    target = module.split(".")[1]
    assert (LAYERS[target] < LAYERS[package]) is allowed
