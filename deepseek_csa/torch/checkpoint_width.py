"""Weights read at the width the checkpoint stores them: the released model.py's
attention output projection ``wo_a`` read as FP8 again (``fp8_wo_a``), and its float32
weights that the checkpoint stores in bf16 read as bf16 (``bf16_f32_weights``).

The released checkpoint stores ``wo_a`` in FP8 (e4m3 codes, ue8m0 scales per 128 x 128
block); DeepSeek's convert.py widens it to bf16 and model.py multiplies it as a bf16
einsum (its comment: "wo_a is FP8 in checkpoint; could do FP8 einsum here for better
perf, but using BF16 for simplicity").  At decode that einsum reads 2 bytes a weight,
wo_a is the layer's largest single read (V4-Flash: 8 x [1024, 4096], 64 MiB in bf16),
and a step is bound by the bytes it reads.

``fp8_wo_a(model)`` finds each attention's bf16 ``wo_a`` weight, quantizes it back to
e4m3 codes with power-of-two scales per 128 x 128 block -- exactly: a widened FP8 tensor
is representable, and the function checks that the codes times the scales give the bf16
values bit for bit, leaving any weight that is not so (a genuinely bf16 one) as it is --
and puts in its place an ``FP8Weight``: a tensor with the bf16 weight's shape and dtype
that holds only the codes and scales.  model.py's two uses of it are served directly:
``.view(groups, rank, -1)`` gives another FP8Weight, and ``torch.einsum("bsgd,grd->bsgr",
o, wo_a)`` with at most ``MAX_ROWS`` rows of o runs deepseek_csa's weight-only FP8 GEMM
(``torch.ops.deepseek_csa.wfp8_gemm``: o as it is, bf16, times the decoded weights,
float32 sums, bf16 result -- the einsum's arithmetic, its products exact, its sums in
another order).  Any other use, and the einsum of a long prefill, sees the bf16 weight
(dequantized for that call; exact).
"""
from __future__ import annotations

import torch

from . import ops

__all__ = ["FP8Weight", "fp8_wo_a", "requantize_fp8", "MAX_ROWS", "BF16Weight",
           "RouterWeight", "bf16_f32_weights"]

# Activation rows up to which the einsum runs the weight-only GEMV (it streams the codes
# once per row of o; beyond a few rows the dequantized bf16 einsum, a real GEMM, wins).
MAX_ROWS = 16
_EQ = "bsgd,grd->bsgr"
_EINSUM = torch.functional.einsum     # what __torch_function__ receives for torch.einsum


def requantize_fp8(w, block=128):
    """(codes float8_e4m3fn [N, K], scales float8_e8m0fnu [ceil(N/128), ceil(K/128)]) whose
    product is w (bf16 [N, K]) bit for bit, or None when w is not so representable."""
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    wf = torch.zeros(nb * block, kb * block, dtype=torch.float32)
    wf[:N, :K] = w.float()
    blocks = wf.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    # the smallest power of two s with amax / s <= 448 (e4m3's largest finite value)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 448.0)), torch.zeros_like(amax))
    e = e.clamp(-127, 127)
    s = torch.exp2(e)
    codes = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn)
    back = (codes.float() * s[:, None, :, None]).view(nb * block, kb * block)[:N, :K]
    if not torch.equal(back.bfloat16().view(torch.int16), w.view(torch.int16)):
        return None
    scales = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return codes.view(nb * block, kb * block)[:N, :K].contiguous(), scales


def _dequantize(codes, scales, shape):
    N, K = codes.shape
    s = scales.float().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return (codes.float() * s).bfloat16().view(shape)


class FP8Weight(torch.Tensor):
    """A bf16 weight held as e4m3 codes [N, K] and e8m0 scales per 128 x 128 block (see
    the module docstring).  ``shape`` / ``dtype`` are the bf16 weight's; ``nbytes_read``
    is what a decode step reads of it."""

    @staticmethod
    def __new__(cls, codes, scales, shape=None):
        shape = tuple(codes.shape) if shape is None else tuple(shape)
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bfloat16,
                                                device=codes.device, requires_grad=False)
        t.codes, t.scales = codes, scales
        return t

    @property
    def nbytes_read(self):
        return self.codes.numel() + self.scales.numel()

    def dequantize(self):
        """The bf16 weight (a new tensor, exact)."""
        return _dequantize(self.codes, self.scales, self.shape)

    def __repr__(self):
        return (f"FP8Weight(shape={list(self.shape)}, codes {list(self.codes.shape)} e4m3, "
                f"scales {list(self.scales.shape)} e8m0)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.view and isinstance(args[0], FP8Weight) and not kwargs:
            self, shape = args[0], args[1:]
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            if all(isinstance(d, int) for d in shape) and sum(d == -1 for d in shape) <= 1:
                known = 1
                for d in shape:
                    known *= d if d != -1 else 1
                numel = self.codes.numel()
                shape = tuple(numel // known if d == -1 else d for d in shape)
                p = 1
                for d in shape:
                    p *= d
                if p != numel:
                    raise RuntimeError(f"shape {list(args[1:])} is invalid for input of size {numel}")
                return FP8Weight(self.codes, self.scales, shape)
        if (func is _EINSUM and not kwargs and len(args) == 3 and args[0] == _EQ
                and isinstance(args[2], FP8Weight) and not isinstance(args[1], FP8Weight)):
            o, w = args[1], args[2]
            G = w.shape[0]
            if (o.dim() == 4 and o.dtype == torch.bfloat16        # else: as the bf16 weight
                    and o.shape[0] * o.shape[1] <= MAX_ROWS and o.shape[2] == G
                    and w.dim() == 3 and o.shape[3] == w.shape[2]
                    and w.shape[0] * w.shape[1] == w.codes.shape[0]):
                out = ops.call("wfp8_gemm", o, w.codes, w.scales, G, o.dtype)
                return out.view(o.shape[0], o.shape[1], G, w.shape[1])
        if getattr(func, "__name__", "") == "__get__" or func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args = tuple(a.dequantize() if isinstance(a, FP8Weight) else a for a in args)
        kwargs = {k: (v.dequantize() if isinstance(v, FP8Weight) else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # what __torch_function__ did not serve and reached the dispatcher: on the bf16
        # weight, dequantized for the call
        unwrap = lambda a: a.dequantize() if isinstance(a, FP8Weight) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


_META = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
         torch.Tensor.__format__, torch.Tensor.requires_grad_, torch.Tensor.stride}


def _attention_wo_a(model):
    for m in model.modules():
        lin = getattr(m, "wo_a", None)
        if lin is not None and hasattr(m, "attn_sink") and isinstance(lin, torch.nn.Module):
            yield lin


def fp8_wo_a(model):
    """Replaces each attention's bf16 ``wo_a`` weight under model by an FP8Weight (where
    the weight is exactly FP8-representable).  Returns how many were replaced."""
    n = 0
    for lin in _attention_wo_a(model):
        w = lin._parameters.get("weight")
        if w is None or isinstance(w, FP8Weight) or w.dtype != torch.bfloat16 or w.dim() != 2:
            continue
        with torch.no_grad():
            q = requantize_fp8(w.detach())
        if q is None:
            continue
        lin._parameters["weight"] = FP8Weight(*q)
        n += 1
    return n


# ---------------------------------------------------------------- float32 weights as bf16
_LINEAR = torch.nn.functional.linear


class _HeldBF16(torch.Tensor):
    """A weight held as a bf16 tensor ``w16`` and shown to torch as a tensor of dtype
    ``SHOWN`` (a wrapper subclass: no storage of its own)."""
    SHOWN = torch.bfloat16

    @staticmethod
    def __new__(cls, w16):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(w16.shape), dtype=cls.SHOWN,
                                                device=w16.device, requires_grad=False)
        t.w16 = w16
        return t

    @property
    def nbytes_read(self):
        return self.w16.numel() * 2


class BF16Weight(_HeldBF16):
    """A float32 weight [N, K] whose values are bf16, held as the bf16 tensor (half the
    bytes).  ``F.linear(x, w)`` with float32 x of at most MAX_ROWS rows runs
    ``torch.ops.deepseek_csa.wbf16_gemm`` (float32 products and sums in its fixed order;
    F.linear's own float32 GEMV sums in another order); everything else sees the float32
    weight (widened for that call; exact)."""
    SHOWN = torch.float32

    def widen(self):
        return self.w16.float()

    def __repr__(self):
        return f"BF16Weight(shape={list(self.shape)}, float32 values held in bf16)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is _LINEAR and len(args) >= 2 and isinstance(args[1], BF16Weight)
                and not isinstance(args[0], BF16Weight)
                and (len(args) < 3 or args[2] is None) and kwargs.get("bias") is None):
            x, w = args[0], args[1]
            if (x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] == w.shape[1]
                    and x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and x.numel() > 0):
                return ops.call("wbf16_gemm", x, w.w16, torch.float32)
        if getattr(func, "__name__", "") == "__get__" or func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        unwrap = lambda a: a.widen() if isinstance(a, BF16Weight) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.widen() if isinstance(a, BF16Weight) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def _f32_linear_weights(model):
    """(module, name) of the float32 2-D weights model.py multiplies by F.linear: every
    Linear's (the compressors' wkv / wgate) and the head's."""
    for m in model.modules():
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if w is None or isinstance(w, BF16Weight) or w.dtype != torch.float32 or w.dim() != 2:
            continue
        if hasattr(m, "in_features") or type(m).__name__ == "ParallelHead" or hasattr(m, "get_logits"):
            yield m


class RouterWeight(_HeldBF16):
    """The MoE router's bf16 weight [E, dim], which the released ``Gate.forward`` widens
    on every call (``linear(x.float(), self.weight.float())``: 2 bytes a weight read, 4
    written, 4 read again by the float32 F.linear -- measured 0.8 ms a step of the
    released-width layer, one core, against ~0.1 for the 2.1 MB it holds).  Here
    ``.float()`` returns a BF16Weight over the same bf16 tensor (no copy), so that
    F.linear runs wbf16_gemm: the float32 products of the released call, summed in
    another order.  Everything else sees the bf16 weight itself."""

    def __repr__(self):
        return f"RouterWeight(shape={list(self.shape)}, bf16; .float() read as bf16)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float and len(args) == 1 and not kwargs:
            return BF16Weight(args[0].w16)
        if getattr(func, "__name__", "") == "__get__" or func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        unwrap = lambda a: a.w16 if isinstance(a, RouterWeight) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.w16 if isinstance(a, RouterWeight) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def _routers(model):
    """The released MoE routers (Gate: a bf16 [E, dim] weight, a topk)."""
    for m in model.modules():
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if (w is not None and not isinstance(w, RouterWeight) and w.dtype == torch.bfloat16
                and w.dim() == 2 and hasattr(m, "topk") and hasattr(m, "score_func")):
            yield m


def bf16_f32_weights(model):
    """Replaces each float32 weight model.py multiplies by F.linear (the compressors',
    the head's) whose values are all bf16 -- the checkpoint stores them in bf16 and the
    loader widens them -- by a BF16Weight, and each MoE router's bf16 weight, which
    model.py widens to float32 on every call, by a RouterWeight (the same float32
    multiplication on the bf16 weight).  Returns how many were replaced."""
    n = 0
    for m in list(_f32_linear_weights(model)):
        w = m._parameters["weight"].detach()
        w16 = w.bfloat16()
        if not torch.equal(w16.float(), w):
            continue
        m._parameters["weight"] = BF16Weight(w16)
        n += 1
    for m in list(_routers(model)):
        m._parameters["weight"] = RouterWeight(m._parameters["weight"].detach())
        n += 1
    return n
