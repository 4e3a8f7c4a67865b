"""FSDP's root reduce-scatter at the end of the backward (estimator/phases.py _root_reduce_scatter).

The measured figures below come from `benchmarks/estimator_accuracy.py --only vocab-zero --verbose`
(measure/memory.py's exact tracker, torch 2.13 CPU, gloo ranks); re-measure them there if the template or torch
changes.
"""

from __future__ import annotations

import inspect

import pytest
from curry_train.estimator import estimate, layout_of, load_any
from curry_train.estimator.phases import _root_reduce_scatter
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
    ({"parallel.dp": 2}, 11_151_148),  # two micro-steps: every sharded grad exists
    ({"parallel.dp": 2, "train.global_batch": 4}, 10_102_440),  # one: the root's is the new output
    ({"parallel.dp": 4}, 7_413_160),
])
def test_the_root_reduce_scatter_is_the_peak_where_measured(overrides, measured):
    b = estimate(load_any("tiny", {**VOCAB_BF16, **overrides})).per_pp_rank[0]
    assert b.phase == "root reduce-scatter"
    assert abs(b.total - measured) / measured < 0.001


def test_cuda_has_no_gloo_copy_of_the_input():
    cpu = layout_of(load_any("tiny", {**VOCAB_BF16, "parallel.dp": 2}))
    cuda = layout_of(load_any("tiny", {**VOCAB_BF16, "parallel.dp": 2, "hardware.device": "cuda"}))
    st = _states(cpu, [0])
    rs_cpu = _root_reduce_scatter(cpu, st, 2, 2, 0, 0)[5]["root_reduce_scatter"]
    rs_cuda = _root_reduce_scatter(cuda, _states(cuda, [0]), 2, 2, 0, 0)[5]["root_reduce_scatter"]
    assert rs_cpu - rs_cuda == 4 * (st.root_unit // 2)  # gloo's fp32 copy of the whole root unit
