"""`make test-hf-versions`: the transformers bridge tests (every tests/test_*transformers*.py)
under every release in deepseek_csa.transformers.SUPPORTED_VERSIONS but the venv's own,
which `make test` covers.

Each release is installed once (``pip install --no-deps --target``) into its own
directory under build/hf-versions/<version> and put first on PYTHONPATH, so it shadows the
venv's transformers while torch, tokenizers, huggingface-hub, ... come from the venv
(installing torch again per version would cost minutes and gigabytes).  A requirement the
venv lacks altogether (5.25 requires ``kernels``, which requires ``tomlkit``) is installed
into the same directory, again without its dependencies, until every requirement of what
the directory holds is met by it or by the venv.  A requirement the venv has at a version
the release does not accept fails with its name instead of a confusing test failure (the
overlay never shadows a package of the venv).  The venv's own release, when named, runs
without the overlay.  Usage: python tests/hf_versions.py [version ...]
"""
import glob
import os
import subprocess
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "build", "hf-versions")
# every test file of the bridge (test_transformers_*.py, test_grad_transformers.py, ...)
TESTS = sorted(os.path.relpath(p, ROOT)
               for p in glob.glob(os.path.join(ROOT, "tests", "test_*transformers*.py")))


def supported():
    sys.path.insert(0, ROOT)
    import deepseek_csa.transformers as dch
    return list(dch.SUPPORTED_VERSIONS)


def _pip_target(d, reqs):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", d] + reqs, check=True)


def overlay(v):
    d = os.path.join(CACHE, v)
    if not os.path.exists(os.path.join(d, ".complete")):
        subprocess.run(["rm", "-rf", d], check=True)
        _pip_target(d, [f"transformers=={v}"])
        open(os.path.join(d, ".complete"), "w").close()
    # what the venv lacks altogether, one level of requirements at a time (a few rounds:
    # transformers -> kernels -> tomlkit)
    for _ in range(5):
        absent, _bad = unmet(d)
        if not absent:
            break
        _pip_target(d, absent)
    return d


def _version(d, name):
    """The version of `name` in the overlay d, else in the venv, else None."""
    for dist in metadata.distributions(path=[d], name=name):
        return dist.version
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unmet(d):
    """(absent, bad): the requirements of the distributions in d that neither d nor the
    venv has (as requirement strings for pip), and those met by neither (explained)."""
    from packaging.requirements import Requirement
    absent, bad = [], []
    for dist in metadata.distributions(path=[d]):
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = _version(d, req.name)
            if have is None:
                absent.append(f"{req.name}{req.specifier}")
                bad.append(f"{req} (not installed)")
            elif have not in req.specifier:
                bad.append(f"{req} (found {have})")
    return sorted(set(absent)), bad


def main(argv):
    try:
        here = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        here = None
    versions = argv or supported()
    if not argv and here in versions:
        # `make test` runs the same files on the venv's own release (CI runs both targets)
        print(f"== transformers {here}: the venv's own release, tested by `make test` "
              f"(python tests/hf_versions.py {here} runs it here)", flush=True)
        versions = [v for v in versions if v != here]
    failed = []
    for v in versions:
        env = dict(os.environ)
        if v != here:
            d = overlay(v)
            _absent, bad = unmet(d)
            if bad:
                print(f"== transformers {v}: the venv lacks {', '.join(bad)}", flush=True)
                failed.append(v)
                continue
            env["PYTHONPATH"] = d + os.pathsep + env.get("PYTHONPATH", "")
        print(f"== transformers {v}", flush=True)
        probe = subprocess.run([sys.executable, "-c", "import transformers; "
                                "print(transformers.__version__)"], env=env, cwd=ROOT,
                               capture_output=True, text=True)
        if probe.stdout.strip() != v:
            print(f"   imports {probe.stdout.strip() or probe.stderr[-500:]} instead", flush=True)
            failed.append(v)
            continue
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-W", "ignore::FutureWarning"] + TESTS, env=env, cwd=ROOT)
        if r.returncode:
            failed.append(v)
    if failed:
        print(f"FAILED under transformers {', '.join(failed)}")
        return 1
    print(f"bridge tests passed under transformers {', '.join(versions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
