/* index_scores, index_topk, topk_indices, select_candidate_blocks, window_topk_idxs,
 * compress_topk_idxs. */
#include "glue.h"

#include <string.h>

#include "../index.h"

#define I32_MAX 2147483647LL

/* q/k/weights of a scoring call, validated; the arrays are new references. */
struct qkw {
    PyArrayObject *q, *k, *w;
};

static void qkw_clear(struct qkw *a)
{
    Py_XDECREF(a->q);
    Py_XDECREF(a->k);
    Py_XDECREF(a->w);
    memset(a, 0, sizeof *a);
}

/* Replaces *a by its unit-inner-stride view (csa_unit_inner), releasing the old
 * reference; -1 on error (with *a cleared). */
static int to_unit_inner(PyArrayObject **a)
{
    PyArrayObject *c = csa_unit_inner(*a);
    Py_DECREF(*a);
    *a = c;
    return c ? 0 : -1;
}

static int parse_qkw(const char *fn, PyObject *qo, PyObject *ko, PyObject *wo, long long ratio,
                     long long start_pos, struct qkw *a, struct csa_index_problem *p)
{
    char b1[256], b2[256];
    memset(a, 0, sizeof *a);
    /* FP4 rows (docs/kernels.md, section 4): a uint8 k (and optionally a uint8 q) of
     * Di / 2 + Di / 32 bytes a row. */
    PyArrayObject *k8 = csa_u8_view(ko), *q8 = csa_u8_view(qo);
    npy_intp Di;
    int qbf, k_fp4 = 0, q_fp4 = 0;
    if (q8 && !k8) {
        Py_DECREF(q8);
        PyErr_Format(PyExc_TypeError,
                     "%s(): a uint8 (FP4 rows) 'q' needs a uint8 (FP4 rows) 'k', got k of another "
                     "dtype", fn);
        goto fail;
    }
    if (k8) {
        a->k = k8;
        a->q = q8;
        if (PyArray_NDIM(a->k) != 3) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'k' (uint8 FP4 rows) must have 3 dimensions [B, Tc, Di/2 + Di/32], "
                         "got shape %s", fn, csa_shape_str(a->k, b1, sizeof b1));
            goto fail;
        }
        if (!a->q && !(a->q = csa_array(qo, fn, "q", CSA_F32 | CSA_BF16, 4, 4, 0))) goto fail;
        if (q8 && PyArray_NDIM(a->q) != 4) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'q' (uint8 FP4 rows) must have 4 dimensions [B, S, Hi, Di/2 + "
                         "Di/32], got shape %s", fn, csa_shape_str(a->q, b1, sizeof b1));
            goto fail;
        }
        const npy_intp qd = PyArray_DIM(a->q, 3);
        Di = q8 ? (qd % 17 == 0 ? qd / 17 * 32 : -1) : qd;
        /* a uint8 k is FP4 rows only at that width: anything else is a wrong dtype */
        if (Di < 0 || Di % 32 || PyArray_DIM(a->k, 2) != Di / 2 + Di / 32) {
            PyErr_Format(PyExc_TypeError,
                         "%s(): 'k' must be float32 or bfloat16 [B, Tc, Di], or uint8 FP4 rows "
                         "[B, Tc, Di/2 + Di/32] with Di a multiple of 32; got uint8 of shape %s "
                         "with q of shape %s", fn, csa_shape_str(a->k, b2, sizeof b2),
                         csa_shape_str(a->q, b1, sizeof b1));
            goto fail;
        }
        if (csa_check_dim(a->k, fn, "k", 0, PyArray_DIM(a->q, 0), "batch, q.shape[0]")) goto fail;
        if (!(a->w = csa_array(wo, fn, "weights", CSA_F32 | CSA_BF16, 3, 3, 0))) goto fail;
        qbf = !q8 && csa_is_bf16(a->q);
        k_fp4 = 1;
        q_fp4 = q8 != NULL;
    } else {
        if (!(a->q = csa_array(qo, fn, "q", CSA_F32 | CSA_BF16, 4, 4, 0))) goto fail;
        if (!(a->k = csa_array(ko, fn, "k", CSA_F32 | CSA_BF16, 3, 3, 0))) goto fail;
        if (!(a->w = csa_array(wo, fn, "weights", CSA_F32 | CSA_BF16, 3, 3, 0))) goto fail;
        /* q . k runs in one dtype, as the reference's einsum insists: no silent promotion
         * (a float32 copy of a bf16 cache is what this path exists to avoid). */
        qbf = csa_is_bf16(a->q);
        if (csa_is_bf16(a->k) != qbf) {
            PyErr_Format(PyExc_TypeError,
                         "%s(): 'k' must have the dtype of 'q' (%s), got %s; convert one of them",
                         fn, qbf ? "bfloat16" : "float32", qbf ? "float32" : "bfloat16");
            goto fail;
        }
        Di = PyArray_DIM(a->q, 3);
        if (csa_check_dim(a->k, fn, "k", 0, PyArray_DIM(a->q, 0), "batch, q.shape[0]")) goto fail;
        if (csa_check_dim(a->k, fn, "k", 2, Di, "index head dim Di, q.shape[3]")) goto fail;
    }
    {
        const npy_intp B = PyArray_DIM(a->q, 0), S = PyArray_DIM(a->q, 1),
                       Hi = PyArray_DIM(a->q, 2), Tc = PyArray_DIM(a->k, 1);
        if (PyArray_DIM(a->w, 0) != B || PyArray_DIM(a->w, 1) != S || PyArray_DIM(a->w, 2) != Hi) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'weights' must have shape [B, S, Hi] = [%lld, %lld, %lld] "
                         "(from q of shape %s), got %s",
                         fn, (long long)B, (long long)S, (long long)Hi,
                         csa_shape_str(a->q, b1, sizeof b1), csa_shape_str(a->w, b2, sizeof b2));
            goto fail;
        }
        const long long need = (start_pos + (long long)S) / ratio;
        if ((long long)Tc < need) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'k' must hold at least (start_pos + S) // ratio = (%lld + %lld) // "
                         "%lld = %lld compressed entries, got shape %s",
                         fn, start_pos, (long long)S, ratio, need, csa_shape_str(a->k, b1, sizeof b1));
            goto fail;
        }
        if (to_unit_inner(&a->q) || to_unit_inner(&a->k)) goto fail;
        *p = (struct csa_index_problem){
            .q = PyArray_DATA(a->q), .k = PyArray_DATA(a->k), .w = PyArray_DATA(a->w),
            .qk_bf16 = qbf, .w_bf16 = csa_is_bf16(a->w),
            .B = B, .S = S, .Hi = Hi, .Di = Di, .Tc = Tc,
            .sqb = csa_stride(a->q, 0), .sqs = csa_stride(a->q, 1), .sqh = csa_stride(a->q, 2),
            .skb = csa_stride(a->k, 0), .skt = csa_stride(a->k, 1),
            .swb = csa_stride(a->w, 0), .sws = csa_stride(a->w, 1), .swh = csa_stride(a->w, 2),
            .ratio = ratio, .start_pos = start_pos, .k_fp4 = k_fp4, .q_fp4 = q_fp4,
        };
    }
    /* FP4 keys take AMX-INT8 tiles at level amx; say once when the kernel refused them */
    static int amx_warned = 0;
    if (k_fp4 && !amx_warned && csa_amx_refused()) {
        amx_warned = 1;
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                             "%s(): this CPU has AMX, but the kernel refused this process the tile "
                             "state (arch_prctl ARCH_REQ_XCOMP_PERM failed), so the levels stop at "
                             "'avx512' and FP4 keys are scored by AVX512_VNNI instead of AMX-INT8 "
                             "tiles: the same results, slower", fn) < 0)
            goto fail;
    }
    return 0;
fail:
    qkw_clear(a);
    return -1;
}

static int parse_order(const char *fn, PyObject *o, int *order)
{
    const char *s = (o && PyUnicode_Check(o)) ? PyUnicode_AsUTF8(o) : NULL;
    if (s && strcmp(s, "score") == 0) {
        *order = CSA_ORDER_SCORE;
        return 0;
    }
    if (s && strcmp(s, "position") == 0) {
        *order = CSA_ORDER_POSITION;
        return 0;
    }
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s(): 'order' must be \"score\" (V4) or \"position\" (V4.1), "
                 "got %R", fn, o);
    return -1;
}

/* index_scores' rounding: "float32" (0) or "bf16" (1: csa_index_problem.bf16_steps). */
static int parse_rounding(const char *fn, PyObject *o, int *bf16_steps)
{
    const char *s = (o && PyUnicode_Check(o)) ? PyUnicode_AsUTF8(o) : NULL;
    if (s && (strcmp(s, "float32") == 0 || strcmp(s, "bf16") == 0)) {
        *bf16_steps = s[0] == 'b';
        return 0;
    }
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s(): 'rounding' must be \"float32\" or \"bf16\", got %R",
                 fn, o);
    return -1;
}

/* ratio >= 1, start_pos >= 0, the topk, offset and order arguments. */
static int parse_common(const char *fn, PyObject *ratio_o, PyObject *sp_o, long long *ratio,
                        long long *start_pos)
{
    if (!ratio_o) {
        PyErr_Format(PyExc_TypeError, "%s(): missing required keyword argument 'ratio'", fn);
        return -1;
    }
    if (csa_int_arg(ratio_o, fn, "ratio", 1, I32_MAX, ratio)) return -1;
    if (sp_o && csa_int_arg(sp_o, fn, "start_pos", 0, (long long)1 << 40, start_pos)) return -1;
    return 0;
}

/* candidates: bool [B, S, n_blocks], block_size given or Tc / n_blocks. */
static int parse_cand(const char *fn, PyObject *co, PyObject *bso, npy_intp B, npy_intp S,
                      npy_intp Tc, PyArrayObject **arr, struct csa_index_cand *c)
{
    char b1[256];
    memset(c, 0, sizeof *c);
    *arr = NULL;
    if (!co || co == Py_None) {
        if (bso && bso != Py_None) {
            PyErr_Format(PyExc_ValueError, "%s(): 'block_size' is only used with 'candidates'",
                         fn);
            return -1;
        }
        return 0;
    }
    PyArrayObject *a = csa_array(co, fn, "candidates", CSA_BOOL, 3, 3, 0);
    if (!a) return -1;
    if (csa_check_dim(a, fn, "candidates", 0, B, "batch") ||
        csa_check_dim(a, fn, "candidates", 1, S, "query positions S"))
        goto fail;
    const npy_intp nb = PyArray_DIM(a, 2);
    long long bs;
    if (bso && bso != Py_None) {
        if (csa_int_arg(bso, fn, "block_size", 1, I32_MAX, &bs)) goto fail;
    } else if (nb > 0 && Tc % nb == 0) {
        bs = Tc / nb;
    } else if (nb == 0 && Tc == 0) {
        bs = 1;
    } else {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'candidates' has %lld blocks, which do not divide Tc = %lld evenly; "
                     "pass block_size", fn, (long long)nb, (long long)Tc);
        goto fail;
    }
    if (nb != (Tc + bs - 1) / bs) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'candidates' must have shape[2] == ceil(Tc / block_size) = "
                     "ceil(%lld / %lld) = %lld blocks, got shape %s",
                     fn, (long long)Tc, bs, (long long)((Tc + bs - 1) / bs),
                     csa_shape_str(a, b1, sizeof b1));
        goto fail;
    }
    *c = (struct csa_index_cand){.mask = PyArray_DATA(a), .n_blocks = nb, .block_size = bs,
                                 .scb = csa_stride(a, 0), .scs = csa_stride(a, 1),
                                 .scn = csa_stride(a, 2)};
    *arr = a;
    return 0;
fail:
    Py_DECREF(a);
    return -1;
}

/* The result of `shape` (an npy_type array) and the C-contiguous buffer the kernel
 * writes (*work: out itself, or a temporary csa_finish copies in). */
static PyArrayObject *out_and_work(PyObject *oo, const char *fn, const npy_intp *shape,
                                   int npy_type, PyArrayObject **ins, int n_in,
                                   PyArrayObject **work)
{
    PyArrayObject *o = csa_out_array(oo, fn, 3, shape, NULL, npy_type, ins, n_in, 0, NULL);
    *work = o ? csa_work_array(o, CSA_WORK_C_CONTIG) : NULL;
    if (o && !*work) Py_CLEAR(o);
    return o;
}

/* ------------------------------------------------------------------ index_scores */

PyDoc_STRVAR(index_scores_doc,
"index_scores(q, k, weights, *, ratio, start_pos=0, rounding=\"float32\", out=None)\n--\n\n"
"Indexer scores (docs/kernels.md, section 4), float32 [B, S, Tc]:\n"
"``score[b,s,t] = sum_h relu(q[b,s,h,:] . k[b,t,:]) * weights[b,s,h]`` for the\n"
"entries the query at absolute position P = start_pos + s can see,\n"
"t < (P + 1) // ratio; -inf for the others.  For tensor-parallel users who sum\n"
"the partial scores of their heads across ranks before topk_indices().\n\n"
"q       : float32 or bfloat16 [B, S, Hi, Di] (any strides).\n"
"k       : [B, Tc, Di] in q's dtype, Tc >= (start_pos + S) // ratio (a longer cache is\n"
"          fine).\n"
"weights : float32 or bfloat16 [B, S, Hi].\n"
"ratio   : compress ratio (>= 1); start_pos: absolute position of q[:, 0].\n"
"rounding: \"float32\" (every step in float32, heads added in order) or \"bf16\": the\n"
"          roundings of the released indexer's bfloat16 torch expression (einsum,\n"
"          relu, times weights, sum over heads): each head's dot and its weighted term\n"
"          rounded to bfloat16, the terms summed in float32 in torch's order for that\n"
"          sum (16 heads at a time, then the partial sums), the total rounded to\n"
"          bfloat16, so torch.topk of the scores (as bfloat16) picks what the released\n"
"          code picks.  Needs FP4 keys (a uint8 k), where each dot is exact; no gradient.\n"
"out     : float32 [B, S, Tc] or None.\n"
"bfloat16 (ml_dtypes.bfloat16 arrays, torch.bfloat16 tensors) is read in place, never\n"
"copied to float32: computed in float32 (products of bfloat16 are exact), scores\n"
"float32 as the released scorer returns them.  At ISA level 'amx' the bfloat16 q . k\n"
"run on AMX-BF16 tiles (another float32 summation order; bfloat16 subnormals count as\n"
"zero); at the other levels bfloat16 inputs give exactly the float32 result.\n"
"Scores are bitwise identical at any thread count and to the ones index_topk() ranks;\n"
"relu keeps NaN.  Returns out (a new array when out is None).");

static PyObject *py_index_scores(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "index_scores";
    static char *kwlist[] = {"q", "k", "weights", "ratio", "start_pos", "rounding", "out", NULL};
    PyObject *qo, *ko, *wo, *ro = NULL, *spo = NULL, *rdo = NULL, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$OOOO:index_scores", kwlist, &qo, &ko, &wo,
                                     &ro, &spo, &rdo, &oo))
        return NULL;
    long long ratio, start_pos = 0;
    int bf16_steps = 0;
    if (parse_common(fn, ro, spo, &ratio, &start_pos)) return NULL;
    if (rdo && parse_rounding(fn, rdo, &bf16_steps)) return NULL;
    if (bf16_steps) {
        PyArrayObject *k8 = csa_u8_view(ko);
        if (!k8) {
            PyObject *dt = PyObject_GetAttrString(ko, "dtype");
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s(): rounding=\"bf16\" needs FP4 keys (a uint8 'k' "
                         "of Di/2 + Di/32 bytes a row, fp4_pack()), got k of dtype %S", fn,
                         dt ? dt : (PyObject *)Py_TYPE(ko));
            Py_XDECREF(dt);
            return NULL;
        }
        Py_DECREF(k8);
    }
    struct qkw a;
    struct csa_index_problem p;
    if (parse_qkw(fn, qo, ko, wo, ratio, start_pos, &a, &p)) return NULL;
    if (bf16_steps && p.Hi > 65536) {
        PyErr_Format(PyExc_ValueError, "%s(): rounding=\"bf16\" takes at most 65536 heads, q has "
                     "%lld", fn, (long long)p.Hi);
        qkw_clear(&a);
        return NULL;
    }
    p.bf16_steps = bf16_steps;
    npy_intp shape[3] = {p.B, p.S, p.Tc};
    PyArrayObject *ins[3] = {a.q, a.k, a.w}, *work, *out;
    PyObject *ret = NULL;
    if (!(out = out_and_work(oo, fn, shape, NPY_FLOAT32, ins, 3, &work))) goto done;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_index_scores(&p, (float *)PyArray_DATA(work), p.S * p.Tc, p.Tc);
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, out, work);
    Py_DECREF(out);
    Py_DECREF(work);
done:
    qkw_clear(&a);
    return ret;
}

/* ------------------------------------------------------------------ top-k */

static int parse_topk_args(const char *fn, PyObject *tko, PyObject *offo, PyObject *ordo,
                           long long Tc, long long *topk, long long *offset, int *order)
{
    if (csa_int_arg(tko, fn, "topk", 1, I32_MAX, topk)) return -1;
    if (offo && csa_int_arg(offo, fn, "offset", 0, I32_MAX - (Tc > 0 ? Tc - 1 : 0), offset))
        return -1;
    if (ordo && parse_order(fn, ordo, order)) return -1;
    return 0;
}

PyDoc_STRVAR(index_topk_doc,
"index_topk(q, k, weights, topk, *, ratio, start_pos=0, offset=0, order=\"score\",\n"
"           candidates=None, block_size=None, out=None)\n--\n\n"
"Fused indexer scoring and top-k selection (docs/kernels.md, section 4).  Returns int32\n"
"[B, S, K], K = min(topk, (start_pos + S) // ratio).  Never materializes the\n"
"[S, Tc] scores: each thread scores a block of up to 8 query rows into [Tc]\n"
"scratch rows and selects from them right away (calls with fewer than 4 rows per\n"
"thread, i.e. decode, split the keys across threads and keep their few [Tc] rows).\n"
"A query row only scores the entries it can see.\n\n"
"q, k, weights, ratio, start_pos: as index_scores() (float32 or bfloat16).\n"
"Ranking: higher score first, NaN above +inf (as torch.topk), -0.0 == +0.0, and equal\n"
"  scores by LOWER position first, so the selected set is unique; identical at any\n"
"  thread count and to topk_indices(index_scores(...)).\n"
"Row s takes the min(K, n) best of the n entries it can see (t < (start_pos+s+1) // ratio,\n"
"  and inside kept blocks when candidates are given), writes each as t + offset and\n"
"  pads the row with -1 at the end.\n"
"order      : \"score\" (V4: by rank, best first) or \"position\" (V4.1: ascending t).\n"
"offset     : added to the selected positions (prefill: S window rows; decode: the window).\n"
"candidates : bool [B, S, n_blocks] or None (V4.1): entry t is eligible only when\n"
"             candidates[b, s, t // block_size]; n_blocks = ceil(Tc / block_size).\n"
"block_size : defaults to Tc // n_blocks when that divides Tc evenly.\n"
"out        : int32 [B, S, K] or None.");

static PyObject *py_index_topk(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "index_topk";
    static char *kwlist[] = {"q", "k", "weights", "topk", "ratio", "start_pos", "offset",
                             "order", "candidates", "block_size", "out", NULL};
    PyObject *qo, *ko, *wo, *tko, *ro = NULL, *spo = NULL, *offo = NULL, *ordo = NULL,
                                  *co = Py_None, *bso = Py_None, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OOOOOOO:index_topk", kwlist, &qo, &ko, &wo,
                                     &tko, &ro, &spo, &offo, &ordo, &co, &bso, &oo))
        return NULL;
    long long ratio, start_pos = 0, topk, offset = 0;
    int order = CSA_ORDER_SCORE;
    if (parse_common(fn, ro, spo, &ratio, &start_pos)) return NULL;
    struct qkw a;
    struct csa_index_problem p;
    if (parse_qkw(fn, qo, ko, wo, ratio, start_pos, &a, &p)) return NULL;
    PyArrayObject *ca = NULL, *work = NULL, *out = NULL;
    PyObject *ret = NULL;
    struct csa_index_cand c;
    if (parse_topk_args(fn, tko, offo, ordo, p.Tc, &topk, &offset, &order)) goto done;
    if (parse_cand(fn, co, bso, p.B, p.S, p.Tc, &ca, &c)) goto done;
    const long long width = (start_pos + p.S) / ratio;
    const csa_idx K = topk < width ? topk : width;
    npy_intp shape[3] = {p.B, p.S, K};
    PyArrayObject *ins[4] = {a.q, a.k, a.w, ca};
    if (!(out = out_and_work(oo, fn, shape, NPY_INT32, ins, 4, &work))) goto done;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_index_topk(&p, &c, K, offset, order, (int32_t *)PyArray_DATA(work));
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, out, work);
done:
    Py_XDECREF(out);
    Py_XDECREF(work);
    Py_XDECREF(ca);
    qkw_clear(&a);
    return ret;
}

/* scores [B, S, Tc] float32 with Tc >= (start_pos + S) // ratio. */
static PyArrayObject *parse_scores(const char *fn, PyObject *so, long long ratio,
                                   long long start_pos)
{
    char b1[256];
    PyArrayObject *s = csa_array(so, fn, "scores", CSA_F32, 3, 3, 0);
    if (!s) return NULL;
    const long long need = (start_pos + (long long)PyArray_DIM(s, 1)) / ratio;
    if ((long long)PyArray_DIM(s, 2) < need) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'scores' must have at least (start_pos + S) // ratio = %lld entries "
                     "on its last axis, got shape %s",
                     fn, need, csa_shape_str(s, b1, sizeof b1));
        Py_DECREF(s);
        return NULL;
    }
    return s;
}

PyDoc_STRVAR(topk_indices_doc,
"topk_indices(scores, topk, *, ratio, start_pos=0, offset=0, order=\"score\",\n"
"             candidates=None, block_size=None, out=None)\n--\n\n"
"Top-k selection over precomputed scores float32 [B, S, Tc] (e.g. summed over\n"
"tensor-parallel ranks).  Only the entries row s can see, t < (start_pos+s+1) // ratio,\n"
"are read.  Same ranking, -1 padding, offset, order and candidates as index_topk(),\n"
"and the same result on the scores of index_scores().  Returns int32 [B, S, K],\n"
"K = min(topk, (start_pos + S) // ratio).");

static PyObject *py_topk_indices(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "topk_indices";
    static char *kwlist[] = {"scores", "topk", "ratio", "start_pos", "offset", "order",
                             "candidates", "block_size", "out", NULL};
    PyObject *so, *tko, *ro = NULL, *spo = NULL, *offo = NULL, *ordo = NULL, *co = Py_None,
                        *bso = Py_None, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OOOOOOO:topk_indices", kwlist, &so, &tko,
                                     &ro, &spo, &offo, &ordo, &co, &bso, &oo))
        return NULL;
    long long ratio, start_pos = 0, topk, offset = 0;
    int order = CSA_ORDER_SCORE;
    if (parse_common(fn, ro, spo, &ratio, &start_pos)) return NULL;
    PyArrayObject *s = parse_scores(fn, so, ratio, start_pos), *ca = NULL, *work = NULL,
                  *out = NULL;
    if (!s) return NULL;
    PyObject *ret = NULL;
    struct csa_index_cand c;
    const npy_intp B = PyArray_DIM(s, 0), S = PyArray_DIM(s, 1), Tc = PyArray_DIM(s, 2);
    if (parse_topk_args(fn, tko, offo, ordo, Tc, &topk, &offset, &order)) goto done;
    if (parse_cand(fn, co, bso, B, S, Tc, &ca, &c)) goto done;
    const long long width = (start_pos + S) / ratio;
    const csa_idx K = topk < width ? topk : width;
    npy_intp shape[3] = {B, S, K};
    PyArrayObject *ins[2] = {s, ca};
    if (!(out = out_and_work(oo, fn, shape, NPY_INT32, ins, 2, &work))) goto done;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_topk_indices((const float *)PyArray_DATA(s), B, S, Tc, csa_stride(s, 0),
                          csa_stride(s, 1), csa_stride(s, 2), ratio, start_pos, &c, K, offset,
                          order, (int32_t *)PyArray_DATA(work));
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, out, work);
done:
    Py_XDECREF(out);
    Py_XDECREF(work);
    Py_XDECREF(ca);
    Py_DECREF(s);
    return ret;
}

PyDoc_STRVAR(select_candidate_blocks_doc,
"select_candidate_blocks(scores, topk_blocks, block_size, *, ratio, start_pos=0, out=None)\n--\n\n"
"V4.1 level one of the two-level top-k.  scores: float32 [B, S, Tc]; block j covers\n"
"entries [j*block_size, (j+1)*block_size) and scores the max of its VISIBLE entries\n"
"(t < (start_pos+s+1) // ratio; NaN ranks highest).  Per row the block holding the\n"
"newest visible entry is always kept and counts among topk_blocks; the others are\n"
"the best reachable blocks, ties by lower block index; a row that sees nothing keeps\n"
"none.  Returns bool [B, S, ceil(Tc / block_size)] (True = kept), the 'candidates'\n"
"of index_topk() / topk_indices().");

static PyObject *py_select_candidate_blocks(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "select_candidate_blocks";
    static char *kwlist[] = {"scores", "topk_blocks", "block_size", "ratio", "start_pos", "out",
                             NULL};
    PyObject *so, *tbo, *bso, *ro = NULL, *spo = NULL, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$OOO:select_candidate_blocks", kwlist, &so,
                                     &tbo, &bso, &ro, &spo, &oo))
        return NULL;
    long long ratio, start_pos = 0, tb, bs;
    if (parse_common(fn, ro, spo, &ratio, &start_pos)) return NULL;
    if (csa_int_arg(tbo, fn, "topk_blocks", 1, I32_MAX, &tb)) return NULL;
    if (csa_int_arg(bso, fn, "block_size", 1, I32_MAX, &bs)) return NULL;
    PyArrayObject *s = parse_scores(fn, so, ratio, start_pos), *work = NULL, *out = NULL;
    if (!s) return NULL;
    PyObject *ret = NULL;
    const npy_intp B = PyArray_DIM(s, 0), S = PyArray_DIM(s, 1), Tc = PyArray_DIM(s, 2);
    npy_intp shape[3] = {B, S, (Tc + bs - 1) / bs};
    PyArrayObject *ins[1] = {s};
    if (!(out = out_and_work(oo, fn, shape, NPY_BOOL, ins, 1, &work))) goto done;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_select_candidate_blocks((const float *)PyArray_DATA(s), B, S, Tc, csa_stride(s, 0),
                                     csa_stride(s, 1), csa_stride(s, 2), ratio, start_pos, tb,
                                     bs, (uint8_t *)PyArray_DATA(work));
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, out, work);
done:
    Py_XDECREF(out);
    Py_XDECREF(work);
    Py_DECREF(s);
    return ret;
}

/* ------------------------------------------------------------------ index lists */

static int parse_batch_seq(const char *fn, PyObject *bo, PyObject *so, PyObject *spo,
                           long long *B, long long *S, long long *sp)
{
    if (csa_int_arg(bo, fn, "batch", 0, I32_MAX, B)) return -1;
    if (csa_int_arg(so, fn, "seqlen", 0, I32_MAX, S)) return -1;
    if (csa_int_arg(spo, fn, "start_pos", 0, (long long)1 << 40, sp)) return -1;
    if (*sp > 0 && *S != 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'seqlen' must be 1 when start_pos > 0 (decode), got seqlen=%lld at "
                     "start_pos=%lld",
                     fn, *S, *sp);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(window_topk_idxs_doc,
"window_topk_idxs(window, batch, seqlen, start_pos, *, out=None)\n--\n\n"
"Sliding-window indices (docs/kernels.md, section 6), int32.\n"
"Prefill (start_pos == 0): [batch, seqlen, min(seqlen, window)], row s lists\n"
"  max(0, s-window+1) .. s in ascending order, then -1.\n"
"Decode (start_pos > 0, seqlen == 1): [batch, 1, window] ring slots: while the ring\n"
"  fills (start_pos < window-1) slots 0 .. start_pos then -1, afterwards\n"
"  (start_pos+1+j) % window for j = 0 .. window-1 (oldest first).");

static PyObject *py_window_topk_idxs(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "window_topk_idxs";
    static char *kwlist[] = {"window", "batch", "seqlen", "start_pos", "out", NULL};
    PyObject *wo, *bo, *so, *spo, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$O:window_topk_idxs", kwlist, &wo, &bo, &so,
                                     &spo, &oo))
        return NULL;
    long long window, B, S, sp;
    if (csa_int_arg(wo, fn, "window", 1, I32_MAX, &window)) return NULL;
    if (parse_batch_seq(fn, bo, so, spo, &B, &S, &sp)) return NULL;
    npy_intp shape[3] = {B, S, sp == 0 ? (S < window ? S : window) : window};
    PyArrayObject *work, *out = out_and_work(oo, fn, shape, NPY_INT32, NULL, 0, &work);
    if (!out) return NULL;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_window_topk_idxs((int32_t *)PyArray_DATA(work), window, B, S, sp);
    Py_END_ALLOW_THREADS
    PyObject *ret = csa_finish(st, fn, oo, out, work);
    Py_DECREF(out);
    Py_DECREF(work);
    return ret;
}

PyDoc_STRVAR(compress_topk_idxs_doc,
"compress_topk_idxs(ratio, batch, seqlen, start_pos, offset, *, out=None)\n--\n\n"
"HCA indices (docs/kernels.md, section 4): every visible compressed entry, int32\n"
"[batch, seqlen, (start_pos + seqlen) // ratio].  Prefill: row s lists t + offset\n"
"for t < (s+1) // ratio, then -1.  Decode (start_pos > 0, seqlen == 1):\n"
"0 .. (start_pos+1)//ratio - 1, plus offset.");

static PyObject *py_compress_topk_idxs(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "compress_topk_idxs";
    static char *kwlist[] = {"ratio", "batch", "seqlen", "start_pos", "offset", "out", NULL};
    PyObject *ro, *bo, *so, *spo, *offo, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$O:compress_topk_idxs", kwlist, &ro, &bo,
                                     &so, &spo, &offo, &oo))
        return NULL;
    long long ratio, B, S, sp, offset;
    if (csa_int_arg(ro, fn, "ratio", 1, I32_MAX, &ratio)) return NULL;
    if (parse_batch_seq(fn, bo, so, spo, &B, &S, &sp)) return NULL;
    const long long W = (sp + S) / ratio;
    if (csa_int_arg(offo, fn, "offset", 0, I32_MAX - (W > 0 ? W - 1 : 0), &offset)) return NULL;
    npy_intp shape[3] = {B, S, W};
    PyArrayObject *work, *out = out_and_work(oo, fn, shape, NPY_INT32, NULL, 0, &work);
    if (!out) return NULL;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_compress_topk_idxs((int32_t *)PyArray_DATA(work), ratio, B, S, sp, offset);
    Py_END_ALLOW_THREADS
    PyObject *ret = csa_finish(st, fn, oo, out, work);
    Py_DECREF(out);
    Py_DECREF(work);
    return ret;
}

#define KW(f) (PyCFunction)(void (*)(void))(f), METH_VARARGS | METH_KEYWORDS
PyMethodDef csa_index_methods[] = {
    {"index_scores", KW(py_index_scores), index_scores_doc},
    {"index_topk", KW(py_index_topk), index_topk_doc},
    {"topk_indices", KW(py_topk_indices), topk_indices_doc},
    {"select_candidate_blocks", KW(py_select_candidate_blocks), select_candidate_blocks_doc},
    {"window_topk_idxs", KW(py_window_topk_idxs), window_topk_idxs_doc},
    {"compress_topk_idxs", KW(py_compress_topk_idxs), compress_topk_idxs_doc},
    {NULL, NULL, 0, NULL},
};
