"""The white-box harness: DDP matches the single-device reference, and a broken variant is caught and named."""

from __future__ import annotations

import pytest
import torch
from curry_train.config import load_config
from curry_train.validation.compare import compare
from curry_train.validation.whitebox import checksum, whitebox_batch

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"


@pytest.mark.multirank
def test_ddp_two_ranks_matches_reference_over_accumulation_layouts(tmp_path):
    cfgs = [load_config(TINY, o) for o in (
        {"parallel.dp": 2},                             # 2 micro-batches per rank
        {"parallel.dp": 2, "train.micro_batch": 1},     # 4 micro-batches per rank (no_sync path)
        {"parallel.dp": 2, "train.micro_batch": 4},     # no accumulation
        {"parallel.dp": 2, "train.dtype": "bfloat16"},  # bf16 autocast vs the fp32 reference (looser, stated)
        {"parallel.dp": 2, "parallel.zero": 3, "train.dtype": "bfloat16"},  # FSDP2 MixedPrecisionPolicy
    )]
    verdicts = whitebox_batch(cfgs, steps=2, out_dir=tmp_path)
    for v in verdicts:
        assert v.passed, v.failures
        assert v.loss_max_diff <= (2e-2 if "loss_rtol" in v.tolerance and v.tolerance["loss_rtol"] > 1e-4 else 1e-5)
        assert v.n_params_compared == 39
        assert v.n_replica_copies == 2 * 39  # both ranks' copies of every parameter were checked
        assert v.steps == 2 and len(v.losses_parallel) == 2
        assert v.losses_parallel[1] < v.losses_parallel[0] + 1.0  # two real steps were taken


@pytest.mark.multirank
def test_ddp_four_ranks_matches_reference(tmp_path):
    (v,) = whitebox_batch([load_config(TINY, {"parallel.dp": 4})], steps=2, out_dir=tmp_path)
    assert v.passed, v.failures


@pytest.mark.multirank
def test_an_unreduced_gradient_fails_and_names_the_parameter_and_layer(tmp_path):
    broken = "layers.1.attention.wv.weight"
    (v,) = whitebox_batch([load_config(TINY, {"parallel.dp": 2})], out_dir=tmp_path, inject="ddp-unreduced-grad",
                          inject_target=broken)
    assert not v.passed
    assert v.worst_parameter.name == f"grad[step 0] {broken}"
    assert v.first_diverging_layer == "layers.1"
    assert any(broken in f for f in v.failures)


def _fake(steps: int) -> dict:
    p = {"w": torch.ones(3)}
    return {"losses": [1.0] * steps, "grads": [p] * steps, "params": [p] * steps, "params_before": p,
            "replicas": [{}] * steps, "holders": [{"w": 1}] * steps}


@pytest.mark.parametrize("steps", [0, -1])
def test_a_verdict_that_compared_nothing_never_passes(steps):
    v = compare(load_config(TINY), _fake(0), _fake(0), steps)
    assert not v.passed and "compared nothing" in v.failures[0]


def test_a_step_missing_on_one_side_fails():
    v = compare(load_config(TINY), _fake(2), _fake(1), 2)
    assert not v.passed and "compared nothing" in " ".join(v.failures)


def test_checksum_sees_one_flipped_bit_and_a_swap():
    t = torch.randn(1000)
    u = t.clone()
    u.view(torch.int32)[17] ^= 1
    assert checksum(u) != checksum(t)
    s = t.clone()
    s[[3, 4]] = s[[4, 3]]
    assert checksum(s) != checksum(t) and checksum(t.clone()) == checksum(t)


def _drifted(param_drift: float, grad_diff: float) -> tuple[dict, dict]:
    """Two 2-step runs: the parallel weights after step 0 differ by `param_drift` (relative L2), its step-1
    gradient by `grad_diff` in one element; gradients of max 1.0, an update of 1.0 per element."""
    before, after = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    g = {"w": torch.tensor([1.0, 0.5, 0.0, -0.25])}
    ref = {"losses": [1.0, 1.0], "grads": [g, g], "params": [after, after], "params_before": before,
           "replicas": [{}, {}], "holders": [{"w": 1}] * 2}
    p0 = {"w": after["w"] + torch.tensor([param_drift * 2.0, 0.0, 0.0, 0.0])}  # ||p|| = 2
    g1 = {"w": g["w"] + torch.tensor([0.0, 0.0, grad_diff, 0.0])}
    par = {**ref, "grads": [g, g1], "params": [p0, p0]}
    return ref, par


def test_later_step_gradients_allow_the_drift_the_update_bound_admits_and_no_more():
    """compare.py docstring, "drift": the step-1 bound grows by grad_drift * delta * max|g|, delta measured."""
    cfg = load_config(TINY)
    kappa = 30.0
    ok = compare(cfg, *_drifted(1e-4, 0.9 * kappa * 1e-4), 2)
    assert ok.passed, ok.failures
    bad = compare(cfg, *_drifted(1e-4, 1.2 * kappa * 1e-4 + 1e-6), 2)
    assert not bad.passed and "grad[step 1] w" in bad.failures[0]
    # without drift the tight bound holds: the same gradient difference fails
    tight = compare(cfg, *_drifted(0.0, 0.9 * kappa * 1e-4), 2)
    assert not tight.passed and "grad[step 1] w" in tight.failures[0]


def _adam_step(g_small: float, where: int, diff: float) -> tuple[dict, dict]:
    """One step of a 4096-element tensor updated by lr*sign(g); element 0 has gradient `g_small`; the parallel
    weights differ by `diff` at element `where`."""
    lr = load_config(TINY).train.lr
    g = torch.full((4096,), 1e-3)
    g[0] = g_small
    before = {"w": torch.zeros(4096)}
    after = {"w": -lr * torch.sign(g)}
    ref = {"losses": [1.0], "grads": [{"w": g}], "params": [after], "params_before": before,
           "replicas": [{}], "holders": [{"w": 1}]}
    moved = after["w"].clone()
    moved[where] += diff
    return ref, {**ref, "params": [{"w": moved}]}


def test_an_eps_sized_gradients_update_may_differ_by_a_sign_flip_and_no_other_element_may():
    """compare.py docstring, "sign-free": AdamW turns eps-sized gradient noise into a share of lr."""
    cfg = load_config(TINY)
    lr = cfg.train.lr
    assert compare(cfg, *_adam_step(1e-8, 0, 0.1 * lr), 1).passed  # 0.1 lr of 0.19 L2: 1.6e-3, over 1e-3
    assert not compare(cfg, *_adam_step(1e-3, 0, 0.1 * lr), 1).passed  # the same on an ordinary element
    assert not compare(cfg, *_adam_step(1e-8, 0, 2.5 * lr), 1).passed  # more than a sign flip
    assert not compare(cfg, *_adam_step(1e-8, 1, 0.1 * lr), 1).passed  # the free element excuses no other


def test_layouts_of_one_model_share_one_reference_and_no_layout_leaks_into_it():
    from curry_train.validation import whitebox as wb

    dp2 = load_config(TINY, {"parallel.dp": 2, "parallel.zero": 3})
    tp2 = load_config(TINY, {"parallel.tp": 2, "parallel.sp": True})
    shared = wb.single_device_reference(dp2, 1)
    assert wb.single_device_reference(tp2, 1) is shared  # memoised: one reference for both layouts
    assert wb.single_device_reference(load_config(TINY, {"train.seed": 7}), 1) is not shared  # another model
    assert wb.single_device_reference(dp2, 2) is not shared  # another horizon
    fresh = wb.reference(load_config(TINY), 1)  # the uncached reference of the one-device config
    assert fresh["losses"] == shared["losses"]
    assert all(torch.equal(fresh["grads"][0][k], g) for k, g in shared["grads"][0].items())
