"""Bad-input cases generated from the registry (tests/hardening_registry.py).

``cases(entry, sizes, seed)`` yields, for one valid call of the given sizes, every
mutation of ONE parameter at a time, each with what must happen:

- ``Expect.raises(types, names)``: an exception of one of ``types`` whose message
  names one of ``names`` (the mutated parameter, or another one it must agree with);
- ``Expect.same()``: a valid call with an odd layout (strided, reversed, unaligned,
  read-only, zero-stride, torch tensor, ...) that must give the result of the same
  values laid out contiguously;
- ``Expect.anything()``: valid-but-odd input (NaN, zero-size, absurdly large sizes)
  whose only contract is: no crash, no hang, inputs unchanged, a deterministic answer,
  or a clear Python exception.

``run_case`` executes one and checks it.  Every case has a description; the
distinct descriptions are what the suite counts.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple

import numpy as np

from hardening_registry import NO, Arr, Choice, Flag, Int, Real, to_numpy

I32_MAX, I32_MIN = 2**31 - 1, -2**31

ANY_ERR = (ValueError, TypeError, MemoryError, OverflowError, IndexError)


@dataclasses.dataclass
class Expect:
    kind: str                          # 'raise' | 'same' | 'anything'
    types: Tuple[type, ...] = ()
    names: Tuple[str, ...] = ()

    @staticmethod
    def raises(types, *names):
        return Expect("raise", types if isinstance(types, tuple) else (types,), names)

    @staticmethod
    def same():
        return Expect("same")

    @staticmethod
    def anything():
        return Expect("anything")


@dataclasses.dataclass
class Case:
    desc: str                          # entry|param|mutation|detail, no sizes or seeds
    vals: dict
    expect: Expect
    sizes: Optional[dict] = None       # when the mutation changed the sizes
    guards: tuple = ()                 # (buffer, mask) pairs whose unmasked part must stay


# ---------------------------------------------------------------- layouts

def copy_vals(vals):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in vals.items()}


def strided(a, step=2):
    """Same values, every `step`-th element of a larger buffer on every axis; returns
    (view, buffer, mask of the view's elements in the buffer)."""
    shape = tuple(n * step + 1 for n in a.shape)
    buf = np.full(shape, 77, dtype=a.dtype) if a.dtype != object else np.empty(shape, object)
    sl = tuple(slice(1, 1 + n * step, step) for n in a.shape)
    v = buf[sl]
    v[...] = a
    mask = np.zeros(shape, bool)
    mask[sl] = True
    return v, buf, mask


def tail_view(a, pad=3):
    """Same values as the last `a.shape[-1]` columns of a wider array (x[..., -n:])."""
    buf = np.full(a.shape[:-1] + (a.shape[-1] + pad,), 55, dtype=a.dtype)
    v = buf[..., pad:]
    v[...] = a
    mask = np.zeros(buf.shape, bool)
    mask[..., pad:] = True
    return v, buf, mask


def reversed_view(a, axis):
    buf = np.ascontiguousarray(np.flip(a, axis))
    return np.flip(buf, axis)


def unaligned(a):
    raw = np.zeros(a.nbytes + a.itemsize + 1, np.uint8)
    v = raw[1:1 + a.nbytes].view(a.dtype).reshape(a.shape)
    v[...] = a
    assert not v.flags.aligned or a.itemsize == 1 or a.size == 0
    return v


def readonly(a):
    c = a.copy()
    c.setflags(write=False)
    return c


def byteswapped(a):
    return a.astype(a.dtype.newbyteorder(">"))


def zero_stride(a, axis=0):
    """Writeable view repeating a's first slice along `axis` with stride 0."""
    base = np.ascontiguousarray(np.take(a, [0], axis=axis))
    strides = list(base.strides)
    strides[axis] = 0
    return np.lib.stride_tricks.as_strided(base, shape=a.shape, strides=strides, writeable=True)


def huge_view(a, axis, n):
    """A read-only array whose `axis` has length n with stride 0 over a's first slice."""
    base = np.ascontiguousarray(np.take(a, [0], axis=axis) if a.shape[axis] else
                                np.zeros(a.shape[:axis] + (1,) + a.shape[axis + 1:], a.dtype))
    shape = list(a.shape)
    shape[axis] = n
    strides = list(base.strides)
    strides[axis] = 0
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides, writeable=False)


def torch_of(a):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a))


def torch_strided(a):
    import torch
    v, buf, _ = strided(a)
    return torch.from_numpy(buf)[tuple(slice(1, 1 + n * 2, 2) for n in a.shape)]


try:
    from ml_dtypes import bfloat16 as BF16
except ImportError:  # pragma: no cover
    BF16 = None

BAD_DTYPES = {
    "f": [np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_, np.complex64, object],
    "i": [np.int64, np.int16, np.uint32, np.int8, np.float32, np.float64, np.bool_, object],
    "b": [np.int32, np.uint8, np.float32, object],
}


def _kind(dtype):
    return "b" if dtype == np.bool_ else ("i" if dtype.kind in "iu" else "f")


def _values_like(p: Arr, shape, sizes, rng):
    if p.index is not None:
        lo, hi = p.index(sizes)
        if hi < lo:
            return np.full(shape, lo, p.dtype)
        return rng.integers(lo, hi + 1, size=shape).astype(p.dtype)
    if p.dtype == np.bool_:
        return rng.random(shape) < 0.5
    return rng.standard_normal(shape).astype(p.dtype)


# ---------------------------------------------------------------- the generator

def cases(entry, sizes, vals, rng):
    """Every one-parameter mutation of the valid call `vals` (sizes `sizes`)."""
    with np.errstate(all="ignore"):         # casting NaN/inf to int for dtype cases
        yield from _cases(entry, sizes, vals, rng)


def _cases(entry, sizes, vals, rng):
    E = entry.name
    params = entry.params

    def d(*parts):
        return "|".join([E] + [str(p) for p in parts])

    def with_(name, value, desc, expect, **kw):
        v = copy_vals(vals)
        if value is NO:
            v[name] = NO
        else:
            v[name] = value
        return Case(desc, v, expect, **kw)

    def users(sym):
        return tuple(entry.symbol_users(sym)) + tuple(n for n in params if n == sym)

    # ---- call-level
    yield Case(d("*", "valid"), copy_vals(vals), Expect.same())
    # CPython's own parser may count arguments before it looks at names
    yield Case(d("*", "unknown keyword"), dict(copy_vals(vals), bogus_kw=1),
               Expect.raises(TypeError, "bogus_kw", "arguments"))
    for name in entry.positional:
        p = params[name]
        required = not (isinstance(p, Arr) and p.optional)
        if required:
            yield with_(name, NO, d(name, "missing"), Expect.raises(TypeError, name))

    for name, p in params.items():
        v0 = vals[name]
        if isinstance(p, Arr):
            yield from _array_cases(entry, name, p, v0, vals, sizes, rng, d, with_, users)
        elif isinstance(p, Int):
            yield from _int_cases(entry, name, p, v0, d, with_)
        elif isinstance(p, Real):
            yield from _real_cases(name, p, v0, d, with_)
        elif isinstance(p, Choice):
            for bad, t in (("nope", ValueError), ("", ValueError), (None, (TypeError, ValueError)),
                           (1, (TypeError, ValueError)), (b"x", (TypeError, ValueError))):
                if bad is None and p.none_ok:
                    yield with_(name, None, d(name, "None (default)"), Expect.anything())
                    continue
                yield with_(name, bad, d(name, "bad choice", repr(bad)),
                            Expect.raises(t if isinstance(t, tuple) else (t,), name))
            for c in p.choices:
                yield with_(name, c, d(name, "choice", c), Expect.anything())
        elif isinstance(p, Flag):
            yield with_(name, not v0, d(name, "flag flipped"), Expect.anything())
            yield with_(name, np.bool_(v0), d(name, "numpy bool"), Expect.same())

    # ---- zero-size and absurd sizes, one symbol at a time
    for sym in entry.sizes:
        if sizes.get(sym, 0) == 0:
            continue
        if sym in entry.zero_ok:
            exp = Expect.anything()
        elif sym in entry.zero_bad:
            exp = Expect.raises((ValueError,), *users(sym))
        else:
            exp = Expect.anything()
        try:
            s0 = entry.make_sizes({k: (0 if k == sym else sizes[k]) for k in entry.sizes})
            v = entry.build(s0, int(rng.integers(1 << 30)))
        except Exception:
            continue
        yield Case(d(sym, "zero size"), v, exp, sizes=s0)

    # ---- huge logical shapes from zero strides (reads only; outputs cannot be allocated)
    for sym in sorted({s for p in params.values() if isinstance(p, Arr) for s in p.shape
                       if isinstance(s, str)}):
        if sym in entry.huge_skip:
            continue
        arrs = [n for n in users(sym) if isinstance(params.get(n), Arr)]
        if any(params[n].written for n in arrs) or any(n in params and not isinstance(params[n], Arr)
                                                       for n in users(sym)):
            continue
        if any(vals[n] is NO or vals[n] is None for n in arrs):
            continue
        limit = (2**63 - 1) // 16
        for n in arrs:
            a = vals[n]
            other = int(np.prod([k for ax, k in enumerate(a.shape) if params[n].shape[ax] != sym]))
            if other:
                limit = min(limit, (2**63 - 1) // (a.itemsize * other) - 1)
        # 2**40 elements: no output of that many rows can be allocated; `limit`: the
        # largest length NumPy allows at all (byte size just under 2**63)
        for big in sorted({min(1 << 40, limit), limit}):
            v = copy_vals(vals)
            ok = True
            for n in arrs:
                a = vals[n]
                for ax, s in enumerate(params[n].shape):
                    if s == sym:
                        try:
                            a = huge_view(a, ax, big)
                        except ValueError:
                            ok = False
                v[n] = a
            if ok:
                label = "2**40" if big == 1 << 40 else "NumPy's largest"
                yield Case(d(sym, "huge zero-stride dim", label), v, Expect.anything())


def _array_cases(entry, name, p, v0, vals, sizes, rng, d, with_, users):
    if p.role == "out":
        yield from _out_cases(entry, name, p, vals, sizes, rng, d, with_)
        return
    # None / missing
    if v0 is NO:
        return
    if p.optional:
        yield with_(name, None, d(name, "None (optional)"), Expect.anything())
    else:
        yield with_(name, None, d(name, "None"), Expect.raises(TypeError, name))
    # wrong dtypes (and the documented alternatives, e.g. bfloat16)
    for dt in BAD_DTYPES[_kind(p.dtype)] + ([BF16] if BF16 is not None and _kind(p.dtype) == "f"
                                            else []):
        alt = np.dtype(dt).name in p.also
        yield with_(name, v0.astype(dt), d(name, "dtype", np.dtype(dt).name),
                    Expect.anything() if alt else Expect.raises(TypeError, name))
    if v0.dtype.itemsize > 1:
        # read: the same result, or a TypeError naming it (a dtype check that wants '<f4')
        yield with_(name, byteswapped(v0), d(name, "big-endian"),
                    Expect.raises((ValueError, TypeError), name) if p.written
                    else Expect("same", (TypeError,), (name,)))
    # wrong Python types
    for bad, label in (("abc", "str"), (3.5, "float"), ({}, "dict"),
                       (v0.astype(np.float64).tolist() if v0.ndim else [1.0], "list of floats")):
        yield with_(name, bad, d(name, "object", label), Expect.raises(TypeError, name))
    try:
        import torch
        for tdt in (torch.float64, torch.bfloat16, torch.int64):
            if (p.dtype == np.float32 and tdt == torch.float32) or (p.dtype == np.int32 and tdt == torch.int32):
                continue
            t = torch.from_numpy(np.ascontiguousarray(v0).astype(np.float64)).to(tdt)
            alt = str(tdt).replace("torch.", "") in p.also
            yield with_(name, t, d(name, "torch dtype", str(tdt)),
                        Expect.anything() if alt else Expect.raises(TypeError, name))
    except ImportError:
        pass
    # ranks
    lo, hi = p.ndim
    if lo > 0:
        yield with_(name, np.zeros((), p.dtype), d(name, "rank 0"),
                    Expect.raises(ValueError, name))
        if v0.ndim - 1 < lo and v0.ndim >= 1:
            yield with_(name, np.zeros(v0.shape[1:], p.dtype), d(name, "rank -1"),
                        Expect.raises(ValueError, name))
    if hi is not None:
        yield with_(name, v0[None].copy(), d(name, "rank +1"), Expect.raises(ValueError, name))
        yield with_(name, v0[None, None].copy(), d(name, "rank +2"), Expect.raises(ValueError, name))
    # shapes: a dimension that must agree with another parameter
    for ax, sym in enumerate(p.shape):
        if not isinstance(sym, str):
            continue
        others = [u for u in users(sym) if u != name
                  and vals.get(u, NO) is not NO and vals.get(u) is not None]
        if not others:
            continue
        n = v0.shape[ax]
        for bad_n, label in ((n + 1, "+1"), (n - 1, "-1"), (2 * n + 3, "x2+3"), (0, "0")):
            if bad_n < 0 or bad_n == n:
                continue
            shape = list(v0.shape)
            shape[ax] = bad_n
            bad = _values_like(p, tuple(shape), sizes, rng)
            yield with_(name, bad, d(name, "shape mismatch", f"axis {ax} ({sym}) {label}"),
                        Expect.raises((ValueError,), name, *others))
    # layouts with the same values
    sv, buf, mask = strided(v0)
    yield with_(name, sv, d(name, "strided (every 2nd element)"), Expect.same(),
                guards=((buf, mask),))
    if v0.ndim:
        tv, tbuf, tmask = tail_view(v0)
        yield with_(name, tv, d(name, "tail view x[..., -n:]"), Expect.same(),
                    guards=((tbuf, tmask),))
    for ax in range(v0.ndim):
        yield with_(name, reversed_view(v0, ax), d(name, "reversed stride", f"axis {ax}"),
                    Expect.same())
    if v0.ndim >= 2:
        yield with_(name, np.asfortranarray(v0), d(name, "Fortran order"), Expect.same())
    if p.dtype.itemsize > 1 and (v0.size or not p.written):
        yield with_(name, unaligned(v0), d(name, "unaligned"),
                    Expect.raises(ValueError, name) if p.written else Expect.same())
    yield with_(name, readonly(v0), d(name, "read-only"),
                Expect.raises(ValueError, name) if p.written else Expect.same())
    if v0.ndim and v0.shape[0] > 1:
        if p.written:
            yield with_(name, zero_stride(v0.copy()), d(name, "zero stride (written)"),
                        Expect.raises(ValueError, name))
        else:
            z = np.broadcast_to(np.take(v0, [0], axis=0), v0.shape)
            yield with_(name, z, d(name, "zero stride (broadcast)"), Expect.same())
    try:
        import torch  # noqa: F401
        yield with_(name, torch_of(v0), d(name, "torch tensor"), Expect.same())
        if v0.size:
            yield with_(name, torch_strided(v0), d(name, "torch strided view"), Expect.same())
    except ImportError:
        pass
    # values
    if p.index is not None:
        ilo, ihi = p.index(sizes)
        if v0.size:
            for bad, label in ((ihi + 1, "hi+1"), (ilo - 1, "lo-1"), (I32_MAX, "INT32_MAX"),
                               (I32_MIN, "INT32_MIN"), (ihi + 1000, "hi+1000")):
                b = v0.copy()
                b.flat[int(rng.integers(b.size))] = bad
                yield with_(name, b, d(name, "index out of range", label),
                            Expect.raises((IndexError, ValueError), name))
            yield with_(name, np.full_like(v0, ilo), d(name, "all indices lo"), Expect.anything())
            yield with_(name, np.full_like(v0, max(ihi, ilo)), d(name, "all indices hi"),
                        Expect.anything())
    elif p.dtype.kind == "f" and v0.size:
        for vals_, label in (([np.nan], "NaN"), ([np.inf], "+inf"), ([-np.inf], "-inf"),
                             ([np.nan, np.inf, -np.inf], "NaN and infs"),
                             ([3e38], "near float32 max"), ([1e-45], "denormal")):
            b = v0.copy()
            for x in vals_:
                b.flat[int(rng.integers(b.size))] = x
            yield with_(name, b, d(name, "values", label),
                        Expect.anything() if entry.nan_ok else Expect.raises(ValueError, name))
        yield with_(name, np.full_like(v0, np.nan), d(name, "values", "all NaN"),
                    Expect.anything())
        yield with_(name, np.zeros_like(v0), d(name, "values", "all zero"), Expect.anything())


def _out_cases(entry, name, p, vals, sizes, rng, d, with_):
    shape = p.concrete_shape(sizes)
    ok = np.full(shape, 9.0, p.dtype)
    yield with_(name, ok, d(name, "given"), Expect.same())
    yield with_(name, None, d(name, "None"), Expect.same())
    sv, buf, mask = strided(ok)
    layout = Expect.raises(ValueError, name) if p.contiguous else Expect.same()
    if ok.size:
        yield with_(name, sv, d(name, "strided"), layout, guards=((buf, mask),))
        for ax in range(len(shape)):
            if shape[ax] > 1:
                yield with_(name, reversed_view(ok, ax), d(name, "reversed stride", f"axis {ax}"),
                            layout)
    for dt in BAD_DTYPES[_kind(p.dtype)] + ([BF16] if BF16 is not None and _kind(p.dtype) == "f"
                                            else []):
        yield with_(name, ok.astype(dt), d(name, "dtype", np.dtype(dt).name),
                    Expect.raises(TypeError, name))
    for ax in range(len(shape)):
        for delta in (1, -1):
            s = list(shape)
            s[ax] += delta
            if s[ax] < 0:
                continue
            yield with_(name, np.zeros(s, p.dtype), d(name, "shape", f"axis {ax} {delta:+d}"),
                        Expect.raises(ValueError, name))
    yield with_(name, np.zeros((1,) + shape, p.dtype), d(name, "rank +1"),
                Expect.raises(ValueError, name))
    yield with_(name, readonly(ok), d(name, "read-only"), Expect.raises(ValueError, name))
    if ok.itemsize > 1 and ok.size:
        yield with_(name, unaligned(ok), d(name, "unaligned"), Expect.raises(ValueError, name))
    if ok.itemsize > 1:
        yield with_(name, ok.astype(ok.dtype.newbyteorder(">")), d(name, "big-endian"),
                    Expect.raises((ValueError, TypeError), name))
    if len(shape) and shape[0] > 1 and ok.size:
        yield with_(name, zero_stride(ok.copy()), d(name, "zero stride"),
                    Expect.raises(ValueError, name))
    yield with_(name, ok.tolist(), d(name, "list"), Expect.raises(TypeError, name))
    yield with_(name, "abc", d(name, "str"), Expect.raises(TypeError, name))
    # aliasing an input: the same array (in place, if documented) or a shifted overlap
    for iname, ip in entry.params.items():
        if not isinstance(ip, Arr) or ip.role == "out" or vals[iname] is NO or vals[iname] is None:
            continue
        a = vals[iname]
        if a.dtype != p.dtype or a.size == 0 or int(np.prod(shape)) == 0:
            continue
        if a.shape == shape:
            v = dict(vals)
            v = {k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in v.items()}
            v[name] = v[iname]
            yield Case(d(name, "is input", iname), v,
                       Expect.anything() if iname in entry.in_place_ok
                       else Expect.raises(ValueError, name, iname))
        n = int(np.prod(shape))
        if n < 2 or a.size < 2:
            continue          # a one-element shift of one element does not overlap
        big = np.zeros(max(a.size, n) + 1, p.dtype)
        v = {k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in vals.items()}
        big[:a.size] = a.ravel()
        v[iname] = big[:a.size].reshape(a.shape)
        v[name] = big[1:1 + n].reshape(shape)
        yield Case(d(name, "overlaps input (shifted by 1)", iname), v,
                   Expect.raises(ValueError, name, iname))


def _int_cases(entry, name, p, v0, d, with_):
    below = sorted({p.lo - 1, -1, -2**31, -2**63, -2**64})
    for bad in below:
        if bad >= p.lo:
            continue
        yield with_(name, bad, d(name, "int below range", bad),
                    Expect.raises((ValueError, OverflowError), name))
    if p.hi is not None:
        for bad in (p.hi + 1, 2**63, 2**64):
            yield with_(name, bad, d(name, "int above range", bad),
                        Expect.raises((ValueError, OverflowError), name))
    else:
        # A size-like int of 2**31 could make a legal 8+ GB allocation (and, once
        # touched, exhaust the machine): only 2**40, which no allocator grants.
        for big in ((2**40,) if p.size_like else (2**31, 2**40)):
            yield with_(name, big, d(name, "huge int", big),
                        Expect.raises((ValueError,), name) if p.exact else Expect.anything())
        for bad in (2**63, 2**64, 10**30):
            yield with_(name, bad, d(name, "int beyond int64", bad),
                        Expect.raises((ValueError, OverflowError, MemoryError), name))
    for bad, label in ((float(v0), "float"), (str(v0), "str"), (None, "None"), ([v0], "list"),
                       (True, "bool"), (complex(v0), "complex"), (np.float32(v0), "np.float32")):
        if bad is None and p.optional:
            yield with_(name, None, d(name, "None (default)"), Expect.anything())
            continue
        yield with_(name, bad, d(name, "int wrong type", label), Expect.raises(TypeError, name))
    if p.exact:
        for bad in (v0 + 1, v0 - 1, v0 + 2):
            if bad >= p.lo:
                yield with_(name, bad, d(name, "int not the expected value", f"{bad - v0:+d}"),
                            Expect.raises((ValueError,), name))
    yield with_(name, np.int64(v0), d(name, "np.int64"), Expect.same())
    yield with_(name, np.int32(v0), d(name, "np.int32"), Expect.same())


def _real_cases(name, p, v0, d, with_):
    if p.finite:
        for bad in (float("nan"), float("inf"), float("-inf")):
            yield with_(name, bad, d(name, "non-finite", bad), Expect.raises(ValueError, name))
    if p.lo > -np.inf:
        for bad in ({p.lo - 1.0, p.lo / 2 if p.lo > 0 else -1e-30}
                    | ({p.lo} if p.lo_open else set())):
            yield with_(name, bad, d(name, "below range", bad), Expect.raises(ValueError, name))
    if p.hi < np.inf:
        yield with_(name, p.hi * 10, d(name, "above range", p.hi * 10),
                    Expect.raises(ValueError, name))
    for bad, label in (("1", "str"), (None, "None"), ([v0], "list"), (1j, "complex"),
                       (np.ones(3), "array")):
        if bad is None and p.optional:
            continue
        yield with_(name, bad, d(name, "real wrong type", label), Expect.raises(TypeError, name))
    if v0 is not None:
        yield with_(name, np.float64(v0), d(name, "np.float64"), Expect.same())
    else:
        yield with_(name, 0.5, d(name, "a value"), Expect.anything())


# ---------------------------------------------------------------- running a case

def _snap(x):
    if type(x).__module__.startswith("torch"):
        return to_numpy(x).copy()
    if isinstance(x, np.ndarray):
        if x.size > (1 << 24) and not x.flags.writeable:
            return None       # a huge zero-stride read-only view: nothing to snapshot
        return x.copy()
    return None


def _as_np(x):
    return to_numpy(x)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == object:
        return all(x is y or x == y or (x != x and y != y) for x, y in zip(a.flat, b.flat))
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                          np.ascontiguousarray(b).view(np.uint8))


def outputs_equal(got, want, loose):
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = _as_np(g), _as_np(w)
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape} != {w.shape}"
        if g.dtype.kind in "iub" or w.dtype.kind in "iub":
            if not np.array_equal(g, w):
                return f"output {i}: integers differ"
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        if not np.array_equal(np.isnan(g64), np.isnan(w64)):
            return f"output {i}: NaN pattern differs"
        fin = np.isfinite(w64)
        if not np.array_equal(g64[~fin & ~np.isnan(w64)], w64[~fin & ~np.isnan(w64)]):
            return f"output {i}: infinities differ"
        rtol = 1e-5 if loose else 2e-6
        err = np.abs(g64[fin] - w64[fin])
        if err.size and not (err <= 1e-6 + rtol * np.abs(w64[fin])).all():
            return f"output {i}: max |diff| {err.max():.3g}"
    return None


def contiguous_vals(vals):
    """The same values as plain C-contiguous native numpy arrays."""
    out = {}
    for k, v in vals.items():
        s = _snap(v)
        if s is not None and k != "bogus_kw":
            s = np.ascontiguousarray(s)
            if s.dtype.byteorder == ">":
                s = s.astype(s.dtype.newbyteorder("="))
            out[k] = s
        else:
            out[k] = v
    return out


def run_case(entry, case, sizes):
    """Runs one case; returns None if it behaved, else a description of the failure."""
    sizes = case.sizes or sizes
    vals = case.vals
    snaps = {k: _snap(v) for k, v in vals.items()}
    guards = [(b, m, b.copy()) for b, m in case.guards]
    try:
        ret = entry.invoke(vals, sizes)
        err = None
    except Exception as e:  # noqa: BLE001 - judged below
        ret, err = None, e
    written = {n for n, p in entry.params.items() if isinstance(p, Arr) and p.written}
    # an input passed as the output too (documented in-place use) is written
    written |= {k for k, v in vals.items() if isinstance(v, np.ndarray)
                and any(v is vals[w] for w in written if w in vals)}
    # the memory around strided views is never touched
    for b, m, b0 in guards:
        if not _same_bits(b[~m], b0[~m]):
            return "wrote outside the view it was given"
    exp = case.expect
    if err is not None:
        # an error must leave every array as it was
        for k, s in snaps.items():
            if s is not None and not _same_bits(_snap(vals[k]), s):
                return f"raised {type(err).__name__} but modified {k!r}"
        if exp.kind == "raise" and not isinstance(err, exp.types):
            return f"raised {type(err).__name__}: {err}; expected {[t.__name__ for t in exp.types]}"
        if exp.kind == "same" and not (exp.types and isinstance(err, exp.types)):
            return f"valid call raised {type(err).__name__}: {err}"
        if not isinstance(err, ANY_ERR):
            return f"raised unexpected {type(err).__name__}: {err}"
        msg = str(err)
        names = exp.names if exp.kind in ("raise", "same") else ()
        if names and not any(re.search(r"(?<![A-Za-z0-9_])" + re.escape(n) + r"(?![A-Za-z0-9_])",
                                       msg) for n in names):
            return f"message does not name {' or '.join(names)}: {type(err).__name__}: {msg}"
        if len(msg) < 10:
            return f"message too terse: {msg!r}"
        return None
    if exp.kind == "raise":
        return f"accepted; expected {[t.__name__ for t in exp.types]} naming {exp.names}"
    for k, s in snaps.items():
        if s is not None and k not in written and not _same_bits(_snap(vals[k]), s):
            return f"modified read-only input {k!r}"
    got = entry.outputs(ret, vals)
    if exp.kind == "same":
        ref_vals = contiguous_vals(_restore(vals, snaps))
        want = entry.outputs(entry.invoke(ref_vals, sizes), ref_vals)
        why = outputs_equal(got, want, entry.loose)
        if why:
            return "differs from the contiguous call: " + why
    else:
        # deterministic: the same call again gives the same bits
        again_vals = _restore(vals, snaps)
        try:
            again = entry.outputs(entry.invoke(again_vals, sizes), again_vals)
        except Exception as e:  # noqa: BLE001
            return f"succeeded once, then raised {type(e).__name__}: {e}"
        for g, a in zip(got, again):
            if not _same_bits(_as_np(g), _as_np(a)):
                return "not deterministic: a second identical call differs"
    return None


def _restore(vals, snaps):
    """Fresh copies of the arguments as they were BEFORE the call (for in-place kernels),
    keeping the layout of the originals where it matters only through values."""
    out = {}
    for k, v in vals.items():
        s = snaps.get(k)
        if s is None:
            out[k] = v
            continue
        if type(v).__module__.startswith("torch"):
            import torch
            if BF16 is not None and s.dtype == BF16:
                out[k] = torch.from_numpy(s.view(np.int16).copy()).view(torch.bfloat16)
            else:
                out[k] = torch.from_numpy(s.copy())
            continue
        c = np.empty_like(v) if isinstance(v, np.ndarray) and v.flags.writeable else None
        if c is not None and not _has_zero_stride(v):
            c = _like_layout(v, s)
            out[k] = c
        else:
            out[k] = s.copy() if v.flags.writeable else readonly(s)
    return out


def _has_zero_stride(a):
    return any(st == 0 and n > 1 for st, n in zip(a.strides, a.shape))


def _like_layout(v, s):
    """A new array holding s, laid out like v where cheap (strided / reversed stay so)."""
    if v.flags.c_contiguous:
        return np.ascontiguousarray(s)
    if v.flags.f_contiguous:
        return np.asfortranarray(s)
    return s.copy()


# ---- arrays read with a unit last stride only (hardening_registry
# UNIT_LAST_STRIDE): their layout variants that change the last stride must raise a
# ValueError naming them instead of giving the contiguous result; and the out= dtypes
# an entry documents besides float32 (hardening_registry OUT_ALSO) are valid.
def _last_stride_changed(v):
    try:
        import torch
        if isinstance(v, torch.Tensor):
            return v.dim() and v.shape[-1] > 1 and v.stride(-1) != 1
    except ImportError:
        pass
    return isinstance(v, np.ndarray) and v.ndim and v.shape[-1] > 1 and \
        v.strides[-1] != v.itemsize


_cases_before_unit_stride = _cases


def _cases(entry, sizes, vals, rng):  # noqa: F811 - wraps the generator above
    from hardening_registry import OUT_ALSO, UNIT_LAST_STRIDE
    names = UNIT_LAST_STRIDE.get(entry.name, ())
    out_ok = {f"{entry.name}|out|dtype|{n}" for n in OUT_ALSO.get(entry.name, ())}
    for c in _cases_before_unit_stride(entry, sizes, vals, rng):
        if c.desc in out_ok:      # a documented alternative out= dtype
            c.expect = Expect.anything()
        if names and c.expect.kind == "same":
            for n in names:
                if c.vals.get(n) is not vals.get(n) and _last_stride_changed(c.vals.get(n)):
                    c.expect = Expect.raises(ValueError, n)
        yield c
