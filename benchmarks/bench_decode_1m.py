"""Decode from 8K to 1M tokens of context: one V4-Flash CSA layer (ratio 4, indexer) and
one HCA layer (ratio 128), whole decode steps of ``CSALayer`` with their split, beside
llama.cpp's CPU ops on the same sizes, and the memory each side's caches take.

    .venv/bin/python benchmarks/bench_decode_1m.py --quick      # 8K, 128K, 1M
    .venv/bin/python benchmarks/bench_decode_1m.py              # 8K, 32K, 128K, 512K, 1M
    DEEPSEEK_CSA_ISA=avx2 .venv/bin/python benchmarks/bench_decode_1m.py --quick --ggml-isa avx2

The caches are not prefilled (a 1M-token prefill is out of reach here): each layer's
window ring, compressed KV, FP4 index keys and compressor state are written directly
(``CSALayer.fill_synthetic``: Gaussian values on their QAT grids), then the layer decodes
real steps from there.  Per context, one interleaved run (harness.interleaved_times) holds:

  ours    the CSA layer's decode step and the HCA layer's (everything: projections,
          compressor step, indexer, attention), and on those layers' own caches the
          pieces alone: index_topk over the FP4 key rows, its two halves index_scores
          and topk_indices, sparse_attn over window 128 + top-512 (CSA) and over window
          128 + every compressed entry (HCA);
  llama   llama.cpp's graphs (benchmarks/llamacpp_ops.c, docs/peers.md sections 1-2):
          ggml_lightning_indexer + ggml_top_k and the indexer alone (keys F16, its
          default cache type: our FP4 keys widened, exact), the CSA attention (concat
          window + compressed, top-k mask, flash attention; K/V F16) and the HCA
          attention (concat, causal mask, flash attention; K/V F16), the same values.

The layer steps' split comes from ``CSALayer.timings`` over the same calls.  Memory:
``cache_bytes()`` of our layers, llama.cpp's cache sizes at its default F16 cache type
(K-only caches: window, compressed, indexer, each padded to 256 cells), the released
model.py's buffers (bf16 ``kv_cache`` of window + max_seq_len / ratio entries, bf16
indexer ``kv_cache``, complex64 ``freqs_cis`` of max_seq_len positions, the compressors'
float32 state), and the peak resident memory of allocating, filling and decoding our
two layers, measured.  Then the whole V4-Flash per token at 1M from the released layer
counts (CSA / HCA / window-only layers of ``V4_FLASH.compress_ratios``).

Needs `make peers` (llama.cpp's ggml, build/peers/libcsa_ggml_ops.so, compiled from
benchmarks/llamacpp_ops.c; `make peers` again after that file changes: the HCA graph is
newer than the first harness builds, and an older harness is refused); without the
build the llama.cpp sides are left out.  --ggml-isa avx2 reads
build/peers/libcsa_ggml_ops-avx2.so (`PEERS_GGML_ISA=avx2 make peers`).  Writes benchmarks/results/decode_1m[_avx2][_quick].json
and .png.  Memory: about 3 GiB resident at 1M (run under `flock /tmp/mem.lock`).
run.py finds no cases here (cases() is empty): this is its own run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import harness  # noqa: E402

import deepseek_csa as dc  # noqa: E402
from deepseek_csa.layer import CSALayer, random_layer_weights  # noqa: E402

CFG = dc.V4_FLASH
FULL = [8192, 32768, 131072, 524288, 1 << 20]
QUICK = [8192, 131072, 1 << 20]
BAR = 3.0   # issue: at 1M, our CSA indexer + attention >= 3x llama.cpp's


def cases(quick=False):
    return []


def layer_counts(cfg=CFG):
    """CSA / HCA / window-only layers of the backbone (MTP layers not counted)."""
    rs = cfg.compress_ratios[:cfg.n_layers]
    return {"csa": sum(r == 4 for r in rs), "hca": sum(r == 128 for r in rs),
            "window": sum(r == 0 for r in rs), "other": sum(r not in (0, 4, 128) for r in rs)}


# ---------------------------------------------------------------- memory, computed
def _pad(n, m=256):
    return -(-n // m) * m


def llama_cache_bytes(ctx, ratio, cfg=CFG, cell=2, n_ubatch=512):
    """llama.cpp's K-only caches of one layer at its default F16 type (cell bytes per
    value): the window (raw) cache, the compressed cache and, for ratio 4, the
    lightning-indexer cache, each ceil(ctx / ratio) cells padded to 256
    (src/llama-kv-cache-dsv4.cpp); the raw cache is its sliding-window cache, window +
    n_ubatch (default 512) cells padded to 256 (src/llama-kv-cache-iswa.cpp)."""
    D, Di = cfg.head_dim, cfg.index_head_dim
    comp = _pad(max(1, -(-ctx // ratio))) * D * cell
    idx = _pad(max(1, -(-ctx // ratio))) * Di * cell if ratio == 4 else 0
    raw = _pad(min(ctx, cfg.window + n_ubatch)) * D * cell
    return {"window": raw, "compressed": comp, "index_keys": idx, "total": raw + comp + idx,
            "rope_table": 0, "total_with_rope": raw + comp + idx, "fixed": raw}


def released_buffer_bytes(ctx, ratio, cfg=CFG, batch=1):
    """The released model.py's buffers of one attention layer at max_seq_len = ctx,
    max_batch_size = batch (bf16 default dtype): Attention.kv_cache bf16 [B, window +
    ctx // ratio, D], Indexer.kv_cache bf16 [B, ctx // 4, Di] (ratio 4), freqs_cis
    complex64 [ctx, Dr / 2], the Compressor's kv_state and score_state float32
    [B, c * ratio, c * D] (c = 2 with overlap) and the indexer compressor's likewise."""
    D, Dr, Di, win = cfg.head_dim, cfg.rope_dim, cfg.index_head_dim, cfg.window
    kv = batch * (win + ctx // ratio) * D * 2
    idx = batch * (ctx // 4) * Di * 2 if ratio == 4 else 0
    rope = ctx * (Dr // 2) * 8
    c = 2 if ratio == 4 else 1
    state = 2 * batch * c * ratio * c * D * 4
    if ratio == 4:
        state += 2 * batch * 2 * ratio * 2 * Di * 4
    return {"kv": kv, "index_keys": idx, "compressor_state": state, "total": kv + idx + state,
            "rope_table": rope, "total_with_rope": kv + idx + state + rope,
            "fixed": win * D * 2 + state}


def ours_bytes(layer):
    """Our layer's caches (cache_bytes) and its RoPE tables (cos and sin, float32
    [max_seq_len, Dr / 2] each), which scale with max_seq_len as the released
    freqs_cis does."""
    b = dict(layer.cache_bytes())
    b["rope_table"] = int(layer._cos.nbytes + layer._sin.nbytes)
    b["total_with_rope"] = b["total"] + b["rope_table"]
    b["fixed"] = layer.cfg.window * layer.cfg.head_dim * 4     # the window ring
    return b


# ---------------------------------------------------------------- one context
def _vm(name):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    return 0


def build_layers(ctx, weights, margin, seed):
    """The CSA and HCA layers at position ctx, caches filled synthetically."""
    layers = {}
    for kind, r in (("csa", 4), ("hca", 128)):
        lay = CSALayer(weights[kind], CFG, ratio=r, batch=1, max_seq_len=ctx + margin)
        lay.fill_synthetic(ctx, seed=seed + r)
        layers[kind] = lay
    return layers


def point(ctx, weights, g, threads, reps, seed=0):
    rng = np.random.default_rng(seed)
    H, D, Dr, win = CFG.n_heads, CFG.head_dim, CFG.rope_dim, CFG.window
    Hi, Di, K = CFG.index_heads, CFG.index_head_dim, CFG.index_topk
    margin = reps + 16
    x = rng.standard_normal((1, 1, CFG.dim), dtype=np.float32)

    # allocate + fill + two decode steps, peak resident memory measured
    built = {}

    def alloc_and_decode():
        t0 = time.perf_counter()
        built.update(build_layers(ctx, weights, margin, seed))
        built["fill_s"] = time.perf_counter() - t0
        for lay in (built["csa"], built["hca"]):
            lay(x, lay._pos)
    peak = harness.peak_extra_rss(alloc_and_decode)
    csa, hca = built["csa"], built["hca"]
    mem = {"ours_peak_extra_rss": peak, "rss_after_fill": _vm("VmRSS:"),
           "fill_s": built["fill_s"],
           "ours": {"csa": ours_bytes(csa), "hca": ours_bytes(hca)},
           "llama_f16": {"csa": llama_cache_bytes(ctx, 4), "hca": llama_cache_bytes(ctx, 128)},
           "released": {"csa": released_buffer_bytes(ctx, 4),
                        "hca": released_buffer_bytes(ctx, 128)}}

    # op-level inputs on the layers' own caches, at position ctx (every entry visible)
    n, nh = ctx // 4, ctx // 128
    iq = rng.standard_normal((1, 1, Hi, Di), dtype=np.float32)
    if CFG.index_hadamard:
        dc.hadamard(iq, out=iq)
    dc.fp4_round(iq, 32)
    iw = (rng.standard_normal((1, 1, Hi), dtype=np.float32)
          * np.float32(Di ** -0.5 * Hi ** -0.5))
    ik = csa._ik[:, :n]
    q = rng.standard_normal((1, 1, H, D), dtype=np.float32)
    sink = csa.w["attn_sink"]
    scale = D ** -0.5
    sel = dc.index_topk(iq, ik, iw, K, ratio=4, start_pos=ctx)[0, 0]   # [K] in 0..n-1
    widx = np.arange(win, dtype=np.int32)
    cidx = np.concatenate([widx, win + np.sort(sel)])[None, None].astype(np.int32)
    hidx = np.concatenate([widx, win + np.arange(nh, dtype=np.int32)])[None, None]
    kv_c, kv_h = csa._kv[:, :win + n], hca._kv[:, :win + nh]
    o_c, o_h = np.empty_like(q), np.empty_like(q)
    scores = dc.index_scores(iq, ik, iw, ratio=4, start_pos=ctx)
    sides = {
        "ours CSA step": lambda: csa(x, csa._pos),
        "ours HCA step": lambda: hca(x, hca._pos),
        "ours index_topk FP4": lambda: dc.index_topk(iq, ik, iw, K, ratio=4, start_pos=ctx,
                                                     offset=win),
        "ours index_scores FP4": lambda: dc.index_scores(iq, ik, iw, ratio=4, start_pos=ctx,
                                                         out=scores),
        "ours topk_indices": lambda: dc.topk_indices(scores, K, ratio=4, start_pos=ctx,
                                                     offset=win),
        "ours CSA sparse_attn": lambda: dc.sparse_attn(q, kv_c, sink, cidx, scale, out=o_c),
        "ours HCA sparse_attn": lambda: dc.sparse_attn(q, kv_h, sink, hidx, scale, out=o_h),
    }
    graphs, llama_err = {}, None
    if g is not None:
        import bench_llamacpp as bl
        kf = dc.fp4_unpack(ik[0])                           # exact in F16 (FP4 grid)
        zeros = lambda m: np.zeros((1, m), np.uint16)       # noqa: E731  all visible
        try:
            graphs = {
                "llama.cpp indexer+top_k F16": bl.ggml_indexer(g, iq[0], kf, iw[0], zeros(n),
                                                               K, 1, threads),
                "llama.cpp indexer F16": bl.ggml_indexer(g, iq[0], kf, iw[0], zeros(n), K, 1,
                                                         threads, with_topk=False),
                "llama.cpp CSA attn F16": bl.ggml_attn(g, q[0], kv_c[0], sink, zeros(win),
                                                       zeros(n), sel[None], scale, 1, threads),
                "llama.cpp HCA attn F16": bl.ggml_attn(g, q[0], kv_h[0], sink, zeros(win),
                                                       zeros(nh), np.zeros((1, 0), np.int32),
                                                       scale, 1, threads),
            }
        except Exception as e:   # where llama.cpp's CPU ops stop
            llama_err = f"{type(e).__name__}: {e}"
            graphs = {}
        del kf
        for name, gr in graphs.items():
            sides[name] = gr.run
    # checks, before the layer steps below write the window ring the ops read: the same
    # inputs give the same answers on both sides
    checks = {}
    if graphs:
        gi = graphs["llama.cpp indexer+top_k F16"]
        gi.run()
        a, b = set(sel.tolist()), set(gi.output()[0].tolist())
        checks["topk_set_agreement"] = len(a & b) / len(a | b)
        for kind, gname, o, idx, kv in (("csa", "llama.cpp CSA attn F16", o_c, cidx, kv_c),
                                        ("hca", "llama.cpp HCA attn F16", o_h, hidx, kv_h)):
            dc.sparse_attn(q, kv, sink, idx, scale, out=o)
            graphs[gname].run()
            go = graphs[gname].output()
            checks[f"{kind}_attn_rel_ours_vs_llama"] = float(np.linalg.norm(go - o[0])
                                                            / np.linalg.norm(o[0]))
    csa.reset_timings()
    hca.reset_timings()
    p0 = {"csa": csa._pos, "hca": hca._pos}
    t_load0, c0 = os.getloadavg(), time.process_time()
    w0 = time.perf_counter()
    # CPU time of each call beside its wall time: on a shared host (load average above
    # the 2 cores) a side's wall time includes waiting for a core, its CPU time less so
    cpu_t = {k: [] for k in sides}

    def timed(name, fn):
        def run():
            c = time.process_time()
            fn()
            cpu_t[name].append(time.process_time() - c)
        return run
    raw = harness.interleaved_times({k: timed(k, f) for k, f in sides.items()}, reps=reps)
    cpu_t = {k: v[2:] for k, v in cpu_t.items()}     # the two untimed warm-up calls
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    med = {k: statistics.median(v) for k, v in raw.items()}
    steps = {"csa": csa._pos - p0["csa"], "hca": hca._pos - p0["hca"]}
    split = {k: {op: s / steps[k] for op, s in lay.timings.items()}
             for k, lay in (("csa", csa), ("hca", hca))}

    def per_round(num, den, t=raw):
        """Median over rounds of sum(num sides) / sum(den sides) in the same round."""
        return statistics.median(sum(t[a][i] for a in num) / max(sum(t[b][i] for b in den),
                                                                   1e-9)
                                 for i in range(len(t[den[0]])))
    row = {"context": ctx, "Tc_csa": n, "Tc_hca": nh, "ms": {k: 1e3 * v for k, v in med.items()},
           "cpu_ms": {k: 1e3 * statistics.median(v) for k, v in cpu_t.items()},
           "rounds": len(raw["ours CSA step"]),
           "split_ms": {k: {op: 1e3 * v for op, v in s.items()} for k, s in split.items()},
           "memory": mem, "loadavg_before": t_load0, "loadavg_after": os.getloadavg(),
           "cpu_over_wall": cpu / wall, "llama_error": llama_err,
           # the process's high-water mark since this point's allocation began: weights,
           # both layers, llama.cpp's graphs (its own F16 copies of the caches) and all
           "process_peak_rss": _vm("VmHWM:")}
    row.update(checks)
    if graphs:
        row["speedup_csa_indexer_attn"] = per_round(
            ["llama.cpp indexer+top_k F16", "llama.cpp CSA attn F16"],
            ["ours index_topk FP4", "ours CSA sparse_attn"])
        row["speedup_indexer"] = per_round(["llama.cpp indexer+top_k F16"], ["ours index_topk FP4"])
        row["speedup_csa_attn"] = per_round(["llama.cpp CSA attn F16"], ["ours CSA sparse_attn"])
        row["speedup_hca_attn"] = per_round(["llama.cpp HCA attn F16"], ["ours HCA sparse_attn"])
        row["cpu_speedup_csa_indexer_attn"] = per_round(
            ["llama.cpp indexer+top_k F16", "llama.cpp CSA attn F16"],
            ["ours index_topk FP4", "ours CSA sparse_attn"], cpu_t)
        row["cpu_speedup_hca_attn"] = per_round(["llama.cpp HCA attn F16"],
                                                ["ours HCA sparse_attn"], cpu_t)
    del graphs
    m = row["ms"]
    msg = (f"ctx {ctx:>8}: CSA step {m['ours CSA step']:7.2f} ms, HCA step "
           f"{m['ours HCA step']:7.2f} ms; index_topk {m['ours index_topk FP4']:6.2f}, "
           f"CSA attn {m['ours CSA sparse_attn']:5.2f}, HCA attn {m['ours HCA sparse_attn']:5.2f} ms")
    if "speedup_csa_indexer_attn" in row:
        msg += (f" | llama.cpp idx+top_k {m['llama.cpp indexer+top_k F16']:7.2f}, CSA attn "
                f"{m['llama.cpp CSA attn F16']:6.2f}, HCA attn {m['llama.cpp HCA attn F16']:6.2f}"
                f" ms | CSA idx+attn x{row['speedup_csa_indexer_attn']:.2f} (CPU time "
                f"x{row['cpu_speedup_csa_indexer_attn']:.2f}), HCA attn "
                f"x{row['speedup_hca_attn']:.2f} (CPU x{row['cpu_speedup_hca_attn']:.2f}); "
                f"top-k sets {100 * row['topk_set_agreement']:.0f}% equal, attention ours vs "
                f"llama.cpp {row['csa_attn_rel_ours_vs_llama']:.1e} (CSA), "
                f"{row['hca_attn_rel_ours_vs_llama']:.1e} (HCA)")
    elif llama_err:
        msg += f" | llama.cpp: {llama_err}"
    print(msg + f" | peak +{peak / 2**30:.2f} GiB, load {t_load0[0]:.1f}", flush=True)
    return row


# ---------------------------------------------------------------- whole model
def projection(row, counts):
    """Per token at row's context, the whole V4-Flash's attention layers: CSA and HCA
    layers from the measured steps; the window-only layers (context-independent, ratio
    0) counted as the HCA step minus its compressed-part work (compressor and the
    sparse attention over the compressed entries, a bound from above).  Memory from the
    per-layer bytes."""
    m, s = row["ms"], row["split_ms"]
    win_ms = m["ours HCA step"] - s["hca"].get("compressor", 0.0)
    out = {"layers": counts,
           "ours_attention_layers_ms": counts["csa"] * m["ours CSA step"]
           + counts["hca"] * m["ours HCA step"] + counts["window"] * win_ms,
           "ours_indexer_attention_ms": counts["csa"] * (m["ours index_topk FP4"]
                                                          + m["ours CSA sparse_attn"])
           + counts["hca"] * m["ours HCA sparse_attn"]}
    if "llama.cpp CSA attn F16" in m:
        out["llama_indexer_attention_ms"] = (
            counts["csa"] * (m["llama.cpp indexer+top_k F16"] + m["llama.cpp CSA attn F16"])
            + counts["hca"] * m["llama.cpp HCA attn F16"])
        out["llama_over_ours_indexer_attention"] = (out["llama_indexer_attention_ms"]
                                                    / out["ours_indexer_attention_ms"])
    mem = row["memory"]
    for side in ("ours", "llama_f16", "released"):
        tot = counts["csa"] * mem[side]["csa"]["total"] + counts["hca"] * mem[side]["hca"]["total"]
        out[f"{side}_cache_bytes_csa_hca_layers"] = tot
    out["ours_rope_tables_bytes"] = (counts["csa"] + counts["hca"] + counts["window"]) * \
        mem["ours"]["csa"]["rope_table"]
    return out


def per_token_bytes(row):
    """Bytes per token of context of each layer kind: the caches less their fixed part
    (window, compressor state) over the context; position tables apart (ours float32
    cos + sin, the released complex64 freqs_cis; llama.cpp computes RoPE on the fly)."""
    ctx, mem = row["context"], row["memory"]
    out = {}
    for side in ("ours", "llama_f16", "released"):
        for kind in ("csa", "hca"):
            b = mem[side][kind]
            out[f"{side}_{kind}"] = (b["total"] - b["fixed"]) / ctx
            out[f"{side}_{kind}_rope_table"] = b["rope_table"] / ctx
    return out


# ---------------------------------------------------------------- plot
def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.8))
    ctx = [r["context"] for r in rows]
    styles = {"ours": "-", "llama.cpp": "--"}
    for name in rows[0]["ms"]:
        if name in ("ours index_scores FP4", "ours topk_indices", "llama.cpp indexer F16"):
            continue
        a.plot(ctx, [r["ms"].get(name, np.nan) for r in rows], marker="o",
               ls=styles["ours" if name.startswith("ours") else "llama.cpp"], label=name)
    a.set_ylabel("decode step / op, ms (median)")
    for key, lab in (("speedup_csa_indexer_attn", "CSA indexer+top-k + attention"),
                     ("speedup_indexer", "CSA indexer+top-k"),
                     ("speedup_csa_attn", "CSA attention"), ("speedup_hca_attn", "HCA attention")):
        if key in rows[0]:
            b.plot(ctx, [r.get(key, np.nan) for r in rows], marker="o", label=lab)
    b.axhline(BAR, color="k", lw=0.8, ls=":", label=f"bar {BAR:g}x")
    b.set_ylabel("llama.cpp time / ours (same round)")
    for side, ls in (("ours", "-"), ("llama_f16", "--"), ("released", ":")):
        for kind in ("csa", "hca"):
            c.plot(ctx, [r["memory"][side][kind]["total"] / 2 ** 20 for r in rows], marker="o",
                   ls=ls, label=f"{side} {kind.upper()} layer")
    c.plot(ctx, [r["memory"]["ours_peak_extra_rss"] / 2 ** 20 for r in rows], marker="s",
           color="k", label="ours CSA+HCA: measured peak RSS")
    c.set_ylabel("cache bytes per layer (no position tables), MiB")
    for ax in (a, b, c):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    a.set_yscale("log")
    c.set_yscale("log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8K, 128K and 1M only, fewer rounds")
    ap.add_argument("--contexts", type=str, default=None, help="comma-separated, e.g. 8192,1048576")
    ap.add_argument("--reps", type=int, default=None, help="rounds per context (default 9; quick 5)")
    ap.add_argument("--ggml-isa", default="native", choices=["native", "avx2"])
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--out", type=str, default=None)
    a = ap.parse_args(argv)
    contexts = ([int(c) for c in a.contexts.split(",")] if a.contexts
                else (QUICK if a.quick else FULL))
    reps = a.reps or (5 if a.quick else 9)
    threads = dc.max_threads()
    g = None
    if not a.no_llama:
        import bench_llamacpp as bl
        lib = bl.LIB if a.ggml_isa == "native" else bl.PEERS / "libcsa_ggml_ops-avx2.so"
        src = HERE / "llamacpp_ops.c"
        if lib.exists() and lib.stat().st_mtime < src.stat().st_mtime:
            # the HCA graph (topk = 0) is newer than some harness builds: an old one
            # would build a top-k mask of zero rows
            raise SystemExit(f"{lib} is older than {src}: rebuild it (`make peers`"
                             + (", PEERS_GGML_ISA=avx2" if a.ggml_isa == "avx2" else "") + ")")
        try:
            g = bl.GGML(lib)
        except (FileNotFoundError, OSError) as e:
            print(f"llama.cpp left out: {e}")
    cpu = harness.cpu_model()
    env = harness.environment(threads)
    env.update(ggml_build=a.ggml_isa if g is not None else None, loadavg_start=os.getloadavg())
    title = (f"V4-Flash decode, one CSA + one HCA layer, {cpu}, ours ISA {dc.get_isa()}, "
             f"ggml {a.ggml_isa}, {threads} threads")
    print(title, flush=True)
    counts = layer_counts()
    weights = {"csa": random_layer_weights(CFG, 4, seed=1),
               "hca": random_layer_weights(CFG, 128, seed=2)}
    rows = []
    for ctx in contexts:
        rows.append(point(ctx, weights, g, threads, reps))
        rows[-1]["per_token_bytes"] = per_token_bytes(rows[-1])
    out = {"environment": env, "cpu": cpu, "isa": dc.get_isa(), "threads": threads,
           "layer_counts": counts, "bar": BAR, "rows": rows,
           "vm_hwm_bytes": _vm("VmHWM:"), "loadavg_end": os.getloadavg()}
    last = rows[-1]
    out["projection"] = {"context": last["context"], **projection(last, counts)}
    pr = out["projection"]
    print(f"whole V4-Flash at ctx {last['context']} ({counts['csa']} CSA, {counts['hca']} HCA, "
          f"{counts['window']} window layers): attention layers {pr['ours_attention_layers_ms']:.0f}"
          f" ms/token (ours); indexer + attention ours {pr['ours_indexer_attention_ms']:.0f} ms"
          + (f", llama.cpp {pr['llama_indexer_attention_ms']:.0f} ms "
             f"(x{pr['llama_over_ours_indexer_attention']:.2f})"
             if "llama_indexer_attention_ms" in pr else "")
          + f"; caches ours {pr['ours_cache_bytes_csa_hca_layers'] / 2**30:.2f} GiB, llama.cpp F16 "
          f"{pr['llama_f16_cache_bytes_csa_hca_layers'] / 2**30:.2f} GiB, released "
          f"{pr['released_cache_bytes_csa_hca_layers'] / 2**30:.2f} GiB", flush=True)
    if "speedup_csa_indexer_attn" in last:
        ok = last["speedup_csa_indexer_attn"] >= BAR
        out["bar_met"] = ok
        print(f"BAR at ctx {last['context']}: CSA indexer + attention "
              f"x{last['speedup_csa_indexer_attn']:.2f} vs llama.cpp "
              f"({'>=' if ok else '<'} {BAR:g}x; CPU time "
              f"x{last['cpu_speedup_csa_indexer_attn']:.2f}; load average "
              f"{last['loadavg_before'][0]:.1f})", flush=True)
    res = harness.RESULTS
    res.mkdir(parents=True, exist_ok=True)
    name = a.out or ("decode_1m" + ("_avx2" if a.ggml_isa == "avx2" else "")
                     + ("_quick" if a.quick else ""))
    (res / f"{name}.json").write_text(json.dumps(out, indent=1, default=float))
    try:
        plot(rows, res / f"{name}.png", title + f"; load average {env['loadavg_start'][0]:.1f} "
             f"at the start (2 cores)")
    except ImportError as e:
        print(f"no plot: {e}")
    print(f"wrote {res / (name + '.json')}")


if __name__ == "__main__":
    main()
