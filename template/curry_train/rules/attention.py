"""Which attention settings may launch: GQA/MHA (the n_kv_heads path) and MLA (model/mla.py); called by
rules/validity.py `check`. Torch-free, without runtime imports from `curry_train.config`.

MLA (DeepSeek-V2, arXiv:2405.04434 §2.1; DeepSeek-V3, arXiv:2412.19437 §2.1) under the template's primitives:
  TP   the query and KV up-projections are split by heads (n_heads % tp, checked with the GQA fields), the
       down-projections and their norms are replicated (parallel/tensor_parallel.py `mla_plan`): no rank needs
       a divisibility of the ranks.
  CP   refused: the ring attention (parallel/context_parallel.py) stacks K and V into one buffer that travels
       the ring, which needs one head dim for both, and MLA's K has qk_nope + qk_rope dims, V v_head_dim.
"""

from __future__ import annotations

from typing import Any

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def uses_mla(m: Any) -> bool:
    return m.attention == "mla"


def check_attention(m: Any, p: Any, bad: Any) -> None:
    """Append to `bad(fields, message, fix)` every problem of model.attention and its fields."""
    if not uses_mla(m):
        for field in MLA_FIELDS:
            if getattr(m, field):
                bad([f"model.{field}", "model.attention"], f"{field}={getattr(m, field)} is an MLA setting, but "
                    f"attention={m.attention}", f"set model.attention=mla, or model.{field}=0")
        if m.attention == "mha" and m.n_kv_heads != m.n_heads:
            bad(["model.attention", "model.n_kv_heads"], f"attention=mha gives every query head its own K/V "
                f"head, but n_kv_heads={m.n_kv_heads} != n_heads={m.n_heads}",
                f"set model.n_kv_heads={m.n_heads}, or model.attention=gqa")
        return
    for field, low in (("kv_lora_rank", 1), ("qk_nope_head_dim", 1), ("qk_rope_head_dim", 2), ("v_head_dim", 1)):
        if getattr(m, field) < low:
            bad([f"model.{field}", "model.attention"], f"attention=mla needs {field} >= {low}, got "
                f"{getattr(m, field)}", f"set model.{field} (DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim "
                "128, qk_rope_head_dim 64, v_head_dim 128)")
    if m.qk_rope_head_dim % 2:
        bad(["model.qk_rope_head_dim"], f"qk_rope_head_dim={m.qk_rope_head_dim} is odd; RoPE rotates pairs",
            "use an even qk_rope_head_dim")
    if m.v_head_dim > m.qk_nope_head_dim + m.qk_rope_head_dim:
        bad(["model.v_head_dim", "model.qk_nope_head_dim"], f"v_head_dim={m.v_head_dim} exceeds the query/key head "
            f"dim {m.qk_nope_head_dim + m.qk_rope_head_dim}: model/mla.py pads v up to it for the fused kernels",
            "use v_head_dim <= qk_nope_head_dim + qk_rope_head_dim (DeepSeek-V3: 128 <= 192)")
    if m.n_kv_heads != m.n_heads:
        bad(["model.n_kv_heads", "model.attention"], f"attention=mla up-projects a K and a V for every query head "
            f"(n_heads={m.n_heads}), but n_kv_heads={m.n_kv_heads}", f"set model.n_kv_heads={m.n_heads}")
    if p.cp > 1:
        bad(["parallel.cp", "model.attention"], "context parallel with attention=mla is not supported: the ring "
            "attention sends K and V as one stacked buffer of one head dim, and MLA's K has qk_nope_head_dim + "
            "qk_rope_head_dim dims, V v_head_dim", "set parallel.cp=1 (shard the sequence with parallel.sp and tp)")


def attn_head_dims(m: Any) -> tuple[int, int, int]:
    """(query/key head dim, value head dim, RoPE dims) of the attention core: MLA's own, else d_model / n_heads."""
    if uses_mla(m):
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.qk_rope_head_dim
    d = m.d_model // m.n_heads
    return d, d, d
