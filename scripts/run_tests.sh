#!/usr/bin/env bash
# The README's test command: installs what is missing, then runs the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh tests/unit -q`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python -m pytest "$@"
