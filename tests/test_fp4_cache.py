"""FP4 index-key rows (docs/kernels.md, section 4): fp4_pack / fp4_unpack and the
indexer scoring a uint8 k of that format with exact integer block sums."""
import numpy as np
import pytest

import deepseek_csa as dc
from deepseek_csa import _core

LEVELS = [lv for lv in ("ref", "base", "avx2", "avx512", "amx")
          if lv in _core.ISA_LEVELS and _core.ISA_LEVELS.index(lv) <= _core.ISA_LEVELS.index(dc.best_isa())]


@pytest.fixture
def at_level():
    before = dc.get_isa()

    def set_(lv):
        dc.set_isa(lv)
    yield set_
    dc.set_isa(before)


def _grid(rng, shape, scale=1.0):
    return dc.fp4_round((rng.standard_normal(shape) * scale).astype(np.float32), 32)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


# ---------------------------------------------------------------- pack / unpack

def test_layout_by_hand():
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [0.5, -6.0, 1.5, 0.0]       # scale 1: amax 6 -> 2**ceil(log2(1)) = 1
    p = dc.fp4_pack(x)
    assert p.shape == (1, 17) and p.dtype == np.uint8
    # element 0 (0.5 = code 1) low nibble, element 1 (-6 = code 8|7) high nibble
    assert p[0, 0] == (0xF << 4) | 0x1
    assert p[0, 1] == 0x3                  # 1.5 = code 3, then +0
    assert p[0, 16] == 127                 # 2**0
    y = x * 2.0 ** -10                     # the same codes, exponent 117
    q = dc.fp4_pack(y)
    assert np.array_equal(q[0, :16], p[0, :16]) and q[0, 16] == 117
    assert np.array_equal(_bits(dc.fp4_unpack(q)), _bits(y))


@pytest.mark.parametrize("shape", [(3, 128), (2, 5, 64), (32,), (4, 0, 96)])
def test_roundtrip_bitwise(shape):
    rng = np.random.default_rng(1)
    x = _grid(rng, shape, 3.0)
    x0 = x.copy()
    p = dc.fp4_pack(x)
    assert p.shape == shape[:-1] + (shape[-1] // 2 + shape[-1] // 32,)
    assert np.array_equal(_bits(x), _bits(x0))            # input unchanged
    assert np.array_equal(_bits(dc.fp4_unpack(p)), _bits(x))
    # out= for both, and bfloat16 input holding the same values
    o = np.empty_like(p)
    assert dc.fp4_pack(x, out=o) is o and np.array_equal(o, p)
    from ml_dtypes import bfloat16
    assert np.array_equal(dc.fp4_pack(x.astype(bfloat16)), p)
    f = np.empty(shape, np.float32)
    assert dc.fp4_unpack(p, out=f) is f and np.array_equal(_bits(f), _bits(x))


def test_round_true_equals_fp4_round():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 128)).astype(np.float32)
    p = dc.fp4_pack(x, round=True)
    assert np.array_equal(_bits(dc.fp4_unpack(p)), _bits(dc.fp4_round(x.copy(), 32)))


def test_off_grid_raises_naming_row_and_block():
    rng = np.random.default_rng(3)
    x = _grid(rng, (4, 128))
    x[2, 70] += np.float32(0.01) * np.abs(x[2, 64:96]).max()
    with pytest.raises(ValueError, match=r"'x'.*row 2.*block 2"):
        dc.fp4_pack(x)
    with pytest.raises(ValueError, match="multiple of 32"):
        dc.fp4_pack(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="multiple of 17"):
        dc.fp4_unpack(np.zeros((2, 18), np.uint8))
    with pytest.raises(TypeError, match="'p'"):
        dc.fp4_unpack(np.zeros((2, 17), np.float32))


def test_nan_scale_byte_unpacks_to_nan():
    p = np.zeros((1, 17), np.uint8)
    p[0, 16] = 0xFF
    assert np.isnan(dc.fp4_unpack(p)).all()


# ---------------------------------------------------------------- scoring

def _problem(rng, B, S, Hi, Di, Tc, wdt=np.float32):
    q = _grid(rng, (B, S, Hi, Di))
    k = _grid(rng, (B, Tc, Di), 2.0)
    w = rng.standard_normal((B, S, Hi)).astype(wdt)
    return q, k, w


CASES = [  # B, S, Hi, Di, Tc, ratio, start_pos
    (1, 1, 64, 128, 300, 4, 1197),    # decode, released widths
    (2, 3, 7, 32, 41, 4, 150),         # batch > 1, odd heads, one block
    (1, 9, 17, 64, 40, 4, 129),        # start_pos in the middle of a group
    (1, 20, 33, 96, 20, 1, 0),         # prefill, ratio 1
]


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_float32_on_dequantized(case, at_level):
    B, S, Hi, Di, Tc, ratio, sp = case
    rng = np.random.default_rng(sum(case))
    q, k, w = _problem(rng, B, S, Hi, Di, Tc)
    kp, qp = dc.fp4_pack(k), dc.fp4_pack(q)
    k0, q0 = kp.copy(), q.copy()
    ref = None
    for lv in LEVELS:
        at_level(lv)
        want = dc.index_scores(q, k, w, ratio=ratio, start_pos=sp)
        got = dc.index_scores(q, kp, w, ratio=ratio, start_pos=sp)
        got_q = dc.index_scores(qp, kp, w, ratio=ratio, start_pos=sp)
        assert np.array_equal(_bits(got), _bits(got_q))   # q rounded on the fly == q packed
        fin = np.isfinite(want)
        assert np.array_equal(fin, np.isfinite(got))
        tol = 2e-6 * (np.abs(q).sum(-1).max() * np.abs(k).max() * np.abs(w).sum(-1).max()) + 1e-30
        assert np.abs(got[fin] - want[fin]).max() <= tol
        if ref is None:
            ref = got
        # every level gives the oracle's bits (the integer path keeps its order)
        assert np.array_equal(_bits(got), _bits(ref))
        K = min(16, (sp + S) // ratio)
        ta = dc.index_topk(q, kp, w, K, ratio=ratio, start_pos=sp)
        tb = dc.topk_indices(got, K, ratio=ratio, start_pos=sp)
        assert np.array_equal(ta, tb)
        tf = dc.index_topk(q, k, w, K, ratio=ratio, start_pos=sp)
        for b, s in zip(*np.nonzero((ta != tf).any(-1))):  # only at (near-)ties
            a, f = set(ta[b, s]) - {-1}, set(tf[b, s]) - {-1}
            sc = want[b, s]
            thr = np.sort(sc[np.isfinite(sc)])[::-1][len(a) - 1]
            for t in a ^ f:
                assert abs(sc[t] - thr) <= tol
    assert np.array_equal(kp, k0) and np.array_equal(_bits(q), _bits(q0))


def test_packed_is_exact_where_float32_rounds(at_level):
    """Block 0 holds one large product (36 * 2**20, ulp 4), block 1 32 products of
    0.25: the float32 path adds each 0.25 to the big sum and loses it; the packed path
    adds block 1's exact sum 8 once."""
    Di = 64
    q = np.zeros((1, 1, 1, Di), np.float32)
    k = np.zeros((1, 1, Di), np.float32)
    q[..., 0] = 6 * 2.0 ** 10
    k[..., 0] = 6 * 2.0 ** 10
    q[..., 32:] = 0.5
    k[..., 32:] = 0.5
    w = np.ones((1, 1, 1), np.float32)
    exact = 36.0 * 2 ** 20 + 8
    for lv in LEVELS:
        at_level(lv)
        f = dc.index_scores(q, k, w, ratio=1, start_pos=0)[0, 0, 0]
        p = dc.index_scores(q, dc.fp4_pack(k), w, ratio=1, start_pos=0)[0, 0, 0]
        assert p == exact
        assert f != exact


def test_candidates_position_order_and_bf16(at_level):
    rng = np.random.default_rng(7)
    B, S, Hi, Di, Tc, sp = 2, 5, 16, 64, 64, 250
    q, k, w = _problem(rng, B, S, Hi, Di, Tc)
    from ml_dtypes import bfloat16
    w = w.astype(bfloat16).astype(np.float32)
    kp = dc.fp4_pack(k)
    cand = rng.random((B, S, Tc // 8)) < 0.6
    for lv in LEVELS:
        at_level(lv)
        sc = dc.index_scores(q, kp, w, ratio=4, start_pos=sp)
        want = dc.topk_indices(sc, 12, ratio=4, start_pos=sp, order="position",
                               candidates=cand, offset=3)
        got = dc.index_topk(q, kp, w, 12, ratio=4, start_pos=sp, order="position",
                            candidates=cand, offset=3)
        assert np.array_equal(got, want)
        # a bfloat16 q holding the same values rounds to the same FP4 rows
        got16 = dc.index_scores(q.astype(bfloat16), kp, w.astype(bfloat16), ratio=4,
                                start_pos=sp)
        assert np.array_equal(_bits(got16), _bits(sc))


def test_bad_fp4_k_arguments():
    rng = np.random.default_rng(8)
    q, k, w = _problem(rng, 1, 1, 4, 64, 8)
    kp = dc.fp4_pack(k)
    with pytest.raises(TypeError, match="'k'.*uint8 FP4 rows"):
        dc.index_scores(q, kp[..., :-1], w, ratio=4, start_pos=31)
    with pytest.raises(TypeError, match="multiple of 32"):
        dc.index_scores(q[..., :48], kp, w, ratio=4, start_pos=31)
    with pytest.raises(TypeError, match="'k'"):
        dc.index_scores(dc.fp4_pack(q), k, w, ratio=4, start_pos=31)
    with pytest.raises(ValueError, match="'k'"):
        dc.index_topk(q, kp, w, 4, ratio=4, start_pos=100)
