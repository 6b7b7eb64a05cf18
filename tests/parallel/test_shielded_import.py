"""`signals_held`: a signal during an import waits for it, then acts as usual."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SLOW_MODULE = """
import os, signal, time
os.kill(os.getpid(), signal.{sig})  # arrives while this module is being imported
time.sleep(0.2)
LOADED = True
"""

CALLER = """
import sys
sys.path.insert(0, {where!r})
from fivefold.launch.shielded_import import signals_held
try:
    with signals_held():
        import slow_module
except KeyboardInterrupt:
    print("interrupt after import:", sys.modules["slow_module"].LOADED)
    sys.exit(130)
print("no interrupt")
"""


def _run_caller(tmp_path: Path, sig: str) -> subprocess.CompletedProcess:
    (tmp_path / "slow_module.py").write_text(SLOW_MODULE.format(sig=sig))
    code = textwrap.dedent(CALLER.format(where=str(tmp_path)))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_sigint_during_the_import_is_raised_once_the_module_has_loaded(tmp_path) -> None:
    done = _run_caller(tmp_path, "SIGINT")
    assert done.returncode == 130, done.stderr
    assert done.stdout.strip() == "interrupt after import: True"


def test_sigterm_during_the_import_keeps_its_default_action_after_it(tmp_path) -> None:
    done = _run_caller(tmp_path, "SIGTERM")
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_previous_handlers_are_back_after_the_import(sig) -> None:
    from fivefold.launch.shielded_import import signals_held

    before = signal.getsignal(sig)
    with signals_held():
        import json  # noqa: F401
    assert signal.getsignal(sig) is before
