"""One long tool call in its own process: `python -m curry_train_mcp.worker '<json request>'`.

The MCP server never imports torch and never runs training in its own process. Each long call (bench, white-box,
measured probe, climb) runs here, in a fresh session started by `jobs.run_worker`, which reads this process's stdout
as a line protocol: `{"progress": "..."}` lines, then exactly one `{"result": {...}}` or `{"error": {...}}` line.
Anything else that writes to fd 1 (a library print) is redirected to stderr before work starts, so the protocol
stays clean, and the ranks' own output goes to their run folder's log file.

Cancellation: SIGTERM / SIGINT set an event that the launcher polls; it kills the torchrun process group and the
run is recorded as cancelled. If the server dies, this worker notices its parent changed and cancels itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

Say = Callable[[str], None]


def _bench(args: dict[str, Any], cancel: threading.Event, say: Say, root: str | None) -> dict[str, Any]:
    from curry_train.measure.bench import bench

    return bench(args["config"], steps=args.get("steps", 5), warmup=args.get("warmup", 1),
                 overrides=args.get("overrides") or {}, root=root, timeout=args.get("timeout"),
                 cancel=cancel, progress=say, micro_batches=args.get("micro_batches")).model_dump(mode="json")


def _whitebox(args: dict[str, Any], cancel: threading.Event, say: Say, root: str | None) -> dict[str, Any]:
    from curry_train.measure import service

    say(f"launching the parallel run and the single-device reference for {args['config']}")
    v = service.whitebox(args["config"], args.get("overrides") or {}, steps=args.get("steps"), root=root,
                         timeout=args.get("timeout", 900.0), cancel=cancel, inject=args.get("inject"),
                         resume_from_layout=args.get("resume_from_layout"))
    return v.model_dump(mode="json")


def _probe(args: dict[str, Any], cancel: threading.Event, say: Say, root: str | None) -> dict[str, Any]:
    from curry_train.measure.hardware import probe_hardware

    if args.get("measure"):
        say("timing a matmul per device and an all-reduce across local ranks")
    return probe_hardware(measure=bool(args.get("measure")), timeout=args.get("timeout", 300.0),
                          cancel=cancel).model_dump(mode="json")


def _sweep(args: dict[str, Any], cancel: threading.Event, say: Say, root: str | None) -> dict[str, Any]:
    from curry_train.measure.preflight import preflight
    from curry_train.measure.service import resolve
    from curry_train.measure.sweep import capacity_sweep

    preflight(*resolve(args["config"], args.get("overrides") or {}, root))  # measured: it launches ranks

    return capacity_sweep(args["config"], args.get("overrides") or {}, measured=True, rungs=args.get("rungs"),
                          max_micro_batch=args.get("max_micro_batch", 4096),
                          max_runs_per_rung=args.get("max_runs_per_rung", 8), timeout=args.get("timeout", 1800.0),
                          cancel=cancel, progress=say, root=root).model_dump(mode="json")


def _climb(args: dict[str, Any], cancel: threading.Event, say: Say, root: str | None) -> dict[str, Any]:
    """The CLI's climb itself (the same ledger, configs and checkpoint chain), each progress line a notification.
    Not in LOCKED: the climb takes the device lock per launch, between which cheap tools and other jobs may run."""
    from curry_train.cli.climb import climb

    return climb(args["config"], int(args["memory_budget"]), overrides=args.get("overrides") or {},
                 name=args.get("name"), steps=int(args.get("steps", 3)), max_rungs=int(args.get("max_rungs", 8)),
                 root=root, timeout=float(args.get("timeout", 900.0)), log=say,
                 keep_checkpoints=bool(args.get("keep_checkpoints")), cancel=cancel).model_dump(mode="json")


def _selftest(args: dict[str, Any], cancel: threading.Event, say: Say, root: str | None) -> dict[str, Any]:
    """Not a tool: the launcher self-test with an injected fault, for tests/reliability/test_faults.py."""
    from curry_train.measure import service

    say(f"launching {args.get('nproc', 2)} self-test rank(s), fault={args.get('fault')}")
    rec = service.selftest(args.get("config", "tiny"), nproc=int(args.get("nproc", 2)), fault=args.get("fault"),
                           fault_rank=int(args.get("fault_rank", 0)), root=root, timeout=args.get("timeout", 120.0),
                           cancel=cancel)
    return rec.model_dump(mode="json")


TASKS: dict[str, Callable[[dict[str, Any], threading.Event, Say, str | None], dict[str, Any]]] = {
    "bench": _bench, "whitebox": _whitebox, "probe": _probe, "sweep": _sweep, "selftest": _selftest,
    "climb": _climb,
}
# Tasks that occupy the accelerators (or all CPU cores) and so take the device lock.
LOCKED = {"bench", "whitebox", "sweep", "probe_measure", "selftest"}


def _classify(e: BaseException) -> tuple[str, str]:
    from curry_train.config import ConfigError
    from curry_train.paths import UnsafeName
    from curry_train.train.launch import LaunchError

    if isinstance(e, (ConfigError, UnsafeName, FileNotFoundError, ValueError)):
        return "invalid", str(e)
    if isinstance(e, KeyError):
        return "invalid", str(e.args[0]) if e.args else str(e)
    if isinstance(e, LaunchError):
        return ("cancelled" if str(e).startswith("cancelled") else "failed"), str(e)
    if isinstance(e, TimeoutError):
        return "busy", str(e)
    return "bug", f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # from here on, a stray print lands on stderr, never in the protocol
    req = json.loads(argv[0])
    cancel = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: cancel.set())
    # The server's pid comes in the request: reading getppid() here would miss a server that died while this
    # process was still starting (we would already be re-parented and take init for the server).
    parent = int(req.get("server_pid") or os.getppid())
    if os.getppid() != parent:  # already orphaned: do not even start
        cancel.set()

    def watchdog() -> None:  # the server died: do not leave ranks running for nobody
        while not cancel.is_set():
            if os.getppid() != parent:
                cancel.set()
            time.sleep(0.2)

    threading.Thread(target=watchdog, daemon=True).start()
    lock_gate = threading.Lock()

    def send(obj: dict[str, Any]) -> None:
        with lock_gate:
            try:
                proto.write(json.dumps(obj, default=str) + "\n")
            except BrokenPipeError:  # the server is gone
                cancel.set()

    def say(msg: str) -> None:
        send({"progress": msg})

    task, args, root = req["task"], req.get("args") or {}, req.get("root")
    lock = None
    try:
        if task in LOCKED or (task == "probe" and args.get("measure")):
            from curry_train.measure.bench import DeviceLock

            lock = DeviceLock(root)
            lock.acquire(timeout=float(args.get("lock_timeout", 3600.0)), cancel=cancel, on_wait=say)
        if cancel.is_set():
            raise TimeoutError("cancelled before the job started")
        send({"result": TASKS[task](args, cancel, say, root)})
        return 0
    except Exception as e:  # noqa: BLE001 - top level of the worker: report, the server turns it into a ToolError
        kind, message = _classify(e)
        if cancel.is_set() and kind in ("bug", "failed", "busy"):  # busy: cancelled while waiting for the lock
            kind = "cancelled"
        if kind == "bug":
            traceback.print_exc(file=sys.stderr)
        send({"error": {"kind": kind, "message": message[:8000]}})
        return 1
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
