"""Expert parallel: autograd all-to-all, an EP MoE layer against the same layer on one rank, and white-box runs.

    .venv/bin/pytest tests/parallel/test_expert_parallel.py -q

White-box = the whole training step (DDP / FSDP2 gradient paths for expert shards, capacity dropping, the
white-box gather of expert shards) against the single-device reference, at the fixed fp32 tolerances of
validation/whitebox.py. One forkserver launch per world size.
"""

from __future__ import annotations

import copy

import pytest
import torch
from curry_train.config import load_config
from curry_train.train.launch import launch_forkserver
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(300)


def _ep_checks(rank: int, world: int) -> dict:
    """Runs on 2 ranks: returns max abs diffs and the per-rank diagnostics."""
    import torch.distributed as dist
    from curry_train.mesh import Topology, build_mesh
    from curry_train.model.gpt import init_weights
    from curry_train.model.moe import MoE, expert_load
    from curry_train.parallel import comms
    from curry_train.parallel.expert_parallel import apply_ep
    from curry_train.parallel.recompute import checkpointed

    out: dict = {}
    # 1. uneven all-to-all with a zero split: rank 0 keeps 3 rows and sends none; rank 1 sends 2, keeps 4.
    in_splits, out_splits = [[3, 0], [2, 4]][rank], [[3, 2], [0, 4]][rank]
    x = (torch.arange(sum(in_splits) * 2, dtype=torch.float64).view(-1, 2) + 100 * rank).requires_grad_()
    y = comms.all_to_all(x, out_splits, in_splits, dist.group.WORLD)
    expect = [
        torch.cat([torch.arange(6.0).view(3, 2), torch.arange(4.0).view(2, 2) + 100]),
        torch.arange(4.0, 12.0).view(4, 2) + 100,
    ][rank].double()
    (0.5 * (y * y).sum()).backward()  # dL/dy = y, sent back by the transposed exchange: dL/dx = x
    out["a2a"] = max(float((y - expect).abs().max()), float((x.grad - x).abs().max()))

    # 2. EP MoE layer == the full layer on the same tokens; rank 0's tokens all go to its own experts (a zero
    #    split in both all-to-alls), rank 1's are mixed.
    for cf in (0.0, 1.0):
        cfg = load_config("configs/tiny-moe.yaml", {"parallel.dp": 2, "parallel.ep": 2, "model.capacity_factor": cf})
        mesh = build_mesh(Topology.from_config(cfg), "cpu")
        full = MoE(cfg.model)
        init_weights(full, cfg.model, 0)
        u = torch.nn.functional.normalize(torch.ones(64), dim=0)
        with torch.no_grad():
            full.router.gate.weight[:2] += 3 * u
            full.router.gate.weight[2:] -= 3 * u
        ep = copy.deepcopy(full)
        apply_ep(ep, mesh, cfg)
        g = torch.Generator().manual_seed(10 + rank)
        xs = torch.randn(2, 32, 64, generator=g) + (3 * u if rank == 0 else 0)
        dy = torch.randn(2, 32, 64, generator=g)
        res = {}
        for name, mod in (("full", full), ("ep", ep)):
            xr = xs.clone().requires_grad_()
            yr = mod(xr)
            (yr * dy).sum().backward()
            res[name] = (yr.detach(), xr.grad, {n: p.grad for n, p in mod.named_parameters()})
        (y_f, dx_f, g_f), (y_e, dx_e, g_e) = res["full"], res["ep"]
        diffs = [
            float((y_f - y_e).abs().max()),
            float((dx_f - dx_e).abs().max()),
            float((g_f["router.gate.weight"] - g_e["router.gate.weight"]).abs().max()),
        ]
        for n in ("w1", "w2", "w3"):  # the shard's grad = sum over the ep ranks' tokens of the full grad's slice
            ref = g_f[f"experts.{n}"].clone()
            dist.all_reduce(ref)
            diffs.append(float((ref[2 * rank : 2 * rank + 2] - g_e[f"experts.{n}"]).abs().max()))
            p = dict(ep.named_parameters())[f"experts.{n}"]
            diffs.append(
                float((p._curry_gather(p.detach()) - dict(full.named_parameters())[f"experts.{n}"]).abs().max())
            )
        out[f"moe_cf{cf}"] = max(diffs)
        out[f"load_cf{cf}"] = expert_load(ep)[""]

    # 3. The same EP layer checkpointed: collectives and host reads run in backward, per recompute mode.
    for mode in ("none", "selective", "full"):
        ep.host_syncs = 0
        layer = checkpointed(ep.forward, mode) if mode != "none" else ep.forward
        xr = xs.clone().requires_grad_()
        with _Collectives() as c:
            yr = layer(xr)
            (yr * dy).sum().backward()
        out[f"rc_{mode}"] = {"fwd": c.fwd, "bwd": c.bwd, "host_syncs": ep.host_syncs,
                             "y": yr.detach(), "dx": xr.grad}
    out["overlap"] = _overlap_checks(rank, xs, dy)

    # 4. The router under TP + EP (its tp_group: both ranks route their own tokens with one weight): the
    #    all-reduces it runs per forward and backward, per recompute mode (replays included)
    cfg = load_config("configs/tiny-moe.yaml", {"parallel.tp": 2, "parallel.sp": True, "parallel.ep": 2,
                                                "model.z_loss_coef": 1e-3})
    moe = MoE(cfg.model)
    init_weights(moe, cfg.model, 0)
    moe.router.tp_group = dist.group.WORLD
    for mode in ("none", "selective", "full"):
        layer = checkpointed(moe.forward, mode) if mode != "none" else moe.forward
        with _Collectives(("c10d.allreduce_",)) as c:
            (layer(xs.clone().requires_grad_()) * dy).sum().backward()
        out[f"router_{mode}"] = c.fwd + c.bwd
    return out


FS = 200  # the shared expert's width: no other matmul of the layer has a dimension this large (D 64, F 128, R <= 128)


def _overlap_checks(rank: int, xs: torch.Tensor, dy: torch.Tensor) -> dict:
    """A MoE layer with a shared expert on 2 ranks, per recompute mode: the order in which the all-to-alls, their
    waits and the shared expert's matmuls run, forward and backward; and its output and input gradient against
    the same layer with the shared expert after the combine's wait (no overlap)."""
    import torch.distributed as dist
    from curry_train.mesh import Topology, build_mesh
    from curry_train.model.gpt import build_model
    from curry_train.model.moe import moe_layers
    from curry_train.parallel import comms
    from curry_train.parallel.expert_parallel import apply_ep
    from curry_train.parallel.recompute import checkpointed

    cfg = load_config("configs/tiny-moe.yaml", {"parallel.dp": 2, "parallel.ep": 2, "model.n_shared_experts": 1,
                                                "model.shared_d_ff": FS})
    model = build_model(cfg)
    apply_ep(model, build_mesh(Topology.from_config(cfg), "cpu"), cfg)
    moe = moe_layers(model)[0][1]
    store = dist.distributed_c10d._get_default_store()
    out: dict = {}
    for mode in ("none", "selective", "full"):
        layer = checkpointed(moe.forward, mode) if mode != "none" else moe.forward
        xr = xs.clone().requires_grad_()
        # mode none: rank 1 holds back its side of the combine (forward) and of its transpose (backward) until
        # rank 0 has run the shared expert's matmuls of that pass; rank 0 gets there only if its exchange was
        # in flight meanwhile (a blocking all-to-all could not return before rank 1 joins: a store timeout)
        with _Overlap(rank, store if mode == "none" else None) as log:
            yr = layer(xr)
            (yr * dy).sum().backward()
        out[mode] = {"ops": log.ops, "y": yr.detach(), "dx": xr.grad}
    real = comms.all_to_all_overlapped
    comms.all_to_all_overlapped = lambda x, o, i, g, work: (comms.all_to_all(x, o, i, g), work())  # not overlapped
    try:
        xr = xs.clone().requires_grad_()
        yr = moe.forward(xr)
        (yr * dy).sum().backward()
        out["serial"] = {"y": yr.detach(), "dx": xr.grad}
    finally:
        comms.all_to_all_overlapped = real
    return out


class _Overlap(TorchDispatchMode):
    """Logs "a2a" (an all-to-all issued), "wait" and "shared" (a matmul with a dimension of width FS) with the
    pass they run in. With a store, rank 0 posts when a pass's shared matmuls are done (3 forward, 6 backward:
    input and weight gradients) and rank 1 waits for that post before its overlapped all-to-all of the pass."""

    def __init__(self, rank: int, store):
        super().__init__()
        self.rank, self.store, self.ops = rank, store, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import datetime

        name, bwd = func.name(), torch._C._current_graph_task_id() != -1
        tag = ("a2a" if name == "_c10d_functional::all_to_all_single" else
               "wait" if name == "_c10d_functional::wait_tensor" else
               "shared" if name == "aten::mm" and any(FS in a.shape for a in args[:2]) else None)
        if tag == "a2a" and self.store is not None and self.rank == 1:
            a2as = sum(1 for t, b in self.ops if t == "a2a" and b == bwd)
            if (a2as == 1 and not bwd) or (a2as == 0 and bwd):  # the combine, then its transpose
                self.store.wait(["shared_bwd" if bwd else "shared_fwd"], datetime.timedelta(seconds=30))
        result = func(*args, **(kwargs or {}))
        if tag:
            self.ops.append((tag, bwd))
        if tag == "shared" and self.store is not None and self.rank == 0:
            done = sum(1 for t, b in self.ops if t == "shared" and b == bwd)
            if done == (6 if bwd else 3):
                self.store.set("shared_bwd" if bwd else "shared_fwd", "1")
        return result


class _Collectives(TorchDispatchMode):
    """Counts the all-to-alls that run (functional or not), in forward and in backward (recomputation included)."""

    OPS = ("_c10d_functional.all_to_all_single", "c10d.alltoall_base_", "c10d.alltoall_")

    def __init__(self, ops: tuple[str, ...] = OPS):
        super().__init__()
        self.fwd = self.bwd = 0
        self.OPS = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().replace("::", ".") in self.OPS:
            if torch._C._current_graph_task_id() == -1:
                self.fwd += 1
            else:
                self.bwd += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def ep_checks() -> list:
    """One 2-rank launch for the checks of the two tests below."""
    return launch_forkserver(_ep_checks, 2, timeout=180)


def test_ep_all_to_all_and_moe_layer_equal_the_single_rank_layer(ep_checks):
    res = ep_checks
    for r in res:
        assert r["a2a"] == 0.0
        assert r["moe_cf0.0"] < 1e-6 and r["moe_cf1.0"] < 1e-6
    # rank 0 routed nothing to rank 1's experts (2, 3); every rank processed exactly what was routed to it
    for cf in ("0.0", "1.0"):
        loads = [r[f"load_cf{cf}"] for r in res]
        assert loads[0]["routed"][2:] == [0, 0]
        for rank in range(2):
            routed_here = [sum(ld["routed"][2 * rank + e] for ld in loads) for e in range(2)]
            assert loads[rank]["received"] == routed_here
    assert res[0]["load_cf1.0"]["dropped"] == 64  # experts 0 and 1 each get all 64 tokens, capacity 32
    for r in res:
        # forward: counts + dispatch + combine (a checkpointed block runs the count exchange inside host_once,
        # hidden from dispatch modes); backward: the 2 transposes, plus the 2 replays of full recompute only
        assert {k: (r[k]["fwd"], r[k]["bwd"]) for k in ("rc_none", "rc_selective", "rc_full")} == {
            "rc_none": (3, 2), "rc_selective": (2, 2), "rc_full": (2, 4)}, "selective replays no all-to-all"
        assert [r[k]["host_syncs"] for k in ("rc_none", "rc_selective", "rc_full")] == [1, 1, 1]
        for k in ("rc_selective", "rc_full"):  # recompute changes nothing the ranks compute
            assert torch.equal(r[k]["y"], r["rc_none"]["y"]) and torch.equal(r[k]["dx"], r["rc_none"]["dx"])


def _pass(ops: list, bwd: bool) -> list[str]:
    """The tags of one pass with each run of shared matmuls folded to one "shared"."""
    tags = [t for t, b in ops if b == bwd]
    return [t for i, t in enumerate(tags) if t != "shared" or i == 0 or tags[i - 1] != "shared"]


def test_the_shared_expert_runs_while_the_combine_all_to_all_is_in_flight(ep_checks):
    """model/moe.py overlaps the combine all-to-all with the shared expert (comms.all_to_all_overlapped): forward,
    its matmuls run between the exchange's issue and its wait; backward, the transposed exchange is issued before
    the shared expert's backward and waited after it. Rank 0 finishing the shared expert before rank 1 has issued
    its side (mode none) shows the exchange was in flight meanwhile. Every recompute mode keeps the order and
    computes what the serial layer computes (selective: the exchanges are saved and not replayed)."""
    for r in ep_checks:
        o = r["overlap"]
        for mode in ("none", "selective", "full"):  # the dispatch, then the combine around the shared expert
            assert _pass(o[mode]["ops"], False) == ["a2a", "wait", "a2a", "shared", "wait"], mode
        assert _pass(o["none"]["ops"], True) == ["a2a", "shared", "wait", "a2a", "wait"]
        # selective: the recomputation (the saved exchanges' waits around the shared expert's unsaved matmul,
        # no all-to-all), then the same overlapped transpose
        assert _pass(o["selective"]["ops"], True) == ["wait", "shared", "wait", "a2a", "shared", "wait", "a2a",
                                                      "wait"]
        # full recompute replays the forward (its own overlapped combine) inside the backward
        assert _pass(o["full"]["ops"], True) == ["a2a", "wait", "a2a", "shared", "wait", "a2a", "shared", "wait",
                                                 "a2a", "wait"]
        for mode in ("none", "selective", "full"):
            assert torch.equal(o[mode]["y"], o["serial"]["y"]) and torch.equal(o[mode]["dx"], o["serial"]["dx"])
            # the estimator prices exactly these: per block and micro-batch, the exchanges behind the shared
            # expert and the others (estimator/comm_ep.py)
            assert _overlapped(o[mode]["ops"]) == _priced(mode), mode


def test_the_estimator_prices_the_routers_all_reduces_over_tp(ep_checks):
    """TP + EP: the router sums its slot counts and its loss value over tp in forward (again when recompute
    replays the forward) and its gate's gradient in backward; estimator/comm_ep.py prices each of them per MoE
    block and micro-batch."""
    from curry_train.estimator import comm_ep, layout_of

    for mode in ("none", "selective", "full"):
        x = layout_of(load_config("configs/tiny-moe.yaml", {"parallel.tp": 2, "parallel.sp": True, "parallel.ep": 2,
                                                            "model.z_loss_coef": 1e-3, "parallel.recompute": mode}))
        calls: list = []
        comm_ep._router_tp(x, lambda *a, **_: calls.append(a[4]), 1)
        assert all(r[f"router_{mode}"] == sum(calls) for r in ep_checks), mode
        assert sum(calls) == (3 if mode == "none" else 5)  # counts and loss value (twice with a replay), gradient


def _overlapped(ops: list) -> tuple[int, int]:
    """(all-to-alls with shared matmuls between their issue and their wait, the others), both passes."""
    tags = [t for t, _ in ops]
    hid = [("shared" in tags[i:tags.index("wait", i)]) for i, t in enumerate(tags) if t == "a2a"]
    return sum(hid), len(hid) - sum(hid)


def _priced(recompute: str) -> tuple[int, int]:
    """comm_ep's all-to-alls per MoE block and micro-batch: (in a shared-expert window, on the critical path)."""
    from curry_train.estimator import comm_ep, layout_of
    from curry_train.estimator.profiles import get_profile

    x = layout_of(load_config("configs/tiny-moe.yaml", {"parallel.dp": 2, "parallel.ep": 2, "model.shared_d_ff": FS,
                                                        "model.n_shared_experts": 1, "parallel.recompute": recompute}))
    calls: list = []
    comm_ep.ep_all_to_alls(x, get_profile("H100"), lambda *a, **_: calls.append((a[4], a[6])), "intra", 1)
    n = x.n_layers * x.n_micro_batches
    return sum(c for c, w in calls if w) // n, sum(c for c, w in calls if not w) // n


def _assert_passed(overrides, verdicts):
    for o, v in zip(overrides, verdicts):
        assert v.passed, f"{o}: {v.failures[:5]} worst={v.worst_parameter}"


WORLD2 = [
    {"parallel.dp": 2, "parallel.ep": 2},  # acceptance: DDP + edp all-reduce (edp of size 1)
    {"parallel.dp": 2, "parallel.ep": 2, "model.capacity_factor": 1.0},  # dropping, same rule as the reference
    {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 2, "model.z_loss_coef": 1e-3},  # FSDP2 expert units
    {"parallel.dp": 2, "parallel.ep": 1},  # replicated experts: plain DDP
    # selective recompute around nested FSDP expert units: saved all-to-alls, profiler markers ignored by SAC
    {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 2, "parallel.recompute": "selective"},
]
WORLD4 = [
    {"parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 3},  # acceptance
    {"parallel.dp": 4, "parallel.ep": 2, "model.capacity_factor": 1.0, "parallel.recompute": "full"},  # edp = 2
    {"parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 3, "model.capacity_factor": 1.0},
    {"parallel.dp": 2, "parallel.ep": 2, "parallel.cp": 2},  # MoE + ring attention; aux counts over cp
]


def test_whitebox_ep_two_ranks(tmp_path):
    cfgs = [load_config("configs/tiny-moe.yaml", o) for o in WORLD2]
    _assert_passed(WORLD2, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


def test_whitebox_ep_four_ranks(tmp_path):
    cfgs = [load_config("configs/tiny-moe.yaml", o) for o in WORLD4]
    _assert_passed(WORLD4, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


# PP x MoE: the config accepts it only with the router's auxiliary losses off (the schedule's loss sees only the
# last stage's output, config.py's rule); README claims a white-box test for every accepted combination.
PP_MOE = [
    {"parallel.pp": 2, "model.aux_loss_coef": 0.0, "model.z_loss_coef": 0.0},  # 1F1B
    {"parallel.pp": 2, "model.aux_loss_coef": 0.0, "model.z_loss_coef": 0.0, "parallel.pp_schedule": "gpipe",
     "model.capacity_factor": 1.0},  # GPipe, with token dropping
]


def test_whitebox_pipeline_with_moe_two_ranks(tmp_path):
    cfgs = [load_config(PRESETS / "tiny-moe.yaml", o) for o in PP_MOE]
    _assert_passed(PP_MOE, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))
