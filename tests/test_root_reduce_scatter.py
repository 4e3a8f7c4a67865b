"""FSDP's reduce-scatters of the [norm, output] unit after its backward and of the embedding at the end of the
backward (estimator/phases.py head_reduce_scatter, _root_reduce_scatter).

The measured figures below come from `benchmarks/estimator_accuracy.py --only vocab-zero --verbose`
(measure/memory.py's exact tracker, torch 2.13 CPU, gloo ranks); re-measure them there if the template or torch
changes.
"""

from __future__ import annotations

import inspect

import pytest
from curry_train.estimator import estimate, layout_of, load_any
from curry_train.estimator.phases import _unit_reduce_scatter
from curry_train.estimator.states import _states

VOCAB_BF16 = {"model.vocab_size": 4096, "parallel.zero": 3, "train.dtype": "bfloat16"}


def test_torch_still_reduces_in_fp32_and_releases_the_previous_input():
    # The facts the moment encodes: the input is allocated in reduce_dtype (fp32: a [V, D] fp32 copy of the
    # root's bf16 gradients), and the previous unit's input is popped before the next reduce appends its own.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    src = inspect.getsource(foreach_reduce)
    assert "dtype=reduce_dtype" in src and "unsharded_grads.clear()" in src
    assert "reduce_scatter_max_input_buffers" in inspect.getsource(FSDPParamGroup.post_backward)


@pytest.mark.parametrize(("overrides", "measured"), [
    ({"parallel.dp": 2}, 9_564_204),  # two micro-steps (11,151,148 in the root's reduce-scatter before the split)
    ({"parallel.dp": 4, "parallel.zero": 2}, 6_684_584),  # one micro-step, zero 2 (7,413,160 before)
])
def test_the_head_reduce_scatter_is_the_peak_where_measured(overrides, measured):
    b = estimate(load_any("tiny", {**VOCAB_BF16, **overrides})).per_pp_rank[0]
    assert b.phase == "head reduce-scatter"
    assert abs(b.total - measured) / measured < 0.001


def test_cuda_has_no_gloo_copy_of_the_input():
    cpu = layout_of(load_any("tiny", {**VOCAB_BF16, "parallel.dp": 2}))
    cuda = layout_of(load_any("tiny", {**VOCAB_BF16, "parallel.dp": 2, "hardware.device": "cuda"}))
    st, st_cuda = _states(cpu, [0]), _states(cuda, [0])
    rs_cpu = _unit_reduce_scatter(cpu, st.head_unit, st.head_stored, 2)
    rs_cuda = _unit_reduce_scatter(cuda, st_cuda.head_unit, st_cuda.head_stored, 2)
    assert rs_cpu - rs_cuda == 4 * (st.head_unit // 2)  # gloo's fp32 copy of the whole unit
