"""GPU figures, one prepared script (< 8 min on one H200): template MFU for a ~1B dense model in bf16, the
estimator's per-rank total vs torch.cuda.max_memory_allocated for 6 single-GPU configs, the measured white-box
noise of one GPU, and a 2-GPU white-box (tiny, dp=2 on two GPUs through torchrun and NCCL against the reference on
one GPU, TF32 off; plus one planted bug that must fail) when two GPUs exist; otherwise it prints
"white-box: skipped: 1 GPU".

    .venv/bin/python benchmarks/gpu.py                # on a machine with a CUDA GPU
    .venv/bin/python benchmarks/gpu.py --dry-run      # anywhere: builds and validates every config, estimates them
    .venv/bin/python benchmarks/gpu.py --smoke        # CPU smoke run of the same code paths (tiny sizes)

Without a GPU (and neither flag) it exits 2 with a message saying so. MFU uses the PaLM convention
(estimate.flops_per_token: 6N + 12 L H Dh s per token) over the chip's dense bf16 peak (estimate.peak_flops),
with train.compile on where the config has that field. Goals: MFU >= 45% (torchtitan reports 33-39% for Llama 3
8B on H100); estimator error <= 5%. The memory rows also print what the device holds beyond the allocator
(mem_get_info at the peak - max_memory_reserved: the context term of estimator/reserve.py, no NCCL on one GPU).
White-box noise (validation/compare.py's GPU bounds are reasoned, not measured): one fp32 step's gradients on
this GPU computed twice (kernel nondeterminism) and as 1 vs 2 accumulated micro-batches (the reduction-order
change a data-parallel split makes), worst relative L2 per tensor against compare.FP32's grad_rel_l2 bound.
Final line: one JSON object. Never copy these numbers into docs without running this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = {"path": REPO / "configs/tiny.yaml"}  # the config every case overrides (--base)

ONE_B = {  # ~1.0B params: Llama-style shapes
    "model.vocab_size": 32000, "model.d_model": 2048, "model.n_layers": 16, "model.n_heads": 16,
    "model.n_kv_heads": 8, "model.d_ff": 5632, "train.seq_len": 2048, "train.global_batch": 8,
    "train.micro_batch": 8, "train.dtype": "bfloat16", "hardware.device": "cuda", "hardware.gpu_memory_gib": 141,
}
MEMORY_CASES = {  # single GPU, ~0.5B shapes so fp32 + activations fit comfortably
    "fp32": {},
    "bf16": {"train.dtype": "bfloat16"},
    "bf16_recompute_full": {"train.dtype": "bfloat16", "parallel.recompute": "full"},
    "bf16_recompute_selective": {"train.dtype": "bfloat16", "parallel.recompute": "selective"},
    "bf16_accumulate_4": {"train.dtype": "bfloat16", "train.micro_batch": 2},
    "fp32_long_seq": {"train.seq_len": 4096, "train.global_batch": 4, "train.micro_batch": 4},
}
HALF_B = {"model.vocab_size": 32000, "model.d_model": 1536, "model.n_layers": 12, "model.n_heads": 12,
          "model.n_kv_heads": 4, "model.d_ff": 4096, "train.seq_len": 2048, "train.global_batch": 8,
          "train.micro_batch": 8, "hardware.device": "cuda", "hardware.gpu_memory_gib": 141}
SMOKE = {"model.vocab_size": 256, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
         "model.n_kv_heads": 2, "model.d_ff": 128, "train.seq_len": 64, "hardware.device": "cpu"}


def mfu_run(overrides: dict, steps: int, warmup: int) -> dict:
    import torch
    from curry_train.config import load_config
    from curry_train.estimator import flops_per_token, peak_flops
    from curry_train.measure.steptime import timed_step
    from curry_train.model.gpt import count_params
    from curry_train.train.loop import setup, train_step

    cfg = load_config(BASE["path"], overrides)
    par = setup(cfg)
    for s in range(warmup):
        train_step(par, s)
    times = [timed_step(par, warmup + s).step_time_s for s in range(steps)]
    dt = statistics.median(times)
    tokens_per_s = cfg.train.global_batch * cfg.train.seq_len / dt
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = peak_flops(name, cfg.train.dtype)
    achieved = tokens_per_s * flops_per_token(cfg)
    return {"device": name, "params": count_params(par.parts[0]), "step_time_s": round(dt, 4),
            "tokens_per_s": round(tokens_per_s, 1), "achieved_tflops": round(achieved / 1e12, 2),
            "peak_tflops": peak and round(peak / 1e12, 1), "mfu": peak and round(achieved / peak, 4)}


def memory_run(base: dict, cases: dict) -> dict:
    import torch
    from curry_train.config import load_config
    from curry_train.estimator import estimate
    from curry_train.measure.memory import measure_memory

    out = {}
    for name, extra in cases.items():
        cfg = load_config(BASE["path"], {**base, **extra})
        rep = measure_memory(cfg)
        est = estimate(cfg).memory.total
        measured = rep.cuda_max_allocated if rep.cuda_max_allocated is not None else rep.peak
        beyond = (rep.cuda_device_used_at_peak - rep.cuda_max_reserved) if rep.cuda_max_reserved else None
        out[name] = {"estimated": est, "measured": measured, "tracked_peak": rep.peak,
                     "error": round((est - measured) / measured, 4), "max_reserved": rep.cuda_max_reserved,
                     "device_used_at_peak": rep.cuda_device_used_at_peak, "beyond_allocator": beyond}
        print(f"{name:26s} estimate {est / 2**30:8.3f} GiB  measured {measured / 2**30:8.3f} GiB  "
              f"error {out[name]['error']:+.2%}" + (f"  beyond the allocator {beyond / 2**30:.2f} GiB"
                                                     if beyond is not None else ""), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _grads(overrides: dict) -> dict:
    """One fp32 step's gradients on one device (TF32 off, as the white-box runs), by parameter name."""
    from curry_train.config import load_config
    from curry_train.train.loop import forward_backward, setup

    par = setup(load_config(BASE["path"], overrides))
    forward_backward(par, 0)
    return {n: p.grad.detach().double().clone() for n, p in par.parts[0].named_parameters() if p.grad is not None}


def noise_run(base: dict) -> dict:
    """The white-box noise this device makes with no parallelism at all: the same step twice, and 1 vs 2
    accumulated micro-batches; the worst relative L2 per tensor, and its ratio to compare.FP32's bound."""
    import torch
    from curry_train.validation.compare import FP32

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    one = {**base, "train.dtype": "float32", "train.micro_batch": base["train.global_batch"]}
    a, b = _grads(one), _grads(one)
    c = _grads({**one, "train.micro_batch": base["train.global_batch"] // 2})

    def worst(x: dict, y: dict) -> float:
        return max(float((x[n] - y[n]).norm() / max(float(y[n].norm()), 1e-30)) for n in x)

    out = {"repeat_rel_l2": worst(a, b), "accumulate_rel_l2": worst(c, a), "bound": FP32["grad_rel_l2"]}
    out["worst_of_bound"] = round(max(out["repeat_rel_l2"], out["accumulate_rel_l2"]) / out["bound"], 4)
    print(f"white-box noise: repeat {out['repeat_rel_l2']:.2e}, 1 vs 2 micro-batches {out['accumulate_rel_l2']:.2e} "
          f"relative L2 (bound {out['bound']:.0e}: {out['worst_of_bound']:.1%} of it)", flush=True)
    return out


def dry_run(one_b: dict, half_b: dict) -> dict:
    """Every config this script would run, built and validated, with the estimator's figures: no GPU needed."""
    from curry_train.config import load_config
    from curry_train.estimator import estimate

    out = {}
    for name, ov in {"mfu_1b": one_b, **{f"memory_{k}": {**half_b, **v} for k, v in MEMORY_CASES.items()}}.items():
        e = estimate(load_config(BASE["path"], ov), gpu="H200")
        out[name] = {"params": e.param_count, "estimated_bytes": e.memory.total, "fits": e.fits,
                     "estimated_mfu": round(e.step_time.mfu, 4)}
        print(f"{name:34s} {e.param_count / 1e9:5.2f} B params  estimate {e.memory.total / 2**30:7.2f} GiB  "
              f"estimated MFU {e.step_time.mfu:.1%}  {'fits' if e.fits else 'DOES NOT FIT'}", flush=True)
    return out


def whitebox_run(smoke: bool) -> dict:
    """2-rank white-box on CUDA (validation/compare.py states the GPU tolerances); skipped below 2 GPUs. --smoke
    runs the same path on CPU ranks."""
    import tempfile

    import torch
    from curry_train.config import load_config
    from curry_train.validation.whitebox import run_whitebox

    gpus = torch.cuda.device_count()
    if gpus < 2 and not smoke:
        print(f"white-box: skipped: {gpus} GPU", flush=True)
        return {"skipped": f"{gpus} GPU"}
    device = "cpu" if smoke else "cuda"
    out = {}
    for label, inject in (("clean", None), ("data-same-rows", "data-same-rows")):
        cfg = load_config(BASE["path"], {"parallel.dp": 2, "hardware.device": device})
        with tempfile.TemporaryDirectory() as d:
            v = run_whitebox(cfg, steps=2, run_dir=Path(d), timeout=300, inject=inject)
        w = v.worst_parameter
        out[label] = {"passed": v.passed, "wall_s": round(v.wall_s, 1), "loss_max_diff": v.loss_max_diff,
                      "worst": w and {"name": w.name, "measured": w.measured, "allowed": w.allowed}}
        print(f"white-box {label:15s} {'PASSED' if v.passed else 'FAILED'} in {v.wall_s:.1f} s; worst "
              f"{w and w.name} {w and w.measured:.2e} (allowed {w and w.allowed:.2e})", flush=True)
    out["ok"] = out["clean"]["passed"] and not out["data-same-rows"]["passed"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, not the GPU")
    ap.add_argument("--dry-run", action="store_true", help="build and estimate every config; no GPU needed")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--base", type=Path, default=BASE["path"], help="the YAML every case overrides (tiny)")
    a = ap.parse_args()
    BASE["path"] = a.base
    t0 = time.perf_counter()
    one_b = {**ONE_B, **_compile()}
    if a.dry_run:
        est = dry_run(one_b, HALF_B)
        print(json.dumps({"dry_run": True, "configs": est, "wall_s": round(time.perf_counter() - t0, 1)}))
        return 0
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False here); run it where one is, "
              "or --dry-run to check its configs, --smoke for its code paths on CPU", file=sys.stderr)
        return 2
    one_b = {**ONE_B, **SMOKE} if a.smoke else one_b
    half_b = {**HALF_B, **SMOKE} if a.smoke else HALF_B
    mfu = mfu_run(one_b, steps=3 if a.smoke else a.steps, warmup=1 if a.smoke else 3)
    print(f"MFU run: {mfu}", flush=True)
    mem = memory_run(half_b, MEMORY_CASES)
    errors = [abs(v["error"]) for v in mem.values()]
    noise = noise_run(half_b)
    wb = whitebox_run(a.smoke)
    print(json.dumps({"smoke": a.smoke, "mfu": mfu, "memory": mem, "max_abs_memory_error": max(errors),
                      "noise": noise, "whitebox": wb, "goals": {"mfu": 0.45, "memory_error": 0.05},
                      "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


def _compile() -> dict:
    """train.compile on for the MFU run where the config has the field (another change adds it)."""
    from curry_train.config import TrainConfig

    field = TrainConfig.model_fields.get("compile")
    return {"train.compile": True} if field is not None and isinstance(field.default, bool) else {}


if __name__ == "__main__":
    sys.exit(main())
