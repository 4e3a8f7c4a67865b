"""Which torch curry_train runs on, checked at import time without importing torch.

The declared range is the tested range (README "Torch versions"): the minimum is the oldest torch the whole test
suite and the evals passed on (`bash scripts/compat.sh VERSION`). `check_torch()` reads the installed version
from the package metadata (`importlib.metadata`), never by importing torch, so the MCP server, which imports
curry_train but never torch, still starts in about a second.

APIS lists the torch APIs the template depends on that are newer than torch 2.4, with the first release that has
each one. Releases are dated by the release cadence table in pytorch/pytorch RELEASE.md (branch cuts: 2.5 Sep 2024,
2.6 Dec 2024, 2.7 Mar 2025, 2.8 Jun 2025, 2.9 Sep 2025, 2.10 Dec 2025, 2.11 16 Feb 2026, 2.12 13 Apr 2026,
2.13 8 Jun 2026, 2.14 10 Aug 2026); an API is in the first release whose branch was cut after its pull request
landed. Every entry was also checked by name in the installed 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from importlib import metadata

MINIMUM = (2, 13)
TESTED = ("2.13.0", "2.14.1")  # full suite + evals passed (scripts/compat.sh; CI runs the pinned 2.13.0)


@dataclass(frozen=True)
class Api:
    api: str
    since: tuple[int, int]  # first torch release that has it
    used_by: str
    evidence: str
    probe: tuple[str, str, str | None]  # (module, attribute path, keyword it must accept): missing_apis() checks it
    shim: str = ""  # how an older torch is served, if it is


APIS = (
    Api("PipelineStage(get_mesh=...): DTensor activations between pipeline stages", (2, 13),
        "parallel/pipeline.py (pp > 1; SP activations are DTensors)",
        "pytorch#177727/#177728 (DTensor-aware pipelining, RFC #172419), opened 2026-03-18, four weeks before "
        "the 2.12 branch cut (13 Apr 2026); whether it made 2.12 is unverified, so 2.13, where it is present. No "
        "older spelling: stages could not send DTensors before",
        ("torch.distributed.pipelining", "PipelineStage.__init__", "get_mesh")),
    Api("dist.all_gather_single / reduce_scatter_single", (2, 13), "parallel/comms.py all_gather_dim0",
        "pytorch#186123 (rename of all_gather_into_tensor / reduce_scatter_tensor, old names kept as "
        "deprecated aliases), opened 2026-06-03, before the 2.13 branch cut (8 Jun 2026); in 2.13.0",
        ("torch.distributed", "all_gather_single", None),
        shim="comms.py falls back to all_gather_into_tensor (torch >= 1.13)"),
    Api("DeviceMesh._unflatten", (2, 10), "mesh.py ep_meshes (parallel.ep > 1)",
        "pytorch#161224 (CuTe-layout _unflatten), opened 2025-08-21, stacked on #164510 (Oct 2025): after the "
        "2.9 branch cut (Sep 2025)", ("torch.distributed.device_mesh", "DeviceMesh._unflatten", None)),
    Api("FSDPModule.set_force_sum_reduction_for_comms", (2, 9), "parallel/expert_parallel.py (EP + zero >= 2)",
        "pytorch#155915, opened 2025-06-13, in the month of the 2.8 branch cut (Jun 2025): 2.9 at the latest; "
        "InternLM/xtuner#1961 guards it at torch >= 2.10",
        ("torch.distributed.fsdp", "FSDPModule.set_force_sum_reduction_for_comms", None)),
    Api("pipelining schedules' scale_grads=", (2, 7), "parallel/pipeline.py build_schedule",
        "pytorch#144352 (PP grad scaling), opened 2025-01-07, after the 2.6 branch cut (Dec 2024)",
        ("torch.distributed.pipelining", "Schedule1F1B.__init__", "scale_grads")),
    Api("fully_shard / MixedPrecisionPolicy in torch.distributed.fsdp", (2, 6), "parallel/fsdp.py",
        "FSDP2 moved from torch.distributed._composable.fsdp to the public torch.distributed.fsdp in 2.6",
        ("torch.distributed.fsdp", "MixedPrecisionPolicy", None)),
    Api("ScheduleZBVZeroBubble (V placement)", (2, 6), "parallel/pipeline.py (pp_schedule=zero_bubble, "
        "pp_virtual=2)", "pytorch#142084 (ZBV schedule), reviewed 2024-12-06, the month of the 2.6 branch cut "
        "(2.7 at the latest)", ("torch.distributed.pipelining", "ScheduleZBVZeroBubble", None)),
    Api("ScheduleInterleavedZeroBubble", (2, 5), "parallel/pipeline.py (pp_schedule=zero_bubble, "
        "pp_virtual > 2)", "pytorch#133467 (ZeroBubble schedule), merge requested 2024-08-22, before the 2.5 "
        "branch cut (Sep 2024)", ("torch.distributed.pipelining", "ScheduleInterleavedZeroBubble", None)),
    Api("DeviceMesh._flatten", (2, 5), "mesh.py dp_cp_mesh", "pytorch#132632, reviewed 2024-08-06, before the "
        "2.5 branch cut (Sep 2024)", ("torch.distributed.device_mesh", "DeviceMesh._flatten", None)),
    Api("public torch.distributed.tensor (DTensor, Shard, Replicate)", (2, 5), "parallel/tensor_parallel.py",
        "torch.distributed._tensor became torch.distributed.tensor in 2.5 (pytorch#133022 and its stack, 2024-08)",
        ("torch.distributed.tensor", "DTensor", None)),
)


def missing_apis() -> list[str]:
    """The APIS entries the installed torch lacks (imports torch: for tests and scripts/compat.sh, not import)."""
    import importlib
    import inspect

    missing = []
    for a in APIS:
        module, path, keyword = a.probe
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
            if keyword is not None and keyword not in inspect.signature(obj).parameters:
                raise AttributeError(keyword)
        except (ImportError, AttributeError):
            missing.append(a.api)
    return missing


class TorchVersionError(ImportError):
    """The installed torch is outside the supported range (one line: installed, minimum, the feature)."""


def parse(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string: '2.13.0+cpu' -> (2, 13); None if it does not parse."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_torch() -> str | None:
    """The installed torch's version from its distribution metadata (no import), or None if absent."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def torch_problem(version: str | None = None) -> str | None:
    """One line saying why this torch cannot run curry_train, or None when it can."""
    version = installed_torch() if version is None else version
    need = ".".join(map(str, MINIMUM))
    fix = f"install torch>={need} (tested: {', '.join(TESTED)}; e.g. pip install 'torch=={TESTED[0]}')"
    if version is None:
        return f"curry_train needs torch>={need}, and torch is not installed: {fix}"
    have = parse(version)
    if have is not None and have >= MINIMUM:
        return None
    newer = [a for a in APIS if not a.shim and (have is None or a.since > have)]
    if newer:  # name the newest API without an older spelling: that one is what this torch cannot run
        a = max(newer, key=lambda a: a.since)
        why = f"{a.api}, used by {a.used_by}, needs torch>={'.'.join(map(str, a.since))}"
    else:
        why = f"{need} is the oldest torch the suite and the evals were run on"
    return f"curry_train needs torch>={need} but torch {version} is installed; {why}: {fix}"


def check_torch() -> None:
    """Raise TorchVersionError (one line) when the installed torch is below MINIMUM or missing."""
    problem = torch_problem()
    if problem is not None:
        raise TorchVersionError(problem)


def entry_is_cli(argv: list[str] | None = None) -> bool:
    """True when this process is the `curry-train` CLI (the console script or `python -m curry_train.cli`).

    Read from `sys.orig_argv` (Python >= 3.10), which holds the command line from the start; `sys.argv[0]` is
    still "-m" while `-m` imports the parent package. The CLI checks torch itself as the first thing in `main`, so
    that it can print the one line and exit 2 (invalid input) instead of dying in an import traceback."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] in ("curry_train.cli", "curry_train.cli.__main__")
    return len(argv) > 1 and os.path.basename(argv[1]).split(".")[0] in ("curry-train", "curry-train-script")
