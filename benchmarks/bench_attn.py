"""Top-k sparse attention with a sink: compute-bound (4*S*H*K*D FLOPs, every index
valid), so GFLOP/s against the fp32 FMA peak.  The eager reference (deepseek_csa.reference.attn)
gathers kv[idx] into [B, S, K, D] and runs einsum + softmax with the sink as an extra
logit."""
import ml_dtypes
import numpy as np
import torch

import deepseek_csa as dc
from deepseek_csa.reference.attn import sparse_attn as _attn_ref
from harness import Case


def _case(name, B, S, H, D, N, K, rng, bf16=False):
    q = rng.standard_normal((B, S, H, D), dtype=np.float32)
    kv = rng.standard_normal((B, N, D), dtype=np.float32)
    sink = rng.standard_normal(H, dtype=np.float32)
    idx = rng.integers(0, N, (B, S, K)).astype(np.int32)
    scale = D ** -0.5
    args = tuple(map(torch.from_numpy, (q, kv, sink, idx))) + (scale,)
    if bf16:  # the released dtypes: ours reads bf16 natively, the reference runs in bf16
        q, kv = q.astype(ml_dtypes.bfloat16), kv.astype(ml_dtypes.bfloat16)
        args = (args[0].bfloat16(), args[1].bfloat16()) + args[2:]
        name += " bf16"
    out = np.empty_like(q)
    return Case("sparse_attn", name,
                ours=lambda: dc.sparse_attn(q, kv, sink, idx, scale, out=out),
                eager=lambda: _attn_ref(*args), compile_fn=_attn_ref, compile_args=args,
                bytes=2 * q.nbytes + kv.nbytes + idx.nbytes, flops=4.0 * B * S * H * K * D,
                bound="compute_bf16" if bf16 else "compute",
                reps=(3 if bf16 else 7) if S > 1 else 0)  # seconds-long rounds


def cases(quick=False):
    rng = np.random.default_rng(0)
    S = 256 if quick else 2048
    return [
        _case(f"prefill B=1 S={S} H=64 D=512 K=640", 1, S, 64, 512, S + S // 4, 640, rng),
        _case("decode B=1 S=1 H=64 D=512 K=640", 1, 1, 64, 512, 128 + 4096, 640, rng),
        # bf16 prefill at S=256: torch's bf16 eager reference takes ~17 s a call at S=256
        # on an AVX2 CPU (no native bf16 there), over 2 minutes at S=2048; the per-query
        # work is the same (K rows each), so the ratios hold
        _case("prefill B=1 S=256 H=64 D=512 K=640", 1, 256, 64, 512, 320, 640, rng,
              bf16=True),
        _case("decode B=1 S=1 H=64 D=512 K=640", 1, 1, 64, 512, 128 + 4096, 640, rng, bf16=True),
    ]
