#!/usr/bin/env bash
# Compatibility run on another torch: `bash scripts/compat.sh 2.14.1`.
# Makes (or reuses) .venv-torch-VERSION next to the project's .venv, which it never touches; installs torch==VERSION
# and this package there, then runs the whole test suite and the scripted evals (`python -m evals`) and prints a
# summary. On a machine without a CPU wheel of VERSION the registry's CUDA build is installed (several GB); it runs
# on CPU like the CPU wheel. Exit status: 0 when both the suite and the evals passed, 1 otherwise.
# Environment: PYTEST_ARGS (extra pytest arguments, e.g. "-x"), PYTHON (the interpreter that makes the venv).
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: bash scripts/compat.sh TORCH_VERSION   (e.g. 2.14.1)}
VENV=".venv-torch-$VERSION"
PY=${PYTHON:-python3}
LOG="$VENV/compat-logs"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || exit 1
have=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
if [ "$have" != "$VERSION" ]; then
  echo "compat: installing torch==$VERSION into $VENV" >&2
  "$VENV/bin/pip" install -q "torch==$VERSION" || exit 1
fi
# torch==VERSION already satisfies the package's torch range, so pip keeps it (an out-of-range VERSION fails here).
"$VENV/bin/pip" install -q -e ".[dev]" || exit 1
got=$("$VENV/bin/python" -c "import torch; print(torch.__version__)") || exit 1
echo "compat: torch $got (cuda build: $("$VENV/bin/python" -c 'import torch; print(torch.version.cuda)')) in $VENV" >&2
mkdir -p "$LOG"

start=$(date +%s)
# shellcheck disable=SC2086  # PYTEST_ARGS is a word list on purpose
"$VENV/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$LOG/pytest.log"
suite_rc=${PIPESTATUS[0]}
suite_s=$(( $(date +%s) - start ))

start=$(date +%s)
"$VENV/bin/python" -m evals 2>&1 | tee "$LOG/evals.log"
evals_rc=${PIPESTATUS[0]}
evals_s=$(( $(date +%s) - start ))

summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|[0-9]+ (passed|failed|error)" "$LOG/pytest.log" | tail -1)
echo
echo "== compat summary: torch $got =="
echo "suite: rc=$suite_rc in ${suite_s}s: ${summary:-no pytest summary line (see $LOG/pytest.log)}"
echo "evals: rc=$evals_rc in ${evals_s}s: $(tail -1 "$LOG/evals.log")"
[ "$suite_rc" -eq 0 ] && [ "$evals_rc" -eq 0 ]
