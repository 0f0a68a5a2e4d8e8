"""Planted bugs in the Python bridges: torch drop-ins / swap, the transformers bridge,
the kernel module (load_model_py).  apply() monkeypatches; format: run.py."""


def _kmod_attn_zero():
    import deepseek_csa.torch.kernel_module as K
    import torch

    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
        return torch.zeros_like(q)
    K.sparse_attn = sparse_attn


MUTANTS = [
    dict(name="kmod_attn_zero", kind="py", apply=_kmod_attn_zero,
         targets=["tests/test_kernel_module.py::test_replay_every_kernel_call"],
         what="the kernel module's sparse_attn returns zeros"),
]
