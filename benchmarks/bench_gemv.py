"""wfp8_gemm / wbf16_gemm, the runner's weight-only GEMVs, at the decode shapes of one
V4-Flash layer at the released width (docs/runner.md "What it does" 8), weights cold.

One activation row; each call reads a different copy of the weights, cycling through
>= 320 MiB of copies (beyond the 300 MiB L3 this VM reports), as a decode step that
reads ~1 GB between two uses of one weight sees them: from memory.  GB/s = weight bytes
(codes + scales) / median call time, Python glue included, and over the 10th-percentile
call (on a shared host a call of a few ms is often preempted, which the median shows).
Beside them, in the same rounds: fp8_gemm (one FP8 row times e4m3 weights) at the wo_a
bytes, a read-only probe (our C read loop at the same ISA level, harness.read_gbs's,
over the same bytes of float32 copies, cycled the same way; torch.sum, the probe before
it, is bound by its own arithmetic here) and an empty call of each kernel (N = 4, K = 128) right after the others: the
per-call cost of glue and dispatch with the caches just flushed by a weight stream.
Only ratios within one run count.

    python benchmarks/bench_gemv.py [--threads 1,2] [--rounds 15] [--json out.json]

Shapes (the runner's layer): wo_a (8 groups x [1024 rows x 4096], bf16 rows, e4m3 with
e8m0 128 x 128 scales, 33.6 MB); wbf16 (float32 row times bf16 weights, K = 4096): the
compressor's wkv and wgate (N = 1024 each), the indexer compressor's (N = 256 each),
the head of the bench's layer (N = 512) and the router (N = 256), 27.3 MB over 6 calls.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import deepseek_csa as dc  # noqa: E402

K = 4096
COLD_BYTES = 320 << 20


def _e4m3(rng, shape):
    u = rng.integers(0, 256, shape).astype(np.uint8)
    u[(u & 0x7F) == 0x7F] ^= 1
    return u


def _copies(make, nbytes):
    return [make(i) for i in range(max(2, -(-COLD_BYTES // nbytes)))]


def cases():
    rng = np.random.default_rng(0)
    out = []
    G, R = 8, 1024
    a = rng.standard_normal((1, G, K)).astype(ml_dtypes.bfloat16)
    nb = G * R * K + (G * R // 128) * (K // 128)
    ws = _copies(lambda i: (_e4m3(rng, (G * R, K)),
                            rng.integers(118, 124, (G * R // 128, K // 128)).astype(np.uint8)), nb)
    out.append(("wfp8 wo_a 8x[1024x4096]", nb,
                lambda w: dc.wfp8_gemm(a, w[0], w[1], groups=G), ws))
    x = rng.standard_normal((1, K)).astype(np.float32)
    for N, what in ((1024, "wkv/wgate"), (512, "head"), (256, "idx wkv/wgate, router")):
        nb = N * K * 2
        ws = _copies(lambda i, N=N: rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16), nb)
        out.append((f"wbf16 N={N} ({what})", nb, lambda w: dc.wbf16_gemm(x, w), ws))
    # fp8_gemm at the wo_a bytes (N = 8192, K = 4096)
    N8 = 8192
    T = torch.from_numpy
    a8 = T(_e4m3(rng, (1, K))).view(torch.float8_e4m3fn)
    a8s = T((2.0 ** rng.integers(-6, -2, (1, K // 128))).astype(np.float32))
    nb = N8 * K + (N8 // 128) * (K // 128) * 4
    ws = _copies(lambda i: (T(_e4m3(rng, (N8, K))).view(torch.float8_e4m3fn),
                            T((2.0 ** rng.integers(-9, -5, (N8 // 128, K // 128))).astype(np.float32))),
                 nb)
    out.append(("fp8_gemm N=8192 K=4096", nb, lambda w: dc.fp8_gemm(a8, a8s, w[0], w[1]), ws))
    from deepseek_csa import _core
    for nb in (G * R * K, 1024 * K * 2, 256 * K * 2):
        ws = _copies(lambda i, nb=nb: np.ones(nb // 4, np.float32), nb)
        out.append((f"read probe {nb / 1e6:.1f} MB", nb,
                    lambda w: _core._stream_read(w, torch.get_num_threads()), ws))
    # per-call overhead: the smallest shapes, warm
    a1 = rng.standard_normal((1, K)).astype(ml_dtypes.bfloat16)[:, :128].copy()
    b1, s1 = _e4m3(rng, (4, 128)), np.full((1, 1), 127, np.uint8)
    out.append(("wfp8 empty N=4 K=128", 0, lambda w: dc.wfp8_gemm(a1, b1, s1), [None]))
    x1, w1 = x[:, :128].copy(), rng.standard_normal((4, 128)).astype(ml_dtypes.bfloat16)
    out.append(("wbf16 empty N=4 K=128", 0, lambda w: dc.wbf16_gemm(x1, w1), [None]))
    return out


def run(threads, rounds):
    cs = cases()
    rows = []
    for t in threads:
        with threadpool_limits(limits=t, user_api="openmp"):
            torch.set_num_threads(t)
            times = {name: [] for name, *_ in cs}
            every = {name: [] for name, *_ in cs}
            idx = {name: 0 for name, *_ in cs}
            for name, _, fn, ws in cs:        # warm-up: page in every copy
                for w in ws:
                    fn(w)
            for _ in range(rounds):
                for name, _, fn, ws in cs:
                    per = []
                    for _ in range(len(ws)):
                        w = ws[idx[name] % len(ws)]
                        idx[name] += 1
                        t0 = time.perf_counter()
                        fn(w)
                        per.append(time.perf_counter() - t0)
                    times[name].append(statistics.median(per))
                    every[name] += per
            for name, nb, *_ in cs:
                s = statistics.median(times[name])
                p10 = sorted(every[name])[len(every[name]) // 10]
                rows.append(dict(name=name, threads=t, bytes=nb, us=s * 1e6, us_p10=p10 * 1e6,
                                 gbs=nb / s / 1e9 if nb else None,
                                 gbs_p10=nb / p10 / 1e9 if nb else None))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args()
    load0 = open("/proc/loadavg").read().split()[:3]
    rows = run([int(t) for t in args.threads.split(",")], args.rounds)
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"isa {dc.get_isa()}, load {' '.join(load0)} -> {' '.join(load1)}")
    for r in rows:
        g = f"{r['gbs']:6.1f} GB/s  (p10 {r['gbs_p10']:5.1f})" if r["gbs"] else ""
        print(f"{r['threads']}t  {r['name']:40s} {r['us']:9.1f} us  {g}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(isa=dc.get_isa(), load=[load0, load1],
                                                   rows=rows), indent=1))


if __name__ == "__main__":
    main()
