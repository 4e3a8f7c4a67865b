"""Peak live tensor bytes while a rank builds its model (train.loop.setup): the init peak.

    python -c "from curry_train.config import Config; from curry_train.measure.init_memory import measure_init; \
               print(measure_init(Config())[1])"

The same bookkeeping as measure/memory.py's step tracker, without categories: a TorchDispatchMode registers
every storage an aten op returns (views and in-place results de-duplicated by storage; a DTensor counts its
local shard), a weakref finalizer removes it when freed, and FSDP2's `UntypedStorage.resize_` (not an aten op)
updates the size. Exact at op granularity on CPU; on CUDA the allocator's own high-water mark is reported too.
Not seen: memory a C++ collective allocates internally (gloo / NCCL buffers). The bound parallel/materialize.py
promises and estimator/init.py models: local shards + the largest full parameter + one local chunk of it + the
RoPE tables (+ DDP's gradient buckets, allocated when DDP wraps the model).
"""

from __future__ import annotations

import threading
import weakref
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from curry_train.measure.tracker import _real, _storages


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of live tensor storages created while active; `peak` is their maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.total = self.peak = 0
        self.lock = threading.RLock()

    def _register(self, st: torch.UntypedStorage) -> None:
        k, n = st._cdata, st.nbytes()
        old = self.live.get(k)
        if old is None:
            self.refs[k] = weakref.ref(st, partial(self._freed, k))
        self.live[k] = n
        self.total += n - (old or 0)
        self.peak = max(self.peak, self.total)

    def _freed(self, key: int, _ref: Any) -> None:
        with self.lock:
            self.total -= self.live.pop(key, 0)
            self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here as plain tensors
        out = func(*args, **(kwargs or {}))
        with self.lock:
            for t in tree_leaves(out):
                for st in _storages(t) if _real(t) else ():
                    if self.live.get(st._cdata) != st.nbytes():
                        self._register(st)
        return out

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int):  # FSDP2 frees and refills its buffers this way
            out = tracker._orig_resize(st, size)
            with tracker.lock:
                tracker._register(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        super().__exit__(*exc)
        self.refs.clear()


def measure_init(cfg, device: torch.device | None = None, **setup_kwargs: Any) -> tuple[Any, dict[str, int]]:
    """Run train.loop.setup under the tracker: (the Parallelized, {"init_peak_bytes", "after_init_bytes",
    "cuda_init_peak_bytes"?}). Call inside a rank after the process group is up (or in one process)."""
    from curry_train.train.loop import setup

    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with LiveBytes() as tracker:
        par = setup(cfg, device, **setup_kwargs)
    out = {"init_peak_bytes": tracker.peak, "after_init_bytes": tracker.total}
    if cuda:
        out["cuda_init_peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - base)
    return par, out
