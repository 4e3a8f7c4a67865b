"""Uneven pipeline stages (pipeline_split.py), PP x MoE with router losses (moe.AuxLossBackward), the
PP+DDP+EP expert-gradient fix, and MoE + CP with capacity over whole sequences, against the single-device
reference through the white-box harness (one forkserver launch per world size).

    .venv/bin/pytest tests/parallel/test_pipeline_uneven_moe.py -x -q
"""

from __future__ import annotations

import pytest
from curry_train.config import load_config
from curry_train.model.gpt import build_model
from curry_train.parallel.pipeline import build_stage_module, stage_layers
from curry_train.pipeline_split import split_layers, stage_costs

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(600)
TINY, MOE = PRESETS / "tiny.yaml", PRESETS / "tiny-moe.yaml"

WORLD2 = [
    (TINY, {"parallel.pp": 2, "model.n_layers": 5}),  # (3, 2): the head is on stage 1
    (TINY, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2,
            "model.n_layers": 5}),  # uneven chunks (1, 2, 1, 1)
    (TINY, {"parallel.pp": 2, "model.n_layers": 5, "parallel.pp_layers": [1, 4]}),  # explicit override
    (MOE, {"parallel.pp": 2, "model.z_loss_coef": 1e-3}),  # aux + z losses on both stages
    # capacity over whole sequences, with and without the aux loss (the repro is the first; AdamW's first
    # step amplifies its eps-sized gradient noise, which compare.py's re-synchronised reference keeps out of step 1)
    (MOE, {"parallel.cp": 2, "model.capacity_factor": 1.0}),
    (MOE, {"parallel.cp": 2, "model.capacity_factor": 1.0, "model.aux_loss_coef": 0.0}),
]
WORLD4 = [
    (TINY, {"parallel.pp": 4, "model.n_layers": 6}),  # (1, 2, 2, 1)
    # the repro: DDP + EP under PP left expert gradients un-reduced and unscaled
    (MOE, {"parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "model.aux_loss_coef": 0.0,
           "train.global_batch": 16}),
    (MOE, {"parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "model.z_loss_coef": 1e-3,
           "train.global_batch": 16}),
    (MOE, {"parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3, "model.z_loss_coef": 1e-3,
           "train.global_batch": 16}),
]


def test_split_balances_cost_and_keeps_even_splits_even():
    assert split_layers(8, 4) == (2, 2, 2, 2) and split_layers(13, 4) == (4, 3, 3, 3)
    tiny = dict(d_model=64, n_heads=8, n_kv_heads=4, d_ff=128, vocab_size=256, seq_len=64)
    layer, embed, head = stage_costs(**tiny)
    assert split_layers(5, 2, layer, embed, head) == (3, 2)  # the head's 0.4 layer goes with the lighter stage
    assert split_layers(6, 4, layer, embed, head) == (1, 2, 2, 1)
    # Llama 3 405B over PP16: one fewer layer on the first and the last stage, as Meta ran it
    big = stage_costs(d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, vocab_size=128256, seq_len=8192)
    assert split_layers(126, 16, *big) == (7, *[8] * 14, 7)
    with pytest.raises(ValueError, match="cannot fill"):
        split_layers(3, 4)


def test_uneven_stages_cover_every_layer_once_with_the_full_models_names():
    cfg = load_config(TINY, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                             "parallel.pp_virtual": 2, "model.n_layers": 5})
    assert [stage_layers(s, cfg) for s in range(4)] == [[0], [1, 2], [3], [4]]  # embedding: stage 0 lighter
    model = build_model(cfg)
    names = [n for s in range(4) for n, _ in build_stage_module(model, s, cfg).named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    over = load_config(TINY, {"parallel.pp": 2, "model.n_layers": 5, "parallel.pp_layers": [1, 4]})
    assert stage_layers(1, over) == [1, 2, 3, 4]


def _run(world, tmp_path):
    cfgs = [load_config(path, o) for path, o in world]
    for (path, o), v in zip(world, whitebox_batch(cfgs, steps=2, out_dir=tmp_path)):
        assert v.passed, f"{path.name} {o}: {v.failures[:5]} worst={v.worst_parameter}"


def test_whitebox_two_ranks(tmp_path):
    _run(WORLD2, tmp_path)


def test_whitebox_four_ranks(tmp_path):
    _run(WORLD4, tmp_path)
