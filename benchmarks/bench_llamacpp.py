"""llama.cpp as a peer (issue 27): its CPU ops for DeepSeek-V4 beside ours, op level,
same inputs, same thread count, interleaved rounds, each side at its native precision.

    make peers                                          # once: builds llama.cpp's ggml
    python benchmarks/bench_llamacpp.py --quick         # representative subset
    python benchmarks/bench_llamacpp.py                 # every row of the issue
    python benchmarks/bench_llamacpp.py --tiny          # smoke run, small shapes (no JSON kept)
    DEEPSEEK_CSA_ISA=avx2 python benchmarks/bench_llamacpp.py --ggml-isa avx2 --quick
                                   # both at AVX2 (after PEERS_GGML_ISA=avx2 make peers)

Durations (2 cores, idle host, ggml built): --quick ~10 min, full ~15 min; --tiny ~1 min.

Run on its own, not by run.py (it needs the library `make peers` builds; cases() is
empty).  llama.cpp is llama-cpp-python 0.3.36's vendored tree (deepseek4 architecture),
its ggml built CPU-only with -DGGML_NATIVE=ON under build/peers/ and driven through
benchmarks/llamacpp_ops.c (ctypes): each ggml graph is the one llama.cpp's deepseek4
model builds (src/models/deepseek4.cpp), on ggml's CPU backend with n_threads = ours.

Rows (each names both sides' precision; ours is compared with llama.cpp's FASTEST
variant of the same op and shape, the variant named):
  indexer    ggml_lightning_indexer + ggml_top_k (keys F32, F16 = llama.cpp's default
             cache type) vs our index_topk on float32, bfloat16 and FP4 key rows;
             Hi=64, Di=128, top-512; decode S=1 at Tc = 1K, 4K, 16K, 64K; prefill S=2048,
             Tc=512.  Inputs: q and k on the FP4 grid (the released indexer QAT-rounds
             both), so every side multiplies the same values.
  attention  llama.cpp's CSA graph: K = V = concat(window, compressed), the top-k mask
             (fill -inf, set_rows 0 at the top-k, + causal mask, joined to the window
             mask), ggml_flash_attn_ext with sinks, F32 accumulation and the n_kv_max hint;
             K/V F16 (llama.cpp's default) and F32, and F16 with K handed in already
             concatenated (not what llama.cpp runs: a stricter bar, kept among the
             variants ours is compared with), vs our sparse_attn float32 / bfloat16;
             H=64, D=512, window 128 + top-512; decode at the same Tc, prefill S=2048.
  gemm       ggml mul_mat with Q8_0 weights (llama.cpp's converter dequantizes the FP8
             checkpoint and requantizes) and MXFP4 (the FP4 experts, bit for bit), the
             weight in the buffer llama.cpp would give it (CPU_REPACK where it takes
             it; AMX only with --ggml-amx, see docs/peers.md), vs our fp8_quant + fp8_gemm / fp8_quant + fp4_gemm (bf16 out), at
             wq_b 32768x1024 and one expert's w1 2048x4096, M = 1 and 2048.
Every row also states the relative error (Frobenius) of each side against a float64
reference on the same inputs, and ours against llama.cpp (indexer: agreement of the
selected sets instead).

Same-run ceilings (issue item 5): our FMA peak probe and STREAM triad
(harness.machine_peaks) and numpy's OpenBLAS sgemm at n=3072 as a fraction of the FMA
peak; compute-bound rows (prefill, M=2048) give ours as a fraction of OpenBLAS.

Prints one line per row, ends with `llamacpp: N/M rows ours >= llama.cpp`, writes
benchmarks/results/llamacpp.json and llamacpp.png (--tiny: build/peers/ instead).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from llamacpp_pin import LLAMACPP_VERSION, PEERS  # noqa: E402,F401  (one pin, one build folder)

LIB = PEERS / "libcsa_ggml_ops.so"

NEG_INF_F16 = np.uint16(0xFC00)
# ggml's AMX buffer (Q8_0 weights on AMX-INT8 tiles) died with SIGILL in
# tinygemm_kernel_amx for M >= 2 on the test host (docs/peers.md section 3): off unless
# --ggml-amx (M = 1 runs there and is no faster than CPU_REPACK's kernels, see docs).
ALLOW_AMX = False


def cases(quick=False):
    return []  # not part of run.py: needs `make peers`


# ---------------------------------------------------------------- ggml through ctypes
class GGML:
    def __init__(self, path=LIB):
        self.path = path
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: run `make peers` first (builds llama.cpp's "
                                    f"ggml under {PEERS})")
        L = ctypes.CDLL(str(path))
        P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        L.gb_indexer.restype = P
        L.gb_indexer.argtypes = [I] * 7 + [P] * 4 + [I]
        L.gb_attn.restype = P
        L.gb_attn.argtypes = [I] * 8 + [P] * 6 + [F, I, I]
        L.gb_mul_mat.restype = P
        L.gb_mul_mat.argtypes = [I, I, I, I, P, P, I, I]
        L.gb_run.argtypes = [P]
        L.gb_free.argtypes = [P]
        L.gb_output.argtypes = [P, P, ctypes.c_size_t]
        L.gb_output_nbytes.argtypes = [P]
        L.gb_output_nbytes.restype = ctypes.c_size_t
        L.gb_weight_buffer.argtypes = [P]
        L.gb_weight_buffer.restype = ctypes.c_char_p
        L.gb_quantize.argtypes = [I, P, P, ctypes.c_int64, ctypes.c_int64]
        L.gb_quantize.restype = ctypes.c_size_t
        L.gb_row_size.argtypes = [I, ctypes.c_int64]
        L.gb_row_size.restype = ctypes.c_size_t
        L.gb_dequantize.argtypes = [I, P, P, ctypes.c_int64]
        L.gb_type_id.argtypes = [ctypes.c_char_p]
        self.L = L
        self.Q8_0 = L.gb_type_id(b"q8_0")
        self.MXFP4 = L.gb_type_id(b"mxfp4")
        assert self.Q8_0 >= 0 and self.MXFP4 >= 0, "this ggml lacks q8_0 / mxfp4"


class Graph:
    """One built ggml graph: run() computes it (the timed call), output() copies it out."""

    def __init__(self, g: GGML, handle, out_dtype, out_shape, keep):
        if not handle:
            raise RuntimeError("ggml graph construction failed")
        self.g, self.h, self.keep = g, handle, keep  # keep: inputs alive while in use
        self.out = np.empty(out_shape, out_dtype)
        assert g.L.gb_output_nbytes(handle) == self.out.nbytes

    def run(self):
        if self.g.L.gb_run(self.h) != 0:
            raise RuntimeError("ggml graph compute failed")

    def output(self):
        self.g.L.gb_output(self.h, self.out.ctypes.data, self.out.nbytes)
        return self.out

    def weight_buffer(self):
        return self.g.L.gb_weight_buffer(self.h).decode()

    def __del__(self):
        try:
            self.g.L.gb_free(self.h)
        except Exception:
            pass


def _p(a):
    return a.ctypes.data


def _c(a, dt):
    return np.ascontiguousarray(a, dtype=dt)


def ggml_indexer(g, q, k, w, mask, topk, k_type, threads, with_topk=True):
    """q [S, Hi, Di], k [Tc, Di], w [S, Hi] float32, mask [S, Tc] f16 bits."""
    S, Hi, Di = q.shape
    Tc = k.shape[0]
    ins = (_c(q, np.float32), _c(k, np.float32), _c(w, np.float32), _c(mask, np.uint16))
    h = g.L.gb_indexer(Hi, Di, S, Tc, topk, k_type, int(with_topk), *map(_p, ins), threads)
    if with_topk:
        return Graph(g, h, np.int32, (S, topk), ins)
    return Graph(g, h, np.float32, (S, Tc), ins)


def ggml_attn(g, q, kv, sink, raw_mask, csa_mask, topk_idx, scale, kv_type, threads,
              n_swa=128, concat=True):
    S, H, D = q.shape
    Nw = raw_mask.shape[1]
    Tc = csa_mask.shape[1]
    topk = topk_idx.shape[1]
    ins = (_c(q, np.float32), _c(kv, np.float32), _c(sink, np.float32),
           _c(raw_mask, np.uint16), _c(csa_mask, np.uint16), _c(topk_idx, np.int32))
    h = g.L.gb_attn(H, D, S, Nw, Tc, topk, kv_type, int(concat), *map(_p, ins), scale, n_swa,
                    threads)
    return Graph(g, h, np.float32, (S, H, D), ins)


def ggml_mul_mat(g, wtype, wbytes, x, threads, use_extra=1):
    M, K = x.shape
    N = wbytes.shape[0]
    ins = (_c(wbytes, np.uint8), _c(x, np.float32))
    h = g.L.gb_mul_mat(wtype, N, K, M, _p(ins[0]), _p(ins[1]), int(use_extra), threads)
    return Graph(g, h, np.float32, (M, N), ins)


# ---------------------------------------------------------------- input builders
def _f16_mask(visible):
    """bool -> f16 bits: 0 where visible, -inf elsewhere."""
    return np.where(visible, np.uint16(0), NEG_INF_F16).astype(np.uint16)


def _rel(a, ref):
    a = np.asarray(a, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-300))


def _e2m1_table():
    return np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def fp4_to_mxfp4(codes_packed, scales_e8m0):
    """Our FP4 layout (b [N, K/2], element 2i in the low nibble; b_s [N, K/32] ue8m0) to
    ggml's block_mxfp4 rows ({uint8 e; uint8 qs[16]} per 32: qs[j] = code[j] |
    code[j + 16] << 4): the same codes and the same exponents, re-ordered only."""
    N, K2 = codes_packed.shape
    K = 2 * K2
    codes = np.empty((N, K), np.uint8)
    codes[:, 0::2] = codes_packed & 15
    codes[:, 1::2] = codes_packed >> 4
    blk = codes.reshape(N, K // 32, 32)
    qs = blk[..., :16] | (blk[..., 16:] << 4)
    out = np.concatenate([scales_e8m0.reshape(N, K // 32, 1).astype(np.uint8), qs], -1)
    return np.ascontiguousarray(out.reshape(N, K // 32 * 17))


# ---------------------------------------------------------------- rows
class Row(dict):
    pass


def _times(sides, rounds, budget):
    t = harness.interleaved_times(sides, reps=rounds, budget=budget)
    return {k: statistics.median(v) for k, v in t.items()}, t


def _round_stats(raw, ours, llama):
    """Median over the rounds of llama.cpp's time / ours in the same round, and the
    number of rounds."""
    return dict(speedup_rounds=statistics.median(l / o for l, o in zip(raw[llama], raw[ours])),
                rounds=len(raw[ours]))


def indexer_flops(S, Tc, Hi=64, Di=128, ratio=4, start=None):
    """FLOPs of the indexer's score GEMM counting only the entries a query may see:
    query s (at position start + s) sees the compressed entries t < (start + s + 1) //
    ratio, at most Tc.  A prefill from position 0 sees about half of the S x Tc block
    (the snapshots before this counted all of it: 374 GFLOP/s, "192% of OpenBLAS
    sgemm", above the FMA peak).  start: the rows' first position (None: the rows'
    default, 4 Tc - 1 for one decode query, else 0)."""
    if start is None:
        start = ratio * Tc - 1 if S == 1 else 0
    vis = np.minimum(Tc, (start + np.arange(S) + 1) // ratio)
    return 2.0 * Hi * Di * float(vis.sum())


def attn_flops(S, Tc, H=64, D=512, win=128, topk=512):
    """FLOPs of sparse attention (q.k and p.v, 4 H D a slot) over the slots a query
    may see: the decode row's slots are all valid; prefill row r sees min(win, r + 1)
    window tokens and min(topk, Tc, (r + 1) // 4) compressed entries (the rest of its
    win + topk slots are -1 and cost nothing; counting them gave 325 GFLOP/s, above the
    FMA peak)."""
    if S == 1:
        return 4.0 * H * D * (win + min(topk, Tc))
    r = np.arange(S)
    valid = np.minimum(win, r + 1) + np.minimum(min(topk, Tc), (r + 1) // 4)
    return 4.0 * H * D * float(valid.sum())


def rederive(path):
    """Rewrites a committed snapshot's derived numbers (indexer FLOPs, GFLOP/s, the
    fraction of OpenBLAS sgemm, the check text; its .md table and .png) from its stored
    times and shapes, without re-running anything."""
    import re
    path = Path(path)
    snap = json.loads(path.read_text())
    peaks = snap["ceilings"]
    for r in snap["rows"]:
        if r["op"] not in ("indexer", "attention"):
            continue
        r["flops"] = (indexer_flops if r["op"] == "indexer" else attn_flops)(r["S"], r["Tc"])
        if r["bound"] == "compute":
            r["ours_gflops"] = r["flops"] / r["ours_s"] / 1e9
            r["llama_gflops"] = r["flops"] / r["llama_s"] / 1e9
            r["ours_frac_openblas"] = r["ours_gflops"] / peaks["numpy_sgemm_gflops"]
            r["check"] = re.sub(r"; ours \d+ GFLOP/s = \d+% of OpenBLAS sgemm.*$", "", r["check"])
            r["check"] += (f"; ours {r['ours_gflops']:.0f} GFLOP/s = "
                           f"{100 * r['ours_frac_openblas']:.0f}% of OpenBLAS sgemm (causal FLOPs)")
    snap["note"] += (" Indexer and attention FLOPs re-derived from the stored times counting "
                     "only the causally visible entries (bench_llamacpp.py --rederive).")
    path.write_text(json.dumps(snap, indent=1, default=float))
    plot(snap["rows"], path.with_suffix(".png"))
    path.with_suffix(".md").write_text(markdown(snap["rows"], peaks))
    print(f"rewrote {path} and its .md / .png from the stored times")


def indexer_rows(g, threads, S, Tc, rounds, budget, rng):
    import ml_dtypes
    import deepseek_csa as dc
    Hi, Di, topk, ratio = 64, 128, 512, 4
    start = 4 * Tc - 1 if S == 1 else 0
    q = dc.fp4_round(rng.standard_normal((1, S, Hi, Di), dtype=np.float32), 32)
    k = dc.fp4_round(rng.standard_normal((1, Tc, Di), dtype=np.float32), 32)
    w = (rng.standard_normal((1, S, Hi), dtype=np.float32) * (Di * Hi) ** -0.5).astype(np.float32)
    qb, kb = q.astype(ml_dtypes.bfloat16), k.astype(ml_dtypes.bfloat16)
    kp = dc.fp4_pack(k)
    K = min(topk, (start + S) // ratio)
    vis = (start + np.arange(S) + 1) // ratio                     # row s sees t < vis[s]
    visible = np.arange(Tc)[None, :] < vis[:, None]
    mask = _f16_mask(visible)
    gk = min(topk, Tc)
    sides = {
        "ours float32": lambda: dc.index_topk(q, k, w, topk, ratio=ratio, start_pos=start),
        "ours bfloat16": lambda: dc.index_topk(qb, kb, w, topk, ratio=ratio, start_pos=start),
        "ours FP4 rows": lambda: dc.index_topk(q, kp, w, topk, ratio=ratio, start_pos=start),
    }
    graphs = {f"llama.cpp keys {n}": ggml_indexer(g, q[0], k[0], w[0], mask, gk, t, threads)
              for n, t in (("F32", 0), ("F16", 1))}
    for n, gr in graphs.items():
        sides[n] = gr.run
    med, raw = _times(sides, rounds, budget)
    # cross-check: ggml's scores against index_scores and float64; selected sets
    nr = min(S, 256)  # float64 reference on the first rows
    ref = np.einsum("shd,td->sht", q[0, :nr].astype(np.float64), k[0].astype(np.float64))
    ref = (np.maximum(ref, 0) * w[0, :nr, :, None].astype(np.float64)).sum(1)
    gsc = ggml_indexer(g, q[0], k[0], w[0], mask, gk, 0, threads, with_topk=False)
    gsc.run()
    gs = np.where(visible, gsc.output(), 0)[:nr]
    osc = np.where(visible, dc.index_scores(q, k, w, ratio=ratio, start_pos=start)[0], 0)[:nr]
    refv = np.where(visible[:nr], ref, 0)
    del gsc
    ours_sets = {}
    for name, fn in list(sides.items())[:3]:
        idx = fn()[0]
        ours_sets[name] = [set(r[r >= 0].tolist()) for r in idx]
    g_sets = {}
    for n, gr in graphs.items():
        gr.run()
        out = gr.output()
        g_sets[n] = [set(t for t in r.tolist() if t < vis[s]) for s, r in enumerate(out)]
    best = min(graphs, key=lambda n: med[n])
    rows = []
    kind = "decode" if S == 1 else "prefill"
    flops = indexer_flops(S, Tc, Hi, Di, ratio, start)
    for name in list(sides)[:3]:
        agree = statistics.mean(len(a & b) / len(a | b) if a | b else 1.0
                                for a, b in zip(ours_sets[name], g_sets[best]))
        rows.append(Row(op="indexer", S=S, Tc=Tc, case=f"{kind} S={S} Tc={Tc} Hi={Hi} Di={Di} top-{topk}",
                        ours=name, ours_prec=_prec(name, "indexer"), llama=best,
                        llama_prec=_prec(best, "indexer"), ours_s=med[name], llama_s=med[best],
                        all_llama_s={n: med[n] for n in graphs},
                        bound="compute" if S > 1 else "memory", flops=flops,
                        check=f"top-{K} sets agree {100 * agree:.2f}% with {best}; "
                              f"scores rel err vs float64: ours f32 {_rel(osc, refv):.1e}, "
                              f"llama.cpp F32 {_rel(gs, refv):.1e}",
                        **_round_stats(raw, name, best), set_agreement=agree, scores_rel_err_ours=_rel(osc, refv),
                        scores_rel_err_llama=_rel(gs, refv)))
    return rows


def attn_rows(g, threads, S, Tc, rounds, budget, rng):
    import ml_dtypes
    import deepseek_csa as dc
    H, D, win, topk = 64, 512, 128, 512
    scale = D ** -0.5
    if S == 1:
        Nw = win
        raw_vis = np.ones((1, Nw), bool)
        csa_vis = np.ones((1, Tc), bool)
        sel = np.sort(rng.choice(Tc, min(topk, Tc), replace=False))[None, :].astype(np.int32)
        ours_idx = np.concatenate([np.arange(Nw)[None, :], Nw + sel], 1).astype(np.int32)
    else:  # prefill: the raw segment holds all S tokens (sliding window), Tc = S / 4
        Nw = S
        s = np.arange(S)[:, None]
        t = np.arange(S)[None, :]
        raw_vis = (t <= s) & (t > s - win)
        csa_vis = np.arange(Tc)[None, :] < ((s + 1) // 4)
        sel = np.tile(np.arange(min(topk, Tc), dtype=np.int32), (S, 1))  # Tc <= topk: all
        ours_idx = np.full((S, win + topk), -1, np.int32)
        for r in range(S):
            wv = np.arange(max(0, r - win + 1), r + 1)
            cv = Nw + sel[r][csa_vis[r, sel[r]]]
            row = np.concatenate([wv, cv])
            ours_idx[r, :len(row)] = row
    q = rng.standard_normal((1, S, H, D), dtype=np.float32)
    kv = rng.standard_normal((1, Nw + Tc, D), dtype=np.float32)
    sink = rng.standard_normal(H, dtype=np.float32)
    qb, kvb = q.astype(ml_dtypes.bfloat16), kv.astype(ml_dtypes.bfloat16)
    idx = ours_idx[None]
    o32 = np.empty_like(q)
    o16 = np.empty_like(qb)
    sides = {
        "ours float32": lambda: dc.sparse_attn(q, kv, sink, idx, scale, out=o32),
        "ours bfloat16": lambda: dc.sparse_attn(qb, kvb, sink, idx, scale, out=o16),
    }
    graphs = {f"llama.cpp K/V {n}": ggml_attn(g, q[0], kv[0], sink, _f16_mask(raw_vis),
                                               _f16_mask(csa_vis), sel, scale, t, threads,
                                               concat=c)
              for n, t, c in (("F16", 1, True), ("F32", 0, True), ("F16 no concat", 1, False))}
    for n, gr in graphs.items():
        sides[n] = gr.run
    med, raw = _times(sides, rounds, budget)
    ref = _attn_ref64(q[0], kv[0], sink, ours_idx, scale, rows=64)
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    ref16 = _attn_ref64(f16(q[0]), f16(kv[0]), sink, ours_idx, scale, rows=64)
    errs = {}
    for name, fn in list(sides.items())[:2]:
        errs[name] = _rel(np.asarray(fn()[0][:64], np.float32), ref)
    gouts = {}
    for n, gr in graphs.items():
        gr.run()
        gouts[n] = gr.output().copy()
        errs[n] = _rel(gouts[n][:64], ref)
    best = min(graphs, key=lambda n: med[n])
    rows = []
    kind = "decode" if S == 1 else "prefill"
    K = win + topk
    for name in list(sides)[:2]:
        ob = np.asarray(sides[name]()[0], np.float32)
        rows.append(Row(op="attention", S=S, Tc=Tc, case=f"{kind} S={S} window {win} + top-{topk} of Tc={Tc} "
                                              f"H={H} D={D}",
                        ours=name, ours_prec=_prec(name, "attention"), llama=best,
                        llama_prec=_prec(best, "attention"), ours_s=med[name], llama_s=med[best],
                        all_llama_s={n: med[n] for n in graphs},
                        bound="compute" if S > 1 else "memory", flops=attn_flops(S, Tc, H, D, win, topk),
                        check=f"rel err vs float64: ours {errs[name]:.1e}, "
                              + ", ".join(f"{n.replace('llama.cpp ', '')} {errs[n]:.1e}"
                                          for n in graphs)
                              + f" (F16 vs float64 on F16-rounded q, K/V: "
                              f"{_rel(gouts['llama.cpp K/V F16'][:64], ref16):.1e})"
                              + f"; ours vs {best} {_rel(ob, gouts[best]):.1e}",
                        **_round_stats(raw, name, best),
                        rel_err_ours=errs[name], rel_err_llama={n: errs[n] for n in graphs},
                        rel_err_llama_f16_vs_f16_inputs=_rel(gouts["llama.cpp K/V F16"][:64], ref16),
                        rel_ours_vs_llama=_rel(ob, gouts[best])))
    return rows


def _attn_ref64(q, kv, sink, idx, scale, rows=64):
    """float64 sparse attention with a sink on the first `rows` query rows."""
    S, H, D = q.shape
    out = np.zeros((min(rows, S), H, D))
    for s in range(min(rows, S)):
        ii = idx[s][idx[s] >= 0]
        kk = kv[ii].astype(np.float64)
        lg = scale * (q[s].astype(np.float64) @ kk.T)                 # [H, n]
        m = np.maximum(lg.max(1), sink)
        e = np.exp(lg - m[:, None])
        out[s] = (e @ kk) / (e.sum(1) + np.exp(sink - m))[:, None]
    return out


def gemm_rows(g, threads, M, which, rounds, budget, rng, small=False):
    import ml_dtypes
    import deepseek_csa as dc
    if which == "fp8":
        N, K = (32768, 1024) if not small else (1024, 1024)
        # a checkpoint-like weight: Gaussian, e4m3 per 128x128 block with a power-of-two
        # scale (amax -> 448); uniform random codes would make 1/16 of them e4m3
        # subnormals, far more than real weights hold (docs/peers.md, section 5)
        W0 = rng.standard_normal((N, K), dtype=np.float32) * 0.02
        amax = np.abs(W0.reshape(N // 128, 128, K // 128, 128)).max((1, 3))
        bs = (2.0 ** np.ceil(np.log2(amax / 448.0))).astype(np.float32)
        sc = np.repeat(np.repeat(bs, 128, 0), 128, 1)
        u = (W0 / sc).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        W = u.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * sc
        wnote = (f"Gaussian weights, e4m3 per 128x128 block; e4m3 subnormal codes "
                 f"{100 * ((u & 0x78) == 0).mean():.3f}% (zeros included)")
        wq = np.empty((N, g.L.gb_row_size(g.Q8_0, K)), np.uint8)
        g.L.gb_quantize(g.Q8_0, _p(np.ascontiguousarray(W)), _p(wq), N, K)
        gtype, gname = g.Q8_0, "llama.cpp Q8_0"
        ours = lambda xx: dc.fp8_gemm(*dc.fp8_quant(xx), u, bs)      # noqa: E731
        label, shape = "ours fp8_quant + fp8_gemm", f"wq_b N={N} K={K}"
    else:
        N, K = (2048, 4096) if not small else (256, 4096)
        # a checkpoint-like expert weight: Gaussian, e2m1 per 32 with a ue8m0 scale (the
        # released format, as fp4_quant writes it)
        W0 = rng.standard_normal((N, K), dtype=np.float32) * 0.02
        b4, b4s = dc.fp4_quant(W0, 32)
        tab = _e2m1_table()
        codes = np.stack([b4 & 15, b4 >> 4], -1).reshape(N, K)
        W = tab[codes] * np.repeat(2.0 ** (b4s.astype(np.float32) - 127), 32, 1)
        wnote = (f"Gaussian weights, e2m1 per 32 (fp4_quant); codes +-0.5: "
                 f"{100 * ((codes & 7) == 1).mean():.1f}%")
        wq = fp4_to_mxfp4(b4, b4s)
        chk = np.empty((N, K), np.float32)
        g.L.gb_dequantize(g.MXFP4, _p(wq), _p(chk), N * K)
        assert np.array_equal(chk, W), "MXFP4 re-encoding is not bit-exact"
        gtype, gname = g.MXFP4, "llama.cpp MXFP4"
        b4se = b4s.view(ml_dtypes.float8_e8m0fnu)
        ours = lambda xx: dc.fp4_gemm(*dc.fp8_quant(xx), b4, b4se)   # noqa: E731
        label, shape = "ours fp8_quant + fp4_gemm", f"expert w1 N={N} K={K}"
    x = rng.standard_normal((M, K), dtype=np.float32)
    gr = ggml_mul_mat(g, gtype, wq, x, threads, use_extra=2 if ALLOW_AMX else 1)
    sides = {label: lambda: ours(x), gname: gr.run}
    med, raw = _times(sides, rounds, budget)
    nr = min(M, 64)
    ref = x[:nr].astype(np.float64) @ W.astype(np.float64).T
    o = np.asarray(ours(x)[:nr], np.float32)
    gr.run()
    go = gr.output()[:nr]
    kind = "decode" if M == 1 else "prefill"
    wbuf = gr.weight_buffer()
    return [Row(op="gemm", case=f"{kind} M={M} {shape}", ours=label,
                ours_prec=("x: e4m3 per 128 (ue8m0 scale); W: " +
                           ("e4m3, 128x128 fp32 scales" if which == "fp8" else "e2m1, ue8m0 per 32")
                           + "; fp32 accumulate, bf16 out"),
                llama=gname,
                llama_prec=("x: Q8_0 (int8 per 32, f16 scale); W: " +
                            ("Q8_0 (int8 per 32, f16 scale) from the dequantized FP8"
                             if which == "fp8" else "MXFP4 (the same e2m1 codes and e8m0 scales)")
                            + f"; f32 out; weight buffer {wbuf}"),
                ours_s=med[label], llama_s=med[gname], all_llama_s={gname: med[gname]},
                bound="compute" if M > 1 else "memory", flops=2.0 * M * N * K,
                weight_bytes=int(wq.nbytes), **_round_stats(raw, label, gname), weights=wnote,
                check=f"{wnote}; rel err vs float64 (first {nr} rows): ours {_rel(o, ref):.1e}, "
                      f"llama.cpp {_rel(go, ref):.1e}; ours vs llama.cpp {_rel(o, go):.1e}",
                rel_err_ours=_rel(o, ref), rel_err_llama=_rel(go, ref),
                rel_ours_vs_llama=_rel(o, go))]


def _prec(name, op):
    table = {
        ("indexer", "ours float32"): "q, k float32 (values on the FP4 grid); fp32 scores",
        ("indexer", "ours bfloat16"): "q, k bfloat16 (same values); fp32 scores",
        ("indexer", "ours FP4 rows"): "k packed FP4 rows (68 B/row), q FP4 per 32; exact int dots",
        ("indexer", "llama.cpp keys F32"): "q F32, k F32; f32 dots",
        ("indexer", "llama.cpp keys F16"): "q F32, k F16 (llama.cpp's default cache type), "
                                           "converted to F32 per row",
        ("attention", "ours float32"): "q, kv float32; fp32 softmax and accumulation",
        ("attention", "ours bfloat16"): "q, kv bfloat16; fp32 logits/softmax/accumulation, "
                                        "weights rounded to bf16 before P.V",
        ("attention", "llama.cpp K/V F16"): "K/V F16 (default cache type), q rounded to F16, "
                                            "P.V accumulated in F16",
        ("attention", "llama.cpp K/V F32"): "K/V F32, f32 dots and accumulation",
        ("attention", "llama.cpp K/V F16 no concat"): "as K/V F16, K handed in already "
                                                      "concatenated (llama.cpp concatenates "
                                                      "window + compressed every call)",
    }
    return table[(op, name)]


# ---------------------------------------------------------------- ceilings
def ceilings(threads, quick, tiny):
    from threadpoolctl import threadpool_limits
    peaks = dict(harness.machine_peaks(threads, refresh=not tiny))
    n = 512 if tiny else (2048 if quick else 3072)
    a = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(2).standard_normal((n, n), dtype=np.float32)
    best = 0.0
    with threadpool_limits(threads, user_api="blas"):
        a @ b
        for _ in range(3 if not tiny else 1):
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2.0 * n ** 3 / (time.perf_counter() - t0) / 1e9)
    peaks["numpy_sgemm_gflops"] = best
    peaks["numpy_sgemm_n"] = n
    peaks["numpy_sgemm_frac_fma"] = best / peaks["fma_gflops"]
    try:
        cfg = np.show_config(mode="dicts")
        peaks["numpy_blas"] = cfg["Build Dependencies"]["blas"]["name"]
    except Exception:
        peaks["numpy_blas"] = "?"
    return peaks


def isa_label():
    import deepseek_csa as dc
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    cpu_isa = ("AMX-INT8/BF16" if {"amx_int8", "amx_bf16"} <= flags else
               "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "base")
    # the extra paths the avx512 / amx levels take on this CPU (docs/kernels.md s. 9)
    extra = dc._core._build_info().get("cpu_features", "").split()
    isa = dc.get_isa()
    if extra and isa in ("avx512", "amx"):
        isa += " + " + " ".join(extra)
    return isa, cpu_isa


# ---------------------------------------------------------------- main
def plan(args):
    """(op, S or M, Tc or kind) of every row group."""
    if args.tiny:
        return [("indexer", 1, 1024), ("indexer", 64, 64), ("attention", 1, 1024),
                ("attention", 64, 16), ("gemm", 1, "fp8"), ("gemm", 64, "fp4")]
    dec = [1024, 4096, 16384, 65536]
    if args.quick:
        return ([("indexer", 1, 4096), ("indexer", 1, 65536), ("indexer", 2048, 512),
                 ("attention", 1, 4096), ("attention", 1, 65536), ("attention", 2048, 512),
                 ("gemm", 1, "fp8"), ("gemm", 2048, "fp8"), ("gemm", 1, "fp4"),
                 ("gemm", 2048, "fp4")])
    return ([("indexer", 1, t) for t in dec] + [("indexer", 2048, 512)]
            + [("attention", 1, t) for t in dec] + [("attention", 2048, 512)]
            + [("gemm", m, w) for w in ("fp8", "fp4") for m in (1, 2048)])


def fmt(r):
    ratio = r["llama_s"] / r["ours_s"]
    return (f"{r['op']:<9} {r['case']:<52} {r['ours']:<26} {r['ours_s'] * 1e3:9.3f} ms | "
            f"{r['llama']:<19} {r['llama_s'] * 1e3:9.3f} ms | x{ratio:5.2f} "
            f"{'>=' if ratio >= 1 else '< '} ({r['rounds']} rounds) | {r['cpu']} [ours {r['isa']}, "
            f"ggml {r['ggml_build']}; CPU {r['cpu_isa']}] "
            f"{r['threads']}t | {r['check']}")


def plot(rows, path):
    """Top: llama.cpp time / ours per row.  Bottom: decode time against Tc, ours and
    llama.cpp's fastest variant, indexer and attention."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['op']} {r['case'].split(' H=')[0]}\n{r['ours']} vs {r['llama']}" for r in rows]
    sp = [r["llama_s"] / r["ours_s"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(9, 0.6 * len(rows)), 11),
                                  gridspec_kw={"height_ratios": [3, 2]})
    x = np.arange(len(rows))
    ax.bar(x, sp, color=["tab:green" if v >= 1 else "tab:red" for v in sp])
    ax.axhline(1, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("llama.cpp time / our time (x, > 1: ours faster)")
    if rows:
        ax.set_title(f"ours vs llama.cpp {LLAMACPP_VERSION} ggml, {rows[0]['cpu']} "
                     f"[ours {rows[0]['isa']}, ggml {rows[0].get('ggml_build', 'native')}], "
                     f"{rows[0]['threads']} threads")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=6, rotation=60, ha="right")
    styles = {"indexer": "o", "attention": "s"}
    for op, mk in styles.items():
        dec = [r for r in rows if r["op"] == op and r.get("S") == 1]
        for side in sorted({r["ours"] for r in dec}):
            pts = sorted((r["Tc"], r["ours_s"]) for r in dec if r["ours"] == side)
            ax2.plot(*zip(*pts), marker=mk, label=f"{op}: {side}")
        lp = sorted({(r["Tc"], r["llama_s"], r["llama"]) for r in dec})
        if lp:
            ax2.plot([p[0] for p in lp], [p[1] for p in lp], marker=mk, ls="--", color="k",
                     label=f"{op}: llama.cpp (fastest variant)")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("compressed entries Tc (decode, S=1)")
    ax2.set_ylabel("seconds per call")
    if ax2.lines:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows, peaks):
    """The rows as a Markdown table for the README's "How we compare"."""
    r0 = rows[0]
    out = [f"{r0['cpu']}, ours at ISA {r0['isa']}, ggml {r0.get('ggml_build', 'native')} build, "
           f"{r0['threads']} threads; FMA peak {peaks['fma_gflops']:.0f} GFLOP/s, STREAM triad "
           f"{peaks['stream_gbs']:.1f} GB/s, OpenBLAS sgemm {peaks['numpy_sgemm_gflops']:.0f} "
           f"GFLOP/s ({100 * peaks['numpy_sgemm_frac_fma']:.0f}% of FMA peak).", "",
           "| op | case | ours | ms | llama.cpp | ms | llama.cpp / ours | check |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['op']} | {r['case']} | {r['ours']} | {r['ours_s'] * 1e3:.3f} | "
                   f"{r['llama']} | {r['llama_s'] * 1e3:.3f} | x{r['speedup']:.2f} | "
                   f"{r['check']} |")
    met = sum(r["speedup"] >= 1 for r in rows)
    out += ["", f"llamacpp: {met}/{len(rows)} rows ours >= llama.cpp", ""]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    ap.add_argument("--quick", action="store_true", help="representative subset (~10 rows groups)")
    ap.add_argument("--tiny", action="store_true", help="smoke run: small shapes, 3 rounds, "
                    "output in build/peers/ (not a measurement)")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (0: ~budget)")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per side when rounds=0")
    ap.add_argument("-k", action="append", default=[], help="keep row groups whose op matches")
    ap.add_argument("--ggml-isa", default="native", choices=["native", "avx2"],
                    help="which ggml build: native (-march=native) or avx2 "
                         "(PEERS_GGML_ISA=avx2 make peers); pair avx2 with DEEPSEEK_CSA_ISA=avx2")
    ap.add_argument("--ggml-amx", action="store_true",
                    help="let ggml put Q8_0 weights in its AMX buffer (crashed here for M >= 2)")
    ap.add_argument("--note", default="")
    ap.add_argument("--no-model", action="store_true",
                    help="op rows only (skip bench_llamacpp_model.py's whole-model rows)")
    ap.add_argument("--rederive", metavar="JSON",
                    help="recompute a snapshot's derived numbers from its stored times, run nothing")
    a = ap.parse_args(argv)
    if a.rederive:
        rederive(a.rederive)
        return 0
    from threadpoolctl import threadpool_limits
    import torch
    torch.set_num_threads(a.threads)
    global ALLOW_AMX
    ALLOW_AMX = a.ggml_amx
    try:
        g = GGML(LIB if a.ggml_isa == "native" else PEERS / "libcsa_ggml_ops-avx2.so")
    except FileNotFoundError as e:
        print(f"SKIP bench_llamacpp: {e}")
        return 0
    if a.tiny:  # a smoke run leaves the snapshot (and the cached peaks) alone
        harness.RESULTS = PEERS / "tiny-results"
        harness.RESULTS.mkdir(parents=True, exist_ok=True)
    isa, cpu_isa = isa_label()
    cpu = harness.cpu_model()
    rounds = 3 if a.tiny and not a.rounds else a.rounds
    rows = []
    t_start = time.time()
    with threadpool_limits(a.threads, user_api="openmp"):
        peaks = ceilings(a.threads, a.quick, a.tiny)
        print(f"ceilings ({cpu}, ours at ISA {isa}, CPU {cpu_isa}, {a.threads} threads): "
              f"FMA peak {peaks['fma_gflops']:.0f} GFLOP/s ({peaks['isa']}), "
              f"AMX-BF16 {peaks.get('amx_bf16_gflops') or 0:.0f} GFLOP/s, "
              f"STREAM triad {peaks['stream_gbs']:.1f} GB/s, numpy {peaks['numpy_blas']} sgemm "
              f"n={peaks['numpy_sgemm_n']} {peaks['numpy_sgemm_gflops']:.0f} GFLOP/s "
              f"({100 * peaks['numpy_sgemm_frac_fma']:.0f}% of FMA peak)", flush=True)
        rng = np.random.default_rng(0)
        for op, n, t in plan(a):
            if a.k and not any(w in op for w in a.k):
                continue
            if op == "indexer":
                new = indexer_rows(g, a.threads, n, t, rounds, a.budget, rng)
            elif op == "attention":
                new = attn_rows(g, a.threads, n, t, rounds, a.budget, rng)
            else:
                new = gemm_rows(g, a.threads, n, t, rounds, a.budget, rng, small=a.tiny)
            for r in new:
                r.update(cpu=cpu, isa=isa, cpu_isa=cpu_isa, ggml_build=a.ggml_isa,
                         threads=a.threads,
                         load_avg_1min=os.getloadavg()[0])
                r["speedup"] = r["llama_s"] / r["ours_s"]
                if r["bound"] == "compute":
                    r["ours_gflops"] = r["flops"] / r["ours_s"] / 1e9
                    r["llama_gflops"] = r["flops"] / r["llama_s"] / 1e9
                    r["ours_frac_openblas"] = r["ours_gflops"] / peaks["numpy_sgemm_gflops"]
                    r["check"] += (f"; ours {r['ours_gflops']:.0f} GFLOP/s = "
                                   f"{100 * r['ours_frac_openblas']:.0f}% of OpenBLAS sgemm")
                print(fmt(r), flush=True)
                rows.append(dict(r))
    met = sum(r["speedup"] >= 1 for r in rows)
    # the whole-model rows (bench_llamacpp_model.py: llama.cpp, transformers eager and
    # + swap on one V4-Flash-width model; --quick: decode at 4K and the cross-engine
    # row), folded into the count; skipped with a note when libllama is not built
    model_rows = []
    if not a.tiny and not a.k and not a.no_model:
        import bench_llamacpp_model as bm
        msnap = bm.run((["--quick"] if a.quick else []) + ["--threads", str(a.threads)])
        if isinstance(msnap, dict):
            model_rows = bm.bench_summary(msnap)
            for name_, ok, note in model_rows:
                print(f"{name_:<60} {'>=' if ok else '< '} {note}", flush=True)
        else:
            print("model rows: skipped (bench_llamacpp_model.py said why above)", flush=True)
    met += sum(ok for _, ok, _ in model_rows)
    n_rows = len(rows) + len(model_rows)
    out_dir = PEERS if a.tiny else harness.RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    name = ("llamacpp_tiny" if a.tiny else "llamacpp") + ("_avx2" if a.ggml_isa == "avx2" else "")
    snap = {"note": f"benchmarks/bench_llamacpp.py{' --quick' if a.quick else ''}"
                    f"{' --tiny (smoke run, not a measurement)' if a.tiny else ''}: ours vs "
                    f"llama-cpp-python {LLAMACPP_VERSION}'s vendored ggml (CPU backend, "
                    f"GGML_NATIVE), interleaved rounds, medians. " + a.note,
            "llamacpp_version": LLAMACPP_VERSION, "ceilings": peaks,
            "env": harness.environment(a.threads), "host": platform.node(),
            "seconds": time.time() - t_start, "rows": rows,
            "summary": f"{met}/{n_rows} rows ours >= llama.cpp",
            "model_rows": [dict(row=n_, met=bool(ok), note=t_) for n_, ok, t_ in model_rows],
            "model_rows_json": "benchmarks/results/llamacpp_model.json"}
    (out_dir / f"{name}.json").write_text(json.dumps(snap, indent=1, default=float))
    if rows:
        plot(rows, out_dir / f"{name}.png")
        (out_dir / f"{name}.md").write_text(markdown(rows, peaks))
    print(f"wrote {out_dir / (name + '.json')} and {name}.png ({time.time() - t_start:.0f} s)")
    print(f"llamacpp: {met}/{n_rows} rows ours >= llama.cpp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
