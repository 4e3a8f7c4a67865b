"""Activation recomputation: same names, bitwise-equal gradients, the documented selective policy, and the memory it
saves, measured per block. One process (recompute needs no ranks); the multi-rank white-box runs of recompute with
every ZeRO stage are in test_zero.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from curry_train.config import load_config
from curry_train.measure.memory import measure_memory
from curry_train.measure.tracker import _is_recomputing
from curry_train.model.data import global_batch, micro_batches
from curry_train.model.gpt import build_model, lm_loss
from curry_train.parallel.recompute import apply_recompute
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
F32 = 4
aten = torch.ops.aten


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class _RecomputedOps(TorchDispatchMode):
    """Records the ops run by checkpoint recomputation during backward, with the output width of each matmul."""

    def __init__(self):
        super().__init__()
        self.ops: set = set()
        self.mm_widths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() != -1 and _is_recomputing():
            self.ops.add(func)
            if func is aten.mm.default:
                self.mm_widths.append(out.shape[-1])
        return out


def _grads(mode: str, *, preset: str = "tiny.yaml"):
    cfg = load_config(PRESETS / preset, {"parallel.recompute": mode})
    model = build_model(cfg)
    apply_recompute(model, None, cfg)
    x, y, pos = next(micro_batches(cfg, *global_batch(cfg, 0), dp_rank=0))
    with _RecomputedOps() as rec:
        lm_loss(model(x, pos), y).backward()
    return model, {n: p.grad for n, p in model.named_parameters()}, rec


def test_recompute_keeps_names_and_gives_bitwise_equal_gradients(one_thread):
    for preset in ("tiny.yaml", "tiny-moe.yaml"):
        ref_model, ref, _ = _grads("none", preset=preset)
        for mode in ("selective", "full"):
            model, grads, _ = _grads(mode, preset=preset)
            assert list(model.state_dict()) == list(ref_model.state_dict())
            assert list(grads) == list(ref)
            for name, g in ref.items():
                assert torch.equal(grads[name], g), f"{preset} {mode}: {name}"


def test_selective_reruns_every_other_matmul_and_keeps_fused_attention(one_thread):
    """Per block the forward runs wq, wk, wv, wo, w1, w3, w2; the policy keeps the 1st, 3rd, ... outputs, so the
    recomputation reruns exactly wk [.., kv], wo [.., D] and w3 [.., F] in every block, and never the SDPA."""
    _, _, full = _grads("full")
    _, _, sel = _grads("selective")
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert {aten.mm.default, sdpa} <= full.ops  # full recompute reruns the projections and the attention
    assert sdpa not in sel.ops
    m = load_config(TINY).model
    kv = m.n_kv_heads * m.d_model // m.n_heads
    # full: every projection but w2, whose output no backward reads (the recomputation stops early after w3)
    assert sorted(full.mm_widths) == sorted([m.d_model, kv, kv, m.d_model, m.d_ff, m.d_ff] * m.n_layers)
    assert sorted(sel.mm_widths) == sorted([kv, m.d_model, m.d_ff] * m.n_layers)
    cheap = {aten.rsqrt.default, aten.silu.default, aten.mul.Tensor, aten.cat.default}  # RMSNorm, SwiGLU, RoPE
    assert cheap <= sel.ops and cheap <= full.ops


def test_selective_keeps_the_routing_and_replays_no_host_read_in_moe(one_thread):
    """MoE blocks: top-k is saved (the recomputation never reruns it) and the dispatch's host read of the split
    sizes runs once per block forward, not again in backward (parallel/recompute.host_once)."""
    from curry_train.model.moe import moe_layers

    model, _, sel = _grads("selective", preset="tiny-moe.yaml")
    assert aten.topk.default not in sel.ops
    assert aten.rsqrt.default in sel.ops  # the blocks were recomputed all the same
    assert [m.host_syncs for _, m in moe_layers(model)] == [1] * len(moe_layers(model))
    model, _, full = _grads("full", preset="tiny-moe.yaml")
    assert aten.topk.default in full.ops
    assert [m.host_syncs for _, m in moe_layers(model)] == [1] * len(moe_layers(model))


def test_importing_recompute_leaves_torch_sac_ignored_ops_unchanged(tmp_path):
    """The profiler markers are ignored only while a checkpointed block runs: a fresh interpreter's torch global
    is the same after importing the module and after a selective forward + backward."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch, torch.utils.checkpoint as c\n"
        "before = set(c.SAC_IGNORED_OPS)\n"
        "from curry_train.parallel.recompute import checkpointed\n"
        "after_import = set(c.SAC_IGNORED_OPS)\n"
        "seen = []\n"
        "def f(x):\n"
        "    seen.append(torch.ops.profiler._record_function_enter_new.default in c.SAC_IGNORED_OPS)\n"
        "    return (x @ x).sin()\n"
        "x = torch.randn(4, 4, requires_grad=True)\n"
        "checkpointed(f, 'selective')(x).sum().backward()\n"
        "print(before == after_import, before == set(c.SAC_IGNORED_OPS), seen)\n", encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True", "[True,", "True]"]  # unchanged; ignored in forward and recompute


def test_recompute_shrinks_activations_per_block_to_what_the_policy_keeps(one_thread):
    """Adding 4 blocks adds, per block: everything (none), the policy's saved tensors (selective), or only the
    block input [B, T, D] (full). Read off the measurement, compared with shapes."""
    act = {}
    for layers in (4, 8):
        for mode in ("none", "selective", "full"):
            # one micro-batch a step: activations are one micro-batch's, whatever the accumulation around it
            cfg = load_config(TINY, {"model.n_layers": layers, "parallel.recompute": mode, "train.global_batch": 2})
            act[layers, mode] = measure_memory(cfg).activations
    per_block = {mode: (act[8, mode] - act[4, mode]) / 4 for mode in ("none", "selective", "full")}
    m, t = cfg.model, cfg.train
    tokens, head_dim = t.micro_batch * t.seq_len, m.d_model // m.n_heads
    kv = m.n_kv_heads * head_dim
    assert per_block["full"] == tokens * m.d_model * F32  # the block input only
    # block input, wq and wv outputs, attention out + logsumexp (one per head), w1 and w2 outputs
    saved = m.d_model + m.d_model + kv + m.d_model + m.n_heads + m.d_ff + m.d_model
    assert per_block["selective"] == tokens * saved * F32
    assert per_block["none"] > 1.8 * per_block["selective"]
    assert act[4, "none"] > act[4, "selective"] > act[4, "full"]
