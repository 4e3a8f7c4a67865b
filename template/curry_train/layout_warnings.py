"""Layouts that are valid and launch, but where a primitive does nothing: warnings, not errors.

    python -c "from curry_train.config import load_config; from curry_train.layout_warnings import layout_warnings; \
print(layout_warnings(load_config('configs/tiny.yaml', {'parallel.zero': 2})))"

ZeRO (Rajbhandari et al., 2020) shards optimizer state, gradients and parameters across the data-parallel group;
here that group is dp x cp (wrapping.py: DDP / ZeRO-1 / FSDP only when dp * cp > 1). With one
data-parallel rank there is nothing to shard over, so `parallel.zero` >= 1 silently trains like zero=0 and the
per-rank memory does not drop (a ZeRO-2 run at dp=1 would otherwise pass without a word). This
config has no HSDP switch: hybrid sharding is FSDP over dp x cp here, covered by the same check.

Torch-free and import-light (config types only for hints), so the CLI, the estimator and the MCP server can call it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from curry_train.config import Config

_STAGE = {1: "ZeRO-1 (optimizer-state sharding)", 2: "ZeRO-2 (optimizer + gradient sharding)",
          3: "ZeRO-3/FSDP (full sharding)"}


def layout_warnings(cfg: Config) -> list[str]:
    """One line per primitive that the layout turns on but that has no effect; empty when every one counts."""
    p = cfg.parallel
    out = []
    if p.zero >= 1 and p.dp * p.cp == 1:
        out.append(f"parallel.zero={p.zero} at dp=1: {_STAGE[p.zero]} shards over the data-parallel ranks "
                   f"(dp x cp = 1 here), so it does nothing and saves no memory. Fix: set parallel.zero=0, or "
                   f"parallel.dp>1 to shard")
    return out
