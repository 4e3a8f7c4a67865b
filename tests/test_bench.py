"""bench: the reduction of per-rank results, the device lock, the pictures, and one real 2-rank bench."""

from __future__ import annotations

import io
import json
import math
import threading

import pytest
from curry_train.breakdown import CATEGORIES
from curry_train.config import load_config
from curry_train.measure.bench import BenchResult, DeviceLock, fold, summarise
from curry_train.plots import memory_breakdown_png, pipeline_timeline_png, simulate_pipeline
from curry_train.store.runs import Ledger


def _rank(rank: int, times: list[float], peak: int, losses=(5.0, 4.5, 4.0), **mem) -> dict:
    at = {"params": 100, "param_copies": 10, "grads": 100, "grad_buffers": 100, "optimizer": 200,
          "activations": peak - 510, "other": 0}
    return {"rank": rank, "device": "cpu", "oom": False, "losses": list(losses), "step_time_s": times,
            "memory": {"params": 100, "param_copies": 10, "grads": 100, "grad_buffers": 100, "optimizer": 200,
                       "activations": peak - 510, "other": 0, "peak": peak, "at_peak": at, **mem}}


def test_summary_takes_the_slowest_rank_per_step_then_the_median_and_the_rank_with_the_largest_peak(project):
    cfg = load_config(project / "configs/tiny.yaml", {"parallel.dp": 2})
    values = [_rank(0, [0.10, 0.30, 0.20], 1000), _rank(1, [0.20, 0.10, 0.25], 1500)]
    r = summarise(cfg, values, run_id="bench-x", config_name="tiny", overrides={"parallel.dp": 2}, steps=3,
                  warmup=1, wall_s=1.0)
    assert r.step_times_s == [0.20, 0.30, 0.25] and r.step_time_s == 0.25
    assert r.tokens_per_s == pytest.approx(8 * 64 / 0.25)
    assert r.peak_memory_bytes == 1500 and r.per_rank_peak_bytes == [1000, 1500] and r.memory_breakdown.rank == 1
    b = r.memory_breakdown
    # the measured categories as they are: the estimator files them the same way (curry_train/breakdown.py)
    assert (b.params, b.param_copies, b.grads, b.grad_buffers, b.optimizer, b.activations, b.other) == \
        (100, 10, 100, 100, 200, 990, 0)
    assert sum(b.by_category().values()) == b.peak
    assert r.loss_finite and not r.oom and r.mfu is None and r.world_size == 2
    assert r.estimate is not None and r.estimate.total > 0  # the estimator's prediction beside the measurement
    assert r.estimate.error_vs_measured == pytest.approx(r.estimate.total / 1500 - 1)


def test_cpu_oom_is_a_peak_above_the_budget_and_nan_losses_are_not_finite(project):
    cfg = load_config(project / "configs/tiny.yaml", {"hardware.gpu_memory_gib": 1e-6})  # ~1 KiB budget
    r = summarise(cfg, [_rank(0, [0.1], 5000, losses=(5.0, math.nan))], run_id="b", config_name="tiny",
                  overrides={}, steps=1, warmup=1, wall_s=1.0)
    assert r.oom and "budget" in r.oom_detail and not r.loss_finite


def test_fold_keeps_every_shared_category_and_folds_nothing_into_other():
    at = {"params": 1, "param_copies": 2, "grads": 3, "grad_buffers": 4, "optimizer": 5, "activations": 6,
          "loss": 8, "pp_buffers": 9, "other": 7}
    b = fold({"at_peak": at, "params": 1}, peak=45, rank=0)
    assert b.by_category() == at and tuple(b.by_category()) == CATEGORIES and b.peak == 45


def test_the_device_lock_admits_one_holder_and_is_freed_on_release(project):
    a, b = DeviceLock(project), DeviceLock(project)
    assert a.try_acquire() and not b.try_acquire()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TimeoutError, match="cancelled"):
        b.acquire(timeout=5, cancel=cancel)
    with pytest.raises(TimeoutError, match="busy"):
        b.acquire(timeout=0.3)
    a.release()
    assert b.try_acquire()
    b.release()


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG that decodes completely (Pillow ships with matplotlib)."""
    from PIL import Image

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(io.BytesIO(data)) as im:
        im.load()  # decodes every pixel: a truncated or corrupt file raises
        return im.size


def test_pictures_are_valid_pngs():
    mem = memory_breakdown_png({"estimate": {"params": 10, "grads": 10, "optimizer": 20, "activations": 40,
                                             "other": 5}, "measured": {"params": 10, "grads": 10, "optimizer": 20,
                                                                       "activations": 45, "other": 6}},
                               budget_bytes=80, peaks={"measured": 95})
    w, h = _png_size(mem)
    assert w >= 800 and h >= 400  # readable: matplotlib at 100 dpi, real axes and text
    assert _png_size(pipeline_timeline_png(4, 8, "1f1b"))[0] >= 900


@pytest.mark.parametrize("schedule,p,v,m", [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 2, 1, 4),
                                            ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 2, 2, 4)])
def test_simulated_bubble_matches_the_textbook_fraction(schedule, p, v, m):
    tl = simulate_pipeline(p, m, schedule, v)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (v * m) / (1 + (p - 1) / (v * m)), abs=1e-9)
    assert sum(len(r) for r in tl.ops) == 2 * p * v * m


def test_zero_bubble_fills_idle_time_with_weight_gradients():
    assert simulate_pipeline(4, 8, "zero_bubble", 1).bubble_fraction < simulate_pipeline(4, 8, "1f1b").bubble_fraction


@pytest.mark.multirank
def test_a_real_two_rank_bench_through_the_cli_measures_records_and_draws(project, tmp_path, capsys):
    """The CLI's bench in this process, its two ranks forked (tests/forkrun.py): the bench through torchrun's
    environment is the MCP stdio tests' (tests/test_mcp_stdio.py), torchrun's own contract tests/test_cli.py's."""
    from curry_train.cli import main

    png = tmp_path / "memory.png"
    code = main(["bench", "--config", "tiny", "--set", "parallel.dp=2", "--steps", "3", "--micro-batches", "1",
                 "--json", "--plot", str(png), "--root", str(project)])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    r = BenchResult.model_validate(json.loads(out))
    assert r.world_size == 2 and r.device == "cpu" and r.loss_finite and len(r.losses) == 4
    assert r.step_time_s and r.step_time_s > 0 and len(r.step_times_s) == 3
    # one of the step's two micro-batches per rank: 2 ranks x 2 sequences x 64 tokens in each benched step
    assert (r.micro_batches, r.full_micro_batches) == (1, 2)
    assert r.tokens_per_s == pytest.approx(2 * 2 * 64 / r.step_time_s)
    assert r.timeout_s == 300.0 and r.fits and r.max_memory_reserved_bytes is None  # the floor; CPU: no device view
    b = r.memory_breakdown
    assert r.peak_memory_bytes > 0 and sum(b.by_category().values()) == b.peak
    assert b.params == 723_200 and b.optimizer >= 2 * b.params  # tiny: 180,800 fp32 params; AdamW: 2 states + step
    assert not r.oom and r.mfu is None and r.estimate is not None
    assert abs(r.estimate.error_vs_measured) < 0.5
    rec = Ledger(project).get(r.run_id)
    assert rec.status == "ok" and rec.metrics["peak_memory_bytes"] == r.peak_memory_bytes
    assert _png_size(png.read_bytes())[0] >= 800
    assert "step 3/3" in err and "launching 2 rank" in err and "1/2 micro-batches" in err
    assert "1 more step of the same run" in err  # progress on stderr, JSON on stdout
