"""`python -m scalemon` is the `scalemon` command."""

import sys

from scalemon.cli.main import main

sys.exit(main())
