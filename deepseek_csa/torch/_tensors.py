"""Arguments brought to the kernels' dtypes, shared by the torch bridge's modules.

The operators (ops.py) read CPU float32 and bfloat16 tensors in place; these helpers
hand such tensors on unchanged and convert anything else (another dtype or device)
with differentiable torch conversions, so they trace under torch.compile and
gradients reach each input in its own dtype."""
import torch

_KERNEL = (torch.float32, torch.bfloat16)


def kernel_dtype(t):
    """t itself when it is a CPU float32 / bfloat16 tensor, else a CPU float32 copy."""
    if t.device.type == "cpu" and t.dtype in _KERNEL:
        return t
    return t.to("cpu", torch.float32)


def kernel_f32(t):
    """t itself when it is a CPU float32 tensor, else a CPU float32 copy."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return t
    return t.to("cpu", torch.float32)


def kernel_pair(a, b):
    """Two operands that must share a dtype (q and kv; q and k): bfloat16 both when
    both are, else float32 both."""
    a, b = kernel_dtype(a), kernel_dtype(b)
    if a.dtype != b.dtype:
        a, b = kernel_f32(a), kernel_f32(b)
    return a, b


def kernel_i32(t):
    """Index lists as CPU int32 (the released ones are int64)."""
    if t.device.type == "cpu" and t.dtype == torch.int32:
        return t
    return t.to("cpu", torch.int32)


def to_like(t, like):
    """t in like's dtype and device (no copy when it already is)."""
    if t.dtype == like.dtype and t.device == like.device:
        return t
    return t.to(like.device, like.dtype)
