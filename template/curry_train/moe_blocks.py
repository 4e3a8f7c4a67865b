"""Which FFN each block of a MoE model has, and how wide: torch-free and import-free, so the config, the model,
the pipeline split and the estimator all read the one rule (config.py re-exports it).

    python -c "from curry_train.config import Config, shared_width; print(shared_width(Config().model))"

`m` is a config.ModelConfig (duck-typed: config.py imports this module).
"""

from __future__ import annotations

from typing import Any


def shared_width(m: Any) -> int:
    """Hidden size of a MoE block's fused shared expert (0 = none): shared_d_ff, or n_shared_experts * d_ff as
    DeepSeek-V2/V3 build it (one SwiGLU whose width is the sum of the shared experts', Dai et al. 2024
    "DeepSeekMoE" §3.2; the model and the estimator share this rule)."""
    if not m.num_experts or not m.n_shared_experts:
        return 0
    return m.shared_d_ff or m.n_shared_experts * m.d_ff


def dense_width(m: Any) -> int:
    """Hidden size of a dense block's SwiGLU: dense_d_ff for the first_k_dense blocks of a MoE model, else d_ff."""
    return (m.dense_d_ff or m.d_ff) if m.num_experts and m.first_k_dense else m.d_ff


def is_moe_block(m: Any, layer: int) -> bool:
    """Whether global block `layer` has the MoE FFN: every block of a MoE model but its first_k_dense."""
    return m.num_experts > 0 and layer >= m.first_k_dense


def tp_split_widths(m: Any) -> list[tuple[str, int]]:
    """The FFN widths tensor parallel splits, as (the model field that sets it, width); each must divide by tp.
    d_ff on a dense model; on a MoE model the dense first blocks' and the shared expert's, while the routed experts
    stay whole (expert-parallel instead: Megatron-LM's expert-tensor-parallel size 1, parallel/tensor_parallel.py)."""
    if not m.num_experts:
        return [("d_ff", m.d_ff)]
    out = []
    if m.first_k_dense:
        out.append(("dense_d_ff" if m.dense_d_ff else "d_ff", dense_width(m)))
    if shared_width(m):
        out.append(("shared_d_ff" if m.shared_d_ff else "d_ff", shared_width(m)))
    return out
