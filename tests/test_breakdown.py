"""One memory model (issue 19, item 5): the estimate and the measurement split a rank's peak into the same
categories (curry_train/breakdown.py), so they agree category by category, not only in total.

    .venv/bin/pytest tests/test_breakdown.py -q
"""

from __future__ import annotations

import pytest
from curry_train.breakdown import CATEGORIES
from curry_train.config import from_dict
from curry_train.estimator import estimate, load_any
from curry_train.measure.bench import fold


def test_the_estimate_uses_the_shared_categories_and_they_sum_to_its_total():
    for over in ({}, {"parallel.dp": 2}, {"parallel.dp": 2, "parallel.zero": 3}, {"parallel.pp": 2}):
        m = estimate(load_any("tiny", over)).memory
        assert tuple(m.by_category()) == CATEGORIES and sum(m.by_category().values()) == m.total, over
    ddp = estimate(load_any("tiny", {"parallel.dp": 2})).memory
    assert ddp.grads > 0 and ddp.grad_buffers == 0  # gradient_as_bucket_view: DDP's buckets are the grads
    # the loss gradients at the loss backward, not "other" (unchunked: with train.loss_chunks=0, the default, one
    # chunk's are small and tiny's peak is the LM head's backward)
    unchunked = estimate(load_any("tiny", {"parallel.dp": 2, "train.loss_chunks": 1})).memory
    assert unchunked.phase == "loss backward" and unchunked.loss == 2 * 4 * 2 * 64 * 256
    assert estimate(load_any("tiny", {"parallel.pp": 2})).memory.pp_buffers > 0
    assert estimate(load_any("tiny", {"parallel.dp": 2, "parallel.zero": 3})).memory.param_copies > 0


@pytest.mark.multirank
def test_tiny_dp2_and_pp2_estimate_and_measurement_agree_per_category():
    from curry_train.measure.memory import memory_spec
    from curry_train.train.jobs import rank_jobs
    from curry_train.train.launch import launch_forkserver

    cfgs = [from_dict(load_any("tiny").to_dict(), ov) for ov in ({"parallel.dp": 2}, {"parallel.pp": 2})]
    specs = [memory_spec(c) for c in cfgs]
    per_rank = launch_forkserver(rank_jobs, 2, specs, timeout=300)
    for i, cfg in enumerate(cfgs):
        reports = [per_rank[r][i] for r in range(2)]
        worst = max(reports, key=lambda rep: rep["peak"])
        measured = fold(worst, peak=worst["peak"], rank=worst["rank"]).by_category()
        est = estimate(cfg).memory.by_category()
        assert sum(measured.values()) == worst["peak"]
        exact = ("params", "param_copies", "grads", "grad_buffers", "optimizer", "pp_buffers")
        assert {k: est[k] for k in exact} == {k: measured[k] for k in exact}, (cfg.parallel, est, measured)
        for k in ("activations", "loss", "other"):  # op-granular transients: within 2% of the peak
            assert abs(est[k] - measured[k]) <= 0.02 * worst["peak"], (cfg.parallel, k, est[k], measured[k])
