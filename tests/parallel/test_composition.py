"""2-D and 3-D compositions (parallelize.py: PP split -> TP/SP -> recompute -> FSDP/DDP -> optimizer -> schedule)
against the single-device reference through the white-box harness; one launch per world size."""

from __future__ import annotations

import pytest
from curry_train.config import load_config

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

TINY = PRESETS / "tiny.yaml"
pytestmark = pytest.mark.multirank

PP2_DP2 = {"parallel.pp": 2, "parallel.dp": 2, "train.global_batch": 16}  # 4 micro-batches per dp rank
FOUR_RANKS = [
    {"parallel.dp": 2, "parallel.zero": 3, "parallel.tp": 2, "parallel.sp": True},       # 2-D: FSDP x TP+SP
    {"parallel.dp": 2, "parallel.zero": 2, "parallel.tp": 2},
    {"parallel.dp": 2, "parallel.zero": 3, "parallel.tp": 2, "parallel.sp": True, "parallel.recompute": "selective"},
    {**PP2_DP2},                                                                         # PP x DDP
    {**PP2_DP2, "parallel.pp_schedule": "gpipe", "parallel.zero": 1},                    # PP x ZeRO-1
    {**PP2_DP2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2},
    {**PP2_DP2, "parallel.zero": 3},                                                     # PP x FSDP
    {**PP2_DP2, "parallel.zero": 2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2},
    {"parallel.pp": 2, "parallel.tp": 2},                                                # PP x TP
    {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.pp_schedule": "interleaved_1f1b",
     "parallel.pp_virtual": 2},
    {"parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.pp_schedule": "zero_bubble",
     "parallel.pp_virtual": 2, "parallel.recompute": "full"},
    {"parallel.cp": 2, "parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2},
    {"parallel.cp": 2, "parallel.tp": 2, "parallel.zero": 3},                            # ring attention x TP
    # Megatron's distributed optimizer (ZeRO-1 under TP on FSDP2, 2 micro-batches per dp rank held gathered)
    {"parallel.dp": 2, "parallel.zero": 1, "parallel.tp": 2, "parallel.sp": True},
    {"parallel.dp": 2, "parallel.zero": 1, "parallel.tp": 2},
    {"parallel.dp": 2, "parallel.zero": 2, "parallel.tp": 2, "parallel.fsdp_keep_gathered": True},
]
EIGHT_RANKS = [
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 3},          # 3-D (acceptance)
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 2, "parallel.sp": True,
     "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2, "train.global_batch": 16},
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 1, "parallel.sp": True},  # Megatron
]


@pytest.mark.slow
def test_two_dimensional_layouts_on_four_ranks_match_the_reference(tmp_path):
    cfgs = [load_config(TINY, o) for o in FOUR_RANKS]
    for o, v in zip(FOUR_RANKS, whitebox_batch(cfgs, steps=2, out_dir=tmp_path)):
        assert v.passed, (o, v.failures, v.worst_parameter)
        assert v.n_params_compared == 39


@pytest.mark.slow
def test_three_dimensional_layouts_on_eight_ranks_match_the_reference(tmp_path):
    cfgs = [load_config(TINY, o) for o in EIGHT_RANKS]
    for o, v in zip(EIGHT_RANKS, whitebox_batch(cfgs, steps=2, out_dir=tmp_path, timeout=600)):
        assert v.passed, (o, v.failures, v.worst_parameter)
