"""The advisor follows the stage-4 ladder exactly, cites numbers, and keeps to the anti-patterns."""

from __future__ import annotations

import json

import pytest
from curry_train.advice.advisor import recommend_next
from curry_train.estimator import estimate_memory

SMALL_NODE = {"hardware.gpus_per_node": 4, "hardware.nodes": 1}


def test_single_device_oom_recommends_recompute_first():
    r = recommend_next("tiny", None, {"hardware.gpu_memory_gib": 0.004})
    assert r.symptom == "oom" and r.symptom_source == "derived"
    assert r.primitive == "recompute"
    assert r.memory_after_bytes < r.memory_before_bytes
    assert "MiB" in r.reason and "usable" in r.reason  # cites the numbers


def test_eight_gpu_ddp_oom_recommends_a_zero_stage():
    r = recommend_next("llama3-8b", None, {"parallel.zero": 0, "parallel.recompute": "none"})
    assert r.symptom == "oom"
    assert r.primitive in ("zero1", "zero2", "zero3")
    assert r.config_patch["parallel.zero"] == int(r.primitive[-1])
    assert r.validation is not None and r.validation.tool == "whitebox_compare"
    assert "curry-train whitebox --config llama3-8b" in r.validation.command


def test_ddp_oom_gets_the_lowest_zero_stage_that_fits():
    base = {"parallel.dp": 4, **SMALL_NODE}
    totals = [estimate_memory("tiny", {**base, "parallel.zero": z}).memory.total for z in range(4)]
    assert totals[0] > totals[1] > totals[2] > totals[3]
    budget = (totals[1] + totals[2]) / 2  # ZeRO-2 is the lowest stage under it
    r = recommend_next("tiny", None, {**base, "hardware.gpu_memory_gib": budget / 2**30})
    assert r.primitive == "zero2" and r.fits_after


def test_full_sharding_without_recompute_gets_recompute_before_tensor_parallel():
    ov = {"parallel.dp": 4, "parallel.zero": 3, **SMALL_NODE, "hardware.gpu_memory_gib": 0.0025}
    r = recommend_next("tiny", None, ov)
    assert r.primitive == "recompute"


def test_oom_at_full_sharding_and_recompute_gets_tensor_parallel_within_a_node():
    ov = {"parallel.dp": 4, "parallel.zero": 3, "parallel.recompute": "full", **SMALL_NODE,
          "hardware.gpu_memory_gib": 0.001}
    r = recommend_next("tiny", None, ov)
    assert r.primitive == "tp"
    assert r.config_patch["parallel.tp"] <= 4 and r.config_patch["parallel.sp"] is True
    assert any(x.startswith("pp:") and "one node" in x for x in r.rejected) or r.primitive == "tp"


def test_never_tensor_parallel_before_full_sharding():
    for z in (0, 1, 2):
        r = recommend_next("tiny", None, {"parallel.dp": 4, "parallel.zero": z, **SMALL_NODE,
                                          "hardware.gpu_memory_gib": 0.0005})
        assert r.primitive != "tp"


def test_never_pipeline_inside_one_node():
    ov = {"parallel.dp": 1, "parallel.tp": 4, "parallel.sp": True, "parallel.zero": 3, "parallel.recompute": "full",
          **SMALL_NODE, "hardware.gpu_memory_gib": 0.0005}
    r = recommend_next("tiny", None, ov)
    assert r.primitive != "pp"
    assert r.more_gpus_needed and "more GPUs" in r.reason


def test_long_sequences_whose_activations_overflow_get_context_parallel():
    # 32k tokens, few heads (this template's ring attention keeps (T / 2cp)^2 fp32 score tiles per head, so CP
    # only pays when it splits the sequence finely enough; the estimator counts them)
    ov = {"model.d_model": 512, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 1024,
          "parallel.dp": 16, "parallel.zero": 3, "parallel.recompute": "full", "hardware.gpus_per_node": 16,
          "hardware.gpu_memory_gib": 0.4, "train.seq_len": 32768, "train.global_batch": 16, "train.micro_batch": 1}
    r = recommend_next("tiny", None, ov)
    assert r.primitive == "cp" and r.fits_after
    assert r.config_patch["parallel.cp"] * r.config_patch["parallel.dp"] == 16


def test_no_context_parallel_without_proven_need():
    ov = {"parallel.dp": 4, "parallel.zero": 3, "parallel.recompute": "full", **SMALL_NODE,
          "hardware.gpu_memory_gib": 0.001}
    r = recommend_next("tiny", None, ov)
    assert r.primitive != "cp"
    assert any(x.startswith("cp: no proven need") for x in r.rejected)


def test_moe_at_full_sharding_gets_expert_parallel_and_dense_models_never_do():
    moe = recommend_next("tiny-moe", None, {"parallel.dp": 4, "parallel.zero": 3, "parallel.recompute": "full",
                                            **SMALL_NODE, "hardware.gpu_memory_gib": 0.004})
    assert moe.primitive == "ep" and moe.config_patch["parallel.ep"] in (2, 4)
    for gib in (0.0005, 0.001, 0.002, 0.004):
        dense = recommend_next("tiny", None, {"parallel.dp": 4, "parallel.zero": 3, "parallel.recompute": "full",
                                              **SMALL_NODE, "hardware.gpu_memory_gib": gib})
        assert dense.primitive != "ep"


def test_slow_across_nodes_and_comm_bound_gets_pipeline_parallel():
    ov = {"train.seq_len": 1024, "parallel.dp": 32, "hardware.nodes": 4, "parallel.zero": 3,
          "train.global_batch": 512}
    r = recommend_next("llama3-8b", None, ov)
    assert r.symptom == "slow"
    assert r.primitive == "pp" and r.throughput_change_pct > 0


def test_says_when_the_only_answer_is_more_gpus():
    r = recommend_next("tiny", None, {"hardware.gpus_per_node": 1, "parallel.recompute": "full",
                                      "hardware.gpu_memory_gib": 0.001})
    assert r.primitive == "none" and r.more_gpus_needed and "more GPUs" in r.reason


def test_a_config_that_fits_and_is_not_comm_bound_needs_nothing():
    r = recommend_next("llama3-8b")
    assert r.symptom == "none" and r.primitive == "none" and r.config_patch == {}


def test_a_given_oom_is_trusted_even_when_the_estimate_fits():
    r = recommend_next("tiny", "oom")
    assert r.symptom_source == "given" and r.primitive == "recompute"
    assert r.memory_after_bytes < r.memory_before_bytes


def test_recommendations_climb_one_rung_at_a_time_until_it_fits():
    from curry_train.estimator import load_any

    cfg = load_any("llama3-8b", {"parallel.zero": 0, "parallel.recompute": "none"})
    seen = []
    for _ in range(6):
        r = recommend_next(cfg)
        if r.primitive == "none":
            break
        seen.append(r.primitive)
        cfg = load_any(cfg, r.config_patch)
    assert seen == ["zero3", "recompute"]
    assert estimate_memory(cfg).fits


def test_cli_recommend_json(capsys):
    from curry_train.cli import main

    assert main(["recommend", "--config", "tiny", "--set", "hardware.gpu_memory_gib=0.004", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["primitive"] == "recompute" and out["config_patch"]


@pytest.mark.parametrize("symptom", ["oom", "slow", "none"])
def test_every_symptom_returns_a_valid_primitive(symptom):
    r = recommend_next("llama3-70b", symptom)
    assert r.primitive in ("none", "recompute", "zero1", "zero2", "zero3", "tp", "pp", "ep", "cp", "dp")
