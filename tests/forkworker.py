"""The MCP worker (curry_train_mcp/worker.py) with torchrun swapped for the forkserver: `python -m tests.forkworker
'<json request>'`, which jobs.run_worker starts in every multirank test not marked `torchrun`
(tests/conftest.py, `_ranks_forked_unless_torchrun`).

For in-memory MCP tests whose subject is the tool (its arguments, progress, ledger, configs, device lock), not
torchrun: the worker is the real one, a process of its own with the same line protocol, but its ranks fork from a
forkserver it starts (tests/forkrun.py: one torch import for every launch of the call, instead of torchrun's agent
and a cold import per rank). Cancellation and rank faults kill torchrun's tree: they stay on the real worker
(tests/test_mcp_server.py, tests/reliability/test_faults.py).
"""

from __future__ import annotations

import curry_train.train.launch as launch
from curry_train_mcp.worker import main

from tests.forkrun import ForkJob

launch.start_torchrun = ForkJob  # run_torchrun, which bench, white-box and climb call, starts through it

if __name__ == "__main__":
    raise SystemExit(main())
