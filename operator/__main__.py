"""`python -m inferscale.operator [flags]`."""

import sys

from .cli import main

sys.exit(main())
