"""Jobs that run inside every rank, whichever launcher started the ranks (torchrun or the test forkserver).

A job spec is a JSON-able dict: {"kind": <name>, "config": <resolved config dict>, ...kind arguments,
"out_dir": <run folder>}, plus "job": "module:function" when the job lives above this layer. `rank_job` calls
function(spec) and returns its JSON-able value; files (tensors) go under spec["out_dir"].

Each job is named by the module that owns it: JOBS below holds this module's own (training, the launcher
self-test); any other job's spec carries its "job", set by its owner (validation/whitebox.py `WHITEBOX_JOB`,
measure/bench.py `BENCH_JOB`, measure/memory.py `MEMORY_JOB` and `memory_spec`), so nothing here names a module
of another layer (tests/test_architecture.py counts such strings as imports).
"""

from __future__ import annotations

import importlib
from typing import Any

# kind -> "module:function(spec) -> JSON-able value", for the jobs defined here.
JOBS = {
    "train": f"{__name__}:train_job",
    "selftest": f"{__name__}:selftest_job",
}


def job_function(spec: dict[str, Any]) -> str:
    """The "module:function" a spec runs: its own "job", else its kind's entry in JOBS."""
    target = spec.get("job") or JOBS.get(spec.get("kind", ""))
    if target is None:
        raise ValueError(f"unknown job kind {spec.get('kind')!r}; known here: {sorted(JOBS)} (a job of another "
                         "layer names its function in the spec's 'job', e.g. measure.memory.memory_spec)")
    module, _, fn = target.partition(":")
    if not module.startswith("curry_train.") or not fn:
        raise ValueError(f"job {target!r}: expected 'curry_train.<module>:<function>'")
    return target


def train_job(spec: dict[str, Any]) -> dict[str, Any]:
    from curry_train.config import from_dict
    from curry_train.train.loop import run_training

    log = None
    if spec.get("progress"):  # one JSON line per step on stderr (ranks.log), followed by train/progress.py
        import json
        import sys

        def log(rec: dict[str, Any]) -> None:
            print(json.dumps(rec), file=sys.stderr, flush=True)

    return run_training(from_dict(spec["config"]), log=log, checkpoint_dir=spec.get("checkpoint_dir"),
                        save_every=int(spec.get("save_every") or 0), resume=spec.get("resume"),
                        keep_last=int(spec.get("keep_last") or 0))


def selftest_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Launcher self-test (tests and `probe`): one collective, then on `spec["fault_rank"]` the fault named by
    `spec["fault"]`: "raise" an exception, "hang" in a collective the peers never join, "exit" by a signal,
    "oom" a torch.OutOfMemoryError (what a real allocator failure raises), "stubborn" hang after ignoring SIGTERM
    (like training code whose checkpoint-on-preemption handler never returns)."""
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    fault, here = spec.get("fault"), rank == spec.get("fault_rank", 0)
    if fault == "raise" and here:
        raise RuntimeError("selftest: injected failure")
    if fault == "oom" and here:
        raise torch.OutOfMemoryError("selftest: injected out of memory (tried to allocate 1.00 TiB)")
    if fault == "stubborn" and here:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if fault in ("hang", "stubborn"):
        if here:
            time.sleep(3600)  # the peers wait in the barrier below until the deadline kills the group
        dist.barrier()
    if fault == "exit" and here:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"rank": rank, "sum": float(t), "pid": os.getpid()}


def rank_job(rank: int, world: int, spec: dict[str, Any]) -> Any:
    """Entry point for the forkserver launcher (module-level, picklable); torchrun goes through rank_main."""
    module, fn = job_function(spec).split(":")
    return getattr(importlib.import_module(module), fn)(spec)


def rank_jobs(rank: int, world: int, specs: list[dict[str, Any]]) -> list[Any]:
    """Several jobs in one launch (tests): launch cost dominates a tiny job, so batch them."""
    return [rank_job(rank, world, s) for s in specs]
