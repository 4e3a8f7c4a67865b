"""recommend_next and plan give one answer to "it runs out of memory, what next?" on every shipped preset, the
user's micro-batch kept (docs/ARCHITECTURE.md#one-answer-to-an-oom).

    .venv/bin/python -m pytest -q -n 0 tests/test_oom_agreement.py

Agreement, checked here with plan called directly (not through advice/agree.py), for the OOM a preset's user
reports: the estimate shows none on any shipped preset, so the answer names the rung `if_confirmed`, and a
confirming measurement would put the true peak over the budget although the estimate is more than the
estimator's error band under it. So
  1. the rung lowers the estimated peak by more than that band (a rung that keeps or raises it clears nothing);
  2. plan, asked the same question (the GPUs the rung uses, the preset's micro-batch kept, every layout's limit
     lowered as that target lowers this one's: `margin`), agrees: the rung raises a primitive plan's final also
     uses more of than the preset (a step of plan's climb from the preset to its final), or leads within the
     planner's tie band (WITHIN) of plan's final, or is plan's final itself; and
  3. no rung (more GPUs) only where plan finds no layout under that budget either.
"""

from __future__ import annotations

import pytest
from curry_train.advice.advisor import recommend_next
from curry_train.advice.planner import plan
from curry_train.advice.search import PEAK_ERROR_BAND
from curry_train.estimator import estimate, load_any
from curry_train.rules import WITHIN

from tests.conftest import preset_cases

MODES = ("none", "selective", "full")
KEYS = ("zero", "recompute", "tp", "pp", "ep", "cp", "dp_replicate")


def _more(before: dict, after: dict) -> set[str]:
    def amount(par: dict, k: str) -> int:
        return MODES.index(par[k]) if k == "recompute" else par[k]

    return {k for k in KEYS if amount(after, k) > amount(before, k)}


def _plan_on(cfg, gpus: int, margin: float):
    h, t = cfg.hardware, cfg.train
    gpn, nodes = (gpus, 1) if gpus < h.gpus_per_node else (h.gpus_per_node, gpus // h.gpus_per_node)
    return plan(cfg.to_dict(), gpn, nodes, h.gpu_memory_gib, t.seq_len, t.global_batch, micro_batch=t.micro_batch,
                search_micro_batch=False, dtype=t.dtype, hardware="CPU" if h.device == "cpu" else None, margin=margin,
                top=1)


@pytest.mark.parametrize("name", preset_cases())
def test_the_oom_rung_lowers_the_peak_and_is_plans_answer_to_the_same_budget(name):
    cfg = load_any(name)
    before = estimate(cfg)
    r = recommend_next(name, "oom")
    assert r.evidence == "unconfirmed"  # every shipped preset fits its budget with room by the estimate
    target = int(before.memory.total * (1 - PEAK_ERROR_BAND))  # what a confirming measurement implies
    margin = 1 - target / before.usable_bytes
    rung = r.if_confirmed
    if not rung:  # more GPUs: plan finds nothing under that budget on these GPUs either
        assert r.more_gpus_needed or "more GPUs" in r.reason
        assert not _plan_on(cfg, cfg.hardware.gpus_per_node * cfg.hardware.nodes, margin).fits, (name, r.reason)
        return
    new = load_any(cfg, rung)
    after = estimate(new)
    assert after.memory.total < before.memory.total, (name, rung)  # 1. it lowers the peak
    p = _plan_on(cfg, new.world_size, margin)
    if not p.fits:  # plan's search is narrower than the ladder's (it keeps dp at what the batch feeds)
        return
    cur, par = cfg.parallel.model_dump(), new.parallel.model_dump()
    planned = {k: v for k, v in p.final.items() if cur.get(k) != v} == {k.split(".")[-1]: v for k, v in rung.items()
                                                                      if k.startswith("parallel.")}
    step = after.step_time.total_s
    assert planned or _more(cur, par) & _more(cur, p.final) or step <= p.final_step_time_s * (1 + WITHIN), (
        name, rung, step, p.final, p.final_step_time_s)


def test_a_rung_that_keeps_the_layout_is_never_named():
    # TP + PP: FSDP2 under the pipeline schedule holds the units and reduces once for zero 1 and zero 2 (the same
    # layout); zero 3 under fsdp_reshard=default keeps its units gathered too. The ZeRO-3 rung there reshards
    r = recommend_next("gpt3-175b", "oom")  # tp 8 x pp 16, zero 2
    assert r.if_confirmed.get("parallel.zero") != 2
    if r.if_confirmed.get("parallel.zero") == 3:
        assert r.if_confirmed["parallel.fsdp_reshard"] == "always"
    assert estimate(load_any("gpt3-175b", r.if_confirmed)).memory.total < r.memory_before_bytes


def test_a_confirmed_oom_gets_the_planners_layout_when_the_ladder_has_no_better_rung():
    # megatron-1t (TP 8 x PP 64 x DP 6, ZeRO-2, full recompute): no rung of the ladder lowers its peak by the band,
    # while plan finds a layout under that budget on the same 3,072 GPUs; the answer is plan's layout, not
    # "more GPUs"
    r = recommend_next("megatron-1t", "oom")
    assert r.if_confirmed and not r.more_gpus_needed
    assert "the planner's layout" in r.reason
    after = estimate(load_any("megatron-1t", r.if_confirmed)).memory.total
    assert after < r.memory_before_bytes * (1 - PEAK_ERROR_BAND)
