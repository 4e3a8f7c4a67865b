"""Activation bytes of one micro-batch on one rank, by what holds them: what autograd saves per op, under each
dtype path (fp32, or bf16 under FSDP2's policy), recompute mode, TP/SP, CP ring attention and MoE (part of
curry_train.estimator; measured on torch 2.13 CPU with saved-tensor hooks, see estimate.py's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from curry_train.config import loss_chunk_count
from curry_train.estimator.layout import LAYOUT_CACHE, Layout, block_matmuls
from curry_train.estimator.mla import mla_core_out_width, mla_matmuls, mla_saved
from curry_train.sac_rule import saved_matmuls


@dataclass
class _Acts:
    """Bytes of one micro-batch on this rank (n = b * T / cp tokens), by what holds them."""

    layer_saved: int  # per layer, kept from forward to backward (after recompute's dropping)
    layer_full: int  # per layer without recompute (what a recomputed block materialises in backward)
    ffn_saved: int  # the FFN's share of layer_full (its input copies and SwiGLU / expert intermediates)
    prod: int  # the SwiGLU product w2 saves (freed by the first op of a block's backward)
    ffn_bwd: int  # the FFN backward's working set: dprod + dsilu + dup (three [n, F] gradients)
    norm_bwd: int  # lean.py RMSNorm backward's working set: fp32 normalised input, its gradient, one product
    embed: int  # token ids (+ TP's masked ids and mask)
    head: int  # final norm's saved tensors and the head's input
    lsm: int  # fp32 log_softmax output saved by the loss (of one chunk when the loss is chunked)
    targets: int  # target ids the loss keeps
    logits: int  # [tokens, V/tp] in the compute dtype, alive until the micro-batch's backward ends (one chunk's)
    grad_logits: int  # the logits' gradient (compute dtype; one chunk's)
    dy_head: int  # gradient of the head's input [n, D]
    grad_logits_all: int  # every chunk's logits gradient (zero bubble keeps them for the weight pass)
    chunks: int  # token chunks of the head + loss (config.loss_chunk_count); 1 = the full logits at once
    chunk_targets: int  # target ids of one chunk (the loss_parallel masks are per chunk)
    rope: int  # cos/sin rows indexed per forward call, shared by a chunk's layers
    stream: int  # one hidden state [n_local, D] in the residual dtype
    d_stream: int  # its gradient
    lin_out_grads: int  # gradients of one layer's linear outputs (zero bubble keeps them for the W pass)
    ring_bwd: int  # context_parallel.RingAttention.backward's working set
    post_attn: int  # wo's input and the FFN norm's saved tensors (freed before the attention core's backward)
    shared_prod: int = 0  # MoE: the shared expert's SwiGLU product (its backward runs before the experts')
    # MoE, at the shared expert's backward (it runs inside the combine, model/moe.py): the combine's rows [S, D]
    # are freed, the experts' output gradient [S_kept, D] waits (with ep > 1 as the send buffer of the combine's
    # transpose, whose [R, D] receive buffer is in flight too)
    combine_rows: int = 0
    combine_grad: int = 0


@lru_cache(maxsize=LAYOUT_CACHE)
def _acts(layout: Layout) -> _Acts:
    t, sp = layout.tp, layout.sp
    T = layout.seq_len // layout.cp
    n = layout.micro_batch * T  # tokens per micro-batch on this rank
    nn_ = n // t if sp else n  # tokens in the norm/residual region (SP shards the sequence)
    D, Dh = layout.d_model, layout.head_dim
    Hl, Gl = layout.n_heads // t, layout.n_kv_heads // t
    Dq, Dkv = Hl * Dh, Gl * Dh
    Fl = layout.d_ff // t
    Vl = layout.vocab_size // t
    path = layout.precision  # fp32 | mp (wrapping.precision_path: bf16 is FSDP2's policy, the stream bf16 too)
    c = r = 4 if path == "fp32" else 2  # compute and residual-stream bytes
    cp_ring = layout.cp > 1
    # attention core: SDPA (GQA inside the kernel, enable_gqa) and ring attention (CP, fused kernels with their
    # LSE: flash on CPU, memory-efficient elsewhere) both save q, the un-repeated k, v, out and the fp32 lse.
    attn = n * (Dq * c + 2 * Dkv * c + Dq * c + Hl * 4)
    wo_in = n * Dq * c
    if layout.mla:  # estimator/mla.py: latents, up-projections and the core; wo's input [n, Hl Dv]
        wo_in = n * Hl * layout.v_head_dim * c
        attn = mla_saved(layout, n, c) - wo_in
    # model/lean.py RMSNorm saves its input (residual dtype) and the fp32 rstd [n, 1], for each of the 2 norms
    norms = 2 * nn_ * (r * D + 4)
    y1 = y2 = c * n * D  # the norm's output, shared by wq, wk, wv (w1, w3)
    if layout.num_experts:
        # TP + EP (layout.ep_over_tp): the MoE routes this rank's nn_ = n/t tokens, the norm's local output; the
        # shared expert all-gathers it to n rows (kept for its w1 / w3 backward, as a dense FFN's)
        nm = layout.moe_tokens
        gathered = c * n * D if layout.ep_over_tp and layout.shared_d_ff else 0
        ffn = _moe_saved(layout, nm, path, n) + c * nm * D + gathered
        _, Sk = _moe_slots(layout, nm)
        # what is freed by the time the experts' SwiGLU backward runs: their product, and the shared expert's
        # saved tensors (its branch is recorded after the routed one, so autograd runs its backward first)
        prod = Sk * layout.d_ff * c + _shared_saved(layout, n, path) + gathered
        # Experts.forward (CPU loop) takes unbind views of the stacked weights: the El [D, F] slice gradients
        # live until UnbindBackward stacks them into one [El, D, F] tensor (both at once: 2 per weight)
        El = layout.num_experts // layout.ep
        ffn_bwd = 2 * El * D * layout.d_ff * (2 if path == "mp" else 4) + 3 * (Sk // El) * layout.d_ff * c
        combine = (_moe_slots(layout, nm)[0] * D * c, Sk * D * c * (2 if layout.ep > 1 else 1))
    else:
        ffn = y2 + n * 3 * Fl * c  # lean.py SwiGLU keeps w1 x and w3 x; w2 keeps the product
        prod = n * Fl * c
        ffn_bwd = 3 * prod
        combine = (0, 0)
    full = norms + y1 + attn + wo_in + ffn
    stream = nn_ * D * r
    if layout.recompute == "full":
        saved = stream
    elif layout.recompute == "selective":
        saved = stream + _selective_saved(layout, n, nn_, c, path)
    else:
        saved = full
    embed = n * 8 + (n * 9 if t > 1 else 0)  # ids; TP's vocab-parallel lookup keeps masked ids and a mask
    head = nn_ * (r * D + 4) + c * n * D  # the final norm's input and rstd, the head's (compute dtype) input
    # model/gpt.py chunked_lm_loss: k checkpointed chunks of at most nc tokens; only one chunk's logits,
    # log-softmax and their gradients exist at a time (forward keeps a scalar per chunk)
    k = loss_chunk_count(layout.loss_chunks, n, layout.vocab_size, layout.d_model)
    nc = -(-n // k)
    return _Acts(layer_saved=saved, layer_full=full, ffn_saved=ffn, prod=prod, ffn_bwd=ffn_bwd,
                 norm_bwd=12 * nn_ * D + 4 * nn_, embed=embed, head=head, lsm=4 * nc * Vl,
                 targets=n * 8, logits=c * nc * Vl, grad_logits=c * nc * Vl, dy_head=c * n * D,
                 grad_logits_all=c * n * Vl, chunks=k, chunk_targets=nc * 8,
                 rope=2 * T * (layout.rope_dim // 2) * 4, stream=stream, d_stream=stream,
                 lin_out_grads=n * ((sum(w for _, w, _, _ in mla_matmuls(layout, n)) - D if layout.mla else
                                     Dq + 2 * Dkv) + 2 * D + (2 * Fl if not layout.num_experts else 0)) * c,
                 ring_bwd=_ring_backward(layout, n, Dq, Dkv, Hl, c) if cp_ring else 0, post_attn=wo_in + norms // 2,
                 shared_prod=n * (layout.shared_d_ff // t) * c if layout.num_experts else 0,
                 combine_rows=combine[0], combine_grad=combine[1])


def _ring_backward(layout: Layout, n: int, Dq: int, Dkv: int, Hl: int, c: int) -> int:
    """RingAttention.backward (context_parallel.py, fused kernels) on one rank: the incoming gradient made
    contiguous and the fp32 dq [n, Dq]; the K/V stack and the ring's receive buffer [2, n, Dkv] in the compute
    dtype; fp32 dK/dV and its shift buffer; the GQA-repeated K and V [n, Dq] (compute dtype); one block's
    kernel outputs dq, dk, dv (T/(2 cp) rows, compute dtype) and their fp32 head-summed copies. No score tile:
    the fused kernels work in on-chip tiles (O(T), not O(T^2))."""
    rep = Dq // max(Dkv, 1)
    nb = n // 2  # one block: half of this rank's tokens (head-tail layout, T/(2 cp) rows per sequence)
    return (n * Dq * (c + 4) + 2 * (2 * n * Dkv * c) + 2 * (2 * n * Dkv * 4)
            + (2 * n * Dq * c if rep > 1 else 0) + 3 * nb * Dq * c + 2 * nb * Dkv * 4)


def _moe_slots(layout: Layout, n: int) -> tuple[int, int]:
    """(routing slots S = n*K, kept slots) of one micro-batch on this rank (uniform routing)."""
    S = n * layout.top_k
    if layout.capacity_factor > 0:
        cap = math.ceil(layout.capacity_factor * n * layout.top_k / layout.num_experts)
        return S, min(S, cap * layout.num_experts)
    return S, S


def _moe_saved(layout: Layout, n: int, path: str, n_shared: int | None = None) -> int:
    """moe.MoE's saved tensors per micro-batch (measured on torch 2.13 CPU): router probs, top-k ids and
    gates, the dispatched rows [S_kept, D] (and a second [S_kept, D] the combine keeps), every expert's SwiGLU
    intermediates (4 F per kept slot), the combine's rows [S, D] and weights. EP trades rows, it does not
    remove them (uniform routing assumed: each rank receives as many rows as it sends). The router runs in
    fp32 whatever the compute dtype: in bf16 it keeps fp32 upcasts of its input and weight."""
    S, Sk = _moe_slots(layout, n)
    D, F, E, K = layout.d_model, layout.d_ff, layout.num_experts, layout.top_k
    router = n * E * 4 + n * K * (8 + 4 + 4) + n * 4 + (n * E * 4 if layout.has_z_loss else 0)
    if layout.route_groups > 1:  # moe.group_limited: masked_fill keeps its [n, E] bool mask
        router += n * E
    idx = 2 * Sk * 8
    c = 4 if path == "fp32" else 2
    rows = 2 * Sk * D * c + Sk * 4 * F * c + S * D * c
    if layout.ep > 1:  # received rows are permuted into expert order and back: index_copy keeps one more [R, D]
        rows += Sk * D * c
    if path == "mp":
        rows += n * D * 4 + E * D * 4 + n * K * c  # the router's fp32 upcasts of its input and weight
    return router + idx + rows + _shared_saved(layout, n if n_shared is None else n_shared, path)


def _shared_saved(layout: Layout, n: int, path: str) -> int:
    """The shared expert (a SwiGLU of width Fs over all n tokens, moe.MoE.shared_experts, gpt.FeedForward): w1 and
    w3 outputs and the product, as a dense FFN's (model/lean.py's SwiGLU rebuilds silu in backward); its input is
    the router's (already counted)."""
    Fs = layout.shared_d_ff // layout.tp  # TP-split like a dense SwiGLU
    if not Fs:
        return 0
    c = 4 if path == "fp32" else 2
    return n * 3 * Fs * c


def _selective_saved(layout: Layout, n: int, nn_: int, c: int, path: str) -> int:
    """What parallel/recompute.py's selective policy keeps per block besides its input: every other matmul output
    (curry_train/sac_rule.py, in layout.block_matmuls' order; the fp32 router's in fp32), the fused attention's out
    [n, Dq] and fp32 logsumexp [n, Hl], SP's two reduce-scatter outputs [n/t, D]; MoE: the router's top-k values
    (fp32) and ids (int64) [n, K] and, with ep > 1, the dispatch and combine all-to-all outputs [S_kept, D] (the
    dispatched rows and the combined rows in the compute dtype)."""
    Hl, D = layout.n_heads // layout.tp, layout.d_model
    El = layout.num_experts // layout.ep if layout.num_experts else 1
    nm = layout.moe_tokens if layout.num_experts else n  # TP + EP: this rank's T/tp shard
    _, Sk = _moe_slots(layout, nm) if layout.num_experts else (0, 0)
    mms = block_matmuls(layout, n, Sk // El)
    kept = sum(rows * w_out * (4 if fp32 else c)
               for (rows, w_out, _, fp32), keep in zip(mms, saved_matmuls(len(mms))) if keep)
    core = n * ((mla_core_out_width(layout) if layout.mla else Hl * layout.head_dim) * c + Hl * 4)
    rs = 2 * nn_ * D * c if layout.sp else 0
    moe = 0
    if layout.num_experts:
        moe = nm * layout.top_k * (4 + 8)
        if layout.ep > 1:
            moe += Sk * D * 2 * c
    return int(kept) + core + rs + moe
