#!/usr/bin/env bash
# Install Debian's chromium for the explorer's browser tests (tests/explore/test_browser.py).
# Playwright drives it through executable_path=/usr/bin/chromium; `playwright install` (which
# downloads its own browser build) is never used. Safe to run twice.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    echo "install-browser: $(/usr/bin/chromium --version 2>/dev/null | head -n 1) already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: apt-get not found; install Chromium by hand and set FIVEFOLD_CHROMIUM" >&2
    echo "install-browser: to its path before running the explorer's browser tests." >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium >/dev/null
echo "install-browser: $(/usr/bin/chromium --version 2>/dev/null | head -n 1) installed"
