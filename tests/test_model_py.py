"""Layer-by-layer swaps into DeepSeek's released inference/model.py.

Set DEEPSEEK_MODEL_PY to a released ``inference/model.py`` (DeepSeek-V4-Flash / V4-Pro; a
V4.1 file is tried as well).  The file is loaded from that path on the CPU, with CPU
stand-ins (below) for its GPU-only imports: the ``kernel`` module (act_quant,
fp4_act_quant, fp8_gemm, fp4_gemm, sparse_attn, hc_split_sinkhorn) and
``fast_hadamard_transform``.  A small random-weight Transformer is built and run in
float32 (prefill, then decode steps); then each attention layer in turn is swapped onto
deepseek_csa (``deepseek_csa.torch.swap``) and every layer's output and every indexer
top-k is compared with the unswapped run: the swapped layer within 1e-4 relative, the
others unchanged, top-k sets identical.  The swapped layer's output is handed on as the
unswapped one's (tests/ref_layer.py ``swap_report``) so that QAT rounding and top-k
selections downstream see the same inputs.

The stand-ins follow SPEC.md (FP8/FP4 quantize-dequantize onto the e4m3 / e2m1 grids,
gather sparse attention with a sink, Walsh-Hadamard); the unswapped run uses them, so the
comparison is deepseek_csa against model.py's own torch code plus these.  The released
``rotate_activation`` asserts bfloat16; for the float32 run it is replaced by the same
transform without the assertion.
"""
import copy
import dataclasses
import importlib.util
import os
import re
import sys
import types

import numpy as np
import pytest
import torch

import ref_layer as R

import deepseek_csa.torch as dct

MODEL_PY = os.environ.get("DEEPSEEK_MODEL_PY")
pytestmark = pytest.mark.skipif(
    not MODEL_PY, reason="DEEPSEEK_MODEL_PY is not set: point it at a released DeepSeek-V4 "
                         "inference/model.py to swap deepseek_csa into it layer by layer")


# ----------------------------------------------------------------------------- stand-ins
def _act_quant(x, block_size=128, scale_fmt=None, scale_dtype=None, inplace=False):
    e8 = getattr(torch, "float8_e8m0fnu", None)
    pow2 = scale_fmt is not None or (e8 is not None and scale_dtype == e8)
    if inplace:
        x.copy_(R.fp8_qat(x.float(), block_size, pow2=pow2))
        return x
    xb = x.float().unflatten(-1, (-1, block_size))
    s = (xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)
    s = R._pow2_at_least(s) if pow2 else s
    return (xb / s).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2), s.squeeze(-1)


def _fp4_act_quant(x, block_size=32, inplace=True):
    if not inplace:
        raise NotImplementedError("stand-in fp4_act_quant: inplace only")
    x.copy_(R.fp4_qat(x.float(), block_size))
    return x


def _gemm_unavailable(*a, **k):
    raise NotImplementedError("the stand-in runs bf16/fp32 weights only (no FP8/FP4 GEMM)")


def _hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """Hyper-connection split: sigmoid pre/post weights, Sinkhorn-normalised mixing."""
    h = hc_mult
    pre = torch.sigmoid(mixes[..., :h] * hc_scale[0] + hc_base[:h]) + eps
    post = 2 * torch.sigmoid(mixes[..., h:2 * h] * hc_scale[1] + hc_base[h:2 * h])
    c = mixes[..., 2 * h:].unflatten(-1, (h, h)) * hc_scale[2] + hc_base[2 * h:].view(h, h)
    c = torch.softmax(c, -1) + eps
    for _ in range(sinkhorn_iters):
        c = c / (c.sum(-2, keepdim=True) + eps)
        c = c / (c.sum(-1, keepdim=True) + eps)
    return pre, post, c


def _hadamard_transform(x, scale=1.0):
    return (R.hadamard(x) * (scale * x.shape[-1] ** 0.5)).to(x.dtype)


def _standin_modules():
    k = types.ModuleType("kernel")
    k.__doc__ = "CPU stand-in for model.py's GPU kernel module (tests/test_model_py.py)"
    k.act_quant, k.fp4_act_quant = _act_quant, _fp4_act_quant
    k.fp8_gemm = k.fp4_gemm = _gemm_unavailable
    k.sparse_attn, k.hc_split_sinkhorn = R.sparse_attn, _hc_split_sinkhorn
    k.hadamard_transform = _hadamard_transform
    k.fp4_act_quant_e4m3 = lambda x, block_size=16, inplace=True: R.fp4_act_quant_e4m3(
        x, block_size, inplace)
    f = types.ModuleType("fast_hadamard_transform")
    f.hadamard_transform = _hadamard_transform
    return {"kernel": k, "fast_hadamard_transform": f}


@pytest.fixture(scope="module")
def model_py():
    text = open(MODEL_PY).read()
    mods = _standin_modules()
    wanted = set()
    for m in re.finditer(r"^\s*from\s+kernel\s+import\s+(\([^)]*\)|[^\n]+)", text, re.M):
        names = m.group(1).strip("() \n").split(",")
        wanted |= {n.split(" as ")[0].strip() for n in names if n.strip()}
    missing = sorted(n for n in wanted if not hasattr(mods["kernel"], n))
    if missing:
        pytest.skip(f"{MODEL_PY} imports {missing} from its kernel module; no CPU stand-in")
    saved = {n: sys.modules.get(n) for n in mods}
    sys.modules.update(mods)
    try:
        spec = importlib.util.spec_from_file_location("deepseek_released_model", MODEL_PY)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod._released_rotate_activation = mod.rotate_activation
        yield mod
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _build(mod, seed=0, bf16=False):
    fields = {f.name for f in dataclasses.fields(mod.ModelArgs)}
    want = dict(max_batch_size=2, max_seq_len=256, dtype="bf16", vocab_size=256, dim=256,
                moe_inter_dim=128, n_hash_layers=0, n_mtp_layers=0, n_heads=8,
                n_routed_experts=4, n_activated_experts=2, q_lora_rank=64, head_dim=128,
                rope_head_dim=64, o_groups=4, o_lora_rank=32, window_size=16,
                compress_rope_theta=160000.0, original_seq_len=65536, rope_factor=16,
                index_n_heads=16, index_head_dim=64, index_topk=16, hc_mult=2)
    if "kv_source_layers" in fields:  # V4.1
        want.update(n_layers=5, compress_ratios=(0, 2, 2, 1, 1), kv_source_layers=(1, 3),
                    index_source_layers=(1, 3, 4))
    else:
        want.update(n_layers=4, compress_ratios=(0, 4, 128, 4))
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
    mod.rotate_activation = lambda x: _hadamard_transform(x, scale=x.shape[-1] ** -0.5)
    return model, args


def test_swap_each_layer_into_released_model(model_py):
    base, args = _build(model_py)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    S, steps = 57, 7

    def run(m):
        m(tokens[:, :S], 0)
        for p in range(S, S + steps):
            m(tokens[:, p:p + 1], p)

    report = R.swap_report(lambda: copy.deepcopy(base), run)
    assert len(report) == args.n_layers
    for r in report:
        assert r["ok"], r   # within 1e-4, top-k identical (unless a QAT rounding flipped)
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
        for r in R.swap_report(lambda: copy.deepcopy(base), run, layers=csa, ops=[op]):
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

        b_out, b_tk = R.record(copy.deepcopy(base), run)
        for lid in b_out:
            m = copy.deepcopy(base)
            with dct.swap(m, layers=[lid]):
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
