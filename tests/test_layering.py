"""The import direction of the design, read from the source (every import: lazy, relative and
`importlib.import_module` ones included; see tests/import_graph.py).

    errors, units -> specs -> planner -> explore   (pure Python: never torch)
                          -> launch      (process start-up and the host: torch only lazily)
                          -> model -> parallel -> calibration, checkpoint -> train -> cli

A package may import only packages on a lower layer (specs, planner and the explorer: no torch
at all), so `parallel/` never reaches into `train/` or `checkpoint/`, and the planner and the
explorer stay fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from import_graph import imports_of, package_modules

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
    "explore": 3,
    "cli": 7,
    "__main__": 8,
    "__init__": 8,
}
NO_TORCH = ("errors", "units", "specs", "planner", "explore")


def package_of(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def violations(root: Path = SRC, layers: dict[str, int] = LAYERS) -> list[str]:
    """Every import in the package `root` of a package on the same or a higher layer."""
    out = []
    known = set(package_modules(root))
    for path in sorted(root.rglob("*.py")):
        package = package_of(path, root)
        layer = layers[package]
        for line, module in imports_of(path, root, known):
            top = module.split(".")[0]
            where = f"{path.relative_to(root.parent)}:{line} imports {module}"
            if top == "torch" and package in NO_TORCH:
                out.append(f"{where} ({package} never imports torch)")
            if top != root.name or module == root.name:
                continue
            target = module.split(".")[1]
            if target != package and layers[target] >= layer:
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
        ("explore", "fivefold.train.config", False),
        ("explore", "fivefold.planner.search.layouts", True),
        ("train", "fivefold.parallel.protocol", True),
        ("checkpoint", "fivefold.parallel.process_group", True),
    ],
)
def test_the_rule_itself(package, module, allowed):
    """The checker would catch an upward import (guards against a rule that accepts all)."""
    target = module.split(".")[1]
    assert (LAYERS[target] < LAYERS[package]) is allowed


def test_relative_and_dynamic_upward_imports_are_caught(tmp_path):
    """specs reaching up to the planner with `from ..planner import`, or by import_module."""
    files = {
        "__init__.py": "",
        "specs/__init__.py": "from ..planner import pricing\n",
        "specs/shape.py": "import importlib\nP = importlib.import_module('fivefold.planner')\n",
        "planner/__init__.py": "from ..specs import shape\n",
        "planner/pricing.py": "from . import other\n",
    }
    for name, text in files.items():
        (tmp_path / "fivefold" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fivefold" / name).write_text(text)
    assert violations(tmp_path / "fivefold", {"specs": 1, "planner": 2, "__init__": 8}) == [
        "fivefold/specs/__init__.py:1 imports fivefold.planner.pricing (specs is below planner)",
        "fivefold/specs/shape.py:2 imports fivefold.planner (specs is below planner)",
    ]
