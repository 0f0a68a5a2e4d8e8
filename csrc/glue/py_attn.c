/* sparse_attn: top-k sparse attention with an attention sink (docs/kernels.md, section 5). */
#include "glue.h"

#include <math.h>

#include "../attn.h"

PyDoc_STRVAR(sparse_attn_doc,
"sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale, *, out=None, return_lse=False)\n--\n\n"
"Top-k sparse multi-query attention with an attention sink (docs/kernels.md, section 5).\n\n"
"For every (b, s, h), over the valid entries j of topk_idxs[b, s] (-1 = skip):\n"
"l_j = softmax_scale * q[b,s,h] . kv[b, idx_j];\n"
"out[b,s,h] = sum_j e^(l_j - m) kv[b, idx_j] / (sum_j e^(l_j - m) + e^(attn_sink[h] - m)).\n"
"K = V (one KV head shared by all heads); the sink adds to the denominator only;\n"
"a query with no valid index gets zeros; duplicate indices count once each.\n\n"
"q             : float32 or bfloat16 [B, S, H, D], any strides.\n"
"kv            : [B, N, D] of q's dtype, any strides.\n"
"attn_sink     : float32 [H].\n"
"topk_idxs     : int32 [B, S, K], every entry in [-1, N) (else IndexError, nothing written).\n"
"softmax_scale : finite float (D**-0.5 in the model).\n"
"out           : [B, S, H, D] of q's dtype, or None; must not overlap an input.\n"
"return_lse    : also return lse, float32 [B, S, H], the row log-sum-exp of the full\n"
"                denominator log(sum_j e^(l_j) + e^(attn_sink[h])) (attn_sink[h] for a\n"
"                query with no valid index), from the same pass: what\n"
"                sparse_attn_backward needs.\n"
"Returns out (a new array when out is None), or (out, lse) with return_lse.  Bitwise\n"
"identical at any thread count.\n\n"
"bfloat16 (ml_dtypes.bfloat16 arrays, torch bf16 tensors viewed without a copy): float32\n"
"logits, softmax and accumulation; the weights are rounded to bf16 before they\n"
"multiply kv, as in a bf16 GEMM; the output is rounded once.  At ISA level 'amx' the\n"
"products run on AMX-BF16 tiles (bf16 subnormals count as zero there).");

/* IndexError naming the first entry of topk_idxs outside [-1, N) (after the kernel
 * refused the call with CSA_EINDEX, having written nothing). */
PyObject *csa_attn_raise_bad_index(const struct csa_attn_problem *p, const char *fn)
{
    csa_idx b = 0, s = 0, k = 0;
    if (!csa_attn_bad_index(p, &b, &s, &k)) return csa_raise_status(CSA_EINDEX, fn);
    const int32_t v = p->idx[b * p->si_b + s * p->si_s + k];
    PyErr_Format(PyExc_IndexError,
                 "%s(): 'topk_idxs' holds %d at [%lld, %lld, %lld], outside [-1, N) with N = "
                 "%lld (kv.shape[1]); -1 marks an empty slot",
                 fn, (int)v, (long long)b, (long long)s, (long long)k, (long long)p->N);
    return NULL;
}

/* topk_idxs as int32 [B, S, K], with the reference's advice on a wrong dtype. */
PyArrayObject *csa_attn_parse_idx(PyObject *io, const char *fn)
{
    PyArrayObject *idx = csa_array(io, fn, "topk_idxs", CSA_I32, 3, 3, 0);
    if (idx) return idx;
    PyObject *dt = PyErr_ExceptionMatches(PyExc_TypeError) ? PyObject_GetAttrString(io, "dtype")
                                                            : NULL;
    if (dt) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): 'topk_idxs' must be an int32 array (as the reference kernel "
                     "takes; convert with .int() or .astype(np.int32)), got dtype %S",
                     fn, dt);
        Py_DECREF(dt);
    } else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): 'topk_idxs' must be an int32 array, got %s", fn,
                     Py_TYPE(io)->tp_name);
    }
    return NULL;
}

static PyObject *py_sparse_attn(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "sparse_attn";
    static char *kwlist[] = {"q", "kv", "attn_sink", "topk_idxs", "softmax_scale", "out",
                             "return_lse", NULL};
    PyObject *qo, *kvo, *so, *io, *sco, *oo = Py_None;
    int want_lse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$Op:sparse_attn", kwlist, &qo, &kvo, &so,
                                     &io, &sco, &oo, &want_lse))
        return NULL;
    PyArrayObject *q = NULL, *kv = NULL, *sink = NULL, *idx = NULL, *out = NULL, *lse = NULL;
    PyArrayObject *qc = NULL, *kvc = NULL, *sc = NULL, *ic = NULL, *work = NULL;
    PyObject *ret = NULL;

    /* parse */
    if (!(q = csa_array(qo, fn, "q", CSA_F32 | CSA_BF16, 4, 4, 0))) goto done;
    const int bf16 = csa_is_bf16(q);
    if (!(kv = csa_array(kvo, fn, "kv", CSA_F32 | CSA_BF16, 3, 3, 0))) goto done;
    if (csa_is_bf16(kv) != bf16) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): 'kv' must have q's dtype (%s), got %s; cast one of them", fn,
                     bf16 ? "bfloat16" : "float32", bf16 ? "float32" : "bfloat16");
        goto done;
    }
    if (!(sink = csa_array(so, fn, "attn_sink", CSA_F32, 1, 1, 0))) goto done;
    if (!(idx = csa_attn_parse_idx(io, fn))) goto done;
    /* shapes */
    const npy_intp B = PyArray_DIM(q, 0), S = PyArray_DIM(q, 1), H = PyArray_DIM(q, 2),
                   D = PyArray_DIM(q, 3), N = PyArray_DIM(kv, 1), K = PyArray_DIM(idx, 2);
    if (csa_check_dim(kv, fn, "kv", 0, B, "q.shape[0], the batch")) goto done;
    if (csa_check_dim(kv, fn, "kv", 2, D, "q.shape[3], the head dim")) goto done;
    if (csa_check_dim(sink, fn, "attn_sink", 0, H, "q.shape[2], one per head")) goto done;
    if (csa_check_dim(idx, fn, "topk_idxs", 0, B, "q.shape[0], the batch")) goto done;
    if (csa_check_dim(idx, fn, "topk_idxs", 1, S, "q.shape[1], one row per query")) goto done;
    double scale;
    if (csa_float_arg(sco, fn, "softmax_scale", &scale)) goto done;
    if (!isfinite(scale) || !isfinite((float)scale)) {
        csa_value_error_f(fn, "softmax_scale", "finite in float32", scale);
        goto done;
    }
    const npy_intp shape[4] = {B, S, H, D};
    PyArrayObject *ins[4] = {q, kv, sink, idx};
    if (!(out = csa_out_array(oo, fn, 4, shape, q, 0, ins, 4, 0, NULL))) goto done;
    if (want_lse && !(lse = (PyArrayObject *)PyArray_EMPTY(3, (npy_intp *)shape, NPY_FLOAT32, 0)))
        goto done;
    if (!(qc = csa_unit_inner(q)) || !(kvc = csa_unit_inner(kv)) ||
        !(sc = csa_unit_inner(sink)) || !(ic = csa_unit_inner(idx)) ||
        !(work = csa_work_array(out, CSA_WORK_UNIT_INNER)))
        goto done;
    /* call */
    const struct csa_attn_problem p = {
        .q = PyArray_DATA(qc), .sq_b = csa_stride(qc, 0), .sq_s = csa_stride(qc, 1),
        .sq_h = csa_stride(qc, 2),
        .kv = PyArray_DATA(kvc), .skv_b = csa_stride(kvc, 0), .skv_n = csa_stride(kvc, 1),
        .sink = PyArray_DATA(sc),
        .idx = PyArray_DATA(ic), .si_b = csa_stride(ic, 0), .si_s = csa_stride(ic, 1),
        .out = PyArray_DATA(work), .so_b = csa_stride(work, 0), .so_s = csa_stride(work, 1),
        .so_h = csa_stride(work, 2),
        .B = B, .S = S, .H = H, .D = D, .N = N, .K = K, .scale = (float)scale, .bf16 = bf16,
        .lse = lse ? PyArray_DATA(lse) : NULL, .sl_b = S * H, .sl_s = H,
    };
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_sparse_attn(&p);
    Py_END_ALLOW_THREADS
    /* finish */
    ret = st == CSA_EINDEX ? csa_attn_raise_bad_index(&p, fn) : csa_finish(st, fn, oo, out, work);
    if (ret && lse) {
        PyObject *pair = PyTuple_Pack(2, ret, (PyObject *)lse);
        Py_DECREF(ret);
        ret = pair;
    }
done:
    Py_XDECREF(lse);
    Py_XDECREF(q);
    Py_XDECREF(kv);
    Py_XDECREF(sink);
    Py_XDECREF(idx);
    Py_XDECREF(out);
    Py_XDECREF(qc);
    Py_XDECREF(kvc);
    Py_XDECREF(sc);
    Py_XDECREF(ic);
    Py_XDECREF(work);
    return ret;
}

PyMethodDef csa_attn_methods[] = {
    {"sparse_attn", (PyCFunction)(void (*)(void))py_sparse_attn, METH_VARARGS | METH_KEYWORDS,
     sparse_attn_doc},
    {NULL, NULL, 0, NULL},
};
