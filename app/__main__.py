"""`python -m app ...`: the `colibri` command without its installed entry point."""

import sys

from app.cli import main

sys.exit(main())
