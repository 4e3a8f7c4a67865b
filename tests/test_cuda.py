"""The cuda tier: what only a GPU can prove, one device, in-process (`pytest -m cuda`; skipped without a GPU).

    .venv/bin/python -m pytest -m cuda -q -n 0 tests/test_cuda.py

One training step per primitive that fits on one device (fp32 and bf16, recompute, the MoE's grouped GEMM,
train.compile on and off where the config has the field), measure_memory's tracker against
torch.cuda.max_memory_allocated and the device view beside it, and the CP ring's CUDA kernels (flash in bf16,
memory-efficient in fp32) with a block of 24 rows, not a multiple of the efficient kernel's 32-row LSE padding.
The first test runs everywhere: it pins the kernel choice and the padding rule the CUDA path relies on.
"""

from __future__ import annotations

import math

import pytest
import torch
from curry_train.config import TrainConfig, load_config
from curry_train.parallel.context_parallel import EFFICIENT_LSE_ALIGN, block_kernel, lse_rows

from tests.conftest import PRESETS

CUDA = torch.cuda.is_available()


def test_the_ring_picks_its_kernel_by_device_and_pads_the_efficient_lse_to_32_rows():
    assert block_kernel(torch.zeros(1, 1, 4, 8)) == "cpu_flash"
    assert EFFICIENT_LSE_ALIGN == 32
    if torch.version.hip is None:
        assert (lse_rows(24), lse_rows(32), lse_rows(33)) == (32, 32, 64)


@pytest.mark.parametrize("kind,dtype", [("flash", torch.bfloat16), ("efficient", torch.float32)])
def test_the_cuda_block_kernels_take_their_arguments_on_meta_tensors(kind, dtype, monkeypatch):
    """Both CUDA paths through torch's meta kernels (no GPU): every argument in its place, the flash forward's
    aux handed back to its backward, the efficient LSE cut to the 24 real rows for the merge."""
    import curry_train.parallel.context_parallel as cp

    monkeypatch.setattr(cp, "block_kernel", lambda q: kind)
    q, k, v = (torch.empty(2, 4, 24, 64, device="meta", dtype=dtype) for _ in range(3))
    out, lse, aux = cp._attn_fwd(q, k, v, True)
    assert out.shape == q.shape and lse.shape == (2, 4, 24) and (aux is None) == (kind == "efficient")
    grads = cp._attn_bwd(torch.empty_like(out), q, k, v, out, lse, True, aux)
    assert [g.shape for g in grads] == [q.shape] * 3


def _steps(overrides: dict, steps: int = 2) -> list[float]:
    from curry_train.train.loop import setup, train_step

    base = "tiny-moe" if overrides.pop("moe", False) else "tiny"
    cfg = load_config(PRESETS / f"{base}.yaml", {"hardware.device": "cuda", **overrides})
    par = setup(cfg, torch.device("cuda", 0))
    return [train_step(par, s, read=True).loss for s in range(steps)]


PRIMITIVES = {
    "fp32": {},
    "bf16": {"train.dtype": "bfloat16"},
    "recompute-full": {"parallel.recompute": "full"},
    "recompute-selective-bf16": {"parallel.recompute": "selective", "train.dtype": "bfloat16"},
    "no-accumulation": {"train.micro_batch": 8},  # tiny's default accumulates 4 micro-batches
    "moe-bf16": {"moe": True, "train.dtype": "bfloat16"},
}


@pytest.mark.parametrize("name", list(PRIMITIVES))
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_one_training_step_per_single_device_primitive(name):
    losses = _steps(dict(PRIMITIVES[name]))
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0] + 0.5, losses


@pytest.mark.parametrize("compile_on", [False, True])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_step_with_compile_on_and_off_trains(compile_on):
    field = TrainConfig.model_fields.get("compile")
    if field is None or not isinstance(field.default, bool):
        pytest.skip("train.compile is not a boolean config field in this checkout")
    losses = _steps({"train.compile": compile_on, "train.dtype": "bfloat16"})
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_grouped_gemm_matches_the_padded_kernel_in_bf16():
    from curry_train.model.experts import Experts

    torch.manual_seed(0)
    counts = [40, 0, 72, 16]  # an empty group included
    x0 = torch.randn(sum(counts), 64, device="cuda", dtype=torch.bfloat16)
    res = {}
    for kernel in ("padded", "grouped"):
        ex = Experts(4, 64, 128).cuda().to(torch.bfloat16)
        torch.manual_seed(1)
        for w in (ex.w1, ex.w3, ex.w2):
            torch.nn.init.normal_(w, std=0.05)
        ex.kernel = kernel
        x = x0.clone().requires_grad_()
        y = ex(x, counts, torch.tensor(counts, device="cuda"))
        y.float().sum().backward()
        res[kernel] = [y.detach().float(), x.grad.float(), ex.w1.grad.float()]
    for a, b in zip(res["padded"], res["grouped"]):
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2)  # bf16: different accumulation order


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_measure_memory_tracks_the_allocator_and_reports_the_device_view():
    from curry_train.measure.memory import measure_memory

    cfg = load_config(PRESETS / "tiny.yaml", {"hardware.device": "cuda", "model.d_model": 1024, "model.d_ff": 2048,
                                              "hardware.gpu_memory_gib": 80})
    r = measure_memory(cfg)
    # the tracker counts live tensor bytes; the allocator rounds each block up to 512 B and holds cuBLAS's
    # workspaces beside them: the allocator is never below the tracker, and above it by at most 5% + 64 MiB
    assert r.cuda_max_allocated is not None and r.peak <= r.cuda_max_allocated
    assert r.cuda_max_allocated <= r.peak * 1.05 + 2**26
    assert r.cuda_max_reserved >= r.cuda_max_allocated
    assert r.cuda_device_total >= r.cuda_device_used_at_peak >= r.cuda_max_reserved


def _reference(q, k, v):
    """Causal attention in fp64 math: out and the input gradients for dout = 1."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
    out = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ leaves[2]
    return out, torch.autograd.grad(out.sum(), leaves)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_ring_on_one_gpu_merges_blocks_of_24_rows_exactly(dtype, kernel, tmp_path):
    """A one-rank ring over T = 48 (two head-tail chunks of 24): three blocks merged by LSE, the backward fed the
    merged LSE, in which the efficient kernel needs its 32-row padding restored."""
    import torch.distributed as dist
    from curry_train.model.data import cp_positions
    from curry_train.parallel.context_parallel import RingCoreAttention

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    torch.manual_seed(0)
    B, H, G, T, Dh = 2, 4, 2, 48, 64
    q = torch.randn(B, H, T, Dh, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, G, T, Dh, device="cuda", dtype=dtype) for _ in range(2))
    assert block_kernel(q[:, :, :24]) == kernel
    attn = RingCoreAttention(dist.group.WORLD, 1, 0, cp_positions)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves)
    grads = torch.autograd.grad(out.float().sum(), leaves)
    ref, ref_grads = _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    ref_grads = (ref_grads[0], *(g.unflatten(1, (G, 2)).sum(2) for g in ref_grads[1:]))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    assert float((out.double() - ref).abs().max()) < tol
    for got, want in zip(grads, ref_grads):
        assert float((got.double() - want).abs().max()) < tol * max(1.0, float(want.abs().max()))


def test_the_gpu_benchmark_builds_its_configs_anywhere_and_refuses_to_run_without_a_gpu():
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    script = [sys.executable, str(REPO / "benchmarks/gpu.py"), "--base", str(PRESETS / "tiny.yaml")]
    dry = subprocess.run([*script, "--dry-run"], capture_output=True, text=True, timeout=120, check=False)
    assert dry.returncode == 0, dry.stderr[-2000:]
    configs = json.loads(dry.stdout.splitlines()[-1])["configs"]
    assert len(configs) == 7 and all(c["fits"] for c in configs.values())
    assert 0.8e9 < configs["mfu_1b"]["params"] < 1.2e9  # the ~1B dense model of the MFU goal
    if not CUDA:
        run = subprocess.run(script, capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr
