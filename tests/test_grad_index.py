"""Gradients of the indexer scores and the indexer's KL objective (docs/kernels.md,
section 11.3; issue 28; SPEC section 10).

References: written here from the formulas, in float64 torch with autograd (never
calling deepseek_csa).  Error budget: float32 inputs exact in float64; our float32 sums
run over Di (the dots), n slots (dq, dw) and n * Hi (dk) terms of mixed sign, so each
result's error stays below a few float32 ulps times sqrt(terms) of the largest term;
we allow ``TOL = 3e-5`` of the largest reference magnitude of each array (max-norm,
elementwise errors relative to max|ref|) -- a relative 1e-4 mistake is caught.  The
loss (double row sums over float32 scores) is held to 1e-5 relative.
"""
import numpy as np
import pytest

import deepseek_csa as dc
from conftest import same_bits_at_thread_counts, unchanged

torch = pytest.importorskip("torch")

TOL = 3e-5


# ---------------------------------------------------------------- float64 references

def _t(x):
    return torch.tensor(np.asarray(x, np.float64), dtype=torch.float64, requires_grad=True)


def ref_scores(q, k, w, ratio, start_pos):
    """I [B, S, Tc] and the visibility mask: I = sum_h w relu(q . k)."""
    a = torch.einsum("bshd,btd->bsht", q, k)
    I = (torch.relu(a) * w[..., None]).sum(2)
    S, Tc = q.shape[1], k.shape[1]
    nv = (start_pos + torch.arange(S) + 1) // ratio
    mask = torch.arange(Tc)[None, :] < nv[:, None]
    return I, mask


def ref_kl(q, k, w, idx, target, ratio, start_pos):
    """Mean over rows with slots and nonzero target mass of KL(p || softmax(I_slots))."""
    I, mask = ref_scores(q, k, w, ratio, start_pos)
    B, S = I.shape[:2]
    tgt = torch.tensor(np.asarray(target, np.float64))
    total, rows = 0.0, 0
    for b in range(B):
        for s in range(S):
            if idx is None:
                sl = torch.nonzero(mask[s]).flatten()
                y = tgt[b, s, sl]
            else:
                keep = [j for j in range(idx.shape[2]) if idx[b, s, j] >= 0]
                sl = torch.tensor([int(idx[b, s, j]) for j in keep], dtype=torch.long)
                y = tgt[b, s, keep] if keep else tgt[b, s, :0]
            if len(sl) == 0 or float(y.sum()) == 0.0:
                continue
            p = y / y.sum()
            ls = torch.log_softmax(I[b, s, sl], 0)
            nz = p > 0
            total = total + (p[nz] * (torch.log(p[nz]) - ls[nz])).sum()
            rows += 1
    return total / rows if rows else torch.zeros((), dtype=torch.float64)


def ref_grads(loss, *ts):
    gs = torch.autograd.grad(loss, ts, allow_unused=True)
    return [np.zeros(t.shape) if g is None else g.numpy() for g, t in zip(gs, ts)]


def close(got, want, what, tol=TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(np.abs(want).max(initial=0.0), 1e-30)
    err = np.abs(got - want).max(initial=0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} * {scale:.3g}"


# ---------------------------------------------------------------- inputs

def make(rng, B, S, Hi, Di, ratio, sp, more=0, zero_heads=False):
    Tc = (sp + S) // ratio + more
    q = rng.standard_normal((B, S, Hi, Di)).astype(np.float32)
    k = rng.standard_normal((B, Tc, Di)).astype(np.float32)
    w = rng.standard_normal((B, S, Hi)).astype(np.float32)
    if zero_heads:           # exact zero dots: relu'(0) = 0, as torch
        q[:, ::2, 0] = 0.0
    return q, k, w, Tc


def make_idx(rng, B, S, K, ratio, sp, *, dup=True, one=True):
    """Valid slots: distinct visible entries, a duplicate, a row with one entry, -1."""
    idx = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            nv = (sp + s + 1) // ratio
            m = min(nv, K - 1)
            if one and s % 5 == 1:
                m = min(m, 1)
            if m > 0:
                idx[b, s, :m] = rng.choice(nv, m, replace=False)
                rng.shuffle(idx[b, s])
                if dup and s % 3 == 0:
                    j = int(np.flatnonzero(idx[b, s] >= 0)[0])
                    fill = np.flatnonzero(idx[b, s] < 0)
                    if len(fill):
                        idx[b, s, fill[0]] = idx[b, s, j]
    return idx


SCORE_SHAPES = [
    # B, S, Hi, Di, ratio, start_pos, more
    (1, 7, 3, 5, 1, 0, 0),
    (2, 13, 5, 19, 2, 3, 1),
    (1, 70, 17, 33, 4, 5, 2),       # several dk chunks, odd heads / features
    (2, 9, 4, 16, 128, 300, 1),     # ratio 128 with start_pos > 0
    (1, 40, 1, 1, 4, 0, 0),
]


@pytest.mark.parametrize("shape", SCORE_SHAPES)
def test_scores_backward_matches_reference(isa, rng, shape):
    B, S, Hi, Di, ratio, sp, more = shape
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, more, zero_heads=True)
    g = rng.standard_normal((B, S, Tc)).astype(np.float32)
    g[:, :, -1] = np.nan        # invisible for the first rows: never read there
    nv = (sp + np.arange(S) + 1) // ratio
    g[:, nv >= Tc, -1] = 1.0    # rows that see the last entry read a finite G
    with unchanged(g, q, k, w):
        gq, gk, gw = dc.index_scores_backward(g, q, k, w, ratio=ratio, start_pos=sp)
    qt, kt, wt = _t(q), _t(k), _t(w)
    I, mask = ref_scores(qt, kt, wt, ratio, sp)
    G = torch.tensor(np.where(mask.numpy()[None], g, 0.0))
    want = ref_grads((I * G).sum(), qt, kt, wt)
    for got, ref, what in zip((gq, gk, gw), want, ("grad_q", "grad_k", "grad_weights")):
        assert got.dtype == np.float32
        close(got, ref, what)


def test_scores_backward_out_buffers(rng):
    q, k, w, Tc = make(rng, 2, 11, 3, 8, 2, 1)
    g = rng.standard_normal((2, 11, Tc)).astype(np.float32)
    want = dc.index_scores_backward(g, q, k, w, ratio=2, start_pos=1)
    bufs = (np.full(q.shape, 7, np.float32), np.full((2, Tc, 24), 7, np.float32)[:, :, ::3],
            np.full(w.shape, 7, np.float32))
    got = dc.index_scores_backward(g, q, k, w, ratio=2, start_pos=1, grad_q=bufs[0],
                                   grad_k=bufs[1], grad_weights=bufs[2])
    for a, b, c in zip(got, bufs, want):
        assert a is b
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------- KL objective

KL_SHAPES = [
    # B, S, Hi, Di, ratio, start_pos, K
    (1, 9, 3, 7, 1, 0, 4),
    (2, 17, 5, 19, 2, 3, 6),
    (2, 75, 6, 21, 4, 2, 9),       # several chunks, K > visible for early rows
    (1, 6, 4, 16, 128, 700, 3),    # ratio 128, start_pos > 0
]


def kl_target(rng, shape, zero_rows=True):
    t = rng.random(shape).astype(np.float32)
    t[t < 0.15] = 0.0              # zero targets inside a row: 0 log 0 = 0
    if zero_rows:
        t[:, 2] = 0.0              # a row whose target sums to 0 takes no part
    return t


@pytest.mark.parametrize("shape", KL_SHAPES)
def test_kl_sparse_matches_reference(isa, rng, shape):
    B, S, Hi, Di, ratio, sp, K = shape
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 1, zero_heads=True)
    idx = make_idx(rng, B, S, K, ratio, sp)
    tgt = kl_target(rng, (B, S, K))
    with unchanged(q, k, w, idx, tgt):
        loss, gq, gk, gw = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, start_pos=sp,
                                              return_grads=True)
    qt, kt, wt = _t(q), _t(k), _t(w)
    L = ref_kl(qt, kt, wt, idx, tgt, ratio, sp)
    assert isinstance(loss, float)
    assert abs(loss - L.item()) <= 1e-5 * abs(L.item()) + 1e-7
    for got, ref, what in zip((gq, gk, gw), ref_grads(L, qt, kt, wt), ("q", "k", "w")):
        close(got, ref, "grad_" + what)
    # the loss alone: the same bits as with the gradients
    assert dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, start_pos=sp) == loss


@pytest.mark.parametrize("ratio,sp", [(4, 0), (4, 6), (128, 250), (1, 0)])
def test_kl_dense_warmup_matches_reference(isa, rng, ratio, sp):
    B, S, Hi, Di = 2, 37, 5, 12
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 2)
    tgt = kl_target(rng, (B, S, Tc), zero_rows=False)
    tgt[0, 3] = 0.0
    tgt[:, :, -1] = -1.0 if Tc > (sp + S) // ratio else tgt[:, :, -1]  # invisible: not read
    loss, gq, gk, gw = dc.indexer_kl_loss(q, k, w, None, tgt, ratio=ratio, start_pos=sp,
                                          return_grads=True)
    qt, kt, wt = _t(q), _t(k), _t(w)
    L = ref_kl(qt, kt, wt, None, tgt, ratio, sp)
    assert abs(loss - L.item()) <= 1e-5 * abs(L.item()) + 1e-7
    for got, ref, what in zip((gq, gk, gw), ref_grads(L, qt, kt, wt), ("q", "k", "w")):
        close(got, ref, "grad_" + what)


def test_kl_one_valid_entry_is_zero(isa, rng):
    """A row with one slot: p = softmax = 1, loss 0 and zero gradients."""
    q, k, w, Tc = make(rng, 1, 8, 3, 5, 1, 0)
    idx = np.full((1, 8, 3), -1, np.int32)
    idx[0, :, 1] = np.arange(8) // 2
    tgt = rng.random((1, 8, 3)).astype(np.float32) + 0.1
    loss, gq, gk, gw = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=1, return_grads=True)
    assert loss == 0.0
    assert not gq.any() and not gk.any() and not gw.any()


def test_kl_no_rows_take_part(isa, rng):
    q, k, w, Tc = make(rng, 2, 5, 2, 4, 1, 0)
    idx = np.full((2, 5, 3), -1, np.int32)
    tgt = np.ones((2, 5, 3), np.float32)
    loss, gq, gk, gw = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=1, return_grads=True)
    assert loss == 0.0 and not gq.any() and not gk.any() and not gw.any()
    idx[:, :, 0] = 0
    tgt[:] = 0.0                # slots, but no target mass anywhere
    assert dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=1) == 0.0


def test_kl_released_shape(rng):
    """Hi = 64, Di = 128 (the released indexer), ratio 4, float32 vs the float64 reference."""
    B, S, Hi, Di, ratio, K = 1, 96, 64, 128, 4, 16
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, 0)
    q *= 0.1
    idx = make_idx(rng, B, S, K, ratio, 0)
    tgt = kl_target(rng, (B, S, K))
    loss, gq, gk, gw = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, return_grads=True)
    qt, kt, wt = _t(q), _t(k), _t(w)
    L = ref_kl(qt, kt, wt, idx, tgt, ratio, 0)
    assert abs(loss - L.item()) <= 1e-5 * abs(L.item())
    for got, ref, what in zip((gq, gk, gw), ref_grads(L, qt, kt, wt), ("q", "k", "w")):
        close(got, ref, "grad_" + what)


# ---------------------------------------------------------------- determinism

def test_bits_independent_of_threads(isa, rng):
    B, S, Hi, Di, ratio, sp, K = 2, 150, 7, 20, 2, 3, 12
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 1)
    idx = make_idx(rng, B, S, K, ratio, sp)
    tgt = kl_target(rng, (B, S, K))
    g = rng.standard_normal((B, S, Tc)).astype(np.float32)
    same_bits_at_thread_counts(
        lambda: dc.index_scores_backward(g, q, k, w, ratio=ratio, start_pos=sp))
    same_bits_at_thread_counts(
        lambda: [np.float64(x) for x in dc.indexer_kl_loss(
            q, k, w, idx, tgt, ratio=ratio, start_pos=sp, return_grads=True)])
    dense = kl_target(rng, (B, S, Tc), zero_rows=False)
    same_bits_at_thread_counts(
        lambda: [np.float64(x) for x in dc.indexer_kl_loss(
            q, k, w, None, dense, ratio=ratio, start_pos=sp, return_grads=True)])


# ---------------------------------------------------------------- errors

def test_bad_inputs_raise_clearly(rng):
    q, k, w, Tc = make(rng, 1, 8, 2, 4, 2, 0)
    idx = np.zeros((1, 8, 2), np.int32)
    idx[0, :2] = -1             # rows 0-1 see nothing
    tgt = np.ones((1, 8, 2), np.float32)
    bad = idx.copy()
    bad[0, 5, 1] = 3            # row 5 sees 3 entries: 0 .. 2
    with unchanged(q, k, w, bad, tgt), pytest.raises(IndexError, match=r"topk_idxs'\[0, 5, 1\]"):
        dc.indexer_kl_loss(q, k, w, bad, tgt, ratio=2)
    neg = tgt.copy()
    neg[0, 4, 0] = -0.5
    with pytest.raises(ValueError, match="attn_target"):
        dc.indexer_kl_loss(q, k, w, idx, neg, ratio=2)
    with pytest.raises(ValueError, match="attn_target"):
        dc.indexer_kl_loss(q, k, w, None, tgt, ratio=2)
    with pytest.raises(TypeError, match="topk_idxs"):
        dc.indexer_kl_loss(q, k, w, idx.astype(np.int64), tgt, ratio=2)
    with pytest.raises(TypeError, match="'q'"):
        dc.indexer_kl_loss(q.astype(np.float64), k, w, idx, tgt, ratio=2)
    with pytest.raises(ValueError, match="grad_scores"):
        dc.index_scores_backward(np.zeros((1, 8, Tc + 1), np.float32), q, k, w, ratio=2)
    with pytest.raises(ValueError, match="grad_k"):
        dc.index_scores_backward(np.zeros((1, 8, Tc), np.float32), q, k, w, ratio=2,
                                 grad_k=np.zeros((1, Tc, 5), np.float32))


# ---------------------------------------------------------------- torch autograd

def test_torch_index_scores_autograd(rng):
    import deepseek_csa.torch as dct
    B, S, Hi, Di, ratio, sp = 2, 21, 5, 9, 2, 3
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 1)
    g = rng.standard_normal((B, S, Tc)).astype(np.float32)
    qt, kt, wt = (torch.tensor(x, requires_grad=True) for x in (q, k, w))
    sc = dct.index_scores(qt, kt, wt, ratio=ratio, start_pos=sp)
    assert sc.requires_grad and sc.dtype == torch.float32
    np.testing.assert_array_equal(sc.detach().numpy(),
                                  dc.index_scores(q, k, w, ratio=ratio, start_pos=sp))
    gt = torch.tensor(g)
    # the -inf entries: a finite gradient there must not reach q, k, w
    (torch.where(torch.isfinite(sc), sc, torch.zeros_like(sc)) * gt).sum().backward()
    q64, k64, w64 = _t(q), _t(k), _t(w)
    I, mask = ref_scores(q64, k64, w64, ratio, sp)
    want = ref_grads((I * torch.tensor(g, dtype=torch.float64) * mask).sum(), q64, k64, w64)
    for t, ref, what in zip((qt, kt, wt), want, "qkw"):
        close(t.grad.numpy(), ref, "torch grad " + what)
    with torch.no_grad():
        assert not dct.index_scores(qt, kt, wt, ratio=ratio, start_pos=sp).requires_grad


@pytest.mark.parametrize("dense", [False, True])
def test_torch_indexer_kl_loss_autograd(rng, dense):
    import deepseek_csa.torch as dct
    B, S, Hi, Di, ratio, sp, K = 2, 19, 4, 10, 2, 1, 5
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 1)
    idx = None if dense else make_idx(rng, B, S, K, ratio, sp)
    tgt = kl_target(rng, (B, S, Tc if dense else K))
    qt, kt = torch.tensor(q, requires_grad=True), torch.tensor(k, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.bfloat16, requires_grad=True)   # grads in its dtype
    tidx = None if dense else torch.tensor(idx.astype(np.int64))
    loss = dct.indexer_kl_loss(qt, kt, wt, tidx, torch.tensor(tgt), ratio=ratio, start_pos=sp)
    assert loss.shape == () and loss.requires_grad
    (2.0 * loss).backward()
    wb = wt.detach().float().numpy()
    q64, k64, w64 = _t(q), _t(k), _t(wb)
    L = ref_kl(q64, k64, w64, idx, tgt, ratio, sp)
    assert abs(loss.item() - L.item()) <= 1e-5 * abs(L.item()) + 1e-6
    want = ref_grads(2.0 * L, q64, k64, w64)
    close(qt.grad.numpy(), want[0], "grad q")
    close(kt.grad.numpy(), want[1], "grad k")
    assert wt.grad.dtype == torch.bfloat16
    close(wt.grad.float().numpy(), want[2], "grad w", tol=1e-2)
    with torch.no_grad():
        l2 = dct.indexer_kl_loss(qt, kt, wt, tidx, torch.tensor(tgt), ratio=ratio, start_pos=sp)
    assert l2.item() == loss.item() and not l2.requires_grad


def test_torch_import_stays_lazy():
    """``import deepseek_csa`` (the NumPy layer, gradients included) never imports torch;
    ``deepseek_csa.torch`` does, and registers the operators."""
    import subprocess
    import sys
    code = ("import sys, deepseek_csa as m; m.indexer_kl_loss; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=__import__("os").path.dirname(__import__("os").path.dirname(
                             __file__)))
    assert out.stdout.strip() == "False", out.stderr


def test_torch_gradcheck(rng):
    """torch.autograd.gradcheck on small odd shapes, with tolerances for float32 kernels:
    central differences with eps = 1e-2 of float32 results (relative error ~1e-7) leave
    ~1e-5 of noise; the inputs keep every |q . k| well away from the relu kink so no
    difference step crosses it."""
    import deepseek_csa.torch as dct
    B, S, Hi, Di, ratio, sp, K = 1, 5, 2, 3, 2, 1, 3
    for _ in range(1000):             # every |q . k| >= 0.15: a step of 1e-2 cannot cross 0
        q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 0)
        if np.abs(np.einsum("bshd,btd->bsht", q, k)).min() >= 0.15:
            break
    idx = make_idx(rng, B, S, K, ratio, sp, dup=True, one=False)
    tgt = kl_target(rng, (B, S, K), zero_rows=False)
    q64, k64, w64 = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, w))

    def scores(q_, k_, w_):
        sc = dct.index_scores(q_, k_, w_, ratio=ratio, start_pos=sp)
        return torch.where(torch.isfinite(sc), sc, torch.zeros_like(sc)).double()

    def kl(q_, k_, w_):
        return dct.indexer_kl_loss(q_, k_, w_, torch.tensor(idx), torch.tensor(tgt),
                                   ratio=ratio, start_pos=sp).double()

    for fn in (scores, kl):
        assert torch.autograd.gradcheck(fn, (q64, k64, w64), eps=1e-2, atol=2e-3, rtol=2e-3,
                                         nondet_tol=0.0)


# ---------------------------------------------------------------- objective variants
# target='joint', clip, positions, metrics, degenerate rows (docs/kernels.md, section
# 11.3, "Variants").  The reference restates each formula in float64 (never our code).
# Error budget: the loss is a double sum over float32 scores (relative error ~1e-7 of
# each score), held to 1e-6 relative; gradients as above (TOL, max-norm).

VTOL = 1e-6


def ref_kl_variant(q, k, w, idx, target, ratio, start_pos=0, positions=None,
                   mode="selected", clip=None):
    """(loss, kl_uniform, rows, degenerate rows) in float64: per row with slots and
    Z != 0, p = y / Z, L = log_softmax(I) (clamped below at clip), rho = 1 or Z,
    loss_row = rho sum p (log p - L), kl_uniform_row = rho (log n + sum p log p)."""
    a = torch.einsum("bshd,btd->bsht", q, k)
    I = (torch.relu(a) * w[..., None]).sum(2)
    B, S, Tc = I.shape
    tgt = torch.tensor(np.asarray(target, np.float64))
    total, klu, rows, degen = 0.0, 0.0, 0, 0
    for b in range(B):
        for s in range(S):
            P = int(positions[b if positions.shape[0] > 1 else 0, s]) if positions is not None \
                else start_pos + s
            nv = min(max((P + 1) // ratio, 0), Tc)
            if idx is None:
                sl = list(range(nv))
                y = tgt[b, s, :nv]
            else:
                keep = [j for j in range(idx.shape[2]) if idx[b, s, j] >= 0]
                sl = [int(idx[b, s, j]) for j in keep]
                y = tgt[b, s, keep]
            if not sl or float(y.sum()) == 0.0:
                continue
            Z = float(y.sum())
            p = y / Z
            ls = torch.log_softmax(I[b, s, torch.tensor(sl, dtype=torch.long)], 0)
            L = ls if clip is None else torch.clamp(ls, min=clip)
            rho = Z if mode == "joint" else 1.0
            nz = p > 0
            total = total + rho * (p[nz] * (torch.log(p[nz]) - L[nz])).sum()
            klu += rho * (np.log(len(sl)) + float((p[nz] * torch.log(p[nz])).sum()))
            rows += 1
            degen += idx is None or set(sl) == set(range(nv))
    if not rows:
        return torch.zeros((), dtype=torch.float64), 0.0, 0, 0
    return total / rows, klu / rows, rows, degen


def joint_target(rng, shape):
    """Joint probabilities: each row's slots hold a random share (<= 1) of the mass."""
    t = kl_target(rng, shape)
    share = rng.uniform(0.05, 0.95, shape[:2] + (1,))
    return (t / np.maximum(t.sum(-1, keepdims=True), 1e-30) * share).astype(np.float32)


def check_variant(got, ref_loss, qt, kt, wt, what):
    loss, gq, gk, gw = got[:4]
    L = ref_loss.item()
    assert abs(loss - L) <= VTOL * abs(L) + 1e-9, f"{what}: loss {loss} vs {L}"
    for g, r, n in zip((gq, gk, gw), ref_grads(ref_loss, qt, kt, wt), "qkw"):
        close(g, r, f"{what} grad_{n}")


@pytest.mark.parametrize("mode", ["selected", "joint"])
@pytest.mark.parametrize("clip", [None, -100.0, -2.5])
@pytest.mark.parametrize("dense", [False, True])
def test_kl_variants_match_reference(isa, rng, mode, clip, dense):
    """Every (target, clip, stage) against its float64 reference, the metrics too.
    Scores are spread wide (weights x 4) so clip=-2.5 cuts slots that carry target mass."""
    B, S, Hi, Di, ratio, sp, K = 2, 41, 5, 13, 2, 3, 7
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 1, zero_heads=True)
    w *= 4.0
    idx = None if dense else make_idx(rng, B, S, K, ratio, sp)
    shape = (B, S, Tc if dense else K)
    tgt = joint_target(rng, shape) if mode == "joint" else kl_target(rng, shape)
    with unchanged(q, k, w, tgt):
        got = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, start_pos=sp, target=mode,
                                 clip=clip, return_grads=True, return_metrics=True)
    qt, kt, wt = _t(q), _t(k), _t(w)
    L, klu, rows, degen = ref_kl_variant(qt, kt, wt, idx, tgt, ratio, sp, mode=mode, clip=clip)
    check_variant(got, L, qt, kt, wt, f"{mode} clip={clip}")
    m = got[4]
    assert m.kl == got[0] and m.rows == rows and m.degenerate_rows == degen
    assert abs(m.kl_uniform - klu) <= VTOL * abs(klu)
    assert abs(m.kl_captured - (1 - L.item() / klu)) <= 1e-5
    if clip == -2.5:                 # the clip does bite: the loss moved
        unclipped = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, start_pos=sp,
                                       target=mode)
        assert got[0] < unclipped
    # the loss alone, with or without metrics: the same bits
    assert dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, start_pos=sp, target=mode,
                              clip=clip) == got[0]


def test_kl_clip_gradient_is_zero_where_clipped(rng):
    """One row, two slots, the second far below the clip: its log term is the constant
    clip, so G = softmax * U - p * u with U = p_0: d(loss)/dI_1 = q_1 p_0 (not q_1 - p_1,
    nor -p_1 as an unclamped log would give).  Checked through grad_weights of a
    one-head, one-feature problem where I_j = w relu(q k_j)."""
    q = np.ones((1, 1, 1, 1), np.float32)
    k = np.array([[[1.0], [0.01]]], np.float32)
    w = np.array([[[30.0]]], np.float32)
    idx = np.array([[[0, 1]]], np.int32)
    tgt = np.array([[[0.5, 0.5]]], np.float32)
    with pytest.warns(RuntimeWarning, match="dense warm-up"):     # one row, both entries
        loss, gq, gk, gw = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=1, start_pos=1,
                                              clip=-5.0, return_grads=True)
    I = np.array([30.0, 0.3])
    l = I - np.log(np.exp(I - I.max()).sum()) - I.max()
    assert l[1] < -5.0 <= l[0]
    qs = np.exp(l)
    G = qs * 0.5 - np.array([0.5, 0.0])          # U = p_0 = 0.5, u = (1, 0)
    assert abs(loss - (0.5 * (np.log(0.5) - l[0]) + 0.5 * (np.log(0.5) + 5.0))) < 1e-6
    np.testing.assert_allclose(gw[0, 0, 0], G @ np.array([1.0, 0.01]), rtol=1e-5, atol=1e-9)


def test_kl_clip_inactive_and_selected_default_same_bits(rng):
    """clip=-100 where nothing reaches it, and target='selected' spelled out, give the
    default call's bits (the default is unchanged)."""
    q, k, w, Tc = make(rng, 2, 30, 4, 9, 2, 1, 1)
    idx = make_idx(rng, 2, 30, 6, 2, 1)
    tgt = kl_target(rng, (2, 30, 6))
    base = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, start_pos=1, return_grads=True)
    for kw in (dict(clip=-100.0), dict(target="selected"), dict(target="selected", clip=-1e9)):
        got = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, start_pos=1, return_grads=True,
                                 **kw)
        assert got[0] == base[0]
        for a, b in zip(got[1:], base[1:]):
            assert a.tobytes() == b.tobytes()


def test_kl_joint_is_mass_weighted_selected(rng):
    """target='joint' is, row by row, the selected loss times the row's mass: with one
    row per call the two differ by exactly that factor (loss and gradients)."""
    q, k, w, Tc = make(rng, 1, 1, 3, 8, 1, 9)
    idx = np.array([[[0, 4, 7, -1, 2]]], np.int32)
    tgt = np.array([[[0.1, 0.2, 0.05, 0.9, 0.15]]], np.float32)   # -1 slot: not read
    sel = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=1, start_pos=9, return_grads=True)
    jnt = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=1, start_pos=9, target="joint",
                             return_grads=True)
    Z = 0.1 + 0.2 + 0.05 + 0.15
    assert abs(jnt[0] - Z * sel[0]) <= 1e-6 * abs(jnt[0])
    for a, b in zip(jnt[1:], sel[1:]):
        np.testing.assert_allclose(a, Z * b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dense", [False, True])
def test_kl_positions_match_reference(isa, rng, dense):
    """Per-query positions (a left-padded batch: pad queries at position 1, real ones
    from 0; another row from 5, one that skips): visibility (P + 1) // ratio clamped to
    Tc, as the reference; metrics' degenerate rows follow it."""
    B, S, Hi, Di, ratio, K = 3, 23, 4, 11, 2, 5
    Tc = 9
    q = rng.standard_normal((B, S, Hi, Di)).astype(np.float32)
    k = rng.standard_normal((B, Tc, Di)).astype(np.float32)
    w = rng.standard_normal((B, S, Hi)).astype(np.float32)
    pos = np.empty((B, S), np.int32)
    pos[0] = np.where(np.arange(S) < 6, 1, np.arange(S) - 6)       # left padding
    pos[1] = 5 + np.arange(S)                                      # sees up to Tc (clamped)
    pos[2] = np.arange(S) * 2 - 3                                  # skips, starts negative
    idx = None
    if not dense:
        idx = np.full((B, S, K), -1, np.int32)
        for b in range(B):
            for s in range(S):
                nv = min(max((int(pos[b, s]) + 1) // ratio, 0), Tc)
                m = min(nv, K)
                if m:
                    idx[b, s, :m] = rng.choice(nv, m, replace=False)
    tgt = kl_target(rng, (B, S, Tc if dense else K), zero_rows=False)
    with unchanged(q, k, w, pos, tgt):
        got = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, positions=pos,
                                 return_grads=True, return_metrics=True)
    qt, kt, wt = _t(q), _t(k), _t(w)
    L, klu, rows, degen = ref_kl_variant(qt, kt, wt, idx, tgt, ratio, positions=pos)
    check_variant(got, L, qt, kt, wt, "positions")
    assert got[4].rows == rows and got[4].degenerate_rows == degen
    assert 0 < degen < rows or dense
    # positions = start_pos + s: the start_pos call's bits (a broadcast row too)
    sp = 4
    ar = (sp + np.arange(S, dtype=np.int32))[None]
    q2, k2, w2, _ = make(rng, 2, S, Hi, Di, ratio, sp)
    idx2 = None if dense else make_idx(rng, 2, S, K, ratio, sp)
    t2 = kl_target(rng, (2, S, k2.shape[1] if dense else K))
    a = dc.indexer_kl_loss(q2, k2, w2, idx2, t2, ratio=ratio, start_pos=sp, return_grads=True)
    b = dc.indexer_kl_loss(q2, k2, w2, idx2, t2, ratio=ratio, positions=np.broadcast_to(
        ar, (2, S)), return_grads=True)
    c = dc.indexer_kl_loss(q2, k2, w2, idx2, t2, ratio=ratio,
                           positions=np.repeat(ar, 2, 0), return_grads=True)
    for r in (b, c):
        assert r[0] == a[0] and all(x.tobytes() == y.tobytes() for x, y in zip(r[1:], a[1:]))


def test_kl_degenerate_rows_warn(rng):
    """Every row's slots = every entry it can see (top-k >= visible): the sparse loss is
    the dense one; it says so (RuntimeWarning) and the metrics count the rows.  Some
    rows degenerate, or the dense warm-up itself: no warning."""
    import warnings
    B, S, Hi, Di, ratio = 1, 12, 3, 8, 4
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, 0)
    idx = np.full((B, S, 4), -1, np.int32)
    for s in range(S):
        nv = (s + 1) // ratio
        idx[0, s, :nv] = rng.permutation(nv)
    tgt = rng.random((B, S, 4)).astype(np.float32) + 0.1
    with pytest.warns(RuntimeWarning, match="dense warm-up"):
        loss, m = dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, return_metrics=True)
    assert m.rows == m.degenerate_rows == S - 3         # rows 0-2 see nothing
    dense = rng.random((B, S, Tc)).astype(np.float32) + 0.1
    idx2 = idx.copy()
    idx2[0, -1, 1] = -1                                  # the last row misses one entry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, m2 = dc.indexer_kl_loss(q, k, w, idx2, tgt, ratio=ratio, return_metrics=True)
        _, m3 = dc.indexer_kl_loss(q, k, w, None, dense, ratio=ratio, return_metrics=True)
    assert m2.rows == S - 3 and m2.degenerate_rows == S - 4
    assert m3.degenerate_rows == m3.rows == S - 3


def test_kl_variant_bits_independent_of_threads(isa, rng):
    B, S, Hi, Di, ratio, sp, K = 2, 150, 7, 20, 2, 3, 12
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 1)
    w *= 4.0
    idx = make_idx(rng, B, S, K, ratio, sp)
    tgt = joint_target(rng, (B, S, K))
    pos = (sp + np.arange(S, dtype=np.int32))[None].repeat(B, 0)
    pos[1, :7] = 1                       # pad queries (left padding): see entry 0 only
    idx[1, :7] = -1
    idx[1, :7, 0] = 0
    for kw in (dict(target="joint", clip=-2.0, start_pos=sp), dict(positions=pos, clip=-1.0)):
        same_bits_at_thread_counts(
            lambda: [np.float64(x) if np.isscalar(x) else (np.array(tuple(x)) if
                     not isinstance(x, np.ndarray) else x) for x in dc.indexer_kl_loss(
                q, k, w, idx, tgt, ratio=ratio, return_grads=True, return_metrics=True,
                **kw)])


def test_kl_variant_bad_inputs(rng):
    q, k, w, Tc = make(rng, 1, 8, 2, 4, 2, 0)
    idx = np.zeros((1, 8, 2), np.int32)
    idx[0, :2] = -1
    tgt = np.full((1, 8, 2), 0.25, np.float32)
    with pytest.raises(ValueError, match="'target' must be 'selected' or 'joint'"):
        dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, target="dense")
    with pytest.raises(ValueError, match="'clip'"):
        dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, clip=0.5)
    with pytest.raises(ValueError, match="'clip'"):
        dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, clip=float("nan"))
    with pytest.raises(TypeError, match="clip"):
        dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, clip="low")
    heads = tgt * 4                                     # a sum over 4 heads, undivided
    with unchanged(q, k, w, idx, heads), pytest.raises(ValueError, match=r"joint.*\[0, 2\]"):
        dc.indexer_kl_loss(q, k, w, idx, heads, ratio=2, target="joint")
    pos = np.arange(8, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="start_pos must be 0"):
        dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, start_pos=1, positions=pos)
    with pytest.raises(ValueError, match="'positions' must have shape"):
        dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, positions=pos[:, :5])
    with pytest.raises(TypeError, match="positions"):
        dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=2, positions=pos.astype(np.int64))
    bad = pos.copy()
    bad[0, 5] = 2                                       # row 5 now sees entry 0 only
    idx5 = idx.copy()
    idx5[0, 5] = [0, 1]
    with pytest.raises(IndexError, match=r"positions\[b, s\]"):
        dc.indexer_kl_loss(q, k, w, idx5, tgt, ratio=2, positions=bad)


@pytest.mark.parametrize("mode,clip", [("joint", None), ("selected", -2.0), ("joint", -2.0)])
def test_torch_kl_variants_autograd(rng, mode, clip):
    import deepseek_csa.torch as dct
    B, S, Hi, Di, ratio, sp, K = 2, 19, 4, 10, 2, 1, 5
    q, k, w, Tc = make(rng, B, S, Hi, Di, ratio, sp, 1)
    w *= 4.0
    idx = make_idx(rng, B, S, K, ratio, sp)
    tgt = joint_target(rng, (B, S, K))
    pos = torch.tensor(sp + np.arange(S))[None]                  # int64, as position ids
    qt, kt, wt = (torch.tensor(x, requires_grad=True) for x in (q, k, w))
    loss, m = dct.indexer_kl_loss(qt, kt, wt, torch.tensor(idx), torch.tensor(tgt),
                                  ratio=ratio, positions=pos, target=mode, clip=clip,
                                  return_metrics=True)
    assert loss.requires_grad and not m.kl.requires_grad and m.kl.float().item() == loss.item()
    (3.0 * loss).backward()
    q64, k64, w64 = _t(q), _t(k), _t(w)
    L, klu, rows, degen = ref_kl_variant(q64, k64, w64, idx, tgt, ratio, sp, mode=mode,
                                         clip=clip)
    assert abs(loss.item() - L.item()) <= VTOL * abs(L.item()) + 1e-7   # float32 result
    assert int(m.rows) == rows and int(m.degenerate_rows) == degen
    for t, r, n in zip((qt, kt, wt), ref_grads(3.0 * L, q64, k64, w64), "qkw"):
        close(t.grad.numpy(), r, "torch grad " + n)
