"""Pipeline parallel over the mesh's "pp" axis with torch.distributed.pipelining (manual stage split).

    curry-train whitebox --config configs/tiny.yaml --set parallel.pp=2 --set parallel.pp_schedule=gpipe --json

Shape legend: B rows of this dp rank per step (= m * mb), mb micro-batch, m micro-batches, T sequence, D d_model,
V vocab, p = pp ranks, v = pp_virtual chunks per rank, S = p * v stages, L layers.

Split: S stages of consecutive layers, at least one each (pipeline_split.py: boundaries balance the estimated
cost, embedding on stage 0 and head + loss on stage S-1 included; `parallel.pp_layers` overrides them; the
slowest stage sets the pace). Stage 0 also owns the embedding, stage S-1 the final norm and LM head. A stage is the
full Transformer with the parts it does not own removed, so its parameter names are the full model's (`layers.<i>` keeps
the global index) and the white-box check merges stages by name.

Placement of stages on ranks (schedules from torch.distributed.pipelining):
  gpipe    one stage per rank, all forwards then all backwards (Huang et al. 2019, "GPipe");
  1f1b     one stage per rank, one-forward-one-backward steady state (Narayanan et al. 2019, "PipeDream"):
           same bubble (p-1)/(m+p-1), at most p micro-batches of activations in flight;
  interleaved_1f1b  looped placement, rank r holds stages r, r+p, ... (Narayanan et al. 2021, "Efficient
           Large-Scale Language Model Training on GPU Clusters", §2.2.2): bubble divided by ~v, v x the p2p;
  zero_bubble  backward split into input-grad (B) and weight-grad (W) passes that fill the bubble (Qi et al.
           2024, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241): with v=2 the V placement (rank r holds
           stages r and 2p-1-r, ZBV §6), otherwise looped placement with the interleaved zero-bubble schedule.

Loss: the last stage computes it in its own forward (model/gpt.py chunked_lm_loss, so the [mb * T, V] logits
never exist at once): the micro-batch's targets reach it as the forward kwarg `targets`, which step() splits
into micro-batches like the inputs and passes to every stage this rank runs (torch 2.13 stage.py
forward_one_chunk: "kwargs can be passed to all stages"; a stage without the head ignores them). The
schedule's loss_fn (`_stage_loss`) then only hands that mean over one micro-batch's tokens on; the schedule
divides the accumulated gradients by m (`scale_grads=True`), so gradients are the mean over the m
micro-batches, as in the reference; DDP / FSDP then average over dp. The schedule itself skips DDP's
all-reduce / FSDP's reduce-scatter on all but the last micro-batch.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.model.data import cp_positions
from curry_train.pipeline_split import pipeline_stage_ids, split_for, stage_layer_range

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def schedule_name(cfg: Config) -> str:
    """torch class name of the configured schedule."""
    p = cfg.parallel
    if p.pp_schedule == "zero_bubble":
        return "ScheduleZBVZeroBubble" if p.pp_virtual == 2 else "ScheduleInterleavedZeroBubble"
    return SCHEDULES[p.pp_schedule]


def stage_ids(pp_rank: int, cfg: Config) -> list[int]:
    """Stage indices held by pipeline rank `pp_rank`, in the order the schedule expects (rules/: looped, or
    a V for ScheduleZBVZeroBubble so the turn stays local); the estimator uses the same function."""
    p = cfg.parallel
    return pipeline_stage_ids(p.pp, p.pp_virtual, p.pp_schedule, pp_rank)


def stage_layers(stage: int, cfg: Config) -> list[int]:
    """Global layer indices of a stage: a contiguous share, from the one split function the estimator uses too
    (pipeline_split.split_for: cost-balanced, or parallel.pp_layers)."""
    return list(stage_layer_range(split_for(cfg), stage))


def build_stage_module(model: nn.Module, stage: int, cfg: Config) -> nn.Module:
    """The part of `model` that stage `stage` runs: same class, same parameter names, other parts removed."""
    n_stages = cfg.parallel.pp * cfg.parallel.pp_virtual
    keep = {str(i) for i in stage_layers(stage, cfg)}
    drop = [m for k, m in model.layers.items() if k not in keep]
    drop += [m for m, owned in ((model.tok_embeddings, stage == 0), (model.norm, stage == n_stages - 1),
                                (model.output, stage == n_stages - 1)) if not owned]
    # Copy what the stage keeps; the memo maps dropped modules to themselves so they are not copied only to be
    # deleted (torchtitan's pipeline split deep-copies the whole model per stage).
    part = copy.deepcopy(model, memo={id(m): m for m in drop})
    for k in [k for k in part.layers if k not in keep]:
        del part.layers[k]
    if stage != 0:
        part.tok_embeddings = None  # a later stage receives hidden states [mb, T, D]
    if stage != n_stages - 1:
        part.norm, part.output = None, None  # ... and sends hidden states on
    return part


def _positions_hook(positions: torch.Tensor):
    """The schedule calls a stage with its activation only; give every stage the tokens' global positions
    (RoPE), which under SP or CP are not `arange` of the local length."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) < 2 and kwargs.get("positions") is None:
            kwargs = {**kwargs, "positions": positions}
        return args, kwargs

    return hook


def apply_pp(model: nn.Module, mesh: Any, cfg: Config, device: torch.device | None = None
             ) -> tuple[list[nn.Module], list[int]]:
    """Split `model` into this rank's stage modules. Returns (parts, stage_ids), in schedule order.
    `device`: where the stages will run (the model itself may still be on "meta", parallel/materialize.py)."""
    pp_rank = mesh["pp"].get_local_rank()
    cp_rank = mesh["cp"].get_local_rank()
    ids = stage_ids(pp_rank, cfg)
    device = device or next(model.parameters()).device
    positions = cp_positions(cfg.train.seq_len, cfg.parallel.cp, cp_rank).to(device)  # [T / cp]
    parts = []
    from curry_train.model.moe import moe_layers

    for s in ids:
        part = build_stage_module(model, s, cfg)
        for _, moe in moe_layers(part):
            # The schedule's loss is the last stage's LM loss only: every stage's router losses get their
            # gradient in backward instead (moe.AuxLossBackward, Megatron's aux-loss scaler). Scale 1 per
            # micro-batch, like the LM loss; the schedule then divides every gradient by m (scale_grads).
            moe.aux_grad_scale = 1.0
        part.register_forward_pre_hook(_positions_hook(positions), with_kwargs=True)
        parts.append(part)
    return parts, ids


def build_schedule(par) -> Any:
    """PipelineStage(s) around the wrapped parts on the pp group, and the configured schedule."""
    from torch.distributed import pipelining
    from torch.nn.parallel import DistributedDataParallel

    cfg = par.cfg
    n_stages = cfg.parallel.pp * cfg.parallel.pp_virtual
    group = par.mesh["pp"].get_group()
    for part in par.parts:
        if isinstance(part, DistributedDataParallel):
            # The schedule arms DDP's reducer itself before the last micro-batch's backward
            # (stage.backward_maybe_with_nosync). Left on, the shape-inference forward of the first step arms it
            # too, its input-only backward never fires the hooks, and the next backward double-counts them
            # ("rebuilt parameter indices size is not same as original model parameters size").
            part.require_backward_grad_sync = False
            # ... and with the flag off, expert_parallel's DDP hook would never reduce the expert shards:
            # pipeline_forward_backward reduces them after the step instead.
            part._curry_manual_expert_sync = True

    def get_mesh(names: tuple[str, ...], layout: Any) -> Any:  # rebuilds received DTensors (SP activations)
        return par.mesh[names[0] if len(names) == 1 else names]

    stage_cls = _split_backward_stage() if cfg.parallel.pp_schedule == "zero_bubble" else pipelining.PipelineStage
    stages = [stage_cls(part, s, n_stages, par.device, group=group, get_mesh=get_mesh)
              for part, s in zip(par.parts, par.stage_ids)]
    cls = getattr(pipelining, schedule_name(cfg))
    single = cfg.parallel.pp_virtual == 1
    # scale_grads=True: grads /= m after the step, so the per-micro-batch mean losses average like the reference.
    return cls(stages[0] if single else stages, n_microbatches=cfg.num_microbatches, loss_fn=_stage_loss,
               scale_grads=True)


def _split_backward_stage() -> type:
    """PipelineStage whose input-gradient (I) and weight-gradient (W) passes see FSDP's unsharded parameters.

    Why (the ZeRO-3 x zero_bubble bug: step-0 gradients of every stage but stage 0 wrong, the head's lost):
    torch 2.13 `pipelining/_backward.py` `stage_backward_input` finds the weights' gradient paths by the
    AccumulateGrad nodes of `self.submod.parameters()` (`_get_grad_fn_or_grad_acc`, then `get_param_groups`),
    evaluated before its `autograd.grad` call. The forward graph was built on FSDP2's unsharded parameters
    (`FSDPParam._unsharded_param`, one Parameter object reused by every all-gather); but with
    reshard_after_forward=True (zero=3) `FSDPParamGroup.post_forward` has already swapped the module's
    attributes back to the sharded DTensors, whose AccumulateGrad nodes are not in that graph. The runtime's
    UNSHARD action (`schedules._add_unshard_reshard`) does not help: the stage's next forward reshards again.
    `get_param_groups` then finds no group for those parameters, so `stage_backward_weight` computes nothing
    for them and the micro-batch's weight gradient is silently dropped (no error). Stage 0 is spared because
    its W pass is a full `stage_backward`, and zero=2 (reshard_after_forward=False) keeps the unsharded
    Parameters registered, so both pass. Fix: gather every FSDP unit of the stage (`FSDPModule.unshard`, a
    no-op when already gathered) before the I and the W pass, so `submod.parameters()` are the Parameters the
    graph used; the W pass also needs it because a forward between I and W reshards again. Cost: the chunk's
    units are gathered at the start of I rather than one by one during it; torch keeps them all gathered after
    any backward until REDUCE_GRAD anyway (`backward_maybe_with_nosync` -> `set_reshard_after_backward(False)`),
    and the all-gathers are the ones zero=3's own pre-backward unshard would issue (benchmarks/
    estimator_accuracy.py row pp2-dp2-zero3-d256-zb; estimator/phases.py models this gather as a moment of its own)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    class SplitBackwardStage(PipelineStage):
        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            if backward_type in ("input", "weight") and isinstance(self.submod, FSDPModule):
                for module in self.submod.modules():
                    if isinstance(module, FSDPModule):
                        module.unshard()
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    return SplitBackwardStage


def _stage_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss_fn: the last stage's forward already returned the micro-batch's mean loss."""
    return output


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def pipeline_forward_backward(par, step: int) -> torch.Tensor:
    """Optimizer step `step`'s forward and backward through the pipeline for this dp (and cp) rank's rows.

    Only the owners of the first stage (tokens) and of the last (targets) build this rank's micro-batches (the
    train/feed.py prefetcher); a middle stage reads no data. Returns this rank's mean loss: the last stage's over
    its micro-batches, 0 on the other stages (train.loop.reduce_losses sums over pp, then averages over dp x cp).
    """
    from curry_train.train.feed import feed_of

    cfg = par.cfg
    last = cfg.parallel.pp * cfg.parallel.pp_virtual - 1
    first_stage, last_stage = 0 in par.stage_ids, last in par.stage_ids
    args: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, Any] = {}
    losses: list[torch.Tensor] = []
    if first_stage or last_stage:
        feed = feed_of(par)
        x, y, _ = feed.host(step)  # [m * mb, T / cp]: the schedule re-splits into m micro-batches
        if first_stage:  # the owner of stage 0 feeds the tokens
            args = (feed.to_device(x),)
        if last_stage:
            y = feed.to_device(y)
            # `target` (the schedule's, required with a loss_fn) and `targets` (the model's forward kwarg) are the
            # same ids
            kwargs = {"target": y, "losses": losses, "targets": y}
        del x, y  # only the device copies stay alive through the schedule
    # loss_parallel covers the last stage's forward (the loss) and the backward (the schedule runs both inside
    # step()). return_outputs=False: only the losses are used here.
    with par.loss_context():
        par.schedule.step(*args, return_outputs=False, **kwargs)
    for part in par.parts:  # DDP + EP: expert shards, summed over edp_cp after the schedule scaled by 1/m
        reduce_experts = getattr(part, "_curry_reduce_experts", None)
        if reduce_experts is not None:
            reduce_experts()
    if not losses:
        return torch.zeros((), device=par.device)
    return torch.stack([_plain(t).detach().float() for t in losses]).mean()
