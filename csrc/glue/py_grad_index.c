/* Glue of the backward kernels of index_scores_backward, indexer_kl_loss. */
#include "glue.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../index.h"

#define I32_MAX 2147483647LL

/* Validated float32 q [B,S,Hi,Di], k [B,Tc,Di], weights [B,S,Hi] (new references, q and
 * k with unit inner stride) and the problem over them. */
struct gqkw {
    PyArrayObject *q, *k, *w;
};

static void gqkw_clear(struct gqkw *a)
{
    Py_XDECREF(a->q);
    Py_XDECREF(a->k);
    Py_XDECREF(a->w);
    memset(a, 0, sizeof *a);
}

static int unit_inner(PyArrayObject **a)
{
    PyArrayObject *c = csa_unit_inner(*a);
    Py_DECREF(*a);
    *a = c;
    return c ? 0 : -1;
}

static int parse_ratio(const char *fn, PyObject *ro, PyObject *spo, long long *ratio,
                       long long *start_pos)
{
    if (!ro) {
        PyErr_Format(PyExc_TypeError, "%s(): missing required keyword argument 'ratio'", fn);
        return -1;
    }
    if (csa_int_arg(ro, fn, "ratio", 1, I32_MAX, ratio)) return -1;
    if (spo && csa_int_arg(spo, fn, "start_pos", 0, (long long)1 << 40, start_pos)) return -1;
    return 0;
}

/* check_tc: k must hold every entry a query at start_pos + s can see (not with
 * per-query positions, whose visibility is clamped to Tc). */
static int parse_gqkw(const char *fn, PyObject *qo, PyObject *ko, PyObject *wo, long long ratio,
                      long long start_pos, int check_tc, struct gqkw *a,
                      struct csa_index_problem *p)
{
    char b1[256], b2[256];
    memset(a, 0, sizeof *a);
    /* float32 only: the gradients are float32 (a bfloat16 caller widens first) */
    if (!(a->q = csa_array(qo, fn, "q", CSA_F32, 4, 4, 0))) goto fail;
    if (!(a->k = csa_array(ko, fn, "k", CSA_F32, 3, 3, 0))) goto fail;
    if (!(a->w = csa_array(wo, fn, "weights", CSA_F32, 3, 3, 0))) goto fail;
    const npy_intp B = PyArray_DIM(a->q, 0), S = PyArray_DIM(a->q, 1), Hi = PyArray_DIM(a->q, 2),
                   Di = PyArray_DIM(a->q, 3), Tc = PyArray_DIM(a->k, 1);
    if (csa_check_dim(a->k, fn, "k", 0, B, "batch, q.shape[0]")) goto fail;
    if (csa_check_dim(a->k, fn, "k", 2, Di, "index head dim Di, q.shape[3]")) goto fail;
    if (PyArray_DIM(a->w, 0) != B || PyArray_DIM(a->w, 1) != S || PyArray_DIM(a->w, 2) != Hi) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'weights' must have shape [B, S, Hi] = [%lld, %lld, %lld] (from q of "
                     "shape %s), got %s", fn, (long long)B, (long long)S, (long long)Hi,
                     csa_shape_str(a->q, b1, sizeof b1), csa_shape_str(a->w, b2, sizeof b2));
        goto fail;
    }
    const long long need = (start_pos + (long long)S) / ratio;
    if (check_tc && (long long)Tc < need) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'k' must hold at least (start_pos + S) // ratio = (%lld + %lld) // %lld "
                     "= %lld compressed entries, got shape %s",
                     fn, start_pos, (long long)S, ratio, need, csa_shape_str(a->k, b1, sizeof b1));
        goto fail;
    }
    if (unit_inner(&a->q) || unit_inner(&a->k)) goto fail;
    *p = (struct csa_index_problem){
        .q = PyArray_DATA(a->q), .k = PyArray_DATA(a->k), .w = PyArray_DATA(a->w),
        .B = B, .S = S, .Hi = Hi, .Di = Di, .Tc = Tc,
        .sqb = csa_stride(a->q, 0), .sqs = csa_stride(a->q, 1), .sqh = csa_stride(a->q, 2),
        .skb = csa_stride(a->k, 0), .skt = csa_stride(a->k, 1),
        .swb = csa_stride(a->w, 0), .sws = csa_stride(a->w, 1), .swh = csa_stride(a->w, 2),
        .ratio = ratio, .start_pos = start_pos,
    };
    return 0;
fail:
    gqkw_clear(a);
    return -1;
}

/* The three gradient results (grad_q, grad_k, grad_weights) and the C-contiguous
 * buffers the kernel writes; new references, NULL entries on error. */
struct gouts {
    PyArrayObject *o[3], *w[3];
};

static void gouts_clear(struct gouts *g)
{
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(g->o[i]);
        Py_XDECREF(g->w[i]);
    }
    memset(g, 0, sizeof *g);
}

static int make_gouts(const char *fn, PyObject **args, const struct csa_index_problem *p,
                      PyArrayObject **ins, int n_in, struct gouts *g)
{
    static const char *names[3] = {"grad_q", "grad_k", "grad_weights"};
    const npy_intp sq[4] = {p->B, p->S, p->Hi, p->Di}, sk[3] = {p->B, p->Tc, p->Di},
                   sw[3] = {p->B, p->S, p->Hi};
    const npy_intp *shapes[3] = {sq, sk, sw};
    const int nd[3] = {4, 3, 3};
    PyArrayObject *all[10];
    memset(g, 0, sizeof *g);
    for (int i = 0; i < n_in; i++) all[i] = ins[i];
    for (int i = 0; i < 3; i++) {
        /* the results may not overlap the inputs nor each other */
        g->o[i] = csa_out_array_named(args[i], fn, names[i], nd[i], shapes[i], NULL, NPY_FLOAT32,
                                      all, n_in + i, 0, NULL);
        if (!g->o[i]) goto fail;
        all[n_in + i] = g->o[i];
        if (!(g->w[i] = csa_work_array(g->o[i], CSA_WORK_C_CONTIG))) goto fail;
    }
    return 0;
fail:
    gouts_clear(g);
    return -1;
}

/* Copies the work buffers back and builds the (grad_q, grad_k, grad_weights) tuple of
 * what the caller gets (their own arrays when they passed them). */
static PyObject *finish_gouts(const char *fn, PyObject **args, struct gouts *g)
{
    for (int i = 0; i < 3; i++)
        if (g->w[i] != g->o[i] && PyArray_CopyInto(g->o[i], g->w[i])) return NULL;
    PyObject *t = PyTuple_New(3);
    if (!t) return NULL;
    for (int i = 0; i < 3; i++) {
        PyObject *r = (args[i] && args[i] != Py_None) ? args[i] : (PyObject *)g->o[i];
        Py_INCREF(r);
        PyTuple_SET_ITEM(t, i, r);
    }
    (void)fn;
    return t;
}

/* ------------------------------------------------------------------ index_scores_backward */

PyDoc_STRVAR(index_scores_backward_doc,
"index_scores_backward(grad_scores, q, k, weights, *, ratio, start_pos=0, grad_q=None,\n"
"                      grad_k=None, grad_weights=None)\n--\n\n"
"Gradients of index_scores() (docs/kernels.md, section 11.3): with\n"
"a[b,s,h,t] = q[b,s,h] . k[b,t] and G = grad_scores,\n"
"  grad_weights[b,s,h] = sum_t G[b,s,t] relu(a)\n"
"  grad_q[b,s,h]       = sum_t G[b,s,t] weights[b,s,h] relu'(a) k[b,t]\n"
"  grad_k[b,t]         = sum_s sum_h G[b,s,t] weights[b,s,h] relu'(a) q[b,s,h]\n"
"over the entries query s can see, t < (start_pos + s + 1) // ratio; G at the others\n"
"(the -inf scores) is never read.  relu'(a) = 0 where a <= 0 (torch's relu backward).\n\n"
"grad_scores : float32 [B, S, Tc] (any strides).\n"
"q, k, weights, ratio, start_pos : as index_scores(), float32 only.\n"
"grad_q, grad_k, grad_weights : float32 results of shape q / k / weights, or None.\n"
"Returns (grad_q, grad_k, grad_weights).  grad_k, which every query row adds into, is\n"
"summed in a fixed order: bitwise identical at any thread count.");

static PyObject *py_index_scores_backward(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "index_scores_backward";
    static char *kwlist[] = {"grad_scores", "q", "k", "weights", "ratio", "start_pos",
                             "grad_q", "grad_k", "grad_weights", NULL};
    PyObject *go, *qo, *ko, *wo, *ro = NULL, *spo = NULL, *outs[3] = {Py_None, Py_None, Py_None};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OOOOO:index_scores_backward", kwlist, &go,
                                     &qo, &ko, &wo, &ro, &spo, &outs[0], &outs[1], &outs[2]))
        return NULL;
    long long ratio, start_pos = 0;
    if (parse_ratio(fn, ro, spo, &ratio, &start_pos)) return NULL;
    struct gqkw a;
    struct csa_index_problem p;
    if (parse_gqkw(fn, qo, ko, wo, ratio, start_pos, 1, &a, &p)) return NULL;
    PyObject *ret = NULL;
    struct gouts g;
    memset(&g, 0, sizeof g);
    char b1[256];
    PyArrayObject *ga = csa_array(go, fn, "grad_scores", CSA_F32, 3, 3, 0);
    if (!ga) goto done;
    if (PyArray_DIM(ga, 0) != p.B || PyArray_DIM(ga, 1) != p.S || PyArray_DIM(ga, 2) != p.Tc) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'grad_scores' must have the scores' shape [B, S, Tc] = [%lld, %lld, "
                     "%lld], got %s", fn, (long long)p.B, (long long)p.S, (long long)p.Tc,
                     csa_shape_str(ga, b1, sizeof b1));
        goto done;
    }
    PyArrayObject *ins[4] = {ga, a.q, a.k, a.w};
    if (make_gouts(fn, outs, &p, ins, 4, &g)) goto done;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_index_scores_backward(&p, (const float *)PyArray_DATA(ga), csa_stride(ga, 0),
                                   csa_stride(ga, 1), csa_stride(ga, 2),
                                   (float *)PyArray_DATA(g.w[0]), (float *)PyArray_DATA(g.w[1]),
                                   (float *)PyArray_DATA(g.w[2]));
    Py_END_ALLOW_THREADS
    if (st) csa_raise_status(st, fn);
    else ret = finish_gouts(fn, outs, &g);
done:
    gouts_clear(&g);
    Py_XDECREF(ga);
    gqkw_clear(&a);
    return ret;
}

/* ------------------------------------------------------------------ indexer_kl_loss */

/* Entries query (b, s) can see (index.h: start_pos + s or its own position). */
static long long kl_nv(const struct csa_index_problem *p, const struct csa_kl_target *x,
                       csa_idx b, csa_idx s)
{
    const long long P = x->pos ? (long long)x->pos[b * x->spb + s * x->sps]
                               : (long long)p->start_pos + s;
    const long long nv = P + 1 <= 0 ? 0 : (P + 1) / p->ratio;
    return nv < p->Tc ? nv : p->Tc;
}

/* A joint target's row mass above this is not a probability (float32 sums of
 * probabilities are ~1e-7 off; a sum over H heads passed as it is exceeds it as soon
 * as the row's slots hold more than 1/H of the attention). */
#define KL_JOINT_MAX_MASS 1.001

/* topk_idxs values: -1 or an entry the row can see; targets at valid slots >= 0 (or
 * NaN); a joint target's row mass <= 1.  Checked under the GIL so the error names the
 * slot. */
static int check_slots(const char *fn, const struct csa_index_problem *p,
                       const struct csa_kl_target *x)
{
    const csa_idx K = x->idx ? x->K : p->Tc;
    for (csa_idx b = 0; b < p->B; b++)
        for (csa_idx s = 0; s < p->S; s++) {
            const long long nv = kl_nv(p, x, b, s);
            const float *tr = x->t + b * x->stb + s * x->sts;
            double mass = 0.0;
            for (csa_idx j = 0; j < K; j++) {
                if (x->idx) {
                    const int32_t t = x->idx[b * x->sib + s * x->sis + j * x->sik];
                    if (t == -1) continue;
                    if (t < -1 || t >= nv) {
                        PyErr_Format(PyExc_IndexError,
                                     "%s(): 'topk_idxs'[%lld, %lld, %lld] = %d must be -1 or a "
                                     "compressed entry query %lld can see, 0 <= t < (%s + 1) // "
                                     "ratio = %lld (indices without the window offset, as "
                                     "index_topk(..., offset=0) gives them)",
                                     fn, (long long)b, (long long)s, (long long)j, (int)t,
                                     (long long)s, x->pos ? "positions[b, s]" : "start_pos + s",
                                     nv);
                        return -1;
                    }
                } else if (j >= nv) {
                    break;
                }
                const float v = tr[j * x->stk];
                if (v < 0.0f) {
                    char vb[64];
                    snprintf(vb, sizeof vb, "%.9g", (double)v);
                    PyErr_Format(PyExc_ValueError,
                                 "%s(): 'attn_target' must be >= 0 at every valid slot, got "
                                 "attn_target[%lld, %lld, %lld] = %s", fn, (long long)b,
                                 (long long)s, (long long)j, vb);
                    return -1;
                }
                mass += (double)v;
            }
            if (x->target == CSA_KL_JOINT && mass > KL_JOINT_MAX_MASS) {
                char vb[64];
                snprintf(vb, sizeof vb, "%.9g", mass);
                PyErr_Format(PyExc_ValueError,
                             "%s(): target='joint' reads 'attn_target' as probabilities of "
                             "the joint attention distribution (a row's slots sum to at most "
                             "1), got a sum of %s over the slots of row [%lld, %lld]; "
                             "sparse_attn_weights sums over the heads: divide it by their "
                             "number", fn, vb, (long long)b, (long long)s);
                return -1;
            }
        }
    return 0;
}

/* The metrics result of indexer_kl_loss(..., return_metrics=True), created once. */
static PyTypeObject *kl_metrics_type;

static PyStructSequence_Field kl_metrics_fields[] = {
    {"kl", "the loss (the mean over the rows taking part)"},
    {"kl_uniform", "the same mean of the target's KL to the uniform distribution over "
                   "each row's slots, weighted as the loss"},
    {"kl_captured", "1 - kl / kl_uniform (nan when kl_uniform is 0)"},
    {"rows", "rows taking part"},
    {"degenerate_rows", "rows taking part whose slots are every entry they can see"},
    {NULL, NULL},
};

static PyStructSequence_Desc kl_metrics_desc = {
    "deepseek_csa.IndexerKLMetrics",
    "indexer_kl_loss(..., return_metrics=True)'s last result (no gradient).",
    kl_metrics_fields, 5,
};

static PyObject *kl_metrics(double loss, const struct csa_kl_stats *st)
{
    if (!kl_metrics_type && !(kl_metrics_type = PyStructSequence_NewType(&kl_metrics_desc)))
        return NULL;
    PyObject *m = PyStructSequence_New(kl_metrics_type);
    if (!m) return NULL;
    const double cap = st->kl_uniform != 0.0 ? 1.0 - loss / st->kl_uniform : NAN;
    PyObject *v[5] = {PyFloat_FromDouble(loss), PyFloat_FromDouble(st->kl_uniform),
                      PyFloat_FromDouble(cap), PyLong_FromLongLong(st->rows),
                      PyLong_FromLongLong(st->degenerate)};
    for (int i = 0; i < 5; i++) {
        if (!v[i]) {
            for (int j = i; j < 5; j++) Py_XDECREF(v[j]);
            Py_DECREF(m);
            return NULL;
        }
        PyStructSequence_SET_ITEM(m, i, v[i]);
    }
    return m;
}

PyDoc_STRVAR(indexer_kl_loss_doc,
"indexer_kl_loss(q, k, weights, topk_idxs, attn_target, *, ratio, start_pos=0,\n"
"                positions=None, target='selected', clip=None, return_grads=False,\n"
"                return_metrics=False)\n--\n\n"
"The lightning indexer's training objective (docs/kernels.md, section 11.3), forward\n"
"and backward in one pass.  I[b,s,t] = sum_h weights[b,s,h] relu(q[b,s,h] . k[b,t])\n"
"(index_scores).  Query (b, s) sits at position P = start_pos + s (or positions[b, s])\n"
"and sees the entries t < (P + 1) // ratio (at most Tc).  For each query row, its slots\n"
"j with topk_idxs[b,s,j] >= 0 (sparse stage) or every entry it can see (topk_idxs=None:\n"
"the dense warm-up), Z = the sum of the row's attn_target over its slots,\n"
"p_j = attn_target_j / Z and l_j = log_softmax_j(I):\n"
"  loss_row = rho * sum_j p_j (log p_j - L_j),  0 log 0 = 0,\n"
"  L_j = l_j, or max(l_j, clip) with clip given (clipped slots pass no gradient),\n"
"  rho = 1 (target='selected': the row's target L1-normalized over its slots) or Z\n"
"  (target='joint': attn_target is the joint attention probability of each slot, a\n"
"  mean over heads of the softmax over window + compressed entries + sink, i.e.\n"
"  sparse_attn_weights / n_heads; each row then weighs by the mass its slots hold).\n"
"The result is the mean of loss_row over the rows with at least one slot and a nonzero\n"
"target sum (the others take no part and get no gradient; 0.0 when no row takes part).\n"
"Duplicate slots count as often as they appear.\n\n"
"q, k, weights : float32, as index_scores().\n"
"topk_idxs     : int32 [B, S, K], -1 = no entry, else a compressed entry the row can see\n"
"                (positions as index_topk(..., offset=0) gives them); or None.\n"
"attn_target   : float32 [B, S, K] (sparse) or [B, S, Tc] (dense), >= 0; a constant.\n"
"                target='joint': each row's slots sum to at most 1.\n"
"positions     : int32 [B, S] (any strides: a broadcast row serves every batch row),\n"
"                each query's position (padded batches, per-row positions); start_pos\n"
"                must then be 0.  None: start_pos + s.\n"
"target        : 'selected' (default) or 'joint'.\n"
"clip          : None, or a float <= 0: log-probabilities below it count as clip in\n"
"                the loss and pass no gradient.\n"
"return_grads  : also return the gradients of the loss, float32 arrays of the shapes of\n"
"                q, k and weights (grad_k summed in a fixed order: bitwise identical at\n"
"                any thread count).\n"
"return_metrics: also return an IndexerKLMetrics (kl, kl_uniform, kl_captured, rows,\n"
"                degenerate_rows), last.\n"
"Returns loss (a float), or (loss, grad_q, grad_k, grad_weights), then the metrics when\n"
"asked.  A sparse-stage call in which every row taking part is degenerate (its slots\n"
"are every entry it can see: the loss is the dense warm-up's) warns (RuntimeWarning).\n"
"Memory: O(B*S) + O(threads * K * Hi) + a few [Tc, Di] partials of grad_k; never an\n"
"[S, Tc] array in the sparse stage.");

static PyObject *py_indexer_kl_loss(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "indexer_kl_loss";
    static char *kwlist[] = {"q", "k", "weights", "topk_idxs", "attn_target", "ratio",
                             "start_pos", "positions", "target", "clip", "return_grads",
                             "return_metrics", NULL};
    PyObject *qo, *ko, *wo, *io, *to, *ro = NULL, *spo = NULL, *po = Py_None, *tgo = NULL,
             *clo = Py_None, *rgo = Py_False, *rmo = Py_False;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OOOOOOO:indexer_kl_loss", kwlist, &qo,
                                     &ko, &wo, &io, &to, &ro, &spo, &po, &tgo, &clo, &rgo, &rmo))
        return NULL;
    const int rg = PyObject_IsTrue(rgo), rm = PyObject_IsTrue(rmo);
    if (rg < 0 || rm < 0) return NULL;
    long long ratio, start_pos = 0;
    if (parse_ratio(fn, ro, spo, &ratio, &start_pos)) return NULL;
    int target = CSA_KL_SELECTED;
    if (tgo && tgo != Py_None) {
        const char *ts = PyUnicode_Check(tgo) ? PyUnicode_AsUTF8(tgo) : NULL;
        if (ts && !strcmp(ts, "joint")) target = CSA_KL_JOINT;
        else if (!ts || strcmp(ts, "selected")) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s(): 'target' must be 'selected' or 'joint', got %R",
                         fn, tgo);
            return NULL;
        }
    }
    double clip = 0.0;
    const int clip_on = clo != Py_None;
    if (clip_on) {
        if (csa_float_arg(clo, fn, "clip", &clip)) return NULL;
        if (!(clip <= 0.0 && isfinite(clip))) /* a log-probability is <= 0; None: no clip */
            return csa_value_error_f(fn, "clip",
                                     "None or a finite log-probability <= 0 (e.g. -100)", clip);
    }
    if (po != Py_None && start_pos != 0) {
        PyErr_Format(PyExc_ValueError, "%s(): 'positions' gives every query's position: "
                     "start_pos must be 0 with it, got %lld", fn, start_pos);
        return NULL;
    }
    struct gqkw a;
    struct csa_index_problem p;
    if (parse_gqkw(fn, qo, ko, wo, ratio, start_pos, po == Py_None, &a, &p)) return NULL;
    PyObject *ret = NULL, *outs[3] = {Py_None, Py_None, Py_None};
    struct gouts g;
    memset(&g, 0, sizeof g);
    char b1[256];
    PyArrayObject *ia = NULL, *ta = NULL, *pa = NULL;
    struct csa_kl_target x;
    memset(&x, 0, sizeof x);
    x.target = target;
    x.clip_on = clip_on;
    x.clip = clip;
    csa_idx K = p.Tc;
    if (po != Py_None) {
        if (!(pa = csa_array(po, fn, "positions", CSA_I32, 2, 2, 0))) goto done;
        if (PyArray_DIM(pa, 0) != p.B || PyArray_DIM(pa, 1) != p.S) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'positions' must have shape [B, S] = [%lld, %lld] (one row for "
                         "all: a broadcast view), got %s", fn, (long long)p.B, (long long)p.S,
                         csa_shape_str(pa, b1, sizeof b1));
            goto done;
        }
        x.pos = (const int32_t *)PyArray_DATA(pa);
        x.spb = csa_stride(pa, 0);
        x.sps = csa_stride(pa, 1);
    }
    if (io != Py_None) {
        if (!(ia = csa_array(io, fn, "topk_idxs", CSA_I32, 3, 3, 0))) goto done;
        if (csa_check_dim(ia, fn, "topk_idxs", 0, p.B, "batch, q.shape[0]") ||
            csa_check_dim(ia, fn, "topk_idxs", 1, p.S, "query positions S, q.shape[1]"))
            goto done;
        K = PyArray_DIM(ia, 2);
        x.idx = (const int32_t *)PyArray_DATA(ia);
        x.K = K;
        x.sib = csa_stride(ia, 0);
        x.sis = csa_stride(ia, 1);
        x.sik = csa_stride(ia, 2);
    }
    if (!(ta = csa_array(to, fn, "attn_target", CSA_F32, 3, 3, 0))) goto done;
    if (PyArray_DIM(ta, 0) != p.B || PyArray_DIM(ta, 1) != p.S || PyArray_DIM(ta, 2) != K) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'attn_target' must have shape [B, S, %s] = [%lld, %lld, %lld], got %s",
                     fn, ia ? "K (topk_idxs.shape[2])" : "Tc (dense warm-up: k.shape[1])",
                     (long long)p.B, (long long)p.S, (long long)K, csa_shape_str(ta, b1, sizeof b1));
        goto done;
    }
    x.t = (const float *)PyArray_DATA(ta);
    x.stb = csa_stride(ta, 0);
    x.sts = csa_stride(ta, 1);
    x.stk = csa_stride(ta, 2);
    if (rg) { /* first: a batch too large to allocate fails before the O(B*S*K) checks */
        PyArrayObject *ins[6] = {a.q, a.k, a.w, ia, ta, pa};
        if (make_gouts(fn, outs, &p, ins, 6, &g)) goto done;
    }
    if (check_slots(fn, &p, &x)) goto done;
    double loss = 0.0;
    struct csa_kl_stats stats;
    memset(&stats, 0, sizeof stats);
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_indexer_kl(&p, &x, &loss, &stats, rg ? (float *)PyArray_DATA(g.w[0]) : NULL,
                        rg ? (float *)PyArray_DATA(g.w[1]) : NULL,
                        rg ? (float *)PyArray_DATA(g.w[2]) : NULL);
    Py_END_ALLOW_THREADS
    if (st) {
        csa_raise_status(st, fn);
        goto done;
    }
    /* the sparse stage degenerated into the dense warm-up: say so (a fixed message, so
     * Python's default filter shows it once per call site) */
    if (x.idx && stats.rows > 0 && stats.degenerate == stats.rows &&
        PyErr_WarnEx(PyExc_RuntimeWarning,
                     "indexer_kl_loss(): every row's slots are all the entries it can see "
                     "(top-k >= visible entries), so this sparse-stage loss is the dense "
                     "warm-up's; return_metrics=True counts such rows (degenerate_rows)", 1))
        goto done;
    PyObject *met = NULL;
    if (rm && !(met = kl_metrics(loss, &stats))) goto done;
    if (!rg) {
        ret = met ? Py_BuildValue("(dN)", loss, met) : PyFloat_FromDouble(loss);
        goto done;
    }
    PyObject *grads = finish_gouts(fn, outs, &g);
    if (!grads) {
        Py_XDECREF(met);
        goto done;
    }
    if (met)
        ret = Py_BuildValue("(dOOON)", loss, PyTuple_GET_ITEM(grads, 0),
                            PyTuple_GET_ITEM(grads, 1), PyTuple_GET_ITEM(grads, 2), met);
    else
        ret = Py_BuildValue("(dOOO)", loss, PyTuple_GET_ITEM(grads, 0),
                            PyTuple_GET_ITEM(grads, 1), PyTuple_GET_ITEM(grads, 2));
    Py_DECREF(grads);
done:
    gouts_clear(&g);
    Py_XDECREF(ia);
    Py_XDECREF(ta);
    Py_XDECREF(pa);
    gqkw_clear(&a);
    return ret;
}

PyMethodDef csa_grad_index_methods[] = {
    {"index_scores_backward", (PyCFunction)(void (*)(void))py_index_scores_backward,
     METH_VARARGS | METH_KEYWORDS, index_scores_backward_doc},
    {"indexer_kl_loss", (PyCFunction)(void (*)(void))py_indexer_kl_loss,
     METH_VARARGS | METH_KEYWORDS, indexer_kl_loss_doc},
    {NULL, NULL, 0, NULL},
};
