"""fp8_gemm / fp4_gemm, fp8_quant / fp4_quant and hc_split_sinkhorn (docs/kernels.md section 9)
against dequantize-to-float64-then-matmul references written here from docs/kernels.md, at
every ISA level; bitwise equal to the scalar oracle and across thread counts."""
import ml_dtypes
import numpy as np
import pytest
import torch

import deepseek_csa as dc
from conftest import ISA_LEVELS_BF16, isa_level, same_bits_at_thread_counts, unchanged

E4M3, E8M0, FP4 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu, ml_dtypes.float4_e2m1fn


def dec8(u):
    return np.asarray(u).view(np.uint8).view(E4M3).astype(np.float64)


def dec_e8(u):
    return np.asarray(u).view(np.uint8).view(E8M0).astype(np.float64)


def dec4(packed, K):
    p = np.asarray(packed).view(np.uint8)
    nib = np.stack([p & 15, p >> 4], -1).reshape(p.shape[:-1] + (K,))
    return nib.astype(np.uint8).view(FP4).astype(np.float64)


def scale_f(s):
    s = np.asarray(s)
    return dec_e8(s) if s.dtype.itemsize == 1 else s.astype(np.float64)


def rand_e4m3(rng, shape, nan=False):
    u = rng.integers(0, 256, shape).astype(np.uint8)
    if not nan:
        u[(u & 0x7F) == 0x7F] ^= 0x01
    return u


def rand_scales(rng, shape, e8m0):
    e = rng.integers(118, 130, shape).astype(np.uint8)
    if e8m0:
        return e
    return (dec_e8(e) * rng.uniform(0.5, 1.0, shape)).astype(np.float32)


def want_fp8(a, a_s, b, b_s):
    K = a.shape[-1]
    A = dec8(a) * np.repeat(scale_f(a_s), 128, -1)[..., :K]
    N = b.shape[0]
    B = dec8(b) * np.repeat(np.repeat(scale_f(b_s), 128, 0), 128, 1)[:N, :K]
    return A @ B.T, np.abs(A) @ np.abs(B).T


def want_fp4(a, a_s, b, b_s):
    K = a.shape[-1]
    A = dec8(a) * np.repeat(scale_f(a_s), 128, -1)[..., :K]
    B = dec4(b, K) * np.repeat(scale_f(b_s), 32, 1)[:, :K]
    return A @ B.T, np.abs(A) @ np.abs(B).T


def check_close(got, want, mag, what):
    # float32 accumulation of exact products: |err| <= K * 2^-23 * sum|a||b| (loose)
    err = np.abs(got.astype(np.float64) - want)
    bound = 1e-5 * mag + 1e-30
    assert (err <= bound).all(), (what, float((err / (mag + 1e-30)).max()))


def at_ref(fn, *a, **k):
    before = dc.get_isa()
    dc.set_isa("ref")
    try:
        return fn(*a, **k)
    finally:
        dc.set_isa(before)


FP8_SHAPES = [(1, 1, 16), (1, 300, 256), (5, 257, 384), (33, 130, 144), (70, 64, 1024),
              (3, 129, 40), (2, 7, 5)]
FP4_SHAPES = [(1, 1, 32), (1, 300, 256), (5, 257, 96), (33, 130, 640), (3, 9, 50), (17, 65, 2)]


CPU_FEATURES = dc._core._build_info()["cpu_features"].split()
# the levels whose GEMMs of more than 16 rows run as one bf16 GEMM (docs/kernels.md s. 9)
BF16_GEMM_LEVELS = (["amx"] if "amx" in ISA_LEVELS_BF16 else []) + \
    (["avx512"] if "bf16" in CPU_FEATURES and "avx512" in ISA_LEVELS_BF16 else [])


def bf16_gemm_takes(M, K, e8m0):
    """Whether the bf16 GEMM computes this fp8_gemm / fp4_gemm (power-of-two scales)
    (docs/kernels.md section 9): its bits may differ from the oracle's by float32
    rounding."""
    return dc.get_isa() in BF16_GEMM_LEVELS and e8m0 and M > 16 and K % 128 == 0


@pytest.mark.parametrize("M,N,K", FP8_SHAPES)
@pytest.mark.parametrize("e8m0", [True, False])
def test_fp8_gemm_vs_dequant_matmul(isa_bf16, rng, M, N, K, e8m0):
    a, b = rand_e4m3(rng, (M, K)), rand_e4m3(rng, (N, K))
    KB = -(-K // 128)
    a_s, b_s = rand_scales(rng, (M, KB), e8m0), rand_scales(rng, (-(-N // 128), KB), e8m0)
    got = dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32")
    want, mag = want_fp8(a, a_s, b, b_s)
    check_close(got, want, mag, (M, N, K))
    if not bf16_gemm_takes(M, K, e8m0):
        ref = at_ref(dc.fp8_gemm, a, a_s, b, b_s, out_dtype="float32")
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    bf = dc.fp8_gemm(a, a_s, b, b_s)           # bfloat16 by default: one rounding
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.view(np.uint16), got.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("M,N,K", FP4_SHAPES)
@pytest.mark.parametrize("e8m0", [True, False])
def test_fp4_gemm_vs_dequant_matmul(isa_bf16, rng, M, N, K, e8m0):
    a = rand_e4m3(rng, (M, K))
    b = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    a_s = rand_scales(rng, (M, -(-K // 128)), e8m0)
    b_s = rand_scales(rng, (N, -(-K // 32)), e8m0)
    got = dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32")
    want, mag = want_fp4(a, a_s, b, b_s)
    check_close(got, want, mag, (M, N, K))
    if not bf16_gemm_takes(M, K, e8m0):
        ref = at_ref(dc.fp4_gemm, a, a_s, b, b_s, out_dtype="float32")
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def adversarial_fp4(rng, M, N, K):
    """Activations of 448 and 2^-9 (codes 0x7e, 0x01), weights of 6 and 0.5: block sums
    that float32 cannot hold exactly, so that summation orders give different bits."""
    a = rng.choice(np.array([0x7E, 0x01, 0x7E, 0xFE], np.uint8), (M, K))
    b = rng.choice(np.array([0x77, 0x17, 0x71, 0x11, 0xF1], np.uint8), (N, K // 2))
    a_s = rng.integers(124, 130, (M, K // 128)).astype(np.uint8)
    b_s = rng.integers(125, 130, (N, K // 32)).astype(np.uint8)
    return a, a_s, b, b_s


@pytest.mark.parametrize("level", BF16_GEMM_LEVELS or [
    pytest.param("none", marks=pytest.mark.skip(reason="no AMX-BF16 or AVX512_BF16 on this CPU"))])
def test_gemm_bf16_paths(rng, level):
    """The bf16 GEMM of the amx level (AMX tiles) and of the avx512 level on CPUs with
    AVX512_BF16 (VDPBF16PS), docs/kernels.md section 9.  FP4, one activation row:
    bitwise the oracle even where summation orders disagree.  More rows (FP4 and FP8):
    one bf16 GEMM whose float32 sums run in the tiles' / dot products' order -- within
    2 K 2^-24 sum|a sa w sb| of the float64 value (each of two recursive sums of K terms
    is within (K - 1) 2^-24 of the sum of magnitudes), bitwise the same at any thread
    count; scales that cannot be folded exactly (not powers of two, exponents beyond
    +-44) take the oracle's path."""
    with isa_level(level):
        for M, N, K in [(1, 300, 1024), (1, 9, 4096), (37, 70, 1024), (100, 300, 512)]:
            a, a_s, b, b_s = adversarial_fp4(rng, M, N, K)
            got = dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32")
            ref = at_ref(dc.fp4_gemm, a, a_s, b, b_s, out_dtype="float32")
            want, mag = want_fp4(a, a_s, b, b_s)
            if M == 1:
                np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
                continue
            assert (got.view(np.uint32) != ref.view(np.uint32)).any()   # the bf16 GEMM ran
            err = np.abs(got.astype(np.float64) - want)
            assert (err <= 2 * K * 2.0 ** -24 * mag).all(), float((err / mag).max())
            same_bits_at_thread_counts(lambda: dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32"))
            # float32 powers of two fold like e8m0; a bf16 output is the float32 rounded once
            f32 = dc.fp4_gemm(a, a_s.view(E8M0).astype(np.float32), b, b_s, out_dtype="float32")
            np.testing.assert_array_equal(f32.view(np.uint32), got.view(np.uint32))
            bf = dc.fp4_gemm(a, a_s, b, b_s)
            np.testing.assert_array_equal(bf.view(np.uint16), got.astype(ml_dtypes.bfloat16).view(np.uint16))
            # not foldable: the oracle's bits
            for a_s2, b_s2 in [(a_s.view(E8M0).astype(np.float32) * np.float32(0.75), b_s),
                               (a_s, np.where(b_s == 125, np.uint8(127 + 45), b_s))]:
                np.testing.assert_array_equal(
                    dc.fp4_gemm(a, a_s2, b, b_s2, out_dtype="float32").view(np.uint32),
                    at_ref(dc.fp4_gemm, a, a_s2, b, b_s2, out_dtype="float32").view(np.uint32))
        # the extreme exponents the tiles fold (-44 on both sides): the least products
        # stay normal (the tiles flush subnormals), so the budget still holds
        a, a_s, b, b_s = adversarial_fp4(rng, 20, 40, 256)
        a_s[:], b_s[::2] = 127 - 44, 127 - 44
        got = dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32")
        want, mag = want_fp4(a, a_s, b, b_s)
        assert (np.abs(got.astype(np.float64) - want) <= 2 * 256 * 2.0 ** -24 * mag).all()
        assert (got[:, ::2] != 0).all()
        # FP8 weights on the tiles: activations and weights of 448 and 2^-9, one
        # power-of-two scale per 128 x 128 block; a NaN weight code makes its column NaN
        for M, N, K in [(40, 300, 1024), (17, 129, 256)]:
            a = rng.choice(np.array([0x7E, 0x01, 0xFE, 0x7E], np.uint8), (M, K))
            b = rng.choice(np.array([0x7E, 0x01, 0xFE, 0x81], np.uint8), (N, K))
            a_s = rng.integers(124, 130, (M, K // 128)).astype(np.uint8)
            b_s = (2.0 ** rng.integers(-6, 2, (-(-N // 128), K // 128))).astype(np.float32)
            got = dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32")
            ref = at_ref(dc.fp8_gemm, a, a_s, b, b_s, out_dtype="float32")
            want, mag = want_fp8(a, a_s, b, b_s)
            assert (got.view(np.uint32) != ref.view(np.uint32)).any()
            err = np.abs(got.astype(np.float64) - want)
            assert (err <= 2 * K * 2.0 ** -24 * mag).all(), float((err / mag).max())
            same_bits_at_thread_counts(lambda: dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32"))
            b[N - 1, 5] = 0x7F
            got = dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32")
            assert np.isnan(got[:, N - 1]).all() and np.isfinite(got[:, :N - 1]).all()
        # NaN codes: a row with one is NaN, the others are not (tiles); one row: the
        # float32 path (bitwise the oracle)
        a, a_s, b, b_s = adversarial_fp4(rng, 40, 33, 256)
        a[7, 100] = 0x7F
        got = dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32")
        assert np.isnan(got[7]).all() and np.isfinite(np.delete(got, 7, 0)).all()
        one = dc.fp4_gemm(a[7:8], a_s[7:8], b, b_s, out_dtype="float32")
        np.testing.assert_array_equal(one.view(np.uint32), at_ref(
            dc.fp4_gemm, a[7:8], a_s[7:8], b, b_s, out_dtype="float32").view(np.uint32))


def test_gemm_one_row_every_code(rng):
    """fp4_gemm of one activation row, every non-NaN activation code (its exponent picks
    the int8 pass, byte and weight shift j, its sign the table's half, in the int8 path
    of AVX-512 CPUs with VNNI + VBMI,
    docs/kernels.md section 9) against every weight code, K = 4 groups of 128 and a
    partial one (3 blocks): bitwise the oracle at every level, within the float32 budget
    of the float64 value."""
    codes = np.array([v for v in range(256) if v & 0x7F != 0x7F], np.uint8)
    for K in (512, 608):
        a = rng.permutation(np.resize(codes, K))[None]
        b = rng.integers(0, 256, (45, K // 2)).astype(np.uint8)
        a_s = rng.integers(120, 135, (1, -(-K // 128))).astype(np.uint8)
        b_s = rng.integers(120, 135, (45, K // 32)).astype(np.uint8)
        ref = at_ref(dc.fp4_gemm, a, a_s, b, b_s, out_dtype="float32")
        want, mag = want_fp4(a, a_s, b, b_s)
        check_close(ref, want, mag, ("all codes", K))
        for level in ISA_LEVELS_BF16:
            with isa_level(level):
                got = dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32")
            np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=level)
    # the adversarial blocks, where summation orders disagree
    a, a_s, b, b_s = adversarial_fp4(rng, 1, 300, 1024)
    ref = at_ref(dc.fp4_gemm, a, a_s, b, b_s, out_dtype="float32")
    got = dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32")
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def adversarial_fp8(rng, N, K):
    """Activations and weights mixing codes of magnitude 2^7..448 with ones below 2^-4
    (subnormals too): block sums float32 cannot hold, so that another order of the
    additions gives other bits (a third of the outputs when two neighbouring steps
    of every lane swap)."""
    codes = np.arange(256, dtype=np.uint8)
    pick = codes[((codes & 0x7F) >= 0x70) & ((codes & 0x7F) != 0x7F) | ((codes & 0x7F) < 0x20)]
    a, b = rng.choice(pick, (1, K)), rng.choice(pick, (N, K))
    KB = -(-K // 128)
    return a, rand_scales(rng, (1, KB), True), b, rand_scales(rng, (-(-N // 128), KB), True)


def bits(x):
    """float32 bits, every NaN as one (NaN payloads are not part of the contract)."""
    return np.where(np.isnan(x), np.uint32(0x7FC00000), np.asarray(x, np.float32).view(np.uint32))


ONE_ROW_CODE = """
import sys, numpy as np, deepseek_csa as dc
z = np.load(sys.argv[1])
fn = getattr(dc, str(z["fn"]))
outs = {}
for i in range(int(z["n"])):
    a, a_s, b, b_s = (z[f"{k}{i}"] for k in ("a", "as", "b", "bs"))
    for level in dc.ISA_LEVELS:
        if dc.ISA_LEVELS.index(level) <= dc.ISA_LEVELS.index(dc.best_isa()):
            dc.set_isa(level)
            outs[f"{level}{i}"] = fn(a, a_s, b, b_s, out_dtype="float32")
outs["features"] = np.array(dc._core._build_info()["cpu_features"])
np.savez(sys.argv[2], **outs)
"""


def check_every_level_and_feature_set(tmp_path, fn, cases):
    """fn on each case (a, a_s, b, b_s) at every level, in a process per set of CPU
    features (DEEPSEEK_CSA_CPU_FEATURES: all, VNNI + VBMI alone, none): bitwise the
    oracle's output."""
    import os
    import subprocess
    import sys
    z = {"n": len(cases), "fn": fn.__name__}
    for i, (a, a_s, b, b_s) in enumerate(cases):
        z.update({f"a{i}": a, f"as{i}": a_s, f"b{i}": b, f"bs{i}": b_s})
    np.savez(tmp_path / "in.npz", **z)
    for feat in (None, "vnni_vbmi", "none"):
        env = {k: v for k, v in os.environ.items() if k != "DEEPSEEK_CSA_CPU_FEATURES"}
        if feat is not None:
            env["DEEPSEEK_CSA_CPU_FEATURES"] = feat
        out = tmp_path / f"out-{feat}.npz"
        subprocess.run([sys.executable, "-c", ONE_ROW_CODE, str(tmp_path / "in.npz"), str(out)],
                       env=env, check=True)
        got = np.load(out)
        if feat is not None:  # the mask took
            assert set(str(got["features"]).split()) <= set(feat.split()) - {"none"}
        for i, (a, a_s, b, b_s) in enumerate(cases):
            ref = at_ref(fn, a, a_s, b, b_s, out_dtype="float32")
            for level in dc.ISA_LEVELS:
                if f"{level}{i}" in got:
                    np.testing.assert_array_equal(bits(got[f"{level}{i}"]), bits(ref),
                                                  err_msg=f"{level}, case {i}, features {got['features']}")


def test_fp8_gemm_one_row_every_code_and_order(rng, tmp_path):
    """fp8_gemm of one activation row: every activation code against every weight code (NaN
    codes too: their rows are NaN), K = 4 groups of 128 and a partial one, N not a
    multiple of 8, and the adversarial blocks where the order of the additions shows:
    bitwise the oracle at every level, with every set of CPU features
    (DEEPSEEK_CSA_CPU_FEATURES: the one-row path by bf16 dot products where the CPU has
    AVX512_BF16, the byte-permute float32 decode where it has only VNNI + VBMI, the AVX2
    decode below; docs/kernels.md section 9)."""
    cases = []
    codes = np.arange(256, dtype=np.uint8)
    for K in (512, 608):
        a = rng.permutation(np.resize(codes[(codes & 0x7F) != 0x7F], K))[None]
        b = rng.permutation(np.resize(codes, 45 * K)).reshape(45, K)
        b[(b & 0x7F) == 0x7F] ^= 1
        b[40, 3], b[41, K - 1], b[44, 130] = 0x7F, 0xFF, 0x7F  # NaN codes: NaN rows
        KB = -(-K // 128)
        cases.append((a, rand_scales(rng, (1, KB), True), b, rand_scales(rng, (1, KB), False)))
    cases.append(adversarial_fp8(rng, 300, 1024))
    cases.append(adversarial_fp8(rng, 13, 160))
    for a, a_s, b, b_s in cases:
        ref = at_ref(dc.fp8_gemm, a, a_s, b, b_s, out_dtype="float32")
        nan_rows = ((b & 0x7F) == 0x7F).any(1)
        assert np.isnan(ref[0, nan_rows]).all() and np.isfinite(ref[0, ~nan_rows]).all()
        want, mag = want_fp8(a, a_s, b, b_s)
        check_close(ref[:, ~nan_rows], want[:, ~nan_rows], mag[:, ~nan_rows], a.shape)
    # the adversarial blocks do tell orders apart: pairs of steps swapped give other bits
    a, a_s, b, b_s = cases[2]
    sw = np.arange(1024).reshape(8, 8, 2, 8)[:, :, ::-1].reshape(-1)  # steps 2s <-> 2s + 1
    swapped = at_ref(dc.fp8_gemm, a[:, sw], a_s, np.ascontiguousarray(b[:, sw]), b_s, out_dtype="float32")
    assert (swapped != at_ref(dc.fp8_gemm, a, a_s, b, b_s, out_dtype="float32")).mean() > 0.1
    check_every_level_and_feature_set(tmp_path, dc.fp8_gemm, cases)


def int8_pass_chunks(rng, K):
    """One activation row whose 64-column chunks (the int8 paths' unit, docs/kernels.md
    section 9) take every pass structure: all zero (and -0), only tiny codes (one pass at
    the bottom), the largest codes with codes of every exponent below (three passes,
    columns straddling two), one exponent only (one pass at the top), negative only,
    then random codes; K = 64 c + 32 ends on a chunk with one block."""
    codes = np.array([v for v in range(256) if v & 0x7F != 0x7F], np.uint8)
    tiny = codes[(codes & 0x7F) < 0x10]                         # e4m3 exponent field 0, 1
    one_exp = codes[(codes & 0x78) == 0x68]                     # one exponent, both signs
    patterns = [np.zeros(64, np.uint8), np.full(64, 0x80, np.uint8), rng.choice(tiny, 64),
                rng.choice(codes, 64), rng.choice(one_exp, 64), rng.choice(codes[codes >= 0x80], 64)]
    # 448 (the top), then a code of every exponent field with a random mantissa and sign
    patterns[3][:17] = [0x7E] + [8 * e + int(rng.integers(0, 7)) | int(rng.integers(0, 2)) << 7
                                 for e in range(16)]
    a = np.concatenate(patterns + [rng.choice(codes, K - 64 * len(patterns))])
    return a[None]


@pytest.mark.parametrize("N,K", [(13, 416), (64, 4096), (8, 384)])
def test_fp4_gemm_one_row_int8_passes(rng, tmp_path, N, K):
    """fp4_gemm of one activation row on the exact 8-bit paths (AVX2's VPMADDUBSW, with
    the byte passes each 64-column chunk needs; AVX-512 VNNI's two passes): every pass
    structure of a chunk (int8_pass_chunks), N not a multiple of 8, a last chunk of one
    block, e8m0 scales with codes 0 and 0xff (the general decode) and without (the
    shift), float32 and strided scales: bitwise the oracle at every level and set of CPU
    features, within the float32 budget of the float64 value."""
    a = int8_pass_chunks(rng, K)
    a_s = rng.integers(118, 137, (1, -(-K // 128))).astype(np.uint8)
    b = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    plain = rng.integers(110, 140, (N, K // 32)).astype(np.uint8)
    special = plain.copy()
    special[0, 1], special[N - 1, -1] = 0, 0xFF
    s8 = np.zeros((N, 2 * (K // 32)), np.uint8)
    s8[:, ::2] = plain
    sf = rand_scales(rng, (N, K // 32), False)
    cases = [(a, a_s, b, plain), (a, a_s, b, special), (a, a_s, b, s8[:, ::2]), (a, a_s, b, sf)]
    for a_, as_, b_, bs_ in cases:
        want, mag = want_fp4(a_, as_, b_, bs_)
        fin = np.isfinite(want)
        check_close(at_ref(dc.fp4_gemm, a_, as_, b_, bs_, out_dtype="float32")[fin], want[fin], mag[fin], (N, K))
    check_every_level_and_feature_set(tmp_path, dc.fp4_gemm, cases)


def test_cpu_features_env_names_what_it_ignores():
    """DEEPSEEK_CSA_CPU_FEATURES keeps only what it names and the CPU has; a name it does
    not know is said once on import (the C runtime cannot print)."""
    import os
    import subprocess
    import sys
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import deepseek_csa as dc; print(repr(dc._core._build_info()['cpu_features']))")
    env = dict(os.environ, DEEPSEEK_CSA_CPU_FEATURES="bf16, avx10")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "DEEPSEEK_CSA_CPU_FEATURES='bf16, avx10'" in r.stderr and "RuntimeWarning" in r.stderr
    assert eval(r.stdout.strip()).split() in ([], ["bf16"])
    env["DEEPSEEK_CSA_CPU_FEATURES"] = "none"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "DEEPSEEK_CSA_CPU_FEATURES" not in r.stderr and eval(r.stdout.strip()) == ""


def test_gemm_threads_bitwise(rng):
    a, b = rand_e4m3(rng, (37, 512)), rand_e4m3(rng, (300, 512))
    a_s, b_s = rand_scales(rng, (37, 4), True), rand_scales(rng, (3, 4), True)
    b4 = rng.integers(0, 256, (300, 256)).astype(np.uint8)
    b4s = rand_scales(rng, (300, 16), True)
    same_bits_at_thread_counts(lambda: (
        dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32"),
        dc.fp8_gemm(a[:1], a_s[:1], b, b_s, out_dtype="float32"),
        dc.fp4_gemm(a, a_s, b4, b4s, out_dtype="float32"),
        dc.fp4_gemm(a[:1], a_s[:1], b4, b4s, out_dtype="float32"),
        dc.fp4_gemm(a[:3], a_s[:3], b4, b4s, out_dtype="float32")))


# b_index: row i of a against weight b[b_index[i]] of E stacked ones.  The glue runs the
# evenly spaced rows of one weight as one GEMM and the one-row GEMMs in one parallel
# region (csrc/gemm.h, csa_gemm_batch); the reference is the dequantized matmul per row.
def _index_cases(rng, M, E):
    return {"sorted runs": np.sort(rng.integers(0, E, M)).astype(np.int32),
            "grouped t*G+g": np.tile(np.arange(E, dtype=np.int32), -(-M // E))[:M],
            "random": rng.integers(0, E, M).astype(np.int32),
            "one weight": np.full(M, E - 1, np.int32)}


def _indexed_gemm_case(rng, fmt, M, N, K, E, e8m0):
    a, a_s = rand_e4m3(rng, (M, K)), rand_scales(rng, (M, -(-K // 128)), e8m0)
    if fmt == "fp8":
        b = rand_e4m3(rng, (E, N, K))
        b_s = rand_scales(rng, (E, -(-N // 128), -(-K // 128)), e8m0)
        return dc.fp8_gemm, want_fp8, a, a_s, b, b_s
    b = rng.integers(0, 256, (E, N, K // 2)).astype(np.uint8)
    b_s = rand_scales(rng, (E, N, -(-K // 32)), e8m0)
    return dc.fp4_gemm, want_fp4, a, a_s, b, b_s


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("M,N,K,E", [(1, 260, 256, 3), (6, 136, 512, 4), (40, 64, 384, 8),
                                     (7, 33, 96, 2)])
def test_gemm_b_index_rows_take_their_weight(isa_bf16, rng, fmt, M, N, K, E):
    e8m0 = bool(M % 2)
    fn, want_fn, a, a_s, b, b_s = _indexed_gemm_case(rng, fmt, M, N, K, E, e8m0)
    for label, ix in _index_cases(rng, M, E).items():
        with unchanged(a, a_s, b, b_s, ix):
            got = fn(a, a_s, b, b_s, b_index=ix, out_dtype="float32")
        want = np.empty((M, N))
        mag = np.empty((M, N))
        for i in range(M):
            w, m_ = want_fn(a[i:i + 1], a_s[i:i + 1], b[ix[i]], b_s[ix[i]])
            want[i], mag[i] = w[0], m_[0]
        check_close(got, want, mag, (label, fmt, M, N, K))
        # the bits: those of fp8_gemm / fp4_gemm on each weight's rows, which are the
        # oracle's for up to 16 rows on every path (larger groups may take the bf16 GEMM)
        for e in range(E):
            rows = np.flatnonzero(ix == e)
            if rows.size and rows.size <= 16:
                alone = fn(a[rows], a_s[rows], b[e], b_s[e], out_dtype="float32")
                assert np.array_equal(bits(got[rows]), bits(alone)), (label, e)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("M", [5, 40])
def test_gemm_b_index_minus_one_is_a_zero_row(rng, fmt, M):
    """b_index = -1: that output row is +0.0 (bfloat16 and float32, also over garbage
    in out=), and every other row has the bits of the same call without the -1 rows (they
    join no weight's run); all -1: all zeros."""
    E, N, K = 3, 136, 256
    fn, _, a, a_s, b, b_s = _indexed_gemm_case(rng, fmt, M, N, K, E, True)
    ix = np.sort(rng.integers(0, E, M)).astype(np.int32)
    holes = rng.random(M) < 0.3
    holes[1] = True
    ix_h = np.where(holes, -1, ix).astype(np.int32)
    keep = np.flatnonzero(~holes)
    for dt in ("float32", "bfloat16"):
        with unchanged(a, a_s, b, b_s, ix_h):
            got = fn(a, a_s, b, b_s, b_index=ix_h, out_dtype=dt)
        out = np.full((M, N), np.nan, np.float32 if dt == "float32" else ml_dtypes.bfloat16)
        fn(a, a_s, b, b_s, b_index=ix_h, out=out)
        assert np.array_equal(bits(out.astype(np.float32)), bits(got.astype(np.float32)))
        assert not np.any(bits(got[holes].astype(np.float32)))          # +0.0, not -0.0
        alone = fn(a[keep], a_s[keep], b, b_s, b_index=ix[keep], out_dtype=dt)
        assert np.array_equal(bits(got[keep].astype(np.float32)), bits(alone.astype(np.float32)))
        none = fn(a, a_s, b, b_s, b_index=np.full(M, -1, np.int32), out_dtype=dt)
        assert not np.any(bits(none.astype(np.float32)))


def test_gemm_b_index_grouped_projection_layout(rng):
    """The grouped output projection as one call: x [T, G, K] -> [T, G, N] with rows
    t * G + g against weight g equals a call per group on the strided rows x[:, g]."""
    T, G, N, K = 20, 4, 256, 512
    a, a_s = rand_e4m3(rng, (T, G, K)), rand_scales(rng, (T, G, K // 128), True)
    b, b_s = rand_e4m3(rng, (G, N, K)), rand_scales(rng, (G, N // 128, K // 128), True)
    ix = np.tile(np.arange(G, dtype=np.int32), (T, 1))
    got = dc.fp8_gemm(a, a_s, b, b_s, b_index=ix)
    assert got.shape == (T, G, N)
    for g in range(G):
        assert np.array_equal(bits(got[:, g]), bits(dc.fp8_gemm(a[:, g], a_s[:, g], b[g], b_s[g])))


def test_gemm_b_index_threads_bitwise(rng):
    """One parallel region over several one-row problems: the same bits at any thread
    count, and the bits of one call a row."""
    K, N, E = 512, 300, 5
    ix = np.array([3, 0, 4, 4, 1, 3], np.int32)
    a, a_s = rand_e4m3(rng, (6, K)), rand_scales(rng, (6, K // 128), True)
    b8, b8s = rand_e4m3(rng, (E, N, K)), rand_scales(rng, (E, 3, K // 128), True)
    b4 = rng.integers(0, 256, (E, N, K // 2)).astype(np.uint8)
    b4s = rand_scales(rng, (E, N, K // 32), True)
    g8, g4 = same_bits_at_thread_counts(lambda: (
        dc.fp8_gemm(a, a_s, b8, b8s, b_index=ix, out_dtype="float32"),
        dc.fp4_gemm(a, a_s, b4, b4s, b_index=ix, out_dtype="float32")))
    for i, e in enumerate(ix):
        assert np.array_equal(bits(g8[i:i + 1]), bits(dc.fp8_gemm(a[i:i + 1], a_s[i:i + 1], b8[e],
                                                                  b8s[e], out_dtype="float32")))
        assert np.array_equal(bits(g4[i:i + 1]), bits(dc.fp4_gemm(a[i:i + 1], a_s[i:i + 1], b4[e],
                                                                  b4s[e], out_dtype="float32")))


def test_gemm_b_index_bad_inputs_name_it(rng):
    a, a_s = rand_e4m3(rng, (3, 256)), rand_scales(rng, (3, 2), True)
    b, b_s = rand_e4m3(rng, (2, 128, 256)), rand_scales(rng, (2, 1, 2), True)
    ix = np.array([0, 1, 1], np.int32)
    out = np.full((3, 128), 7.0, np.float32)
    with unchanged(a, a_s, b, b_s, ix, out):
        for bad, exc in ((np.array([0, 2, 1], np.int32), ValueError),
                         (np.array([0, -2, 1], np.int32), ValueError),
                         (ix.astype(np.int64), TypeError), (ix[:2], ValueError),
                         (ix[None], ValueError)):
            with pytest.raises(exc, match="b_index"):
                dc.fp8_gemm(a, a_s, b, b_s, b_index=bad, out=out)
        with pytest.raises(ValueError, match="'b'"):
            dc.fp8_gemm(a, a_s, b[0], b_s[0], b_index=ix, out=out)    # 2-D weights
        with pytest.raises(ValueError, match="b_s"):
            dc.fp8_gemm(a, a_s, b, b_s[:1], b_index=ix, out=out)      # scales of one weight
    with pytest.raises(ValueError, match="'b'.*takes b_index"):
        dc.fp8_gemm(a, a_s, b, b_s)                                   # stacked, no index


def test_gemm_nan_codes_and_strided_views(isa, rng):
    a, b = rand_e4m3(rng, (4, 3, 256)), rand_e4m3(rng, (64, 256))
    b[5, 17] = 0x7F
    a[1, 2, 3] = 0xFF
    a_s = rand_scales(rng, (4, 3, 2), True)
    b_s = rand_scales(rng, (1, 2), False)
    got = dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32")
    assert got.shape == (4, 3, 64)
    assert np.isnan(got[:, :, 5]).all() and np.isnan(got[1, 2]).all()
    assert np.isfinite(np.delete(np.delete(got.reshape(12, 64), 5, 0), 5, 1)).all()
    # the one-row path (NaN codes noted per block, the block redone by the scalar path)
    one = dc.fp8_gemm(a[1, 1:3][:1], a_s[1, 1:3][:1], b, b_s, out_dtype="float32")
    np.testing.assert_array_equal(one.view(np.uint32), at_ref(
        dc.fp8_gemm, a[1, 1:3][:1], a_s[1, 1:3][:1], b, b_s, out_dtype="float32").view(np.uint32))
    assert np.isnan(one[0, 5]) and np.isfinite(np.delete(one[0], 5)).all()
    # strided activations / scales / output give the contiguous result
    big = np.zeros((4, 6, 300), np.uint8)
    big[:, ::2, 10:266] = a
    sbig = np.zeros((4, 3, 5), np.uint8)
    sbig[:, :, ::2][..., :2] = a_s
    av, sv = big[:, ::2, 10:266], sbig[:, :, ::2][..., :2]
    out = np.zeros((4, 3, 128), np.float32)
    r = dc.fp8_gemm(av, sv, b, b_s, out=out[..., ::2])
    np.testing.assert_array_equal(np.asarray(r).view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("N,K", [(13, 96), (8, 4096), (70, 160), (1, 32)])
def test_fp4_gemm_one_row_scale_codes_and_strides(isa_bf16, rng, N, K):
    """The one-row fp4 path (8 weight rows a vector, 16 at the amx level; scales decoded
    in-register, gathered at amx): N not a multiple of 8 or 16, an odd number of
    32-blocks, e8m0 scale codes 0 (2^-127) and 0xff (NaN), float32 and e8m0 scales
    through strided views, padded weight rows."""
    a = rand_e4m3(rng, (1, K))
    a_s = rand_scales(rng, (1, -(-K // 128)), True)
    bb = rng.integers(0, 256, (N, K // 2 + 7)).astype(np.uint8)
    b = bb[:, 3:3 + K // 2]
    b_s = rand_scales(rng, (N, K // 32), True)
    b_s[0] = 0          # every block of row 0 at 2^-127: a tiny but nonzero result
    if N > 2:
        b_s[2, 0] = 0xFF
    got = dc.fp4_gemm(a, a_s, b, b_s, out_dtype="float32")
    ref = at_ref(dc.fp4_gemm, a, a_s, b, b_s, out_dtype="float32")
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    nan = np.zeros(N, bool)
    nan[2:3] = True
    np.testing.assert_array_equal(np.isnan(got[0]), nan)
    assert got[0, 0] != 0
    want, mag = want_fp4(a, a_s, b, b_s)
    fin = np.isfinite(want)
    check_close(got[fin], want[fin], mag[fin], (N, K))
    sf = np.zeros((N, 2 * (K // 32)), np.float32)
    sf[:, ::2] = rand_scales(rng, (N, K // 32), False)
    got = dc.fp4_gemm(a, a_s, b, sf[:, ::2], out_dtype="float32")
    ref = at_ref(dc.fp4_gemm, a, a_s, b, sf[:, ::2], out_dtype="float32")
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    want, mag = want_fp4(a, a_s, b, sf[:, ::2])
    check_close(got, want, mag, (N, K, "f32 scales"))
    s8 = np.zeros((N, 3 * (K // 32)), np.uint8)
    s8[:, ::3] = b_s
    got = dc.fp4_gemm(a, a_s, b, s8[:, ::3], out_dtype="float32")
    ref = at_ref(dc.fp4_gemm, a, a_s, b, b_s, out_dtype="float32")
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_gemm_torch_dtypes(rng):
    a, b = rand_e4m3(rng, (3, 256)), rand_e4m3(rng, (130, 256))
    a_s, b_s = rand_scales(rng, (3, 2), True), rand_scales(rng, (2, 2), True)
    T = torch.from_numpy
    want = dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32")
    got = dc.fp8_gemm(T(a).view(torch.float8_e4m3fn), T(a_s).view(torch.float8_e8m0fnu),
                      T(b).view(torch.float8_e4m3fn), T(b_s).view(torch.float8_e8m0fnu),
                      out_dtype="float32")
    np.testing.assert_array_equal(got, want)
    ml = dc.fp8_gemm(a.view(E4M3), a_s.view(E8M0), b.view(E4M3), b_s.view(E8M0),
                     out_dtype="float32")
    np.testing.assert_array_equal(ml, want)
    out = torch.empty(3, 130, dtype=torch.bfloat16)
    dc.fp8_gemm(T(a).view(torch.float8_e4m3fn), T(a_s).view(torch.float8_e8m0fnu),
                T(b).view(torch.float8_e4m3fn), T(b_s).view(torch.float8_e8m0fnu), out=out)
    torch.testing.assert_close(out, T(want).bfloat16(), rtol=0, atol=0)
    b4 = rng.integers(0, 256, (130, 128)).astype(np.uint8)
    b4s = rand_scales(rng, (130, 8), True)
    w4 = dc.fp4_gemm(a, a_s, b4, b4s, out_dtype="float32")
    g4 = dc.fp4_gemm(T(a).view(torch.float8_e4m3fn), T(a_s).view(torch.float8_e8m0fnu),
                     T(b4).view(torch.float4_e2m1fn_x2), T(b4s).view(torch.float8_e8m0fnu),
                     out_dtype="float32")
    np.testing.assert_array_equal(g4, w4)


def test_gemm_takes_parameters_that_require_grad(rng):
    """A released model's weights and scales are nn.Parameters (requires_grad=True, FP8
    ones included): the GEMMs read them in place, detached, as plain tensors; a 1-byte
    dtype the argument does not take is still refused by name."""
    a, b = rand_e4m3(rng, (2, 256)), rand_e4m3(rng, (130, 256))
    a_s, b_s = rand_scales(rng, (2, 2), False), rand_scales(rng, (2, 2), False)
    T, P = torch.from_numpy, torch.nn.Parameter
    want = dc.fp8_gemm(a, a_s, b, b_s, out_dtype="float32")
    w, ws = P(T(b).view(torch.float8_e4m3fn)), P(T(b_s))
    assert w.requires_grad and ws.requires_grad
    got = dc.fp8_gemm(T(a).view(torch.float8_e4m3fn), T(a_s), w, ws, out_dtype="float32")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(TypeError, match="'b'.*bool"):
        dc.fp8_gemm(a, a_s, T(b).bool(), b_s)
    with pytest.raises(TypeError, match="'a_s'.*bool"):
        dc.fp8_gemm(a, T(a_s).bool(), b, b_s)


@pytest.mark.parametrize("fn", ["fp8_gemm", "fp4_gemm"])
def test_gemm_bad_inputs_name_the_argument(rng, fn):
    f = getattr(dc, fn)
    fp8 = fn == "fp8_gemm"
    M, N, K = 3, 130, 256
    a = rand_e4m3(rng, (M, K))
    a_s = rand_scales(rng, (M, 2), True)
    b = rand_e4m3(rng, (N, K)) if fp8 else rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    b_s = rand_scales(rng, (2, 2) if fp8 else (N, 8), True)
    f(a, a_s, b, b_s)
    cases = [
        ((a.astype(np.float32), a_s, b, b_s), TypeError, "'a'"),
        ((a, a_s.astype(np.float64), b, b_s), TypeError, "'a_s'"),
        ((a, a_s, b.astype(np.int16), b_s), TypeError, "'b'"),
        ((a, a_s, b, b_s.astype(np.int32)), TypeError, "'b_s'"),
        ((a, a_s[:, :1], b, b_s), ValueError, "'a_s'"),
        ((a, a_s[:2], b, b_s), ValueError, "'a_s'"),
        ((a, a_s, b, b_s[:1]), ValueError, "'b_s'"),
        ((a, a_s, b, b_s[:, :1]), ValueError, "'b_s'"),
        ((a[:, :128], a_s[:, :1], b, b_s[..., :1] if fp8 else b_s[:, :4]), ValueError, "'b'"),
        ((a, a_s, np.repeat(b, 2, 1)[:, ::2], b_s), ValueError, "'b'"),
        ((a, a_s, b[None], b_s), ValueError, "'b'"),
        ((None, a_s, b, b_s), TypeError, "'a'"),
    ]
    if not fp8:
        cases.append(((a.view(E4M3), a_s, b.view(E4M3), b_s), TypeError, "'b'"))
        cases.append(((torch.from_numpy(a).view(torch.float8_e4m3fn), a_s,
                       torch.from_numpy(b).view(torch.float8_e4m3fn), b_s), TypeError, "'b'"))
    for args, exc, name in cases:
        with pytest.raises(exc, match=name):
            f(*args)
    with pytest.raises(ValueError, match="out_dtype"):
        f(a, a_s, b, b_s, out_dtype="float16")
    with pytest.raises(ValueError, match="'out'"):
        f(a, a_s, b, b_s, out=np.zeros((M, N + 1), np.float32))
    with pytest.raises(TypeError, match="'out'"):
        f(a, a_s, b, b_s, out=np.zeros((M, N), np.float64))


# ---------------------------------------------------------------- quantizers

def spread(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return (x * np.float32(10.0) ** rng.uniform(-6, 6, shape[:-1] + (1,))).astype(np.float32)


# Codes and scales of the quantizers, written here in torch from docs/kernels.md
# section 7 (and the released kernel's scale arithmetic): never from our fp8_round /
# fp4_round or our scales.  Blocks holding a NaN are left to the NaN-pattern checks.
def ref_fp8_quant(x, block, scale):
    """(e4m3 codes uint8, float32 scales): amax = max(|x|, 1e-4) per block, r = amax *
    float32(1/448), s = 2^ceil(log2 r) ('ue8m0', from the exponent bits) or r ('fp32'),
    codes = e4m3(clamp(x / s, +-448)) by torch's cast."""
    xb = torch.from_numpy(np.ascontiguousarray(x)).unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    r = amax * torch.tensor(1 / 448, dtype=torch.float32)
    if scale == "ue8m0":
        m, e = torch.frexp(r)
        s = torch.ldexp(torch.ones_like(r), e - (m == 0.5).to(e.dtype))
    else:
        s = r
    q = (xb / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.flatten(-2).numpy(), s[..., 0].numpy()


E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ref_fp4_quant(x, block, scale):
    """(packed e2m1 codes, element 2i in the low nibble, scale bytes): amax = max(|x|,
    floor) per block; 'ue8m0': s = 2^ceil(log2(amax * float32(1/6))), floor 6 * 2^-126,
    byte = 127 + log2 s; 'e4m3': s = e4m3(amax / 6), floor 6 * 2^-9, byte = its bits.
    Codes: the nearest of E2M1_VALUES to |x / s| clamped at 6 (ties to the even code),
    sign in bit 3."""
    xb = torch.from_numpy(np.ascontiguousarray(x)).unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True)
    if scale == "e4m3":
        s8 = (amax.clamp_min(6 * 2.0 ** -9) / 6).clamp_max(448).to(torch.float8_e4m3fn)
        s, sbytes = s8.float(), s8.view(torch.uint8)
    else:
        r = amax.clamp_min(6 * 2.0 ** -126) * torch.tensor(1 / 6, dtype=torch.float32)
        m, e = torch.frexp(r)
        e = e - (m == 0.5).to(e.dtype)
        s, sbytes = torch.ldexp(torch.ones_like(r), e), (e + 127).to(torch.uint8)
    v = (xb / s).clamp(-6, 6).numpy().astype(np.float64)
    d = np.abs(np.abs(v)[..., None] - E2M1_VALUES)
    best = d == d.min(-1, keepdims=True)
    even = best & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), even.argmax(-1), best.argmax(-1))
    codes = (idx | (np.signbit(v) << 3)).astype(np.uint8).reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, sbytes[..., 0].numpy()


@pytest.mark.parametrize("scale", ["ue8m0", "fp32"])
@pytest.mark.parametrize("block", [128, 64, 32, 3])
def test_fp8_quant_codes_scales(isa, rng, scale, block):
    x = spread(rng, (7, 5, 384))
    x[2, 1, 5] = np.nan
    x[3, 0, :block] = 0
    q, s = dc.fp8_quant(x, block, scale=scale)
    assert q.dtype == np.uint8 and q.shape == x.shape and s.shape == (7, 5, 384 // block)
    wq, ws = ref_fp8_quant(x, block, scale)
    fb = ~np.isnan(x).reshape(7, 5, -1, block).any(-1)       # blocks without a NaN
    np.testing.assert_array_equal(s[fb].view(np.uint32), ws[fb].view(np.uint32))
    fin = fb.repeat(block, -1)
    np.testing.assert_array_equal(q[fin], wq[fin])
    # a NaN reaches the dequantized values through its block only
    deq = (q.view(E4M3).astype(np.float32).reshape(7, 5, -1, block) * s[..., None]).reshape(x.shape)
    assert np.isnan(deq[2, 1, 5]) and not np.isnan(deq[fin]).any()
    if scale == "ue8m0":
        q2, s2 = dc.fp8_quant(x, block, scale=scale, scale_dtype="e8m0")
        np.testing.assert_array_equal(q2, q)
        np.testing.assert_array_equal(dec_e8(s2)[~np.isnan(s)], s[~np.isnan(s)])
    ref = at_ref(dc.fp8_quant, x, block, scale=scale)
    np.testing.assert_array_equal(ref[0], q)
    np.testing.assert_array_equal(ref[1].view(np.uint32), s.view(np.uint32))


def test_fp8_quant_bf16_input(rng):
    x = spread(rng, (9, 256)).astype(ml_dtypes.bfloat16)
    q, s = dc.fp8_quant(x)
    q2, s2 = dc.fp8_quant(x.astype(np.float32))
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(s, s2)
    qt, st = dc.fp8_quant(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)[:, :128])
    np.testing.assert_array_equal(qt, dc.fp8_quant(x[:, :128].astype(np.float32))[0])


@pytest.mark.parametrize("scale,block", [("ue8m0", 32), ("e4m3", 16), ("ue8m0", 2)])
def test_fp4_quant_codes_scales(isa, rng, scale, block):
    x = spread(rng, (6, 4, 128))
    x[1, 1, 7] = np.nan
    q, s = dc.fp4_quant(x, block, scale=scale)
    assert q.shape == (6, 4, 64) and s.dtype == np.uint8 and s.shape == (6, 4, 128 // block)
    sf = dec_e8(s) if scale == "ue8m0" else s.view(E4M3).astype(np.float64)
    wq, ws = ref_fp4_quant(x, block, scale)
    fb = ~np.isnan(x).reshape(6, 4, -1, block).any(-1)       # blocks without a NaN
    np.testing.assert_array_equal(s[fb], ws[fb])
    fin = fb.repeat(block // 2, -1)        # a byte holds 2 elements of one block
    np.testing.assert_array_equal(q[fin], wq[fin])
    deq = (dec4(q, 128).reshape(6, 4, -1, block) * sf[..., None]).reshape(x.shape)
    assert np.isnan(deq[1, 1, 7]) and not np.isnan(deq[fb.repeat(block, -1)]).any()
    q32, s32 = dc.fp4_quant(x, block, scale=scale, scale_dtype="float32")
    np.testing.assert_array_equal(q32, q)
    np.testing.assert_array_equal(s32[~np.isnan(s32)], sf[~np.isnan(s32)].astype(np.float32))
    ref = at_ref(dc.fp4_quant, x, block, scale=scale)
    np.testing.assert_array_equal(ref[0], q)
    np.testing.assert_array_equal(ref[1], s)


def test_quant_then_gemm_is_the_released_linear(rng):
    """act_quant -> fp8_gemm of a random bf16 activation against e4m3 weights matches
    the dequantized float64 product within float32 accumulation error."""
    x = spread(rng, (5, 512))
    q, s = dc.fp8_quant(x, 128, scale_dtype="e8m0")
    b = rand_e4m3(rng, (96, 512))
    bs = rand_scales(rng, (1, 4), True)
    got = dc.fp8_gemm(q, s, b, bs, out_dtype="float32")
    want, mag = want_fp8(q, s, b, bs)
    check_close(got, want, mag, "linear")


def test_quant_bad_inputs(rng):
    x = rng.standard_normal((4, 128)).astype(np.float32)
    with pytest.raises(ValueError, match="'block'"):
        dc.fp8_quant(x, 100)
    with pytest.raises(ValueError, match="'block'"):
        dc.fp4_quant(x, 3)
    with pytest.raises(ValueError, match="'scale'"):
        dc.fp8_quant(x, scale="e4m3")
    with pytest.raises(ValueError, match="e8m0"):
        dc.fp8_quant(x, scale="fp32", scale_dtype="e8m0")
    with pytest.raises(ValueError, match="scale_dtype"):
        dc.fp4_quant(x, 16, scale="e4m3", scale_dtype="e8m0")
    with pytest.raises(TypeError, match="'x'"):
        dc.fp8_quant(x.astype(np.float64))


# ---------------------------------------------------------------- Sinkhorn

def sinkhorn_ref(mixes, sc, base, h, iters, eps):
    """docs/kernels.md section 9, float64."""
    m = mixes.astype(np.float64)
    sig = lambda v: 1 / (1 + np.exp(-v))
    pre = sig(m[..., :h] * sc[0] + base[:h]) + eps
    post = 2 * sig(m[..., h:2 * h] * sc[1] + base[h:2 * h])
    c = m[..., 2 * h:].reshape(m.shape[:-1] + (h, h)) * sc[2] + base[2 * h:].reshape(h, h)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return pre, post, c


@pytest.mark.parametrize("h,iters", [(4, 20), (2, 1), (3, 5), (8, 7)])
def test_hc_split_sinkhorn(isa, rng, h, iters):
    mixes = rng.standard_normal((3, 5, (2 + h) * h)).astype(np.float32)
    sc = rng.uniform(0.5, 2, 3).astype(np.float32)
    base = (0.1 * rng.standard_normal((2 + h) * h)).astype(np.float32)
    got = dc.hc_split_sinkhorn(mixes, sc, base, h, iters, 1e-6)
    want = sinkhorn_ref(mixes, sc, base, h, iters, 1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    ref = at_ref(dc.hc_split_sinkhorn, mixes, sc, base, h, iters, 1e-6)
    for g, w in zip(got, ref):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
    # the comb rows and columns are (nearly) doubly stochastic after many iterations
    if iters >= 20:
        np.testing.assert_allclose(got[2].sum(-2), 1, atol=1e-4)


def test_hc_split_sinkhorn_bad_inputs(rng):
    m = rng.standard_normal((2, 24)).astype(np.float32)
    sc, base = np.ones(3, np.float32), np.zeros(24, np.float32)
    dc.hc_split_sinkhorn(m, sc, base, 4, 20, 1e-6)
    with pytest.raises(ValueError, match="'mixes'"):
        dc.hc_split_sinkhorn(m, sc, base, 3, 20, 1e-6)
    with pytest.raises(ValueError, match="'hc_scale'"):
        dc.hc_split_sinkhorn(m, sc[:2], base, 4, 20, 1e-6)
    with pytest.raises(ValueError, match="'hc_base'"):
        dc.hc_split_sinkhorn(m, sc, base[:20], 4, 20, 1e-6)
    with pytest.raises(ValueError, match="'sinkhorn_iters'"):
        dc.hc_split_sinkhorn(m, sc, base, 4, 0, 1e-6)
    with pytest.raises(TypeError, match="'mixes'"):
        dc.hc_split_sinkhorn(m.astype(np.float64), sc, base, 4, 20, 1e-6)
