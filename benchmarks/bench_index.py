"""Indexer scoring and top-k: compute-bound, so GFLOP/s of the scoring GEMM
(2 * S * Hi * Di * Tc, the causal half that is never computed included) against the
fp32 FMA peak."""
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
    flops = 2.0 * S * Hi * Di * Tc
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

    Tc = 16384 if not quick else 4096
    p = 4 * Tc - 1
    kd = rng.standard_normal((1, Tc, Di), dtype=np.float32)
    q1, w1 = q[:, :1].copy(), w[:, :1].copy()
    tq1, tkd, tw1 = torch.from_numpy(q1), torch.from_numpy(kd), torch.from_numpy(w1)
    dargs = (tq1, tkd, tw1, topk, 4, p, 128)
    out.append(Case("index_topk", f"decode S=1 Tc={Tc} Hi={Hi} Di={Di} k={topk}",
                    ours=lambda: dc.index_topk(q1, kd, w1, topk, ratio=4, start_pos=p,
                                               offset=128),
                    eager=lambda: _topk_ref(*dargs), compile_fn=_topk_ref, compile_args=dargs,
                    flops=2.0 * Hi * Di * Tc, bytes=kd.nbytes + q1.nbytes, bound="compute"))
    return out
