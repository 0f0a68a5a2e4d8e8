"""Layer-by-layer swaps into DeepSeek's released V4 inference/model.py.

The file is found by ``released_files.v4_model_py()``: ``<repo>/../shared/reference/
deepseek-v4/inference/model.py`` or the path in DEEPSEEK_MODEL_PY (V4-Flash / V4-Pro
share it; the tests skip, saying where they looked, when it is absent; the V4.1 file has
its own tests, test_model_py_v41.py).  The file is loaded from that path on the CPU through
``deepseek_csa.torch.load_model_py``, i.e. with the package's own CPU implementations of
its GPU-only imports: the ``kernel`` module (act_quant, fp4_act_quant, fp8_gemm, fp4_gemm,
sparse_attn, hc_split_sinkhorn) and ``fast_hadamard_transform``.  A small random-weight
Transformer is built and run in float32 (prefill, then decode steps); then each attention layer in turn is swapped onto
deepseek_csa (``deepseek_csa.torch.swap``) and every layer's output and every indexer
top-k is compared with the unswapped run (a window-only layer, a ratio-4 CSA layer with
its indexer, a ratio-128 HCA layer and a ratio-8 one, over a prefill and decode steps
that complete groups of every ratio, the 128 one included): the swapped layer row by row within
QAT_TOL = 1e-5 relative (a few rows a flipped QAT rounding explains within 1e-2:
deepseek_csa.reference.layer.qat_close), the others unchanged, top-k sets identical.  The swapped layer's output is handed on as the
unswapped one's (deepseek_csa.reference.layer ``swap_report``) so that QAT rounding and top-k
selections downstream see the same inputs.

The file is loaded with the package's kernel module, but every run here replaces what
model.py imports from ``kernel`` (and the Hadamard transform) by the float32 reference
stand-ins of deepseek_csa.reference.kernel_module (``reference_kernels``): the unswapped
layers run model.py's torch code on those stand-ins, never on our kernels, so the
comparison is deepseek_csa's swapped ops against an independent reference.  The released
``rotate_activation`` asserts bfloat16; for the float32 run it is replaced by the
reference transform without the assertion.
"""
import copy
import dataclasses
import re
import warnings

import pytest
import torch

import ref_layer as R
import released_files as rf

import deepseek_csa.torch as dct
from deepseek_csa.torch import kernel_module as K
from deepseek_csa.reference import kernel_module as KM



# ----------------------------------------------------------------------------- loading
# The file is imported through the package's own CPU ``kernel`` / ``fast_hadamard_transform``
# (deepseek_csa.torch.load_model_py); the former float32 stand-ins of this file are gone
# (their Sinkhorn normalised rows and columns in the other order than the released kernel,
# docs/kernels.md section 9; the package's follows the released order).
def _hadamard(x):
    """The released rotate_activation's transform without its bfloat16 assertion (the
    float32 reference)."""
    return KM.hadamard_transform(x, scale=x.shape[-1] ** -0.5)


def reference_kernels(mod, qat=True):
    """model.py's ``kernel`` functions and ``fast_hadamard_transform`` replaced by the
    float32 references (deepseek_csa.reference.kernel_module) while the block runs; a
    swapped layer still routes its ops to deepseek_csa.  ``qat=False``: the in-place
    FP8 / FP4 roundings leave their input as it is (the only forms a float32 model
    with bf16-dtype weights calls)."""
    return KM.installed_in(mod, qat=qat)


@pytest.fixture(scope="module")
def model_py():
    MODEL_PY = rf.v4_model_py()
    text = open(MODEL_PY).read()
    provided = K.kernel_module()
    wanted = set()
    for m in re.finditer(r"^\s*from\s+(?:\.|[\w.]*\.)?kernel\s+import\s+(\([^)]*\)|[^\n]+)",
                         text, re.M):
        names = m.group(1).strip("() \n").split(",")
        wanted |= {n.split(" as ")[0].strip() for n in names if n.strip()}
    missing = sorted(n for n in wanted if not hasattr(provided, n))
    if missing:
        pytest.skip(f"{MODEL_PY} imports {missing} from its kernel module; deepseek_csa's "
                    "kernel module does not provide them")
    with K.preserved_modules(("kernel", "fast_hadamard_transform")):
        mod = dct.load_model_py(MODEL_PY)
        mod._released_rotate_activation = mod.rotate_activation
        yield mod


# Narrower than the layers above (dim 128, 4 heads) for the runs over 130 tokens that
# an HCA layer's ratio 128 needs.
NARROW = dict(dim=128, n_heads=4, o_groups=2, index_n_heads=8, moe_inter_dim=64)


def _build(mod, seed=0, bf16=False, **kw):
    fields = {f.name for f in dataclasses.fields(mod.ModelArgs)}
    want = dict(max_batch_size=2, max_seq_len=256, dtype="bf16", vocab_size=256, dim=256,
                moe_inter_dim=128, n_hash_layers=0, n_mtp_layers=0, n_heads=8,
                n_routed_experts=4, n_activated_experts=2, q_lora_rank=64, head_dim=128,
                rope_head_dim=64, o_groups=4, o_lora_rank=32, window_size=16,
                compress_rope_theta=160000.0, original_seq_len=65536, rope_factor=16,
                index_n_heads=16, index_head_dim=64, index_topk=16, hc_mult=2)
    # window-only, CSA (ratio 4, indexer), HCA (ratio 128) and a ratio-8 compressed layer
    want.update(n_layers=4, compress_ratios=(0, 4, 128, 8))
    want.update(kw)
    args = mod.ModelArgs(**{k: v for k, v in want.items() if k in fields})
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    if bf16:  # as the released generate.py builds it
        torch.set_default_dtype(torch.bfloat16)
    try:
        model = mod.Transformer(args)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            shape = p.shape
            if name.endswith("norm.weight"):
                v = 1 + 0.1 * torch.randn(shape, generator=g)
            elif "hc_" in name:
                v = 0.1 * torch.randn(shape, generator=g)
            elif p.dim() == 2 and not name.endswith("ape") and "embed" not in name:
                v = torch.randn(shape, generator=g) * shape[1] ** -0.5
            elif name.endswith("gate.bias"):
                v = torch.zeros(shape)
            else:
                v = torch.randn(shape, generator=g)
            p.data = v.to(p.dtype) if bf16 else v.float()
        if bf16:
            return model, args
        for m in model.modules():
            for n, b in list(m._buffers.items()):
                if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                    m._buffers[n] = b.float()
    # float32 run: the released rotate_activation insists on bfloat16
    mod.rotate_activation = _hadamard
    return model, args


def test_swap_each_layer_into_released_model(model_py):
    base, args = _build(model_py, **NARROW)
    # a 122-token prefill (ratio-4 / -8 / -128 groups left open) and decode steps
    # 122 .. 129, which complete groups of every ratio (the 128 one at position 127)
    tokens = torch.randint(0, args.vocab_size, (2, 130), generator=torch.Generator().manual_seed(1))
    S, steps = 122, 8

    def run(m):
        m(tokens[:, :S], 0)
        for p in range(S, S + steps):
            m(tokens[:, p:p + 1], p)

    with reference_kernels(model_py):
        report = R.swap_report(lambda: copy.deepcopy(base), run)
    assert len(report) == args.n_layers
    for r in report:
        assert r["ok"], r   # qat_close, top-k identical (unless a QAT rounding flipped)
        assert all(e == 0 for l, e in r["per_layer"].items() if l != r["layer"]), r
    # the swapped layers really ran our kernels
    assert any(r["per_layer"][r["layer"]] > 0 for r in report)


def test_swap_ops_one_at_a_time(model_py):
    base, args = _build(model_py, seed=2)
    tokens = torch.randint(0, args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))

    def run(m):
        m(tokens[:, :37], 0)
        for p in range(37, 40):
            m(tokens[:, p:p + 1], p)

    csa = [i for i, r in enumerate(args.compress_ratios) if r][:1]  # the first compressed layer
    for op in dct.OPS:
        with reference_kernels(model_py):
            rep = R.swap_report(lambda: copy.deepcopy(base), run, layers=csa, ops=[op])
        for r in rep:
            assert r["ok"], (op, r)


def test_swap_bf16_released_model(model_py):
    """The released dtypes (bfloat16 activations and projections): each swapped layer
    within bfloat16 tolerance of the unswapped run, >= 99% of the top-k entries shared."""
    saved = model_py.rotate_activation
    try:
        # the bf16 run keeps the released rotate_activation (which asserts bfloat16)
        model_py.rotate_activation = model_py._released_rotate_activation
        base, args = _build(model_py, seed=4, bf16=True)
        tokens = torch.randint(0, args.vocab_size, (1, 44),
                               generator=torch.Generator().manual_seed(5))

        def run(m):
            m(tokens[:, :40], 0)
            for p in range(40, 44):
                m(tokens[:, p:p + 1], p)

        with reference_kernels(model_py):
            b_out, b_tk = R.record(copy.deepcopy(base), run)
        for lid in b_out:
            m = copy.deepcopy(base)
            with reference_kernels(model_py), dct.swap(m, layers=[lid]):
                outs, tks = R.record(m, run, substitute={lid: b_out[lid]})
            for g, w in zip(outs[lid], b_out[lid]):
                assert R.rel_err(g, w) < 3e-2, lid
            for l in b_tk:
                for g, w in zip(tks[l], b_tk[l]):
                    rows = zip(g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1]))
                    same = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist()))
                               for a, b in rows)
                    assert same >= 0.99 * (w >= 0).sum(), (lid, l)
    finally:
        model_py.rotate_activation = saved


# ----------------------------------------------------------------------------- whole model
# A tiny FP8 / FP4 configuration of the released V4 Transformer (FP8 dense linears with
# e8m0 block scales, FP4 routed experts), a CSA layer with its indexer and a ratio-8
# compressed layer behind a window-only one; run in bfloat16 as the released generate.py
# runs it.
V4_FP8 = dict(max_batch_size=2, max_seq_len=64, dtype="fp8", expert_dtype="fp4",
              scale_fmt="ue8m0", scale_dtype="fp8", vocab_size=128, dim=256,
              moe_inter_dim=256, n_layers=3, n_hash_layers=0, n_mtp_layers=0, n_heads=4,
              n_routed_experts=4, n_activated_experts=2, q_lora_rank=128, head_dim=128,
              rope_head_dim=64, o_groups=2, o_lora_rank=64, window_size=8,
              compress_ratios=(0, 4, 8), index_n_heads=4, index_head_dim=64, index_topk=4,
              hc_mult=2, hc_sinkhorn_iters=6)


def test_released_transformer_fp8_fp4_on_our_kernel_module(model_py):
    """The whole released Transformer, FP8 / FP4 weights kept, on deepseek_csa's
    ``kernel`` module: every kernel call of a prefill of 13 tokens and 3 decode steps
    (completing ratio-4 and ratio-8 groups) replayed on ours against the float32
    reference kernels (quantizers bit for bit, GEMMs within one bf16 ulp, ...:
    test_kernel_module.replay_every_kernel_call), and the run on our kernels within
    test_kernel_module.E2E_TOL of the reference run's logits."""
    import test_kernel_module as TK
    saved = model_py.rotate_activation
    try:
        # bfloat16 run: the released rotate_activation (asserting bfloat16) as it is
        model_py.rotate_activation = model_py._released_rotate_activation
        # built twice (deepcopy drops the ``weight.scale`` attribute the released
        # Linear hangs on its FP8 / FP4 weights)
        model = TK.build(model_py, seed=5, **V4_FP8)
        assert model.layers[0].ffn.experts[0].w1.weight.dtype == torch.float4_e2m1fn_x2
        assert model.layers[1].attn.wq_a.weight.dtype == torch.float8_e4m3fn
        assert model.layers[1].attn.indexer.wq_b.weight.dtype == torch.float8_e4m3fn
        tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(6))
        want = TK.replay_every_kernel_call(model_py, model, tokens, 13, 3)
        got = TK.run(TK.build(model_py, seed=5, **V4_FP8), tokens, 13, 3)
    finally:
        model_py.rotate_activation = saved
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert R.rel_err(g.float(), w.float()) < TK.E2E_TOL, R.rel_err(g.float(), w.float())


# Decode against prefill, QAT off: measured <= 2e-6 relative on the logits (float32, other
# summation orders); 1e-4.
DECODE_TOL = 1e-4


def test_v4_decode_equals_prefill_at_every_offset(model_py):
    """V4's control for the V4.1 finding (docs/layers.md): one decode step after a
    prefill of p tokens equals the prefill of the same p + 1 tokens at every offset of
    p + 1 modulo 4 and 8, and where it completes a 16 group, QAT off (each V4 layer
    reads only its own caches; the ratio-16 layer stands in for HCA's 128, the same
    code path)."""
    base, args = _build(model_py, seed=8, compress_ratios=(0, 4, 8, 16), **NARROW)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(9))
    with reference_kernels(model_py, qat=False), torch.no_grad():
        for p in range(31, 39):
            m = copy.deepcopy(base)
            m(tokens[:, :p], 0)
            dec = m(tokens[:, p:p + 1], p)
            pre = copy.deepcopy(base)(tokens[:, :p + 1], 0)
            assert R.rel_err(dec, pre) < DECODE_TOL, (p, R.rel_err(dec, pre))


def test_compiled_swapped_transformer_gives_eager_logits(model_py):
    """torch.compile of the released Transformer, every layer swapped onto deepseek_csa
    and model.py's ``kernel`` module ours: the compiled model gives the swapped eager
    model's logits on a prefill and the decode steps after it.  Our kernels are
    operators inside the graphs, the FP4 index-key packing too: no graph break names
    deepseek_csa.  Budget: the same kernels run on the same
    values; torch's own ops around them (projections, the MoE, hyper-connections) may be
    reordered by the compiler's decompositions: float32 rounding, 1e-5 relative."""
    base, args = _build(model_py, seed=5)
    tokens = torch.randint(0, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    S = 21

    def run(m):
        out = [m(tokens[:, :S], 0)]
        for p in range(S, tokens.shape[1]):
            out.append(m(tokens[:, p:p + 1], p))
        return out

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager, comp = copy.deepcopy(base), copy.deepcopy(base)
    with torch.no_grad(), dct.swap(eager), dct.swap(comp):
        want = run(eager)
        got = run(torch.compile(comp, backend="aot_eager"))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    print(dict(counters["graph_break"]))
    ours = [r for r in counters["graph_break"] if "deepseek_csa" in r or "fp4_pack" in r]
    assert not ours, ours


def _widen_wo_a_from_fp8(model):
    """Each attention's bf16 wo_a made a widened FP8 tensor (e4m3 codes times power-of-two
    scales per 128 x 128 block), as DeepSeek's convert.py writes it from the checkpoint."""
    with torch.no_grad():
        for layer in model.layers:
            w = layer.attn.wo_a.weight
            n, k = w.shape
            nb, kb = -(-n // 128), -(-k // 128)
            wp = torch.zeros(nb * 128, kb * 128)
            wp[:n, :k] = w.float()
            amax = wp.view(nb, 128, kb, 128).abs().amax((1, 3)).clamp_min(1e-4)
            s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))[:, None, :, None]
            q = (wp.view(nb, 128, kb, 128) / s).to(torch.float8_e4m3fn).float() * s
            w.copy_(q.reshape(nb * 128, kb * 128)[:n, :k].bfloat16())


# fp8_wo_a against the released bf16 einsum, same model and tokens: the products are the
# same (exact), the float32 sums in another order, then rounded to bf16 -- an ulp of
# difference in a few wo_a outputs, which FP8 QAT rounding downstream can amplify.
# Measured: logits bitwise equal (seeds 5, 6, 7: the bf16 rounding of wo_a's output
# absorbed the order); with bf16_f32_weights too, <= 1.7e-7 relative; budget 5e-2, where wo_a's output dropped or doubled moves them by
# over 0.3.
FP8_WO_A_TOL = 5e-2


def _run_counting_ops(model, tokens):
    """TK.run's result on the model, and the names of the deepseek_csa operators it called
    through ops.call, in order."""
    return _run_counting_ops_steps(model, tokens, 20, 4)


def test_released_transformer_fp8_wo_a_equals_bf16_einsum(model_py):
    """deepseek_csa.torch.checkpoint_width on the released Transformer (the runner's default,
    --wo-a fp8): every layer's wo_a held as FP8 codes, the decode einsum on the
    weight-only FP8 GEMV, the prefill's on the dequantized weight -- prefill logits
    bitwise those of the bf16 einsum as released, decode logits within FP8_WO_A_TOL,
    greedy tokens the same."""
    import test_kernel_module as TK
    from deepseek_csa.torch.checkpoint_width import FP8Weight, fp8_wo_a
    saved = model_py.rotate_activation
    try:
        model_py.rotate_activation = model_py._released_rotate_activation
        # a prefill of 20 tokens (> MAX_ROWS: the einsum on the dequantized weight)
        tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(6))
        base = TK.build(model_py, seed=5, **dict(V4_FP8, max_batch_size=1))
        _widen_wo_a_from_fp8(base)
        want = TK.run(base, tokens, 20, 4)
        model = TK.build(model_py, seed=5, **dict(V4_FP8, max_batch_size=1))
        _widen_wo_a_from_fp8(model)
        assert fp8_wo_a(model) == len(model.layers)
        assert all(isinstance(l.attn.wo_a.weight, FP8Weight) for l in model.layers)
        got, calls = _run_counting_ops(model, tokens)
    finally:
        model_py.rotate_activation = saved
    assert calls.count("wfp8_gemm") == 4 * len(model.layers)       # decode steps only
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert torch.isfinite(g).all()
        assert R.rel_err(g.float(), w.float()) < FP8_WO_A_TOL, R.rel_err(g.float(), w.float())
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def _f32_weights_bf16_valued(model):
    """The float32 weights the released checkpoint stores in bf16 (the compressors' wkv /
    wgate, the head) given bf16 values, as the loader's widening leaves them."""
    from deepseek_csa.torch.checkpoint_width import _f32_linear_weights
    n = 0
    with torch.no_grad():
        for m in _f32_linear_weights(model):
            m.weight.copy_(m.weight.bfloat16().float())
            n += 1
    return n


def _bf16_valued_pair(model_py, token_seed):
    """(tokens, n, want, model): two released FP8 Transformers of one seed whose float32
    weights hold bf16 values (n of them), the first run as released (want: prefill and 4
    decode steps' logits), the second left to the test to change.  The caller has put the
    released rotate_activation in place."""
    import test_kernel_module as TK
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(token_seed))
    base = TK.build(model_py, seed=5, **dict(V4_FP8, max_batch_size=1))
    n = _f32_weights_bf16_valued(base)
    want = TK.run(base, tokens, 20, 4)
    model = TK.build(model_py, seed=5, **dict(V4_FP8, max_batch_size=1))
    assert _f32_weights_bf16_valued(model) == n
    return tokens, n, want, model


def _assert_close_same_tokens(got, want):
    """Every step's logits within FP8_WO_A_TOL of the released run's, the same argmax."""
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert R.rel_err(g.float(), w.float()) < FP8_WO_A_TOL, R.rel_err(g.float(), w.float())
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_released_transformer_bf16_f32_weights(model_py):
    """deepseek_csa.torch.bf16_f32_weights on the released Transformer (the runner's
    default, --f32-weights bf16): the compressors' and the head's float32 weights held in
    bf16, their decode F.linear on the float32 GEMV (wbf16_gemm; the prefill's
    compressors, more than MAX_ROWS rows, F.linear on the widened weight) -- logits
    within FP8_WO_A_TOL (float32 sums in another order than F.linear's, which
    FP8 QAT rounding downstream can amplify), greedy tokens the same."""
    from deepseek_csa.torch.checkpoint_width import BF16Weight, bf16_f32_weights
    saved = model_py.rotate_activation
    try:
        model_py.rotate_activation = model_py._released_rotate_activation
        tokens, n, want, model = _bf16_valued_pair(model_py, 7)
        # one compressor a compressed layer (two with the indexer's), and the head
        assert n >= 2 * 3 + 1
        assert bf16_f32_weights(model) == n + len(model.layers)      # and the routers
        assert isinstance(model.head.weight, BF16Weight)
        got, calls = _run_counting_ops(model, tokens)
    finally:
        model_py.rotate_activation = saved
    assert calls.count("wbf16_gemm") >= 4 * n - 4     # decode steps (the head every step)
    _assert_close_same_tokens(got, want)              # the prefill's head: one row, GEMV


def test_released_transformer_fused_moe_bitwise(model_py):
    """deepseek_csa.torch.fuse_moe on the released Transformer (the runner's default,
    --moe fused): the routed FP4 experts as three fp4_gemm calls with b_index, the
    SwiGLU over every (token, expert) pair at once, moe_combine adding them in the
    released loop's order -- prefill and decode logits bitwise those of model.py's
    per-expert loop, with 2 of 4 and 3 of 8 experts a token (a prefill's tokens share
    experts)."""
    import test_kernel_module as TK
    from deepseek_csa.torch.fused_moe import fuse_moe, unfuse_moe
    saved = model_py.rotate_activation
    try:
        model_py.rotate_activation = model_py._released_rotate_activation
        for seed, kw in ((5, {}), (8, dict(n_routed_experts=8, n_activated_experts=3,
                                           swiglu_limit=0.5))):
            tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(seed))
            cfg = dict(V4_FP8, max_batch_size=1, **kw)
            base = TK.build(model_py, seed=seed, **cfg)
            want = TK.run(base, tokens, 20, 4)
            model = TK.build(model_py, seed=seed, **cfg)
            assert fuse_moe(model) == len(model.layers)
            assert fuse_moe(model) == 0                    # already fused
            e = model.layers[0].ffn.experts[1].w1
            assert e.weight.data_ptr() == model.layers[0].ffn._csa_stacks[0][1].data_ptr()
            got, calls = _run_counting_ops(model, tokens)
            for g, w in zip(got, want):
                assert torch.equal(g, w), R.rel_err(g.float(), w.float())
            # 3 fp4_gemm calls a layer a call of the model (1 prefill, 4 decode steps)
            assert calls.count("fp4_gemm") == 3 * 5 * len(model.layers)
            assert calls.count("moe_combine") == 5 * len(model.layers)
            # fused before the weights are loaded (as the runner does): the loader's
            # copies land in the stacks
            with TK.bf16_default():
                fresh = model_py.Transformer(model_py.ModelArgs(**cfg))
            assert fuse_moe(fresh) == len(fresh.layers)
            with torch.no_grad():
                for k, v in base.state_dict().items():
                    fresh.state_dict(keep_vars=True)[k].copy_(v)
            for g, w in zip(TK.run(fresh, tokens, 20, 4), want):
                assert torch.equal(g, w)
            # a prefill of more than CHUNK_PAIRS pairs (here 5) on the released forward,
            # the decode steps fused
            import deepseek_csa.torch.fused_moe as FM
            saved_chunk, FM.CHUNK_PAIRS = FM.CHUNK_PAIRS, 5
            try:
                for g, w in zip(TK.run(fresh, tokens, 20, 4), want):
                    assert torch.equal(g, w)
            finally:
                FM.CHUNK_PAIRS = saved_chunk
            unfuse_moe(model)                              # the released loop again
            model2 = TK.build(model_py, seed=seed, **cfg)
            assert fuse_moe(model2) == len(model2.layers)
            unfuse_moe(model2)
            again = TK.run(model2, tokens, 20, 4)
            for g, w in zip(again, want):
                assert torch.equal(g, w)
    finally:
        model_py.rotate_activation = saved


def test_released_transformer_fused_indexer_bitwise(model_py):
    """deepseek_csa.torch.fuse_indexer on the released Transformer (the runner's default,
    --indexer fused): each decode step's indexer scores from index_scores(rounding="bf16")
    on the FP4 key rows, then torch.topk as released -- every indexer call's selection
    and every logit bitwise those of the released einsum, over 30 decode steps (up to 12
    entries for a top-4), with 4 and with 20 index heads (a 16-head chunk of torch's sum
    and a tail), batch 1 and 2; a second prompt (prefill at 0 again) repacks the keys, and
    a one-token prompt decodes its first steps (no entry yet) as released."""
    import test_kernel_module as TK
    from deepseek_csa.torch.fused_indexer import fuse_indexer, unfuse_indexer
    saved = model_py.rotate_activation

    def run_recording(model, tokens):
        picks = []
        hooks = [l.attn.indexer.register_forward_hook(lambda m, a, out: picks.append(out.clone()))
                 for l in model.layers if getattr(l.attn, "indexer", None) is not None]
        try:
            out, calls = _run_counting_ops_steps(model, tokens, 20, 30)
            out += TK.run(model, tokens[:, 5:], 16, 3)       # another prompt
            out += TK.run(model, tokens[:, 7:], 1, 6)        # one token: steps with no entry
        finally:
            for h in hooks:
                h.remove()
        return out, picks, calls

    try:
        model_py.rotate_activation = model_py._released_rotate_activation
        for seed, B, kw in ((5, 1, {}), (7, 2, dict(index_n_heads=20))):
            cfg = dict(V4_FP8, max_batch_size=B, **kw)
            tokens = torch.randint(0, 128, (B, 50), generator=torch.Generator().manual_seed(seed))
            want, want_picks, _ = run_recording(TK.build(model_py, seed=seed, **cfg), tokens)
            model = TK.build(model_py, seed=seed, **cfg)
            assert fuse_indexer(model) == 1 and fuse_indexer(model) == 0
            with warnings.catch_warnings():               # no fallback to the einsum
                warnings.simplefilter("error", RuntimeWarning)
                got, picks, calls = run_recording(model, tokens)
            assert calls.count("index_scores") == 30          # every decode step, one layer
            assert len(picks) == len(want_picks)
            for i, (g, w) in enumerate(zip(picks, want_picks)):
                assert torch.equal(g, w), i
            for g, w in zip(got, want):
                assert torch.equal(g, w), R.rel_err(g.float(), w.float())
            unfuse_indexer(model)
            assert "forward" not in vars(model.layers[1].attn.indexer)
    finally:
        model_py.rotate_activation = saved


def _run_counting_ops_steps(model, tokens, S, steps):
    """_run_counting_ops with S prompt tokens and `steps` decode steps."""
    import test_kernel_module as TK
    from deepseek_csa.torch import ops
    calls, orig = [], ops.call
    ops.call = lambda name, *a: (calls.append(name), orig(name, *a))[1]
    try:
        return TK.run(model, tokens, S, steps), calls
    finally:
        ops.call = orig


def test_released_transformer_bf16_router(model_py):
    """bf16_f32_weights also gives each MoE router a RouterWeight: Gate.forward's
    per-call float32 widening of its bf16 weight becomes wbf16_gemm on the bf16 weight
    (rows <= MAX_ROWS; a prefill's router widens as released) -- logits within
    FP8_WO_A_TOL, greedy tokens the same; the weight reads as the bf16 tensor."""
    from deepseek_csa.torch.checkpoint_width import RouterWeight, bf16_f32_weights
    saved = model_py.rotate_activation
    try:
        model_py.rotate_activation = model_py._released_rotate_activation
        tokens, n, want, model = _bf16_valued_pair(model_py, 9)
        w = model.layers[0].ffn.gate.weight.detach().clone()
        assert bf16_f32_weights(model) == n + len(model.layers)
        g = model.layers[0].ffn.gate.weight
        assert isinstance(g, RouterWeight) and torch.equal(g.w16, w)
        got, calls = _run_counting_ops(model, tokens)
    finally:
        model_py.rotate_activation = saved
    # the router every decode step a layer, besides the compressors and the head
    assert calls.count("wbf16_gemm") >= 4 * (n + len(model.layers)) - 4
    _assert_close_same_tokens(got, want)
