"""The kernels as PyTorch operators (deepseek_csa/torch/ops.py): every operator passes
``torch.library.opcheck`` (schema, fake kernel, autograd registration, aot_dispatch static
and dynamic) on small odd shapes and one released shape, in float32 and bfloat16; the
direct eager path gives the dispatcher's bits; the differentiable functions compile
with ``fullgraph=True`` forward and backward, equal to eager; a module calling them
exports, and the saved ExportedProgram loads and runs in a fresh process.

The arithmetic of each kernel is tested against its reference elsewhere (test_attn.py,
test_grad_*.py, ...): here the question is only whether torch sees the same thing
through each door, so comparisons are bitwise where the same kernel runs, and at the
float32 budget of the kernel where torch.compile may reorder torch's own arithmetic
around it (the conversions and reductions outside our kernels).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deepseek_csa as dc  # noqa: E402
import deepseek_csa.torch as dct  # noqa: E402
from deepseek_csa.torch import ops  # noqa: E402

O = torch.ops.deepseek_csa
F32, BF16 = torch.float32, torch.bfloat16


def _gen(seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, dtype=F32, grad=False: torch.randn(
        *shape, generator=g).to(dtype).requires_grad_(grad)


def _idx(B, S, K, N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, N, (B, S, K), generator=g, dtype=torch.int32)


def _bytes(t):
    return t.view(torch.uint8)


def _rope(S, n):
    cos, sin = dc.rope_table(n, S, base=10000.0)
    return torch.from_numpy(cos), torch.from_numpy(sin)


# --------------------------------------------------------------------------- registry
# One or more cases per operator: (name, shape kind, builder(dtype) -> args).  "odd" are
# small shapes off every tile (T not a multiple of the ratio, p mid-group, batch > 1),
# "released" one V4-Flash shape cut to few rows.  Builders return None where the
# kernel takes float32 only.
def _cases():
    C = []

    def case(name, kind, build, dtypes=(F32, BF16)):
        for dt in dtypes:
            C.append(pytest.param(name, build, dt, id=f"{name}-{kind}-{str(dt)[6:]}"))

    r = _gen()
    case("rms_norm", "odd", lambda dt: (r(2, 3, 40, dtype=dt, grad=True), r(40, grad=True), 1e-6))
    case("rms_norm", "noweight", lambda dt: (r(5, 24, dtype=dt, grad=True), None, 1e-6))
    case("rms_norm", "released", lambda dt: (r(1, 2, 4096, dtype=dt, grad=True), r(4096, grad=True),
                                             1e-6))
    case("rms_norm_backward", "odd", lambda dt: (r(3, 40, dtype=dt), r(3, 40, dtype=dt), r(40),
                                                 1e-6))
    case("apply_rope", "odd", lambda dt: (r(2, 5, 3, 16, dtype=dt, grad=True), *_rope(5, 16), False))
    case("apply_rope", "released", lambda dt: (r(1, 3, 64, 64, dtype=dt, grad=True), *_rope(3, 64),
                                               True))
    case("apply_rope_", "odd", lambda dt: (r(2, 5, 16, dtype=dt), *_rope(5, 16), False))
    case("gated_pool", "overlap", lambda dt: (r(2, 11, 64, dtype=dt, grad=True),
                                              r(2, 11, 64, dtype=dt, grad=True), 4, r(4, 64, grad=True),
                                              True))
    case("gated_pool", "plain", lambda dt: (r(1, 9, 24, dtype=dt, grad=True),
                                            r(1, 9, 24, dtype=dt, grad=True), 3, None, False))
    case("gated_pool", "released", lambda dt: (r(1, 256, 512, dtype=dt, grad=True),
                                               r(1, 256, 512, dtype=dt, grad=True), 128,
                                               r(128, 512, grad=True), False))
    case("gated_pool_backward", "odd", lambda dt: (r(2, 2, 32), r(2, 11, 64, dtype=dt),
                                                   r(2, 11, 64, dtype=dt), 4, r(4, 64), True))
    case("gated_pool_backward", "plain", lambda dt: (r(1, 3, 24, dtype=dt), r(1, 9, 24, dtype=dt),
                                                     r(1, 9, 24, dtype=dt), 3, None, False))
    case("index_scores", "odd", lambda dt: (r(2, 5, 3, 32, grad=True), r(2, 4, 32, grad=True),
                                            r(2, 5, 3, grad=True), 4, 7), dtypes=(F32,))
    case("index_scores", "bf16", lambda dt: (r(2, 5, 3, 32, dtype=dt), r(2, 4, 32, dtype=dt),
                                             r(2, 5, 3), 4, 7), dtypes=(BF16,))
    case("index_scores_backward", "odd", lambda dt: (r(2, 5, 4), r(2, 5, 3, 32), r(2, 4, 32),
                                                     r(2, 5, 3), 4, 7), dtypes=(F32,))
    case("index_topk", "odd", lambda dt: (r(2, 5, 3, 32, dtype=dt), r(2, 6, 32, dtype=dt),
                                          r(2, 5, 3), 3, 4, 13, 7, "score", None, 0))
    case("index_topk", "released", lambda dt: (r(1, 2, 64, 128, dtype=dt), r(1, 600, 128, dtype=dt),
                                               r(1, 2, 64), 512, 4, 2398, 128, "position", None, 0))
    case("topk_indices", "odd", lambda dt: (r(2, 5, 6), 3, 4, 13, 0, "score", None, 0),
         dtypes=(F32,))
    case("topk_indices", "candidates", lambda dt: (r(1, 3, 9), 4, 2, 16, 5, "position",
                                                   torch.tensor([[[True, False, True]] * 3]), 4),
         dtypes=(F32,))
    case("select_candidate_blocks", "odd", lambda dt: (r(2, 5, 9), 2, 4, 2, 13), dtypes=(F32,))
    case("window_topk_idxs", "prefill", lambda dt: (8, 2, 5, 0), dtypes=(F32,))
    case("window_topk_idxs", "decode", lambda dt: (8, 2, 1, 11), dtypes=(F32,))
    case("compress_topk_idxs", "prefill", lambda dt: (4, 2, 9, 0, 9), dtypes=(F32,))
    case("compress_topk_idxs", "decode", lambda dt: (4, 1, 1, 17, 128), dtypes=(F32,))
    case("sparse_attn", "odd", lambda dt: (r(2, 5, 3, 24, dtype=dt, grad=True),
                                           r(2, 9, 24, dtype=dt, grad=True), r(3, grad=True),
                                           _idx(2, 5, 6, 9), 0.2))
    case("sparse_attn", "released", lambda dt: (r(1, 2, 64, 512, dtype=dt, grad=True),
                                                r(1, 700, 512, dtype=dt, grad=True), r(64, grad=True),
                                                _idx(1, 2, 640, 700), 512 ** -0.5))
    case("sparse_attn_backward", "odd", lambda dt: (r(2, 5, 3, 24, dtype=dt), r(2, 5, 3, 24, dtype=dt),
                                                    r(2, 9, 24, dtype=dt), r(3), _idx(2, 5, 6, 9), 0.2,
                                                    *O.sparse_attn(r(2, 5, 3, 24, dtype=dt),
                                                                   r(2, 9, 24, dtype=dt), r(3),
                                                                   _idx(2, 5, 6, 9), 0.2)))
    case("sparse_attn_weights", "odd", lambda dt: (r(2, 5, 3, 24, dtype=dt), r(2, 9, 24, dtype=dt),
                                                   r(3), _idx(2, 5, 6, 9), 0.2))

    def kl(dt):
        q, k, w = r(2, 5, 3, 32, grad=True), r(2, 4, 32, grad=True), r(2, 5, 3, grad=True)
        idx = O.index_topk(q.detach(), k.detach(), w.detach(), 3, 4, 11, 0, "score", None, 0)
        return q, k, w, idx, torch.rand(idx.shape), 4, 11, None, "selected", None

    def kl_joint(dt):
        # joint probabilities (rows sum to <= 1), per-query positions (a left-padded row),
        # a clip that bites
        q, k, w = r(2, 5, 3, 32, grad=True), r(2, 4, 32, grad=True), r(2, 5, 3, grad=True)
        pos = torch.tensor([[11, 12, 13, 14, 15], [1, 1, 0, 1, 3]], dtype=torch.int32)
        idx = torch.tensor([[[0, 1, 2]] * 5, [[-1] * 3] * 4 + [[-1, 0, -1]]], dtype=torch.int32)
        return q, k, w, idx, torch.rand(idx.shape) / 4, 4, 0, pos, "joint", -1.0
    case("indexer_kl_loss", "sparse", kl, dtypes=(F32,))
    case("indexer_kl_loss", "joint", kl_joint, dtypes=(F32,))
    case("indexer_kl_loss", "dense", lambda dt: (r(1, 3, 2, 32, grad=True), r(1, 4, 32, grad=True),
                                                 r(1, 3, 2, grad=True), None, torch.rand(1, 3, 4), 2, 5,
                                                 None, "selected", -100.0),
         dtypes=(F32,))
    for nm, scale, blk in (("fp8_round", "ue8m0", 64), ("fp8_round", "fp32", 32),
                           ("fp4_round", "ue8m0", 32), ("fp4_round", "e4m3", 16)):
        case(nm, scale, lambda dt, blk=blk, scale=scale: (r(3, 5, 128, dtype=dt, grad=True), blk,
                                                          scale))
        case(nm + "_", scale, lambda dt, blk=blk, scale=scale: (r(3, 128, dtype=dt), blk, scale))
    case("hadamard", "normalized", lambda dt: (r(3, 5, 128, dtype=dt, grad=True), None))
    case("hadamard", "scaled", lambda dt: (r(2, 64, dtype=dt, grad=True), 0.5))

    def gemm(name):
        def build(dt):
            a, b = r(3, 256), r(72, 256)
            qa, sa = O.fp8_quant(a, 128, "ue8m0", "float32")
            if name == "fp8_gemm":
                qb, sb = O.fp8_quant(b, 128, "ue8m0", "float32")
                sb = torch.ones(1, 2)
            else:
                qb, sb = O.fp4_quant(b, 32, "ue8m0", "e8m0")
            # opcheck's schema test multiplies inputs; float8 has no CPU multiply: bytes
            return _bytes(qa), sa, _bytes(qb), _bytes(sb) if sb.dtype != F32 else sb, dt, None
        return build
    case("fp8_gemm", "odd", gemm("fp8_gemm"))
    case("fp4_gemm", "odd", gemm("fp4_gemm"))

    def wfp8(groups):
        def build(dt):
            qb, _ = O.fp8_quant(r(2 * 72, 256), 128, "ue8m0", "float32")
            shape = (3, groups, 256) if groups > 1 else (3, 256)
            return r(*shape, dtype=dt), _bytes(qb), r(2, 2).abs() + 0.5, groups, dt
        return build
    case("wfp8_gemm", "odd", wfp8(1))
    case("wfp8_gemm", "groups", wfp8(2))
    case("wbf16_gemm", "odd", lambda dt: (r(3, 5, 200, dtype=dt), r(37, 200, dtype=BF16), F32),
         dtypes=(F32,))
    case("fp8_quant", "odd", lambda dt: (r(3, 5, 256, dtype=dt), 128, "ue8m0", "e8m0"))
    case("fp8_quant", "fp32", lambda dt: (r(2, 64, dtype=dt), 32, "fp32", "float32"))
    case("fp4_quant", "e8m0", lambda dt: (r(3, 64, dtype=dt), 32, "ue8m0", "e8m0"))
    case("fp4_quant", "e4m3", lambda dt: (r(3, 64, dtype=dt), 16, "e4m3", "e4m3"))
    case("fp4_pack", "on grid", lambda dt: (O.fp4_round(r(2, 3, 64, dtype=dt), 32, "ue8m0"), False))
    case("fp4_pack", "round", lambda dt: (r(5, 96, dtype=dt), True))
    # rows of repeated tokens (their order matters in bf16), skipped indices (-1, 3)
    case("moe_combine", "odd", lambda dt: (r(7, 5, dtype=dt), torch.tensor([2, 0, 2, -1, 1, 3, 2]),
                                           3))
    case("moe_combine", "one token", lambda dt: (r(6, 40, dtype=dt),
                                                 torch.tensor([0, 0, -1, 0, 0, 0]), 1))
    case("hc_split_sinkhorn", "odd", lambda dt: (r(2, 3, 24), torch.rand(3), r(24), 4, 20, 1e-6),
         dtypes=(F32,))
    return C


CASES = _cases()


def test_every_operator_has_a_case():
    covered = {p.values[0] for p in CASES}
    assert covered == set(ops.OPS), sorted(set(ops.OPS) ^ covered)


@pytest.mark.parametrize("name,build,dtype", CASES)
def test_opcheck(name, build, dtype):
    args = build(dtype)
    torch.library.opcheck(ops.OPS[name], args)


def _outs(r):
    return r if isinstance(r, tuple) else () if r is None else (r,)


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int16) \
        if t.dtype == BF16 else t


@pytest.mark.parametrize("name,build,dtype",
                         [p for p in CASES if p.values[0] not in ops.DIFFERENTIABLE])
def test_gradless_operator_reads_requires_grad_inputs(name, build, dtype):
    """An operator without a gradient formula (integer lists, quantized copies, the
    backward kernels) reads tensors that require grad as plain data: no error, the bits
    of the call on detached inputs, and no result that autograd could differentiate
    (integer results do not require grad)."""
    args = build(dtype)
    want = [t.clone() for t in _outs(ops.OPS[name](*[a.detach().clone() if isinstance(
        a, torch.Tensor) else a for a in args]))]
    mutated = name.endswith("_")            # the in-place ops rotate / round args[0]
    grad_args = [a.detach().clone().requires_grad_(a.is_floating_point() and bool(i or not mutated))
                 if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    for door in (ops.OPS[name], lambda *a: ops.call(name, *a)):
        a = [t.clone() if isinstance(t, torch.Tensor) and mutated and not i else t
             for i, t in enumerate(grad_args)]
        got = _outs(door(*a))
        if mutated:
            got = (a[0],)
        assert len(got) == len(want) or mutated
        for u, v in zip(got, want if not mutated else got):
            assert torch.equal(_bits(u.detach()), _bits(v))
            if not (u.is_floating_point() or u.is_complex()):
                assert not u.requires_grad


def _combine_reference(rows, index, num_tokens):
    """One row at a time, in order, each sum rounded to rows' dtype (what a loop of
    per-expert index_add_ calls computes); out-of-range indices add nothing."""
    out = [[torch.zeros((), dtype=rows.dtype) for _ in range(rows.shape[1])]
           for _ in range(num_tokens)]
    for p, t in enumerate(index.tolist()):
        if 0 <= t < num_tokens:
            for h in range(rows.shape[1]):
                out[t][h] = (out[t][h].float() + rows[p, h].float()).to(rows.dtype)
    return torch.stack([torch.stack(r) for r in out]) if num_tokens else \
        rows.new_zeros((0, rows.shape[1]))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("P,T", [(1, 1), (6, 1), (13, 4), (40, 9), (5, 0)])
def test_moe_combine_adds_rows_in_order(dtype, P, T):
    """moe_combine against the element-wise reference: rows of very different
    magnitudes (so the order of a token's adds shows in the rounding), repeated tokens,
    indices -1 and T skipped; the inputs unchanged."""
    g = torch.Generator().manual_seed(P * 31 + T)
    scale = torch.exp2(torch.randint(-9, 10, (P, 1), generator=g).float())
    rows = (torch.randn(P, 3, generator=g) * scale).to(dtype)
    index = torch.randint(-1, T + 1, (P,), generator=g)
    r0, i0 = rows.clone(), index.clone()
    want = _combine_reference(rows, index, T)
    for door in (O.moe_combine, lambda *a: ops.call("moe_combine", *a)):
        got = door(rows, index, T)
        assert got.dtype == dtype and got.shape == (T, 3)
        assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(rows, r0) and torch.equal(index, i0)


def test_moe_combine_bad_arguments_name_them():
    rows, index = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    for args, what in (((rows[0], index, 2), "rows"), ((rows.long(), index, 2), "rows"),
                       ((rows, index.int(), 2), "index"), ((rows, index[:3], 2), "index"),
                       ((rows, index, -1), "num_tokens")):
        with pytest.raises(ValueError, match=f"moe_combine: '{what}'"):
            ops.call("moe_combine", *args)


# --------------------------------------------------------------------------- direct path
def test_direct_path_gives_the_dispatchers_bits():
    r = _gen(3)
    x, w = r(4, 100), r(100)
    q, kv, sink, idx = r(1, 3, 4, 32, dtype=BF16), r(1, 7, 32, dtype=BF16), r(4), _idx(1, 3, 5, 7)
    with torch.no_grad():
        assert ops.direct(x, w, torch.nn.Parameter(w))
        for name, args in (("rms_norm", (x, w, 1e-6)), ("sparse_attn", (q, kv, sink, idx, 0.3)),
                           ("hadamard", (x[:, :64], None))):
            a, b = ops.call(name, *args), ops.OPS[name](*args)
            for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert torch.equal(u.view(torch.int16) if u.dtype == BF16 else u,
                                   v.view(torch.int16) if v.dtype == BF16 else v), name


def test_direct_path_is_not_taken_where_something_watches():
    x = torch.randn(2, 8)
    assert ops.direct(x, 3, None)
    assert not ops.direct(x.requires_grad_())
    with torch.no_grad():
        assert ops.direct(x)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not ops.direct(torch.empty(2))
    with torch.inference_mode():
        assert ops.direct(torch.empty(2))


# --------------------------------------------------------------------------- torch.compile
def _dropin_cases():
    r = _gen(5)
    fc = torch.polar(torch.ones(5, 8), torch.randn(5, 8))

    def rope(x):
        y = x * 1.0
        dct.apply_rotary_emb(y[..., -16:], fc)
        return y

    def qat(x):
        y = x * 1.0
        dct.act_quant(y, 64, "ue8m0", None, True)
        dct.fp4_act_quant(y, 32, True)
        return y

    idx = _idx(2, 5, 6, 9)
    ti = O.index_topk(torch.randn(2, 5, 3, 32), torch.randn(2, 4, 32), torch.randn(2, 5, 3), 3, 4,
                      11, 0, "score", None, 0)
    target = torch.rand(ti.shape, generator=torch.Generator().manual_seed(0))
    return [
        ("rms_norm", lambda x, w: dct.rms_norm(x, w, 1e-6), (r(2, 5, 40), r(40))),
        ("apply_rotary_emb", rope, (r(2, 5, 3, 24),)),
        ("sparse_attn", lambda q, kv, s: dct.sparse_attn(q, kv, s, idx, 0.3),
         (r(2, 5, 3, 24), r(2, 9, 24), r(3))),
        ("gated_pool", lambda kv, sc, ape: dct.gated_pool(kv, sc, 4, ape=ape, overlap=True),
         (r(2, 11, 64), r(2, 11, 64), r(4, 64))),
        ("index_scores", lambda q, k, w: dct.index_scores(q, k, w, ratio=4, start_pos=7)
         .clamp_min(-1e4), (r(2, 5, 3, 32), r(2, 4, 32), r(2, 5, 3))),
        ("indexer_kl_loss", lambda q, k, w: dct.indexer_kl_loss(q, k, w, ti, target, ratio=4,
                                                                start_pos=11),
         (r(2, 5, 3, 32), r(2, 4, 32), r(2, 5, 3))),
        ("indexer_kl_loss_joint", lambda q, k, w: dct.indexer_kl_loss(
            q, k, w, ti, target / 4, ratio=4, positions=torch.arange(11, 16)[None],
            target="joint", clip=-1.0), (r(2, 5, 3, 32), r(2, 4, 32), r(2, 5, 3))),
        ("rotate_activation", dct.rotate_activation, (r(3, 64),)),
        ("qat", qat, (r(3, 128),)),
    ]


@pytest.mark.parametrize("name,fn,args", _dropin_cases(), ids=[c[0] for c in _dropin_cases()])
def test_compile_fullgraph_forward_and_backward(name, fn, args):
    """Each differentiable function compiles into one graph (no break at our kernels),
    forward and backward, and gives eager's values and gradients: bitwise where only
    our kernels run, at float32 rounding where torch's own ops around them are fused."""
    torch._dynamo.reset()
    eager_in = [a.clone().requires_grad_() for a in args]
    comp_in = [a.clone().requires_grad_() for a in args]
    ye = fn(*eager_in)
    ge = torch.randn(ye.shape, generator=torch.Generator().manual_seed(1))
    (ye * ge).sum().backward()
    cf = torch.compile(fn, fullgraph=True, backend="aot_eager")
    yc = cf(*comp_in)
    (yc * ge).sum().backward()
    torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-6)
    for a, b in zip(comp_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_compile_inductor_explain_has_no_break():
    """With the default backend (inductor), a block of the ops the attention uses is one
    graph: dynamo's explain reports no graph break."""
    r = _gen(7)
    q, kv, sink, w = r(1, 4, 2, 32), r(1, 6, 32), r(2), r(32)
    fc = torch.polar(torch.ones(4, 8), torch.randn(4, 8))

    def block(q, kv):
        q = dct.rms_norm(q, None, 1e-6)
        dct.apply_rotary_emb(q[..., -16:], fc)
        idx = dct.get_window_topk_idxs(4, 1, 4, 0)
        kv = dct.rms_norm(kv, w, 1e-6)
        return dct.sparse_attn(q, kv, sink, idx, 0.25)

    with torch.no_grad():
        ex = torch._dynamo.explain(block)(q.clone(), kv)
        assert ex.graph_break_count == 0, ex.break_reasons
        torch._dynamo.reset()
        got = torch.compile(block, fullgraph=True)(q.clone(), kv)
        want = block(q.clone(), kv)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- torch.export
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.w = torch.nn.Parameter(torch.randn(32, generator=g))
        self.sink = torch.nn.Parameter(torch.randn(2, generator=g))

    def forward(self, q, kv):
        q = dct.rms_norm(q, None, 1e-6)
        kv = dct.rms_norm(kv, self.w, 1e-6)
        q = dct.rotate_activation(q)
        idx = dct.get_window_topk_idxs(4, q.shape[0], q.shape[1], 0)
        return dct.sparse_attn(q, kv, self.sink, idx, 0.25)


def test_export_save_load_in_a_fresh_process(tmp_path):
    m = _Block()
    r = _gen(13)
    q, kv = r(1, 4, 2, 32), r(1, 4, 32)
    ep = torch.export.export(m, (q, kv), strict=False)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"deepseek_csa.rms_norm.default", "deepseek_csa.sparse_attn.default",
            "deepseek_csa.hadamard.default"} <= targets, targets
    with torch.no_grad():
        want = m(q, kv)
    torch.testing.assert_close(ep.module()(q, kv), want, rtol=0, atol=0)
    path = tmp_path / "block.pt2"
    torch.export.save(ep, str(path))
    np.save(tmp_path / "q.npy", q.numpy())
    np.save(tmp_path / "kv.npy", kv.numpy())
    np.save(tmp_path / "want.npy", want.numpy())
    code = (
        "import sys, numpy as np, torch, deepseek_csa.torch\n"
        f"d = {str(tmp_path)!r}\n"
        "ep = torch.export.load(d + '/block.pt2')\n"
        "q, kv = (torch.from_numpy(np.load(d + f'/{n}.npy')) for n in ('q', 'kv'))\n"
        "got = ep.module()(q, kv).detach().numpy()\n"
        "assert np.array_equal(got, np.load(d + '/want.npy')), abs(got - np.load(d + '/want.npy')).max()\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# --------------------------------------------------------------------------- C++ kernels
# deepseek_csa.torch._native (csrc/torch/native.cpp): C++ CPU and autograd kernels for
# the operators in ops.NATIVE, in front of their Python kernels, which keep every case
# the C++ plain path does not take.  The question again is only whether torch sees the
# same thing: the C++ path's bits against the Python kernel's (both run the same C
# kernel), the same errors, the same gradients, and the fallbacks.
_native_built = __import__("importlib.util").util.find_spec("deepseek_csa.torch._native")
needs_native = pytest.mark.skipif(
    _native_built is None or not ops.NATIVE,
    reason="deepseek_csa.torch._native is not built or not loaded (setup.py builds it where "
           "torch is importable at build time)")


def _native_kernel_registered(name, key):
    dump = torch._C._dispatch_dump(f"deepseek_csa::{name}")
    return any(line.startswith(key + ":") and "native.cpp" in line for line in dump.splitlines())


@needs_native
def test_native_operators_have_cpp_cpu_and_autograd_kernels():
    assert {"rms_norm", "apply_rope_", "fp8_quant", "fp8_gemm", "fp4_gemm",
            "hc_split_sinkhorn", "sparse_attn", "gated_pool", "moe_combine"} <= ops.NATIVE
    for name in ops.NATIVE:
        assert _native_kernel_registered(name, "CPU"), torch._C._dispatch_dump(f"deepseek_csa::{name}")
        if name in ops.DIFFERENTIABLE:
            assert _native_kernel_registered(name, "Autograd[alias]")


@needs_native
def test_native_plain_keys_are_a_plain_cpu_tensors():
    keys = torch._C._dispatch_keys(torch.empty(0)) & torch._C._after_autograd_keyset
    assert ops._NATIVE.plain_keys() == keys.raw_repr()


def _native_extra_cases():
    """Cases beyond the registry's: the layouts and arguments the C++ kernels leave to the
    Python kernel (strided, empty, other dtypes, overlap, b_index, bad arguments), and
    plain ones at other shapes.  pytest params (name, builder(dtype) -> args)."""
    r = _gen(21)
    w = r(7)

    def gemm(name, fmt, n, k, lead, b_index=None, strided_bs=False):
        def build(dt):
            g = torch.Generator().manual_seed(n * k)
            if k % 128 == 0:
                qa, sa = O.fp8_quant(r(*lead, k), 128, "ue8m0",
                                     "e8m0" if fmt == "e8m0" else "float32")
            else:    # a trailing partial block: codes and scales drawn directly
                qa = torch.randint(0, 0x7f, (*lead, k), generator=g, dtype=torch.uint8)
                qa = qa.view(torch.float8_e4m3fn)
                sa = torch.rand(*lead, (k + 127) // 128, generator=g) + 0.5
            if name == "fp8_gemm":   # codes below 0x7f: no NaN
                qb = torch.randint(0, 0x7f, (n, k), generator=g, dtype=torch.uint8)
                qb = qb.view(torch.float8_e4m3fn)
                sb = torch.rand((n + 127) // 128, (k + 127) // 128, generator=g) + 0.5
            else:
                qb = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
                qb = qb.view(torch.float4_e2m1fn_x2)
                sb = torch.randint(120, 130, (n, (k + 31) // 32), generator=g, dtype=torch.uint8)
                sb = sb.view(torch.float8_e8m0fnu)
            if strided_bs:
                sb = sb.t().contiguous().t()
            if b_index is not None:
                qb, sb = torch.stack([qb, qb]), torch.stack([sb, sb])
            return qa, sa, qb, sb, dt, b_index
        return build

    rope = _rope(3, 8)
    C = [
        ("rms_norm", "no weight", lambda dt: (r(2, 7, dtype=dt), None, 1e-6)),
        ("rms_norm", "one row, released width", lambda dt: (r(1, 4096, dtype=dt), r(4096), 1e-6)),
        ("rms_norm", "rows of one", lambda dt: (r(5, 1, dtype=dt), r(1), 1e-6)),
        ("rms_norm", "strided x", lambda dt: (r(3, 14, dtype=dt)[:, ::2], w, 1e-6)),
        ("rms_norm", "strided weight", lambda dt: (r(3, 7, dtype=dt), r(14)[::2], 1e-6)),
        ("rms_norm", "empty", lambda dt: (r(0, 7, dtype=dt), w, 1e-6)),
        ("rms_norm", "bf16 weight", lambda dt: (r(3, 7, dtype=dt), w.to(BF16), 1e-6)),
        ("rms_norm", "eps nan", lambda dt: (r(3, 7, dtype=dt), w, float("nan"))),
        ("rms_norm", "float64", lambda dt: (r(3, 7).double(), w, 1e-6)),
        ("rms_norm", "weight 2-d", lambda dt: (r(3, 7, dtype=dt), w[None], 1e-6)),
        ("apply_rope_", "4-d", lambda dt: (r(2, 3, 4, 16, dtype=dt), *_rope(3, 16), True)),
        ("apply_rope_", "last features of a strided view",
         lambda dt: (r(2, 3, 4, 24, dtype=dt)[..., 8:], *rope, False)),
        ("apply_rope_", "transposed", lambda dt: (r(2, 4, 3, 8, dtype=dt).transpose(1, 2), *rope,
                                                  False)),
        ("apply_rope_", "rope part of a wider row", lambda dt: (r(2, 3, 20, dtype=dt), *rope, False)),
        ("apply_rope_", "expanded (self-overlap)",
         lambda dt: (r(2, 3, 1, 8, dtype=dt).expand(2, 3, 4, 8), *rope, False)),
        ("apply_rope_", "cos rows do not match", lambda dt: (r(2, 4, 8, dtype=dt), *rope, False)),
        ("apply_rope_", "x over cos's memory", lambda dt: _rope_overlapping(dt)),
        ("fp8_quant", "block 128 fp32", lambda dt: (r(1, 256, dtype=dt), 128, "fp32", "float32")),
        ("fp8_quant", "strided x", lambda dt: (r(3, 512, dtype=dt)[:, ::2], 128, "ue8m0", "float32")),
        ("fp8_quant", "block does not divide", lambda dt: (r(3, 100, dtype=dt), 64, "ue8m0", "float32")),
        ("fp8_quant", "e8m0 of fp32 scales", lambda dt: (r(3, 128, dtype=dt), 128, "fp32", "e8m0")),
        ("fp8_quant", "unknown scale", lambda dt: (r(3, 128, dtype=dt), 128, "e4m3", "float32")),
        ("fp8_gemm", "float8, f32 scales", gemm("fp8_gemm", "f32", 200, 384, (2, 3))),
        ("fp8_gemm", "e8m0 activation scales, one row", gemm("fp8_gemm", "e8m0", 130, 256, (1,))),
        ("fp8_gemm", "K off the block", gemm("fp8_gemm", "f32", 64, 200, (3,))),
        ("fp8_gemm", "column-major b_s", gemm("fp8_gemm", "f32", 260, 256, (3,), strided_bs=True)),
        ("fp8_gemm", "b_index", gemm("fp8_gemm", "f32", 64, 256, (3,),
                                     b_index=torch.tensor([1, -1, 0], dtype=torch.int32))),
        ("fp4_gemm", "float4 codes", gemm("fp4_gemm", "f32", 96, 256, (2, 2))),
        ("fp4_gemm", "b_index", gemm("fp4_gemm", "e8m0", 40, 128, (2,),
                                     b_index=torch.tensor([0, 1], dtype=torch.int32))),
        ("fp4_gemm", "b_index out of range", gemm("fp4_gemm", "f32", 40, 128, (2,),
                                                  b_index=torch.tensor([0, 2], dtype=torch.int32))),
        ("fp8_gemm", "b_index grouped rows", gemm("fp8_gemm", "f32", 64, 256, (2, 4),
                                                  b_index=torch.tensor([[0, 1, 0, 1]] * 2,
                                                                       dtype=torch.int32))),
        ("sparse_attn", "decode, released width", lambda dt: (r(1, 1, 64, 512, dtype=dt),
                                                              r(1, 300, 512, dtype=dt), r(64),
                                                              _idx(1, 1, 200, 300), 512 ** -0.5)),
        ("sparse_attn", "strided kv rows", lambda dt: (r(2, 3, 4, 16, dtype=dt),
                                                       r(2, 18, 16, dtype=dt)[:, ::2], r(4),
                                                       _idx(2, 3, 5, 9), 0.25)),
        ("sparse_attn", "int64 indices", lambda dt: (r(2, 3, 4, 16, dtype=dt), r(2, 9, 16, dtype=dt),
                                                     r(4), _idx(2, 3, 5, 9).long(), 0.25)),
        ("sparse_attn", "index out of range", lambda dt: (r(1, 2, 4, 16, dtype=dt),
                                                          r(1, 9, 16, dtype=dt), r(4),
                                                          _idx(1, 2, 5, 9) + 3, 0.25)),
        ("sparse_attn", "inner stride 2", lambda dt: (r(2, 3, 4, 32, dtype=dt)[..., ::2],
                                                      r(2, 9, 16, dtype=dt), r(4), _idx(2, 3, 5, 9),
                                                      0.25)),
        ("sparse_attn", "infinite scale", lambda dt: (r(2, 3, 4, 16, dtype=dt), r(2, 9, 16, dtype=dt),
                                                      r(4), _idx(2, 3, 5, 9), float("inf"))),
        ("gated_pool", "ratio 128", lambda dt: (r(1, 300, 16, dtype=dt), r(1, 300, 16, dtype=dt),
                                                128, r(128, 16), False)),
        ("gated_pool", "ratio 1 no score", lambda dt: (r(2, 5, 8, dtype=dt), None, 1, None, False)),
        ("gated_pool", "f32 score of bf16 kv", lambda dt: (r(2, 9, 8, dtype=dt), r(2, 9, 8), 4,
                                                           r(4, 8), False)),
        ("gated_pool", "strided rows", lambda dt: (r(2, 18, 8, dtype=dt)[:, ::2], r(2, 9, 8, dtype=dt),
                                                   4, None, True)),
        ("gated_pool", "bf16 ape", lambda dt: (r(2, 9, 8, dtype=dt), r(2, 9, 8, dtype=dt), 4,
                                               r(4, 8).to(BF16), False)),
        ("gated_pool", "fewer tokens than a group", lambda dt: (r(2, 3, 8, dtype=dt),
                                                                r(2, 3, 8, dtype=dt), 4, None, True)),
        ("gated_pool", "odd width with overlap", lambda dt: (r(2, 8, 7, dtype=dt), r(2, 8, 7, dtype=dt),
                                                             4, None, True)),
        ("moe_combine", "six rows a token", lambda dt: (
            r(60, 700, dtype=dt), torch.randperm(60, generator=torch.Generator().manual_seed(3)) % 10,
            10)),
        ("moe_combine", "prefill-sized", lambda dt: (
            r(600, 700, dtype=dt), torch.randperm(600, generator=torch.Generator().manual_seed(4)) % 100,
            100)),
        ("moe_combine", "strided rows, indices out of range", lambda dt: (
            r(7, 10, dtype=dt)[:, ::2], torch.tensor([4, 0, -2, 1, 9, 0, 1])[::1], 3)),
        ("moe_combine", "no tokens", lambda dt: (r(3, 5, dtype=dt), torch.tensor([0, 1, 2]), 0)),
        ("moe_combine", "float64 rows", lambda dt: (r(3, 5).double(), torch.tensor([0, 1, 0]), 2)),
        ("moe_combine", "int32 index", lambda dt: (r(3, 5, dtype=dt),
                                                   torch.tensor([0, 1, 0], dtype=torch.int32), 2)),
        ("moe_combine", "negative token count", lambda dt: (r(3, 5, dtype=dt), torch.tensor([0, 1, 0]),
                                                            -1)),
        ("hc_split_sinkhorn", "h = 2", lambda dt: (r(5, 8), torch.rand(3), r(8), 2, 7, 0.0)),
        ("hc_split_sinkhorn", "wrong width", lambda dt: (r(5, 9), torch.rand(3), r(8), 2, 7, 0.0)),
        ("hc_split_sinkhorn", "strided mixes", lambda dt: (r(5, 48)[:, ::2], torch.rand(3), r(24),
                                                           4, 20, 1e-6)),
    ]
    python_path = {"strided x", "strided weight", "empty", "bf16 weight", "eps nan", "float64",
                   "weight 2-d", "expanded (self-overlap)", "cos rows do not match",
                   "block does not divide", "e8m0 of fp32 scales", "unknown scale",
                   "b_index out of range", "wrong width", "strided mixes", "int64 indices",
                   "index out of range", "inner stride 2", "infinite scale", "bf16 ape",
                   "fewer tokens than a group", "odd width with overlap", "float64 rows",
                   "x over cos's memory",
                   "int32 index", "negative token count", "prefill-sized"}
    return [pytest.param(n, b, dt, "Python" if i in python_path else "C++",
                         id=f"{n}-{i}-{str(dt)[6:]}") for n, i, b in C for dt in (F32, BF16)]


def _rope_overlapping(dt):
    """apply_rope_'s x and cos over the same float32 memory through two storages (two
    from_numpy views of one array): the glue's overlap check must refuse it."""
    buf = np.random.default_rng(5).standard_normal(64).astype(np.float32)
    x = torch.from_numpy(buf[:48]).view(2, 3, 8)
    cos = torch.from_numpy(buf[40:52]).view(3, 4)
    return x, cos, torch.from_numpy(np.ones((3, 4), np.float32)), False


def _native_cases():
    registry = [pytest.param(*p.values, None, id=p.id) for p in CASES if p.values[0] in ops.NATIVE]
    return registry + _native_extra_cases()


def _run_operator(fn, name, args):
    """fn's results on args as a tuple; for the in-place apply_rope_, it runs on the same
    view of a copy of x's base and the whole copy is the result."""
    if name != "apply_rope_":
        with torch.no_grad():
            out = fn(*args)
        return out if isinstance(out, tuple) else (out,)
    x = args[0]
    base = x if x._base is None else x._base

    def span(t):
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    if any(isinstance(a, torch.Tensor) and span(a)[0] < span(base)[1] and span(base)[0] < span(a)[1]
           for a in args[1:]):
        with torch.no_grad():     # x over another argument's memory: refused before writing
            fn(*args)
        return (base,)
    whole = base.clone()
    view = whole.as_strided(x.size(), x.stride(), x.storage_offset() - base.storage_offset())
    with torch.no_grad():
        fn(view, *args[1:])
    return (whole,)


@needs_native
@pytest.mark.parametrize("name, build, dtype, path", _native_cases())
def test_native_kernels_give_the_python_kernels_bits_or_errors(name, build, dtype, path):
    # both doors run the same C kernel: the C++ path (torch.ops) and the Python kernel
    # must agree bit for bit, or raise the same error
    args = build(dtype)
    try:
        want = _run_operator(ops._IMPLS[name], name, args)
    except Exception as e:       # the Python kernel's error must come out unchanged
        with pytest.raises(type(e)) as got:
            _run_operator(getattr(O, name), name, args)
        assert str(got.value) == str(e)
        return
    before = ops._NATIVE.python_calls()[name]
    got = _run_operator(getattr(O, name), name, args)
    handed_on = ops._NATIVE.python_calls()[name] - before
    if path is not None:     # the plain cases must not reach the Python kernel
        assert handed_on == (path == "Python"), (path, handed_on)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.numel():
            assert torch.equal(_bytes(g.contiguous()), _bytes(w.contiguous()))


@needs_native
@pytest.mark.parametrize("bad", ["dtype", "eps_nan", "eps_negative", "weight_shape", "weight_2d"])
def test_native_rms_norm_refusals_are_the_glues(bad):
    x, w, eps = torch.ones(2, 8), torch.ones(8), 1e-6
    if bad == "dtype":
        x = x.double()
    elif bad == "eps_nan":
        eps = float("nan")
    elif bad == "eps_negative":
        eps = -1.0
    elif bad == "weight_shape":
        w = torch.ones(9)
    else:
        w = torch.ones(1, 8)
    with pytest.raises((ValueError, TypeError)) as want:
        dc.rms_norm(x.numpy(), w.numpy(), eps)
    with pytest.raises(type(want.value)) as got:
        O.rms_norm(x, w, eps)
    assert str(got.value) == str(want.value)


@needs_native
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_native_rms_norm_gradients_go_through_the_formula(dtype):
    r = _gen(22)
    x0, w0, g = r(3, 5, 16, dtype=dtype), r(16), r(3, 5, 16, dtype=dtype)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    O.rms_norm(x, w, 1e-6).backward(g)
    gx, gw = O.rms_norm_backward(g, x0, w0, 1e-6)
    assert torch.equal(_bytes(x.grad), _bytes(gx.to(dtype)))
    assert torch.equal(w.grad, gw)
    with torch.no_grad():     # grad mode off: nothing recorded, the C++ path's result
        y = O.rms_norm(x, w, 1e-6)
    assert not y.requires_grad


def _fresh(code, **env):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          text=True, cwd=root, timeout=300, env={**os.environ, **env})


def test_native_off_keeps_the_python_kernels_without_a_warning():
    out = _fresh("import torch, deepseek_csa.torch as d\n"
                 "print(sorted(d.ops.NATIVE))\n"
                 "print(torch.ops.deepseek_csa.rms_norm(torch.ones(2, 4), None, 1e-6).sum().item())\n",
                 DEEPSEEK_CSA_TORCH_NATIVE="0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[]", "7.999996185302734"], out.stdout
    assert "C++ operator kernels" not in out.stderr


@needs_native
def test_native_built_for_another_torch_is_not_loaded_and_says_so_once():
    # the version written beside the module at build time is checked before loading
    # it: loading a C++ module built against another torch's ABI could crash
    out = _fresh("import torch\n"
                 "torch.__version__ = '0.0.0+other'\n"
                 "import deepseek_csa.torch as d, deepseek_csa.torch.ops\n"
                 "print(sorted(d.ops.NATIVE))\n"
                 "print(torch.ops.deepseek_csa.rms_norm(torch.ones(2, 4), None, 1e-6).sum().item())\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[]", "7.999996185302734"], out.stdout
    assert out.stderr.count("C++ operator kernels are not used") == 1, out.stderr
    assert "0.0.0+other" in out.stderr
