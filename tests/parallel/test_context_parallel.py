"""Context parallel: block plan, ring attention against full-sequence SDPA, balance, activation memory, white-box.

    .venv/bin/pytest tests/parallel/test_context_parallel.py -q -s     # -s prints the balance / memory figures

Ring attention is checked on its own (out, dq, dk, dv against causal SDPA on the whole sequence, GQA, both the
head-tail and the contiguous layout, fp32 and bf16) and inside the model (logits at the local positions, and
saved-activation bytes per rank against cp=1). White-box runs prove the whole step at the fixed fp32 tolerances.
"""

from __future__ import annotations

import pytest
import torch
from curry_train.config import load_config
from curry_train.model.data import cp_positions
from curry_train.parallel.context_parallel import attention_work, plan_blocks
from curry_train.train.launch import launch_forkserver

from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(300)


def contiguous_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The layout without load balancing: rank r holds tokens [r*T/cp, (r+1)*T/cp)."""
    return torch.arange(rank * seq_len // cp, (rank + 1) * seq_len // cp)


@pytest.mark.parametrize("layout", [cp_positions, contiguous_positions])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_plan_covers_every_causal_pair_exactly_once(layout, cp):
    T = 12 * cp
    pos = [layout(T, cp, r) for r in range(cp)]
    seen = torch.zeros(T, T, dtype=torch.long)
    for r in range(cp):
        for src in range(cp):
            for qs, ks, mask in plan_blocks(pos[r], pos[src], T // (2 * cp)):
                m = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.bool) if mask is None else mask
                seen[pos[r][qs][:, None], pos[src][ks][None, :]] += m.long()
    assert torch.equal(seen, torch.ones(T, T, dtype=torch.long).tril())


def test_head_tail_layout_balances_attention_work_and_contiguous_does_not():
    for cp in (2, 4):
        bal = [w["computed_pairs"] for w in attention_work(64, cp)]
        unbal = [w["computed_pairs"] for w in attention_work(64, cp, contiguous_positions)]
        c = 64 // (2 * cp)
        assert bal == [(2 * cp + 1) * c * c] * cp  # one half-masked diagonal pair + 2(cp-1)+1 full c x c blocks
        assert unbal == [(4 * r + 3) * c * c for r in range(cp)]
        assert sum(bal) == sum(unbal)
        print(
            f"\ncp={cp} computed pairs per rank: head-tail {bal} (max/mean 1.00), contiguous {unbal} "
            f"(max/mean {max(unbal) * cp / sum(unbal):.2f})"
        )


def _saved_bytes(model, fn) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during fn() (docs/CPU-DISTRIBUTED.md)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _cp_checks(rank: int, world: int) -> dict:
    from curry_train.mesh import Topology, build_mesh
    from curry_train.model.gpt import build_model, causal_attention, lm_loss
    from curry_train.parallel.context_parallel import RingCoreAttention, apply_cp, cp_flops

    mesh = build_mesh(Topology(cp=world), "cpu")
    group = mesh["cp"].get_group()
    out: dict = {}
    # 1. ring attention alone, GQA (4 query heads over 2 kv heads), fp32 and bf16, both layouts
    B, H, G, T, Dh = 2, 4, 2, 16 * world, 8
    g = torch.Generator().manual_seed(0)  # same full tensors on every rank
    q, k, v, dout = (torch.randn(B, h, T, Dh, generator=g) for h in (H, G, G, H))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # the ring repeats the kv heads itself (context_parallel._rep): so does the reference, whose k/v gradients
    # are then summed over the repeats as the ring's are, and the fp32 bound measures the ring's merging only
    ref = causal_attention(leaves[0], *(t.repeat_interleave(H // G, dim=1) for t in leaves[1:]))
    ref_grads = torch.autograd.grad((ref * dout).sum(), leaves)
    ref = ref.detach()
    for name, layout in (("head_tail", cp_positions), ("contiguous", contiguous_positions)):
        for dtype in (torch.float32, torch.bfloat16):
            pos = layout(T, world, rank)
            attn = RingCoreAttention(group, world, rank, layout)
            local = [t[:, :, pos].to(dtype).requires_grad_() for t in (q, k, v)]
            o = attn(*local)
            grads = torch.autograd.grad((o.float() * dout[:, :, pos]).sum(), local)
            diffs = [float((o.detach().float() - ref[:, :, pos]).abs().max())]
            diffs += [float((a.float() - b[:, :, pos]).abs().max()) for a, b in zip(grads, ref_grads)]
            out[f"ring_{name}_{str(dtype)[6:]}"] = max(diffs)
            if dtype == torch.float32:
                out[f"flops_{name}"] = attn.flops
    # 2. inside the model: logits at this rank's positions, and saved-activation bytes vs the plain model
    cfg = load_config("configs/tiny.yaml", {"parallel.cp": world})
    plain, model = build_model(cfg), build_model(cfg)
    apply_cp(model, mesh, cfg)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len), generator=g)
    pos = cp_positions(cfg.train.seq_len, world, rank)
    with torch.no_grad():
        out["logits"] = float((model(x[:, pos], pos) - plain(x)[:, pos]).abs().max())
    cp_flops(model)
    out["act_bytes"] = _saved_bytes(model, lambda: lm_loss(model(x[:, pos], pos), x[:, pos]))
    out["act_bytes_cp1"] = _saved_bytes(plain, lambda: lm_loss(plain(x), x))
    out["model_attn_flops"] = cp_flops(model)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_full_causal_attention_and_balances_work(world):
    res = launch_forkserver(_cp_checks, world, timeout=180)
    for r in res:
        for name in ("head_tail", "contiguous"):
            assert r[f"ring_{name}_float32"] < 2e-6, r
            assert r[f"ring_{name}_bfloat16"] < 5e-2, r  # bf16 inputs (8-bit mantissa), fp32 block math
        assert r["logits"] < 2e-5
    bal, unbal = [r["flops_head_tail"] for r in res], [r["flops_contiguous"] for r in res]
    assert len(set(bal)) == 1 and max(unbal) > 1.3 * (sum(unbal) / world)
    assert len({r["model_attn_flops"] for r in res}) == 1
    ratio = [r["act_bytes"] / r["act_bytes_cp1"] for r in res]
    assert all(1 / world * 0.9 < x < 1 / world * 1.2 for x in ratio), ratio
    print(
        f"\ncp={world}: attention FLOPs per rank head-tail {bal}, contiguous {unbal} "
        f"(max/mean {max(unbal) * world / sum(unbal):.2f}); saved activations per rank "
        f"{[r['act_bytes'] for r in res]} B vs cp=1 {res[0]['act_bytes_cp1']} B (ratio {[f'{x:.3f}' for x in ratio]})"
    )


def _assert_passed(overrides, verdicts):
    for o, v in zip(overrides, verdicts):
        assert v.passed, f"{o}: {v.failures[:5]} worst={v.worst_parameter}"


WORLD2 = [{"parallel.cp": 2}, {"parallel.cp": 2, "parallel.recompute": "full"}]
WORLD4 = [
    {"parallel.cp": 4},  # acceptance
    {"parallel.dp": 2, "parallel.cp": 2, "parallel.zero": 3},  # acceptance: cp folds into FSDP's dp_cp mesh
    {"parallel.cp": 2, "parallel.tp": 2, "parallel.zero": 3},  # acceptance (TP needs FSDP: config.check)
    {"parallel.dp": 2, "parallel.cp": 2},  # DDP over dp x cp
    {"parallel.cp": 2, "parallel.pp": 2},  # cp x pp on the fused ring
]


def test_whitebox_cp_two_ranks(tmp_path):
    cfgs = [load_config("configs/tiny.yaml", o) for o in WORLD2]
    _assert_passed(WORLD2, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


def test_whitebox_cp_four_ranks(tmp_path):
    cfgs = [load_config("configs/tiny.yaml", o) for o in WORLD4]
    _assert_passed(WORLD4, whitebox_batch(cfgs, steps=2, out_dir=tmp_path))


def _backward_events(rank: int, world: int) -> list[str]:
    """The order of the ring's backward: each dK/dV exchange ("start 1" / "wait 1") and each block kernel."""
    import curry_train.parallel.context_parallel as cpm
    from curry_train.mesh import Topology, build_mesh
    from curry_train.parallel.comms import RingExchange

    mesh = build_mesh(Topology(cp=world), "cpu")
    events: list[str] = []
    start, wait, bwd = RingExchange.start, RingExchange.wait, cpm._attn_bwd

    def logged_start(self, t):
        events.append(f"start {self.tag}")
        return start(self, t)

    def logged_wait(self):
        events.append(f"wait {self.tag}")
        return wait(self)

    def logged_bwd(*a, **k):
        events.append("block")
        return bwd(*a, **k)

    RingExchange.start, RingExchange.wait, cpm._attn_bwd = logged_start, logged_wait, logged_bwd
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * world, 8, generator=g) for _ in range(3))
    pos = cp_positions(8 * world, world, rank)
    attn = cpm.RingCoreAttention(mesh["cp"].get_group(), world, rank, cp_positions)
    local = [t[:, :, pos].requires_grad_() for t in (q, k, v)]
    out = attn(*local)
    events.clear()  # the backward only
    out.sum().backward()
    return events


def test_the_dkdv_exchange_is_in_flight_while_the_next_blocks_run():
    """Ring attention's backward posts each step's dK/dV exchange and computes the next step's blocks before it
    waits for it (a blocking shift would show "start 1" directly followed by "wait 1")."""
    for events in launch_forkserver(_backward_events, 4, timeout=180):
        grad = [i for i, e in enumerate(events) if e.endswith(" 1")]
        assert [events[i] for i in grad] == ["start 1", "wait 1"] * 4, events
        pairs = list(zip(grad[::2], grad[1::2]))  # (posted, awaited) per exchange; the last overlaps nothing
        assert all("block" in events[a:b] for a, b in pairs[:-1]), events
