"""index_scores(..., rounding="bf16"): the roundings of the released indexer's bfloat16
torch expression, ``(einsum("bshd,btd->bsht", q, k).relu_() * w[..., None]).sum(dim=2)``
with bfloat16 q, k and w, so that torch.topk of the scores picks what the released code
picks (deepseek_csa.torch.fused_indexer, the runner's decode path).

Reference: that torch expression itself, on FP4-grid q and k (the released indexer
rounds both to FP4 before scoring), never our code.  Error budget: zero -- each head's
dot product of FP4-grid rows is exact in float32 in any order (block exponents within
2^2 here, so every partial sum fits 24 bits), and every later step is a rounding the
mode claims to make in torch's order; any differing bit is a bug.  Shapes: heads below
one 16-head chunk of torch's sum, chunks plus a tail, the released 64, and 300 (its
second level, after 256 heads); entries 1 to 16384, on and off torch's 32-column
groups (its last T % 32 columns sum the heads in another order); batch 2.  Also: every ISA level the
oracle's bits, 1 / 2 / 3 threads the same bits, the arguments refused, the torch
operator (no gradient in this mode)."""
import numpy as np
import pytest

import deepseek_csa as dc
from conftest import same_bits_at_thread_counts

torch = pytest.importorskip("torch")

LEVELS = [lv for lv in dc.ISA_LEVELS
          if dc.ISA_LEVELS.index(lv) <= dc.ISA_LEVELS.index(dc.best_isa())]


def _grid(rng, shape, scale=1.0):
    return dc.fp4_round((rng.standard_normal(shape) * scale).astype(np.float32), 32)


def _case(B, H, D, T, seed, cancel=True):
    """FP4-grid q [B, 1, H, D] (bf16), k [B, T, D] (float32) and weights [B, 1, H] (bf16).
    cancel: pairs of heads (the same query row, weights +-2^22 and +-2^21) whose huge
    terms cancel exactly, so that the float32 sum keeps the small terms' bits or loses
    them depending on where the partial sums meet: with Gaussian terms alone, summing
    the heads in another order changes ~1 bfloat16 score in 10^4, here ~1 in 2."""
    rng = np.random.default_rng(seed)
    qn = _grid(rng, (B, 1, H, D))
    w = (rng.standard_normal((B, 1, H)) * 0.3).astype(np.float32)
    if H > 2:
        w[:, :, 1] = 0.0                 # a zero weight: relu(dot) * 0
        w[:, :, 2] = -abs(w[:, :, 2])    # negative terms
    if cancel:
        for a, b, e in ((0, H // 2, 22), (H // 4 + 1, H - 1, 21), (3, 3 + 16, 22)):
            if 3 <= a < b < H:
                qn[:, :, b] = qn[:, :, a]
                w[:, :, a], w[:, :, b] = 2.0 ** e, -2.0 ** e
    q = torch.from_numpy(qn).bfloat16()
    k = _grid(rng, (B, T, D), 2.0)
    return q, k, torch.from_numpy(w).bfloat16()


def _released(q, k, w):
    kt = torch.from_numpy(k).bfloat16()
    return (torch.einsum("bshd,btd->bsht", q, kt).relu_() * w.unsqueeze(-1)).sum(dim=2)


def _ours(q, k, w):
    T = k.shape[1]
    return dc.index_scores(q, dc.fp4_pack(k), w, ratio=1, start_pos=T - 1, rounding="bf16")


SHAPES = [  # B, H, D, T: torch's head order differs below and past 32 floor(T / 32)
    (1, 4, 32, 1),
    (1, 7, 32, 40),        # lanes of one head, 3 left over
    (1, 17, 96, 33),       # one left over
    (2, 40, 64, 70),
    (1, 64, 128, 1000),
    (2, 64, 128, 4099),
    (1, 64, 128, 16384),
    (1, 300, 64, 100),     # the cascade's second level (256 heads)
]


@pytest.fixture
def at_level():
    before = dc.get_isa()
    yield dc.set_isa
    dc.set_isa(before)


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_bitwise_the_released_bf16_expression(at_level, shape):
    B, H, D, T = shape
    q, k, w = _case(B, H, D, T, seed=sum(shape))
    want = _released(q, k, w)
    for lv in LEVELS:
        at_level(lv)
        got = torch.from_numpy(_ours(q, k, w))
        assert torch.equal(got.bfloat16().float(), got), f"{lv}: values not bfloat16"
        bad = (got.bfloat16().view(torch.int16) != want.view(torch.int16)).sum().item()
        assert bad == 0, f"{lv}: {bad} of {want.numel()} scores differ"


def test_float32_rounding_differs_where_the_roundings_matter():
    """The default (every step float32) is not the released bits: the mode is needed."""
    q, k, w = _case(1, 64, 128, 1000, seed=3, cancel=False)
    f32 = torch.from_numpy(dc.index_scores(q, dc.fp4_pack(k), w, ratio=1, start_pos=999))
    assert (f32.bfloat16() != _released(q, k, w)).any()


def test_nan_and_infinite_weights():
    q, k, w = _case(1, 20, 64, 40, seed=4)
    w[0, 0, 3] = float("inf")
    w[0, 0, 5] = float("nan")
    got = torch.from_numpy(_ours(q, k, w))
    want = _released(q, k, w)
    assert torch.equal(torch.isnan(got), torch.isnan(want.float()))
    ok = ~torch.isnan(got)
    assert torch.equal(got[ok], want.float()[ok])


def test_same_bits_at_1_2_3_threads():
    q, k, w = _case(1, 64, 128, 4096, seed=5)
    kp = dc.fp4_pack(k)
    same_bits_at_thread_counts(
        lambda: (dc.index_scores(q, kp, w, ratio=4, start_pos=4 * 4096 - 1, rounding="bf16"),))


def test_arguments_refused():
    q, k, w = _case(1, 8, 32, 5, seed=6)
    with pytest.raises(TypeError, match="rounding=\"bf16\" needs FP4 keys"):
        dc.index_scores(q, torch.from_numpy(k).bfloat16(), w, ratio=1, start_pos=4,
                        rounding="bf16")
    with pytest.raises(ValueError, match="'rounding' must be"):
        dc.index_scores(q, dc.fp4_pack(k), w, ratio=1, start_pos=4, rounding="bfloat16")


def test_torch_operator_and_no_gradient():
    import deepseek_csa.torch  # noqa: F401  registers torch.ops.deepseek_csa
    q, k, w = _case(1, 20, 64, 40, seed=7)
    kp = torch.from_numpy(dc.fp4_pack(k))
    got = torch.ops.deepseek_csa.index_scores(q, kp, w, 1, 39, rounding="bf16")
    assert torch.equal(got.bfloat16(), _released(q, k, w))
    qg = q.float().requires_grad_()
    s = torch.ops.deepseek_csa.index_scores(qg, kp, w.float(), 1, 39, rounding="bf16")
    with pytest.raises(RuntimeError, match="has no gradient"):
        s.sum().backward()
