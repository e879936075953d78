#!/usr/bin/env bash
# The README's test command: installs what is missing, then runs the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python -m pytest tests "$@"
