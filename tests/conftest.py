"""Shared test helpers: ISA levels, thread limits, inputs-unchanged checks, error budgets.

The torch references live in deepseek_csa.reference (tests/ref_*.py name them).
"""
import contextlib

import numpy as np
import pytest

import deepseek_csa as dc


def pytest_configure(config):
    """`make mutants`: with CSA_PY_MUTANT=<file stem>:<name> set, plants that Python-level
    bug (tests/mutants/plugin.py) before any test module is imported."""
    from mutants.plugin import apply_from_env
    apply_from_env()

ALL_LEVELS = dc.ISA_LEVELS
# Every level this CPU has.  'amx' differs from 'avx512' only where it uses AVX512_BF16
# dot products or AMX-BF16 tiles (bfloat16 attention and indexer, and fp4_gemm, whose
# FP8 x FP4 products are exact in bf16), so tests of the other float32 kernels skip it.
ISA_LEVELS_BF16 = list(ALL_LEVELS[:ALL_LEVELS.index(dc.best_isa()) + 1])
ISA_LEVELS = [l for l in ISA_LEVELS_BF16 if l != "amx"]


def _at_level(request):
    before = dc.get_isa()
    dc.set_isa(request.param)
    yield request.param
    dc.set_isa(before)


@pytest.fixture(params=ISA_LEVELS)
def isa(request):
    """Runs the test once per ISA level this CPU has ('ref' is the scalar oracle)."""
    yield from _at_level(request)


@pytest.fixture(params=ISA_LEVELS_BF16)
def isa_bf16(request):
    """Like `isa`, plus 'amx' (the native bfloat16 dot products) when the CPU has it."""
    yield from _at_level(request)


@pytest.fixture(scope="module")
def one_thread():
    """One thread each for torch and our kernels while a module's tests run (use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models, where on a
    shared machine an OpenMP barrier per tiny op costs more than the op; the kernels'
    results do not depend on the thread count."""
    import torch
    from threadpoolctl import threadpool_limits
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1, user_api="openmp"):
        yield
    torch.set_num_threads(n)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@contextlib.contextmanager
def isa_level(level):
    """Runs the block at one ISA level ('ref', 'base', 'avx2', 'avx512', 'amx')."""
    before = dc.get_isa()
    dc.set_isa(level)
    try:
        yield
    finally:
        dc.set_isa(before)


@contextlib.contextmanager
def threads(n):
    """Limits OpenMP (ours and torch's) to n threads, the way users do."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=n, user_api="openmp"):
        yield


def _raw_bytes(a):
    """The bytes of every element of an array, whatever its dtype and strides."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def same_bits_at_thread_counts(call, counts=(1, 2, 3)):
    """Runs call() under each OpenMP thread count in counts and asserts that what it
    returns (an array, or a tuple / list of arrays) has the same bytes every time:
    bitwise, so -0 against +0 and NaN payloads count, which np.array_equal would
    miss.  Returns the result at counts[0]."""
    def flat(r):
        return list(r) if isinstance(r, (tuple, list)) else [r]

    results = []
    for n in counts:
        with threads(n):
            results.append(flat(call()))
    first = results[0]
    for n, r in zip(counts[1:], results[1:]):
        assert len(r) == len(first)
        for i, (got, want) in enumerate(zip(r, first)):
            got, want = np.asarray(got), np.asarray(want)
            assert got.shape == want.shape and got.dtype == want.dtype, (n, i)
            assert np.array_equal(_raw_bytes(got), _raw_bytes(want)), \
                f"output {i} at {n} threads differs from {counts[0]} thread(s)"
    return first if len(first) > 1 else first[0]


@contextlib.contextmanager
def unchanged(*arrays):
    """Asserts that the arrays hold the same bits after the block (raising or not)."""
    snaps = [_raw_bytes(np.array(a, copy=True)) for a in arrays]
    try:
        yield
    finally:
        for i, (a, s) in enumerate(zip(arrays, snaps)):
            assert np.array_equal(_raw_bytes(a), s), f"input {i} was modified"


def assert_close(got, want, *, rtol=1e-5, atol=1e-6, what=""):
    """Error budget relative to a reference: |got - want| <= atol + rtol * |want|,
    NaN where the reference has NaN and the same infinities."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)],
                                  err_msg=f"{what}: infinities")
    err = np.abs(got[fin] - want[fin])
    bound = atol + rtol * np.abs(want[fin])
    if err.size and not (err <= bound).all():
        i = int(np.argmax(err - bound))
        raise AssertionError(f"{what}: {int((err > bound).sum())} of {err.size} elements outside "
                             f"atol={atol} rtol={rtol}; worst |diff|={err[i]:.3g} at ref "
                             f"{want[fin][i]:.6g}")


def bf16_round(x):
    """Rounds float32 values to bfloat16 precision (nearest-even), as float32."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().float().numpy()
