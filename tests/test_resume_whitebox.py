"""The resume white-box (validation/resume.py): save in layout A after 2 steps, resume in layout B for 2 more; the
saved and loaded state are bitwise the run's, the resumed steps match the reference within the white-box bounds,
and the planted resume bugs, which the loss-only resume check passes, fail it."""

from __future__ import annotations

import json

import pytest
from curry_train.config import load_config
from curry_train.validation.inject import CATALOGUE, InjectionError, check

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
STEPS = {"train.steps": 4, "train.lr_schedule": "cosine", "train.warmup_steps": 1, "train.grad_clip": 0.5}
ZERO3, TP2 = {"parallel.dp": 2, "parallel.zero": 3}, {"parallel.tp": 2}
DDP, ZERO1 = {"parallel.dp": 2}, {"parallel.dp": 2, "parallel.zero": 1}
LOSS_ONLY_RTOL = 1e-5  # the loss-only resume check of tests/test_checkpoint.py


def _cfg(o: dict):
    return load_config(TINY, {**STEPS, **o})


@pytest.mark.multirank
def test_resume_is_proven_and_the_planted_resume_bugs_pass_the_loss_check_but_fail_it(tmp_path):
    from curry_train.validation.resume import resume_batch
    from curry_train.validation.whitebox import single_device_reference

    names = [None, None, "resume-drops-moments", "resume-step-reset"]
    pairs = [(_cfg(ZERO3), _cfg(TP2)), (_cfg(DDP), _cfg(ZERO1)), (_cfg(ZERO3), _cfg(TP2)), (_cfg(ZERO3), _cfg(TP2))]
    verdicts = resume_batch(pairs, out_dir=tmp_path, inject=names)  # 2 launches: A (2 layouts), B (4 specs)
    uninterrupted = single_device_reference(_cfg({}), 4)["losses"]
    loss_only = [max(abs(a - b) / abs(b) for a, b in zip(v.losses_parallel, uninterrupted)) for v in verdicts]
    print(json.dumps({f"{i} {n}": {"passed": v.passed, "bound_use": v.bound_use, "loss_only_rel": r,
                                   "worst": v.worst_parameter and v.worst_parameter.model_dump(),
                                   "failures": v.failures[:4]}
                      for i, (n, v, r) in enumerate(zip(names, verdicts, loss_only))}))
    for v in verdicts:
        assert v.steps == 4 and len(v.losses_parallel) == 4 and v.resume["step"] == 2
    for v in verdicts[:2]:  # clean: every check passes, the state bitwise, the position exact
        assert v.passed, v.failures
        assert v.bound_use["resume_saved_bitwise"] == v.bound_use["resume_loaded_bitwise"] == 0.0
        assert v.bound_use["resume_position"] == 0.0
        assert max(v.bound_use.values()) < 0.5, v.bound_use
    for name, v, rel in zip(names[2:], verdicts[2:], loss_only[2:]):
        assert rel < LOSS_ONLY_RTOL, (name, rel)  # the loss-only resume check passes the bug ...
        assert not v.passed, name  # ... the resume white-box fails it, naming the tensor and the step
        assert v.worst_parameter.name == "param[step 2] layers.2.attention_norm.weight", v.worst_parameter
        assert v.first_diverging_layer == "layers.2"
    drops, reset = verdicts[2], verdicts[3]
    assert any(f.startswith("resume loaded: layers.2.attention_norm.weight.exp_avg differs") for f in drops.failures)
    assert any(f.startswith("resume loaded: layers.2.attention_norm.weight.step differs") for f in reset.failures)
    assert any(f.startswith("resume position: 1 AdamW step counter(s)") for f in reset.failures)


@pytest.mark.multirank
def test_bf16_pairs_of_the_former_autocast_layouts_resume_into_fsdp_and_back(tmp_path):
    """Every bf16 layout makes FSDP2's casts (wrapping.py), so a pair of DDP-era (ZeRO-0, ZeRO-1) and FSDP layouts
    is comparable (they were refused while ZeRO-0/1 ran autocast); resharding bf16 ZeRO-0's replicas into ZeRO-3
    shards and ZeRO-3 into ZeRO-1's held step is bitwise."""
    from curry_train.validation.resume import layout_from, resume_batch

    bf16 = {"train.dtype": "bfloat16"}
    pairs = [(_cfg({**DDP, **bf16}), _cfg({**ZERO3, **bf16})), (_cfg({**ZERO3, **bf16}), _cfg({**ZERO1, **bf16}))]
    for a, b in pairs:
        assert layout_from(b, a) is a  # not refused: the same casts and the same (fp32) bounds
    for v in resume_batch(pairs, out_dir=tmp_path):
        assert v.passed, v.failures
        assert v.bound_use["resume_saved_bitwise"] == v.bound_use["resume_loaded_bitwise"] == 0.0
        assert v.tolerance["update_rtol"] == 1e-3 and max(v.bound_use.values()) < 0.5, v.bound_use


def test_bf16_pairs_held_to_different_bounds_are_refused():
    from curry_train.validation.inject import WhiteboxInputError
    from curry_train.validation.resume import layout_from

    with pytest.raises(WhiteboxInputError, match="same bounds"):
        layout_from(_cfg({**TP2, "train.dtype": "bfloat16"}), "dp=2,zero=3")


def test_resume_bugs_need_a_resume_and_a_real_tensor():
    cfg = _cfg(TP2)
    assert CATALOGUE["resume-drops-moments"].family == CATALOGUE["resume-step-reset"].family == "resume"
    with pytest.raises(InjectionError, match="--resume-from-layout"):
        check("resume-drops-moments", cfg)
    assert check("resume-step-reset", cfg, resume=True).name == "resume-step-reset"


@pytest.mark.parametrize(("spec", "says"), [
    ("dp2", "neither KEY=VALUE"),
    ("dp=2,zero", "is not KEY=VALUE"),
    ("dp=3", "--resume-from-layout 'dp=3'"),  # 3 ranks do not divide the batch: refused by config.check
    ("model.d_model=32", "differs in model"),
])
def test_bad_saving_layouts_are_refused_before_anything_runs(capsys, project, spec, says):
    from curry_train.cli import main

    code = main(["whitebox", "--config", "tiny", "--root", str(project), "--set", "parallel.tp=2",
                 "--resume-from-layout", spec, "--json"])
    err = capsys.readouterr().err
    assert code == 2 and says in err, (code, err)
    assert not (project / "runs" / "ledger.sqlite3").exists()


def test_the_saving_layout_resets_the_parallel_section():
    from curry_train.validation.resume import layout_from

    a = layout_from(_cfg(TP2), "dp=2,zero=3")
    assert (a.parallel.dp, a.parallel.zero, a.parallel.tp) == (2, 3, 1)
    assert layout_from(_cfg(TP2), "single").world_size == 1
