"""Indexer scoring, top-k selection, candidate blocks and index lists against the
float32 reference (tests/ref_index.py)."""
import numpy as np
import pytest
import torch

import deepseek_csa as dc
from conftest import assert_close, bf16_round, same_bits_at_thread_counts, threads, unchanged
import ref_index as ref

T = torch.from_numpy


def _inputs(rng, B, S, Hi, Di, Tc, scale=1.0):
    q = rng.standard_normal((B, S, Hi, Di), dtype=np.float32) * scale
    k = rng.standard_normal((B, Tc, Di), dtype=np.float32)
    w = rng.standard_normal((B, S, Hi), dtype=np.float32) * (Di ** -0.5 * Hi ** -0.5)
    return q, k, w


def _score_bound(q, k, w):
    """Rounding budget of a score: a few float32 ulps of sum_h |q.k| |w| (no cancellation
    credit), so near-zero sums of large terms are judged fairly."""
    a = torch.einsum("bshd,btd->bsht", T(np.abs(q)), T(np.abs(k)))
    return (a * T(np.abs(w))[..., None]).sum(2).numpy()


def _check_scores(got, q, k, w, ratio, start_pos, factor=2e-5):
    want = ref.index_scores(T(q), T(k), T(w), ratio, start_pos).numpy()
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg="-inf mask")
    fin = np.isfinite(want)
    bound = factor * _score_bound(q, k, w) + 1e-30
    err = np.abs(got[fin] - want[fin])
    assert (err <= bound[fin]).all(), f"worst err/bound {(err / bound[fin]).max():.3g}"
    return want


def _check_topk(got, ref_scores, topk, ratio, start_pos, offset, order, candidates=None,
                block_size=None, rtol=1e-5, atol_frac=1e-5):
    """Our selection against the reference's: per row the same -1 pattern and set, or,
    where scores (nearly) tie at the k-th place, the same multiset of reference scores."""
    ref_scores = np.asarray(ref_scores)
    B, S, Tc = ref_scores.shape
    K = min(topk, (start_pos + S) // ratio)
    assert got.shape == (B, S, K) and got.dtype == np.int32
    want = ref.topk_indices(T(ref_scores), topk, ratio, start_pos, offset, order, candidates,
                            block_size).numpy()
    e = ref.eligible(B, S, Tc, ratio, start_pos, candidates, block_size).numpy()
    for b in range(B):
        for s in range(S):
            g, wv = got[b, s], want[b, s]
            n = min(K, int(e[b, s].sum()))
            assert (g[n:] == -1).all() and (g[:n] >= offset).all(), (b, s, g)
            t = g[:n] - offset
            assert len(set(t.tolist())) == n and e[b, s, t].all(), (b, s, "ineligible/dup")
            if order == "position":
                assert (np.diff(t) > 0).all(), (b, s, "not ascending")
            if set(t.tolist()) != set((wv[:n] - offset).tolist()):
                mine = np.sort(ref_scores[b, s, t])
                theirs = np.sort(ref_scores[b, s, wv[:n] - offset])
                scale = np.abs(ref_scores[b, s, e[b, s]]).max()
                assert_close(mine, theirs, rtol=rtol, atol=atol_frac * scale,
                             what=f"row {(b, s)} selected scores")


# ---------------------------------------------------------------- scores

SHAPES = [  # B, S, Hi, Di, Tc, ratio, start_pos
    (1, 64, 64, 128, 16, 4, 0),        # V4-Flash indexer, prefill
    (1, 1, 64, 128, 2048, 4, 8191),    # V4-Flash decode
    (2, 37, 5, 19, 20, 2, 0),          # odd everything, batch 2, V4.1 ratio 2
    (3, 9, 17, 33, 40, 3, 7),          # chunk starting mid-group
    (1, 3, 2, 8, 0, 4, 0),             # S < r: nothing visible, Tc = 0
    (2, 5, 16, 16, 9, 1, 3),           # ratio 1, Tc longer than needed
    (1, 0, 4, 8, 3, 4, 0),             # S = 0
    (1, 1, 1, 1, 1, 1, 0),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_index_scores_matches_reference(isa, rng, shape):
    B, S, Hi, Di, Tc, r, p = shape
    q, k, w = _inputs(rng, B, S, Hi, Di, Tc)
    with unchanged(q, k, w):
        got = dc.index_scores(q, k, w, ratio=r, start_pos=p)
    _check_scores(got, q, k, w, r, p)


def test_index_scores_v4_flash_prefill_chunk(rng):
    """Released indexer shape, a 256-query chunk at start_pos 3840 over Tc = 1024."""
    q, k, w = _inputs(rng, 1, 256, 64, 128, 1024)
    got = dc.index_scores(q, k, w, ratio=4, start_pos=3840)
    _check_scores(got, q, k, w, 4, 3840)


def test_index_scores_strided_views_and_out(rng):
    qb, kb, wb = _inputs(rng, 2, 12, 6, 40, 30)
    q, k, w = qb[:, ::2, ::-1, ::2], kb[:, 3:, ::2], wb[:, ::2, ::-1]
    want = ref.index_scores(*(T(np.ascontiguousarray(a)) for a in (q, k, w)), 2, 0).numpy()
    got = dc.index_scores(q, k, w, ratio=2)
    assert_close(got, want, rtol=2e-5, atol=2e-5)
    out = np.zeros((2, 6, 54), np.float32)[:, :, ::2]
    assert dc.index_scores(q, k, w, ratio=2, out=out) is out
    assert_close(out, want, rtol=2e-5, atol=2e-5)


def test_index_scores_torch_tensors(rng):
    q, k, w = _inputs(rng, 1, 8, 4, 16, 4)
    got = dc.index_scores(T(q), T(k), T(w), ratio=2)
    _check_scores(got, q, k, w, 2, 0)


def test_index_scores_bf16_tolerance(rng):
    """The reference run in bfloat16 on the same (bf16-representable) inputs."""
    q, k, w = (bf16_round(a) for a in _inputs(rng, 1, 32, 64, 128, 1024))
    got = dc.index_scores(q, k, w, ratio=4, start_pos=4064)
    want = ref.index_scores(T(q).bfloat16(), T(k).bfloat16(), T(w).bfloat16(), 4, 4064)
    want = want.float().numpy()
    scale = np.abs(want[np.isfinite(want)]).max()
    assert_close(got, want, rtol=3e-2, atol=3e-2 * scale, what="bf16 scores")
    # top-k overlap with the bfloat16 path (kernels.md section 8: >= 99%)
    mine = dc.index_topk(q, k, w, 512, ratio=4, start_pos=4064)
    theirs = ref.topk_indices(T(want), 512, 4, 4064).numpy()
    overlap = np.mean([len(set(a) & set(b)) / len(a) for a, b in
                       zip(mine.reshape(-1, 512), theirs.reshape(-1, 512))])
    assert overlap >= 0.99, overlap


def test_index_scores_nan_inf_like_reference(rng):
    q, k, w = _inputs(rng, 1, 8, 4, 16, 8)
    q[0, 3, 1, 5] = np.nan        # row 3: NaN everywhere it sees
    k[0, 2, 7] = np.inf           # key 2: +-inf dots -> relu -> inf or 0 ... or NaN via w
    w[0, 5, 0] = 0.0              # 0 * inf = NaN in row 5 if head 0 sees +inf
    got = dc.index_scores(q, k, w, ratio=1)
    want = ref.index_scores(T(q), T(k), T(w), 1, 0).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    assert_close(got[fin], want[fin], rtol=2e-5, atol=1e-5)


# ---------------------------------------------------------------- fused top-k

TOPK_CASES = [  # B, S, Hi, Di, Tc, ratio, start_pos, topk
    (1, 512, 64, 128, 128, 4, 0, 64),        # V4-Flash heads, prefill with real selection
    (1, 1, 64, 128, 16384, 4, 65535, 512),   # V4-Flash decode at 64K context
    (1, 256, 64, 128, 1024, 4, 3840, 512),   # V4-Flash topk over 1024 entries
    (2, 37, 5, 19, 20, 2, 0, 6),
    (3, 9, 17, 33, 40, 3, 7, 4),
    (2, 7, 3, 8, 10, 1, 0, 100),             # topk larger than what is visible
    (1, 3, 2, 8, 0, 4, 0, 5),                # Tc = 0 -> width 0
    (1, 6, 1, 4, 6, 1, 0, 3),                # Hi = 1: many exact-zero ties
]


@pytest.mark.parametrize("case", TOPK_CASES)
@pytest.mark.parametrize("order", ["score", "position"])
def test_index_topk_matches_reference(isa, rng, case, order):
    B, S, Hi, Di, Tc, r, p, topk = case
    if isa == "ref" and S * Tc * Hi * Di > 2e7:
        pytest.skip("the scalar oracle is slow on the released shapes; small shapes cover it")
    q, k, w = _inputs(rng, B, S, Hi, Di, Tc)
    offset = 128 if p else S
    with unchanged(q, k, w):
        got = dc.index_topk(q, k, w, topk, ratio=r, start_pos=p, offset=offset, order=order)
    want_scores = ref.index_scores(T(q), T(k), T(w), r, p).numpy()
    _check_topk(got, want_scores, topk, r, p, offset, order)
    # the fused kernel and the two-step path agree exactly, ties included
    sc = dc.index_scores(q, k, w, ratio=r, start_pos=p)
    two = dc.topk_indices(sc, topk, ratio=r, start_pos=p, offset=offset, order=order)
    np.testing.assert_array_equal(got, two)
    np.testing.assert_array_equal(got, ref.exact_topk(sc, topk, r, p, offset, order))


def test_index_topk_ties_by_lower_position(isa, rng):
    """relu zeros: with one head and negative dots most scores are exactly 0."""
    q, k, w = _inputs(rng, 2, 40, 1, 4, 40)
    w[:] = 1.0
    k[:, ::3] = -np.abs(k[:, ::3])
    q[:] = np.abs(q)
    got = dc.index_topk(q, k, w, 12, ratio=1, order="score")
    sc = dc.index_scores(q, k, w, ratio=1)
    assert (sc[np.isfinite(sc)] == 0).sum() > 100
    np.testing.assert_array_equal(got, ref.exact_topk(sc, 12, 1))
    _check_topk(got, ref.index_scores(T(q), T(k), T(w), 1, 0).numpy(), 12, 1, 0, 0, "score")


@pytest.mark.parametrize("order", ["score", "position"])
def test_topk_indices_exact_ranking(isa, rng, order):
    """Many ties, NaN, +-inf, -0.0: the documented total order, exactly."""
    B, S, Tc = 2, 50, 300
    sc = rng.integers(-4, 5, (B, S, Tc)).astype(np.float32) * 0.5
    sc[sc == 0] = rng.choice(np.array([0.0, -0.0], np.float32), size=int((sc == 0).sum()))
    sc[0, :, 7] = np.nan
    sc[1, :, 100:103] = np.nan
    sc[0, :, 11] = np.inf
    sc[1, :, 5] = -np.inf
    for p, r, topk, off in [(0, 1, 20, 0), (250, 2, 64, 7), (0, 3, 500, 128), (549, 2, 1, 3)]:
        with unchanged(sc):
            got = dc.topk_indices(sc, topk, ratio=r, start_pos=p, offset=off, order=order)
        np.testing.assert_array_equal(got, ref.exact_topk(sc, topk, r, p, off, order),
                                      err_msg=f"p={p} r={r} topk={topk}")


def test_topk_indices_large_rows_radix_paths(rng):
    """Long rows with dense ties around the k-th key exercise every radix level."""
    sc = rng.standard_normal((1, 3, 20000)).astype(np.float32)
    sc[0, 1] = np.round(sc[0, 1] * 3) / 3       # few distinct values
    sc[0, 2, 5000:15000] = 0.25                 # a plateau straddling the k-th
    for order in ("score", "position"):
        got = dc.topk_indices(sc, 9000, ratio=1, start_pos=19997, order=order)
        np.testing.assert_array_equal(got, ref.exact_topk(sc, 9000, 1, 19997, 0, order))


def test_topk_indices_long_rows_bin_prefilter(rng):
    """Rows longer than the top-k keep only the 11-bit key bins holding the k best before
    the radix select: the k-th key inside a crowded bin (values 1 + tiny steps share
    one), NaNs filling the top bin past k, ties straddling the k-th, -0.0 / +0.0."""
    Tc, K = 70000, 512
    sc = rng.standard_normal((1, 4, Tc)).astype(np.float32)
    sc[0, 1] = 1.0 + rng.integers(0, 64, Tc).astype(np.float32) * 2.0 ** -20
    sc[0, 2, ::50] = np.nan                       # 1400 NaNs: more than k in the top bin
    sc[0, 3] = np.where(rng.random(Tc) < 0.5, np.float32(0.0), np.float32(-0.0))
    sc[0, 3, 1000:1600] = 2.0                     # 600 ties above the zeros
    for order in ("score", "position"):
        for K_ in (K, 1, Tc - 1):
            with unchanged(sc):
                got = dc.topk_indices(sc, K_, ratio=1, start_pos=Tc - 4, order=order)
            np.testing.assert_array_equal(got, ref.exact_topk(sc, K_, 1, Tc - 4, 0, order),
                                          err_msg=f"K={K_} {order}")


def test_topk_indices_strided_scores_and_out(rng):
    base = rng.standard_normal((2, 10, 64)).astype(np.float32)
    sc = base[:, ::2, ::2]
    want = ref.exact_topk(np.ascontiguousarray(sc), 5, 2, 20, 3, "score")
    np.testing.assert_array_equal(dc.topk_indices(sc, 5, ratio=2, start_pos=20, offset=3), want)
    out = np.zeros((2, 5, 10), np.int32)[:, :, ::2]
    assert dc.topk_indices(sc, 5, ratio=2, start_pos=20, offset=3, out=out) is out
    np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------- V4.1 candidate blocks

def test_select_candidate_blocks_contract(rng):
    B, S, Tc, bs = 2, 40, 70, 8
    sc = rng.integers(-3, 4, (B, S, Tc)).astype(np.float32)
    sc[0, :, 17] = np.nan
    for p, r, tb in [(0, 2, 3), (100, 2, 1), (30, 1, 4), (0, 1, 20)]:
        got = dc.select_candidate_blocks(sc, tb, bs, ratio=r, start_pos=p)
        assert got.dtype == np.bool_ and got.shape == (B, S, 9)
        np.testing.assert_array_equal(got, ref.exact_candidate_blocks(sc, tb, bs, r, p),
                                      err_msg=f"p={p} r={r} tb={tb}")
        nv = np.minimum((p + np.arange(S) + 1) // r, Tc)
        assert (got.sum(-1) == np.minimum(tb, -(-nv // bs))).all()


@pytest.mark.parametrize("order", ["score", "position"])
def test_index_topk_with_candidates(isa, rng, order):
    """Two-level V4.1 selection: entries outside kept blocks are never selected."""
    B, S, Hi, Di, Tc, r, p, bs = 2, 24, 8, 16, 64, 2, 90, 8
    q, k, w = _inputs(rng, B, S, Hi, Di, Tc)
    sc = dc.index_scores(q, k, w, ratio=r, start_pos=p)
    cand = dc.select_candidate_blocks(sc, 3, bs, ratio=r, start_pos=p)
    with unchanged(cand):
        got = dc.index_topk(q, k, w, 16, ratio=r, start_pos=p, order=order, candidates=cand)
    np.testing.assert_array_equal(got, ref.exact_topk(sc, 16, r, p, 0, order, cand, bs))
    np.testing.assert_array_equal(got, dc.topk_indices(sc, 16, ratio=r, start_pos=p,
                                                        order=order, candidates=cand))
    _check_topk(got, ref.index_scores(T(q), T(k), T(w), r, p).numpy(), 16, r, p, 0, order,
                cand, bs)
    # Tc not a multiple of the block size needs block_size
    k2 = k[:, :60]
    cand2 = cand[:, :, :8]
    got2 = dc.index_topk(q, k2, w, 16, ratio=r, start_pos=p, order=order, candidates=cand2,
                         block_size=8)
    sc2 = dc.index_scores(q, k2, w, ratio=r, start_pos=p)
    np.testing.assert_array_equal(got2, ref.exact_topk(sc2, 16, r, p, 0, order, cand2, 8))


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("S, Tc, p", [(300, 128, 0), (1, 4096, 16383), (3, 700, 2797),
                                     (20, 600, 2380)])
def test_bitwise_identical_at_1_2_3_threads(rng, S, Tc, p):
    q, k, w = _inputs(rng, 1, S, 64, 128, Tc)
    same_bits_at_thread_counts(lambda: (
        dc.index_scores(q, k, w, ratio=4, start_pos=p),
        dc.index_topk(q, k, w, 100, ratio=4, start_pos=p),
        dc.index_topk(q, k, w, 100, ratio=4, start_pos=p, order="position")))


def test_rows_score_the_same_alone_or_in_a_batch(rng):
    """A query row's scores do not depend on the other rows of the call (prefill vs
    decode work splits)."""
    q, k, w = _inputs(rng, 1, 40, 64, 128, 40)
    full = dc.index_scores(q, k, w, ratio=1)
    for s in (0, 17, 39):
        one = dc.index_scores(q[:, s:s + 1], k, w[:, s:s + 1], ratio=1, start_pos=s)
        assert np.array_equal(one[0, 0], full[0, s])


# ---------------------------------------------------------------- bad inputs

def _good(rng):
    return _inputs(rng, 2, 8, 4, 16, 8)


@pytest.mark.parametrize("mutate, kw, exc, words", [
    (lambda q, k, w: (q[..., :8], k, w), {}, ValueError, ["'k'", "Di"]),
    (lambda q, k, w: (q, k, w[..., :3]), {}, ValueError, ["'weights'", "[2, 8, 4]"]),
    (lambda q, k, w: (q, k[:1], w), {}, ValueError, ["'k'", "batch"]),
    (lambda q, k, w: (q, k[:, :3], w), {}, ValueError, ["'k'", "(start_pos + S) // ratio", "4"]),
    (lambda q, k, w: (q.astype(np.float64), k, w), {}, TypeError, ["'q'", "float64"]),
    (lambda q, k, w: (q, k.astype(np.float16), w), {}, TypeError, ["'k'", "float16"]),
    (lambda q, k, w: (q, k, w.astype(np.int32)), {}, TypeError, ["'weights'", "int32"]),
    (lambda q, k, w: (q[0], k, w), {}, ValueError, ["'q'", "4 dimensions"]),
    (lambda q, k, w: (q, k, w), {"ratio": 0}, ValueError, ["'ratio'"]),
    (lambda q, k, w: (q, k, w), {"start_pos": -1}, ValueError, ["'start_pos'"]),
    (lambda q, k, w: (q, k, w), {"start_pos": 10}, ValueError, ["'k'", "(10 + 8) // 2 = 9"]),
])
def test_scoring_bad_inputs(rng, mutate, kw, exc, words):
    q, k, w = _good(rng)
    qq, kk, ww = mutate(q, k, w)
    args = dict(ratio=2)
    args.update(kw)
    for call in (lambda: dc.index_scores(qq, kk, ww, **args),
                 lambda: dc.index_topk(qq, kk, ww, 3, **args)):
        with unchanged(q, k, w):
            with pytest.raises(exc) as e:
                call()
        for word in words:
            assert word in str(e.value), (word, str(e.value))


@pytest.mark.parametrize("kw, exc, words", [
    ({"topk": 0}, ValueError, ["'topk'"]),
    ({"topk": -3}, ValueError, ["'topk'"]),
    ({"topk": 2.5}, TypeError, ["'topk'"]),
    ({"order": "descending"}, ValueError, ["'order'", "position"]),
    ({"offset": -1}, ValueError, ["'offset'"]),
    ({"candidates": np.ones((2, 8, 3), np.int32)}, TypeError, ["'candidates'", "bool"]),
    ({"candidates": np.ones((2, 8, 3), bool)}, ValueError, ["'candidates'", "block_size"]),
    ({"candidates": np.ones((2, 8, 3), bool), "block_size": 2}, ValueError,
     ["'candidates'", "ceil"]),
    ({"candidates": np.ones((2, 7, 4), bool)}, ValueError, ["'candidates'"]),
    ({"block_size": 2}, ValueError, ["'block_size'"]),
    ({"out": np.zeros((2, 8, 3), np.int32)}, ValueError, ["'out'", "[2, 8, 4]"]),
    ({"out": np.zeros((2, 8, 4), np.float32)}, TypeError, ["'out'"]),
])
def test_topk_bad_inputs(rng, kw, exc, words):
    q, k, w = _good(rng)
    args = dict(topk=4, ratio=2)
    args.update(kw)
    with unchanged(q, k, w):
        with pytest.raises(exc) as e:
            dc.index_topk(q, k, w, **args)
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    sc = dc.index_scores(q, k, w, ratio=2)
    with unchanged(sc):
        with pytest.raises(exc) as e:
            dc.topk_indices(sc, **args)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_other_bad_inputs():
    sc = np.zeros((1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="'scores'"):
        dc.topk_indices(sc[:, :, :1], 2, ratio=2)
    with pytest.raises(TypeError, match="'scores'"):
        dc.topk_indices(sc.astype(np.float64), 2, ratio=2)
    with pytest.raises(TypeError, match="ratio"):
        dc.topk_indices(sc, 2)
    with pytest.raises(ValueError, match="'topk_blocks'"):
        dc.select_candidate_blocks(sc, 0, 4, ratio=1)
    with pytest.raises(ValueError, match="'block_size'"):
        dc.select_candidate_blocks(sc, 1, 0, ratio=1)
    with pytest.raises(ValueError, match="'window'"):
        dc.window_topk_idxs(0, 1, 4, 0)
    with pytest.raises(ValueError, match="'seqlen'"):
        dc.window_topk_idxs(128, 1, 4, 5)
    with pytest.raises(ValueError, match="'seqlen'"):
        dc.compress_topk_idxs(4, 1, 2, 9, 0)
    with pytest.raises(ValueError, match="'offset'"):
        dc.compress_topk_idxs(4, 1, 8, 0, -1)
    with pytest.raises(ValueError, match="'ratio'"):
        dc.compress_topk_idxs(0, 1, 8, 0, 0)
    ro = np.zeros((1, 4, 2), np.int32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="'out' is read-only"):
        dc.topk_indices(sc, 2, ratio=2, out=ro)


# ---------------------------------------------------------------- index lists

@pytest.mark.parametrize("window, batch, seqlen, p", [
    (128, 1, 4096, 0), (128, 2, 100, 0), (4, 1, 9, 0), (128, 1, 1, 0), (3, 2, 0, 0),
    (128, 2, 1, 1), (128, 1, 1, 126), (128, 1, 1, 127), (128, 3, 1, 128), (128, 1, 1, 1000),
    (5, 1, 1, 3), (5, 1, 1, 4), (1, 1, 1, 7)])
def test_window_topk_idxs(window, batch, seqlen, p):
    got = dc.window_topk_idxs(window, batch, seqlen, p)
    want = ref.window_topk_idxs(window, batch, seqlen, p).numpy()
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    if p > 0:  # the slot written at p is in the list; ring order ends with it
        assert (got[..., -1] == p % window).all() or p < window - 1


@pytest.mark.parametrize("ratio, batch, seqlen, p, offset", [
    (128, 1, 4096, 0, 4096), (128, 2, 300, 0, 300), (4, 1, 9, 0, 9), (128, 1, 100, 0, 100),
    (128, 2, 1, 1000, 128), (128, 1, 1, 127, 128), (128, 1, 1, 126, 128), (2, 1, 0, 0, 0)])
def test_compress_topk_idxs(ratio, batch, seqlen, p, offset):
    got = dc.compress_topk_idxs(ratio, batch, seqlen, p, offset)
    want = ref.compress_topk_idxs(ratio, batch, seqlen, p, offset).numpy()
    assert got.dtype == np.int32 and got.shape == (batch, seqlen, (p + seqlen) // ratio)
    np.testing.assert_array_equal(got, want)


def test_index_lists_out_and_keywords():
    out = np.full((1, 9, 4), 7, np.int32)
    assert dc.window_topk_idxs(window=4, batch=1, seqlen=9, start_pos=0, out=out) is out
    np.testing.assert_array_equal(out, ref.window_topk_idxs(4, 1, 9, 0).numpy())


@pytest.mark.parametrize("order", ["score", "position"])
def test_index_topk_decode_batch_with_candidates(isa, rng, order):
    """Decode rows (keys split across threads) with a batch and V4.1 candidates."""
    B, Hi, Di, Tc, r, p, bs = 3, 64, 128, 3000, 2, 5998, 64
    q, k, w = _inputs(rng, B, 1, Hi, Di, Tc)
    if isa == "ref":
        q, k = q[..., :16], k[..., :16]
    sc = dc.index_scores(q, k, w, ratio=r, start_pos=p)
    cand = dc.select_candidate_blocks(sc, 8, bs, ratio=r, start_pos=p)
    assert cand[:, 0, -1].all() and (cand.sum(-1) == 8).all()
    with threads(2):
        got = dc.index_topk(q, k, w, 256, ratio=r, start_pos=p, offset=128, order=order,
                            candidates=cand, block_size=bs)
    np.testing.assert_array_equal(got, ref.exact_topk(sc, 256, r, p, 128, order, cand, bs))
    _check_topk(got, ref.index_scores(T(q), T(k), T(w), r, p).numpy(), 256, r, p, 128, order,
                cand, bs)


def test_torch_inputs_for_topk_and_candidates(rng):
    q, k, w = _inputs(rng, 1, 12, 4, 16, 12)
    sc = dc.index_scores(q, k, w, ratio=1)
    cand = dc.select_candidate_blocks(sc, 2, 4, ratio=1)
    got = dc.index_topk(T(q), T(k), T(w), 5, ratio=1, candidates=torch.from_numpy(cand))
    np.testing.assert_array_equal(got, ref.exact_topk(sc, 5, 1, 0, 0, "score", cand, 4))
    np.testing.assert_array_equal(dc.topk_indices(T(sc), 5, ratio=1), ref.exact_topk(sc, 5, 1))


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 4), st.integers(0, 30),
       st.integers(1, 50), st.sampled_from(["score", "position"]), st.integers(0, 2**31 - 1))
def test_topk_indices_property(B, S, ratio, p, topk, order, seed):
    """Random small rows drawn from few values (ties, zeros of both signs, NaN, inf)."""
    r = np.random.default_rng(seed)
    Tc = (p + S) // ratio + int(r.integers(0, 3))
    vals = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan], np.float32)
    sc = r.choice(vals, size=(B, S, Tc)) * r.choice(np.array([1, 1, 1, 0.5], np.float32),
                                                     size=(B, S, Tc))
    got = dc.topk_indices(sc, topk, ratio=ratio, start_pos=p, offset=3, order=order)
    np.testing.assert_array_equal(got, ref.exact_topk(sc, topk, ratio, p, 3, order))
    if Tc:
        bs = int(r.integers(1, Tc + 1))
        cand = r.random((B, S, -(-Tc // bs))) < 0.6
        got = dc.topk_indices(sc, topk, ratio=ratio, start_pos=p, order=order, candidates=cand,
                              block_size=bs)
        np.testing.assert_array_equal(got, ref.exact_topk(sc, topk, ratio, p, 0, order, cand, bs))
        tb = int(r.integers(1, 5))
        np.testing.assert_array_equal(
            dc.select_candidate_blocks(sc, tb, bs, ratio=ratio, start_pos=p),
            ref.exact_candidate_blocks(sc, tb, bs, ratio, p))


# ---------------------------------------------------------------- bfloat16 inputs
#
# The bf16 run of the reference is the float32 reference on the bfloat16 values (what the
# released scorer does: bf16 q and k, float32 products and sums, float32 scores).  The
# product of two bfloat16 values is exact in float32 (8 + 8 significant bits), so our
# bf16 path differs from that run only in the order of the float32 additions (the AMX
# tile unit's inside a dot product): the float32 budget of _check_scores holds, a few
# ulps of sum_h |w| |q|.|k| per (Di + Hi) terms (2e-5 >= (Di + Hi) * 2^-24 for every
# shape here).  The pure-bfloat16 torch run is checked separately at bf16 tolerance.

from ml_dtypes import bfloat16 as BF16  # noqa: E402

from conftest import ISA_LEVELS_BF16  # noqa: E402


def _bf16_inputs(rng, B, S, Hi, Di, Tc, w_bf16=False):
    q, k, w = _inputs(rng, B, S, Hi, Di, Tc)
    return q.astype(BF16), k.astype(BF16), (w.astype(BF16) if w_bf16 else w)


def _wide(*arrays):
    """The float32 arrays holding exactly the same values."""
    return tuple(np.asarray(a, np.float32) for a in arrays)


def _tb(a):
    """A torch bfloat16 tensor sharing a's memory (the torch bridge's 16-bit view)."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def _overlap(a, b):
    """Mean fraction of each row's non-padding entries of a that b also selected."""
    fr = []
    for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
        x, y = set(x[x >= 0].tolist()), set(y[y >= 0].tolist())
        fr.append(len(x & y) / max(len(x), 1))
    return float(np.mean(fr))


BF16_SHAPES = SHAPES + [  # B, S, Hi, Di, Tc, ratio, start_pos
    (1, 5, 64, 128, 37, 1, 0),        # released heads, Tc not a multiple of 16
    (2, 3, 100, 64, 50, 2, 95),       # Hi > 64 (two passes of head tiles), Hi % 16 != 0
    (1, 4, 16, 32, 16, 1, 12),        # exactly one tile each way
    (1, 2, 3, 200, 9, 1, 7),          # Di > 128 and not a multiple of 32
]


@pytest.mark.parametrize("shape", BF16_SHAPES)
@pytest.mark.parametrize("wdt", ["float32", "bfloat16"])
def test_bf16_scores_match_reference(isa_bf16, rng, shape, wdt):
    B, S, Hi, Di, Tc, r, p = shape
    q, k, w = _bf16_inputs(rng, B, S, Hi, Di, Tc, w_bf16=wdt == "bfloat16")
    with unchanged(q, k, w):
        got = dc.index_scores(q, k, w, ratio=r, start_pos=p)
    _check_scores(got, *_wide(q, k, w), r, p)
    f32 = dc.index_scores(*_wide(q, k, w), ratio=r, start_pos=p)
    if isa_bf16 != "amx":   # widened copies through the float32 code: its very bits
        np.testing.assert_array_equal(got.view(np.uint32), f32.view(np.uint32))


@pytest.mark.parametrize("case", [  # B, S, Hi, Di, Tc, ratio, start_pos, topk
    (1, 256, 64, 128, 1024, 4, 3840, 512),   # V4-Flash prefill chunk, 1024 entries
    (1, 1, 64, 128, 16384, 4, 65535, 512),   # V4-Flash decode at 64K context
    (2, 2, 64, 128, 3000, 4, 11998, 512),    # decode-like batch (keys split across threads)
])
def test_bf16_topk_released_shapes(isa_bf16, rng, case):
    """>= 99% top-k overlap with the bf16 run of the reference and with our float32
    path on the same values (in fact the same sets up to near-ties at the k-th score),
    and the fused selection is exactly the two-step one."""
    B, S, Hi, Di, Tc, r, p, topk = case
    if isa_bf16 == "ref":
        pytest.skip("the scalar oracle is slow on the released shapes; small shapes cover it")
    q, k, w = _bf16_inputs(rng, B, S, Hi, Di, Tc)
    with unchanged(q, k, w):
        got = dc.index_topk(q, k, w, topk, ratio=r, start_pos=p, offset=128)
    ref_sc = ref.index_scores(*(T(a) for a in _wide(q, k, w)), r, p).numpy()
    want = ref.topk_indices(T(ref_sc), topk, r, p, 128).numpy()
    assert _overlap(got, want) >= 0.99
    _check_topk(got, ref_sc, topk, r, p, 128, "score")
    f32 = dc.index_topk(*_wide(q, k, w), topk, ratio=r, start_pos=p, offset=128)
    assert _overlap(got, f32) >= 0.99
    sc = dc.index_scores(q, k, w, ratio=r, start_pos=p)
    np.testing.assert_array_equal(got, dc.topk_indices(sc, topk, ratio=r, start_pos=p,
                                                        offset=128))


def test_bf16_against_pure_bf16_torch_run(isa_bf16, rng):
    """kernels.md section 8: the reference run entirely in bfloat16 (einsum rounded to bf16) at bf16
    tolerance, >= 99% of the top-k shared."""
    if isa_bf16 == "ref":
        pytest.skip("slow scalar oracle; the float32-run comparisons cover it")
    q, k, w = _bf16_inputs(rng, 1, 32, 64, 128, 1024, w_bf16=True)
    got = dc.index_scores(q, k, w, ratio=4, start_pos=4064)
    want = ref.index_scores(_tb(q), _tb(k), _tb(w), 4, 4064).float().numpy()
    scale = np.abs(want[np.isfinite(want)]).max()
    assert_close(got, want, rtol=3e-2, atol=3e-2 * scale, what="bf16 scores")
    mine = dc.index_topk(q, k, w, 512, ratio=4, start_pos=4064)
    assert _overlap(mine, ref.topk_indices(T(want), 512, 4, 4064).numpy()) >= 0.99


@pytest.mark.parametrize("order", ["score", "position"])
def test_bf16_exact_ties_nan_inf_like_float32(isa_bf16, rng, order):
    """Small-integer q and k make every dot product exact in any summation order, so the
    bf16 path (AMX tiles included) must give exactly the float32 path's bits: the same
    head-sum order, hence the same exact ties (relu zeros), NaN and infinities, and the
    same selections (with and without V4.1 candidates)."""
    B, S, Hi, Di, Tc, r, p = 2, 30, 20, 40, 40, 1, 10
    q = rng.integers(-3, 4, (B, S, Hi, Di)).astype(np.float32)
    k = rng.integers(-3, 4, (B, Tc, Di)).astype(np.float32)
    w = rng.standard_normal((B, S, Hi)).astype(np.float32)
    q[0, 3, 1, 5] = np.nan            # row (0, 3): NaN wherever it looks
    k[1, 2, 7] = np.inf               # key (1, 2): +-inf dots
    w[1, 6, :] = 0.0                  # row (1, 6): 0 * inf = NaN where a dot is +inf
    q[1, 9, :2] = 0.0                 # exact-zero heads
    w[0, 8, 4] = -np.inf
    q16, k16 = q.astype(BF16), k.astype(BF16)
    assert np.array_equal(np.asarray(q16, np.float32), q, equal_nan=True)
    for wx in (w, w.astype(BF16)):
        wf = np.asarray(wx, np.float32)
        a = dc.index_scores(q16, k16, wx, ratio=r, start_pos=p)
        b = dc.index_scores(q, k, wf, ratio=r, start_pos=p)
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        vis = np.arange(Tc)[None, :] < ref.visible(p, S, r).numpy()[:, None]
        # the case is not vacuous: NaN, visible -inf (w = -inf) and exact zeros occur
        assert np.isnan(a).any() and np.isneginf(a[:, vis]).any() and (a == 0).any()
        np.testing.assert_array_equal(
            dc.index_topk(q16, k16, wx, 12, ratio=r, start_pos=p, order=order),
            dc.index_topk(q, k, wf, 12, ratio=r, start_pos=p, order=order))
        cand = dc.select_candidate_blocks(b, 2, 8, ratio=r, start_pos=p)
        got = dc.index_topk(q16, k16, wx, 12, ratio=r, start_pos=p, order=order,
                            candidates=cand)
        np.testing.assert_array_equal(got, ref.exact_topk(b, 12, r, p, 0, order, cand, 8))
    want = ref.index_scores(T(q), T(k), T(w), r, p).numpy()
    np.testing.assert_array_equal(np.isnan(a), np.isnan(want))


def test_bf16_subnormals(isa_bf16):
    """bfloat16 subnormals (|x| < 2^-126) are exact at every level but 'amx', where the
    tile unit reads them as zero and flushes subnormal float32 results (documented in
    index_scores' docstring)."""
    q = np.zeros((1, 1, 1, 32), np.float32)
    k = np.zeros((1, 2, 32), np.float32)
    w = np.ones((1, 1, 1), np.float32)
    q[..., 0], k[0, 0, 0], k[0, 1, 0] = 2.0 ** -130, 2.0 ** 100, 1.0
    q[..., 1], k[0, 1, 1] = 2.0 ** -70, 2.0 ** -70     # a normal x normal subnormal product
    got = dc.index_scores(q.astype(BF16), k.astype(BF16), w, ratio=1, start_pos=1)[0, 0]
    exact = np.array([2.0 ** -30, 2.0 ** -130 + 2.0 ** -140], np.float32)
    if isa_bf16 == "amx":
        np.testing.assert_array_equal(got, [0.0, 0.0])
    else:
        np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("S, Tc, p", [(300, 128, 0), (1, 4096, 16383), (3, 700, 2797),
                                     (20, 600, 2380), (2, 37, 147)])
def test_bf16_bitwise_identical_at_1_2_3_threads(rng, S, Tc, p):
    """At the top level (the AMX tiles when the CPU has them): same bits at any thread
    count, prefill-like and decode-like (keys split across threads) calls alike."""
    before = dc.get_isa()
    dc.set_isa(ISA_LEVELS_BF16[-1])
    try:
        q, k, w = _bf16_inputs(rng, 1, S, 64, 128, Tc)
        first = same_bits_at_thread_counts(lambda: (
            dc.index_scores(q, k, w, ratio=4, start_pos=p),
            dc.index_topk(q, k, w, 100, ratio=4, start_pos=p),
            dc.index_topk(q, k, w, 100, ratio=4, start_pos=p, order="position")))
        # a row scores the same alone (decode split) as inside the prefill call
        if S > 1:
            for s in (0, S // 2, S - 1):
                one = dc.index_scores(q[:, s:s + 1], k, w[:, s:s + 1], ratio=4, start_pos=p + s)
                assert np.array_equal(one[0, 0].view(np.uint32), first[0][0, s].view(np.uint32))
    finally:
        dc.set_isa(before)


def test_bf16_views_torch_tensors_and_out(isa_bf16, rng):
    """Strided bf16 views and torch bfloat16 tensors (read in place) give the bits of the
    contiguous call; out= is float32."""
    qb, kb, wb = _bf16_inputs(rng, 2, 12, 34, 80, 40, w_bf16=True)
    q, k, w = qb[:, ::2, ::-1, ::2], kb[:, 3:, ::2], wb[:, ::2, ::-1]
    want = dc.index_scores(*(np.ascontiguousarray(a) for a in (q, k, w)), ratio=2)
    with unchanged(qb, kb, wb):
        got = dc.index_scores(q, k, w, ratio=2)
        tq, tk, tw = _tb(qb)[:, ::2].flip(2)[..., ::2], _tb(kb)[:, 3:, ::2], _tb(wb)[:, ::2].flip(2)
        got_t = dc.index_scores(tq, tk, tw, ratio=2)
        got_tc = dc.index_scores(_tb(np.ascontiguousarray(q)), _tb(np.ascontiguousarray(k)),
                                 _tb(np.ascontiguousarray(w)), ratio=2)
    for g in (got, got_t, got_tc):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g.view(np.uint32), want.view(np.uint32))
    out = np.zeros((2, 6, 74), np.float32)[:, :, ::2]
    assert dc.index_scores(q, k, w, ratio=2, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    idx = dc.index_topk(tq, tk, tw, 5, ratio=2, offset=3)
    np.testing.assert_array_equal(idx, dc.topk_indices(want, 5, ratio=2, offset=3))
    # keys read in place with a negative row stride (the tiles load rows at any stride)
    kr = kb[::-1, ::-1]
    np.testing.assert_array_equal(
        dc.index_scores(qb, kr, wb, ratio=1, start_pos=28).view(np.uint32),
        dc.index_scores(qb, np.ascontiguousarray(kr), wb, ratio=1, start_pos=28).view(np.uint32))


@pytest.mark.parametrize("qdt, kdt", [(BF16, np.float32), (np.float32, BF16)])
def test_bf16_mixed_q_k_dtypes_raise(rng, qdt, kdt):
    """q . k runs in one dtype (as the reference's einsum): a mix raises, naming 'k'."""
    q, k, w = _good(rng)
    qq, kk = q.astype(qdt), k.astype(kdt)
    for call in (lambda: dc.index_scores(qq, kk, w, ratio=2),
                 lambda: dc.index_topk(qq, kk, w, 3, ratio=2)):
        with unchanged(qq, kk, w):
            with pytest.raises(TypeError) as e:
                call()
        msg = str(e.value)
        assert "'k'" in msg and "'q'" in msg and "bfloat16" in msg and "float32" in msg, msg
    with pytest.raises(TypeError, match="'out'"):
        dc.index_scores(q.astype(BF16), k.astype(BF16), w, ratio=2,
                        out=np.zeros((2, 8, 8), BF16))
