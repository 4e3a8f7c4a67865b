"""Training: build the seeded model, parallelize it from the config, run AdamW steps over the synthetic stream.

    python -m curry_train.train.loop --config configs/tiny.yaml                              # one process
    torchrun --nproc-per-node 2 -m curry_train.train.loop --config configs/tiny.yaml --set parallel.dp=2

`train_step` is the one training step every caller runs (train, bench, climb, memory, the white-box's ranks):
build only this rank's micro-batches of the global batch (model/data.py) and accumulate their gradients (reducing
only on the last micro-step), clip, set the scheduled lr and step the optimizer (train/optim.py), zero the
gradients, without waiting for the device (the loss and clip norm stay device tensors; the micro-batches come
prefetched, train/feed.py). `run_training` reads the losses every train.log_every steps and logs loss, step time
and tokens/s as JSON lines on stderr (stdout stays free for callers such as the MCP server).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from curry_train.config import Config, ConfigError, load_config, parse_sets
from curry_train.mesh import Topology, build_mesh, device_type, node_layout, pp_mesh
from curry_train.model.gpt import aux_loss, build_meta_model
from curry_train.parallel.parallelize import Parallelized, grad_reduce_group, parallelize
from curry_train.train.feed import feed_of
from curry_train.train.optim import optimizer_step


def init_distributed(cfg: Config) -> torch.device:
    """Join the process group torchrun (or a test launcher) set up: gloo on CPU, nccl on CUDA, with
    `comm.init_timeout_s` until the first step lowers it to `comm.train_timeout_s` (train/comm_init.py)."""
    from curry_train.train.comm_init import init_process_group

    dev = device_type(cfg)
    if dev == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)  # N ranks share the cores; torchrun sets OMP_NUM_THREADS=1 too
        device = torch.device("cpu")
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_process_group(cfg, device)
    return device


def setup(cfg: Config, device: torch.device | None = None, *, model_hook=None) -> Parallelized:
    """This rank's parallel model + optimizer. World size must equal dp*tp*pp*cp.

    The model is built on the meta device and each rank materialises only its local shards after the layout is
    applied (parallel/materialize.py): no rank ever holds the full model, and every layout starts from the
    reference's weights. `model_hook(model)` runs on the (meta) model before parallelize (the white-box
    self-test injects faults there). A single process whose layout runs FSDP2 at degree 1 (bf16: wrapping.py)
    and has no process group yet gets a 1-rank one here (comm_init.init_single_rank; the process's
    destroy_process_group ends it, as it ends torchrun's).
    """
    from curry_train.parallel.fsdp import replicas
    from curry_train.wrapping import data_parallel_wrapper

    topo = Topology.from_config(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != topo.world_size:
        raise ValueError(
            f"world size {world} != dp*tp*pp*cp = {topo.world_size}; launch with --nproc-per-node {topo.world_size}"
        )
    device = device or torch.device(device_type(cfg))
    for problem in node_layout(topo, cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "0"))):  # multi-node only
        if problem.startswith("error"):
            raise ValueError(problem)
        if rank() == 0:
            print(problem, file=sys.stderr)
    p = cfg.parallel
    fsdp = data_parallel_wrapper(p.dp, p.cp, p.zero, p.tp, cfg.train.dtype) == "fsdp"
    if fsdp and not dist.is_initialized():
        from curry_train.train.comm_init import init_single_rank

        init_single_rank(cfg, device)
    mesh = build_mesh(topo, device.type, dp_replicate=replicas(cfg),  # FSDP2's replica groups (HSDP, ZeRO-0)
                      experts=cfg.model.num_experts > 0) if world > 1 or fsdp else None
    model = build_meta_model(cfg)
    if model_hook is not None:
        model_hook(model)
    par = parallelize(model, mesh, cfg, topo=topo, device=device)
    return par


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class StepResult:
    """One optimizer step. `loss` and `grad_norm` are Python floats only on a read step (`train_step(read=True)`,
    by default every train.log_every-th); otherwise None, and their tensors stay on the device, unread."""

    loss: float | None  # the global mean loss (all ranks' tokens)
    step_time_s: float  # host time of the step: the device may still be running it unless the step was read
    tokens_per_s: float
    grad_norm: float | None = None  # the pre-clip global norm this rank clipped by (None: clipping off or unread)
    loss_local: torch.Tensor | None = None  # this rank's mean loss, a device scalar (reduce_losses averages them)
    norm: torch.Tensor | None = None  # the pre-clip global norm, a float64 device scalar (None: clipping off)


def forward_backward(par: Parallelized, step: int) -> torch.Tensor:
    """Accumulate this rank's gradients for optimizer step `step`; returns this rank's mean loss over its
    micro-batches (a device scalar, not reduced across ranks: `reduce_losses`; pp: the last stage's, 0 elsewhere)."""
    cfg, topo = par.cfg, par.topo
    if topo.pp > 1:
        from curry_train.parallel.pipeline import pipeline_forward_backward

        return pipeline_forward_backward(par, step)
    feed = feed_of(par)
    model, n = par.parts[0], cfg.num_microbatches
    batch = feed.host(step)  # prefetched on the feed's thread while the previous step ran
    losses = []
    for m in range(n):
        par.grad_sync(m == n - 1)  # reduce gradients once, on the last micro-step
        x, y, pos = (feed.to_device(t) for t in feed.micro(batch, m))  # [mb, T_local] x2, [T_local]: enqueued
        # The model computes the loss itself (model/gpt.py chunked_lm_loss: no full [mb*T, V] logits), so TP's
        # loss_parallel must cover its forward as well as the backward, which recomputes the chunks.
        with par.loss_context():
            loss = model(x, pos, targets=y)  # mean over the mb * T_local tokens
            extra = aux_loss(model)
            ((loss if extra is None else loss + extra) / n).backward()
        losses.append(_local(loss.detach()))
    return torch.stack(losses).mean()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor; keep a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reduce_losses(par: Parallelized, losses: list[torch.Tensor]) -> list[float]:
    """The global mean loss of each step from every rank's `StepResult.loss_local`: one all-reduce of the stacked
    steps and one host read for all of them (every rank must call it, with the same number of steps)."""
    loss = torch.stack([t.float() for t in losses])  # [steps]
    if par.topo.pp > 1:  # only the last stage has the loss: summing over the pp group hands it to every stage
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=pp_mesh(par.mesh).get_group())
    group = grad_reduce_group(par)  # ... then average over the ranks that saw different rows (dp) or tokens (cp)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG for every dtype
        loss /= dist.get_world_size(group)
    return loss.tolist()


def is_log_step(cfg: Config, step: int, start: int = 0) -> bool:
    """Whether `run_training` reads (reduces, logs) step `step`: the first, every train.log_every-th, the last."""
    return step == start or (step + 1) % cfg.train.log_every == 0 or step + 1 >= cfg.train.steps


def train_step(par: Parallelized, step: int, *,
               after_backward: Callable[[torch.Tensor], None] | None = None, read: bool | None = None) -> StepResult:
    """Optimizer step `step`: forward and backward over this rank's micro-batches, clip, lr schedule, update,
    zero the gradients. `after_backward(loss)` runs between the backward and the update with this rank's loss,
    to read values out (the white-box gathers the gradients there, validation/whitebox.py); it must not change
    them. `read`: reduce the loss across ranks and read it and the clip norm to the host (True), or leave both
    on the device and only assert the loss finite there, without waiting (False); None: `is_log_step`. The step
    itself never waits for the device otherwise (docs/ARCHITECTURE.md#training-step)."""
    t0 = time.perf_counter()
    loss = forward_backward(par, step)
    if after_backward is not None:
        after_backward(loss)
    norm = optimizer_step(par.optimizer, par.parts, par.cfg, step, par.mesh)
    par.zero_grad()
    r = StepResult(loss=None, step_time_s=0.0, tokens_per_s=0.0, loss_local=loss, norm=norm)
    if read if read is not None else is_log_step(par.cfg, step):
        r.loss = reduce_losses(par, [loss])[0]
        r.grad_norm = None if norm is None else float(norm)
    else:
        torch._assert_async(torch.isfinite(loss), f"the loss of step {step} is not finite")
    r.step_time_s = time.perf_counter() - t0
    r.tokens_per_s = par.cfg.train.global_batch * par.cfg.train.seq_len / r.step_time_s
    return r


@contextmanager
def collect_garbage(every: int) -> Iterator[Callable[[int], None]]:
    """Python's cyclic GC off for the loop, one full collection every `every` steps (`tick(step)`): an automatic
    collection can start in any step on any rank and stall every other rank at the next collective
    (torchtitan's GarbageCollection, torchtitan/tools/utils.py). every = 0: GC left as it is."""
    if every <= 0:
        yield lambda step: None
        return
    was = gc.isenabled()
    gc.disable()
    gc.collect()
    try:
        yield lambda step: gc.collect() if step > 0 and step % every == 0 else None
    finally:
        if was:
            gc.enable()


def run_training(cfg: Config, *, log=None, checkpoint_dir: str | None = None, save_every: int = 0,
                 resume: str | None = None, keep_last: int = 0) -> dict[str, Any]:
    """Train steps [start, cfg.train.steps) in this process group; returns losses and timings (same on all ranks).

    The steps are read only at `is_log_step` steps and before a checkpoint: one all-reduce and one host read give
    the losses of every step since the last read, and each step's time is its window's wall time per step (the
    host runs ahead of the device in between). `resume`: a checkpoint (any layout) to continue from, start = its
    step; `checkpoint_dir` + `save_every`: save after every save_every-th optimizer step (train/checkpoint.py:
    asynchronous, atomic, never overwriting; the oldest step folders beyond `keep_last` are deleted once a newer
    one is whole, 0 keeps all).
    """
    from curry_train.train import checkpoint
    from curry_train.train.comm_init import set_train_timeout

    device = init_distributed(cfg)
    par = setup(cfg, device)
    start = checkpoint.load(par, resume) if resume else 0
    history: list[StepResult] = []
    window: list[StepResult] = []
    tokens = cfg.train.global_batch * cfg.train.seq_len
    t_window = time.perf_counter()
    with collect_garbage(cfg.train.gc_every) as tick:
        for step in range(start, cfg.train.steps):
            r = train_step(par, step, read=False)
            if step == start:  # the first step built and warmed everything up: now bound each collective tightly
                set_train_timeout(cfg, par.mesh)
            window.append(r)
            history.append(r)
            save = bool(checkpoint_dir and save_every and (step + 1) % save_every == 0)
            if save or is_log_step(cfg, step, start):
                for w, v in zip(window, reduce_losses(par, [w.loss_local for w in window])):
                    w.loss, w.loss_local = v, None
                dt = (time.perf_counter() - t_window) / len(window)  # the read above waited for the device
                for w in window:
                    w.step_time_s, w.tokens_per_s = dt, tokens / dt
                r.grad_norm = None if r.norm is None else float(r.norm)
                if log is not None and rank() == 0:
                    rec = {"step": step, "loss": round(r.loss, 6), "step_time_s": round(dt, 5),
                           "tokens_per_s": round(tokens / dt, 1)}
                    log(rec if r.grad_norm is None else {**rec, "grad_norm": round(r.grad_norm, 6)})
                window = []
                if save:
                    checkpoint.save_async(par, checkpoint_dir, step + 1, keep_last=keep_last)  # written while training
                t_window = time.perf_counter()
            tick(step)
    checkpoint.finish()
    if par.feed is not None:
        par.feed.close()
    return {
        "start_step": start,
        "losses": [r.loss for r in history],
        "step_time_s": [r.step_time_s for r in history],
        "tokens_per_s": [r.tokens_per_s for r in history],
        "world_size": par.topo.world_size,
        "device": par.device.type,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Train the GPT template (run under torchrun for several ranks).")
    ap.add_argument("--config", required=True, help="path to a YAML config, e.g. configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override")
    ap.add_argument("--checkpoint-dir", default=None, help="save checkpoints (step-NNNNNN folders) here")
    ap.add_argument("--save-every", type=int, default=0, help="save after every N optimizer steps")
    ap.add_argument("--resume", default=None, help="continue from this checkpoint (any layout)")
    ap.add_argument("--keep-last", type=int, default=0, help="keep only the newest N step folders (0: all)")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, parse_sets(a.set))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    out = run_training(cfg, log=lambda rec: print(json.dumps(rec), file=sys.stderr, flush=True),
                       checkpoint_dir=a.checkpoint_dir, save_every=a.save_every, resume=a.resume,
                       keep_last=a.keep_last)
    if rank() == 0:
        print(json.dumps({"first_loss": out["losses"][0], "last_loss": out["losses"][-1]}), file=sys.stderr)
    from curry_train.train.comm_init import end_rank

    end_rank()  # every peer has finished, then the cached groups, DDP's cycles (quirk 1) and the world
    return 0


if __name__ == "__main__":
    sys.exit(main())
