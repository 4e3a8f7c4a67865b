"""Live progress of a torchrun job for a human at a terminal: follow the job's ranks.log, turn rank 0's per-step
JSON lines (train/loop.py `run_training(log=...)`) into short lines at a bounded rate.

    with follow_steps(run_dir / "ranks.log", total=20, say=print):
        run_torchrun(...)

`curry-train train` was silent for ~48 s on 2 cores: torchrun start, torch import in every rank,
model build, then the steps. The first line goes out at launch; step lines come at most every `interval` seconds
(plus the first and the last step), so a 10k-step run does not flood the terminal.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def step_line(rec: dict, total: int) -> str:
    return (f"step {rec['step'] + 1}/{total}: loss {rec['loss']:.4f}, {rec['step_time_s'] * 1e3:.1f} ms, "
            f"{rec['tokens_per_s']:.0f} tokens/s")


@contextmanager
def follow_steps(log_path: Path, total: int, say: Callable[[str], None], interval: float = 2.0,
                 poll: float = 0.25) -> Iterator[None]:
    """Report step lines found in `log_path` while the body runs (a daemon thread; stops when the body ends)."""
    stop = threading.Event()

    def run() -> None:
        pos, buf, last_said = 0, "", 0.0
        pending: dict | None = None
        while True:
            done = stop.is_set()  # read the file once more after the job ended: the last step is in it
            try:
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    f.seek(pos)
                    buf += f.read()
                    pos = f.tell()
            except OSError:
                pass
            *lines, buf = buf.split("\n")
            for line in lines:
                if not line.startswith('{"step"'):
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                now = time.monotonic()
                if rec["step"] == 0 or rec["step"] + 1 == total or now - last_said >= interval:
                    say(step_line(rec, total))
                    last_said, pending = now, None
                else:
                    pending = rec
            if done:
                if pending is not None:
                    say(step_line(pending, total))
                return
            stop.wait(poll)

    t = threading.Thread(target=run, name="follow-steps", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)
