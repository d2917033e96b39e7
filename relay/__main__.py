"""`python -m scalemon.relay --job ID` runs this node's relay (what the agent starts)."""

import sys

from .main import main

sys.exit(main())
