"""Host syncs per training step, counted without CUDA: every read of a tensor's value on the host and every blocking
copy to a device that `train.loop.train_step` makes between two logged steps (docs/ARCHITECTURE.md#training-step).

On CUDA each of these waits for the device: `.item()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)` copy a value
back, and a `.to(device)` / `.copy_` from pageable memory without non_blocking blocks the host until the copy is
done. The counter patches those methods on torch.Tensor (and torch.cuda.synchronize) and records each call made
on the training thread, so the same count holds on CPU: a `.to` that names a device counts as a copy there even
when it is the tensor's own (on CPU the host batch *is* on the device; on CUDA the same line copies to it), a
`.to(other)` or `.copy_(src)` only when the devices differ. Not counted: the feed's own thread (train/feed.py builds
host batches there, off the step), and reads of torch.optim's `state["step"]` counters, which torch keeps on the
host unless the optimizer is capturable (reading them never waits for a device).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
from curry_train.config import load_config

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
# grad_clip on: the clip norm is in the step; 4 micro-batches per rank at dp 1 (global 8 / micro 2)
BASE = {"train.grad_clip": 0.5, "train.steps": 6}
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


class HostSyncs:
    """While entered: `syncs` lists (what, where) of every host read / blocking device copy on this thread,
    `async_copies` counts the non_blocking device copies. `exempt` holds ids of host-resident tensors to skip."""

    def __init__(self, exempt: set[int] = frozenset()):
        self.exempt, self.syncs, self.async_copies = set(exempt), [], 0
        self._thread, self._saved = threading.get_ident(), {}

    def _where(self, depth: int = 2) -> str:
        f = sys._getframe(depth)  # the caller of the patched method
        return f"{f.f_code.co_filename.rpartition('/')[2]}:{f.f_lineno}"

    def _mine(self, t: Any) -> bool:
        return threading.get_ident() == self._thread and id(t) not in self.exempt

    def __enter__(self) -> HostSyncs:
        T = torch.Tensor
        self._saved = {name: getattr(T, name) for name in (*READS, "to", "copy_")}
        self._saved_sync = torch.cuda.synchronize
        for name in READS:
            setattr(T, name, self._read(name, self._saved[name]))
        orig_to, orig_copy = self._saved["to"], self._saved["copy_"]

        def to(t, *args, **kwargs):
            device = kwargs.get("device", next((a for a in args if isinstance(a, (torch.device, str, T))), None))
            if isinstance(device, T):  # .to(other): other's dtype and device, a copy only across devices
                device = device.device if device.device != t.device else None
            if device is not None and self._mine(t):  # a named device: a host -> device copy on CUDA
                blocking = not kwargs.get("non_blocking", next((a for a in args if isinstance(a, bool)), False))
                self._copy(blocking, "to")
            return orig_to(t, *args, **kwargs)

        def copy_(t, src, non_blocking=False):
            if isinstance(src, T) and src.device != t.device and self._mine(t):
                self._copy(not non_blocking, "copy_")
            return orig_copy(t, src, non_blocking)

        def synchronize(*args, **kwargs):
            self.syncs.append(("torch.cuda.synchronize", self._where()))
            return self._saved_sync(*args, **kwargs)

        T.to, T.copy_, torch.cuda.synchronize = to, copy_, synchronize
        return self

    def _read(self, name: str, orig: Any) -> Any:
        def read(t, *args, **kwargs):
            if self._mine(t):
                self.syncs.append((name, self._where()))
            return orig(t, *args, **kwargs)

        return read

    def _copy(self, blocking: bool, name: str) -> None:
        if blocking:
            self.syncs.append((f"blocking {name}", self._where(3)))
        else:
            self.async_copies += 1

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize = self._saved_sync


def optimizer_step_counters(par: Any) -> set[int]:
    """ids of torch.optim's host-side step counters (ZeroRedundancyOptimizer wraps its local optimizer)."""
    opt = getattr(par.optimizer, "optim", par.optimizer)
    return {id(s["step"]) for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)}


def count_steps(par: Any, steps: range) -> dict[str, Any]:
    """Syncs of `train_step(read=False)` over `steps` (after a warm-up step 0 that creates the optimizer state),
    and of one read step after them."""
    from curry_train.train.loop import train_step

    train_step(par, 0)
    with HostSyncs(optimizer_step_counters(par)) as quiet:
        for s in steps:
            train_step(par, s, read=False)
    with HostSyncs(optimizer_step_counters(par)) as logged:
        train_step(par, steps.stop, read=True)
    return {"syncs": quiet.syncs, "async_copies": quiet.async_copies, "logged": logged.syncs}


def _count_job(rank: int, world: int, layouts: list[dict]) -> list[dict[str, Any]]:
    from curry_train.train.loop import setup

    return [count_steps(setup(load_config(TINY, {**BASE, **o})), range(1, 3)) for o in layouts]


def test_a_step_between_logs_never_syncs_the_host_on_one_process():
    from curry_train.train.loop import setup

    cfg = load_config(TINY, BASE)
    got = count_steps(setup(cfg), range(1, 4))
    assert got["syncs"] == [], got["syncs"]  # 0 per step between logs
    # every micro-batch's ids, targets and positions went to the device without blocking: 3 copies each
    assert got["async_copies"] == 3 * 3 * cfg.num_microbatches
    # a read step: the reduced loss (one tolist for the steps read) and the clip norm (one float)
    assert sorted(w for w, _ in got["logged"]) == ["__float__", "tolist"], got["logged"]


LAYOUTS = [{"parallel.dp": 2}, {"parallel.dp": 2, "parallel.zero": 3}, {"parallel.pp": 2}]  # DDP, FSDP2, a pipeline


@pytest.mark.multirank
def test_a_step_between_logs_never_syncs_the_host_under_ddp_fsdp_and_pp():
    from curry_train.train.launch import launch_forkserver

    for rank, per_layout in enumerate(launch_forkserver(_count_job, 2, LAYOUTS)):
        for o, got in zip(LAYOUTS, per_layout):
            assert got["syncs"] == [], (o, rank, got["syncs"])
            assert got["async_copies"] > 0, (o, rank)  # dp: every rank feeds; pp: stage 0 the ids, 1 the targets
            assert sorted(w for w, _ in got["logged"]) == ["__float__", "tolist"], (o, rank, got["logged"])


def test_the_counter_sees_what_it_counts():
    """The counter itself: a host read, a blocking copy and a non-blocking one are each recorded."""
    t = torch.ones(2)
    with HostSyncs() as c:
        float(t.sum()), t.tolist(), t.to("cpu"), t.to("cpu", non_blocking=True), t.to(torch.float64)
    assert [w for w, _ in c.syncs] == ["__float__", "tolist", "blocking to"] and c.async_copies == 1


def test_the_architecture_page_quotes_the_log_and_gc_defaults():
    from curry_train.config import TrainConfig

    from tests.conftest import REPO

    page = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    log_every, gc_every = (TrainConfig.model_fields[f].default for f in ("log_every", "gc_every"))
    assert f"`train.log_every` = {log_every} by" in page and f"`train.gc_every` = {gc_every} steps" in page
    steps = load_config(TINY).train.steps
    from curry_train.train.loop import is_log_step

    read = [s + 1 for s in range(steps) if is_log_step(load_config(TINY), s)]
    assert f"the {len(read)} reads of a {steps}-step" in page and f"(steps {', '.join(map(str, read))})" in page


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own sync detector needs a GPU")
def test_cuda_reports_no_synchronizing_call_in_a_step_between_logs():
    """The device-side check of the counter above: torch.cuda.set_sync_debug_mode("error") raises on any call
    that synchronizes with the device (a D2H read, a copy from pageable memory, a stream synchronize)."""
    from curry_train.train.loop import setup, train_step

    par = setup(load_config(TINY, {**BASE, "hardware.device": "cuda"}))
    train_step(par, 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(1, 4):
            train_step(par, s, read=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert train_step(par, 4, read=True).loss is not None
