"""MLA's terms for the estimator (model/mla.py; DeepSeek-V2 arXiv:2405.04434 §2.1): its parameter tensors, its
matmuls in the forward order the selective policy counts, and what its autograd saves (part of
curry_train.estimator; pure arithmetic, no torch).

Shape legend: n tokens on this rank, D d_model, Hl = n_heads / tp, Rq q_lora_rank, Rkv kv_lora_rank, Dn / Dr / Dv
the nope / rope / value head dims, qk = Dn + Dr. TP splits the up-projections by heads and wo by its input;
the down-projections (wq_a, wkv_a) and their norms are replicated (parallel/tensor_parallel.py mla_plan).
"""

from __future__ import annotations

from typing import Any


def mla_tensors(x: Any) -> list[tuple[int, int, int, str]]:
    """The attention's parameters between the block's two norms, in model/mla.py's order, TP-local
    (dim0, rest, global numel, "dense")."""
    D, t, H = x.d_model, x.tp, x.n_heads
    qk, Rq, Rkv = x.qk_nope_head_dim + x.qk_rope_head_dim, x.q_lora_rank, x.kv_lora_rank
    out = []
    if Rq:
        out += [(Rq, D, Rq * D, "dense"), (Rq, 1, Rq, "dense"), (H * qk // t, Rq, H * qk * Rq, "dense")]
    else:
        out.append((H * qk // t, D, H * qk * D, "dense"))
    kvw = x.qk_nope_head_dim + x.v_head_dim
    out += [(Rkv + x.qk_rope_head_dim, D, (Rkv + x.qk_rope_head_dim) * D, "dense"), (Rkv, 1, Rkv, "dense"),
            (H * kvw // t, Rkv, H * kvw * Rkv, "dense"), (D, H * x.v_head_dim // t, D * H * x.v_head_dim, "dense")]
    return out


def mla_linear_params(x: Any) -> int:
    """Matmul parameters one token passes through in one MLA attention (global: all heads)."""
    return sum(g for _, rest, g, _ in mla_tensors(x) if rest > 1)


def mla_matmuls(x: Any, n: float) -> list[tuple[float, int, int, bool]]:
    """(rows, output width, input width, fp32) of MLA's matmuls in forward order, TP-local."""
    D, Hl = x.d_model, x.n_heads // x.tp
    qk, Rq, Rkv = x.qk_nope_head_dim + x.qk_rope_head_dim, x.q_lora_rank, x.kv_lora_rank
    q = [(n, Rq, D, False), (n, Hl * qk, Rq, False)] if Rq else [(n, Hl * qk, D, False)]
    return q + [(n, Rkv + x.qk_rope_head_dim, D, False), (n, Hl * (x.qk_nope_head_dim + x.v_head_dim), Rkv, False),
                (n, D, Hl * x.v_head_dim, False)]


def mla_saved(x: Any, n: int, c: int) -> int:
    """Bytes model/mla.py's autograd saves per micro-batch besides the block norm's output (c: compute dtype bytes;
    measured with saved-tensor hooks, torch 2.13 CPU): q_norm's input c_q [n, Rq] and fp32 rstd, wq_b's input
    [n, Rq]; kv_norm's input, a view that keeps the whole wkv_a output [n, Rkv + Dr], and its rstd; wkv_b's input
    [n, Rkv]; the fused SDPA's q, k (the cats), v (zero-padded to qk dims, a new tensor; without padding a view
    keeping the whole wkv_b output [n, Hl (Dn + Dv)]) and out [n, Hl qk], its fp32 logsumexp [n, Hl]; wo's input
    [n, Hl Dv] (the transpose copy). RoPE saves nothing but the shared cos/sin rows."""
    Hl, Rq, Rkv, Dr = x.n_heads // x.tp, x.q_lora_rank, x.kv_lora_rank, x.qk_rope_head_dim
    qk, Dv = x.qk_nope_head_dim + Dr, x.v_head_dim
    q = n * (2 * Rq * c + 4) if Rq else 0
    kv = n * ((Rkv + Dr) * c + 4 + Rkv * c)
    v = Hl * qk if Dv < qk else Hl * (x.qk_nope_head_dim + Dv)
    core = n * (3 * Hl * qk * c + v * c + Hl * 4)
    return q + kv + core + n * Hl * Dv * c


def mla_core_out_width(x: Any) -> int:
    """Width of the fused kernel's output per token on this rank: Hl (Dn + Dr) (v is padded to the qk dims)."""
    return x.n_heads // x.tp * (x.qk_nope_head_dim + x.qk_rope_head_dim)


def mla_core_flops_per_token(x: Any) -> float:
    """The causal core forward + backward per token: QK^T over qk dims and PV over Dv dims, each 2 FLOPs per
    multiply-add, x3 for backward, at the causal half: 6 L H s (qk + Dv) / 2."""
    qk = x.qk_nope_head_dim + x.qk_rope_head_dim
    return 3.0 * x.n_layers * x.n_heads * x.seq_len * (qk + x.v_head_dim)


def mla_replicated_flops_per_token(x: Any) -> float:
    """Forward + backward FLOPs per token of the down-projections (wq_a, wkv_a) that TP replicates: every rank runs
    them whole (6 FLOPs per parameter per token; a full recompute reruns their forward, x 4/3)."""
    if x.attention != "mla":
        return 0.0
    rep = (x.q_lora_rank + x.kv_lora_rank + x.qk_rope_head_dim) * x.d_model
    return 6.0 * x.n_layers * rep * (4.0 / 3.0 if x.recompute == "full" else 1.0)
