"""Lean autograd for the element-wise parts of a block, RMSNorm and the SwiGLU gate (docs/ESTIMATION.md, "Activations").

Plain autograd keeps the input of every op it differentiates through: RMSNorm's fp32 upcast, its normalised
copy and the rsqrt; SiLU's input, its output and the up projection for the gate product. Written as one
`torch.autograd.Function` each, the forward runs the same ops (same numerics) and saves only what the backward
cannot rebuild cheaply (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, §4: element-wise work is recomputed, not stored):
  RMSNorm  x [N.., D] in its own dtype and the fp32 reciprocal RMS [N.., 1]: the statistics stay fp32.
  SwiGLU   the two projections a = w1 x and b = w3 x [N.., F]; silu(a) is rebuilt in backward.
The backward of each is written with in-place ops so that its working set is that of plain autograd (three
[N.., F] tensors for SwiGLU; estimator/acts.py `ffn_bwd`). Both take DTensors (sequence-parallel norms) as
well as plain tensors: every op here has a DTensor rule, and the weight gradient is reduced with sum_to_size as
autograd's own broadcasting backward does.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    """y = (x * rsqrt(mean(x^2) + eps)).type_as(x) * w, the statistics in fp32; saves x and rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()  # [N.., D] fp32 (x itself when x is fp32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [N.., 1] fp32
        ctx.save_for_backward(x, rstd, weight)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        xn = x.float() * rstd  # [N.., D] fp32, the normalised input rebuilt
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g * xn.type_as(x)).sum_to_size(weight.shape)
        gn = (g * weight).float()  # [N.., D] gradient of the fp32 normalised input
        # d/dx of x * rstd(x): rstd * (gn - xn * mean(gn * xn)) (Zhang & Sennrich 2019, eq. 4)
        dot = (gn * xn).mean(-1, keepdim=True)  # [N.., 1]
        gx = gn.sub_(xn.mul_(dot)).mul_(rstd)
        return gx.to(x.dtype), gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    """silu(a) * b (Shazeer 2020); saves a and b only."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, b = ctx.saved_tensors
        s = torch.sigmoid(a)  # [N.., F]
        u = a * s  # silu(a)
        # silu'(a) = s (1 + a (1 - s)) = s - s * silu(a) + silu(a), built in s's storage
        s.addcmul_(s, u, value=-1).add_(u)
        gb = u.mul_(g)  # d/db = g * silu(a), in u's storage
        ga = s.mul_(g).mul_(b)  # d/da = g * b * silu'(a), in s's storage: never more than three [N.., F] alive
        return ga, gb


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(a, b)
