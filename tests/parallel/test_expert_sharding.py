"""FSDP2 shards experts over the expert-data-parallel ranks on a hidden dim when whole experts do not
split evenly (expert_parallel.expert_shard_placement): every rank holds 1/(ep * edp) of the expert weights.

    .venv/bin/pytest tests/parallel/test_expert_sharding.py -x -q
"""

from __future__ import annotations

import pytest
from curry_train.config import load_config
from curry_train.estimator import _states, layout_of
from curry_train.train.launch import launch_forkserver

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(600)
MOE = PRESETS / "tiny-moe.yaml"
# El = 1 expert per rank over edp = 2 ranks: dim 0 cannot split (it was padding before); El = 2: it can
LAYOUTS = [{"model.num_experts": 2, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 3},
           {"model.num_experts": 4, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 3}]


def _expert_bytes(rank: int, world: int) -> list[dict]:
    from curry_train.parallel.expert_parallel import is_expert_param
    from curry_train.train.loop import init_distributed, setup

    out = []
    for o in LAYOUTS:
        cfg = load_config(MOE, o)
        par = setup(cfg, init_distributed(cfg))
        local = [p.to_local() for part in par.parts for p in part.parameters() if is_expert_param(p)]
        every = [p.to_local() for part in par.parts for p in part.parameters()]
        out.append({"bytes": sum(t.numel() * t.element_size() for t in local),
                    "all_bytes": sum(t.numel() * t.element_size() for t in every),
                    "placement": str(next(p for p in par.parts[0].parameters() if is_expert_param(p)).placements)})
    return out


def test_every_rank_holds_one_over_ep_times_edp_of_the_experts():
    res = launch_forkserver(_expert_bytes, 4, timeout=300)
    for i, o in enumerate(LAYOUTS):
        m = load_config(MOE, o).model
        total = m.n_layers * 3 * m.num_experts * m.d_model * m.d_ff * 4  # fp32 w1, w3, w2 of every layer
        per_rank = [r[i]["bytes"] for r in res]
        assert per_rank == [total // 4] * 4, (o, per_rank, total)  # ep * edp = 4: no padding
        print(f"\n{o}: expert bytes per rank {per_rank} of {total} ({res[0][i]['placement']})")
        # the estimator's stored parameters are rank 0's (FSDP2 pads uneven dense dims there, e.g. the router)
        assert 4 * _states(layout_of(load_config(MOE, o)), [0]).n_stored == res[0][i]["all_bytes"]

def test_whitebox_experts_sharded_on_a_hidden_dim(tmp_path):
    cfgs = [load_config(MOE, o) for o in LAYOUTS]
    for o, v in zip(LAYOUTS, whitebox_batch(cfgs, steps=2, out_dir=tmp_path)):
        assert v.passed, f"{o}: {v.failures[:5]} worst={v.worst_parameter}"
