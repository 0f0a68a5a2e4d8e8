"""DeepSeek's released ``inference/model.py`` on the CPU as shipped: CPU implementations
of the GPU-only modules it imports, ``kernel`` (act_quant, fp4_act_quant, fp8_gemm,
fp4_gemm, sparse_attn, hc_split_sinkhorn) and ``fast_hadamard_transform``
(hadamard_transform), built on deepseek_csa's C kernels.

    import deepseek_csa.torch as dct
    model_py = dct.load_model_py("path/to/inference")      # the folder or its model.py
    torch.set_default_dtype(torch.bfloat16)                 # as the released generate.py
    model = model_py.Transformer(model_py.ModelArgs(**cfg)) # FP8 / FP4 weights stay FP8 / FP4

    dct.install_kernels()          # or: put the modules in sys.modules, import it yourself
    import model

Facts of the released file this follows: it imports ``kernel`` when it is imported but
``fast_hadamard_transform`` inside every ``rotate_activation`` call, so the modules stay in
``sys.modules`` while the model runs (``install_kernels()`` leaves them there; used as a
context manager it restores what was there before on exit); its GEMMs return
``torch.get_default_dtype()`` (bf16 in the released run; ``rotate_activation`` asserts
bf16); ``Transformer.__init__`` sets module globals, so one import serves one
configuration (load the file again for another).

Dtypes: ``torch.float8_e4m3fn`` values, ``torch.float8_e8m0fnu`` or float32 scales,
``torch.float4_e2m1fn_x2`` packed weights are handed to the kernels as byte views (no
copies, no float32 copy of a weight, ever); activations bf16 or float32.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import types


import torch

from . import ops
from ._tensors import kernel_dtype, kernel_f32, to_like
from .dropins import _round_inplace, sparse_attn as _sparse_attn

__all__ = ["load_model_py", "install_kernels", "kernel_module", "hadamard_module"]


# ----------------------------------------------------------------------------- helpers
def _is_e8m0(dtype):
    return dtype is not None and dtype == getattr(torch, "float8_e8m0fnu", None)


# ----------------------------------------------------------------------------- kernel
def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=None, inplace=False):
    """Released ``act_quant``: FP8 e4m3 over blocks of ``block_size`` of the last dim,
    power-of-two scales when ``scale_fmt`` is set or ``scale_dtype`` is e8m0.
    ``inplace=True``: x becomes its quantize-dequantize (QAT rounding), returned.
    Otherwise returns ``(float8_e4m3fn [..., N], scales [..., N / block] in scale_dtype)``
    (float32 unless e8m0)."""
    pow2 = scale_fmt is not None or _is_e8m0(scale_dtype)
    scale = "ue8m0" if pow2 else "fp32"
    if inplace:
        return _round_inplace("fp8_round", x, block_size, scale)
    e8 = _is_e8m0(scale_dtype)
    y, st = ops.call("fp8_quant", kernel_dtype(x.detach()), int(block_size), scale,
                     "e8m0" if e8 else "float32")
    if not e8 and scale_dtype is not None and scale_dtype != torch.float32:
        st = st.to(scale_dtype)
    return y, st


def fp4_act_quant(x, block_size=32, inplace=True, scale_dtype=None):
    """Released ``fp4_act_quant``: FP4 e2m1 over blocks of ``block_size`` with e8m0
    scales (``scale_dtype=torch.float8_e4m3fn``: V4.1's e4m3 scales).  In place: the
    quantize-dequantize of x.  Otherwise ``(float4_e2m1fn_x2 [..., N / 2], scales)``."""
    e4 = scale_dtype is not None and scale_dtype == torch.float8_e4m3fn
    scale = "e4m3" if e4 else "ue8m0"
    if inplace:
        return _round_inplace("fp4_round", x, block_size, scale)
    f32 = scale_dtype is not None and scale_dtype == torch.float32
    return ops.call("fp4_quant", kernel_dtype(x.detach()), int(block_size), scale,
                    "float32" if f32 else ("e4m3" if e4 else "e8m0"))


def fp4_act_quant_e4m3(x, block_size=16, inplace=True):
    """FP4 with e4m3 scales (V4.1 compressed KV)."""
    return fp4_act_quant(x, block_size, inplace, scale_dtype=torch.float8_e4m3fn)


def _gemm(name, a, a_s, b, b_s):
    # the GEMMs read weights that require grad (the model's nn.Parameters) detached,
    # without copies; the result is in the default dtype, as the released kernels give
    dt = torch.get_default_dtype()
    out = ops.call(name, a.detach(), a_s.detach(), b.detach(), b_s.detach(),
                   dt if dt in (torch.bfloat16, torch.float32) else torch.float32, None)
    return out if out.dtype == dt else out.to(dt)


def fp8_gemm(a, a_s, b, b_s, scale_dtype=None):
    """Released ``fp8_gemm``: ``a [..., K]`` float8_e4m3fn with ``a_s [..., K/128]``,
    ``b [N, K]`` float8_e4m3fn with ``b_s [ceil(N/128), K/128]`` (e8m0 or float32) ->
    ``[..., N]`` in ``torch.get_default_dtype()`` (deepseek_csa.fp8_gemm)."""
    return _gemm("fp8_gemm", a, a_s, b, b_s)


def fp4_gemm(a, a_s, b, b_s, scale_dtype=None):
    """Released ``fp4_gemm``: FP8 activations against ``b [N, K/2]``
    float4_e2m1fn_x2 with ``b_s [N, K/32]`` e8m0 (deepseek_csa.fp4_gemm)."""
    return _gemm("fp4_gemm", a, a_s, b, b_s)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """Released ``hc_split_sinkhorn`` -> (pre, post, comb), float32."""
    return ops.call("hc_split_sinkhorn", kernel_f32(mixes.detach()), kernel_f32(hc_scale.detach()),
                    kernel_f32(hc_base.detach()), int(hc_mult), int(sinkhorn_iters), float(eps))


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """Released ``sparse_attn`` (deepseek_csa.sparse_attn, bf16 read in place)."""
    return _sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)


def hadamard_transform(x, scale=1.0):
    """``fast_hadamard_transform.hadamard_transform(x, scale)``: the (unnormalized)
    Walsh-Hadamard transform of the last dim times ``scale``, in x's dtype."""
    return to_like(ops.call("hadamard", kernel_dtype(x), float(scale)), x)


_KERNEL_NAMES = ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn",
                 "hc_split_sinkhorn", "fp4_act_quant_e4m3", "hadamard_transform")


def kernel_module(name="kernel"):
    """A new module object with the CPU ``kernel`` functions."""
    m = types.ModuleType(name, "deepseek_csa's CPU implementation of DeepSeek's kernel module")
    g = globals()
    for n in _KERNEL_NAMES:
        setattr(m, n, g[n])
    m.__deepseek_csa__ = True
    return m


def hadamard_module(name="fast_hadamard_transform"):
    m = types.ModuleType(name, "deepseek_csa's CPU fast_hadamard_transform")
    m.hadamard_transform = hadamard_transform
    m.__deepseek_csa__ = True
    return m


# ----------------------------------------------------------------------------- install
def _restore_modules(saved):
    """Puts back sys.modules entries saved as {name: module or None} (None: absent)."""
    for n, m in saved.items():
        if m is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = m


@contextlib.contextmanager
def preserved_modules(names):
    """Within the block sys.modules may change freely under ``names``; on exit each of
    them is back to what it was (removed where it was absent)."""
    saved = {n: sys.modules.get(n) for n in names}
    try:
        yield
    finally:
        _restore_modules(saved)


class _Installed:
    """Handle of ``install_kernels``: the modules are in sys.modules from the call on;
    ``uninstall()`` (or leaving a ``with`` block) puts back what was there before."""

    def __init__(self, names):
        self._saved = {}
        for n in names:
            self._saved[n] = sys.modules.get(n)
        self.kernel = kernel_module()
        self.fast_hadamard_transform = hadamard_module()
        for n in names:
            if n == "fast_hadamard_transform":
                sys.modules[n] = self.fast_hadamard_transform
            else:
                sys.modules[n] = self.kernel

    def uninstall(self):
        _restore_modules(self._saved)
        self._saved = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()
        return False


def install_kernels(extra=()):
    """Puts deepseek_csa's ``kernel`` and ``fast_hadamard_transform`` modules into
    ``sys.modules`` (and under each name in ``extra``, e.g. ``"inference.kernel"``), so
    that ``import model`` of DeepSeek's released inference code works on the CPU.
    Returns a handle; as a context manager it restores the previous modules on exit
    (the released model imports fast_hadamard_transform at call time, so keep them
    installed while it runs)."""
    return _Installed(("kernel", "fast_hadamard_transform") + tuple(extra))


_LOADED = 0


def load_model_py(path, name=None):
    """Imports DeepSeek's released ``inference/model.py`` (``path``: the file or its
    folder) with deepseek_csa's ``kernel`` and ``fast_hadamard_transform`` installed and
    returns the module.  ``from kernel import ...``, ``from .kernel import ...`` and
    ``from inference.kernel import ...`` are all served (the latter two through a
    package over the file's folder).  Each call imports the file afresh (its
    ``Transformer.__init__`` sets module globals: one import, one configuration)."""
    global _LOADED
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "model.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_model_py(): no model.py at {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    text = open(path, encoding="utf-8").read()
    relative = re.search(r"^\s*from\s+\.\s*kernel\s+import|^\s*from\s+\.\s+import\s+[^\n]*\bkernel\b",
                         text, re.M) is not None
    pkg_abs = re.search(r"^\s*(from|import)\s+([A-Za-z_][\w]*)\.kernel\b", text, re.M)
    extra = []
    if pkg_abs:
        extra.append(pkg_abs.group(2) + ".kernel")
    installed = install_kernels(extra)
    _LOADED += 1
    mod_name = name or f"deepseek_model_py_{_LOADED}"
    spec_name = mod_name
    if relative:
        pkg = f"{mod_name}_pkg"
        p = types.ModuleType(pkg)
        p.__path__ = [folder]
        p.__package__ = pkg
        sys.modules[pkg] = p
        sys.modules[pkg + ".kernel"] = installed.kernel
        sys.modules[pkg + ".fast_hadamard_transform"] = installed.fast_hadamard_transform
        p.kernel = installed.kernel
        spec_name = pkg + ".model"
    if pkg_abs:
        top = pkg_abs.group(2)
        if top not in sys.modules:
            p = types.ModuleType(top)
            p.__path__ = [folder]
            sys.modules[top] = p
        setattr(sys.modules[top], "kernel", installed.kernel)
    spec = importlib.util.spec_from_file_location(spec_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec_name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(spec_name, None)
        raise
    mod.__deepseek_csa_kernels__ = installed
    return mod
