/* Glue of the backward kernels of sparse attention: sparse_attn_backward, sparse_attn_weights
 * (docs/kernels.md, section 11.1). */
#include "glue.h"

#include <math.h>

#include "../attn.h"

/* py_attn.c's: the IndexError naming the first bad entry, topk_idxs as int32 [B, S, K]. */
PyObject *csa_attn_raise_bad_index(const struct csa_attn_problem *p, const char *fn);
PyArrayObject *csa_attn_parse_idx(PyObject *io, const char *fn);

/* The forward's arguments, parsed and checked as sparse_attn checks them. */
struct attn_args {
    PyArrayObject *q, *kv, *sink, *idx;        /* as given (views) */
    PyArrayObject *qc, *kvc, *sc, *ic;         /* unit inner stride */
    npy_intp B, S, H, D, N, K;
    double scale;
};

static void attn_args_free(struct attn_args *x)
{
    Py_XDECREF(x->q);
    Py_XDECREF(x->kv);
    Py_XDECREF(x->sink);
    Py_XDECREF(x->idx);
    Py_XDECREF(x->qc);
    Py_XDECREF(x->kvc);
    Py_XDECREF(x->sc);
    Py_XDECREF(x->ic);
}

static int attn_args_parse(struct attn_args *x, const char *fn, int dtypes, PyObject *qo,
                           PyObject *kvo, PyObject *so, PyObject *io, PyObject *sco)
{
    if (!(x->q = csa_array(qo, fn, "q", dtypes, 4, 4, 0))) return -1;
    const int bf16 = csa_is_bf16(x->q);
    if (!(x->kv = csa_array(kvo, fn, "kv", dtypes, 3, 3, 0))) return -1;
    if (csa_is_bf16(x->kv) != bf16) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): 'kv' must have q's dtype (%s), got %s; cast one of them", fn,
                     bf16 ? "bfloat16" : "float32", bf16 ? "float32" : "bfloat16");
        return -1;
    }
    if (!(x->sink = csa_array(so, fn, "attn_sink", CSA_F32, 1, 1, 0))) return -1;
    if (!(x->idx = csa_attn_parse_idx(io, fn))) return -1;
    x->B = PyArray_DIM(x->q, 0), x->S = PyArray_DIM(x->q, 1), x->H = PyArray_DIM(x->q, 2);
    x->D = PyArray_DIM(x->q, 3), x->N = PyArray_DIM(x->kv, 1), x->K = PyArray_DIM(x->idx, 2);
    if (csa_check_dim(x->kv, fn, "kv", 0, x->B, "q.shape[0], the batch")) return -1;
    if (csa_check_dim(x->kv, fn, "kv", 2, x->D, "q.shape[3], the head dim")) return -1;
    if (csa_check_dim(x->sink, fn, "attn_sink", 0, x->H, "q.shape[2], one per head")) return -1;
    if (csa_check_dim(x->idx, fn, "topk_idxs", 0, x->B, "q.shape[0], the batch")) return -1;
    if (csa_check_dim(x->idx, fn, "topk_idxs", 1, x->S, "q.shape[1], one row per query"))
        return -1;
    if (csa_float_arg(sco, fn, "softmax_scale", &x->scale)) return -1;
    if (!isfinite(x->scale) || !isfinite((float)x->scale)) {
        csa_value_error_f(fn, "softmax_scale", "finite in float32", x->scale);
        return -1;
    }
    return 0;
}

static int attn_args_views(struct attn_args *x)
{
    return (x->qc = csa_unit_inner(x->q)) && (x->kvc = csa_unit_inner(x->kv)) &&
                   (x->sc = csa_unit_inner(x->sink)) && (x->ic = csa_unit_inner(x->idx))
               ? 0
               : -1;
}

static struct csa_attn_problem attn_args_problem(const struct attn_args *x)
{
    const struct csa_attn_problem p = {
        .q = PyArray_DATA(x->qc), .sq_b = csa_stride(x->qc, 0), .sq_s = csa_stride(x->qc, 1),
        .sq_h = csa_stride(x->qc, 2),
        .kv = PyArray_DATA(x->kvc), .skv_b = csa_stride(x->kvc, 0),
        .skv_n = csa_stride(x->kvc, 1),
        .sink = PyArray_DATA(x->sc),
        .idx = PyArray_DATA(x->ic), .si_b = csa_stride(x->ic, 0), .si_s = csa_stride(x->ic, 1),
        .B = x->B, .S = x->S, .H = x->H, .D = x->D, .N = x->N, .K = x->K,
        .scale = (float)x->scale, .bf16 = csa_is_bf16(x->q),
    };
    return p;
}

PyDoc_STRVAR(sparse_attn_weights_doc,
"sparse_attn_weights(q, kv, attn_sink, topk_idxs, softmax_scale, *, out=None)\n--\n\n"
"The attention probabilities of sparse_attn, summed over heads (docs/kernels.md, 11.1):\n"
"out[b, s, k] = sum_h e^(l_{b,s,h,k} - lse[b,s,h]) for a valid slot, 0 for a -1 slot (a\n"
"duplicated index gives each of its slots the same value); the sink's share is what a\n"
"row does not sum to (H per row in total).  Computed by the forward's pass without its\n"
"output (float32 logits and softmax for bfloat16 inputs too).\n\n"
"q, kv, attn_sink, topk_idxs, softmax_scale: as sparse_attn (float32 or bfloat16).\n"
"out : float32 [B, S, K], or None.\n"
"Returns out, float32 [B, S, K].  Bitwise identical at any thread count.");

static PyObject *py_sparse_attn_weights(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "sparse_attn_weights";
    static char *kwlist[] = {"q", "kv", "attn_sink", "topk_idxs", "softmax_scale", "out", NULL};
    PyObject *qo, *kvo, *so, *io, *sco, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$O:sparse_attn_weights", kwlist, &qo,
                                     &kvo, &so, &io, &sco, &oo))
        return NULL;
    struct attn_args x = {0};
    PyArrayObject *out = NULL, *work = NULL;
    PyObject *ret = NULL;
    if (attn_args_parse(&x, fn, CSA_F32 | CSA_BF16, qo, kvo, so, io, sco)) goto done;
    const npy_intp shape[3] = {x.B, x.S, x.K};
    PyArrayObject *ins[4] = {x.q, x.kv, x.sink, x.idx};
    if (!(out = csa_out_array(oo, fn, 3, shape, NULL, NPY_FLOAT32, ins, 4, 0, NULL))) goto done;
    if (attn_args_views(&x) || !(work = csa_work_array(out, CSA_WORK_UNIT_INNER))) goto done;
    struct csa_attn_problem p = attn_args_problem(&x);
    p.weights = PyArray_DATA(work);
    p.sw_b = csa_stride(work, 0);
    p.sw_s = csa_stride(work, 1);
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_sparse_attn_weights(&p);
    Py_END_ALLOW_THREADS
    ret = st == CSA_EINDEX ? csa_attn_raise_bad_index(&p, fn) : csa_finish(st, fn, oo, out, work);
done:
    attn_args_free(&x);
    Py_XDECREF(out);
    Py_XDECREF(work);
    return ret;
}

PyDoc_STRVAR(sparse_attn_backward_doc,
"sparse_attn_backward(grad_out, q, kv, attn_sink, topk_idxs, softmax_scale, out, lse, *,\n"
"                     grad_q=None, grad_kv=None, grad_sink=None, grad_dtype=None)\n--\n\n"
"Gradients of sparse_attn (docs/kernels.md, section 11.1) from its saved output and\n"
"row log-sum-exp (sparse_attn(..., return_lse=True)).  With p_j = e^(l_j - lse) and\n"
"Dr = grad_out . out per (b, s, h):\n"
"dl_j = p_j (grad_out . kv_j - Dr);  grad_q = softmax_scale sum_j dl_j kv_j;\n"
"grad_kv[b, idx_j] += p_j grad_out + softmax_scale dl_j q  (over queries, slots, heads);\n"
"grad_sink[h] = -sum_{b,s} e^(attn_sink[h] - lse) Dr.\n"
"-1 slots are skipped, a query with no valid index gives no gradient, a duplicated\n"
"index counts once per slot; grad_kv rows no slot lists are 0.\n\n"
"q, kv, out : [B, S, H, D], [B, N, D], [B, S, H, D]; float32, or all three bfloat16\n"
"             (ml_dtypes.bfloat16 arrays, CPU torch bf16 tensors viewed without a copy).\n"
"grad_out   : [B, S, H, D], float32 or bfloat16 (independently of q).\n"
"attn_sink  : float32 [H]; topk_idxs: int32 [B, S, K]; lse: float32 [B, S, H].\n"
"grad_dtype : None or 'float32' (default), or 'bfloat16' (also ml_dtypes.bfloat16): the\n"
"             dtype of grad_q and grad_kv; grad_sink is always float32.\n"
"grad_q, grad_kv, grad_sink: results of those shapes and dtypes, or None.\n"
"bfloat16 inputs are read as they are and widened exactly: all arithmetic is float32,\n"
"so the float32 gradients are bitwise those of the float32 call on the widened values;\n"
"bfloat16 gradients are those rounded once to nearest-even (grad_q as each row is stored;\n"
"grad_kv through float32 scratch of its size).  Returns (grad_q, grad_kv, grad_sink).  Every grad_kv element is\n"
"summed in (b, s, slot) order: bitwise identical at any thread count.");

/* The argument object the caller gets back for one result. */
static PyObject *result_of(PyObject *arg, PyArrayObject *out)
{
    return (arg && arg != Py_None) ? arg : (PyObject *)out;
}

static PyObject *py_sparse_attn_backward(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "sparse_attn_backward";
    static char *kwlist[] = {"grad_out", "q", "kv", "attn_sink", "topk_idxs", "softmax_scale",
                             "out", "lse", "grad_q", "grad_kv", "grad_sink", "grad_dtype", NULL};
    PyObject *go, *qo, *kvo, *so, *io, *sco, *oo, *lo, *gqo = Py_None, *gkvo = Py_None,
             *gso = Py_None, *gdo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOO|$OOOO:sparse_attn_backward", kwlist, &go,
                                     &qo, &kvo, &so, &io, &sco, &oo, &lo, &gqo, &gkvo, &gso, &gdo))
        return NULL;
    struct attn_args x = {0};
    PyArrayObject *dO = NULL, *O = NULL, *lse = NULL, *dOc = NULL, *Oc = NULL, *lsec = NULL;
    PyArrayObject *gq = NULL, *gkv = NULL, *gs = NULL, *wq = NULL, *wkv = NULL, *wsk = NULL;
    PyArrayObject *gproto = NULL;
    PyObject *ret = NULL;
    if (!(dO = csa_array(go, fn, "grad_out", CSA_F32 | CSA_BF16, 4, 4, 0))) goto done;
    if (attn_args_parse(&x, fn, CSA_F32 | CSA_BF16, qo, kvo, so, io, sco)) goto done;
    if (!(O = csa_array(oo, fn, "out", csa_is_bf16(x.q) ? CSA_BF16 : CSA_F32, 4, 4, 0))) goto done;
    if (csa_grad_dtype_arg(gdo, fn, &gproto) < 0) goto done;
    if (!(lse = csa_array(lo, fn, "lse", CSA_F32, 3, 3, 0))) goto done;
    for (int i = 0; i < 4; i++) {
        static const char *what[4] = {"q.shape[0], the batch", "q.shape[1], the queries",
                                      "q.shape[2], the heads", "q.shape[3], the head dim"};
        const npy_intp want = PyArray_DIM(x.q, i);
        if (csa_check_dim(dO, fn, "grad_out", i, want, what[i])) goto done;
        if (csa_check_dim(O, fn, "out", i, want, what[i])) goto done;
        if (i < 3 && csa_check_dim(lse, fn, "lse", i, want, what[i])) goto done;
    }
    const npy_intp sq[4] = {x.B, x.S, x.H, x.D}, skv[3] = {x.B, x.N, x.D}, ssk[1] = {x.H};
    PyArrayObject *ins[10] = {dO, x.q, x.kv, x.sink, x.idx, O, lse, NULL, NULL, NULL};
    if (!(gq = csa_out_array_named(gqo, fn, "grad_q", 4, sq, gproto, NPY_FLOAT32, ins, 7, 0, NULL)))
        goto done;
    ins[7] = gq;
    if (!(gkv = csa_out_array_named(gkvo, fn, "grad_kv", 3, skv, gproto, NPY_FLOAT32, ins, 8, 0,
                                    NULL)))
        goto done;
    ins[8] = gkv;
    if (!(gs = csa_out_array_named(gso, fn, "grad_sink", 1, ssk, NULL, NPY_FLOAT32, ins, 9, 0,
                                   NULL)))
        goto done;
    if (attn_args_views(&x) || !(dOc = csa_unit_inner(dO)) || !(Oc = csa_unit_inner(O)) ||
        !(lsec = csa_unit_inner(lse)) || !(wq = csa_work_array(gq, CSA_WORK_UNIT_INNER)) ||
        !(wkv = csa_work_array(gkv, CSA_WORK_UNIT_INNER)) ||
        !(wsk = csa_work_array(gs, CSA_WORK_C_CONTIG)))
        goto done;
    struct csa_attn_bwd_problem g = {
        .f = attn_args_problem(&x),
        .dout = PyArray_DATA(dOc), .sdo_b = csa_stride(dOc, 0), .sdo_s = csa_stride(dOc, 1),
        .sdo_h = csa_stride(dOc, 2),
        .dq = PyArray_DATA(wq), .sdq_b = csa_stride(wq, 0), .sdq_s = csa_stride(wq, 1),
        .sdq_h = csa_stride(wq, 2),
        .dkv = PyArray_DATA(wkv), .sdkv_b = csa_stride(wkv, 0), .sdkv_n = csa_stride(wkv, 1),
        .dsink = PyArray_DATA(wsk),
        .dout_bf16 = csa_is_bf16(dOc), .dq_bf16 = csa_is_bf16(wq), .dkv_bf16 = csa_is_bf16(wkv),
    };
    g.f.out = PyArray_DATA(Oc);
    g.f.so_b = csa_stride(Oc, 0), g.f.so_s = csa_stride(Oc, 1), g.f.so_h = csa_stride(Oc, 2);
    g.f.lse = PyArray_DATA(lsec);
    g.f.sl_b = csa_stride(lsec, 0), g.f.sl_s = csa_stride(lsec, 1);
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_sparse_attn_backward(&g);
    Py_END_ALLOW_THREADS
    if (st == CSA_EINDEX) {
        csa_attn_raise_bad_index(&g.f, fn);
        goto done;
    }
    if (st) {
        csa_raise_status(st, fn);
        goto done;
    }
    if ((wq != gq && PyArray_CopyInto(gq, wq)) || (wkv != gkv && PyArray_CopyInto(gkv, wkv)) ||
        (wsk != gs && PyArray_CopyInto(gs, wsk)))
        goto done;
    ret = PyTuple_Pack(3, result_of(gqo, gq), result_of(gkvo, gkv), result_of(gso, gs));
done:
    attn_args_free(&x);
    Py_XDECREF(dO);
    Py_XDECREF(O);
    Py_XDECREF(lse);
    Py_XDECREF(dOc);
    Py_XDECREF(Oc);
    Py_XDECREF(lsec);
    Py_XDECREF(gq);
    Py_XDECREF(gkv);
    Py_XDECREF(gs);
    Py_XDECREF(wq);
    Py_XDECREF(wkv);
    Py_XDECREF(wsk);
    Py_XDECREF(gproto);
    return ret;
}

PyMethodDef csa_grad_attn_methods[] = {
    {"sparse_attn_backward", (PyCFunction)(void (*)(void))py_sparse_attn_backward,
     METH_VARARGS | METH_KEYWORDS, sparse_attn_backward_doc},
    {"sparse_attn_weights", (PyCFunction)(void (*)(void))py_sparse_attn_weights,
     METH_VARARGS | METH_KEYWORDS, sparse_attn_weights_doc},
    {NULL, NULL, 0, NULL},
};
