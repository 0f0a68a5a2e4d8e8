"""Planted bugs in the Python bridges: the torch drop-ins / swap, the transformers
bridge, the kernel module (load_model_py, generate) and the NumPy layer.  apply()
monkeypatches (format: run.py).  A bridge's calls into the C kernels go through its
module's ``_dc`` name, so a mutant replaces that name in ONE module by a copy of
deepseek_csa whose function is wrong, and the other bridges stay correct; the
transformers bridge calls the operators through its attention module's ``_call``,
which its mutants wrap."""
import types


def _scaled_result(r, f):
    import numpy as np
    if hasattr(r, "mul_"):
        r.mul_(f)
    else:
        np.multiply(r, np.asarray(f, dtype=r.dtype), out=r)
    return r


def _patch_dc(modname, fname, wrap):
    """modname's ``_dc`` becomes a copy of deepseek_csa with fname replaced by
    wrap(original function)."""
    import importlib
    mod = importlib.import_module(modname)
    dc = mod._dc
    proxy = types.ModuleType(dc.__name__)
    proxy.__dict__.update({k: v for k, v in vars(dc).items() if not k.startswith("__")})
    setattr(proxy, fname, wrap(getattr(dc, fname)))
    mod._dc = proxy


def _output_times(f):
    def wrap(fn):
        def g(*a, **kw):
            r = fn(*a, **kw)
            return _scaled_result(kw["out"] if kw.get("out") is not None else r, f)
        return g
    return wrap


# -------------------------------------------------------------- the kernel module
def _kmod_attn_zero():
    import deepseek_csa.torch.kernel_module as K
    import torch

    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
        return torch.zeros_like(q)
    K.sparse_attn = sparse_attn


def _kmod_attn_1e2():
    import deepseek_csa.torch.kernel_module as K
    orig = K.sparse_attn

    def sparse_attn(*a):
        return (orig(*a).float() * (1 + 1e-2)).to(a[0].dtype)
    K.sparse_attn = sparse_attn


# -------------------------------------------------------------- torch drop-ins / swap
def _torch_attn_x11():
    _patch_dc("deepseek_csa.torch.dropins", "sparse_attn", _output_times(1.1))


def _torch_attn_1e4():
    _patch_dc("deepseek_csa.torch.dropins", "sparse_attn", _output_times(1 + 1e-4))


# -------------------------------------------------------------- transformers bridge
def _patch_tf_call(opname, wrap):
    """The transformers bridge calls every operator through its attention module's
    ``_call``: ``opname``'s calls become wrap(real _call, *args)."""
    import deepseek_csa.transformers.attention as T
    real = T._call

    def call(name, *args):
        if name == opname:
            return wrap(real, *args)
        return real(name, *args)
    T._call = call


def _tf_qat_kv_dropped():
    import deepseek_csa.transformers.attention as T
    T._qat_kv = lambda x, rd: x


def _tf_qat_index_no_hadamard():
    import deepseek_csa.transformers.attention as T
    T._qat_index = lambda x, rd=None: T._call("fp4_round", x, 32, "ue8m0")


def _tf_attn_1e4():
    def wrap(real, *a):
        out, lse = real("sparse_attn", *a)
        return out * (1 + 1e-4), lse
    _patch_tf_call("sparse_attn", wrap)


# -------------------------------------------------------------- the NumPy layer
def _layer_attn_5e4():
    _patch_dc("deepseek_csa.layer", "sparse_attn", _output_times(1 + 5e-4))


KM = "tests/test_kernel_module.py::"
GEN = "tests/test_generate.py::"
TF = "tests/test_transformers_bridge.py::"

# -------------------------------------------------------------- FP8 / FP4 projections
def _quant_fp8_1e4():
    _patch_dc("deepseek_csa.torch.quantized", "fp8_gemm", _output_times(1 + 1e-4))


def _quant_act_fp32():
    # activations quantized with float32 scales (amax / 448), not the released
    # power-of-two ones
    import deepseek_csa.torch.quantized as Q
    Q._act_q = lambda x: Q._dc.fp8_quant(x, Q._BLOCK, scale="fp32")


def _tf_hc_iters():
    _patch_tf_call("hc_split_sinkhorn", lambda real, m, sc, b, h, iters, eps:
                   real("hc_split_sinkhorn", m, sc, b, h, iters - 1, eps))


def _tf_crop_keeps_overlap():
    """CSACacheLayer.crop rolls the entries and buffers back but keeps the overlap state
    (the previous group's rows the next CSA entry pools with) of the rejected tokens."""
    import deepseek_csa.transformers as T
    csa = T._cache_classes()[1]
    orig = csa.crop

    def crop(self, r):
        ov = dict(self.overlap_kv), dict(self.overlap_gate)
        orig(self, r)
        self.overlap_kv.update(ov[0])
        self.overlap_gate.update(ov[1])
    csa.crop = crop


def _tf_crop_window_stale():
    """The CSA/HCA layers' crop keeps the newest window rows (the rejected tokens')
    instead of those before them."""
    import deepseek_csa.transformers as T
    for c in T._cache_classes():
        def crop(self, r, orig=c.crop):
            keys = self.keys
            orig(self, r)
            if r and self.keys is not None and self.keys.shape[2]:
                self.keys = self.values = keys[:, :, keys.shape[2] - self.keys.shape[2]:]
        c.crop = crop


QUANT = "tests/test_quantized.py::"
ASSISTED = "tests/test_transformers_assisted.py::"

MUTANTS = [
    dict(name="tf_crop_keeps_overlap", kind="py", apply=_tf_crop_keeps_overlap,
         targets=[ASSISTED + "test_crop_every_offset",
                  ASSISTED + "test_crop_into_the_prefill_and_across_calls"],
         what="transformers bridge: a crop keeps the CSA overlap state of rejected tokens"),
    dict(name="tf_crop_window_stale", kind="py", apply=_tf_crop_window_stale,
         targets=[ASSISTED + "test_crop_every_offset",
                  ASSISTED + "test_crop_into_the_prefill_and_across_calls"],
         what="transformers bridge: a crop keeps the rejected tokens' window rows"),
    dict(name="tf_hc_iters", kind="py", apply=_tf_hc_iters,
         targets=["tests/test_transformers_bridge.py::test_decode_steps"],
         what="the swapped hyper-connections run one Sinkhorn iteration fewer"),
    dict(name="quant_fp8_1e4", kind="py", apply=_quant_fp8_1e4,
         targets=[QUANT + "test_fp8_linear_matches_reference",
                  QUANT + "test_fp8_grouped_linear_matches_per_group_reference"],
         what="FP8Linear's GEMM output off by a relative 1e-4"),
    dict(name="quant_act_fp32", kind="py", apply=_quant_act_fp32,
         targets=[QUANT + "test_fp4_experts_matches_reference",
                  QUANT + "test_quantized_model_matches_reference"],
         what="FP8Linear / FP4Experts quantize activations with float32 scales, not ue8m0"),
    dict(name="kmod_attn_zero", kind="py", apply=_kmod_attn_zero,
         targets=[KM + "test_replay_every_kernel_call",
                  KM + "test_float32_scales_and_fp8_experts",
                  KM + "test_load_model_py_fp8_fp4_params_stay",
                  GEN + "test_in_process_planted_and_loaded",
                  GEN + "test_runner_tp2_equals_tp1_equals_in_process"],
         what="the kernel module's sparse_attn returns zeros"),
    dict(name="kmod_attn_1e2", kind="py", apply=_kmod_attn_1e2,
         targets=[KM + "test_replay_every_kernel_call", KM + "test_swap_keeps_working_on_fp8_model"],
         what="the kernel module's sparse_attn off by a relative 1e-2 (its bf16 output: 1e-3 is "
              "below one bf16 step)"),
    dict(name="torch_attn_x1.1", kind="py", apply=_torch_attn_x11,
         targets=[KM + "test_swap_keeps_working_on_fp8_model",
                  "tests/test_torch_bridge.py::test_swap_each_layer_matches_unswapped"],
         what="the torch drop-in sparse_attn's output scaled by 1.1"),
    dict(name="torch_attn_1e4", kind="py", apply=_torch_attn_1e4,
         targets=["tests/test_torch_bridge.py::test_swap_each_layer_matches_unswapped"],
         what="the torch drop-in sparse_attn's output off by a relative 1e-4 (float32 "
              "models; below a bf16 step, so not the FP8 model's test)"),
    dict(name="tf_qat_kv_dropped", kind="py", apply=_tf_qat_kv_dropped,
         targets=[TF + "test_qat_option"],
         what="transformers bridge, qat=True: the FP8 rounding of KV rows / entries dropped"),
    dict(name="tf_qat_index_no_hadamard", kind="py", apply=_tf_qat_index_no_hadamard,
         targets=[TF + "test_qat_option"],
         what="transformers bridge, qat=True: the indexer's Hadamard skipped before FP4"),
    dict(name="tf_attn_1e4", kind="py", apply=_tf_attn_1e4,
         targets=[TF + "test_single_attention_module", TF + "test_qat_option"],
         what="transformers bridge: the attention output off by a relative 1e-4"),
    dict(name="layer_attn_5e4", kind="py", apply=_layer_attn_5e4,
         targets=["tests/test_layer.py::test_v4_layer_matches_reference[128-260-4]",
                  "tests/test_layer.py::test_v4_layer_matches_reference",
                  "tests/test_layer.py::test_v4_flash_shaped_layer"],
         what="CSALayer's attention output off by a relative 5e-4"),
]
