/* sparse_attn: top-k sparse attention with an attention sink (SPEC section 5). */
#include "glue.h"

#include <math.h>

#include "../attn.h"

/* A C-contiguous copy of `a` if its last axis is not unit-stride (the tuned kernel
 * streams rows), else `a` itself; a new reference either way, NULL on error. */
static PyArrayObject *unit_inner(PyArrayObject *a)
{
    const int nd = PyArray_NDIM(a);
    if (nd == 0 || PyArray_DIM(a, nd - 1) <= 1 || csa_stride(a, nd - 1) == 1) {
        Py_INCREF(a);
        return a;
    }
    return (PyArrayObject *)PyArray_NewCopy(a, NPY_CORDER);
}

/* Raises IndexError for the first entry of idx [B, S, K] outside [-1, n); 0 if none. */
static int check_indices(PyArrayObject *idx, npy_intp n, const char *fn)
{
    const npy_intp B = PyArray_DIM(idx, 0), S = PyArray_DIM(idx, 1), K = PyArray_DIM(idx, 2);
    const csa_idx sb = csa_stride(idx, 0), ss = csa_stride(idx, 1), sk = csa_stride(idx, 2);
    const int32_t *p = (const int32_t *)PyArray_DATA(idx);
    for (npy_intp b = 0; b < B; b++)
        for (npy_intp s = 0; s < S; s++)
            for (npy_intp k = 0; k < K; k++) {
                const int32_t v = p[b * sb + s * ss + k * sk];
                if (v < -1 || v >= n) {
                    PyErr_Format(PyExc_IndexError,
                                 "%s(): 'topk_idxs' holds %d at [%lld, %lld, %lld], outside "
                                 "[-1, N) with N = %lld (kv.shape[1]); -1 marks an empty slot",
                                 fn, (int)v, (long long)b, (long long)s, (long long)k,
                                 (long long)n);
                    return -1;
                }
            }
    return 0;
}

PyDoc_STRVAR(sparse_attn_doc,
"sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale, *, out=None)\n--\n\n"
"Top-k sparse multi-query attention with an attention sink (SPEC section 5).\n\n"
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
"Returns out (a new array when out is None).  Bitwise identical at any thread count.\n\n"
"bfloat16 (ml_dtypes.bfloat16 arrays, torch bf16 tensors viewed without a copy): float32\n"
"logits, softmax and accumulation; the weights are rounded to bf16 before they\n"
"multiply kv, as in a bf16 GEMM; the output is rounded once.  At ISA level 'amx' the\n"
"products run on AMX-BF16 tiles (bf16 subnormals count as zero there).");

static PyObject *py_sparse_attn(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "sparse_attn";
    static char *kwlist[] = {"q", "kv", "attn_sink", "topk_idxs", "softmax_scale", "out", NULL};
    PyObject *qo, *kvo, *so, *io, *sco, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|$O:sparse_attn", kwlist, &qo, &kvo, &so,
                                     &io, &sco, &oo))
        return NULL;
    PyArrayObject *q = NULL, *kv = NULL, *sink = NULL, *idx = NULL, *out = NULL;
    PyArrayObject *qc = NULL, *kvc = NULL, *sc = NULL, *ic = NULL, *tmp = NULL;
    PyObject *ret = NULL;

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
    if (!(idx = csa_array(io, fn, "topk_idxs", CSA_I32, 3, 3, 0))) {
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
        goto done;
    }
    const npy_intp B = PyArray_DIM(q, 0), S = PyArray_DIM(q, 1), H = PyArray_DIM(q, 2),
                   D = PyArray_DIM(q, 3), N = PyArray_DIM(kv, 1), K = PyArray_DIM(idx, 2);
    if (csa_check_dim(kv, fn, "kv", 0, B, "q.shape[0], the batch")) goto done;
    if (csa_check_dim(kv, fn, "kv", 2, D, "q.shape[3], the head dim")) goto done;
    if (csa_check_dim(sink, fn, "attn_sink", 0, H, "q.shape[2], one per head")) goto done;
    if (csa_check_dim(idx, fn, "topk_idxs", 0, B, "q.shape[0], the batch")) goto done;
    if (csa_check_dim(idx, fn, "topk_idxs", 1, S, "q.shape[1], one row per query")) goto done;

    const double scale = PyFloat_AsDouble(sco);
    if (scale == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s(): 'softmax_scale' must be a float, got %s", fn,
                     Py_TYPE(sco)->tp_name);
        goto done;
    }
    if (!isfinite(scale) || !isfinite((float)scale)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'softmax_scale' must be finite, got %R", fn, sco);
        goto done;
    }
    if (check_indices(idx, N, fn)) goto done;

    const npy_intp shape[4] = {B, S, H, D};
    PyArrayObject *ins[4] = {q, kv, sink, idx};
    if (oo == Py_None)  /* every element gets written: no need to zero it first */
        out = csa_empty_like_dtype(q, 4, shape);
    else
        out = csa_out_array_as(oo, fn, 4, shape, q, ins, 4);
    if (!out) goto done;

    if (!(qc = unit_inner(q)) || !(kvc = unit_inner(kv)) || !(sc = unit_inner(sink)) ||
        !(ic = unit_inner(idx)))
        goto done;
    PyArrayObject *dst = out;
    if (D > 1 && csa_stride(out, 3) != 1) {
        if (!(tmp = csa_empty_like_dtype(q, 4, shape))) goto done;
        dst = tmp;
    }
    int st;
    Py_BEGIN_ALLOW_THREADS
    if (bf16)
        st = csa_sparse_attn_bf16(
            (const csa_bf16 *)PyArray_DATA(qc), csa_stride(qc, 0), csa_stride(qc, 1),
            csa_stride(qc, 2), (const csa_bf16 *)PyArray_DATA(kvc), csa_stride(kvc, 0),
            csa_stride(kvc, 1), (const float *)PyArray_DATA(sc), (const int32_t *)PyArray_DATA(ic),
            csa_stride(ic, 0), csa_stride(ic, 1), (csa_bf16 *)PyArray_DATA(dst),
            csa_stride(dst, 0), csa_stride(dst, 1), csa_stride(dst, 2), B, S, H, D, N, K,
            (float)scale);
    else
        st = csa_sparse_attn((const float *)PyArray_DATA(qc), csa_stride(qc, 0), csa_stride(qc, 1),
                             csa_stride(qc, 2), (const float *)PyArray_DATA(kvc),
                             csa_stride(kvc, 0), csa_stride(kvc, 1), (const float *)PyArray_DATA(sc),
                             (const int32_t *)PyArray_DATA(ic), csa_stride(ic, 0), csa_stride(ic, 1),
                             (float *)PyArray_DATA(dst), csa_stride(dst, 0), csa_stride(dst, 1),
                             csa_stride(dst, 2), B, S, H, D, N, K, (float)scale);
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, out, tmp);
done:
    Py_XDECREF(q);
    Py_XDECREF(kv);
    Py_XDECREF(sink);
    Py_XDECREF(idx);
    Py_XDECREF(out);
    Py_XDECREF(qc);
    Py_XDECREF(kvc);
    Py_XDECREF(sc);
    Py_XDECREF(ic);
    Py_XDECREF(tmp);
    return ret;
}

PyMethodDef csa_attn_methods[] = {
    {"sparse_attn", (PyCFunction)(void (*)(void))py_sparse_attn, METH_VARARGS | METH_KEYWORDS,
     sparse_attn_doc},
    {NULL, NULL, 0, NULL},
};
