"""What a planter returns and the two helpers every planter uses (validation/plant.py, plant_numerics.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Planted:
    """What parallel_job applies: a hook on the full model before parallelize, and a function after it."""

    model_hook: Callable[[torch.nn.Module], None] | None = None
    after_setup: Callable[[Any], None] = lambda par: None


def _patch(stack: contextlib.ExitStack, module: Any, attr: str, value: Any) -> None:
    old = getattr(module, attr)
    setattr(module, attr, value)
    stack.callback(setattr, module, attr, old)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def hook_on_rank1(par: Any, name: str, hook: Callable[..., Any], prepend: bool = False) -> None:
    """Register a forward hook on rank 1's module whose canonical (wrapper-free) name is `name`."""
    from curry_train.parallel.parallelize import canonical_name

    if _rank() != 1:
        return
    for part in par.parts:
        for n, m in part.named_modules():
            if canonical_name(n) == name:
                m.register_forward_hook(hook, prepend=prepend)
