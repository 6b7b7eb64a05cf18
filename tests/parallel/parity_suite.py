"""The two tests every parity module defines, built from its case lists.

    test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)

`test_parity_ci` runs the CI cases, `test_parity` (marked slow, run by `make parity`) the rest;
each case is one test whose id is the case's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from harness import ParityCase, assert_parity


def _case_id(case: ParityCase) -> str:
    return case.name


def parity_tests(
    ci_cases: Sequence[ParityCase], slow_cases: Sequence[ParityCase]
) -> tuple[Callable[[ParityCase], None], Callable[[ParityCase], None]]:
    """(test_parity_ci, test_parity) for a module's CI and slow cases."""

    @pytest.mark.parametrize("case", ci_cases, ids=_case_id)
    def test_parity_ci(case: ParityCase) -> None:
        assert_parity(case)

    @pytest.mark.slow
    @pytest.mark.parametrize("case", slow_cases, ids=_case_id)
    def test_parity(case: ParityCase) -> None:
        assert_parity(case)

    return test_parity_ci, test_parity
