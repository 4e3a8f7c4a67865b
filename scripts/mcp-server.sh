#!/usr/bin/env bash
# The Claude Code plugin's MCP server (.claude-plugin/plugin.json): the README's set-up once (scripts/setup.sh:
# .venv, the CPU torch wheel where no torch is installed yet, this package), then `curry-train mcp` on stdio.
# Not `uv run`: uv would resolve torch from PyPI on its own, a multi-GB CUDA build on Linux (docs/INTEGRATION.md).
# The set-up's output goes to stderr: stdout carries only the MCP protocol. The working directory is kept, so the
# server's configs/ and runs/ are the user's project ($CURRY_TRAIN_ROOT, else the working directory, else here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$ROOT/.venv/bin/curry-train" ]; then
  bash "$ROOT/scripts/setup.sh" 1>&2
fi
exec "$ROOT/.venv/bin/curry-train" mcp "$@"
