"""The white-box harness: DDP matches the single-device reference, and a broken variant is caught and named."""

from __future__ import annotations

import pytest
from curry_train.config import load_config
from curry_train.validation.whitebox import whitebox_batch

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
pytestmark = pytest.mark.multirank


def test_ddp_two_ranks_matches_reference_over_accumulation_layouts(tmp_path):
    cfgs = [load_config(TINY, o) for o in (
        {"parallel.dp": 2},                             # 2 micro-batches per rank
        {"parallel.dp": 2, "train.micro_batch": 1},     # 4 micro-batches per rank (no_sync path)
        {"parallel.dp": 2, "train.micro_batch": 4},     # no accumulation
        {"parallel.dp": 2, "train.dtype": "bfloat16"},  # bf16 autocast vs the fp32 reference (looser, stated)
        {"parallel.dp": 2, "parallel.zero": 3, "train.dtype": "bfloat16"},  # FSDP2 MixedPrecisionPolicy
    )]
    verdicts = whitebox_batch(cfgs, steps=2, out_dir=tmp_path)
    for v in verdicts:
        assert v.passed, v.failures
        assert v.loss_max_diff <= (2e-2 if "loss_rtol" in v.tolerance and v.tolerance["loss_rtol"] > 1e-4 else 1e-5)
        assert v.n_params_compared == 39
        assert v.losses_parallel[1] < v.losses_parallel[0] + 1.0  # two real steps were taken


def test_ddp_four_ranks_matches_reference(tmp_path):
    (v,) = whitebox_batch([load_config(TINY, {"parallel.dp": 4})], steps=2, out_dir=tmp_path)
    assert v.passed, v.failures


def test_an_unreduced_gradient_fails_and_names_the_parameter_and_layer(tmp_path):
    broken = "layers.2.feed_forward.w1.weight"
    (v,) = whitebox_batch([load_config(TINY, {"parallel.dp": 2})], out_dir=tmp_path, break_grad_sync=[broken])
    assert not v.passed
    assert v.worst_parameter.name.endswith(broken)
    assert v.first_diverging_layer == "layers.2"
    assert any(broken in f for f in v.failures)
