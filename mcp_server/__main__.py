"""`python -m curry_train_mcp [--http --port N]`: the same server as `curry-train mcp`."""

import sys

from .cli import main

sys.exit(main())
