"""ZeRO-1/2/3 x recompute none/selective/full match the single-device reference (white-box), on 2 and 4 ranks.

One forkserver launch per world size runs every layout (launch cost dominates a tiny job). Two steps each: the
second one runs with AdamW state, so ZeRO-1's post-step parameter broadcast and FSDP's sharded state are checked.
That the stages really shard is measured in tests/test_memory.py.
"""

from __future__ import annotations

import pytest
from curry_train.config import load_config

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

TINY = PRESETS / "tiny.yaml"
TINY_MOE = PRESETS / "tiny-moe.yaml"
pytestmark = pytest.mark.multirank
MATRIX = [{"parallel.zero": z, "parallel.recompute": r} for z in (1, 2, 3) for r in ("none", "selective", "full")]


def _assert_all_pass(overrides: list[dict], tmp_path) -> None:
    cfgs = [load_config(o.pop("config", TINY), o) for o in overrides]
    verdicts = whitebox_batch(cfgs, steps=2, out_dir=tmp_path)
    failed = {str(o): (v.failures[:3], v.worst_parameter) for o, v in zip(overrides, verdicts) if not v.passed}
    assert not failed, failed
    assert all(v.loss_max_diff <= 1e-5 for v in verdicts)


def test_zero_and_recompute_match_reference_on_two_ranks(tmp_path):
    overrides = [{"parallel.dp": 2, **o} for o in MATRIX] + [
        {"parallel.dp": 2, "parallel.recompute": "selective"},  # recompute under plain DDP
        {"parallel.dp": 2, "parallel.recompute": "full"},
        {"parallel.dp": 2, "parallel.zero": 1, "train.micro_batch": 1},  # 4 micro-batches: DDP no_sync
        {"parallel.dp": 2, "parallel.zero": 3, "train.micro_batch": 1},  # FSDP set_requires_gradient_sync
        # ZeRO-2 whose units stay gathered across the 4 micro-batches (fsdp.holds_step), with full recompute
        {"parallel.dp": 2, "parallel.zero": 2, "parallel.fsdp_keep_gathered": True, "train.micro_batch": 1,
         "parallel.recompute": "full"},
        # MoE: the experts are a nested FSDP unit inside the selectively checkpointed block (recompute.py)
        {"config": TINY_MOE, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3, "parallel.recompute": "selective"},
    ]
    _assert_all_pass(overrides, tmp_path)


def test_zero_and_recompute_match_reference_on_four_ranks(tmp_path):
    overrides = [{"parallel.dp": 4, **o} for o in MATRIX] + [
        # FSDP over the dp axis of a 2-D mesh whose blocks are already TP (+SP) DTensors, and over pipeline stages
        {"parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.zero": 3,
         "parallel.recompute": "selective"},
        {"parallel.dp": 2, "parallel.pp": 2, "parallel.zero": 2, "parallel.recompute": "full"},
    ]
    _assert_all_pass(overrides, tmp_path)
