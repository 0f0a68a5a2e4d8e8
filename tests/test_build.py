"""The package installs and works with a C compiler that has no OpenMP.

`pip install .` with a compiler wrapper that rejects -fopenmp (tests/c/cc-without-openmp,
standing in for Apple's clang without libomp) must give a working serial module that
says, once, that it is serial, and computes the same bits as the OpenMP build.

It builds the whole extension (about a minute on 2 cores), so it runs only when
CSA_TEST_NOOMP=1 (`make test-noomp`, also in .ci/run)."""
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(os.environ.get("CSA_TEST_NOOMP") != "1",
                                reason="builds the package without OpenMP (~1 min): "
                                       "make test-noomp")

# Runs a few kernels on fixed inputs and saves the outputs; the same script runs
# against both builds.
PROBE = r"""
import sys, warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import deepseek_csa as dc
import numpy as np
info = dc.build_info()
msgs = [str(x.message) for x in w if "OpenMP" in str(x.message)]
print("OPENMP", info["openmp"], "THREADS", dc.max_threads(), "WARNINGS", len(msgs))
print("FILE", dc._core.__file__)
rng = np.random.default_rng(0)
out = {}
x = rng.standard_normal((37, 193)).astype(np.float32)
out["norm"] = dc.rms_norm(x, weight=rng.standard_normal(193).astype(np.float32), eps=1e-6)
B, S, H, D, N, K = 1, 5, 16, 64, 97, 23
q = rng.standard_normal((B, S, H, D)).astype(np.float32)
kv = rng.standard_normal((B, N, D)).astype(np.float32)
sink = rng.standard_normal(H).astype(np.float32)
idx = rng.integers(-1, N, (B, S, K)).astype(np.int32)
out["attn"] = dc.sparse_attn(q, kv, sink, idx, D ** -0.5)
xs = rng.standard_normal((8, 256)).astype(np.float32)
out["had"] = dc.hadamard(xs)
out["fp8"] = dc.fp8_round(xs.copy(), 64)
np.savez(sys.argv[1], **out)
"""


def _run_probe(pythonpath, npz, tmp):
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", PROBE, npz], cwd=tmp, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_pip_install_without_openmp(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    shutil.copytree(os.path.join(ROOT, "csrc"), src / "csrc")
    shutil.copytree(os.path.join(ROOT, "deepseek_csa"), src / "deepseek_csa",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    cc = os.path.join(ROOT, "tests", "c", "cc-without-openmp")
    # LDSHARED as Python was built with it, its compiler replaced by the wrapper
    ldshared = shlex.split(sysconfig.get_config_var("LDSHARED") or "cc -shared")
    env = dict(os.environ, CC=cc, LDSHARED=" ".join([cc] + ldshared[1:]))
    env["CSA_TORCH_NATIVE"] = "0"   # the C build is under test; the torch C++ module is not
    env.pop("CSA_OPENMP", None)
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation",
                        "--no-deps", "--no-index", "--target", str(site), str(src)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "cannot build OpenMP code" in log, "the build did not say it is serial"
    assert "cc-without-openmp" in log, "the wrapper compiler was not used"

    serial = _run_probe(str(site), str(tmp_path / "serial.npz"), tmp_path)
    assert "OPENMP False THREADS 1 WARNINGS 1" in serial, serial
    assert str(site) in serial, serial

    threaded = _run_probe(ROOT, str(tmp_path / "omp.npz"), tmp_path)
    assert "OPENMP True" in threaded and "WARNINGS 0" in threaded, threaded

    import numpy as np
    a, b = np.load(tmp_path / "serial.npz"), np.load(tmp_path / "omp.npz")
    for k in a.files:
        assert a[k].tobytes() == b[k].tobytes(), k
