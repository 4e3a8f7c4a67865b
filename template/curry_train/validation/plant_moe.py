"""Planters of the catalogue entries for TP with EP (validation/inject.py CATALOGUE; plant.planted applies them,
imports torch): the router's gradient left un-summed over tp, and every tp rank dispatching the whole sequence.
"""

from __future__ import annotations

from curry_train.config import Config
from curry_train.validation.planting import Planted, _patch


def tp_ep_router_unreduced(stack, cfg: Config, target: str | None) -> Planted:
    """model/moe.py TopKRouter routes this tp rank's T/tp tokens with the replicated gate weight and sums its
    gradient over tp (comms.sum_grad_over); the identity instead leaves each tp rank its own share."""
    from curry_train.parallel import comms

    _patch(stack, comms, "sum_grad_over", lambda t, group: t)
    return Planted()


def tp_ep_tokens_twice(stack, cfg: Config, target: str | None) -> Planted:
    """The TP plan of the sequence-parallel MoE without EP (all-gather the sequence into the MoE) kept while the
    EP group spans the tp ranks: every tp rank dispatches the whole micro-batch, so each token reaches its
    experts tp times (the forward is still exact; expert and router gradients are tp times too large)."""
    from curry_train.parallel import tensor_parallel

    plan = tensor_parallel.block_plan
    _patch(stack, tensor_parallel, "block_plan",
           lambda sp, dense_ffn=True, shared=False, ep_over_tp=False, mla_q_lora=None:
           plan(sp, dense_ffn, shared, False, mla_q_lora))
    return Planted()


PLANTERS = {"tp-ep-router-unreduced": tp_ep_router_unreduced, "tp-ep-tokens-twice": tp_ep_tokens_twice}
