"""What a bench runs and how long it may take: its micro-batches and its timeout, both fixed before it launches.

    from curry_train.measure.bench_plan import bench_config, bench_timeout
    bench_config(cfg, 2)          # the config with a step of 2 micro-batches per rank, the layout unchanged
    bench_timeout(cfg, steps=5, warmup=1)   # seconds: init + the estimated step time x steps x margin, floored

A bench times a step of a few micro-batches, not the config's whole global batch: the layout (parallel section,
micro_batch, seq_len, recompute, dtype) is the config's, only train.global_batch shrinks to dp x micro_batch x N,
so a llama3-8b bench costs N micro-batches per step, not 64. Gradient accumulation frees each micro-batch's
activations before the next, so without a pipeline the per-rank peak of N >= 2 micro-batches is that of the full
batch (N = 2 keeps the no-sync then sync path of gradient accumulation); a pipeline's peak grows with the
micro-batches in flight (docs/ESTIMATION.md, "Pipeline schedules"), so under pp > 1 the default is the whole
batch. A whole step the estimator puts under WHOLE_STEP_S is benched whole too: it costs little, and the bench
then measures the config itself, so two benches of layouts with one global batch compare their losses as well.
Tokens/s counts the tokens the benched step really processed, and the estimate beside the measurement is
the estimate of the benched config, so the two compare like with like.
"""

from __future__ import annotations

from typing import Any, Literal

from curry_train.config import Config, ConfigError, Problem, from_dict

BENCH_MICRO_BATCHES = 2  # default micro-batches per rank per benched step without a pipeline (see above)
WHOLE_STEP_S = 30.0  # ... unless the estimated whole step is this short: then the bench runs the config itself
INIT_S = 180.0  # torchrun start, import torch, process groups, meta build + local materialisation (assumed)
MARGIN = 3.0  # the estimate's step time may be this far off (contention, a first-call kernel autotune)
TRACKED_STEP_COST = 4.0  # the memory step runs under a dispatch mode: this many plain steps (assumed)
FLOOR_S = 300.0  # tiny CPU runs: the estimator's microseconds would leave no time to import torch


def full_micro_batches(cfg: Config) -> int:
    return cfg.num_microbatches


def bench_config(cfg: Config, micro_batches: int | Literal["all"] | None) -> Config:
    """`cfg` with a step of `micro_batches` micro-batches per rank (None: the default above; "all": the whole
    step, as `climb` benches, whose rungs are one training run); a bad count is a ConfigError naming
    --micro-batches, raised before anything launches."""
    full = full_micro_batches(cfg)
    if micro_batches == "all":
        return cfg
    if micro_batches is None:
        whole = cfg.parallel.pp > 1 or estimated_step_s(cfg) <= WHOLE_STEP_S
        n = full if whole else min(full, BENCH_MICRO_BATCHES)
    else:
        n = micro_batches
    if n < 1 or n > full:
        raise ConfigError([Problem(
            fields=["--micro-batches"], message=f"{n} micro-batches per rank: the config's step has {full} "
            f"(train.global_batch={cfg.train.global_batch} / (parallel.dp={cfg.parallel.dp} x "
            f"train.micro_batch={cfg.train.micro_batch}))", fix=f"use 1 <= --micro-batches <= {full}")])
    if n == full:
        return cfg
    raw: dict[str, Any] = cfg.to_dict()
    raw["train"]["global_batch"] = cfg.parallel.dp * cfg.train.micro_batch * n
    try:
        return from_dict(raw)
    except ConfigError as e:  # e.g. a pipeline schedule that needs more micro-batches than N
        raise ConfigError([Problem(fields=["--micro-batches", *p.fields], message=p.message,
                                   fix=f"{p.fix}; or a larger --micro-batches (at most {full})")
                           for p in e.problems]) from None


def estimated_step_s(cfg: Config) -> float:
    """The estimator's step time for `cfg` on its hardware (estimator.estimate), the one number the timeout
    scales."""
    from curry_train.estimator import estimate

    return float(estimate(cfg).step_time.total_s)


def bench_timeout(cfg: Config, steps: int, warmup: int) -> float:
    """Seconds before every rank is killed: INIT_S + MARGIN x step x (warmup + steps + TRACKED_STEP_COST), at
    least FLOOR_S. `cfg` is the benched config (bench_config), whose step covers the benched micro-batches."""
    work = MARGIN * estimated_step_s(cfg) * (warmup + steps + TRACKED_STEP_COST)
    return max(FLOOR_S, INIT_S + work)
