"""index_scores / index_topk on FP4 key rows by exact integer dot products
(docs/kernels.md, section 4, "The integer path"): bitwise the oracle's scores and the
oracle's top-k at every ISA level, with every set of CPU features
(DEEPSEEK_CSA_CPU_FEATURES: the AMX-INT8 tiles, VPDPBUSD, VPMADDUBSW), at 1, 2 and 3
threads, on the shapes and codes where an integer path could go wrong: Tc off the
8/16-key tiles, Hi off the 16-head tiles and past 64 (two passes of the tiles), S = 1..8,
batches, start_pos in the middle of a group, Di of 1 to 8 blocks (an odd count: half a
64-feature chunk), block exponents spread past the prescaled path's reach, zero blocks
and zero rows, NaN scale bytes, exponents at both ends of the range, weights that the
tiles' folded scales would round (tiny, huge) and key exponents past the folding's
range.  The error budget is zero: the integer path claims the oracle's
float32 operations in the oracle's order, so any difference is a bug."""
import os
import subprocess
import sys

import numpy as np
import pytest

import deepseek_csa as dc
from conftest import same_bits_at_thread_counts

LEVELS = [lv for lv in dc.ISA_LEVELS
          if dc.ISA_LEVELS.index(lv) <= dc.ISA_LEVELS.index(dc.best_isa())]


@pytest.fixture
def at_level():
    before = dc.get_isa()
    yield dc.set_isa
    dc.set_isa(before)


def _grid(rng, shape, scale=1.0):
    return dc.fp4_round((rng.standard_normal(shape) * scale).astype(np.float32), 32)


def _same(got, want, what):
    """Bitwise, NaN against NaN by position (a payload is the CPU's choice)."""
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    nan = np.isnan(w)
    np.testing.assert_array_equal(np.isnan(g), nan, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(g[~nan].view(np.uint32), w[~nan].view(np.uint32), err_msg=what)


def _blockscale(rng, x, lo, hi):
    """Each 32-block of x times 2^u, u uniform in [lo, hi]: exponents spread across a
    row's blocks (the prescaled path takes spreads up to 2^3 / 2^2)."""
    sh = x.shape[:-1] + (x.shape[-1] // 32, 1)
    f = np.exp2(rng.integers(lo, hi + 1, sh)).astype(np.float32)
    return (x.reshape(sh[:-1] + (32,)) * f).reshape(x.shape)


def make_case(rng, B, S, Hi, Di, Tc, kind):
    """(q as FP4 rows, k as FP4 rows, w) of a kind: plain Gaussian; 'spread' block
    exponents spread by up to 2^12; 'zeros' zero blocks, zero keys and a zero head;
    'codes' NaN scale bytes and exponents at both ends (scalar fallbacks), infinite
    and NaN weights; 'weights' queries at 2^-20 and every fourth 16-key tile at 2^105
    (key exponents past the AMX path's folded scales, inside the exact range: keys
    16-31 and head 0 at the largest codes, so that a folded scale would overflow), and
    in the last row (or batch entry) tiny and huge weights (w 2^(eq - 129) not exact)."""
    q, k = _grid(rng, (B, S, Hi, Di)), _grid(rng, (B, Tc, Di), 2.0)
    w = rng.standard_normal((B, S, Hi)).astype(np.float32)
    if kind == "spread":
        # heads and 16-key tiles within the prescaled reach (2^2), at the VNNI path's
        # (2^3), past both (2^4, one key a tile) and far past (2^12)
        for h, (lo, hi) in zip(range(3), [(0, 2), (0, 3), (-6, 6)]):
            q[:, :, h::3] = _blockscale(rng, q[:, :, h::3], lo, hi)
        tile = np.arange(Tc) // 16 % 4
        for t, (lo, hi) in enumerate([(0, 2), (0, 3), (-6, 6), (0, 2)]):
            k[:, tile == t] = _blockscale(rng, k[:, tile == t], lo, hi)
        k[:, 16 * 3 + 5::64] = _blockscale(rng, k[:, 16 * 3 + 5::64], 0, 4)
    if kind == "weights":
        q *= np.float32(2.0 ** -20)
        k[:, np.arange(Tc) // 16 % 4 == 2] *= np.float32(2.0 ** 105)
        # head 0 and keys 16-31 all +6: N = 18432, whose N 2^(ek - 127) overflows at
        # ek = 242 though the dot (N 2^(ek + eq - 256)) is finite
        q[:, :, 0] = np.float32(6 * 2.0 ** -20)
        k[:, 16:32] = np.float32(6 * 2.0 ** 115)
        last = (slice(None), -1) if S > 1 else (-1,)
        wl = w[last]
        wl[..., ::3] *= np.float32(2.0 ** -130)     # subnormal: w 2^(eq - 129) rounds
        wl[..., 1] = np.float32(3e38)
        w[last] = wl
    if kind == "zeros":
        kb = k.reshape(B, Tc, Di // 32, 32)
        kb[rng.random(kb.shape[:3]) < 0.3] = 0
        k[:, ::7] = 0
        qb = q.reshape(B, S, Hi, Di // 32, 32)
        qb[rng.random(qb.shape[:4]) < 0.3] = 0
        q[:, :, 0] = 0
    qp, kp = dc.fp4_pack(q), dc.fp4_pack(k)
    if kind == "zeros":
        # zero blocks with extreme scale bytes: +0 whatever the scale, unless it is
        # infinite against the other side's (0 x inf = NaN in the oracle)
        z = ~(kp[..., :Di // 2].reshape(B, Tc, Di // 32, 16) & 0x77).any(-1)
        kp[..., Di // 2:][z] = rng.choice(np.array([0, 1, 200, 254], np.uint8), int(z.sum()))
    if kind == "codes":
        W = Di // 2 + Di // 32
        kp[:, 5 % Tc, W - 1] = 0xFF                  # NaN scale: NaN scores (unless masked)
        kp[:, 7 % Tc, Di // 2] = 0                   # 2^-127: products below the normals
        kp[:, 9 % Tc, Di // 2:] = 1
        kp[:, 11 % Tc, Di // 2:] = 254               # 2^127: products that overflow
        kp[:, 13 % Tc, Di // 2:] = 200
        if Tc > 40:
            kp[:, 40, Di // 2:] = 0xFF
        qp[0, 0, Hi // 2, Di // 2:] = 250            # a head with huge scales
        if S > 1:
            qp[0, 1, 0, W - 1] = 0xFF                # a NaN query row
        w[0, 0, 0] = np.inf
        if Hi > 2:
            w[-1, -1, 1] = np.nan
    return qp, kp, w


SHAPES = [  # B, S, Hi, Di, Tc, ratio, start_pos
    (1, 1, 64, 128, 1000, 4, 3999),     # decode, released widths
    (1, 1, 64, 128, 333, 4, 1330),      # Tc not a multiple of a tile
    (2, 8, 64, 128, 300, 4, 1190),      # speculative verification, batch 2
    (1, 5, 17, 64, 40, 4, 131),         # start_pos in the middle of a group, odd heads
    (3, 2, 7, 32, 45, 1, 40),           # one block, ratio 1
    (1, 3, 5, 256, 70, 4, 270),         # 8 blocks: two AVX-512 decode passes
    (1, 2, 9, 160, 50, 4, 190),         # 5 blocks: a partial pass
    (1, 40, 16, 128, 40, 1, 0),         # prefill (whole query rows per thread)
    (2, 1, 64, 128, 5000, 4, 19990),    # decode over several key chunks
    (1, 2, 100, 96, 90, 4, 361),        # 100 heads: two passes of the tiles, half a chunk
]
KINDS = ["plain", "spread", "zeros", "codes", "weights"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_scores_and_topk_bitwise_the_oracle(at_level, shape, kind):
    B, S, Hi, Di, Tc, r, sp = shape
    rng = np.random.default_rng(sum(shape) + 1000 * KINDS.index(kind))
    qp, kp, w = make_case(rng, B, S, Hi, Di, Tc, kind)
    qf = dc.fp4_unpack(qp)
    nan_q = np.isnan(qf)
    K = min(64, Tc)
    cand = rng.random((B, S, -(-Tc // 8))) < 0.7
    at_level("ref")
    want = dc.index_scores(qp, kp, w, ratio=r, start_pos=sp)
    want_k = dc.index_topk(qp, kp, w, K, ratio=r, start_pos=sp)
    want_c = dc.index_topk(qp, kp, w, K, ratio=r, start_pos=sp, order="position",
                           candidates=cand, block_size=8, offset=7)
    for lv in LEVELS[1:]:
        at_level(lv)
        _same(dc.index_scores(qp, kp, w, ratio=r, start_pos=sp), want, f"{lv} scores")
        np.testing.assert_array_equal(dc.index_topk(qp, kp, w, K, ratio=r, start_pos=sp), want_k,
                                      err_msg=f"{lv} top-k")
        np.testing.assert_array_equal(
            dc.index_topk(qp, kp, w, K, ratio=r, start_pos=sp, order="position",
                          candidates=cand, block_size=8, offset=7), want_c, err_msg=f"{lv} top-k, candidates")
        if not nan_q.any():
            # a float32 q on the e2m1 grid rounds to the same rows inside the call
            _same(dc.index_scores(qf, kp, w, ratio=r, start_pos=sp), want, f"{lv} float32 q")


def test_integer_path_is_exact_where_float32_rounds(at_level):
    """The oracle's dot, not the float32 one: block 0 holds one product 36 * 2^20, block
    1 32 products of 1/4 (8 in all, below the big sum's ulp 4 one at a time); the
    prescaled path adds the integers 36 * 2^20 * 2^k and 8 * 2^k exactly, as the
    oracle's block sums do."""
    Di = 64
    q = np.zeros((1, 1, 1, Di), np.float32)
    k = np.zeros((1, 16, Di), np.float32)
    q[..., 0] = k[..., 0] = 6 * 2.0 ** 10
    q[..., 32:] = k[..., 32:] = 0.5
    w = np.ones((1, 1, 1), np.float32)
    for lv in LEVELS:
        at_level(lv)
        assert (dc.index_scores(q, dc.fp4_pack(k), w, ratio=1, start_pos=15) == 36.0 * 2 ** 20 + 8).all()


def bound_case(Di):
    """(q, k, w) whose dots sit at the int16 lanes' bound (VPMADDUBSW path,
    ix4_tiles_*_fast16): every code +-6, a head's blocks at 2^2 above its base but the
    last (at the base), keys flat (keys 0-15) or one block 2^1 up (keys 16-31).  A
    lane's true sum |sum(k q)| is 12 * 16 * (48 nb' + 12) (nb' = nb - 1 blocks up):
    29952 < 2^15 at Di = 128 against flat keys (the int16 lanes' case, their start
    values 48 * 16 * 156 far past 2^15: the modulo does the work); 39168 against the
    others, and 39168 at Di = 160 against flat keys: past 2^15, the int32 path's."""
    nb = Di // 32
    sq = np.exp2(np.array([2] * (nb - 1) + [0], np.float32))
    q = np.repeat(6 * sq, 32)[None, None, None, :] * np.ones((1, 1, 8, 1), np.float32)
    q[0, 0, 1::2] *= -1
    sk = np.ones((32, nb), np.float32)
    sk[16:, 0] = 2
    k = (6 * np.repeat(sk, 32, axis=1))[None]
    k[0, ::3] *= -1
    w = np.linspace(0.5, 1.5, 8, dtype=np.float32)[None, None]
    return dc.fp4_pack(q), dc.fp4_pack(k), w


@pytest.mark.parametrize("Di", [128, 160])
def test_int16_lanes_at_their_bound(at_level, Di):
    qp, kp, w = bound_case(Di)
    at_level("ref")
    want = dc.index_scores(qp, kp, w, ratio=1, start_pos=31)
    for lv in LEVELS[1:]:
        at_level(lv)
        _same(dc.index_scores(qp, kp, w, ratio=1, start_pos=31), want, f"{lv} scores")


@pytest.mark.parametrize("qscale", [1.0, 2.0 ** -60])
def test_zero_blocks_inside_a_keys_spread(at_level, qscale):
    """Keys with a block of zero codes whose scale byte lies 0 .. 4 below, or 2 above,
    the key's nonzero blocks (and keys all zero at ordinary scale bytes): the VNNI
    level's vector decode counts such a block in the key's spread and base, the scalar
    pass leaves it out; both are exact, so the scores are the oracle's bits (with q at
    2^-60 the lowered base also crosses the exact range's lower end: the oracle's own
    function for the tile)."""
    rng = np.random.default_rng(45)
    Tc, Di, Hi = 160, 128, 24
    q = _grid(rng, (1, 1, Hi, Di)) * np.float32(qscale)
    k = _grid(rng, (1, Tc, Di), 2.0)
    qp, kp = dc.fp4_pack(q), dc.fp4_pack(k)
    nb = Di // 32
    for t in range(Tc):
        j, d = t % nb, [0, -1, -2, -3, -4, 2, 0, 0][(t // 16) % 8]
        if t % 3 == 0:
            continue
        kp[0, t, 16 * j:16 * j + 16] = 0 if t % 2 else 0x88   # +0 / -0 codes
        others = [int(kp[0, t, Di // 2 + i]) for i in range(nb) if i != j]
        kp[0, t, Di // 2 + j] = np.uint8(min(others) + d)
    kp[0, 80:96, :Di // 2] = 0                                 # a tile of zero keys
    w = rng.standard_normal((1, 1, Hi)).astype(np.float32)
    at_level("ref")
    want = dc.index_scores(qp, kp, w, ratio=1, start_pos=Tc - 1)
    want_k = dc.index_topk(qp, kp, w, 32, ratio=1, start_pos=Tc - 1)
    for lv in LEVELS[1:]:
        at_level(lv)
        _same(dc.index_scores(qp, kp, w, ratio=1, start_pos=Tc - 1), want, f"{lv} scores")
        np.testing.assert_array_equal(dc.index_topk(qp, kp, w, 32, ratio=1, start_pos=Tc - 1), want_k,
                                      err_msg=f"{lv} top-k")


@pytest.mark.parametrize("kscale", [-60, 0, 60])
def test_factored_head_sum_at_its_range_bounds(at_level, kscale):
    """The VNNI path's factored head sum (ix4_tiles_vnni: 2^(ek - 127) times the sum of
    relu(N) w 2^(eq - 129)) holds only while every term is normal and finite at both
    scales: weights swept across 2^-130 .. 2^120 against keys at 2^kscale take it on
    both sides of its lower (terms below the normals once scaled: the oracle rounds
    them there) and upper bound (sums past the largest float)."""
    rng = np.random.default_rng(146 + kscale)
    Tc, Di, Hi = 48, 128, 16
    qp = dc.fp4_pack(_grid(rng, (1, 1, Hi, Di)))
    kp = dc.fp4_pack(_grid(rng, (1, Tc, Di)) * np.float32(2.0 ** kscale))
    w0 = rng.standard_normal((1, 1, Hi)).astype(np.float32)
    for e in range(-130, 121, 3):
        w = w0 * np.float32(2.0 ** e)
        at_level("ref")
        want = dc.index_scores(qp, kp, w, ratio=1, start_pos=Tc - 1)
        for lv in LEVELS[1:]:
            at_level(lv)
            _same(dc.index_scores(qp, kp, w, ratio=1, start_pos=Tc - 1), want, f"{lv} scores, w at 2^{e}")


@pytest.mark.parametrize("S, Tc, sp", [(1, 4096, 16383), (3, 700, 2797), (20, 600, 2380),
                                       (300, 128, 0)])
def test_bitwise_identical_at_1_2_3_threads(S, Tc, sp):
    rng = np.random.default_rng(S + Tc)
    qp, kp, w = make_case(rng, 1, S, 64, 128, Tc, "spread")
    same_bits_at_thread_counts(lambda: (
        dc.index_scores(qp, kp, w, ratio=4, start_pos=sp),
        dc.index_topk(qp, kp, w, 100, ratio=4, start_pos=sp),
        dc.index_topk(qp, kp, w, 100, ratio=4, start_pos=sp, order="position")))


FEATURE_CODE = """
import sys, numpy as np, deepseek_csa as dc
z = np.load(sys.argv[1])
outs = {}
for i in range(int(z["n"])):
    qp, kp, w = z[f"q{i}"], z[f"k{i}"], z[f"w{i}"]
    r, sp, K = (int(v) for v in z[f"a{i}"])
    for lv in dc.ISA_LEVELS:
        if dc.ISA_LEVELS.index(lv) <= dc.ISA_LEVELS.index(dc.best_isa()):
            dc.set_isa(lv)
            outs[f"s{lv}{i}"] = dc.index_scores(qp, kp, w, ratio=r, start_pos=sp)
            outs[f"t{lv}{i}"] = dc.index_topk(qp, kp, w, K, ratio=r, start_pos=sp)
outs["features"] = np.array(dc._core._build_info()["cpu_features"])
np.savez(sys.argv[2], **outs)
"""


FEATURE_SETS = [None, "none", "vnni_vbmi bf16", "amx_int8"]


def test_every_level_with_every_feature_set(tmp_path, at_level):
    """In a process per set of CPU features, every level gives the oracle's bits: all
    (level amx on AMX-INT8 tiles); none (the AVX-512 levels take VPMADDUBSW pairs);
    without amx_int8 (level amx takes VPDPBUSD); amx_int8 alone (the tiles on keys laid
    out for VPMADDUBSW: offset 48, blocks prescaled within 2^2)."""
    rng = np.random.default_rng(11)
    z, cases = {}, []
    for i, (shape, kind) in enumerate([(SHAPES[0], "plain"), (SHAPES[2], "spread"),
                                       (SHAPES[5], "zeros"), (SHAPES[1], "codes"),
                                       (SHAPES[3], "weights"), (SHAPES[6], "spread"),
                                       (SHAPES[7], "plain"), (SHAPES[9], "weights")]):
        B, S, Hi, Di, Tc, r, sp = shape
        qp, kp, w = make_case(rng, B, S, Hi, Di, Tc, kind)
        z.update({f"q{i}": qp, f"k{i}": kp, f"w{i}": w, f"a{i}": np.array([r, sp, 50])})
        cases.append((qp, kp, w, r, sp, 50))
    for Di in (128, 160):
        i = len(cases)
        qp, kp, w = bound_case(Di)
        z.update({f"q{i}": qp, f"k{i}": kp, f"w{i}": w, f"a{i}": np.array([1, 31, 20])})
        cases.append((qp, kp, w, 1, 31, 20))
    z["n"] = len(cases)
    np.savez(tmp_path / "in.npz", **z)
    at_level("ref")
    refs = [(dc.index_scores(qp, kp, w, ratio=r, start_pos=sp),
             dc.index_topk(qp, kp, w, K, ratio=r, start_pos=sp)) for qp, kp, w, r, sp, K in cases]
    have = dc._core._build_info()["cpu_features"].split()
    for feat in FEATURE_SETS:
        env = {k: v for k, v in os.environ.items() if k != "DEEPSEEK_CSA_CPU_FEATURES"}
        if feat is not None:
            env["DEEPSEEK_CSA_CPU_FEATURES"] = feat
        out = tmp_path / f"out-{feat}.npz"
        subprocess.run([sys.executable, "-c", FEATURE_CODE, str(tmp_path / "in.npz"), str(out)],
                       env=env, check=True)
        got = np.load(out)
        if feat is not None:
            assert str(got["features"]).split() == [f for f in feat.split() if f in have]
        for i, (sc, tk) in enumerate(refs):
            for lv in LEVELS:
                what = f"{lv}, case {i}, features {str(got['features'])!r}"
                _same(got[f"s{lv}{i}"], sc, what)
                np.testing.assert_array_equal(got[f"t{lv}{i}"], tk, err_msg=what)


REFUSED_CODE = """
import ctypes, warnings
class stack_t(ctypes.Structure):
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]
# an alternate signal stack too small for the tile state: Linux then refuses the
# permission to use it (ARCH_REQ_XCOMP_PERM fails with ENOSPC)
buf = ctypes.create_string_buffer(4096)
assert ctypes.CDLL(None).sigaltstack(ctypes.byref(stack_t(ctypes.addressof(buf), 0, 4096)), None) == 0
import numpy as np, deepseek_csa as dc
q, k, w = np.zeros((1, 1, 2, 32), np.float32), dc.fp4_pack(np.zeros((1, 16, 32), np.float32)), np.ones((1, 1, 2), np.float32)
with warnings.catch_warnings(record=True) as r:
    warnings.simplefilter("always")
    for _ in range(2):
        dc.index_topk(q, k, w, 4, ratio=1, start_pos=15)
        dc.index_scores(q, k, w, ratio=1, start_pos=15)
print(dc.best_isa(), len(r), *[str(x.message) for x in r])
"""


@pytest.mark.skipif(dc.best_isa() != "amx", reason="needs a CPU with AMX this process may use")
def test_refused_tiles_run_the_vnni_path_and_say_so_once():
    r = subprocess.run([sys.executable, "-c", REFUSED_CODE], capture_output=True, text=True, check=True)
    level, n, msg = r.stdout.split(" ", 2)
    assert (level, n) == ("avx512", "1"), r.stdout
    assert "refused" in msg and "AVX512_VNNI" in msg
