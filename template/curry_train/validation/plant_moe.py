"""Planters of the MoE catalogue entries (validation/inject.py CATALOGUE; plant.planted applies them, imports
torch): under TP with EP the router's gradient left un-summed over tp, and every tp rank dispatching the whole
sequence; in any layout a top-k that takes the wrong experts for some tokens.
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


def route_drops_best(stack, cfg: Config, target: str | None) -> Planted:
    """An off-by-one in the top-k selection on every rank: every 8th token of each router call (local order)
    takes the experts ranked 2..K+1 instead of 1..K. Planted through the router's `replay` (model/moe.py), the
    hook the white-box reference replays near ties with: its best expert is dropped, never a near tie
    (validation/routing.py must fail it, not excuse it)."""
    import torch

    from curry_train.model.moe import TopKRouter

    def wrong(x: torch.Tensor, w: torch.Tensor, logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        N, K = top.shape
        shifted = logits.topk(K + 1, dim=-1).indices[:, 1:]  # [N, K]: ranks 2..K+1
        every8 = torch.arange(N, device=top.device) % 8 == 0  # [N]
        return torch.where(every8[:, None], shifted, top)

    def after(par) -> None:
        for part in par.parts:
            for m in part.modules():
                if isinstance(m, TopKRouter):
                    m.replay = wrong

    return Planted(after_setup=after)


PLANTERS = {"tp-ep-router-unreduced": tp_ep_router_unreduced, "tp-ep-tokens-twice": tp_ep_tokens_twice,
            "route-drops-best": route_drops_best}
