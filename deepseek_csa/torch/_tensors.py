"""Tensor <-> NumPy handoff shared by the torch bridge's modules: CPU float32 and
bfloat16 tensors reach the kernels as views of the same memory, results come back as
tensors over the kernels' buffers.  torch is imported lazily."""


def _torch():
    import torch
    return torch


# ----------------------------------------------------------------------------- tensors
def _f32(t):
    """NumPy float32 view of a CPU float32 tensor, else a float32 copy."""
    torch = _torch()
    t = t.detach()
    if t.dtype == torch.float32 and t.device.type == "cpu":
        return t.numpy()
    return t.to("cpu", torch.float32).numpy()


def _out(a, like):
    """Tensor over the NumPy result, in like's dtype (a copy only when that is not f32)."""
    torch = _torch()
    t = torch.from_numpy(a)
    if like.dtype != torch.float32 or like.device.type != "cpu":
        t = t.to(like.device, like.dtype)
    return t


def _native_bf16(*ts):
    """True when every tensor is a CPU bfloat16 one: the kernels then read them in place."""
    torch = _torch()
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts)


def _inplace(x, fn):
    """Runs fn in place on x: CPU float32 and bfloat16 tensors directly (the kernels
    write them), others through a float32 copy written back."""
    torch = _torch()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        fn(x.detach())
    else:
        tmp = x.detach().to("cpu", torch.float32)
        fn(tmp.numpy())
        x.copy_(tmp)
    return x
