"""Planted mistakes in the indexer gradients (issue 30); tests/test_grad_index.py must fail
with each.  C mutants live in the tuned body (csrc/index_grad_impl.h), never the _ref."""

TARGETS = ["tests/test_grad_index.py"]


def _loss_sum_not_mean():
    """indexer_kl_loss returns the sum over rows instead of the mean (loss and grads)."""
    import numpy as np

    import deepseek_csa as dc
    import deepseek_csa.indexer as ix
    orig = dc.indexer_kl_loss

    def wrong(q, k, weights, topk_idxs, attn_target, **kw):
        r = orig(q, k, weights, topk_idxs, attn_target, **kw)
        # scale by the number of query rows: the sum convention of SPEC's formula
        n = max(1, int(np.asarray(q).shape[0] * np.asarray(q).shape[1]))
        if isinstance(r, tuple):
            return (r[0] * n,) + tuple(g * n for g in r[1:])
        return r * n
    dc.indexer_kl_loss = wrong
    ix.indexer_kl_loss = wrong


def _torch_kl_ignores_grad_output():
    """The indexer_kl_loss operator's backward forgets to scale by the incoming gradient."""
    import torch
    import deepseek_csa.torch.ops as O

    def backward(ctx, grad, *_):
        gq, gk, gw = ctx.saved_tensors
        return gq, gk, gw, None, None, None, None, None, None, None
    torch.library.register_autograd("deepseek_csa::indexer_kl_loss", backward,
                                    setup_context=O._kl_setup, lib=O.LIB)


MUTANTS = [
    dict(name="ixg_gate_ge", kind="c", define="CSA_MUTANT_IXG_GATE_GE", targets=TARGETS,
         what="relu'(0) taken as 1: the gate passes where a == 0 exactly"),
    dict(name="ixg_dk_skip_dup", kind="c", define="CSA_MUTANT_IXG_DK_SKIP_DUP", targets=TARGETS,
         what="d(k) drops the second of two adjacent duplicate slots"),
    dict(name="ixg_dq_scale", kind="c", define="CSA_MUTANT_IXG_DQ_SCALE", targets=TARGETS,
         what="d(q) off by a relative 1e-4"),
    dict(name="ixg_joint_as_selected", kind="c", define="CSA_MUTANT_IXG_JOINT_AS_SELECTED",
         targets=TARGETS, what="target='joint' computed as 'selected' in the tuned body"),
    dict(name="ixg_clip_dropped", kind="c", define="CSA_MUTANT_IXG_CLIP_DROPPED",
         targets=TARGETS, what="the tuned body ignores clip (loss and gradient unclipped)"),
    dict(name="kl_sum_not_mean", kind="py", targets=TARGETS,
         what="the KL loss summed over rows instead of averaged", apply=_loss_sum_not_mean),
    dict(name="torch_kl_no_grad_scale", kind="py", targets=TARGETS,
         what="torch indexer_kl_loss backward ignores the incoming gradient",
         apply=_torch_kl_ignores_grad_output),
]
