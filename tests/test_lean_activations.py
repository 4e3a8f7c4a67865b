"""Lean activations (model/lean.py, GQA inside SDPA): what one block saves for backward, measured with saved-tensor
hooks on the tiny preset under each precision path, against the estimator's per-layer figure (estimator/acts.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from curry_train.config import load_config
from curry_train.estimator import load_any
from curry_train.estimator.acts import _acts
from curry_train.estimator.layout import layout_of
from curry_train.model.gpt import Block, build_model, rope_tables
from curry_train.model.lean import rms_norm, swiglu

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
PATHS = {  # precision path -> overrides on the tiny preset that select it (wrapping.precision_path)
    "fp32": {},
    "mp": {"train.dtype": "bfloat16", "parallel.dp": 2, "parallel.zero": 3},
    "mp-one-rank": {"train.dtype": "bfloat16"},  # FSDP2 at degree 1: the same policy, so the same bytes
}


def _saved_block(path: str) -> tuple[int, list[torch.Tensor], int]:
    """(bytes one block saves for backward, the saved tensors, the estimator's layer_full) on the tiny preset.
    "mp" runs the block as FSDP2's MixedPrecisionPolicy leaves an unsharded unit: bf16 weights and hidden
    states, the fp32 RoPE tables (cast_forward_inputs=False, parallel/fsdp.py)."""
    cfg = load_config(TINY, PATHS[path])
    assert layout_of(cfg).precision == path.split("-")[0]
    m, t = cfg.model, cfg.train
    block = Block(m)
    x = torch.randn(t.micro_batch, t.seq_len, m.d_model, requires_grad=True)  # [B, T, D]
    cos, sin = rope_tables(m.d_model // m.n_heads, t.seq_len, m.rope_theta)  # [T, Dh/2]
    if path != "fp32":
        block, x = block.to(torch.bfloat16), x.detach().bfloat16().requires_grad_()
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}  # acts.py `rope`, shared
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = block(x, cos, sin)
    y.float().sum().backward()  # the saved tensors are enough for backward
    total = sum(s.untyped_storage().nbytes() for s in saved.values())
    return total, list(saved.values()), _acts(layout_of(cfg)).layer_full


@pytest.mark.parametrize("path", list(PATHS))
def test_saved_bytes_per_layer_are_the_estimate(path: str) -> None:
    measured, _, estimated = _saved_block(path)
    assert measured == estimated, f"{path}: a block saves {measured} B, the estimator says {estimated} B"


def test_bf16_fsdp_block_saves_no_fp32_copy_of_the_stream() -> None:
    """Under FSDP's bf16 policy the only fp32 tensors a block keeps are the per-token statistics (RMSNorm's rstd
    [B, T, 1] and SDPA's logsumexp [B, H, T]); plain autograd kept the norms' fp32 upcasts [B, T, D]."""
    _, saved, _ = _saved_block("mp")
    cfg = load_config(TINY)
    stream = (cfg.train.micro_batch, cfg.train.seq_len, cfg.model.d_model)  # [B, T, D]
    wide = [tuple(s.shape) for s in saved if s.dtype == torch.float32 and s.numel() == math.prod(stream)]
    assert not wide, f"fp32 [.., D] tensors saved in a bf16 block: {wide}"


def test_gqa_keeps_kv_heads_unrepeated() -> None:
    """k and v are saved with G heads (SDPA enable_gqa): no [B, H, T, Dh] copy of them, no repeat in the graph."""
    _, saved, _ = _saved_block("fp32")
    m, t = load_config(TINY).model, load_config(TINY).train
    dh = m.d_model // m.n_heads
    heads = sorted(s.shape[1] for s in saved if tuple(s.shape[::2]) == (t.micro_batch, t.seq_len) and s.shape[-1] == dh)
    assert heads == [m.n_kv_heads, m.n_kv_heads, m.n_heads, m.n_heads], heads  # k, v; q, out
    model = build_model(load_config(TINY))
    loss = model(torch.randint(0, m.vocab_size, (1, t.seq_len)), targets=torch.zeros(1, t.seq_len, dtype=torch.long))
    nodes, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in nodes:
            nodes.add(fn)
            todo.extend(nxt for nxt, _ in fn.next_functions)
    names = {type(fn).__name__ for fn in nodes}
    assert "ExpandBackward0" not in names, names  # repeat_interleave(int) is unsqueeze, expand, clone, view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_functions_match_plain_autograd(dtype: torch.dtype) -> None:
    """Same forward, same gradients (to the dtype's rounding) as the plain-autograd ops they replace."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 64, dtype=dtype, requires_grad=True), (1 + torch.randn(64) / 10).to(dtype).requires_grad_()
    a, b = torch.randn(4, 64, dtype=dtype, requires_grad=True), torch.randn(4, 64, dtype=dtype, requires_grad=True)
    g = torch.randn(4, 64, dtype=dtype)
    xf = x.float()
    plain_norm = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for lean, plain, inputs in ((rms_norm(x, w, 1e-5), plain_norm, (x, w)), (swiglu(a, b), F.silu(a) * b, (a, b))):
        assert torch.equal(lean, plain)
        for got, want in zip(torch.autograd.grad(lean, inputs, g), torch.autograd.grad(plain, inputs, g), strict=True):
            assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_llama3_8b_activation_bytes_per_layer_at_most_40_sbh() -> None:
    """Korthikanti et al. 2022 Table 2 adapted to SwiGLU, GQA and flash attention: ~36 bytes per s*b*h per layer
    (bf16 FSDP, tp 1, no recompute); plain autograd and repeated k/v made it 54."""
    cfg = load_any(PRESETS / "llama3-8b.yaml", {"train.seq_len": 4096, "parallel.recompute": "none"})
    lay = layout_of(cfg)
    per_sbh = _acts(lay).layer_full / (lay.micro_batch * lay.seq_len * lay.d_model)
    assert lay.precision == "mp" and per_sbh <= 40, per_sbh


def _block_input_dtypes(store: str) -> tuple[list, int]:
    """The dtypes each block's forward receives under bf16 ZeRO-3 on a 1-rank world (run by in_fresh_process)."""
    import torch.distributed as dist
    from curry_train.mesh import Topology, build_mesh
    from curry_train.model.gpt import build_meta_model
    from curry_train.parallel.fsdp import apply_fsdp
    from curry_train.parallel.materialize import global_shapes, materialize

    cfg = load_config(TINY, {"train.dtype": "bfloat16", "parallel.zero": 3})
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mesh = build_mesh(Topology(), "cpu")  # one rank: FSDP2's degree-1 sharding, its policy all the same
        model = build_meta_model(cfg)
        apply_fsdp(model, mesh, cfg)
        materialize(model, cfg, torch.device("cpu"), mesh, global_shapes(cfg))
        seen = []
        for block in model.layers.values():
            block.register_forward_pre_hook(lambda _m, args: seen.append(tuple(a.dtype for a in args)))
        model(torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len)))
    finally:
        dist.destroy_process_group()
    return seen, cfg.model.n_layers


def test_fsdp_bf16_blocks_get_bf16_hidden_states_and_the_fp32_rope_tables(tmp_path) -> None:
    """MixedPrecisionPolicy(cast_forward_inputs=False): each block's inputs as the root hands them, the hidden
    state bf16 (the embedding computes in bf16), cos/sin the root's fp32 tables, not a bf16 copy per block."""
    from tests.isolated import in_fresh_process

    seen, n_layers = in_fresh_process(_block_input_dtypes, str(tmp_path / "store"))
    assert seen == [(torch.bfloat16, torch.float32, torch.float32)] * n_layers, seen
