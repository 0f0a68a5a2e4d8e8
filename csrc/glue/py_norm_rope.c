/* rms_norm, rope_table, apply_rope. */
#include "glue.h"

#include <math.h>

#include "../norm.h"
#include "../rope.h"

struct norm_params {
    const float *w;
    csa_idx sw;
    float eps;
};

static int norm_rows(const void *x, csa_idx rows, csa_idx d, csa_idx sx_row, csa_idx sx_col,
                     void *out, csa_idx so_row, csa_idx so_col, int bf16, const void *params)
{
    const struct norm_params *p = params;
    if (bf16)
        return csa_rms_norm_bf16(x, rows, d, sx_row, sx_col, p->w, p->sw, p->eps, out, so_row,
                                 so_col);
    return csa_rms_norm(x, rows, d, sx_row, sx_col, p->w, p->sw, p->eps, out, so_row, so_col);
}

PyDoc_STRVAR(rms_norm_doc,
"rms_norm(x, weight=None, eps=1e-6, *, out=None)\n--\n\n"
"RMSNorm over the last axis, in float32: ``weight * x * rsqrt(mean(x**2) + eps)``.\n\n"
"x      : float32 or bfloat16 [..., D], any leading dims, any strides.\n"
"weight : float32 [D] or None (no weight, as for the attention query).\n"
"eps    : float.\n"
"out    : [..., D] of x's dtype, or None; may be ``x`` itself (in place).\n"
"bfloat16 (ml_dtypes.bfloat16 arrays, torch bfloat16 tensors) is read and written\n"
"as is, computed in float32 and rounded once on store, like the reference.\n"
"Returns out (a new array when out is None).");

static PyObject *py_rms_norm(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "rms_norm";
    static char *kwlist[] = {"x", "weight", "eps", "out", NULL};
    PyObject *xo, *wo = Py_None, *oo = Py_None, *epso = NULL;
    double eps = 1e-6;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO$O:rms_norm", kwlist, &xo, &wo, &epso, &oo))
        return NULL;
    if (epso && csa_float_arg(epso, fn, "eps", &eps)) return NULL;
    PyArrayObject *x = NULL, *w = NULL, *out = NULL;
    PyObject *ret = NULL;
    if (!(x = csa_array(xo, fn, "x", CSA_F32 | CSA_BF16, 1, NPY_MAXDIMS, 0))) goto done;
    const int nd = PyArray_NDIM(x);
    const npy_intp d = PyArray_DIM(x, nd - 1);
    if (wo != Py_None) {
        if (!(w = csa_array(wo, fn, "weight", CSA_F32, 1, 1, 0))) goto done;
        if (csa_check_dim(w, fn, "weight", 0, d, "x.shape[-1]")) goto done;
    }
    if (!isfinite(eps) || eps < 0) {
        csa_value_error_f(fn, "eps", "finite and >= 0", eps);
        goto done;
    }
    PyArrayObject *ins[2] = {x, w};
    int inplace = 0;
    if (!(out = csa_out_array(oo, fn, nd, PyArray_DIMS(x), x, 0, ins, 2, CSA_OUT_MAY_ALIAS,
                              &inplace)))
        goto done;
    const struct norm_params p = {w ? PyArray_DATA(w) : NULL, w ? csa_stride(w, 0) : 0,
                                  (float)eps};
    if (csa_run_rows(inplace ? out : x, out, fn, norm_rows, &p)) goto done;
    ret = csa_finish(CSA_OK, fn, oo, out, NULL);
done:
    Py_XDECREF(x);
    Py_XDECREF(w);
    Py_XDECREF(out);
    return ret;
}

PyDoc_STRVAR(rope_table_doc,
"rope_table(rope_dim, seqlen, *, base, original_seq_len=0, factor=1.0, beta_fast=32, beta_slow=1)\n--\n\n"
"RoPE cos/sin tables, float32 [seqlen, rope_dim // 2] each (docs/kernels.md, section 2).\n\n"
"Frequencies f_i = 1 / base**(2i/rope_dim); with original_seq_len > 0 YaRN blends\n"
"f_i / factor into the slow pairs between the beta_fast and beta_slow corrections.\n"
"Angle a[t, i] = float32(t) * f_i.  Returns (cos, sin).");

static PyObject *py_rope_table(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "rope_table";
    static char *kwlist[] = {"rope_dim", "seqlen", "base", "original_seq_len", "factor",
                             "beta_fast", "beta_slow", NULL};
    PyObject *rdo, *slo, *oslo = NULL, *baseo = NULL, *fo = NULL, *bfo = NULL, *bso = NULL;
    double base = 0, factor = 1.0, beta_fast = 32.0, beta_slow = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OOOOO:rope_table", kwlist, &rdo, &slo, &baseo,
                                     &oslo, &fo, &bfo, &bso))
        return NULL;
    long long rope_dim, seqlen, osl = 0;
    if (csa_int_arg(rdo, fn, "rope_dim", 2, 8192, &rope_dim)) return NULL;
    if (rope_dim % 2) {
        PyErr_Format(PyExc_ValueError, "%s(): 'rope_dim' must be even, got %lld", fn, rope_dim);
        return NULL;
    }
    if (csa_int_arg(slo, fn, "seqlen", 0, (long long)1 << 31, &seqlen)) return NULL;
    if (oslo && csa_int_arg(oslo, fn, "original_seq_len", 0, (long long)1 << 40, &osl))
        return NULL;
    if (!baseo) {
        PyErr_Format(PyExc_TypeError, "%s(): missing required keyword argument 'base'", fn);
        return NULL;
    }
    if (csa_float_arg(baseo, fn, "base", &base) || (fo && csa_float_arg(fo, fn, "factor", &factor)) ||
        (bfo && csa_float_arg(bfo, fn, "beta_fast", &beta_fast)) ||
        (bso && csa_float_arg(bso, fn, "beta_slow", &beta_slow)))
        return NULL;
    /* The table is computed in float32: every parameter must survive that cast
     * (a factor of 1e-50 would become 0 and turn the whole table into NaN). */
    if (!isfinite(base) || base <= 1.0 || !isfinite((float)base))
        return csa_value_error_f(fn, "base", "finite in float32 and > 1", base);
    if (!(factor >= 1e-30 && factor <= 1e30))
        return csa_value_error_f(fn, "factor", "in [1e-30, 1e30]", factor);
    if (!(beta_fast >= 1e-30 && beta_fast <= 1e30))
        return csa_value_error_f(fn, "beta_fast", "in [1e-30, 1e30]", beta_fast);
    if (!(beta_slow >= 1e-30 && beta_slow <= 1e30))
        return csa_value_error_f(fn, "beta_slow", "in [1e-30, 1e30]", beta_slow);
    npy_intp shape[2] = {(npy_intp)seqlen, (npy_intp)(rope_dim / 2)};
    PyArrayObject *c = (PyArrayObject *)PyArray_EMPTY(2, shape, NPY_FLOAT32, 0);
    PyArrayObject *s = (PyArrayObject *)PyArray_EMPTY(2, shape, NPY_FLOAT32, 0);
    if (!c || !s) {
        Py_XDECREF(c);
        Py_XDECREF(s);
        return NULL;
    }
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_rope_table((float *)PyArray_DATA(c), (float *)PyArray_DATA(s), seqlen, rope_dim,
                        base, osl, factor, beta_fast, beta_slow);
    Py_END_ALLOW_THREADS
    if (st) {
        Py_DECREF(c);
        Py_DECREF(s);
        return csa_raise_status(st, fn);
    }
    return Py_BuildValue("(NN)", c, s);
}

PyDoc_STRVAR(apply_rope_doc,
"apply_rope(x, cos, sin, *, inverse=False)\n--\n\n"
"Rotates, in place, the last 2*cos.shape[-1] features of x as adjacent pairs\n"
"(x[2i], x[2i+1]) by the angles of cos/sin; the first features are untouched.\n\n"
"x        : float32 or bfloat16 [B, S, D] or [B, S, H, D], writeable, any strides\n"
"           (e.g. x[..., -64:]); bfloat16 is rotated in float32 and rounded on store.\n"
"cos, sin : float32 [S, Dr/2], rows matching axis 1 of x, any strides (e.g. cos[::4]).\n"
"inverse  : rotate by minus the angle (de-rotation of the attention output).\n"
"Returns x.");

static PyObject *py_apply_rope(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "apply_rope";
    static char *kwlist[] = {"x", "cos", "sin", "inverse", NULL};
    PyObject *xo, *co, *so;
    int inverse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$p:apply_rope", kwlist, &xo, &co, &so,
                                     &inverse))
        return NULL;
    PyArrayObject *x = NULL, *c = NULL, *s = NULL;
    PyObject *ret = NULL;
    char b1[256], b2[256];
    if (!(x = csa_array(xo, fn, "x", CSA_F32 | CSA_BF16, 3, 4, 1))) goto done;
    if (!(c = csa_array(co, fn, "cos", CSA_F32, 2, 2, 0))) goto done;
    if (!(s = csa_array(so, fn, "sin", CSA_F32, 2, 2, 0))) goto done;
    const int nd = PyArray_NDIM(x);
    const npy_intp half = PyArray_DIM(c, 1), d = PyArray_DIM(x, nd - 1);
    if (PyArray_DIM(s, 0) != PyArray_DIM(c, 0) || PyArray_DIM(s, 1) != half) {
        PyErr_Format(PyExc_ValueError, "%s(): 'sin' must have the shape of 'cos' %s, got %s", fn,
                     csa_shape_str(c, b1, sizeof b1), csa_shape_str(s, b2, sizeof b2));
        goto done;
    }
    if (csa_check_dim(c, fn, "cos", 0, PyArray_DIM(x, 1), "x.shape[1], one row per position"))
        goto done;
    if (2 * half > d) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'cos' rotates 2*%lld features but 'x' has only %lld (shape %s)", fn,
                     (long long)half, (long long)d, csa_shape_str(x, b1, sizeof b1));
        goto done;
    }
    if (csa_may_overlap(x, c) || csa_may_overlap(x, s)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'x' overlaps 'cos' or 'sin'", fn);
        goto done;
    }
    const npy_intp n2 = nd == 4 ? PyArray_DIM(x, 2) : 1;
    const csa_idx s2 = nd == 4 ? csa_stride(x, 2) : 0;
    const csa_idx s3 = csa_stride(x, nd - 1);
    const int bf16 = csa_is_bf16(x);
    char *base = PyArray_BYTES(x) + (d - 2 * half) * PyArray_STRIDE(x, nd - 1);
    const csa_idx n0 = PyArray_DIM(x, 0), n1 = PyArray_DIM(x, 1), s0 = csa_stride(x, 0),
                  s1 = csa_stride(x, 1), scr = csa_stride(c, 0), scc = csa_stride(c, 1),
                  ssr = csa_stride(s, 0), ssc = csa_stride(s, 1);
    const float *cp = (const float *)PyArray_DATA(c), *sp = (const float *)PyArray_DATA(s);
    int st;
    Py_BEGIN_ALLOW_THREADS
    if (bf16)
        st = csa_apply_rope_bf16((csa_bf16 *)base, n0, n1, n2, half, s0, s1, s2, s3, cp, scr, scc,
                                 sp, ssr, ssc, inverse);
    else
        st = csa_apply_rope((float *)base, n0, n1, n2, half, s0, s1, s2, s3, cp, scr, scc, sp, ssr,
                            ssc, inverse);
    Py_END_ALLOW_THREADS
    if (st) {
        csa_raise_status(st, fn);
        goto done;
    }
    Py_INCREF(xo);
    ret = xo;
done:
    Py_XDECREF(x);
    Py_XDECREF(c);
    Py_XDECREF(s);
    return ret;
}

PyMethodDef csa_norm_rope_methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_VARARGS | METH_KEYWORDS,
     rms_norm_doc},
    {"rope_table", (PyCFunction)(void (*)(void))py_rope_table, METH_VARARGS | METH_KEYWORDS,
     rope_table_doc},
    {"apply_rope", (PyCFunction)(void (*)(void))py_apply_rope, METH_VARARGS | METH_KEYWORDS,
     apply_rope_doc},
    {NULL, NULL, 0, NULL},
};
