"""Template training step vs a minimal hand-written torch loop over the same model and data (one process).

    .venv/bin/python benchmarks/step_overhead.py [--config tiny] [--set model.d_model=256 ...] [--rounds 7]

Both sides run the identical model (build_model), batch (global_batch) and AdamW; the only difference is the
template's machinery (Parallelized, grad_sync hooks, loss context, micro-batch generator). Rounds
alternate A/B so drift on a noisy machine hits both equally; the ratio is template/handwritten throughput per
round, reported as the median. Goal: >= 0.97. Then the same with train.compile=true (parallel/compile.py, each
block torch.compile'd; compiled once in a warm-up round, not timed): `compiled_ratio`, the compiled template's
throughput over the same eager handwritten loop (no goal on CPU, where the default stays eager: it shows what
inductor's C++ kernels give on this machine). Final line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from curry_train.config import load_config, parse_sets
from curry_train.model.data import global_batch
from curry_train.model.gpt import build_model, lm_loss
from curry_train.paths import resolve_config_arg
from curry_train.train.loop import setup, train_step


def handwritten(cfg, steps: int, start: int) -> float:
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    mb, n = cfg.train.micro_batch, cfg.num_microbatches
    batches = [global_batch(cfg, s) for s in range(start, start + steps)]
    t0 = time.perf_counter()
    for x, y in batches:
        for m in range(n):
            loss = lm_loss(model(x[m * mb:(m + 1) * mb]), y[m * mb:(m + 1) * mb])
            (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def template(cfg, steps: int, start: int) -> float:
    par = setup(cfg)
    t0 = time.perf_counter()
    for s in range(start, start + steps):
        train_step(par, s)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", action="append", default=["model.d_model=256", "model.d_ff=512", "train.seq_len=256"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compile-rounds", type=int, default=3)
    a = ap.parse_args()
    cfg = load_config(resolve_config_arg(a.config), parse_sets(a.set))
    torch.set_num_threads(1)  # one core each side, no interference from the OpenMP pool sizing
    template(cfg, 2, 0), handwritten(cfg, 2, 0)  # warm-up (allocator, first-call costs)
    tokens = cfg.train.global_batch * cfg.train.seq_len * a.steps
    ratio, t_tpl, t_hand = rounds(cfg, a.rounds, a.steps, tokens, "")
    compiled = load_config(resolve_config_arg(a.config), {**parse_sets(a.set), "train.compile": True})
    template(compiled, 2, 0)  # warm-up: torch.compile traces and inductor builds the block's kernels once
    c_ratio, t_comp, _ = rounds(compiled, a.compile_rounds, a.steps, tokens, "compiled ")
    print(json.dumps({"throughput_ratio": round(ratio, 4),
                      "template_tokens_per_s": round(tokens / t_tpl, 1),
                      "handwritten_tokens_per_s": round(tokens / t_hand, 1),
                      "compiled_ratio": round(c_ratio, 4), "compiled_tokens_per_s": round(tokens / t_comp, 1),
                      "rounds": a.rounds, "compile_rounds": a.compile_rounds, "steps_per_round": a.steps,
                      "overrides": a.set, "goal": 0.97}))


def rounds(cfg, n: int, steps: int, tokens: int, label: str) -> tuple[float, float, float]:
    """n alternating A/B rounds -> (median throughput ratio template / handwritten, median times of each)."""
    ratios, t_tpl, t_hand = [], [], []
    for r in range(n):
        order = (template, handwritten) if r % 2 == 0 else (handwritten, template)
        times = {fn.__name__: fn(cfg, steps, 2) for fn in order}
        t_tpl.append(times["template"])
        t_hand.append(times["handwritten"])
        ratios.append(times["handwritten"] / times["template"])  # throughput ratio template / handwritten
        print(f"round {r}: {label}template {tokens / times['template']:.0f} tok/s, "
              f"handwritten {tokens / times['handwritten']:.0f} tok/s, ratio {ratios[-1]:.3f}", flush=True)
    return statistics.median(ratios), statistics.median(t_tpl), statistics.median(t_hand)


if __name__ == "__main__":
    main()
