"""Flip-aware routing (validation/routing.py): MoE in bf16 under tp and cp passes the white-box with its near-tied
top-k flips judged and replayed, a wrong expert choice fails it; the judge's rules on hand-made routes."""

from __future__ import annotations

import math

import pytest
import torch
from curry_train.config import load_config
from curry_train.validation.compare import BF16, _Checker
from curry_train.validation.routing import LAMBDA, RouteReplay, U, flip_aware, roundings, route_check

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

MOE = PRESETS / "tiny-moe.yaml"
BF = {"train.dtype": "bfloat16"}
LAYOUTS = {"tp2": {"parallel.tp": 2}, "tp2 sp": {"parallel.tp": 2, "parallel.sp": True}, "cp2": {"parallel.cp": 2}}


@pytest.mark.multirank
def test_bf16_moe_under_tp_and_cp_passes_with_near_ties_replayed_and_a_wrong_expert_fails(tmp_path):
    """docs/CPU-DISTRIBUTED.md, "bf16": before the routing was judged, the router gate's gradient failed the 5%
    bound on these layouts (1.04x tp2, 1.45x cp2) because the bf16 stream flipped near-tied top-k choices."""
    cfgs = [load_config(MOE, {**o, **BF}) for o in LAYOUTS.values()] + [load_config(MOE, {**LAYOUTS["cp2"], **BF})]
    *clean, bug = whitebox_batch(cfgs, steps=2, out_dir=tmp_path, inject=[None, None, None, "route-drops-best"])
    for name, v in zip(LAYOUTS, clean):
        assert v.passed, (name, v.failures)
        assert v.tolerance == BF16 and max(v.bound_use.values()) < 0.5, (name, v.bound_use)  # every bound, margin
        assert {"router_logits", "routing_tie"} <= set(v.bound_use), v.bound_use
        counts = [c for step in v.routing for c in step.values()]
        assert len(counts) == 2 * 4 and all(c["tokens"] == 8 * 64 and c["diverged"] == 0 for c in counts), counts
        assert sum(c["flips"] for c in counts) >= 1, counts  # the replay is exercised, not vacuous
        assert all(c["replayed"] == c["discordant"] <= 8 for c in counts), counts
    # every 8th token drops its best expert: 64 of the 512 tokens of each router, none of them a near tie
    assert not bug.passed and bug.injection == "route-drops-best"
    said = ("routing[step 0] layers.0.feed_forward.router: 64 of 512 tokens chose other experts than the reference "
            "beyond the bf16 near-tie margin")
    assert any(f.startswith(said) for f in bug.failures), bug.failures[:3]
    assert bug.bound_use["routing_tie"] > 10 and bug.first_diverging_layer == "layers.0", bug.bound_use
    assert bug.worst_parameter.name == "routing[step 0] layers.0.feed_forward.router", bug.worst_parameter


def test_flip_aware_only_where_bf16_is_held_to_relative_bounds():
    assert flip_aware(load_config(MOE, {"parallel.tp": 2, **BF}))
    assert flip_aware(load_config(MOE, {"parallel.dp": 2, "parallel.ep": 2, **BF}))
    assert not flip_aware(load_config(MOE, {"parallel.tp": 2}))  # fp32: exact routing, the fp32 bounds judge
    assert not flip_aware(load_config(MOE, {"parallel.dp": 2, **BF}))  # the reference's bf16 ops exactly
    assert not flip_aware(load_config(MOE, {"parallel.cp": 2, **BF}), compiled=True)
    assert not flip_aware(load_config(PRESETS / "tiny.yaml", {"parallel.tp": 2, **BF}))  # no router


def _judge(par_top: list[list[int]], par_logits: torch.Tensor, logits: torch.Tensor, x: torch.Tensor,
           w: torch.Tensor, name: str = "layers.0.feed_forward.router"):
    """One micro-batch of 1 sequence of len(par_top) tokens through RouteReplay; returns (its top-k, stats)."""
    N = len(par_top)
    recorded = {name: {"experts": torch.tensor(par_top).view(1, N, -1), "logits": par_logits.view(1, N, -1),
                       "conflicts": {}}}
    judge = RouteReplay(recorded, micro_batch=1)
    top = logits.topk(len(par_top[0]), dim=-1).indices
    out = judge._replay(name, 0, x, w, logits, top)
    return out, judge.stats


def test_a_flip_within_the_margin_is_replayed_and_one_beyond_it_fails():
    torch.manual_seed(0)
    E, D = 4, 64
    w, x = torch.randn(E, D) * 0.02, torch.randn(2, D)
    # token 0: experts 1 and 2 nearly tied, token 1: expert 1 far ahead of 2 (logits set by hand, x for the margin)
    logits = torch.tensor([[3.0, 1.0, 1.0 - 1e-6, -1.0], [3.0, 1.0, 0.0, -1.0]])
    par_logits = logits.clone()
    par_logits[0, 2] += 2e-6  # the parallel run's x rounded elsewhere: 2 of its 3 best swap order
    out, st = _judge([[0, 2], [0, 2]], par_logits, logits, x, w)
    assert out.tolist() == [[0, 2], [0, 1]]  # token 0 replays the parallel choice; token 1 keeps its own
    s = st["layers.0.feed_forward.router"]
    assert (s["tokens"], s["discordant"], s["flips"], s["replayed"], s["diverged"]) == (2, 2, 2, 1, 1)
    scale = LAMBDA * math.sqrt(roundings("layers.0.feed_forward.router")) * U  # c = 3 for the first block
    margin = scale * float((x[1] * (w[1] - w[2])).norm())
    assert s["worst_share"] == pytest.approx(1.0 / margin, rel=1e-4)  # token 1's gap of 1.0 against its margin
    c = _Checker(True, dict(BF16))
    route_check(c, 0, st)
    assert c.failures == [f"routing[step 0] layers.0.feed_forward.router: 1 of 2 tokens chose other experts than "
                          f"the reference beyond the bf16 near-tie margin (worst gap {1.0 / margin:.3g}x the margin)"]
    assert c.use["routing_tie"] > 1 and c.localise()[1] == "layers.0"


def test_unrecorded_tokens_and_logits_beyond_rounding_fail():
    torch.manual_seed(0)
    w, x = torch.randn(4, 64) * 0.02, torch.randn(2, 64)
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [3.0, 1.0, 0.0, -1.0]])
    out, st = _judge([[0, 1], [-1, -1]], logits + 0.5, logits, x, w)  # logits 0.5 off; token 1 never routed
    s = st["layers.0.feed_forward.router"]
    assert out.tolist() == [[0, 1], [0, 1]] and s["unrecorded"] == 1 and s["logit_share"] > 1
    c = _Checker(True, dict(BF16))
    route_check(c, 1, st)
    assert len(c.failures) == 1 and "1 tokens the ranks did not route" in c.failures[0], c.failures
    assert "router logits moved" in c.failures[0]


def test_the_docs_and_the_skill_quote_the_margin_the_code_applies():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "CPU-DISTRIBUTED.md").read_text()
    skill = (root / "skills" / "whitebox-validation" / "SKILL.md").read_text()
    assert U == 2.0 ** -8 and "u = 2^-8" in doc and "u = 2^-8" in skill
    for text in (doc, skill):
        assert f"{LAMBDA:g} sqrt(c) u ||x * W_e||_2" in text
    first, last = roundings("layers.0.feed_forward.router"), roundings("layers.3.feed_forward.router")
    assert f"({first} in `layers.0`, {last} in `layers.3`)" in doc
    assert "left open" not in doc


def test_a_training_run_frees_the_router_logits_and_only_a_recording_keeps_them():
    # Routing carrying the [N, E] logits kept them alive through the MoE block: the measured activations of
    # moe-front-tp2-ep2 moved 1.3% (benchmarks/estimator_accuracy.py) until only the recorder turned it on
    from types import SimpleNamespace

    from curry_train.model.gpt import build_model
    from curry_train.model.moe import TopKRouter
    from curry_train.validation.routing import RouteRecorder

    cfg = load_config(MOE)
    model = build_model(cfg)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    x = torch.randn(8, cfg.model.d_model)
    assert routers and all(r(x).logits is None for r in routers)
    topo = SimpleNamespace(tp=1, cp=1, coords=lambda rank: {"dp": 0, "tp": 0, "cp": 0})
    rec = RouteRecorder(SimpleNamespace(cfg=cfg, topo=topo, parts=[model]), lambda n: n, lambda: True)
    assert all(r(x).logits.shape == (8, cfg.model.num_experts) for r in routers)
    rec.close()
    assert all(r(x).logits is None for r in routers)


def test_the_memoised_reference_never_drops_recorded_routes():
    # the uninterrupted reference (no weights) is memoised per model; a call that carries the parallel run's
    # routes must be judged, not answered from the memo without them
    from curry_train.validation.whitebox import single_device_reference

    cfg = load_config(MOE, {**LAYOUTS["tp2"], **BF, "train.global_batch": 2})
    assert single_device_reference(cfg, 1)["routing"] == [None]
    judged = single_device_reference(cfg, 1, routes=[{}])["routing"][0]  # nothing recorded: every token unrecorded
    tokens = cfg.train.global_batch * cfg.train.seq_len
    assert judged and all(st["unrecorded"] == tokens and st["tokens"] == 0 for st in judged.values()), judged
