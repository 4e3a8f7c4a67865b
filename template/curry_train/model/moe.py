"""Mixture-of-experts FFN: a softmax top-k router (optionally group-limited) and batched SwiGLU experts,
dispatched by expert id, plus always-active shared experts (DeepSeekMoE).

    .venv/bin/pytest tests/parallel/test_moe.py

Shape legend: N local tokens (B*T), D d_model, F d_ff per expert, E experts, El experts on this rank (E / ep),
K top-k, S = N*K routing slots (slot n*K + k = token n's k-th choice), C capacity per expert, R rows received,
G route groups, Eg = E / G experts per group, M groups a token may use, Fs the fused shared expert's width.

One code path for every layout: expert parallelism (parallel/expert_parallel.py) only sets `ep_group`, keeps
this rank's El experts, and the dispatch below turns into two all-to-alls (comms.all_to_all is the identity
on one rank). Routing, capacity and the auxiliary losses always use this rank's own N tokens ("source side"),
so the single-device reference, which replays each data-parallel rank's micro-batches one at a time, applies
exactly the same rule to exactly the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from curry_train.config import ModelConfig
from curry_train.model.experts import Experts
from curry_train.parallel import comms
from curry_train.parallel.recompute import host_once


@dataclass
class Routing:
    experts: torch.Tensor  # [N, K] int64 expert id of each slot
    weights: torch.Tensor  # [N, K] fp32 gate, renormalised over the K choices
    keep: torch.Tensor  # [N, K] bool: slot within its expert's capacity
    aux_loss: torch.Tensor | None  # scalar: coef * load-balance + z_coef * z-loss
    logits: torch.Tensor | None = None  # [N, E] the fp32 router logits the choice was made on


def capacity(num_tokens: int, m: ModelConfig) -> int | None:
    """Switch Transformer capacity (Fedus et al. 2021, §2.2): ceil(cf * N * K / E) slots per expert; None = no drop."""
    if m.capacity_factor <= 0:
        return None
    return math.ceil(m.capacity_factor * num_tokens * m.top_k / m.num_experts)


def capacity_keep(experts: torch.Tensor, num_experts: int, cap: int | None) -> torch.Tensor:
    """Deterministic dropping: each expert keeps its first `cap` slots in priority order (all first choices in
    token order, then all second choices, ...; GShard, Lepikhin et al. 2020, Alg. 1). experts [N, K] -> [N, K]."""
    if cap is None:
        return torch.ones_like(experts, dtype=torch.bool)
    slot_major = experts.t().reshape(-1)  # [K*N] priority order
    # a comparison, not F.one_hot, whose range check reads the ids back to the host on CUDA
    onehot = (slot_major.unsqueeze(1) == torch.arange(num_experts, device=experts.device)).long()  # [K*N, E]
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # [K*N] rank of the slot within its expert
    return (position < cap).view(experts.shape[1], experts.shape[0]).t()  # [N, K]


def _histogram(ids: torch.Tensor, n: int) -> torch.Tensor:
    """bincount(ids, minlength=n) without a host sync (CUDA's bincount reads max(ids) back to size its output)."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def capacity_keep_cp(experts: torch.Tensor, batch: int, m: ModelConfig, group: Any) -> torch.Tensor:
    """capacity_keep over whole sequences when context parallel splits them.

    experts [N, K] of this cp rank's tokens, rows (b, local t), N = batch * T/cp. The expert ids of every cp
    rank are all-gathered (N*K integers, not differentiable), put back at their global positions
    (data.cp_positions), and the priority order is that of the full [batch, T] micro-batch the single-device
    reference routes; this rank keeps its own slots of the result -> [N, K].
    """
    from curry_train.model.data import cp_positions

    cp, rank, K = comms.group_size(group), comms.group_rank(group), experts.shape[1]
    Tl = experts.shape[0] // batch
    T = Tl * cp
    local = experts.view(batch, Tl, K).transpose(0, 1).contiguous()  # [Tl, batch, K]
    gathered = comms.all_gather_dim0(local, group)  # [cp * Tl, batch, K], rank j's rows at j*Tl
    pos = torch.cat([cp_positions(T, cp, j) for j in range(cp)]).to(experts.device)  # [T]
    full = torch.empty_like(gathered).index_copy_(0, pos, gathered)  # [T, batch, K] in sequence order
    keep = capacity_keep(full.transpose(0, 1).reshape(batch * T, K), m.num_experts, capacity(batch * T, m))
    mine = cp_positions(T, cp, rank).to(experts.device)
    return keep.view(batch, T, K)[:, mine].reshape(-1, K)  # [N, K]


class AuxLossBackward(torch.autograd.Function):
    """Identity on the activation whose backward also starts the backward of a side loss (Megatron-LM
    `MoEAuxLossAutoScaler`, megatron/core/transformer/moe/moe_utils.py).

    A pipeline schedule backpropagates only from the last stage's loss; an earlier stage's router losses are not
    part of it. Attached to the MoE output, this gives `aux` the gradient `scale` when the backward reaches the
    MoE layer, so every stage's router losses reach the weights without going through the schedule's loss.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class TopKRouter(nn.Module):
    """Softmax over E logits, top-k, gates renormalised to sum to 1 (Mixtral, Jiang et al. 2024, §2.1).

    Runs in fp32 whatever the compute dtype (bf16 units cast up here; "selective precision", Fedus et al. 2021
    §2.4): the softmax and the top-k choice are where rounding changes which expert a token goes to.
    """

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        self.gate = nn.Linear(m.d_model, m.num_experts, bias=False)  # weight [E, D]
        self.stats_group: Any = None  # set by apply_cp: ranks holding other tokens of the same sequences
        # set by apply_ep under TP + EP: the tp ranks, each routing its own T/tp slice of the same micro-batch
        self.tp_group: Any = None
        # The white-box reference only (validation/routing.py): (x, w, logits, top_e) -> the top-k to use, the
        # parallel run's choices on tokens whose top-k it flipped by bf16 rounding. None in every training run.
        self.replay: Callable[..., torch.Tensor] | None = None
        # The white-box recorder only: Routing carries the logits while it is set. A training run leaves it off so
        # the [N, E] logits are freed when the router returns, as before (the estimator's activations).
        self.keep_logits = False

    def forward(self, x: torch.Tensor, batch: int = 1) -> Routing:  # x [N, D], N = batch * local T
        m = self.m
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32
        # Under TP + EP each tp rank routes other tokens with the same replicated weight: its gradient is summed
        # over tp (Megatron-LM marks the router weight sequence_parallel and all-reduces it over TP likewise)
        w = comms.sum_grad_over(self.gate.weight, self.tp_group)
        logits = F.linear(x.to(dtype), w.to(dtype))  # [N, E]
        probs = logits.softmax(-1)  # [N, E]
        choose = group_limited(probs, m.route_groups, m.route_top_groups) if m.route_groups > 1 else probs
        top_p, top_e = choose.topk(m.top_k, dim=-1)  # [N, K]
        if self.replay is not None:
            top_e = self.replay(x.to(dtype), w.to(dtype), logits, top_e)  # [N, K]
            top_p = choose.gather(-1, top_e)  # the same entries as topk's where top_e is unchanged
        weights = top_p / top_p.sum(-1, keepdim=True)
        if m.capacity_factor > 0 and comms.group_size(self.stats_group) > 1:  # CP: capacity per whole sequence
            keep = capacity_keep_cp(top_e, batch, m, self.stats_group)
        else:
            keep = capacity_keep(top_e, m.num_experts, capacity(x.shape[0], m))
        aux = None
        if m.aux_loss_coef > 0:
            # Switch load balance (Fedus et al. 2021, eq. 4-6, top-k form as in GShard): E * sum_e f_e * P_e,
            # f_e = share of the N*K routing slots that chose e (not differentiable), P_e = mean router prob.
            # Under CP f counts the whole sequences (summed over stats_group); the loss is then linear in the
            # local P, so the dp x cp gradient mean of the per-rank losses is the full-sequence loss's gradient.
            counts = _histogram(top_e.flatten(), m.num_experts).float()  # [E]
            comms.all_reduce_sum_(counts, self.tp_group)  # TP + EP: the micro-batch's slots, every tp rank's
            f = comms.all_reduce_sum_(counts, self.stats_group) / counts.sum()
            aux = m.aux_loss_coef * m.num_experts * (f * probs.mean(0)).sum()
        if m.z_loss_coef > 0:  # ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean logsumexp^2
            z = m.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()
            aux = z if aux is None else aux + z
        if aux is not None and self.tp_group is not None:
            # TP + EP: this rank's terms are linear in its local means (f is the micro-batch's), so the loss every
            # tp rank adds is their mean, with 1/tp of this rank's gradient (summed over tp with the weight's)
            aux = comms.group_mean_value(aux, self.tp_group)
        kept = logits if self.keep_logits else None
        return Routing(experts=top_e, weights=weights, keep=keep, aux_loss=aux, logits=kept)


def group_limited(probs: torch.Tensor, groups: int, top_groups: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3, arXiv:2412.19437 §2.1.2, "node-limited routing"; DeepSeek-V2 §2.1.3):
    the E experts form `groups` equal groups (experts [g*Eg, (g+1)*Eg)); a group's score for a token is the sum
    of its two highest probabilities (V3's rule; V2 took the maximum), and the token may only choose among the
    experts of its `top_groups` best groups. probs [N, E] -> [N, E] with the other groups' entries at -1, below
    every probability, so the top-k that follows picks inside the chosen groups and the gates keep the original
    probabilities. With groups = the EP ranks' nodes, each token's all-to-all reaches at most top_groups nodes.
    Scored on the softmax probabilities (this router's affinities), not V3's sigmoid with a balancing bias."""
    N, E = probs.shape
    Eg = E // groups
    score = probs.view(N, groups, Eg).topk(min(2, Eg), dim=-1).values.sum(-1)  # [N, G]
    best = score.topk(top_groups, dim=-1).indices  # [N, M]
    allowed = torch.zeros(N, groups, dtype=torch.bool, device=probs.device).scatter_(1, best, True)  # [N, G]
    return probs.masked_fill(~allowed.repeat_interleave(Eg, dim=1), -1.0)  # [N, E]


class MoE(nn.Module):
    """The FFN slot of a MoE block: router -> dispatch -> experts -> combine, plus the shared experts.

    Shared experts (DeepSeekMoE, Dai et al. 2024 §3.2; DeepSeek-V2/V3) see every token: n_shared_experts SwiGLUs
    of width d_ff are one SwiGLU of width Fs = config.shared_width (their concatenation, as DeepSeek's released
    code builds them), added to the routed output. Their parameters are ordinary dense ones: replicated over ep
    and averaged over dp like the router, never on the expert all-to-all; they compute while the combine
    all-to-all is in flight, forward and backward (_run_experts; docs/ARCHITECTURE.md#mixture-of-experts).

    After each forward: `aux_loss` (added by model.aux_loss), `tokens_per_expert` [E] (kept slots this rank
    routed), `dropped_slots`, and `tokens_received` [El] (rows each local expert processed: the EP load).
    """

    def __init__(self, m: ModelConfig, shared_experts: nn.Module | None = None):
        super().__init__()
        self.m = m
        self.router = TopKRouter(m)
        self.experts = Experts(m.num_experts, m.d_model, m.d_ff)
        # gpt.Block passes its SwiGLU of width config.shared_width (w1/w3 [Fs, D], w2 [D, Fs]); None = none
        self.shared_experts = shared_experts
        self.ep_group: Any = None  # set by apply_ep; None = all experts local
        # set by apply_pp: the router losses get their gradient in backward (AuxLossBackward), not via the loss
        self.aux_grad_scale: float | None = None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.tokens_received: torch.Tensor | None = None
        self.dropped_slots = 0
        self.host_syncs = 0  # device-to-host reads made by forward (tests count them: one per layer call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, D]
        B, T, D = x.shape
        K, E = self.m.top_k, self.m.num_experts
        xf = x.reshape(-1, D)  # [N, D]
        r = self.router(xf, batch=B)
        self.aux_loss = r.aux_loss

        # Dispatch order: kept slots sorted by expert id (stable, so token order within an expert), which is
        # also destination-rank order because rank j owns experts [j*El, (j+1)*El). Dropped slots sort last
        # (key E) and are cut off once the kept count is known; no nonzero() (a host sync) to find them.
        flat_e = r.experts.flatten()  # [S]
        key = torch.where(r.keep.flatten(), flat_e, E)  # [S]
        order = torch.argsort(key, stable=True)  # [S]: kept slots grouped by expert, then the dropped ones
        counts = _histogram(key, E + 1)[:E]  # [E] kept slots per expert
        # the shared experts see every token, no routing weight (on [B, T, D], the layout tensor_parallel.block_plan
        # shards it in); they run while the combine all-to-all is in flight (_run_experts)
        shared = (lambda: self.shared_experts(x).reshape(-1, D)) if self.shared_experts is not None else _nothing
        y_sent, n_kept, y_shared = self._run_experts(xf, order, counts, shared)  # [S_kept, D] rows in `order`
        order = order[:n_kept]
        self.tokens_per_expert, self.dropped_slots = counts.detach(), flat_e.numel() - n_kept

        # Combine: dropped slots contribute 0 (the residual carries the token, Fedus et al. 2021 §2.2).
        y_slots = y_sent.new_zeros(flat_e.numel(), D).index_copy(0, order, y_sent)  # [S, D]
        y = (y_slots.view(-1, K, D) * r.weights.to(y_slots.dtype).unsqueeze(-1)).sum(1)  # [N, D]
        if y_shared is not None:
            y = y + y_shared  # [N, D]
        if self.aux_grad_scale is not None and r.aux_loss is not None and torch.is_grad_enabled():
            y = AuxLossBackward.apply(y, r.aux_loss, self.aux_grad_scale)
        return y.view(B, T, D)

    def _exchange(self, counts: torch.Tensor, group: Any) -> tuple[torch.Tensor, list[int]]:
        """counts [E] -> (recv_counts [ep * El] ordered (src rank, local expert), the host list of both)."""
        recv_counts = comms.exchange_counts(counts, group)
        self.host_syncs += 1
        return recv_counts, torch.cat([counts, recv_counts]).tolist()

    def _run_experts(self, xf: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                     side: Callable[[], Any]) -> tuple[torch.Tensor, int, Any]:
        """xf [N, D] tokens, order [S] slots grouped by global expert id (kept first), counts [E] kept slots per
        expert, `side` the computation that needs no expert output (the shared experts) -> (expert outputs of the
        kept slots in `order`'s row order [S_kept, D], S_kept, side()).

        Overlapped combine: with ep > 1, `side` runs while the combine all-to-all is in flight, and its backward
        while the combine's transpose is (comms.all_to_all_overlapped; docs/ARCHITECTURE.md#mixture-of-experts).
        The combine, not the dispatch: both move S_kept x D rows, but `side` after the experts keeps the block's
        matmul order (the selective policy's saved set, curry_train/sac_rule.py) and its backward before theirs.
        With ep = 1 `side` runs at the same point, so every layout records the same graph.

        The one host read of the layer: the all-to-all needs its split sizes as Python ints, so the send and
        receive counts come back together in a single `.tolist()` (`host_syncs` counts it; the kernels take the
        group sizes on the device). Selective or full recompute does not replay it, nor the count exchange: the
        recomputation gets the forward's values (parallel/recompute.host_once)."""
        group, K = self.ep_group, self.m.top_k
        ep = comms.group_size(group)
        El = self.m.num_experts // ep
        recv_counts, host = host_once(lambda: self._exchange(counts, group))  # once per forward, not replayed
        sent, recv = host[: ep * El], host[ep * El:]
        n_kept = sum(sent)
        x = xf[order[:n_kept] // K]  # [S_kept, D]
        in_splits = [sum(sent[j * El:(j + 1) * El]) for j in range(ep)]  # rows to each destination rank
        out_splits = [sum(recv[j * El:(j + 1) * El]) for j in range(ep)]  # rows from each source rank
        per_expert = [sum(recv[j * El + e] for j in range(ep)) for e in range(El)]
        per_expert_t = recv_counts.view(ep, El).sum(0)  # [El] on the device
        self.tokens_received = per_expert_t.detach()
        recv_x = comms.all_to_all(x, out_splits, in_splits, group)  # [R, D] ordered (src, local expert)
        if ep == 1:
            return self.experts(recv_x, per_expert, per_expert_t), n_kept, side()
        # (src, expert) -> (expert, src) so each expert's rows are contiguous, run, then restore (src, expert).
        R = sum(out_splits)
        local_e = torch.arange(El, device=x.device).repeat(ep).repeat_interleave(recv_counts, output_size=R)
        perm = torch.argsort(local_e, stable=True)  # [R]
        y = self.experts(recv_x[perm], per_expert, per_expert_t)
        y = torch.zeros_like(y).index_copy(0, perm, y)  # [R, D] back in (src, expert) order
        y_sent, done = comms.all_to_all_overlapped(y, in_splits, out_splits, group, side)  # [S_kept, D]
        return y_sent, n_kept, done


def _nothing() -> None:
    return None


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def expert_load(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per-rank diagnostics of the last forward, per MoE layer: slots routed to each expert (all E, from this
    rank's tokens), slots dropped by capacity, and rows each *local* expert processed (the EP compute load)."""
    out = {}
    for name, m in moe_layers(model):
        if m.tokens_per_expert is None:
            continue
        out[name] = {
            "routed": m.tokens_per_expert.tolist(),
            "dropped": m.dropped_slots,
            "received": m.tokens_received.tolist(),
        }
    return out
