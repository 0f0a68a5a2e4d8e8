"""Layer-by-layer swaps into DeepSeek's released inference/model.py.

Set DEEPSEEK_MODEL_PY to a released ``inference/model.py`` (DeepSeek-V4-Flash / V4-Pro; a
V4.1 file is tried as well).  The file is loaded from that path on the CPU through
``deepseek_csa.torch.load_model_py``, i.e. with the package's own CPU implementations of
its GPU-only imports: the ``kernel`` module (act_quant, fp4_act_quant, fp8_gemm, fp4_gemm,
sparse_attn, hc_split_sinkhorn) and ``fast_hadamard_transform``.  A small random-weight
Transformer is built and run in float32 (prefill, then decode steps); then each attention layer in turn is swapped onto
deepseek_csa (``deepseek_csa.torch.swap``) and every layer's output and every indexer
top-k is compared with the unswapped run: the swapped layer row by row within
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
import contextlib
import sys
import copy
import dataclasses
import os
import re

import pytest
import torch

import ref_layer as R

import deepseek_csa.torch as dct
from deepseek_csa.torch import kernel_module as K
from deepseek_csa.reference import kernel_module as KM

MODEL_PY = os.environ.get("DEEPSEEK_MODEL_PY")
pytestmark = pytest.mark.skipif(
    not MODEL_PY, reason="DEEPSEEK_MODEL_PY is not set: point it at a released DeepSeek-V4 "
                         "inference/model.py to swap deepseek_csa into it layer by layer")


# ----------------------------------------------------------------------------- loading
# The file is imported through the package's own CPU ``kernel`` / ``fast_hadamard_transform``
# (deepseek_csa.torch.load_model_py); the former float32 stand-ins of this file are gone
# (their Sinkhorn normalised rows and columns in the other order than the released kernel,
# docs/kernels.md section 9; the package's follows the released order).
def _hadamard(x):
    """The released rotate_activation's transform without its bfloat16 assertion (the
    float32 reference)."""
    return KM.hadamard_transform(x, scale=x.shape[-1] ** -0.5)


@contextlib.contextmanager
def reference_kernels(mod):
    """model.py's ``kernel`` functions and ``fast_hadamard_transform`` replaced by the
    float32 references (deepseek_csa.reference.kernel_module) while the block runs; a
    swapped layer still routes its ops to deepseek_csa."""
    G = vars(mod)
    saved = {n: G[n] for n in KM.REFS if n in G}
    fht = sys.modules.get("fast_hadamard_transform")
    ref_fht = K.hadamard_module()
    ref_fht.hadamard_transform = KM.hadamard_transform
    G.update({n: KM.REFS[n] for n in saved})
    sys.modules["fast_hadamard_transform"] = ref_fht
    try:
        yield
    finally:
        G.update(saved)
        if fht is not None:
            sys.modules["fast_hadamard_transform"] = fht


@pytest.fixture(scope="module")
def model_py():
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
    mod.rotate_activation = _hadamard
    return model, args


def test_swap_each_layer_into_released_model(model_py):
    base, args = _build(model_py)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    S, steps = 57, 7

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
