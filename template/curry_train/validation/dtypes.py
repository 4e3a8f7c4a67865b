"""The bf16 policy checked directly: the dtypes every FSDP2 unit holds against the policy parallel/fsdp.py gives it;
and which bf16 layouts compute the reference's exact bf16 ops (`bf16_cast_exact`: compare.py's bound class, and
whether validation/routing.py judges the routing).

A reduction in bf16 instead of fp32 changes each gradient by ~2^-9 relative, which the relative bf16 bounds of
tp/cp/ep layouts (validation/compare.py) cannot see; the unit's own dtypes show it in any layout.
"""

from __future__ import annotations

import torch
from torch import nn

from curry_train.config import Config


def fsdp_unit_dtypes(parts: list[nn.Module], canonical=lambda n: n) -> dict[str, list[str]]:
    """Every FSDP2 unit's effective dtypes, as its parameters hold them (FSDPParam, after the policy's clamping):
    {unit: ["master compute reduce", ...]}; checked by `policy_failures`. {"error": [...]} when this torch's
    FSDP2 has no such attributes."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[str, list[str]] = {}
    for part in parts:
        for name, m in part.named_modules():
            if not isinstance(m, FSDPModule):
                continue
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            params = getattr(group, "fsdp_params", None)
            if group is not None and params is None:
                return {"error": [f"torch {torch.__version__}: FSDP2 param groups have no fsdp_params"]}
            rows = set()
            for fp in params or []:
                compute = fp.param_dtype or fp.orig_dtype
                rows.add(f"{fp.orig_dtype} {compute} {fp.reduce_dtype or compute}")
            out[canonical(name) or "root"] = sorted(rows)
    return out


def policy_failures(cfg: Config, units: dict[str, list[str]]) -> list[str]:
    """Rank 0's FSDP units must hold the dtypes of the policy parallel/fsdp.py gives every unit (fp32 master,
    compute in param_dtype, reduce in reduce_dtype): a reduction in bf16 fails here whatever the layout's bounds."""
    if not units:
        return []
    if "error" in units:
        return [f"FSDP dtypes not readable: {units['error'][0]}; validation/dtypes.py needs updating"]
    from curry_train.parallel.fsdp import fsdp_kwargs

    mp = fsdp_kwargs(cfg)["mp_policy"]
    compute = mp.param_dtype or torch.float32
    want = f"{torch.float32} {compute} {mp.reduce_dtype or compute}"
    return [f"FSDP unit {unit}: dtypes (master compute reduce) {rows} != the policy's [{want}] (parallel/fsdp.py "
            "fsdp_kwargs)" for unit, rows in sorted(units.items()) if rows and rows != [want]]


def bf16_cast_exact(cfg: Config, compiled: bool = False) -> bool:
    """A bf16 layout whose every bf16 operation has the shape the reference's has (validation/compare.py docstring,
    "bfloat16"): the batch is split only at micro-batch boundaries (dp, ZeRO/FSDP, HSDP, pp, recompute), never a
    matmul's inner or token dimension (tp, cp, ep), and eager: inductor fuses elementwise chains (RMSNorm, RoPE,
    SiLU * up) and keeps their intermediates in fp32 (torch._inductor.config.emulate_precision_casts is off), so a
    compiled block rounds to bf16 fewer times than the eager reference, the same class of difference as tp's other
    partial sums. With the whole block in bf16 (FSDP2's policy on every bf16 layout, no fp32 stream) that difference
    reaches the grad norm: BF16_COMPILED (measured, tiny compiled, 2 steps: 1 rank and dp2 9.3e-4 relative on the
    grad norm, tp2 7.0e-4; gradients 21% of the 5% L2 bound, activations 25-33%)."""
    p = cfg.parallel
    return p.tp == 1 and p.cp == 1 and p.ep == 1 and not compiled
