"""`curry-train bench | probe | update-config | climb | install-skills`: the tool subcommands of the CLI.

    curry-train probe [--measure] --json
    curry-train bench --config tiny --set parallel.dp=2 --steps 3 --json [--plot memory.png]
    curry-train update-config tiny-zero1 --base tiny --set parallel.dp=2 --set parallel.zero=1 --json
    curry-train climb --config configs/tiny.yaml --memory-budget 6000000
    curry-train install-skills [--dest ~/.claude/skills]

Same functions as the MCP tools (bench.bench, hardware.probe_hardware, config_store.update_config, climb.climb);
results on stdout (one JSON object with --json), progress on stderr, exit codes as in cli.py.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from curry_train.cli import EXIT_FAIL, EXIT_INVALID, EXIT_OK, add_config_args, add_root_json, emit
from curry_train.cli.argtypes import byte_count, nonneg_int, positive_int, seconds


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _mib(b: float | None) -> str:
    from curry_train.cli.report import human_bytes

    return human_bytes(b)


def _human_bench(r) -> str:
    lines = [f"bench {r.run_id}: {r.config_name} world={r.world_size} on {r.device}",
             f"  median step {r.step_time_s * 1e3:.1f} ms ({r.micro_batches}/{r.full_micro_batches} micro-batches "
             f"per rank), {r.tokens_per_s:.0f} tokens/s" if r.step_time_s else
             "  no step time (OOM)",
             (f"  peak {_mib(r.peak_memory_bytes)} per rank (rank {r.memory_breakdown.rank}); budget "
              f"{_mib(r.memory_budget_bytes)} (usable {_mib(r.usable_bytes)})"
              f"{'  -> OOM' if r.oom else '' if r.fits else '  -> over the usable budget'}"),
             "  " + ", ".join(f"{k} {_mib(getattr(r.memory_breakdown, k))}"
                              for k in ("params", "grads", "optimizer", "activations", "other"))]
    if r.estimate is not None:
        err = r.estimate.error_vs_measured
        lines.append(f"  estimate {_mib(r.estimate.total)}" + (f" ({err:+.1%} vs measured)" if err is not None else ""))
    if r.losses:
        lines.append(f"  loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f} ({'finite' if r.loss_finite else 'NOT FINITE'})")
    if r.mfu is not None:
        lines.append(f"  MFU {r.mfu:.1%}")
    return "\n".join(lines)


def _cmd_bench(a: argparse.Namespace) -> int:
    from curry_train.cli.report import warn_layout
    from curry_train.config import parse_sets
    from curry_train.measure.bench import DeviceLock, bench

    warn_layout("bench", a.config, parse_sets(a.set), a.root)
    lock = DeviceLock(a.root)
    try:
        lock.acquire(timeout=a.timeout or 3600.0, on_wait=_err)
    except TimeoutError as e:
        _err(f"curry-train bench: {e}")
        return EXIT_FAIL
    try:
        r = bench(a.config, steps=a.steps, warmup=a.warmup, overrides=parse_sets(a.set), root=a.root,
                  timeout=a.timeout, progress=_err, micro_batches=a.micro_batches)
    finally:
        lock.release()
    if a.plot and r.plot_path:
        shutil.copyfile(r.plot_path, a.plot)
        _err(f"memory breakdown written to {a.plot}")
    emit(r, a.json, _human_bench)
    return EXIT_FAIL if r.oom or not r.loss_finite else EXIT_OK


def _human_probe(h) -> str:
    lines = [(f"{h.gpu_count} GPU(s), {h.cpu_count} CPU(s), {_mib(h.memory_bytes)} RAM; torch {h.torch_version}, "
              f"CUDA {h.cuda_version or '-'}, NCCL {h.nccl_version or '-'}; backends {', '.join(h.backends)}")]
    for g in h.gpus:
        lines.append(f"  [{g.index}] {g.name} {g.memory_bytes / 2**30:.1f} GiB cc {g.compute_capability} "
                     f"nvlinks {g.nvlinks}")
    if h.topology:
        lines += ["  topology:"] + ["    " + " ".join(f"{c:>5}" for c in row) for row in h.topology]
    if h.launcher or h.cluster:
        lines.append(f"  env: {dict(**h.launcher, **h.cluster)}")
    if h.measured:
        m = h.measured
        lines.append(f"  measured: matmul {m.matmul_tflops} TFLOP/s ({m.matmul_dtype}, n={m.matmul_size}); "
                     f"all-reduce busbw {m.allreduce_busbw_gbps or 0:.2f} GB/s over {m.allreduce_ranks} ranks")
    return "\n".join(lines)


def _cmd_probe(a: argparse.Namespace) -> int:
    from curry_train.measure.hardware import probe_hardware

    emit(probe_hardware(measure=a.measure), a.json, _human_probe)
    return EXIT_OK


def _cmd_update_config(a: argparse.Namespace) -> int:
    from curry_train.config import parse_sets
    from curry_train.store.configs import update_config

    r = update_config(a.name, parse_sets(a.set), a.base, root=a.root)
    emit(r, a.json, lambda u: (f"{'created' if u.created else 'updated' if u.written else 'unchanged'} {u.path}"
                               + "".join(f"\n  {c.key}: {c.old!r} -> {c.new!r}" for c in u.diff)))
    return EXIT_OK


def _cmd_climb(a: argparse.Namespace) -> int:
    from curry_train.cli.climb import climb, format_table
    from curry_train.config import parse_sets

    report = climb(a.config, a.memory_budget, overrides=parse_sets(a.set), name=a.name, steps=a.steps,
                   max_rungs=a.max_rungs, root=a.root, timeout=a.timeout, log=_err,
                   keep_checkpoints=a.keep_checkpoints)
    emit(report, a.json, format_table)
    return EXIT_OK if report.fits else EXIT_FAIL


def skills_source() -> Path:
    return Path(__file__).resolve().parents[3] / "skills"  # template/curry_train/cli/tools.py -> checkout root


def _cmd_install_skills(a: argparse.Namespace) -> int:
    src = Path(a.source) if a.source else skills_source()
    dest = Path(a.dest).expanduser()
    skills = sorted(p.parent for p in src.glob("*/SKILL.md"))
    if not skills:
        _err(f"no skills found under {src}")
        return EXIT_INVALID
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for d in skills:
        target = dest / d.name
        if target.exists():
            if not a.force:
                _err(f"{target} exists; pass --force to replace it")
                continue
            shutil.rmtree(target)
        shutil.copytree(d, target, ignore=shutil.ignore_patterns("__pycache__"))
        done.append(d.name)
    emit({"dest": str(dest), "installed": done}, a.json,
         lambda r: f"installed {len(r['installed'])} skill(s) into {r['dest']}: {', '.join(r['installed'])}")
    return EXIT_OK if done or not skills else EXIT_FAIL


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure step time, throughput and per-rank memory (vs the estimate)")
    add_config_args(p)
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=nonneg_int, default=1, help="untimed steps first")
    p.add_argument("--micro-batches", type=positive_int, default=None,
                   help="micro-batches per rank in each benched step, the layout unchanged (default: 2, or the "
                   "whole step under a pipeline or when its estimate is at most 30 s; measure/bench_plan.py)")
    p.add_argument("--timeout", type=seconds, default=None, help="seconds before every rank is killed (default: "
                   "init + the estimated step time x steps x margin)")
    p.add_argument("--plot", metavar="PNG", help="also write the memory breakdown (estimate vs measured) here")
    p.set_defaults(fn=_cmd_bench)

    p = sub.add_parser("probe", help="GPUs, links, CPUs, memory, versions, launcher/cluster environment")
    p.add_argument("--measure", action="store_true", help="also time a matmul and an all-reduce (launches ranks)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(fn=_cmd_probe)

    p = sub.add_parser("update-config", help="validate and atomically write configs/NAME.yaml (history kept)")
    p.add_argument("name", help="config name to write, e.g. tiny-zero1")
    p.add_argument("--base", help="start from this config (required when NAME does not exist yet)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted change (repeatable)")
    add_root_json(p)
    p.set_defaults(fn=_cmd_update_config)

    p = sub.add_parser("climb", help="the main job: climb the parallelism ladder until a memory budget fits")
    add_config_args(p)
    p.add_argument("--memory-budget", type=byte_count, required=True, metavar="BYTES",
                   help="per-rank memory budget in bytes, e.g. 1700000")
    p.add_argument("--name", default=None, help="config the climb writes (default <config>-climb)")
    p.add_argument("--steps", type=positive_int, default=3, help="timed bench steps per rung")
    p.add_argument("--max-rungs", type=nonneg_int, default=8, help="stop after this many primitives")
    p.add_argument("--timeout", type=seconds, default=900.0, help="seconds per bench / white-box run")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep every rung's checkpoint (fp32 weights + AdamW moments, 12 B/param each); "
                        "default: only the latest rung's, the one it resumed from is deleted once it has saved its own")
    p.set_defaults(fn=_cmd_climb)

    p = sub.add_parser("install-skills", help="copy the skills into a Claude skills folder")
    p.add_argument("--dest", default="~/.claude/skills", help="target folder (default ~/.claude/skills)")
    p.add_argument("--source", default=None, help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="replace skills that are already there")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(fn=_cmd_install_skills)
