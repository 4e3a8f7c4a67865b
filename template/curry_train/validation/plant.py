"""How each entry of validation/inject.CATALOGUE is planted inside the rank processes (imports torch).

Each planter takes (stack, cfg, target) and returns a Planted; module attributes it replaces are restored
by `stack` when the rank job ends. Nothing here is imported by the single-device reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from curry_train.config import Config
from curry_train.validation.inject import InjectionError, check
from curry_train.validation.planting import Planted, _patch, _rank


@contextlib.contextmanager
def planted(name: str | None, cfg: Config, target: str | None = None, resume: bool = False) -> Iterator[Planted]:
    """Plant `name` for the duration of one rank job (module patches are restored on exit); none: no-op.
    `resume`: the job loads a checkpoint (the "resume" family plants there)."""
    if not name:
        yield Planted()
        return
    check(name, cfg, resume=resume)
    with contextlib.ExitStack() as stack:
        from curry_train.validation.plant_experts import PLANTERS as EXPERTS
        from curry_train.validation.plant_moe import PLANTERS as MOE
        from curry_train.validation.plant_numerics import PLANTERS as NUMERICS  # imports this module's helpers

        yield {**PLANTERS, **NUMERICS, **MOE, **EXPERTS}[name](stack, cfg, target)


def _param_groups(opt: Any) -> list[dict]:
    """The optimizer's param groups, plus the wrapped local optimizer's (ZeroRedundancyOptimizer.optim)."""
    from curry_train.parallel.zero import zero_optimizers  # ZeRO-1 with experts: one per group

    groups = list(opt.param_groups)
    for z in zero_optimizers(opt):
        inner = getattr(z, "optim", None)
        groups += list(inner.param_groups) if inner is not None else []
    return groups


def ddp_unreduced_grad(stack, cfg: Config, target: str | None) -> Planted:
    """Put one parameter on DDP's ignore list before wrapping: its gradient stays each rank's own (the bug of a
    hand-rolled DDP or a missed hook). Default target: the middle block's first FFN weight."""
    name = target or (f"layers.{cfg.model.n_layers // 2}.feed_forward.w1.weight" if cfg.model.num_experts == 0
                      else f"layers.{cfg.model.n_layers // 2}.attention.wq.weight")

    def hook(model: torch.nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        known = dict(model.named_parameters())
        if name not in known:
            raise InjectionError(f"ddp-unreduced-grad: no parameter {name!r}; e.g. {next(iter(known))}")
        old = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted({*old, name}))

    return Planted(model_hook=hook)


def zero1_no_weight_decay(stack, cfg: Config, target: str | None) -> Planted:
    """ZeroRedundancyOptimizer copies the outer param groups' hyper-parameters into its local AdamW each step
    (torch/distributed/optim/zero_redundancy_optimizer.py, _sync_param_groups): zero both."""

    def after(par: Any) -> None:
        for g in _param_groups(par.optimizer):
            g["weight_decay"] = 0.0

    return Planted(after_setup=after)


def fsdp_grad_sum(stack, cfg: Config, target: str | None) -> Planted:
    """Every FSDP2 unit reduce-scatters with divide factor 1, i.e. a plain sum over the dp x cp ranks. Sum-only
    collectives (gloo has no PREMUL_SUM), as fully_shard_experts already does for the expert units."""

    def after(par: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        for part in par.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)

    return Planted(after_setup=after)


def hsdp_no_replica_allreduce(stack, cfg: Config, target: str | None) -> Planted:
    """HSDP whose replica all-reduce is missing: FSDP2's post-backward calls `foreach_reduce(..., all_reduce_group,
    ...)` with the replicate process group when the unit's mesh is 2-D (torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py post_backward; _fsdp_collectives.py foreach_reduce: "not `None` iff HSDP"). Passing None
    keeps the reduce-scatter inside the shard group and drops the all-reduce across replicas, and FSDP2 then
    averages over the shard group only (_get_gradient_divide_factors): each replica steps on the mean gradient of
    its own 1/dp_replicate of the batch, the replicas drift apart, as in a hand-built HSDP whose replicate group
    was never wired. Patched where post_backward looks the name up, for this rank job only."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    exact = _fsdp_param_group.foreach_reduce
    sig = inspect.signature(exact)
    if "all_reduce_group" not in sig.parameters:
        raise InjectionError(f"hsdp-no-replica-allreduce: torch {torch.__version__}'s FSDP2 foreach_reduce has no "
                             "all_reduce_group argument any more; the planter in validation/plant.py needs updating")

    def no_replica_all_reduce(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.arguments["all_reduce_group"] = None
        return exact(*bound.args, **bound.kwargs)

    _patch(stack, _fsdp_param_group, "foreach_reduce", no_replica_all_reduce)
    return Planted()


def tp_sp_norm_unreduced(stack, cfg: Config, target: str | None) -> Planted:
    """Under SP a norm weight (a Replicate DTensor) gets a Partial gradient: each rank's share from its T/tp
    tokens, which DTensor sums over tp before accumulating. The hook relabels the partial local gradient as
    already replicated, so the sum never happens (each rank keeps its own share)."""

    def hook_for(param: torch.Tensor):
        from torch.distributed.tensor import DTensor, Replicate

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                return DTensor.from_local(grad.to_local(), grad.device_mesh, [Replicate()] * grad.device_mesh.ndim,
                                          run_check=False)
            return grad

        return hook

    def after(par: Any) -> None:
        for part in par.parts:
            for name, p in part.named_parameters():
                if name.split(".")[-2] in ("attention_norm", "ffn_norm", "norm"):
                    p.register_hook(hook_for(p))

    return Planted(after_setup=after)


def pp_unscaled_grads(stack, cfg: Config, target: str | None) -> Planted:
    """The schedule reads scale_grads at every step (torch/distributed/pipelining/schedules.py)."""

    def after(par: Any) -> None:
        par.schedule.scale_grads = False

    return Planted(after_setup=after)


def ep_expert_unreduced(stack, cfg: Config, target: str | None) -> Planted:
    """parallel/ddp.py calls expert_parallel.sync_expert_grads at wrap time; a no-op leaves each rank's expert
    gradients as they arrived from the all-to-all: neither summed over edp nor divided by dp*cp."""
    from curry_train.parallel import expert_parallel

    _patch(stack, expert_parallel, "sync_expert_grads", lambda ddp, mesh, cfg: None)
    return Planted()


def cp_local_lse(stack, cfg: Config, target: str | None) -> Planted:
    """Ring attention whose backward uses the log-sum-exp over this rank's own keys (ring step 0) instead of the
    final merged one: the forward is still exact, the probabilities the backward rebuilds do not sum to one.
    The local LSE comes from the same fused kernel the ring runs (context_parallel._attn_fwd), over plans[rank]."""
    from curry_train.parallel import context_parallel as cpm

    exact = cpm.RingAttention

    class LocalLSE(exact):
        @staticmethod
        def forward(ctx, q, k, v, group, plans, rank):
            out = exact.forward(ctx, q, k, v, group, plans, rank)  # [B, H, Tl, Dh]
            rep = q.shape[1] // k.shape[1]
            kr, vr = cpm._rep(k, rep), cpm._rep(v, rep)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # [B, H, Tl]
            for qs, ks, causal in plans[rank]:  # own keys only: every query sees at least its own position
                lse_b = cpm._attn_fwd(q[:, :, qs], kr[:, :, ks], vr[:, :, ks], causal)[1]
                lse[..., qs] = torch.logaddexp(lse[..., qs], lse_b.float())
            ctx.save_for_backward(q, k, v, out, lse)
            return out

    _patch(stack, cpm, "RingAttention", LocalLSE)
    return Planted()


def data_same_rows(stack, cfg: Config, target: str | None) -> Planted:
    """Every dp rank reads dp rank 0's rows (train/feed.py, which every layout's step reads its micro-batches from,
    imports rank_micro_batches by name)."""
    from curry_train.model import data
    from curry_train.train import feed

    def rank0_step(cfg, step, dp_rank, cp_rank=0):
        return data.rank_micro_batches(cfg, step, 0, cp_rank)

    _patch(stack, feed, "rank_micro_batches", rank0_step)
    return Planted()


def replica_lr(stack, cfg: Config, target: str | None) -> Planted:
    """Ranks other than 0 step with 10x the learning rate (a per-rank schedule or a config read per host): the
    schedule train.optim.optimizer_step reads each step (by module attribute) returns 10x there."""
    from curry_train.train import optim

    exact = optim.lr_at

    def after(par: Any) -> None:
        if _rank() != 0:
            _patch(stack, optim, "lr_at", lambda cfg, step: 10 * exact(cfg, step))

    return Planted(after_setup=after)


def zero_grad_noop(stack, cfg: Config, target: str | None) -> Planted:
    """The training step's zero-grad does nothing (e.g. an in-place zeroing that never reaches DDP's bucket
    views): every step's gradients are added to the previous steps' (train.loop.train_step calls
    Parallelized.zero_grad; the step after the first reads the sum of two steps' gradients)."""

    def after(par: Any) -> None:
        par.zero_grad = lambda: None

    return Planted(after_setup=after)


def rank_grad_1pct(stack, cfg: Config, target: str | None) -> Planted:
    """Rank 1's attention.wq gradients are 1% too large before the reduction (a per-rank loss scale, a partial
    sum counted 1.01 times): a tensor hook on the parameter runs before DDP's accumulate-grad reduction hook, so
    the reduced gradient, the same on every replica, is 0.5% off on wq only."""

    def after(par: Any) -> None:
        if _rank() != 1:
            return
        for part in par.parts:
            for name, p in part.named_parameters():
                if name.endswith("attention.wq.weight"):
                    p.register_hook(lambda g: g * 1.01)

    return Planted(after_setup=after)


def unseen_rows_grad(stack, cfg: Config, target: str | None) -> Planted:
    """Embedding rows no token of the step uses get a gradient of 1e-11 instead of exactly 0 (a dense term, such as
    a smoothing or z-loss leaking into the embedding): AdamW moves each such row by ~1e-3*lr per step (1e-11 /
    (1e-11 + eps)), where the reference never moves it (the loss and grad norm do not see it at 2 steps)."""

    def leak(g: torch.Tensor) -> torch.Tensor:
        return torch.where(g == 0, torch.full_like(g, 1e-11), g)

    def after(par: Any) -> None:
        for part in par.parts:
            for name, p in part.named_parameters():
                if name.endswith("tok_embeddings.weight"):
                    p.register_hook(leak)

    return Planted(after_setup=after)


def clip_local_norm(stack, cfg: Config, target: str | None) -> Planted:
    """Gradient clipping by this rank's local norm: train.optim.global_grad_norm without any of its all-reduces
    (the local shard's squares only), the bug of clipping with clip_grad_norm_ on sharded tensors' local parts.
    Every FSDP or TP shard then gets its own clip coefficient, and TP-replicated tensors another per rank."""
    from curry_train.train import optim

    def local_norm(parts, cfg, mesh):
        total = torch.zeros((), dtype=torch.float64)
        for part in parts:
            for p in part.parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    total = total + g.detach().double().pow(2).sum().cpu()
        return total.sqrt()

    _patch(stack, optim, "global_grad_norm", local_norm)
    return Planted()


def ddp_rank_sum(stack, cfg: Config, target: str | None) -> Planted:
    """Rank 1 steps on the SUM of the dp gradients, not their mean (a comm hook that forgets the 1/world
    division on one host): its DDP comm hook is the default all-reduce times the group size. Rank 0 is right."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    def summed(group, bucket):
        n = dist.get_world_size(group)
        return default_hooks.allreduce_hook(group, bucket).then(lambda fut: fut.value() * n)

    def after(par: Any) -> None:
        for part in par.parts:
            if isinstance(part, DistributedDataParallel):
                part.register_comm_hook(part.process_group, summed if _rank() == 1 else default_hooks.allreduce_hook)

    return Planted(after_setup=after)


def _resume_target(cfg: Config, target: str | None) -> str:
    """The tensor a resume bug hits: the middle block's attention norm weight by default (its moments move the
    next loss by ~1e-6 relative only, so the loss-only resume check cannot see the bug)."""
    from curry_train.model.gpt import build_meta_model

    name = target or f"layers.{cfg.model.n_layers // 2}.attention_norm.weight"
    known = [n for n, _ in build_meta_model(cfg).named_parameters()]
    if name not in known:
        raise InjectionError(f"resume planter: no parameter {name!r}; e.g. {known[0]}")
    return name


def _load_without(stack, keys: Any) -> None:
    """The checkpoint load asks DCP for every key but those `keys(name)` names: they keep what the load state
    created (train/checkpoint.py state_dict(for_load=True): zero moments, step 0), as a load whose key mapping
    misses them would. Only the load is changed (for_load), never the save."""
    from curry_train.train import checkpoint

    exact = checkpoint.state_dict

    def state_dict(par: Any, *, for_load: bool = False) -> dict[str, torch.Tensor]:
        out = exact(par, for_load=for_load)
        if for_load:
            for k in keys:  # absent on ranks that do not own the tensor (ZeRO-1 partitions, other stages)
                out.pop(k, None)
        return out

    _patch(stack, checkpoint, "state_dict", state_dict)


def resume_drops_moments(stack, cfg: Config, target: str | None) -> Planted:
    """One tensor's AdamW moments (exp_avg, exp_avg_sq) are not loaded on resume: they stay 0."""
    name = _resume_target(cfg, target)
    _load_without(stack, [f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"])
    return Planted()


def resume_step_reset(stack, cfg: Config, target: str | None) -> Planted:
    """One tensor's AdamW step counter is not restored on resume: it restarts at 0, so its next update has the
    bias correction 1 / (1 - beta^1) of a first step instead of 1 / (1 - beta^(k+1)) (Kingma & Ba 2015, Alg. 1)."""
    _load_without(stack, [f"optim.{_resume_target(cfg, target)}.step"])
    return Planted()


PLANTERS = {
    "ddp-unreduced-grad": ddp_unreduced_grad,
    "zero1-no-weight-decay": zero1_no_weight_decay,
    "fsdp-grad-sum": fsdp_grad_sum,
    "hsdp-no-replica-allreduce": hsdp_no_replica_allreduce,
    "tp-sp-norm-unreduced": tp_sp_norm_unreduced,
    "pp-unscaled-grads": pp_unscaled_grads,
    "ep-expert-unreduced": ep_expert_unreduced,
    "cp-local-lse": cp_local_lse,
    "data-same-rows": data_same_rows,
    "replica-lr": replica_lr,
    "zero-grad-noop": zero_grad_noop,
    "rank-grad-1pct": rank_grad_1pct,
    "unseen-rows-grad": unseen_rows_grad,
    "clip-local-norm-fsdp": clip_local_norm,
    "clip-local-norm-tp": clip_local_norm,
    "ddp-rank-sum": ddp_rank_sum,
    "resume-drops-moments": resume_drops_moments,
    "resume-step-reset": resume_step_reset,
}
