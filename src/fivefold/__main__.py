import sys

from fivefold.cli.main import main

sys.exit(main())
