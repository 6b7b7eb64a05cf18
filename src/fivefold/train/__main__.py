"""`python -m fivefold.train recipe.toml [overrides]` (also as `torchrun ... -m fivefold.train`)."""

import sys

from fivefold.train.entry import main

sys.exit(main())
