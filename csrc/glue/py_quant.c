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

/* ------------------------------------------------------------ fp4_pack / fp4_unpack */

#include <stdlib.h>
#include "../qpack.h"


PyDoc_STRVAR(fp4_pack_doc,
"fp4_pack(x, *, round=False, out=None)\n--\n\n"
"FP4 rows (docs/kernels.md, section 4, \"FP4 key rows\"): the indexer's key cache format.\n"
"Each row of D features (D % 32 == 0) becomes D // 2 + D // 32 bytes: bytes\n"
"0 .. D/2 - 1 hold the e2m1 codes (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6)\n"
"two a byte, element 2i in the low nibble (torch's float4_e2m1fn_x2), then one ue8m0\n"
"byte per block of 32 features, the exponent field of the block's power-of-two scale\n"
"(127 = 2**0; 0xff = NaN).  D = 128: 68 bytes instead of 512 (float32).\n\n"
"x     : float32 or bfloat16 [..., D], any strides.  With round=False (default) every\n"
"        block must already be on its FP4 grid, i.e. fp4_round(x, 32) == x bitwise (as\n"
"        the QAT-rounded index keys are): otherwise ValueError naming the first row and\n"
"        block that is not.  round=True rounds as fp4_round(x, 32) does first.\n"
"out   : uint8 [..., D // 2 + D // 32] or None.\n"
"fp4_unpack(fp4_pack(x)) == fp4_round(x, 32) bitwise.  Returns out (a new array when\n"
"out is None).");

static PyObject *py_fp4_pack(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "fp4_pack";
    static char *kwlist[] = {"x", "round", "out", NULL};
    PyObject *xo, *ro = Py_False, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OO:fp4_pack", kwlist, &xo, &ro, &oo))
        return NULL;
    const int rnd = PyObject_IsTrue(ro);
    if (rnd < 0) return NULL;
    PyArrayObject *x = NULL, *xc = NULL, *res = NULL, *out = NULL;
    PyObject *ret = NULL;
    char b1[256], b2[256];
    if (!(x = csa_array(xo, fn, "x", CSA_F32 | CSA_BF16, 1, NPY_MAXDIMS, 0))) goto done;
    const int nd = PyArray_NDIM(x);
    const npy_intp D = PyArray_DIM(x, nd - 1);
    if (D % 32) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): the last dimension of 'x' must be a multiple of 32 (one scale per 32 "
                     "features), got shape %s", fn, csa_shape_str(x, b1, sizeof b1));
        goto done;
    }
    npy_intp shape[NPY_MAXDIMS];
    for (int i = 0; i < nd; i++) shape[i] = PyArray_DIM(x, i);
    const npy_intp W = D / 2 + D / 32;
    shape[nd - 1] = W;
    if (oo != Py_None) {
        if (!(out = csa_u8_view(oo))) {
            PyErr_Format(PyExc_TypeError, "%s(): 'out' must be a uint8 array, got %s", fn,
                         Py_TYPE(oo)->tp_name);
            goto done;
        }
        int same = PyArray_NDIM(out) == nd;
        for (int i = 0; same && i < nd; i++) same = PyArray_DIM(out, i) == shape[i];
        if (!same) {
            PyArrayObject *tmp = (PyArrayObject *)PyArray_EMPTY(nd, shape, NPY_UINT8, 0);
            if (tmp) {
                PyErr_Format(PyExc_ValueError, "%s(): 'out' must have shape %s, got %s", fn,
                             csa_shape_str(tmp, b1, sizeof b1), csa_shape_str(out, b2, sizeof b2));
                Py_DECREF(tmp);
            }
            goto done;
        }
        if (!PyArray_ISWRITEABLE(out)) {
            PyErr_Format(PyExc_ValueError, "%s(): 'out' must be writeable", fn);
            goto done;
        }
        if (csa_self_overlap(out)) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'out' must not have overlapping elements (a zero or overlapping "
                         "stride)", fn);
            goto done;
        }
        if (csa_may_overlap(out, x)) {
            PyErr_Format(PyExc_ValueError, "%s(): 'out' must not overlap 'x'", fn);
            goto done;
        }
    }
    if (!(xc = (PyArrayObject *)PyArray_NewCopy(x, NPY_CORDER))) goto done;
    if (!(res = (PyArrayObject *)PyArray_EMPTY(nd, shape, NPY_UINT8, 0))) goto done;
    const int bf = csa_is_bf16(x);
    const csa_idx rows = D ? (csa_idx)(PyArray_SIZE(x) / D) : 0;
    int st = CSA_OK;
    csa_idx bad = -1;
    float bad_v = 0, bad_r = 0;
    Py_BEGIN_ALLOW_THREADS
    const size_t n = (size_t)rows * (size_t)D;
    float *xf = NULL, *rf = NULL;
    if (bf) {
        xf = malloc((n ? n : 1) * sizeof(float));
        if (!xf) st = CSA_ENOMEM;
        const csa_bf16 *s16 = (const csa_bf16 *)PyArray_DATA(xc);
        for (size_t i = 0; !st && i < n; i++) xf[i] = csa_bf16_to_f32(s16[i]);
    }
    const float *src = bf ? xf : (const float *)PyArray_DATA(xc);
    if (!st && !rnd) {
        rf = malloc((n ? n : 1) * sizeof(float));
        if (!rf) st = CSA_ENOMEM;
        if (!st)
            st = csa_quant_round(src, rows, D, D, 1, 32, CSA_Q_E2M1, CSA_QS_UE8M0, rf, D, 1);
        for (size_t i = 0; !st && i < n; i++) {
            uint32_t a, b;
            memcpy(&a, src + i, 4);
            memcpy(&b, rf + i, 4);
            if (a != b && !(src[i] != src[i] && rf[i] != rf[i])) {
                bad = (csa_idx)i;
                bad_v = src[i];
                bad_r = rf[i];
                break;
            }
        }
    }
    uint8_t *q = (uint8_t *)PyArray_DATA(res);
    if (!st && bad < 0 && rows > 0)
        st = csa_quant_pack(src, 0, rows, D, D, 1, 32, CSA_Q_E2M1, CSA_QS_UE8M0, q, W, q + D / 2,
                            1, W, 1);
    free(xf);
    free(rf);
    Py_END_ALLOW_THREADS
    if (st) {
        csa_raise_status(st, fn);
        goto done;
    }
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'x' is not on the FP4 grid of its block (block 32, ue8m0 scale): row "
                     "%lld (of the leading axes flattened), block %lld (features %lld..%lld) "
                     "holds %R at feature %lld, which rounds to %R; pass round=True to round",
                     fn, (long long)(bad / D), (long long)(bad % D / 32),
                     (long long)(bad % D / 32 * 32), (long long)(bad % D / 32 * 32 + 31),
                     PyFloat_FromDouble(bad_v), (long long)(bad % D), PyFloat_FromDouble(bad_r));
        goto done;
    }
    if (out) {
        if (PyArray_CopyInto(out, res)) goto done;
        ret = oo;
        Py_INCREF(ret);
    } else {
        ret = (PyObject *)res;
        res = NULL;
    }
done:
    Py_XDECREF(x);
    Py_XDECREF(xc);
    Py_XDECREF(res);
    Py_XDECREF(out);
    return ret;
}

PyDoc_STRVAR(fp4_unpack_doc,
"fp4_unpack(p, *, out=None)\n--\n\n"
"The float32 values of FP4 rows (fp4_pack's format, docs/kernels.md section 4):\n"
"p : uint8 [..., W] with W = D // 2 + D // 32 (W % 17 == 0), any strides.\n"
"Returns float32 [..., D]: e2m1(code) * 2**(e - 127) per element (NaN where the\n"
"block's byte is 0xff), exact.  out: float32 [..., D] or None.");

static PyObject *py_fp4_unpack(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "fp4_unpack";
    static char *kwlist[] = {"p", "out", NULL};
    PyObject *po, *oo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$O:fp4_unpack", kwlist, &po, &oo)) return NULL;
    PyArrayObject *p = csa_u8_view(po), *pc = NULL, *out = NULL, *work = NULL;
    PyObject *ret = NULL;
    char b1[256];
    if (!p) {
        PyErr_Format(PyExc_TypeError, "%s(): 'p' must be a uint8 array of FP4 rows, got %s", fn,
                     Py_TYPE(po)->tp_name);
        return NULL;
    }
    const int nd = PyArray_NDIM(p);
    const npy_intp W = nd ? PyArray_DIM(p, nd - 1) : -1;
    if (nd < 1 || W % 17) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'p' must have a last dimension D/2 + D/32 (a multiple of 17 bytes), "
                     "got shape %s", fn, csa_shape_str(p, b1, sizeof b1));
        goto done;
    }
    const npy_intp D = W / 17 * 32;
    npy_intp shape[NPY_MAXDIMS];
    for (int i = 0; i < nd; i++) shape[i] = PyArray_DIM(p, i);
    shape[nd - 1] = D;
    PyArrayObject *ins[1] = {p};
    if (!(out = csa_out_array(oo, fn, nd, shape, NULL, NPY_FLOAT32, ins, 1, 0, NULL))) goto done;
    if (!(work = csa_work_array(out, CSA_WORK_C_CONTIG))) goto done;
    if (!(pc = (PyArrayObject *)PyArray_NewCopy(p, NPY_CORDER))) goto done;
    Py_BEGIN_ALLOW_THREADS
    static const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    const uint8_t *src = (const uint8_t *)PyArray_DATA(pc);
    float *dst = (float *)PyArray_DATA(work);
    const npy_intp rows = D ? PyArray_SIZE(work) / D : 0;
    for (npy_intp r = 0; r < rows; r++) {
        const uint8_t *row = src + r * W;
        float *o = dst + r * D;
        for (npy_intp j = 0; j < D / 32; j++) {
            const uint8_t e = row[D / 2 + j];
            union { uint32_t u; float f; } sc = {e ? (uint32_t)e << 23 : 0x00400000u};
            if (e == 0xff) sc.u = 0x7fc00000u;
            for (npy_intp i = 32 * j; i < 32 * j + 32; i++)
                o[i] = e2m1[(row[i >> 1] >> (4 * (i & 1))) & 15] * sc.f;
        }
    }
    Py_END_ALLOW_THREADS
    ret = csa_finish(CSA_OK, fn, oo, out, work);
done:
    Py_XDECREF(p);
    Py_XDECREF(pc);
    Py_XDECREF(out);
    Py_XDECREF(work);
    return ret;
}

PyMethodDef csa_quant_methods[] = {
    {"fp4_pack", (PyCFunction)(void (*)(void))py_fp4_pack, METH_VARARGS | METH_KEYWORDS,
     fp4_pack_doc},
    {"fp4_unpack", (PyCFunction)(void (*)(void))py_fp4_unpack, METH_VARARGS | METH_KEYWORDS,
     fp4_unpack_doc},
    {"fp8_round", (PyCFunction)(void (*)(void))py_fp8_round, METH_VARARGS | METH_KEYWORDS,
     fp8_round_doc},
    {"fp4_round", (PyCFunction)(void (*)(void))py_fp4_round, METH_VARARGS | METH_KEYWORDS,
     fp4_round_doc},
    {"hadamard", (PyCFunction)(void (*)(void))py_hadamard, METH_VARARGS | METH_KEYWORDS,
     hadamard_doc},
    {NULL, NULL, 0, NULL},
};
