/* gated_pool, and the private calls behind deepseek_csa.Compressor. */
#include "glue.h"

#include <math.h>

#include "../pool.h"

/* `ape` as float32: itself (new reference), or for a bfloat16 ape a float32 copy
 * (exact; ape is [ratio, c*D], small beside kv and score). */
static PyArrayObject *ape_f32(PyArrayObject *a)
{
    if (!csa_is_bf16(a)) {
        Py_INCREF(a);
        return a;
    }
    PyArrayObject *o = (PyArrayObject *)PyArray_EMPTY(2, PyArray_DIMS(a), NPY_FLOAT32, 0);
    if (!o) return NULL;
    float *dst = PyArray_DATA(o);
    const npy_intp n0 = PyArray_DIM(a, 0), n1 = PyArray_DIM(a, 1);
    for (npy_intp i = 0; i < n0; i++)
        for (npy_intp j = 0; j < n1; j++)
            dst[i * n1 + j] = csa_bf16_to_f32(*(const csa_bf16 *)PyArray_GETPTR2(a, i, j));
    return o;
}

/* kv / score / ape checks shared by gated_pool and the Compressor: returns c*d. */
static int check_inputs(const char *fn, PyArrayObject *kv, PyArrayObject *score,
                        PyArrayObject *ape, long long ratio, int overlap)
{
    char b1[256], b2[256];
    const npy_intp cd = PyArray_DIM(kv, 2);
    if (overlap && cd % 2) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): with overlap 'kv' must have an even last dimension (2*D), got "
                     "shape %s",
                     fn, csa_shape_str(kv, b1, sizeof b1));
        return -1;
    }
    if (score) {
        if (PyArray_NDIM(score) != 3 || PyArray_DIM(score, 0) != PyArray_DIM(kv, 0) ||
            PyArray_DIM(score, 1) != PyArray_DIM(kv, 1) || PyArray_DIM(score, 2) != cd) {
            PyErr_Format(PyExc_ValueError, "%s(): 'score' must have the shape of 'kv' %s, got %s",
                         fn, csa_shape_str(kv, b1, sizeof b1),
                         csa_shape_str(score, b2, sizeof b2));
            return -1;
        }
    }
    if (ape) {
        if (PyArray_DIM(ape, 0) != ratio || PyArray_DIM(ape, 1) != cd) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'ape' must have shape [ratio, kv.shape[-1]] = [%lld, %lld], got "
                         "%s",
                         fn, ratio, (long long)cd, csa_shape_str(ape, b1, sizeof b1));
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(gated_pool_doc,
"gated_pool(kv, score, ratio, *, ape=None, overlap=False, out=None)\n--\n\n"
"Gated pooling of the complete groups of a prefill (docs/kernels.md, section 3), in float32.\n\n"
"kv, score : float32 or bfloat16 [B, T, c*D], c = 2 with overlap else 1, any strides.\n"
"ratio     : int >= 1, tokens per entry.\n"
"ape       : float32 [ratio, c*D] added to the scores (None: zeros, as in V4.1); a\n"
"            bfloat16 ape is widened to float32 (exact).\n"
"overlap   : V4's ratio-4 scheme: entry g softmaxes over 2*ratio candidates, the\n"
"            tokens of group g-1 through features [0, D) and those of group g through\n"
"            features [D, 2D); group -1 does not exist (weight 0).\n"
"out       : [B, T // ratio, D] of kv's dtype, or None.\n\n"
"Without overlap entry g pools tokens g*ratio .. g*ratio+ratio-1 per feature with\n"
"softmax(score + ape) weights.  Ratio 1 without overlap is V4.1's ungated entry:\n"
"the token's own kv (score is ignored and may be None).  The T % ratio trailing\n"
"tokens make no entry (deepseek_csa.Compressor keeps them for decode).\n\n"
"bfloat16 (ml_dtypes.bfloat16 arrays, torch bfloat16 tensors, viewed without a copy)\n"
"is read as is and widened exactly; all arithmetic is float32.  The result has kv's\n"
"dtype: a bfloat16 kv gives a bfloat16 result rounded once (nearest-even) on store,\n"
"i.e. the float32 result on the widened inputs cast to bfloat16 (the reference's\n"
"pooled `.to(bfloat16)`).  kv and score may differ in dtype (each is widened).\n"
"Returns out [B, T // ratio, D].");

static PyObject *py_gated_pool(PyObject *self, PyObject *args, PyObject *kw)
{
    static const char *fn = "gated_pool";
    static char *kwlist[] = {"kv", "score", "ratio", "ape", "overlap", "out", NULL};
    PyObject *kvo, *so, *ro, *apo = Py_None, *oo = Py_None;
    int overlap = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$OpO:gated_pool", kwlist, &kvo, &so, &ro,
                                     &apo, &overlap, &oo))
        return NULL;
    PyArrayObject *kv = NULL, *sc = NULL, *ape = NULL, *out = NULL, *kvc = NULL, *scc = NULL,
                  *apc = NULL, *work = NULL;
    PyObject *ret = NULL;
    long long ratio;
    if (csa_int_arg(ro, fn, "ratio", 1, (long long)1 << 40, &ratio)) return NULL;
    const int gate = ratio > 1 || overlap;
    if (!(kv = csa_array(kvo, fn, "kv", CSA_F32 | CSA_BF16, 3, 3, 0))) goto done;
    if (so != Py_None || gate)
        if (!(sc = csa_array(so, fn, "score", CSA_F32 | CSA_BF16, 3, 3, 0))) goto done;
    if (apo != Py_None && !(ape = csa_array(apo, fn, "ape", CSA_F32 | CSA_BF16, 2, 2, 0)))
        goto done;
    if (check_inputs(fn, kv, sc, ape, ratio, overlap)) goto done;
    const npy_intp B = PyArray_DIM(kv, 0), T = PyArray_DIM(kv, 1);
    const npy_intp d = PyArray_DIM(kv, 2) / (overlap ? 2 : 1);
    const int kvbf = csa_is_bf16(kv), scbf = sc && csa_is_bf16(sc);
    npy_intp shape[3] = {B, T / ratio, d};
    PyArrayObject *ins[3] = {kv, sc, ape};
    if (!(out = csa_out_array(oo, fn, 3, shape, kv, 0, ins, 3, 0, NULL))) goto done;
    if (!(kvc = csa_unit_inner(kv))) goto done;
    if (sc && !(scc = csa_unit_inner(sc))) goto done;
    if (ape) {
        PyArrayObject *a32 = ape_f32(ape);
        if (!a32) goto done;
        apc = csa_unit_inner(a32);
        Py_DECREF(a32);
        if (!apc) goto done;
    }
    if (!(work = csa_work_array(out, CSA_WORK_UNIT_INNER))) goto done;
    const struct csa_pool_problem p = {
        .kv = PyArray_DATA(kvc), .skb = csa_stride(kvc, 0), .skt = csa_stride(kvc, 1), .skf = 1,
        .score = scc ? PyArray_DATA(scc) : NULL, .ssb = scc ? csa_stride(scc, 0) : 0,
        .sst = scc ? csa_stride(scc, 1) : 0, .ssf = 1,
        .ape = apc ? PyArray_DATA(apc) : NULL, .sar = apc ? csa_stride(apc, 0) : 0, .saf = 1,
        .out = PyArray_DATA(work), .sob = csa_stride(work, 0), .sog = csa_stride(work, 1),
        .sof = 1, .B = B, .T = T, .d = d, .ratio = ratio, .overlap = overlap,
        .kv_bf16 = kvbf, .sc_bf16 = scbf, .out_bf16 = kvbf,
    };
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_gated_pool(&p);
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, out, work);
done:
    Py_XDECREF(kv);
    Py_XDECREF(sc);
    Py_XDECREF(ape);
    Py_XDECREF(out);
    Py_XDECREF(kvc);
    Py_XDECREF(scc);
    Py_XDECREF(apc);
    Py_XDECREF(work);
    return ret;
}

/* ---------------------------------------------------------------- Compressor state
 *
 * deepseek_csa/compressor.py builds the state once, at construction, with
 *   _pool_state(ratio, overlap, d, kv_state, score_state, prev_kv, prev_score, pos,
 *               ape or None, norm_w or None, eps, cos or None, sin or None, bf16,
 *               quant, quant_d, pack)
 * (C-contiguous float32 arrays, pos int64, of the shapes in pool.h, owned by the
 * Compressor; quant an enum csa_pool_quant code, quant_d the features FP8 rounds,
 * pack 0/1: the epilogue of pool.h).  They are validated there, once, into a state_view kept in a capsule
 * (which also keeps the arguments alive); prefill and step take the capsule. */

typedef struct {
    csa_pool_state st;
    csa_pool_epilogue ep;
    const float *ape;
} state_view;

static int state_arr(PyObject *o, int type, npy_intp n, const char *what, const char *fn)
{
    if (!PyArray_Check(o) || PyArray_TYPE((PyArrayObject *)o) != type ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) || PyArray_SIZE((PyArrayObject *)o) < n ||
        !PyArray_ISWRITEABLE((PyArrayObject *)o)) {
        PyErr_Format(PyExc_RuntimeError, "%s(): the Compressor's %s array is corrupt", fn, what);
        return -1;
    }
    return 0;
}

static int parse_state(PyObject *tup, const char *fn, state_view *v)
{
    Py_ssize_t ratio, d;
    Py_ssize_t quant_d;
    int overlap, bf16, quant, pack;
    double eps;
    PyObject *ks, *ss, *pk, *ps, *pos, *ape, *nw, *co, *so;
    if (!PyTuple_Check(tup) ||
        !PyArg_ParseTuple(tup, "ninOOOOOOOdOOiini", &ratio, &overlap, &d, &ks, &ss, &pk, &ps,
                          &pos, &ape, &nw, &eps, &co, &so, &bf16, &quant, &quant_d, &pack)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s(): the Compressor's state is corrupt", fn);
        return -1;
    }
    const npy_intp batch = PyArray_Check(pos) ? PyArray_SIZE((PyArrayObject *)pos) : 0;
    const npy_intp cd = (overlap ? 2 : 1) * d;
    const int fp4 = quant == CSA_POOL_Q_FP4 || quant == CSA_POOL_Q_HADAMARD_FP4;
    if (ratio < 1 || d < 0 || quant < CSA_POOL_Q_NONE || quant > CSA_POOL_Q_FP4_E4M3 ||
        quant_d < 0 || quant_d > d || (pack && (!fp4 || d % 32))) {
        PyErr_Format(PyExc_RuntimeError, "%s(): the Compressor's state is corrupt", fn);
        return -1;
    }
    if (state_arr(pos, NPY_INT64, batch, "pos", fn) ||
        state_arr(ks, NPY_FLOAT32, batch * ratio * cd, "kv state", fn) ||
        state_arr(ss, NPY_FLOAT32, batch * ratio * cd, "score state", fn) ||
        state_arr(pk, NPY_FLOAT32, overlap ? batch * ratio * d : 0, "previous kv", fn) ||
        state_arr(ps, NPY_FLOAT32, overlap ? batch * ratio * d : 0, "previous score", fn) ||
        (ape != Py_None && state_arr(ape, NPY_FLOAT32, ratio * cd, "ape", fn)) ||
        (nw != Py_None && state_arr(nw, NPY_FLOAT32, d, "norm weight", fn)))
        return -1;
    v->st = (csa_pool_state){batch, ratio, d, overlap,
                             PyArray_DATA((PyArrayObject *)ks), PyArray_DATA((PyArrayObject *)ss),
                             PyArray_DATA((PyArrayObject *)pk), PyArray_DATA((PyArrayObject *)ps),
                             PyArray_DATA((PyArrayObject *)pos)};
    v->ape = ape == Py_None ? NULL : PyArray_DATA((PyArrayObject *)ape);
    v->ep = (csa_pool_epilogue){bf16, nw == Py_None ? NULL : PyArray_DATA((PyArrayObject *)nw),
                                (float)eps, NULL, NULL, 0, 0, 0, quant, quant_d, pack != 0};
    if (co != Py_None) {
        PyArrayObject *c = (PyArrayObject *)co, *s = (PyArrayObject *)so;
        if (!PyArray_Check(co) || !PyArray_Check(so) || PyArray_NDIM(c) != 2 ||
            PyArray_TYPE(c) != NPY_FLOAT32 || PyArray_TYPE(s) != NPY_FLOAT32 ||
            !PyArray_IS_C_CONTIGUOUS(c) || !PyArray_IS_C_CONTIGUOUS(s) ||
            PyArray_SIZE(c) != PyArray_SIZE(s) || 2 * PyArray_DIM(c, 1) > d) {
            PyErr_Format(PyExc_RuntimeError, "%s(): the Compressor's RoPE tables are corrupt", fn);
            return -1;
        }
        v->ep.cos = PyArray_DATA(c);
        v->ep.sin = PyArray_DATA(s);
        v->ep.half = PyArray_DIM(c, 1);
        v->ep.rows = PyArray_DIM(c, 0);
        v->ep.srow = PyArray_DIM(c, 1);
    }
    return 0;
}

static const char *const STATE_CAPSULE = "deepseek_csa._pool_state";

typedef struct {
    state_view v;
    PyObject *keep;   /* the arguments of _pool_state: the arrays the view points into */
} pool_state_box;

static void state_capsule_free(PyObject *cap)
{
    pool_state_box *b = PyCapsule_GetPointer(cap, STATE_CAPSULE);
    if (!b) {
        PyErr_Clear();
        return;
    }
    Py_XDECREF(b->keep);
    PyMem_Free(b);
}

static PyObject *py_pool_state(PyObject *self, PyObject *args)
{
    state_view v;
    if (parse_state(args, "Compressor", &v)) return NULL;
    pool_state_box *b = PyMem_Malloc(sizeof *b);
    if (!b) return PyErr_NoMemory();
    b->v = v;
    b->keep = args;
    Py_INCREF(args);
    PyObject *cap = PyCapsule_New(b, STATE_CAPSULE, state_capsule_free);
    if (!cap) {
        Py_DECREF(args);
        PyMem_Free(b);
    }
    return cap;
}

/* The state_view of a _pool_state capsule (validated when it was made). */
static int get_state(PyObject *cap, const char *fn, state_view *v)
{
    const pool_state_box *b =
        PyCapsule_CheckExact(cap) ? PyCapsule_GetPointer(cap, STATE_CAPSULE) : NULL;
    if (!b) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): the Compressor's state is corrupt", fn);
        return -1;
    }
    *v = b->v;
    return 0;
}

/* The kv / score of a prefill or step, validated against the state. */
static int state_inputs(const char *fn, state_view *v, PyObject *kvo, PyObject *so,
                        PyArrayObject **kv, PyArrayObject **sc)
{
    const int gate = v->st.ratio > 1 || v->st.overlap;
    const npy_intp cd = (v->st.overlap ? 2 : 1) * v->st.d;
    char b1[256];
    if (!(*kv = csa_array(kvo, fn, "kv", CSA_F32 | CSA_BF16, 3, 3, 0))) return -1;
    if ((so != Py_None || gate) &&
        !(*sc = csa_array(so, fn, "score", CSA_F32 | CSA_BF16, 3, 3, 0)))
        return -1;
    if (PyArray_DIM(*kv, 2) != cd) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'kv' must have shape[2] == %lld (%s), got shape %s", fn,
                     (long long)cd, v->st.overlap ? "2*head_dim, overlap" : "head_dim",
                     csa_shape_str(*kv, b1, sizeof b1));
        return -1;
    }
    if (check_inputs(fn, *kv, *sc, NULL, v->st.ratio, v->st.overlap)) return -1;
    if (PyArray_DIM(*kv, 0) > v->st.batch) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'kv' has %lld rows but the Compressor holds state for batch=%lld",
                     fn, (long long)PyArray_DIM(*kv, 0), (long long)v->st.batch);
        return -1;
    }
    return 0;
}

static int check_rope_rows(const char *fn, const state_view *v, long long last_g)
{
    if (v->ep.cos && last_g >= 0 && last_g * v->st.ratio >= v->ep.rows) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): entry %lld is rotated at position %lld but the RoPE tables have "
                     "only %lld rows",
                     fn, last_g, last_g * (long long)v->st.ratio, (long long)v->ep.rows);
        return -1;
    }
    return 0;
}

/* The pooling problem of a prefill or step on the state's geometry: kv / score (unit
 * feature strides), the state's ape, out C-contiguous with strides (sob, sog). */
static struct csa_pool_problem pool_problem(const state_view *v, PyArrayObject *kv,
                                            PyArrayObject *sc, PyArrayObject *out,
                                            csa_idx sob, csa_idx sog)
{
    const csa_idx cd = (v->st.overlap ? 2 : 1) * v->st.d;
    const int kvbf = csa_is_bf16(kv);
    return (struct csa_pool_problem){
        .kv = PyArray_DATA(kv), .skb = csa_stride(kv, 0), .skt = csa_stride(kv, 1), .skf = 1,
        .score = sc ? PyArray_DATA(sc) : NULL, .ssb = sc ? csa_stride(sc, 0) : 0,
        .sst = sc ? csa_stride(sc, 1) : 0, .ssf = 1,
        .ape = v->ape, .sar = cd, .saf = 1,
        .out = PyArray_DATA(out), .sob = sob, .sog = sog, .sof = 1,
        .B = PyArray_DIM(kv, 0), .T = PyArray_DIM(kv, 1), .d = v->st.d, .ratio = v->st.ratio,
        .overlap = v->st.overlap, .kv_bf16 = kvbf, .sc_bf16 = sc && csa_is_bf16(sc),
        .out_bf16 = kvbf,
    };
}

/* The arrays of one prefill or step: the caller's kv / score (validated against the
 * state), their unit-inner-stride views, and the result. */
struct stream_arrays {
    PyArrayObject *kv, *sc, *kvc, *scc, *out;
};

static void stream_clear(struct stream_arrays *a)
{
    Py_XDECREF(a->kv);
    Py_XDECREF(a->sc);
    Py_XDECREF(a->kvc);
    Py_XDECREF(a->scc);
    Py_XDECREF(a->out);
}

/* The unit-inner views the kernels read; -1 with an exception on error. */
static int stream_views(struct stream_arrays *a)
{
    if (!(a->kvc = csa_unit_inner(a->kv))) return -1;
    if (a->sc && !(a->scc = csa_unit_inner(a->sc))) return -1;
    return 0;
}

/* The uint8 result of a packed prefill (pool.h, `pack`): a new C-contiguous array, or
 * `out`, which must be a writeable C-contiguous uint8 array of exactly `shape` that
 * overlaps none of the inputs.  A new reference, or NULL with the exception set. */
static PyArrayObject *packed_out(PyObject *oo, const char *fn, npy_intp *shape,
                                 PyArrayObject **ins, int n_in)
{
    if (oo == Py_None) return (PyArrayObject *)PyArray_EMPTY(3, shape, NPY_UINT8, 0);
    char b1[256];
    PyArrayObject *o = (PyArrayObject *)oo;
    if (!PyArray_Check(oo) || PyArray_TYPE(o) != NPY_UINT8) {
        PyErr_Format(PyExc_TypeError, "%s(): 'out' must be a uint8 array (packed=True), got %s",
                     fn, PyArray_Check(oo) ? PyArray_DESCR(o)->typeobj->tp_name
                                           : Py_TYPE(oo)->tp_name);
        return NULL;
    }
    if (PyArray_NDIM(o) != 3 || PyArray_DIM(o, 0) != shape[0] || PyArray_DIM(o, 1) != shape[1] ||
        PyArray_DIM(o, 2) != shape[2]) {
        PyErr_Format(PyExc_ValueError, "%s(): 'out' must have shape [%lld, %lld, %lld], got %s",
                     fn, (long long)shape[0], (long long)shape[1], (long long)shape[2],
                     csa_shape_str(o, b1, sizeof b1));
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(o) || !PyArray_ISWRITEABLE(o)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'out' must be writeable and C-contiguous", fn);
        return NULL;
    }
    for (int i = 0; i < n_in; i++)
        if (ins[i] && csa_may_overlap(o, ins[i])) {
            PyErr_Format(PyExc_ValueError, "%s(): 'out' overlaps an input; pass a separate array",
                         fn);
            return NULL;
        }
    Py_INCREF(o);
    return o;
}

static PyObject *py_pool_prefill(PyObject *self, PyObject *args)
{
    static const char *fn = "Compressor.prefill";
    PyObject *to, *kvo, *so, *oo = Py_None;
    if (!PyArg_ParseTuple(args, "OOO|O:_pool_prefill", &to, &kvo, &so, &oo)) return NULL;
    state_view v;
    if (get_state(to, fn, &v)) return NULL;
    struct stream_arrays a = {0};
    PyObject *ret = NULL;
    if (state_inputs(fn, &v, kvo, so, &a.kv, &a.sc)) goto done;
    const npy_intp B = PyArray_DIM(a.kv, 0), T = PyArray_DIM(a.kv, 1), G = T / v.st.ratio;
    if (check_rope_rows(fn, &v, (long long)G - 1)) goto done;
    const npy_intp row = v.ep.pack ? CSA_POOL_PACKED_ROW(v.st.d) : v.st.d;
    npy_intp shape[3] = {B, G, row};
    PyArrayObject *ins[2] = {a.kv, a.sc};
    a.out = v.ep.pack ? packed_out(oo, fn, shape, ins, 2)
                      : csa_out_array(oo, fn, 3, shape, a.kv, 0, ins, 2, 0, NULL);
    if (!a.out) goto done;
    if (!PyArray_IS_C_CONTIGUOUS(a.out)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'out' must be C-contiguous", fn);
        goto done;
    }
    if (stream_views(&a)) goto done;
    const struct csa_pool_problem p = pool_problem(&v, a.kvc, a.scc, a.out, G * row, row);
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = csa_pool_prefill(&v.st, &p, &v.ep);
    Py_END_ALLOW_THREADS
    ret = csa_finish(st, fn, oo, a.out, NULL);
done:
    stream_clear(&a);
    return ret;
}

/* ValueError unless every used row of the state is at position p. */
static int check_positions(const char *fn, const state_view *v, npy_intp B, long long p)
{
    for (npy_intp b = 0; b < B; b++)
        if (v->st.pos[b] != p) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): 'start_pos' must be %lld, the next position of row %lld of the "
                         "state, got %lld (prefill() or reset() starts a new sequence)",
                         fn, (long long)v->st.pos[b], (long long)b, p);
            return -1;
        }
    return 0;
}

static PyObject *py_pool_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *fn = "Compressor.step";
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "_pool_step(): takes 4 arguments, got %zd", nargs);
        return NULL;
    }
    state_view v;
    if (get_state(args[0], fn, &v)) return NULL;
    struct stream_arrays a = {0};
    PyObject *ret = NULL;
    long long p;
    if (state_inputs(fn, &v, args[1], args[2], &a.kv, &a.sc)) goto done;
    if (csa_int_arg(args[3], fn, "start_pos", 0, (long long)1 << 62, &p)) goto done;
    char b1[256];
    if (PyArray_DIM(a.kv, 1) != 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): 'kv' must hold one token per row, shape [B, 1, %lld], got %s", fn,
                     (long long)PyArray_DIM(a.kv, 2), csa_shape_str(a.kv, b1, sizeof b1));
        goto done;
    }
    const npy_intp B = PyArray_DIM(a.kv, 0);
    if (check_positions(fn, &v, B, p)) goto done;
    const int emit = (p + 1) % v.st.ratio == 0;
    if (emit && check_rope_rows(fn, &v, p / v.st.ratio)) goto done;
    const npy_intp row = v.ep.pack ? CSA_POOL_PACKED_ROW(v.st.d) : v.st.d;
    npy_intp shape[3] = {B, 1, row};
    a.out = v.ep.pack ? (PyArrayObject *)PyArray_EMPTY(3, shape, NPY_UINT8, 0)
                      : csa_empty_like_dtype(a.kv, 3, shape);
    if (!a.out || stream_views(&a)) goto done;
    const struct csa_pool_problem pp = pool_problem(&v, a.kvc, a.scc, a.out, row, 0);
    int st, emitted = 0;
    Py_BEGIN_ALLOW_THREADS
    st = csa_pool_step(&v.st, &pp, p, &v.ep, &emitted);
    Py_END_ALLOW_THREADS
    if (st) {
        csa_raise_status(st, fn);
    } else {
        ret = emitted ? (PyObject *)a.out : Py_None;   /* an entry, or None mid-group */
        Py_INCREF(ret);
    }
done:
    stream_clear(&a);
    return ret;
}

PyDoc_STRVAR(round_bf16_doc,
"_round_bf16(x)\n--\n\n"
"Rounds a writeable float32 array to bfloat16 precision in place (nearest-even).");

static PyObject *py_round_bf16(PyObject *self, PyObject *xo)
{
    PyArrayObject *x = csa_array(xo, "_round_bf16", "x", CSA_F32, 0, NPY_MAXDIMS, 1);
    if (!x) return NULL;
    if (!PyArray_IS_C_CONTIGUOUS(x)) {
        Py_DECREF(x);
        PyErr_SetString(PyExc_ValueError, "_round_bf16(): 'x' must be C-contiguous");
        return NULL;
    }
    csa_round_bf16((float *)PyArray_DATA(x), PyArray_SIZE(x), 1);
    Py_DECREF(x);
    Py_INCREF(xo);
    return xo;
}

PyMethodDef csa_pool_methods[] = {
    {"gated_pool", (PyCFunction)(void (*)(void))py_gated_pool, METH_VARARGS | METH_KEYWORDS,
     gated_pool_doc},
    {"_pool_state", (PyCFunction)py_pool_state, METH_VARARGS,
     "_pool_state(ratio, overlap, d, kv, score, prev_kv, prev_score, pos, ape, norm_w, eps, "
     "cos, sin, bf16, quant, quant_d, pack)\n--\n\nPrivate: the Compressor's state, validated once."},
    {"_pool_prefill", (PyCFunction)py_pool_prefill, METH_VARARGS,
     "_pool_prefill(state, kv, score, out=None)\n--\n\nPrivate: Compressor.prefill."},
    {"_pool_step", (PyCFunction)(void (*)(void))py_pool_step, METH_FASTCALL,
     "_pool_step(state, kv, score, start_pos)\n--\n\nPrivate: Compressor.step."},
    {"_round_bf16", (PyCFunction)py_round_bf16, METH_O, round_bf16_doc},
    {NULL, NULL, 0, NULL},
};
