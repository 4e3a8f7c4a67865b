"""The bf16 policy checked directly: the dtypes every FSDP2 unit holds against the policy parallel/fsdp.py gives it.

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
