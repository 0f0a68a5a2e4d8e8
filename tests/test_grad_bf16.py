"""bfloat16 training through the torch operators: the backward of rms_norm, gated_pool
and sparse_attn reads bf16 tensors as they are and returns bf16 gradients, with no
float32 copy of a [B, S, H, D] tensor (q, out, grad_out, d(q)), neither in torch nor in
the kernels' scratch.

Two kinds of check:
- exact: each backward operator on bf16 tensors gives the float32 backward on the same
  (exactly widened) values, rounded once to bf16 -- bit for bit, at every ISA level;
- error budget: a bf16 layer's gradients (through autograd, the ops' registered
  formulas) against the float32 gradients of the same inputs.  The bf16 run rounds the
  forward's outputs (out of attention, the pooled entries) and the gradients to bf16:
  each rounding is a relative 2^-9 ~ 2e-3 per element; attention's backward reads the
  rounded output in Dr = dO . O, whose error dl = p (dP - Dr) carries with the same
  relative size where dP - Dr does not cancel.  Bar: 1e-2 norm-wise (5 rounding units),
  per gradient.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deepseek_csa as dc  # noqa: E402
import deepseek_csa.torch as dct  # noqa: E402
from deepseek_csa.torch import ops  # noqa: E402

BF, F32 = torch.bfloat16, torch.float32
BUDGET = 1e-2


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale


def _idx(B, S, K, N, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, N, (B, S, K), generator=g, dtype=torch.int32)


def _bits(t):
    return t.contiguous().view(torch.int16)


def _assert_rounded(got, want32):
    """got (bf16) is want32 (float32) rounded once to nearest-even, bit for bit."""
    assert got.dtype == BF and want32.dtype == F32
    assert torch.equal(_bits(got), _bits(want32.to(BF)))


# ----------------------------------------------------------------------------- exact
def test_rms_norm_backward_op_bf16_is_float32_rounded(isa):
    r = _gen(0)
    x, dy, w = r(3, 7, 4, 40).to(BF), r(3, 7, 4, 40).to(BF), r(40)
    gx, gw = ops.OPS["rms_norm_backward"](dy, x, w, 1e-6)
    gx32, gw32 = ops.OPS["rms_norm_backward"](dy.float(), x.float(), w, 1e-6)
    _assert_rounded(gx, gx32)
    assert gw.dtype == F32 and torch.equal(gw, gw32)
    gx, _ = ops.OPS["rms_norm_backward"](dy, x, None, 1e-6)          # the per-head q norm
    _assert_rounded(gx, ops.OPS["rms_norm_backward"](dy.float(), x.float(), None, 1e-6)[0])


@pytest.mark.parametrize("ratio,overlap,T,D", [(4, True, 23, 40), (3, False, 13, 24),
                                               (128, False, 256, 48)])
def test_gated_pool_backward_op_bf16_is_float32_rounded(isa, ratio, overlap, T, D):
    r = _gen(1)
    c = 2 if overlap else 1
    kv, sc = r(2, T, c * D).to(BF), r(2, T, c * D).to(BF)
    ape, dy = r(ratio, c * D), r(2, T // ratio, D).to(BF)
    got = ops.OPS["gated_pool_backward"](dy, kv, sc, ratio, ape, overlap)
    want = ops.OPS["gated_pool_backward"](dy.float(), kv.float(), sc.float(), ratio, ape, overlap)
    _assert_rounded(got[0], want[0])
    _assert_rounded(got[1], want[1])
    assert got[2].dtype == F32 and torch.equal(got[2], want[2])


def test_sparse_attn_backward_op_bf16_is_float32_rounded(isa_bf16):
    r = _gen(2)
    B, S, H, D, N, K = 2, 9, 5, 40, 17, 7
    q, kv, sink = r(B, S, H, D).to(BF), r(B, N, D).to(BF), r(H)
    idx = _idx(B, S, K, N)
    out, lse = ops.OPS["sparse_attn"](q, kv, sink, idx, 0.3)
    dO = r(B, S, H, D).to(BF)
    got = ops.OPS["sparse_attn_backward"](dO, q, kv, sink, idx, 0.3, out, lse)
    want = ops.OPS["sparse_attn_backward"](dO.float(), q.float(), kv.float(), sink, idx, 0.3,
                                           out.float(), lse)
    _assert_rounded(got[0], want[0])
    _assert_rounded(got[1], want[1])
    assert got[2].dtype == F32 and torch.equal(got[2], want[2])


# ----------------------------------------------------------------------------- budget
def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _both(fn, *leaves):
    """Gradients of sum(fn(...) * probe) w.r.t. leaves, in bf16 and in float32."""
    res = {}
    for dt in (BF, F32):
        xs = [t.detach().to(dt if t.dtype == BF else t.dtype).requires_grad_() for t in leaves]
        y = fn(*xs)
        probe = _gen(99)(*y.shape).to(y.dtype)
        (y * probe).float().sum().backward()
        res[dt] = [x.grad for x in xs]
    for x, g in zip(leaves, res[BF]):
        assert g.dtype == x.dtype
    return res[BF], res[F32]


def test_layer_ops_bf16_grads_within_budget():
    r = _gen(4)
    B, S, H, D, N, K = 1, 24, 8, 64, 40, 16
    q = r(B, S, H, D).to(BF)
    kv = r(B, N, D).to(BF)
    sink = r(H)
    idx = _idx(B, S, K, N)

    def attn(q, kv, sink):
        qn = ops.call("rms_norm", q, None, 1e-6)                  # the per-head q norm
        return ops.call("sparse_attn", qn, kv, sink, idx, D ** -0.5)[0]
    gb, gf = _both(attn, q, kv, sink)
    for a, b in zip(gb, gf):
        assert _rel(a, b) <= BUDGET, _rel(a, b)

    kvp, scp, ape = r(B, 32, 2 * D).to(BF), r(B, 32, 2 * D).to(BF), r(4, 2 * D)
    gb, gf = _both(lambda k, s, a: dct.gated_pool(k, s, 4, ape=a, overlap=True), kvp, scp, ape)
    for a, b in zip(gb, gf):
        assert _rel(a, b) <= BUDGET, _rel(a, b)


# ----------------------------------------------------------------------------- no copies
class _Float32Watch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every operator output that is a float32 tensor whose last two dims are
    (H, D) with at least `numel` elements: a float32 [B, S, H, D] tensor."""

    def __init__(self, H, D, numel):
        super().__init__()
        self.HD, self.numel, self.seen = (H, D), numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if (isinstance(t, torch.Tensor) and t.dtype == F32 and t.dim() >= 2
                    and tuple(t.shape[-2:]) == self.HD and t.numel() >= self.numel):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_swap_training_step_in_bf16_makes_no_float32_q_copy(monkeypatch):
    """A bf16 swapped model's forward + backward: no operator (ours or torch's) makes a
    float32 tensor of q's [B, S, H, D] shape -- the old backward widened grad_out, q and
    out and returned a float32 d(q), and the norm's backward a float32 d(x) -- and the
    attention's backward kernel allocates no float32 scratch of d(q)'s size (its peak
    memory stays below that size at a shape where it is 32 MiB)."""
    pytest.importorskip("transformers")
    import deepseek_csa.transformers as dch
    from test_transformers_bridge import ids_for, make_model
    m = make_model().to(BF).train()
    cfg = m.config
    B, S = 2, 40
    ids = ids_for(B, S, seed=5)
    H, D = cfg.num_attention_heads, cfg.head_dim
    watch = _Float32Watch(H, D, B * S * H * D)
    with dch.swapped(m):
        with watch:
            out = m(ids, labels=ids)
            out.loss.backward()
    assert not watch.seen, watch.seen[:5]
    assert all(p.grad is None or p.grad.dtype == BF for p in m.parameters())
    assert m.model.layers[1].self_attn.q_b_proj.weight.grad.abs().sum() > 0


_PEAK_SCRIPT = r"""
import sys
import numpy as np, ml_dtypes
import deepseek_csa as dc
dc.set_isa(sys.argv[1])
bf = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
S, H, D, N, K = 256, 64, 512, 768, 64
q = (rng.standard_normal((1, S, H, D), dtype=np.float32) * 0.5).astype(bf)
kv = rng.standard_normal((1, N, D), dtype=np.float32).astype(bf)
sink = rng.standard_normal(H, dtype=np.float32)
idx = rng.integers(0, N, (1, S, K), dtype=np.int32)
out, lse = dc.sparse_attn(q, kv, sink, idx, D ** -0.5, return_lse=True)
dO = rng.standard_normal(q.shape, dtype=np.float32).astype(bf)
gq, gkv, gs = np.empty(q.shape, bf), np.empty(kv.shape, bf), np.empty(H, np.float32)
gq[...] = 0; gkv[...] = 0

def field(name):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name):
                return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = field("VmRSS:")
dc.sparse_attn_backward(dO, q, kv, sink, idx, D ** -0.5, out, lse, grad_q=gq, grad_kv=gkv,
                        grad_sink=gs, grad_dtype="bfloat16")
print(field("VmHWM:") - base)
"""


def test_sparse_attn_backward_bf16_has_no_float32_dq_scratch():
    """At S=256, H=64, D=512 a float32 d(q) is 32 MiB; the bf16 backward's first call in
    a fresh process (results preallocated: no allocator cache to hide a big scratch)
    peaks well below it: P and dS of two row chunks and d(kv)'s float32 sums
    ([B, N, D], 1.5 MiB) only.  (The 'ref' oracle, which goes through float32 scratch,
    peaks above 32 MiB here.)"""
    import os
    import subprocess
    import sys
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to read the peak resident memory")
    level = "avx512" if "avx512" in dc.ISA_LEVELS[:dc.ISA_LEVELS.index(dc.best_isa()) + 1] \
        else dc.best_isa()
    r = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, level], capture_output=True,
                       text=True, check=True)
    peak = int(r.stdout.split()[-1])
    assert peak < 16 * 2 ** 20, peak / 2 ** 20
