"""Where the tests find DeepSeek's released inference code (test data, never copied into
the repo), and how they load the V4.1 file on the CPU.

The files sit beside the checkout, in ``<repo>/../shared/reference/`` (its README lists
them; from a git worktree, beside the main checkout): ``deepseek-v4/inference/{model.py, kernel.py, convert.py, generate.py,
config.json}`` and ``deepseek-v41/inference/model.py``.  Two environment variables
override the location (a ``model.py`` or the folder holding it):

* ``DEEPSEEK_MODEL_PY``      the V4 (V4-Flash / V4-Pro) ``inference/model.py``; its
  folder is also where ``convert.py`` is looked for;
* ``DEEPSEEK_MODEL_PY_V41``  the V4.1-Flash ``inference/model.py``.

A test that needs a file calls ``v4_model_py()`` / ``v4_convert_py()`` /
``v41_model_py()``: the path, or ``pytest.skip`` with a reason naming where the file was
looked for and which variable to set (``find_v4(filename)``: the path or None, and where).

``load_v41(path)`` imports the V4.1 file, whose relative imports (``.kernel_cpu``,
``.engram``, ``.vision``, ``.image_processor``) are not shipped with it, with the
stand-ins of ``tests/v41_standins`` in their place.
"""
import importlib.util
import os
import re
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main_checkout(root):
    """The main checkout of a git worktree (``.git`` is then a file naming
    ``<main>/.git/worktrees/<name>``); root itself otherwise."""
    try:
        with open(os.path.join(root, ".git")) as f:
            line = f.read().strip()
    except (IsADirectoryError, FileNotFoundError, NotADirectoryError, PermissionError):
        return root
    m = re.match(r"gitdir:\s*(.+)", line)
    if not m:
        return root
    gitdir = os.path.normpath(os.path.join(root, m.group(1)))
    parts = gitdir.split(os.sep)
    if len(parts) > 3 and parts[-2] == "worktrees" and parts[-3] == ".git":
        return os.sep.join(parts[:-3]) or os.sep
    return root


def _reference_dir():
    """``<repo>/../shared/reference``; from a git worktree, the main checkout's when the
    worktree has none beside it."""
    for root in (ROOT, _main_checkout(ROOT)):
        d = os.path.normpath(os.path.join(root, "..", "shared", "reference"))
        if os.path.isdir(d):
            return d
    return os.path.normpath(os.path.join(ROOT, "..", "shared", "reference"))


REFERENCE = _reference_dir()
V4_DEFAULT = os.path.join(REFERENCE, "deepseek-v4", "inference", "model.py")
V41_DEFAULT = os.path.join(REFERENCE, "deepseek-v41", "inference", "model.py")

ENV_V4 = "DEEPSEEK_MODEL_PY"
ENV_V41 = "DEEPSEEK_MODEL_PY_V41"


def _locate(env, default, what, filename="model.py"):
    """(path or None, where it was looked for)."""
    given = os.environ.get(env)
    if given:
        p = os.path.join(given, "model.py") if os.path.isdir(given) else given
        if filename != "model.py":
            p = os.path.join(os.path.dirname(p), filename)
        return (p if os.path.isfile(p) else None), f"{p} (from {env}={given})"
    p = os.path.join(os.path.dirname(default), filename)
    return (p if os.path.isfile(p) else None), p


def _require(env, default, what, filename="model.py"):
    path, where = _locate(env, default, what, filename)
    if path is None:
        pytest.skip(f"{what} not found at {where}: put DeepSeek's released files in "
                    f"{os.path.dirname(os.path.dirname(default))} (see "
                    f"{os.path.join(REFERENCE, 'README.md')}) or set {env} to the "
                    f"released inference/model.py")
    return path


def v4_model_py():
    """The released V4 ``inference/model.py``, or skip."""
    return _require(ENV_V4, V4_DEFAULT, "DeepSeek-V4's released inference/model.py")


def v4_convert_py():
    """The released V4 ``inference/convert.py`` (beside its model.py), or skip."""
    return _require(ENV_V4, V4_DEFAULT, "DeepSeek-V4's released inference/convert.py",
                    "convert.py")


def find_v4(filename="model.py"):
    """(path of the released V4 ``inference/<filename>`` or None, where it was looked
    for), without skipping: for the benchmarks, which say what they did not run."""
    return _locate(ENV_V4, V4_DEFAULT, "", filename)


def v41_model_py():
    """The released V4.1 ``inference/model.py``, or skip."""
    return _require(ENV_V41, V41_DEFAULT, "DeepSeek-V4.1's released inference/model.py")


_LOADED = 0


def load_v41(path):
    """Imports the released V4.1 ``model.py`` as ``<package>.model`` of a fresh package
    whose ``kernel_cpu``, ``engram``, ``vision`` and ``image_processor`` are the test
    stand-ins (tests/v41_standins).  Each call imports the file afresh (its module
    globals -- world_size, default_dtype, shared_attn -- belong to one model)."""
    global _LOADED
    from v41_standins import engram, image_processor, kernel_cpu, vision
    _LOADED += 1
    pkg = f"deepseek_v41_released_{_LOADED}"
    p = types.ModuleType(pkg)
    p.__path__ = [os.path.dirname(os.path.abspath(path))]
    p.__package__ = pkg
    sys.modules[pkg] = p
    for name, m in (("kernel_cpu", kernel_cpu), ("engram", engram), ("vision", vision),
                    ("image_processor", image_processor)):
        sys.modules[f"{pkg}.{name}"] = m
        setattr(p, name, m)
    spec = importlib.util.spec_from_file_location(f"{pkg}.model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return mod
