"""Bad input for every public kernel: a clear Python exception naming the argument (or
the documented result), inputs unchanged, never a crash.

The kernels and their parameters come from tests/hardening_registry.py; the
mutations (wrong dtype, rank, shape, layout, writeability, alignment, values,
indices, ints, reals, zero-size and absurd sizes) from tests/hardening_cases.py.
Hypothesis draws the sizes and values of the valid call each mutation starts from;
every mutation runs at every draw.  The last test prints how many distinct cases
ran (``pytest -s tests/test_hardening.py`` shows it; so does the report).
"""
import collections
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import deepseek_csa as dc
from conftest import threads
from hardening_cases import cases, run_case
from hardening_registry import ENTRIES, KNOWN, BY_NAME, known_issue

CASES = set()                       # distinct case descriptions that ran
RUNS = collections.Counter()        # executions per entry
FAILS = []

# No shrinking: each example already runs every mutation, and the failure report
# lists the cases that misbehaved with their sizes.
SETTINGS = settings(max_examples=int(os.environ.get("CSA_HARDEN_EXAMPLES", "10")),
                    deadline=None, derandomize=True, database=None, print_blob=False,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))


def _sizes_strategy(entry):
    return st.fixed_dictionaries({k: st.integers(lo, hi) for k, (lo, hi) in entry.sizes.items()})


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_bad_inputs(entry):
    if not entry.available():
        pytest.skip(f"deepseek_csa.{entry.func} does not exist yet")

    @SETTINGS
    @given(drawn=_sizes_strategy(entry), seed=st.integers(0, 2**31 - 1))
    def run(drawn, seed):
        sizes = entry.make_sizes(drawn)
        vals = entry.build(sizes, seed)
        rng = np.random.default_rng(seed + 1)
        failures = []
        for case in cases(entry, sizes, vals, rng):
            CASES.add(case.desc)
            RUNS[entry.name] += 1
            why = run_case(entry, case, sizes)
            if why and not known_issue(entry.name, case.desc):
                failures.append(f"{case.desc}: {why}")
        if failures:
            FAILS.extend(failures)
            raise AssertionError(f"{len(failures)} cases misbehaved at sizes {sizes}:\n  "
                                 + "\n  ".join(failures[:40]))

    # One OpenMP thread: on a loaded 2-core machine every tiny parallel region can wait a
    # scheduler tick for its second thread.  The crash-guard subprocess below and
    # test_threads.py run the same kernels with several threads.
    with threads(1):
        run()


def _known_issue_reproduces(entry_name, pattern):
    """(cases matching pattern that ran, the misbehaviours among them)."""
    import re
    entry = BY_NAME[entry_name]
    bad, ran = [], 0
    for pick in (0, 1):
        sizes = entry.make_sizes({k: r[pick] for k, r in entry.sizes.items()})
        vals = entry.build(sizes, 5)
        for case in cases(entry, sizes, vals, np.random.default_rng(6)):
            if re.search(pattern, case.desc):
                ran += 1
                w = run_case(entry, case, sizes)
                if w:
                    bad.append(f"{case.desc}: {w}")
    return ran, bad


def test_known_issues_still_misbehave():
    """Each entry of hardening_registry.KNOWN (a misbehaviour found and not fixed, which
    test_entry tolerates) must still match cases and still misbehave on them: a fixed
    one or a stale pattern fails here, so the list cannot silently excuse a
    regression.  (A loop, not a parametrization: with KNOWN empty, as now, this is one
    passing test, not a collected-and-skipped empty parameter set.)"""
    stale = []
    for entry_name, pattern, why in KNOWN:
        assert entry_name in BY_NAME, f"KNOWN names an unknown entry {entry_name!r}"
        if not BY_NAME[entry_name].available():
            continue
        ran, bad = _known_issue_reproduces(entry_name, pattern)
        if not ran:
            stale.append(f"{entry_name}: no case matches {pattern!r}")
        elif not bad:
            stale.append(f"{entry_name}: {pattern!r} no longer misbehaves ({why}): delete its line")
    assert not stale, "\n".join(stale)


# ---------------------------------------------------------------- beyond the table

def test_byte_sizes_beyond_64_bits_cannot_reach_a_kernel():
    """Shapes whose byte size overflows 64 bits: NumPy and torch refuse to build them
    (even from zero strides), so no kernel can be handed one; the largest shapes they
    allow are exercised per kernel as 'huge zero-stride dim' cases."""
    import torch
    base = np.zeros(4, np.float32)
    for shape in [(2**62, 4), (2**31, 2**31, 4), (2**63 - 1, 1)]:
        with pytest.raises((ValueError, MemoryError)):
            np.lib.stride_tricks.as_strided(base, shape=shape, strides=(0,) * len(shape))
    with pytest.raises(RuntimeError):
        torch.zeros(1).expand(2**62, 2**3)
    CASES.add("*|shapes beyond 2**64 bytes")


def test_huge_ints_whose_product_overflows():
    """Size ints whose product overflows int64 in C (batch * seqlen * window ...)."""
    ran = 0
    for e in ENTRIES:
        if not e.available():
            continue
        from hardening_registry import Int
        ints = [n for n, p in e.params.items() if isinstance(p, Int) and (p.size_like or p.huge_ok)]
        if len(ints) < 2:
            continue
        sizes = e.make_sizes({k: v[1] for k, v in e.sizes.items()})
        for big in (2**31, 2**32 + 1, 2**40, 2**62):
            vals = e.build(sizes, 0)
            for n in ints:
                vals[n] = big
            with pytest.raises((ValueError, MemoryError, OverflowError, IndexError)) as err:
                e.invoke(vals, sizes)      # a call that returns accepted an overflowed size
            assert len(str(err.value)) > 10, (e.name, big, str(err.value))
            CASES.add(f"{e.name}|{'+'.join(ints)}|all huge|{big}")
            ran += 1
    if not ran:
        pytest.skip("no kernel with several size ints yet")


def test_apply_rope_tail_wider_than_x():
    """2 * cos.shape[1] > x.shape[-1]: rejected before any write."""
    x = np.ones((1, 3, 2, 6), np.float32)
    c = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="'cos'"):
        dc.apply_rope(x, c, c)
    assert (x == 1).all()
    CASES.add("apply_rope|cos|rotates more features than x has")


def test_written_overlapping_strides_rejected():
    """A written array whose elements alias (as_strided with a zero or short stride)
    would make the kernel's answer depend on its write order: refused."""
    buf = np.zeros(64, np.float32)
    ov = np.lib.stride_tricks.as_strided(buf, shape=(4, 8), strides=(8, 4))  # rows overlap
    with pytest.raises(ValueError, match="overlap"):
        dc.rms_norm(np.ones((4, 8), np.float32), out=ov)
    with pytest.raises(ValueError, match="overlap"):
        dc.apply_rope(ov[None], np.ones((4, 4), np.float32), np.ones((4, 4), np.float32))
    assert (buf == 0).all()
    CASES.update({"rms_norm|out|overlapping strides", "apply_rope|x|overlapping strides"})


def test_list_written_in_place_is_refused():
    """Writing into the temporary copy of a list would be lost silently."""
    x = np.ones((1, 2, 4), np.float32)
    lst = [[[np.float32(1)] * 4] * 2]
    with pytest.raises(TypeError, match="'x'"):
        dc.apply_rope(lst, np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    with pytest.raises(TypeError, match="'out'"):
        dc.rms_norm(x, out=x.tolist())
    CASES.update({"apply_rope|x|list of float32", "rms_norm|out|list of float32"})


def test_rope_table_parameters_that_float32_cannot_hold():
    """A factor of 1e-50 is positive and finite in double, 0 in float32: NaN tables."""
    for kw, word in [(dict(factor=1e-50), "factor"), (dict(factor=1e40), "factor"),
                     (dict(beta_fast=1e-60), "beta_fast"), (dict(beta_slow=1e300), "beta_slow"),
                     (dict(base=1e300), "base")]:
        with pytest.raises(ValueError, match=word):
            dc.rope_table(8, 4, base=kw.pop("base", 1e4), original_seq_len=100, **kw)
        CASES.add(f"rope_table|{word}|not representable in float32")


def test_messages_format_their_numbers():
    """No printf directive left unformatted in a message (PyErr_Format has no %g)."""
    msgs = []
    for call in (lambda: dc.rms_norm(np.ones(3, np.float32), eps=-1.0),
                 lambda: dc.rope_table(8, 4, base=0.5),
                 lambda: dc.rope_table(8, 4, base=1e4, factor=-2.0)):
        with pytest.raises(ValueError) as e:
            call()
        msgs.append(str(e.value))
    for m in msgs:
        assert "%" not in m, m
    assert "-1" in msgs[0] and "0.5" in msgs[1] and "-2" in msgs[2]


def test_subprocess_survives_every_case_kind():
    """Crash guard: the whole table once more in a child process, with the default
    OpenMP threads (the table test above runs with one), at the best ISA level and at
    the scalar 'ref' level (the oracle kernels, which users can select), so a
    segfault is reported as a failure instead of taking pytest down."""
    code = textwrap.dedent("""
        import numpy as np, deepseek_csa as dc
        from hardening_registry import ENTRIES, known_issue
        from hardening_cases import cases, run_case
        n = bad = 0
        for isa, e in [(i, e) for i in (dc.best_isa(), 'ref') for e in ENTRIES]:
            dc.set_isa(isa)
            if not e.available():
                continue
            sizes = e.make_sizes({k: min(hi, lo + 2) for k, (lo, hi) in e.sizes.items()})
            vals = e.build(sizes, 7)
            for c in cases(e, sizes, vals, np.random.default_rng(8)):
                n += 1
                why = run_case(e, c, sizes)
                if why and not known_issue(e.name, c.desc):
                    bad += 1
                    print('FAIL', c.desc, why)
        print('RAN', n, 'BAD', bad)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, f"child died with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "BAD 0" in r.stdout, r.stdout[-5000:]


def test_private_pool_step_corrupt_ratio_raises_cleanly():
    if not hasattr(dc, "Compressor"):
        pytest.skip("no Compressor yet")
    from deepseek_csa import _core
    comp = dc.Compressor(2, 4, 8, overlap=True)
    args = [4, 1, 8, comp._kv, comp._score, comp._prev_kv, comp._prev_score, comp._pos,
            None, None, 1e-6, None, None, 0, 0, 0, 0]
    _core._pool_state(*args)                      # the valid state is accepted
    one = np.zeros((2, 1, 16), np.float32)
    for i, bad in [(0, 0), (14, 9), (15, 99), (16, 1), (7, comp._kv)]:
        corrupt = list(args)
        corrupt[i] = bad                          # ratio 0, quant code, quant_d, pack, pos
        with pytest.raises((ValueError, RuntimeError, TypeError)):
            _core._pool_state(*corrupt)
    with pytest.raises(TypeError, match="state"):  # only the capsule is a state
        _core._pool_step(tuple(args), one, one, 0)
    with pytest.raises(TypeError, match="state"):
        _core._pool_prefill(None, one, one)
    assert comp.step(one, one, 0) is None


def test_isa_controls_reject_bad_levels():
    before = dc.get_isa()
    try:
        for bad in ("x", 1.5, None, True, -1, "AVX512 "):
            with pytest.raises((ValueError, TypeError), match="set_isa"):
                dc.set_isa(bad)
            assert dc.get_isa() == before
            CASES.add(f"set_isa|level|{bad!r}")
    finally:
        dc.set_isa(before)


def test_sanitizer_build_is_live():
    """Under `make asan` (sanitizer runtimes preloaded) the extension must really be the
    instrumented build, or a clean run would prove nothing."""
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("not a sanitizer run (make asan)")
    data = open(dc._core.__file__, "rb").read()
    assert b"__asan_report" in data and b"__ubsan_handle" in data


def test_zz_report_case_count(capsys):
    """Prints the number of distinct bad-input cases this run tried (and must reach)."""
    if not CASES:
        pytest.skip("the table tests did not run in this session")
    avail = [e.name for e in ENTRIES if e.available()]
    with capsys.disabled():
        print(f"\n[hardening] {len(CASES)} distinct bad-input cases over {len(avail)} entries "
              f"({', '.join(avail)}); {sum(RUNS.values())} executions; "
              f"{len(FAILS)} misbehaved")
    # the bar (500) once every kernel of the table exists; pro rata before that
    assert len(CASES) >= (500 if len(avail) == len(ENTRIES) else 100 * len(avail))

