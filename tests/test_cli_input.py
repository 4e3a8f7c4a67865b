"""What a newcomer meets on the command line: bad numbers refused in one line with exit 2,
a missing YAML path named as missing, units that scale, no 'None' in the sweep, metrics in `runs`, a full
`runs --diff`, help and defaults on every option, a warning for ZeRO at dp=1 (from `estimate` and from `train`), and
no traceback when the reader of stdout goes away (`| head`). Each drives the real CLI in a subprocess but the train
one (in process, its rank forked)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest


def _cli(*args, root, stdout=subprocess.PIPE, timeout=300):
    return subprocess.run([sys.executable, "-m", "curry_train.cli", *args, "--root", str(root)],
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout)


BAD_NUMBERS = [  # (command + arguments, option named in the message, the range it states)
    (["bench", "--steps", "-3"], "--steps", ">= 1"),
    (["climb", "--memory-budget", "-5"], "--memory-budget", ">= 1"),
    (["bench", "--timeout", "nan"], "--timeout", "> 0"),
    (["plan", "--model", "tiny", "--margin", "1"], "--margin", "[0, 1)"),
    (["sweep", "--max-micro-batch", "0"], "--max-micro-batch", ">= 1"),
    (["mcp", "--http", "--port", "70000"], "--port", "<= 65535"),
    (["mcp", "--http", "--port", "0"], "--port", ">= 1"),
]


@pytest.mark.parametrize(("args", "option", "rng"), BAD_NUMBERS, ids=[" ".join(a[0][:1] + a[0][-2:])
                                                                       for a in BAD_NUMBERS])
def test_bad_numeric_option_is_one_line_exit_2(project, args, option, rng):
    r = _cli(*args, root=project)
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert option in lines[0] and rng in lines[0] and f"curry-train {args[0]}" in lines[0]
    assert not (project / "runs" / "ledger.sqlite3").exists()  # refused before anything started


def _numeric_options():
    from curry_train.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for a in p._actions:
            yield name, a


def test_every_numeric_option_has_a_range_checking_type():
    # a bare int/float lets -3 through to a traceback deep in the tool; whitebox is validated in its own module
    bare = [f"{n} {a.option_strings}" for n, a in _numeric_options() if a.type in (int, float)
            and (n, a.dest) not in {("whitebox", "steps"), ("whitebox", "timeout")}]
    assert bare == []


def test_every_option_has_help_and_the_help_shows_defaults(project):
    owned_elsewhere = {("whitebox", "timeout")}  # the validation/whitebox CLI
    missing = [f"{n} {a.option_strings}" for n, a in _numeric_options()
               if not isinstance(a, argparse._HelpAction) and not a.help and (n, a.dest) not in owned_elsewhere]
    assert missing == []
    r = _cli("bench", "--help", root=project)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "(default: 5)" in text and "(default: tiny)" in text and "default: None" not in text


def test_missing_yaml_path_says_so_and_lists_the_configs(project):
    r = _cli("estimate", "--config", "configs/nope.yaml", root=project)
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "tiny" in r.stderr and "llama3-8b" in r.stderr
    assert "not allowed" not in r.stderr


def test_estimate_on_tiny_prints_units_that_scale(project):
    r = _cli("estimate", "--config", "tiny", root=project)
    assert r.returncode == 0, r.stderr
    assert "0.00 GiB" not in r.stdout and "0.000" not in r.stdout
    assert "MiB" in r.stdout and "KiB" in r.stdout and "181k params" in r.stdout
    # MFU and HFU with the one convention they count in (estimator/layout.py MFU_CONVENTION)
    assert "HFU" in r.stdout and "causal attention counted as half" in r.stdout


def test_sweep_says_what_no_micro_batch_means(project):
    r = _cli("sweep", "--config", "llama3-8b", root=project)
    assert r.returncode == 0, r.stderr
    assert "None" not in r.stdout
    assert "max micro-batch: none (1 sequence per rank already exceeds the budget)" in r.stdout


def test_zero_at_dp1_is_warned_on_stderr_and_in_the_estimate(project):
    r = _cli("estimate", "--config", "tiny", "--set", "parallel.zero=2", "--json", root=project)
    assert r.returncode == 0, r.stderr
    assert "warning: parallel.zero=2 at dp=1" in r.stderr and "parallel.zero=0" in r.stderr
    assert any("zero=2 at dp=1" in w for w in json.loads(r.stdout)["warnings"])
    r = _cli("estimate", "--config", "tiny", "--set", "parallel.zero=2", "--set", "parallel.dp=2", root=project)
    assert "warning" not in r.stderr


def _two_runs(project):
    from curry_train.config import load_config
    from curry_train.store.runs import Ledger

    ledger = Ledger(project)
    tiny = project / "configs" / "tiny.yaml"
    a = ledger.start("train", load_config(tiny), "tiny")
    b = ledger.start("bench", load_config(tiny, {"parallel.dp": 2, "parallel.zero": 3, "parallel.recompute": "full",
                                                 "train.steps": 5, "train.lr": 1e-3}), "tiny")
    ledger.finish(a.run_id, status="ok", metrics={"losses": [5.5, 4.0], "last_loss": 4.0, "step_time_s": 0.02})
    ledger.finish(b.run_id, status="ok", metrics={"losses": [5.5, 4.1], "step_time_s": 0.04,
                                                   "peak_memory_bytes": 2_300_000})
    return a.run_id, b.run_id


def test_runs_shows_metrics_and_diff_names_every_change(project):
    a, b = _two_runs(project)
    r = _cli("runs", root=project)
    assert r.returncode == 0, r.stderr
    assert "loss 4.0000" in r.stdout and "step 20.0 ms" in r.stdout and "peak 2.19 MiB" in r.stdout
    r = _cli("runs", "--diff", a, b, root=project)
    assert r.returncode == 0, r.stderr
    assert "5 config change(s)" in r.stdout
    for key in ("parallel.dp", "parallel.zero", "parallel.recompute", "train.steps", "train.lr"):
        assert key in r.stdout
    assert "step time: 20.0 ms -> 40.0 ms (x2.00)" in r.stdout


@pytest.mark.parametrize("args", [["estimate", "--config", "llama3-8b"], ["runs"]])
def test_closed_stdout_gives_no_traceback(project, args):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has already exited: every write gets EPIPE
    try:
        r = _cli(*args, root=project, stdout=write_end)
    finally:
        os.close(write_end)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 141


@pytest.mark.multirank
def test_train_warns_about_zero_at_dp1_before_it_launches(project, capsys):
    """In process, its one rank forked (train's progress through torchrun: tests/test_cli.py)."""
    from curry_train.cli import main

    assert main(["train", "--config", "tiny", "--set", "parallel.zero=1", "--set", "train.steps=3",
                 "--root", str(project)]) == 0
    err = capsys.readouterr().err
    assert "warning: parallel.zero=1 at dp=1" in err and "launching 1 rank(s)" in err
    assert err.index("warning") < err.index("launching")
