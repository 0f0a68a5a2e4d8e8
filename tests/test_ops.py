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
