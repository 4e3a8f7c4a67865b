"""One white-box run per (config, steps, planted bug) per test process: the tests' `whitebox_batch`.

A verdict is a function of the config, the steps and the planted bug only (validation/whitebox.py: the ranks run
that spec, the reference is recomputed from it in this process), so a layout two test files white-box (e.g. DDP on
two ranks in test_whitebox.py and test_chunked_loss.py) is launched once and both tests read the same verdict.
The multi-rank tests share one xdist worker (tests/conftest.py, the collection hook's order), so this per-process
memo is the session's pool; each caller gets its own copy to read. Only the configs not seen yet are launched, in
one forkserver launch per call as before (docs/CPU-DISTRIBUTED.md, "White-box checks").
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from curry_train.config import Config
from curry_train.validation import whitebox as _wb
from curry_train.validation.horizon import default_steps
from curry_train.validation.verdict import Verdict

_VERDICTS: dict[str, Verdict] = {}  # key: the spec's JSON (config, steps, planted bug, its target)
LAUNCHED: list[int] = []  # how many configs each call launched (tests/test_whitebox_pool.py reads it)


def _key(cfg: Config, steps: int, inject: str | None, target: str | None) -> str:
    return json.dumps([cfg.to_dict(), steps, inject, target], sort_keys=True, default=str)


def whitebox_batch(cfgs: list[Config], *, steps: int | None = None, out_dir: Path, timeout: float = 300.0,
                   inject: str | list[str | None] | None = None, inject_target: str | None = None) -> list[Verdict]:
    """validation.whitebox.whitebox_batch, launching only the configs no earlier call of this process ran."""
    per = [default_steps(c) if steps is None else steps for c in cfgs]  # resolved as whitebox_batch does
    for s in sorted(set(per)):
        _wb.check_steps(s, timeout)
    if len({c.world_size for c in cfgs}) != 1:  # refused as whitebox_batch does, even when some are pooled
        raise ValueError(f"one launch needs one world size, got {sorted({c.world_size for c in cfgs})}")
    names = inject if isinstance(inject, list) else [inject] * len(cfgs)
    keys = [_key(c, s, n, inject_target) for c, s, n in zip(cfgs, per, names, strict=True)]
    todo = [i for i, k in enumerate(keys) if k not in _VERDICTS and k not in keys[:i]]
    LAUNCHED.append(len(todo))
    if todo:
        got = _wb.whitebox_batch([cfgs[i] for i in todo], steps=steps, out_dir=out_dir, timeout=timeout,
                                 inject=[names[i] for i in todo], inject_target=inject_target)
        _VERDICTS.update(zip((keys[i] for i in todo), got, strict=True))
    return [copy.deepcopy(_VERDICTS[k]) for k in keys]
