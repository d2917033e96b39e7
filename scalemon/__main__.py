"""`python -m scalemon` is the `scalemon` command."""

import sys

from scalemon.cli import main

sys.exit(main())
