"""The released model.py's MoE with its routed FP4 experts run as three GEMM calls
(``fuse_moe``), the runner's default (``python -m deepseek_csa.generate --moe fused``).

The released ``MoE.forward`` loops over the experts in Python: ``bincount().tolist()``,
then for each expert chosen a ``torch.where``, a gather, the Expert's w1 / w3 / w2 (an
``act_quant`` and an ``fp4_gemm`` each), the SwiGLU in float32 and ``y[idx] += ...``.
At decode (one token, 6 experts of 256) that is ~130 torch operator calls a layer, on
one thread, between GEMVs that take ~0.15 ms each.

``fuse_moe(model)`` stacks each MoE's routed FP4 weights into [E, N, K/2] codes and
[E, N, K/32] scales -- each expert's parameters become views of the stacks, so the
model holds no second copy; call it before loading the weights (the loader then copies
into the stacks) or after (the weights are copied over) -- and gives the MoE an instance ``forward`` that runs the
same arithmetic over every (token, expert) pair at once:

* the pairs sorted by expert, stable (tokens ascending within an expert): each
  expert's rows one contiguous run, in the order ``torch.where`` gives them;
* x quantized once (``act_quant`` is per row and 128-block: the rows model.py quantizes
  for each expert's w1 and w3 are these rows, gathered), then ``fp4_gemm`` with
  ``b_index`` for w1, w3 and w2: the C side runs each expert's run of rows as one GEMM
  problem, the problem model.py's per-expert call is, so the same bits;
* the clamp, SiLU, product and routing weight elementwise over all pairs in float32
  (as model.py, per element), rounded to the default dtype, quantized per row;
* the expert outputs added into a float32 zero row per token in the pairs' order --
  experts ascending, one float32 rounding per add -- by ``moe_combine``, which is
  model.py's ``y[idx] += expert(...)`` sequence; then the shared expert as released.

A call with more than ``CHUNK_PAIRS`` (token, expert) pairs -- a long prefill -- runs
the released forward (on the same weights): fused, its peak memory was higher.

So the logits are bitwise those of the released loop (tests/test_model_py.py checks
it).  The router (``self.gate``) and the shared expert stay the module's own.  A MoE
whose experts are not all FP4 and all present (``world_size > 1`` leaves some None) is
left as released.  ``unfuse_moe`` restores the released forward (the weights stay
stacked: the same values).
"""
from __future__ import annotations

import sys
import types

import torch

from . import ops

__all__ = ["fuse_moe", "unfuse_moe"]


def _moe_modules(model):
    for m in model.modules():
        if (hasattr(m, "experts") and hasattr(m, "gate") and hasattr(m, "shared_experts")
                and isinstance(getattr(m, "experts"), torch.nn.ModuleList)):
            yield m


def _fusable(moe):
    """The released V4 MoE (its Gate module, Experts taking the routing weights, a
    swiglu_limit), every expert present and FP4."""
    import inspect
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    if (f4 is None or len(moe.experts) == 0 or not isinstance(moe.gate, torch.nn.Module)
            or not hasattr(moe.gate, "score_func") or not hasattr(moe, "dim")):
        return False
    for e in moe.experts:
        if e is None or not hasattr(e, "swiglu_limit"):
            return False
        try:
            if "weights" not in inspect.signature(type(e).forward).parameters:
                return False
        except (TypeError, ValueError):
            return False
        for lin in (e.w1, e.w2, e.w3):
            if lin.weight.dtype != f4 or getattr(lin, "scale", None) is None:
                return False
    return True


def _stack(moe, name):
    """(codes uint8 [E, N, K/2], scales uint8 [E, N, K/32]) of the experts' `name`
    Linears; each expert's weight and scale become views of them (as the same dtypes)."""
    lins = [getattr(e, name) for e in moe.experts]
    w0, s0 = lins[0].weight, lins[0].scale
    E = len(lins)
    codes = torch.empty((E,) + tuple(w0.shape), dtype=torch.uint8)
    scales = torch.empty((E,) + tuple(s0.shape), dtype=torch.uint8)
    with torch.no_grad():
        for i, lin in enumerate(lins):
            w, s = lin.weight, lin.scale
            codes[i].copy_(w.detach().view(torch.uint8))
            scales[i].copy_(s.detach().view(torch.uint8))
            # the expert's parameters now views of the stacks: the old storage is freed
            nw = torch.nn.Parameter(codes[i].view(w.dtype), requires_grad=False)
            ns = torch.nn.Parameter(scales[i].view(s.dtype), requires_grad=False)
            nw.scale = ns
            lin._parameters["weight"] = nw
            lin._parameters["scale"] = ns
    _trim()
    return codes, scales


def _trim():
    """Gives the freed per-expert storage back to the system: glibc keeps freed
    mid-sized blocks in its heap (its mmap threshold rises as large blocks are freed), so
    after stacking a loaded model the old copies stayed resident -- peak RSS 4.1 -> 6.9
    GiB for the released-width layer (docs/peers.md section 9).  The runner stacks before
    loading (nothing resident to free); this is for a model fused after its load."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _moe_forward(self, x, input_ids):
    G = self._csa_globals
    shape = x.size()
    if x.numel() // self.dim * self.n_activated_experts > CHUNK_PAIRS:
        return type(self).forward(self, x, input_ids)      # as released
    x = x.view(-1, self.dim)
    weights, indices = self.gate(x, input_ids.flatten())
    y = self._csa_routed(x, weights, indices, G)
    if G.get("world_size", 1) > 1:
        import torch.distributed as dist
        dist.all_reduce(y)
    y += self.shared_experts(x)
    return y.type_as(x).view(shape)


# (token, expert) pairs above which the released MoE.forward runs (a prefill): all
# pairs at once -- and, measured, also in chunks of whole experts of 4096 pairs -- raised
# the peak RSS of a 4096-token prefill at the released width 5.54 -> 6.62 GiB (cause not
# found), and a prefill's Python is a small part of its time.
CHUNK_PAIRS = 4096


def _pairs(self, xq, xs, tok, pos, e_idx, weights, G):
    """The expert outputs [P, dim] (default dtype) of the pairs (their rows of the
    quantized x, their experts e_idx, ascending): model.py's Expert.forward each."""
    dt = torch.get_default_dtype()
    bs, fmt, sdt = G["block_size"], G["scale_fmt"], G["scale_dtype"]
    w1, s1, w3, s3, w2, s2 = self._csa_stacks
    out_dt = dt if dt in (torch.bfloat16, torch.float32) else torch.float32
    xq, xs = xq[tok], xs[tok]
    gate = ops.call("fp4_gemm", xq, xs, w1, s1, out_dt, e_idx)
    up = ops.call("fp4_gemm", xq, xs, w3, s3, out_dt, e_idx)
    if out_dt != dt:
        gate, up = gate.to(dt), up.to(dt)
    gate, up = gate.float(), up.float()
    lim = self._csa_swiglu_limit
    if lim > 0:
        up = torch.clamp(up, min=-lim, max=lim)
        gate = torch.clamp(gate, max=lim)
    h = torch.nn.functional.silu(gate) * up
    h = weights[tok, pos].unsqueeze(-1) * h
    hq, hs = G["act_quant"](h.to(dt), bs, fmt, sdt)
    out = ops.call("fp4_gemm", hq, hs, w2, s2, out_dt, e_idx)
    return out.to(dt) if out_dt != dt else out


def _routed(self, x, weights, indices, G):
    """The routed experts' float32 sum [T, dim] (model.py's y before the shared expert)."""
    T, k = indices.shape
    flat = indices.reshape(-1)
    if T == 1:
        # one token: its k experts are distinct (top-k), the pairs sorted by expert
        e_sorted, pos = torch.sort(flat)
        tok = torch.zeros_like(pos)
    else:
        order = torch.argsort(flat, stable=True)
        e_sorted = flat[order]
        tok, pos = order // k, order % k
    e_idx = e_sorted.to(torch.int32)
    xq, xs = G["act_quant"](x, G["block_size"], G["scale_fmt"], G["scale_dtype"])
    xq = xq.view(torch.uint8)
    xs = xs.view(torch.uint8) if xs.element_size() == 1 else xs
    out = _pairs(self, xq, xs, tok, pos, e_idx, weights, G)
    return ops.call("moe_combine", out.float(), tok, T)


def fuse_moe(model):
    """Gives each released MoE under model whose routed experts are all FP4 the fused
    forward (module docstring).  Returns how many were fused."""
    n = 0
    for moe in _moe_modules(model):
        if getattr(moe, "_csa_fused", False) or not _fusable(moe):
            continue
        G = vars(sys.modules[type(moe).__module__])   # model.py's act_quant and formats
        if not all(k in G for k in ("act_quant", "block_size", "scale_fmt", "scale_dtype")):
            continue
        w1, s1 = _stack(moe, "w1")
        w3, s3 = _stack(moe, "w3")
        w2, s2 = _stack(moe, "w2")
        moe._csa_stacks = (w1, s1, w3, s3, w2, s2)
        moe._csa_globals = G
        moe._csa_swiglu_limit = float(moe.experts[0].swiglu_limit)
        moe._csa_routed = types.MethodType(_routed, moe)
        moe.forward = types.MethodType(_moe_forward, moe)
        moe._csa_fused = True
        n += 1
    return n


def unfuse_moe(model):
    """The released MoE.forward again on every fused MoE under model."""
    for moe in _moe_modules(model):
        if moe.__dict__.pop("_csa_fused", False):
            for a in ("forward", "_csa_stacks", "_csa_globals", "_csa_routed",
                      "_csa_swiglu_limit"):
                moe.__dict__.pop(a, None)
    return model
