"""RMSNorm and RoPE/YaRN against the float32 reference (tests/ref_norm_rope.py)."""

import numpy as np
import pytest
import torch

import deepseek_csa as dc
from deepseek_csa import configs
from conftest import (
    ISA_LEVELS, assert_close, bf16_round, same_bits_at_thread_counts, threads, unchanged)
import ref_norm_rope as ref

T = torch.from_numpy


# ---------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("shape", [(8192, 512), (4, 4096), (2, 3, 128), (1, 1), (5, 7), (3, 0, 9),
                                   (2, 1, 3, 17)])
def test_rms_norm_matches_reference(isa, rng, shape):
    x = rng.standard_normal(shape, dtype=np.float32) * 3
    w = rng.standard_normal(shape[-1:], dtype=np.float32)
    with unchanged(x, w):
        got = dc.rms_norm(x, w, eps=1e-6)
        got_nw = dc.rms_norm(x)
    assert_close(got, ref.rms_norm(T(x), T(w)).numpy(), rtol=2e-6, atol=1e-6, what="rms_norm")
    assert_close(got_nw, ref.rms_norm(T(x)).numpy(), rtol=2e-6, atol=1e-6, what="rms_norm no w")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_large_output_is_bitwise_the_row_blocks(isa, rng, dtype):
    """An output of 32 MiB or more is stored past the caches (docs/kernels.md, RMSNorm):
    bitwise the same rows normed 256 at a time (ordinary stores), at an odd width, into
    output rows that start at every offset from a 64-byte line; nothing else of the
    output buffer is written."""
    import ml_dtypes
    rows, d = (8200, 1031) if dtype == "float32" else (16400, 1031)
    x = rng.standard_normal((rows, d), dtype=np.float32) * 3
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(d, dtype=np.float32)
    buf = np.full((rows, d + 3), 7, x.dtype)
    out = buf[:, 1:d + 1]
    assert out.nbytes >= 32 << 20
    with unchanged(x, w):
        assert dc.rms_norm(x, w, out=out) is out
        nw = dc.rms_norm(x)
    want = np.concatenate([dc.rms_norm(x[i:i + 256], w) for i in range(0, rows, 256)])
    want_nw = np.concatenate([dc.rms_norm(x[i:i + 256]) for i in range(0, rows, 256)])
    u = np.uint16 if dtype == "bfloat16" else np.uint32
    assert np.array_equal(np.ascontiguousarray(out).view(u), want.view(u))
    assert np.array_equal(nw.view(u), want_nw.view(u))
    assert (buf[:, 0] == 7).all() and (buf[:, d + 1:] == 7).all()


def test_rms_norm_bf16_tolerance(rng):
    """Same inputs through the reference in bfloat16: agreement at bf16 tolerance."""
    x = bf16_round(rng.standard_normal((64, 512), dtype=np.float32))
    w = bf16_round(rng.standard_normal(512, dtype=np.float32))
    want = ref.rms_norm(T(x).bfloat16(), T(w).bfloat16()).float().numpy()
    assert_close(dc.rms_norm(x, w), want, rtol=1.6e-2, atol=1e-2, what="bf16")


def test_rms_norm_strided_views_and_out(rng):
    base = rng.standard_normal((6, 10, 40), dtype=np.float32)
    x = base[::2, 1::3, ::-2]          # non-contiguous, reversed inner stride
    w = rng.standard_normal(40, dtype=np.float32)[::2]
    want = ref.rms_norm(T(np.ascontiguousarray(x)), T(np.ascontiguousarray(w))).numpy()
    assert_close(dc.rms_norm(x, w), want, rtol=2e-6, what="strided")
    out = np.full((6, 10, 40), 7.0, np.float32)[::2, 1::3, :20]
    r = dc.rms_norm(x, w, out=out)
    assert r is out
    assert_close(out, want, rtol=2e-6, what="out=")
    xi = np.ascontiguousarray(x)
    assert dc.rms_norm(xi, w, out=xi) is xi          # in place
    assert_close(xi, want, rtol=2e-6, what="in place")


def test_rms_norm_nan_inf_propagate_like_reference():
    x = np.array([[1, 2, np.nan, 4], [1, np.inf, 3, 4], [0, 0, 0, 0], [1e30, 1e30, 1, 1]],
                 np.float32)
    assert_close(dc.rms_norm(x), ref.rms_norm(T(x)).numpy(), rtol=2e-6, what="nan/inf")


def test_rms_norm_torch_tensor_no_copy():
    t = torch.randn(3, 16)
    r = dc.rms_norm(t, out=t)
    assert r is t
    assert_close(t.numpy(), ref.rms_norm(t).numpy(), rtol=2e-6, what="torch in place")


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((np.ones((2, 4)),), {}, TypeError, ["'x'", "float32", "float64"]),
    ((np.ones((2, 4), np.float16),), {}, TypeError, ["'x'", "float16"]),
    ((np.ones((2, 4), np.int32),), {}, TypeError, ["'x'", "int32"]),
    ((np.float32(3.0),), {}, ValueError, ["'x'", "dimensions"]),
    ((np.ones((2, 4), np.float32), np.ones(5, np.float32)), {}, ValueError,
     ["'weight'", "4", "[5]"]),
    ((np.ones((2, 4), np.float32), np.ones((1, 4), np.float32)), {}, ValueError, ["'weight'"]),
    ((np.ones((2, 4), np.float32),), {"eps": -1.0}, ValueError, ["'eps'"]),
    ((np.ones((2, 4), np.float32),), {"out": np.ones((2, 5), np.float32)}, ValueError,
     ["'out'", "[2, 4]", "[2, 5]"]),
    (("hello",), {}, TypeError, ["'x'"]),
])
def test_rms_norm_bad_inputs(args, kwargs, exc, words):
    arrays = [a for a in args if isinstance(a, np.ndarray)] + [
        v for v in kwargs.values() if isinstance(v, np.ndarray)]
    with unchanged(*arrays):
        with pytest.raises(exc) as e:
            dc.rms_norm(*args, **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_rms_norm_readonly_out_and_overlap():
    x = np.ones((2, 4), np.float32)
    ro = np.zeros((2, 4), np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="'out' is read-only"):
        dc.rms_norm(x, out=ro)
    big = np.ones((3, 4), np.float32)
    with unchanged(big), pytest.raises(ValueError, match="overlaps"):
        dc.rms_norm(big[:2], out=big[1:])


# ---------------------------------------------------------------- RoPE tables

@pytest.mark.parametrize("cfg", [configs.V4_FLASH, configs.V4_PRO, configs.V41_FLASH])
@pytest.mark.parametrize("ratio", [0, 4])
def test_rope_table_matches_reference(cfg, ratio):
    kw = cfg.rope_kwargs(ratio)
    c, s = dc.rope_table(cfg.rope_dim, 70000, **kw)
    rc, rs = ref.rope_table(cfg.rope_dim, 70000, **kw)
    assert c.shape == s.shape == (70000, cfg.rope_dim // 2)
    # the angle is float32(t) * f; cos/sin of it within a few float32 ulps of torch's
    assert_close(c, rc.numpy(), rtol=0, atol=4e-6, what="cos")
    assert_close(s, rs.numpy(), rtol=0, atol=4e-6, what="sin")


def test_rope_table_yarn_changes_only_slow_pairs():
    c0, _ = dc.rope_table(64, 1000, base=160000.0)
    c1, _ = dc.rope_table(64, 1000, base=160000.0, original_seq_len=65536, factor=16)
    assert np.array_equal(c0[:, :2], c1[:, :2])          # fastest pairs untouched
    assert not np.allclose(c0[:, -1], c1[:, -1])         # slowest pairs stretched
    rc, _ = ref.rope_table(64, 1000, 160000.0, 65536, 16, 32, 1)
    assert_close(c1, rc.numpy(), rtol=0, atol=4e-6)


def test_rope_table_equal_correction_bounds():
    """high == low uses a span of 0.001 (docs/kernels.md)."""
    kw = dict(base=10000.0, original_seq_len=4096, factor=4.0, beta_fast=8, beta_slow=8)
    c, s = dc.rope_table(16, 50, **kw)
    rc, rs = ref.rope_table(16, 50, **kw)
    assert_close(c, rc.numpy(), rtol=0, atol=4e-6)


@pytest.mark.parametrize("args, kwargs, exc, word", [
    ((63, 10), {"base": 1e4}, ValueError, "rope_dim"),
    ((0, 10), {"base": 1e4}, ValueError, "rope_dim"),
    ((64, -1), {"base": 1e4}, ValueError, "seqlen"),
    ((64, 10), {}, TypeError, "base"),
    ((64, 10), {"base": 0.5}, ValueError, "base"),
    ((64, 10), {"base": 1e4, "factor": 0.0}, ValueError, "factor"),
    ((64.0, 10), {"base": 1e4}, TypeError, "rope_dim"),
])
def test_rope_table_bad_inputs(args, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        dc.rope_table(*args, **kwargs)


# ---------------------------------------------------------------- apply_rope

def _tables(S, half, rng):
    a = rng.uniform(-50, 50, (S, half)).astype(np.float32)
    return np.cos(a), np.sin(a)


@pytest.mark.parametrize("shape", [(1, 4096, 64, 512), (2, 7, 3, 40), (3, 5, 96), (1, 1, 1, 2),
                                   (2, 0, 3, 8)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_matches_reference(isa, rng, shape, inverse):
    if shape[1] == 4096 and isa != ISA_LEVELS[-1]:
        pytest.skip("the released shape runs at the best ISA level; the small ones cover the rest")
    half = min(32, shape[-1] // 2)
    c, s = _tables(shape[1], half, rng)
    x = rng.standard_normal(shape, dtype=np.float32)
    head = x[..., :-2 * half].copy()
    want = ref.apply_rope(T(x[..., -2 * half:].copy()), T(c), T(s), inverse).numpy()
    with unchanged(c, s):
        r = dc.apply_rope(x, c, s, inverse=inverse)
    assert r is x
    assert_close(x[..., -2 * half:], want, rtol=1e-6, atol=1e-6, what="apply_rope")
    assert np.array_equal(x[..., :-2 * half], head), "features in front of the tail changed"


def test_apply_rope_on_tail_view_and_strided_tables(rng):
    """The reference rotates x[..., -64:] in place and reads every 4th table row."""
    x = rng.standard_normal((2, 6, 4, 512), dtype=np.float32)
    x0 = x.copy()
    cfull, sfull = _tables(24, 32, rng)
    c, s = cfull[::4], sfull[::4]
    want = ref.apply_rope(T(x0[..., -64:].copy()), T(c.copy()), T(s.copy())).numpy()
    dc.apply_rope(x[..., -64:], c, s)
    assert_close(x[..., -64:], want, rtol=1e-6, atol=1e-6, what="tail view")
    assert np.array_equal(x[..., :-64], x0[..., :-64])


def test_apply_rope_round_trip(rng):
    x = rng.standard_normal((1, 33, 2, 64), dtype=np.float32)
    x0 = x.copy()
    c, s = dc.rope_table(64, 33, base=160000.0, original_seq_len=65536, factor=16)
    dc.apply_rope(dc.apply_rope(x, c, s), c, s, inverse=True)
    assert_close(x, x0, rtol=1e-5, atol=1e-6)


def test_apply_rope_bf16_tolerance(rng):
    x = bf16_round(rng.standard_normal((1, 16, 4, 128), dtype=np.float32))
    c, s = dc.rope_table(64, 16, base=10000.0)
    want = ref.apply_rope(T(x).bfloat16(), T(c), T(s)).float().numpy()
    assert_close(dc.apply_rope(x.copy(), c, s), want, rtol=1.6e-2, atol=1e-2, what="bf16")


def test_apply_rope_nan_inf_stay_in_their_pair(rng):
    x = rng.standard_normal((1, 2, 8), dtype=np.float32)
    x[0, 0, 4] = np.nan
    x[0, 1, 2] = np.inf
    c, s = _tables(2, 4, rng)
    want = ref.apply_rope(T(x), T(c), T(s)).numpy()
    dc.apply_rope(x, c, s)
    assert_close(x, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make, exc, words", [
    (lambda x, c, s: (x.astype(np.float64), c, s), TypeError, ["'x'", "float64"]),
    (lambda x, c, s: (x[0, 0], c, s), ValueError, ["'x'", "3 to 4"]),
    (lambda x, c, s: (x, c[:-1], s[:-1]), ValueError, ["'cos'", "x.shape[1]"]),
    (lambda x, c, s: (x, c, s[:, :-1]), ValueError, ["'sin'"]),
    (lambda x, c, s: (x[..., :6], c, s), ValueError, ["'cos'", "features"]),
    (lambda x, c, s: (x, c.astype(np.float64), s), TypeError, ["'cos'"]),
    (lambda x, c, s: (x, c[None], s), ValueError, ["'cos'"]),
])
def test_apply_rope_bad_inputs(rng, make, exc, words):
    x = rng.standard_normal((2, 5, 3, 16), dtype=np.float32)
    c, s = _tables(5, 4, rng)
    xx, cc, ss = make(x, c, s)
    with unchanged(x, c, s):
        with pytest.raises(exc) as e:
            dc.apply_rope(xx, cc, ss)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_apply_rope_readonly_x(rng):
    x = rng.standard_normal((1, 2, 8), dtype=np.float32)
    x.setflags(write=False)
    c, s = _tables(2, 4, rng)
    with pytest.raises(ValueError, match="'x' is read-only"):
        dc.apply_rope(x, c, s)


# ---------------------------------------------------------------- threads

def test_threadpoolctl_limits_our_threads():
    from threadpoolctl import threadpool_info
    assert any(i["user_api"] == "openmp" for i in threadpool_info())
    with threads(1):
        assert dc.max_threads() == 1
    with threads(2):
        assert dc.max_threads() == 2


def test_bitwise_identical_at_1_and_2_threads(rng):
    x = rng.standard_normal((1000, 512), dtype=np.float32)
    w = rng.standard_normal(512, dtype=np.float32)
    q = rng.standard_normal((1, 257, 16, 128), dtype=np.float32)
    c, s = dc.rope_table(64, 257, base=1e4)
    same_bits_at_thread_counts(lambda: (dc.rms_norm(x, w), dc.apply_rope(q.copy(), c, s)))


# ---------------------------------------------------------------- bfloat16 in and out

def _bf16_ulps(got, want):
    """Distance in bfloat16 units in the last place (both bf16 values as float32)."""
    g = np.asarray(got, np.float32).view(np.int32) >> 16
    w = np.asarray(want, np.float32).view(np.int32) >> 16
    # map sign-magnitude to a monotone integer line
    g = np.where(g < 0, -(g & 0x7FFF), g)
    w = np.where(w < 0, -(w & 0x7FFF), w)
    return np.abs(g.astype(np.int64) - w)


@pytest.mark.parametrize("shape", [(64, 512), (3, 5, 7), (2, 0, 4)])
def test_rms_norm_bf16_native_within_one_ulp(isa, rng, shape):
    import ml_dtypes
    x = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(shape[-1], dtype=np.float32)
    with unchanged(x.view(np.uint16), w):
        y = dc.rms_norm(x, w)
    assert y.dtype == x.dtype and y.shape == x.shape
    want = ref.rms_norm(T(x.astype(np.float32)).bfloat16(), T(w)).float().numpy()
    assert _bf16_ulps(y.astype(np.float32), want).max(initial=0) <= 1


def test_bf16_torch_tensors_in_place_without_copy(rng):
    t = torch.randn(4, 6, 2, 128, dtype=torch.bfloat16)
    want = ref.rms_norm(t)
    ptr = t.data_ptr()
    assert dc.rms_norm(t, out=t) is t and t.data_ptr() == ptr
    assert _bf16_ulps(t.float().numpy(), want.float().numpy()).max() <= 1
    c, s = dc.rope_table(64, 6, base=1e4)
    t2 = t.clone()
    want = ref.apply_rope(t2, T(c), T(s))
    assert dc.apply_rope(t2[..., -64:], c, s) is not None
    assert _bf16_ulps(t2.float().numpy(), want.float().numpy()).max() <= 1
    assert torch.equal(t2[..., :-64], t[..., :-64])


def test_apply_rope_bf16_native_within_one_ulp(isa, rng):
    import ml_dtypes
    x = rng.standard_normal((2, 9, 3, 128), dtype=np.float32).astype(ml_dtypes.bfloat16)
    c, s = dc.rope_table(64, 9, base=160000.0, original_seq_len=65536, factor=16)
    want = ref.apply_rope(T(x.astype(np.float32)).bfloat16(), T(c), T(s), True).float().numpy()
    dc.apply_rope(x[..., -64:], c, s, inverse=True)
    assert _bf16_ulps(x.astype(np.float32), want).max() <= 1


def test_bf16_out_must_match_dtype(rng):
    import ml_dtypes
    x = np.ones((2, 4), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="'out'.*bfloat16"):
        dc.rms_norm(x, out=np.ones((2, 4), np.float32))
