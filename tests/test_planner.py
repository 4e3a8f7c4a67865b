"""The planner: climbs one rung at a time from plain DP, ends on a layout that fits, ranks every layout fast."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from curry_train.advice.planner import plan


def test_llama3_70b_on_four_nodes_of_eight_80gb_gpus_at_4k_fits_without_context_parallel():
    p = plan("llama3-70b", gpus_per_node=8, nodes=4, gpu_memory_gib=80.0, seq_len=4096)
    assert p.fits
    assert p.final["cp"] == 1
    assert p.final["tp"] <= 8  # TP stays inside a node
    assert p.rungs[-1].memory_gib["total"] <= 80.0


def test_the_climb_starts_from_plain_data_parallel_and_adds_one_primitive_per_rung():
    p = plan("llama3-70b", gpus_per_node=8, nodes=4, gpu_memory_gib=80.0, seq_len=4096)
    first = p.rungs[0].parallel
    assert p.rungs[0].primitive == "baseline"
    assert (first["dp"], first["zero"], first["recompute"], first["tp"], first["pp"], first["cp"]) == \
        (32, 0, "none", 1, 1, 1)
    ladder = ["zero1", "zero2", "zero3", "recompute", "tp", "cp", "pp", "dp"]
    climbed = [r.primitive for r in p.rungs[1:]]
    assert climbed and climbed[0].startswith("zero")  # DDP OOM -> a ZeRO stage first
    assert [ladder.index(x) for x in climbed] == sorted(ladder.index(x) for x in climbed)
    assert all(not r.fits for r in p.rungs[:-1]) and p.rungs[-1].fits


def test_ranked_layouts_fit_and_are_sorted_by_step_time():
    p = plan("llama3-8b", gpus_per_node=8, nodes=1, gpu_memory_gib=80.0, seq_len=8192, global_batch=512)
    assert p.layouts_valid >= p.layouts_fitting >= len(p.ranked) > 0
    times = [r.step_time_s for r in p.ranked]
    assert times == sorted(times) or all(abs(a - b) / b < 0.01 for a, b in itertools.pairwise(times))
    assert all(r.total_gib <= 80.0 for r in p.ranked)
    for r in p.ranked:
        par = r.parallel
        assert par["dp"] * par["tp"] * par["pp"] * par["cp"] == 8


def test_an_inline_model_section_is_accepted():
    model = {"vocab_size": 32000, "d_model": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 8, "d_ff": 5632}
    p = plan(model, gpus_per_node=8, nodes=1, gpu_memory_gib=40.0, seq_len=4096, global_batch=64)
    assert p.model == "inline" and p.fits


def test_a_model_too_big_for_the_cluster_says_more_gpus():
    p = plan("llama3-405b", gpus_per_node=8, nodes=1, gpu_memory_gib=80.0, seq_len=8192, global_batch=64)
    assert not p.fits and p.more_gpus_needed


def test_planning_16384_gpus_takes_under_a_second():
    t0 = time.perf_counter()
    p = plan("llama3-405b", gpus_per_node=8, nodes=2048, gpu_memory_gib=80.0, seq_len=8192, global_batch=2048)
    wall = time.perf_counter() - t0
    assert p.gpus == 16384 and p.layouts_valid > 0
    assert wall < 3.0  # the benchmark's goal is 1 s; slack for a shared CI core


def test_cli_plan_json(capsys):
    from curry_train.cli import main

    assert main(["plan", "--model", "llama3-8b", "--nodes", "1", "--seq-len", "8192", "--global-batch", "512",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["final"]["zero"] == 3


def test_cli_plan_rejects_an_unknown_model(capsys):
    from curry_train.cli import main

    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "available" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"d_model": 0}, {"bogus": 1}])
def test_an_invalid_inline_model_is_refused(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        plan({"vocab_size": 256, **bad}, 8, 1, 80.0, 1024, 8)
