"""`python -m colibri.app ...`: the `colibri` command without its installed entry point."""

import sys

from colibri.app.cli import main

sys.exit(main())
