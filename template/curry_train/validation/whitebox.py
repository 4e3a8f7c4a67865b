"""White-box comparison: the parallel run must compute the same loss, gradients and updates as one device.

    curry-train whitebox --config configs/tiny.yaml --set parallel.dp=2 --json

Reference: one process, the full model from the same seed, the same global batch accumulated over the same
micro-batches (dp rank r's micro-batch m is the same rows of the same step), plain AdamW.
Parallel: N ranks through the launcher; after each backward every parameter's gradient is gathered to full
shape (DTensor.full_tensor for FSDP/TP, stage dicts for PP, expert shards for EP) under its reference name.

Tolerances (fp32; measured noise in ../shared/notes/torch-cpu-distributed.md §2, kept >= 10x above it):
  loss       |d| <= 1e-5 * max(1, |ref|)      observed <= 9.5e-7: reductions sum in another order
  gradients  |d| <= 1e-6 + 1e-5 * |ref|       observed <= 3.4e-8 (elementwise; relative error alone is
                                              meaningless for near-zero grads)
  grad norm  |d| <= 1e-6 + 1e-5 * ref
  params     |d| <= 1e-5 + 0.1 * lr * steps   AdamW divides by sqrt(v): a grad of order eps=1e-8 turns 1e-9
                                              of noise into a large fraction of lr. A skipped or doubled update
                                              (the bugs this catches) is off by ~lr per element.
bfloat16 runs are compared with the fp32 reference: the loss at every step within 2%, the grad norm within 5%,
and each parameter's step-0 gradient within 5% relative L2 error (bf16 keeps 8 mantissa bits, ~0.4% per
rounding, compounded over a few layers). Later-step gradients and the updated weights are not compared element-
wise in bf16: AdamW's first updates are ~lr*sign(g), so any gradient below bf16 resolution flips a whole lr-sized
step; those paths are proven in fp32, where the same code runs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from curry_train.config import Config, from_dict
from curry_train.validation.verdict import ParamDiff, Verdict

FP32 = {"loss_rtol": 1e-5, "grad_atol": 1e-6, "grad_rtol": 1e-5, "param_atol": 1e-5, "param_lr_frac": 0.1}
BF16 = {"loss_rtol": 2e-2, "grad_rel_l2": 5e-2}


# --------------------------------------------------------------------------- parallel side (inside the ranks)


def gather_full(par, which: str) -> dict[str, torch.Tensor] | None:
    """Every parameter (`which="param"`) or gradient (`"grad"`) at full shape under its reference name, on rank 0.

    All ranks must call it (full_tensor and the EP/PP gathers are collectives). Returns None off rank 0.
    """
    import torch.distributed as dist

    from curry_train.parallel.parallelize import canonical_name

    local: dict[str, torch.Tensor] = {}
    for part in par.parts:
        for name, p in part.named_parameters():
            t = p if which == "param" else p.grad
            if t is None:
                t = torch.zeros_like(p)
            t = t.detach()
            if hasattr(t, "full_tensor"):  # DTensor: FSDP shards and/or TP shards
                t = t.full_tensor()
            gather = getattr(p, "_curry_gather", None)  # e.g. expert shards over the ep group
            if gather is not None:
                t = gather(t)
            local[canonical_name(name)] = t.float().cpu().clone()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    if par.topo.pp == 1:  # every rank holds every name already
        return local if dist.get_rank() == 0 else None
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for d in parts:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


def _fault_hook(names: list[str] | None):
    """Self-test of the checker: leave these parameters' gradients un-reduced across data-parallel ranks,
    through DDP's own ignore list (the bug a hand-rolled DDP or a missed hook produces)."""
    if not names:
        return None

    def hook(model: torch.nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        known = dict(model.named_parameters())
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"break_grad_sync: no parameter {unknown}; e.g. {next(iter(known))}")
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)

    return hook


def parallel_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Rank side: train `steps` steps, gathering grads after each backward and params at the end."""
    import torch.distributed as dist

    from curry_train.train.loop import forward_backward, init_distributed, setup

    cfg = from_dict(spec["config"])
    device = init_distributed(cfg)
    par = setup(cfg, device, model_hook=_fault_hook(spec.get("break_grad_sync")))
    losses, grads = [], []
    for step in range(spec.get("steps", 1)):
        losses.append(float(forward_backward(par, step)))
        grads.append(gather_full(par, "grad"))
        par.optimizer.step()
        par.optimizer.zero_grad(set_to_none=True)
    params = gather_full(par, "param")
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = Path(spec["out_dir"]) / f"parallel_{spec.get('tag', 'run')}.pt"
        torch.save({"losses": losses, "grads": grads, "params": params}, path)
    return {"losses": losses}


# --------------------------------------------------------------------------- reference (one process)


def reference(cfg: Config, steps: int) -> dict[str, Any]:
    """The single-device reference: same seed, same micro-batches in dp-rank order, fp32, plain AdamW."""
    from curry_train.model.data import global_batch, micro_batches
    from curry_train.model.gpt import aux_loss, build_model, lm_loss
    from curry_train.train.optim import install

    torch.set_num_threads(1)  # match the ranks' thread count so matmuls sum in the same order
    ref_cfg = from_dict(cfg.to_dict(), {"train.dtype": "float32"}, validate=False)
    model = build_model(ref_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    install(opt, cfg, [model])  # the same lr schedule and grad clip as the ranks (train/optim.py)
    dp, n = cfg.parallel.dp, cfg.num_microbatches
    flat = from_dict(cfg.to_dict(), {"parallel.cp": 1}, validate=False)  # full sequences
    losses, grads = [], []
    for step in range(steps):
        inputs, targets = global_batch(cfg, step)
        total = 0.0
        for r in range(dp):
            for x, y, pos in micro_batches(flat, inputs, targets, r):
                loss = lm_loss(model(x, pos), y)
                extra = aux_loss(model)
                ((loss if extra is None else loss + extra) / (dp * n)).backward()
                total += loss.item() / (dp * n)
        losses.append(total)
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


# --------------------------------------------------------------------------- comparison


def _layer_order(name: str) -> tuple[int, int]:
    if name.startswith("tok_embeddings"):
        return (0, 0)
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)))
    return (2, 0 if name.startswith("norm") else 1)


def _module_of(name: str) -> str:
    m = re.match(r"(layers\.\d+)\.", name)
    return m.group(1) if m else name.split(".")[0]


def compare(cfg: Config, ref: dict[str, Any], par: dict[str, Any], steps: int) -> Verdict:
    bf16 = cfg.train.dtype == "bfloat16"
    tol = dict(BF16 if bf16 else FP32)
    failures: list[str] = []
    worst: tuple[float, ParamDiff] | None = None
    failing_names: list[str] = []

    def consider(kind: str, name: str, a: torch.Tensor, b: torch.Tensor | None, param: bool) -> None:
        nonlocal worst
        if b is None:
            failures.append(f"{kind} {name}: missing from the parallel run")
            failing_names.append(name)
            return
        if a.shape != b.shape:
            failures.append(f"{kind} {name}: shape {tuple(b.shape)} != reference {tuple(a.shape)}")
            failing_names.append(name)
            return
        d = (a - b).abs()
        if bf16:  # relative L2 error of the whole tensor: bf16 rounding is relative, per element it is noise
            rel = float((a - b).norm() / (a.norm() + 1e-12))
            ratio = rel / tol["grad_rel_l2"]
            allowed = tol["grad_rel_l2"] * float(a.norm())
            measured = float((a - b).norm())
        else:
            allowed_t = (torch.full_like(a, tol["param_atol"] + tol["param_lr_frac"] * cfg.train.lr * steps) if param
                         else tol["grad_atol"] + tol["grad_rtol"] * a.abs())
            ratio = float((d / allowed_t).max()) if d.numel() else 0.0
            allowed = float(allowed_t.max()) if d.numel() else 0.0
            measured = float(d.max()) if d.numel() else 0.0
        diff = ParamDiff(name=f"{kind} {name}", max_abs_diff=float(d.max()) if d.numel() else 0.0,
                         allowed=allowed, ref_max_abs=float(a.abs().max()) if a.numel() else 0.0)
        if worst is None or ratio > worst[0]:
            worst = (ratio, diff)
        if ratio > 1.0:
            what = "L2 |diff|" if bf16 else "max |diff|"
            failures.append(f"{kind} {name}: {what} {measured:.3e} > allowed {allowed:.3e}")
            failing_names.append(name)

    loss_diffs = [abs(a - b) for a, b in zip(ref["losses"], par["losses"])]
    loss_max = max(loss_diffs) if loss_diffs else float("inf")
    for a, d in zip(ref["losses"], loss_diffs):
        if d > tol["loss_rtol"] * max(1.0, abs(a)):
            failures.insert(0, f"loss: |diff| {d:.3e} > {tol['loss_rtol'] * max(1.0, abs(a)):.3e}")
            break
    gn_ref, gn_par = [], []
    for s in range(steps):
        rg, pg = ref["grads"][s], par["grads"][s] or {}
        gn_ref.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in rg.values()))))
        gn_par.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in pg.values()))) if pg else 0.0)
        if abs(gn_ref[-1] - gn_par[-1]) > 1e-6 + (5e-2 if bf16 else 1e-5) * gn_ref[-1]:
            failures.append(f"grad norm step {s}: {gn_par[-1]:.6g} vs reference {gn_ref[-1]:.6g}")
        for name in sorted(rg, key=_layer_order):
            if bf16 and s > 0:
                break  # after one bf16 AdamW step the weights legitimately differ: compare step 0 only
            consider(f"grad[step {s}]", name, rg[name], pg.get(name), param=False)
        for name in sorted(set(pg) - set(rg)):
            failures.append(f"grad {name}: not a reference parameter (name mapping broken)")
    for name in sorted(ref["params"], key=_layer_order):
        if bf16:
            break  # see the module docstring: AdamW's sign-like first steps make bf16 param diffs O(lr)
        consider("param", name, ref["params"][name], (par["params"] or {}).get(name), param=True)
    first = min(failing_names, key=_layer_order) if failing_names else None
    if not bf16:
        tol["param_atol_effective"] = tol["param_atol"] + tol["param_lr_frac"] * cfg.train.lr * steps
    return Verdict(
        passed=not failures, world_size=cfg.world_size, steps=steps,
        losses_ref=ref["losses"], losses_parallel=par["losses"], loss_max_diff=loss_max,
        grad_norm_ref=gn_ref, grad_norm_parallel=gn_par,
        worst_parameter=worst[1] if worst else None,
        first_diverging_layer=_module_of(first) if first else None,
        failures=failures[:20], tolerance=tol, n_params_compared=len(ref["params"]),
    )


# --------------------------------------------------------------------------- drivers


def run_whitebox(cfg: Config, *, steps: int = 1, run_dir: Path, timeout: float = 600.0, cancel=None,
                 launcher: str = "torchrun", break_grad_sync: list[str] | None = None) -> Verdict:
    """Launch the parallel run (torchrun by default), compute the reference here, compare."""
    t0 = time.perf_counter()
    spec = {"kind": "whitebox", "config": cfg.to_dict(), "steps": steps, "tag": "run",
            "break_grad_sync": break_grad_sync or []}
    if launcher == "torchrun":
        from curry_train.train.launch import run_torchrun

        run_torchrun(spec, cfg.world_size, run_dir, timeout=timeout, cancel=cancel)
    else:
        from curry_train.train.jobs import rank_job
        from curry_train.train.launch import launch_forkserver

        launch_forkserver(rank_job, cfg.world_size, {**spec, "out_dir": str(run_dir)}, timeout=timeout)
    verdict = compare_saved(cfg, run_dir / "parallel_run.pt", steps)
    verdict.wall_s = time.perf_counter() - t0
    return verdict


def compare_saved(cfg: Config, path: Path, steps: int) -> Verdict:
    par = torch.load(path, weights_only=False)
    return compare(cfg, reference(cfg, steps), par, steps)


def whitebox_batch(cfgs: list[Config], *, steps: int = 1, out_dir: Path, timeout: float = 300.0,
                   break_grad_sync: list[str] | None = None) -> list[Verdict]:
    """Tests: run every config of one world size in a single forkserver launch, then compare each."""
    from curry_train.train.jobs import rank_jobs
    from curry_train.train.launch import launch_forkserver

    worlds = {c.world_size for c in cfgs}
    if len(worlds) != 1:
        raise ValueError(f"one launch needs one world size, got {sorted(worlds)}")
    specs = [{"kind": "whitebox", "config": c.to_dict(), "steps": steps, "tag": str(i), "out_dir": str(out_dir),
              "break_grad_sync": break_grad_sync or []} for i, c in enumerate(cfgs)]
    launch_forkserver(rank_jobs, worlds.pop(), specs, timeout=timeout)
    return [compare_saved(c, out_dir / f"parallel_{i}.pt", steps) for i, c in enumerate(cfgs)]
