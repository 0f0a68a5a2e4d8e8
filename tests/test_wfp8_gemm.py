"""wfp8_gemm (weight-only FP8: float activations times e4m3 weights with 128 x 128 block
scales, csrc/gemm.h) against a dequantize-to-float64-then-matmul reference and bitwise
against the scalar oracle at every ISA level and thread count; hostile inputs; and
deepseek_csa.torch.checkpoint_width's FP8Weight, which serves the released model.py's wo_a
einsum with it."""
import ml_dtypes
import numpy as np
import pytest
import torch

import deepseek_csa as dc
from conftest import isa_level, same_bits_at_thread_counts, unchanged
from test_gemm import dec8, rand_e4m3, rand_scales, scale_f

BF16 = ml_dtypes.bfloat16


def want(a, b, b_s, groups=1):
    """float64 reference and sum |a||b| (the error scale)."""
    K, N = a.shape[-1], b.shape[0]
    B = dec8(b) * np.repeat(np.repeat(scale_f(b_s), 128, 0), 128, 1)[:N, :K]
    A = np.asarray(a, dtype=np.float64)
    if groups == 1:
        return A @ B.T, np.abs(A) @ np.abs(B).T
    R = N // groups
    outs = [A[..., g, :] @ B[g * R:(g + 1) * R].T for g in range(groups)]
    mags = [np.abs(A[..., g, :]) @ np.abs(B[g * R:(g + 1) * R]).T for g in range(groups)]
    return np.concatenate(outs, -1), np.concatenate(mags, -1)


def at_ref(*a, **k):
    with isa_level("ref"):
        return dc.wfp8_gemm(*a, **k)


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


SHAPES = [  # (lead, groups, K, N)
    ((1,), 1, 4096, 256), ((1, 1), 8, 512, 64), ((3,), 1, 200, 37), ((1,), 1, 17, 5),
    ((2,), 4, 130, 12), ((1,), 2, 128, 6), ((5,), 1, 1000, 130), ((2, 3), 1, 96, 9),
    ((1,), 3, 384, 261),
]


@pytest.mark.parametrize("lead,G,K,N", SHAPES)
@pytest.mark.parametrize("act", ["bf16", "f32"])
@pytest.mark.parametrize("e8m0", [True, False])
def test_vs_dequant_matmul_and_oracle(isa_bf16, rng, lead, G, K, N, act, e8m0):
    if N % G:
        N += G - N % G
    shape = lead + ((G,) if G > 1 else ()) + (K,)
    a = rng.standard_normal(shape).astype(np.float32)
    if act == "bf16":
        a = a.astype(BF16)
    b = rand_e4m3(rng, (N, K))
    b_s = rand_scales(rng, ((N + 127) // 128, (K + 127) // 128), e8m0)
    with unchanged(a, b, b_s):
        got = same_bits_at_thread_counts(
            lambda: dc.wfp8_gemm(a, b, b_s, groups=G, out_dtype="float32"))
    assert got.shape == lead + (N,) and got.dtype == np.float32
    ref = at_ref(a, b, b_s, groups=G, out_dtype="float32")
    np.testing.assert_array_equal(bits(got), bits(ref))
    w, mag = want(a, b, b_s, G)
    err = np.abs(got.astype(np.float64) - w)
    assert (err <= 1e-5 * mag + 1e-30).all(), float((err / (mag + 1e-30)).max())
    g16 = dc.wfp8_gemm(a, b, b_s, groups=G)             # bf16 by default: got rounded once
    assert g16.dtype == BF16
    np.testing.assert_array_equal(bits(g16), bits(got.astype(BF16)))


def test_levels_agree_on_wo_a_shape(rng):
    """The runner's shape (8 groups x [1024, 4096] at decode, one and three rows)."""
    G, K, R = 8, 4096, 1024
    b = rand_e4m3(rng, (G * R, K))
    b_s = rand_scales(rng, (G * R // 128, K // 128), True)
    for M in (1, 3):
        a = rng.standard_normal((M, G, K)).astype(BF16)
        ref = at_ref(a, b, b_s, groups=G, out_dtype="float32")
        for lvl in ("base", "avx2", "avx512", "amx"):
            if lvl not in dc.ISA_LEVELS or dc.ISA_LEVELS.index(lvl) > dc.ISA_LEVELS.index(dc.best_isa()):
                continue
            with isa_level(lvl):
                np.testing.assert_array_equal(
                    bits(dc.wfp8_gemm(a, b, b_s, groups=G, out_dtype="float32")), bits(ref))


def test_hostile_codes_and_scales(isa_bf16, rng):
    """NaN codes (0x7f / 0xff) anywhere in a block, e8m0 0xff (NaN) and 0x00 (2^-127),
    infinite and subnormal activations, zero rows: the oracle's results at every level,
    the same bits at every thread count."""
    K, N = 300, 200
    a = rng.standard_normal((2, K)).astype(np.float32)
    a[1, 7] = np.inf
    a[0, 3] = 1e-41
    b = rand_e4m3(rng, (N, K))
    b[3] = 0
    b[5, 130] = 0xFF
    b[6, 0] = 0x7F
    b[7, 299] = 0x7F                             # in the partial last block
    b_s = rand_scales(rng, (2, 3), True)
    b_s[1, 2] = 0xFF
    b_s[0, 0] = 0x00
    got = same_bits_at_thread_counts(lambda: dc.wfp8_gemm(a, b, b_s, out_dtype="float32"))
    ref = at_ref(a, b, b_s, out_dtype="float32")
    # NaN where the oracle has NaN (which operand's sign an addition of two NaNs keeps
    # is the compiler's choice of operand order), the other bits equal
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    fin = ~np.isnan(ref)
    np.testing.assert_array_equal(bits(got)[fin], bits(ref)[fin])
    assert np.isnan(got).any() and fin.any()
    clean = rand_e4m3(rng, (N, K))
    clean[4, 5] = 0x7F                          # one NaN code: its row is NaN, others not
    g = dc.wfp8_gemm(a[:1].astype(BF16), clean, rand_scales(rng, (2, 3), True),
                     out_dtype="float32")
    assert np.isnan(g[0, 4]) and np.isfinite(np.delete(g[0], 4)).all()


def test_empty_and_bad_arguments(rng):
    b = rand_e4m3(rng, (8, 64))
    b_s = rand_scales(rng, (1, 1), True)
    a = rng.standard_normal((2, 64)).astype(np.float32)
    assert dc.wfp8_gemm(a[:0], b, b_s).shape == (0, 8)
    z = dc.wfp8_gemm(np.zeros((1, 0), np.float32), np.zeros((8, 0), np.uint8),
                     np.zeros((1, 0), np.uint8), out_dtype="float32")
    assert z.shape == (1, 8) and (z == 0).all()
    with pytest.raises(ValueError, match="K = a.shape"):
        dc.wfp8_gemm(a[:, :32], b, b_s)
    with pytest.raises(ValueError, match="ceil"):
        dc.wfp8_gemm(a, b, rand_scales(rng, (2, 1), True))
    with pytest.raises(ValueError, match="groups"):
        dc.wfp8_gemm(a, b, b_s, groups=3)                # a is not [..., 3, K]
    with pytest.raises(ValueError, match="multiple of groups"):
        dc.wfp8_gemm(np.zeros((1, 3, 64), np.float32), b, b_s, groups=3)
    with pytest.raises(ValueError, match="groups"):
        dc.wfp8_gemm(a, b, b_s, groups=0)
    with pytest.raises(ValueError, match="contiguous rows"):
        dc.wfp8_gemm(a, np.asfortranarray(rand_e4m3(rng, (8, 64))), b_s)
    with pytest.raises(TypeError):
        dc.wfp8_gemm(a.astype(np.float64), b, b_s)
    with pytest.raises(TypeError):
        dc.wfp8_gemm(a, b.astype(np.float32), b_s)
    with pytest.raises(ValueError, match="out_dtype"):
        dc.wfp8_gemm(a, b, b_s, out_dtype="float16")
    # strided activations are read as they are (copied), torch tensors without a copy
    big = rng.standard_normal((2, 128)).astype(np.float32)
    np.testing.assert_array_equal(bits(dc.wfp8_gemm(big[:, ::2], b, b_s)),
                                  bits(dc.wfp8_gemm(np.ascontiguousarray(big[:, ::2]), b, b_s)))
    t = torch.from_numpy(a).bfloat16()
    got = dc.wfp8_gemm(t, torch.from_numpy(b).view(torch.float8_e4m3fn),
                       torch.from_numpy(b_s).view(torch.float8_e8m0fnu), out_dtype="float32")
    np.testing.assert_array_equal(bits(got), bits(dc.wfp8_gemm(t.float().numpy().astype(BF16), b,
                                                              b_s, out_dtype="float32")))


# ------------------------------------------------------------------ torch: FP8Weight
def _widened_fp8(rng, N, K):
    """A bf16 weight that is an FP8 tensor widened (as convert.py widens wo_a)."""
    b = torch.from_numpy(rand_e4m3(rng, (N, K))).view(torch.float8_e4m3fn)
    e = torch.from_numpy(rng.integers(118, 126, ((N + 127) // 128, (K + 127) // 128)))
    s = torch.exp2(e.float() - 127)
    full = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return (b.float() * full).bfloat16()


def test_requantize_exact_and_refuses_bf16(rng):
    from deepseek_csa.torch.checkpoint_width import FP8Weight, requantize_fp8
    for N, K in ((256, 512), (300, 200), (128, 128)):
        w = _widened_fp8(rng, N, K)
        q = requantize_fp8(w)
        assert q is not None
        fw = FP8Weight(*q)
        assert fw.shape == w.shape and fw.dtype == torch.bfloat16
        assert torch.equal(fw.dequantize().view(torch.int16), w.view(torch.int16))
        assert fw.nbytes_read == N * K + q[1].numel()
    assert requantize_fp8(torch.randn(256, 256).bfloat16()) is None     # genuinely bf16
    z = torch.zeros(128, 256, dtype=torch.bfloat16)
    assert torch.equal(FP8Weight(*requantize_fp8(z)).dequantize(), z)


@pytest.mark.parametrize("rows", [1, 2, 16, 40])
def test_fp8_weight_einsum(rng, rows):
    dtype = torch.bfloat16
    """model.py's uses: .view(G, R, -1) and einsum('bsgd,grd->bsgr'): at decode (<= 16
    rows) the weight-only GEMV, within float32 summation order of the bf16 einsum, and
    bitwise equal to the kernel; beyond, the einsum on the dequantized weight itself."""
    from deepseek_csa.torch.checkpoint_width import MAX_ROWS, FP8Weight, requantize_fp8
    G, R, D = 4, 256, 384
    w = _widened_fp8(rng, G * R, D)
    fw = FP8Weight(*requantize_fp8(w))
    v = fw.view(G, R, -1)
    assert isinstance(v, FP8Weight) and v.shape == (G, R, D)
    o = torch.from_numpy(rng.standard_normal((1, rows, G, D)).astype(np.float32)).to(dtype)
    want_t = torch.einsum("bsgd,grd->bsgr", o, w.to(dtype).view(G, R, -1))
    got = torch.einsum("bsgd,grd->bsgr", o, v)
    assert got.shape == want_t.shape and got.dtype == dtype
    if rows <= MAX_ROWS:
        k = dc.wfp8_gemm(o, fw.codes, fw.scales, groups=G, out_dtype="float32")
        assert torch.equal(got, torch.from_numpy(np.asarray(k, np.float32)).to(dtype).view(got.shape))
        torch.testing.assert_close(got.float(), want_t.float(), rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(got, want_t)
    # float32 activations fail as against the bf16 weight (model.py's o is bf16)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.einsum("bsgd,grd->bsgr", o.float(), v)
    # anything else sees the bf16 weight
    assert torch.equal(fw + 0, w)
    assert torch.equal(fw.float(), w.float())
    with pytest.raises(RuntimeError):
        fw.view(7, -1)


# ------------------------------------------------------------------ wbf16_gemm
@pytest.mark.parametrize("M,K,N", [(1, 4096, 1024), (3, 200, 37), (1, 17, 5), (2, 384, 261),
                                   (16, 128, 8)])
@pytest.mark.parametrize("act", ["bf16", "f32"])
def test_wbf16_vs_dequant_matmul_and_oracle(isa_bf16, rng, M, K, N, act):
    a = rng.standard_normal((M, K)).astype(np.float32)
    if act == "bf16":
        a = a.astype(BF16)
    b = rng.standard_normal((N, K)).astype(BF16)
    with unchanged(a, b):
        got = same_bits_at_thread_counts(lambda: dc.wbf16_gemm(a, b))
    assert got.dtype == np.float32 and got.shape == (M, N)
    with isa_level("ref"):
        ref = dc.wbf16_gemm(a, b)
    np.testing.assert_array_equal(bits(got), bits(ref))
    A, B = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(got - A @ B.T)
    assert (err <= 1e-6 * (np.abs(A) @ np.abs(B).T) + 1e-30).all()
    np.testing.assert_array_equal(bits(dc.wbf16_gemm(a, b, out_dtype="bfloat16")),
                                  bits(got.astype(BF16)))


def test_wbf16_hostile_and_bad_arguments(isa_bf16, rng):
    a = rng.standard_normal((2, 300)).astype(np.float32)
    b = rng.standard_normal((9, 300)).astype(BF16)
    b[1, 5], b[2, 140], b[3, 299], b[4] = np.nan, np.inf, -np.inf, 0
    a[1, 7] = np.inf                            # inf x 0 in row 4: NaN there
    got = same_bits_at_thread_counts(lambda: dc.wbf16_gemm(a, b))
    with isa_level("ref"):
        ref = dc.wbf16_gemm(a, b)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    fin = ~np.isnan(ref)
    np.testing.assert_array_equal(bits(got)[fin], bits(ref)[fin])
    assert np.isnan(got[:, 1]).all() and np.isnan(got[1, 4]) and got[0, 4] == 0
    assert np.isinf(got[0, 2]) and fin.any()
    with pytest.raises(TypeError):
        dc.wbf16_gemm(a, b.astype(np.float32))            # float32 weights: not this entry
    with pytest.raises(ValueError, match="K = a.shape"):
        dc.wbf16_gemm(a[:, :100], b)
    with pytest.raises(ValueError, match="contiguous rows"):
        dc.wbf16_gemm(a[:, :150], b[:, ::2])


def test_bf16_weight_linear(rng):
    """BF16Weight: F.linear with <= MAX_ROWS float32 rows on wbf16_gemm (its bits), more
    rows or bf16 rows as F.linear on the widened weight; other uses see the float32 weight."""
    from deepseek_csa.torch.checkpoint_width import MAX_ROWS, BF16Weight, bf16_f32_weights
    F = torch.nn.functional
    w16 = torch.from_numpy(rng.standard_normal((70, 256)).astype(np.float32)).bfloat16()
    bw = BF16Weight(w16)
    assert bw.dtype == torch.float32 and bw.shape == (70, 256) and bw.nbytes_read == 70 * 256 * 2
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x = torch.from_numpy(rng.standard_normal((1, rows, 256)).astype(np.float32))
        got = F.linear(x, bw)
        if rows <= MAX_ROWS:
            k = torch.from_numpy(np.asarray(dc.wbf16_gemm(x, w16)))
            assert torch.equal(got, k)
            torch.testing.assert_close(got, F.linear(x, w16.float()), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, F.linear(x, w16.float()))
    assert torch.equal(bw * 2, w16.float() * 2)
    with pytest.raises(RuntimeError):
        F.linear(torch.ones(1, 256, dtype=torch.bfloat16), bw)   # as the float32 weight
    lin = torch.nn.Linear(256, 70, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w16.float())
    other = torch.nn.Linear(256, 70, bias=False)                 # not bf16-valued: kept
    assert bf16_f32_weights(torch.nn.Sequential(lin, other)) == 1
    assert isinstance(lin.weight, BF16Weight) and not isinstance(other.weight, BF16Weight)
