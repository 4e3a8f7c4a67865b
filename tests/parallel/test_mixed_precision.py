"""bf16 on every layout runs FSDP2's MixedPrecisionPolicy (wrapping.py): bf16 compute parameters, a bf16 residual
stream, fp32 master weights and AdamW state, and no torch.autocast region anywhere, on real ranks.

    .venv/bin/pytest tests/parallel/test_mixed_precision.py -q -n 0

The layouts FSDP did not wrap before (DDP = ZeRO-0, ZeRO-1 without TP, one process, TP alone, PP alone) ran under
torch.autocast: an fp32 stream and norms, a bf16 cast of each Linear's input. Forward hooks read what each block,
norm and Linear really receives during a real train_step; torch.autocast's enabled regions are counted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from curry_train.config import load_config

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
BF16 = {"train.dtype": "bfloat16"}
TWO_RANKS = {  # the layouts that ran under autocast, plus ZeRO-3 (always FSDP) as the control
    "dp2-zero0": {**BF16, "parallel.dp": 2},
    "dp2-zero1": {**BF16, "parallel.dp": 2, "parallel.zero": 1},
    "tp2": {**BF16, "parallel.tp": 2},
    "pp2": {**BF16, "parallel.pp": 2},
    "dp2-zero3": {**BF16, "parallel.dp": 2, "parallel.zero": 3},
}


def _observe(cfg_over: dict[str, Any]) -> dict[str, Any]:
    """One real train_step of tiny under `cfg_over` on this rank, with what its modules receive recorded."""
    from curry_train.parallel.parallelize import canonical_name
    from curry_train.train.loop import init_distributed, setup, train_step
    from torch.distributed.fsdp import FSDPModule

    cfg = load_config(TINY, cfg_over)
    par = setup(cfg, init_distributed(cfg))
    seen: dict[str, set] = {"block_in": set(), "norm_in": set(), "linear_w": set(), "autocast_on": set()}
    entered = []
    exact_enter = torch.amp.autocast_mode.autocast.__enter__

    def counting_enter(self):  # an enabled autocast region (torch.utils.checkpoint enters disabled ones to replay
        if self._enabled:  # the forward's autocast state: the chunked loss and recompute do)
            entered.append(self.fast_dtype)
        return exact_enter(self)

    def block_hook(mod, args):
        seen["block_in"].add(str(args[0].dtype))  # the residual stream entering the block [B, T, D]
        seen["autocast_on"].add(torch.is_autocast_enabled(args[0].device.type))

    hooks = []
    for part in par.parts:
        for name, m in part.named_modules():
            name = canonical_name(name)  # (DDP's `module.` prefix, were there one)
            if name.startswith("layers.") and name.count(".") == 1:
                hooks.append(m.register_forward_pre_hook(block_hook))
            elif name.endswith("_norm") or name == "norm":
                hooks.append(m.register_forward_pre_hook(lambda mod, args: seen["norm_in"].add(str(args[0].dtype))))
            elif isinstance(m, torch.nn.Linear):
                hooks.append(m.register_forward_pre_hook(lambda mod, args: seen["linear_w"].add(str(mod.weight.dtype))))
    torch.amp.autocast_mode.autocast.__enter__ = counting_enter
    try:
        train_step(par, 0, read=True)
    finally:
        torch.amp.autocast_mode.autocast.__enter__ = exact_enter
        for h in hooks:
            h.remove()
    opt_params = [p for g in par.optimizer.param_groups for p in g["params"]]
    mesh = getattr(opt_params[0], "device_mesh", None)  # FSDP2's (replicas, shard) or (shard,) mesh; DDP: none
    states = [t for st in par.optimizer.state.values() for k, t in st.items() if k != "step"]
    return {**{k: sorted(map(str, v)) for k, v in seen.items()}, "autocast_entered": len(entered),
            "fsdp": all(isinstance(part, FSDPModule) for part in par.parts),
            "param_mesh": None if mesh is None else tuple(mesh.shape),
            "master": sorted({str(p.dtype) for p in opt_params}), "adam": sorted({str(t.dtype) for t in states}),
            "mesh": None if par.mesh is None else tuple(par.mesh.shape)}


def _observe_all(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    return [_observe(o) for o in layouts]


def _assert_policy(name: str, got: dict) -> None:
    assert got["autocast_entered"] == 0 and got["autocast_on"] == ["False"], (name, got)
    assert got["block_in"] == ["torch.bfloat16"], (name, got)  # the residual stream is bf16 ...
    assert got["norm_in"] == ["torch.bfloat16"], (name, got)  # ... and so are the norms' inputs
    assert got["linear_w"] == ["torch.bfloat16"], (name, got)  # every Linear computes with bf16 weights
    assert got["master"] == ["torch.float32"] and got["adam"] == ["torch.float32"], (name, got)  # fp32 masters
    assert got["fsdp"], (name, got)


@pytest.mark.multirank
def test_bf16_layouts_without_fsdp_before_run_the_policy_on_two_ranks():
    from curry_train.train.launch import launch_forkserver

    per_rank = launch_forkserver(_observe_all, 2, list(TWO_RANKS.values()), timeout=300)
    for rank, res in enumerate(per_rank):
        for (name, _), got in zip(TWO_RANKS.items(), res):
            _assert_policy(f"{name} rank {rank}", got)
    by = dict(zip(TWO_RANKS, per_rank[0]))
    assert by["dp2-zero0"]["param_mesh"] == (2, 1)  # DP as 2 replicas of one shard (wrapping.fsdp_replicas)
    assert by["dp2-zero1"]["param_mesh"] == by["dp2-zero3"]["param_mesh"] == (2,)  # one shard group of 2


@pytest.mark.multirank
def test_bf16_one_rank_runs_the_policy_at_degree_one():
    from curry_train.train.launch import launch_forkserver

    (got,) = launch_forkserver(_observe_all, 1, [BF16], timeout=300)[0]
    _assert_policy("one rank", got)
    assert got["mesh"] == (1, 1, 1, 1)


def _alone(_: int) -> dict:
    """A single process with no process group at all (python -m curry_train.train.loop): setup makes the 1-rank
    group FSDP2 needs (comm_init.init_single_rank), and the process's destroy ends it."""
    import torch.distributed as dist
    from curry_train.train.comm_init import destroy_process_group

    torch.set_num_threads(1)
    assert not dist.is_initialized()
    got = _observe(BF16)
    got["world"] = dist.get_world_size()
    destroy_process_group()
    got["after"] = dist.is_initialized()
    return got


def test_bf16_single_process_gets_a_one_rank_group(tmp_path):
    from tests.isolated import in_fresh_process

    got = in_fresh_process(_alone, 0)
    _assert_policy("alone", got)
    assert got["world"] == 1 and got["after"] is False


def _fp32_alone(_: int) -> dict:
    import torch.distributed as dist
    from curry_train.train.loop import setup

    par = setup(load_config(TINY))
    return {"initialized": dist.is_initialized(), "mesh": par.mesh, "plain": type(par.parts[0]).__name__}


def test_fp32_single_process_stays_the_plain_model_without_a_group():
    """wrapping.py: fp32 keeps torch's replicated wrappers and no wrapper on one rank (nothing to cast)."""
    from tests.isolated import in_fresh_process

    assert in_fresh_process(_fp32_alone, 0) == {"initialized": False, "mesh": None, "plain": "Transformer"}
