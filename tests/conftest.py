"""Import paths shared by the whole suite.

The test directories are not packages, so their helper modules are imported by name: the
multi-rank harness (`harness`, from tests/parallel, used by the parallel and checkpoint tests)
and the tiny model specs (`tiny_models`, here). The forkserver that spawns the ranks starts with
this path, so its children can import the harness and the workers too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
for directory in (TESTS, TESTS / "parallel"):
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))

# Hermetic CPU runs: no device profile from the user's cache (`fivefold calibrate`) unless a
# test names one. Set at import so spawned ranks inherit it.
os.environ["FIVEFOLD_PROFILE"] = str(TESTS / "no-device-profile.toml")
