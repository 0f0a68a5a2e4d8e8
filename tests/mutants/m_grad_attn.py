"""Planted bugs in the gradients of sparse attention (C: `#ifdef CSA_MUTANT_*` in the
tuned bodies of attn_impl.h / attn_bwd_impl.h; Python: the autograd formula of the
deepseek_csa::sparse_attn operator and the drop-in's routing).  Format: tests/mutants/run.py."""

T = "tests/test_grad_attn.py"


def _dropin_not_differentiable():
    """The sparse_attn drop-in hands the operator detached q and kv (no gradients)."""
    import deepseek_csa.torch.dropins as D
    orig = D.kernel_pair
    D.kernel_pair = lambda a, b: orig(a.detach(), b.detach())


def _backward_default_scale():
    """The operator's backward uses D**-0.5 instead of the forward's softmax_scale."""
    import torch
    import deepseek_csa.torch.ops as O
    orig = O._attn_backward

    def backward(ctx, grad_out, grad_lse):
        ctx.scale = ctx.saved_tensors[0].shape[-1] ** -0.5
        return orig(ctx, grad_out, grad_lse)
    torch.library.register_autograd("deepseek_csa::sparse_attn", backward,
                                    setup_context=O._attn_setup, lib=O.LIB)


MUTANTS = [
    dict(name="attn_bwd_dq_scale", kind="c", define="CSA_MUTANT_ATTN_BWD_DQ_SCALE",
         targets=[T], what="sparse_attn_backward: d(q) off by a relative 1e-4"),
    dict(name="attn_bwd_sink_sign", kind="c", define="CSA_MUTANT_ATTN_BWD_SINK_SIGN",
         targets=[T], what="sparse_attn_backward: d(attn_sink) with the wrong sign"),
    dict(name="attn_bwd_no_dr", kind="c", define="CSA_MUTANT_ATTN_BWD_NO_DR",
         targets=[T], what="sparse_attn_backward: dl = p dP, the dO.O term of the softmax "
                           "Jacobian forgotten"),
    dict(name="attn_bwd_dup_once", kind="c", define="CSA_MUTANT_ATTN_BWD_DUP_ONCE",
         targets=[T], what="sparse_attn_backward: a kv row listed in two adjacent slots "
                           "gets d(kv) once"),
    dict(name="attn_bwd_bf16_trunc", kind="c", define="CSA_MUTANT_ATTN_BWD_BF16_TRUNC",
         targets=[T], what="sparse_attn_backward(grad_dtype='bfloat16'): d(q) truncated to "
                           "bfloat16 instead of rounded to nearest-even"),
    dict(name="attn_bwd_chunk_last", kind="c", define="CSA_MUTANT_ATTN_BWD_CHUNK_LAST",
         targets=[T], what="sparse_attn_backward: the column items skip each chunk's last "
                           "row (its d(kv) lost)"),
    dict(name="attn_lse_no_sink", kind="c", define="CSA_MUTANT_ATTN_LSE_NO_SINK",
         targets=[T], what="sparse_attn(return_lse=True): lse without the sink's term"),
    dict(name="attn_weights_head", kind="c", define="CSA_MUTANT_ATTN_WEIGHTS_HEAD",
         targets=[T], what="sparse_attn_weights: the last head left out of the sum"),
    dict(name="attn_dropin_no_grad", kind="py", apply=_dropin_not_differentiable,
         targets=[T], what="the torch sparse_attn drop-in is not differentiable"),
    dict(name="attn_torch_bwd_scale", kind="py", apply=_backward_default_scale,
         targets=[T], what="the torch backward uses D**-0.5, not the call's softmax_scale"),
]
