"""RMSNorm and RoPE: memory-bound, so GB/s against stream bandwidth."""
import numpy as np
import torch

import deepseek_csa as dc
from harness import Case


def _rms_ref(x, w, eps: float = 1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def _rope_ref(x, cos, sin):
    """Reference rotation of the last 2*half features, in place like the released code."""
    half = cos.shape[-1]
    tail = x[..., -2 * half:]
    re, im = tail[..., 0::2], tail[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2)
    tail.copy_(out)
    return x


def cases(quick=False):
    rng = np.random.default_rng(0)
    out = []
    for shape in ([(8192, 512), (4096, 4096)] if not quick else [(1024, 512)]):
        x = rng.standard_normal(shape, dtype=np.float32)
        w = rng.standard_normal(shape[-1], dtype=np.float32)
        y = np.empty_like(x)
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        out.append(Case("rms_norm", f"{shape}", ours=lambda x=x, w=w, y=y: dc.rms_norm(x, w, out=y),
                        eager=lambda tx=tx, tw=tw: _rms_ref(tx, tw), compile_fn=_rms_ref,
                        compile_args=(tx, tw), bytes=2 * x.nbytes + w.nbytes))
    # bfloat16 in and out, at the same shapes: half the bytes of the float32 cases
    import ml_dtypes
    for shape in ([(8192, 512), (4096, 4096)] if not quick else [(1024, 512)]):
        xb = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal(shape[-1], dtype=np.float32)
        yb = np.empty_like(xb)
        txb = torch.from_numpy(xb.view(np.int16)).view(torch.bfloat16)
        tw = torch.from_numpy(w)
        out.append(Case("rms_norm", f"{shape} bf16",
                        ours=lambda xb=xb, w=w, yb=yb: dc.rms_norm(xb, w, out=yb),
                        eager=lambda txb=txb, tw=tw: _rms_ref(txb, tw), compile_fn=_rms_ref,
                        compile_args=(txb, tw), bytes=2 * xb.nbytes + w.nbytes))
    S = 4096 if not quick else 512
    q = rng.standard_normal((1, S, 64, 512), dtype=np.float32)
    c, s = dc.rope_table(64, S, base=160000.0, original_seq_len=65536, factor=16)
    tq, tc, ts = torch.from_numpy(q), torch.from_numpy(c), torch.from_numpy(s)
    tail_bytes = 2 * q[..., -64:].size * 4 + c.nbytes + s.nbytes
    out.append(Case("apply_rope", f"q[1,{S},64,512][...,-64:]",
                    ours=lambda: dc.apply_rope(q[..., -64:], c, s),
                    eager=lambda: _rope_ref(tq, tc, ts), compile_fn=_rope_ref,
                    compile_args=(tq, tc, ts), bytes=tail_bytes))
    return out
