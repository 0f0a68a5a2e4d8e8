"""Planted bugs in the backward of RMSNorm, RoPE and gated pooling (C: `#ifdef
CSA_MUTANT_*` in the tuned bodies of pool_impl.h / norm_impl.h; Python: the autograd
formulas of the deepseek_csa operators and the differentiable compressor).  Format: tests/mutants/run.py."""

T = "tests/test_grad_norm_rope_pool.py"


def _rotary_forward_in_backward():
    """apply_rope's backward rotates the gradient forward instead of back."""
    import torch
    import deepseek_csa.torch.ops as O

    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return O.OPS["apply_rope"](grad, cos, sin, ctx.inverse), None, None, None
    torch.library.register_autograd("deepseek_csa::apply_rope", backward,
                                    setup_context=O._rope_setup, lib=O.LIB)


def _pool_ape_grad_dropped():
    """The gated_pool operator returns no gradient for ape."""
    import torch
    import deepseek_csa.torch.ops as O
    orig = O._pool_backward

    def backward(ctx, grad):
        gk, gs, r, ga, ov = orig(ctx, grad)
        return gk, gs, r, None, ov
    torch.library.register_autograd("deepseek_csa::gated_pool", backward,
                                    setup_context=O._pool_setup, lib=O.LIB)


def _compressor_state_detached():
    """The differentiable compressor drops its graph-carrying streaming state (decode
    entries read the released buffers, detached): the prefill's tail tokens lose the
    gradient of the entries that later complete."""
    import deepseek_csa.torch.compressor_grad as m
    orig = m.compressor_forward_grad

    def f(mod, G, x, start_pos):
        mod._csa_grad_state = None
        return orig(mod, G, x, start_pos)
    m.compressor_forward_grad = f


MUTANTS = [
    dict(name="pool_grad_first_group", kind="c", define="CSA_MUTANT_POOL_GRAD_FIRST_GROUP",
         targets=[T], what="gated_pool_backward: overlap's first entry (no group -1) gets "
                           "gradients off by a relative 1e-3"),
    dict(name="pool_grad_ape_drop", kind="c", define="CSA_MUTANT_POOL_GRAD_APE_DROP",
         targets=[T], what="gated_pool_backward: d(ape) misses the last group of row 0"),
    dict(name="pool_grad_pair_nan", kind="c", define="CSA_MUTANT_POOL_GRAD_PAIR_NAN",
         targets=[T], what="gated_pool_backward at avx2, bf16 gradients: a pair of vectors "
                           "tested for NaN by its first vector only (a NaN's low payload "
                           "bits carried into the rounding)"),
    dict(name="pool_grad_y", kind="c", define="CSA_MUTANT_POOL_GRAD_Y",
         targets=[T], what="gated_pool_backward: the recomputed entry y off by a relative "
                           "1e-4 (d(score) = w dy (kv - y) slightly wrong)"),
    dict(name="rms_grad_weight", kind="c", define="CSA_MUTANT_RMS_GRAD_WEIGHT",
         targets=[T], what="rms_norm_backward: d(weight) off by a relative 1e-4"),
    dict(name="rms_grad_mean", kind="c", define="CSA_MUTANT_RMS_GRAD_MEAN",
         targets=[T], what="rms_norm_backward: d(x)'s mean term divides by D + 1"),
    dict(name="rotary_backward_forward", kind="py", apply=_rotary_forward_in_backward,
         targets=[T], what="apply_rotary_emb's backward rotates forward, not back"),
    dict(name="pool_torch_ape_none", kind="py", apply=_pool_ape_grad_dropped,
         targets=[T], what="torch gated_pool drops ape's gradient"),
    dict(name="compressor_state_detached", kind="py", apply=_compressor_state_detached,
         targets=[T], what="the compressor drop-in's decode reads a detached state"),
]
