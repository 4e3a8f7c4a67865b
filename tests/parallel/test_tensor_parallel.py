"""Tensor and sequence parallel (parallel/tensor_parallel.py) match the single-device reference.

Every config below runs through the white-box harness (loss, every gradient at full shape, parameters after two
AdamW steps, fp32 tolerances of validation/whitebox.py); one launch per world size.
"""

from __future__ import annotations

import pytest
from curry_train.config import ConfigError, load_config
from curry_train.train.launch import launch_forkserver

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

TINY = PRESETS / "tiny.yaml"
pytestmark = pytest.mark.multirank

TWO_RANKS = [
    {"parallel.tp": 2},
    {"parallel.tp": 2, "parallel.sp": True},
    {"parallel.tp": 2, "parallel.sp": True, "model.n_kv_heads": 2},   # GQA: 4 query heads per kv head
    {"parallel.tp": 2, "model.n_kv_heads": 8},                        # plain multi-head attention
    {"parallel.tp": 2, "parallel.sp": True, "parallel.recompute": "full"},
    {"parallel.tp": 2, "parallel.sp": True, "parallel.recompute": "selective"},
    {"parallel.tp": 2, "train.micro_batch": 8},                       # no gradient accumulation
    {"parallel.tp": 2, "parallel.sp": True, "train.dtype": "bfloat16"},  # FSDP2 at degree 1; bf16 bounds of compare.py
]
FOUR_RANKS = [
    {"parallel.tp": 4},                                               # one kv head per rank
    {"parallel.tp": 4, "parallel.sp": True},
]


def _assert_all_pass(overrides, verdicts):
    for o, v in zip(overrides, verdicts):
        assert v.passed, (o, v.failures, v.worst_parameter)
        assert v.n_params_compared == 39


def test_tp_and_sp_on_two_ranks_match_the_reference(tmp_path):
    cfgs = [load_config(TINY, o) for o in TWO_RANKS]
    _assert_all_pass(TWO_RANKS, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


def test_tp_on_a_moe_model_splits_attention_and_replicates_experts(tmp_path):
    moe = [{"parallel.tp": 2}, {"parallel.tp": 2, "parallel.sp": True}]
    cfgs = [load_config(PRESETS / "tiny-moe.yaml", o) for o in moe]
    for o, v in zip(moe, whitebox_batch(cfgs, steps=2, out_dir=tmp_path)):
        assert v.passed, (o, v.failures, v.worst_parameter)


@pytest.mark.slow
def test_tp_and_sp_on_four_ranks_match_the_reference(tmp_path):
    cfgs = [load_config(TINY, o) for o in FOUR_RANKS]
    _assert_all_pass(FOUR_RANKS, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


def _layouts(rank: int, world: int, overrides: dict) -> dict:
    """Inside a rank: placements and local shapes the TP plan produced."""
    from curry_train.train.loop import setup
    from torch.distributed.tensor import DTensor

    par = setup(load_config(TINY, overrides))
    out = {"loss_parallel": par.loss_parallel}
    for name, p in par.parts[0].named_parameters():
        if isinstance(p, DTensor):
            out[name] = (repr(p.placements[0]), tuple(p.to_local().shape))
        else:
            out[name] = ("plain", tuple(p.shape))
    return out


def test_the_plan_shards_columns_rows_vocab_and_replicates_sp_norms():
    layout = launch_forkserver(_layouts, 2, {"parallel.tp": 2, "parallel.sp": True})[0]
    assert layout["loss_parallel"] is True  # logits stay vocab-sharded for loss_parallel()
    a, f = "layers.0.attention.", "layers.0.feed_forward."
    # column-parallel: output features (whole heads) split, [out/t, in]
    assert layout[a + "wq.weight"] == ("Shard(dim=0)", (32, 64))      # 8 heads * 8 / 2
    assert layout[a + "wk.weight"] == ("Shard(dim=0)", (16, 64))      # 4 kv heads * 8 / 2
    assert layout[f + "w1.weight"] == ("Shard(dim=0)", (64, 64))      # d_ff 128 / 2
    # row-parallel: input features split, [out, in/t]
    assert layout[a + "wo.weight"] == ("Shard(dim=1)", (64, 32))
    assert layout[f + "w2.weight"] == ("Shard(dim=1)", (64, 64))
    # vocab-parallel embedding (rows) and LM head (columns of the logits)
    assert layout["tok_embeddings.weight"] == ("Shard(dim=0)", (128, 64))
    assert layout["output.weight"] == ("Shard(dim=0)", (128, 64))
    # sequence parallel: norm weights are replicated DTensors (their grads are summed over the T/t slices)
    assert layout["layers.0.attention_norm.weight"] == ("Replicate()", (64,))
    assert layout["norm.weight"] == ("Replicate()", (64,))


def test_ddp_with_tp_is_refused_with_the_distributed_optimizer_fix():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 0})
    assert any("parallel.zero=1 with tp" in p.fix for p in e.value.problems)
    for zero in (1, 2):  # the fix validates: Megatron's distributed optimizer, or ZeRO-2
        load_config(TINY, {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": zero})
