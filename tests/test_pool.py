"""Gated pooling and the streaming Compressor against the float32 reference
(tests/ref_pool.py), the prefill/decode invariant, bad inputs, NaN/inf, threads."""
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import deepseek_csa as dc
from conftest import (
    ISA_LEVELS_BF16, assert_close, bf16_round, same_bits_at_thread_counts, unchanged)
import ref_pool as ref

T_ = torch.from_numpy
BF16 = ml_dtypes.bfloat16
CFG = dc.V4_FLASH
# kinds of released compressors: (ratio, overlap, has ape)
V4_CSA, V4_HCA, V41_PAIR, V41_ONE = (4, True, True), (128, False, True), (2, False, False), \
    (1, False, False)


def _inputs(rng, B, T, cd, ratio, ape=True, scale=2.0):
    kv = rng.standard_normal((B, T, cd), dtype=np.float32)
    sc = rng.standard_normal((B, T, cd), dtype=np.float32) * scale
    ap = rng.standard_normal((ratio, cd), dtype=np.float32) if ape else None
    return kv, sc, ap


def _bits(a):
    """The raw bits of a float32 or bfloat16 array."""
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _ref_pool(kv, sc, ratio, ape, overlap):
    return ref.pool(T_(kv), None if sc is None else T_(sc), ratio,
                    None if ape is None else T_(ape), overlap).numpy()


# ---------------------------------------------------------------- gated_pool

@pytest.mark.parametrize("kind, D, T", [
    (V4_CSA, 512, 1024), (V4_CSA, 128, 1024), (V4_HCA, 512, 1024), (V41_PAIR, 512, 1024),
    (V41_ONE, 512, 256)])
def test_gated_pool_released_shapes(isa, rng, kind, D, T):
    ratio, overlap, has_ape = kind
    if isa == "ref" and T > 256 and D > 128:
        T = 256                     # the scalar oracle is slow; the shape logic is the same
    c = 2 if overlap else 1
    kv, sc, ape = _inputs(rng, 1, T + 3, c * D, ratio, has_ape)
    with unchanged(kv, sc, *([ape] if has_ape else [])):
        got = dc.gated_pool(kv, sc, ratio, ape=ape, overlap=overlap)
    assert got.shape == (1, (T + 3) // ratio, D)
    assert_close(got, _ref_pool(kv, sc, ratio, ape, overlap), rtol=1e-5, atol=2e-6,
                 what=f"ratio {ratio}")


@pytest.mark.parametrize("B, T, D, ratio, overlap", [
    (3, 13, 17, 4, True), (2, 3, 8, 4, True), (2, 4, 8, 4, True), (1, 11, 600, 5, False),
    (2, 9, 33, 2, False), (2, 7, 16, 1, True), (2, 7, 5, 1, False), (1, 300, 24, 128, False),
    (2, 25, 1, 3, True), (1, 5, 1030, 2, True), (0, 8, 8, 2, False), (2, 0, 8, 4, True),
    (2, 8, 0, 2, False)])
def test_gated_pool_odd_shapes(isa, rng, B, T, D, ratio, overlap):
    c = 2 if overlap else 1
    kv, sc, ape = _inputs(rng, B, T, c * D, ratio)
    want = _ref_pool(kv, sc, ratio, ape, overlap)
    assert_close(dc.gated_pool(kv, sc, ratio, ape=ape, overlap=overlap), want, rtol=1e-5,
                 atol=2e-6, what="ape")
    want = _ref_pool(kv, sc, ratio, None, overlap)
    assert_close(dc.gated_pool(kv, sc, ratio, overlap=overlap), want, rtol=1e-5, atol=2e-6,
                 what="no ape")


def test_gated_pool_ratio1_ignores_score(rng):
    kv = rng.standard_normal((2, 5, 16), dtype=np.float32)
    assert np.array_equal(dc.gated_pool(kv, None, 1), kv)
    sc = np.full_like(kv, np.nan)
    assert np.array_equal(dc.gated_pool(kv, sc, 1), kv)


def test_gated_pool_strided_views_torch_and_out(rng):
    base = rng.standard_normal((2, 40, 3, 64), dtype=np.float32)
    kv = base[:, ::2, 0, ::-1]              # [2, 20, 64], reversed feature stride
    sc = base[:, 1::2, 2, :]
    ape = rng.standard_normal((4, 128), dtype=np.float32)[:, ::2]
    want = _ref_pool(np.ascontiguousarray(kv), np.ascontiguousarray(sc), 4,
                     np.ascontiguousarray(ape), True)
    assert_close(dc.gated_pool(kv, sc, 4, ape=ape, overlap=True), want, rtol=1e-5, atol=2e-6)
    out = np.full((2, 5, 64), 9.0, np.float32)[:, :, ::2]
    assert dc.gated_pool(kv, sc, 4, ape=ape, overlap=True, out=out) is out
    assert_close(out, want, rtol=1e-5, atol=2e-6, what="strided out")
    tk, ts = torch.from_numpy(np.ascontiguousarray(kv)), torch.from_numpy(np.ascontiguousarray(sc))
    assert_close(dc.gated_pool(tk, ts, 4, ape=torch.from_numpy(np.ascontiguousarray(ape)),
                               overlap=True), want, rtol=1e-5, atol=2e-6, what="torch")


def test_gated_pool_nan_inf_like_torch_softmax(isa):
    """-inf logits get weight 0, all -inf is NaN, a NaN or +inf logit makes the feature
    NaN, an inf value with weight 0 is NaN (0 * inf), as the reference computes them."""
    ratio, D = 4, 20
    kv = np.ones((1, 12, 2 * D), np.float32)
    sc = np.zeros((1, 12, 2 * D), np.float32)
    sc[0, 4:8, D + 0] = -np.inf                      # entry 1: current group masked -> prev only
    sc[0, 0:4, 1] = -np.inf                          # entry 1: prev masked
    sc[0, 8:12, D + 2] = -np.inf                     # entry 2: half masked
    sc[0, 0:4, D + 3] = -np.inf                      # entry 0: no prev, all masked -> NaN
    sc[0, 5, D + 4] = np.nan                         # entry 1: NaN logit
    sc[0, 9, D + 5] = np.inf                         # entry 2: +inf logit
    kv[0, 6, D + 6] = np.inf                         # entry 1: inf value
    kv[0, 2, D + 7] = np.nan                         # entry 0: NaN value
    sc[0, 2, D + 8] = -np.inf
    kv[0, 2, D + 8] = np.inf                         # weight-0 inf value -> NaN, as 0 * inf
    kv[0, 9, D + 9] = -1e37
    kv[0, 10, D + 9] = -1e37                         # large values (sum(e*kv) / sum(e): values
    #                                                  within 2r of FLT_MAX would overflow)
    want = _ref_pool(kv, sc, ratio, None, True)
    got = dc.gated_pool(kv, sc, ratio, overlap=True)
    assert np.isnan(want[0, 0, 3]) and np.isnan(want[0, 1, 4]) and np.isnan(want[0, 2, 5])
    assert_close(got, want, rtol=1e-5, atol=2e-6, what="nan/inf")
    # non-overlap, huge logit spread (exp underflows for all but the max)
    sc2 = np.array([[[0.0], [-200.0], [-90.0], [-87.0]]], np.float32)
    kv2 = np.array([[[1.0], [2.0], [3.0], [4.0]]], np.float32)
    assert_close(dc.gated_pool(kv2, sc2, 4), _ref_pool(kv2, sc2, 4, None, False), rtol=1e-6)


def test_gated_pool_exp_accuracy_over_logit_range(isa, rng):
    """The tuned exp across the whole float range of logit differences."""
    T, D = 4 * 2048, 16
    sc = rng.uniform(-120, 0, (1, T, D)).astype(np.float32)
    sc[0, ::4] = 0.0
    kv = rng.standard_normal((1, T, D), dtype=np.float32)
    assert_close(dc.gated_pool(kv, sc, 4), _ref_pool(kv, sc, 4, None, False), rtol=2e-6,
                 atol=1e-6, what="exp")


@pytest.mark.parametrize("make, exc, words", [
    (lambda kv, sc, ap: ((kv.astype(np.float64), sc, 4), {"ape": ap, "overlap": True}),
     TypeError, ["'kv'", "float64"]),
    (lambda kv, sc, ap: ((kv, sc.astype(np.float16), 4), {"ape": ap, "overlap": True}),
     TypeError, ["'score'", "float16"]),
    (lambda kv, sc, ap: ((kv, sc[:, :, :-2], 4), {"ape": ap, "overlap": True}),
     ValueError, ["'score'", "[2, 9, 16]", "[2, 9, 14]"]),
    (lambda kv, sc, ap: ((kv, sc, 4), {"ape": ap[:, :8], "overlap": True}),
     ValueError, ["'ape'", "[4, 16]", "[4, 8]"]),
    (lambda kv, sc, ap: ((kv, sc, 2), {"ape": ap, "overlap": True}),
     ValueError, ["'ape'", "[2, 16]"]),
    (lambda kv, sc, ap: ((kv, sc, 0), {}), ValueError, ["'ratio'", "got 0"]),
    (lambda kv, sc, ap: ((kv, sc, -4), {}), ValueError, ["'ratio'"]),
    (lambda kv, sc, ap: ((kv, sc, 4.0), {}), TypeError, ["'ratio'"]),
    (lambda kv, sc, ap: ((kv[:, :, :15], sc[:, :, :15], 4), {"overlap": True}),
     ValueError, ["even", "'kv'"]),
    (lambda kv, sc, ap: ((kv, None, 4), {}), TypeError, ["'score'", "None"]),
    (lambda kv, sc, ap: ((kv[0], sc[0], 4), {}), ValueError, ["'kv'", "3 dimensions"]),
    (lambda kv, sc, ap: ((kv, sc, 4), {"out": np.zeros((2, 3, 16), np.float32)}),
     ValueError, ["'out'", "[2, 2, 16]", "[2, 3, 16]"]),
    (lambda kv, sc, ap: ((kv, sc, 4), {"out": kv[:, :2]}), ValueError, ["'out'", "overlaps"]),
])
def test_gated_pool_bad_inputs(rng, make, exc, words):
    kv, sc, ap = _inputs(rng, 2, 9, 16, 4)
    args, kwargs = make(kv, sc, ap)
    with unchanged(kv, sc, ap):
        with pytest.raises(exc) as e:
            dc.gated_pool(*args, **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_gated_pool_bitwise_identical_at_any_thread_count(rng):
    kv, sc, ape = _inputs(rng, 2, 1001, 1024, 4)
    kv2, sc2, ape2 = _inputs(rng, 1, 1030, 512, 128)
    same_bits_at_thread_counts(lambda: (dc.gated_pool(kv, sc, 4, ape=ape, overlap=True),
                                        dc.gated_pool(kv2, sc2, 128, ape=ape2)))


# ---------------------------------------------------------------- Compressor

KINDS = [(r, ov) for r in (1, 2, 3, 4, 5, 8) for ov in (False, True)] + [(128, False),
                                                                         (128, True)]


def _epilogue_kw(rng, D, ratio, positions, rope=True, dtype="float32"):
    w = rng.standard_normal(D, dtype=np.float32)
    kw = dict(norm_weight=w, eps=1e-6, model_dtype=dtype)
    if rope:
        cos, sin = dc.rope_table(min(D - D % 2, 64), positions, **CFG.rope_kwargs(4))
        kw["rope"] = (cos, sin)
    return kw


def _stream(comp, kv, sc, T1):
    """prefill(T1) then one step per token: all entries along axis 1."""
    outs = [comp.prefill(kv[:, :T1], None if sc is None else sc[:, :T1])]
    for p in range(T1, kv.shape[1]):
        y = comp.step(kv[:, p:p + 1], None if sc is None else sc[:, p:p + 1], p)
        assert (y is not None) == ((p + 1) % comp.ratio == 0)
        if y is not None:
            outs.append(y)
    return np.concatenate(outs, axis=1)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_prefill_then_decode_is_bitwise_prefill(data):
    """For every ratio/overlap, random T and every split point: prefill(T1) + decode
    steps == prefill(T), bitwise, with and without the epilogue, at every ISA level;
    the state is per row (fresh rows beside used ones do not matter)."""
    ratio, overlap = data.draw(st.sampled_from(KINDS), label="kind")
    isa = data.draw(st.sampled_from(ISA_LEVELS_BF16), label="isa")
    bf16_in = data.draw(st.booleans(), label="bfloat16 inputs")
    B = data.draw(st.integers(1, 3), label="B")
    D = data.draw(st.sampled_from([1, 4, 17, 64, 130]), label="D")
    T = data.draw(st.integers(0, 3 * ratio + 5 if ratio < 128 else 300), label="T")
    epi = data.draw(st.sampled_from([None, "float32", "bfloat16"]), label="epilogue")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    rng = np.random.default_rng(seed)
    c = 2 if overlap else 1
    kv, sc, ape = _inputs(rng, B, T, c * D, ratio, ape=data.draw(st.booleans(), label="ape"))
    if ratio == 1 and not overlap and data.draw(st.booleans(), label="score None"):
        sc = None
    if bf16_in:
        kv, sc = kv.astype(BF16), None if sc is None else sc.astype(BF16)
    kw = {} if epi is None else _epilogue_kw(rng, D, ratio, T + 1, rope=D >= 2, dtype=epi)
    before = dc.get_isa()
    dc.set_isa(isa)
    try:
        full = dc.Compressor(B + 1, ratio, D, overlap=overlap, ape=ape, **kw).prefill(kv, sc)
        splits = range(T + 1) if T <= 40 else sorted({0, 1, T // 2, T - 1, T} |
                                                      set(data.draw(st.lists(
                                                          st.integers(0, T), max_size=3))))
        comp = dc.Compressor(B + 1, ratio, D, overlap=overlap, ape=ape, **kw)
        for T1 in splits:
            got = _stream(comp, kv, sc, T1)      # prefill restarts the sequence each time
            assert got.shape == full.shape and got.dtype == full.dtype == kv.dtype
            assert np.array_equal(_bits(got), _bits(full)), f"split {T1} of {T} differs"
            assert list(comp.positions[:B]) == [T] * B
        # batch rows are independent: each row alone gives its rows' bits
        for b in range(B):
            one = dc.Compressor(1, ratio, D, overlap=overlap, ape=ape, **kw).prefill(
                kv[b:b + 1], None if sc is None else sc[b:b + 1])
            assert np.array_equal(_bits(one), _bits(full[b:b + 1]))
    finally:
        dc.set_isa(before)


@pytest.mark.parametrize("kind, D", [(V4_CSA, 512), (V4_CSA, 128), (V4_HCA, 512),
                                     (V41_PAIR, 512), (V41_ONE, 512)])
@pytest.mark.parametrize("epilogue", [False, True])
def test_compressor_matches_released_module(rng, kind, D, epilogue):
    """Prefill (T % ratio != 0) then decode steps through the reference module with its
    buffers, entries compared one by one at float32 tolerance."""
    ratio, overlap, has_ape = kind
    c = 2 if overlap else 1
    T1 = {4: 37, 128: 300, 2: 9, 1: 5}[ratio]
    T = T1 + (2 * ratio + 3 if ratio < 128 else 140)
    B = 2
    kv, sc, ape = _inputs(rng, B, T, c * D, ratio, has_ape)
    kw, rkw = {}, {}
    if epilogue:
        kw = _epilogue_kw(rng, D, ratio, T)
        cos, sin = kw["rope"]
        rkw = dict(norm_w=T_(kw["norm_weight"]), eps=1e-6, cos=T_(cos), sin=T_(sin))
    comp = dc.Compressor(3, ratio, D, overlap=overlap, ape=ape, **kw)
    rc = ref.RefCompressor(3, ratio, D, overlap, None if ape is None else T_(ape), **rkw)
    tol = dict(rtol=2e-5, atol=5e-6)
    got = comp.prefill(kv[:, :T1], sc[:, :T1])
    want = rc(T_(kv[:, :T1]), T_(sc[:, :T1]), 0)
    assert_close(got, want.numpy(), **tol, what="prefill")
    n = 0
    for p in range(T1, T):
        y = comp.step(kv[:, p:p + 1], sc[:, p:p + 1], p)
        w = rc(T_(kv[:, p:p + 1]), T_(sc[:, p:p + 1]), p)
        assert (y is None) == (w is None), p
        if y is not None:
            n += 1
            assert y.shape == (B, 1, D)
            assert_close(y, w.numpy(), **tol, what=f"step {p}")
    assert n == (T // ratio) - (T1 // ratio)


@pytest.mark.parametrize("kind, D", [(V4_CSA, 512), (V4_HCA, 512), (V41_PAIR, 512),
                                     (V41_ONE, 512)])
def test_compressor_bf16_path(rng, kind, D):
    """The reference in the bfloat16 model dtype against ours in bfloat16 (and in
    float32) at bf16 tolerance."""
    ratio, overlap, has_ape = kind
    c = 2 if overlap else 1
    T = 8 * ratio + ratio // 2 + 1
    kv, sc, ape = _inputs(rng, 1, T, c * D, ratio, has_ape)
    if ratio == 1:
        kv = bf16_round(kv)           # V4.1's ratio-1 projection is bf16
    kw = _epilogue_kw(rng, D, ratio, T, dtype="bfloat16")
    kw["norm_weight"] = bf16_round(kw["norm_weight"])
    cos, sin = kw["rope"]
    rc = ref.RefCompressor(1, ratio, D, overlap, None if ape is None else T_(ape),
                           norm_w=T_(kw["norm_weight"]), cos=T_(cos), sin=T_(sin),
                           dtype=torch.bfloat16)
    want = rc(T_(kv), T_(sc), 0).numpy()
    got = dc.Compressor(1, ratio, D, overlap=overlap, ape=ape, **kw).prefill(kv, sc)
    assert np.array_equal(got, bf16_round(got)), "bfloat16 mode returns bf16 values"
    assert_close(got, want, rtol=1.6e-2, atol=1e-2, what="bf16 vs bf16")
    kw32 = dict(kw, model_dtype="float32")
    got32 = dc.Compressor(1, ratio, D, overlap=overlap, ape=ape, **kw32).prefill(kv, sc)
    assert_close(got32, want, rtol=1.6e-2, atol=1e-2, what="fp32 vs bf16")


def test_compressor_short_prefill_and_mid_group_start(rng):
    """T < ratio emits nothing; a decode start mid-group; step at position 0."""
    kv, sc, ape = _inputs(rng, 1, 11, 16, 4)
    comp = dc.Compressor(1, 4, 8, overlap=True, ape=ape)
    y = comp.prefill(kv[:, :2], sc[:, :2])
    assert y.shape == (1, 0, 8) and list(comp.positions) == [2]
    assert comp.step(kv[:, 2:3], sc[:, 2:3], 2) is None
    y = comp.step(kv[:, 3:4], sc[:, 3:4], 3)
    assert_close(y, _ref_pool(kv[:, :4], sc[:, :4], 4, ape, True), rtol=1e-5, atol=2e-6)
    comp.reset()
    outs = [comp.step(kv[:, p:p + 1], sc[:, p:p + 1], p) for p in range(8)]
    assert [o is None for o in outs] == [True, True, True, False] * 2
    want = dc.gated_pool(kv[:, :8], sc[:, :8], 4, ape=ape, overlap=True)
    assert np.array_equal(np.concatenate([outs[3], outs[7]], 1), want)


def test_compressor_reset_and_partial_batch(rng):
    """Rows beyond B keep their state; reset(rows) makes rows fresh; a second sequence
    never sees the first one's leftovers (unlike the released module)."""
    ratio, D = 4, 8
    kv, sc, ape = _inputs(rng, 3, 20, 2 * D, ratio)
    comp = dc.Compressor(3, ratio, D, overlap=True, ape=ape)
    comp.prefill(kv, sc[:, :, :])
    comp.prefill(kv[:1, :6], sc[:1, :6])                      # row 0 restarts
    assert list(comp.positions) == [6, 20, 20]
    with pytest.raises(ValueError, match="row 1"):
        comp.step(kv[:2, 6:7], sc[:2, 6:7], 6)                 # rows 0, 1 disagree
    comp.step(kv[:1, 6:7], sc[:1, 6:7], 6)
    y = comp.step(kv[:1, 7:8], sc[:1, 7:8], 7)
    assert np.array_equal(y, dc.gated_pool(kv[:1, :8], sc[:1, :8], 4, ape=ape, overlap=True)[:, 1:])
    comp.reset(1)
    assert list(comp.positions) == [8, 0, 20]
    # a fresh row-1 sequence of 3 tokens then decode: same as a brand-new Compressor
    fresh = dc.Compressor(1, ratio, D, overlap=True, ape=ape)
    kv2, sc2, _ = _inputs(rng, 1, 8, 2 * D, ratio)
    comp2 = dc.Compressor(2, ratio, D, overlap=True, ape=ape)
    comp2.prefill(kv[:2], sc[:2])                              # leftovers in both rows
    got = _stream(comp2, np.concatenate([kv2, kv2]), np.concatenate([sc2, sc2]), 3)
    want = _stream(fresh, kv2, sc2, 3)
    assert np.array_equal(got[:1], want) and np.array_equal(got[1:], want)


def test_compressor_quant_hook(rng):
    calls = []

    def q(x):
        calls.append(x.shape)
        x[...] = np.round(x)           # in place, returns None

    kv, sc, _ = _inputs(rng, 1, 9, 8, 4)
    comp = dc.Compressor(1, 4, 8, quant=q)
    y = comp.prefill(kv[:, :7], sc[:, :7])
    assert np.array_equal(y, np.round(dc.gated_pool(kv[:, :7], sc[:, :7], 4)))
    y = comp.step(kv[:, 7:8], sc[:, 7:8], 7)
    assert np.array_equal(y, np.round(dc.gated_pool(kv[:, :8], sc[:, :8], 4)[:, 1:]))
    assert calls == [(1, 1, 8), (1, 1, 8)]
    comp = dc.Compressor(1, 4, 8, quant=lambda x: x * 0)   # returning a new array
    assert not comp.prefill(kv[:, :8], sc[:, :8]).any()
    with pytest.raises(ValueError, match="'quant'"):
        dc.Compressor(1, 4, 8, quant="int8")


@pytest.mark.parametrize("quant", ["fp8", "fp4", "hadamard_fp4", "fp4_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compressor_released_quant(rng, quant, dtype):
    """The named QAT roundings equal the float32 reference of kernels.md section 7 applied to the
    entries of the same Compressor without rounding, in prefill and in decode."""
    import ref_quant
    D, ratio, T = 128, 4, 19
    kv, sc, ape = _inputs(rng, 2, T, 2 * D, ratio)
    kw = _epilogue_kw(rng, D, ratio, T, dtype=dtype)
    plain = dc.Compressor(2, ratio, D, overlap=True, ape=ape, **kw)
    rounded = dc.Compressor(2, ratio, D, overlap=True, ape=ape, quant=quant, **kw)
    entries = [plain.prefill(kv[:, :10], sc[:, :10])]
    got = [rounded.prefill(kv[:, :10], sc[:, :10])]
    for p in range(10, T):
        e, g = plain.step(kv[:, p:p + 1], sc[:, p:p + 1], p), rounded.step(
            kv[:, p:p + 1], sc[:, p:p + 1], p)
        assert (e is None) == (g is None)
        if e is not None:
            entries.append(e)
            got.append(g)
    e = torch.from_numpy(np.concatenate(entries, 1))
    if quant == "fp8":
        want = e.clone()
        want[..., :D - 64] = ref_quant.fp8_round(e[..., :D - 64], 64)
    elif quant == "fp4":
        want = ref_quant.fp4_round(e, 32)
    elif quant == "hadamard_fp4":
        h = ref_quant.hadamard(e)
        want = ref_quant.fp4_round(h.bfloat16().float() if dtype == "bfloat16" else h, 32)
    else:
        want = ref_quant.fp4_round(e, 16, scale="e4m3")
        if dtype == "bfloat16":
            want = want.bfloat16().float()
    assert_close(np.concatenate(got, 1), want.numpy(), rtol=0, atol=0, what=quant)


def _state(comp):
    return [comp._kv.copy(), comp._score.copy(), comp._prev_kv.copy(),
            comp._prev_score.copy(), comp._pos.copy()]


def _same_state(a, b):
    return all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("call, exc, words", [
    (lambda c, kv, sc: c.step(kv[:, 5:6], sc[:, 5:6], 6), ValueError,
     ["'start_pos'", "must be 5", "got 6"]),
    (lambda c, kv, sc: c.step(kv[:, 5:6], sc[:, 5:6], 4), ValueError, ["'start_pos'"]),
    (lambda c, kv, sc: c.step(kv[:, 5:6], sc[:, 5:6], -1), ValueError, ["'start_pos'"]),
    (lambda c, kv, sc: c.step(kv[:, 5:6], sc[:, 5:6], 5.0), TypeError, ["'start_pos'"]),
    (lambda c, kv, sc: c.step(kv[:, 5:7], sc[:, 5:7], 5), ValueError, ["one token", "'kv'"]),
    (lambda c, kv, sc: c.step(np.concatenate([kv] * 2)[:, 5:6], np.concatenate([sc] * 2)[:, 5:6],
                              5), ValueError, ["rows", "batch=3"]),
    (lambda c, kv, sc: c.step(kv[:, 5:6].astype(np.float64), sc[:, 5:6], 5), TypeError,
     ["'kv'", "float64"]),
    (lambda c, kv, sc: c.step(kv[:, 5:6], sc[:, 5:6, :8], 5), ValueError, ["'score'"]),
    (lambda c, kv, sc: c.step(kv[:, 5:6, :8], sc[:, 5:6, :8], 5), ValueError,
     ["'kv'", "16"]),
    (lambda c, kv, sc: c.step(kv[:, 5:6], None, 5), TypeError, ["'score'"]),
    (lambda c, kv, sc: c.prefill(np.concatenate([kv] * 2), np.concatenate([sc] * 2)),
     ValueError, ["rows", "batch=3"]),
    (lambda c, kv, sc: c.prefill(kv.astype(np.float64), sc), TypeError, ["'kv'"]),
    (lambda c, kv, sc: c.prefill(kv, sc.astype(np.int32)), TypeError, ["'score'"]),
    (lambda c, kv, sc: c.prefill(kv[:, :, :12], sc[:, :, :12]), ValueError, ["'kv'"]),
    (lambda c, kv, sc: c.prefill(kv, sc[:, :-1]), ValueError, ["'score'"]),
])
def test_compressor_bad_inputs_leave_state_unchanged(rng, call, exc, words):
    kv, sc, ape = _inputs(rng, 3, 12, 16, 4)
    comp = dc.Compressor(3, 4, 8, overlap=True, ape=ape)
    comp.prefill(kv[:, :5], sc[:, :5])
    s0 = _state(comp)
    with unchanged(kv, sc):
        with pytest.raises(exc) as e:
            call(comp, kv, sc)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert _same_state(s0, _state(comp)), "a rejected call changed the state"
    # and it still continues correctly
    outs = [comp.step(kv[:, p:p + 1], sc[:, p:p + 1], p) for p in range(5, 8)]
    assert np.array_equal(outs[-1], dc.gated_pool(kv[:, :8], sc[:, :8], 4, ape=ape,
                                                  overlap=True)[:, 1:])


def test_compressor_rope_table_too_short_is_rejected(rng):
    kv, sc, _ = _inputs(rng, 1, 12, 16, 4)
    cos, sin = dc.rope_table(8, 8, base=1e4)
    comp = dc.Compressor(1, 4, 16, rope=(cos, sin))
    with pytest.raises(ValueError, match="RoPE tables"):
        comp.prefill(kv, sc)                         # entry 2 at position 8
    assert list(comp.positions) == [0]
    comp.prefill(kv[:, :8], sc[:, :8])
    s0 = _state(comp)
    for p in range(8, 11):
        comp.step(kv[:, p:p + 1], sc[:, p:p + 1], p)
    s1 = _state(comp)
    with pytest.raises(ValueError, match="RoPE tables"):
        comp.step(kv[:, 11:12], sc[:, 11:12], 11)
    assert _same_state(s1, _state(comp)) and not _same_state(s0, s1)


@pytest.mark.parametrize("args, kwargs, exc, word", [
    ((1, 0, 8), {}, ValueError, "'ratio'"),
    ((1, -2, 8), {}, ValueError, "'ratio'"),
    ((0, 4, 8), {}, ValueError, "'batch'"),
    ((1, 4, 0), {}, ValueError, "'head_dim'"),
    ((1, 4.0, 8), {}, TypeError, "'ratio'"),
    ((1, 4, 8), {"ape": np.zeros((4, 8), np.float32), "overlap": True}, ValueError, "'ape'"),
    ((1, 4, 8), {"ape": np.zeros((2, 8), np.float32)}, ValueError, "'ape'"),
    ((1, 4, 8), {"ape": np.zeros((4, 8))}, TypeError, "'ape'"),
    ((1, 4, 8), {"norm_weight": np.zeros(7, np.float32)}, ValueError, "'norm_weight'"),
    ((1, 4, 8), {"eps": -1.0}, ValueError, "'eps'"),
    ((1, 4, 8), {"model_dtype": "float16"}, ValueError, "'model_dtype'"),
    ((1, 4, 8), {"rope": (np.zeros((4, 8), np.float32),) * 2}, ValueError, "'rope'"),
    ((1, 4, 8), {"rope": np.zeros((4, 2), np.float32)}, TypeError, "'rope'"),
    ((1, 4, 8), {"quant": 3}, TypeError, "'quant'"),
])
def test_compressor_bad_construction(args, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        dc.Compressor(*args, **kwargs)


def test_compressor_decode_bitwise_at_any_thread_count(rng):
    kv, sc, ape = _inputs(rng, 4, 300, 1024, 4)
    same_bits_at_thread_counts(
        lambda: _stream(dc.Compressor(4, 4, 512, overlap=True, ape=ape), kv, sc, 257))


def test_compressor_takes_torch_tensors(rng):
    kv, sc, ape = _inputs(rng, 2, 10, 16, 4)
    want = _stream(dc.Compressor(2, 4, 8, overlap=True, ape=ape), kv, sc, 5)
    comp = dc.Compressor(2, 4, 8, overlap=True, ape=T_(ape))
    got = _stream(comp, T_(kv), T_(sc), 5)
    assert np.array_equal(got, want)
    s0 = _state(comp)
    with pytest.raises(TypeError, match="'score'"):
        comp.step(T_(kv[:, :1]), T_(sc[:, :1]).requires_grad_(), 10)
    assert _same_state(s0, _state(comp))
    with pytest.raises(TypeError, match="'kv'.*float16"):
        comp.step(T_(kv[:, :1]).half(), T_(sc[:, :1]), 10)
    assert _same_state(s0, _state(comp))


# ---------------------------------------------------------------- bfloat16 in and out

def _bf16_ulps(got, want):
    """Per element, the distance in bfloat16 ulps of two bf16-valued arrays (NaN must
    match NaN: distance 0, else a huge one)."""
    def line(a):
        h = np.ascontiguousarray(np.asarray(a, np.float32)).view(np.int32).astype(np.int64) >> 16
        return np.where(h < 0, -(h & 0x7FFF), h)   # sign-magnitude -> a monotone line
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    d = np.abs(line(g) - line(w))
    return np.where(np.isnan(g) | np.isnan(w), np.where(np.isnan(g) & np.isnan(w), 0, 1 << 30), d)


def _assert_one_ulp(got, want, what="", atol=2e-6):
    """bf16 results within 1 bf16 ulp of the bf16 run of the reference.  Pooling is a
    reduction: where a sum cancels to near zero, the float32 rounding of the reference
    itself (atol, as the float32 tests allow) may span more bf16 ulps of the tiny
    result, so an element also passes within atol + 1 ulp (ulp <= |want| 2^-7)."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ok = (_bf16_ulps(g, w) <= 1) | (np.abs(g - w) <= atol + np.abs(w) * 2.0 ** -7)
    if not ok.all():
        i = np.flatnonzero(~ok.ravel())[0]
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.size} beyond 1 bf16 ulp; first "
                             f"got {g.ravel()[i]!r} want {w.ravel()[i]!r}")
    return int(_bf16_ulps(g, w).max(initial=0))


def _tb(a):
    """A bf16 NumPy array as a torch bfloat16 tensor sharing its memory."""
    return T_(a.view(np.int16)).view(torch.bfloat16)


def _ref_pool_bf16(kv, sc, ratio, ape, overlap):
    """The bfloat16 run of the reference: inputs as the model holds them (bf16), the
    pooling in float32, the entry cast to bfloat16."""
    return ref.pool(_tb(kv), None if sc is None else _tb(sc), ratio,
                    None if ape is None else T_(ape), overlap).bfloat16().float().numpy()


@pytest.mark.parametrize("B, T, D, ratio, overlap", [
    (1, 1027, 512, 4, True), (1, 1030, 512, 128, False), (1, 1025, 512, 2, False),
    (3, 13, 17, 4, True), (2, 3, 8, 4, True), (1, 11, 600, 5, False), (2, 9, 33, 2, False),
    (2, 7, 5, 1, False), (2, 25, 1, 3, True), (1, 5, 1030, 2, True), (0, 8, 8, 2, False),
    (2, 0, 8, 4, True)])
def test_gated_pool_bf16_vs_bf16_reference(isa_bf16, rng, B, T, D, ratio, overlap):
    """bf16 kv / score: a bf16 result within 1 ulp of the bf16 run of the reference,
    bitwise the float32 path on the widened inputs cast to bf16, and within bf16
    tolerance of the float32 path on the unrounded inputs."""
    if isa_bf16 == "ref" and T * D > 1 << 16:
        T = 64 * ratio + 3          # the scalar oracle is slow; the shape logic is the same
    c = 2 if overlap else 1
    kv, sc, ape = _inputs(rng, B, T, c * D, ratio)
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    with unchanged(kb.view(np.uint16), sb.view(np.uint16), ape):
        got = dc.gated_pool(kb, sb, ratio, ape=ape, overlap=overlap)
    assert got.dtype == BF16 and got.shape == (B, T // ratio, D)
    g32 = got.astype(np.float32)
    _assert_one_ulp(g32, _ref_pool_bf16(kb, sb, ratio, ape, overlap), "vs bf16 reference")
    wide = dc.gated_pool(kb.astype(np.float32), sb.astype(np.float32), ratio, ape=ape,
                         overlap=overlap)
    assert np.array_equal(_bits(got), _bits(wide.astype(BF16))), "not the cast of the f32 path"
    # inputs rounded to bf16 (scores ~ N(0, 2): logit errors ~ 1e-2): an absolute budget
    # at the scale of the values (|kv| ~ 1), a wrong kernel is off by O(1)
    assert_close(g32, _ref_pool(kv, sc, ratio, ape, overlap), rtol=2e-2, atol=5e-2,
                 what="bf16 path vs float32 reference")


def test_gated_pool_bf16_mixed_dtypes_ape_and_ratio1(rng):
    """The result follows kv's dtype; a bf16 score or ape is widened like a float32 one;
    ratio 1 passes kv through (bf16 stays bf16 bit for bit)."""
    kv, sc, ape = _inputs(rng, 2, 21, 32, 4)
    kb, sb, ab = kv.astype(BF16), sc.astype(BF16), ape.astype(BF16)
    kw_, sw_, aw_ = (a.astype(np.float32) for a in (kb, sb, ab))
    want = dc.gated_pool(kw_, sw_, 4, ape=aw_, overlap=True)
    r = dc.gated_pool(kb, sw_, 4, ape=aw_, overlap=True)
    assert r.dtype == BF16 and np.array_equal(_bits(r), _bits(want.astype(BF16)))
    r = dc.gated_pool(kw_, sb, 4, ape=ab, overlap=True)
    assert r.dtype == np.float32 and np.array_equal(_bits(r), _bits(want))
    r = dc.gated_pool(kb, sb, 4, ape=ab, overlap=True)
    assert r.dtype == BF16 and np.array_equal(_bits(r), _bits(want.astype(BF16)))
    assert np.array_equal(_bits(dc.gated_pool(kb, None, 1)), _bits(kb))
    assert np.array_equal(_bits(dc.gated_pool(kb[:, :, ::-1], sb, 1)), _bits(kb[:, :, ::-1]))


def test_gated_pool_bf16_views_out_and_torch(rng):
    base = rng.standard_normal((2, 40, 3, 64), dtype=np.float32).astype(BF16)
    kv = base[:, ::2, 0, ::-1]              # [2, 20, 64], reversed feature stride
    sc = base[:, 1::2, 2, :]
    ape = rng.standard_normal((4, 128), dtype=np.float32)[:, ::2]
    want = dc.gated_pool(kv.astype(np.float32), sc.astype(np.float32), 4, ape=ape,
                         overlap=True).astype(BF16)
    with unchanged(base.view(np.uint16)):
        got = dc.gated_pool(kv, sc, 4, ape=ape, overlap=True)
    assert np.array_equal(_bits(got), _bits(want))
    buf = np.full((2, 5, 64), 9.0, BF16)
    out = buf[:, :, ::2]
    assert dc.gated_pool(kv, sc, 4, ape=ape, overlap=True, out=out) is out
    assert np.array_equal(_bits(out), _bits(want)) and (buf[:, :, 1::2] == 9).all()
    tk, ts = _tb(np.ascontiguousarray(kv)), _tb(np.ascontiguousarray(sc))
    tout = torch.zeros(2, 5, 32, dtype=torch.bfloat16)
    ptr = tout.data_ptr()
    assert dc.gated_pool(tk, ts, 4, ape=T_(np.ascontiguousarray(ape)), overlap=True,
                         out=tout) is tout
    assert tout.data_ptr() == ptr
    assert np.array_equal(tout.view(torch.int16).numpy().view(np.uint16), _bits(want))
    got = dc.gated_pool(tk, ts, 4, ape=np.ascontiguousarray(ape), overlap=True)
    assert got.dtype == BF16 and np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("make, exc, words", [
    (lambda kb, sb, ap: ((kb.astype(np.float16), sb, 4), {}), TypeError, ["'kv'", "bfloat16"]),
    (lambda kb, sb, ap: ((kb, sb.astype(np.float64), 4), {}), TypeError, ["'score'", "float64"]),
    (lambda kb, sb, ap: ((kb, sb, 4), {"ape": ap.astype(np.float16)}), TypeError,
     ["'ape'", "float16"]),
    (lambda kb, sb, ap: ((kb, sb, 4), {"out": np.zeros((2, 2, 16), np.float32)}), TypeError,
     ["'out'", "bfloat16", "float32"]),
    (lambda kb, sb, ap: ((kb.astype(np.float32), sb, 4), {"out": np.zeros((2, 2, 16), BF16)}),
     TypeError, ["'out'", "float32"]),
    (lambda kb, sb, ap: ((kb, sb, 4), {"out": np.zeros((2, 3, 16), BF16)}), ValueError,
     ["'out'", "[2, 2, 16]"]),
    (lambda kb, sb, ap: ((kb, sb, 4), {"out": kb[:, :2]}), ValueError, ["'out'", "overlaps"]),
])
def test_gated_pool_bf16_bad_inputs(rng, make, exc, words):
    kv, sc, ap = _inputs(rng, 2, 9, 16, 4)
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    args, kwargs = make(kb, sb, ap)
    with unchanged(kb.view(np.uint16), sb.view(np.uint16), ap):
        with pytest.raises(exc) as e:
            dc.gated_pool(*args, **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_gated_pool_bf16_bitwise_at_any_thread_count(rng):
    kv, sc, ape = _inputs(rng, 2, 1001, 1024, 4)
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    same_bits_at_thread_counts(lambda: dc.gated_pool(kb, sb, 4, ape=ape, overlap=True))


@pytest.mark.parametrize("kind, D", [(V4_CSA, 512), (V4_HCA, 512), (V41_PAIR, 512),
                                     (V41_ONE, 512), ((3, True, True), 24)])
def test_compressor_bf16_inputs_vs_bf16_reference(isa_bf16, rng, kind, D):
    """bf16 kv / score through prefill and decode: bf16 entries within 1 ulp of the
    released module run in bfloat16 (pooling in float32 on the bf16 inputs, then the
    cast, the norm and RoPE in the model dtype), bitwise equal to float32 inputs with
    model_dtype='bfloat16', and within bf16 tolerance of the float32 module."""
    ratio, overlap, has_ape = kind
    if isa_bf16 == "ref" and ratio == 128:
        pytest.skip("the scalar oracle is slow at ratio 128; the other kinds cover it")
    c = 2 if overlap else 1
    T1 = {4: 37, 128: 300, 2: 9, 1: 5, 3: 7}[ratio]
    T = T1 + (2 * ratio + 3 if ratio < 128 else 140)
    B = 2
    kv, sc, ape = _inputs(rng, B, T, c * D, ratio, has_ape)
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    kw = _epilogue_kw(rng, D, ratio, T)
    cos, sin = kw["rope"]
    rkw = dict(norm_w=T_(kw["norm_weight"]), eps=1e-6, cos=T_(cos), sin=T_(sin))
    ta = None if ape is None else T_(ape)
    rc = ref.RefCompressor(B, ratio, D, overlap, ta, dtype=torch.bfloat16, **rkw)
    r32 = ref.RefCompressor(B, ratio, D, overlap, ta, **rkw)
    comp = dc.Compressor(B, ratio, D, overlap=overlap, ape=ape, **kw)
    c32 = dc.Compressor(B, ratio, D, overlap=overlap, ape=ape,
                        **dict(kw, model_dtype="bfloat16"))
    kf, sf = kb.astype(np.float32), sb.astype(np.float32)
    calls = [(slice(0, T1), 0)] + [(slice(p, p + 1), p) for p in range(T1, T)]
    n = 0
    for sl, p in calls:
        got = comp.prefill(kb[:, sl], sb[:, sl]) if p == 0 else comp.step(kb[:, sl], sb[:, sl], p)
        same = (c32.prefill(kf[:, sl], sf[:, sl]) if p == 0 else
                c32.step(kf[:, sl], sf[:, sl], p))
        want = rc(T_(kf[:, sl]), T_(sf[:, sl]), p)
        w32 = r32(T_(kv[:, sl]), T_(sc[:, sl]), p)
        assert (got is None) == (want is None) == (same is None), p
        if got is None:
            continue
        n += got.shape[1]
        assert got.dtype == BF16
        g = got.astype(np.float32)
        _assert_one_ulp(g, want.numpy(), f"position {p}", atol=1e-5)
        # the same rounding points as float32 inputs in bf16 mode (the f32 and bf16 norm
        # kernels may vectorize their sum differently: 1 ulp)
        assert _bf16_ulps(g, same).max() <= 1, f"position {p}: vs float32 in bf16 mode"
        assert_close(g, w32.numpy(), rtol=3e-2, atol=3e-2, what=f"vs float32 module at {p}")
    assert n == T // ratio


@pytest.mark.parametrize("quant", ["fp8", "fp4", "hadamard_fp4", "fp4_e4m3"])
def test_compressor_bf16_inputs_released_quant(rng, quant):
    """With bf16 inputs the named QAT roundings act on the bf16 entries (float32 inside,
    one rounding to bf16 at the end): the reference's rounding of the unrounded bf16
    entries, bit for bit."""
    import ref_quant
    D, ratio, T = 128, 4, 19
    kv, sc, ape = _inputs(rng, 2, T, 2 * D, ratio)
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    kw = _epilogue_kw(rng, D, ratio, T)
    plain = dc.Compressor(2, ratio, D, overlap=True, ape=ape, **kw)
    rounded = dc.Compressor(2, ratio, D, overlap=True, ape=ape, quant=quant, **kw)
    e = [plain.prefill(kb[:, :10], sb[:, :10])]
    got = [rounded.prefill(kb[:, :10], sb[:, :10])]
    for p in range(10, T):
        y = [c.step(k[:, p:p + 1], s[:, p:p + 1], p)
             for c, k, s in ((plain, kb, sb), (rounded, kb, sb))]
        if y[0] is not None:
            for lst, v in zip((e, got), y):
                lst.append(v)
    got = np.concatenate(got, 1)
    assert got.dtype == BF16
    x = _tb(np.concatenate(e, 1)).float()
    if quant == "fp8":
        want = x.clone()
        want[..., :D - 64] = ref_quant.fp8_round(x[..., :D - 64], 64)
    elif quant == "fp4":
        want = ref_quant.fp4_round(x, 32)
    elif quant == "hadamard_fp4":
        want = ref_quant.fp4_round(ref_quant.hadamard(x).bfloat16().float(), 32)
    else:
        want = ref_quant.fp4_round(x, 16, scale="e4m3")
    assert_close(got.astype(np.float32), want.bfloat16().float().numpy(), rtol=0, atol=0,
                 what=quant)


def test_compressor_bf16_out_and_decode_threads(rng):
    """prefill's out= must be bf16 for bf16 kv; decode of bf16 inputs gives the same bits
    at 1, 2 and 3 threads."""
    kv, sc, ape = _inputs(rng, 4, 300, 1024, 4)
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    comp = dc.Compressor(4, 4, 512, overlap=True, ape=ape)
    with pytest.raises(TypeError, match="'out'.*bfloat16"):
        comp.prefill(kb[:, :8], sb[:, :8], out=np.zeros((4, 2, 512), np.float32))
    out = np.zeros((4, 2, 512), BF16)
    assert comp.prefill(kb[:, :8], sb[:, :8], out=out) is out
    first = same_bits_at_thread_counts(
        lambda: _stream(dc.Compressor(4, 4, 512, overlap=True, ape=ape), kb, sb, 257))
    assert np.array_equal(_bits(out), _bits(first)[:, :2])


def test_bf16_nan_inf_and_mixed_dtype_stream(isa_bf16, rng):
    """NaN / inf in bf16 inputs behave as in float32 (the softmax rules of the float32
    test), NaN stays NaN through the bf16 store; a Compressor fed bf16 kv with float32
    scores (the widened bf16 values) streams the same bits as bf16 scores."""
    ratio, D = 4, 20
    kv = np.ones((1, 12, 2 * D), np.float32)
    sc = np.zeros((1, 12, 2 * D), np.float32)
    sc[0, 4:8, D + 0] = -np.inf
    sc[0, 0:4, D + 3] = -np.inf                      # entry 0: all masked -> NaN
    sc[0, 5, D + 4] = np.nan
    sc[0, 9, D + 5] = np.inf
    kv[0, 6, D + 6] = np.inf
    kv[0, 2, D + 7] = np.nan
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    got = dc.gated_pool(kb, sb, ratio, overlap=True).astype(np.float32)
    want = dc.gated_pool(kb.astype(np.float32), sb.astype(np.float32), ratio, overlap=True)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 0, 3]) and np.isnan(got[0, 1, 4]) and np.isnan(got[0, 2, 5])
    fin = ~np.isnan(want)
    assert np.array_equal(got[fin], want[fin].astype(BF16).astype(np.float32))
    kv, sc, ape = _inputs(rng, 2, 23, 16, 4)
    kb, sb = kv.astype(BF16), sc.astype(BF16)
    a = _stream(dc.Compressor(2, 4, 8, overlap=True, ape=ape), kb, sb, 9)
    b = _stream(dc.Compressor(2, 4, 8, overlap=True, ape=ape), kb, sb.astype(np.float32), 9)
    assert a.dtype == b.dtype == BF16 and np.array_equal(_bits(a), _bits(b))


# ---------------------------------------------------------------- the fused QAT epilogue

# (B, ratio, overlap, T, T1): T not a multiple of ratio, a prefill shorter than one
# group (S < ratio), batch > 1, overlap on and off, V4.1's ratios 2 and 1.
_FUSED_SHAPES = [(2, 4, True, 19, 10), (3, 4, False, 13, 3), (1, 4, True, 11, 2),
                 (2, 2, False, 9, 5), (2, 1, False, 5, 3), (1, 8, False, 21, 7)]


def _quant_then_round(comp_plain, quant, rd, bf16, kv, sc, T1):
    """The old path: entries of a Compressor without rounding, then the released QAT
    rounding by separate calls (compressor._quant_fn) on each returned array."""
    from deepseek_csa.compressor import _quant_fn
    fn = _quant_fn(quant, rd, bf16)
    outs = []
    y = comp_plain.prefill(kv[:, :T1], sc[:, :T1])
    if y.shape[1]:
        fn(y)
    outs.append(y)
    for p in range(T1, kv.shape[1]):
        y = comp_plain.step(kv[:, p:p + 1], sc[:, p:p + 1], p)
        if y is not None:
            fn(y)
            outs.append(y)
    return np.concatenate(outs, 1)


@pytest.mark.parametrize("shape", _FUSED_SHAPES)
@pytest.mark.parametrize("mode", ["float32", "bfloat16", "bf16_inputs"])
@pytest.mark.parametrize("quant", ["fp8", "fp4", "hadamard_fp4", "fp4_e4m3"])
def test_compressor_fused_quant_is_pool_then_round(rng, quant, mode, shape):
    """The named roundings in the C epilogue give bitwise what pooling and then rounding
    by separate calls gave, in prefill and in every streaming step."""
    B, ratio, overlap, T, T1 = shape
    D = 128
    c = 2 if overlap else 1
    kv, sc, ape = _inputs(rng, B, T, c * D, ratio)
    if mode == "bf16_inputs":
        kv, sc = kv.astype(BF16), sc.astype(BF16)
    kw = _epilogue_kw(rng, D, ratio, T, dtype="bfloat16" if mode == "bfloat16" else "float32")
    kw.update(overlap=overlap, ape=ape if ratio > 1 else None)
    want = _quant_then_round(dc.Compressor(B, ratio, D, **kw), quant, 64, mode == "bfloat16",
                             kv, sc, T1)
    got = _stream(dc.Compressor(B, ratio, D, quant=quant, **kw), kv, sc, T1)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(_bits(got), _bits(want)), (quant, mode, shape)
    plain = _stream(dc.Compressor(B, ratio, D, **kw), kv, sc, T1)
    assert not np.array_equal(_bits(plain), _bits(got))   # the rounding did something


def test_compressor_fused_quant_without_rope_rounds_in_front_of_64(rng):
    kv, sc, ape = _inputs(rng, 2, 9, 192, 2)
    kw = dict(ape=ape, norm_weight=rng.standard_normal(192, dtype=np.float32))
    want = _quant_then_round(dc.Compressor(2, 2, 192, **kw), "fp8", 64, False, kv, sc, 4)
    got = _stream(dc.Compressor(2, 2, 192, quant="fp8", **kw), kv, sc, 4)
    assert np.array_equal(_bits(got), _bits(want))


from deepseek_csa import _core  # noqa: E402

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _unpack_fp4(q, D):
    """uint8 [..., D/2 + D/32] packed entries -> float32 [..., D]: codes times scales."""
    codes = np.stack([q[..., :D // 2] & 15, q[..., :D // 2] >> 4], -1).reshape(q.shape[:-1] + (D,))
    vals = E2M1_VALUES[codes & 7] * np.where(codes & 8, np.float32(-1), np.float32(1))
    e = q[..., D // 2:].astype(np.int32) - 127
    scale = np.ldexp(np.float32(1), e).astype(np.float32)
    return (vals.reshape(q.shape[:-1] + (D // 32, 32)) * scale[..., None]).reshape(vals.shape)


@pytest.mark.parametrize("shape", [(2, 4, True, 19, 10), (3, 2, False, 9, 1), (2, 1, False, 4, 2)])
@pytest.mark.parametrize("mode", ["float32", "bfloat16", "bf16_inputs"])
@pytest.mark.parametrize("quant", ["fp4", "hadamard_fp4"])
def test_compressor_packed_fp4_is_the_rounded_entries(rng, quant, mode, shape):
    """packed=True rows: D/2 bytes of e2m1 codes (element 2i low nibble) then D/32 ue8m0
    bytes; codes times scales are bitwise the entries of packed=False, prefill and step."""
    B, ratio, overlap, T, T1 = shape
    D = 128
    c = 2 if overlap else 1
    kv, sc, ape = _inputs(rng, B, T, c * D, ratio)
    if mode == "bf16_inputs":
        kv, sc = kv.astype(BF16), sc.astype(BF16)
    kw = _epilogue_kw(rng, D, ratio, T, dtype="bfloat16" if mode == "bfloat16" else "float32")
    kw.update(overlap=overlap, ape=ape if ratio > 1 else None, quant=quant)
    vals = dc.Compressor(B, ratio, D, **kw)
    pk = dc.Compressor(B, ratio, D, packed=True, **kw)
    want = [vals.prefill(kv[:, :T1], sc[:, :T1])]
    got = [pk.prefill(kv[:, :T1], sc[:, :T1])]
    assert got[0].dtype == np.uint8 and got[0].shape == (B, T1 // ratio, D // 2 + D // 32)
    for p in range(T1, T):
        w, g = (m.step(kv[:, p:p + 1], sc[:, p:p + 1], p) for m in (vals, pk))
        assert (w is None) == (g is None)
        if g is not None:
            assert g.dtype == np.uint8 and g.shape == (B, 1, D // 2 + D // 32)
            want.append(w)
            got.append(g)
    want = np.concatenate(want, 1).astype(np.float32)
    got = _unpack_fp4(np.concatenate(got, 1), D)
    assert want.shape[1] > 1
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (quant, mode, shape)
    # the same bytes as quantizing the rounded rows to codes (fp4_quant, csrc/qpack.h)
    q, rows = pk.prefill(kv, sc), vals.prefill(kv, sc)
    codes, scales = _core.fp4_quant(rows, 32)
    assert np.array_equal(q[..., :D // 2], codes) and np.array_equal(q[..., D // 2:], scales)


def test_compressor_packed_out_and_bad_arguments(rng):
    kv, sc, ape = _inputs(rng, 2, 12, 64, 4)
    comp = dc.Compressor(2, 4, 64, ape=ape, quant="fp4", packed=True)
    want = comp.prefill(kv, sc)
    out = np.full((2, 3, 34), 7, np.uint8)
    assert comp.prefill(kv, sc, out=out) is out and np.array_equal(out, want)
    s0 = _state(comp)
    for bad, exc, word in [(np.zeros((2, 3, 34), np.float32), TypeError, "uint8"),
                           (np.zeros((2, 3, 32), np.uint8), ValueError, "shape"),
                           (np.zeros((2, 3, 68), np.uint8)[..., ::2], ValueError, "contiguous")]:
        with unchanged(kv, sc):
            with pytest.raises(exc, match=word):
                comp.prefill(kv, sc, out=bad)
        assert _same_state(s0, _state(comp))
    for kwargs in [{}, {"quant": "fp8"}, {"quant": "fp4_e4m3"}, {"quant": np.round}]:
        with pytest.raises(ValueError, match="'packed'"):
            dc.Compressor(1, 4, 128, packed=True, **kwargs)
    with pytest.raises(TypeError, match="'packed'"):
        dc.Compressor(1, 4, 64, quant="fp4", packed="yes")
    for D, q in [(48, "fp4"), (48, "hadamard_fp4"), (96, "hadamard_fp4"), (24, "fp4_e4m3"),
                 (96, "fp8")]:
        with pytest.raises(ValueError, match="'quant'"):
            dc.Compressor(1, 4, D, quant=q)
    assert "packed=True" in repr(comp)
