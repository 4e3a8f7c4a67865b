"""`python -m evals`: replay every scripted conversation against `curry-train mcp` (see evals/runner.py)."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
