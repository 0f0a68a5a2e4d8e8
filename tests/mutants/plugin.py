"""The pytest side of `make mutants`: plants one Python-level bug for a whole run.

tests/conftest.py calls apply_from_env() from its pytest_configure hook, i.e. before
any test module is imported.  With CSA_PY_MUTANT=<file stem>:<name> set (the runner,
tests/mutants/run.py, sets it), the mutant `name` of tests/mutants/<file stem>.py is
looked up and its apply() called; apply() monkeypatches (a module attribute, a
method) and takes no arguments.  Unset, nothing happens.  A name that does not exist
is a usage error (the run fails with exit status 4, which the runner reports as an
error, never as a kill).
"""
import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def load(stem):
    """tests/mutants/<stem>.py as a module (by path: tests/mutants is not a package)."""
    path = os.path.join(HERE, stem + ".py")
    spec = importlib.util.spec_from_file_location("csa_mutants_" + stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def find(stem, name):
    for m in load(stem).MUTANTS:
        if m["name"] == name:
            return m
    raise KeyError(name)


def apply_from_env():
    want = os.environ.get("CSA_PY_MUTANT")
    if not want:
        return None
    stem, _, name = want.partition(":")
    try:
        m = find(stem, name)
    except (OSError, KeyError) as e:
        raise pytest.UsageError(f"CSA_PY_MUTANT={want!r}: no such mutant ({e!r})")
    if m.get("kind") != "py":
        raise pytest.UsageError(f"CSA_PY_MUTANT={want!r} is a {m.get('kind')!r} mutant, not 'py'")
    m["apply"]()
    return m
