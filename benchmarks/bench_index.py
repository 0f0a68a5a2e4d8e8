"""Indexer scoring and top-k: compute-bound, so GFLOP/s of the scoring GEMM
(2 Hi Di per causally visible (query, entry) pair: about half of S x Tc) against the
fp32 FMA peak (bfloat16 cases: against the AMX-BF16 tile peak).

bfloat16 cases run ours on ml_dtypes.bfloat16 arrays and the torch reference
on torch.bfloat16 tensors (eager and compiled).  The bar is our bf16 scoring at >= 1.5x
the throughput of our float32 scoring; `python benchmarks/bench_index.py` measures that
ratio with the two calls interleaved in one process (robust to a busy machine)."""
import statistics
import sys
import time

import ml_dtypes
import numpy as np
import torch

import deepseek_csa as dc
from harness import Case


def _scores_ref(q, k, w, ratio: int, start_pos: int):
    """Eager reference: einsum, relu, weighted head sum, causal -inf."""
    s = torch.einsum("bshd,btd->bsht", q, k).relu_()
    s = (s * w.unsqueeze(-1)).sum(2)
    S, Tc = q.shape[1], k.shape[1]
    vis = (start_pos + torch.arange(S) + 1) // ratio
    return s.masked_fill(torch.arange(Tc)[None, :] >= vis[:, None], float("-inf"))


def _topk_ref(q, k, w, topk: int, ratio: int, start_pos: int, offset: int):
    """... then torch.topk, -1 for entries the query cannot see, + offset."""
    s = _scores_ref(q, k, w, ratio, start_pos)
    S = q.shape[1]
    vis = (start_pos + torch.arange(S) + 1) // ratio
    idx = s.topk(min(topk, (start_pos + S) // ratio), dim=-1).indices
    return torch.where(idx >= vis[:, None], -1, idx + offset)


def cases(quick=False):
    rng = np.random.default_rng(0)
    Hi, Di, topk = 64, 128, 512
    out = []
    S, Tc = (4096, 1024) if not quick else (1024, 256)
    q = rng.standard_normal((1, S, Hi, Di), dtype=np.float32)
    k = rng.standard_normal((1, Tc, Di), dtype=np.float32)
    w = rng.standard_normal((1, S, Hi), dtype=np.float32) * (Di ** -0.5 * Hi ** -0.5)
    tq, tk, tw = torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(w)
    # only the entries a query may see: query s sees t < (s + 1) // 4 (about half of the
    # S x Tc block; counting all of it read as above the FMA peak)
    flops = 2.0 * Hi * Di * float(np.minimum(Tc, (np.arange(S) + 1) // 4).sum())
    nbytes = q.nbytes + k.nbytes + w.nbytes
    args = (tq, tk, tw, topk, 4, 0, S)
    out.append(Case("index_topk", f"prefill S={S} Tc={Tc} Hi={Hi} Di={Di} k={topk}",
                    ours=lambda: dc.index_topk(q, k, w, topk, ratio=4, offset=S),
                    eager=lambda: _topk_ref(*args), compile_fn=_topk_ref, compile_args=args,
                    flops=flops, bytes=nbytes + S * topk * 4, bound="compute", reps=3))
    out.append(Case("index_topk", f"prefill V4.1 order=position S={S} Tc={Tc}",
                    ours=lambda: dc.index_topk(q, k, w, topk, ratio=4, offset=S,
                                               order="position"),
                    flops=flops, bytes=nbytes + S * topk * 4, bound="compute", reps=3))
    sargs = (tq, tk, tw, 4, 0)
    sc = np.empty((1, S, Tc), np.float32)
    out.append(Case("index_scores", f"prefill S={S} Tc={Tc} Hi={Hi} Di={Di}",
                    ours=lambda: dc.index_scores(q, k, w, ratio=4, out=sc),
                    eager=lambda: _scores_ref(*sargs), compile_fn=_scores_ref, compile_args=sargs,
                    flops=flops, bytes=nbytes + sc.nbytes, bound="compute", reps=3))
    out.append(Case("topk_indices", f"S={S} Tc={Tc} k={topk}",
                    ours=lambda: dc.topk_indices(sc, topk, ratio=4, offset=S),
                    eager=lambda t=torch.from_numpy(sc): t.topk(topk, dim=-1),
                    bytes=sc.nbytes + S * topk * 4, bound="memory"))

    # the same prefill in bfloat16 (weights too, as the released model keeps them)
    qb, kb, wb = _bf16(q), _bf16(k), _bf16(w)
    bq, bk, bw = _tb(qb), _tb(kb), _tb(wb)
    nbytes16 = qb.nbytes + kb.nbytes + wb.nbytes
    bargs = (bq, bk, bw, topk, 4, 0, S)
    out.append(Case("index_topk", f"prefill bf16 S={S} Tc={Tc} Hi={Hi} Di={Di} k={topk}",
                    ours=lambda: dc.index_topk(qb, kb, wb, topk, ratio=4, offset=S),
                    eager=lambda: _topk_ref(*bargs), compile_fn=_topk_ref, compile_args=bargs,
                    flops=flops, bytes=nbytes16 + S * topk * 4, bound="compute_bf16", reps=3))
    bsargs = (bq, bk, bw, 4, 0)
    out.append(Case("index_scores", f"prefill bf16 S={S} Tc={Tc} Hi={Hi} Di={Di}",
                    ours=lambda: dc.index_scores(qb, kb, wb, ratio=4, out=sc),
                    eager=lambda: _scores_ref(*bsargs), compile_fn=_scores_ref,
                    compile_args=bsargs, flops=flops, bytes=nbytes16 + sc.nbytes,
                    bound="compute_bf16", reps=3))

    Tc = 16384 if not quick else 4096
    p = 4 * Tc - 1
    kd = rng.standard_normal((1, Tc, Di), dtype=np.float32)
    q1, w1 = q[:, :1].copy(), w[:, :1].copy()
    tq1, tkd, tw1 = torch.from_numpy(q1), torch.from_numpy(kd), torch.from_numpy(w1)
    dflops = 2.0 * Hi * Di * Tc
    dargs = (tq1, tkd, tw1, topk, 4, p, 128)
    out.append(Case("index_topk", f"decode S=1 Tc={Tc} Hi={Hi} Di={Di} k={topk}",
                    ours=lambda: dc.index_topk(q1, kd, w1, topk, ratio=4, start_pos=p,
                                               offset=128),
                    eager=lambda: _topk_ref(*dargs), compile_fn=_topk_ref, compile_args=dargs,
                    flops=dflops, bytes=kd.nbytes + q1.nbytes, bound="compute"))
    dsargs = (tq1, tkd, tw1, 4, p)
    out.append(Case("index_scores", f"decode S=1 Tc={Tc} Hi={Hi} Di={Di}",
                    ours=lambda: dc.index_scores(q1, kd, w1, ratio=4, start_pos=p),
                    eager=lambda: _scores_ref(*dsargs), compile_fn=_scores_ref,
                    compile_args=dsargs, flops=dflops, bytes=kd.nbytes + q1.nbytes,
                    bound="compute"))
    q1b, kdb, w1b = _bf16(q1), _bf16(kd), _bf16(w1)
    bq1, bkd, bw1 = _tb(q1b), _tb(kdb), _tb(w1b)
    bdargs = (bq1, bkd, bw1, topk, 4, p, 128)
    out.append(Case("index_topk", f"decode bf16 S=1 Tc={Tc} Hi={Hi} Di={Di} k={topk}",
                    ours=lambda: dc.index_topk(q1b, kdb, w1b, topk, ratio=4, start_pos=p,
                                               offset=128),
                    eager=lambda: _topk_ref(*bdargs), compile_fn=_topk_ref, compile_args=bdargs,
                    flops=dflops, bytes=kdb.nbytes + q1b.nbytes, bound="compute_bf16"))
    bdsargs = (bq1, bkd, bw1, 4, p)
    out.append(Case("index_scores", f"decode bf16 S=1 Tc={Tc} Hi={Hi} Di={Di}",
                    ours=lambda: dc.index_scores(q1b, kdb, w1b, ratio=4, start_pos=p),
                    eager=lambda: _scores_ref(*bdsargs), compile_fn=_scores_ref,
                    compile_args=bdsargs, flops=dflops, bytes=kdb.nbytes + q1b.nbytes,
                    bound="compute_bf16"))
    return out


def _bf16(a):
    return a.astype(ml_dtypes.bfloat16)


def _tb(a):
    """torch.bfloat16 tensor sharing the memory of an ml_dtypes.bfloat16 array."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def bf16_ratio(threads=2, rounds=7, quick=False):
    """Throughput of our bfloat16 calls over our float32 calls on the same values, the
    two timed alternately (f32, bf16, f32, bf16, ...) so that load from other processes
    hits both alike; returns {case: (f32 ms, bf16 ms, ratio)} from the medians."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    Hi, Di, topk = 64, 128, 512
    S, Tc = (4096, 1024) if not quick else (1024, 256)
    Td = 16384 if not quick else 4096
    res = {}
    for name, S_, Tc_, p in (("prefill", S, Tc, 0), ("decode", 1, Td, 4 * Td - 1)):
        q = rng.standard_normal((1, S_, Hi, Di), dtype=np.float32)
        k = rng.standard_normal((1, Tc_, Di), dtype=np.float32)
        w = rng.standard_normal((1, S_, Hi), dtype=np.float32) * (Di ** -0.5 * Hi ** -0.5)
        q, k, w = (np.asarray(_bf16(a), np.float32) for a in (q, k, w))  # same values
        b16 = tuple(_bf16(a) for a in (q, k, w))
        for fn, call in (("index_scores", lambda a: dc.index_scores(*a, ratio=4, start_pos=p)),
                         ("index_topk", lambda a: dc.index_topk(*a, topk, ratio=4,
                                                                start_pos=p, offset=128))):
            reps = 1 if S_ > 1 else 50
            t32, t16 = [], []
            with threadpool_limits(threads, user_api="openmp"):
                call((q, k, w))
                call(b16)
                for _ in range(rounds):
                    for args, ts in (((q, k, w), t32), (b16, t16)):
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            call(args)
                        ts.append((time.perf_counter() - t0) / reps)
            a, b = statistics.median(t32), statistics.median(t16)
            res[f"{fn} {name}"] = (a * 1e3, b * 1e3, a / b)
    return res


if __name__ == "__main__":
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print(f"ISA {dc.get_isa()}, {threads} threads: our bf16 vs our float32 (bar: >= 1.5x)")
    for case, (a, b, r) in bf16_ratio(threads).items():
        print(f"  {case:<22} f32 {a:9.3f} ms   bf16 {b:9.3f} ms   x{r:5.2f}")
