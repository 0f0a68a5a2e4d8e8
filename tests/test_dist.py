"""Distributions (issue 29): the sdist carries every C source and header the build needs,
a wheel built from the sdist alone installs into a fresh venv outside the checkout, and
there it imports, runs a kernel, the demo and the notebook's first cells.

The fresh venv gets the wheel (pip, no deps) and reaches its dependencies (numpy, torch,
matplotlib) in the project venv through a .pth file: installing torch per run would cost
minutes and a gigabyte; the package itself comes only from the wheel (checked).
`python -m build` is used when the `build` package is installed, else setuptools'
sdist and `pip wheel` (the same backend).  Builds the extension once (1-2 minutes):
runs only with CSA_TEST_DIST=1 (`make test-dist`)."""
import glob
from importlib import metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(os.environ.get("CSA_TEST_DIST") != "1",
                                reason="builds an sdist and a wheel (~2 min): make test-dist")


def _sh(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, **kw)
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout


def _tracked_copy(dst):
    """The checkout's tracked files (what a clean clone has), without build products."""
    try:
        files = _sh(["git", "ls-files"], cwd=ROOT).split()
    except (AssertionError, FileNotFoundError):
        files = None
    if not files:
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
            "build", ".venv", "*.so", "__pycache__", "*.egg-info", ".git"))
        return
    for f in files:
        os.makedirs(os.path.join(dst, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))


def test_sdist_wheel_fresh_venv(tmp_path):
    src = tmp_path / "checkout"
    _tracked_copy(src)
    dist = tmp_path / "dist"
    try:                    # the `build` package (not the checkout's build/ folder)
        metadata.version("build")
        have_build = True
    except metadata.PackageNotFoundError:
        have_build = False
    if have_build:
        _sh([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist),
             str(src)])
    else:
        _sh([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=src)
    sdists = glob.glob(str(dist / "*.tar.gz"))
    assert len(sdists) == 1, sdists
    with tarfile.open(sdists[0]) as t:
        names = t.getnames()
        top = names[0].split("/")[0]
        inside = {n.split("/", 1)[1] for n in names if "/" in n}
        need = {os.path.relpath(p, ROOT) for p in
                glob.glob(os.path.join(ROOT, "csrc", "**", "*.[ch]"), recursive=True)}
        missing = sorted(need - inside)
        assert not missing, f"sdist lacks {missing}"
        assert "pyproject.toml" in inside and "setup.py" in inside
        t.extractall(tmp_path / "sd")
    # the wheel from the sdist alone
    wheels = tmp_path / "wheels"
    _sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(tmp_path / "sd" / top)])
    whl = glob.glob(str(wheels / "deepseek_csa-*.whl"))
    assert len(whl) == 1, whl
    # a fresh venv outside the checkout
    venv = tmp_path / "venv"
    _sh([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    _sh([py, "-m", "pip", "install", "-q", "--no-deps", whl[0]])
    vsite = _sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    with open(os.path.join(vsite, "_csa_project_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    run = tmp_path / "run"
    run.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("PYTHONPATH", None)
    out = _sh([py, "-c", "import numpy as np, deepseek_csa as dc\n"
               "print(dc.__file__)\n"
               "x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)\n"
               "y = dc.rms_norm(x, None, 1e-6)\n"
               "ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)\n"
               "assert np.abs(y - ref).max() < 1e-5\n"
               "print(dc.build_info())\n"], cwd=run, env=env)
    assert str(venv) in out.splitlines()[0], out
    out = _sh([py, "-m", "deepseek_csa.demo", "--seqlen", "128", "--steps", "2", "--no-check"],
              cwd=run, env=env)
    assert "prefill" in out, out
    # the notebook's first two code cells (imports, a tiny model swapped layer by layer)
    nb = json.load(open(os.path.join(ROOT, "examples", "swap_layers.ipynb")))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"][:2]
    code = "\n".join(cells) + "\nimport deepseek_csa; print('NB', deepseek_csa.__file__)\n"
    out = _sh([py, "-c", code], cwd=run, env=env)
    assert "NB " + str(venv) in out, out[-2000:]
