"""`make mutants`: plants small, realistic bugs one at a time and runs, for each, the
tests that claim to cover what it breaks.  A mutant is killed when those tests fail.

Mutants live in tests/mutants/m_*.py, each file a list

    MUTANTS = [
        dict(name="attn_scale", kind="c", define="CSA_MUTANT_ATTN_SCALE",
             targets=["tests/test_attn.py", "tests/c/driver.c::sparse_attn"],
             what="softmax scale off by a relative 1e-4 in the tuned body"),
        dict(name="swap_noop", kind="py", targets=["tests/test_x.py::test_y"],
             what="...", apply=fn),          # fn() monkeypatches; no arguments
    ]

Targets are pytest paths / node ids (relative to the repository root), or the C
driver: "tests/c/driver.c" (every case) or "tests/c/driver.c::<kernel>" (the cases
of one kernel, by the driver's kernel name).

- "py" mutants: pytest runs in this checkout with CSA_PY_MUTANT=<file stem>:<name>;
  tests/conftest.py's pytest_configure calls the mutant's apply() (plugin.py).
- "c" mutants: `#ifdef CSA_MUTANT_X` inside a kernel's tuned body (never its `_ref`
  oracle).  The clean extension (and, when a target asks for it, the clean C
  driver) is built once into build/mutants/ and its compile and link commands kept;
  a mutant recompiles only the .c files that contain its define (directly or
  through an included header) with -DCSA_MUTANT_X into its own build dir and links
  them with the clean objects (a few seconds instead of a full build).  The tests
  run in a copy of the tree (build/mutants/tree) holding the mutant's module.

Every target is run on its own and must fail: a mutant is killed when each of its
targets fails (pytest exit status 1 / driver status 1), so a mutant listing a file
and a single test proves both.  A usage or collection error (any other status) is
reported as an error and counts as not killed.
Prints one line per mutant, then `mutants: K/N killed` and the survivors; the exit
status is nonzero when any survives.

    python tests/mutants/run.py [-k SUBSTRING] [--list] [--check-clean] [-v]
"""
import argparse
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "mutants")
WORK = os.path.join(ROOT, "build", "mutants")
DRIVER = "tests/c/driver.c"
PY = sys.executable


# ------------------------------------------------------------------ discovery

def discover():
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, "m_*.py"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location("csa_mutants_" + stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for m in mod.MUTANTS:
            m = dict(m)
            m["file"] = stem
            m["id"] = f"{stem}:{m['name']}"
            assert m.get("kind") in ("c", "py"), (m["id"], m.get("kind"))
            assert m.get("targets"), (m["id"], "no targets")
            if m["kind"] == "c":
                assert re.fullmatch(r"CSA_MUTANT_\w+", m.get("define", "")), (m["id"], m.get("define"))
            else:
                assert callable(m.get("apply")), (m["id"], "py mutant without apply()")
            out.append(m)
    ids = [m["id"] for m in out]
    assert len(set(ids)) == len(ids), "duplicate mutant names"
    return out


# ------------------------------------------------------------------ builds

def _sources_mtime(extra=()):
    files = glob.glob(os.path.join(ROOT, "csrc", "**", "*.[ch]"), recursive=True)
    files += [os.path.join(ROOT, f) for f in extra]
    return max(os.path.getmtime(f) for f in files)


def _parse_commands(lines):
    """{source: compile argv} and the link argv from a build log's command lines."""
    compiles, link = {}, None
    for line in lines:
        try:
            argv = shlex.split(line)
        except ValueError:
            continue
        if not argv or not re.search(r"(^|/)(x86_64-linux-gnu-|aarch64-linux-gnu-)?(gcc|cc|clang)(-\d+)?$",
                                     argv[0]):
            continue
        if "-c" in argv and "-o" in argv:
            src = argv[argv.index("-c") + 1]
            compiles[os.path.normpath(src)] = argv
        elif "-o" in argv:
            link = argv
    return compiles, link


class Build:
    """A clean build whose compile / link commands are kept for partial rebuilds."""

    def __init__(self, name, extra_sources=()):
        self.dir = os.path.join(WORK, name)
        self.meta = os.path.join(self.dir, "commands.json")
        self.extra = extra_sources

    def fresh(self):
        if not os.path.exists(self.meta):
            return False
        return os.path.getmtime(self.meta) > _sources_mtime(self.extra)

    def load(self):
        with open(self.meta) as f:
            d = json.load(f)
        self.compiles, self.link, self.output = d["compiles"], d["link"], d["output"]

    def save(self, compiles, link, output):
        assert compiles and link, f"{self.dir}: could not read the build commands"
        with open(self.meta, "w") as f:
            json.dump(dict(compiles=compiles, link=link, output=output), f)
        self.load()

    def affected(self, define):
        """The sources that contain `define`, directly or through a quoted #include
        (or `#define CSA_IMPL "x_impl.h"`) of a header that does."""
        inc = re.compile(r'^\s*#\s*(?:include|define\s+CSA_IMPL)\s+"([^"]+)"', re.M)
        memo = {}

        def has(path, seen):
            if path in memo:
                return memo[path]
            if path in seen or not os.path.exists(path):
                return False
            seen = seen | {path}
            text = open(path, errors="replace").read()
            hit = define in text or any(
                has(os.path.normpath(os.path.join(d, h)), seen)
                for h in inc.findall(text)
                for d in (os.path.dirname(path), os.path.join(ROOT, "csrc")))
            memo[path] = hit
            return hit

        return [s for s in self.compiles if has(os.path.join(ROOT, s), frozenset())]

    def variant(self, tag, define):
        """Builds the clean build with -D`define` in the affected sources only; returns
        (output path, affected sources, seconds)."""
        t0 = time.perf_counter()
        srcs = self.affected(define)
        if not srcs:
            raise RuntimeError(f"{define} appears in no source of {self.dir}")
        vdir = os.path.join(WORK, "variants", tag)
        shutil.rmtree(vdir, ignore_errors=True)
        os.makedirs(vdir)
        swap = {}
        for s in srcs:
            argv = list(self.compiles[s])
            o = argv.index("-o")
            obj = os.path.join(vdir, s.replace("/", "_") + ".o")
            swap[argv[o + 1]] = obj
            argv[o + 1] = obj
            argv.insert(1, "-D" + define)
            _check(subprocess.run(argv, cwd=ROOT, capture_output=True, text=True), argv)
        link = [swap.get(a, a) for a in self.link]
        out = os.path.join(vdir, os.path.basename(self.output))
        link[link.index("-o") + 1] = out
        _check(subprocess.run(link, cwd=ROOT, capture_output=True, text=True), link)
        return out, srcs, time.perf_counter() - t0


def _check(r, argv):
    if r.returncode:
        raise RuntimeError(f"build failed: {shlex.join(argv)}\n{r.stdout}{r.stderr}")


def ext_build():
    b = Build("ext")
    if b.fresh():
        b.load()
        return b
    shutil.rmtree(b.dir, ignore_errors=True)
    os.makedirs(b.dir)
    print("mutants: clean build of the extension (once; reused until csrc/ changes)", flush=True)
    r = subprocess.run([PY, "setup.py", "build_ext", "--force",
                        "--build-temp", os.path.join(b.dir, "temp"),
                        "--build-lib", os.path.join(b.dir, "lib")],
                       cwd=ROOT, capture_output=True, text=True)
    _check(r, ["setup.py", "build_ext"])
    compiles, link = _parse_commands((r.stdout + r.stderr).splitlines())
    out = link[link.index("-o") + 1]
    b.save({os.path.relpath(os.path.normpath(os.path.join(ROOT, s)), ROOT): a
            for s, a in compiles.items()}, link, out)
    return b


def driver_build():
    b = Build("driver", extra_sources=[DRIVER])
    if b.fresh():
        b.load()
        return b
    shutil.rmtree(b.dir, ignore_errors=True)
    os.makedirs(b.dir)
    print("mutants: clean build of the C driver (once)", flush=True)
    rel = os.path.relpath(b.dir, ROOT)
    target = f"{rel}/driver"
    dry = subprocess.run(["make", "-s", "-n", "-B", f"TESTC_DIR={rel}", target],
                         cwd=ROOT, capture_output=True, text=True)
    _check(dry, ["make", "-n", target])
    _check(subprocess.run(["make", "-s", f"TESTC_DIR={rel}", target],
                          cwd=ROOT, capture_output=True, text=True), ["make", target])
    compiles, link = _parse_commands(dry.stdout.splitlines())
    b.save(compiles, link, link[link.index("-o") + 1])
    return b


# ------------------------------------------------------------------ the tree copy

def tree_copy():
    """A copy of the checkout (sources, tests, data; no .git, builds or modules) that
    the C mutants' tests run in; made once per `make mutants`."""
    dst = os.path.join(WORK, "tree")
    shutil.rmtree(dst, ignore_errors=True)
    skip = shutil.ignore_patterns(".git", "build", ".venv", "__pycache__", ".pytest_cache",
                                  ".hypothesis", "*.so", "*.egg-info", "results")
    shutil.copytree(ROOT, dst, ignore=skip, symlinks=True)
    return dst


# ------------------------------------------------------------------ running

def split_targets(targets):
    py, drv = [], []
    for t in targets:
        if t == DRIVER or t.startswith(DRIVER + "::"):
            drv.append(t.partition("::")[2] or None)
        else:
            py.append(t)
    return py, drv


def run_pytest(cwd, targets, env, verbose):
    argv = [PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly"] + targets
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    if verbose:
        print(r.stdout[-3000:] + r.stderr[-2000:])
    return r.returncode, tail[0]


def run_driver(exe, kernels, verbose):
    for k in kernels:
        argv = [exe] + ([k] if k else [])
        r = subprocess.run(argv, capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="2"))
        if verbose:
            print(r.stdout[-3000:])
        if r.returncode:
            last = r.stdout.strip().splitlines()[-1:] or [""]
            return r.returncode, f"driver {k or 'all'}: {last[0]}"
        if re.search(r"^0 passed", r.stdout, re.M):
            return 4, f"driver {k}: no case ran (kernel name?)"
    return 0, "driver passed"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", action="append", default=[], help="only mutants whose id contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--check-clean", action="store_true",
                    help="first run every distinct target without a mutant (they must pass)")
    args = ap.parse_args(argv)

    mutants = discover()
    if args.k:
        mutants = [m for m in mutants if any(k in m["id"] for k in args.k)]
    if args.list:
        for m in mutants:
            print(f"{m['id']:40s} {m['kind']:2s} {m.get('what', '')}\n{'':43s}-> {', '.join(m['targets'])}")
        return 0

    results = []   # (mutant, status, detail, seconds)
    ext = drv = tree = None
    base_env = dict(os.environ)
    base_env.pop("CSA_PY_MUTANT", None)
    t_all = time.perf_counter()
    if args.check_clean:
        py_all = sorted({t for m in mutants for t in split_targets(m["targets"])[0]})
        r = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + py_all,
                           cwd=ROOT, env=base_env, capture_output=True, text=True)
        print("clean targets:", (r.stdout.strip().splitlines() or [""])[-1], flush=True)
        if r.returncode:
            print(r.stdout[-5000:])
            return 2
    for m in mutants:
        t0 = time.perf_counter()
        py_t, drv_t = split_targets(m["targets"])
        outcomes, build_s = [], 0.0   # (target, rc, detail)
        try:
            if m["kind"] == "py":
                if drv_t:
                    raise RuntimeError("a py mutant cannot target the C driver")
                env = dict(base_env, CSA_PY_MUTANT=m["id"])
                for t in py_t:
                    outcomes.append((t, *run_pytest(ROOT, [t], env, args.verbose)))
            else:
                if drv_t:
                    drv = drv or driver_build()
                    exe, _, s = drv.variant("driver-" + m["name"], m["define"])
                    build_s += s
                    for k in drv_t:
                        outcomes.append((DRIVER + ("::" + k if k else ""),
                                         *run_driver(exe, [k], args.verbose)))
                if py_t:
                    ext = ext or ext_build()
                    tree = tree or tree_copy()
                    so, srcs, s = ext.variant("ext-" + m["name"], m["define"])
                    build_s += s
                    shutil.copy2(so, os.path.join(tree, "deepseek_csa", os.path.basename(so)))
                    for t in py_t:
                        outcomes.append((t, *run_pytest(tree, [t], base_env, args.verbose)))
            bad = [o for o in outcomes if o[1] not in (0, 1)]
            alive = [o for o in outcomes if o[1] == 0]
            if bad:
                status = "error"
                detail = "; ".join(f"{t}: exit {rc}: {d}" for t, rc, d in bad)
            elif alive:
                status = "survived"
                detail = "passed: " + ", ".join(t for t, *_ in alive)
            else:
                status = "killed"
                detail = "; ".join(d for _, _, d in outcomes)
        except Exception as e:   # a build that fails is an error, not a kill
            status, detail = "error", str(e).splitlines()[0][:300]
        if m["kind"] == "c":
            detail = f"[build {build_s:.1f}s] {detail}"
        dt = time.perf_counter() - t0
        results.append((m, status, detail, dt))
        print(f"{status:9s} {m['id']:42s} {dt:6.1f}s  {detail}", flush=True)

    killed = [r for r in results if r[1] == "killed"]
    print(f"mutants: {len(killed)}/{len(results)} killed  ({time.perf_counter() - t_all:.0f}s)")
    for m, status, detail, _ in results:
        if status != "killed":
            print(f"  {status.upper()}: {m['id']} ({m['kind']}) {m.get('what', '')}\n"
                  f"      targets: {', '.join(m['targets'])}\n      {detail}")
    return 0 if len(killed) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
