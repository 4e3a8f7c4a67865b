"""Context parallel: every rank holds T/cp tokens of each sequence; attention runs as ring attention over
mesh["cp"] with online-softmax (log-sum-exp) merging. Causal, load-balanced, GQA, exact backward.

    curry-train whitebox --config configs/tiny.yaml --set parallel.cp=2 --json

Shape legend: B micro-batch, H query heads, G kv heads (rep = H/G; local counts under TP), Tl = T/cp local
tokens, Tq/Tk rows of one block, Dh head dim, cp ring size, r this rank's ring index.

Ring attention (Liu et al. 2023, arXiv:2310.01889, §3): K/V travel around the ring; at step s rank r holds the
K/V of rank (r - s) mod cp and merges that block's softmax into its running output by log-sum-exp
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"). The backward is the flash-attention
backward per block (Dao et al. 2022, arXiv:2205.14135, Alg. 4) with the *final* LSE, while dK/dV ride the ring
with K/V and arrive home after cp shifts. Only q, k, v, out and LSE are saved: O(Tl) activations per rank.

Causality by global positions: a block (query run, key run) is skipped when every key is in the future, runs
unmasked when every key is in the past, and is masked by `q_pos >= k_pos` otherwise. With data.cp_positions'
head-tail layout (rank r holds chunks r and 2cp-1-r of 2cp) every rank computes the same number of block pairs
(Brandon et al. 2023 "Striped Attention"; Megatron-LM CP); `attention_work` reports it per rank. RoPE already
uses the global positions (model.forward(tokens, positions)).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.model.data import cp_positions
from curry_train.model.gpt import Attention
from curry_train.model.moe import TopKRouter
from curry_train.parallel.comms import RingExchange


def _runs(pos: torch.Tensor, chunk: int) -> list[tuple[int, int]]:
    """Runs of consecutive positions, cut into pieces of at most `chunk`, as (start, end) local indices."""
    cuts = [0, *((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist(), len(pos)]
    return [(a, min(a + chunk, b)) for lo, b in itertools.pairwise(cuts) for a in range(lo, b, chunk)]


def plan_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int) -> list[tuple[slice, slice, Any]]:
    """The (query rows, key rows, mask or None) blocks that causal attention of q_pos over k_pos needs.
    Blocks are at most chunk x chunk, so a diagonal block wastes at most half of chunk^2 pairs."""
    blocks = []
    for qa, qb in _runs(q_pos, chunk):
        for ka, kb in _runs(k_pos, chunk):
            qp, kp = q_pos[qa:qb], k_pos[ka:kb]
            if kp[0] > qp[-1]:
                continue  # all keys in the future
            mask = None if kp[-1] <= qp[0] else qp[:, None] >= kp[None, :]  # [Tq, Tk]
            blocks.append((slice(qa, qb), slice(ka, kb), mask))
    return blocks


def attention_work(seq_len: int, cp: int, positions: Callable[[int, int, int], torch.Tensor] = cp_positions):
    """Per ring rank: (computed, causal) query-key pairs of one head over the whole ring, at the block size
    T/(2cp) that RingCoreAttention uses. `computed` is what the blocks multiply (forward FLOPs = 4 * Dh * pairs
    per head and sequence); `causal` counts only the unmasked pairs."""
    pos = [positions(seq_len, cp, j) for j in range(cp)]
    out = []
    for r in range(cp):
        computed = causal = 0
        for src in range(cp):
            for qs, ks, mask in plan_blocks(pos[r], pos[src], max(1, seq_len // (2 * cp))):
                n = (qs.stop - qs.start) * (ks.stop - ks.start)
                computed += n
                causal += n if mask is None else int(mask.sum())
        out.append({"computed_pairs": computed, "causal_pairs": causal})
    return out


def _block_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = q @ k.unsqueeze(2).transpose(-1, -2) * scale  # [B, G, rep, Tq, Dh] x [B, G, 1, Dh, Tk] -> [.., Tq, Tk]
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


class RingAttention(torch.autograd.Function):
    """Forward: out [B, H, Tl, Dh] of causal attention of local queries over all ranks' keys.
    Backward: dq locally; dk/dv accumulated by each rank they visit and returned to their owner.
    Every rank runs cp-1 K/V shifts forward and cp-1 K/V + cp dK/dV shifts backward (no skipped pairs)."""

    @staticmethod
    def forward(ctx, q, k, v, group, plans: list[list], rank: int):
        """plans[src] = plan_blocks(my positions, rank src's positions)."""
        cp, dtype = len(plans), q.dtype
        H, Dh, G = q.shape[1], q.shape[3], k.shape[1]
        scale = 1.0 / math.sqrt(Dh)
        ring = RingExchange(group)
        q5 = q.float().unflatten(1, (G, H // G))  # [B, G, rep, Tl, Dh]; query head h uses kv head h // rep
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # [B, G, rep, Tl]
        kv = torch.stack([k, v])  # [2, B, G, Tl, Dh], travels in the input dtype
        with torch.autocast(q.device.type, enabled=False):
            for step in range(cp):
                if step < cp - 1:
                    ring.start(kv)  # next block's transfer overlaps this block's compute
                src = (rank - step) % cp
                kf, vf = kv[0].float(), kv[1].float()
                for qs, ks, mask in plans[src]:
                    s = _block_scores(q5[..., qs, :], kf[..., ks, :], mask, scale)  # [B, G, rep, Tq, Tk]
                    # a row whose keys are all masked gets a finite -1e30 LSE and contributes exactly 0
                    lse_b = torch.logsumexp(s, -1).clamp_min(-1e30)  # [B, G, rep, Tq]
                    o_b = torch.exp(s - lse_b.unsqueeze(-1)) @ vf[..., ks, :].unsqueeze(2)  # [B, G, rep, Tq, Dh]
                    new = torch.logaddexp(lse[..., qs], lse_b)
                    keep_old, take_new = torch.exp(lse[..., qs] - new), torch.exp(lse_b - new)  # [B, G, rep, Tq]
                    out[..., qs, :] = out[..., qs, :] * keep_old.unsqueeze(-1) + o_b * take_new.unsqueeze(-1)
                    lse[..., qs] = new
                if step < cp - 1:
                    kv = ring.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.rank = group, plans, rank
        return out.flatten(1, 2).to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plans, rank = ctx.plans, ctx.rank
        cp, G = len(plans), k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        ring = RingExchange(ctx.group)
        q5 = q.float().unflatten(1, (G, q.shape[1] // G))
        do5 = dout.float().unflatten(1, (G, q.shape[1] // G))  # [B, G, rep, Tl, Dh]
        delta = (do5 * out).sum(-1)  # [B, G, rep, Tl] = rowsum(dO * O)
        dq = torch.zeros_like(q5)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)  # grads of the K/V block held now
        with torch.autocast(q.device.type, enabled=False):
            for step in range(cp):
                if step < cp - 1:
                    ring.start(kv)
                src = (rank - step) % cp
                kf, vf = kv[0].float(), kv[1].float()
                for qs, ks, mask in plans[src]:
                    s = _block_scores(q5[..., qs, :], kf[..., ks, :], mask, scale)
                    p = torch.exp(s - lse[..., qs].unsqueeze(-1))  # [B, G, rep, Tq, Tk] final probabilities
                    do_b = do5[..., qs, :]
                    dkv[1, ..., ks, :] += (p.transpose(-1, -2) @ do_b).sum(2)  # dV
                    dp = do_b @ vf[..., ks, :].unsqueeze(2).transpose(-1, -2)  # [B, G, rep, Tq, Tk]
                    ds = p * (dp - delta[..., qs].unsqueeze(-1)) * scale
                    dq[..., qs, :] += ds @ kf[..., ks, :].unsqueeze(2)
                    dkv[0, ..., ks, :] += (ds.transpose(-1, -2) @ q5[..., qs, :]).sum(2)  # dK
                if step < cp - 1:
                    kv = ring.wait()
                dkv = ring.shift(dkv)  # to the next holder of this block; the cp-th shift brings ours home
        return dq.flatten(1, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class RingCoreAttention(nn.Module):
    """Drop-in for Attention.core_attention(q, k, v) on one cp rank; counts the FLOPs it runs (diagnostics)."""

    def __init__(self, group: Any, cp: int, rank: int, positions: Callable[[int, int, int], torch.Tensor]):
        super().__init__()
        self.group, self.cp, self.rank, self.positions = group, cp, rank, positions
        self.flops = 0  # forward attention FLOPs (QK^T and PV) this rank ran since the last reset (+ recompute)
        self._plans: dict[tuple[int, str], tuple[list[list], int]] = {}  # (T, device) -> (plans, pairs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, Tl, Dh = q.shape
        key = (Tl * self.cp, str(q.device))
        if key not in self._plans:
            pos = [self.positions(key[0], self.cp, j).to(q.device) for j in range(self.cp)]
            chunk = max(1, key[0] // (2 * self.cp))  # the head-tail chunk: its diagonal block is half masked
            plans = [plan_blocks(pos[self.rank], pos[src], chunk) for src in range(self.cp)]
            pairs = sum((qs.stop - qs.start) * (ks.stop - ks.start) for p in plans for qs, ks, _ in p)
            self._plans[key] = (plans, pairs)
        plans, pairs = self._plans[key]
        self.flops += 4 * B * H * Dh * pairs
        return RingAttention.apply(q, k, v, self.group, plans, self.rank)


def apply_cp(model: nn.Module, mesh: Any, cfg: Config) -> None:
    """Swap every Attention.core_attention for ring attention over mesh["cp"], in place.

    The data side is already sharded by data.micro_batches (each cp rank gets its cp_positions of every
    sequence, and the model gets those global positions for RoPE); the loss is a mean over local tokens and
    dp_cp averaging makes it the global mean, since every rank holds the same number of tokens.
    MoE: the routers' load-balance counts are summed over the cp group, and capacity (capacity_factor > 0) is
    decided over the whole sequences (moe.capacity_keep_cp gathers the cp ranks' expert ids), as the
    full-sequence reference decides it.
    """
    cp_mesh = mesh["cp"]
    group, cp, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    for m in model.modules():
        if isinstance(m, Attention):
            m.core_attention = RingCoreAttention(group, cp, rank, cp_positions)
        if isinstance(m, TopKRouter):  # MoE load-balance statistics over whole sequences (moe.TopKRouter)
            m.stats_group = group


def cp_flops(model: nn.Module, reset: bool = True) -> int:
    """Forward attention FLOPs this rank ran (summed over layers) since the last reset."""
    total = 0
    for m in model.modules():
        if isinstance(m, RingCoreAttention):
            total += m.flops
            if reset:
                m.flops = 0
    return total
