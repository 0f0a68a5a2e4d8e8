"""Backward of RMSNorm, rotary embedding and gated pooling (docs/kernels.md, section 11.2).

References are written here from the formulas (float64 NumPy, and float64 torch autograd
on a float64 reference that torch.autograd.gradcheck validates first); none calls
deepseek_csa.

Error budget (float32 kernels against float64 references):
- gated pooling: a logit l carries a rounding error of ~|l| * 2^-24 and exp adds ~1 ulp,
  so each softmax weight w is good to a relative ~(|l|max + 2) * 6e-8 <= 1e-6 at our
  scales (|l| <= ~10); d(kv) = w dy inherits it (bound: relative 2e-5).  d(score) =
  w dy (kv - y) also carries y's absolute error, ~1e-6 * max|kv|, so each element's
  bound is 2e-5 * |ref| + 4e-6 * |w dy| * max|kv| (element-wise, so a relative 1e-4
  error in y is caught).  d(ape) sums B*G such terms: the sum of their bounds plus
  1e-6 * B*G * sum|terms| for the float32 summation.
- RMSNorm: inv to ~2 ulp, the dot product over D to ~D * 6e-8 relative to sum|g x|, so
  d(x) is within 2e-5 relative plus 1e-6 * D^(1/2) * max|g| * inv absolute; d(weight)
  sums R rows: absolute 1e-6 * R * max|dy x inv|.
- RoPE: a 2x2 rotation per pair, two products and a sum: 3e-7 relative to |grad|.
"""
import itertools

import numpy as np
import pytest
import torch

import deepseek_csa as dc
from conftest import assert_close, same_bits_at_thread_counts, unchanged

T_ = torch.from_numpy


# ---------------------------------------------------------------- references (float64)

def _cands(g, r, d, overlap):
    """(token, feature slice, ape row) of every candidate of entry g."""
    if not overlap:
        return [(g * r + j, slice(0, d), j) for j in range(r)]
    prev = [((g - 1) * r + j, slice(0, d), j) for j in range(r)] if g > 0 else []
    return prev + [(g * r + j, slice(d, 2 * d), j) for j in range(r)]


def ref_pool_backward(dy, kv, sc, r, ape, overlap):
    """d(kv), d(score), d(ape) in float64, straight from the softmax formulas."""
    kv = np.asarray(kv, np.float64)
    dy = np.asarray(dy, np.float64)
    B, T, cd = kv.shape
    d, G = cd // (2 if overlap else 1), T // r
    gk, gs, ga = np.zeros_like(kv), np.zeros_like(kv), np.zeros((r, cd))
    if r == 1 and not overlap:
        gk[:, :G] = dy
        return gk, gs, ga
    sc = np.asarray(sc, np.float64)
    a = np.zeros((r, cd)) if ape is None else np.asarray(ape, np.float64)
    for g in range(G):
        c = _cands(g, r, d, overlap)
        L = np.stack([sc[:, t, fs] + a[j, fs] for t, fs, j in c])
        K = np.stack([kv[:, t, fs] for t, fs, j in c])
        E = np.exp(L - L.max(0))
        W = E / E.sum(0)
        y = (W * K).sum(0)
        for q, (t, fs, j) in enumerate(c):
            gk[:, t, fs] = W[q] * dy[:, g]
            gs[:, t, fs] = W[q] * dy[:, g] * (K[q] - y)
            ga[j, fs] += (W[q] * dy[:, g] * (K[q] - y)).sum(0)
    return gk, gs, ga


def torch_pool(kv, sc, r, ape, overlap):
    """Gated pooling in torch (any dtype; differentiable), written from the formula."""
    B, T, cd = kv.shape
    d, G = cd // (2 if overlap else 1), T // r
    if r == 1 and not overlap:
        return kv[:, :G]
    l = sc[:, :G * r]
    if ape is not None:
        l = l + ape.repeat(G, 1)
    l, k = l.reshape(B, G, r, cd), kv[:, :G * r].reshape(B, G, r, cd)
    if overlap:
        pad_l = torch.full((B, 1, r, d), -float("inf"), dtype=l.dtype)
        pad_k = torch.zeros((B, 1, r, d), dtype=k.dtype)
        l = torch.cat([torch.cat([pad_l, l[:, :-1, :, :d]], 1), l[..., d:]], 2)
        k = torch.cat([torch.cat([pad_k, k[:, :-1, :, :d]], 1), k[..., d:]], 2)
    return (torch.softmax(l, 2) * k).sum(2)


def ref_rms_backward(dy, x, w, eps):
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    D = x.shape[-1]
    if D == 0:
        return np.zeros_like(x), np.zeros(0)
    inv = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    g = dy * (1.0 if w is None else np.asarray(w, np.float64))
    dx = inv * g - x * inv ** 3 * (g * x).sum(-1, keepdims=True) / D
    dw = (dy * x * inv).reshape(-1, D).sum(0)
    return dx, dw


def torch_rms(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def torch_rope(x, cos, sin, inverse):
    """Pairs (x[2i], x[2i+1]) rotated by angle a (-a when inverse), positions on axis 1."""
    s = -sin if inverse else sin
    shape = [1, cos.shape[0]] + [1] * (x.dim() - 3) + [cos.shape[1]]
    c, s = cos.reshape(shape), s.reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)


def _inputs(rng, B, T, cd, r, ape=True, scale=2.0):
    kv = rng.standard_normal((B, T, cd), dtype=np.float32)
    sc = (rng.standard_normal((B, T, cd)) * scale).astype(np.float32)
    ap = rng.standard_normal((r, cd), dtype=np.float32) if ape else None
    dy = rng.standard_normal((B, T // r, cd // (1 + 0)), dtype=np.float32)
    return kv, sc, ap, dy


def _dy(rng, B, T, r, d):
    return rng.standard_normal((B, T // r, d), dtype=np.float32)


def _bounded(got, want, bound, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.size} outside the budget; "
                             f"worst at {i}: got {got[i]:.8g} want {want[i]:.8g} "
                             f"bound {bound[i]:.3g}")


def _check_pool(got, want, dy, kv, r, what):
    """The module docstring's budget, element by element: d(kv) within 2e-5 relative;
    d(score) within 2e-5 relative plus 4e-6 * |w dy| * max|kv| (y's error); d(ape) the
    sum of its terms' bounds plus the summation's own rounding."""
    gk, gs, ga = got
    rk, rs, ra = want
    kvmax = float(np.abs(kv).max(initial=1.0))
    _bounded(gk, rk, 2e-5 * np.abs(rk) + 1e-30, f"{what} d(kv)")
    bs = 2e-5 * np.abs(rs) + 4e-6 * np.abs(rk) * kvmax + 1e-30
    _bounded(gs, rs, bs, f"{what} d(score)")
    if ga is not None:
        B, T, cd = kv.shape
        G = T // r
        n = max(B * G, 1)
        grp = lambda a: a[:, :G * r].reshape(B * G, r, cd) if B * G else np.zeros((1, r, cd))
        ba = grp(bs).sum(0) + 1e-6 * n * grp(np.abs(rs)).sum(0) + 1e-30
        _bounded(ga, ra, ba, f"{what} d(ape)")


# ---------------------------------------------------------------- the float64 references themselves

def test_torch_references_pass_gradcheck():
    g = torch.Generator().manual_seed(0)
    for (B, T, d, r, ov) in [(2, 9, 3, 4, True), (1, 7, 2, 3, False), (2, 5, 2, 1, True)]:
        cd = d * (2 if ov else 1)
        kv = torch.randn(B, T, cd, dtype=torch.float64, generator=g, requires_grad=True)
        sc = torch.randn(B, T, cd, dtype=torch.float64, generator=g, requires_grad=True)
        ap = torch.randn(r, cd, dtype=torch.float64, generator=g, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a, b, c: torch_pool(a, b, r, c, ov), (kv, sc, ap))
    x = torch.randn(3, 2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch_rms(a, b, 1e-6), (x, w))
    cos, sin = torch.cos(torch.randn(4, 3, dtype=torch.float64)), None
    ang = torch.randn(4, 3, dtype=torch.float64, generator=g)
    cos, sin = torch.cos(ang), torch.sin(ang)
    x = torch.randn(2, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: torch_rope(a, cos, sin, False), (x,))


def test_numpy_pool_reference_is_torch_autograd():
    """The float64 NumPy reference (used for the big shapes) equals float64 autograd."""
    rng = np.random.default_rng(5)
    for (B, T, d, r, ov) in [(2, 11, 3, 4, True), (2, 9, 4, 2, False), (1, 7, 2, 1, True)]:
        cd = d * (2 if ov else 1)
        kv, sc, ap, _ = _inputs(rng, B, T, cd, r)
        dy = _dy(rng, B, T, r, d)
        t = [T_(a.astype(np.float64)).requires_grad_() for a in (kv, sc, ap)]
        torch_pool(*t[:2], r, t[2], ov).backward(T_(dy.astype(np.float64)))
        for got, want in zip(ref_pool_backward(dy, kv, sc, r, ap, ov), t):
            np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- gated_pool_backward

ODD = [  # B, T, D, ratio, overlap, ape
    (3, 13, 17, 4, True, True),     # T % r = 1, overlap at the first group, batch 3
    (2, 3, 8, 4, True, True),       # T < r: no entry, every gradient 0
    (2, 4, 8, 4, True, False),      # one group: only the first (overlap) entry
    (1, 11, 37, 5, False, True),
    (2, 9, 33, 2, False, True),
    (2, 7, 16, 1, True, True),      # ratio 1 with overlap (a gate of 2 candidates)
    (2, 7, 5, 1, False, True),      # ratio 1 ungated: d(kv) = dy, d(score) = 0
    (1, 300, 24, 128, False, True),  # T % 128 = 44
    (2, 25, 1, 3, True, True),
    (1, 5, 300, 2, True, False),     # D beyond the tuned chunk
    (0, 8, 8, 2, False, True), (2, 0, 8, 4, True, True),
]


@pytest.mark.parametrize("B, T, D, r, ov, has_ape", ODD)
def test_gated_pool_backward_odd_shapes(isa, rng, B, T, D, r, ov, has_ape):
    cd = D * (2 if ov else 1)
    kv, sc, ap, _ = _inputs(rng, B, T, cd, r, has_ape)
    dy = _dy(rng, B, T, r, D)
    with unchanged(dy, kv, sc, *([ap] if has_ape else [])):
        got = dc.gated_pool_backward(dy, kv, sc, r, ape=ap, overlap=ov)
    assert (got[2] is None) == (not has_ape)
    want = ref_pool_backward(dy, kv, sc, r, ap, ov)
    _check_pool(got, want, dy, kv, r, f"B{B} T{T} D{D} r{r} ov{ov}")
    G = T // r
    assert not got[0][:, G * r:].any() and not got[1][:, G * r:].any(), "trailing tokens"
    if ov and G:
        assert not got[0][:, (G - 1) * r:, :D].any(), "last group's first halves feed nothing"


@pytest.mark.parametrize("kind, D, T", [
    ((4, True, True), 512, 1027), ((4, True, True), 128, 1027),     # V4 CSA KV, indexer
    ((128, False, True), 512, 1027), ((2, False, False), 512, 1027),  # V4 HCA, V4.1 pair
    ((1, False, False), 512, 259)])                                   # V4.1 ungated
def test_gated_pool_backward_released_shapes(rng, kind, D, T):
    r, ov, has_ape = kind
    cd = D * (2 if ov else 1)
    kv, sc, ap, _ = _inputs(rng, 1, T, cd, r, has_ape)
    dy = _dy(rng, 1, T, r, D)
    got = dc.gated_pool_backward(dy, kv, sc, r, ape=ap, overlap=ov)
    _check_pool(got, ref_pool_backward(dy, kv, sc, r, ap, ov), dy, kv, r, f"r{r}")


def test_gated_pool_backward_ratio1_ungated_is_identity(rng):
    kv = rng.standard_normal((2, 6, 9), dtype=np.float32)
    dy = rng.standard_normal((2, 6, 9), dtype=np.float32)
    gk, gs, ga = dc.gated_pool_backward(dy, kv, None, 1)
    assert np.array_equal(gk, dy) and not gs.any() and ga is None


def test_gated_pool_backward_bf16_inputs(rng):
    """bfloat16 kv / score / grad_out are widened exactly: the float32 result on the
    widened values, bitwise."""
    import ml_dtypes
    kv, sc, ap, _ = _inputs(rng, 2, 14, 32, 4)
    dy = _dy(rng, 2, 14, 4, 16)
    h = [a.astype(ml_dtypes.bfloat16) for a in (dy, kv, sc)]
    w = [a.astype(np.float32) for a in h]
    got = dc.gated_pool_backward(*h, 4, ape=ap, overlap=True)
    want = dc.gated_pool_backward(*w, 4, ape=ap, overlap=True)
    for a, b in zip(got, want):
        assert a.dtype == np.float32 and np.array_equal(a, b)


def test_bf16_gradients_are_the_float32_ones_rounded(isa, rng):
    """grad_dtype='bfloat16' (gated_pool_backward: grad_kv, grad_score; rms_norm_backward:
    grad_x): the float32 gradient rounded once to nearest-even, bitwise (no error budget:
    the same float32 arithmetic, one rounding), from bf16 inputs and float32 ones, into a
    new array or a strided bf16 out=; the other gradients stay float32."""
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    kv, sc, ap, _ = _inputs(rng, 2, 22, 32, 4)
    dy = _dy(rng, 2, 22, 4, 16)
    for args in ((dy, kv, sc), tuple(a.astype(bf) for a in (dy, kv, sc))):
        want = dc.gated_pool_backward(*args, 4, ape=ap, overlap=True)
        got = dc.gated_pool_backward(*args, 4, ape=ap, overlap=True, grad_dtype="bfloat16")
        assert got[0].dtype == bf and got[1].dtype == bf and got[2].dtype == np.float32
        for g, w in zip(got[:2], want[:2]):
            assert np.array_equal(g.view(np.uint16), w.astype(bf).view(np.uint16))
        assert np.array_equal(got[2], want[2])
        big = np.zeros((2, 22, 64), bf)
        r = dc.gated_pool_backward(*args, 4, ape=ap, overlap=True, grad_dtype=bf,
                                   grad_kv=big[..., ::2])
        assert r[0].base is big and np.array_equal(np.asarray(r[0], np.float32),
                                                   np.asarray(got[0], np.float32))
    x = rng.standard_normal((5, 3, 40), dtype=np.float32)
    g = rng.standard_normal((5, 3, 40), dtype=np.float32)
    w = rng.standard_normal(40, dtype=np.float32)
    for xa, ga in ((x, g), (x.astype(bf), g.astype(bf))):
        want = dc.rms_norm_backward(ga, xa, w, 1e-6)
        got = dc.rms_norm_backward(ga, xa, w, 1e-6, grad_dtype="bfloat16")
        assert got[0].dtype == bf and got[1].dtype == np.float32
        assert np.array_equal(got[0].view(np.uint16), want[0].astype(bf).view(np.uint16))
        assert np.array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="grad_dtype"):
        dc.rms_norm_backward(g, x, w, 1e-6, grad_dtype="int8")
    with pytest.raises(TypeError, match="grad_kv"):
        dc.gated_pool_backward(dy, kv, sc, 4, ape=ap, overlap=True, grad_dtype="bfloat16",
                               grad_kv=np.zeros_like(kv))


def _round_bf16_bits(f32):
    """bfloat16 bits of float32 values, written out here: nearest-even, and a NaN keeps
    its sign and top payload bits with the quiet bit set."""
    u = np.ascontiguousarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    hi = u >> 16
    r = (u + 0x7FFF + (hi & 1)) >> 16
    return np.where(np.isnan(f32), hi | 0x40, r).astype(np.uint16)


@pytest.mark.parametrize("B, T, D, r, ov", [(2, 45, 96, 4, True), (1, 300, 160, 128, False),
                                             (2, 23, 200, 4, False)])
def test_bf16_gradients_on_rows_of_whole_blocks(isa, rng, B, T, D, r, ov):
    """Rows wide enough that the tuned bodies' blocks (32 or 64 features) lie whole
    inside them, where the AVX2 body rounds and packs two vectors of each gradient at
    once with one NaN test for both: the float32 gradients rounded, bit for bit, with
    NaN, inf and overflowing values in the inputs and at several output offsets; float32
    inputs carry NaNs whose low payload bits a rounding without the NaN rule would
    carry into the kept bits."""
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    cd = D * (2 if ov else 1)
    kv, sc, ap, _ = _inputs(rng, B, T, cd, r)
    sc[0, 1::5, 3::17] = np.nan
    kv[-1, 2::7, 40:44] = np.inf
    kv[0, 0, 64:72] = 3e38
    kv.view(np.uint32)[-1, 1::3, 91::13] = 0x7FA0FFFF
    dy = _dy(rng, B, T, r, D)
    with np.errstate(invalid="ignore"):      # the signalling NaNs, narrowed
        h16 = tuple(a.astype(bf) for a in (dy, kv, sc))
    for h, off in itertools.product(((dy, kv, sc), h16), (0, 16, 48)):
        want = dc.gated_pool_backward(*h, r, ape=ap, overlap=ov)
        n = B * T * cd * 2
        raw = [np.zeros(n + 128, np.uint8) for _ in range(2)]
        gk, gs = (x[(-x.ctypes.data) % 64 + off:][:n].view(bf).reshape(B, T, cd) for x in raw)
        dc.gated_pool_backward(*h, r, ape=ap, overlap=ov, grad_kv=gk, grad_score=gs,
                               grad_dtype=bf)
        for g, w in zip((gk, gs), want[:2]):
            assert np.isnan(w).any() and np.array_equal(g.view(np.uint16), _round_bf16_bits(w))


def test_gated_pool_backward_strided_and_out(rng):
    kv, sc, ap, _ = _inputs(rng, 2, 18, 40, 4)
    dy = _dy(rng, 2, 18, 4, 20)
    want = dc.gated_pool_backward(dy, kv, sc, 4, ape=ap, overlap=True)
    big = rng.standard_normal((2, 18, 80), dtype=np.float32)
    big[..., ::2] = kv
    outs = [np.full((2, 18, 40), 7.0, np.float32), np.full((2, 18, 40), 7.0, np.float32),
            np.full((4, 40), 7.0, np.float32)]
    sk = np.zeros((2, 18, 80), np.float32)[..., ::2]          # a strided grad_kv
    r = dc.gated_pool_backward(dy, big[..., ::2], sc, 4, ape=ap, overlap=True, grad_kv=sk,
                               grad_score=outs[1], grad_ape=outs[2])
    assert r[0] is sk and r[1] is outs[1] and r[2] is outs[2]
    for a, b in zip((sk, outs[1], outs[2]), want):
        assert np.array_equal(a, b)


def test_gated_pool_backward_bits_at_thread_counts(isa, rng):
    """The tuned body's items are chunks of entries that the shape alone decides (here 4,
    2, 2, -, 8 and 6 of them), each with its own partial d(ape): the same bits at 1, 2, 3
    threads, NaN and inf inputs included."""
    for (B, T, D, r, ov) in [(2, 403, 96, 4, True), (2, 515, 64, 128, False),
                             (3, 301, 80, 2, False), (2, 64, 200, 1, False),
                             (1, 2051, 128, 4, True), (3, 1100, 72, 128, False)]:
        cd = D * (2 if ov else 1)
        kv, sc, ap, _ = _inputs(rng, B, T, cd, r)
        if T > 1000:
            sc[0, ::7, ::5] = np.nan
            kv[-1, 3::11, ::3] = np.inf
        dy = _dy(rng, B, T, r, D)
        same_bits_at_thread_counts(lambda: dc.gated_pool_backward(dy, kv, sc, r, ape=ap,
                                                                  overlap=ov))


def test_gated_pool_backward_bits_at_any_output_alignment(isa, rng):
    """The tuned body streams whole lines and cuts its feature chunks on d(kv)'s lines:
    where the results start (any 4-byte offset in a line) changes no bit, float32 or
    bfloat16 gradients, NaN signs included."""
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    for (T, D, r, ov) in [(259, 96, 4, True), (515, 72, 128, False)]:
        cd = D * (2 if ov else 1)
        kv, sc, ap, _ = _inputs(rng, 1, T, cd, r)
        sc[0, ::7, ::5] = np.nan
        dy = _dy(rng, 1, T, r, D)
        for gdt in (np.float32, bf):
            n = T * cd * np.dtype(gdt).itemsize
            got = []
            for off in (0, 4, 16, 36):
                raw = [np.zeros(n + 128, np.uint8) for _ in range(2)]
                o = [(-x.ctypes.data) % 64 + off for x in raw]
                gk, gs = (x[k:k + n].view(gdt).reshape(1, T, cd) for x, k in zip(raw, o))
                r3 = dc.gated_pool_backward(dy, kv, sc, r, ape=ap, overlap=ov, grad_kv=gk,
                                            grad_score=gs, grad_dtype=gdt)
                got.append([np.asarray(a).view(np.uint8).copy() for a in r3])
            for g in got[1:]:
                assert all(np.array_equal(a, b) for a, b in zip(got[0], g))


def test_gated_pool_backward_errors(rng):
    kv, sc, ap, _ = _inputs(rng, 1, 8, 8, 4)
    dy = _dy(rng, 1, 8, 4, 4)
    with pytest.raises(ValueError, match="grad_out"):
        dc.gated_pool_backward(dy[:, :1], kv, sc, 4, ape=ap, overlap=True)
    with pytest.raises(ValueError, match="score"):
        dc.gated_pool_backward(dy, kv, sc[:, :4], 4, ape=ap, overlap=True)
    with pytest.raises(ValueError, match="grad_ape"):
        dc.gated_pool_backward(dy, kv, sc, 4, overlap=True, grad_ape=np.zeros((4, 8), np.float32))
    ro = np.zeros((1, 8, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="grad_kv"):
        dc.gated_pool_backward(dy, kv, sc, 4, ape=ap, overlap=True, grad_kv=ro)


# ---------------------------------------------------------------- streaming

@pytest.mark.parametrize("r, ov, has_ape, T1, T2", [
    (4, True, True, 10, 13), (4, True, True, 3, 9), (128, False, True, 130, 260),
    (2, False, False, 5, 6), (1, False, False, 3, 4), (3, True, False, 0, 10)])
def test_streaming_gradient_is_the_concatenations(isa, rng, r, ov, has_ape, T1, T2):
    """A prefill of T1 tokens and T2 decode tokens (the Compressor's streaming: each
    emitted decode entry pools the state's rows -- with overlap the previous group's
    first halves and the open group) get the gradient of ONE gated_pool over the
    concatenation: prefill's backward on its complete groups plus, per decode entry,
    gated_pool_backward over the window of tokens the state held, scattered back to
    their positions.  Every (token, feature) feeds one entry, so d(kv) and d(score) are
    bitwise those of the one-shot call; d(ape) is the same sum in the same order."""
    D = 6
    cd = D * (2 if ov else 1)
    T = T1 + T2
    kv, sc, ap, _ = _inputs(rng, 1, T, cd, r, has_ape)
    dy = _dy(rng, 1, T, r, D)
    # the forward streaming law first: Compressor prefill + steps = one gated_pool
    comp = dc.Compressor(1, r, D, overlap=ov, ape=ap)
    ent = [comp.prefill(kv[:, :T1], sc[:, :T1])]
    for p in range(T1, T):
        e = comp.step(kv[:, p:p + 1], sc[:, p:p + 1], p)
        if e is not None:
            ent.append(e)
    one = dc.gated_pool(kv, sc, r, ape=ap, overlap=ov)
    assert np.array_equal(np.concatenate(ent, 1), one)
    # the backward, piece by piece
    G1 = T1 // r
    gk, gs = np.zeros_like(kv), np.zeros_like(kv)
    ga = np.zeros((r, cd), np.float32) if has_ape else None
    pk, ps, pa = dc.gated_pool_backward(dy[:, :G1], kv[:, :T1], sc[:, :T1], r, ape=ap,
                                        overlap=ov)
    gk[:, :T1], gs[:, :T1] = pk, ps
    if has_ape:
        ga = pa
    for g in range(G1, T // r):             # entries the decode steps emit
        lo = (g - 1) * r if (ov and g > 0) else g * r
        win = slice(lo, (g + 1) * r)
        wdy = np.zeros((1, (win.stop - lo) // r, D), np.float32)
        wdy[:, -1] = dy[:, g]
        wk, ws, wa = dc.gated_pool_backward(wdy, kv[:, win], sc[:, win], r, ape=ap, overlap=ov)
        if ov and g > 0:
            gk[:, win.start:g * r, :D] = wk[:, :r, :D]      # the previous group's first halves
            gs[:, win.start:g * r, :D] = ws[:, :r, :D]
            gk[:, g * r:win.stop, D:] = wk[:, r:, D:]
            gs[:, g * r:win.stop, D:] = ws[:, r:, D:]
        else:
            gk[:, win], gs[:, win] = wk, ws
        if has_ape:
            ga = ga + wa
    want = dc.gated_pool_backward(dy, kv, sc, r, ape=ap, overlap=ov)
    assert np.array_equal(gk, want[0]) and np.array_equal(gs, want[1])
    if has_ape:
        assert np.array_equal(ga, want[2])


def test_streaming_torch_state_carries_the_gradient(rng):
    """torch: a prefill keeps its open group (and, with overlap, its last complete group)
    as tensors of the graph; each decode entry pools the state + the new token; the
    gradient of a loss over every entry equals the one-shot gated_pool's."""
    import deepseek_csa.torch as dct
    r, D, T1, T = 4, 8, 10, 23
    kv0, sc0, ap0, _ = _inputs(rng, 2, T, 2 * D, r)
    wgt = T_(rng.standard_normal((2, T // r, D), dtype=np.float32))

    def leaves():
        return [T_(a.copy()).requires_grad_() for a in (kv0, sc0, ap0)]

    kv, sc, ap = leaves()
    whole = T1 // r * r
    ent = [dct.gated_pool(kv[:, :T1], sc[:, :T1], r, ape=ap, overlap=True)]
    state_kv, state_sc = kv[:, whole - r:T1], sc[:, whole - r:T1]   # prev group + open tail
    for p in range(T1, T):
        state_kv = torch.cat([state_kv, kv[:, p:p + 1]], 1)
        state_sc = torch.cat([state_sc, sc[:, p:p + 1]], 1)
        if (p + 1) % r == 0:
            ent.append(dct.gated_pool(state_kv, state_sc, r, ape=ap, overlap=True)[:, -1:])
            state_kv, state_sc = state_kv[:, -r:], state_sc[:, -r:]
    (torch.cat(ent, 1) * wgt).sum().backward()
    k1, s1, a1 = leaves()
    (dct.gated_pool(k1, s1, r, ape=a1, overlap=True) * wgt).sum().backward()
    assert torch.equal(kv.grad, k1.grad) and torch.equal(sc.grad, s1.grad)
    assert_close(ap.grad.numpy(), a1.grad.numpy(), rtol=1e-6, atol=1e-6, what="d(ape)")


# ---------------------------------------------------------------- rms_norm_backward

@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 7), (130, 64), (200, 33), (65, 1030), (0, 8),
                                   (4, 0)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_backward_odd_shapes(isa, rng, shape, weighted):
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    w = rng.standard_normal(shape[-1], dtype=np.float32) if weighted else None
    with unchanged(x, dy, *([w] if weighted else [])):
        gx, gw = dc.rms_norm_backward(dy, x, w, 1e-6)
    rx, rw = ref_rms_backward(dy, x, w, 1e-6)
    D = max(shape[-1], 1)
    inv = 1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + 1e-6).max(initial=1.0) \
        if x.size else 1.0
    gmax = float(np.abs(dy).max(initial=1.0) * (np.abs(w).max(initial=1.0) if weighted else 1))
    assert_close(gx, rx, rtol=2e-5, atol=1e-6 * np.sqrt(D) * gmax * max(inv, 1.0) * 4,
                 what="d(x)")
    if weighted:
        rows = int(np.prod(shape[:-1]))
        assert_close(gw, rw, rtol=2e-5, atol=1e-6 * max(rows, 1) * 4, what="d(weight)")
    else:
        assert gw is None


def test_rms_norm_backward_released_shape(rng):
    x = rng.standard_normal((1, 1024, 4096), dtype=np.float32)
    dy = rng.standard_normal((1, 1024, 4096), dtype=np.float32)
    w = rng.standard_normal(4096, dtype=np.float32)
    gx, gw = dc.rms_norm_backward(dy, x, w, 1e-6)
    rx, rw = ref_rms_backward(dy, x, w, 1e-6)
    assert_close(gx, rx, rtol=2e-5, atol=1e-4, what="d(x)")
    assert_close(gw, rw, rtol=2e-5, atol=4e-3, what="d(weight)")


def test_rms_norm_backward_bits_at_thread_counts(isa, rng):
    for shape in [(1000, 96), (129, 4096), (7, 3, 500)]:
        x = rng.standard_normal(shape, dtype=np.float32)
        dy = rng.standard_normal(shape, dtype=np.float32)
        w = rng.standard_normal(shape[-1], dtype=np.float32)
        same_bits_at_thread_counts(lambda: dc.rms_norm_backward(dy, x, w, 1e-6))


def test_rms_norm_backward_bf16_and_strides(rng):
    import ml_dtypes
    x = rng.standard_normal((6, 40), dtype=np.float32)
    dy = rng.standard_normal((6, 40), dtype=np.float32)
    w = rng.standard_normal(40, dtype=np.float32)
    xh, dh = x.astype(ml_dtypes.bfloat16), dy.astype(ml_dtypes.bfloat16)
    a = dc.rms_norm_backward(dh, xh, w, 1e-6)
    b = dc.rms_norm_backward(dh.astype(np.float32), xh.astype(np.float32), w, 1e-6)
    # the same values widened (the row sums' order is written out, the element-wise
    # loops may be vectorized differently per dtype: within float32 rounding)
    assert a[0].dtype == np.float32 and a[1].dtype == np.float32
    assert_close(a[0], b[0], rtol=1e-6, atol=1e-6, what="bf16 d(x)")
    assert_close(a[1], b[1], rtol=1e-6, atol=1e-6, what="bf16 d(w)")
    big = np.zeros((6, 80), np.float32)
    big[:, 1::2] = x
    gx = np.zeros((6, 80), np.float32)[:, ::2]
    r = dc.rms_norm_backward(dy.T.copy().T, big[:, 1::2], w, 1e-6, grad_x=gx)
    want = dc.rms_norm_backward(dy, x, w, 1e-6)
    assert r[0] is gx and np.array_equal(gx, want[0]) and np.array_equal(r[1], want[1])


# ---------------------------------------------------------------- torch

@pytest.mark.parametrize("B, T, D, r, ov", [(2, 11, 5, 4, True), (2, 9, 3, 2, False),
                                              (1, 260, 20, 128, False), (2, 5, 4, 1, True)])
def test_torch_gated_pool_grads(rng, B, T, D, r, ov):
    import deepseek_csa.torch as dct
    cd = D * (2 if ov else 1)
    kv, sc, ap, _ = _inputs(rng, B, T, cd, r)
    dy = _dy(rng, B, T, r, D)
    t = [T_(a.copy()).requires_grad_() for a in (kv, sc, ap)]
    y = dct.gated_pool(t[0], t[1], r, ape=t[2], overlap=ov)
    y.backward(T_(dy))
    t64 = [T_(a.astype(np.float64)).requires_grad_() for a in (kv, sc, ap)]
    y64 = torch_pool(t64[0], t64[1], r, t64[2], ov)
    y64.backward(T_(dy.astype(np.float64)))
    assert_close(y.detach().numpy(), y64.detach().numpy(), rtol=1e-5, atol=2e-6, what="out")
    _check_pool([a.grad.numpy() for a in t], [a.grad.numpy() for a in t64], dy, kv, r, "torch")


def test_torch_gated_pool_no_grad_and_bf16(rng):
    import deepseek_csa.torch as dct
    kv, sc, ap, _ = _inputs(rng, 1, 12, 16, 4)
    y = dct.gated_pool(T_(kv), T_(sc), 4, ape=T_(ap), overlap=True)
    assert not y.requires_grad and np.array_equal(
        y.numpy(), dc.gated_pool(kv, sc, 4, ape=ap, overlap=True))
    kb = T_(kv).bfloat16().requires_grad_()
    sb = T_(sc).bfloat16().requires_grad_()
    y = dct.gated_pool(kb, sb, 4, ape=T_(ap), overlap=True)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert kb.grad.dtype == torch.bfloat16 and sb.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("weighted", [True, False])
def test_torch_rms_norm_dropin_grads(rng, weighted):
    import deepseek_csa.torch as dct
    x = rng.standard_normal((2, 7, 33), dtype=np.float32)
    w = rng.standard_normal(33, dtype=np.float32)
    dy = rng.standard_normal((2, 7, 33), dtype=np.float32)
    xt, wt = T_(x.copy()).requires_grad_(), T_(w.copy()).requires_grad_()
    y = dct.rms_norm(xt, wt if weighted else None, 1e-6)
    y.backward(T_(dy))
    x64, w64 = T_(x.astype(np.float64)).requires_grad_(), T_(w.astype(np.float64)).requires_grad_()
    torch_rms(x64, w64 if weighted else None, 1e-6).backward(T_(dy.astype(np.float64)))
    assert_close(xt.grad.numpy(), x64.grad.numpy(), rtol=2e-5, atol=2e-5, what="d(x)")
    if weighted:
        assert_close(wt.grad.numpy(), w64.grad.numpy(), rtol=2e-5, atol=2e-5, what="d(w)")

    class Norm(torch.nn.Module):      # rms_norm_forward(self, x): the module's weight
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(T_(w.copy())), 1e-6

    m = Norm()
    xt.grad = None
    dct.rms_norm_forward(m, xt).backward(T_(dy))
    assert_close(m.weight.grad.numpy(), w64.grad.numpy() if weighted else
                 ref_rms_backward(dy, x, w, 1e-6)[1], rtol=2e-5, atol=2e-5, what="module d(w)")


@pytest.mark.parametrize("inverse", [False, True])
def test_torch_apply_rotary_emb_grads(rng, inverse):
    """The drop-in rotates in place (here a view of a larger tensor, as the model does
    with q[..., -rd:]); the gradient is the inverse rotation."""
    import deepseek_csa.torch as dct
    B, S, H, D, rd = 2, 5, 3, 12, 8
    q = rng.standard_normal((B, S, H, D), dtype=np.float32)
    ang = rng.uniform(-5, 5, (S, rd // 2))
    freqs = torch.polar(torch.ones(S, rd // 2), T_(ang).float())
    dy = rng.standard_normal((B, S, H, D), dtype=np.float32)
    qt = T_(q.copy()).requires_grad_()
    z = qt * 1.0
    out = dct.apply_rotary_emb(z[..., -rd:], freqs, inverse)
    assert out.data_ptr() == z[..., -rd:].data_ptr()
    z.backward(T_(dy))
    q64 = T_(q.astype(np.float64)).requires_grad_()
    c, s = torch.cos(T_(ang.astype(np.float32)).double()), torch.sin(T_(ang.astype(np.float32)).double())
    z64 = torch.cat([q64[..., :-rd], torch_rope(q64[..., -rd:], c, s, inverse)], -1)
    z64.backward(T_(dy.astype(np.float64)))
    assert_close(z.detach().numpy(), z64.detach().numpy(), rtol=1e-5, atol=1e-5, what="out")
    assert_close(qt.grad.numpy(), q64.grad.numpy(), rtol=1e-5, atol=1e-5, what="d(x)")


# ---------------------------------------------------------------- the compressor drop-in

def _compressor(ratio, D, rotate, B=2, dim=24, rd=8, seed=0):
    """A module with the released Compressor's layout (deepseek_csa.reference.layer) whose
    forward is the drop-in; random weights."""
    from types import SimpleNamespace
    from deepseek_csa.reference import layer as L
    torch.manual_seed(seed)
    args = SimpleNamespace(dim=dim, rope_head_dim=rd, norm_eps=1e-6, max_batch_size=B)
    m = L.Compressor(args, compress_ratio=ratio, head_dim=D, rotate=rotate)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * 0.4 + (1.0 if p is m.norm.weight else 0.0))
    m.freqs_cis = L.precompute_freqs_cis(rd, 64, 0, 10000.0, 1.0, 32, 1)
    m.kv_cache = torch.zeros(B, 64 // ratio, D)
    return m


def _hadamard64(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return T_(h / np.sqrt(n))


def _ref_compressor(m, x, r, ov, rotate):
    """float64 autograd of pool -> RMSNorm -> RoPE at g*r -> (Hadamard); the QAT rounding
    is straight-through, so its gradient is that of the function without it."""
    P = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    x = x.detach().double().requires_grad_()
    kv, sc = x @ P["wkv.weight"].T, x @ P["wgate.weight"].T
    y = torch_rms(torch_pool(kv, sc, r, P["ape"], ov), P["norm.weight"], 1e-6)
    G, rd = y.shape[1], m.rope_head_dim
    fc = m.freqs_cis[0:G * r:r]
    y = torch.cat([y[..., :-rd], torch_rope(y[..., -rd:], fc.real.double(), fc.imag.double(),
                                            False)], -1)
    if rotate:
        y = y @ _hadamard64(y.shape[-1])
    return y, x, P


def _norm_close(got, want, rel, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"


@pytest.mark.parametrize("r, D, rotate", [(4, 72, False), (4, 32, True), (8, 72, False)])
def test_compressor_dropin_gradients(r, D, rotate):
    """Gradients of every parameter and of x through the drop-in (prefill) against a
    float64 autograd reference: within 1e-5 norm-wise (float32 kernels; QAT rounding
    straight-through).  The values equal the forward-only drop-in's."""
    import deepseek_csa.torch as dct
    ov = r == 4
    m = _compressor(r, D, rotate)
    x = (torch.randn(2, 4 * r + 3, 24) * 0.8).requires_grad_()
    with torch.no_grad():
        want_vals = dct.compressor_forward(m, x, 0).clone()
    ent = dct.compressor_forward(m, x, 0)
    assert ent.requires_grad and torch.equal(ent.detach(), want_vals)
    wgt = torch.randn(ent.shape)
    (ent * wgt).sum().backward()
    y, x64, P = _ref_compressor(m, x, r, ov, rotate)
    (y * wgt.double()).sum().backward()
    _norm_close(x.grad, x64.grad, 1e-5, "d(x)")
    for n, p in m.named_parameters():
        _norm_close(p.grad, P[n].grad, 1e-5, f"d({n})")


@pytest.mark.parametrize("r, T1", [(4, 9), (4, 2), (8, 13), (8, 0)])
def test_compressor_dropin_streaming_gradient(r, T1):
    """prefill(T1) then decode steps: the entries are the one-shot prefill's (bitwise)
    and so is the gradient (to float32 rounding of the projections' backward, which
    runs on other row blocks), the tokens held in the state included.  The inputs and
    projection weights sit on a coarse dyadic grid (x: multiples of 1/8, |x| <= 2; w:
    multiples of 1/16, |w| <= 1), so x @ w is exact in float32 whatever rows torch's BLAS
    blocks together (on an AMD EPYC Zen 4 it rounds a 1-token slice differently from
    the same rows of a longer call): the entries' bits are then the drop-in's alone."""
    import deepseek_csa.torch as dct
    T, D = 3 * r + 3, 72
    x0 = torch.clamp(torch.round(torch.randn(2, T, 24) * 0.8 * 8), -16, 16) / 8
    wgt = torch.randn(2, T // r, D)

    def run(split):
        m = _compressor(r, D, False)
        with torch.no_grad():
            for lin in (m.wkv, m.wgate):
                lin.weight.copy_(torch.clamp(torch.round(lin.weight * 16), -16, 16) / 16)
        x = x0.clone().requires_grad_()
        ents = []
        if split:
            if T1:
                e = dct.compressor_forward(m, x[:, :T1], 0)
                if e is not None:
                    ents.append(e)
            for p in range(T1, T):
                if p == 0:
                    e = dct.compressor_forward(m, x[:, :1], 0)
                else:
                    e = dct.compressor_forward(m, x[:, p:p + 1], p)
                if e is not None:
                    ents.append(e)
        else:
            ents.append(dct.compressor_forward(m, x, 0))
        ent = torch.cat(ents, 1)
        (ent * wgt).sum().backward()
        return ent.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}

    e1, gx1, gp1 = run(True)
    e0, gx0, gp0 = run(False)
    assert torch.equal(e1, e0)
    _norm_close(gx1, gx0, 1e-6, "d(x)")
    for n in gp0:
        _norm_close(gp1[n], gp0[n], 1e-6, f"d({n})")


@pytest.mark.parametrize("r", [4, 8])
def test_compressor_dropin_grad_decode_after_no_grad_prefill(r):
    """A decode step under autograd after a prefill that ran without it: the state comes
    from the released buffers (detached) and the entries are the forward-only path's."""
    import deepseek_csa.torch as dct
    T1, T, D = r + 2, 3 * r, 72
    x = torch.randn(2, T, 24) * 0.8
    ref_m, m = _compressor(r, D, False), _compressor(r, D, False)
    with torch.no_grad():
        dct.compressor_forward(ref_m, x[:, :T1], 0)
        dct.compressor_forward(m, x[:, :T1], 0)
        want = [dct.compressor_forward(ref_m, x[:, p:p + 1], p) for p in range(T1, T)]
    got = [dct.compressor_forward(m, x[:, p:p + 1], p) for p in range(T1, T)]
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.requires_grad and torch.equal(a.detach(), b)
    sum(a.sum() for a in got if a is not None).backward()
    assert m.wkv.weight.grad is not None and m.ape.grad is not None
