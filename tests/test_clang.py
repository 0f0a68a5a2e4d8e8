"""The package built with clang, as with gcc (issue 29).

`pip install .` with CC=clang, with OpenMP (libomp-dev) and without it (CSA_OPENMP=0,
the build Apple's clang without libomp gets), each into a temp dir:
  * every public kernel's outputs at every ISA level the clang build has are bitwise
    equal to the in-place (gcc) build's (tests/compiler_probe.py);
  * the fast kernel tests run against the clang module.
A clang OpenMP build has the 'base' level only on x86 (csrc/csa.h, CSA_X86_VARIANTS:
clang does not give the functions it outlines from `omp parallel` the enclosing
function's target); the serial clang build has every level.

Builds the extension twice (about 1-2 minutes each on 2 busy cores): runs only with
CSA_TEST_CLANG=1 (`make test-clang`)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLANG = shutil.which("clang")

pytestmark = [
    pytest.mark.skipif(os.environ.get("CSA_TEST_CLANG") != "1",
                       reason="builds the package with clang (~3 min): make test-clang"),
    pytest.mark.skipif(CLANG is None, reason="no clang (apt-get install clang libomp-dev)"),
]

FAST_TESTS = ["tests/test_norm_rope.py", "tests/test_pool.py", "tests/test_quant.py",
              "tests/test_gemm.py", "tests/test_attn.py", "tests/test_index.py"]


def _build(tmp, openmp):
    src = tmp / "src"
    src.mkdir()
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    shutil.copytree(os.path.join(ROOT, "csrc"), src / "csrc")
    shutil.copytree(os.path.join(ROOT, "deepseek_csa"), src / "deepseek_csa",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = dict(os.environ, CC=CLANG, LDSHARED=f"{CLANG} -shared")
    env["CSA_TORCH_NATIVE"] = "0"   # the C build is under test; the torch C++ module is not
    env.pop("CSA_OPENMP", None)
    if not openmp:
        env["CSA_OPENMP"] = "0"
    site = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation",
                        "--no-deps", "--no-index", "--target", str(site), str(src)],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "clang" in log
    return site


def _probe(pythonpath, npz, cwd):
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="2")
    code = ("import sys, runpy; sys.argv = ['probe', %r]; "
            "import deepseek_csa as dc; print('FILE', dc._core.__file__, dc.build_info()); "
            "runpy.run_path(%r, run_name='__main__')"
            % (npz, os.path.join(ROOT, "tests", "compiler_probe.py")))
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def gcc_npz(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gcc")
    out = _probe(ROOT, str(tmp / "gcc.npz"), tmp)
    assert "'compiler': '" in out
    return np.load(tmp / "gcc.npz")


@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "serial"])
def test_clang_build_bits_and_tests(tmp_path, gcc_npz, openmp):
    site = _build(tmp_path, openmp)
    out = _probe(str(site), str(tmp_path / "clang.npz"), tmp_path)
    assert str(site) in out, out
    assert "clang" in out.lower(), out           # build_info names the compiler
    levels = out.strip().splitlines()[-1]
    if not openmp:
        assert "avx2" in levels or "x86_64" not in out, levels
    got = np.load(tmp_path / "clang.npz")
    assert len(got.files) > 20
    differ = [k for k in got.files if got[k].tobytes() != gcc_npz[k].tobytes()]
    assert not differ, f"clang bits differ from gcc's: {differ}"
    # the fast kernel tests, importing the clang module: a copy of tests/ beside it
    shutil.copytree(os.path.join(ROOT, "tests"), tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "c"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    os.symlink(site / "deepseek_csa", tmp_path / "deepseek_csa")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    # (the serial module has one thread: its thread-count tests do not apply)
    sel = "not slow and not bench" + ("" if openmp else " and not threadpoolctl")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-k", sel] + FAST_TESTS,
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in tail
