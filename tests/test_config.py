"""The config contract: validation before launch, errors that name fields and fixes, dotted overrides."""

from __future__ import annotations

import pytest
from curry_train.config import Config, ConfigError, check, from_dict, load_config, parse_sets

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"

# Every override set the parallel issues use must validate on tiny.
VALID_ON_TINY = [
    {}, {"parallel.dp": 2}, {"parallel.dp": 4}, {"parallel.dp": 2, "parallel.zero": 3},
    {"parallel.recompute": "selective"}, {"parallel.tp": 2}, {"parallel.tp": 4},
    {"parallel.tp": 2, "parallel.sp": True},
    {"parallel.pp": 2}, {"parallel.pp": 4}, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
    {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2},
    {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2},
    {"parallel.dp": 2, "parallel.zero": 3, "parallel.tp": 2, "parallel.sp": True},
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 3},
    {"parallel.cp": 2}, {"parallel.cp": 4}, {"parallel.dp": 2, "parallel.cp": 2, "parallel.zero": 3},
    {"parallel.cp": 2, "parallel.tp": 2, "parallel.zero": 3},
]


@pytest.mark.parametrize("overrides", VALID_ON_TINY)
def test_tiny_accepts_every_override_set_the_parallel_issues_use(overrides):
    cfg = load_config(TINY, overrides)
    assert cfg.world_size == cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp


def test_tiny_moe_accepts_expert_parallel_layouts():
    for o in ({"parallel.dp": 2, "parallel.ep": 2}, {"parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 3}):
        assert load_config(PRESETS / "tiny-moe.yaml", o).model.num_experts == 4


def test_pp_layers_errors_say_what_is_wrong_and_the_fix():
    _, text = _fields({"parallel.pp": 2, "parallel.pp_layers": [3, 2]})
    assert "sums to 5, not n_layers=4" in text and "2 positive layer counts summing to 4" in text
    _, text = _fields({"parallel.pp": 2, "parallel.pp_layers": [4, 0]})
    assert "a stage with no layer" in text
    assert load_config(TINY, {"parallel.pp": 2, "parallel.pp_layers": [3, 1]}).parallel.pp_layers == [3, 1]


def test_ep_that_does_not_divide_num_experts_is_refused_with_a_fix():
    with pytest.raises(ConfigError) as e:
        load_config(PRESETS / "tiny-moe.yaml", {"parallel.dp": 3, "parallel.ep": 3,
                                                          "train.global_batch": 12})
    assert any("model.num_experts" in p.fields and "use ep in [1, 2, 4]" in p.fix for p in e.value.problems)


def _fields(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    return {f for p in e.value.problems for f in p.fields}, str(e.value)


def test_tp_that_does_not_divide_heads_names_both_fields_and_a_fix():
    fields, text = _fields({"parallel.tp": 3})
    assert {"model.n_heads", "parallel.tp"} <= fields
    assert "n_heads=8" in text and "tp=3" in text and "Fix: use tp in [2, 4, 8]" in text


@pytest.mark.parametrize("overrides,expected", [
    ({"parallel.pp": 5}, "model.n_layers"),  # 4 layers cannot fill 5 stages (uneven splits are fine)
    ({"parallel.pp": 2, "parallel.pp_layers": [3, 2]}, "parallel.pp_layers"),  # sums to 5, not n_layers=4
    ({"parallel.pp": 2, "parallel.pp_layers": [4, 0]}, "parallel.pp_layers"),  # a stage with no layer
    ({"parallel.pp": 2, "parallel.pp_layers": [1, 1, 2]}, "parallel.pp_layers"),  # 3 entries for 2 stages
    ({"parallel.cp": 3}, "train.seq_len"),
    ({"parallel.dp": 3}, "train.global_batch"),
    ({"parallel.ep": 2}, "model.num_experts"),
    ({"parallel.sp": True}, "parallel.sp"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b"}, "parallel.pp_virtual"),
    ({"parallel.pp": 4, "train.micro_batch": 4}, "parallel.pp"),
    ({"parallel.tp": 16, "model.n_heads": 16, "model.n_kv_heads": 16, "model.d_model": 128, "model.d_ff": 256},
     "hardware.gpus_per_node"),
    ({"model.n_kv_heads": 3}, "model.n_kv_heads"),
])
def test_each_rule_names_the_field_that_breaks_it(overrides, expected):
    fields, _ = _fields(overrides)
    assert expected in fields


def test_unknown_keys_are_errors_at_every_level():
    with pytest.raises(ConfigError, match="parallel.dpp"):
        from_dict({"parallel": {"dpp": 2}})
    with pytest.raises(ConfigError, match="optimizer"):
        from_dict({"optimizer": {}})
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict({}, {"parallel.dpp": 2})


def test_wrong_types_name_the_field():
    with pytest.raises(ConfigError) as e:
        from_dict({"parallel": {"zero": 5}})
    assert e.value.problems[0].fields == ["parallel.zero"]


def test_overrides_do_not_touch_the_file_and_parse_yaml_scalars():
    before = TINY.read_bytes()
    cfg = load_config(TINY, parse_sets(["parallel.dp=2", "train.lr=1e-3", "parallel.sp=false", "train.dtype=bfloat16"]))
    assert (cfg.parallel.dp, cfg.train.lr, cfg.parallel.sp, cfg.train.dtype) == (2, 1e-3, False, "bfloat16")
    assert TINY.read_bytes() == before


def test_defaults_are_the_tiny_model_and_valid():
    assert check(Config()) == []
