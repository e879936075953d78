#!/usr/bin/env bash
# The README's test command: installs what is missing, then runs the test suite, one line
# per test (its name when it starts, PASSED/FAILED/SKIPPED when it ends), so a Spark test
# that takes minutes shows which one runs. Extra arguments go to pytest, e.g.
# `bash scripts/run_tests.sh tests/unit -q` (-q gives pytest's dots instead).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python -m pytest -v "$@"
