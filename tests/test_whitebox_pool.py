"""The tests' white-box pool (tests/whitebox_pool.py): a config white-boxed once in this process is not launched
again, and what differs in steps or planted bug is a run of its own. The launch is replaced by a recorder here; the
real launches are every white-box test's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from curry_train.config import load_config

from tests import whitebox_pool as pool
from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"


def test_the_pool_launches_each_config_steps_and_bug_once(monkeypatch, tmp_path):
    launched: list[list] = []

    def launch(cfgs, *, steps, out_dir, timeout, inject, inject_target):
        launched.append([(c.parallel.dp, c.parallel.tp, steps, n) for c, n in zip(cfgs, inject)])
        return [SimpleNamespace(dp=c.parallel.dp, tp=c.parallel.tp, steps=steps, injection=n)
                for c, n in zip(cfgs, inject)]

    monkeypatch.setattr(pool._wb, "whitebox_batch", launch)
    monkeypatch.setattr(pool, "_VERDICTS", {})
    dp2, tp2, cp2 = (load_config(TINY, o) for o in ({"parallel.dp": 2}, {"parallel.tp": 2}, {"parallel.cp": 2}))
    first = pool.whitebox_batch([dp2, tp2, dp2], steps=2, out_dir=tmp_path)
    assert launched == [[(2, 1, 2, None), (1, 2, 2, None)]]  # the repeated config within one call: once
    assert [(v.dp, v.tp) for v in first] == [(2, 1), (1, 2), (2, 1)] and first[0] is not first[2]  # own copies
    again = pool.whitebox_batch([tp2, dp2], steps=2, out_dir=tmp_path)
    assert len(launched) == 1 and [(v.dp, v.tp) for v in again] == [(1, 2), (2, 1)]  # nothing launched
    pool.whitebox_batch([dp2, dp2], steps=3, out_dir=tmp_path, inject=[None, "ddp-unreduced-grad"])
    assert launched[1] == [(2, 1, 3, None), (2, 1, 3, "ddp-unreduced-grad")]  # other steps, a planted bug: new runs
    # steps None: each config's own default horizon (2 for tiny, 3 through a 2-step warm-up), resolved by
    # whitebox_batch per config and keyed so here: dp2 at 2 steps is pooled, the warm-up config is new
    warm = load_config(TINY, {"parallel.dp": 2, "train.warmup_steps": 2})
    pool.whitebox_batch([cp2, dp2, warm], out_dir=tmp_path)
    assert launched[2] == [(1, 1, None, None), (2, 1, None, None)]
    pool.whitebox_batch([warm], steps=3, out_dir=tmp_path)  # its default horizon, asked for by number: pooled
    with pytest.raises(ValueError, match="one world size"):  # as whitebox_batch, though dp2 is pooled
        pool.whitebox_batch([dp2, load_config(TINY, {"parallel.dp": 4})], steps=2, out_dir=tmp_path)
    assert len(launched) == 3
