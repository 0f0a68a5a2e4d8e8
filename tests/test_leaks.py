"""Reference counts and memory stay flat over 10**4 calls of every kernel.

Each kernel of the registry is called 10**4 times, cycling through every case the
bad-input generator makes for it (valid calls, odd layouts that make the glue copy,
and every error path), with the same argument objects each time.  After a warm-up
round, we require:

- ``sys.getrefcount`` of every array / tensor argument unchanged (a missing
  Py_DECREF on some path would add one per call);
- ``sys.getallocatedblocks()`` (live Python objects) flat within a small slack;
- tracemalloc's traced memory (NumPy reports its data buffers to tracemalloc) and the
  process RSS (/proc/self/statm) flat within a tolerance far below what 10**4 leaked
  arrays would take.

Run ``pytest -s tests/test_leaks.py`` to see the figures.
"""
import gc
import os
import sys
import time
import tracemalloc

import numpy as np
import pytest

from conftest import threads
from hardening_cases import cases
from hardening_registry import ENTRIES

CALLS = int(os.environ.get("CSA_LEAK_CALLS", "10000"))
PAGE = os.sysconf("SC_PAGE_SIZE")
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


def traced():
    """Bytes tracemalloc holds, without the records of FAILED huge allocations: NumPy
    tracks a failed np.zeros of 2**40 elements as if it had succeeded (its 4 TiB stay
    in the total), which would drown any real leak."""
    return sum(t.size for t in tracemalloc.take_snapshot().traces if t.size < 1 << 36)


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _leak_sizes(entry):
    # Small (fast) calls, but with arrays of a few KB so a leaked buffer shows.
    s = {k: min(hi, max(lo, 3)) for k, (lo, hi) in entry.sizes.items()}
    for big in ("D", "Di", "CD", "blk"):
        if big in entry.sizes:
            s[big] = entry.sizes[big][1]
    return entry.make_sizes(s)


def _tracked(vals):
    import torch
    return [(k, v) for k, v in vals.items() if isinstance(v, (np.ndarray, torch.Tensor))]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_flat_memory_and_refcounts(entry, capsys):
    if not entry.available():
        pytest.skip(f"deepseek_csa.{entry.func} does not exist yet")
    sizes = _leak_sizes(entry)
    vals = entry.build(sizes, 3)
    cs = [c for c in cases(entry, sizes, vals, np.random.default_rng(4))
          if "huge zero-stride" not in c.desc]      # each tries (and fails) a 2**40 allocation
    fn = entry.resolve()
    calls = []
    for c in cs:
        args, kwargs = entry.split(c.vals)
        calls.append((c, args, kwargs))

    def one(i):
        c, args, kwargs = calls[i % len(calls)]
        try:
            if entry.call is not None:
                entry.call(fn, args, kwargs, c.sizes or sizes)
            else:
                fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - error paths are part of the loop
            pass

    with threads(1):
        for i in range(2 * len(calls)):          # warm-up: caches, lazy imports, pools
            one(i)
        gc.collect()
        refs0 = [[sys.getrefcount(v) for _, v in _tracked(c.vals)] for c, _, _ in calls]
        tracemalloc.start()
        gc.collect()
        blocks0, mem0, rss0 = sys.getallocatedblocks(), traced(), rss()
        t0 = time.perf_counter()
        for i in range(CALLS):
            one(i)
        dt = time.perf_counter() - t0
        gc.collect()
        blocks1, mem1, rss1 = sys.getallocatedblocks(), traced(), rss()
        tracemalloc.stop()
        refs1 = [[sys.getrefcount(v) for _, v in _tracked(c.vals)] for c, _, _ in calls]

    n_err = sum(1 for c in cs if c.expect.kind == "raise")
    with capsys.disabled():
        print(f"\n[leaks] {entry.name}: {CALLS} calls over {len(calls)} cases ({n_err} error "
              f"paths) in {dt:.2f}s: live blocks {blocks1 - blocks0:+d}, traced "
              f"{(mem1 - mem0) / 1024:+.1f} KiB, RSS {(rss1 - rss0) / 2**20:+.2f} MiB")
    grew = [(c.desc, k, r0, r1) for (c, _, _), a, b in zip(calls, refs0, refs1)
            for (k, _), r0, r1 in zip(_tracked(c.vals), a, b) if r0 != r1]
    assert not grew, f"reference counts changed: {grew[:10]}"
    # One leaked object per call would be >= 10**4 blocks and >= 1 MiB traced (a leaked
    # array's buffer: >= 10 MiB); the slack absorbs caches that fill once.
    assert blocks1 - blocks0 < 2000, f"{blocks1 - blocks0} more live Python objects"
    assert mem1 - mem0 < 512 * 1024, f"traced memory grew by {(mem1 - mem0) / 1024:.0f} KiB"
    if not UNDER_ASAN:       # ASan's quarantine keeps freed memory resident on purpose
        assert rss1 - rss0 < 8 * 2**20, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB"


def test_leak_check_detects_a_leak():
    """The check itself: a deliberately leaking Python 'kernel' is caught."""
    kept = []
    x = np.ones(1024, np.float32)
    tracemalloc.start()
    gc.collect()
    b0, m0 = sys.getallocatedblocks(), tracemalloc.get_traced_memory()[0]
    r0 = sys.getrefcount(x)
    for _ in range(CALLS):
        kept.append((x, x.copy()))
    b1, m1 = sys.getallocatedblocks(), tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert sys.getrefcount(x) - r0 == CALLS
    assert b1 - b0 >= 500 and m1 - m0 >= 256 * 1024
