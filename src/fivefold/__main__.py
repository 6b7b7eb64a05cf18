"""`python -m fivefold`: the `fivefold` command (`fivefold.cli.main`)."""

from fivefold.launch.shielded_import import hold_signals

hold_signals()  # before any other import: a Ctrl-C from here on reaches main's handler

import sys  # noqa: E402

from fivefold.cli.main import main  # noqa: E402

sys.exit(main())
