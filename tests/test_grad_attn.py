"""Gradients of sparse attention (issue 28; docs/kernels.md, section 11.1).

References written here from the formulas, never calling our kernels: a float64 NumPy
forward / backward of the gather form (duplicates counted per slot, -1 slots skipped,
an all-invalid row giving the constant 0), and torch autograd on a float64 gather
reference for gradcheck-style checks.

Error budget (float32 kernels against the float64 reference): each gradient element is
a float32 sum of up to K*H products (dq: K), exp() is ~2 ulp, so the error is bounded
norm-wise, not per element (sums that cancel have large relative errors).  Measured
worst max|err| / max|ref| over every ISA level and these shapes, the released one
included: 1.3e-6.  Budget: |err| <= 1e-5 * max|ref| + 1e-5 * |ref| per element (~8x
headroom), which a relative 1e-4 error in any gradient (the mutants) exceeds.
"""
import numpy as np
import pytest

import deepseek_csa as dc
from conftest import assert_close, same_bits_at_thread_counts, threads, unchanged  # noqa: F401


# ---------------------------------------------------------------- float64 reference
def ref_forward(q, kv, sink, idx, scale):
    """out [B,S,H,D], lse [B,S,H], weights [B,S,K] in float64."""
    q = q.astype(np.float64)
    kv = kv.astype(np.float64)
    sink = sink.astype(np.float64)
    B, S, H, D = q.shape
    K = idx.shape[2]
    out = np.zeros((B, S, H, D))
    lse = np.zeros((B, S, H))
    w = np.zeros((B, S, K))
    for b in range(B):
        for s in range(S):
            ok = idx[b, s] >= 0
            if not ok.any():
                lse[b, s] = sink
                continue
            g = kv[b, idx[b, s, ok]]                       # [k, D]
            l = scale * q[b, s] @ g.T                      # [H, k]
            m = np.maximum(l.max(1), sink)
            den = np.exp(l - m[:, None]).sum(1) + np.exp(sink - m)
            lse[b, s] = m + np.log(den)
            p = np.exp(l - lse[b, s][:, None])
            out[b, s] = p @ g
            w[b, s, ok] = p.sum(0)
    return out, lse, w


def ref_backward(dout, q, kv, sink, idx, scale):
    """(dq, dkv, dsink) in float64 from the reference forward."""
    dout = dout.astype(np.float64)
    q64, kv64 = q.astype(np.float64), kv.astype(np.float64)
    out, lse, _ = ref_forward(q, kv, sink, idx, scale)
    B, S, H, D = q.shape
    dq = np.zeros_like(q64)
    dkv = np.zeros_like(kv64)
    dsink = np.zeros(H)
    for b in range(B):
        for s in range(S):
            ok = idx[b, s] >= 0
            if not ok.any():
                continue
            ii = idx[b, s, ok]
            g = kv64[b, ii]
            p = np.exp(scale * q64[b, s] @ g.T - lse[b, s][:, None])     # [H, k]
            Dr = (dout[b, s] * out[b, s]).sum(1)                          # [H]
            dl = p * (dout[b, s] @ g.T - Dr[:, None])
            dq[b, s] = scale * dl @ g
            contrib = p.T @ dout[b, s] + scale * dl.T @ q64[b, s]        # [k, D]
            np.add.at(dkv[b], ii, contrib)
            dsink -= np.exp(sink - lse[b, s]) * Dr
    return dq, dkv, dsink


# ---------------------------------------------------------------- inputs
def make(rng, B, S, H, D, N, K, *, minus=0.2, dup=0.1, dead_rows=(), visible=None):
    q = rng.standard_normal((B, S, H, D)).astype(np.float32)
    kv = rng.standard_normal((B, N, D)).astype(np.float32)
    sink = rng.standard_normal(H).astype(np.float32)
    hi = N if visible is None else visible
    idx = rng.integers(0, hi, (B, S, K)).astype(np.int32)
    idx[rng.random((B, S, K)) < minus] = -1
    # adjacent duplicates (the scatter must count each slot)
    d = rng.random((B, S, K)) < dup
    d[..., 0] = False
    idx[d] = np.roll(idx, 1, axis=2)[d]
    for (b, s) in dead_rows:
        idx[b, s] = -1
    dout = rng.standard_normal((B, S, H, D)).astype(np.float32)
    return q, kv, sink, idx, dout


def run_bwd(q, kv, sink, idx, scale, dout):
    out, lse = dc.sparse_attn(q, kv, sink, idx, scale, return_lse=True)
    return dc.sparse_attn_backward(dout, q, kv, sink, idx, scale, out, lse)


def budget(want):
    m = float(np.abs(want).max()) if want.size else 1.0
    return dict(rtol=1e-5, atol=1e-5 * max(m, 1e-3))


SHAPES = [
    # B, S, H, D, N, K
    (1, 5, 3, 7, 11, 6),
    (2, 9, 5, 24, 13, 17),       # K > N: duplicates certain
    (1, 7, 16, 64, 40, 70),      # more than one block of gathered rows
    (2, 4, 20, 33, 30, 9),
]


# ---------------------------------------------------------------- forward additions
@pytest.mark.parametrize("shape", SHAPES)
def test_lse_and_weights(isa, rng, shape):
    B, S, H, D, N, K = shape
    q, kv, sink, idx, _ = make(rng, B, S, H, D, N, K, dead_rows=[(0, 1)])
    scale = D ** -0.5
    out_r, lse_r, w_r = ref_forward(q, kv, sink, idx, scale)
    out, lse = dc.sparse_attn(q, kv, sink, idx, scale, return_lse=True)
    assert lse.dtype == np.float32 and lse.shape == (B, S, H)
    assert_close(out, out_r, rtol=1e-4, atol=1e-5, what="out")
    assert_close(lse, lse_r, rtol=1e-5, atol=1e-5, what="lse")
    np.testing.assert_array_equal(lse[0, 1], sink)        # all-invalid row: lse = sink
    # return_lse does not change out
    np.testing.assert_array_equal(out, dc.sparse_attn(q, kv, sink, idx, scale))
    w = dc.sparse_attn_weights(q, kv, sink, idx, scale)
    assert w.dtype == np.float32 and w.shape == (B, S, K)
    assert_close(w, w_r, rtol=1e-4, atol=1e-5, what="weights")
    assert (w[idx < 0] == 0).all()
    # duplicated index: the same value in each of its slots
    b, s = np.nonzero((idx[..., 1:] == idx[..., :-1]).any(-1) & (idx[..., 1:] >= 0).any(-1))
    for bb, ss in zip(b, s):
        r = idx[bb, ss]
        for k in range(1, K):
            if r[k] >= 0 and r[k] == r[k - 1]:
                assert w[bb, ss, k] == w[bb, ss, k - 1]


def test_lse_bf16(isa_bf16, rng):
    ml = pytest.importorskip("ml_dtypes")
    q, kv, sink, idx, _ = make(rng, 1, 6, 16, 32, 20, 12, dead_rows=[(0, 2)])
    qb, kvb = q.astype(ml.bfloat16), kv.astype(ml.bfloat16)
    _, lse_r, w_r = ref_forward(qb.astype(np.float32), kvb.astype(np.float32), sink, idx, 0.2)
    _, lse = dc.sparse_attn(qb, kvb, sink, idx, 0.2, return_lse=True)
    assert_close(lse, lse_r, rtol=1e-4, atol=1e-4, what="lse bf16")
    w = dc.sparse_attn_weights(qb, kvb, sink, idx, 0.2)
    assert_close(w, w_r, rtol=1e-4, atol=1e-5, what="weights bf16")


# ---------------------------------------------------------------- backward
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_float64(isa, rng, shape):
    B, S, H, D, N, K = shape
    q, kv, sink, idx, dout = make(rng, B, S, H, D, N, K, dead_rows=[(B - 1, S - 1)])
    scale = D ** -0.5
    dq, dkv, dsink = run_bwd(q, kv, sink, idx, scale, dout)
    rq, rkv, rs = ref_backward(dout, q, kv, sink, idx, scale)
    assert dq.dtype == dkv.dtype == dsink.dtype == np.float32
    assert_close(dq, rq, **budget(rq), what="dq")
    assert_close(dkv, rkv, **budget(rkv), what="dkv")
    assert_close(dsink, rs, **budget(rs), what="dsink")
    assert (dq[B - 1, S - 1] == 0).all()                  # all-invalid row
    unused = np.ones((B, N), bool)
    for b in range(B):
        unused[b, idx[b][idx[b] >= 0]] = False
    assert (dkv[unused] == 0).all()


def test_backward_k_beyond_visible(isa, rng):
    # K = 24 slots over only 5 visible rows: many duplicates, rows >= 5 untouched
    q, kv, sink, idx, dout = make(rng, 1, 6, 8, 16, 12, 24, visible=5, minus=0.3, dup=0.0)
    dq, dkv, dsink = run_bwd(q, kv, sink, idx, 0.25, dout)
    rq, rkv, rs = ref_backward(dout, q, kv, sink, idx, 0.25)
    assert_close(dq, rq, **budget(rq), what="dq")
    assert_close(dkv, rkv, **budget(rkv), what="dkv")
    assert_close(dsink, rs, **budget(rs), what="dsink")
    assert (dkv[0, 5:] == 0).all()


def test_all_rows_invalid(isa, rng):
    q, kv, sink, idx, dout = make(rng, 2, 3, 4, 8, 6, 5, minus=1.0)
    out, lse = dc.sparse_attn(q, kv, sink, idx, 1.0, return_lse=True)
    np.testing.assert_array_equal(lse, np.broadcast_to(sink, lse.shape))
    dq, dkv, dsink = dc.sparse_attn_backward(dout, q, kv, sink, idx, 1.0, out, lse)
    assert not dq.any() and not dkv.any() and not dsink.any()
    assert not dc.sparse_attn_weights(q, kv, sink, idx, 1.0).any()


def test_strided_and_out_args(rng):
    q, kv, sink, idx, dout = make(rng, 2, 5, 6, 12, 9, 7)
    qs = np.zeros((2, 5, 6, 20), np.float32)[..., 3:15]
    qs[...] = q
    out, lse = dc.sparse_attn(q, kv, sink, idx, 0.3, return_lse=True)
    want = dc.sparse_attn_backward(dout, q, kv, sink, idx, 0.3, out, lse)
    gq = np.zeros((2, 5, 6, 24), np.float32)[..., ::2]
    gkv = np.full((2, 9, 12), np.nan, np.float32)
    gs = np.full(6, np.nan, np.float32)
    got = dc.sparse_attn_backward(dout, qs, kv, sink, idx, 0.3, out, lse,
                                  grad_q=gq, grad_kv=gkv, grad_sink=gs)
    assert got[0] is gq and got[1] is gkv and got[2] is gs
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_released_shape(rng):
    # the released prefill shape (H=64, D=512, K=640) at a smaller S
    B, S, H, D, N, K = 1, 6, 64, 512, 900, 640
    q, kv, sink, idx, dout = make(rng, B, S, H, D, N, K, minus=0.05, dup=0.01)
    q *= 0.5
    scale = D ** -0.5
    dq, dkv, dsink = run_bwd(q, kv, sink, idx, scale, dout)
    rq, rkv, rs = ref_backward(dout, q, kv, sink, idx, scale)
    assert_close(dq, rq, **budget(rq), what="dq")
    assert_close(dkv, rkv, **budget(rkv), what="dkv")
    assert_close(dsink, rs, **budget(rs), what="dsink")


@pytest.mark.parametrize("level", ["ref", "base", "avx2", "avx512"])
def test_bitwise_threads(rng, level):
    if level not in dc.ISA_LEVELS or dc.ISA_LEVELS.index(level) > dc.ISA_LEVELS.index(dc.best_isa()):
        pytest.skip(f"{level} not on this CPU")
    before = dc.get_isa()
    dc.set_isa(level)
    try:
        q, kv, sink, idx, dout = make(rng, 2, 23, 16, 40, 30, 50)
        out, lse = dc.sparse_attn(q, kv, sink, idx, 0.2, return_lse=True)
        same_bits_at_thread_counts(lambda: dc.sparse_attn(q, kv, sink, idx, 0.2, return_lse=True))
        same_bits_at_thread_counts(lambda: dc.sparse_attn_weights(q, kv, sink, idx, 0.2))
        same_bits_at_thread_counts(
            lambda: dc.sparse_attn_backward(dout, q, kv, sink, idx, 0.2, out, lse))
    finally:
        dc.set_isa(before)


# ---------------------------------------------------------------- bfloat16
# Error budget: none.  bfloat16 inputs are widened exactly where they are read and all
# arithmetic is float32, so the float32 gradients of bfloat16 inputs are bitwise those
# of the float32 call on the widened values, and a bfloat16 gradient is that result
# rounded once (nearest-even), at every ISA level and thread count.
def _bf16_case(rng, B, S, H, D, N, K):
    ml = pytest.importorskip("ml_dtypes")
    q, kv, sink, idx, dout = make(rng, B, S, H, D, N, K)
    bf = ml.bfloat16
    qb, kvb, dob = q.astype(bf), kv.astype(bf), dout.astype(bf)
    out, lse = dc.sparse_attn(qb, kvb, sink, idx, 0.3, return_lse=True)   # out: bfloat16
    return ml, (qb, kvb, sink, idx, dob, out, lse)


@pytest.mark.parametrize("shape", SHAPES + [(1, 3, 64, 512, 700, 640)])
def test_bf16_inputs_are_the_widened_float32_call(isa, rng, shape):
    ml, (qb, kvb, sink, idx, dob, out, lse) = _bf16_case(rng, *shape)
    f = np.float32
    want = dc.sparse_attn_backward(dob.astype(f), qb.astype(f), kvb.astype(f), sink, idx, 0.3,
                                   out.astype(f), lse)
    for do in (dob, dob.astype(f)):     # grad_out's dtype is independent of q's
        got = dc.sparse_attn_backward(do, qb, kvb, sink, idx, 0.3, out, lse)
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            np.testing.assert_array_equal(g, w)
    gq, gkv, gs = dc.sparse_attn_backward(dob, qb, kvb, sink, idx, 0.3, out, lse,
                                          grad_dtype=ml.bfloat16)
    assert gq.dtype == ml.bfloat16 and gkv.dtype == ml.bfloat16 and gs.dtype == np.float32
    np.testing.assert_array_equal(gq.view(np.uint16), want[0].astype(ml.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(gkv.view(np.uint16), want[1].astype(ml.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(gs, want[2])


def test_bf16_out_args_torch_and_threads(rng):
    ml, (qb, kvb, sink, idx, dob, out, lse) = _bf16_case(rng, 2, 19, 16, 40, 30, 50)
    want = dc.sparse_attn_backward(dob, qb, kvb, sink, idx, 0.3, out, lse, grad_dtype="bfloat16")
    big = np.zeros((2, 19, 16, 80), ml.bfloat16)
    gq = big[..., ::2]                                  # a strided result
    gkv = np.zeros((2, 30, 40), ml.bfloat16)
    got = dc.sparse_attn_backward(dob, qb, kvb, sink, idx, 0.3, out, lse, grad_q=gq,
                                  grad_kv=gkv, grad_dtype="bfloat16")
    assert got[0] is gq and got[1] is gkv
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    torch = pytest.importorskip("torch")
    t = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)  # noqa: E731
    got = dc.sparse_attn_backward(t(dob), t(qb), t(kvb), sink, idx, 0.3, t(out), lse,
                                  grad_dtype="bfloat16")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    same_bits_at_thread_counts(
        lambda: dc.sparse_attn_backward(dob, qb, kvb, sink, idx, 0.3, out, lse,
                                        grad_dtype="bfloat16"))


def test_inputs_unchanged(rng):
    q, kv, sink, idx, dout = make(rng, 1, 4, 4, 8, 6, 5)
    out, lse = dc.sparse_attn(q, kv, sink, idx, 0.5, return_lse=True)
    with unchanged(q, kv, sink, idx, dout, out, lse):
        dc.sparse_attn_backward(dout, q, kv, sink, idx, 0.5, out, lse)
        dc.sparse_attn_weights(q, kv, sink, idx, 0.5)


def test_errors(rng):
    q, kv, sink, idx, dout = make(rng, 1, 4, 4, 8, 6, 5)
    out, lse = dc.sparse_attn(q, kv, sink, idx, 0.5, return_lse=True)
    bad = idx.copy()
    bad[0, 2, 3] = 6
    gq = np.full_like(q, 7.0)
    with unchanged(gq), pytest.raises(IndexError, match=r"topk_idxs.*\[0, 2, 3\]"):
        dc.sparse_attn_backward(dout, q, kv, sink, bad, 0.5, out, lse, grad_q=gq)
    with pytest.raises(ValueError, match="lse"):
        dc.sparse_attn_backward(dout, q, kv, sink, idx, 0.5, out, lse[:, :, :2])
    with pytest.raises(TypeError, match="grad_out"):
        dc.sparse_attn_backward(dout.astype(np.float64), q, kv, sink, idx, 0.5, out, lse)
    ml = pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError, match="'kv' must have q's dtype"):
        dc.sparse_attn_backward(dout, q.astype(ml.bfloat16), kv, sink, idx, 0.5, out, lse)
    with pytest.raises(TypeError, match="'out'"):
        dc.sparse_attn_backward(dout, q.astype(ml.bfloat16), kv.astype(ml.bfloat16), sink, idx,
                                0.5, out, lse)
    with pytest.raises(ValueError, match="grad_dtype"):
        dc.sparse_attn_backward(dout, q, kv, sink, idx, 0.5, out, lse, grad_dtype="float16")
    with pytest.raises(TypeError, match="grad_q"):
        dc.sparse_attn_backward(dout, q, kv, sink, idx, 0.5, out, lse, grad_dtype="bfloat16",
                                grad_q=np.zeros_like(q))
    with pytest.raises(ValueError, match="grad_kv"):
        dc.sparse_attn_backward(dout, q, kv, sink, idx, 0.5, out, lse,
                                grad_kv=np.zeros((1, 5, 8), np.float32))


# ---------------------------------------------------------------- torch autograd
def _torch_ref(q, kv, sink, idx, scale):
    """float64 gather reference, written from the formula (differentiable)."""
    import torch
    B, S, H, D = q.shape
    K = idx.shape[-1]
    ok = idx >= 0
    safe = idx.clamp(min=0).long()
    g = torch.gather(kv, 1, safe.reshape(B, S * K, 1).expand(B, S * K, D)).reshape(B, S, K, D)
    l = scale * torch.einsum("bshd,bskd->bshk", q, g)
    l = l.masked_fill(~ok[:, :, None, :], float("-inf"))
    full = torch.cat([l, sink.view(1, 1, H, 1).expand(B, S, H, 1)], -1)
    p = torch.softmax(full, -1)[..., :K]
    out = torch.einsum("bshk,bskd->bshd", p, g)
    dead = ~ok.any(-1)
    return out.masked_fill(dead[:, :, None, None], 0.0)


def test_torch_function_matches_float64_autograd(rng):
    torch = pytest.importorskip("torch")
    import deepseek_csa.torch as dct
    q, kv, sink, idx, dout = make(rng, 2, 7, 5, 12, 9, 11, dead_rows=[(1, 3)])
    tq, tkv, ts = (torch.tensor(a, requires_grad=True) for a in (q, kv, sink))
    ti = torch.from_numpy(idx)
    o = dct.sparse_attn(tq, tkv, ts, ti, 0.3)
    o.backward(torch.from_numpy(dout))
    rq, rkv, rs = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, kv, sink))
    ro = _torch_ref(rq, rkv, rs, ti, 0.3)
    ro.backward(torch.from_numpy(dout).double())
    for got, want, name in ((tq.grad, rq.grad, "q"), (tkv.grad, rkv.grad, "kv"), (ts.grad, rs.grad, "sink")):
        assert_close(got.numpy(), want.numpy(), **budget(want.numpy()), what=name)


def test_gradcheck_style(rng):
    """gradcheck-style: our float32 analytic gradient against central finite differences
    of the float64 reference forward, along random directions (directional derivative;
    finite-difference error ~1e-8, our float32 error ~1e-6 relative)."""
    q, kv, sink, idx, _ = make(rng, 1, 4, 3, 6, 7, 9, dead_rows=[(0, 2)])
    scale = 0.4
    w_out = rng.standard_normal(q.shape)
    dq, dkv, dsink = run_bwd(q, kv, sink, idx, scale, w_out.astype(np.float32))

    def f(q_, kv_, s_):
        return float((ref_forward(q_, kv_, s_, idx, scale)[0] * w_out).sum())

    eps = 1e-5
    for _ in range(3):
        vq, vkv, vs = (rng.standard_normal(a.shape) for a in (q, kv, sink))
        q64, kv64, s64 = q.astype(np.float64), kv.astype(np.float64), sink.astype(np.float64)
        num = (f(q64 + eps * vq, kv64 + eps * vkv, s64 + eps * vs)
               - f(q64 - eps * vq, kv64 - eps * vkv, s64 - eps * vs)) / (2 * eps)
        ana = float((dq * vq).sum() + (dkv * vkv).sum() + (dsink * vs).sum())
        assert abs(num - ana) <= 1e-4 * (1 + abs(num)), (num, ana)


def test_torch_dropin_differentiable(rng):
    torch = pytest.importorskip("torch")
    import deepseek_csa.torch as dct
    q, kv, sink, idx, dout = make(rng, 1, 6, 4, 16, 10, 8, dead_rows=[(0, 0)])
    tq, tkv, ts = (torch.tensor(a, requires_grad=True) for a in (q, kv, sink))
    ti = torch.from_numpy(idx).long()                      # any integer dtype, like the drop-in
    o = dct.sparse_attn(tq, tkv, ts, ti, 0.25)
    assert o.requires_grad
    np.testing.assert_array_equal(o.detach().numpy(), dc.sparse_attn(q, kv, sink, idx, 0.25))
    (o * torch.from_numpy(dout)).sum().backward()
    rq, rkv, rs = ref_backward(dout, q, kv, sink, idx, 0.25)
    assert_close(tq.grad.numpy(), rq, **budget(rq), what="dq")
    assert_close(tkv.grad.numpy(), rkv, **budget(rkv), what="dkv")
    assert_close(ts.grad.numpy(), rs, **budget(rs), what="dsink")
    # without grad: the plain forward (no graph)
    with torch.no_grad():
        assert not dct.sparse_attn(tq, tkv, ts, ti, 0.25).requires_grad


def test_torch_bf16_and_weights(rng):
    torch = pytest.importorskip("torch")
    import deepseek_csa.torch as dct
    q, kv, sink, idx, dout = make(rng, 1, 5, 4, 16, 10, 8)
    tq = torch.tensor(q).bfloat16().requires_grad_()
    tkv = torch.tensor(kv).bfloat16().requires_grad_()
    ts = torch.tensor(sink, requires_grad=True)
    o = dct.sparse_attn(tq, tkv, ts, torch.from_numpy(idx), 0.25)
    assert o.dtype == torch.bfloat16
    o.float().mul(torch.from_numpy(dout)).sum().backward()
    assert tq.grad.dtype == tkv.grad.dtype == torch.bfloat16 and ts.grad.dtype == torch.float32
    qf, kvf = tq.detach().float().numpy(), tkv.detach().float().numpy()
    rq, rkv, rs = ref_backward(dout, qf, kvf, sink, idx, 0.25)
    # bf16 budget: the forward's weights are rounded to bf16 (~4e-3 relative) and the
    # gradients are returned in bf16
    assert_close(tq.grad.float().numpy(), rq, rtol=3e-2, atol=3e-2 * np.abs(rq).max(), what="dq")
    assert_close(tkv.grad.float().numpy(), rkv, rtol=3e-2, atol=3e-2 * np.abs(rkv).max(), what="dkv")
    w = dct.sparse_attn_weights(tq, tkv, ts, torch.from_numpy(idx), 0.25)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert_close(w.numpy(), ref_forward(qf, kvf, sink, idx, 0.25)[2], rtol=1e-4, atol=1e-5,
                 what="weights")


def test_torch_gradcheck(rng):
    torch = pytest.importorskip("torch")
    import deepseek_csa.torch as dct
    q, kv, sink, idx, _ = make(rng, 1, 3, 2, 5, 6, 7, dead_rows=[(0, 1)])
    args = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, kv, sink)]
    ti = torch.from_numpy(idx)
    # the kernels run in float32: finite differences with eps 1e-3 carry ~1e-4 noise
    assert torch.autograd.gradcheck(lambda a, b, c: dct.sparse_attn(a, b, c, ti, 0.5), args,
                                    eps=1e-3, atol=2e-3, rtol=2e-2)


def test_many_chunks(rng):
    # K = 640, D = 512: 24 query rows fill a chunk of G, so 30 rows take two chunks and
    # d(kv) rows listed in both are summed across the chunk boundary
    B, S, H, D, N, K = 2, 15, 3, 512, 700, 640
    q, kv, sink, idx, dout = make(rng, B, S, H, D, N, K, minus=0.05, dup=0.02)
    scale = D ** -0.5
    dq, dkv, dsink = same_bits_at_thread_counts(lambda: run_bwd(q, kv, sink, idx, scale, dout))
    rq, rkv, rs = ref_backward(dout, q, kv, sink, idx, scale)
    assert_close(dq, rq, **budget(rq), what="dq")
    assert_close(dkv, rkv, **budget(rkv), what="dkv")
    assert_close(dsink, rs, **budget(rs), what="dsink")
