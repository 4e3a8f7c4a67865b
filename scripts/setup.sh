#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (pinned CPU-safe 2.13.0 when no torch is installed yet) and curry-train[dev].
# On a CPU machine torch==2.13.0 resolves to the CPU wheel; an unpinned torch could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[dev]"
.venv/bin/python -c "import torch, mcp, curry_train; print(f'curry-train ready: torch {torch.__version__}', flush=True)" >&2
