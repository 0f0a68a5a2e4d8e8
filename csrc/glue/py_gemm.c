/* fp8_gemm, fp4_gemm, fp8_quant, fp4_quant, hc_split_sinkhorn (docs/kernels.md section 9). */
#include "glue.h"

#include <math.h>
#include <string.h>

#include "../gemm.h"
#include "../qpack.h"
#include "../quant.h"
#include "../sinkhorn.h"

/* The Python entry point `name`: the body shared by one family (g_gemm, g_quant) run
 * for one format, under the function's own name (its errors say which was called). */
#define G_ENTRY(name, body, fmt)                                                   \
    static PyObject *py_##name(PyObject *self, PyObject *args, PyObject *kw)      \
    {                                                                              \
        return body(args, kw, #name, fmt);                                         \
    }

/* Accepted byte formats of an argument (besides float32 / bfloat16 via csa_array). */
#define G_E4M3 16   /* uint8 codes, ml_dtypes float8_e4m3fn, torch float8_e4m3fn */
#define G_E8M0 32   /* uint8 codes, ml_dtypes / torch float8_e8m0fnu */
#define G_FP4X2 64  /* uint8 bytes, torch float4_e2m1fn_x2 */

static const char *g_kinds_str(int kinds)
{
    if (kinds == G_E4M3) return "float8_e4m3fn (or uint8 codes)";
    if (kinds == G_FP4X2) return "float4_e2m1fn_x2 (or uint8 bytes)";
    if (kinds == (G_E8M0 | CSA_F32)) return "float32 or float8_e8m0fnu (or uint8 codes)";
    if (kinds == (G_E4M3 | CSA_F32)) return "float32 or float8_e4m3fn (or uint8 codes)";
    return "float32";
}

/* The name of a 1-byte dtype this argument accepts, given a dtype's name. */
static int g_byte_name_ok(const char *nm, int kinds)
{
    size_t n = strlen(nm);
#define ENDS(s) (n >= sizeof(s) - 1 && strcmp(nm + n - (sizeof(s) - 1), s) == 0)
    if (ENDS("uint8")) return 1;
    if ((kinds & G_E4M3) && ENDS("float8_e4m3fn")) return 1;
    if ((kinds & G_E8M0) && ENDS("float8_e8m0fnu")) return 1;
    if ((kinds & G_FP4X2) && ENDS("float4_e2m1fn_x2")) return 1;
    return 0;
#undef ENDS
}

/* An ndarray over obj's memory: float32 (when CSA_F32 is in kinds, through csa_array)
 * or the bytes of a 1-byte format viewed as uint8 (*bytes = 1).  Torch tensors of
 * float8 / float4 dtypes are viewed as uint8 without a copy; GEMM operands are weights
 * and their scales (nn.Parameters that may require grad), so tensors are detached. */
static PyArrayObject *g_arr(PyObject *obj, const char *fn, const char *name, int kinds,
                            int min_nd, int max_nd, int *bytes)
{
    *bytes = 0;
    if (obj == NULL || obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array, got None", fn, name,
                     g_kinds_str(kinds));
        return NULL;
    }
    PyObject *src = NULL;   /* new reference: an ndarray candidate */
    char nm[64];
    int st;
    PyObject *tv = csa_torch_view(obj, CSA_TV_BYTES | CSA_TV_DETACH, &st, nm, sizeof nm);
    if (st != CSA_TV_NOT_TENSOR) {
        const int ok = g_byte_name_ok(nm, kinds);
        if (!ok && !(kinds & (CSA_F32 | CSA_BF16))) {
            Py_XDECREF(tv);
            PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s tensor, got dtype %s", fn,
                         name, g_kinds_str(kinds), nm);
            return NULL;
        }
        if (ok && !tv) {
            PyErr_Format(PyExc_TypeError,
                         "%s(): '%s' is a torch tensor NumPy cannot view (on a GPU?); "
                         "pass t.cpu()", fn, name);
            return NULL;
        }
        if (ok) {
            src = tv;   /* a byte format: its uint8 view */
            tv = NULL;
        } else if (tv && PyArray_ITEMSIZE((PyArrayObject *)tv) == 1) {
            Py_DECREF(tv);   /* a 1-byte dtype not accepted here: csa_array names it */
            tv = NULL;
        }
    }
    /* tv: a float tensor's view (NULL if none), which csa_array takes instead of obj */
    if (!src && PyArray_Check(obj) && PyArray_ITEMSIZE((PyArrayObject *)obj) == 1 &&
        PyArray_TYPE((PyArrayObject *)obj) != NPY_BOOL &&
        PyArray_TYPE((PyArrayObject *)obj) != NPY_INT8) {
        if (g_byte_name_ok(PyArray_DESCR((PyArrayObject *)obj)->typeobj->tp_name, kinds) ||
            PyArray_TYPE((PyArrayObject *)obj) == NPY_UINT8) {
            Py_INCREF(obj);
            src = obj;
        }
    }
    if (src) {
        PyArrayObject *a = (PyArrayObject *)src;
        PyArray_Descr *u8 = PyArray_DescrFromType(NPY_UINT8);
        PyArrayObject *v = (PyArrayObject *)PyArray_View(a, u8, NULL);   /* steals u8 */
        Py_DECREF(src);
        if (!v) return NULL;
        const int nd = PyArray_NDIM(v);
        if (nd < min_nd || nd > max_nd) {
            char buf[256];
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must have %d to %d dimensions, got %d "
                         "(shape %s)", fn, name, min_nd, max_nd, nd,
                         csa_shape_str(v, buf, sizeof buf));
            Py_DECREF(v);
            return NULL;
        }
        *bytes = 1;
        return v;
    }
    if (kinds & (CSA_F32 | CSA_BF16)) {
        PyArrayObject *a = csa_array(tv ? tv : obj, fn, name, kinds & (CSA_F32 | CSA_BF16),
                                     min_nd, max_nd, 0);
        Py_XDECREF(tv);
        if (!a && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array (%S)", fn, name,
                         g_kinds_str(kinds), v ? v : Py_None);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        return a;
    }
    Py_XDECREF(tv);
    PyObject *d = PyArray_Check(obj) ? PyObject_Str((PyObject *)PyArray_DESCR((PyArrayObject *)obj))
                                     : NULL;
    PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array, got %s", fn, name,
                 g_kinds_str(kinds), d ? PyUnicode_AsUTF8(d) : Py_TYPE(obj)->tp_name);
    Py_XDECREF(d);
    return NULL;
}

/* a itself (a new reference) when its leading dimensions fold into *rows rows of stride
 * *rs (and, with unit_last, its last stride is 1), else a C-contiguous copy of it. */
static PyArrayObject *g_rows(PyArrayObject *a, int unit_last, csa_idx *rows, csa_idx *rs)
{
    const int nd = PyArray_NDIM(a);
    if ((!unit_last || PyArray_DIM(a, nd - 1) <= 1 || csa_stride(a, nd - 1) == 1) &&
        !csa_fold_rows(a, rows, rs)) {
        Py_INCREF(a);
        return a;
    }
    PyArrayObject *c = (PyArrayObject *)PyArray_NewCopy(a, NPY_CORDER);
    if (c) csa_fold_rows(c, rows, rs);
    return c;
}

/* The kernel's status raised, or the tuple (r0, r1[, r2]) of new arrays (r2 may be NULL). */
static PyObject *g_results(int st, const char *fn, PyArrayObject *r0, PyArrayObject *r1,
                           PyArrayObject *r2)
{
    if (st) {
        csa_raise_status(st, fn);
        return NULL;
    }
    return r2 ? PyTuple_Pack(3, (PyObject *)r0, (PyObject *)r1, (PyObject *)r2)
              : PyTuple_Pack(2, (PyObject *)r0, (PyObject *)r1);
}

/* shape = a.shape[:-1] + (last,) */
static void g_shape(PyArrayObject *a, npy_intp last, npy_intp *shape)
{
    const int nd = PyArray_NDIM(a);
    for (int i = 0; i < nd - 1; i++) shape[i] = PyArray_DIM(a, i);
    shape[nd - 1] = last;
}

/* The bfloat16 dtype (ml_dtypes), new reference. */
static PyArray_Descr *g_bf16_descr(void)
{
    PyObject *mld = PyImport_ImportModule("ml_dtypes");
    PyObject *t = mld ? PyObject_GetAttrString(mld, "bfloat16") : NULL;
    PyArray_Descr *d = NULL;
    if (t && !PyArray_DescrConverter(t, &d)) d = NULL;
    Py_XDECREF(mld);
    Py_XDECREF(t);
    return d;
}

/* Parses out_dtype: 1 = bfloat16, 0 = float32, -1 = None; -2 on error. */
static int g_out_dtype(PyObject *o, const char *fn)
{
    if (!o || o == Py_None) return -1;
    const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
    if (s && strcmp(s, "bfloat16") == 0) return 1;
    if (s && strcmp(s, "float32") == 0) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): 'out_dtype' must be 'bfloat16' or 'float32', got %R",
                 fn, o);
    return -2;
}

/* ------------------------------------------------------------ fp8_gemm / fp4_gemm */

static PyObject *g_gemm(PyObject *args, PyObject *kw, const char *fn, int wfmt)
{
    static char *kwlist[] = {"a", "a_s", "b", "b_s", "b_index", "out_dtype", "out", NULL};
    PyObject *ao, *aso, *bo, *bso, *bio = Py_None, *odo = Py_None, *oo = Py_None;
    char spec[40];
    snprintf(spec, sizeof spec, "OOOO|$OOO:%s", fn);
    if (!PyArg_ParseTupleAndKeywords(args, kw, spec, kwlist, &ao, &aso, &bo, &bso, &bio, &odo,
                                     &oo))
        return NULL;
    PyArrayObject *a = NULL, *as = NULL, *b = NULL, *bs = NULL, *out = NULL, *ac = NULL,
                  *asc = NULL, *tmp = NULL, *bi = NULL, *bic = NULL;
    PyObject *ret = NULL;
    /* with b_index, b and b_s stack E weights: their dimensions shift by one */
    const int o = bio != Py_None;
    char b1[256], b2[256];
    int by;
    const int fp8 = wfmt == CSA_W_E4M3;
    const int odt = g_out_dtype(odo, fn);
    if (odt == -2) goto done;
    int as_bytes, bs_bytes;
    if (!(a = g_arr(ao, fn, "a", G_E4M3, 1, NPY_MAXDIMS, &by))) goto done;
    if (!(as = g_arr(aso, fn, "a_s", CSA_F32 | G_E8M0, 1, NPY_MAXDIMS, &as_bytes))) goto done;
    if (!(b = g_arr(bo, fn, "b", fp8 ? G_E4M3 : G_FP4X2, 2 + o, 2 + o, &by))) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) {   /* the rank: say what the other one means */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_Format(PyExc_ValueError, "%S (%s)", v ? v : Py_None,
                         o ? "with b_index, b stacks E weights: [E, N, K]"
                           : "a stack of weights [E, N, K] takes b_index");
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        goto done;
    }
    if (!(bs = g_arr(bso, fn, "b_s", CSA_F32 | G_E8M0, 2 + o, 2 + o, &bs_bytes))) goto done;
    const int nd = PyArray_NDIM(a);
    const npy_intp K = PyArray_DIM(a, nd - 1), N = PyArray_DIM(b, o), E = o ? PyArray_DIM(b, 0) : 1;
    const npy_intp KB = (K + 127) / 128;
    if (o && csa_check_dim(bs, fn, "b_s", 0, E, "E = b.shape[0], one scale array a weight"))
        goto done;
    if (fp8) {
        if (csa_check_dim(b, fn, "b", o + 1, K, "K = a.shape[-1]")) goto done;
        if (csa_check_dim(bs, fn, "b_s", o, (N + 127) / 128, "ceil(N / 128)")) goto done;
        if (csa_check_dim(bs, fn, "b_s", o + 1, KB, "ceil(K / 128)")) goto done;
    } else {
        if (K % 2) {
            PyErr_Format(PyExc_ValueError, "%s(): 'a' must have an even K (shape %s): FP4 "
                         "weights pack two values a byte", fn, csa_shape_str(a, b1, sizeof b1));
            goto done;
        }
        if (csa_check_dim(b, fn, "b", o + 1, K / 2, "K / 2 = a.shape[-1] / 2, two values a byte"))
            goto done;
        if (csa_check_dim(bs, fn, "b_s", o, N, o ? "N = b.shape[1]" : "N = b.shape[0]"))
            goto done;
        if (csa_check_dim(bs, fn, "b_s", o + 1, (K + 31) / 32, "ceil(K / 32)")) goto done;
    }
    if (PyArray_NDIM(as) != nd) {
        PyErr_Format(PyExc_ValueError, "%s(): 'a_s' must have the rank of 'a' (shape %s), got "
                     "shape %s", fn, csa_shape_str(a, b1, sizeof b1), csa_shape_str(as, b2, sizeof b2));
        goto done;
    }
    for (int i = 0; i < nd - 1; i++)
        if (csa_check_dim(as, fn, "a_s", i, PyArray_DIM(a, i), "a's leading dims")) goto done;
    if (csa_check_dim(as, fn, "a_s", nd - 1, KB, "ceil(K / 128), one scale per 128 of K"))
        goto done;
    if (PyArray_DIM(b, o + 1) > 1 && csa_stride(b, o + 1) != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): 'b' must have contiguous rows (unit last stride), "
                     "got a last stride of %lld bytes; weights are read as they are stored",
                     fn, (long long)PyArray_STRIDE(b, o + 1));
        goto done;
    }
    if (o) {
        if (!(bi = csa_array(bio, fn, "b_index", CSA_I32, nd - 1, nd - 1, 0))) goto done;
        for (int i = 0; i < nd - 1; i++)
            if (csa_check_dim(bi, fn, "b_index", i, PyArray_DIM(a, i), "a.shape[:-1]")) goto done;
        if (!(bic = (PyArrayObject *)PyArray_FROMANY((PyObject *)bi, NPY_INT32, 0, 0,
                                                     NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED)))
            goto done;
        const int32_t *ix = PyArray_DATA(bic);
        for (npy_intp i = 0; i < PyArray_SIZE(bic); i++)
            if (ix[i] < -1 || ix[i] >= E) {
                PyErr_Format(PyExc_ValueError, "%s(): 'b_index' must be -1 (no weight: a zero "
                             "row) or in [0, %lld) (E = b.shape[0] weights), got %d at flat "
                             "position %lld", fn,
                             (long long)E, (int)ix[i], (long long)i);
                goto done;
            }
    }
    npy_intp shape[NPY_MAXDIMS];
    g_shape(a, N, shape);
    int bf16;
    if (oo == Py_None) {
        bf16 = odt != 0;
        PyArray_Descr *d = bf16 ? g_bf16_descr() : PyArray_DescrFromType(NPY_FLOAT32);
        if (!d) goto done;
        out = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, d, nd, shape, NULL, NULL, 0, NULL);
        if (!out) goto done;
    } else {
        if (!(out = csa_array(oo, fn, "out", CSA_F32 | CSA_BF16, nd, nd, 1))) goto done;
        bf16 = csa_is_bf16(out);
        if (odt >= 0 && odt != bf16) {
            PyErr_Format(PyExc_ValueError, "%s(): 'out' is %s but out_dtype is %R", fn,
                         bf16 ? "bfloat16" : "float32", odo);
            goto done;
        }
        for (int i = 0; i < nd; i++)
            if (PyArray_DIM(out, i) != shape[i]) {
                PyErr_Format(PyExc_ValueError, "%s(): 'out' must have shape a.shape[:-1] + "
                             "(N,), got %s", fn, csa_shape_str(out, b1, sizeof b1));
                goto done;
            }
        PyArrayObject *ins[5] = {a, as, b, bs, bi};
        for (int i = 0; i < 5; i++)
            if (ins[i] && csa_may_overlap(out, ins[i])) {
                PyErr_Format(PyExc_ValueError, "%s(): 'out' overlaps an input; pass a separate "
                             "array", fn);
                goto done;
            }
    }
    csa_idx rows, sa_row, sas_row, so_row;
    if (!(ac = g_rows(a, 1, &rows, &sa_row))) goto done;
    if (!(asc = g_rows(as, 0, &rows, &sas_row))) goto done;
    PyArrayObject *dst = out;
    if (csa_fold_rows(out, &rows, &so_row) || (N > 1 && csa_stride(out, nd - 1) != 1)) {
        if (!(tmp = csa_empty_like_dtype(out, nd, shape))) goto done;
        dst = tmp;
        csa_fold_rows(tmp, &rows, &so_row);
    }
    struct csa_gemm_args g = {
        .a = PyArray_DATA(ac), .M = rows, .K = K, .sa_row = sa_row,
        .as = PyArray_DATA(asc), .as_fmt = as_bytes ? CSA_S_E8M0 : CSA_S_F32,
        .sas_row = sas_row, .sas_col = csa_stride(asc, nd - 1),
        .b = PyArray_DATA(b), .b_fmt = wfmt, .N = N, .sb_row = PyArray_STRIDE(b, o),
        .bs = PyArray_DATA(bs), .bs_fmt = bs_bytes ? CSA_S_E8M0 : CSA_S_F32,
        .sbs_row = csa_stride(bs, o), .sbs_col = csa_stride(bs, o + 1),
        .out = PyArray_DATA(dst), .out_bf16 = bf16, .so_row = so_row,
    };
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = o ? csa_gemm_indexed(&g, PyArray_DATA(bic), PyArray_STRIDE(b, 0), PyArray_STRIDE(bs, 0))
           : csa_gemm(&g);
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, out, tmp);
done:
    Py_XDECREF(a);
    Py_XDECREF(as);
    Py_XDECREF(b);
    Py_XDECREF(bs);
    Py_XDECREF(out);
    Py_XDECREF(ac);
    Py_XDECREF(asc);
    Py_XDECREF(tmp);
    Py_XDECREF(bi);
    Py_XDECREF(bic);
    return ret;
}

PyDoc_STRVAR(fp8_gemm_doc,
"fp8_gemm(a, a_s, b, b_s, *, b_index=None, out_dtype=None, out=None)\n--\n\n"
"Block-scaled FP8 GEMM, the released kernel.fp8_gemm (docs/kernels.md section 9):\n"
"C[m, n] = sum over 128-blocks kb of (sum_k a[m, k] b[n, k]) * a_s[m, kb] *\n"
"b_s[n // 128, kb], each block's partial sum in float32, scaled and added into a\n"
"float32 accumulator by one FMA; stored as bfloat16 (default) or float32.\n\n"
"a   : [..., K] float8_e4m3fn (ml_dtypes / torch) or uint8 codes, any strides.\n"
"a_s : [..., ceil(K/128)] float32, or float8_e8m0fnu / uint8 e8m0 codes.\n"
"b   : [N, K] float8_e4m3fn or uint8 codes, rows with a unit last stride.\n"
"b_s : [ceil(N/128), ceil(K/128)] float32 or e8m0.\n"
"out_dtype : 'bfloat16' (default) or 'float32'; out: [..., N] of that dtype or None.\n"
"b_index : None, or int32 [...] (a.shape[:-1]) with b [E, N, K] and b_s [E, ceil(N/128),\n"
"    ceil(K/128)] stacking E weights: row a[i] is multiplied by weight b[b_index[i]]\n"
"    (routed experts; a grouped projection as rows t * G + g against weight g), and\n"
"    b_index[i] = -1 makes row i of out zeros (no weight: an empty expert slot).  The\n"
"    evenly spaced rows of one weight run as one GEMM and the one-row GEMMs share one\n"
"    parallel region; the bits are those of fp8_gemm on each such group of rows.\n"
"The block sums have one fixed order (csrc/gemm.h), so the bits are the same at every\n"
"ISA level and thread count.  Returns out (new when None).");

G_ENTRY(fp8_gemm, g_gemm, CSA_W_E4M3)

PyDoc_STRVAR(fp4_gemm_doc,
"fp4_gemm(a, a_s, b, b_s, *, b_index=None, out_dtype=None, out=None)\n--\n\n"
"FP8 activations times FP4 (e2m1) weights, the released kernel.fp4_gemm: as fp8_gemm\n"
"with b [N, K/2] two e2m1 values a byte (element 2i in the low nibble, torch's\n"
"float4_e2m1fn_x2; uint8 accepted) and b_s [N, ceil(K/32)] (float32 or e8m0), one\n"
"scale per 32 along K; the partial sums are per 32-block, each scaled by\n"
"a_s[m, k // 128] * b_s[n, k // 32].  b_index as fp8_gemm's, with b [E, N, K/2] and\n"
"b_s [E, N, ceil(K/32)].  Returns out (bfloat16 by default).");

G_ENTRY(fp4_gemm, g_gemm, CSA_W_E2M1)

/* ------------------------------------------------------------ fp8_quant / fp4_quant */

static int g_choice(PyObject *o, const char *fn, const char *name, const char *const *names,
                    int n, int dflt)
{
    if (!o || o == Py_None) return dflt;
    const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
    for (int i = 0; s && i < n; i++)
        if (strcmp(s, names[i]) == 0) return i;
    if (!s)
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a str, got %s", fn, name,
                     Py_TYPE(o)->tp_name);
    else
        PyErr_Format(PyExc_ValueError, "%s(): '%s' must be one of '%s', '%s'%s%s%s, got %R", fn,
                     name, names[0], names[1], n > 2 ? ", '" : "", n > 2 ? names[2] : "",
                     n > 2 ? "'" : "", o);
    return -1;
}

static PyObject *g_quant(PyObject *args, PyObject *kw, const char *fn, int fmt)
{
    static char *kwlist[] = {"x", "block", "scale", "scale_dtype", NULL};
    PyObject *xo, *bo = NULL, *so = Py_None, *sdo = Py_None;
    char spec[40];
    snprintf(spec, sizeof spec, "O|O$OO:%s", fn);
    if (!PyArg_ParseTupleAndKeywords(args, kw, spec, kwlist, &xo, &bo, &so, &sdo)) return NULL;
    const int fp8 = fmt == CSA_Q_E4M3;
    long long block = fp8 ? 128 : 32;
    if (bo && bo != Py_None && csa_int_arg(bo, fn, "block", 1, (long long)1 << 40, &block))
        return NULL;
    static const char *const s8[] = {"ue8m0", "fp32"}, *const s4[] = {"ue8m0", "e4m3"};
    static const char *const d8[] = {"float32", "e8m0"}, *const d4[] = {"e8m0", "e4m3", "float32"};
    const int sc = g_choice(so, fn, "scale", fp8 ? s8 : s4, 2, 0);
    if (sc < 0) return NULL;
    const int scale = fp8 ? (sc ? CSA_QS_FP32 : CSA_QS_UE8M0) : (sc ? CSA_QS_E4M3 : CSA_QS_UE8M0);
    int sd = g_choice(sdo, fn, "scale_dtype", fp8 ? d8 : d4, fp8 ? 2 : 3, fp8 ? 0 : sc);
    if (sd < 0) return NULL;
    /* s_bytes: fp8 'e8m0'; fp4 'e8m0' / 'e4m3' (which must match the scale rule) */
    const int s_bytes = fp8 ? sd == 1 : sd != 2;
    if (s_bytes && scale == CSA_QS_FP32) {
        PyErr_Format(PyExc_ValueError, "%s(): scale_dtype='e8m0' needs scale='ue8m0' (float32 "
                     "scales are not powers of two)", fn);
        return NULL;
    }
    if (!fp8 && s_bytes && sd != sc) {
        PyErr_Format(PyExc_ValueError, "%s(): scale_dtype=%R does not hold scale=%R scales", fn,
                     sdo, so);
        return NULL;
    }
    PyArrayObject *x = NULL, *xc = NULL, *q = NULL, *s = NULL;
    PyObject *ret = NULL;
    char b1[256];
    if (!(x = csa_array(xo, fn, "x", CSA_F32 | CSA_BF16, 1, NPY_MAXDIMS, 0))) goto done;
    const int nd = PyArray_NDIM(x);
    const npy_intp d = PyArray_DIM(x, nd - 1);
    if (d % block || (!fp8 && block % 2)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'block' (%lld) must %sdivide the last dimension "
                     "of 'x' (shape %s)", fn, block, fp8 ? "" : "be even and ",
                     csa_shape_str(x, b1, sizeof b1));
        goto done;
    }
    csa_idx rows, sx_row;
    if (!(xc = g_rows(x, 0, &rows, &sx_row))) goto done;
    npy_intp shape[NPY_MAXDIMS];
    g_shape(x, fp8 ? d : d / 2, shape);
    if (!(q = (PyArrayObject *)PyArray_EMPTY(nd, shape, NPY_UINT8, 0))) goto done;
    shape[nd - 1] = d / block;
    if (!(s = (PyArrayObject *)PyArray_EMPTY(nd, shape, s_bytes ? NPY_UINT8 : NPY_FLOAT32, 0)))
        goto done;
    const int bf16 = csa_is_bf16(xc);
    const csa_idx sx_col = csa_stride(xc, nd - 1), qrow = fp8 ? d : d / 2, srow = d / block;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_quant_pack(PyArray_DATA(xc), bf16, rows, d, sx_row, d > 1 ? sx_col : 1, block, fmt,
                        scale, PyArray_DATA(q), qrow, PyArray_DATA(s), s_bytes, srow, 1);
    Py_END_ALLOW_THREADS
    ret = g_results(st, fn, q, s, NULL);
done:
    Py_XDECREF(x);
    Py_XDECREF(xc);
    Py_XDECREF(q);
    Py_XDECREF(s);
    return ret;
}

PyDoc_STRVAR(fp8_quant_doc,
"fp8_quant(x, block=128, *, scale='ue8m0', scale_dtype='float32')\n--\n\n"
"FP8 e4m3 quantization to codes and scales, the released act_quant(inplace=False):\n"
"per block of the last axis, the scale s of fp8_round (amax floored at 1e-4;\n"
"scale='ue8m0': 2**ceil(log2(amax/448)), 'fp32': amax * float32(1/448)) and the\n"
"codes of e4m3(clamp(x / s, -448, 448)), nearest-even.\n\n"
"x : float32 or bfloat16 [..., D], D a multiple of block, any strides.\n"
"Returns (q, s): q uint8 [..., D] e4m3fn codes (view as float8_e4m3fn), s [..., D/block]\n"
"float32, or uint8 e8m0 codes with scale_dtype='e8m0' (scale='ue8m0' only).\n"
"decode(q) * s is bitwise fp8_round(x, block, scale=scale).");

G_ENTRY(fp8_quant, g_quant, CSA_Q_E4M3)

PyDoc_STRVAR(fp4_quant_doc,
"fp4_quant(x, block=32, *, scale='ue8m0', scale_dtype=None)\n--\n\n"
"FP4 e2m1 quantization to packed codes and scales, the released\n"
"fp4_act_quant(inplace=False): the scale and rounding of fp4_round.  Returns (q, s):\n"
"q uint8 [..., D/2] two codes a byte, element 2i in the low nibble (torch's\n"
"float4_e2m1fn_x2), s [..., D/block] as uint8 e8m0 codes (scale='ue8m0', the default)\n"
"or e4m3 codes (scale='e4m3', V4.1), or float32 with scale_dtype='float32'.");

G_ENTRY(fp4_quant, g_quant, CSA_Q_E2M1)

/* ------------------------------------------------------------ hc_split_sinkhorn */

static PyObject *py_hc_split_sinkhorn(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "hc_split_sinkhorn";
    static char *kwlist[] = {"mixes", "hc_scale", "hc_base", "hc_mult", "sinkhorn_iters", "eps",
                             NULL};
    PyObject *mo, *so, *bo, *ho = NULL, *io = NULL, *eo = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOO:hc_split_sinkhorn", kwlist, &mo, &so,
                                     &bo, &ho, &io, &eo))
        return NULL;
    long long h = 4, iters = 20;
    double eps = 1e-6;
    if (ho && ho != Py_None && csa_int_arg(ho, fn, "hc_mult", 1, 64, &h)) return NULL;
    if (io && io != Py_None && csa_int_arg(io, fn, "sinkhorn_iters", 1, 1 << 20, &iters))
        return NULL;
    if (eo && eo != Py_None) {
        if (csa_float_arg(eo, fn, "eps", &eps)) return NULL;
        if (!isfinite(eps) || eps < 0) return csa_value_error_f(fn, "eps", "finite and >= 0", eps);
    }
    PyArrayObject *m = NULL, *mc = NULL, *sc = NULL, *bc = NULL, *pre = NULL, *post = NULL,
                  *comb = NULL, *s = NULL, *b = NULL;
    PyObject *ret = NULL;
    char b1[256];
    if (!(m = csa_array(mo, fn, "mixes", CSA_F32, 1, NPY_MAXDIMS - 1, 0))) goto done;
    if (!(s = csa_array(so, fn, "hc_scale", CSA_F32, 1, 1, 0))) goto done;
    if (!(b = csa_array(bo, fn, "hc_base", CSA_F32, 1, 1, 0))) goto done;
    const int nd = PyArray_NDIM(m);
    const npy_intp W = (2 + h) * h;
    if (PyArray_DIM(m, nd - 1) != W) {
        PyErr_Format(PyExc_ValueError, "%s(): 'mixes' must have shape[-1] == (2 + hc_mult) * "
                     "hc_mult = %lld, got shape %s", fn, (long long)W,
                     csa_shape_str(m, b1, sizeof b1));
        goto done;
    }
    if (csa_check_dim(s, fn, "hc_scale", 0, 3, "three scales")) goto done;
    if (csa_check_dim(b, fn, "hc_base", 0, W, "(2 + hc_mult) * hc_mult")) goto done;
    csa_idx rows, mrow;
    if (!(mc = g_rows(m, 1, &rows, &mrow))) goto done;
    if (!(sc = (PyArrayObject *)PyArray_FROMANY((PyObject *)s, NPY_FLOAT32, 1, 1,
                                                NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED)))
        goto done;
    if (!(bc = (PyArrayObject *)PyArray_FROMANY((PyObject *)b, NPY_FLOAT32, 1, 1,
                                                NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED)))
        goto done;
    npy_intp shape[NPY_MAXDIMS];
    g_shape(m, h, shape);
    shape[nd] = h;
    if (!(pre = (PyArrayObject *)PyArray_EMPTY(nd, shape, NPY_FLOAT32, 0))) goto done;
    if (!(post = (PyArrayObject *)PyArray_EMPTY(nd, shape, NPY_FLOAT32, 0))) goto done;
    if (!(comb = (PyArrayObject *)PyArray_EMPTY(nd + 1, shape, NPY_FLOAT32, 0))) goto done;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_hc_sinkhorn(PyArray_DATA(mc), rows, mrow, PyArray_DATA(sc), PyArray_DATA(bc), (int)h,
                         (int)iters, (float)eps, PyArray_DATA(pre), PyArray_DATA(post),
                         PyArray_DATA(comb));
    Py_END_ALLOW_THREADS
    ret = g_results(st, fn, pre, post, comb);
done:
    Py_XDECREF(m);
    Py_XDECREF(mc);
    Py_XDECREF(s);
    Py_XDECREF(b);
    Py_XDECREF(sc);
    Py_XDECREF(bc);
    Py_XDECREF(pre);
    Py_XDECREF(post);
    Py_XDECREF(comb);
    return ret;
}

PyDoc_STRVAR(hc_split_sinkhorn_doc,
"hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6)\n--\n\n"
"The released hyper-connection split (docs/kernels.md section 9), float32:\n"
"pre = sigmoid(mixes[..., :h] * hc_scale[0] + hc_base[:h]) + eps;\n"
"post = 2 * sigmoid(mixes[..., h:2h] * hc_scale[1] + hc_base[h:2h]);\n"
"comb = mixes[..., 2h:] viewed [h, h] * hc_scale[2] + hc_base[2h:], then softmax over\n"
"the last axis + eps, divided by its column sums + eps, then sinkhorn_iters - 1 times\n"
"by its row sums + eps and its column sums + eps (the affine maps as one FMA).\n\n"
"mixes: float32 [..., (2 + h) * h]; hc_scale [3]; hc_base [(2 + h) * h].\n"
"Returns (pre [..., h], post [..., h], comb [..., h, h]).");


/* ------------------------------------------------------------ wfp8_gemm */

/* wfp8_gemm (wbf = 0) and wbf16_gemm (wbf = 1: bf16 weights, no scales) */
static PyObject *g_wgemm(PyObject *args, PyObject *kw, const char *fn, int wbf)
{
    static char *kwlist8[] = {"a", "b", "b_s", "groups", "out_dtype", NULL};
    static char *kwlist16[] = {"a", "b", "groups", "out_dtype", NULL};
    PyObject *ao, *bo, *bso = Py_None, *odo = Py_None, *go = NULL;
    long long G = 1;
    if (wbf ? !PyArg_ParseTupleAndKeywords(args, kw, "OO|$OO:wbf16_gemm", kwlist16, &ao, &bo,
                                           &go, &odo)
            : !PyArg_ParseTupleAndKeywords(args, kw, "OOO|$OO:wfp8_gemm", kwlist8, &ao, &bo, &bso,
                                           &go, &odo))
        return NULL;
    if (go && csa_int_arg(go, fn, "groups", 1, (long long)1 << 40, &G)) return NULL;
    PyArrayObject *a = NULL, *b = NULL, *bs = NULL, *ac = NULL, *out = NULL;
    PyObject *ret = NULL;
    char b1[256];
    int by, bs_bytes;
    const int odt = g_out_dtype(odo, fn);
    if (odt == -2) goto done;
    const int ga = G > 1;   /* a [..., G, K] */
    if (!(a = csa_array(ao, fn, "a", CSA_F32 | CSA_BF16, 1 + ga, NPY_MAXDIMS, 0))) goto done;
    if (wbf) {
        bs_bytes = 0;
        if (!(b = csa_array(bo, fn, "b", CSA_BF16, 2, 2, 0))) goto done;
    } else {
        if (!(b = g_arr(bo, fn, "b", G_E4M3, 2, 2, &by))) goto done;
        if (!(bs = g_arr(bso, fn, "b_s", CSA_F32 | G_E8M0, 2, 2, &bs_bytes))) goto done;
    }
    const int nd = PyArray_NDIM(a);
    const npy_intp K = PyArray_DIM(a, nd - 1), N = PyArray_DIM(b, 0);
    if (csa_check_dim(b, fn, "b", 1, K, "K = a.shape[-1]")) goto done;
    if (!wbf) {
        if (csa_check_dim(bs, fn, "b_s", 0, (N + 127) / 128, "ceil(N / 128)")) goto done;
        if (csa_check_dim(bs, fn, "b_s", 1, (K + 127) / 128, "ceil(K / 128)")) goto done;
    }
    if (ga) {
        if (csa_check_dim(a, fn, "a", nd - 2, G, "groups, a is [..., groups, K]")) goto done;
        if (N % G) {
            PyErr_Format(PyExc_ValueError, "%s(): 'b' must have a multiple of groups = %lld "
                         "rows, got %lld", fn, G, (long long)N);
            goto done;
        }
    }
    if (N > 0 && K > 1 && PyArray_STRIDE(b, 1) != PyArray_ITEMSIZE(b)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'b' must have contiguous rows (unit last stride), "
                     "got a last stride of %lld bytes; weights are read as they are stored",
                     fn, (long long)PyArray_STRIDE(b, 1));
        goto done;
    }
    /* the activations as a C-contiguous [rows, (G,) K] array (a copy only if they are not) */
    Py_INCREF(PyArray_DESCR(a));
    if (!(ac = (PyArrayObject *)PyArray_FromArray(a, PyArray_DESCR(a),
                                                  NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED)))
        goto done;
    npy_intp shape[NPY_MAXDIMS];
    for (int i = 0; i < nd - 1 - ga; i++) shape[i] = PyArray_DIM(a, i);
    shape[nd - 1 - ga] = N;
    csa_idx rows = 1;
    for (int i = 0; i < nd - 1 - ga; i++) rows *= shape[i];
    const int bf16 = wbf ? odt == 1 : odt != 0;    /* default: bfloat16 / float32 (wbf16) */
    PyArray_Descr *d = bf16 ? g_bf16_descr() : PyArray_DescrFromType(NPY_FLOAT32);
    if (!d) goto done;
    out = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, d, nd - ga, shape, NULL, NULL, 0,
                                                NULL);
    if (!out) goto done;
    struct csa_wgemm_args g = {
        .a = PyArray_DATA(ac), .a_bf16 = csa_is_bf16(ac), .M = rows, .K = K,
        .sa_row = G * K, .sa_grp = K, .ng_rows = ga ? N / G : 0,
        .b = PyArray_DATA(b), .b_bf16 = wbf, .N = N, .sb_row = PyArray_STRIDE(b, 0),
        .bs = bs ? PyArray_DATA(bs) : NULL, .bs_fmt = bs_bytes ? CSA_S_E8M0 : CSA_S_F32,
        .sbs_row = bs ? csa_stride(bs, 0) : 0, .sbs_col = bs ? csa_stride(bs, 1) : 0,
        .out = PyArray_DATA(out), .out_bf16 = bf16, .so_row = N,
    };
    (void)b1;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_wfp8_gemm(&g);
    Py_END_ALLOW_THREADS
    if (st) {
        csa_raise_status(st, fn);
        goto done;
    }
    Py_INCREF(out);
    ret = (PyObject *)out;
done:
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(bs);
    Py_XDECREF(ac);
    Py_XDECREF(out);
    return ret;
}

static PyObject *py_wfp8_gemm(PyObject *self, PyObject *args, PyObject *kw)
{
    return g_wgemm(args, kw, "wfp8_gemm", 0);
}

static PyObject *py_wbf16_gemm(PyObject *self, PyObject *args, PyObject *kw)
{
    return g_wgemm(args, kw, "wbf16_gemm", 1);
}

PyDoc_STRVAR(wbf16_gemm_doc,
"wbf16_gemm(a, b, *, groups=1, out_dtype=None)\n--\n\n"
"wfp8_gemm's arithmetic against bfloat16 weights b [N, K] (no scales: each 128-block's\n"
"sum added as it is): float32 activations times a float32 weight that is stored as\n"
"bf16, at half its bytes (the released model.py's compressor and head weights).\n"
"Returns [..., N], float32 by default (out_dtype 'bfloat16' rounds once).");

PyDoc_STRVAR(wfp8_gemm_doc,
"wfp8_gemm(a, b, b_s, *, groups=1, out_dtype=None)\n--\n\n"
"Weight-only FP8 GEMM (csrc/gemm.h, csa_wfp8_gemm): float activations as they are\n"
"(float32 or bfloat16, not quantized) times e4m3 weights with 128 x 128 block scales:\n"
"C[m, n] = sum over 128-blocks kb of (sum_k a[m, k] e4m3(b[n, k])) * b_s[n // 128, kb],\n"
"each block's sum over sixteen lanes in a fixed order, float32; stored as bfloat16\n"
"(default) or float32.  The product the released model.py takes as a bf16 einsum\n"
"against its FP8 wo_a widened to bf16, reading half the bytes.\n\n"
"a   : [..., K] float32 or bfloat16; with groups = G > 1, [..., G, K].\n"
"b   : [N, K] float8_e4m3fn or uint8 codes, rows with a unit last stride.\n"
"b_s : [ceil(N/128), ceil(K/128)] float32 or e8m0.\n"
"groups : G > 1 runs G products side by side: out[..., g * N/G + r] =\n"
"    a[..., g, :] . b[g * N/G + r] (the einsum 'bsgd,grd->bsgr').\n"
"The bits are the same at every ISA level and thread count.  Returns [..., N].");

PyMethodDef csa_gemm_methods[] = {
    {"wfp8_gemm", (PyCFunction)(void (*)(void))py_wfp8_gemm, METH_VARARGS | METH_KEYWORDS,
     wfp8_gemm_doc},
    {"wbf16_gemm", (PyCFunction)(void (*)(void))py_wbf16_gemm, METH_VARARGS | METH_KEYWORDS,
     wbf16_gemm_doc},
    {"fp8_gemm", (PyCFunction)(void (*)(void))py_fp8_gemm, METH_VARARGS | METH_KEYWORDS,
     fp8_gemm_doc},
    {"fp4_gemm", (PyCFunction)(void (*)(void))py_fp4_gemm, METH_VARARGS | METH_KEYWORDS,
     fp4_gemm_doc},
    {"fp8_quant", (PyCFunction)(void (*)(void))py_fp8_quant, METH_VARARGS | METH_KEYWORDS,
     fp8_quant_doc},
    {"fp4_quant", (PyCFunction)(void (*)(void))py_fp4_quant, METH_VARARGS | METH_KEYWORDS,
     fp4_quant_doc},
    {"hc_split_sinkhorn", (PyCFunction)(void (*)(void))py_hc_split_sinkhorn,
     METH_VARARGS | METH_KEYWORDS, hc_split_sinkhorn_doc},
    {NULL, NULL, 0, NULL},
};
