"""`torchrun --nproc-per-node N -m curry_train.train --config configs/tiny.yaml [--set k=v ...]`: the training loop."""

from curry_train.train.loop import main

raise SystemExit(main())
