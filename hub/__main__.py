"""`python -m scalemon.hub` runs a hub (what the agent starts in the background)."""

import sys

from .main import main

sys.exit(main())
