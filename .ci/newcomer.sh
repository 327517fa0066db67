#!/usr/bin/env bash
# The newcomer's path, literally: a fresh `git clone` of this checkout's HEAD into a temporary
# directory, `python3 -m venv .venv` inside the clone (where the README suggests), the README's
# set-up command in it (one `pip install`: the core is built once), then a quick check: the README's
# first Python block runs, and the fast tier of tests/docs and tests/packaging passes with no trainer
# package installed (tests that need one skip). Not the full suite: .ci/run runs that once, in its own venv.
#
# Usage: bash .ci/newcomer.sh SETUP_CMD FAST_TEST_CMD (.ci/run passes the README's commands, which it
# has checked against README.md). Env: NEWCOMER_KEEP=1 keeps the clone.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
SETUP_CMD="$1"
FAST_TEST_CMD="$2"
T0=$SECONDS
step() { echo "-- newcomer [$((SECONDS - T0))s] $*"; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/sparse_ckpt_newcomer.XXXXXX")"
if [ "${NEWCOMER_KEEP:-0}" = 1 ]; then
  echo "newcomer: keeping $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi

step "git clone (HEAD of $ROOT)"
git clone -q "$ROOT" "$WORK/sparse_ckpt"
cd "$WORK/sparse_ckpt"

step "python3 -m venv .venv (inside the clone)"
unset PYTHONPATH  # a newcomer's shell: nothing of this checkout on the import path
python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

step "README set-up: $SETUP_CMD"
bash -c "$SETUP_CMD"
python -c "import sparse_ckpt, sparse_ckpt._C; print('sparse_ckpt', sparse_ckpt.__version__, 'backend', sparse_ckpt.backend())"

step "README's first Python block"
# In a folder of its own: next to the clone, the clone's folder (sparse_ckpt/) would shadow the package.
mkdir "$WORK/run"
python - README.md > "$WORK/run/first_block.py" <<'EOF'
import re
import sys

text = open(sys.argv[1], encoding="utf-8").read()
print(re.search(r"^```python\n(.*?)^```", text, re.S | re.M).group(1))
EOF
(cd "$WORK/run" && python first_block.py)
echo "README's first Python block: ran"

step "fast tests of tests/docs and tests/packaging: $FAST_TEST_CMD tests/docs tests/packaging"
set +e
bash -c "$FAST_TEST_CMD -p no:cacheprovider tests/docs tests/packaging"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "newcomer: the README's fast tests failed in the README's venv (exit $rc)" >&2
  exit "$rc"
fi
step "newcomer path: passed"
