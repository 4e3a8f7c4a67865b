"""The operations the CLI and the MCP tools share: resolve a config, launch through torchrun, record the run.

Every function takes a config *name* (or, from the CLI, a YAML path) plus dotted overrides, validates before any
process starts (ConfigError -> nothing launched, nothing recorded), and records the run in the ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from curry_train.config import Config, load_config
from curry_train.measure.preflight import preflight
from curry_train.paths import resolve_config_arg
from curry_train.store.runs import Ledger, RunRecord


def resolve(config: str, overrides: dict[str, Any] | None = None, root: str | Path | None = None) -> tuple[Config, str]:
    """(validated config, config name) for a name in configs/ or a YAML path; raises ConfigError / FileNotFoundError."""
    path = resolve_config_arg(config, root)
    if not path.is_file():
        from curry_train.paths import config_names

        names = config_names(root)
        raise FileNotFoundError(f"no config {config!r}; available: {', '.join(names) or '(none)'}")
    cfg = load_config(path, overrides)
    if cfg.data.path:  # ranks may start elsewhere: pass an absolute path; a bad file fails here, before a launch
        from curry_train.model.data import token_file

        cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
        token_file(cfg)
    return cfg, path.stem


def _checkpoint_args(cfg: Config, checkpoint_dir: str | None, save_every: int, resume: str | None,
                     keep_last: int = 0) -> dict:
    """Absolute checkpoint paths for the ranks, checked before anything launches (train/checkpoint.py)."""
    from curry_train.config import ConfigError, Problem

    def bad(field: str, message: str, fix: str) -> ConfigError:
        return ConfigError([Problem(fields=[field], message=message, fix=fix)])

    if save_every < 0:
        raise bad("--save-every", f"{save_every} is negative", "use N >= 1 (save after every N steps)")
    if save_every and not checkpoint_dir:
        raise bad("--save-every", "--save-every needs --checkpoint-dir", "add --checkpoint-dir DIR")
    if keep_last < 0:
        raise bad("--keep-last", f"{keep_last} is negative", "use N >= 1 (keep the newest N), or 0 to keep all")
    if keep_last and not checkpoint_dir:
        raise bad("--keep-last", "--keep-last needs --checkpoint-dir", "add --checkpoint-dir DIR")
    out: dict[str, Any] = {}
    if checkpoint_dir:
        out["checkpoint_dir"], out["save_every"] = str(Path(checkpoint_dir).expanduser().resolve()), save_every
        out["keep_last"] = keep_last
    if resume:
        from curry_train.train.checkpoint import find_checkpoint

        folder, meta = find_checkpoint(Path(resume).expanduser(), cfg)
        if meta["step"] >= cfg.train.steps:
            raise bad("train.steps", f"the checkpoint is at step {meta['step']}, train.steps={cfg.train.steps} "
                      "leaves nothing to train", f"set train.steps > {meta['step']}")
        out["resume"] = str(folder.resolve())
    return out


def train(config: str, overrides: dict[str, Any] | None = None, *, root: str | Path | None = None,
          timeout: float = 1800.0, cancel: threading.Event | None = None,
          progress: Callable[[str], None] | None = None, checkpoint_dir: str | None = None,
          save_every: int = 0, resume: str | None = None, keep_last: int = 0) -> RunRecord:
    """Train cfg.train.steps steps on world_size ranks through torchrun (from a checkpoint's step with `resume`,
    saving every `save_every` steps into `checkpoint_dir`); returns the finished run record. `progress` gets a
    line at launch and step lines while it runs (train/progress.py)."""
    from curry_train.train.launch import LaunchError, run_torchrun
    from curry_train.train.progress import follow_steps

    cfg, name = resolve(config, overrides, root)
    preflight(cfg, name)
    ckpt = _checkpoint_args(cfg, checkpoint_dir, save_every, resume, keep_last)
    ledger = Ledger(root)
    rec = ledger.start("train", cfg, name)
    run_path = Path(ledger.path.parent / rec.run_id)
    say = progress or (lambda msg: None)
    say(f"run {rec.run_id}: launching {cfg.world_size} rank(s) through torchrun for {cfg.train.steps} steps; "
        f"step lines follow once the ranks have imported torch and built the model (log: {run_path / 'ranks.log'})")
    try:
        with follow_steps(run_path / "ranks.log", cfg.train.steps, say) if progress else nullcontext():
            values = run_torchrun({"kind": "train", "config": cfg.to_dict(), "progress": progress is not None,
                                   **ckpt}, cfg.world_size, run_path, timeout=timeout, cancel=cancel)
    except LaunchError as e:
        ledger.finish(rec.run_id, status="cancelled" if "cancelled" in str(e) else "failed", error=str(e)[:4000])
        raise
    out = values[0]
    metrics = {
        "losses": out["losses"], "first_loss": out["losses"][0], "last_loss": out["losses"][-1],
        "step_time_s": sorted(out["step_time_s"])[len(out["step_time_s"]) // 2],
        "tokens_per_s": sorted(out["tokens_per_s"])[len(out["tokens_per_s"]) // 2],
        "world_size": out["world_size"], "device": out["device"], "start_step": out.get("start_step", 0),
        **({"checkpoint": ckpt} if ckpt else {}),
    }
    return ledger.finish(rec.run_id, status="ok", metrics=metrics)


def whitebox(config: str, overrides: dict[str, Any] | None = None, *, steps: int | None = None,
             root: str | Path | None = None, timeout: float = 900.0, cancel: threading.Event | None = None,
             inject: str | None = None, inject_target: str | None = None, resume_from_layout: str | None = None,
             resume_at: int = 2, resume_checkpoint: str | None = None):
    """Parallel run vs single-device reference; returns the Verdict (with run_id), recorded in the ledger.

    `steps` None: whitebox.default_steps (2, or through the end of a short lr warm-up).
    `inject` plants one bug of validation/inject.CATALOGUE in the ranks (the verdict must then fail). Bad input
    (steps < 1, timeout <= 0, an unknown injection or one that cannot apply to the layout) is refused
    before anything is launched or recorded (validation/inject.WhiteboxInputError, a ValueError).
    `resume_from_layout` (KEY=VALUE,... or a config name) or `resume_checkpoint` (a step folder; climb): the
    resume white-box (validation/resume.py), layout A saving after `resume_at` steps, `steps` (None: 2) after."""
    from curry_train.train.launch import LaunchError
    from curry_train.validation.whitebox import check_steps, run_whitebox

    check_steps(1 if steps is None else steps, timeout)  # None: whitebox.default_steps of the config
    cfg, name = resolve(config, overrides, root)
    resuming = resume_from_layout is not None or resume_checkpoint is not None
    layout = _saving_layout(cfg, resume_from_layout, root) if resume_from_layout is not None else None
    if inject:
        from curry_train.validation.inject import check

        check(inject, cfg, resume=resuming)
    preflight(cfg, name)
    if layout is not None:
        preflight(layout, name)
    ledger = Ledger(root)
    rec = ledger.start("whitebox", cfg, name)
    try:
        if resuming:
            from curry_train.validation.resume import run_resume_whitebox

            verdict = run_resume_whitebox(cfg, run_dir=ledger.path.parent / rec.run_id, layout=layout,
                                          checkpoint=Path(resume_checkpoint) if resume_checkpoint else None,
                                          resume_at=resume_at, steps=steps or 2, timeout=timeout, cancel=cancel,
                                          inject=inject, inject_target=inject_target)
        else:
            verdict = run_whitebox(cfg, steps=steps, run_dir=ledger.path.parent / rec.run_id, timeout=timeout,
                                   cancel=cancel, inject=inject, inject_target=inject_target)
    except LaunchError as e:
        ledger.finish(rec.run_id, status="cancelled" if "cancelled" in str(e) else "failed", error=str(e)[:4000])
        raise
    verdict.run_id = rec.run_id
    verdict.config_overrides = dict(overrides or {})
    ledger.finish(rec.run_id, status="ok" if verdict.passed else "failed", metrics=verdict.model_dump(mode="json"))
    return verdict


def _saving_layout(cfg: Config, spec: str, root: str | Path | None) -> Config:
    """Layout A of a resume white-box: KEY=VALUE,... on `cfg` (validation/resume.layout_from) or a config name."""
    from curry_train.validation.inject import WhiteboxInputError
    from curry_train.validation.resume import layout_from

    if "=" in spec or spec.strip() in ("", "single"):
        return layout_from(cfg, spec)
    try:
        return layout_from(cfg, resolve(spec, None, root)[0])
    except FileNotFoundError as e:
        raise WhiteboxInputError(f"--resume-from-layout {spec!r} is neither KEY=VALUE (e.g. dp=2,zero=3) nor a "
                                 f"config: {e}") from e


def selftest(config: str = "tiny", *, nproc: int = 2, fault: str | None = None, fault_rank: int = 0,
             root: str | Path | None = None, timeout: float = 120.0,
             cancel: threading.Event | None = None) -> RunRecord:
    """The launcher self-test (jobs.selftest_job) through torchrun, recorded like a bench: one all-reduce, then the
    injected `fault` (raise | hang | exit | oom | stubborn) on `fault_rank`. The fault tests (tests/reliability)
    drive the path every long tool takes - worker, torchrun, ranks, ledger - without building a model."""
    from curry_train.train.launch import LaunchError, run_torchrun

    cfg, name = resolve(config, None, root)
    ledger = Ledger(root)
    rec = ledger.start("selftest", cfg, name)
    spec = {"kind": "selftest", "fault": fault, "fault_rank": fault_rank}
    try:
        values = run_torchrun(spec, nproc, ledger.path.parent / rec.run_id, timeout=timeout, cancel=cancel)
    except LaunchError as e:
        ledger.finish(rec.run_id, status="cancelled" if "cancelled" in str(e) else "failed", error=str(e)[:4000])
        raise
    return ledger.finish(rec.run_id, status="ok", metrics={"ranks": values})
