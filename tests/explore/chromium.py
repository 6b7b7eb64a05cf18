"""Where the system Chromium is, and the flags that keep a headless run offline.

Used by the browser tests here and by `scripts/explore_screenshot.py`: Playwright drives Debian's
`chromium` through `executable_path` (never a downloaded browser build), and the flags stop
Chromium's own background connections, which this project's machines refuse.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

OFFLINE_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str | None:
    """$FIVEFOLD_CHROMIUM if set (None when it is not a file), else the system chromium."""
    configured = os.environ.get("FIVEFOLD_CHROMIUM")
    if configured:
        return configured if Path(configured).is_file() else None
    for candidate in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(candidate).is_file():
            return candidate
    return shutil.which("chromium")
