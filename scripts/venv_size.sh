#!/usr/bin/env bash
# The size of the venv docs/deploy.md tells you to ship with --archives: a fresh venv with
# tfos and its runtime extras (tf, arrow) plus venv-pack, measured unpacked (du) and packed
# (venv-pack's .tar.gz), then removed. Prints the largest packages too.
#
# Usage: bash scripts/venv_size.sh [extras]   (default extras: tf,arrow)
# Needs the packages from pip's configured index or wheel directory (no download when they are
# there); takes a few minutes (installing TensorFlow, gzip of about 2.5 GB on one core).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-tf,arrow}"
PY="${PYTHON:-python3.11}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tfos-venv-size.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# Installed from a copy of the tree, so that the build leaves nothing (tfos.egg-info) in
# the checkout; without PYTHONPATH, on which a checkout makes pip take tfos for installed.
mkdir "$WORK/src"
cp "$ROOT/setup.py" "$ROOT/README.md" "$WORK/src/"
cp -r "$ROOT/tfos" "$WORK/src/tfos"
"$PY" -m venv "$WORK/venv"
env -u PYTHONPATH "$WORK/venv/bin/python" -m pip install -q "$WORK/src[$EXTRAS]" venv-pack
# venv-pack itself and pip are in the measured venv too (a user's venv has pip).
SITE="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
UNPACKED=$(du -sb "$WORK/venv" | cut -f1)
echo "[venv_size] extras [$EXTRAS], $("$WORK/venv/bin/python" -c 'import importlib.metadata as m; print(" ".join(f"{d}=={m.version(d)}" for d in ("tensorflow", "pyspark", "pyarrow", "numpy")))' 2>/dev/null)"
echo "[venv_size] largest packages (MB):"
du -sb "$SITE"/* | sort -rn | head -6 | awk '{printf "  %8.0f  %s\n", $1 / 1e6, $2}' | sed "s#$SITE/##"
T0=$(date +%s)
"$WORK/venv/bin/venv-pack" -q -p "$WORK/venv" -o "$WORK/pyspark_venv.tar.gz"
PACKED=$(stat -c %s "$WORK/pyspark_venv.tar.gz")
awk -v u="$UNPACKED" -v p="$PACKED" -v t="$(( $(date +%s) - T0 ))" \
  'BEGIN { printf "[venv_size] unpacked %.2f GB, packed %.2f GB (venv-pack, %d s)\n", u / 1e9, p / 1e9, t }'
