"""Long context in CI: one training step's peak memory grows linearly in T (no T x T term).

Runs the single-process cases of `benchmarks/long_context.py` (tiny preset, one sequence of
2K, 4K and 8K tokens, packed 700-token documents and one whole-sequence document), measured with
the runtime's own storage counter, and checks that each doubling of T costs at most 2.2x the
memory (the dense-mask attention it replaced measured 2.1x-3.0x and growing). The full matrix
(4K-32K, CP4 at 64K and 128K) with the planner's predictions is the benchmark's; its figures
are in benchmarks/README.md.
"""

from __future__ import annotations

import importlib.util
from itertools import pairwise
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"


@pytest.fixture(scope="module")
def long_context():
    spec = importlib.util.spec_from_file_location("long_context", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("docs", ["packed", "one"])
def test_step_memory_is_linear_in_sequence_length(long_context, docs):
    rows = [long_context.measure_single(t, docs, doc_len=700) for t in (2048, 4096, 8192)]
    ratios = [b["measured_bytes"] / a["measured_bytes"] for a, b in pairwise(rows)]
    assert all(1.5 < r <= 2.2 for r in ratios), ratios
