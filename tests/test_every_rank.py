"""Every pipeline rank's memory decides "fits", through one function (estimator/need.py) that estimate,
quick_layout and the planner's rows all read; its fast path (rank classes) equals evaluating every rank.

    .venv/bin/python -m pytest tests/test_every_rank.py -q
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from curry_train.advice import search as search_mod
from curry_train.advice.planner import plan
from curry_train.estimator import (
    GiB,
    estimate,
    layout_need,
    layout_need_every_rank,
    layout_of,
    load_any,
    quick_layout,
    rank_need,
)
from curry_train.estimator.need import _dominates, rank_classes, rank_ordered
from curry_train.estimator.pipeline import _pipe_states, _simulate_pipe, periodic_rounds
from curry_train.estimator.profiles import get_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from published_layouts import SETUPS  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def _plan_setup(setup):
    _name, preset, gpu, mem, _pub, overrides, _meas = setup
    cfg = load_any(preset, overrides)
    h, t = cfg.hardware, cfg.train
    return plan(preset, h.gpus_per_node, h.nodes, mem, t.seq_len, t.global_batch, micro_batch=t.micro_batch,
                hardware=gpu, gpu=gpu, top=100_000)


def test_rank_ordered_schedules_have_each_rank_dominate_the_next():
    # the fast path's schedule fact: where rank_ordered holds, the states of rank r bound those of rank r + 1 (the
    # head's rank apart, which has a content of its own), so the lowest rank of a stage content bounds the others
    checked = 0
    for schedule, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved_1f1b", (2, 4))):
        for v in vs:
            for units in (False, True):
                for pp in (2, 3, 4, 5, 8, 12, 16):
                    for m in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp, 3 * pp, 4 * pp + 1, 8 * pp, 9 * pp - 1}):
                        if m < 1 or not rank_ordered(schedule, pp, m, units):
                            continue
                        st = [_pipe_states(schedule, pp, v, m, r, units) for r in range(pp - 1)]
                        for r in range(1, pp - 1):
                            assert _dominates(st[r - 1], st[r]), (schedule, v, units, pp, m, r)
                        checked += 1
    assert checked > 150


def test_schedule_states_repeat_after_periodic_rounds():
    # _pipe_states simulates periodic_rounds rounds of pp x v micro-batches for a longer step: the states found
    # there are those of the whole step, but for the head's count of forwards (the head rank's kept logits)
    checked = 0
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zero_bubble", 2)):
        for units in (False, True):
            for pp in (2, 3, 4, 8):
                for m in range(3 * pp * v + 1, 6 * pp * v + 1, max(1, pp // 2)):
                    rounds = periodic_rounds(schedule, pp, v, m)
                    if rounds * pp * v >= m:
                        continue
                    short = rounds * pp * v + m % pp
                    for r in range(pp):
                        full = [replace(q, head_fwds=0) for q in _simulate_pipe(schedule, pp, v, m, r, units)]
                        cut = [replace(q, head_fwds=0) for q in _simulate_pipe(schedule, pp, v, short, r, units)]
                        assert full == cut, (schedule, v, units, pp, m, r)
                    checked += 1
    assert checked > 100


@pytest.mark.slow  # ~35 CPU-s of arithmetic over 5,900 layouts: out of the inner loop, and started first under xdist
def test_the_fast_path_equals_every_rank_on_every_layout_the_planner_evaluates(monkeypatch):
    # every setup of benchmarks/published_layouts.py: every layout `plan` evaluates (each pipeline rank,
    # schedule, HSDP, EP, CP it searches), fast path == every rank, to the byte
    seen: dict = {}

    def recording(x, limit=None):
        seen[x] = None
        return layout_need(x, limit)

    monkeypatch.setattr(search_mod, "layout_need", recording)
    schedules, pp_layouts, compared = set(), 0, 0
    for setup in SETUPS:
        seen.clear()
        _plan_setup(setup)
        assert seen, setup[0]
        for x in seen:
            if x.pp > 1:
                pp_layouts += 1
                schedules.add((x.pp_schedule, x.pp_virtual, x.fsdp and x.zero == 3))
            # Where the fast path keeps every rank (pp 1, or no rank dominated), layout_need is the max over the
            # same ranks as layout_need_every_rank, the same expression: comparing them would test nothing.
            if x.pp == 1 or rank_classes(x) == tuple(range(x.pp)):
                continue
            compared += 1
            assert layout_need(x) == layout_need_every_rank(x), (setup[0], x)
    assert pp_layouts > 1000 and compared > 1000 and len(schedules) >= 6


def test_plans_rows_fit_on_every_rank():
    # Megatron 146B (PP up to 48): before every rank was checked, 66 of its rows fit on ranks 0 and pp - 1 only
    setup = next(s for s in SETUPS if s[0] == "megatron-146b")
    p = _plan_setup(setup)
    cfg = load_any(setup[1], setup[5])
    base = {**cfg.to_dict(), "hardware": {**cfg.to_dict()["hardware"], "gpu_memory_gib": p.gpu_memory_gib}}
    # every row, not only the pipelined ones: the reserve depends on each row's layout (its NCCL communicators)
    assert len([r for r in p.ranked if r.parallel["pp"] > 1]) > 50
    for r in p.ranked:
        e = estimate(load_any({**base, "parallel": dict(r.parallel),
                               "train": {**base["train"], "micro_batch": r.micro_batch}}))
        assert e.fits, r.parallel
        assert r.total_gib == pytest.approx(max(e.memory.total, e.init_peak_bytes) / GiB, abs=1e-3)


def test_quick_layout_and_estimate_agree_when_a_middle_rank_is_the_worst():
    # GPipe at pp 4: every stage holds all its micro-batches, and ranks 1 and 2 hold more layers than rank 0 (whose
    # split prices the embedding) and rank 3 (the head), so neither the first nor the last rank is the worst.
    # (Under 1F1B rank 0's fourth micro-batch now outweighs rank 1's extra layer: bf16's ZeRO-1 stores 16/d B per
    # parameter on FSDP2, wrapping.py, and fused AdamW holds no step transient.)
    cfg = load_any("llama3-8b", {"parallel.dp": 2, "parallel.pp": 4, "parallel.zero": 1, "train.global_batch": 64,
                                 "parallel.pp_schedule": "gpipe", "hardware.nodes": 1})
    x = layout_of(cfg)
    needs = [rank_need(x, r) for r in range(x.pp)]
    worst = needs.index(max(needs))
    assert worst not in (0, x.pp - 1), needs
    e = estimate(cfg)
    assert e.memory.pp_rank == worst
    assert quick_layout(x, get_profile("H100")).total == layout_need(x) == max(e.memory.total, e.init_peak_bytes)
    assert e.fits is (layout_need(x) <= e.usable_bytes)
