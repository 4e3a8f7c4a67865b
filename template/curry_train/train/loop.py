"""Training: build the seeded model, parallelize it from the config, run AdamW steps over the synthetic stream.

    python -m curry_train.train.loop --config configs/tiny.yaml                              # one process
    torchrun --nproc-per-node 2 -m curry_train.train.loop --config configs/tiny.yaml --set parallel.dp=2

`train_step` is the one training step every caller runs (train, bench, climb, memory, the white-box's ranks):
build only this rank's micro-batches of the global batch (model/data.py) and accumulate their gradients (reducing
only on the last micro-step), clip, set the scheduled lr and step the optimizer (train/optim.py), zero the
gradients. Logs loss, step time and tokens/s per step as JSON lines on stderr
(stdout stays free for callers such as the MCP server).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from curry_train.config import Config, ConfigError, load_config, parse_sets
from curry_train.mesh import Topology, build_mesh, device_type, node_layout
from curry_train.model.data import rank_micro_batches
from curry_train.model.gpt import aux_loss, build_meta_model
from curry_train.parallel.parallelize import Parallelized, grad_reduce_group, parallelize
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
    self-test injects faults there).
    """
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
    mesh = build_mesh(topo, device.type, dp_replicate=cfg.parallel.dp_replicate,
                      experts=cfg.model.num_experts > 0) if world > 1 else None
    model = build_meta_model(cfg)
    if model_hook is not None:
        model_hook(model)
    par = parallelize(model, mesh, cfg, topo=topo, device=device)
    return par


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class StepResult:
    loss: float
    step_time_s: float
    tokens_per_s: float
    grad_norm: float | None = None  # the pre-clip global norm this rank clipped by (None: clipping off)


def forward_backward(par: Parallelized, step: int) -> torch.Tensor:
    """Accumulate this rank's gradients for optimizer step `step`; returns the global mean loss (all ranks)."""
    cfg, topo = par.cfg, par.topo
    if topo.pp > 1:
        from curry_train.parallel.pipeline import pipeline_forward_backward

        return pipeline_forward_backward(par, step)
    coords = topo.coords(rank())
    model, n = par.parts[0], cfg.num_microbatches
    losses = []
    for m, (x, y, pos) in enumerate(rank_micro_batches(cfg, step, coords["dp"], coords["cp"])):
        par.grad_sync(m == n - 1)  # reduce gradients once, on the last micro-step
        x, y, pos = x.to(par.device), y.to(par.device), pos.to(par.device)
        # The model computes the loss itself (model/gpt.py chunked_lm_loss: no full [mb*T, V] logits), so TP's
        # loss_parallel must cover its forward as well as the backward, which recomputes the chunks.
        with par.loss_context():
            with par.autocast():
                loss = model(x, pos, targets=y)  # mean over the mb * T_local tokens
            extra = aux_loss(model)
            ((loss if extra is None else loss + extra) / n).backward()
        losses.append(_local(loss.detach()))
    loss = torch.stack(losses).mean()
    group = grad_reduce_group(par)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG for every dtype
        loss /= dist.get_world_size(group)
    return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor; keep a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_step(par: Parallelized, step: int, *,
               after_backward: Callable[[torch.Tensor], None] | None = None) -> StepResult:
    """Optimizer step `step`: forward and backward over this rank's micro-batches, clip, lr schedule, update,
    zero the gradients. `after_backward(loss)` runs between the backward and the update, to read values out
    (the white-box gathers the gradients there, validation/whitebox.py); it must not change them."""
    t0 = time.perf_counter()
    loss = forward_backward(par, step)
    if after_backward is not None:
        after_backward(loss)
    norm = optimizer_step(par.optimizer, par.parts, par.cfg, step, par.mesh)
    par.zero_grad()
    if par.device.type == "cuda":
        torch.cuda.synchronize(par.device)
    dt = time.perf_counter() - t0
    tokens = par.cfg.train.global_batch * par.cfg.train.seq_len
    return StepResult(loss=float(loss), step_time_s=dt, tokens_per_s=tokens / dt, grad_norm=norm)


def run_training(cfg: Config, *, log=None, checkpoint_dir: str | None = None, save_every: int = 0,
                 resume: str | None = None, keep_last: int = 0) -> dict[str, Any]:
    """Train steps [start, cfg.train.steps) in this process group; returns losses and timings (same on all ranks).

    `resume`: a checkpoint (any layout) to continue from, start = its step; `checkpoint_dir` + `save_every`:
    save after every save_every-th optimizer step (train/checkpoint.py: asynchronous, atomic, never
    overwriting; the oldest step folders beyond `keep_last` are deleted once a newer one is whole, 0 keeps all).
    """
    from curry_train.train import checkpoint
    from curry_train.train.comm_init import set_train_timeout

    device = init_distributed(cfg)
    par = setup(cfg, device)
    start = checkpoint.load(par, resume) if resume else 0
    history = []
    for step in range(start, cfg.train.steps):
        r = train_step(par, step)
        if step == start:  # the first step built and warmed everything up: now bound each collective tightly
            set_train_timeout(cfg, par.mesh)
        history.append(r)
        if log is not None and rank() == 0:
            log({"step": step, "loss": round(r.loss, 6), "step_time_s": round(r.step_time_s, 5),
                 "tokens_per_s": round(r.tokens_per_s, 1)})
        if checkpoint_dir and save_every and (step + 1) % save_every == 0:
            checkpoint.save_async(par, checkpoint_dir, step + 1, keep_last=keep_last)  # written while training
    checkpoint.finish()
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
    is_rank0 = rank() == 0
    if dist.is_initialized():
        import gc

        gc.collect()  # DDP reference cycles alive at destroy abort the process (docs/CPU-DISTRIBUTED.md, quirk 1)
        dist.destroy_process_group()
    if is_rank0:
        print(json.dumps({"first_loss": out["losses"][0], "last_loss": out["losses"][-1]}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
