"""The indexer's training objective: indexer_kl_loss forward + backward (sparse stage and
dense warm-up) and index_scores_backward, against torch eager autograd of the same
reference (gather the selected keys, einsum, relu, weighted head sum, log-softmax, KL).

Bar (issue 28): sparse stage at S=4096, Tc=1024, K=512, Hi=64, Di=128: >= 3x torch eager
autograd, peak memory O(S K) (no [S, Tc] tensor).  Compute-bound: 6 * slots * Hi * Di
flops (the scores, d(q) and the d(k) contributions) against the fp32 FMA peak.

    python benchmarks/bench_grad_index.py [--quick] [--threads 2]   # JSON + PNG
    python benchmarks/run.py -k grad_index                            # with the others
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import deepseek_csa as dc  # noqa: E402
from harness import Case  # noqa: E402


def _kl_ref(q, k, w, idx, tgt, ratio, start_pos, joint=False, clip=None):
    """Eager reference over B = 1: gathered keys [S, K, Di] (dense: all Tc keys, -inf past
    the visible ones), scores, KL(p || softmax(I)) mean over rows with mass; ``joint``:
    each row times its target mass, ``clip``: log-softmax clamped below."""
    S, Tc = q.shape[1], k.shape[1]
    if idx is None:
        vis = (start_pos + torch.arange(S) + 1) // ratio
        valid = torch.arange(Tc)[None, :] < vis[:, None]
        a = torch.einsum("shd,td->sht", q[0], k[0])
    else:
        valid = idx[0] >= 0
        kg = k[0][idx[0].clamp(min=0)]
        a = torch.einsum("shd,skd->shk", q[0], kg)
    I = (a.relu() * w[0][..., None]).sum(1).masked_fill(~valid, float("-inf"))
    y = tgt[0] * valid
    z = y.sum(-1, keepdim=True)
    rows = (z[:, 0] > 0)
    p = y / z.clamp(min=1e-30)
    ls = torch.log_softmax(I, -1)
    if clip is not None:
        ls = ls.clamp(min=clip)
    ls = ls.masked_fill(~valid, 0.0)
    per = (torch.xlogy(p, p) - p * ls).sum(-1)
    if joint:
        per = per * z[:, 0]
    return (per * rows).sum() / rows.sum()


def _eager_step(q, k, w, idx, tgt, ratio, start_pos, **kw):
    qt, kt, wt = (x.detach().requires_grad_() for x in (q, k, w))
    loss = _kl_ref(qt, kt, wt, idx, tgt, ratio, start_pos, **kw)
    loss.backward()
    return loss, qt.grad, kt.grad, wt.grad


def _inputs(rng, S, Tc, K, Hi, Di, ratio):
    q = rng.standard_normal((1, S, Hi, Di), dtype=np.float32) * 0.1
    k = rng.standard_normal((1, Tc, Di), dtype=np.float32)
    w = rng.standard_normal((1, S, Hi), dtype=np.float32) * (Di ** -0.5 * Hi ** -0.5)
    idx = dc.index_topk(q, k, w, K, ratio=ratio)                  # the real selection
    if idx.shape[2] < K:
        idx = np.concatenate([idx, np.full((1, S, K - idx.shape[2]), -1, np.int32)], 2)
    tgt = rng.random((1, S, K), dtype=np.float32) * (idx >= 0)
    dense = rng.random((1, S, Tc), dtype=np.float32)
    return q, k, w, idx, tgt, dense


def cases(quick=False):
    rng = np.random.default_rng(0)
    Hi, Di, ratio = 64, 128, 4
    S, Tc, K = (1024, 256, 128) if quick else (4096, 1024, 512)
    q, k, w, idx, tgt, dense = _inputs(rng, S, Tc, K, Hi, Di, ratio)
    tq, tk, tw = torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(w)
    tidx, ttgt, tdense = (torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(tgt),
                          torch.from_numpy(dense))
    slots = float((idx >= 0).sum())
    jtgt = (tgt / np.maximum(tgt.sum(-1, keepdims=True), 1e-30) * 0.5).astype(np.float32)
    tjtgt = torch.from_numpy(jtgt)
    pos = np.broadcast_to(np.arange(S, dtype=np.int32), (1, S))
    vis = np.minimum((np.arange(S) + 1) // ratio, Tc)
    dslots = float(vis.sum())
    nbytes = q.nbytes + k.nbytes + w.nbytes
    out = [
        Case("indexer_kl_loss", f"sparse fwd+bwd S={S} Tc={Tc} K={K} Hi={Hi} Di={Di}",
             ours=lambda: dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio, return_grads=True),
             eager=lambda: _eager_step(tq, tk, tw, tidx, ttgt, ratio, 0),
             flops=6.0 * slots * Hi * Di, bytes=2 * nbytes + idx.nbytes + tgt.nbytes,
             bound="compute", reps=3),
        # the variants (docs/kernels.md 11.3): joint target, clip, per-query positions and
        # the metrics, all in the same pass
        Case("indexer_kl_loss", f"sparse joint+clip+positions+metrics fwd+bwd S={S} Tc={Tc} "
             f"K={K} Hi={Hi} Di={Di}",
             ours=lambda: dc.indexer_kl_loss(q, k, w, idx, jtgt, ratio=ratio, positions=pos,
                                             target="joint", clip=-8.0, return_grads=True,
                                             return_metrics=True),
             eager=lambda: _eager_step(tq, tk, tw, tidx, tjtgt, ratio, 0, joint=True,
                                       clip=-8.0),
             flops=6.0 * slots * Hi * Di, bytes=2 * nbytes + idx.nbytes + tgt.nbytes,
             bound="compute", reps=3),
        # the variants' cost over the default objective, timed interleaved: here the
        # 'eager' column is our default call (selected target, no clip, start_pos)
        Case("indexer_kl_loss", "variants' overhead (eager column = our default call)",
             ours=lambda: dc.indexer_kl_loss(q, k, w, idx, jtgt, ratio=ratio, positions=pos,
                                             target="joint", clip=-8.0, return_grads=True,
                                             return_metrics=True),
             eager=lambda: dc.indexer_kl_loss(q, k, w, idx, tgt, ratio=ratio,
                                              return_grads=True),
             flops=6.0 * slots * Hi * Di, bytes=2 * nbytes + idx.nbytes + tgt.nbytes,
             bound="compute", reps=5),
        Case("indexer_kl_loss", f"dense warm-up fwd+bwd S={S} Tc={Tc} Hi={Hi} Di={Di}",
             ours=lambda: dc.indexer_kl_loss(q, k, w, None, dense, ratio=ratio,
                                             return_grads=True),
             eager=lambda: _eager_step(tq, tk, tw, None, tdense, ratio, 0),
             flops=6.0 * dslots * Hi * Di, bytes=2 * nbytes + dense.nbytes, bound="compute",
             reps=3),
    ]
    g = rng.standard_normal((1, S, Tc), dtype=np.float32)
    tg = torch.from_numpy(g)

    def eager_scores_bwd():
        qt, kt, wt = (x.detach().requires_grad_() for x in (tq, tk, tw))
        a = torch.einsum("bshd,btd->bsht", qt, kt)
        sc = (a.relu() * wt[..., None]).sum(2)
        vis_t = (torch.arange(S) + 1) // ratio
        m = torch.arange(Tc)[None, :] < vis_t[:, None]
        (sc * (tg * m)).sum().backward()
        return qt.grad, kt.grad, wt.grad

    out.append(Case("index_scores_backward", f"S={S} Tc={Tc} Hi={Hi} Di={Di} ratio={ratio}",
                    ours=lambda: dc.index_scores_backward(g, q, k, w, ratio=ratio),
                    eager=eager_scores_bwd, flops=6.0 * dslots * Hi * Di,
                    bytes=2 * nbytes + g.nbytes, bound="compute", reps=3))
    return out


def main():
    import harness
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", default=str(HERE / "results"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    print("load average", os.getloadavg(), flush=True)
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=a.threads, user_api="openmp"):
        peaks = harness.machine_peaks(a.threads)
        rows = []
        for c in cases(a.quick):
            r = harness.run_case(c, peaks, do_compile=False)
            print(harness.fmt_row(r), flush=True)
            rows.append(r)
    res = Path(a.results)
    res.mkdir(parents=True, exist_ok=True)
    name = "grad_index_quick" if a.quick else "grad_index"
    env = harness.environment(a.threads)
    env["loadavg_end"] = os.getloadavg()      # a shared host: how busy it was
    env["cpu_s"] = time.process_time()        # this process's CPU time, all cases
    env["wall_s"] = time.perf_counter() - t0
    (res / f"{name}.json").write_text(json.dumps(
        {"environment": env, "rows": rows}, indent=1))
    harness.plot(rows, res / f"{name}.png")
    print("wrote", res / f"{name}.json", res / f"{name}.png")


if __name__ == "__main__":
    main()
