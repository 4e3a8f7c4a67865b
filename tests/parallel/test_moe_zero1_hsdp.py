"""ZeRO-1 and HSDP with expert parallel against the single-device reference, and the bugs they must not have.

    .venv/bin/pytest tests/parallel/test_moe_zero1_hsdp.py -q -n 0

ZeRO-1 (parallel/zero.py): DDP for the dense parameters, the experts' gradients all-reduced over their edp_cp
holders (parallel/expert_parallel.py), one ZeroRedundancyOptimizer per group. HSDP (dp_replicate > 1): the dense
units on (replicas, shard), the expert units on their holders as (replicas, shard) (mesh.expert_fsdp_mesh),
divided by dp * cp. One forkserver launch on 4 CPU ranks runs the layouts and the planted bugs, each of which
must fail and name an expert weight.
"""

from __future__ import annotations

import re

import pytest
from curry_train.config import ConfigError, load_config
from curry_train.estimator import _states, layout_of
from curry_train.rules import check
from curry_train.wrapping import expert_replicas

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(900)
MOE = PRESETS / "tiny-moe.yaml"
FRONTIER = {"model.n_shared_experts": 1, "model.first_k_dense": 1, "model.dense_d_ff": 96}
# dp4 = 2 EP groups x 2 expert holders; two micro-batches a rank (DDP's deferred sync, FSDP's per-micro reduce)
ZERO1 = {**FRONTIER, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 1, "train.global_batch": 16,
         "train.weight_decay": 0.1}
HSDP = {**FRONTIER, "parallel.dp": 4, "parallel.ep": 2, "parallel.dp_replicate": 2, "parallel.zero": 3,
        "train.global_batch": 16}
PASS = [
    ZERO1,
    HSDP,
    {**HSDP, "parallel.zero": 2},
    {**FRONTIER, "parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1, "train.global_batch": 16},
    {**HSDP, "parallel.ep": 4},  # EP spans both replicas: each expert shard has one holder (expert_replicas 1)
    {**HSDP, "parallel.dp": 2, "parallel.cp": 2},  # EP over the replicas, the experts sharded over cp inside one
]
BUGS = [
    (ZERO1, "ep-expert-unreduced"),  # the expert replica all-reduce over edp_cp skipped
    (ZERO1, "ep-expert-ep-averaged"),
    (HSDP, "ep-expert-ep-averaged"),
    (HSDP, "hsdp-expert-no-replica-allreduce"),  # the expert all-reduce across the HSDP replicas skipped
]


def test_whitebox_zero1_and_hsdp_with_ep_four_ranks_and_their_planted_bugs(tmp_path):
    cfgs = [load_config(MOE, o) for o in PASS] + [load_config(MOE, o) for o, _ in BUGS]
    inject = [None] * len(PASS) + [b for _, b in BUGS]
    verdicts = whitebox_batch(cfgs, steps=2, out_dir=tmp_path, inject=inject, timeout=900)
    for o, v in zip(PASS, verdicts, strict=False):
        assert v.passed, f"{o}: {v.failures[:5]} worst={v.worst_parameter}"
    for (o, bug), v in zip(BUGS, verdicts[len(PASS):], strict=True):
        assert not v.passed, f"{bug} on {o} was not caught"
        assert re.search(r"\.experts\.", v.worst_parameter.name), (bug, v.worst_parameter.name)
        assert v.first_diverging_layer == "layers.1", (bug, v.first_diverging_layer)  # layers.0 is dense


def test_the_expert_hsdp_mesh_lines_up_with_the_replica_groups():
    assert expert_replicas(4, 1, 2, 2) == 2  # EP inside a replica: (2 replicas, 1 holder each)
    assert expert_replicas(8, 1, 2, 2) == 2  # (2 replicas, 2 holders each)
    assert expert_replicas(4, 1, 4, 2) == 1  # EP spans both replicas: one holder, nothing to replicate
    assert expert_replicas(8, 1, 4, 4) == 2  # EP spans 2 of 4 replicas: its holders sit in 2 of them
    assert expert_replicas(4, 2, 2, 1) == 1
    assert expert_replicas(12, 1, 3, 3) is None  # replica groups of 4 dp ranks, EP groups of 3: they cut across
    est = layout_of(load_config(MOE, HSDP))
    assert (est.shard, est.expert_shard) == (2, 1)


def test_rules_accept_zero1_and_hsdp_with_ep_and_refuse_what_is_not_proven():
    assert check(load_config(MOE, ZERO1)) == []
    assert check(load_config(MOE, HSDP)) == []
    bad = {"parallel.dp": 12, "parallel.ep": 3, "parallel.dp_replicate": 3, "parallel.zero": 3,
           "model.num_experts": 3, "model.top_k": 2, "train.global_batch": 24, "hardware.nodes": 2}
    with pytest.raises(ConfigError) as e:
        load_config(MOE, bad)
    assert any({"parallel.dp_replicate", "parallel.ep"} <= set(p.fields) for p in e.value.problems), e.value
    # ZeRO-1 under TP runs on FSDP2 holding the step (wrapping.py), the experts in their own units: accepted
    # (white-boxed in tests/parallel/test_tp_ep.py)
    assert check(load_config(MOE, {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1, "parallel.tp": 2,
                                   "parallel.sp": True})) == []


def test_zero1_expert_optimizer_state_is_sharded_over_the_expert_holders():
    """parallel/zero.py: the experts' AdamW state is split over their edp_cp holders, the rest over dp x cp."""
    ddp = _states(layout_of(load_config(MOE, {**ZERO1, "parallel.zero": 0})), [0])
    z1 = _states(layout_of(load_config(MOE, ZERO1)), [0])
    assert z1.params == ddp.params and z1.ddp_buckets == ddp.ddp_buckets
    assert ddp.opt / 4 < z1.opt < ddp.opt / 1.5  # dense over 4 ranks, experts over their 2 holders


def _optimizer_bytes(rank: int, world: int) -> list[dict]:
    from curry_train.parallel.zero import zero_optimizers
    from curry_train.train.loop import init_distributed, setup, train_step

    out = []
    for o in (ZERO1, HSDP):
        cfg = load_config(MOE, o)
        par = setup(cfg, init_distributed(cfg))
        train_step(par, 0, read=True)  # AdamW allocates its state in the first step
        states = [v for z in zero_optimizers(par.optimizer) for st in getattr(z, "optim", z).state.values()
                  for v in st.values()]
        local = [v.to_local() if hasattr(v, "to_local") else v for v in states]
        expert = next(p for part in par.parts for p in part.parameters() if getattr(p, "_curry_expert", False))
        out.append({"opt": sum(t.numel() * t.element_size() for t in local), "optims": len(zero_optimizers(
            par.optimizer)), "mesh": getattr(getattr(expert, "device_mesh", None), "mesh_dim_names", None)})
    return out


def test_optimizer_state_per_rank_is_the_estimators():
    """ZeRO-1: two ZeroRedundancyOptimizers, the worst rank's AdamW bytes exactly the estimate (dense greedy
    partition over dp4 plus the experts' over their 2 holders); HSDP: the expert units on the 2-D holder mesh."""
    from curry_train.train.launch import launch_forkserver

    res = launch_forkserver(_optimizer_bytes, 4, timeout=600)
    for i, o in enumerate((ZERO1, HSDP)):
        est = _states(layout_of(load_config(MOE, o)), [0]).opt
        assert max(r[i]["opt"] for r in res) == est, (o, [r[i]["opt"] for r in res], est)
    assert [r[0]["optims"] for r in res] == [2] * 4
    assert len({r[0]["opt"] for r in res}) > 1  # the partitions differ per rank: a real split, not a copy
    assert all(r[1]["mesh"] == ("edp_replicate", "edp_shard_cp") for r in res), res


@pytest.mark.timeout(900)
def test_checkpoint_of_zero1_and_hsdp_with_ep_resumes_in_the_other_layout(tmp_path):
    """Each layout saves at step 2 (experts under their global index, ZeRO-1's AdamW state on its owners only)
    and the other resumes it: the four losses are the uninterrupted single-device run's."""
    from curry_train.train.jobs import rank_jobs
    from curry_train.train.launch import launch_forkserver
    from curry_train.train.loop import run_training

    steps = {"train.steps": 4, "train.lr_schedule": "cosine", "train.warmup_steps": 1, "train.grad_clip": 0.5}
    ref = run_training(load_config(MOE, {**FRONTIER, **steps, "train.global_batch": 16,
                                         "train.weight_decay": 0.1}))["losses"]
    layouts = [{**ZERO1, **steps}, {**HSDP, **steps, "train.weight_decay": 0.1}]

    def spec(o, **kw):
        return {"kind": "train", "config": load_config(MOE, o).to_dict(), "out_dir": str(tmp_path), **kw}

    first = launch_forkserver(rank_jobs, 4, [spec(o, checkpoint_dir=str(tmp_path / f"ck{i}"), save_every=2)
                                             for i, o in enumerate(layouts)], timeout=600)[0]
    resumed = launch_forkserver(rank_jobs, 4, [spec(layouts[1 - i], resume=str(tmp_path / f"ck{i}" / "step-000002"))
                                               for i in range(2)], timeout=600)[0]
    for i in range(2):
        assert first[i]["losses"][:2] + resumed[i]["losses"] == pytest.approx(ref, rel=1e-5), (i, ref)


def test_the_planner_searches_zero1_and_hsdp_with_ep():
    """Mixtral 8x7B on 4 nodes of 8: ZeRO-1 with EP and HSDP with EP are ranked beside the rest (both were
    refused by the rules, so the search never priced them), each a config the rules accept."""
    from curry_train.advice.planner import plan
    from curry_train.config import Config

    p = plan("mixtral-8x7b", 8, 4, 80.0, 4096, 256, top=100_000)
    z1 = [r for r in p.ranked if r.parallel["zero"] == 1 and r.parallel["ep"] > 1]
    hsdp = [r for r in p.ranked if r.parallel["dp_replicate"] > 1 and r.parallel["ep"] > 1]
    assert z1 and hsdp, (len(z1), len(hsdp))
    base = load_config(PRESETS / "mixtral-8x7b.yaml",
                       {"hardware.nodes": 4, "train.seq_len": 4096, "train.global_batch": 256})
    for r in z1 + hsdp:
        raw = base.to_dict()
        raw["parallel"].update(r.parallel)
        raw["train"]["micro_batch"] = r.micro_batch
        assert check(Config.model_validate(raw)) == [], r.parallel
        assert expert_replicas(r.parallel["dp"], r.parallel["cp"], r.parallel["ep"], r.parallel["dp_replicate"])
