"""MoE as DeepSeek-V2/V3 build it: shared experts, dense first blocks, group-limited (node-limited) routing.

    .venv/bin/pytest tests/parallel/test_moe_frontier.py -q -n 0

The routing rule and the stage split are checked directly; every parallel path (EP over DDP and FSDP2, PP with a
dense-first model, recompute) against the single-device reference through the white-box harness, one forkserver
launch per world size, at validation/whitebox.py's fixed fp32 tolerances.
"""

from __future__ import annotations

import pytest
import torch
from curry_train.config import ConfigError, load_config
from curry_train.estimator import estimate
from curry_train.model.gpt import FeedForward, build_model, count_params
from curry_train.model.moe import MoE, group_limited
from curry_train.pipeline_split import split_costs, split_for, split_layers

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(600)
MOE = PRESETS / "tiny-moe.yaml"
# one shared expert (width d_ff = 128), the first block dense with its own width, node-limited routing
FRONTIER = {"model.n_shared_experts": 1, "model.first_k_dense": 1, "model.dense_d_ff": 96}
GROUPS = {"model.route_groups": 2, "model.route_top_groups": 1}

WORLD2 = [
    {**FRONTIER, "parallel.dp": 2, "parallel.ep": 2},  # DDP: shared experts all-reduced, experts over edp
    {**GROUPS, "parallel.dp": 2, "parallel.ep": 2, "model.capacity_factor": 1.0},  # node-limited + dropping
    {**FRONTIER, **GROUPS, "parallel.pp": 2, "model.first_k_dense": 2},  # a dense stage and a MoE stage
    {**FRONTIER, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3},  # FSDP2: shared experts in the block
    {**FRONTIER, "parallel.dp": 2, "parallel.zero": 2, "parallel.recompute": "selective"},  # ep 1, SAC
    # the shared expert overlapped with the combine all-to-all under SAC (its output saved, not replayed)
    {**FRONTIER, "parallel.dp": 2, "parallel.ep": 2, "parallel.recompute": "selective"},
]
WORLD4 = [
    {**FRONTIER, **GROUPS, "parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "train.global_batch": 16},
    {**FRONTIER, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 3, "parallel.recompute": "full"},
    # zero bubble's split backward (input pass, then weight pass) through the overlapped combine's transpose
    {**FRONTIER, "parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2, "parallel.dp": 2,
     "parallel.ep": 2, "parallel.zero": 2, "train.global_batch": 16, "model.aux_loss_coef": 0.0,
     "model.z_loss_coef": 0.0},
]


def _assert_passed(overrides, verdicts):
    for o, v in zip(overrides, verdicts, strict=True):
        assert v.passed, f"{o}: {v.failures[:5]} worst={v.worst_parameter}"


def test_whitebox_frontier_moe_two_ranks(tmp_path):
    cfgs = [load_config(MOE, o) for o in WORLD2]
    _assert_passed(WORLD2, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


def test_whitebox_frontier_moe_four_ranks(tmp_path):
    cfgs = [load_config(MOE, o) for o in WORLD4]
    _assert_passed(WORLD4, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


def test_blocks_shared_experts_and_parameter_count():
    cfg = load_config(MOE, FRONTIER)
    model = build_model(cfg)
    first, later = model.layers["0"].feed_forward, model.layers["1"].feed_forward
    assert isinstance(first, FeedForward) and first.w1.weight.shape == (96, 64)
    assert isinstance(later, MoE) and later.shared_experts.w1.weight.shape == (128, 64)
    assert load_config(MOE, {**FRONTIER, "model.n_shared_experts": 2}).model.n_shared_experts == 2
    two = build_model(load_config(MOE, {**FRONTIER, "model.n_shared_experts": 2}))
    assert two.layers["1"].feed_forward.shared_experts.w1.weight.shape == (256, 64)  # 2 x d_ff, fused
    sized = build_model(load_config(MOE, {**FRONTIER, "model.shared_d_ff": 40}))
    assert sized.layers["1"].feed_forward.shared_experts.w2.weight.shape == (64, 40)
    for c, m in ((cfg, model), (load_config(MOE, {**FRONTIER, "model.shared_d_ff": 40}), sized)):
        assert estimate(c).param_count == count_params(m)  # the estimator counts both block kinds exactly


def test_group_limited_routing_keeps_each_token_in_its_best_groups():
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(64, 8, generator=g).softmax(-1)  # [N, E], 4 groups of 2
    masked = group_limited(probs, groups=4, top_groups=2)
    chosen = masked.topk(3, dim=-1).indices // 2  # [N, K] group of each choice
    score = probs.view(64, 4, 2).sum(-1)  # top-2 of a 2-expert group = its sum
    best = score.topk(2, dim=-1).indices
    for n in range(64):
        assert set(chosen[n].tolist()) <= set(best[n].tolist())
    kept = masked > 0
    assert torch.equal(masked[kept], probs[kept])  # gates keep the original probabilities
    assert int(kept.sum(-1).max()) == 4


def test_pipeline_split_prices_dense_blocks_below_moe_blocks():
    even = split_for(load_config(MOE, {"parallel.pp": 2, "model.n_layers": 6}))
    dense_first = split_for(load_config(MOE, {"parallel.pp": 2, "model.n_layers": 6, "model.first_k_dense": 3,
                                              "model.dense_d_ff": 32}))
    assert even == (3, 3) and dense_first[0] > 3, (even, dense_first)


def test_unequal_cost_split_is_the_uniform_split_when_costs_are_equal():
    for L, S, c, first, last in ((13, 4, 5, 1, 2), (126, 16, 10, 1, 3), (61, 16, 7, 0, 40), (9, 9, 3, 5, 5)):
        assert split_costs((c,) * L, S, first, last) == split_layers(L, S, c, first, last)
    assert split_costs((1, 1, 1, 9, 9, 9), 2) == (4, 2)  # cheap dense layers: the first stage takes one more


@pytest.mark.parametrize("overrides, fields", [
    ({"model.first_k_dense": 4}, {"model.first_k_dense", "model.n_layers"}),
    ({"model.dense_d_ff": 64}, {"model.dense_d_ff", "model.first_k_dense"}),
    ({"model.shared_d_ff": 64}, {"model.shared_d_ff", "model.n_shared_experts"}),
    ({"model.route_groups": 3}, {"model.route_groups", "model.num_experts"}),
    ({"model.route_groups": 2, "model.route_top_groups": 3}, {"model.route_top_groups", "model.route_groups"}),
    ({"model.route_groups": 4, "model.route_top_groups": 1}, {"model.route_top_groups", "model.top_k"}),
    ({"model.num_experts": 0, "model.n_shared_experts": 1}, {"model.n_shared_experts", "model.num_experts"}),
])
def test_bad_frontier_settings_are_refused_naming_the_fields(overrides, fields):
    with pytest.raises(ConfigError) as e:
        load_config(MOE, overrides)
    assert fields <= {f for p in e.value.problems for f in p.fields}, e.value
