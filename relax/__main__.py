"""`python -m relax ...`: the same command line as the `relax` script."""

import sys

from relax.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
