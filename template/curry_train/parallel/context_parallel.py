"""Context parallel: every rank holds T/cp tokens of each sequence; attention runs as ring attention over
mesh["cp"] with online-softmax (log-sum-exp) merging. Causal, load-balanced, GQA, exact backward.

    curry-train whitebox --config configs/tiny.yaml --set parallel.cp=2 --json

Shape legend: B micro-batch, H query heads, G kv heads (rep = H/G; local counts under TP), Tl = T/cp local
tokens, Tq/Tk rows of one block, Dh head dim, cp ring size, r this rank's ring index.

Ring attention (Liu et al. 2023, arXiv:2310.01889, §3): K/V travel around the ring; at step s rank r holds the
K/V of rank (r - s) mod cp and merges that block's softmax into its running output by log-sum-exp
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"). Every block runs torch's fused
attention kernel that returns its LSE (`block_kernel`: flash on CPU; on CUDA flash in fp16/bf16, else the
memory-efficient kernel, whose LSE padding to 32 rows is undone and redone explicitly), so no [Tq, Tk] score
tile is ever stored. The backward is the fused flash-attention backward per block (Dao et al. 2022,
arXiv:2205.14135, Alg. 4) with the *final* out and LSE, while dK/dV ride the ring with K/V and arrive home after
cp shifts, each shift posted asynchronously behind the next block's kernels. Only q, k, v, out and LSE are
saved: O(Tl) activations per rank.

Causality by global positions: a block (query run, key run) is skipped when every key is in the future, runs
unmasked when every key is in the past, and is masked by `q_pos >= k_pos` otherwise. With data.cp_positions'
head-tail layout (rank r holds chunks r and 2cp-1-r of 2cp) every rank computes the same number of block pairs
(Brandon et al. 2023 "Striped Attention"; Megatron-LM CP); `attention_work` reports it per rank. RoPE already
uses the global positions (model.forward(tokens, positions)).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.model.data import cp_positions
from curry_train.model.gpt import Attention
from curry_train.model.moe import TopKRouter
from curry_train.parallel.comms import RingExchange

# What the ring's blocks run on, as facts the step-time model prices (estimator/comm.py quotes them as
# CP_RING_KERNEL / CP_RING_KERNEL_DTYPE; tests/test_cost_terms.py fails when the two disagree, and checks that the
# blocks really call a fused SDPA op in this dtype):
RING_KERNEL = "fused_sdpa"  # torch's fused attention with its LSE per block (_attn_fwd / _attn_bwd), no score tile
RING_KERNEL_DTYPE = "compute"  # the blocks take q, k, v in the compute dtype: "compute" | "float32"


def kernel_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the ring's blocks run in (RING_KERNEL_DTYPE): q's own, the compute dtype, or fp32."""
    return q.dtype if RING_KERNEL_DTYPE == "compute" else torch.float32


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


EFFICIENT_LSE_ALIGN = 32  # CUDA's memory-efficient kernel pads its LSE rows to a multiple of 32 (kAlignLSE)


def block_kernel(q: torch.Tensor) -> str:
    """Which fused kernel a block runs: "cpu_flash" on CPU; on CUDA "flash" (FlashAttention-2, Dao 2023: fp16 /
    bf16, head dim a multiple of 8 up to 256, sm80+) and otherwise "efficient" (fp32, older GPUs). Each returns
    the fp32 LSE the merge needs and stores no Tq x Tk tile."""
    if q.device.type == "cpu":
        return "cpu_flash"
    dh = q.shape[-1]
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and dh % 8 == 0 and dh <= 256
            and torch.cuda.get_device_capability(q.device)[0] >= 8):
        return "flash"
    return "efficient"


def lse_rows(tq: int) -> int:
    """Rows of the memory-efficient kernel's LSE for Tq queries: padded to EFFICIENT_LSE_ALIGN on CUDA (its
    backward reads the padded layout), exact on ROCm (torch/_meta_registrations.py, the efficient forward)."""
    return tq if torch.version.hip else -(-tq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN


def _attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, ...]:
    """One block through torch's fused attention that also returns the log-sum-exp: (out [B, H, Tq, Dh] in the
    input dtype, lse [B, H, Tq] fp32, aux). CPU: the flash kernel (torch-cpu-distributed notes, item 14); CUDA:
    the flash kernel, whose `aux` (cum_seq_q, cum_seq_k, rng state) its backward takes back, or the
    memory-efficient one, whose LSE is cut to the Tq real rows here and padded again for its backward."""
    kind = block_kernel(q)
    if kind == "cpu_flash":
        return (*torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal), None)
    if kind == "flash":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False)
        return out, lse, (cum_q, cum_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., : q.shape[2]], None  # [B, H, lse_rows(Tq)] -> the Tq rows the merge uses


def _attn_bwd(dout, q, k, v, out, lse, causal: bool, aux=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's (dq, dk, dv) given the *merged* output and LSE of the whole ring (so P = exp(S - lse_final)
    and rowsum(dO * O) are those of the full softmax: the block's exact share of the gradient). `aux`: a flash
    forward's (cum_seq_q, cum_seq_k, rng state), reused by every block (no dropout: the state is never read)."""
    kind = block_kernel(q)
    if kind == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                                   causal)
    if kind == "flash":
        cum_q, cum_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset)
    tq = q.shape[2]
    lse = torch.nn.functional.pad(lse, (0, lse_rows(tq) - tq))  # [B, H, lse_rows(Tq)]: the padding never read
    zero = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: no dropout
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), zero, zero, 0.0, [True, True, True, False], causal)[:3]


def _rep(t: torch.Tensor, rep: int) -> torch.Tensor:
    """GQA: kv head g serves query heads g*rep .. g*rep+rep-1 (the fused CPU kernel takes equal head counts)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _unrep(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Sum a [B, H, T, Dh] kv-gradient over the query heads that shared each kv head -> [B, G, T, Dh]."""
    return t if rep == 1 else t.unflatten(1, (-1, rep)).sum(2)


class RingAttention(torch.autograd.Function):
    """Forward: out [B, H, Tl, Dh] of causal attention of local queries over all ranks' keys.
    Backward: dq locally; dk/dv accumulated by each rank they visit and returned to their owner.
    Every rank runs cp-1 K/V shifts forward and cp-1 K/V + cp dK/dV shifts backward (no skipped pairs).

    Each block runs torch's fused attention with its LSE (_attn_fwd); blocks merge exactly by log-sum-exp
    (Milakov & Gimelshein 2018): out = sum_b exp(lse_b - lse) * out_b, lse = logsumexp_b lse_b. The backward
    reruns each block's fused backward with the merged out and lse (Dao 2023, FlashAttention-2 §3.1.2; the same
    decomposition as zhuzilin/ring-flash-attention). Saved per layer: q, k, v, out and the fp32 lse only."""

    @staticmethod
    def forward(ctx, q, k, v, group, plans: list[list], rank: int):
        """plans[src] = [(query rows, key rows, causal)] for my positions against rank src's."""
        cp, rep = len(plans), q.shape[1] // k.shape[1]
        ring = RingExchange(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [B, H, Tl, Dh] running merge
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # [B, H, Tl]
        kd = kernel_dtype(q)
        qk = q.to(kd)
        kv = torch.stack([k, v]).to(kd)  # [2, B, G, Tl, Dh], travels in the kernel's dtype
        aux = None  # the flash kernel's (cum_seq_q, cum_seq_k, rng state), for its backward
        for step in range(cp):
            if step < cp - 1:
                ring.start(kv)  # next block's transfer overlaps this block's compute
            kr, vr = _rep(kv[0], rep), _rep(kv[1], rep)  # [B, H, Tl, Dh]
            for qs, ks, causal in plans[(rank - step) % cp]:
                o_b, lse_b, aux_b = _attn_fwd(qk[:, :, qs], kr[:, :, ks], vr[:, :, ks], causal)
                aux = aux if aux is not None else aux_b
                new = torch.logaddexp(lse[..., qs], lse_b)  # [B, H, Tq]
                out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[..., qs] - new).unsqueeze(-1)
                                 + o_b.float() * torch.exp(lse_b - new).unsqueeze(-1))
                lse[..., qs] = new
            if step < cp - 1:
                kv = ring.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.rank, ctx.aux = group, plans, rank, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        """dK/dV ride the ring behind K/V: the exchange of step s's partial sums is posted asynchronously and
        overlaps step s+1's block kernels, whose head-summed dk/dv wait in `parts` until the partial sums they
        belong to arrive; they are then added in the same order as a blocking shift would (same values)."""
        q, k, v, out, lse = ctx.saved_tensors
        plans, rank = ctx.plans, ctx.rank
        cp, rep = len(plans), q.shape[1] // k.shape[1]
        ring, grads = RingExchange(ctx.group), RingExchange(ctx.group, tag=1)
        kd = kernel_dtype(q)
        dout, qk, ok = dout.to(kd).contiguous(), q.to(kd), out.to(kd)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).to(kd)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)  # grads of the K/V block held now
        for step in range(cp):
            if step < cp - 1:
                ring.start(kv)
            kr, vr = _rep(kv[0], rep), _rep(kv[1], rep)
            parts = []  # (key rows, dk [B, G, Tk, Dh] fp32, dv) of this step's blocks
            for qs, ks, causal in plans[(rank - step) % cp]:
                dq_b, dk_b, dv_b = _attn_bwd(dout[:, :, qs], qk[:, :, qs], kr[:, :, ks], vr[:, :, ks],
                                             ok[:, :, qs], lse[..., qs], causal, ctx.aux)
                dq[:, :, qs] += dq_b
                parts.append((ks, _unrep(dk_b.float(), rep), _unrep(dv_b.float(), rep)))
            if step > 0:
                dkv = grads.wait()  # the partial sums of the block held now, from its previous holder
            for ks, dk_b, dv_b in parts:
                dkv[0, :, :, ks] += dk_b
                dkv[1, :, :, ks] += dv_b
            del parts
            if step < cp - 1:
                kv = ring.wait()
            if cp > 1:
                grads.start(dkv)  # to the next holder of this block; the cp-th shift brings ours home
        if cp > 1:
            dkv = grads.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _fused_plan(plan: list[tuple[slice, slice, Any]]) -> list[tuple[slice, slice, bool]]:
    """plan_blocks' masks as the fused kernels' is_causal flag: with chunk-aligned blocks a masked block is a
    square diagonal block (same positions on both sides), which is exactly top-left causal."""
    out = []
    for qs, ks, mask in plan:
        if mask is not None and not (mask.shape[0] == mask.shape[1] and torch.equal(mask, mask.new_ones(
                mask.shape).tril())):
            raise ValueError("ring attention needs chunk-aligned blocks: seq_len must split into 2*cp chunks")
        out.append((qs, ks, mask is not None))
    return out


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
            plans = [_fused_plan(plan_blocks(pos[self.rank], pos[src], chunk)) for src in range(self.cp)]
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
