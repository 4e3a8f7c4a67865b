"""`curry-train`: the command line over the same functions the MCP tools call.

    curry-train train --config configs/tiny.yaml --set parallel.dp=2 --json
    curry-train whitebox --config configs/tiny.yaml --set parallel.dp=2 --json
    curry-train runs [--diff RUN_A RUN_B] --json

Exit codes: 0 success (white-box passed), 1 failure (white-box parity failed; other commands: a rank crashed),
2 invalid input (config, name or arguments; one line on stderr and nothing was launched), 3 the white-box run could
not finish (timeout, crash, out of memory; no verdict), 141 stdout closed by its reader (`| head`).
Results go to stdout (JSON with --json); progress, warnings and logs go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

from curry_train.cli.argtypes import CliParser, nonneg_int, positive_int, seconds, stdout_closed

# Feature modules that add their own subcommands: each defines add_subcommands(subparsers).
EXTENSIONS = ["curry_train.cli.brain", "curry_train.cli.tools", "curry_train.cli.scale", "curry_train.cli.interop",
              "curry_train_mcp.cli"]

EXIT_OK, EXIT_FAIL, EXIT_INVALID, EXIT_UNFINISHED = 0, 1, 2, 3


def emit(obj: Any, as_json: bool, human: Callable[[Any], str] | None = None) -> None:
    if hasattr(obj, "model_dump"):
        data = obj.model_dump(mode="json")
    else:
        data = obj
    if as_json:
        print(json.dumps(data, indent=None, default=str))
    else:
        print(human(obj) if human else json.dumps(data, indent=2, default=str))


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiny", help="config name in configs/ (tiny, llama3-8b, ...) or a YAML path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override applied without writing the file, e.g. parallel.dp=2 (repeatable)")
    add_root_json(p)


def add_root_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default=None, help="project folder holding configs/ and runs/ (default: auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _cmd_train(a: argparse.Namespace) -> int:
    from curry_train.cli.report import say, warn_layout
    from curry_train.config import parse_sets
    from curry_train.measure import service

    warn_layout("train", a.config, parse_sets(a.set), a.root)
    rec = service.train(a.config, parse_sets(a.set), root=a.root, timeout=a.timeout, progress=say,
                        checkpoint_dir=a.checkpoint_dir, save_every=a.save_every, resume=a.resume,
                        keep_last=a.keep_last)
    m = rec.metrics
    emit(rec, a.json, lambda r: (f"run {r.run_id}: {r.config['parallel']} world={m['world_size']}\n"
                                 f"loss {m['first_loss']:.4f} -> {m['last_loss']:.4f} over {len(m['losses'])} steps; "
                                 f"median step {m['step_time_s'] * 1e3:.1f} ms, {m['tokens_per_s']:.0f} tokens/s"))
    return EXIT_OK


def _human_verdict(v: Any) -> str:
    planted = f", planted bug {v.injection}" if v.injection else ""
    lines = [f"white-box {'PASSED' if v.passed else 'FAILED'} (run {v.run_id}, {v.world_size} ranks, {v.steps} "
             f"step(s){planted})",
             f"  loss ref {v.losses_ref} vs parallel {v.losses_parallel} (max diff {v.loss_max_diff:.2e})",
             f"  grad norm ref {v.grad_norm_ref} vs parallel {v.grad_norm_parallel}",
             f"  {v.n_params_compared} parameters, {v.n_replica_copies} copies over all ranks",
             f"  lr schedule: {v.horizon}"]
    if v.resume:
        lines.append(f"  resumed at step {v.resume['step']} from {v.resume.get('checkpoint')} (saved by "
                     f"{v.resume['saved_by']}): checked {', '.join(v.resume['checks'])}")
    if v.worst_parameter:
        w = v.worst_parameter
        lines.append(f"  worst: {w.name}: {w.metric} {w.measured:.2e} (allowed {w.allowed:.2e})")
    if not v.passed:
        lines.append(f"  first diverging layer: {v.first_diverging_layer}"
                     + (f"; diverging rank: {v.diverging_rank}" if v.diverging_rank is not None else ""))
        lines += [f"  - {f}" for f in v.failures[:8]]
    if v.injection:
        lines.append(f"  the planted bug was {'caught' if not v.passed else 'NOT caught'}")
    return "\n".join(lines)


def _list_injections(as_json: bool) -> int:
    from curry_train.validation.inject import listing

    rows = listing()
    emit(rows, as_json, lambda rs: "\n".join(
        f"{r['name']:24s} {r['family']:9s} {r['layout']:36s} {r['breaks']}" + ("" if r["available"] else
                                                                               " [not available]") for r in rs))
    return EXIT_OK


def _cmd_whitebox(a: argparse.Namespace) -> int:
    from curry_train.config import parse_sets
    from curry_train.measure import service

    if a.list_injections:
        return _list_injections(a.json)
    if a.steps is not None and a.steps < 1:
        print(f"curry-train whitebox: --steps {a.steps}: a white-box compares at least 1 optimizer step (default: 2, "
              "or through the end of the lr warm-up)",
              file=sys.stderr)
        return EXIT_INVALID
    if not a.timeout > 0:
        print(f"curry-train whitebox: --timeout {a.timeout}: give a positive number of seconds (default 900)",
              file=sys.stderr)
        return EXIT_INVALID
    inject, target = a.inject, None
    if a.break_grad_sync:
        if inject or len(a.break_grad_sync) > 1:
            print("curry-train whitebox: --break-grad-sync takes one PARAM and is --inject ddp-unreduced-grad on it; "
                  "do not combine it with --inject", file=sys.stderr)
            return EXIT_INVALID
        inject, target = "ddp-unreduced-grad", a.break_grad_sync[0]
    from curry_train.train.launch import LaunchError
    from curry_train.validation.inject import WhiteboxInputError

    try:
        v = service.whitebox(a.config, parse_sets(a.set), steps=a.steps, root=a.root, timeout=a.timeout,
                             inject=inject, inject_target=target, resume_from_layout=a.resume_from_layout,
                             resume_at=a.resume_at)
    except WhiteboxInputError as e:
        print(f"curry-train whitebox: {e}", file=sys.stderr)
        return EXIT_INVALID
    except LaunchError as e:
        print(f"curry-train whitebox: the run could not finish, no verdict: {e}", file=sys.stderr)
        return EXIT_UNFINISHED
    emit(v, a.json, _human_verdict)
    return EXIT_OK if v.passed else EXIT_FAIL


def _cmd_runs(a: argparse.Namespace) -> int:
    from curry_train.cli.report import human_diff, human_runs, run_summary
    from curry_train.store.runs import Ledger, diff_runs

    ledger = Ledger(a.root)
    if a.diff:
        emit(diff_runs(ledger.get(a.diff[0]), ledger.get(a.diff[1])), a.json, human_diff)
    else:
        recs = ledger.list(a.limit)
        emit([{**r.model_dump(mode="json", exclude={"config", "metrics"}), "summary": run_summary(r.metrics)}
              for r in recs], a.json, human_runs)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(prog="curry-train", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a config on dp*tp*pp*cp ranks through torchrun")
    add_config_args(p)
    p.add_argument("--timeout", type=seconds, default=1800.0, help="seconds before every rank is killed")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (step-NNNNNN folders, DCP)")
    p.add_argument("--save-every", type=nonneg_int, default=0, help="save after every N optimizer steps (0: never)")
    p.add_argument("--keep-last", type=nonneg_int, default=0, help="keep only the newest N step folders, the older "
                   "deleted once a newer one is whole (0: keep all)")
    p.add_argument("--resume", default=None, help="continue from this checkpoint (folder or step-NNNNNN); the "
                   "layout may differ from the one that saved it")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("whitebox", help="prove the parallel run matches the single-device reference",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       epilog="exit codes: 0 passed, 1 parity failed, 2 bad input (nothing launched), 3 the run "
                              "could not finish (timeout, crash, out of memory)")
    add_config_args(p)
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps to compare (>= 1; default: 2, or through the first step after the lr "
                        "warm-up, at most 8; more goes further)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before every rank is killed (exit 3)")
    p.add_argument("--inject", metavar="NAME", default=None,
                   help="plant one known bug in the parallel run only; the verdict must fail (--list-injections)")
    p.add_argument("--list-injections", action="store_true",
                   help="print the planted-bug catalogue (name, family, layout, what it breaks) and exit")
    p.add_argument("--break-grad-sync", action="append", default=None, metavar="PARAM",
                   help="same as --inject ddp-unreduced-grad on PARAM (needs dp*cp > 1 and zero <= 1)")
    p.add_argument("--resume-from-layout", default=None, metavar="LAYOUT",
                   help="resume white-box: train --resume-at steps in LAYOUT (KEY=VALUE,... of the parallel section, "
                        "e.g. dp=2,zero=3, 'single', or a config of the same model), save, resume in this layout "
                        "for --steps (default 2) more; the saved and loaded state must be bitwise the run's")
    p.add_argument("--resume-at", type=positive_int, default=2,
                   help="with --resume-from-layout: the step the saving layout checkpoints at")
    p.set_defaults(fn=_cmd_whitebox)

    p = sub.add_parser("runs", help="list recorded runs, or diff two")
    p.add_argument("--diff", nargs=2, metavar=("RUN_A", "RUN_B"), help="compare two runs: config changes, metrics")
    p.add_argument("--limit", type=positive_int, default=20, help="newest runs to list")
    add_root_json(p)
    p.set_defaults(fn=_cmd_runs)

    for mod in EXTENSIONS:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):  # the extension itself is absent; a broken one still fails
                continue
            raise
        module.add_subcommands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from curry_train.compat import TorchVersionError, check_torch

    try:  # before anything imports torch: a torch below the minimum is invalid input, said in one line
        check_torch()
    except TorchVersionError as e:
        print(f"curry-train: {e}", file=sys.stderr)
        return EXIT_INVALID
    from curry_train.config import ConfigError
    from curry_train.measure.preflight import PreflightError
    from curry_train.paths import UnsafeName
    from curry_train.train.launch import LaunchError

    try:
        args = build_parser().parse_args(argv)
    except BrokenPipeError:  # `curry-train --help | head`
        return stdout_closed()
    try:
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe surfaces here, inside the handler, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return stdout_closed()
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError, PreflightError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) adds quotes
        print(f"curry-train {args.command}: {msg}", file=sys.stderr)
        return EXIT_INVALID
    except LaunchError as e:
        print(f"curry-train {args.command}: the run failed: {e}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
