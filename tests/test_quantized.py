"""FP8 / FP4 projections (deepseek_csa.torch.FP8Linear / FP4Experts) and
deepseek_csa.transformers.quantize against references written here from the released
Linear's arithmetic (docs/layers.md, "FP8 / FP4 weights"): the activation rounded by
tests/ref_quant.py's fp8_round (blocks of 128, power-of-two scales), times the
dequantized weight, in float64.

Error budget (float32 output): each 128-block partial sum and the float32 accumulation
of the K/128 scaled blocks round at most (128 + K/128) times, 2^-24 each, relative to
the sum of |products|: 2e-5 * sum|x_r||w| covers K <= 4096.  bfloat16 output adds one
rounding, 2^-9 of |y|.
"""
import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deepseek_csa.torch as dct  # noqa: E402
from deepseek_csa.torch import FP4Experts, FP8Linear, fp4_weight, fp8_weight  # noqa: E402

import ref_quant as R  # noqa: E402

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- references
def fp8_valued(N, K, seed, subnormal=True):
    """[N, K] float32 whose 128 x 128 blocks are e4m3 values times one power of two (a
    dequantized released weight), with subnormal and zero codes and an all-zero block."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x11                       # no NaN codes
    v = codes.view(torch.float8_e4m3fn).float()
    if not subnormal:
        v[v.abs() < 2.0 ** -6] = 1.0
    nb, kb = -(-N // 128), -(-K // 128)
    e = torch.randint(-12, 4, (nb, kb), generator=g)
    s = torch.ldexp(torch.ones(nb, kb), e).repeat_interleave(128, 0).repeat_interleave(128, 1)
    w = v * s[:N, :K]
    w[:min(N, 128), :128] = 0.0
    return w


def ref_fp8_grid(w):
    """w projected onto FP8 weights by the reference rounding: per 128 x 128 block
    s = 2^ceil(log2(amax / 448)), round_e4m3(w / s) * s."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    pad = torch.zeros(nb * 128, kb * 128)
    pad[:N, :K] = w
    amax = pad.view(nb, 128, kb, 128).abs().amax((1, 3)).clamp_min(1e-30)
    s = R.pow2_ceil(amax * torch.tensor(1 / 448, dtype=torch.float32))
    s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    return R.round_e4m3((w / s).clamp(-448, 448)) * s


def deq_fp4(codes, scales):
    """Reference decode of FP4Experts' buffers: codes uint8 [N, K/2] (low nibble first),
    scales e8m0 [N, K/32] -> float32 [N, K]."""
    lo, hi = (codes & 15).long(), (codes >> 4).long()
    v = E2M1[torch.stack([lo, hi], -1).flatten(-2)]
    e = scales.view(torch.uint8).long() - 127
    return v * torch.ldexp(torch.ones(e.shape), e).repeat_interleave(32, -1)


def ref_linear(x, w):
    """The released FP8 / FP4 Linear in float64: act rounding, dequantized weight."""
    xr = R.fp8_round(x.float(), 128).double()
    return xr @ w.double().T, xr.abs() @ w.double().abs().T


def assert_budget(y, ref, mag, bf16=False):
    err = (y.double() - ref).abs()
    bound = 2e-5 * mag + (2.0 ** -8 * ref.abs() if bf16 else 0) + 1e-30
    assert bool((err <= bound).all()), float((err / bound).max())


# ---------------------------------------------------------------- weights
@pytest.mark.parametrize("N,K", [(200, 384), (128, 128), (1, 256), (257, 130), (2100, 256)])
def test_fp8_weight_exact_on_fp8_values(N, K):
    w = fp8_valued(N, K, seed=N + K)
    codes, scales, exact = fp8_weight(w)
    assert exact and codes.dtype == torch.float8_e4m3fn and codes.shape == (N, K)
    assert scales.shape == (-(-N // 128), -(-K // 128))
    e = scales.view(torch.uint8).long() - 127
    s = torch.ldexp(torch.ones(e.shape), e).repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(codes.float() * s[:N, :K], w)


def test_fp8_weight_rounds_other_values():
    w = torch.randn(130, 256, generator=torch.Generator().manual_seed(1))
    codes, scales, exact = fp8_weight(w)
    assert not exact
    lin = FP8Linear(codes, scales)
    assert torch.equal(lin.dequantized_weight(), ref_fp8_grid(w))


def test_fp4_weight_exact_and_rounding():
    g = torch.Generator().manual_seed(2)
    w = R.fp4_round(torch.randn(64, 256, generator=g), 32)
    codes, scales, exact = fp4_weight(w)
    assert exact and torch.equal(deq_fp4(codes, scales), w)
    w2 = torch.randn(64, 256, generator=g)
    codes, scales, exact = fp4_weight(w2)
    assert not exact and torch.equal(deq_fp4(codes, scales), R.fp4_round(w2, 32))


@pytest.mark.parametrize("bad,match", [
    (torch.ones(3), "must be \\[N, K\\]"),
    (torch.full((4, 128), float("nan")), "inf or NaN"),
])
def test_fp8_weight_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        fp8_weight(bad)


# ---------------------------------------------------------------- FP8Linear
@pytest.mark.parametrize("shape", [(1, 256), (3, 5, 256), (2, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    w = fp8_valued(200, 256, seed=3)
    lin = FP8Linear.from_linear(_linear(w))
    assert lin.exact
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x0 = x.clone()
    with torch.no_grad():
        y = lin(x)
    assert y.dtype == dtype and y.shape == shape[:-1] + (200,)
    assert torch.equal(x, x0)
    ref, mag = ref_linear(x, w)
    assert_budget(y, ref, mag, bf16=dtype == torch.bfloat16)


def test_fp8_linear_strided_input():
    w = fp8_valued(128, 256, seed=4)
    lin = FP8Linear.from_linear(_linear(w))
    big = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    x = big[::2, 128:384]                       # rows strided, columns offset
    with torch.no_grad():
        y = lin(x)
    ref, mag = ref_linear(x, w)
    assert_budget(y, ref, mag)


def test_fp8_grouped_linear_matches_per_group_reference():
    G, Kg, Ng = 3, 256, 128
    w = fp8_valued(G * Ng, Kg, seed=6)
    lin = FP8Linear.from_linear(_linear(w), groups=G)
    x = torch.randn(2, 4, G, Kg, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y = lin(x)
    assert y.shape == (2, 4, G, Ng)
    for gi in range(G):
        ref, mag = ref_linear(x[:, :, gi], w[gi * Ng:(gi + 1) * Ng])
        assert_budget(y[:, :, gi], ref, mag)


def test_fp8_linear_same_bits_at_any_thread_count():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    w = fp8_valued(384, 512, seed=8)
    lin = FP8Linear.from_linear(_linear(w))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    outs = []
    for n in (1, 2):
        with threadpoolctl.threadpool_limits(n), torch.no_grad():
            outs.append(lin(x))
    assert torch.equal(outs[0], outs[1])


def test_fp8_linear_errors():
    w = fp8_valued(128, 256, seed=10)
    lin = FP8Linear.from_linear(_linear(w))
    with torch.no_grad(), pytest.raises(ValueError, match="last dim must be 256, got shape"):
        lin(torch.ones(2, 128))
    x = torch.ones(2, 256, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference"):
        lin(x)
    with pytest.raises(ValueError, match="multiple of 128"):
        FP8Linear.from_linear(torch.nn.Linear(100, 128, bias=False))
    with pytest.raises(ValueError, match="has a bias"):
        FP8Linear.from_linear(torch.nn.Linear(128, 128))
    glin = FP8Linear.from_linear(_linear(fp8_valued(256, 128, seed=11)), groups=2)
    with torch.no_grad(), pytest.raises(ValueError, match="grouped layer takes x"):
        glin(torch.ones(3, 256))


def _linear(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


# ---------------------------------------------------------------- transformers
transformers = pytest.importorskip("transformers")
import deepseek_csa.transformers as dch  # noqa: E402

if not dch._supported(transformers.__version__):
    pytest.skip(f"deepseek_csa.transformers supports {dch.SUPPORTED_VERSIONS}",
                allow_module_level=True)

from transformers import DynamicCache  # noqa: E402

LAYERS3 = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def make_model128(seed=0, dtype=torch.float32):
    """A small DeepseekV4ForCausalLM (test_transformers_bridge.make_model, sinks and
    position biases randomized) whose projections fit the 128 blocks (hidden 128, q / o
    ranks 128, experts 128 wide), its FP8 / FP4 weights on the grids already (the
    reference rounding), as a released checkpoint loaded by transformers would be."""
    from test_transformers_bridge import make_model
    m = make_model(LAYERS3, index_n_heads=4, index_topk=3, hca_ratio=8, window=8, seed=seed,
                   hidden_size=128, head_dim=64, partial_rotary_factor=16 / 64,
                   q_lora_rank=128, o_groups=1, o_lora_rank=128, moe_intermediate_size=128,
                   index_head_dim=32)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name:
                p.copy_(R.fp4_round(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5, 32))
            elif p.dim() == 2 and name.split(".")[-2] in FP8_NAMES:
                p.copy_(ref_fp8_grid(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5))
    return m.to(dtype)


FP8_NAMES = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "gate_proj",
             "up_proj", "down_proj")


def ref_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The released expert arithmetic over transformers' float weights: each GEMM's
    input rounded by the reference fp8_round, float64 products, transformers' gate."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float64)
    for t in range(hidden_states.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            if not 0 <= e < self.num_experts:
                continue
            gu = (R.fp8_round(hidden_states[t:t + 1].float(), 128).double()
                  @ self.gate_up_proj[e].double().T).to(hidden_states.dtype)
            h = self._apply_gate(gu)
            y = R.fp8_round(h.float(), 128).double() @ self.down_proj[e].double().T
            out[t] += (y[0].to(hidden_states.dtype) * top_k_weights[t, j]).double()
    return out.to(hidden_states.dtype)


def reference_model(m):
    """A copy of m computing every FP8 / FP4 projection the released way, by reference
    code: a pre-hook rounds each FP8 projection's input, the experts run
    ref_experts_forward."""
    ref = copy.deepcopy(m)
    for name, mod in ref.named_modules():
        leaf = name.split(".")[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        fp8 = ((parent == "self_attn" and leaf in FP8_NAMES[:5]) or
               (parent == "indexer" and leaf == "q_b_proj") or parent == "shared_experts")
        if isinstance(mod, torch.nn.Linear) and fp8:
            mod.register_forward_pre_hook(
                lambda mod, args: (R.fp8_round(args[0].float(), 128).to(args[0].dtype),))
        if type(mod).__name__ == "DeepseekV4Experts":
            mod.forward = ref_experts_forward.__get__(mod)
    return ref


def logits_steps(m, ids, steps):
    cache = DynamicCache(config=m.config)
    out = []
    with torch.no_grad():
        lg = m(ids, past_key_values=cache, use_cache=True).logits
        out.append(lg[:, -1].float())
        for s in range(steps):
            lg = m(lg[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
            out.append(lg[:, -1].float())
    return torch.stack(out)


def test_fp4_experts_matches_reference():
    m = make_model128()
    ex = m.model.layers[1].mlp.experts
    q = FP4Experts.from_experts(ex)
    assert q.exact
    g = torch.Generator().manual_seed(3)
    # integer activations: the gate/up products and sums are exact in float32, so both
    # sides feed the same bits to transformers' gate and to the second rounding
    x = torch.randint(-8, 9, (6, 128), generator=g).float()
    idx = torch.tensor([[0, 1], [3, 2], [1, 4], [2, 2], [0, 3], [4, 4]])   # 4: the mask slot
    w = torch.rand(6, 2, generator=g)
    x0 = x.clone()
    with torch.no_grad():
        y = q(x, idx, w)
        ref = ref_experts_forward(ex, x, idx, w)
    assert torch.equal(x, x0)
    mag = torch.zeros(6, 128, dtype=torch.float64)
    with torch.no_grad():
        for t in range(6):
            for j in range(2):
                e = int(idx[t, j])
                if e < 4:
                    h = ex._apply_gate((x[t:t + 1] @ ex.gate_up_proj[e].T))
                    mag[t] += (R.fp8_round(h, 128).abs().double()
                               @ ex.down_proj[e].abs().double().T)[0] * float(w[t, j])
    assert_budget(y, ref.double(), mag)


def test_quantize_report_and_memory():
    m = make_model128()
    rep = dch.quantize(m)
    assert rep["rounded"] == []
    assert len(rep["fp4"]) == 3 and len(rep["fp8"]) == 3 * 8 + 1
    assert "layers.1.self_attn.compressor.indexer.q_b_proj" in rep["fp8"]
    assert rep["bytes_after"] < rep["bytes_before"] / 3
    assert isinstance(m.model.layers[0].self_attn.o_a_proj, FP8Linear)
    assert dch.quantize(m)["fp8"] == []                    # twice: nothing left to do


@pytest.mark.parametrize("swapped", [False, True])
def test_quantized_model_matches_reference(swapped):
    """Prefill 23 tokens (T not a multiple of 4 or 8) then 6 decode steps, batch 2, on
    the quantized model (swapped or not) against reference_model.  Budget: float32
    rounding (1e-6) moves an activation across an e4m3 rounding boundary rarely; when it
    does, that element moves by one e4m3 step (2^-3 of itself): 1e-3 of the logits."""
    m = make_model128()
    ref = reference_model(m)
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(4))
    want = logits_steps(ref, ids, 6)
    dch.quantize(m)
    if swapped:
        dch.swap(m)
    got = logits_steps(m, ids, 6)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-3, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_quantized_bf16_model_matches_bf16_reference():
    """bf16 activations: the reference rounds each float64 projection once to bf16, ours
    each float32 one; the same flip budget as above."""
    m = make_model128(dtype=torch.bfloat16)
    ref = reference_model(m)
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(5))
    want = logits_steps(ref, ids, 3)
    dch.quantize(m)
    got = logits_steps(m, ids, 3)
    assert float((got - want).norm() / want.norm()) < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_quantize_refuses_and_leaves_the_model_untouched():
    m = make_model128()
    m.model.layers[2].mlp.shared_experts.down_proj = torch.nn.Linear(100, 128, bias=False)
    with pytest.raises(ValueError, match="layers.2.mlp.shared_experts.down_proj: .*multiple of 128"):
        dch.quantize(m)
    assert not any(isinstance(x, (FP8Linear, FP4Experts)) for x in m.modules())
    with pytest.raises(ValueError, match="layer 5 out of range"):
        dch.quantize(make_model128(), layers=[5])


def test_quantize_warns_when_it_rounds():
    m = make_model128()
    with torch.no_grad():
        m.model.layers[0].self_attn.q_a_proj.weight.add_(1e-3)
    with pytest.warns(UserWarning, match="1 modules' weights were not FP8"):
        rep = dch.quantize(m)
    assert rep["rounded"] == ["layers.0.self_attn.q_a_proj"]


def test_quantized_model_refuses_training():
    m = make_model128()
    dch.quantize(m)
    m.train()
    ids = torch.randint(0, 97, (1, 9))
    with pytest.raises(RuntimeError, match="inference"):
        m(ids).logits.sum()


def test_fp4_experts_adds_experts_in_transformers_order():
    """bf16: a token's expert outputs are added one expert at a time, ascending, each
    sum rounded to bf16 (transformers' loop); one scatter over all pairs would round
    differently when tokens repeat."""
    m = make_model128(dtype=torch.bfloat16)
    q = FP4Experts.from_experts(m.model.layers[1].mlp.experts)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(7, 128, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:3] for _ in range(7)])
    w = torch.rand(7, 3, generator=g)
    with torch.no_grad():
        got = q(x, idx, w)
        want = torch.zeros_like(x)
        for e in range(4):                     # only expert e: the others -> mask slot 4
            want += q(x, torch.where(idx == e, idx, torch.full_like(idx, 4)), w)
    assert torch.equal(got, want)
