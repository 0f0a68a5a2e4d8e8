/* Glue of the backward kernels of rms_norm_backward, gated_pool_backward. */
#include "glue.h"

#include <math.h>

#include "../norm.h"
#include "../pool.h"

/* A new reference to `a` as a C-contiguous float32 array when it is bfloat16 (exact),
 * else to `a` with a unit inner stride (csa_unit_inner). */
static PyArrayObject *f32_unit(PyArrayObject *a)
{
    if (!csa_is_bf16(a)) return csa_unit_inner(a);
    PyArrayObject *o = (PyArrayObject *)PyArray_EMPTY(PyArray_NDIM(a), PyArray_DIMS(a),
                                                      NPY_FLOAT32, 0);
    if (!o) return NULL;
    PyArrayObject *c = (PyArrayObject *)PyArray_GETCONTIGUOUS(a);
    if (!c) {
        Py_DECREF(o);
        return NULL;
    }
    const csa_bf16 *src = PyArray_DATA(c);
    float *dst = PyArray_DATA(o);
    for (npy_intp i = 0, n = PyArray_SIZE(a); i < n; i++) dst[i] = csa_bf16_to_f32(src[i]);
    Py_DECREF(c);
    return o;
}

/* A new reference to `a` whose leading axes fold into rows with unit inner stride:
 * itself or a C-contiguous copy. */
static PyArrayObject *foldable(PyArrayObject *a, csa_idx *rows, csa_idx *srow)
{
    PyArrayObject *u = csa_unit_inner(a);
    if (!u) return NULL;
    if (PyArray_NDIM(u) > 1 && csa_fold_rows(u, rows, srow) == 0) return u;
    PyArrayObject *c = (PyArrayObject *)PyArray_NewCopy(u, NPY_CORDER);
    Py_DECREF(u);
    if (!c) return NULL;
    const int nd = PyArray_NDIM(c);
    const npy_intp d = nd ? PyArray_DIM(c, nd - 1) : 1;
    *rows = d ? (csa_idx)(PyArray_SIZE(c) / d) : 0;
    if (!d) {
        *rows = 1;
        for (int i = 0; i < nd - 1; i++) *rows *= PyArray_DIM(c, i);
    }
    *srow = (csa_idx)d;
    return c;
}

PyDoc_STRVAR(rms_norm_backward_doc,
"rms_norm_backward(grad_out, x, weight, eps, *, grad_x=None, grad_weight=None)\n--\n\n"
"Backward of rms_norm (docs/kernels.md, section 11.2), in float32.  With\n"
"inv = 1 / sqrt(mean(x**2) + eps) per row and g = grad_out * weight:\n"
"  grad_x = inv * g - x * inv**3 * sum(g * x) / D,\n"
"  grad_weight = sum over rows of grad_out * x * inv (fixed blocks of 64 rows, in order).\n\n"
"grad_out, x : float32 or bfloat16 [..., D], the same shape, any strides.\n"
"weight      : float32 [D] or None (no weight: grad_weight is None).\n"
"eps         : float (the forward's).\n"
"grad_x      : [..., D] of grad_dtype, or None; grad_weight: float32 [D] or None.\n"
"grad_dtype  : None or 'float32' (default), or 'bfloat16' (also ml_dtypes.bfloat16): the\n"
"              dtype of grad_x, the float32 result rounded once to nearest-even.\n"
"bfloat16 inputs (ml_dtypes.bfloat16 arrays, CPU torch bf16 tensors) are read as they\n"
"are and widened exactly; arithmetic float32.  Bits do not depend on the thread count.\n"
"Returns (grad_x, grad_weight).");

static PyObject *py_rms_norm_backward(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "rms_norm_backward";
    static char *kwlist[] = {"grad_out", "x", "weight", "eps", "grad_x", "grad_weight",
                             "grad_dtype", NULL};
    PyObject *go, *xo, *wo, *epso, *gxo = Py_None, *gwo = Py_None, *gdo = Py_None;
    double eps;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OOO:rms_norm_backward", kwlist, &go, &xo,
                                     &wo, &epso, &gxo, &gwo, &gdo))
        return NULL;
    if (csa_float_arg(epso, fn, "eps", &eps)) return NULL;
    PyArrayObject *dy = NULL, *x = NULL, *w = NULL, *gx = NULL, *gw = NULL, *dyc = NULL,
                  *xc = NULL, *wc = NULL, *gxw = NULL, *gproto = NULL;
    if (csa_grad_dtype_arg(gdo, fn, &gproto) < 0) return NULL;
    PyObject *ret = NULL, *r1 = NULL, *r2 = NULL;
    char b1[256], b2[256];
    if (!(dy = csa_array(go, fn, "grad_out", CSA_F32 | CSA_BF16, 1, NPY_MAXDIMS, 0))) goto done;
    if (!(x = csa_array(xo, fn, "x", CSA_F32 | CSA_BF16, 1, NPY_MAXDIMS, 0))) goto done;
    const int nd = PyArray_NDIM(x);
    const npy_intp d = PyArray_DIM(x, nd - 1);
    if (!PyArray_SAMESHAPE(dy, x)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'grad_out' must have the shape of 'x' %s, got %s",
                     fn, csa_shape_str(x, b1, sizeof b1), csa_shape_str(dy, b2, sizeof b2));
        goto done;
    }
    if (wo != Py_None) {
        if (!(w = csa_array(wo, fn, "weight", CSA_F32, 1, 1, 0))) goto done;
        if (csa_check_dim(w, fn, "weight", 0, d, "x.shape[-1]")) goto done;
    } else if (gwo != Py_None) {
        PyErr_Format(PyExc_ValueError, "%s(): 'grad_weight' must be None when 'weight' is None",
                     fn);
        goto done;
    }
    if (!isfinite(eps) || eps < 0) {
        csa_value_error_f(fn, "eps", "finite and >= 0", eps);
        goto done;
    }
    PyArrayObject *ins[4] = {dy, x, w, NULL};
    if (!(gx = csa_out_array_named(gxo, fn, "grad_x", nd, PyArray_DIMS(x), gproto, NPY_FLOAT32,
                                   ins, 3, 0, NULL)))
        goto done;
    ins[3] = gx;
    if (w) {
        npy_intp ws[1] = {d};
        if (!(gw = csa_out_array_named(gwo, fn, "grad_weight", 1, ws, NULL, NPY_FLOAT32, ins, 4, 0,
                                       NULL)))
            goto done;
    }
    csa_idx rows, sdy, sx, sgx;
    if (!(dyc = foldable(dy, &rows, &sdy))) goto done;
    if (!(xc = foldable(x, &rows, &sx))) goto done;
    if (w && !(wc = csa_unit_inner(w))) goto done;
    /* a bfloat16 grad_x is written as it is (rounded once per element by the kernel) */
    if (!(gxw = csa_work_array(gx, CSA_WORK_C_CONTIG))) goto done;
    sgx = (csa_idx)d;
    float *gwp = NULL, *gwtmp = NULL;
    const int gw_direct = gw && PyArray_IS_C_CONTIGUOUS(gw);
    if (gw) {
        gwp = gw_direct ? PyArray_DATA(gw) : (gwtmp = PyMem_Malloc((size_t)(d ? d : 1) * sizeof(float)));
        if (!gwp) {
            PyErr_NoMemory();
            goto done;
        }
    }
    const int dybf = csa_is_bf16(dyc), xbf = csa_is_bf16(xc), gxbf = csa_is_bf16(gxw);
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_rms_norm_backward(PyArray_DATA(dyc), dybf, sdy, PyArray_DATA(xc), xbf, sx, rows,
                               (csa_idx)d, wc ? PyArray_DATA(wc) : NULL, (float)eps,
                               PyArray_DATA(gxw), gxbf, sgx, gwp);
    Py_END_ALLOW_THREADS
    if (st == CSA_OK && gwtmp)
        for (npy_intp i = 0; i < d; i++) *(float *)PyArray_GETPTR1(gw, i) = gwtmp[i];
    PyMem_Free(gwtmp);
    if (!(r1 = csa_finish(st, fn, gxo, gx, gxw))) goto done;
    if (gw) {
        if (!(r2 = csa_finish(CSA_OK, fn, gwo, gw, NULL))) goto done;
    } else {
        r2 = Py_NewRef(Py_None);
    }
    ret = PyTuple_Pack(2, r1, r2);
done:
    Py_XDECREF(r1);
    Py_XDECREF(r2);
    Py_XDECREF(dy);
    Py_XDECREF(x);
    Py_XDECREF(w);
    Py_XDECREF(gx);
    Py_XDECREF(gw);
    Py_XDECREF(dyc);
    Py_XDECREF(xc);
    Py_XDECREF(wc);
    Py_XDECREF(gxw);
    Py_XDECREF(gproto);
    return ret;
}

PyDoc_STRVAR(gated_pool_backward_doc,
"gated_pool_backward(grad_out, kv, score, ratio, *, ape=None, overlap=False, grad_kv=None,\n"
"                    grad_score=None, grad_ape=None)\n--\n\n"
"Backward of gated_pool (docs/kernels.md, section 11.2), in float32.  Per entry and\n"
"feature, with w = softmax(score + ape) over its candidates (recomputed) and y the entry:\n"
"  grad_kv_j = w_j * grad_out,  grad_score_j = w_j * grad_out * (kv_j - y),\n"
"  grad_ape[j] = sum over rows and groups of grad_score at candidate j (in a fixed\n"
"  order: chunks of entries fixed by the shape, docs/kernels.md section 11.2).\n"
"The T % ratio trailing tokens (and, with overlap, the last complete group's first\n"
"halves) feed no entry: gradient 0.  Ratio 1 without overlap: grad_kv = grad_out,\n"
"grad_score = 0 (score may be None), grad_ape = 0.\n\n"
"grad_out  : float32 or bfloat16 [B, T // ratio, D].\n"
"kv, score : float32 or bfloat16 [B, T, c*D] (c = 2 with overlap), the forward's.\n"
"ape       : float32 / bfloat16 [ratio, c*D] or None (grad_ape is then None).\n"
"grad_kv, grad_score : [B, T, c*D] of grad_dtype, or None; grad_ape: float32 [ratio, c*D]\n"
"            or None.\n"
"grad_dtype : None or 'float32' (default), or 'bfloat16' (also ml_dtypes.bfloat16): the\n"
"            dtype of grad_kv and grad_score, the float32 result rounded once to\n"
"            nearest-even; grad_ape is float32.\n"
"bfloat16 inputs (ml_dtypes.bfloat16 arrays, CPU torch bf16 tensors) are read as they are\n"
"and widened exactly; arithmetic float32, so the float32 gradients are bitwise those of the\n"
"float32 call on the widened values.  Bits do not depend on the thread count.\n"
"Returns (grad_kv, grad_score, grad_ape).");

static PyObject *py_gated_pool_backward(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "gated_pool_backward";
    static char *kwlist[] = {"grad_out", "kv", "score", "ratio", "ape", "overlap",
                             "grad_kv", "grad_score", "grad_ape", "grad_dtype", NULL};
    PyObject *go, *kvo, *so, *ro, *apo = Py_None, *gko = Py_None, *gso = Py_None,
                                  *gao = Py_None, *gdo = Py_None;
    int overlap = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|$OpOOOO:gated_pool_backward", kwlist, &go,
                                     &kvo, &so, &ro, &apo, &overlap, &gko, &gso, &gao, &gdo))
        return NULL;
    long long ratio;
    if (csa_int_arg(ro, fn, "ratio", 1, (long long)1 << 40, &ratio)) return NULL;
    const int gate = ratio > 1 || overlap;
    PyArrayObject *dy = NULL, *kv = NULL, *sc = NULL, *ape = NULL, *gk = NULL, *gs = NULL,
                  *ga = NULL, *dyc = NULL, *kvc = NULL, *scc = NULL, *apc = NULL, *gkw = NULL,
                  *gsw = NULL, *gaw = NULL, *gproto = NULL;
    PyObject *ret = NULL, *r1 = NULL, *r2 = NULL, *r3 = NULL;
    char b1[256], b2[256];
    if (csa_grad_dtype_arg(gdo, fn, &gproto) < 0) return NULL;
    if (!(dy = csa_array(go, fn, "grad_out", CSA_F32 | CSA_BF16, 3, 3, 0))) goto done;
    if (!(kv = csa_array(kvo, fn, "kv", CSA_F32 | CSA_BF16, 3, 3, 0))) goto done;
    if (so != Py_None || gate)
        if (!(sc = csa_array(so, fn, "score", CSA_F32 | CSA_BF16, 3, 3, 0))) goto done;
    if (apo != Py_None && !(ape = csa_array(apo, fn, "ape", CSA_F32 | CSA_BF16, 2, 2, 0)))
        goto done;
    const npy_intp B = PyArray_DIM(kv, 0), T = PyArray_DIM(kv, 1), cd = PyArray_DIM(kv, 2);
    if (overlap && cd % 2) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): with overlap 'kv' must have an even last dimension (2*D), got "
                     "shape %s", fn, csa_shape_str(kv, b1, sizeof b1));
        goto done;
    }
    const npy_intp d = cd / (overlap ? 2 : 1), G = T / ratio;
    if (sc && !PyArray_SAMESHAPE(sc, kv)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'score' must have the shape of 'kv' %s, got %s",
                     fn, csa_shape_str(kv, b1, sizeof b1), csa_shape_str(sc, b2, sizeof b2));
        goto done;
    }
    if (ape && (PyArray_DIM(ape, 0) != ratio || PyArray_DIM(ape, 1) != cd)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'ape' must have shape [ratio, kv.shape[-1]] = [%lld, %lld], got %s",
                     fn, ratio, (long long)cd, csa_shape_str(ape, b1, sizeof b1));
        goto done;
    }
    if (PyArray_DIM(dy, 0) != B || PyArray_DIM(dy, 1) != G || PyArray_DIM(dy, 2) != d) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'grad_out' must have shape [B, T // ratio, D] = [%lld, %lld, %lld], "
                     "got %s", fn, (long long)B, (long long)G, (long long)d,
                     csa_shape_str(dy, b1, sizeof b1));
        goto done;
    }
    if (!ape && gao != Py_None) {
        PyErr_Format(PyExc_ValueError, "%s(): 'grad_ape' must be None when 'ape' is None", fn);
        goto done;
    }
    npy_intp ks[3] = {B, T, cd}, as[2] = {ratio, cd};
    PyArrayObject *ins[6] = {dy, kv, sc, ape, NULL, NULL};
    if (!(gk = csa_out_array_named(gko, fn, "grad_kv", 3, ks, gproto, NPY_FLOAT32, ins, 4, 0, NULL)))
        goto done;
    ins[4] = gk;
    if (!(gs = csa_out_array_named(gso, fn, "grad_score", 3, ks, gproto, NPY_FLOAT32, ins, 5, 0,
                                   NULL)))
        goto done;
    ins[5] = gs;
    if (ape && !(ga = csa_out_array_named(gao, fn, "grad_ape", 2, as, NULL, NPY_FLOAT32, ins, 6, 0,
                                          NULL)))
        goto done;
    if (!(dyc = csa_unit_inner(dy)) || !(kvc = csa_unit_inner(kv))) goto done;
    if (sc && !(scc = csa_unit_inner(sc))) goto done;
    if (ape && !(apc = f32_unit(ape))) goto done;
    /* bfloat16 gradients are written as they are (rounded once by the kernel) */
    if (!(gkw = csa_work_array(gk, CSA_WORK_UNIT_INNER))) goto done;
    if (!(gsw = csa_work_array(gs, CSA_WORK_UNIT_INNER))) goto done;
    if (ga && !(gaw = csa_work_array(ga, CSA_WORK_UNIT_INNER))) goto done;
    const struct csa_pool_grad_problem p = {
        .dy = PyArray_DATA(dyc), .sdb = csa_stride(dyc, 0), .sdg = csa_stride(dyc, 1),
        .kv = PyArray_DATA(kvc), .skb = csa_stride(kvc, 0), .skt = csa_stride(kvc, 1),
        .score = scc ? PyArray_DATA(scc) : NULL, .ssb = scc ? csa_stride(scc, 0) : 0,
        .sst = scc ? csa_stride(scc, 1) : 0,
        .ape = apc ? PyArray_DATA(apc) : NULL, .sar = apc ? csa_stride(apc, 0) : 0,
        .dkv = PyArray_DATA(gkw), .sgkb = csa_stride(gkw, 0), .sgkt = csa_stride(gkw, 1),
        .dsc = PyArray_DATA(gsw), .sgsb = csa_stride(gsw, 0), .sgst = csa_stride(gsw, 1),
        .dape = gaw ? PyArray_DATA(gaw) : NULL, .sgar = gaw ? csa_stride(gaw, 0) : 0,
        .B = B, .T = T, .d = d, .ratio = ratio, .overlap = overlap,
        .dy_bf16 = csa_is_bf16(dyc), .kv_bf16 = csa_is_bf16(kvc),
        .sc_bf16 = scc ? csa_is_bf16(scc) : 0,
        .dkv_bf16 = csa_is_bf16(gkw), .dsc_bf16 = csa_is_bf16(gsw),
    };
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_gated_pool_backward(&p);
    Py_END_ALLOW_THREADS
    if (!(r1 = csa_finish(st, fn, gko, gk, gkw))) goto done;
    if (!(r2 = csa_finish(CSA_OK, fn, gso, gs, gsw))) goto done;
    if (ga) {
        if (!(r3 = csa_finish(CSA_OK, fn, gao, ga, gaw))) goto done;
    } else {
        r3 = Py_NewRef(Py_None);
    }
    ret = PyTuple_Pack(3, r1, r2, r3);
done:
    Py_XDECREF(r1);
    Py_XDECREF(r2);
    Py_XDECREF(r3);
    Py_XDECREF(dy);
    Py_XDECREF(kv);
    Py_XDECREF(sc);
    Py_XDECREF(ape);
    Py_XDECREF(gk);
    Py_XDECREF(gs);
    Py_XDECREF(ga);
    Py_XDECREF(dyc);
    Py_XDECREF(kvc);
    Py_XDECREF(scc);
    Py_XDECREF(apc);
    Py_XDECREF(gkw);
    Py_XDECREF(gsw);
    Py_XDECREF(gaw);
    Py_XDECREF(gproto);
    return ret;
}

PyMethodDef csa_grad_norm_pool_methods[] = {
    {"rms_norm_backward", (PyCFunction)(void (*)(void))py_rms_norm_backward,
     METH_VARARGS | METH_KEYWORDS, rms_norm_backward_doc},
    {"gated_pool_backward", (PyCFunction)(void (*)(void))py_gated_pool_backward,
     METH_VARARGS | METH_KEYWORDS, gated_pool_backward_doc},
    {NULL, NULL, 0, NULL},
};
