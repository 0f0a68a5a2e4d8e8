/* fp8_round, fp4_round, hadamard (docs/kernels.md, section 7). */
#include "glue.h"

#include <math.h>
#include <string.h>

#include "../quant.h"

/* Parses `out` for a result of x's shape and dtype: NULL with an exception on error;
 * *inplace = 1 when out is the same view as x (else it must not overlap x). */
static PyArrayObject *q_out(PyObject *oo, PyArrayObject *x, const char *fn, int *inplace)
{
    PyArrayObject *ins[1] = {x};
    return csa_out_array(oo, fn, PyArray_NDIM(x), PyArray_DIMS(x), x, 0, ins, 1,
                         CSA_OUT_MAY_ALIAS, inplace);
}

/* ------------------------------------------------------------ fp8_round / fp4_round */

struct q_round_params {
    csa_idx block;
    int fmt, scale;
};

static int q_round_kernel(const void *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                          csa_idx sx_col, void *out, csa_idx so_row, csa_idx so_col, int bf16,
                          const void *params)
{
    const struct q_round_params *p = params;
    if (bf16)
        return csa_quant_round_bf16(x, rows, d, sx_row, sx_col, p->block, p->fmt, p->scale,
                                    out, so_row, so_col);
    return csa_quant_round(x, rows, d, sx_row, sx_col, p->block, p->fmt, p->scale, out, so_row,
                           so_col);
}

static PyObject *q_round(PyObject *args, PyObject *kw, const char *fn, int fmt,
                         const char *const *scale_names, const int *scale_codes)
{
    static char *kwlist[] = {"x", "block", "scale", "out", NULL};
    PyObject *xo, *bo, *so = NULL, *oo = Py_None;
    char fmtspec[32];
    snprintf(fmtspec, sizeof fmtspec, "OO|$OO:%s", fn);
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmtspec, kwlist, &xo, &bo, &so, &oo)) return NULL;
    long long block;
    if (csa_int_arg(bo, fn, "block", 1, (long long)1 << 40, &block)) return NULL;
    int scale = scale_codes[0];
    if (so && so != Py_None) {
        const char *sname = PyUnicode_Check(so) ? PyUnicode_AsUTF8(so) : NULL;
        if (!sname) {
            PyErr_Format(PyExc_TypeError, "%s(): 'scale' must be '%s' or '%s', got %s", fn,
                         scale_names[0], scale_names[1], Py_TYPE(so)->tp_name);
            return NULL;
        }
        if (strcmp(sname, scale_names[0]) == 0) {
            scale = scale_codes[0];
        } else if (strcmp(sname, scale_names[1]) == 0) {
            scale = scale_codes[1];
        } else {
            PyErr_Format(PyExc_ValueError, "%s(): 'scale' must be '%s' or '%s', got %R", fn,
                         scale_names[0], scale_names[1], so);
            return NULL;
        }
    }
    const int have_out = oo != Py_None;
    PyArrayObject *x = NULL, *out = NULL;
    PyObject *ret = NULL;
    char b1[256];
    if (!(x = csa_array(xo, fn, "x", CSA_F32 | CSA_BF16, 1, NPY_MAXDIMS, !have_out))) goto done;
    const npy_intp d = PyArray_DIM(x, PyArray_NDIM(x) - 1);
    if (d % block) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'block' (%lld) must divide the last dimension of 'x' (shape %s)", fn,
                     block, csa_shape_str(x, b1, sizeof b1));
        goto done;
    }
    int inplace = !have_out;
    if (have_out && !(out = q_out(oo, x, fn, &inplace))) goto done;
    const struct q_round_params p = {(csa_idx)block, fmt, scale};
    PyArrayObject *dst = out ? out : x;  /* out may be x's own view (in place) */
    if (csa_run_rows(inplace ? dst : x, dst, fn, q_round_kernel, &p)) goto done;
    ret = have_out ? oo : xo;
    Py_INCREF(ret);
done:
    Py_XDECREF(x);
    Py_XDECREF(out);
    return ret;
}

static const char *const fp8_scale_names[] = {"ue8m0", "fp32"};
static const int fp8_scale_codes[] = {CSA_QS_UE8M0, CSA_QS_FP32};
static const char *const fp4_scale_names[] = {"ue8m0", "e4m3"};
static const int fp4_scale_codes[] = {CSA_QS_UE8M0, CSA_QS_E4M3};

PyDoc_STRVAR(fp8_round_doc,
"fp8_round(x, block, *, scale='ue8m0', out=None)\n--\n\n"
"FP8 (e4m3) quantize-dequantize over blocks of `block` features along the last axis,\n"
"as the released model rounds window KV and compressed KV (docs/kernels.md, section 7).\n\n"
"Per block: amax = max(max|x|, 1e-4); inv = float32(1/448);\n"
"  scale='ue8m0' (default): s = 2**ceil(log2(amax * inv)), exact at powers of two;\n"
"  scale='fp32'           : s = amax * inv;\n"
"x = round_e4m3(clamp(x / s, -448, 448)) * s, rounding to nearest-even on the e4m3fn\n"
"grid (subnormals down to 2**-9; what torch's float8_e4m3fn cast gives for values in\n"
"range).  Signs and -0 are kept.  A block holding a NaN or an inf becomes all NaN\n"
"(amax is NaN or inf, so is s, and 0 * inf is NaN), as the formula gives in torch.\n\n"
"x     : float32 or bfloat16 [..., D], D a multiple of block, any strides (views\n"
"        such as x[..., :-64] work).  Rounded IN PLACE when out is None (x must be\n"
"        writeable).  bfloat16 is widened, rounded in float32 and rounded back to\n"
"        bfloat16 once (as x.float() -> round -> .to(bfloat16)).\n"
"block : int >= 1 dividing D (V4: 64 on the first D - 64 features; V4.1: 32).\n"
"out   : [..., D] of x's dtype or None.  When given, x is left untouched and the\n"
"        result goes to out (which may be x itself).\n"
"Returns x (out is None) or out.");

static PyObject *py_fp8_round(PyObject *self, PyObject *args, PyObject *kw)
{
    return q_round(args, kw, "fp8_round", CSA_Q_E4M3, fp8_scale_names, fp8_scale_codes);
}

PyDoc_STRVAR(fp4_round_doc,
"fp4_round(x, block, *, scale='ue8m0', out=None)\n--\n\n"
"FP4 (e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6) quantize-dequantize over blocks of `block`\n"
"features along the last axis (docs/kernels.md, section 7).\n\n"
"Per block, with amax = max|x|:\n"
"  scale='ue8m0' (default; the indexer's q and k, block 32):\n"
"      amax floored at 6 * 2**-126, s = 2**ceil(log2(amax * float32(1/6)));\n"
"  scale='e4m3' (V4.1 compressed KV, block 16):\n"
"      amax floored at 6 * 2**-9, s = e4m3(amax / 6) rounded to nearest-even and\n"
"      saturated at 448 (as the hardware cast; torch's cast would give NaN there).\n"
"x = round_e2m1(clamp(x / s, -6, 6)) * s, nearest-even (0.25 -> 0, 0.75 -> 1,\n"
"2.5 -> 2, 5 -> 4).  Signs and -0 are kept; a block holding a NaN or an inf becomes\n"
"all NaN.\n\n"
"x     : float32 or bfloat16 [..., D], D a multiple of block, any strides.  Rounded\n"
"        IN PLACE when out is None (x must be writeable).  bfloat16 is computed in\n"
"        float32 and rounded back to bfloat16 once.\n"
"block : int >= 1 dividing D.\n"
"out   : [..., D] of x's dtype or None.  When given, x is left untouched and the\n"
"        result goes to out (which may be x itself).\n"
"Returns x (out is None) or out.");

static PyObject *py_fp4_round(PyObject *self, PyObject *args, PyObject *kw)
{
    return q_round(args, kw, "fp4_round", CSA_Q_E2M1, fp4_scale_names, fp4_scale_codes);
}

/* ------------------------------------------------------------ hadamard */

static int q_hadamard_kernel(const void *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                             csa_idx sx_col, void *out, csa_idx so_row, csa_idx so_col,
                             int bf16, const void *params)
{
    const float scale = *(const float *)params;
    if (bf16)
        return csa_hadamard_bf16(x, rows, d, sx_row, sx_col, scale, out, so_row, so_col);
    return csa_hadamard(x, rows, d, sx_row, sx_col, scale, out, so_row, so_col);
}

PyDoc_STRVAR(hadamard_doc,
"hadamard(x, *, scale=None, out=None)\n--\n\n"
"Fast Walsh-Hadamard transform of the last axis (natural / Sylvester order:\n"
"H_2n = [[H_n, H_n], [H_n, -H_n]]), O(n log n), times `scale` (default n**-0.5, the\n"
"normalized transform, which is its own inverse), as the V4 indexer rotates q and k.\n\n"
"x     : float32 or bfloat16 [..., n], n a power of two, any strides; bfloat16 is\n"
"        transformed in float32 and rounded back to bfloat16 once (as\n"
"        x.float() -> transform -> .to(bfloat16)).\n"
"scale : float or None (n**-0.5 rounded to float32).\n"
"out   : [..., n] of x's dtype or None; may be x itself (in place).\n"
"Returns out (a new C-contiguous array when out is None).");

/* A new C-contiguous float32 array whose data starts on a 64-byte boundary (so every
 * row of a power-of-two length >= 16 does too, and the kernel may stream its stores);
 * its memory is owned by a uint8 buffer array set as its base. */
static PyArrayObject *q_new_aligned(int nd, npy_intp *dims)
{
    npy_intp count = 1;
    for (int i = 0; i < nd; i++) count *= dims[i];
    npy_intp len = count * (npy_intp)sizeof(float) + 64;
    PyArrayObject *buf = (PyArrayObject *)PyArray_EMPTY(1, &len, NPY_UINT8, 0);
    if (!buf) return NULL;
    char *p = PyArray_BYTES(buf);
    p += (64 - ((uintptr_t)p & 63)) & 63;
    PyArrayObject *a = (PyArrayObject *)PyArray_NewFromDescr(
        &PyArray_Type, PyArray_DescrFromType(NPY_FLOAT32), nd, dims, NULL, p,
        NPY_ARRAY_CARRAY, NULL);
    if (!a) {
        Py_DECREF(buf);
        return NULL;
    }
    if (PyArray_SetBaseObject(a, (PyObject *)buf)) { /* steals buf */
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

static PyObject *py_hadamard(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "hadamard";
    static char *kwlist[] = {"x", "scale", "out", NULL};
    PyObject *xo, *so = Py_None, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OO:hadamard", kwlist, &xo, &so, &oo))
        return NULL;
    PyArrayObject *x = NULL, *out = NULL;
    PyObject *ret = NULL;
    char b1[256];
    if (!(x = csa_array(xo, fn, "x", CSA_F32 | CSA_BF16, 1, NPY_MAXDIMS, 0))) goto done;
    const npy_intp n = PyArray_DIM(x, PyArray_NDIM(x) - 1);
    if (n < 1 || (n & (n - 1))) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): the last dimension of 'x' must be a power of two, got shape %s", fn,
                     csa_shape_str(x, b1, sizeof b1));
        goto done;
    }
    float scale = (float)(1.0 / sqrt((double)n));
    if (so != Py_None) {
        double sd;
        if (csa_float_arg(so, fn, "scale", &sd)) goto done;
        scale = (float)sd;
    }
    int inplace = 0;
    if (oo != Py_None) {
        if (!(out = q_out(oo, x, fn, &inplace))) goto done;
    } else {
        out = csa_is_bf16(x) ? csa_empty_like_dtype(x, PyArray_NDIM(x), PyArray_DIMS(x))
                             : q_new_aligned(PyArray_NDIM(x), PyArray_DIMS(x));
        if (!out) goto done;
    }
    if (inplace) {
        /* out is x's own memory, so it must be writeable: q_out checked that. */
        if (csa_run_rows(out, out, fn, q_hadamard_kernel, &scale)) goto done;
    } else if (csa_run_rows(x, out, fn, q_hadamard_kernel, &scale)) {
        goto done;
    }
    if (oo != Py_None) {
        ret = oo;
        Py_INCREF(ret);
    } else {
        ret = (PyObject *)out;
        out = NULL;
    }
done:
    Py_XDECREF(x);
    Py_XDECREF(out);
    return ret;
}

PyMethodDef csa_quant_methods[] = {
    {"fp8_round", (PyCFunction)(void (*)(void))py_fp8_round, METH_VARARGS | METH_KEYWORDS,
     fp8_round_doc},
    {"fp4_round", (PyCFunction)(void (*)(void))py_fp4_round, METH_VARARGS | METH_KEYWORDS,
     fp4_round_doc},
    {"hadamard", (PyCFunction)(void (*)(void))py_hadamard, METH_VARARGS | METH_KEYWORDS,
     hadamard_doc},
    {NULL, NULL, 0, NULL},
};
