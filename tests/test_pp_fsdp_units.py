"""Pipeline x FSDP: the units torch.distributed.pipelining keeps gathered (estimator/pipeline.py _kept_units).

The measured figures below come from `benchmarks/estimator_accuracy.py --only d256` (measure/memory.py's exact
tracker, torch 2.13 CPU, 4 gloo ranks); re-measure them there if the template or torch changes.
"""

from __future__ import annotations

import inspect

import pytest
from curry_train.estimator import estimate, in_flight, layout_of, load_any
from curry_train.estimator.pipeline import _kept_units, pipe_states

# zero 3 resharding after forward under PP: parallel.fsdp_reshard=always (the default keeps the units gathered)
D256 = {"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 3, "parallel.fsdp_reshard": "always",
        "train.micro_batch": 1, "model.d_model": 256, "model.d_ff": 512}


def test_torch_still_leaves_units_gathered_after_a_pipeline_backward():
    # The fact the estimator encodes: every FSDP stage backward turns resharding off, perform_reduce_grad turns it
    # back on. If torch changes this, _kept_units and the peak moments built on it must change too.
    from torch.distributed.pipelining.stage import _PipelineStageBase

    nosync = inspect.getsource(_PipelineStageBase.backward_maybe_with_nosync)
    assert "set_reshard_after_backward(False)" in nosync
    assert "set_reshard_after_backward(True)" in inspect.getsource(_PipelineStageBase.perform_reduce_grad)


def test_1f1b_keeps_the_units_only_between_backwards_without_a_forward():
    x = layout_of(load_any("tiny", D256))  # m = 4, rank 0: F F B F B F B B
    acts = _kept_units(x, 0)
    assert [k for k, _, _ in acts] == ["F", "F", "B", "F", "B", "F", "B", "B"]
    # bit 0 (chunk 0) gathered at an action's start: after each backward until the next forward reshards (zero 3)
    assert [bool(kept & 1) for _, _, kept in acts] == [False, False, False, True, False, True, False, True]


def test_gpipe_keeps_the_units_for_every_backward_after_the_first():
    x = layout_of(load_any("tiny", {**D256, "parallel.pp_schedule": "gpipe"}))
    kept = [bool(kept & 1) for kind, _, kept in _kept_units(x, 1) if kind == "B"]
    assert kept == [False, True, True, True]


def test_interleaved_gathers_both_chunks_ahead_and_drops_one_after_its_last_backward():
    x = layout_of(load_any("tiny", {**D256, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2}))
    acts = _kept_units(x, 0)
    assert acts[0][2] == 0b11  # (bit c: chunk c) UNSHARD of both stages before the first action (_add_unshard_reshard)
    # a forward of chunk 1 right after a backward of chunk 0: chunk 0 still gathered (the measured peak)
    assert any(k == "F" and c == 1 and kept & 1 for k, c, kept in acts)
    fwd = [s_ for s_ in pipe_states(x, 0) if s_.fwd]
    assert any(s_.chunk == 1 and s_.kept == (True, False) and s_.held == (3, 2) for s_ in fwd)
    # perform_reduce_grad after chunk 1's 4th (last) backward reshards it
    last_b1 = [i for i, (k, c, _) in enumerate(acts) if k == "B" and c == 1][-1]
    assert not acts[last_b1 + 1][2] & 0b10
    # the forward-end states do not change the schedule's in-flight count
    assert in_flight(x, 0)[1] == max(sum(s_.held) for s_ in pipe_states(x, 0) if not s_.fwd)


ZBV = {"parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2}


def test_zero_bubble_gathers_the_chunk_before_its_split_backward():
    # the template's fix (parallel/pipeline.py _split_backward_stage) the estimator encodes: every unit of the stage
    # unsharded before each I and W pass; if it goes, peak.ZB_GATHERS_BEFORE_SPLIT_BACKWARD must go too
    from curry_train.parallel.pipeline import _split_backward_stage

    src = inspect.getsource(_split_backward_stage)
    assert '("input", "weight")' in src and "module.unshard()" in src
    x = layout_of(load_any("tiny", {**D256, **ZBV}))  # ZBV, rank 0 holds stages 0 and 3
    acts = _kept_units(x, 0)
    # the first I of each chunk starts with the chunk resharded by its forward: the gather is a moment of its own
    assert [bool(kept >> c & 1) for k, c, kept in acts if k == "I"][:3] == [False, False, False]
    # a W leaves its chunk gathered (the unshard, then set_reshard_after_backward(False)) until REDUCE_GRAD
    w_then = [(c, acts[i + 1][2]) for i, (k, c, _) in enumerate(acts[:-1]) if k == "W" and acts[i + 1][0] == "F"]
    assert w_then and all(kept >> c & 1 for c, kept in w_then)


def test_interleaved_zero_bubble_evaluates_the_w_starts_that_gather_again():
    # v = 3: some W passes follow a forward of their chunk (resharded): the W's unshard gathers it again
    x = layout_of(load_any("tiny", {**D256, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 3,
                                  "model.n_layers": 6}))
    assert any(k == "W" and not kept >> c & 1 for k, c, kept in _kept_units(x, 1))
    weights = [s_ for s_ in pipe_states(x, 1) if s_.weight]
    assert weights and all(not s_.kept[s_.chunk] for s_ in weights)
    assert in_flight(x, 1)[1] == max(sum(s_.held) for s_ in pipe_states(x, 1) if not (s_.fwd or s_.weight))
    # I's still waiting for their W (their output gradients retained): the measured peak of row ...-zb-v3 has one
    assert any(s_.pending[s_.chunk] == 0 and sum(s_.pending) == 1 and s_.kept == (True, False, True)
               for s_ in pipe_states(x, 1))


@pytest.mark.parametrize("overrides,pp_rank,measured", [
    ({}, 0, 22_857_292),  # 1F1B: -3.5% before the kept units were modelled
    ({"parallel.pp_schedule": "gpipe"}, 1, 24_590_192),
    ({"parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2}, 0, 25_844_300),
    ({"parallel.zero": 2, "parallel.fsdp_reshard": "default"}, 0, 22_267_980),
    ({"parallel.fsdp_reshard": "default"}, 0, 22_267_980),  # the default under PP: zero 2's units
    (ZBV, 0, 26_101_608),  # +4.4% before the split backward's gather was modelled
    ({"parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 3, "model.n_layers": 6}, 1, 35_693_956),
])
def test_parameter_heavy_pipeline_fsdp_peak_matches_the_tracker(overrides, pp_rank, measured):
    b = estimate(load_any("tiny", {**D256, **overrides})).per_pp_rank[pp_rank]
    assert b.total == pytest.approx(measured, rel=0.03)


def test_zero3_pipeline_peak_holds_every_unit_of_the_stage():
    # d256 1F1B, rank 0: 2 blocks, fp32, at the first block's backward (exact on the tracker); the embedding's
    # own unit was resharded after its forward (fsdp_units.py)
    b = estimate(load_any("tiny", D256)).per_pp_rank[0]
    assert b.phase == "first block gathered (units kept)"
    assert b.param_copies == 4_722_688
    # measured 23,119,436 since RMSNorm / SwiGLU save less (model/lean.py; 24,102,476 before, 24,113,244 before the
    # loss was chunked); the estimate is 2,560 B above (activations)
    assert b.total == pytest.approx(22_857_292, abs=4096)


def test_zero_bubble_zero3_peak_is_the_gather_before_a_split_backward():
    # d256 ZBV, rank 0: the head chunk's I with 3 micro-batches of chunk 0 in flight; the tracker measures every
    # unit of both chunks gathered (5,248,000 B of copies, exact) next to one block's all-gather output
    b = estimate(load_any("tiny", {**D256, **ZBV})).per_pp_rank[0]
    assert b.phase == "units gathered (zero bubble)"
    assert b.param_copies == 5_248_000
    # 654,868 B below since the embedding is a unit of its own (other: 25,511,780 measured before, 65,040 B off)
    assert b.total == pytest.approx(26_101_608, rel=0.03)
