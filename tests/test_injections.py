"""The planted-bug catalogue (validation/inject.py): every entry makes the white-box fail on its natural layout and
the verdict names what the bug touched; bad requests exit 2 before anything starts (a run that cannot finish exits
3: tests/test_cli.py, through torchrun)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from curry_train.cli import main
from curry_train.config import load_config
from curry_train.validation.compare import module_of
from curry_train.validation.horizon import default_steps
from curry_train.validation.inject import CATALOGUE, listing

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

# First diverging module each bug must be localised to (the earliest failing step's earliest failing tensor).
FIRST_LAYER = {"ddp-unreduced-grad": "layers.2", "tp-sp-norm-unreduced": "layers.0", "ep-expert-unreduced": "layers.0",
               "rank-grad-1pct": "layers.0", "mid-layer-forward": "layers.2", "tp-partial-sum-1pct": "layers.2",
               "tp-ep-router-unreduced": "layers.0",
               "ep-expert-ep-averaged": "layers.0", "hsdp-expert-no-replica-allreduce": "layers.0",
               "route-drops-best": "layers.0"}


def _natural(name: str):
    nat = dict(CATALOGUE[name].natural)
    return load_config(PRESETS / f"{nat.pop('config')}.yaml", nat)


@pytest.mark.multirank
def test_every_planted_bug_fails_on_its_natural_layout_and_is_named(tmp_path):
    # the "resume" family plants in the checkpoint load: tests/test_resume_whitebox.py runs them resumed
    names = [n for n, i in CATALOGUE.items() if i.family != "resume"]
    cfgs = [_natural(n) for n in names]
    worlds = sorted({c.world_size for c in cfgs})
    assert worlds == [2, 4]  # one forkserver launch per world size: HSDP needs dp=4, everything else 2 ranks
    by = {}
    for w in worlds:
        mine = [(n, c) for n, c in zip(names, cfgs) if c.world_size == w]
        (out := tmp_path / f"world{w}").mkdir()
        verdicts = whitebox_batch([c for _, c in mine], out_dir=out, timeout=600,  # steps: the default horizon
                                  inject=[n for n, _ in mine])
        by.update(zip([n for n, _ in mine], verdicts))
    for name, v in by.items():
        inj = CATALOGUE[name]
        assert not v.passed, f"{name} was not caught"
        assert v.injection == name
        if inj.touches == "scalar":  # only a per-rank scalar fails: no tensor is named, the rank is
            assert v.worst_parameter is None and v.first_diverging_layer is None, (name, v.worst_parameter)
            assert v.diverging_rank == 0 and any("rank 1" in f for f in v.failures), (name, v.failures[:4])
            continue
        if inj.touches == "grad_norm":  # bf16's relative bounds: only the global norm resolves it, no tensor named
            assert v.worst_parameter is None and v.failures, (name, v.worst_parameter)
            assert all(f.startswith("grad norm step ") for f in v.failures), (name, v.failures[:4])
            continue
        if inj.touches == "rank":
            assert v.diverging_rank == 1, (name, v.diverging_rank, v.failures[:3])
            assert any("rank 1" in f for f in v.failures)
            continue
        worst = v.worst_parameter.name.split(" ")[-1]
        assert re.search(inj.touches, worst), (name, v.worst_parameter.name)
        assert v.first_diverging_layer == FIRST_LAYER.get(name, "tok_embeddings"), (name, v.first_diverging_layer)
        assert any(re.search(inj.touches, f) for f in v.failures), (name, v.failures[:3])
    # the three the old harness let through: caught by the update bound, the replica check, the data
    assert by["zero1-no-weight-decay"].worst_parameter.name.startswith("param[step 0]")
    assert "norm" in by["zero1-no-weight-decay"].worst_parameter.name
    assert by["replica-lr"].worst_parameter.name.startswith("param[step 0, rank 1]")
    # the white-box runs the real train step: a zero-grad that does nothing sums two steps' gradients at step 1
    assert by["zero-grad-noop"].worst_parameter.name.startswith("grad[step 1]"), by["zero-grad-noop"].worst_parameter
    # the holes the re-synchronised, per-tensor, every-rank checks close (each entry passed the drift-loosened
    # harness; docs/CPU-DISTRIBUTED.md, "White-box checks"): which check catches each
    assert by["rank-grad-1pct"].worst_parameter.metric == "L2 |diff|", by["rank-grad-1pct"].worst_parameter
    assert "exactly 0" in by["unseen-rows-grad"].worst_parameter.metric
    assert by["clip-local-norm-fsdp"].worst_parameter.name.startswith("param[step 1]")  # the step-0 bound at step 1
    assert any("rank 1's copy differs" in f for f in by["clip-local-norm-tp"].failures)
    assert by["ddp-rank-sum"].worst_parameter.name.startswith("grad[step 0, rank 1]")  # reduced grads checksummed
    assert by["data-same-rows"].loss_max_diff > 1e-3  # half the batch: another loss, not only other gradients
    # HSDP without the replica all-reduce: rank 0's gradient is its replica's half-batch mean (not the global one),
    # and the first rank of the other replica group (ranks 2, 3 on the (dp_replicate, dp_shard) mesh) diverges.
    hsdp = by["hsdp-no-replica-allreduce"]
    assert hsdp.worst_parameter.name.startswith("grad[step 0]"), hsdp.worst_parameter.name
    assert hsdp.diverging_rank == 2, (hsdp.diverging_rank, hsdp.failures[:3])
    # the holes of the white-box's horizon, localisation and bf16 (each passed, or was localised to the embedding
    # or to no rank, before; docs/CPU-DISTRIBUTED.md, "White-box checks")
    # each bug at the horizon `curry-train whitebox --inject NAME` compares on its natural layout alone
    assert {n: v.steps for n, v in by.items()} == {n: default_steps(_natural(n)) for n in by}
    assert by["lr-warmup-restart"].steps == 3  # default_steps reaches the first step after the warm-up ...
    assert by["lr-warmup-restart"].worst_parameter.name.startswith("param[step 2]")  # ... where the bug starts
    for name in ("mid-layer-forward", "tp-partial-sum-1pct"):  # forward bugs located by the forward activations
        assert by[name].worst_parameter.name == "act[step 0] layers.2", by[name].worst_parameter
    assert any(f.startswith("rank loss step 0, rank 0") for f in by["cp-loss-unreduced"].failures)
    for name in ("replicate-reduce-bf16", "fsdp-reduce-bf16"):  # held to the fp32 bounds against a same-casts reference
        assert by[name].worst_parameter.name.startswith("grad[step 0]"), by[name].worst_parameter


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_catalogue_lists_every_name_with_family_and_layout(capsys):
    code, out, _ = _run(capsys, "whitebox", "--list-injections", "--json")
    rows = json.loads(out)
    assert code == 0
    assert [r["name"] for r in rows if r["available"]] == [r["name"] for r in rows] == list(CATALOGUE) == [
        "ddp-unreduced-grad", "zero1-no-weight-decay", "fsdp-grad-sum", "hsdp-no-replica-allreduce",
        "tp-sp-norm-unreduced", "pp-unscaled-grads", "ep-expert-unreduced", "cp-local-lse", "data-same-rows",
        "replica-lr", "zero-grad-noop", "rank-grad-1pct", "unseen-rows-grad", "clip-local-norm-fsdp",
        "clip-local-norm-tp", "ddp-rank-sum", "lr-warmup-restart", "mid-layer-forward", "cp-loss-unreduced",
        "replicate-reduce-bf16", "fsdp-reduce-bf16", "tp-partial-sum-1pct", "tp-partial-sum-2pct",
        "resume-drops-moments", "resume-step-reset", "tp-ep-router-unreduced", "tp-ep-tokens-twice",
        "ep-expert-ep-averaged", "hsdp-expert-no-replica-allreduce", "route-drops-best"]
    assert all(r["family"] and r["breaks"] and r["layout"] for r in listing())


def test_the_skills_table_is_the_catalogue():
    # skills/whitebox-validation's table of planted bugs names every entry with its family, and no other name
    skill = Path(__file__).resolve().parents[1] / "skills" / "whitebox-validation" / "SKILL.md"
    text = skill.read_text(encoding="utf-8")
    table = text.split("| inject | family |", 1)[1].split("\n\n", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| ([^|]+?) \|", table, flags=re.M))
    assert rows == {n: i.family for n, i in CATALOGUE.items()}


@pytest.mark.parametrize(("args", "says"), [
    (["--inject", "nope"], "use one of ddp-unreduced-grad, zero1-no-weight-decay"),
    (["--set", "parallel.dp=2", "--inject", "ep-expert-unreduced"], "this model is dense"),
    (["--inject", "hsdp-no-replica-allreduce", "--set", "parallel.dp=2"], "parallel.dp_replicate"),
    (["--inject", "hsdp-no-replica-allreduce", "--set", "parallel.dp=4", "--set", "parallel.zero=3"],
     "dp_replicate=1, zero=3"),  # plain FSDP: no replica groups, nothing to skip
    (["--set", "parallel.dp=2", "--inject", "zero1-no-weight-decay"], "needs ZeRO-1"),
    (["--set", "parallel.dp=2", "--set", "parallel.zero=1", "--inject", "zero1-no-weight-decay"], "weight_decay"),
    (["--set", "parallel.tp=2", "--inject", "tp-sp-norm-unreduced"], "needs sequence parallel"),
    (["--set", "parallel.dp=2", "--inject", "pp-unscaled-grads"], "needs pipeline parallelism"),
    (["--set", "parallel.dp=2", "--inject", "cp-local-lse"], "needs context parallelism"),
    (["--set", "parallel.dp=2", "--inject", "ep-expert-ep-averaged"], "this model is dense"),
    (["--inject", "hsdp-expert-no-replica-allreduce", "--set", "parallel.dp=4", "--set", "parallel.dp_replicate=2",
      "--set", "parallel.zero=3"], "this model is dense"),
    (["--break-grad-sync", "output.weight"], "dp=1"),  # the old self-test at dp=1 passed silently
    (["--steps", "0"], "at least 1 optimizer step"),
    (["--steps", "-1"], "at least 1 optimizer step"),
    (["--timeout", "-1"], "positive number of seconds"),
    (["--set", "parallel.dp=2", "--inject", "replica-lr", "--break-grad-sync", "x"], "do not combine"),
    (["--set", "parallel.tp=2", "--inject", "resume-drops-moments"], "add --resume-from-layout"),
])
def test_bad_requests_exit_2_and_launch_nothing(capsys, project, args, says):
    code, out, err = _run(capsys, "whitebox", "--config", "tiny", "--root", str(project), "--json", *args)
    assert code == 2 and out == "", (code, out)
    assert says in err, err
    assert not (project / "runs" / "ledger.sqlite3").exists()  # nothing recorded, nothing launched


def test_module_names_for_localisation():
    assert module_of("layers.2.feed_forward.w1.weight") == "layers.2"
    assert module_of("tok_embeddings.weight") == "tok_embeddings"
