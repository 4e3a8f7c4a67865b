"""bench's plan: a step of a few micro-batches with the layout unchanged, a timeout from the estimated step time,
and on CUDA the estimator's test (budget - reserve) and the device's own view of memory in the result."""

from __future__ import annotations

import pytest
from curry_train.config import ConfigError, load_config
from curry_train.estimator import reserve_bytes
from curry_train.measure.bench import summarise
from curry_train.measure.bench_plan import (
    BENCH_MICRO_BATCHES,
    FLOOR_S,
    INIT_S,
    MARGIN,
    TRACKED_STEP_COST,
    bench_config,
    bench_timeout,
    estimated_step_s,
)

from tests.conftest import PRESETS


def test_a_bench_step_covers_a_few_micro_batches_and_keeps_the_layout():
    cfg = load_config(PRESETS / "llama3-8b.yaml")
    b = bench_config(cfg, None)
    assert cfg.num_microbatches == 64 and b.num_microbatches == BENCH_MICRO_BATCHES == 2
    assert b.parallel == cfg.parallel and b.model == cfg.model and b.hardware == cfg.hardware
    assert (b.train.micro_batch, b.train.seq_len) == (cfg.train.micro_batch, cfg.train.seq_len)
    assert b.train.global_batch == cfg.parallel.dp * cfg.train.micro_batch * 2
    assert bench_config(cfg, 64) is cfg and bench_config(cfg, 5).num_microbatches == 5


def test_a_whole_step_the_estimate_puts_under_30_s_is_benched_whole_so_layouts_compare_their_losses():
    from curry_train.measure.bench_plan import WHOLE_STEP_S, estimated_step_s

    tiny = load_config(PRESETS / "tiny.yaml")  # dp 1: 4 micro-batches
    assert estimated_step_s(tiny) <= WHOLE_STEP_S == 30.0 and tiny.num_microbatches > BENCH_MICRO_BATCHES
    assert bench_config(tiny, None) is tiny  # the config itself: dp 1 and dp 2 bench one global batch
    big = load_config(PRESETS / "llama3-8b.yaml")
    assert estimated_step_s(big) > WHOLE_STEP_S  # hence the 2 micro-batches of the test above


def test_under_a_pipeline_the_default_is_the_whole_step_whose_peak_grows_with_the_micro_batches():
    cfg = load_config(PRESETS / "tiny.yaml", {"parallel.pp": 2})
    assert bench_config(cfg, None).num_microbatches == cfg.num_microbatches == 4


@pytest.mark.parametrize("n", [0, 5])
def test_a_micro_batch_count_outside_the_step_is_refused_naming_the_option(n):
    cfg = load_config(PRESETS / "tiny.yaml")  # 8 / (1 x 2) = 4 micro-batches
    with pytest.raises(ConfigError) as e:
        bench_config(cfg, n)
    assert e.value.problems[0].fields == ["--micro-batches"] and "<= 4" in e.value.problems[0].fix


def test_the_timeout_scales_the_estimated_step_time_of_the_benched_step_with_a_floor():
    tiny = load_config(PRESETS / "tiny.yaml")
    assert bench_timeout(tiny, 5, 1) == FLOOR_S  # the estimator's milliseconds would leave no time to start
    cfg = load_config(PRESETS / "llama3-8b.yaml")
    full = INIT_S + MARGIN * estimated_step_s(cfg) * (5 + 1 + TRACKED_STEP_COST)
    assert bench_timeout(cfg, 5, 1) == pytest.approx(full) and full > 900  # the old fixed 900 s killed it
    few = bench_config(cfg, 8)
    assert bench_timeout(few, 5, 1) == pytest.approx(max(FLOOR_S, INIT_S + MARGIN * estimated_step_s(few) * 10))
    assert bench_timeout(few, 5, 1) < full / 4


def _cuda_rank(peak: int, reserved: int) -> dict:
    at = {"params": peak // 2, "activations": peak - peak // 2}
    return {"rank": 0, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "oom": False,
            "losses": [5.0, 4.0], "step_time_s": [0.5],
            "memory": {"params": peak // 2, "activations": peak - peak // 2, "peak": peak - 1, "at_peak": at,
                       "cuda_max_allocated": peak, "cuda_max_reserved": reserved, "cuda_device_total": 80 * 2**30,
                       "cuda_device_used_at_peak": reserved + 2**30}}


def test_on_cuda_fits_is_the_allocator_peak_against_budget_minus_the_estimators_reserve():
    cfg = bench_config(load_config(PRESETS / "tiny.yaml", {"hardware.device": "cuda", "hardware.gpu_memory_gib": 80}),
                       1)
    budget, reserve = 80 * 2**30, reserve_bytes(cfg)
    assert reserve > 2 * 2**30

    def run(peak: int):
        return summarise(cfg, [_cuda_rank(peak, peak + 2**20)], run_id="b", config_name="tiny", overrides={},
                         steps=1, warmup=1, wall_s=1.0)

    inside_raw = run(budget - reserve + 2**20)  # under the raw budget, over the usable one
    assert not inside_raw.oom and not inside_raw.fits and inside_raw.usable_bytes == budget - reserve
    ok = run(budget - reserve - 2**20)
    assert ok.fits and ok.reserve_bytes == reserve
    assert ok.max_memory_reserved_bytes == ok.peak_memory_bytes + 2**20
    assert ok.device_used_at_peak_bytes == ok.max_memory_reserved_bytes + 2**30
    assert ok.device_total_bytes == 80 * 2**30
    # tokens/s counts the tokens of the benched step: 1 micro-batch of 2 sequences of 64 tokens
    assert ok.tokens_per_s == pytest.approx(2 * 64 / 0.5) and ok.micro_batches == 1


def test_on_cpu_the_device_fields_are_absent_and_fits_is_the_raw_budget():
    cfg = load_config(PRESETS / "tiny.yaml")
    at = {"params": 100, "activations": 400}
    r = summarise(cfg, [{"rank": 0, "device": "cpu", "losses": [1.0], "step_time_s": [0.1],
                         "memory": {"params": 100, "activations": 400, "peak": 500, "at_peak": at}}],
                  run_id="b", config_name="tiny", overrides={}, steps=1, warmup=0, wall_s=1.0)
    assert r.fits and r.reserve_bytes == 0 and r.usable_bytes == r.memory_budget_bytes
    assert r.max_memory_reserved_bytes is None and r.device_used_at_peak_bytes is None


def test_the_reserve_grows_with_the_communicators_and_the_doc_quotes_the_codes_numbers():
    import re

    from curry_train.estimator import layout_of
    from curry_train.estimator.reserve import (
        CUDA_CONTEXT_RESERVE_GIB,
        FRAGMENTATION_RESERVE,
        NCCL_COMMUNICATOR_MIB,
        communicators,
    )

    from tests.conftest import REPO

    one = load_config(PRESETS / "llama3-8b.yaml")  # dp 8 = the world: only the default group
    tp = load_config(PRESETS / "llama3-70b.yaml")  # TP 8 x FSDP 4: default, tp, dp
    assert (communicators(layout_of(one)), communicators(layout_of(tp))) == (1, 3)
    assert reserve_bytes(tp) - reserve_bytes(one) == 2 * NCCL_COMMUNICATOR_MIB * 2**20  # same 80 GiB budget
    assert reserve_bytes(one) == int(CUDA_CONTEXT_RESERVE_GIB * 2**30 + FRAGMENTATION_RESERVE * 80 * 2**30
                                     + NCCL_COMMUNICATOR_MIB * 2**20)
    section = (REPO / "docs/ESTIMATION.md").read_text(encoding="utf-8").split("## Reserve\n")[1].split("\n## ")[0]
    assert f"{CUDA_CONTEXT_RESERVE_GIB} GiB" in section and f"{FRAGMENTATION_RESERVE:.0%}" in section
    assert f"{NCCL_COMMUNICATOR_MIB} MiB per NCCL communicator" in section and "**assumed**" in section
    assert re.search(r"llama3-8b on dp 8: 1; llama3-70b on TP 8 × FSDP 4: 3", section)


def test_the_bench_skill_quotes_the_default_micro_batches():
    from tests.conftest import REPO

    text = (REPO / "skills/bench/SKILL.md").read_text(encoding="utf-8")
    assert f"`micro_batches` micro-batches per rank (default {BENCH_MICRO_BATCHES};" in text
