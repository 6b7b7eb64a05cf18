"""`python -m fivefold.train recipe.toml [overrides]` (also as `torchrun ... -m fivefold.train`)."""

from fivefold.launch.shielded_import import hold_signals

hold_signals()  # before any other import: a signal waits for `main`, which handles it

import os  # noqa: E402
import sys  # noqa: E402

from fivefold.launch.threads import passive_wait  # noqa: E402

passive_wait()  # before torch is imported (see fivefold.launch.threads)

from fivefold.train.entry import main  # noqa: E402

code = main()
if code and int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # After an error or interrupt a rank leaves at once: no interpreter shutdown that could wait
    # on a process-group thread still talking to a dead peer.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
