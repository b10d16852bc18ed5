"""`python -m kamado`: the CLI without an installed entry point (e.g. on a bare GPU box)."""

import sys

from kamado.cli import main

sys.exit(main())
