"""This rank's micro-batches for `train.loop.train_step`: built one step ahead off the training thread, copied to
the device without blocking the host.

    python -c "from curry_train.config import Config; from curry_train.train.feed import Feed; import torch; \
f = Feed(Config(), torch.device('cpu'), 0, 0); print([x.shape for x, _, _ in f.host(0)]); f.close()"

While step s runs, a background thread builds step s + 1's micro-batches (`model/data.rank_micro_batches`: the
synthetic chain or the memory-mapped token file, the same tensors as today's contract) and, on CUDA, copies them
into pinned (page-locked) host memory: a copy from pageable memory is staged through a driver buffer and blocks
the host, one from pinned memory is a DMA the host only enqueues (docs/ARCHITECTURE.md#training-step).
`to_device` then copies a micro-batch with non_blocking=True right before its forward, so the device holds one
micro-batch of ids at a time, as before. The copy is made on every device (copy=True), also on CPU where `.to`
would return the host tensor itself: the ids the step trains on are allocated inside the step on every device,
which is what the CPU memory tracker measures and the estimator models (estimator/acts.py `embed`).
A step asked for out of order (a resume, a caller's own order) is built on the spot; the prefetch then follows it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from curry_train.config import Config
from curry_train.model.data import rank_micro_batches

# (inputs [mb * n, T_local], targets [mb * n, T_local], positions [T_local]): all n micro-batches of one step
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Feed:
    """One rank's data source: `host(step)` (prefetched, pinned on CUDA), `micro(batch, m)`, `to_device(t)`."""

    def __init__(self, cfg: Config, device: torch.device, dp_rank: int, cp_rank: int):
        self.cfg, self.device, self.dp_rank, self.cp_rank = cfg, device, dp_rank, cp_rank
        self._pin = device.type == "cuda"  # pinning is a CUDA host-allocator notion: meaningless on CPU
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future] | None = None

    def _build(self, step: int) -> Batch:
        mbs = list(rank_micro_batches(self.cfg, step, self.dp_rank, self.cp_rank))
        x, y, pos = torch.cat([m[0] for m in mbs]), torch.cat([m[1] for m in mbs]), mbs[0][2]
        return (x.pin_memory(), y.pin_memory(), pos.pin_memory()) if self._pin else (x, y, pos)

    def micro(self, batch: Batch, m: int) -> Batch:
        """Micro-batch m of a step's host batch (views: rows [m * mb, (m + 1) * mb), pinned where the batch is)."""
        mb = self.cfg.train.micro_batch
        x, y, pos = batch
        return x[m * mb : (m + 1) * mb], y[m * mb : (m + 1) * mb], pos

    def host(self, step: int) -> Batch:
        """This rank's rows of step `step` on the host (micro-batches in accumulation order); starts step + 1."""
        if self._ahead is not None and self._ahead[0] == step:
            mbs = self._ahead[1].result()  # re-raises what the builder raised (e.g. a data file's ConfigError)
        else:
            if self._ahead is not None:
                self._ahead[1].cancel()
            mbs = self._build(step)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="curry-feed")
        self._ahead = (step + 1, self._pool.submit(self._build, step + 1))
        return mbs

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh device copy of host tensor `t`, enqueued without waiting (pinned source on CUDA)."""
        return t.to(self.device, non_blocking=True, copy=True)

    def close(self) -> None:
        """Stop prefetching (waits for a build in progress); `host` restarts the thread if called again."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._ahead = None, None


def feed_of(par) -> Feed:
    """The Feed of a Parallelized rank, made on first use (dp and cp coordinates of this rank)."""
    feed = getattr(par, "feed", None)
    if feed is None:
        import torch.distributed as dist

        coords = par.topo.coords(dist.get_rank() if dist.is_initialized() else 0)
        feed = par.feed = Feed(par.cfg, par.device, coords["dp"], coords["cp"])
    return feed
