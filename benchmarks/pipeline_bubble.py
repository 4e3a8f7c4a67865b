"""Pipeline bubble: measured per-rank busy/idle time per schedule vs the textbook fractions.

    python benchmarks/pipeline_bubble.py                       # p in {2, 4}, m in {4, 8}, every schedule
    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 8 --t-f 0.1   # longer work: less relative overhead

Each rank runs torch.distributed.pipelining stages whose work is a *fixed* per-micro-batch workload: a sleep of
t_f in forward, t_b in the input-gradient pass and t_w in the weight-gradient pass (split so zero-bubble
schedules can move the W pass; a full backward is t_b + t_w). Sleeping rather than computing keeps the
measurement independent of how many ranks share the CPU cores (4 ranks on 2 cores would otherwise stretch
every busy period). With v chunks per rank each chunk sleeps t/v, so the work per rank is the same for every
schedule. Every sleep is timed (busy); idle = step wall - busy, on each rank, after a warm-up step (the first
step also infers the stage shapes).

Theory (docs/ESTIMATION.md, pipeline schedules), T = t_f + t_b + t_w, p ranks, m micro-batches, v chunks per rank:
  gpipe, 1f1b        (p-1) / (m + p - 1)                        Huang et al. 2019; Narayanan et al. 2019
  interleaved_1f1b   (p-1) / (v*m + p - 1)                      Narayanan et al. 2021 §2.2.2 (bubble / v)
  zero_bubble (ZBV)  (p-1)(t_f + t_b - 2 t_w) / (m T + that)    Qi et al. 2024 (arXiv:2401.10241) §6: 0 when
                                                                t_f = t_b = t_w, the default here
"simulated" replays torch's own action order for the schedule with zero communication cost (same t_f, t_b, t_w):
it equals the theory for gpipe/1f1b/interleaved, and shows ZBV's finite-m warm-up (torch also runs stage 0's
whole backward in its W pass). measured - simulated is the runtime's overhead (p2p, Python, OS wake-ups); it
shrinks as --t-f grows. busy/nominal > 1 flags sleeps that overshot (a loaded machine).
The last line of stdout is one JSON object with every row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

WIDTH = 16  # activation [mb, WIDTH]: tiny, so p2p time is negligible next to the sleeps
SCHEDULES = {  # name -> (torch class, chunks per rank, placement)
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "zero_bubble": ("ScheduleZBVZeroBubble", 2, "v"),
}


def _busy(seconds: float, log: list[float]) -> None:
    t0 = time.perf_counter()
    if seconds > 0:
        time.sleep(seconds)
    log.append(time.perf_counter() - t0)


class _Work(torch.autograd.Function):
    """Identity that sleeps `fwd_s` in forward and `bwd_s` in backward, logging both as busy time."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s, log):
        ctx.bwd_s, ctx.log = bwd_s, log
        _busy(fwd_s, log)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _busy(ctx.bwd_s, ctx.log)
        return grad, None, None, None


class SleepStage(nn.Module):
    """A stage with a fixed workload: t_f forward, t_b on the input-gradient path, t_w on the weight path."""

    def __init__(self, t_f: float, t_b: float, t_w: float, log: list[float]):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.t_f, self.t_b, self.t_w, self.log = t_f, t_b, t_w, log

    def forward(self, x):
        if not x.requires_grad:  # first stage: its layers still propagate input grads internally
            x = x.detach().requires_grad_()
        x = _Work.apply(x, self.t_f, self.t_b, self.log)  # input path: dI sleeps t_b
        w = _Work.apply(self.weight, 0.0, self.t_w, self.log)  # weight path: dW sleeps t_w
        return x * w


def theory(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float) -> float:
    if schedule == "zero_bubble":
        bubble = max(0.0, (p - 1) * (t_f + t_b - 2 * t_w))
        return bubble / (m * (t_f + t_b + t_w) + bubble)
    return (p - 1) / (v * m + p - 1)


def single_order(schedule: str, p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """(kind, stage, micro-batch) actions per rank of torch's one-stage-per-rank schedules (their
    `pipeline_order` is only a visualisation). 1F1B: rank r runs min(m, p - r) forwards, then alternates B, F."""
    order = {}
    for r in range(p):
        if schedule == "gpipe":
            order[r] = [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
            continue
        warm = min(m, p - r)
        acts = [("F", r, i) for i in range(warm)]
        for i in range(m):
            acts.append(("B", r, i))
            if warm + i < m:
                acts.append(("F", r, warm + i))
        order[r] = acts
    return order


def simulate(
    order: dict[int, list[tuple[str, int, int]]], n_stages: int, t_f: float, t_b: float, t_w: float, v: int
) -> float:
    """Bubble of a schedule's action order with zero communication cost: each rank runs its F / I / W / B
    actions in order, each as soon as its inputs exist. measured - simulated = the runtime's overhead."""
    cost = {"F": t_f / v, "I": t_b / v, "W": t_w / v, "B": (t_b + t_w) / v}
    queues = {r: list(acts) for r, acts in order.items()}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> finish time
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    progress = True
    while progress:
        progress = False
        for r, q in queues.items():
            while q:
                kind, s, mb = q[0]
                if kind == "F":
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif kind in ("I", "B"):
                    deps = [("F", s, mb)] + ([] if s == n_stages - 1 else [("G", s + 1, mb)])
                else:
                    deps = [("I", s, mb)]
                if any(d not in done for d in deps):
                    break
                c = cost[kind]
                if s == 0 and kind in ("I", "W"):  # torch skips stage 0's input pass; its W is a full backward
                    c = 0.0 if kind == "I" else (t_b + t_w) / v
                end = max([free[r]] + [done[d] for d in deps]) + c
                free[r], busy[r] = end, busy[r] + c
                done[(kind, s, mb)] = end
                if kind in ("I", "B"):
                    done[("G", s, mb)] = end  # the input grad is ready for stage s - 1
                q.pop(0)
                progress = True
    if any(queues.values()):
        raise RuntimeError(f"schedule did not finish in simulation: {queues}")
    span = max(free.values())
    return sum(1 - b / span for b in busy.values()) / len(busy)


def _order(sched, schedule: str, p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    if SCHEDULES[schedule][1] == 1:
        return single_order(schedule, p, m)
    return {
        r: [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in acts
            if a is not None and a.computation_type.value in "FIWB"
        ]
        for r, acts in sched.pipeline_order.items()
    }


def _bench_rank(rank: int, world: int, runs: list[dict]) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed import pipelining

    out = []
    for run in runs:
        cls, v, placement = SCHEDULES[run["schedule"]]
        n_stages, m = world * v, run["m"]
        ids = [rank, 2 * world - 1 - rank] if placement == "v" else [rank + k * world for k in range(v)]
        log: list[float] = []
        mods = [SleepStage(run["t_f"] / v, run["t_b"] / v, run["t_w"] / v, log) for _ in ids]
        stages = [pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu")) for mod, s in zip(mods, ids)]
        sched = getattr(pipelining, cls)(
            stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=lambda out, target: out.mean()
        )
        x, y = torch.randn(m * 2, WIDTH), torch.zeros(m * 2, WIDTH)  # 2 rows per micro-batch
        for _ in range(2):  # warm-up (shape inference), then the measured step
            log.clear()
            dist.barrier()
            t0 = time.perf_counter()
            sched.step(*((x,) if 0 in ids else ()), **({"target": y} if n_stages - 1 in ids else {}))
            wall = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when the last rank ends
        busy = sum(log)
        sim = (
            simulate(_order(sched, run["schedule"], world, m), n_stages, run["t_f"], run["t_b"], run["t_w"], v)
            if rank == 0
            else None
        )
        out.append({**run, "rank": rank, "busy_s": busy, "wall_s": float(wall), "simulated": sim})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline ranks p")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="micro-batches m")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--t-f", type=float, default=0.05, help="forward seconds per micro-batch per rank")
    ap.add_argument("--t-b", type=float, default=None, help="input-grad seconds (default t_f)")
    ap.add_argument("--t-w", type=float, default=None, help="weight-grad seconds (default t_f)")
    a = ap.parse_args(argv)
    t_f = a.t_f
    t_b = t_f if a.t_b is None else a.t_b
    t_w = t_f if a.t_w is None else a.t_w

    from curry_train.train.launch import launch_forkserver

    rows = []
    for p in a.pp:
        runs = [
            {"schedule": s, "m": m, "t_f": t_f, "t_b": t_b, "t_w": t_w} for m in a.microbatches for s in a.schedules
        ]
        per_rank = launch_forkserver(_bench_rank, p, runs, timeout=600)
        for i, run in enumerate(runs):
            ranks = [per_rank[r][i] for r in range(p)]
            v = SCHEDULES[run["schedule"]][1]
            wall = ranks[0]["wall_s"]
            idle = [1 - r["busy_s"] / wall for r in ranks]
            rows.append(
                {
                    "schedule": run["schedule"],
                    "p": p,
                    "v": v,
                    "m": run["m"],
                    "step_s": round(wall, 4),
                    "bubble_measured": round(sum(idle) / p, 4),
                    "bubble_theory": round(theory(run["schedule"], p, run["m"], v, t_f, t_b, t_w), 4),
                    "bubble_simulated": round(ranks[0]["simulated"], 4),
                    "bubble_per_rank": [round(x, 4) for x in idle],
                    # busy / nominal work: 1.0 unless sleeps overshoot (a loaded machine) or work repeats
                    "busy_over_nominal": round(sum(r["busy_s"] for r in ranks) / (p * run["m"] * (t_f + t_b + t_w)), 3),
                    "ideal_step_s": round(run["m"] * (t_f + t_b + t_w), 4),
                }
            )
    print(
        f"{'schedule':<17}{'p':>3}{'v':>3}{'m':>4}{'step s':>8}{'ideal s':>8}{'measured':>9}{'simulated':>10}"
        f"{'theory':>7}{'busy/nominal':>13}  measured per rank"
    )
    for r in rows:
        print(
            f"{r['schedule']:<17}{r['p']:>3}{r['v']:>3}{r['m']:>4}{r['step_s']:>8.3f}{r['ideal_step_s']:>8.3f}"
            f"{r['bubble_measured']:>9.3f}{r['bubble_simulated']:>10.3f}{r['bubble_theory']:>7.3f}"
            f"{r['busy_over_nominal']:>13.3f}  "
            f"{r['bubble_per_rank']}"
        )
    print(json.dumps({"benchmark": "pipeline_bubble", "t_f": t_f, "t_b": t_b, "t_w": t_w, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
