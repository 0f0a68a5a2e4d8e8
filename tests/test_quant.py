"""FP8 / FP4 QAT rounding and the Hadamard rotation against the float32 reference
(tests/ref_quant.py) and against torch's own float8_e4m3fn conversion."""
import ml_dtypes
import numpy as np
import pytest
import torch

import deepseek_csa as dc
from conftest import ISA_LEVELS, assert_close, bf16_round, threads, unchanged
import ref_quant as ref

T = torch.from_numpy


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bits_equal(got, want, what=""):
    """Bit-for-bit, except that any NaN matches any NaN."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    ok = np.isnan(want) | (bits(got) == bits(want))
    if not ok.all():
        i = np.flatnonzero(~ok.ravel())[0]
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.size} differ; first at flat {i}: "
                             f"got {got.ravel()[i]!r} want {want.ravel()[i]!r}")


def all_bf16_values(finite=True):
    v = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    return v[np.isfinite(v)] if finite else v


def spread(rng, shape):
    """Normal values with magnitudes spread over many binades, block by block."""
    x = rng.standard_normal(shape, dtype=np.float32)
    return (x * np.float32(10.0) ** rng.uniform(-8, 8, shape[:-1] + (1,))).astype(np.float32)


# ---------------------------------------------------------------- the grids

@pytest.mark.parametrize("k", [-22, -9, -3, 0, 1, 7, 30, 100])
def test_e4m3_grid_exhaustive_vs_torch_cast(isa, k):
    """Every finite bf16 value v, in a block whose amax is 448 * 2^k (so s = 2^k exactly; 448 * 2^k above the 1e-4 floor),
    rounds to torch's float8_e4m3fn(v / 2^k) * 2^k, bit for bit (signs, -0, subnormals,
    ties to even, the top of the range)."""
    s = np.float32(2.0) ** k
    anchor = np.float32(448) * s
    v = all_bf16_values()
    v = v[np.abs(v) <= anchor]
    x = np.stack([np.full_like(v, anchor), v], axis=1)
    x[1::2, 0] *= -1
    got = dc.fp8_round(x.copy(), 2)
    want = (T(v) / float(s)).to(torch.float8_e4m3fn).float().numpy() * s
    assert_bits_equal(got[:, 1], want, f"e4m3 grid at 2^{k}")
    assert_bits_equal(got[:, 0], x[:, 0], "the anchor is on the grid")


@pytest.mark.parametrize("k", [-120, -20, -1, 0, 3, 60])
def test_e2m1_grid_exhaustive_vs_table(isa, k):
    """Every finite bf16 value, in a block whose amax is 6 * 2^k, against the explicit
    nearest-even table search of the reference."""
    s = np.float32(2.0) ** k
    anchor = np.float32(6) * s
    v = all_bf16_values()
    v = v[np.abs(v) <= anchor]
    x = np.stack([v, np.full_like(v, -anchor)], axis=1)
    got = dc.fp4_round(x.copy(), 2)
    want = ref.round_e2m1(T(v) / float(s)).numpy() * s
    assert_bits_equal(got[:, 0], want, f"e2m1 grid at 2^{k}")


E2M1_TABLE = [(0.0, 0.0), (0.1, 0.0), (0.25, 0.0), (0.2500001, 0.5), (0.5, 0.5), (0.75, 1.0),
              (0.7499999, 0.5), (1.0, 1.0), (1.25, 1.0), (1.2500001, 1.5), (1.5, 1.5),
              (1.75, 2.0), (2.0, 2.0), (2.4999998, 2.0), (2.5, 2.0), (2.5000002, 3.0),
              (3.0, 3.0), (3.5, 4.0), (3.4999998, 3.0), (4.0, 4.0), (4.9999995, 4.0), (5.0, 4.0),
              (5.0000005, 6.0), (5.5, 6.0), (6.0, 6.0)]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_exact_table(isa, sign):
    """The e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, nearest-even at every tie."""
    vin = np.array([a for a, _ in E2M1_TABLE], np.float32) * np.float32(sign)
    want = np.array([b for _, b in E2M1_TABLE], np.float32) * np.float32(sign)
    x = np.stack([vin, np.full_like(vin, 6.0)], axis=1)     # amax 6: s = 1
    got = dc.fp4_round(x, 2)
    assert_bits_equal(got[:, 0], want, "e2m1 table")
    if sign < 0:
        assert np.signbit(got[0, 0]) and np.signbit(got[1, 0]), "-0 and -0.1 round to -0"


def test_e4m3_known_values():
    """A few hand-checked e4m3 roundings at s = 1 (amax 448)."""
    vin = np.array([0, 2 ** -10, 1.5 * 2 ** -10, 2 ** -9, 1.5 * 2 ** -9, 2.5 * 2 ** -9, 2 ** -6,
                    1.0625, 1.1875, 17.0, 19.0, 300.0, 432.0, 447.9, 448.0], np.float32)
    want = np.array([0, 0, 2 ** -9, 2 ** -9, 2 ** -8, 2 ** -8, 2 ** -6,
                     1.0, 1.25, 16.0, 20.0, 288.0, 448.0, 448.0, 448.0], np.float32)
    x = np.stack([vin, np.full_like(vin, 448.0)], axis=1)
    assert_bits_equal(dc.fp8_round(x, 2)[:, 0], want, "e4m3 values")


# ---------------------------------------------------------------- scales

@pytest.mark.parametrize("k", [-20, -1, 0, 5, 40])
def test_ue8m0_scale_at_powers_of_two(isa, k):
    """amax exactly 448 * 2^k gives s = 2^k; one ulp more gives 2^(k+1).  The probe
    1.25 * 2^(k-9) rounds to 2^(k-9) under s = 2^k but to 2^(k-8) under s = 2^(k+1)."""
    a = np.float32(448) * np.float32(2.0) ** k
    probe = np.float32(1.25) * np.float32(2.0) ** (k - 9)
    lo, hi = np.float32(2.0) ** (k - 9), np.float32(2.0) ** (k - 8)
    x = np.array([[a, probe], [np.nextafter(a, np.float32(np.inf)), probe],
                  [np.nextafter(a, np.float32(0)), probe]], np.float32)
    got = dc.fp8_round(x.copy(), 2)
    assert got[0, 1] == lo and got[1, 1] == hi and got[2, 1] == lo, got[:, 1]
    assert_bits_equal(got, ref.fp8_round(T(x), 2).numpy(), "vs reference")
    # FP4: amax 6 * 2^k gives s = 2^k; the probe 0.625 * 2^k -> 0.5 * 2^k, else 2^k
    a4 = np.float32(6) * np.float32(2.0) ** k
    p4 = np.float32(0.625) * np.float32(2.0) ** k
    x4 = np.array([[a4, p4], [np.nextafter(a4, np.float32(np.inf)), p4]], np.float32)
    got4 = dc.fp4_round(x4.copy(), 2)
    assert got4[0, 1] == p4 * np.float32(0.8) and got4[1, 1] == np.float32(2.0) ** k, got4
    assert_bits_equal(got4, ref.fp4_round(T(x4), 2).numpy(), "fp4 vs reference")


def test_amax_floors():
    """All-zero and tiny blocks: the floors keep s > 0, so no NaN, and tiny values keep
    the resolution the floor allows."""
    z = np.zeros((2, 64), np.float32)
    z[1, :] = -0.0
    for f, kw in ((dc.fp8_round, {}), (dc.fp8_round, {"scale": "fp32"}), (dc.fp4_round, {}),
                  (dc.fp4_round, {"scale": "e4m3"})):
        got = f(z.copy(), 32, **kw)
        assert_bits_equal(got, z, f"zeros {kw}")
    tiny = np.full((1, 64), 1e-6, np.float32)
    assert_bits_equal(dc.fp8_round(tiny.copy(), 64), ref.fp8_round(T(tiny), 64).numpy(), "fp8")
    # s = 2^ceil(log2(1e-4 / 448)) = 2^-22: 1e-6 / 2^-22 = 4.19 -> 4
    assert dc.fp8_round(tiny.copy(), 64)[0, 0] == np.float32(4 * 2.0 ** -22)
    t4 = np.full((1, 32), 1e-40, np.float32)          # subnormal input
    assert_bits_equal(dc.fp4_round(t4.copy(), 32), ref.fp4_round(T(t4), 32).numpy(), "fp4")
    t4e = np.full((1, 16), 1e-4, np.float32)
    got = dc.fp4_round(t4e.copy(), 16, scale="e4m3")
    assert_bits_equal(got, ref.fp4_round(T(t4e), 16, "e4m3").numpy(), "fp4 e4m3 floor")
    assert (got == 0).all()                           # s = 2^-9: 1e-4 / 2^-9 = 0.05 -> 0


def test_e4m3_scale_saturates_at_448():
    """scale='e4m3': amax/6 above 448 saturates the scale (hardware cast) instead of the
    NaN torch's cast gives; values then clamp at 6 * 448."""
    x = np.array([[6000.0] + [1.0] * 15], np.float32)
    got = dc.fp4_round(x.copy(), 16, scale="e4m3")
    assert got[0, 0] == 6 * 448 and got[0, 1] == 0.0
    assert_bits_equal(got, ref.fp4_round(T(x), 16, "e4m3").numpy(), "saturated")


# ---------------------------------------------------------------- whole tensors

FP8_CASES = [((8192, 448), 64), ((4, 4096, 448), 64), ((3, 5, 64), 64), ((7, 96), 32),
             ((2, 3, 24), 8), ((5, 7), 1), ((1, 448), 64), ((0, 64), 64), ((3, 0), 4),
             ((2, 1, 2, 48), 48)]


@pytest.mark.parametrize("shape, block", FP8_CASES)
@pytest.mark.parametrize("scale", ["ue8m0", "fp32"])
def test_fp8_round_matches_reference(isa, rng, shape, block, scale):
    if np.prod(shape) > 1 << 20 and isa != ISA_LEVELS[-1]:
        pytest.skip("released shapes run at the best level; the small ones cover the rest")
    x = spread(rng, shape)
    want = ref.fp8_round(T(x), block, scale).numpy()
    y = x.copy()
    r = dc.fp8_round(y, block, scale=scale)
    assert r is y
    assert_bits_equal(y, want, f"fp8 {shape} {scale}")


FP4_CASES = [((4096 * 4, 128), 32, "ue8m0"), ((2, 9, 64, 128), 32, "ue8m0"),
             ((3, 5, 512), 16, "e4m3"), ((1, 2048, 512), 16, "e4m3"), ((7, 96), 32, "ue8m0"),
             ((5, 48), 16, "e4m3"), ((4, 6), 2, "ue8m0"), ((3, 10), 5, "e4m3"),
             ((0, 32), 32, "ue8m0"), ((1, 1), 1, "e4m3")]


@pytest.mark.parametrize("shape, block, scale", FP4_CASES)
def test_fp4_round_matches_reference(isa, rng, shape, block, scale):
    if np.prod(shape) > 1 << 20 and isa != ISA_LEVELS[-1]:
        pytest.skip("released shapes run at the best level; the small ones cover the rest")
    x = spread(rng, shape)
    want = ref.fp4_round(T(x), block, scale).numpy()
    y = x.copy()
    assert dc.fp4_round(y, block, scale=scale) is y
    assert_bits_equal(y, want, f"fp4 {shape} {scale}")


def test_power_of_two_rounding_is_idempotent(rng):
    """With ue8m0 scales a rounded block rounds to itself (its amax may halve the scale,
    which keeps every grid point on the grid).  Not so with fp32 / e4m3 scales: the new
    amax gives a different, non-power-of-two scale."""
    x = spread(rng, (64, 512))
    for f, b, kw in ((dc.fp8_round, 64, {}), (dc.fp4_round, 32, {})):
        once = f(x.copy(), b, **kw)
        assert_bits_equal(f(once.copy(), b, **kw), once, f"{f.__name__} {kw}")


def test_bf16_path_agrees(rng):
    """The released model rounds bf16 activations and writes bf16 back.  For power-of-two
    scales the e4m3/e2m1 values times s are exact in bf16, so the bf16 run of the
    reference gives exactly our float32 result; with fp32 / e4m3 scales, bf16 tolerance."""
    x = bf16_round(spread(rng, (256, 512)))
    xb = T(x).bfloat16()
    assert_bits_equal(dc.fp8_round(x.copy(), 64), ref.fp8_round(xb, 64).bfloat16().float().numpy(),
                      "fp8 ue8m0 vs bf16 run")
    assert_bits_equal(dc.fp4_round(x.copy(), 32), ref.fp4_round(xb, 32).bfloat16().float().numpy(),
                      "fp4 ue8m0 vs bf16 run")
    assert_close(dc.fp8_round(x.copy(), 64, scale="fp32"),
                 ref.fp8_round(xb, 64, "fp32").bfloat16().float().numpy(), rtol=8e-3, atol=0,
                 what="fp8 fp32-scale vs bf16 run")
    assert_close(dc.fp4_round(x.copy(), 16, scale="e4m3"),
                 ref.fp4_round(xb, 16, "e4m3").bfloat16().float().numpy(), rtol=8e-3, atol=0,
                 what="fp4 e4m3-scale vs bf16 run")


def test_nan_inf_poison_their_block_only(isa):
    """A NaN or +-inf makes its block's amax NaN / inf, so the whole block becomes NaN
    (as the reference formula gives); other blocks are untouched by it."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 128), dtype=np.float32)
    x[0, 5] = np.nan
    x[1, 70] = np.inf
    x[2, 127] = -np.inf
    for f, b, kw in ((dc.fp8_round, 64, {}), (dc.fp8_round, 32, {"scale": "fp32"}),
                     (dc.fp4_round, 32, {}), (dc.fp4_round, 16, {"scale": "e4m3"})):
        want = (ref.fp8_round if f is dc.fp8_round else ref.fp4_round)(
            T(x), b, kw.get("scale", "ue8m0")).numpy()
        got = f(x.copy(), b, **kw)
        assert_bits_equal(got, want, f"{f.__name__} {kw}")
        assert np.isnan(got[0, :b]).all() and not np.isnan(got[0, b:]).any()
        blk = 70 // b
        assert np.isnan(got[1, blk * b:(blk + 1) * b]).all()
        assert np.isnan(got[2, -b:]).all() and not np.isnan(got[3]).any()


# ---------------------------------------------------------------- views, out=, torch

def test_rounds_tail_views_in_place(rng):
    """The released model rounds kv[..., :-64] in place (V4: block 64, rope tail kept)."""
    kv = spread(rng, (2, 9, 512))
    k0 = kv.copy()
    r = dc.fp8_round(kv[..., :-64], 64)
    assert r.base is kv or r.base is kv.base
    assert_bits_equal(kv[..., :-64], ref.fp8_round(T(k0[..., :-64].copy()), 64).numpy(), "head")
    assert_bits_equal(kv[..., -64:], k0[..., -64:], "rope tail untouched")


@pytest.mark.parametrize("fn, block, kw", [(dc.fp8_round, 8, {}), (dc.fp4_round, 4, {}),
                                            (dc.fp4_round, 4, {"scale": "e4m3"})])
def test_strided_views_and_out(isa, rng, fn, block, kw):
    reff = ref.fp8_round if fn is dc.fp8_round else ref.fp4_round
    base = spread(rng, (6, 10, 64))
    view = base[::2, 1::3, ::-2]                 # not foldable, reversed inner stride
    want = reff(T(np.ascontiguousarray(view)), block, kw.get("scale", "ue8m0")).numpy()
    b0 = base.copy()
    assert fn(view, block, **kw) is view
    assert_bits_equal(view, want, "in place on a strided view")
    mask = np.ones(base.shape, bool)
    mask[::2, 1::3, ::-2] = False
    assert_bits_equal(base[mask], b0[mask], "elements outside the view")
    # out=: x untouched, result in a strided out
    x = np.ascontiguousarray(b0[::2, 1::3, ::-2])
    out = np.full((6, 10, 64), 7.0, np.float32)[::2, 1::3, :32]
    with unchanged(x):
        assert fn(x, block, out=out, **kw) is out
    assert_bits_equal(out, want, "out=")
    # out=x is in place
    assert fn(x, block, out=x, **kw) is x
    assert_bits_equal(x, want, "out=x")


def test_torch_tensors_in_place():
    t = torch.randn(3, 4, 128)
    want8 = ref.fp8_round(t.clone(), 64)
    assert dc.fp8_round(t, 64) is t
    assert_bits_equal(t.numpy(), want8.numpy(), "torch fp8")
    q = torch.randn(2, 5, 64, 128)
    want4 = ref.fp4_round(q.clone(), 32)
    assert dc.fp4_round(q, 32) is q
    assert_bits_equal(q.numpy(), want4.numpy(), "torch fp4")
    tail = torch.randn(2, 6, 512)
    t0 = tail.clone()
    dc.fp8_round(tail[..., :-64], 64)
    assert_bits_equal(tail[..., :-64].numpy(), ref.fp8_round(t0[..., :-64], 64).numpy(), "view")
    assert torch.equal(tail[..., -64:], t0[..., -64:])


@pytest.mark.parametrize("fn, args, kwargs, exc, words", [
    (dc.fp8_round, (np.ones((2, 64)), 64), {}, TypeError, ["'x'", "float32", "float64"]),
    (dc.fp8_round, (np.ones((2, 64), np.float32), 48), {}, ValueError, ["'block'", "48", "[2, 64]"]),
    (dc.fp8_round, (np.ones((2, 64), np.float32), 0), {}, ValueError, ["'block'"]),
    (dc.fp8_round, (np.ones((2, 64), np.float32), 32.0), {}, TypeError, ["'block'"]),
    (dc.fp8_round, (np.ones((2, 64), np.float32), 32), {"scale": "e4m3"}, ValueError,
     ["'scale'", "ue8m0", "fp32"]),
    (dc.fp4_round, (np.ones((2, 64), np.float32), 32), {"scale": "fp32"}, ValueError,
     ["'scale'", "e4m3"]),
    (dc.fp4_round, (np.ones((2, 64), np.float32), 32), {"scale": 3}, TypeError, ["'scale'"]),
    (dc.fp4_round, (np.float32(3.0), 1), {}, ValueError, ["'x'", "dimensions"]),
    (dc.fp4_round, (np.ones((2, 64), np.float32), 32), {"out": np.ones((2, 32), np.float32)},
     ValueError, ["'out'", "[2, 64]", "[2, 32]"]),
    (dc.fp4_round, (np.ones((2, 64), np.float32), 32), {"out": np.ones((2, 64))}, TypeError,
     ["'out'", "float64"]),
    (dc.fp8_round, ("hello", 2), {}, TypeError, ["'x'"]),
    (dc.hadamard, (np.ones((2, 48), np.float32),), {}, ValueError, ["'x'", "power of two", "48"]),
    (dc.hadamard, (np.ones((2, 0), np.float32),), {}, ValueError, ["power of two"]),
    (dc.hadamard, (np.ones((2, 64), np.float64),), {}, TypeError, ["'x'", "float64"]),
    (dc.hadamard, (np.ones((2, 64), np.float32),), {"scale": "a"}, TypeError, ["'scale'"]),
    (dc.hadamard, (np.ones((2, 64), np.float32),), {"out": np.ones((2, 32), np.float32)},
     ValueError, ["'out'", "[2, 64]"]),
])
def test_bad_inputs(fn, args, kwargs, exc, words):
    arrays = [a for a in args if isinstance(a, np.ndarray)] + [
        v for v in kwargs.values() if isinstance(v, np.ndarray)]
    with unchanged(*arrays):
        with pytest.raises(exc) as e:
            fn(*args, **kwargs)
    msg = str(e.value)
    assert fn.__name__ in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_readonly_and_overlap():
    ro = np.ones((2, 64), np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="'x' is read-only"):
        dc.fp8_round(ro, 64)
    out = np.zeros((2, 64), np.float32)
    dc.fp8_round(ro, 64, out=out)                     # read-only x is fine with out=
    assert (out == 1).all()
    big = np.ones((3, 64), np.float32)
    with unchanged(big), pytest.raises(ValueError, match="overlaps"):
        dc.fp4_round(big[:2], 32, out=big[1:])
    with unchanged(big), pytest.raises(ValueError, match="overlaps"):
        dc.hadamard(big[:2], out=big[1:])


# ---------------------------------------------------------------- determinism

def test_bitwise_identical_across_levels_and_threads(rng):
    x = spread(rng, (1000, 512))
    results = {}
    before = dc.get_isa()
    try:
        for level in ("ref", dc.best_isa()):
            dc.set_isa(level)
            for n in (1, 2, 3):
                with threads(n):
                    results[(level, n)] = (dc.fp8_round(x.copy(), 64), dc.fp4_round(x.copy(), 32),
                                           dc.fp4_round(x.copy(), 16, scale="e4m3"),
                                           dc.fp8_round(x.copy(), 32, scale="fp32"),
                                           dc.hadamard(x), dc.hadamard(x[:, :128]))
    finally:
        dc.set_isa(before)
    first = results[("ref", 1)]
    for key, res in results.items():
        for a, b in zip(res, first):
            assert_bits_equal(a, b, f"{key}")


# ---------------------------------------------------------------- hadamard

@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096])
def test_hadamard_matches_explicit_matrix(isa, rng, n):
    rows = 37 if n <= 1024 else 5
    x = rng.standard_normal((rows, n), dtype=np.float32)
    with unchanged(x):
        got = dc.hadamard(x)
    assert got.flags.c_contiguous and got is not x
    assert_close(got, ref.hadamard(T(x)).numpy(), rtol=1e-5, atol=2e-6 * np.log2(2 * n),
                 what=f"hadamard n={n}")


def test_hadamard_large_n_and_released_shape(rng):
    x = rng.standard_normal((3, 1 << 16), dtype=np.float32)
    y = dc.hadamard(x)
    assert_close(dc.hadamard(y), x, rtol=1e-5, atol=3e-5, what="2^16 round trip")
    q = rng.standard_normal((1, 64, 64, 128), dtype=np.float32)
    assert_close(dc.hadamard(q), ref.hadamard(T(q)).numpy(), rtol=1e-5, atol=1e-5, what="q")


def test_hadamard_large_new_array_streams_same_bits(rng):
    """A large new result is written with streaming stores into a 64-byte aligned array;
    the bits are those of the cached path (out=) and of the scalar oracle."""
    x = rng.standard_normal((16384, 128), dtype=np.float32)
    got = dc.hadamard(x)
    assert got.ctypes.data % 64 == 0 and got.flags.c_contiguous and got.flags.writeable
    out = np.empty((16384, 129), np.float32)[:, 1:]
    dc.hadamard(x, out=out)
    assert_bits_equal(got, out, "streamed vs cached stores")
    before = dc.get_isa()
    try:
        dc.set_isa("ref")
        assert_bits_equal(got[:512], dc.hadamard(x[:512]), "vs oracle")
    finally:
        dc.set_isa(before)
    assert_close(got[:256], ref.hadamard(T(x[:256])).numpy(), rtol=1e-5, atol=1e-5, what="ref")


def test_hadamard_is_its_own_inverse_and_scale(isa, rng):
    x = rng.standard_normal((9, 3, 128), dtype=np.float32)
    assert_close(dc.hadamard(dc.hadamard(x)), x, rtol=1e-5, atol=1e-6, what="H H x = x")
    un = dc.hadamard(x, scale=1.0)
    assert_close(un, ref.hadamard(T(x), 1.0).numpy(), rtol=1e-6, atol=1e-5, what="scale=1")
    assert_close(dc.hadamard(x, scale=2), 2 * un, rtol=1e-6, atol=0, what="scale=2")
    # unscaled transform of integers is exact
    xi = rng.integers(-50, 50, (4, 64)).astype(np.float32)
    want = (xi.astype(np.int64) @ ref.hadamard_matrix(64).numpy().astype(np.int64))
    assert_bits_equal(dc.hadamard(xi, scale=1.0), want.astype(np.float32), "exact integers")


def test_hadamard_in_place_out_and_views(isa, rng):
    base = rng.standard_normal((5, 6, 256), dtype=np.float32)
    view = base[::2, 1::2, 64:192]               # rows not foldable, inner contiguous
    want = ref.hadamard(T(np.ascontiguousarray(view))).numpy()
    assert_close(dc.hadamard(view), want, rtol=1e-5, atol=1e-6, what="strided view")
    rev = base[..., ::-2]
    assert_close(dc.hadamard(rev), ref.hadamard(T(np.ascontiguousarray(rev))).numpy(),
                 rtol=1e-5, atol=1e-6, what="reversed inner stride")
    b0 = base.copy()
    assert dc.hadamard(view, out=view) is view   # in place on a view
    assert_close(view, want, rtol=1e-5, atol=1e-6, what="in place")
    mask = np.ones(base.shape, bool)
    mask[::2, 1::2, 64:192] = False
    assert_bits_equal(base[mask], b0[mask], "outside the view")
    out = np.zeros((3, 3, 2, 128), np.float32)[:, :, 0]
    x = np.ascontiguousarray(b0[::2, 1::2, 64:192])
    with unchanged(x):
        assert dc.hadamard(x, out=out) is out
    assert_close(out, want, rtol=1e-5, atol=1e-6, what="strided out=")
    t = torch.from_numpy(x.copy())
    assert dc.hadamard(t, out=t) is t
    assert_close(t.numpy(), want, rtol=1e-5, atol=1e-6, what="torch in place")
    assert dc.hadamard(np.zeros((0, 3, 8), np.float32)).shape == (0, 3, 8)


def test_hadamard_nan_inf_and_bf16(rng):
    x = rng.standard_normal((3, 64), dtype=np.float32)
    x[0, 3] = np.nan
    x[1, 60] = np.inf
    got = dc.hadamard(x)
    assert np.isnan(got[0]).all() and np.isinf(got[1]).all() and np.isfinite(got[2]).all()
    assert_close(got, ref.hadamard(T(x)).numpy(), rtol=1e-5, atol=1e-6, what="nan/inf")
    xb = bf16_round(rng.standard_normal((64, 128), dtype=np.float32))
    h = ref.hadamard_matrix(128).bfloat16()
    want = (T(xb).bfloat16() @ h * 128 ** -0.5).float().numpy()
    assert_close(dc.hadamard(xb), want, rtol=1.6e-2, atol=2e-2, what="bf16 run")


# ---------------------------------------------------------------- bfloat16 in and out

BF16 = ml_dtypes.bfloat16


def _tb(a):
    """A bf16 NumPy array as a torch bfloat16 tensor sharing its memory."""
    return T(a.view(np.int16)).view(torch.bfloat16)


def _bf16_ulps(got, want):
    """Per element, the distance in bf16 ulps of two bf16 arrays (NaN matches NaN)."""
    def line(a):
        h = np.ascontiguousarray(a).view(np.int16).astype(np.int64)
        return np.where(h < 0, -(h & 0x7FFF), h)
    g, w = np.asarray(got, BF16), np.asarray(want, BF16)
    gn, wn = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    return np.where(gn | wn, np.where(gn & wn, 0, 1 << 30), np.abs(line(g) - line(w)))


def _ref_of(fn):
    return {"fp8_round": ref.fp8_round, "fp4_round": ref.fp4_round}[fn.__name__]


BF16_ROUND_CASES = [(dc.fp8_round, (64, 448), 64, "ue8m0"), (dc.fp8_round, (3, 5, 96), 32, "fp32"),
                    (dc.fp8_round, (4, 24), 3, "ue8m0"), (dc.fp4_round, (2, 9, 4, 128), 32, "ue8m0"),
                    (dc.fp4_round, (7, 512), 16, "e4m3"), (dc.fp4_round, (5, 10), 5, "e4m3"),
                    (dc.fp4_round, (2, 8192), 8192, "ue8m0"), (dc.fp8_round, (0, 64), 64, "ue8m0")]


@pytest.mark.parametrize("fn, shape, block, scale", BF16_ROUND_CASES)
def test_bf16_round_vs_bf16_reference(isa_bf16, rng, fn, shape, block, scale):
    """bf16 in place: the reference run on the bf16 tensor (x.float() -> round ->
    .to(bf16)) within 1 ulp (in fact bit for bit: the float32 path on the widened values,
    then one cast), and the float32 path on the unrounded input at bf16 tolerance."""
    x32 = spread(rng, shape)
    xb = x32.astype(BF16)
    want = _ref_of(fn)(_tb(xb), block, scale).bfloat16()
    y = xb.copy()
    assert fn(y, block, scale=scale) is y and y.dtype == BF16
    assert _bf16_ulps(y, want.float().numpy().astype(BF16)).max(initial=0) <= 1
    assert_bits_equal(y.astype(np.float32), fn(xb.astype(np.float32), block, scale=scale)
                      .astype(BF16).astype(np.float32), "the cast of the float32 path")
    f32 = fn(x32.copy(), block, scale=scale)
    # the bf16 input rounding (2^-9 relative) moves a value across a grid midpoint with
    # probability ~ 2^-9 / 2^-m (m mantissa bits of the grid: ~3% for e4m3); those
    # elements move by one grid step, the others agree at bf16 tolerance (a block whose
    # e4m3 scale or power-of-two scale moves moves whole: counted on many blocks only)
    # (measured: 0.3-3% on the large shapes; on the small ones 1 of 96, 29 of 1440, and
    # 5 of 50 -- one block of 5 whose scale moved): large shapes at most 6%; small ones
    # at most 6% plus one whole block
    far = ~np.isclose(y.astype(np.float32), f32, rtol=1.6e-2, atol=0)
    if xb.size >= 2048:
        assert far.mean() <= 0.06, f"{far.mean():.3f} of the elements far from the float32 path"
    else:
        assert far.sum() <= 0.06 * xb.size + block, \
            f"{int(far.sum())} of {xb.size} elements far from the float32 path"


def test_bf16_round_views_out_torch_and_nan(rng):
    base = spread(rng, (6, 10, 64)).astype(BF16)
    view = base[::2, 1::3, ::-2]                 # not foldable, reversed inner stride
    want = dc.fp8_round(view.astype(np.float32), 8).astype(BF16)
    out = np.zeros((3, 3, 2, 32), BF16)[:, :, 0]
    with unchanged(base.view(np.uint16)):
        assert dc.fp8_round(view, 8, out=out) is out
    assert_bits_equal(out.astype(np.float32), want.astype(np.float32), "strided out=")
    b0 = base.copy()
    assert dc.fp8_round(view, 8) is view         # in place on a strided view
    assert_bits_equal(view.astype(np.float32), want.astype(np.float32), "in place view")
    mask = np.ones(base.shape, bool)
    mask[::2, 1::3, ::-2] = False
    assert np.array_equal(base.view(np.uint16)[mask], b0.view(np.uint16)[mask])
    # the released model's in-place rounding of kv[..., :-64] on a torch bf16 tensor
    t = torch.randn(2, 6, 512).bfloat16()
    t0, ptr = t.clone(), t.data_ptr()
    dc.fp8_round(t[..., :-64], 64)
    assert t.data_ptr() == ptr and torch.equal(t[..., -64:], t0[..., -64:])
    assert torch.equal(t[..., :-64], ref.fp8_round(t0[..., :-64], 64).bfloat16())
    q = torch.randn(2, 5, 64, 128).bfloat16()
    want4 = ref.fp4_round(q, 32).bfloat16()
    assert dc.fp4_round(q, 32) is q and torch.equal(q, want4)
    x = rng.standard_normal((4, 128), dtype=np.float32).astype(BF16)
    x[0, 5], x[1, 70] = np.nan, np.inf
    for f, b in ((dc.fp8_round, 64), (dc.fp4_round, 32)):
        got = f(x.copy(), b).astype(np.float32)
        assert np.isnan(got[0, :b]).all() and not np.isnan(got[0, b:]).any()
        assert np.isnan(got[1, 64:64 + b]).all() and np.isfinite(got[2:]).all()


@pytest.mark.parametrize("n", [1, 2, 8, 16, 128, 512, 4096, 8192])
def test_bf16_hadamard_vs_bf16_reference(isa_bf16, rng, n):
    """bf16 x: the transform of the widened values, cast once; within 1 ulp of the
    reference (float64 product) cast to bf16, except where the float32 rounding of a
    cancelling sum spans more ulps of a tiny result; bf16 tolerance vs float32."""
    rows = 9 if n <= 512 else 2
    x32 = rng.standard_normal((rows, n), dtype=np.float32)
    xb = x32.astype(BF16)
    with unchanged(xb.view(np.uint16)):
        got = dc.hadamard(xb)
    assert got.dtype == BF16 and got.shape == xb.shape
    assert_bits_equal(got.astype(np.float32),
                      dc.hadamard(xb.astype(np.float32)).astype(BF16).astype(np.float32),
                      "the cast of the float32 path")
    g = got.astype(np.float32)
    if n > 1024:      # the explicit matrix is n^2: the float32 path (checked above) vouches
        assert_close(dc.hadamard(got).astype(np.float32), x32, rtol=3e-2, atol=3e-2,
                     what="round trip")
        return
    want = ref.hadamard(_tb(xb)).bfloat16().float().numpy()
    ok = (_bf16_ulps(got, want.astype(BF16)) <= 1) | (np.abs(g - want) <= 2e-6 * np.log2(2 * n))
    assert ok.all()
    assert_close(g, ref.hadamard(T(x32)).numpy(), rtol=1.6e-2, atol=2e-2, what="vs float32")


def test_bf16_hadamard_in_place_out_views_torch(rng):
    base = rng.standard_normal((5, 6, 256), dtype=np.float32).astype(BF16)
    view = base[::2, 1::2, 64:192]
    want = dc.hadamard(view.astype(np.float32)).astype(BF16)
    assert_bits_equal(dc.hadamard(view).astype(np.float32), want.astype(np.float32), "view")
    rev = base[..., ::-2]
    assert_bits_equal(dc.hadamard(rev).astype(np.float32),
                      dc.hadamard(rev.astype(np.float32)).astype(BF16).astype(np.float32), "rev")
    assert dc.hadamard(view, out=view) is view
    assert_bits_equal(view.astype(np.float32), want.astype(np.float32), "in place")
    out = np.zeros((3, 3, 2, 128), BF16)[:, :, 0]
    x = np.ascontiguousarray(view)
    with unchanged(x.view(np.uint16)):
        assert dc.hadamard(x, out=out) is out
    t = _tb(x.copy())
    assert dc.hadamard(t, out=t) is t
    assert torch.equal(t, _tb(np.ascontiguousarray(dc.hadamard(x))))


@pytest.mark.parametrize("fn, args, kwargs, exc, words", [
    (dc.fp8_round, (np.ones((2, 64), BF16), 64), {"out": np.ones((2, 64), np.float32)},
     TypeError, ["'out'", "bfloat16", "float32"]),
    (dc.fp4_round, (np.ones((2, 64), np.float32), 32), {"out": np.ones((2, 64), BF16)},
     TypeError, ["'out'", "float32"]),
    (dc.hadamard, (np.ones((2, 64), BF16),), {"out": np.ones((2, 64), np.float32)},
     TypeError, ["'out'", "bfloat16"]),
    (dc.hadamard, (np.ones((2, 48), BF16),), {}, ValueError, ["'x'", "power of two"]),
    (dc.fp8_round, (np.ones((2, 64), np.float16), 64), {}, TypeError,
     ["'x'", "float32 or bfloat16", "float16"]),
    (dc.fp8_round, (np.ones((2, 64), BF16), 48), {}, ValueError, ["'block'", "48"]),
])
def test_bf16_bad_inputs(fn, args, kwargs, exc, words):
    arrays = [a for a in args if isinstance(a, np.ndarray)] + [
        v for v in kwargs.values() if isinstance(v, np.ndarray)]
    with unchanged(*[a.view(np.uint8) for a in arrays]):
        with pytest.raises(exc) as e:
            fn(*args, **kwargs)
    msg = str(e.value)
    assert fn.__name__ in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    ro = np.ones((2, 64), BF16)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="'x' is read-only"):
        dc.fp4_round(ro, 32)


def test_bf16_bitwise_across_levels_and_threads(rng):
    x = spread(rng, (1000, 512)).astype(BF16)
    results = {}
    before = dc.get_isa()
    try:
        for level in ("ref", dc.best_isa()):
            dc.set_isa(level)
            for n in (1, 2, 3):
                with threads(n):
                    results[(level, n)] = [
                        a.view(np.uint16) for a in (
                            dc.fp8_round(x.copy(), 64), dc.fp4_round(x.copy(), 32),
                            dc.fp4_round(x.copy(), 16, scale="e4m3"),
                            dc.fp8_round(x.copy(), 32, scale="fp32"), dc.hadamard(x),
                            dc.hadamard(x[:, :128]))]
    finally:
        dc.set_isa(before)
    first = results[("ref", 1)]
    for key, res in results.items():
        for a, b in zip(res, first):
            assert np.array_equal(a, b), key
