"""The resume white-box: save after step k in layout A, resume in layout B, and prove the resumed run is the same run.

    curry-train whitebox --config tiny --set parallel.tp=2 --resume-from-layout dp=2,zero=3      # k=2, 2 more
    curry-train whitebox --config tiny --set parallel.tp=2 --resume-from-layout dp=2,zero=3 \
        --inject resume-drops-moments                                                             # must fail

Both phases run the white-box's rank job (whitebox.parallel_job: the real train_step, everything gathered), and
the checkpoint is the product's own (train/checkpoint.py: DCP save in A, `load` in B, resharded):
  A   steps 0..k-1 from the seed in layout A, then `checkpoint.save` at step k; its live AdamW state is gathered to
      full after the save. Compared as any white-box (validation/compare.py) with the k-step reference.
  C   the checkpoint itself, read to full tensors in this process by DCP's own reader (format_utils
      dcp_to_torch_save), independent of the ranks' state-dict mapping.
  B   `checkpoint.load` of C in layout B (the planted bug, if any, in B only), the loaded parameters and AdamW state
      gathered to full before any step, then steps k..k+n-1, each gathered as in any white-box.
Checks, beyond the white-box's own on A's and B's steps (every bound of compare.py, re-synchronised every step):
  saved       C's weights and every AdamW tensor (exp_avg, exp_avg_sq, step) == A's after step k, bitwise;
  loaded      B's loaded weights and every AdamW tensor == C's, bitwise, and none missing or extra. DCP copies fp32
              values whatever the reshard (a load is a copy into the new shards' storage), so bitwise holds for
              every pair of layouts and dtypes (the optimizer state is fp32 in every layout);
  position    every step counter == k (the checkpoint's step), B starts at step k, and the lr of each resumed
              step is train/optim.py lr_at of its step index, exactly (the same function of the same step);
  resumed     B's steps against the single-device reference that loads C (whitebox.reference `init`): C's
              weights are A's weights after step k, bitwise (saved, above), which is what the re-synchronised
              reference would restart step k from anyway; its AdamW state is C's, so B's update is held to the
              update the reference makes from the same state, with the step-0 bounds (updates relative 1e-3).
              An uninterrupted reference (its own AdamW state over k + n steps) was the alternative: it also sees a
              save that loses state, but needs A's whole trajectory, which climb's rungs (several layouts, bench
              runs) do not record; here the save is proven by `saved` instead, in every A-phase run.
Why bitwise and not the loss: only the first resumed update depends on the loaded state, and one tensor's moments
lost on resume changes the next loss by ~1e-6 relative (the planted `resume-drops-moments`, under the loss-only
resume test's 1e-5; tests/test_resume_whitebox.py measures it), while its update differs by O(1).

`climb`: a rung that resumed the previous rung's checkpoint is white-boxed from that checkpoint (phase B only,
`checkpoint`), k = its step: loaded state bitwise against C, the position, the resumed steps against the reference
that loads C. docs/CPU-DISTRIBUTED.md ("White-box checks") lists the bounds and the measured figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from curry_train.config import Config, from_dict
from curry_train.validation.compare import _exact, compare
from curry_train.validation.horizon import horizon_note
from curry_train.validation.inject import WhiteboxInputError
from curry_train.validation.verdict import Verdict
from curry_train.validation.whitebox import WHITEBOX_JOB, check_steps, single_device_reference

SAME_SECTIONS = ("model", "train", "data")  # what layout A must share with B: the same model and run, another layout


def layout_from(cfg: Config, spec: str | Config) -> Config:
    """Layout A for `--resume-from-layout`: a Config (another config file of the same model and run), or
    comma-separated KEY=VALUE on `cfg` with its parallel section reset to the defaults ("dp=2,zero=3": a key
    without a dot is parallel.KEY; "single": one device). Refused with the field and the fix (nothing runs)."""
    if isinstance(spec, Config):
        a = spec
    else:
        from curry_train.config import ConfigError, parse_sets

        items = [x.strip() for x in str(spec).split(",") if x.strip()]
        if items == ["single"]:
            items = []
        bad = [x for x in items if "=" not in x]
        if bad:
            raise WhiteboxInputError(f"--resume-from-layout {spec!r}: {bad[0]!r} is not KEY=VALUE; give the layout "
                                     "that saves, e.g. dp=2,zero=3 (parallel.KEY), or 'single' for one device")
        sets = parse_sets([x if "." in x.split("=", 1)[0] else f"parallel.{x}" for x in items])
        try:
            a = from_dict({**cfg.to_dict(), "parallel": {}}, sets)
        except ConfigError as e:
            raise WhiteboxInputError(f"--resume-from-layout {spec!r}: {e}") from e
    diff = [s for s in SAME_SECTIONS if getattr(a, s).model_dump() != getattr(cfg, s).model_dump()]
    if diff:
        raise WhiteboxInputError(f"--resume-from-layout: the saving config differs in {', '.join(diff)}; a resume "
                                 "white-box changes the layout only: give the same model, train and data sections")
    _same_bounds(a, cfg)
    return a


def _same_bounds(a: Config, b: Config) -> None:
    """bf16: every layout makes the same casts (FSDP2's policy, wrapping.precision_path), so any pair's references
    match their runs; but tp, cp and ep round other partial sums and are held to relative bounds, the others to
    the fp32 ones (compare.bf16_cast_exact), and the merged verdict states one set of bounds: both must share it."""
    from curry_train.validation.compare import bf16_cast_exact

    if b.train.dtype == "bfloat16" and bf16_cast_exact(a) != bf16_cast_exact(b):
        bounds = {True: "the fp32 bounds (dp, ZeRO/FSDP, pp, recompute)", False: "relative bf16 bounds (tp, cp, ep)"}
        raise WhiteboxInputError("--resume-from-layout: in bfloat16 both layouts must be held to the same bounds "
                                 f"(A: {bounds[bf16_cast_exact(a)]}, B: {bounds[bf16_cast_exact(b)]}); pair layouts "
                                 "of one kind, or use train.dtype=float32, where every layout pair works")


def _spec(cfg: Config, steps: int, tag: str, out_dir: Path, **kw: Any) -> dict[str, Any]:
    return {"kind": "whitebox", "job": WHITEBOX_JOB, "config": cfg.to_dict(), "steps": steps, "tag": tag,
            "out_dir": str(out_dir), **kw}


def b_spec(cfg: Config, steps: int, tag: str, out_dir: Path, checkpoint: Path, inject: str | None = None,
           target: str | None = None) -> dict[str, Any]:
    """Phase B's rank spec: resume `checkpoint` in `cfg`'s layout, `steps` more steps (the bug planted here)."""
    if inject:
        from curry_train.validation.inject import check

        check(inject, cfg, resume=True)
    return _spec(cfg, steps, tag, out_dir, resume=str(checkpoint), inject=inject, inject_target=target)


def read_checkpoint(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint at full shape, read by DCP's own converter (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"checkpoint_{folder.name}_full.pt"
    dcp_to_torch_save(folder, out)
    try:
        return torch.load(out, weights_only=True)
    finally:
        out.unlink(missing_ok=True)


def _bitwise(kind: str, want: dict[str, torch.Tensor], got: dict[str, torch.Tensor] | None,
             failures: list[str]) -> float:
    """Every tensor of `want` equal to `got`'s bit for bit, none missing or extra; returns the worst ratio
    (compare._exact: 0 when equal, > 1 for any difference, growing with it relative to the tensor's scale)."""
    got, worst = got or {}, 0.0
    for k in sorted(set(want) | set(got)):
        a, b = want.get(k), got.get(k)
        if a is None or b is None or a.shape != b.shape:
            failures.append(f"resume {kind}: {k} " + ("missing" if b is None else "not in the checkpoint" if a is None
                            else f"shape {tuple(b.shape)} != {tuple(a.shape)}"))
            worst = max(worst, 1e30)
            continue
        if not torch.equal(_bits(a), _bits(b)):
            d = float((a.double() - b.double()).abs().max())
            r = _exact(d, max(float(a.abs().max()), 1e-30))
            failures.append(f"resume {kind}: {k} differs (max |diff| {d:.3e}, |ref| max {float(a.abs().max()):.3e})")
            worst = max(worst, r if d else 1.0 + 1e-9)  # a NaN pattern or -0.0 differs in bits only
    return worst


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor (torch.equal compares values: -0.0 == 0.0, NaN != NaN)."""
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def _split(full: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's tensors as (weights by parameter name, AdamW state as "<name>.<key>")."""
    model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    optim = {k[len("optim."):]: v for k, v in full.items() if k.startswith("optim.")}
    return model, optim


def resume_verdict(cfg: Config, par_b: dict[str, Any], ckpt: dict[str, torch.Tensor], step: int, steps: int,
                   par_a: dict[str, Any] | None = None, cfg_a: Config | None = None) -> Verdict:
    """The resume white-box's verdict (module docstring): A's steps (when given) and B's against the reference,
    C against A and B against C bitwise, the step counters and the lr position."""
    from curry_train.train.optim import lr_at
    from curry_train.validation.whitebox import reference
    from curry_train.wrapping import precision_path

    failures: list[str] = []
    use: dict[str, float] = {}
    weights, state = _split(ckpt)
    if par_a is not None:
        use["resume_saved_bitwise"] = max(_bitwise("saved", weights, (par_a.get("params") or [{}])[-1], failures),
                                          _bitwise("saved", state, par_a.get("saved"), failures))
    use["resume_loaded_bitwise"] = max(_bitwise("loaded", weights, par_b.get("loaded_params"), failures),
                                       _bitwise("loaded", state, par_b.get("loaded"), failures))
    counters = {k: float(v) for k, v in (par_b.get("loaded") or {}).items() if k.endswith(".step")}
    wrong = {k: v for k, v in counters.items() if v != step}
    lrs, want = list(par_b.get("lrs") or []), [lr_at(cfg, s) for s in range(step, step + steps)]
    if wrong:
        failures.append(f"resume position: {len(wrong)} AdamW step counter(s) loaded != the checkpoint's step {step}"
                        f", e.g. {next(iter(wrong))} = {next(iter(wrong.values())):g}")
    if par_b.get("start") != step or lrs != want:
        failures.append(f"resume position: resumed at step {par_b.get('start')} with lr {lrs}, expected step {step} "
                        f"with lr {want} (train/optim.py lr_at)")
    use["resume_position"] = 0.0 if not wrong and par_b.get("start") == step and lrs == want else 2.0
    single = from_dict({**cfg.to_dict(), "parallel": {}}, validate=False)
    ref = reference(single, steps, list(par_b.get("params") or []), precision_path(cfg.train.dtype), start=step,
                    init=ckpt, routes=par_b.get("routes"))  # bf16 MoE near ties replayed (validation/routing.py)
    vb = compare(cfg, ref, par_b, steps, first=step)
    va = None
    if par_a is not None and cfg_a is not None:
        va = compare(cfg_a, single_device_reference(cfg_a, step, weights=list(par_a.get("params") or []),
                                                    routes=par_a.get("routes")), par_a, step)
    return _merge(va, vb, failures, use, step, cfg)


def _merge(va: Verdict | None, vb: Verdict, failures: list[str], use: dict[str, float], step: int,
           v_cfg: Config) -> Verdict:
    """One verdict over A's steps (prefixed "layout A:"), the resume checks, and B's steps."""
    v = vb.model_copy(deep=True)
    first = [f"layout A (before the save): {f}" for f in (va.failures if va else [])]
    v.failures = (first + failures + vb.failures)[:20]
    v.passed = vb.passed and not failures and (va is None or va.passed)
    for k, x in use.items():
        v.bound_use[k] = round(x, 6)
    if va is not None:
        v.losses_ref, v.losses_parallel = va.losses_ref + vb.losses_ref, va.losses_parallel + vb.losses_parallel
        v.grad_norm_ref, v.grad_norm_parallel = va.grad_norm_ref + vb.grad_norm_ref, \
            va.grad_norm_parallel + vb.grad_norm_parallel
        v.loss_max_diff = max(va.loss_max_diff, vb.loss_max_diff)
        v.routing = None if va.routing is None and vb.routing is None else (va.routing or []) + (vb.routing or [])
        v.bound_use = {k: max(va.bound_use.get(k, 0.0), v.bound_use.get(k, 0.0)) for k in {*va.bound_use,
                                                                                             *v.bound_use}}
        v.bound_use = dict(sorted(v.bound_use.items()))
        if not va.passed:  # the earliest failing step is A's: localise there
            v.worst_parameter, v.first_diverging_layer, v.diverging_rank = \
                va.worst_parameter, va.first_diverging_layer, va.diverging_rank
    v.steps = len(v.losses_parallel) if va is not None else vb.steps
    v.horizon = f"{horizon_note(v_cfg, step + vb.steps)}; steps {step}..{step + vb.steps - 1} resumed"
    v.resume = {"step": step, "saved_by": "layout A" if va is not None else "the checkpoint",
                "world_size_saved": va.world_size if va is not None else None, "checks": sorted(use)}
    return v


def run_resume_whitebox(cfg: Config, *, run_dir: Path, layout: Config | None = None, checkpoint: Path | None = None,
                        resume_at: int = 2, steps: int = 2, timeout: float = 900.0, cancel=None,
                        launcher: str = "torchrun", inject: str | None = None,
                        inject_target: str | None = None) -> Verdict:
    """Save in `layout` after `resume_at` steps and resume in `cfg`'s layout for `steps` more (phase A + B), or
    resume `checkpoint` (phase B only: climb). Launches with torchrun (the tools) or the forkserver (tests)."""
    import time

    from curry_train.train.checkpoint import find_checkpoint

    t0 = time.perf_counter()
    check_steps(steps, timeout)
    if not isinstance(resume_at, int) or resume_at < 1:
        raise WhiteboxInputError(f"--resume-at {resume_at}: layout A trains at least 1 step before it saves "
                                 "(default 2: the AdamW state then holds two steps' moments)")
    if (layout is None) == (checkpoint is None):
        raise WhiteboxInputError("a resume white-box needs exactly one of a saving layout or a checkpoint")
    par_a, cfg_a = None, layout
    if layout is not None:
        _launch(launcher, _spec(layout, resume_at, "a", run_dir / "save", save=str(run_dir / "checkpoints")),
                layout.world_size, run_dir / "save", timeout, cancel)
        par_a = torch.load(run_dir / "save" / "parallel_a.pt", weights_only=False)
        checkpoint = run_dir / "checkpoints"
    folder, meta = find_checkpoint(checkpoint, cfg)
    step = int(meta["step"])
    _launch(launcher, b_spec(cfg, steps, "b", run_dir / "resume", folder, inject, inject_target), cfg.world_size,
            run_dir / "resume", timeout, cancel)
    par_b = torch.load(run_dir / "resume" / "parallel_b.pt", weights_only=False)
    v = resume_verdict(cfg, par_b, read_checkpoint(folder, run_dir), step, steps, par_a, cfg_a)
    v.injection, v.wall_s = inject, time.perf_counter() - t0
    v.resume["checkpoint"] = str(folder)
    return v


def _launch(launcher: str, spec: dict[str, Any], world: int, out: Path, timeout: float, cancel) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if launcher == "torchrun":
        from curry_train.train.launch import run_torchrun

        run_torchrun(spec, world, out, timeout=timeout, cancel=cancel)
    else:
        from curry_train.train.jobs import rank_job
        from curry_train.train.launch import launch_forkserver

        launch_forkserver(rank_job, world, spec, timeout=timeout)


def resume_batch(pairs: list[tuple[Config, Config]], *, out_dir: Path, resume_at: int = 2, steps: int = 2,
                 inject: list[str | None] | None = None, timeout: float = 600.0) -> list[Verdict]:
    """Tests: (layout A, layout B) pairs in one forkserver launch per phase and world size; pairs with the same
    layout A share its run and checkpoint (a planted resume bug lives in B only)."""
    from curry_train.train.jobs import rank_jobs
    from curry_train.train.launch import launch_forkserver

    names = inject or [None] * len(pairs)
    saves: dict[str, int] = {}  # layout A's JSON -> its index
    for a, b in pairs:
        saves.setdefault(json.dumps(a.to_dict(), sort_keys=True, default=str), len(saves))
    a_of = [saves[json.dumps(a.to_dict(), sort_keys=True, default=str)] for a, _ in pairs]
    firsts = {i: a for (a, _), i in zip(pairs, a_of)}
    for world in sorted({a.world_size for a in firsts.values()}):
        specs = [_spec(a, resume_at, f"a{i}", out_dir, save=str(out_dir / f"ck{i}")) for i, a in firsts.items()
                 if a.world_size == world]
        launch_forkserver(rank_jobs, world, specs, timeout=timeout)
    for world in sorted({b.world_size for _, b in pairs}):
        specs = [b_spec(b, steps, f"b{j}", out_dir, out_dir / f"ck{a_of[j]}" / f"step-{resume_at:06d}", names[j])
                 for j, (_, b) in enumerate(pairs) if b.world_size == world]
        launch_forkserver(rank_jobs, world, specs, timeout=timeout)
    verdicts = []
    for j, (a, b) in enumerate(pairs):
        folder = out_dir / f"ck{a_of[j]}" / f"step-{resume_at:06d}"
        v = resume_verdict(b, torch.load(out_dir / f"parallel_b{j}.pt", weights_only=False),
                           read_checkpoint(folder, out_dir), resume_at, steps,
                           torch.load(out_dir / f"parallel_a{a_of[j]}.pt", weights_only=False), a)
        v.injection = names[j]
        verdicts.append(v)
    return verdicts
