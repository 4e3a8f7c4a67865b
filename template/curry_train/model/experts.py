"""Stacked SwiGLU experts applied to row groups: grouped GEMM, padded batched GEMM, or a per-expert loop.

    .venv/bin/pytest tests/parallel/test_moe.py -q -k grouped

Shape legend: R rows (grouped by local expert), El local experts, D d_model, F d_ff, C the largest group.

Three kernels, one result (tests/parallel/test_moe.py compares them in forward and backward):
  grouped  `torch._grouped_mm(x, w, offs=...)`: one kernel per weight for all experts, offsets stay on the
           device (the grouped GEMM of Megatron-LM's GroupedMLP and torchtitan's MoE). The default on CUDA in
           bf16 only, where torch has it and the rows are 16-byte aligned in the dtype the kernel computes in
           (bf16 under FSDP2's policy, the weights' gathered dtype): torch's CUDA _grouped_mm has a
           grouped kernel (CUTLASS, sm90/sm100) for bf16 only; any other dtype takes `_grouped_mm_fallback`
           (aten/src/ATen/native/cuda/GroupedBlas.cpp), which copies `offs` to the host and loops over the
           groups: a host sync per call, the thing the grouped kernel exists to avoid.
  padded   each group scattered into [El, C, D] and run through `bmm`: fp32 on CUDA, or a torch without
           _grouped_mm.
  loop     one GEMM per expert over `torch.unbind` views of the weights. The CPU default: on CPU a loop costs
           nothing extra, and its numbers are the reference the white-box runs compare against. `unbind`'s
           backward stacks the El slice gradients once; indexing `w[e]` would build a zero-filled [El, D, F]
           gradient per expert (SelectBackward) and sum them.
No kernel loops over experts in Python on the GPU path, and none syncs with the host: the group sizes the
padded kernel needs as Python ints come from the dispatch's single host read (moe.MoE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's backward rejects a
    stride-0 gradient such as that of `.sum()`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def default_kernel(device: torch.device, dtype: torch.dtype, d_model: int, d_ff: int) -> str:
    """loop on CPU; on CUDA grouped for bf16 with 16-byte aligned rows of D and F elements, else padded.
    `dtype` is the compute dtype: the rows' (bf16 under FSDP2's policy, whose units hand the GEMMs bf16 weights)."""
    if device.type == "cpu":
        return "loop"
    aligned = all((d * torch.tensor([], dtype=dtype).element_size()) % 16 == 0 for d in (d_model, d_ff))
    return "grouped" if hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16 and aligned else "padded"


class Experts(nn.Module):
    """El SwiGLU experts as stacked weights (w1/w3 [El, D, F] gate/up, w2 [El, F, D] down)."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.kernel: str | None = None  # None = default_kernel; tests force "grouped" / "padded" / "loop"

    def forward(self, x: torch.Tensor, counts: list[int], counts_t: torch.Tensor) -> torch.Tensor:
        """x [R, D] grouped by local expert, counts[e] (host ints) = counts_t[e] (device) rows of expert e -> [R, D].
        Every expert runs, even on 0 rows, so every rank's autograd graph has the same shape."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        kernel = self.kernel or default_kernel(x.device, x.dtype, x.shape[-1], w1.shape[-1])
        if kernel == "grouped":
            offs = torch.cumsum(counts_t, 0).to(torch.int32)  # [El] end offsets, on the device
            x = _ContiguousGrad.apply(x)
            h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)  # [R, F]
            return torch._grouped_mm(_ContiguousGrad.apply(h), w2, offs=offs)
        if kernel == "padded":
            return _padded(x, counts, counts_t, w1, w3, w2)
        outs = [(F.silu(xe @ a) * (xe @ b)) @ c
                for xe, a, b, c in zip(x.split(counts), w1.unbind(0), w3.unbind(0), w2.unbind(0))]
        return torch.cat(outs)  # [R, D]


def _padded(x, counts: list[int], counts_t, w1, w3, w2) -> torch.Tensor:
    """Scatter the groups into [El, C, D] (zeros past each group's end), bmm, gather the rows back."""
    El, R, C = len(counts), x.shape[0], max(counts, default=0)
    expert = torch.repeat_interleave(torch.arange(El, device=x.device), counts_t, output_size=R)  # [R]
    start = torch.cumsum(counts_t, 0) - counts_t  # [El] first row of each group
    slot = expert * C + (torch.arange(R, device=x.device) - start[expert])  # [R] row in the padded batch
    xp = x.new_zeros(El * C, x.shape[1]).index_copy(0, slot, x).view(El, C, -1)  # [El, C, D]
    yp = torch.bmm(F.silu(torch.bmm(xp, w1)) * torch.bmm(xp, w3), w2)  # [El, C, D]
    return yp.reshape(El * C, -1).index_select(0, slot)  # [R, D]
