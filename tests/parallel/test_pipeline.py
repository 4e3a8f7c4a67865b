"""Pipeline parallel (parallel/pipeline.py): the stage split, the placements, and every schedule against the
single-device reference through the white-box harness (one launch per world size)."""

from __future__ import annotations

import pytest
from curry_train.config import ConfigError, load_config
from curry_train.model.gpt import build_model
from curry_train.parallel.pipeline import build_stage_module, schedule_name, stage_ids, stage_layers

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

TINY = PRESETS / "tiny.yaml"

TWO_RANKS = [
    {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
    {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
    {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2},
    {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2},        # ZBV
    {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 4,        # interleaved ZB
     "model.n_layers": 8},
    {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 4, "model.n_layers": 8},
    {"parallel.pp": 2, "train.micro_batch": 1},                                                # 8 micro-batches
    {"parallel.pp": 2, "parallel.recompute": "full"},
    {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2,
     "parallel.recompute": "selective"},
    {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2,
     "train.dtype": "bfloat16"},
]
FOUR_RANKS = [
    {"parallel.pp": 4, "parallel.pp_schedule": "gpipe"},
    {"parallel.pp": 4, "parallel.pp_schedule": "1f1b"},
    {"parallel.pp": 4, "parallel.pp_schedule": "1f1b", "train.micro_batch": 1},
    # ZeRO-3 x zero bubble: the I / W passes must see FSDP's unsharded parameters (pipeline._split_backward_stage;
    # without it every stage but 0 lost weight gradients, the head's all of them). 4 micro-batches per dp rank,
    # so forwards (which reshard) run between a micro-batch's I and W passes.
    {"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 3, "train.global_batch": 16,
     "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2},                          # ZBV
    {"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 3, "train.global_batch": 16,
     "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 4, "model.n_layers": 8},     # interleaved ZB
    {"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 3, "train.dtype": "bfloat16",
     "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2},
]


def _cfg(**kw):
    return load_config(TINY, {f"parallel.{k}": v for k, v in kw.items()})


def test_placements_are_one_per_rank_looped_or_v():
    assert [stage_ids(r, _cfg(pp=4)) for r in range(4)] == [[0], [1], [2], [3]]
    interleaved = _cfg(pp=2, pp_virtual=2, pp_schedule="interleaved_1f1b")
    assert [stage_ids(r, interleaved) for r in range(2)] == [[0, 2], [1, 3]]  # looped
    zbv = _cfg(pp=2, pp_virtual=2, pp_schedule="zero_bubble")
    assert schedule_name(zbv) == "ScheduleZBVZeroBubble"
    assert [stage_ids(r, zbv) for r in range(2)] == [[0, 3], [1, 2]]  # V: rank 0 holds the first and last
    zb4 = load_config(TINY, {"parallel.pp": 2, "parallel.pp_virtual": 4, "parallel.pp_schedule": "zero_bubble",
                             "model.n_layers": 8})
    assert schedule_name(zb4) == "ScheduleInterleavedZeroBubble"
    assert [stage_ids(r, zb4) for r in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_stages_split_layers_evenly_and_keep_the_full_models_names():
    cfg = _cfg(pp=2, pp_virtual=2, pp_schedule="interleaved_1f1b")
    model = build_model(cfg)
    full = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for s in range(4):
        assert stage_layers(s, cfg) == [s]
        part = build_stage_module(model, s, cfg)
        for name, p in part.named_parameters():
            assert name not in seen, f"{name} in stages {seen[name]} and {s}"
            seen[name] = s
            assert p.shape == full[name].shape and p is not full[name]  # a copy, same name
            assert p.data_ptr() != full[name].data_ptr()
    assert set(seen) == set(full)
    assert seen["tok_embeddings.weight"] == 0 and seen["output.weight"] == 3 and seen["norm.weight"] == 3
    assert len(dict(model.named_parameters())) == len(full)  # the full model is left intact


def test_too_few_layers_and_ddp_with_zero_bubble_are_refused():
    with pytest.raises(ConfigError):
        _cfg(pp=5)  # 4 layers cannot fill 5 stages (uneven splits are fine: test_pipeline_uneven_moe.py)
    with pytest.raises(ConfigError) as e:
        load_config(TINY, {"parallel.pp": 2, "parallel.dp": 2, "train.global_batch": 16,
                           "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2})
    assert any("parallel.zero=2 or 3" in p.fix for p in e.value.problems)


@pytest.mark.multirank
def test_every_schedule_on_two_ranks_matches_the_reference(tmp_path):
    cfgs = [load_config(TINY, o) for o in TWO_RANKS]
    for o, v in zip(TWO_RANKS, whitebox_batch(cfgs, steps=2, out_dir=tmp_path)):
        assert v.passed, (o, v.failures, v.worst_parameter)
        assert v.n_params_compared == (39 if o.get("model.n_layers", 4) == 4 else 75)


@pytest.mark.multirank
@pytest.mark.slow
def test_four_ranks_match_the_reference(tmp_path):
    """Four stages, and two stages x FSDP ZeRO-3 under the zero-bubble schedules."""
    cfgs = [load_config(TINY, o) for o in FOUR_RANKS]
    for o, v in zip(FOUR_RANKS, whitebox_batch(cfgs, steps=2, out_dir=tmp_path)):
        assert v.passed, (o, v.failures, v.worst_parameter)
        assert v.n_params_compared == (39 if o.get("model.n_layers", 4) == 4 else 75)
