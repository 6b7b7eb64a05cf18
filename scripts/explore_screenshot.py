"""Take the README's screenshot of `fivefold explore` (docs/explore.png) in headless Chromium.

Starts the explorer on a free port, moves the page's controls to a showcase layout (Llama 3 70B
on 64 H100s: TP 4, interleaved PP 4 with v = 2, DP 4 with ZeRO-1, full recompute), steps the
ring all-reduce a little and saves the page. Needs Debian's chromium
(scripts/install-browser.sh) and the playwright package (dev extra).

    python scripts/explore_screenshot.py [--out docs/explore.png]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "explore"))

from chromium import OFFLINE_ARGS, chromium_path

from fivefold.explore.server import start_in_thread

SHOWCASE = {
    "#model-preset": "llama3-70b",
    "model.seq_len": "8192",
    "cluster.nodes": "8",
    "plan.tp": "4",
    "plan.pp": "4",
    "plan.schedule": "interleaved-1f1b",
    "plan.vpp": "2",
    "plan.dp_shard": "4",
    "plan.zero": "1",
    "plan.recompute": "full",
    "global_batch": "64",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/explore.png"))
    parser.add_argument("--width", type=int, default=1500)
    parser.add_argument("--height", type=int, default=1440)
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    server, _ = start_in_thread(0)
    profile = tempfile.mkdtemp(prefix="fivefold-shot-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile,
                executable_path=chromium_path(),
                headless=True,
                args=OFFLINE_ARGS,
                viewport={"width": args.width, "height": args.height},
            )
            page = context.new_page()
            page.goto(server.url)
            page.wait_for_selector("body[data-state=ready]")
            for name, value in SHOWCASE.items():
                node = page.locator(name if name.startswith("#") else f'[name="{name}"]')
                if node.evaluate("n => n.tagName") == "SELECT":
                    node.select_option(value)
                else:
                    node.fill(value)
            page.wait_for_function(
                "() => document.body.dataset.state === 'ready' && "
                "document.querySelectorAll('#timeline-svg g.timeline-rank').length === 4"
            )
            for _ in range(2):
                page.click("#ring-next")
            page.check('input[name="colour-by"][value="dp"]')
            page.hover('#rank-svg rect.cell[data-rank="21"]')
            page.evaluate("() => window.scrollTo(0, 0)")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            context.close()
    finally:
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
