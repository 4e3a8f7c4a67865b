"""Multi-head latent attention (MLA), in its training form (no absorbed weights).

DeepSeek-V2 (arXiv:2405.04434) §2.1 and DeepSeek-V3 (arXiv:2412.19437) §2.1.1: the keys and values of every
head are up-projected from one low-rank latent c_kv per token; the queries likewise from c_q when q_lora_rank > 0.
RoPE cannot pass through the up-projection, so a separate rotary key k_rope (qk_rope_head_dim dims) is projected
from the input and shared by all heads (the "decoupled RoPE" of §2.1.3):

    c_q  = RMSNorm(W_dq x)                      [B, T, Rq]        (q = W_q x when q_lora_rank = 0)
    q    = W_uq c_q -> [q_nope | q_rope]         [B, H, T, Dn + Dr], RoPE on q_rope
    [c_kv | k_rope] = W_dkv x                    [B, T, Rkv + Dr], RoPE on k_rope (one head, broadcast to H)
    [k_nope | v] = W_ukv RMSNorm(c_kv)           [B, H, T, Dn + Dv]
    o    = SDPA([q_nope|q_rope], [k_nope|k_rope], v), scale 1/sqrt(Dn + Dr)     [B, H, T, Dv]
    y    = W_o o                                 [B, T, D]

Shape legend: B batch, T sequence, D d_model, H heads (H/tp under TP), Rq q_lora_rank, Rkv kv_lora_rank,
Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim. Module names follow torchtitan's deepseek_v3 model
(wq or wq_a/q_norm/wq_b, wkv_a, kv_norm, wkv_b, wo). Under TP (parallel/tensor_parallel.py `mla_plan`) wq/wq_b
and wkv_b are column-parallel by heads and wo row-parallel; wq_a, q_norm, wkv_a and kv_norm are replicated.
SDPA's default scale is 1/sqrt(q.size(-1)) = 1/sqrt(Dn + Dr), and it takes a value head dim Dv != Dn + Dr.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from curry_train.config import ModelConfig


class MLAttention(nn.Module):
    """`norm` (gpt.RMSNorm, model/lean.py's), `rope` (gpt.apply_rope) and `core` (gpt.causal_attention) are handed
    in by gpt.Block, so this module never imports gpt back."""

    def __init__(self, m: ModelConfig, norm: Callable[[int, float], nn.Module], rope: Callable, core: Callable):
        super().__init__()
        RMSNorm = norm
        self.apply_rope = rope
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_rank = m.kv_lora_rank
        qk = self.nope + self.rope
        if m.q_lora_rank:
            self.wq_a = nn.Linear(m.d_model, m.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(m.q_lora_rank, m.norm_eps)
            self.wq_b = nn.Linear(m.q_lora_rank, m.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(m.d_model, m.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(m.d_model, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, m.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, m.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(m.n_heads * self.v_dim, m.d_model, bias=False)
        self.core_attention = core  # gpt.causal_attention: SDPA, causal
        self.shared_key: Callable = _identity  # TP: sums the rotary key's gradient over the ranks' heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        apply_rope = self.apply_rope
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)  # [B, T, H (Dn+Dr)]
        q = q.view(B, T, -1, self.nope + self.rope).transpose(1, 2)  # [B, H, T, Dn + Dr]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)  # [B, T, Rkv], [B, T, Dr]
        k_rope = self.shared_key(apply_rope(k_rope.unsqueeze(1), cos, sin))  # [B, 1, T, Dr]: one for every head
        kv = self.wkv_b(self.kv_norm(c_kv)).view(B, T, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, H, T, Dn], [B, H, T, Dv]
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)  # [B, H, T, Dn + Dr]
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # [B, H, T, Dn + Dr]
        pad = self.nope + self.rope - self.v_dim
        if pad > 0:  # the fused kernels take one head dim for q, k and v (torch 2.13's CPU flash falls back to the
            v = F.pad(v, (0, pad))  # math path otherwise, which saves the [B, H, T, T] softmax); zero columns of
        y = self.core_attention(q, k, v)[..., :self.v_dim]  # v give zero columns of the output: [B, H, T, Dv]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # [B, T, D]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
