"""curryTrain: a GPT template with every parallelism primitive, proven against a single-device reference."""

from curry_train import compat

__version__ = "0.1.0"

# A torch below the tested minimum fails here, in one line naming both versions and the feature that needs the
# newer one, rather than deep inside a run (compat.py). It reads package metadata only: torch is not imported.
# The CLI runs the same check first thing in main() so that it exits 2 with that line (cli/__init__.py).
if not compat.entry_is_cli():
    compat.check_torch()
