"""`make test-hf-versions`: the transformers bridge tests under every release in
deepseek_csa.transformers.SUPPORTED_VERSIONS.

Each release is installed once (``pip install --no-deps --target``) into its own
directory under build/hf-versions/<version> and put first on PYTHONPATH, so it shadows the
venv's transformers while torch, tokenizers, huggingface-hub, ... come from the venv
(installing torch again per version would cost minutes and gigabytes).  Before a run the
release's own requirements are checked against what the venv has, so a release needing
newer dependencies fails with their names instead of a confusing test failure.  The venv's
own release runs without the overlay.  Usage: python tests/hf_versions.py [version ...]
"""
import os
import subprocess
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "build", "hf-versions")
TESTS = ["tests/test_transformers_bridge.py", "tests/test_transformers_padding.py"]


def supported():
    sys.path.insert(0, ROOT)
    import deepseek_csa.transformers as dch
    return list(dch.SUPPORTED_VERSIONS)


def overlay(v):
    d = os.path.join(CACHE, v)
    if not os.path.exists(os.path.join(d, ".complete")):
        subprocess.run(["rm", "-rf", d], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--disable-pip-version-check", "--target", d, f"transformers=={v}"],
                       check=True)
        open(os.path.join(d, ".complete"), "w").close()
    return d


def unmet(d, v):
    """Requirements of transformers==v (from its metadata in d) the venv does not meet."""
    from packaging.requirements import Requirement
    dist = next(metadata.distributions(path=[d], name="transformers"))
    bad = []
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{req} (not installed)")
            continue
        if have not in req.specifier:
            bad.append(f"{req} (venv has {have})")
    return bad


def main(argv):
    versions = argv or supported()
    try:
        here = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        here = None
    failed = []
    for v in versions:
        env = dict(os.environ)
        if v != here:
            d = overlay(v)
            bad = unmet(d, v)
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
