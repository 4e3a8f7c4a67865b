"""White-box comparison: the parallel run must compute the same loss, gradients and updates as one device.

    curry-train whitebox --config configs/tiny.yaml --set parallel.dp=2 --json   # steps: validation/horizon.py
    curry-train whitebox --config configs/tiny.yaml --set parallel.dp=2 --inject data-same-rows   # must fail

Reference (one process, independent of the parallel code): the full model from the same seed, plain AdamW, and
the step's global batch taken from the data source as one device would: all its sequences in order, accumulated
over micro-batches of the same number of sequences (train.micro_batch), full-length, never through the ranks'
slicing function (model/data.micro_batches). A data-partition bug is therefore not reproduced on both sides. Its
update is the ranks' own optimizer step (train/optim.py optimizer_step: clip, lr schedule, AdamW step); bf16
layouts get a reference making the same casts (`reference`, `cast`).
Parallel: N ranks through the launcher, each running the training step that `train`, `bench` and `climb` run
(train.loop.train_step: micro-batches, clip, lr schedule, update, zero-grad); forward hooks record each layer's
output sums (validation/activations.py) and its `after_backward` hook only reads: every parameter's gradient
gathered to full shape (DTensor.full_tensor for FSDP/TP, stage dicts for PP, expert shards for EP) under its
reference name; after each update every rank's parameters (validation/compare.py: checksummed across replicas,
divergent copies compared too), and every rank's own loss, clip norm and zero-grad leftovers. `--inject NAME`
plants one known bug (validation/inject.py) in the ranks only.
From step 1 on the reference is re-synchronised to the parallel run's gathered weights before each step, so a
step's error never loosens a later step's bound. Tolerances and their measured noise: validation/compare.py.

Wall time: benchmarks/whitebox_time.py and docs/CPU-DISTRIBUTED.md ("White-box checks"); through the CLI it is
dominated by four cold torch imports (CLI, torchrun, 2 ranks), not by the compute.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from curry_train.config import Config, from_dict
from curry_train.validation.activations import ActivationProbe, probed_names
from curry_train.validation.compare import compare, grads_left
from curry_train.validation.dtypes import fsdp_unit_dtypes
from curry_train.validation.gather import _local_full, _merge_on_rank0, checksum, gather_full, replica_copies
from curry_train.validation.horizon import default_steps, horizon_note
from curry_train.validation.verdict import Verdict

__all__ = ["checksum", "gather_full"]  # imported from here too (validation/gather.py holds them)


@contextlib.contextmanager
def deterministic(device_type: str) -> Iterator[None]:
    """CUDA: full fp32 matmuls (TF32 off: 10 mantissa bits would exceed the gradient bound) and deterministic
    kernels where torch has them (warn_only: a kernel without a deterministic variant warns instead of failing;
    CUBLAS_WORKSPACE_CONFIG per the CUDA reproducibility notes). CPU: nothing to change."""
    if device_type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.backends.cudnn.deterministic = saved[2]
        torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])


# --------------------------------------------------------------------------- parallel side (inside the ranks)
# (what it reads out of the ranks: validation/gather.py)
WHITEBOX_JOB = f"{__name__}:parallel_job"  # the rank-side job of a white-box spec (train/jobs.py resolves it)


def parallel_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Rank side: `steps` steps of the real training step (train.loop.train_step: zero-grad, micro-batches, clip,
    lr schedule, update), with the planted bug if any; its `after_backward` hook gathers the gradients before the
    update, and every rank's parameters are gathered after it. `resume` (a checkpoint): loaded first with the
    product's own load (train/checkpoint.py), the steps continue from its step, and the loaded parameters and
    AdamW state are gathered to full before any step; `save` (a folder): the state after the steps is saved there
    (train/checkpoint.py save) and gathered too (validation/resume.py compares all of them)."""
    import torch.distributed as dist

    from curry_train.mesh import device_type
    from curry_train.model.gpt import build_meta_model
    from curry_train.parallel.parallelize import canonical_name
    from curry_train.train import checkpoint
    from curry_train.train.loop import init_distributed, setup, train_step
    from curry_train.validation.gather import optimizer_state_full
    from curry_train.validation.plant import planted
    from curry_train.validation.routing import RouteRecorder, flip_aware

    cfg = from_dict(spec["config"])
    with deterministic(device_type(cfg)), planted(spec.get("inject"), cfg, spec.get("inject_target"),
                                                      bool(spec.get("resume"))) as bug:
        device = init_distributed(cfg)
        par = setup(cfg, device, model_hook=bug.model_hook)
        bug.after_setup(par)
        start, state = 0, {}
        if spec.get("resume"):
            start = checkpoint.load(par, spec["resume"])
            state.update(start=start, loaded_params=gather_full(par, "param"), loaded=optimizer_state_full(par))
        probe = ActivationProbe(par.parts, cfg.model.d_model, canonical_name)
        recorder = RouteRecorder(par, canonical_name, lambda: probe.paused) if flip_aware(cfg, par.compiled) else None
        names, tokens = probed_names(build_meta_model(cfg)), cfg.train.global_batch * cfg.train.seq_len
        losses, grads, params, replicas, holders, grad_replicas, acts, scalars, lrs, routes = ([] for _ in range(10))

        def read_grads(loss: torch.Tensor) -> None:  # reads only: the step goes on with the same gradients
            acts.append(probe.take(names, tokens))  # this step's forward, summed over every rank's tokens
            routes.append(recorder.take() if recorder else None)  # each token's experts (validation/routing.py)
            local = _local_full(par, "grad")  # every rank's reduced gradients, checksummed across replicas too
            grads.append(_merge_on_rank0(par, local))
            grad_replicas.append(replica_copies(local)[0])

        skip = probe.skipping_pipeline_inference() if par.topo.pp > 1 else contextlib.nullcontext()
        for step in range(start, start + spec.get("steps", 2)):
            with skip if step == start else contextlib.nullcontext():
                r = train_step(par, step, after_backward=read_grads, read=True)  # every step's loss and norm
            losses.append(r.loss)
            lrs.append(float(par.optimizer.param_groups[0]["lr"]))  # the schedule position the update used
            scalars.append((r.loss, r.grad_norm, grads_left(par.parts)))  # its own loss, clip norm, leftovers
            local = _local_full(par, "param")  # after every update: the first wrong step is the one named
            params.append(_merge_on_rank0(par, local))
            copies, held = replica_copies(local)
            replicas.append(copies)
            holders.append(held)
        probe.close()
        if recorder:
            recorder.close()
        if spec.get("save"):
            checkpoint.save(par, spec["save"], start + spec.get("steps", 2))
            state["saved"] = optimizer_state_full(par)
        dtypes = fsdp_unit_dtypes(par.parts, canonical_name)
        rank_scalars: list[Any] = [scalars]
        if dist.is_initialized() and dist.get_world_size() > 1:
            rank_scalars = [None] * dist.get_world_size()
            dist.all_gather_object(rank_scalars, scalars)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = Path(spec["out_dir"]) / f"parallel_{spec.get('tag', 'run')}.pt"
        torch.save({"losses": losses, "grads": grads, "params": params, "replicas": replicas, "lrs": lrs,
                    "holders": holders, "grad_replicas": grad_replicas, "acts": acts, "routes": routes, **state,
                    "rank_scalars": rank_scalars, "fsdp_dtypes": dtypes, "compiled": par.compiled}, path)
    return {"losses": losses}


# --------------------------------------------------------------------------- reference (one process)


def reference(cfg: Config, steps: int, weights: list[dict[str, torch.Tensor] | None] | None = None,
              cast: str = "fp32", start: int = 0, init: dict[str, torch.Tensor] | None = None,
              routes: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The single-device reference: same seed, the step's global batch in order in micro-batches of
    train.micro_batch sequences (full length), fp32, plain AdamW, updated by the ranks' own optimizer step
    (train/optim.py optimizer_step: the same clip and lr schedule). On CUDA: one GPU, TF32 off, deterministic.

    `weights` (the parallel run's gathered parameters after each step): before step s >= 1 the model is reset to
    weights[s - 1] (re-synchronised), so step s's gradients and update are taken at the parallel run's own weights
    and every step is held to the step-0 bounds (validation/compare.py, "re-sync"). The optimizer state stays the
    reference's own, built from its gradients at those weights. `starts[s]`: the weights step s started from.

    `cast` (wrapping.precision_path of the run's dtype): the bf16 casts the ranks make, made here on fp32 master
    weights too: "mp" computes with bfloat16 copies of every parameter, inputs not cast (the RoPE tables fp32),
    whose backward gradients are cast back to fp32 and added to the fp32 .grad each micro-step: FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), which every bf16 layout runs (wrapping.py), and
    whose fp32 accumulation is the same whether it reduces every micro-step (ZeRO-2/3) or holds the unsharded
    fp32 sum until the last (ZeRO-0/1, PP: to_accumulated_grad_if_needed upcasts, then adds). The optimizer
    stays fp32.

    `start`, `init` (validation/resume.py): the steps are start .. start + steps - 1 (their data and lr), from a
    checkpoint read to full tensors ({"model.<name>", "optim.<name>.exp_avg|exp_avg_sq|step"}): its weights and
    AdamW state are loaded into the reference before the first of them.

    `routes` (the parallel run's recorded top-k per step, bf16 MoE layouts held to relative bounds): each step's
    routers are judged and replay the near ties the parallel run flipped (validation/routing.py); `routing`
    returns what each step's judge saw."""
    from curry_train.mesh import device_type
    from curry_train.model.data import global_batch
    from curry_train.model.gpt import build_model
    from curry_train.train.optim import adamw_kwargs, optimizer_step
    from curry_train.validation.routing import RouteReplay

    dev = device_type(cfg)
    device = torch.device("cuda", 0) if dev == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)  # match the ranks' thread count so matmuls sum in the same order
    ref_cfg = from_dict(cfg.to_dict(), {"train.dtype": "float32"}, validate=False)
    mb = cfg.train.micro_batch
    positions = torch.arange(cfg.train.seq_len, device=device)
    with deterministic(dev):
        model = build_model(ref_cfg).to(device)
        probe, names = ActivationProbe([model], cfg.model.d_model), probed_names(model)
        before = {k: p.detach().cpu().clone() for k, p in model.named_parameters()}
        weights_ref = list(model.parameters())
        opt = torch.optim.AdamW(weights_ref, **adamw_kwargs(weights_ref, cfg))  # the ranks' optimizer arguments
        if init is not None:
            before = _init_from(model, opt, init)
        losses, grads, params, starts, acts, routing = [], [], [], [], [], []
        for i, step in enumerate(range(start, start + steps)):
            if weights is not None and i > 0:
                _load(model, weights[i - 1] or {})
            starts.append(before if i == 0 else {n: p.detach().cpu().clone() for n, p in model.named_parameters()})
            opt.zero_grad(set_to_none=True)
            inputs, targets = global_batch(cfg, step)  # [global_batch, T]: every sequence of the step
            k = inputs.shape[0] // mb  # micro-batches of mb sequences, in order
            total, rec = 0.0, (routes or [])[i] if i < len(routes or []) else None
            judge = RouteReplay(rec, mb) if rec is not None else None
            for j in range(k):
                x, y = inputs[j * mb:(j + 1) * mb].to(device), targets[j * mb:(j + 1) * mb].to(device)
                total += _micro_step(model, x, positions, y, cast, k, (lambda m, j=j: judge.install(m, j))
                                     if judge else None) / k
            losses.append(total)
            routing.append(judge.stats if judge else None)
            acts.append(probe.take(names, inputs.numel()))
            grads.append({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()})
            optimizer_step(opt, [model], ref_cfg, step)
            params.append({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
    probe.close()
    return {"losses": losses, "grads": grads, "params": params, "params_before": before, "starts": starts,
            "acts": acts, "routing": routing}


def _micro_step(model: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor, y: torch.Tensor, cast: str,
                k: int, install=None) -> float:
    """One micro-batch (x, y: [mb, T]) of k: forward under the layout's casts (reference docstring), backward of
    (loss + aux) / k, its gradients added to `model`'s fp32 .grad. Returns the micro-batch's mean loss.
    `install(module)`: sets the routers' replay on the module that runs (validation/routing.RouteReplay)."""
    from curry_train.model.gpt import aux_loss, lm_loss

    run = model
    if cast == "mp":  # FSDP2's units: bf16 parameters, inputs not cast (fsdp.py): the RoPE tables stay fp32
        run = copy.deepcopy(model).to(torch.bfloat16)  # the forward hooks (activation probe) come along
        run.rope_cos, run.rope_sin = model.rope_cos, model.rope_sin
    if install is not None:
        install(run)
    if cast == "fp32":
        loss = lm_loss(model(x, positions), y)
    else:  # the model's own (chunked) loss, as the ranks run it: its bf16 head per chunk is part of the casts
        loss = run(x, positions, targets=y)
    extra = aux_loss(run)
    ((loss if extra is None else loss + extra) / k).backward()
    if run is not model:  # reduce_dtype fp32: each micro-step's bf16 gradient cast up, then accumulated
        for p, q in zip(model.parameters(), run.parameters()):
            if q.grad is not None:
                p.grad = q.grad.float() if p.grad is None else p.grad + q.grad.float()
    return loss.item()


@torch.no_grad()
def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy the parallel run's weights into the reference model; a name it lacks or a wrong shape keeps the
    reference's own (compare fails that tensor as missing)."""
    for n, p in model.named_parameters():
        w = weights.get(n)
        if w is not None and w.shape == p.shape:
            p.copy_(w.to(p.device, p.dtype))


def _init_from(model: torch.nn.Module, opt: torch.optim.Optimizer, init: dict[str, torch.Tensor]) -> dict:
    """Load a full checkpoint's weights and AdamW state (reference `init`) into the reference; returns the weights.
    Through AdamW's own load_state_dict, which places each tensor as that optimizer keeps it (step on the CPU
    unless fused)."""
    _load(model, {k[len("model."):]: v for k, v in init.items() if k.startswith("model.")})
    named = list(model.named_parameters())
    state = {i: {k: init[f"optim.{n}.{k}"] for k in ("step", "exp_avg", "exp_avg_sq") if f"optim.{n}.{k}" in init}
             for i, (n, _) in enumerate(named)}
    opt.load_state_dict({"state": {i: st for i, st in state.items() if st},
                         "param_groups": opt.state_dict()["param_groups"]})
    return {n: p.detach().cpu().clone() for n, p in named}


# --------------------------------------------------------------------------- drivers


def check_steps(steps: int, timeout: float | None = None) -> None:
    """Refuse a white-box that would compare nothing or could never start (exit 2, nothing run)."""
    from curry_train.validation.inject import WhiteboxInputError

    if not isinstance(steps, int) or steps < 1:
        raise WhiteboxInputError(f"steps={steps}: a white-box compares at least 1 optimizer step (default 2, or "
                                 "through the end of the lr warm-up; 2 or more also exercise the optimizer state)")
    if timeout is not None and not timeout > 0:
        raise WhiteboxInputError(f"timeout={timeout}: give a positive number of seconds (default 900)")


def _spec(cfg: Config, steps: int, tag: str, inject: str | None, target: str | None) -> dict[str, Any]:
    if inject:
        from curry_train.validation.inject import check

        check(inject, cfg)  # unknown name or wrong layout: refused before anything starts
    return {"kind": "whitebox", "job": WHITEBOX_JOB, "config": cfg.to_dict(), "steps": steps, "tag": tag,
            "inject": inject, "inject_target": target}


def run_whitebox(cfg: Config, *, steps: int | None = None, run_dir: Path, timeout: float = 600.0, cancel=None,
                 launcher: str = "torchrun", inject: str | None = None, inject_target: str | None = None) -> Verdict:
    """Launch the parallel run (torchrun by default), compute the reference here, compare. `steps` None:
    default_steps(cfg)."""
    steps = default_steps(cfg) if steps is None else steps
    check_steps(steps, timeout)
    spec = _spec(cfg, steps, "run", inject, inject_target)
    t0 = time.perf_counter()
    if launcher == "torchrun":
        from curry_train.train.launch import run_torchrun

        run_torchrun(spec, cfg.world_size, run_dir, timeout=timeout, cancel=cancel)
    else:
        from curry_train.train.jobs import rank_job
        from curry_train.train.launch import launch_forkserver

        launch_forkserver(rank_job, cfg.world_size, {**spec, "out_dir": str(run_dir)}, timeout=timeout)
    verdict = compare_saved(cfg, run_dir / "parallel_run.pt", steps)
    verdict.injection = inject
    verdict.wall_s = time.perf_counter() - t0
    return verdict


_REFERENCES: dict[str, dict[str, Any]] = {}  # insertion-ordered: the oldest is dropped first
_MAX_REFERENCES = 16  # a tiny model's reference is a few MB; a test batch shares at most a handful


def single_device_reference(cfg: Config, steps: int, weights: list[dict[str, torch.Tensor] | None] | None = None,
                            routes: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """`reference` of the config with its parallel section reset to one device; memoised per process when it is
    not re-synchronised (`weights` None: the uninterrupted run) and replays no recorded routing (`routes`).

    The reference runs on one device, so it depends on the model, train, data and hardware sections only; it is
    run on the config with `parallel` at its defaults, so that a layout cannot leak into it and the uninterrupted
    reference of two layouts of one model is one object; its casts follow the dtype alone (wrapping.precision_path:
    every bf16 layout runs FSDP2's policy). A re-synchronised one depends on the parallel run's weights and is
    computed per run."""
    from curry_train.wrapping import precision_path

    cast = precision_path(cfg.train.dtype)  # the ranks' bf16 casts, none in fp32
    single = from_dict({**cfg.to_dict(), "parallel": {}}, validate=False)
    if weights is not None or any(r is not None for r in routes or []):  # per run: its weights or its routing
        return reference(single, steps, weights, cast, routes=routes)
    key = json.dumps([single.to_dict(), steps, cast], sort_keys=True, default=str)
    if key not in _REFERENCES:
        while len(_REFERENCES) >= _MAX_REFERENCES:
            _REFERENCES.pop(next(iter(_REFERENCES)))
        _REFERENCES[key] = reference(single, steps, cast=cast)
    return _REFERENCES[key]


def compare_saved(cfg: Config, path: Path, steps: int) -> Verdict:
    par = torch.load(path, weights_only=False)
    ref = single_device_reference(cfg, steps, weights=list(par.get("params") or []), routes=par.get("routes"))
    verdict = compare(cfg, ref, par, steps)
    verdict.horizon = horizon_note(cfg, steps)
    verdict.compiled = bool(par.get("compiled", False))  # what the ranks ran (train.compile resolved there)
    return verdict


def whitebox_batch(cfgs: list[Config], *, steps: int | None = None, out_dir: Path, timeout: float = 300.0,
                   inject: str | list[str | None] | None = None, inject_target: str | None = None) -> list[Verdict]:
    """Tests: run every config of one world size in a single forkserver launch, then compare each. `inject`: one
    name for all configs, or one per config (None = clean). `steps` None: each config's own default_steps, the
    horizon `curry-train whitebox` would compare for it alone (each spec carries its steps)."""
    from curry_train.train.jobs import rank_jobs
    from curry_train.train.launch import launch_forkserver

    per = [default_steps(c) if steps is None else steps for c in cfgs]
    for s in sorted(set(per)):
        check_steps(s, timeout)
    worlds = {c.world_size for c in cfgs}
    if len(worlds) != 1:
        raise ValueError(f"one launch needs one world size, got {sorted(worlds)}")
    names = inject if isinstance(inject, list) else [inject] * len(cfgs)
    specs = [{**_spec(c, s, str(i), n, inject_target), "out_dir": str(out_dir)}
             for i, (c, s, n) in enumerate(zip(cfgs, per, names, strict=True))]
    launch_forkserver(rank_jobs, worlds.pop(), specs, timeout=timeout)
    verdicts = [compare_saved(c, out_dir / f"parallel_{i}.pt", s) for i, (c, s) in enumerate(zip(cfgs, per))]
    for v, n in zip(verdicts, names):
        v.injection = n
    return verdicts
