/* Glue of the backward kernels of index_scores_backward, indexer_kl_loss. */
#include "glue.h"

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

static int parse_gqkw(const char *fn, PyObject *qo, PyObject *ko, PyObject *wo, long long ratio,
                      long long start_pos, struct gqkw *a, struct csa_index_problem *p)
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
    if ((long long)Tc < need) {
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
    PyArrayObject *all[8];
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
    if (parse_gqkw(fn, qo, ko, wo, ratio, start_pos, &a, &p)) return NULL;
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

/* topk_idxs values: -1 or an entry the row can see; targets at valid slots >= 0 (or
 * NaN).  Checked under the GIL so the error names the slot. */
static int check_slots(const char *fn, const struct csa_index_problem *p,
                       const struct csa_kl_target *x)
{
    const csa_idx K = x->idx ? x->K : p->Tc;
    for (csa_idx b = 0; b < p->B; b++)
        for (csa_idx s = 0; s < p->S; s++) {
            const long long nvr = (p->start_pos + s + 1) / p->ratio,
                            nv = nvr < p->Tc ? nvr : p->Tc;
            const float *tr = x->t + b * x->stb + s * x->sts;
            for (csa_idx j = 0; j < K; j++) {
                if (x->idx) {
                    const int32_t t = x->idx[b * x->sib + s * x->sis + j * x->sik];
                    if (t == -1) continue;
                    if (t < -1 || t >= nv) {
                        PyErr_Format(PyExc_IndexError,
                                     "%s(): 'topk_idxs'[%lld, %lld, %lld] = %d must be -1 or a "
                                     "compressed entry query %lld can see, 0 <= t < (start_pos + "
                                     "s + 1) // ratio = %lld (indices without the window offset, "
                                     "as index_topk(..., offset=0) gives them)",
                                     fn, (long long)b, (long long)s, (long long)j, (int)t,
                                     (long long)s, nv);
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
            }
        }
    return 0;
}

PyDoc_STRVAR(indexer_kl_loss_doc,
"indexer_kl_loss(q, k, weights, topk_idxs, attn_target, *, ratio, start_pos=0,\n"
"                return_grads=False)\n--\n\n"
"The lightning indexer's training objective (docs/kernels.md, section 11.3), forward\n"
"and backward in one pass.  I[b,s,t] = sum_h weights[b,s,h] relu(q[b,s,h] . k[b,t])\n"
"(index_scores).  For each query row, its slots j with topk_idxs[b,s,j] >= 0 (sparse\n"
"stage) or every entry it can see, t < (start_pos + s + 1) // ratio (topk_idxs=None:\n"
"the dense warm-up): p_j = attn_target_j / sum of the row's attn_target over its slots,\n"
"loss_row = sum_j p_j (log p_j - log_softmax_j(I)) with 0 log 0 = 0; the result is the\n"
"mean of loss_row over the rows with at least one slot and a nonzero target sum (rows\n"
"whose target sums to 0 carry no information: they take no part and get no\n"
"gradient; 0.0 when no row takes part).  Duplicate slots count as often as they appear.\n\n"
"q, k, weights : float32, as index_scores().\n"
"topk_idxs     : int32 [B, S, K], -1 = no entry, else a compressed entry the row can see\n"
"                (positions as index_topk(..., offset=0) gives them); or None.\n"
"attn_target   : float32 [B, S, K] (sparse) or [B, S, Tc] (dense), >= 0; a constant.\n"
"return_grads  : also return the gradients of the loss, float32 arrays of the shapes of\n"
"                q, k and weights (grad_k summed in a fixed order: bitwise identical at\n"
"                any thread count).\n"
"Returns loss (a float), or (loss, grad_q, grad_k, grad_weights).  Memory: O(B*S) +\n"
"O(threads * K * Hi) + a few [Tc, Di] partials of grad_k; never an [S, Tc] array in\n"
"the sparse stage.");

static PyObject *py_indexer_kl_loss(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "indexer_kl_loss";
    static char *kwlist[] = {"q", "k", "weights", "topk_idxs", "attn_target", "ratio",
                             "start_pos", "return_grads", NULL};
    PyObject *qo, *ko, *wo, *io, *to, *ro = NULL, *spo = NULL, *rgo = Py_False;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$OOO:indexer_kl_loss", kwlist, &qo, &ko,
                                     &wo, &io, &to, &ro, &spo, &rgo))
        return NULL;
    const int rg = PyObject_IsTrue(rgo);
    if (rg < 0) return NULL;
    long long ratio, start_pos = 0;
    if (parse_ratio(fn, ro, spo, &ratio, &start_pos)) return NULL;
    struct gqkw a;
    struct csa_index_problem p;
    if (parse_gqkw(fn, qo, ko, wo, ratio, start_pos, &a, &p)) return NULL;
    PyObject *ret = NULL, *outs[3] = {Py_None, Py_None, Py_None};
    struct gouts g;
    memset(&g, 0, sizeof g);
    char b1[256];
    PyArrayObject *ia = NULL, *ta = NULL;
    struct csa_kl_target x;
    memset(&x, 0, sizeof x);
    csa_idx K = p.Tc;
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
        PyArrayObject *ins[5] = {a.q, a.k, a.w, ia, ta};
        if (make_gouts(fn, outs, &p, ins, 5, &g)) goto done;
    }
    if (check_slots(fn, &p, &x)) goto done;
    double loss = 0.0;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_indexer_kl(&p, &x, &loss, rg ? (float *)PyArray_DATA(g.w[0]) : NULL,
                        rg ? (float *)PyArray_DATA(g.w[1]) : NULL,
                        rg ? (float *)PyArray_DATA(g.w[2]) : NULL);
    Py_END_ALLOW_THREADS
    if (st) {
        csa_raise_status(st, fn);
        goto done;
    }
    if (!rg) {
        ret = PyFloat_FromDouble(loss);
        goto done;
    }
    PyObject *grads = finish_gouts(fn, outs, &g);
    if (!grads) goto done;
    ret = Py_BuildValue("(dOOO)", loss, PyTuple_GET_ITEM(grads, 0), PyTuple_GET_ITEM(grads, 1),
                        PyTuple_GET_ITEM(grads, 2));
    Py_DECREF(grads);
done:
    gouts_clear(&g);
    Py_XDECREF(ia);
    Py_XDECREF(ta);
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
