/* Benchmark harness, not package code: drives llama.cpp's ggml (the copy vendored in
 * llama-cpp-python 0.3.36, built by `make peers` under build/peers/) on the ops that
 * benchmarks/bench_llamacpp.py sets beside ours.  Compiled by that script into
 * build/peers/libcsa_ggml_ops.so against the built ggml and loaded with ctypes.
 *
 * Each gb_* constructor builds one ggml graph the way llama.cpp's deepseek4 model builds
 * it (src/models/deepseek4.cpp, read, not copied), uploads the caller's inputs into CPU
 * backend buffers once, and returns a handle; gb_run() computes the graph (the timed
 * part), gb_output() copies the result out.  Nothing here aborts on purpose; ggml itself
 * asserts on shapes it does not accept.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

typedef struct gb {
    ggml_backend_t backend;
    struct ggml_context *ctx_in;    /* inputs (CPU buffer) */
    struct ggml_context *ctx_w;     /* weights (an extra buffer type where one takes them) */
    struct ggml_context *ctx_graph; /* graph nodes, allocated by gallocr */
    ggml_backend_buffer_t buf_in, buf_w;
    ggml_gallocr_t galloc;
    struct ggml_cgraph *gf;
    struct ggml_tensor *out;
    char wbuft[64];
} gb;

static gb *gb_new(int n_threads) {
    gb *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->backend = ggml_backend_cpu_init();
    if (!b->backend) { free(b); return NULL; }
    ggml_backend_cpu_set_n_threads(b->backend, n_threads);
    struct ggml_init_params p = {64 * ggml_tensor_overhead(), NULL, true};
    b->ctx_in = ggml_init(p);
    struct ggml_init_params pg = {256 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true};
    b->ctx_graph = ggml_init(pg);
    strcpy(b->wbuft, "-");
    return b;
}

void gb_free(gb *b) {
    if (!b) return;
    if (b->galloc) ggml_gallocr_free(b->galloc);
    if (b->buf_in) ggml_backend_buffer_free(b->buf_in);
    if (b->buf_w) ggml_backend_buffer_free(b->buf_w);
    if (b->ctx_in) ggml_free(b->ctx_in);
    if (b->ctx_w) ggml_free(b->ctx_w);
    if (b->ctx_graph) ggml_free(b->ctx_graph);
    if (b->backend) ggml_backend_free(b->backend);
    free(b);
}

static int gb_finish(gb *b, struct ggml_tensor *out) {
    b->out = out;
    b->gf = ggml_new_graph_custom(b->ctx_graph, 256, false);
    ggml_build_forward_expand(b->gf, out);
    b->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(b->backend));
    if (!ggml_gallocr_alloc_graph(b->galloc, b->gf)) return -1;
    return 0;
}

/* Upload float32 data into t, converting to F16 when t is F16. */
static void set_f32(struct ggml_tensor *t, const float *src) {
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_set(t, src, 0, ggml_nbytes(t));
    } else {
        int64_t n = ggml_nelements(t);
        ggml_fp16_t *h = malloc(n * sizeof *h);
        ggml_fp32_to_fp16_row(src, h, n);
        ggml_backend_tensor_set(t, h, 0, ggml_nbytes(t));
        free(h);
    }
}

int gb_run(gb *b) {
    return ggml_backend_graph_compute(b->backend, b->gf) == GGML_STATUS_SUCCESS ? 0 : -1;
}

size_t gb_output_nbytes(gb *b) { return ggml_nbytes(b->out); }

int gb_output(gb *b, void *dst, size_t nbytes) {
    if (nbytes != ggml_nbytes(b->out)) return -1;
    ggml_backend_tensor_get(b->out, dst, 0, nbytes);
    return 0;
}

const char *gb_weight_buffer(gb *b) { return b->wbuft; }

/* Lightning indexer + top-k, as deepseek4.cpp's fused path (cparams.fused_lid):
 *   q [S][Hi][Di] f32, k [Tc][Di] (uploaded as k_type: 0 F32, 1 F16), w [S][Hi] f32
 *   (prescaled), mask [S][Tc] f16 bits (0 visible, -inf not).
 * Output: int32 [S][topk], the top-k positions of each row (a set: ggml's order is not
 * meaningful).  with_topk=0 outputs the float32 scores [S][Tc] instead. */
gb *gb_indexer(int Hi, int Di, int S, int Tc, int topk, int k_type, int with_topk,
               const float *q, const float *k, const float *w, const uint16_t *mask,
               int n_threads) {
    gb *b = gb_new(n_threads);
    if (!b) return NULL;
    struct ggml_context *c = b->ctx_in;
    struct ggml_tensor *tq = ggml_new_tensor_4d(c, GGML_TYPE_F32, Di, Hi, S, 1);
    struct ggml_tensor *tk = ggml_new_tensor_4d(c, k_type ? GGML_TYPE_F16 : GGML_TYPE_F32,
                                                Di, 1, Tc, 1);
    struct ggml_tensor *tw = ggml_new_tensor_4d(c, GGML_TYPE_F32, Hi, S, 1, 1);
    struct ggml_tensor *tm = ggml_new_tensor_4d(c, GGML_TYPE_F16, Tc, S, 1, 1);
    b->buf_in = ggml_backend_alloc_ctx_tensors(c, b->backend);
    set_f32(tq, q);
    set_f32(tk, k);
    set_f32(tw, w);
    ggml_backend_tensor_set(tm, mask, 0, ggml_nbytes(tm));
    struct ggml_context *g = b->ctx_graph;
    struct ggml_tensor *score = ggml_lightning_indexer(g, tq, tk, tw, tm);
    struct ggml_tensor *out = score;
    if (with_topk) out = ggml_cont(g, ggml_top_k(g, score, topk));
    if (gb_finish(b, out)) { gb_free(b); return NULL; }
    return b;
}

/* CSA attention as deepseek4.cpp's build_csa_lid_attention + build_top_k_mask:
 *   K = V = concat(raw window keys [Nw][D], compressed keys [Tc][D]) (kv_type 0 F32,
 *   1 F16; with_concat=0 passes the concatenated tensor in directly), the compressed
 *   part of the mask filled -inf, the top-k rows set to 0 (ggml_set_rows), plus the
 *   causal compressed mask, joined to the window mask; then ggml_flash_attn_ext with the
 *   sinks, F32 accumulation and the sparse hint n_kv_max = min(Nw, n_swa) + topk.
 *   q [S][H][D] f32, kv [Nw + Tc][D] f32, sink [H] f32, raw_mask [S][Nw] f16,
 *   csa_mask [S][Tc] f16 (causal part), topk_idx [S][topk] int32 (positions in [0, Tc)).
 * topk = 0 builds build_hca_attention instead: no top-k mask (the compressed mask is
 * csa_mask as given, joined to the window mask), no sparse hint; topk_idx unused.
 * Output: float32 [S][H][D]. */
gb *gb_attn(int H, int D, int S, int Nw, int Tc, int topk, int kv_type, int with_concat,
            const float *q, const float *kv, const float *sink, const uint16_t *raw_mask,
            const uint16_t *csa_mask, const int32_t *topk_idx, float scale, int n_swa,
            int n_threads) {
    gb *b = gb_new(n_threads);
    if (!b) return NULL;
    enum ggml_type kt = kv_type ? GGML_TYPE_F16 : GGML_TYPE_F32;
    struct ggml_context *c = b->ctx_in;
    struct ggml_tensor *tq = ggml_new_tensor_4d(c, GGML_TYPE_F32, D, H, S, 1);
    struct ggml_tensor *traw = ggml_new_tensor_4d(c, kt, D, 1, Nw, 1);
    struct ggml_tensor *tcsa = ggml_new_tensor_4d(c, kt, D, 1, Tc, 1);
    struct ggml_tensor *tall = ggml_new_tensor_4d(c, kt, D, 1, Nw + Tc, 1);
    struct ggml_tensor *tsink = ggml_new_tensor_1d(c, GGML_TYPE_F32, H);
    struct ggml_tensor *trm = ggml_new_tensor_4d(c, GGML_TYPE_F16, Nw, S, 1, 1);
    struct ggml_tensor *tcm = ggml_new_tensor_4d(c, GGML_TYPE_F16, Tc, S, 1, 1);
    struct ggml_tensor *tidx = topk ? ggml_new_tensor_4d(c, GGML_TYPE_I32, topk, S, 1, 1) : NULL;
    b->buf_in = ggml_backend_alloc_ctx_tensors(c, b->backend);
    set_f32(tq, q);
    set_f32(tall, kv);
    if (kt == GGML_TYPE_F32) {
        ggml_backend_tensor_set(traw, kv, 0, ggml_nbytes(traw));
        ggml_backend_tensor_set(tcsa, kv + (size_t)Nw * D, 0, ggml_nbytes(tcsa));
    } else {
        size_t rb = ggml_row_size(kt, D);
        char *tmp = malloc(ggml_nbytes(tall));
        ggml_backend_tensor_get(tall, tmp, 0, ggml_nbytes(tall));
        ggml_backend_tensor_set(traw, tmp, 0, rb * Nw);
        ggml_backend_tensor_set(tcsa, tmp + rb * Nw, 0, rb * Tc);
        free(tmp);
    }
    ggml_backend_tensor_set(tsink, sink, 0, ggml_nbytes(tsink));
    ggml_backend_tensor_set(trm, raw_mask, 0, ggml_nbytes(trm));
    ggml_backend_tensor_set(tcm, csa_mask, 0, ggml_nbytes(tcm));
    if (tidx) ggml_backend_tensor_set(tidx, topk_idx, 0, ggml_nbytes(tidx));

    struct ggml_context *g = b->ctx_graph;
    struct ggml_tensor *k_all = with_concat ? ggml_concat(g, traw, tcsa, 2) : tall;
    struct ggml_tensor *mask;
    if (!topk) {    /* HCA: every compressed entry the causal mask lets through */
        mask = ggml_concat(g, trm, tcm, 0);
    } else {
        /* the top-k mask */
        struct ggml_tensor *m_all = ggml_fill(g, tcm, -INFINITY);
        m_all = ggml_view_4d(g, m_all, 1, m_all->ne[0], m_all->ne[1], m_all->ne[3],
                             m_all->nb[0], m_all->nb[1], m_all->nb[2], 0);
        struct ggml_tensor *zeros = ggml_new_tensor_4d(g, GGML_TYPE_F16, 1, topk, S, 1);
        zeros = ggml_fill(g, zeros, 0.0f);
        struct ggml_tensor *m_top = ggml_set_rows(g, m_all, zeros, tidx);
        m_top = ggml_view_4d(g, m_top, m_top->ne[1], m_top->ne[2], 1, m_top->ne[3],
                             m_top->nb[2], m_top->nb[3], m_top->nb[3], 0);
        m_top = ggml_add(g, m_top, tcm);
        mask = ggml_concat(g, trm, m_top, 0);
    }
    /* attention, as build_attn_mha does it */
    struct ggml_tensor *qp = ggml_permute(g, tq, 0, 2, 1, 3);
    struct ggml_tensor *kp = ggml_permute(g, k_all, 0, 2, 1, 3);
    struct ggml_tensor *out = ggml_flash_attn_ext(g, qp, kp, kp, mask, scale, 0.0f, 0.0f);
    ggml_flash_attn_ext_add_sinks(out, tsink);
    if (topk) ggml_flash_attn_ext_set_n_kv_max(out, (Nw < n_swa ? Nw : n_swa) + topk);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    if (gb_finish(b, out)) { gb_free(b); return NULL; }
    return b;
}

/* y = x @ W^T: W [N][K] as ggml type `wtype` (bytes already in that type's layout,
 * N rows of ggml_row_size(wtype, K)), x [M][K] f32.  The weight goes where llama.cpp
 * puts model weights: the first of the CPU backend's extra buffer types (AMX, CPU_REPACK)
 * that takes this mat-mul, else a plain CPU buffer (gb_weight_buffer names it);
 * use_extra 0: plain buffer only, 1: extra types but AMX, 2: all.
 * Output: float32 [M][N]. */
gb *gb_mul_mat(int wtype, int N, int K, int M, const void *wbytes, const float *x,
               int use_extra, int n_threads) {
    gb *b = gb_new(n_threads);
    if (!b) return NULL;
    struct ggml_context *c = b->ctx_in;
    struct ggml_tensor *tx = ggml_new_tensor_2d(c, GGML_TYPE_F32, K, M);
    b->buf_in = ggml_backend_alloc_ctx_tensors(c, b->backend);
    ggml_backend_tensor_set(tx, x, 0, ggml_nbytes(tx));

    ggml_backend_dev_t dev = ggml_backend_get_device(b->backend);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get_extra = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t cands[16];
    int nc = 0;
    if (use_extra && get_extra) {
        for (ggml_backend_buffer_type_t *p = get_extra(dev); p && *p && nc < 15; p++) {
            /* use_extra 1: not the AMX buffer (its Q8_0 kernel dies with SIGILL on the
             * test host for M >= 2, docs/peers.md); 2: every extra buffer type */
            if (use_extra == 1 && strstr(ggml_backend_buft_name(*p), "AMX")) continue;
            cands[nc++] = *p;
        }
    }
    cands[nc++] = ggml_backend_get_default_buffer_type(b->backend);
    struct ggml_tensor *tw = NULL;
    for (int i = 0; i < nc; i++) {
        struct ggml_init_params p = {4 * ggml_tensor_overhead(), NULL, true};
        struct ggml_context *cw = ggml_init(p);
        struct ggml_tensor *w = ggml_new_tensor_2d(cw, (enum ggml_type)wtype, K, N);
        ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, cands[i]);
        if (!bw) { ggml_free(cw); continue; }
        ggml_backend_buffer_set_usage(bw, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        struct ggml_init_params pt = {4 * ggml_tensor_overhead(), NULL, true};
        struct ggml_context *ct = ggml_init(pt);
        struct ggml_tensor *probe = ggml_mul_mat(ct, w, tx);
        int ok = i == nc - 1 || ggml_backend_dev_supports_op(dev, probe);
        ggml_free(ct);
        if (!ok) { ggml_backend_buffer_free(bw); ggml_free(cw); continue; }
        b->ctx_w = cw;
        b->buf_w = bw;
        tw = w;
        snprintf(b->wbuft, sizeof b->wbuft, "%s", ggml_backend_buft_name(cands[i]));
        break;
    }
    if (!tw) { gb_free(b); return NULL; }
    ggml_backend_tensor_set(tw, wbytes, 0, ggml_nbytes(tw));  /* repacks where the buffer does */
    struct ggml_tensor *out = ggml_mul_mat(b->ctx_graph, tw, tx);
    if (gb_finish(b, out)) { gb_free(b); return NULL; }
    return b;
}

/* ggml's own quantizer (for Q8_0 from float32 weights, as llama.cpp's converter does). */
size_t gb_quantize(int type, const float *src, void *dst, int64_t nrows, int64_t n_per_row) {
    return ggml_quantize_chunk((enum ggml_type)type, src, dst, 0, nrows, n_per_row, NULL);
}

size_t gb_row_size(int type, int64_t n) { return ggml_row_size((enum ggml_type)type, n); }

/* Dequantize rows of a ggml type back to float32 (to check a conversion). */
int gb_dequantize(int type, const void *src, float *dst, int64_t n) {
    const struct ggml_type_traits *tr = ggml_get_type_traits((enum ggml_type)type);
    if (!tr->to_float) return -1;
    tr->to_float(src, dst, n);
    return 0;
}

int gb_type_id(const char *name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char *n = ggml_type_name((enum ggml_type)t);
        if (n && strcmp(n, name) == 0) return t;
    }
    return -1;
}
