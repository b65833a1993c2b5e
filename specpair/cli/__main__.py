"""`python -m specpair.cli …`: the `specpair` command without its console script."""

import sys

from specpair.cli.main import main

sys.exit(main())
