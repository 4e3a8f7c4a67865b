"""Per-rank memory of one training step: the peak of live tensor bytes, split by what the bytes are for.

    python -c "from curry_train.config import load_config; from curry_train.measure.memory import measure_memory; \
               print(measure_memory(load_config('configs/tiny.yaml')))"        # one process; ranks: job kind "memory"

`measure_memory(cfg, steps=2)` runs inside a rank after the process group is up: `train.setup`, steps - 1 warm-up
steps (AdamW state exists only after the first optimizer step; one more if DDP has not yet re-allocated its
buckets, which it does once, in the forward after the first synced backward), then tracks one full step (every
micro-batch's forward and backward, the optimizer step and zero_grad). Every tensor storage alive during that step
is counted once (views and shared storages de-duplicated; a DTensor counts its local shard) in exactly one
category of curry_train/breakdown.py, by the contract written there (the estimator files its bytes by the same
one). How the tracker finds each:

  params, optimizer, pp_buffers   by role, registered when tracking starts (the receive buffers are filled by
                c10d, never by an aten op): the 1/d shard (with FSDP's padding of uneven dim-0 splits) under
                ZeRO-2/3, the local shard under TP, ~1/d of the AdamW state under ZeRO-1..3.
  param_copies  FSDP's all-gathered unsharded parameters (bf16 under mixed precision) and casts of a parameter
                of parameters (an aten cast whose input is a parameter). ZeRO-2 keeps every unit's copy from its
                forward to its backward (all N parameters at full size at the end of the forward); ZeRO-3 frees
                each unit's copy after its forward and gathers it again for its backward.
  grads         the storages .grad points into, and DDP's buckets under gradient_as_bucket_view (apply_ddp sets
                it) from the start: the reducer owns them in C++, so they count by size until its first write.
  grad_buffers  FSDP's unsharded parameters' .grad and unsharded_accumulated_grad (persisting across
                micro-batches when a pipeline accumulates without a sync).
  activations   allocations in the forward (the batch, every op output) and in a checkpoint's recomputation.
  loss          allocations of aten's log_softmax / nll backward, and inside loss_parallel's handlers for them.
  other         the rest: backward allocations, FSDP's own methods (its staging buffers), the optimizer step,
                module buffers.

Each category field is that category's maximum over the step. `peak` is the maximum of the total, which is at
most the sum of the fields (the categories peak at different moments: activations at the end of a forward,
grads at the end of the backward); `at_peak` is the split at the moment of the peak and sums to `peak`.

The tracker (measure/tracker.py) states how exact these numbers are and what it does not see.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from pydantic import BaseModel, Field

from curry_train.breakdown import CATEGORIES
from curry_train.config import Config
from curry_train.measure.tracker import StepMemoryTracker

__all__ = ["CATEGORIES", "MEMORY_JOB", "MemoryReport", "StepMemoryTracker", "cuda_device_view", "measure_memory",
           "measure_step", "memory_job", "memory_spec"]

MEMORY_JOB = f"{__name__}:memory_job"  # the rank-side job a memory spec names (train/jobs.py resolves it)


class MemoryReport(BaseModel):
    """Bytes on one rank during one training step (see the module docstring for the category definitions)."""

    rank: int
    device: str
    params: int = Field(description="Persistent (sharded) parameters.")
    param_copies: int = Field(description="Max of gathered / cast working copies of parameters.")
    grads: int = Field(description="Max of the optimizer-facing gradients (.grad; DDP bucket views).")
    grad_buffers: int = Field(description="Max of FSDP unsharded gradients (DDP buckets without bucket views).")
    optimizer: int = Field(description="Optimizer state.")
    activations: int = Field(description="Max of live forward-created and recomputed tensors.")
    loss: int = Field(0, description="Max of the loss gradients (nll_loss and log_softmax backward).")
    pp_buffers: int = Field(0, description="Pipeline receive buffers.")
    other: int = Field(description="Max of everything else: backward / optimizer temporaries, comm staging, buffers.")
    peak: int = Field(description="Max of the total live bytes over the step.")
    at_peak: dict[str, int] = Field(description="Split of `peak` by category at the moment it was reached.")
    cuda_max_allocated: int | None = Field(None, description="torch.cuda.max_memory_allocated during the step.")
    cuda_max_reserved: int | None = Field(None, description="torch.cuda.max_memory_reserved during the step.")
    cuda_step_start_allocated: int | None = Field(None, description="torch.cuda.memory_allocated before the step.")
    cuda_device_free: int | None = Field(None, description="torch.cuda.mem_get_info free bytes after the step.")
    cuda_device_total: int | None = Field(None, description="torch.cuda.mem_get_info total bytes.")
    cuda_device_used_at_peak: int | None = Field(None, description="Device bytes in use at the step's peak, "
                                                 "allocator and beyond (cuda_device_view).")


def measure_memory(cfg: Config, steps: int = 2) -> MemoryReport:
    """Build this rank's parallel model, warm up steps - 1 steps, and measure the last one (all ranks call it)."""
    from curry_train.train.loop import init_distributed, setup, train_step

    if steps < 2:
        raise ValueError("steps must be >= 2: the optimizer state is created by the first step")
    device = init_distributed(cfg)
    par = setup(cfg, device)
    for step in range(steps - 1):
        train_step(par, step)
    return measure_step(par, steps - 1)


def measure_step(par: Any, step: int) -> MemoryReport:
    """Track optimizer step `step` of an already-built `par` (bench measures its own run this way, so the
    peak is that of the process a normal run is: one model, one mesh, its own communicators). The optimizer
    state must exist (a step ran before); one untracked step more runs first if DDP has not yet re-allocated
    its buckets, which it does once, in the forward after the first synced backward (Li et al. 2020)."""
    import torch.distributed as dist

    from curry_train.train.loop import train_step

    device = par.device
    if any(not getattr(part, "_has_rebuilt_buckets", True) for part in par.parts):
        train_step(par, step)
        step += 1
    cuda = device.type == "cuda"
    if cuda:  # (the tracker only counts what it registers or sees allocated; the CUDA counters count garbage)
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    with StepMemoryTracker(par) as tracker:
        train_step(par, step, after_backward=lambda loss: setattr(tracker, "in_optimizer", True))
        tracker.in_optimizer = False
    extra = {}
    if cuda:
        torch.cuda.synchronize(device)
        extra = {"cuda_max_allocated": torch.cuda.max_memory_allocated(device),
                 "cuda_max_reserved": torch.cuda.max_memory_reserved(device), "cuda_step_start_allocated": start,
                 **cuda_device_view(device)}
    return MemoryReport(rank=dist.get_rank() if dist.is_initialized() else 0, device=device.type,
                        **tracker.maxima, peak=tracker.peak, at_peak=tracker.at_peak, **extra)


def cuda_device_view(device: torch.device) -> dict[str, int]:
    """What the whole device holds at the step's peak, allocator and beyond (context, NCCL, cuBLAS workspaces):
    `mem_get_info` just after the step, corrected by what the allocator reserved at the peak but has released
    since (nothing, unless a caller emptied the cache): used_at_peak = total - free + (max_reserved - reserved)."""
    free, total = torch.cuda.mem_get_info(device)
    lag = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
    return {"cuda_device_free": int(free), "cuda_device_total": int(total),
            "cuda_device_used_at_peak": int(total - free + lag)}


def memory_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Job kind "memory": this rank's MemoryReport as a dict."""
    from curry_train.config import from_dict

    return measure_memory(from_dict(spec["config"]), steps=spec.get("steps", 2)).model_dump()


def memory_spec(cfg: Config, steps: int = 2) -> dict[str, Any]:
    """A job spec that runs `memory_job` on every rank (launch it with train.launch: forkserver or torchrun)."""
    return {"kind": "memory", "job": MEMORY_JOB, "config": cfg.to_dict(), "steps": steps}
