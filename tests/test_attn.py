"""sparse_attn against the float32 torch reference (tests/ref_attn.py) and a bf16 run of it."""
import ml_dtypes
import numpy as np
import pytest
import torch

import deepseek_csa as dc
from conftest import assert_close, bf16_round, same_bits_at_thread_counts, unchanged
import ref_attn as ref

T = torch.from_numpy
WINDOW, TOPK, RATIO = 128, 512, 4   # V4-Flash
RTOL, ATOL = 1e-5, 5e-6             # float32 reference


def want(q, kv, sink, idx, scale):
    return ref.sparse_attn(T(np.ascontiguousarray(q)), T(np.ascontiguousarray(kv)),
                           T(np.ascontiguousarray(sink)), T(np.ascontiguousarray(idx)),
                           scale).numpy()


def prefill_indices(B, S, rng, window=WINDOW, topk=TOPK, ratio=RATIO):
    """kernels.md section 5-6 prefill rows: window positions (padded with -1 to min(S, window)) then
    top-k of the visible compressed entries (t < (s+1)//ratio), shifted by S."""
    w = min(S, window)
    idx = np.full((B, S, w + topk), -1, np.int32)
    for b in range(B):
        for s in range(S):
            lo = max(0, s - window + 1)
            idx[b, s, :s - lo + 1] = np.arange(lo, s + 1)
            vis = (s + 1) // ratio
            pick = rng.permutation(vis)[:topk]
            idx[b, s, w:w + len(pick)] = pick + S
    return idx


def decode_indices(B, p, n_comp, rng, window=WINDOW, topk=TOPK):
    """kernels.md section 6 decode row at position p: ring slots from (p+1) % window, then top-k of the
    n_comp compressed entries shifted by the window size."""
    slots = (np.arange(window) + p + 1) % window
    slots[slots > p] = -1
    idx = np.empty((B, 1, window + topk), np.int32)
    for b in range(B):
        idx[b, 0, :window] = slots
        idx[b, 0, window:] = rng.permutation(n_comp)[:topk] + window
    return idx


def inputs(rng, B, S, H, D, N, sink_scale=1.0):
    q = rng.standard_normal((B, S, H, D), dtype=np.float32)
    kv = rng.standard_normal((B, N, D), dtype=np.float32)
    sink = (rng.standard_normal(H) * sink_scale).astype(np.float32)
    return q, kv, sink


# ---------------------------------------------------------------- released shapes

def test_v4_flash_prefill(isa, rng):
    """H=64, D=512, window 128 + top-k 512 (K = 640), causal rows with -1 padding."""
    if isa == "ref":
        pytest.skip("the scalar oracle is too slow for the released shape; small shapes cover it")
    B, S = 1, 160
    q, kv, sink = inputs(rng, B, S, 64, 512, S + S // RATIO)
    idx = prefill_indices(B, S, rng)
    assert idx.shape[-1] == min(S, WINDOW) + TOPK
    scale = 512 ** -0.5
    with unchanged(q, kv, sink, idx):
        got = dc.sparse_attn(q, kv, sink, idx, scale)
    assert got.shape == q.shape and got.dtype == np.float32
    assert_close(got, want(q, kv, sink, idx, scale), rtol=RTOL, atol=ATOL, what="prefill")


def test_v4_flash_prefill_all_valid(isa, rng):
    """Every one of the K = 640 slots valid: ten full online-softmax blocks."""
    if isa == "ref":
        pytest.skip("the scalar oracle is too slow for the released shape; small shapes cover it")
    B, S, N = 1, 12, 2000
    q, kv, sink = inputs(rng, B, S, 64, 512, N)
    idx = rng.integers(0, N, (B, S, 640)).astype(np.int32)
    got = dc.sparse_attn(q, kv, sink, idx, 512 ** -0.5)
    assert_close(got, want(q, kv, sink, idx, 512 ** -0.5), rtol=RTOL, atol=ATOL, what="dense")


@pytest.mark.parametrize("p", [5, 126, 127, 3000])
def test_v4_flash_decode(isa, rng, p):
    """S = 1 at position p: ring of 128 window rows (partly -1 while filling) + 512."""
    if isa == "ref" and p != 5:
        pytest.skip("one decode case at the scalar level is enough")
    B, n_comp = 2, 2048
    q, kv, sink = inputs(rng, B, 1, 64, 512, WINDOW + n_comp)
    idx = decode_indices(B, p, n_comp, rng)
    got = dc.sparse_attn(q, kv, sink, idx, 512 ** -0.5)
    assert_close(got, want(q, kv, sink, idx, 512 ** -0.5), rtol=RTOL, atol=ATOL, what="decode")


# ---------------------------------------------------------------- odd small shapes

@pytest.mark.parametrize("B, S, H, D, N, K", [
    (1, 1, 1, 1, 1, 1),
    (1, 3, 5, 40, 17, 9),
    (2, 4, 3, 7, 5, 11),         # K > N: duplicates
    (3, 2, 20, 33, 50, 70),      # H not a multiple of 16, D not of 16, K > one block
    (1, 9, 17, 64, 300, 130),    # two chunks of heads in decode-sized calls
    (2, 5, 2, 16, 4, 0),         # K = 0
    (2, 0, 4, 8, 3, 5),          # S = 0
    (1, 2, 3, 0, 4, 2),          # D = 0
    (1, 2, 3, 8, 0, 2),          # N = 0 (every index must be -1)
    (2, 33, 4, 24, 40, 65),      # more queries than the few-queries threshold
])
def test_small_shapes(isa, rng, B, S, H, D, N, K):
    q, kv, sink = inputs(rng, B, S, H, D, N)
    idx = rng.integers(-1, max(N, 1), (B, S, K)).astype(np.int32) if N else \
        np.full((B, S, K), -1, np.int32)
    if S and K:
        idx[0, 0, :] = -1                            # one row with nothing valid
    scale = 0.3
    with unchanged(q, kv, sink, idx):
        got = dc.sparse_attn(q, kv, sink, idx, scale)
    assert_close(got, want(q, kv, sink, idx, scale), rtol=RTOL, atol=ATOL, what="small")
    if S and K and D:
        assert np.all(got[0, 0] == 0), "a row with no valid index must give zeros"


@pytest.mark.parametrize("shape", [(0, 2, 3, 8), (1, 2, 0, 8)])
def test_empty_batch_or_heads(shape):
    B, S, H, D = shape
    out = dc.sparse_attn(np.zeros(shape, np.float32), np.zeros((B, 4, D), np.float32),
                         np.zeros(H, np.float32), np.zeros((B, S, 3), np.int32), 0.5)
    assert out.shape == shape


def test_random_shapes_property(isa):
    """Many random small problems (sizes around the tile edges) against the reference."""
    rng = np.random.default_rng(7)
    for _ in range(25 if isa != "ref" else 8):
        B, S = rng.integers(1, 3), rng.integers(1, 12)
        H, D = rng.integers(1, 40), rng.integers(1, 70)
        N, K = rng.integers(1, 90), rng.integers(0, 140)
        q, kv, sink = inputs(rng, B, S, H, D, N, sink_scale=3.0)
        idx = rng.integers(-1, N, (B, S, K)).astype(np.int32)
        scale = float(rng.uniform(0.01, 1.0))
        assert_close(dc.sparse_attn(q, kv, sink, idx, scale), want(q, kv, sink, idx, scale),
                     rtol=RTOL, atol=ATOL, what=f"B={B} S={S} H={H} D={D} N={N} K={K}")


def test_empty_rows_give_zeros_not_nan(isa, rng):
    q, kv, sink = inputs(rng, 2, 3, 4, 16, 10)
    idx = np.full((2, 3, 6), -1, np.int32)
    idx[1, 2, 3] = 7
    out = np.full(q.shape, np.nan, np.float32)
    dc.sparse_attn(q, kv, sink, idx, 0.25, out=out)
    assert np.all(out[0] == 0) and np.all(out[1, :2] == 0)
    assert_close(out, want(q, kv, sink, idx, 0.25), rtol=RTOL, atol=ATOL, what="one valid")


def test_duplicates_count_once_per_occurrence(isa, rng):
    """[3, 3, 5] weighs row 3 twice, like the reference gather (and unlike [3, 5])."""
    q, kv, sink = inputs(rng, 1, 1, 4, 32, 8)
    a = dc.sparse_attn(q, kv, sink, np.array([[[3, 3, 5]]], np.int32), 0.2)
    b = dc.sparse_attn(q, kv, sink, np.array([[[3, 5, -1]]], np.int32), 0.2)
    assert_close(a, want(q, kv, sink, np.array([[[3, 3, 5]]], np.int32), 0.2), rtol=RTOL,
                 atol=ATOL)
    assert not np.allclose(a, b)


def test_order_within_a_row_does_not_matter(rng):
    q, kv, sink = inputs(rng, 1, 2, 64, 512, 700)
    idx = rng.integers(-1, 700, (1, 2, 640)).astype(np.int32)
    perm = idx[:, :, rng.permutation(640)]
    assert_close(dc.sparse_attn(q, kv, sink, perm, 0.05), dc.sparse_attn(q, kv, sink, idx, 0.05),
                 rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- numerics

def test_sink_only_in_denominator(isa, rng):
    """Sink -inf: plain softmax attention.  A huge sink: outputs shrink towards 0
    (no overflow, no NaN), exactly as the formula says."""
    q, kv, _ = inputs(rng, 1, 3, 4, 16, 12)
    idx = rng.integers(0, 12, (1, 3, 8)).astype(np.int32)
    lo = dc.sparse_attn(q, kv, np.full(4, -np.inf, np.float32), idx, 0.25)
    g = T(kv)[0][T(idx).long()[0]]                                    # [S, K, D]
    p = torch.einsum("shd,skd->shk", T(q)[0], g).mul(0.25).softmax(-1)
    assert_close(lo[0], torch.einsum("shk,skd->shd", p, g).numpy(), rtol=RTOL, atol=ATOL)
    for s in (30.0, 1e4, 1e30):
        sink = np.full(4, s, np.float32)
        hi = dc.sparse_attn(q, kv, sink, idx, 0.25)
        assert np.isfinite(hi).all()
        assert_close(hi, want(q, kv, sink, idx, 0.25), rtol=RTOL, atol=1e-12, what=f"sink {s}")
        assert np.abs(hi).max() < 1e-6


def test_large_logits_do_not_overflow(isa, rng):
    """Logits in the thousands, rising block after block (rescaling of the partial sums)."""
    q, kv, sink = inputs(rng, 1, 2, 16, 32, 300)
    kv *= np.linspace(1, 60, 300, dtype=np.float32)[None, :, None]
    idx = np.tile(np.arange(300, dtype=np.int32), (1, 2, 1))
    got = dc.sparse_attn(q, kv, sink, idx, 1.0)
    assert np.isfinite(got).all()
    assert_close(got, want(q, kv, sink, idx, 1.0), rtol=1e-4, atol=1e-4, what="large logits")


def test_nan_propagates_like_reference(isa, rng):
    q, kv, sink = inputs(rng, 1, 3, 4, 16, 10)
    idx = np.array([[[0, 1, 2], [3, 4, -1], [5, 6, 7]]], np.int32)
    q[0, 0, 2, 5] = np.nan          # one head of query 0
    kv[0, 6, 1] = np.nan            # a row query 2 reads
    kv[0, 9, 0] = np.nan            # a row nobody reads
    got = dc.sparse_attn(q, kv, sink, idx, 0.25)
    assert_close(got, want(q, kv, sink, idx, 0.25), rtol=RTOL, atol=ATOL, what="nan")
    assert np.isnan(got[0, 0, 2]).all() and np.isfinite(got[0, 0, [0, 1, 3]]).all()
    assert np.isnan(got[0, 2]).all() and np.isfinite(got[0, 1]).all()


def test_nan_sink_poisons_its_head_only(isa, rng):
    q, kv, sink = inputs(rng, 1, 2, 4, 16, 10)
    sink[3] = np.nan
    idx = np.array([[[0, 1, 2], [-1, -1, -1]]], np.int32)
    got = dc.sparse_attn(q, kv, sink, idx, 0.25)
    assert_close(got, want(q, kv, sink, idx, 0.25), rtol=RTOL, atol=ATOL, what="nan sink")
    assert np.isnan(got[0, 0, 3]).all() and np.isfinite(got[0, 0, :3]).all()
    assert np.all(got[0, 1] == 0)


def test_bf16_reference(rng):
    """The same inputs through the reference in bfloat16: agreement at bf16 tolerance."""
    B, S, N = 1, 64, 64 + 16
    q, kv, sink = (bf16_round(a) for a in inputs(rng, B, S, 64, 512, N))
    idx = prefill_indices(B, S, rng)
    scale = 512 ** -0.5
    got = dc.sparse_attn(q, kv, sink, idx, scale)
    w16 = ref.sparse_attn(T(q).bfloat16(), T(kv).bfloat16(), T(sink), T(idx), scale).float()
    assert_close(got, w16.numpy(), rtol=2e-2, atol=2e-2, what="bf16")
    # and the float32 path is the more accurate of the two
    w32 = want(q, kv, sink, idx, scale)
    assert np.abs(got - w32).max() < np.abs(w16.numpy() - w32).max()


# ---------------------------------------------------------------- native bfloat16

BF16 = ml_dtypes.bfloat16


def bf16_cases(rng):
    """(name, q, kv, sink, idx) in float32 holding bf16 values: released shapes (a short
    prefill, a decode step) and odd ones (H, D, K not multiples of 16/32, -1 rows)."""
    out = []
    q, kv, sink = inputs(rng, 1, 40, 64, 512, 40 + 10)
    out.append(("prefill", q, kv, sink, prefill_indices(1, 40, rng)))
    q, kv, sink = inputs(rng, 1, 1, 64, 512, WINDOW + 700)
    out.append(("decode", q, kv, sink, decode_indices(1, 900, 700, rng)))
    q, kv, sink = inputs(rng, 2, 5, 3, 40, 17)
    idx = rng.integers(-1, 17, (2, 5, 9)).astype(np.int32)
    idx[1, 2] = -1
    out.append(("odd", q, kv, sink, idx))
    q, kv, sink = inputs(rng, 1, 3, 37, 33, 300)
    out.append(("odd-long", q, kv, sink, rng.integers(-1, 300, (1, 3, 290)).astype(np.int32)))
    return [(n, bf16_round(q), bf16_round(kv), s, i) for n, q, kv, s, i in out]


@pytest.mark.parametrize("case", range(4))
def test_bf16_native_matches_references(isa_bf16, rng, case):
    """bf16 q/kv in, bf16 out: against the float32 reference on the same (bf16) values
    the error is bf16 rounding (the weights and the output), and it must not exceed
    the error of the reference's own bf16 run; against the scalar oracle's bf16 path,
    a few bf16 ulps (only the float32 summation order differs)."""
    name, q, kv, sink, idx = bf16_cases(rng)[case]
    if isa_bf16 == "ref" and name in ("prefill",):
        pytest.skip("the scalar oracle is slow on the released prefill; the others cover it")
    scale = q.shape[-1] ** -0.5
    qb, kvb = q.astype(BF16), kv.astype(BF16)
    with unchanged(qb, kvb, sink, idx):
        got = dc.sparse_attn(qb, kvb, sink, idx, scale)
    assert got.dtype == BF16 and got.shape == q.shape
    got = got.astype(np.float32)
    w32 = want(q, kv, sink, idx, scale)
    w16 = ref.sparse_attn(T(q).bfloat16(), T(kv).bfloat16(), T(sink), T(idx), scale).float().numpy()
    amax = np.abs(w32).max()
    assert_close(got, w32, rtol=2 ** -7, atol=2 ** -8 * amax, what=f"{name} vs float32")
    assert np.abs(got - w32).max() <= max(np.abs(w16 - w32).max(), 2 ** -8 * amax)
    dc.set_isa("ref")
    oracle = dc.sparse_attn(qb, kvb, sink, idx, scale).astype(np.float32)
    assert_close(got, oracle, rtol=2 ** -6, atol=2 ** -9 * amax, what=f"{name} vs oracle")


def test_bf16_zero_rows_nan_and_sink(isa_bf16, rng):
    """All -1 rows give exact zeros, NaN in one kv row poisons exactly the queries that
    pick it, a huge sink gives (near) zeros, not NaN."""
    q, kv, sink = (bf16_round(a) for a in inputs(rng, 1, 4, 32, 64, 40))
    kv[0, 7, 3] = np.nan
    idx = rng.integers(0, 40, (1, 4, 64)).astype(np.int32)
    idx[0, 0] = -1
    idx[0, 1][idx[0, 1] == 7] = 8
    idx[0, 2, 5] = 7
    idx[0, 3][idx[0, 3] == 7] = 8
    sink[1] = 1e30
    got = dc.sparse_attn(q.astype(BF16), kv.astype(BF16), sink, idx, 0.125).astype(np.float32)
    assert np.all(got[0, 0] == 0)
    assert np.isnan(got[0, 2]).all()
    assert np.isfinite(got[0, 1]).all() and np.isfinite(got[0, 3]).all()
    assert np.abs(got[0, 1, 1]).max() < 1e-30 and np.abs(got[0, 3, 1]).max() < 1e-30


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_bf16_bitwise_identical_at_any_thread_count(isa_bf16, rng, shape):
    if isa_bf16 == "ref":
        pytest.skip("the oracle is single-threaded")
    if shape == "prefill":
        q, kv, sink = inputs(rng, 1, 24, 64, 512, 60)
        idx = prefill_indices(1, 24, rng, window=16, topk=300)
    else:
        q, kv, sink = inputs(rng, 1, 1, 64, 512, 900)
        idx = decode_indices(1, 500, 900 - WINDOW, rng)
    qb, kvb = q.astype(BF16), kv.astype(BF16)
    same_bits_at_thread_counts(lambda: dc.sparse_attn(qb, kvb, sink, idx, 0.07))


def test_bf16_torch_views_out_and_dtype_rules(rng):
    """torch bf16 tensors go in without copies (a strided view too), out= takes bf16,
    and mixed or wrong dtypes are refused with the argument named."""
    q, kv, sink = inputs(rng, 1, 3, 16, 64, 20)
    idx = rng.integers(-1, 20, (1, 3, 10)).astype(np.int32)
    qt = T(q).bfloat16()
    big = T(np.concatenate([kv, kv], axis=-1)).bfloat16()
    kvt = big[..., :64]                                     # a strided view
    got = dc.sparse_attn(qt, kvt, T(sink), T(idx), 0.125)
    want16 = dc.sparse_attn(qt.float().numpy().astype(BF16),
                            np.ascontiguousarray(kvt.float().numpy()).astype(BF16), sink, idx, 0.125)
    assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), want16.view(np.uint16))
    out = torch.zeros(1, 3, 16, 64, dtype=torch.bfloat16)
    r = dc.sparse_attn(qt, kvt, T(sink), T(idx), 0.125, out=out)
    assert r is out and np.array_equal(out.view(torch.int16).numpy().view(np.uint16),
                                       want16.view(np.uint16))
    with pytest.raises(TypeError, match="'kv' must have q's dtype"):
        dc.sparse_attn(qt, T(kv), T(sink), T(idx), 0.125)
    with pytest.raises(TypeError, match="'kv' must have q's dtype"):
        dc.sparse_attn(q, kvt, sink, idx, 0.125)
    with pytest.raises((TypeError, ValueError), match="out"):
        dc.sparse_attn(qt, kvt, T(sink), T(idx), 0.125, out=np.zeros(q.shape, np.float32))


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("shape", ["prefill", "decode", "small"])
def test_bitwise_identical_at_any_thread_count(rng, shape):
    if shape == "prefill":
        q, kv, sink = inputs(rng, 1, 48, 64, 512, 60)
        idx = prefill_indices(1, 48, rng, window=16, topk=12)
    elif shape == "decode":
        q, kv, sink = inputs(rng, 1, 1, 64, 512, 900)
        idx = decode_indices(1, 500, 900 - WINDOW, rng)
    else:
        q, kv, sink = inputs(rng, 2, 3, 21, 40, 30)
        idx = rng.integers(-1, 30, (2, 3, 77)).astype(np.int32)
    same_bits_at_thread_counts(lambda: dc.sparse_attn(q, kv, sink, idx, 0.07))


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_a_query_gives_the_same_bits_alone_or_in_a_batch(rng, dtype):
    """Heads are split into work items differently for one query (decode) and many
    (prefill); no head's arithmetic depends on that split."""
    q, kv, sink = inputs(rng, 1, 16, 64, 512, 700)
    q, kv = q.astype(dtype), kv.astype(dtype)
    idx = rng.integers(-1, 700, (1, 16, 640)).astype(np.int32)
    bits = np.uint32 if dtype == np.float32 else np.uint16
    many = dc.sparse_attn(q, kv, sink, idx, 0.05)
    for s in (0, 7, 15):
        one = dc.sparse_attn(q[:, s:s + 1], kv, sink, idx[:, s:s + 1], 0.05)
        assert np.array_equal(one.view(bits), many[:, s:s + 1].view(bits))


# ---------------------------------------------------------------- layouts

def test_strided_inputs_and_out(isa, rng):
    B, S, H, D, N, K = 2, 5, 6, 40, 30, 50
    qb = rng.standard_normal((B, H, S, 2 * D), dtype=np.float32)
    q = qb.transpose(0, 2, 1, 3)[..., ::2]                # no unit stride anywhere
    kvb = rng.standard_normal((B, D, N), dtype=np.float32)
    kv = kvb.transpose(0, 2, 1)[:, :, ::-1]               # reversed feature axis
    sink = rng.standard_normal(2 * H, dtype=np.float32)[::2]
    ib = rng.integers(-1, N, (B, K, S)).astype(np.int32)
    idx = ib.transpose(0, 2, 1)
    w = want(q, kv, sink, idx, 0.2)
    snaps = [a.copy() for a in (q, kv, sink, idx)]  # (conftest.unchanged needs unit strides)
    assert_close(dc.sparse_attn(q, kv, sink, idx, 0.2), w, rtol=RTOL, atol=ATOL)
    for a, c in zip((q, kv, sink, idx), snaps):
        assert np.array_equal(a, c)
    ob = np.full((B, S, H, 2 * D), 9.0, np.float32)
    out = ob[..., 1::2]
    r = dc.sparse_attn(q, kv, sink, idx, 0.2, out=out)
    assert r is out
    assert_close(out, w, rtol=RTOL, atol=ATOL, what="strided out")
    assert np.all(ob[..., ::2] == 9.0), "out= wrote outside its view"


@pytest.mark.parametrize("D", [512, 40])
def test_same_bits_at_any_row_alignment(isa, rng, D):
    """Rows are read in place at whatever offset within a cache line they start (or
    copied when their stride is not a multiple of 64 bytes); no result depends on it."""
    N, H = 50, 16
    q = rng.standard_normal((1, 3, H, D), dtype=np.float32)
    sink = rng.standard_normal(H, dtype=np.float32)
    idx = rng.integers(-1, N, (1, 3, 70)).astype(np.int32)
    src = rng.standard_normal((1, N, D), dtype=np.float32)
    buf = np.zeros(N * (D + 16) + 32, np.float32)
    a0 = (-buf.ctypes.data % 64) // 4
    outs = []
    for off in range(16):
        kv = buf[a0 + off:a0 + off + N * D].reshape(1, N, D)
        kv[:] = src
        outs.append(dc.sparse_attn(q, kv, sink, idx, 0.1))
    wide = buf[a0:a0 + N * (D + 1)].reshape(1, N, D + 1)   # stride not a multiple of 16
    wide[..., :D] = src
    outs.append(dc.sparse_attn(q, wide[..., :D], sink, idx, 0.1))
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))
    assert_close(outs[0], want(q, src, sink, idx, 0.1), rtol=RTOL, atol=ATOL)


def test_torch_tensors_and_keywords(rng):
    q, kv, sink = inputs(rng, 1, 4, 8, 32, 20)
    idx = rng.integers(-1, 20, (1, 4, 10)).astype(np.int32)
    tq, tkv, ts, ti = T(q), T(kv), T(sink), T(idx)
    out = torch.empty(1, 4, 8, 32)
    r = dc.sparse_attn(q=tq, kv=tkv, attn_sink=ts, topk_idxs=ti, softmax_scale=0.1, out=out)
    assert r is out
    assert_close(out.numpy(), want(q, kv, sink, idx, 0.1), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- bad inputs

def _ok(rng):
    q, kv, sink = inputs(rng, 2, 3, 4, 8, 10)
    idx = rng.integers(-1, 10, (2, 3, 5)).astype(np.int32)
    return q, kv, sink, idx


@pytest.mark.parametrize("bad, value, pos", [(10, 10, "[1, 2, 4]"), (-2, -2, "[1, 2, 4]"),
                                             (2**31 - 1, 2**31 - 1, "[1, 2, 4]")])
def test_out_of_range_index_raises_before_writing(rng, bad, value, pos):
    q, kv, sink, idx = _ok(rng)
    idx[1, 2, 4] = bad
    out = np.full(q.shape, 5.0, np.float32)
    with unchanged(q, kv, sink, idx, out):
        with pytest.raises(IndexError) as e:
            dc.sparse_attn(q, kv, sink, idx, 0.1, out=out)
    msg = str(e.value)
    for word in ("'topk_idxs'", str(value), pos, "N = 10"):
        assert word in msg, (word, msg)


@pytest.mark.parametrize("dtype", [np.int64, np.int16, np.uint32, np.float32])
def test_wrong_index_dtype(rng, dtype):
    q, kv, sink, idx = _ok(rng)
    with pytest.raises(TypeError, match="'topk_idxs' must be an int32"):
        dc.sparse_attn(q, kv, sink, idx.astype(dtype), 0.1)
    with pytest.raises(TypeError, match="int32"):
        dc.sparse_attn(q, kv, sink, T(idx.astype(np.int64)), 0.1)


@pytest.mark.parametrize("which, make, exc, words", [
    ("kv", lambda a: a[..., :7], ValueError, ["'kv'", "shape[2] == 8", "head dim"]),
    ("kv", lambda a: a[:1], ValueError, ["'kv'", "shape[0] == 2"]),
    ("sink", lambda a: np.ones(5, np.float32), ValueError, ["'attn_sink'", "shape[0] == 4"]),
    ("sink", lambda a: np.ones((1, 4), np.float32), ValueError, ["'attn_sink'", "dimensions"]),
    ("idx", lambda a: a[:, :2], ValueError, ["'topk_idxs'", "shape[1] == 3"]),
    ("idx", lambda a: a[0], ValueError, ["'topk_idxs'", "dimensions"]),
    ("q", lambda a: a[0], ValueError, ["'q'", "dimensions"]),
    ("q", lambda a: a.astype(np.float64), TypeError, ["'q'", "float32", "float64"]),
    ("kv", lambda a: a.astype(np.float16), TypeError, ["'kv'", "float16"]),
    ("sink", lambda a: None, TypeError, ["'attn_sink'"]),
    ("q", lambda a: "hello", TypeError, ["'q'"]),
])
def test_bad_arrays(rng, which, make, exc, words):
    q, kv, sink, idx = _ok(rng)
    args = {"q": q, "kv": kv, "sink": sink, "idx": idx}
    args[which] = make(args[which])
    arrays = [a for a in args.values() if isinstance(a, np.ndarray)]
    with unchanged(*arrays):
        with pytest.raises(exc) as e:
            dc.sparse_attn(args["q"], args["kv"], args["sink"], args["idx"], 0.1)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("scale, exc", [(float("nan"), ValueError), (float("inf"), ValueError),
                                        (1e39, ValueError), ("0.1", TypeError),
                                        (None, TypeError)])
def test_bad_scale(rng, scale, exc):
    q, kv, sink, idx = _ok(rng)
    with pytest.raises(exc, match="softmax_scale"):
        dc.sparse_attn(q, kv, sink, idx, scale)


def test_bad_out(rng):
    q, kv, sink, idx = _ok(rng)
    with pytest.raises(ValueError, match=r"'out' must have shape \[2, 3, 4, 8\]"):
        dc.sparse_attn(q, kv, sink, idx, 0.1, out=np.zeros((2, 3, 4, 9), np.float32))
    with pytest.raises(TypeError, match="'out'"):
        dc.sparse_attn(q, kv, sink, idx, 0.1, out=np.zeros(q.shape))
    ro = np.zeros(q.shape, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        dc.sparse_attn(q, kv, sink, idx, 0.1, out=ro)
    with unchanged(q), pytest.raises(ValueError, match="overlaps"):
        dc.sparse_attn(q, kv, sink, idx, 0.1, out=q)
