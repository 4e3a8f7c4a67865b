"""The skills' numeric tables against the estimator: a skill can no longer contradict a tool.

    .venv/bin/pytest tests/test_skill_numbers.py -q

Each table row's formula is read from the skill text, evaluated, and compared with what curry_train.estimator
computes for the same layout: bytes of stored model state per parameter per ZeRO stage
(skills/primitive-distributed-optimizer, skills/stage4-parallel-primitive-intro/references/decision-details.md)
and the bubble fraction per pipeline schedule (skills/primitive-pipeline-schedule).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from curry_train.config import from_dict
from curry_train.estimator import _states, layout_of, replace_layout, stage_ids
from curry_train.estimator.acts import _acts
from curry_train.estimator.layout import hardware_flops_per_token
from curry_train.estimator.pipeline import bubble_fraction, in_flight

SKILLS = Path(__file__).resolve().parents[1] / "skills"
DIST_OPT = SKILLS / "primitive-distributed-optimizer" / "SKILL.md"
DECISION = SKILLS / "stage4-parallel-primitive-intro" / "references" / "decision-details.md"
PIPELINE = SKILLS / "primitive-pipeline-schedule" / "SKILL.md"

# Llama 3 8B's shape (Meta 2024, arXiv:2407.21783, Table 3), inline: tests never read the checkout's configs/.
LLAMA3_8B = {"vocab_size": 128256, "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
             "d_ff": 14336}


def _layout_for(dtype: str = "bfloat16", **parallel):
    cfg = from_dict({"model": LLAMA3_8B, "train": {"seq_len": 8192, "global_batch": 64, "micro_batch": 1,
                                                   "dtype": dtype},
                     "parallel": parallel, "hardware": {"device": "cuda", "gpus_per_node": 8, "nodes": 1}})
    return layout_of(cfg)


def _bytes_per_param(zero: int, d: int, dtype: str = "bfloat16") -> float:
    """Stored params + grads + AdamW state over the model's parameters, per rank (the estimator's states)."""
    x = _layout_for(dtype, dp=d, zero=zero)
    st = _states(x, stage_ids(x, 0))
    n = _states(replace_layout(x, dp=1, zero=0), [0]).n_local
    return (st.params + st.grads_full + st.opt) / n


def _eval(formula: str, **names: float) -> float:
    """A table cell such as '8 + 8/d' or '16/d + gathered units' (transient terms dropped), evaluated."""
    expr = formula.replace("gathered units", "").replace("−", "-").replace("·", "*").strip().rstrip("+").strip()
    assert re.fullmatch(r"[0-9dpvm+\-*/() .]+", expr), f"not a formula: {formula!r}"
    return float(eval(expr, {"__builtins__": {}}, names))  # noqa: S307 - digits, operators and table symbols only


def _rows(path: Path, first_cell: str) -> dict[str, list[str]]:
    """The rows of the markdown table whose header starts with `first_cell`, keyed by their first cell."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_cell}"))
    out = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out[cells[0]] = cells[1:]
    return out


@pytest.mark.parametrize("path,first,col", [(DIST_OPT, "`parallel.zero`", 3), (DECISION, "stage", 3)])
@pytest.mark.parametrize("d", [2, 8])
def test_zero_bytes_per_param_match_the_estimator(path, first, col, d):
    rows = _rows(path, first)
    for zero, key in enumerate(("0 (DDP)", "1", "2", "3")):
        claimed = _eval(rows[key][col], d=d)
        got = _bytes_per_param(zero, d)
        # ZeRO-1's optimizer partition is greedy per tensor and FSDP2 pads dim 0: a few percent at most
        assert got == pytest.approx(claimed, rel=0.03), f"{path.name}: zero={zero} d={d}: skill {claimed}, " \
            f"estimator {got:.3f}"


def test_the_dp8_example_matches_the_estimator():
    text = " ".join(DIST_OPT.read_text(encoding="utf-8").split())
    assert "16/8 = 2.0 bytes of stored model state per parameter per rank with zero=1, 2 or 3 in bfloat16" in text
    assert "8 + 8/8 = 9.0 with zero=1 in float32" in text
    assert round(_bytes_per_param(1, 8), 1) == round(_bytes_per_param(2, 8), 1) == round(_bytes_per_param(3, 8), 1) \
        == 2.0  # bf16: ZeRO-1 is FSDP2 holding the step (wrapping.py)
    assert round(_bytes_per_param(1, 8, "float32"), 1) == 9.0  # fp32: DDP + ZeroRedundancyOptimizer


def test_zero1_and_zero2_communication_is_what_the_template_does():
    row = _rows(DIST_OPT, "`parallel.zero`")
    assert "all-gather" in row["1"][4] and "reduce-scatter" in row["1"][4]  # bf16: FSDP2 holding the step
    assert "broadcast" in row["1"][4] and "all-reduce" in row["1"][4]  # fp32: DDP + ZeroRedundancyOptimizer
    assert "SHARD_GRAD_OP" in row["2"][4]  # FSDP2 reshard_after_forward=False


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (8, 2, 32)])
def test_bubble_fractions_match_the_estimator(p, v, m):
    rows = _rows(PIPELINE, "`parallel.pp_schedule`")
    for sched in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"):
        vv = v if sched in ("interleaved_1f1b", "zero_bubble") else 1
        x = _layout_for(dp=1, pp=p, pp_schedule=sched, pp_virtual=vv)
        x = replace_layout(x, global_batch=m, micro_batch=1)
        formula = rows[f"`{sched}`"][0].split("(")[0] if not rows[f"`{sched}`"][0].startswith("(") else \
            re.match(r"\(p−1\)(/\([^)]*\)|/m)", rows[f"`{sched}`"][0]).group(0)
        assert _eval(formula, p=p, v=vv, m=m) == pytest.approx(bubble_fraction(x)), f"{sched}: {formula}"


def test_decision_details_quotes_the_same_bubbles():
    text = " ".join(DECISION.read_text(encoding="utf-8").split())
    assert "(p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved, (p−1)/(3·v·m) zero-bubble" in text


def _saved_per_sbh(dtype: str = "bfloat16", **parallel) -> float:
    """Activation bytes a layer keeps from forward to backward, over s·b·h (the estimator's activation model)."""
    x = _layout_for(dtype, **parallel)
    return _acts(x).layer_saved / (x.seq_len * x.micro_batch * x.d_model)


RECOMPUTE = SKILLS / "primitive-recompute" / "SKILL.md"
TP_MATH = SKILLS / "primitive-tp-linear" / "references" / "tp-math.md"


def test_recompute_activation_factors_match_the_estimator():
    text = " ".join(RECOMPUTE.read_text(encoding="utf-8").split())
    m = re.search(r"bfloat16: none (\d+)·s·b·h bytes, selective (\d+)·s·b·h, full (\d+)·s·b·h "
                  r"\(float32: (\d+), (\d+) and (\d+)\)", text)
    assert m, "the template's per-layer activation factors are quoted in the recompute skill"
    for dtype, claimed in (("bfloat16", m.groups()[:3]), ("float32", m.groups()[3:])):
        got = [round(_saved_per_sbh(dtype, recompute=rc)) for rc in ("none", "selective", "full")]
        assert [int(c) for c in claimed] == got, dtype


def test_full_recompute_keeps_two_sbh_bytes_in_bf16_four_in_fp32_divided_by_tp_under_sp():
    for path in (RECOMPUTE, DECISION, TP_MATH):  # bf16's residual stream is bf16 (FSDP2's policy, no autocast)
        text = path.read_text(encoding="utf-8")
        assert "2·s·b·h" in text and "4·s·b·h in fp32" in text, path
    assert _saved_per_sbh(recompute="full") == 2.0
    assert _saved_per_sbh("float32", recompute="full") == 4.0
    for t in (2, 4, 8):
        assert _saved_per_sbh(recompute="full", tp=t, sp=True, zero=3) == 2.0 / t


def test_recompute_flops_match_the_estimator():
    text = " ".join(RECOMPUTE.read_text(encoding="utf-8").split())
    x = _layout_for()
    none, sel, full = (hardware_flops_per_token(replace_layout(x, recompute=rc))
                       for rc in ("none", "selective", "full"))
    assert "+33% of the block FLOPs" in text and "+31% of all FLOPs for llama3-8b at 8k" in text
    assert round(100 * (full / none - 1)) == 31
    assert "+10% of all FLOPs for llama3-8b at 8k in the estimate" in text  # selective reruns wk, wo, w3
    assert round(100 * (sel / none - 1)) == 10


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 16), (8, 2, 32), (4, 4, 16)])
def test_in_flight_activations_per_schedule_match_the_estimator(p, v, m):
    """The table's 'activations held by stage 0' column (layer-micro-batches) against the estimator's simulation
    of the schedules' action order (estimator/pipeline.py in_flight)."""
    rows = _rows(PIPELINE, "`parallel.pp_schedule`")
    L = LLAMA3_8B["n_layers"]
    held = {}
    for sched in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"):
        vv = v if sched in ("interleaved_1f1b", "zero_bubble") else 1
        x = replace_layout(_layout_for(dp=1, pp=p, pp_schedule=sched, pp_virtual=vv), global_batch=m, micro_batch=1)
        held[sched] = in_flight(x, 0)[1] * L / (p * vv)
        if sched != "zero_bubble":
            formula = rows[f"`{sched}`"][1].split(":")[0].split("≈")[0]
            assert _eval(formula.replace("L", str(L)).replace("min(m, p)", str(min(m, p))), p=p, v=vv, m=m) == \
                pytest.approx(held[sched]), f"{sched}: {formula}"
    assert rows["`zero_bubble`"][1].startswith("as 1F1B, up to about 2×")
    assert held["1f1b"] <= held["zero_bubble"] <= 2 * held["1f1b"]
