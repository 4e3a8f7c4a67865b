"""Planters of the catalogue entries that break a step's numerics rather than a collective: the lr schedule at the
warm-up boundary, one block's forward, a reported scalar, the bf16 reduction dtype, one TP partial sum
(validation/inject.py CATALOGUE; plant.planted applies them, imports torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from curry_train.config import Config
from curry_train.validation.inject import InjectionError
from curry_train.validation.planting import Planted, _patch, hook_on_rank1


def lr_warmup_restart(stack, cfg: Config, target: str | None) -> Planted:
    """At the end of the warm-up the ranks' schedule restarts from its first value (a warm-up scheduler handed to
    the main one with its own step count reset, as a SequentialLR-style chain can): lr_at(step - warmup_steps)
    from step warmup_steps on. Steps before the boundary are exact, so it is caught only when the compared steps
    reach the boundary (whitebox.default_steps)."""
    from curry_train.train import optim

    exact, w = optim.lr_at, cfg.train.warmup_steps
    _patch(stack, optim, "lr_at", lambda cfg, step: exact(cfg, step - w if step >= w else step))
    return Planted()


def mid_layer_forward(stack, cfg: Config, target: str | None) -> Planted:
    """Rank 1's middle transformer block returns its output 0.1% too large (a forward-only error on one rank:
    a wrong scale or a stale buffer in that block). Every layer's gradient below it changes too, so only the
    forward activations can say where it starts."""
    name = target or f"layers.{cfg.model.n_layers // 2}"

    return Planted(after_setup=lambda par: hook_on_rank1(par, name, lambda mod, args, out: out * 1.001))


def cp_loss_unreduced(stack, cfg: Config, target: str | None) -> Planted:
    """The step's loss is averaged over the dp ranks only, not dp x cp (train.loop.reduce_losses reads its
    group from grad_reduce_group by name): each cp rank reports the loss of its own sequence chunks. Gradients
    and updates are exact (the reported loss is not what backward ran on); only the per-rank scalar is wrong."""
    from curry_train.train import loop

    _patch(stack, loop, "grad_reduce_group", lambda par: None if par.mesh is None else par.mesh["dp"].get_group())
    return Planted()


def fsdp_reduce_bf16(stack, cfg: Config, target: str | None) -> Planted:
    """FSDP2's MixedPrecisionPolicy with reduce_dtype=bfloat16 (parallel/fsdp.py fsdp_kwargs returns the policy
    every unit gets; apply_fsdp looks it up by name): gradients reduce-scattered (fsdp-reduce-bf16, sharded units)
    or all-reduced across ZeRO-0's replicas (replicate-reduce-bf16, the bf16 form of DDP's bf16_compress_hook) in
    bf16, not fp32. Everything else of the policy is the real one's (dataclasses.replace), so the reduction is the
    only difference."""
    import dataclasses

    from curry_train.parallel import fsdp

    exact = fsdp.fsdp_kwargs

    def bf16_reduce(cfg: Config) -> dict[str, Any]:
        kwargs = exact(cfg)
        return {**kwargs, "mp_policy": dataclasses.replace(kwargs["mp_policy"], param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.bfloat16)}

    _patch(stack, fsdp, "fsdp_kwargs", bf16_reduce)
    return Planted()


def tp_partial_sum(factor: float) -> Callable[..., Planted]:
    """Rank 1's partial sum of the middle block's row-parallel attention.wo is `factor` times too large before the
    tp all-reduce (1.01: a partial counted 1.01 times): the block's attention output is off by about half of it,
    nothing before it. The hook runs before the module's output redistribution (prepend), on the Partial DTensor."""
    label = f"tp-partial-sum-{round((factor - 1) * 100)}pct"

    def plant(stack, cfg: Config, target: str | None) -> Planted:
        name = target or f"layers.{cfg.model.n_layers // 2}.attention.wo"

        def scale_partial(mod: torch.nn.Module, args: Any, out: Any) -> Any:
            from torch.distributed.tensor import DTensor

            if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
                return DTensor.from_local(out.to_local() * factor, out.device_mesh, out.placements, run_check=False)
            raise InjectionError(f"{label}: {name}'s output is not a Partial DTensor here ({type(out)})")

        return Planted(after_setup=lambda par: hook_on_rank1(par, name, scale_partial, prepend=True))

    return plant


PLANTERS = {
    "lr-warmup-restart": lr_warmup_restart,
    "mid-layer-forward": mid_layer_forward,
    "cp-loss-unreduced": cp_loss_unreduced,
    "replicate-reduce-bf16": fsdp_reduce_bf16,
    "fsdp-reduce-bf16": fsdp_reduce_bf16,
    "tp-partial-sum-1pct": tp_partial_sum(1.01),
    "tp-partial-sum-2pct": tp_partial_sum(1.02),
}
