"""deepseek_csa's kernels as PyTorch operators: ``torch.ops.deepseek_csa.<name>``.

Every kernel the torch side uses is registered here, once, with ``torch.library``: a
schema, the CPU implementation (the C kernel over the tensors' own memory, no copies),
a fake implementation (shapes and dtypes only, for FakeTensor / torch.compile /
torch.export) and, for the differentiable ones, ``register_autograd`` with a backward
that calls the backward kernels as operators too, so a compiled backward graph holds
them.  Importing ``deepseek_csa.torch`` registers them; ``import deepseek_csa`` alone
never imports torch.

    import torch, deepseek_csa.torch
    y = torch.ops.deepseek_csa.rms_norm(x, w, 1e-6)
    torch.compile(f, fullgraph=True)        # no graph break at our kernels
    torch.export.export(model, args)        # the ExportedProgram holds deepseek_csa ops

The operators (float32 or bfloat16 where the kernel reads both; see each kernel's
NumPy docstring in ``deepseek_csa`` for the arithmetic):

=========================  ========================================  ===========
operator                   result                                    gradient
=========================  ========================================  ===========
rms_norm                   [..., D] in x's dtype                     x, weight
rms_norm_backward          (grad_x in x's dtype, grad_weight f32     --
                           or [0])
apply_rope                 rotated copy of x                         x
apply_rope_                x rotated in place (mutates x)            --
gated_pool                 [B, T // ratio, D] in kv's dtype          kv, score, ape
gated_pool_backward        (grad_kv, grad_score: bf16 when kv and    --
                           score are, else f32; grad_ape f32)
index_scores               f32 [B, S, Tc] (rounding='bf16': the      q, k, weights
                           released bf16 expression's values)        (float32 only)
index_scores_backward      (grad_q, grad_k, grad_weights) f32        --
index_topk, topk_indices   int32 [B, S, min(topk, (p + S) // r)]     --
select_candidate_blocks    bool [B, S, ceil(Tc / block_size)]        --
window_topk_idxs           int32 window index lists                  --
compress_topk_idxs         int32 HCA index lists                     --
sparse_attn                (out in q's dtype, lse f32 [B, S, H])     q, kv, attn_sink
sparse_attn_backward       (grad_q, grad_kv in q's dtype,            --
                           grad_sink f32)
sparse_attn_weights        f32 [B, S, K]                             --
indexer_kl_loss            (loss f32 [], grad_q, grad_k, grad_w,     q, k, weights
                           metrics f64 [5])
fp8_round, fp4_round       QAT rounding, a new tensor                x (straight through)
fp8_round_, fp4_round_     QAT rounding in place (mutates x)         --
hadamard                   [..., n] in x's dtype                     x
fp8_gemm, fp4_gemm         [..., N] in out_dtype                     --
wfp8_gemm                  [..., N] in out_dtype (weight-only FP8)   --
wbf16_gemm                 [..., N] in out_dtype (bf16 weights)      --
fp8_quant, fp4_quant       (codes, scales) in torch's float8/4 dtypes --
fp4_pack                   uint8 [..., D / 2 + D / 32] FP4 key rows  --
moe_combine                [num_tokens, H] in rows' dtype: the rows  --
                           added into their tokens' rows in order
hc_split_sinkhorn          (pre, post, comb) f32                     --
=========================  ========================================  ===========

``lse`` of sparse_attn and the gradients and metrics returned by indexer_kl_loss are marked
non-differentiable: nothing flows back through them.

bfloat16 training: the backward operators of rms_norm, gated_pool and sparse_attn read
bfloat16 tensors as they are (widened exactly where the kernel reads them, float32
arithmetic) and write bfloat16 gradients rounded once from the float32 result, so a
bf16 layer's backward makes no float32 copy of q, out, grad_out or d(q) (docs/training.md,
"bfloat16").  The indexer's index_scores / indexer_kl_loss still compute in float32.

C++ kernels: for the operators in ``NATIVE`` (those of a decode step: rms_norm, apply_rope_,
fp8_quant, fp8_gemm, fp4_gemm, hc_split_sinkhorn, sparse_attn, gated_pool, moe_combine)
the CPU kernel and, for the differentiable ones, the autograd kernel are C++
(``deepseek_csa.torch._native``, csrc/torch/native.cpp, built where torch is importable
at build time and loaded only under the torch it was built against): the plain case
runs there straight into the C kernel, everything else -- other layouts, bad arguments,
something to record for autograd -- goes on to the Python kernels below, which keep
the validation, the messages and the formula (docs/architecture.md).

Eager calls: the public functions below call the operators.  In plain eager mode with
no gradient to record (no input requires grad, or grad mode is off), nothing can
observe the dispatch -- no tracer, no dispatch mode, no tensor subclass -- and they call
the operator's CPU implementation directly: the same function the dispatcher would
run, without the dispatcher's trip into Python and back (rms_norm [1, 4096], CPU time
over the NumPy call: +5.9 us through the dispatcher with our autograd kernel, +3.0
direct, Sapphire Rapids Xeon; docs/architecture.md), which a decode step pays hundreds
of times.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import ml_dtypes
import numpy as np
import torch

import deepseek_csa as _dc

__all__ = ["DIFFERENTIABLE", "LIB", "NAMESPACE", "NATIVE", "OPS", "call", "direct"]

NAMESPACE = "deepseek_csa"
LIB = torch.library.Library(NAMESPACE, "DEF")
OPS = {}          # name -> OpOverload (torch.ops.deepseek_csa.<name>.default)
DIFFERENTIABLE = set()   # the names with an autograd formula
NATIVE = set()    # the names whose CPU and autograd kernels are C++ (deepseek_csa.torch._native)
_IMPLS = {}       # name -> the CPU implementation (the direct eager path)


def _load_native():
    """deepseek_csa.torch._native, the C++ kernels of some operators (csrc/torch/native.cpp),
    bound to deepseek_csa._core's C kernels; None where it is not built, was built
    against another torch (its C++ ABI is that build's: loading it could crash, so the
    version written beside it at build time is checked first) or
    DEEPSEEK_CSA_TORCH_NATIVE=0.  Then every operator keeps its Python kernels -- the
    same results, a few microseconds more a call -- and, unless asked for, this says so
    once."""
    if os.environ.get("DEEPSEEK_CSA_TORCH_NATIVE", "1") == "0":
        return None
    spec = importlib.util.find_spec(__package__ + "._native")
    why = None
    if spec is None or not spec.origin:
        why = "it is not built (setup.py builds it where torch is importable at build time)"
    else:
        try:
            with open(os.path.join(os.path.dirname(spec.origin), "_native.torch-version")) as f:
                built = f.read().strip()
        except OSError:
            built = "an unknown torch"
        if built != torch.__version__:
            why = f"it was built against torch {built}, this is torch {torch.__version__}"
    if why is None:
        try:
            from . import _native
            _native.bind_core(_dc._core.__file__)
            return _native
        except Exception as e:   # a broken build must not break the operators
            why = f"loading it failed ({type(e).__name__}: {e})"
    warnings.warn(f"deepseek_csa.torch: the C++ operator kernels are not used: {why}. "
                  "The operators run their Python kernels (the same results, a few "
                  "microseconds more per call); rebuild the package where torch is "
                  "installed (`make build`) to get them.", RuntimeWarning, stacklevel=3)
    return None


_NATIVE = _load_native()

_f32 = torch.float32
_bf16 = torch.bfloat16
_i32 = torch.int32
_NP_BF16 = np.dtype(ml_dtypes.bfloat16)
_NP_F32 = np.dtype(np.float32)   # the one float32 descriptor the glue's results carry
_from_numpy = torch.from_numpy


def _tensor(a):
    """The tensor over a kernel's result array, without a copy: the NumPy entries
    allocate their outputs more cheaply than torch.empty + an out= view (torch.empty_like
    alone costs 0.9 CPU-us against 0.6 for torch.from_numpy, and out= adds the glue's
    view of it and its overlap checks), bfloat16 ones as ml_dtypes arrays viewed back."""
    if a.dtype is _NP_F32 or a.dtype != _NP_BF16:
        return _from_numpy(a)
    return _from_numpy(a.view(np.int16)).view(_bf16)


def _detached(impl):
    """An operator without a gradient formula reads requires-grad tensors as plain data:
    the CPU kernel runs with grad mode off (the glue views a tensor that requires grad
    only then), so an integer result (top-k lists, candidate flags) or a quantized copy
    never raises because an input happens to be a trained parameter."""
    def kernel(*args):
        if not _grad_enabled():
            return impl(*args)
        with torch.no_grad():
            return impl(*args)
    kernel.__name__ = kernel.__qualname__ = impl.__name__
    return kernel


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# the dispatch keys below autograd of a plain dense CPU tensor (CPU, ADInplaceOrView):
# where the keys left are among these, nothing between the autograd kernel and the CPU
# kernel would act on a functional operator.  A DispatchKeySet's & is the & of its
# raw bits, so the test is one int mask of the keyset's raw_repr() (one pybind call
# instead of three: 0.18 against 0.55 CPU-us at load 5).
_NOT_PLAIN = ~(torch._C._dispatch_keys(torch.empty(0)) & _AFTER_AUTOGRAD).raw_repr()
_NOT_PLAIN_AFTER_AUTOGRAD = _AFTER_AUTOGRAD.raw_repr() & _NOT_PLAIN
_any_requires_grad = torch._C._any_requires_grad
_grad_enabled = torch.is_grad_enabled


def _register_autograd(op, name, impl, backward, setup_context, register=True, lib=LIB):
    """The autograd kernel of a differentiable operator: torch.library.register_autograd's
    own (an autograd.Function over the formula), plus a shortcut when there is nothing
    to record and every tensor is a plain CPU tensor (the keys below autograd are CPU and
    ADInplaceOrView only, which a functional operator passes through): the CPU kernel
    is called right here instead of redispatched.  register_autograd's no-grad path
    builds a metadata object, enters _AutoDispatchBelowAutograd and redispatches -- a
    second trip from Python into the dispatcher and back (rms_norm [1, 4096], no_grad:
    see benchmarks/bench_ops_overhead.py for what it saves)."""
    from torch._library.autograd import Info, make_autograd_impl
    generated = make_autograd_impl(op, Info(backward, setup_context))
    if not register:   # a C++ autograd kernel (deepseek_csa.torch._native) calls it
        return generated

    def autograd_kernel(keyset, *args):
        if not keyset.raw_repr() & _NOT_PLAIN_AFTER_AUTOGRAD and not (
                _grad_enabled() and _any_requires_grad(*args)):
            return impl(*args)
        return generated(keyset, *args)
    autograd_kernel.__name__ = autograd_kernel.__qualname__ = f"{name}_autograd"
    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return generated


def _define(schema, impl, fake, *, backward=None, setup_context=None, key="CPU"):
    """Defines deepseek_csa::<name> from its schema with its CPU and fake kernels (and
    its autograd formula); returns the OpOverload.  Operators without a tensor argument
    (the index lists) have nothing to dispatch on: their kernel is registered for every
    backend (``key="CompositeExplicitAutograd"``)."""
    name = schema.split("(", 1)[0]
    native = _NATIVE is not None and name in _NATIVE.OPERATORS
    LIB.define(schema)
    cpu = impl if backward is not None else _detached(impl)
    if not native:
        LIB.impl(name, cpu, key)
    qual = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qual, fake, lib=LIB)
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    if backward is not None:
        generated = _register_autograd(op, name, impl, backward, setup_context,
                                       register=not native)
        DIFFERENTIABLE.add(name)
    if native:   # C++ CPU and autograd kernels in front of these Python ones
        _NATIVE.register_operator(name, cpu, generated if backward is not None else None)
        NATIVE.add(name)
    OPS[name] = op
    _IMPLS[name] = impl
    return op


_is_compiling = torch.compiler.is_compiling
_dispatch_stack = torch._C._len_torch_dispatch_stack
_functorch = torch._C._are_functorch_transforms_active
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(*args):
    """True when an eager call may run the CPU implementation itself: not tracing,
    compiling or exporting, no dispatch mode and no functorch transform active, every
    tensor argument a plain tensor (or Parameter), and nothing for autograd to record."""
    if _is_compiling() or _dispatch_stack() or _functorch():
        return False
    grad = _grad_enabled()
    for t in args:
        if isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


def call(name, *args):
    """deepseek_csa::<name> on args (every schema argument, in order): the CPU
    implementation directly where ``direct`` allows it, else through the dispatcher.
    An operator with C++ kernels (NATIVE) always goes through the dispatcher: its C++
    autograd kernel makes the same test, cheaper than ``direct`` in Python."""
    if name not in NATIVE and direct(*args):
        return _IMPLS[name](*args)
    return OPS[name](*args)


# ----------------------------------------------------------------------------- RMSNorm
def _rms_norm_impl(x, weight, eps):
    return _tensor(_dc.rms_norm(x, weight, eps))


def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _grad_dtype(dtype):
    """The backward kernels' grad_dtype= for gradients of this torch dtype."""
    return "bfloat16" if dtype == _bf16 else "float32"


def _rms_norm_bwd_impl(grad, x, weight, eps):
    gx = torch.empty(x.shape, dtype=x.dtype)
    gd = _grad_dtype(x.dtype)
    if weight is None:
        _dc.rms_norm_backward(grad, x, None, eps, grad_x=gx, grad_dtype=gd)
        return gx, torch.empty(0, dtype=_f32)
    gw = torch.empty(weight.shape, dtype=_f32)
    _dc.rms_norm_backward(grad, x, weight, eps, grad_x=gx, grad_weight=gw, grad_dtype=gd)
    return gx, gw


def _rms_norm_bwd_fake(grad, x, weight, eps):
    return (x.new_empty(x.shape),
            x.new_empty(weight.shape if weight is not None else (0,), dtype=_f32))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight)


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = OPS["rms_norm_backward"](grad, x, weight, ctx.eps)
    return (gx.to(x.dtype) if ctx.needs_input_grad[0] else None,
            gw.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None,
            None)


_define("rms_norm_backward(Tensor grad_out, Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)",
        _rms_norm_bwd_impl, _rms_norm_bwd_fake)
_define("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor", _rms_norm_impl, _rms_norm_fake,
        backward=_rms_norm_backward, setup_context=_rms_norm_setup)


# ----------------------------------------------------------------------------- RoPE
def _rope_inplace_impl(x, cos, sin, inverse):
    _dc.apply_rope(x, cos, sin, inverse=inverse)


def _rope_inplace_fake(x, cos, sin, inverse):
    return None


def _rope_impl(x, cos, sin, inverse):
    y = torch.empty(x.shape, dtype=x.dtype)
    y.copy_(x)
    _dc.apply_rope(y, cos, sin, inverse=inverse)
    return y


def _rope_fake(x, cos, sin, inverse):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.inverse = inverse
    ctx.save_for_backward(cos, sin)


def _rope_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    # a rotation's transpose is the opposite rotation
    return OPS["apply_rope"](grad, cos, sin, not ctx.inverse), None, None, None


_define("apply_rope_(Tensor(a!) x, Tensor cos, Tensor sin, bool inverse) -> ()",
        _rope_inplace_impl, _rope_inplace_fake)
_define("apply_rope(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor",
        _rope_impl, _rope_fake, backward=_rope_backward, setup_context=_rope_setup)


# ----------------------------------------------------------------------------- pooling
def _pool_shape(kv, ratio, overlap):
    d = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    return (kv.shape[0], kv.shape[1] // ratio, d)


def _pool_impl(kv, score, ratio, ape, overlap):
    return _tensor(_dc.gated_pool(kv, score, ratio, ape=ape, overlap=overlap))


def _pool_fake(kv, score, ratio, ape, overlap):
    return kv.new_empty(_pool_shape(kv, ratio, overlap))


def _pool_grad_dtype(kv, score):
    """d(kv) and d(score) share one dtype: bfloat16 when kv and score (if any) are."""
    return _bf16 if kv.dtype == _bf16 and (score is None or score.dtype == _bf16) else _f32


def _pool_bwd_impl(grad, kv, score, ratio, ape, overlap):
    gd = _pool_grad_dtype(kv, score)
    gk = torch.empty(kv.shape, dtype=gd)
    gs = torch.empty(score.shape if score is not None else (0,), dtype=gd)
    ga = torch.empty(ape.shape if ape is not None else (0,), dtype=_f32)
    _dc.gated_pool_backward(grad, kv, score, ratio, ape=ape, overlap=overlap, grad_kv=gk,
                            grad_score=gs if score is not None else None,
                            grad_ape=ga if ape is not None else None,
                            grad_dtype=_grad_dtype(gd))
    return gk, gs, ga


def _pool_bwd_fake(grad, kv, score, ratio, ape, overlap):
    gd = _pool_grad_dtype(kv, score)
    return (kv.new_empty(kv.shape, dtype=gd),
            kv.new_empty(score.shape if score is not None else (0,), dtype=gd),
            kv.new_empty(ape.shape if ape is not None else (0,), dtype=_f32))


def _pool_setup(ctx, inputs, output):
    kv, score, ratio, ape, overlap = inputs
    ctx.ratio, ctx.overlap = ratio, overlap
    ctx.save_for_backward(kv, score, ape)


def _pool_backward(ctx, grad):
    kv, score, ape = ctx.saved_tensors
    gk, gs, ga = OPS["gated_pool_backward"](grad, kv, score, ctx.ratio, ape, ctx.overlap)
    need = ctx.needs_input_grad
    return (gk.to(kv.dtype) if need[0] else None,
            gs.to(score.dtype) if score is not None and need[1] else None, None,
            ga.to(ape.dtype) if ape is not None and need[3] else None, None)


_define("gated_pool_backward(Tensor grad_out, Tensor kv, Tensor? score, int ratio, Tensor? ape, "
        "bool overlap) -> (Tensor, Tensor, Tensor)", _pool_bwd_impl, _pool_bwd_fake)
_define("gated_pool(Tensor kv, Tensor? score, int ratio, Tensor? ape, bool overlap) "
        "-> Tensor", _pool_impl, _pool_fake, backward=_pool_backward, setup_context=_pool_setup)


# ----------------------------------------------------------------------------- indexer
def _scores_impl(q, k, weights, ratio, start_pos, rounding="float32"):
    return torch.from_numpy(_dc.index_scores(q, k, weights, ratio=ratio, start_pos=start_pos,
                                             rounding=rounding))


def _scores_fake(q, k, weights, ratio, start_pos, rounding="float32"):
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=_f32)


def _scores_bwd_impl(grad, q, k, weights, ratio, start_pos):
    gq, gk, gw = _dc.index_scores_backward(grad, q, k, weights, ratio=ratio,
                                           start_pos=start_pos)
    return torch.from_numpy(gq), torch.from_numpy(gk), torch.from_numpy(gw)


def _scores_bwd_fake(grad, q, k, weights, ratio, start_pos):
    return (q.new_empty(q.shape, dtype=_f32), k.new_empty(k.shape, dtype=_f32),
            weights.new_empty(weights.shape, dtype=_f32))


def _scores_setup(ctx, inputs, output):
    q, k, weights, ratio, start_pos, rounding = inputs
    ctx.ratio, ctx.start_pos, ctx.rounding = ratio, start_pos, rounding
    ctx.save_for_backward(q, k, weights)


def _scores_backward(ctx, grad):
    if ctx.rounding != "float32":
        raise RuntimeError(f"index_scores(rounding={ctx.rounding!r}) has no gradient: its "
                           "bfloat16 roundings reproduce the released selection, which is "
                           "discrete; train with rounding='float32'")
    q, k, w = ctx.saved_tensors
    gq, gk, gw = OPS["index_scores_backward"](grad, q, k, w, ctx.ratio, ctx.start_pos)
    need = ctx.needs_input_grad
    return (gq.to(q.dtype) if need[0] else None, gk.to(k.dtype) if need[1] else None,
            gw.to(w.dtype) if need[2] else None, None, None, None)


_define("index_scores_backward(Tensor grad_scores, Tensor q, Tensor k, Tensor weights, int ratio, "
        "SymInt start_pos) -> (Tensor, Tensor, Tensor)", _scores_bwd_impl, _scores_bwd_fake)
_define("index_scores(Tensor q, Tensor k, Tensor weights, int ratio, SymInt start_pos, "
        "str rounding='float32') -> Tensor",
        _scores_impl, _scores_fake, backward=_scores_backward, setup_context=_scores_setup)


def _topk_width(topk, ratio, start_pos, s):
    return torch.sym_min(topk, (start_pos + s) // ratio)


def _index_topk_impl(q, k, weights, topk, ratio, start_pos, offset, order, candidates,
                     block_size):
    kw = {} if candidates is None else dict(candidates=candidates, block_size=block_size)
    return torch.from_numpy(_dc.index_topk(q, k, weights, topk, ratio=ratio, start_pos=start_pos,
                                           offset=offset, order=order, **kw))


def _index_topk_fake(q, k, weights, topk, ratio, start_pos, offset, order, candidates,
                     block_size):
    return q.new_empty((q.shape[0], q.shape[1], _topk_width(topk, ratio, start_pos, q.shape[1])),
                       dtype=_i32)


def _topk_indices_impl(scores, topk, ratio, start_pos, offset, order, candidates, block_size):
    kw = {} if candidates is None else dict(candidates=candidates, block_size=block_size)
    return torch.from_numpy(_dc.topk_indices(scores, topk, ratio=ratio, start_pos=start_pos,
                                             offset=offset, order=order, **kw))


def _topk_indices_fake(scores, topk, ratio, start_pos, offset, order, candidates, block_size):
    s = scores.shape[1]
    return scores.new_empty((scores.shape[0], s, _topk_width(topk, ratio, start_pos, s)),
                            dtype=_i32)


def _blocks_impl(scores, topk_blocks, block_size, ratio, start_pos):
    return torch.from_numpy(_dc.select_candidate_blocks(scores, topk_blocks, block_size,
                                                        ratio=ratio, start_pos=start_pos))


def _blocks_fake(scores, topk_blocks, block_size, ratio, start_pos):
    nb = (scores.shape[2] + block_size - 1) // block_size
    return scores.new_empty((scores.shape[0], scores.shape[1], nb), dtype=torch.bool)


_TOPK_TAIL = "str order, Tensor? candidates, int block_size) -> Tensor"
_define("index_topk(Tensor q, Tensor k, Tensor weights, int topk, int ratio, SymInt start_pos, "
        "SymInt offset, " + _TOPK_TAIL, _index_topk_impl, _index_topk_fake)
_define("topk_indices(Tensor scores, int topk, int ratio, SymInt start_pos, SymInt offset, "
        + _TOPK_TAIL, _topk_indices_impl, _topk_indices_fake)
_define("select_candidate_blocks(Tensor scores, int topk_blocks, int block_size, int ratio, "
        "SymInt start_pos) -> Tensor", _blocks_impl, _blocks_fake)


def _window_impl(window_size, bsz, seqlen, start_pos):
    return torch.from_numpy(_dc.window_topk_idxs(window_size, bsz, seqlen, start_pos))


def _window_fake(window_size, bsz, seqlen, start_pos):
    k = window_size if start_pos > 0 else torch.sym_min(seqlen, window_size)
    return torch.empty((bsz, seqlen, k), dtype=_i32, device="cpu")


def _compress_impl(ratio, bsz, seqlen, start_pos, offset):
    return torch.from_numpy(_dc.compress_topk_idxs(ratio, bsz, seqlen, start_pos, offset))


def _compress_fake(ratio, bsz, seqlen, start_pos, offset):
    return torch.empty((bsz, seqlen, (start_pos + seqlen) // ratio), dtype=_i32, device="cpu")


_define("window_topk_idxs(int window_size, SymInt bsz, SymInt seqlen, SymInt start_pos) -> Tensor",
        _window_impl, _window_fake, key="CompositeExplicitAutograd")
_define("compress_topk_idxs(int ratio, SymInt bsz, SymInt seqlen, SymInt start_pos, SymInt offset) -> Tensor",
        _compress_impl, _compress_fake, key="CompositeExplicitAutograd")


# ----------------------------------------------------------------------------- attention
def _attn_impl(q, kv, attn_sink, topk_idxs, softmax_scale):
    out, lse = _dc.sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale, return_lse=True)
    return _tensor(out), torch.from_numpy(lse)


def _attn_fake(q, kv, attn_sink, topk_idxs, softmax_scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_f32)


def _attn_bwd_impl(grad_out, q, kv, attn_sink, topk_idxs, softmax_scale, out, lse):
    dq, dkv, ds = _dc.sparse_attn_backward(grad_out, q, kv, attn_sink, topk_idxs, softmax_scale,
                                           out, lse, grad_dtype=_grad_dtype(q.dtype))
    return _tensor(dq), _tensor(dkv), torch.from_numpy(ds)


def _attn_bwd_fake(grad_out, q, kv, attn_sink, topk_idxs, softmax_scale, out, lse):
    return (q.new_empty(q.shape), kv.new_empty(kv.shape, dtype=q.dtype),
            attn_sink.new_empty(attn_sink.shape, dtype=_f32))


def _attn_setup(ctx, inputs, output):
    q, kv, attn_sink, topk_idxs, scale = inputs
    out, lse = output
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, kv, attn_sink, topk_idxs, out, lse)


def _attn_backward(ctx, grad_out, grad_lse):
    q, kv, attn_sink, idx, out, lse = ctx.saved_tensors
    # the kernel reads bf16 q / kv / out / grad_out as they are and returns q's dtype
    dq, dkv, ds = OPS["sparse_attn_backward"](grad_out, q, kv, attn_sink, idx, ctx.scale, out,
                                              lse)
    need = ctx.needs_input_grad
    return (dq.to(q.dtype) if need[0] else None, dkv.to(kv.dtype) if need[1] else None,
            ds.to(attn_sink.dtype) if need[2] else None, None, None)


def _weights_impl(q, kv, attn_sink, topk_idxs, softmax_scale):
    return torch.from_numpy(_dc.sparse_attn_weights(q, kv, attn_sink, topk_idxs, softmax_scale))


def _weights_fake(q, kv, attn_sink, topk_idxs, softmax_scale):
    return q.new_empty(topk_idxs.shape, dtype=_f32)


_define("sparse_attn_backward(Tensor grad_out, Tensor q, Tensor kv, Tensor attn_sink, "
        "Tensor topk_idxs, float softmax_scale, Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor)",
        _attn_bwd_impl, _attn_bwd_fake)
_define("sparse_attn(Tensor q, Tensor kv, Tensor attn_sink, Tensor topk_idxs, "
        "float softmax_scale) -> (Tensor, Tensor)", _attn_impl, _attn_fake,
        backward=_attn_backward, setup_context=_attn_setup)
_define("sparse_attn_weights(Tensor q, Tensor kv, Tensor attn_sink, Tensor topk_idxs, "
        "float softmax_scale) -> Tensor", _weights_impl, _weights_fake)


def _kl_impl(q, k, weights, topk_idxs, attn_target, ratio, start_pos, positions, target, clip):
    loss, gq, gk, gw, m = _dc.indexer_kl_loss(q, k, weights, topk_idxs, attn_target, ratio=ratio,
                                              start_pos=start_pos, positions=positions,
                                              target=target, clip=clip, return_grads=True,
                                              return_metrics=True)
    return (torch.tensor(loss, dtype=_f32), torch.from_numpy(gq), torch.from_numpy(gk),
            torch.from_numpy(gw), torch.tensor(tuple(m), dtype=torch.float64))


def _kl_fake(q, k, weights, topk_idxs, attn_target, ratio, start_pos, positions, target, clip):
    return (q.new_empty((), dtype=_f32), q.new_empty(q.shape, dtype=_f32),
            k.new_empty(k.shape, dtype=_f32), weights.new_empty(weights.shape, dtype=_f32),
            q.new_empty((5,), dtype=torch.float64))


def _kl_setup(ctx, inputs, output):
    _, gq, gk, gw, metrics = output
    ctx.mark_non_differentiable(gq, gk, gw, metrics)
    ctx.save_for_backward(gq, gk, gw)
    ctx.dtypes = tuple(t.dtype for t in inputs[:3])


def _kl_backward(ctx, grad, *_):
    # the kernel computed the gradients with the loss: scale them by the incoming one
    gq, gk, gw = ctx.saved_tensors
    need = ctx.needs_input_grad
    return tuple((g * grad).to(dt) if n else None
                 for g, dt, n in zip((gq, gk, gw), ctx.dtypes, need[:3])) + (None,) * 7


# the last result: (kl, kl_uniform, kl_captured, rows, degenerate_rows) as float64
_define("indexer_kl_loss(Tensor q, Tensor k, Tensor weights, Tensor? topk_idxs, Tensor attn_target, "
        "int ratio, SymInt start_pos, Tensor? positions, str target, float? clip) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", _kl_impl, _kl_fake,
        backward=_kl_backward, setup_context=_kl_setup)


# ----------------------------------------------------------------------------- QAT, Hadamard
def _round_impl(kernel):
    def inplace(x, block_size, scale):
        kernel(x, block_size, scale=scale)

    def functional(x, block_size, scale):
        y = torch.empty(x.shape, dtype=x.dtype)
        kernel(x, block_size, scale=scale, out=y)
        return y
    return inplace, functional


def _round_inplace_fake(x, block_size, scale):
    return None


def _round_fake(x, block_size, scale):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _straight_through_setup(ctx, inputs, output):
    pass


def _straight_through(ctx, grad):
    return grad, None, None


for _name, _kernel in (("fp8_round", _dc.fp8_round), ("fp4_round", _dc.fp4_round)):
    _inp, _fun = _round_impl(_kernel)
    _define(f"{_name}_(Tensor(a!) x, int block_size, str scale) -> ()",
            _inp, _round_inplace_fake)
    _define(f"{_name}(Tensor x, int block_size, str scale) -> Tensor", _fun,
            _round_fake, backward=_straight_through, setup_context=_straight_through_setup)


def _hadamard_impl(x, scale):
    return _tensor(_dc.hadamard(x, scale=scale))


def _hadamard_fake(x, scale):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _hadamard_setup(ctx, inputs, output):
    ctx.scale = inputs[1]


def _hadamard_backward(ctx, grad):
    # the Walsh-Hadamard matrix is symmetric: the backward is the same transform
    return OPS["hadamard"](grad, ctx.scale), None


_define("hadamard(Tensor x, float? scale) -> Tensor", _hadamard_impl, _hadamard_fake,
        backward=_hadamard_backward, setup_context=_hadamard_setup)


# ----------------------------------------------------------------------------- FP8 / FP4
_OUT_DTYPES = {_f32: "float32", _bf16: "bfloat16"}


def _gemm_impl(kernel):
    def impl(a, a_s, b, b_s, out_dtype, b_index):
        n = b.shape[-2]
        out = torch.empty(tuple(a.shape[:-1]) + (n,), dtype=out_dtype)
        kernel(a, a_s, b, b_s, b_index=b_index, out_dtype=_OUT_DTYPES[out_dtype], out=out)
        return out
    return impl


def _gemm_fake(a, a_s, b, b_s, out_dtype, b_index):
    return a.new_empty(tuple(a.shape[:-1]) + (b.shape[-2],), dtype=out_dtype)


for _name, _kernel in (("fp8_gemm", _dc.fp8_gemm), ("fp4_gemm", _dc.fp4_gemm)):
    _define(f"{_name}(Tensor a, Tensor a_s, Tensor b, Tensor b_s, ScalarType out_dtype, "
            "Tensor? b_index) -> Tensor", _gemm_impl(_kernel), _gemm_fake)

def _wfp8_gemm_impl(a, b, b_s, groups, out_dtype):
    return _tensor(_dc.wfp8_gemm(a, b, b_s, groups=groups, out_dtype=_OUT_DTYPES[out_dtype]))


def _wfp8_gemm_fake(a, b, b_s, groups, out_dtype):
    lead = tuple(a.shape[:-2] if groups > 1 else a.shape[:-1])
    return a.new_empty(lead + (b.shape[0],), dtype=out_dtype)


_define("wfp8_gemm(Tensor a, Tensor b, Tensor b_s, int groups, ScalarType out_dtype) -> Tensor",
        _wfp8_gemm_impl, _wfp8_gemm_fake)


def _wbf16_gemm_impl(a, b, out_dtype):
    return _tensor(_dc.wbf16_gemm(a, b, out_dtype=_OUT_DTYPES[out_dtype]))


def _wbf16_gemm_fake(a, b, out_dtype):
    return a.new_empty(tuple(a.shape[:-1]) + (b.shape[0],), dtype=out_dtype)


_define("wbf16_gemm(Tensor a, Tensor b, ScalarType out_dtype) -> Tensor",
        _wbf16_gemm_impl, _wbf16_gemm_fake)


_SCALE_DTYPES = {"float32": _f32, "e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}


def _fp8_quant_impl(x, block_size, scale, scale_dtype):
    q, s = _dc.fp8_quant(x, block_size, scale=scale, scale_dtype=scale_dtype)
    st = torch.from_numpy(s)
    return (torch.from_numpy(q).view(torch.float8_e4m3fn),
            st.view(torch.float8_e8m0fnu) if scale_dtype == "e8m0" else st)


def _fp8_quant_fake(x, block_size, scale, scale_dtype):
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(tuple(x.shape[:-1]) + (x.shape[-1] // block_size,),
                        dtype=_SCALE_DTYPES[scale_dtype]))


def _fp4_quant_impl(x, block_size, scale, scale_dtype):
    q, s = _dc.fp4_quant(x, block_size, scale=scale,
                         scale_dtype="float32" if scale_dtype == "float32" else None)
    st = torch.from_numpy(s)
    if scale_dtype != "float32":
        st = st.view(_SCALE_DTYPES[scale_dtype])
    return torch.from_numpy(q).view(torch.float4_e2m1fn_x2), st


def _fp4_quant_fake(x, block_size, scale, scale_dtype):
    return (x.new_empty(tuple(x.shape[:-1]) + (x.shape[-1] // 2,), dtype=torch.float4_e2m1fn_x2),
            x.new_empty(tuple(x.shape[:-1]) + (x.shape[-1] // block_size,),
                        dtype=_SCALE_DTYPES[scale_dtype]))


def _fp4_pack_impl(x, round):
    return torch.from_numpy(_dc.fp4_pack(x, round=round))


def _fp4_pack_fake(x, round):
    d = x.shape[-1]
    return x.new_empty(tuple(x.shape[:-1]) + (d // 2 + d // 32,), dtype=torch.uint8)


# the indexer's FP4 key rows (uint8 [..., D / 2 + D / 32]); round=False raises ValueError
# on a block off the FP4 grid (callers that cannot know use the NumPy entry)
_define("fp4_pack(Tensor x, bool round) -> Tensor", _fp4_pack_impl, _fp4_pack_fake)
_define("fp8_quant(Tensor x, int block_size, str scale, str scale_dtype) "
        "-> (Tensor, Tensor)", _fp8_quant_impl, _fp8_quant_fake)
_define("fp4_quant(Tensor x, int block_size, str scale, str scale_dtype) "
        "-> (Tensor, Tensor)", _fp4_quant_impl, _fp4_quant_fake)


def _moe_combine_impl(rows, index, num_tokens):
    """out [num_tokens, H] = zeros, then for p = 0, 1, ..., P - 1 in that order:
    out[index[p]] += rows[p], each sum rounded to rows' dtype; rows whose index is outside
    0 .. num_tokens - 1 are skipped.  That is what a loop of index_add_ calls does (an
    MoE adding its experts' outputs one expert at a time): a token's sum depends on the
    order of its rows, which a single index_add_ with a repeated index does not keep.
    Here: the j-th row of every token (counting its earlier rows) goes in the j-th
    index_add_, whose indices are then distinct, so each element is added one row at a
    time in the given order (as many calls as the most rows a token has: k at most for
    an MoE's top-k pairs)."""
    _moe_combine_check(rows, index, num_tokens)
    out = torch.zeros((num_tokens, rows.shape[1]), dtype=rows.dtype)
    keep = (index >= 0) & (index < num_tokens)
    if not bool(keep.all()):
        index, rows = index[keep], rows[keep]
    n = index.shape[0]
    if n == 0:
        return out
    if num_tokens == 1:              # decode: every row is the one token's, in order
        for p in range(n):
            out.add_(rows[p:p + 1])
        return out
    by_token = torch.argsort(index, stable=True)       # each token's rows, in order
    counts = torch.bincount(index, minlength=num_tokens)
    first = torch.cumsum(counts, 0) - counts           # a token's first place in by_token
    rank = torch.empty_like(index)
    rank[by_token] = torch.arange(n) - first[index[by_token]]
    for j in range(int(counts.max())):
        sel = rank == j
        out.index_add_(0, index[sel], rows[sel])
    return out


def _moe_combine_check(rows, index, num_tokens):
    if rows.dim() != 2 or not rows.is_floating_point():
        raise ValueError(f"moe_combine: 'rows' must be a float tensor [P, H], got "
                         f"{rows.dtype} of shape {tuple(rows.shape)}")
    if index.dim() != 1 or index.dtype != torch.int64 or index.shape[0] != rows.shape[0]:
        raise ValueError(f"moe_combine: 'index' must be int64 [P] with P = rows.shape[0] = "
                         f"{rows.shape[0]}, got {index.dtype} of shape {tuple(index.shape)}")
    if num_tokens < 0:
        raise ValueError(f"moe_combine: 'num_tokens' must be >= 0, got {num_tokens}")


def _moe_combine_fake(rows, index, num_tokens):
    _moe_combine_check(rows, index, num_tokens)
    return rows.new_empty((num_tokens, rows.shape[1]))


# MoE output: rows [P, H] (float) into [num_tokens, H] by index [P] (int64)
_define("moe_combine(Tensor rows, Tensor index, SymInt num_tokens) -> Tensor",
        _moe_combine_impl, _moe_combine_fake)


def _sinkhorn_impl(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps):
    pre, post, comb = _dc.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters,
                                            eps)
    return torch.from_numpy(pre), torch.from_numpy(post), torch.from_numpy(comb)


def _sinkhorn_fake(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps):
    lead = tuple(mixes.shape[:-1])
    return (mixes.new_empty(lead + (hc_mult,), dtype=_f32),
            mixes.new_empty(lead + (hc_mult,), dtype=_f32),
            mixes.new_empty(lead + (hc_mult, hc_mult), dtype=_f32))


_define("hc_split_sinkhorn(Tensor mixes, Tensor hc_scale, Tensor hc_base, int hc_mult, "
        "int sinkhorn_iters, float eps) -> (Tensor, Tensor, Tensor)",
        _sinkhorn_impl, _sinkhorn_fake)
