"""TP with MoE: attention, dense blocks and shared experts tensor-parallel, the experts expert-parallel over the
dp x tp ranks (Megatron-LM's expert-tensor-parallel size 1), each tp rank routing its own sequence shard (SP).

    .venv/bin/pytest tests/parallel/test_tp_ep.py -q -n 0

Every layout against the single-device reference through the white-box harness (one forkserver launch per world
size, validation/whitebox.py's fp32 tolerances), and the two planted bugs of the layout caught: the router's
gradient left un-summed over tp, and the whole sequence dispatched by every tp rank (tokens counted tp times).
"""

from __future__ import annotations

import pytest
import torch
from curry_train.config import ConfigError, load_config
from curry_train.mesh import Topology, expert_rank_grid

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(900)
MOE = PRESETS / "tiny-moe.yaml"
# a dense first block and a shared expert: both tensor-parallel next to the expert-parallel experts
FRONTIER = {"model.n_shared_experts": 1, "model.first_k_dense": 1, "model.dense_d_ff": 96}
TPEP = {**FRONTIER, "parallel.tp": 2, "parallel.sp": True, "parallel.ep": 2}

WORLD2 = [TPEP]  # the EP group is the tp pair
WORLD4 = [
    {**TPEP, "parallel.dp": 2, "parallel.zero": 3},  # FSDP: experts over edp = the dp pair, EP = the tp pair
    {**TPEP, "parallel.dp": 2, "parallel.zero": 2, "parallel.ep": 4},  # EP over all dp x tp ranks
    {**TPEP, "parallel.pp": 2},  # a dense + MoE stage, then a MoE stage, each TP2 + EP2
    {**TPEP, "parallel.dp": 2, "parallel.zero": 3, "parallel.recompute": "selective", "model.z_loss_coef": 1e-3},
    {**TPEP, "parallel.dp": 2, "parallel.zero": 3, "parallel.ep": 1},  # ep 1: the sequence gathered, shared TP
    # ZeRO-1 under TP: FSDP2 holding the step (wrapping.py), the experts in their own units over edp (selective
    # recompute: the held units and the saved all-to-alls), and EP over all four ranks
    {**TPEP, "parallel.dp": 2, "parallel.zero": 1, "parallel.recompute": "selective"},
    {**TPEP, "parallel.dp": 2, "parallel.zero": 1, "parallel.ep": 4},
]
# the experts' reduced gradients averaged over the EP group as well (their units' all-reduce hook): caught
BUGS4 = [({**TPEP, "parallel.dp": 2, "parallel.zero": 1}, "ep-expert-ep-averaged")]


def _assert_passed(overrides, verdicts):
    for o, v in zip(overrides, verdicts, strict=True):
        assert v.passed, f"{o}: {v.failures[:5]} worst={v.worst_parameter}"


@pytest.mark.multirank
def test_whitebox_tp_with_ep_two_ranks(tmp_path):
    _assert_passed(WORLD2, whitebox_batch([load_config(MOE, o) for o in WORLD2], steps=2, out_dir=tmp_path))


@pytest.mark.multirank
def test_whitebox_tp_with_ep_four_ranks(tmp_path):
    cfgs = [load_config(MOE, o) for o in WORLD4 + [o for o, _ in BUGS4]]
    verdicts = whitebox_batch(cfgs, steps=2, out_dir=tmp_path, inject=[None] * len(WORLD4) + [b for _, b in BUGS4])
    _assert_passed(WORLD4, verdicts[:len(WORLD4)])
    for (o, bug), v in zip(BUGS4, verdicts[len(WORLD4):], strict=True):
        assert not v.passed and ".experts." in v.worst_parameter.name, (bug, o, v.failures[:3])


@pytest.mark.multirank
def test_planted_tp_ep_bugs_fail_the_whitebox(tmp_path):
    cfg = load_config(MOE, TPEP)
    names = ["tp-ep-router-unreduced", "tp-ep-tokens-twice"]
    verdicts = whitebox_batch([cfg, cfg], steps=2, out_dir=tmp_path, inject=names)
    router, twice = verdicts
    assert not router.passed and "router.gate" in router.worst_parameter.name, router.failures[:3]
    assert all("experts." not in f for f in router.failures), router.failures  # only the router is touched
    assert not twice.passed and any("experts." in f for f in twice.failures), twice.failures[:3]


def test_ep_group_spans_the_tp_ranks_first():
    """Megatron's expert rank order with expert-tensor-parallel size 1: tp fastest, then ep, then dp."""
    topo = Topology(dp=2, tp=2, ep=2)
    assert topo.ep_over_tp and not Topology(dp=2, ep=2).ep_over_tp
    grid = expert_rank_grid(topo)  # [pp, edp, ep, 1, 1]
    assert grid[0, :, :, 0, 0].tolist() == [[0, 1], [2, 3]]  # EP groups = the tp pairs, edp = the dp ranks
    assert expert_rank_grid(Topology(dp=2, tp=2, ep=4))[0, 0, :, 0, 0].tolist() == [0, 1, 2, 3]
    assert torch.equal(expert_rank_grid(Topology(dp=4, ep=2)).flatten(), torch.arange(4))
    with pytest.raises(ValueError, match="dp\\*tp"):
        Topology(dp=1, tp=2, ep=4)


@pytest.mark.parametrize("overrides, fields, fix", [
    ({"parallel.sp": False}, {"parallel.sp", "parallel.ep", "parallel.tp"}, "parallel.sp=true"),
    ({"parallel.ep": 4}, {"parallel.ep", "parallel.dp", "parallel.tp"}, "use ep in [1, 2]"),
    ({"model.capacity_factor": 1.0}, {"model.capacity_factor", "parallel.ep", "parallel.tp"}, "capacity_factor=0"),
    ({"model.shared_d_ff": 33}, {"model.shared_d_ff", "parallel.tp"}, "divides 33"),
])
def test_tp_with_ep_refusals_name_the_fields_and_the_fix(overrides, fields, fix):
    with pytest.raises(ConfigError) as e:
        load_config(MOE, {**TPEP, **overrides})
    hit = [p for p in e.value.problems if fields <= set(p.fields)]
    assert hit and fix in hit[0].fix, e.value


def test_tp_with_ep_is_accepted_without_dp_dividing_ep():
    cfg = load_config(MOE, TPEP)  # dp = 1: the EP group is carved from the tp ranks alone
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.ep) == (1, 2, 2)


def test_the_planner_searches_tp_with_ep_for_mixtral():
    """Mixtral 8x7B on 16 H100: TP + EP layouts (EP over dp x tp, SP on) are enumerated, and some fit."""
    from curry_train.advice.planner import plan

    p = plan("mixtral-8x7b", 8, 2, gpu="H100", top=40)
    both = [r.parallel for r in p.ranked if r.parallel["tp"] > 1 and r.parallel["ep"] > 1]
    assert both and all(q["sp"] for q in both), [r.parallel for r in p.ranked][:5]
    assert any(q["ep"] > q["dp"] for q in both)  # an EP group wider than dp: it spans the tp ranks


@pytest.mark.multirank
def test_a_tp_ep_checkpoint_resumes_on_one_device_as_the_uninterrupted_run(tmp_path):
    """Experts saved under their global index from an EP group over the tp ranks (train/checkpoint.py)."""
    from curry_train.train.jobs import rank_jobs
    from curry_train.train.launch import launch_forkserver

    from tests.test_checkpoint import _single, _spec

    ref = _single(tmp_path, FRONTIER, base=MOE)["losses"]
    ck = tmp_path / "tpep"
    first = launch_forkserver(rank_jobs, 2, [_spec(TPEP, MOE, checkpoint_dir=str(ck), save_every=2)],
                              timeout=600)[0][0]["losses"]
    resumed = _single(tmp_path, FRONTIER, base=MOE, resume=str(ck / "step-000002"))["losses"]
    assert first[:2] + resumed == pytest.approx(ref, rel=1e-5)
