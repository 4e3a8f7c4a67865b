"""The estimator's fused-AdamW rule against the template's real parameters: on CUDA the optimizer step holds no
transient when AdamW runs fused, which train/optim.py adamw_kwargs allows only for parameters of one kind (plain
tensors, or DTensors of one mesh); estimator/states.py adamw_fused predicts the kinds per layout.

    .venv/bin/pytest tests/parallel/test_adamw_kinds.py -q -n 0

The kinds are read on CPU ranks (the parameters a layout leaves do not depend on the device): every AdamW the
layout steps (ZeRO-1's per-group local optimizers included) must hold one kind exactly when the estimator, told
the device is CUDA, says fused.
"""

from __future__ import annotations

from typing import Any

import pytest
from curry_train.config import load_config
from curry_train.estimator import layout_of, replace_layout
from curry_train.estimator.states import _states, adamw_fused

from tests.conftest import PRESETS

TWO = [{"parallel.tp": 2}, {"parallel.tp": 2, "parallel.sp": True}, {"parallel.dp": 2, "parallel.zero": 1},
       {"parallel.dp": 2, "train.dtype": "bfloat16"}, {"parallel.pp": 2, "train.dtype": "bfloat16"},
       {"config": "tiny-moe", "parallel.dp": 2, "parallel.ep": 2},
       {"config": "tiny-moe", "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1},
       {"config": "tiny-moe", "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3},
       {"config": "tiny-moe", "parallel.tp": 2, "parallel.sp": True},
       {"config": "tiny-mla", "parallel.tp": 2, "parallel.sp": True}]
FOUR = [{"parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.zero": 3},
        {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3}]


def _cfg(o: dict[str, Any]):
    o = dict(o)
    return load_config(PRESETS / f"{o.pop('config', 'tiny')}.yaml", o)


def _kinds(rank: int, world: int, layouts: list[dict]) -> list[list[int]]:
    """Per layout, per AdamW this rank steps: how many kinds of parameter it holds (plain, or each mesh)."""
    from curry_train.parallel.zero import zero_optimizers
    from curry_train.train.loop import init_distributed, setup

    out = []
    for o in layouts:
        cfg = _cfg(o)
        par = setup(cfg, init_distributed(cfg))
        opts = [getattr(z, "optim", z) for z in zero_optimizers(par.optimizer)]
        out.append([len({getattr(p, "device_mesh", None) for g in opt.param_groups for p in g["params"]})
                    for opt in opts])
    return out


@pytest.mark.multirank
@pytest.mark.parametrize(("world", "layouts"), [(2, TWO), (4, FOUR)])
def test_the_estimators_fused_rule_is_the_kinds_the_template_leaves(world, layouts):
    from curry_train.train.launch import launch_forkserver

    per_rank = launch_forkserver(_kinds, world, layouts, timeout=600)
    for i, o in enumerate(layouts):
        one_kind = all(k == 1 for rank in per_rank for k in rank[i])
        lay = replace_layout(layout_of(_cfg(o)), device="cuda")
        assert adamw_fused(lay) == one_kind, (o, [rank[i] for rank in per_rank])


def test_fused_adamw_holds_no_step_transient_and_the_loop_one_tensors_worth():
    """CUDA fused: the update runs in the kernel (0 B, the step counters on the device); the per-tensor loop:
    sqrt(v) and its quotient of the largest tensor, the step counters on the host; CPU: the loop, counted."""
    fused = replace_layout(layout_of(_cfg({"parallel.dp": 2, "parallel.zero": 3})), device="cuda")
    loop = replace_layout(layout_of(_cfg({"parallel.tp": 2})), device="cuda")
    cpu = layout_of(_cfg({"parallel.dp": 2, "parallel.zero": 3, "hardware.device": "cpu"}))
    assert adamw_fused(fused) and not adamw_fused(loop) and not adamw_fused(cpu)
    st_f, st_l, st_c = _states(fused, [0]), _states(loop, [0]), _states(cpu, [0])
    assert st_f.step_transient == 0
    assert st_l.step_transient == 2 * 4 * st_l.largest_tensor
    assert st_c.step_transient == 2 * 4 * st_c.largest_tensor
    from curry_train.model.gpt import build_model

    n_tensors = sum(1 for _ in build_model(_cfg({})).parameters())
    assert st_f.opt == 8 * st_f.n_stored + 4 * n_tensors  # the fused kernel's step counters live on the device
    assert st_l.opt == 8 * st_l.n_stored  # the loop's stay on the host
