"""Capacity sweep: per ladder rung, the largest micro-batch and family model that fit; estimate and measured."""

from __future__ import annotations

import json

import pytest
from curry_train.advice.sweep import capacity_sweep, family, ladder_rungs
from curry_train.estimator import estimate_memory
from curry_train.measure.sweep import capacity_sweep as measured_sweep


def test_rungs_follow_the_ladder_for_the_hardware():
    from curry_train.estimator import load_any

    labels = [r[0] for r in ladder_rungs(load_any("llama3-70b"))]
    assert labels == ["single", "single+recompute", "ddp", "zero1", "zero2", "zero3", "zero3+recompute", "tp8",
                      "tp8+pp2"]
    one_node = [r[0] for r in ladder_rungs(load_any("llama3-8b"))]
    assert not any("pp" in x for x in one_node)  # no PP inside one node


def test_the_largest_micro_batch_is_the_largest_that_fits_and_grows_up_the_ladder():
    s = capacity_sweep("tiny", {"hardware.gpu_memory_gib": 0.01}, max_micro_batch=512)
    rows = {r.rung: r for r in s.rungs}
    single = rows["single"].max_micro_batch
    assert single and rows["single+recompute"].max_micro_batch > single
    usable = s.usable_bytes
    over = estimate_memory("tiny", {"hardware.gpu_memory_gib": 0.01, "train.micro_batch": single + 1,
                                    "train.global_batch": single + 1})
    assert rows["single"].micro_batch_peak_bytes <= usable < over.memory.total
    assert rows["zero3+recompute"].max_micro_batch >= rows["ddp"].max_micro_batch


def test_the_largest_model_grows_with_sharding():
    s = capacity_sweep("llama3-8b")
    rows = {r.rung: r for r in s.rungs}
    ddp, z3 = rows["ddp"].max_model, rows["zero3+recompute"].max_model
    assert ddp is not None and z3 is not None and z3.params > ddp.params
    assert rows["single"].max_micro_batch is None  # an 8B model does not train on one 80 GB GPU


def test_the_family_scales_width_and_depth_validly():
    from curry_train.estimator import load_any

    fam = family(load_any("llama3-8b"))
    assert len(fam) > 20
    for sec in fam:
        assert sec["d_model"] % sec["n_heads"] == 0 and sec["n_heads"] % sec["n_kv_heads"] == 0
        assert sec["d_model"] // sec["n_heads"] == 128  # head dim kept


def test_cli_sweep_json(capsys):
    from curry_train.cli import main

    assert main(["sweep", "--config", "tiny", "--rung", "single", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rung"] for r in out["rungs"]] == ["single"] and out["mode"] == "estimate"


@pytest.mark.multirank  # the measured sweep launches torchrun from inside the product code
@pytest.mark.slow
def test_measured_mode_binary_searches_with_real_runs():
    s = measured_sweep("tiny", {"hardware.gpu_memory_gib": 0.01}, measured=True, rungs=["single"],
                       max_micro_batch=64, max_runs_per_rung=5, widths=(1.0, 2.0), depths=(1.0,))
    row = s.rungs[0]
    est = capacity_sweep("tiny", {"hardware.gpu_memory_gib": 0.01}, rungs=["single"], max_micro_batch=64)
    assert row.source == "measured" and 1 <= row.runs <= 10
    assert row.max_micro_batch is not None and abs(row.max_micro_batch - est.rungs[0].max_micro_batch) <= 1
    assert row.micro_batch_peak_bytes <= s.usable_bytes
