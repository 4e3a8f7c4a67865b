"""`python -m curry_train.cli ...`: the same as the `curry-train` console script."""

from curry_train.cli import main

raise SystemExit(main())
