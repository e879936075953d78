"""The built wheel: contents, extras with exactly one TensorFlow, installs into a fresh venv.

Runs offline: the wheel is built without build isolation (the venv's setuptools), installed
with ``--no-deps --no-index``, and the extras are resolved against the metadata of the
distributions installed in this venv (the ones setup_env.sh installed from those extras).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TF_DISTS = {"tensorflow", "tensorflow-cpu", "tensorflow-intel", "tensorflow-macos", "tf-nightly", "tf-nightly-cpu"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "tfos"), src / "tfos", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out), str(src)],
        check=True, timeout=300, cwd=str(src),
    )
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    return str(out / wheels[0])


def _metadata(wheel: str) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _extra_reqs(reqs: list[Requirement], extra: str) -> list[Requirement]:
    return [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": extra})]


def _closure(reqs: list[Requirement]) -> set[str]:
    """Names reached from reqs through the installed distributions' requirements."""
    seen: set[str] = set()
    todo = list(reqs)
    while todo:
        r = todo.pop()
        name = canonicalize_name(r.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            sub = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for line in sub:
            q = Requirement(line)
            if q.marker is None or q.marker.evaluate({"extra": ""}):
                todo.append(q)
    return seen


def test_wheel_has_every_module_and_the_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    modules = sorted(f for f in os.listdir(os.path.join(ROOT, "tfos")) if f.endswith(".py"))
    assert modules and all(f"tfos/{m}" in names for m in modules), sorted(set(f"tfos/{m}" for m in modules) - names)
    reqs = _metadata(wheel)
    base = {canonicalize_name(r.name) for r in reqs if r.marker is None}
    assert {"pyspark", "numpy", "cloudpickle", "psutil", "tqdm"} <= base
    assert not base & TF_DISTS, "TensorFlow must stay an extra"
    tf = {canonicalize_name(r.name): str(r.specifier) for r in _extra_reqs(reqs, "tf")}
    assert tf.get("tensorflow") == "==2.21.*" and "tf-keras" in tf and "tensorflow-cpu" not in tf, tf
    cpu = {canonicalize_name(r.name) for r in _extra_reqs(reqs, "tf-cpu")}
    assert "tensorflow-cpu" in cpu and "tensorflow" not in cpu and "tf-keras" not in cpu, cpu
    assert {"nbclient", "ipykernel", "nbconvert"} <= {canonicalize_name(r.name) for r in _extra_reqs(reqs, "test")}


@pytest.mark.parametrize("extra", ["tf", "tf-cpu"])
def test_each_tf_extra_resolves_to_exactly_one_tensorflow(wheel, extra):
    """tf-keras requires 'tensorflow': with tensorflow-cpu that made two TensorFlows."""
    reqs = _extra_reqs(_metadata(wheel), extra)
    needed = {canonicalize_name(r.name) for r in reqs}
    try:
        for name in needed:
            md.version(name)
    except md.PackageNotFoundError as exc:
        pytest.skip(f"{exc.args[0]} is not installed here; its requirements cannot be read offline")
    tfs = _closure(reqs) & TF_DISTS
    assert len(tfs) == 1, f"extra {extra!r} installs {sorted(tfs)}"


def test_wheel_installs_into_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel],
                   check=True, timeout=300)
    # Dependencies come from this venv's site-packages, after the fresh venv's own.
    fresh_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(fresh_site, "zz_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import importlib.metadata as m, tfos, tfos.errors as e;"
        "print(tfos.__file__); print(m.version('tfos'));"
        "print(sorted(r.split(';')[0].strip() for r in m.requires('tfos') if 'extra == \"tf\"' in r));"
        "print(e.FeedError.__mro__[1].__name__, tfos.FeedError is e.FeedError)"
    )
    out = subprocess.run([py, "-c", probe], check=True, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300).stdout.splitlines()
    assert out[0].startswith(fresh_site + os.sep + "tfos" + os.sep), out
    assert out[1] == re.search(r'version="([^"]+)"', open(os.path.join(ROOT, "setup.py")).read()).group(1), out
    assert out[2] == "['tensorboard>=2.21', 'tensorflow==2.21.*', 'tf-keras==2.21.*']", out
    assert out[3] == "TFOSError True", out
