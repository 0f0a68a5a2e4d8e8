/* Private helpers for benchmarks/: machine ceilings. */
#include "glue.h"

#include "../peak.h"

/* flops = kernel(iters, threads) with the GIL released; args (iters, threads). */
static PyObject *peak_call(PyObject *args, const char *fn,
                           double (*kernel)(long long, int, float *))
{
    long long iters;
    int threads;
    if (!PyArg_ParseTuple(args, "Li", &iters, &threads)) return NULL;
    if (iters < 1 || threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): iters and threads must be >= 1", fn);
        return NULL;
    }
    float sink = 0;
    double flops;
    Py_BEGIN_ALLOW_THREADS
    flops = kernel(iters, threads, &sink);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(flops + 0.0 * sink);
}

static PyObject *py_peak_fma(PyObject *self, PyObject *args)
{
    return peak_call(args, "_peak_fma", csa_peak_fma);
}

/* None where no AMX peak exists (CPU, build or level below amx): a number there would
 * be a ceiling nothing can reach. */
static PyObject *py_peak_amx_bf16(PyObject *self, PyObject *args)
{
    PyObject *r = peak_call(args, "_peak_amx_bf16", csa_peak_amx_bf16);
    if (r && PyFloat_AS_DOUBLE(r) == 0.0) {
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    return r;
}

static PyObject *py_peak_fma_shape(PyObject *self, PyObject *noargs)
{
    int vec_bytes = 0;
    const int acc = csa_peak_fma_shape(&vec_bytes);
    return Py_BuildValue("{s:s,s:i,s:i}", "isa", csa_isa_name(csa_isa_get()), "vec_bytes",
                         vec_bytes, "accumulators", acc);
}

static PyObject *py_peak_idot(PyObject *self, PyObject *args)
{
    return peak_call(args, "_peak_idot", csa_peak_idot);
}

static PyObject *py_peak_idot_shape(PyObject *self, PyObject *noargs)
{
    int vec_bytes = 0, vnni = 0;
    const int acc = csa_peak_idot_shape(&vec_bytes, &vnni);
    return Py_BuildValue("{s:s,s:i,s:i,s:s}", "isa", csa_isa_name(csa_isa_get()), "vec_bytes",
                         vec_bytes, "accumulators", acc, "instruction",
                         vnni ? "vpdpbusd" : vec_bytes > 4 ? "vpmaddubsw+vpaddw" : "scalar");
}

static PyObject *py_stream_triad(PyObject *self, PyObject *args)
{
    PyObject *ao, *bo, *co;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi:_stream_triad", &ao, &bo, &co, &threads)) return NULL;
    PyArrayObject *a = csa_array(ao, "_stream_triad", "a", CSA_F32, 1, 1, 1);
    PyArrayObject *b = a ? csa_array(bo, "_stream_triad", "b", CSA_F32, 1, 1, 0) : NULL;
    PyArrayObject *c = b ? csa_array(co, "_stream_triad", "c", CSA_F32, 1, 1, 0) : NULL;
    PyObject *ret = NULL;
    if (c) {
        npy_intp n = PyArray_DIM(a, 0);
        if (PyArray_DIM(b, 0) != n || PyArray_DIM(c, 0) != n || !PyArray_IS_C_CONTIGUOUS(a) ||
            !PyArray_IS_C_CONTIGUOUS(b) || !PyArray_IS_C_CONTIGUOUS(c) || threads < 1) {
            PyErr_SetString(PyExc_ValueError, "_stream_triad(): contiguous arrays of one length");
        } else {
            Py_BEGIN_ALLOW_THREADS
            csa_stream_triad(PyArray_DATA(a), PyArray_DATA(b), PyArray_DATA(c), n, 3.0f, threads);
            Py_END_ALLOW_THREADS
            ret = Py_None;
            Py_INCREF(ret);
        }
    }
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    return ret;
}

static PyObject *py_stream_read(PyObject *self, PyObject *args)
{
    PyObject *bo;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi:_stream_read", &bo, &threads)) return NULL;
    PyArrayObject *b = csa_array(bo, "_stream_read", "b", CSA_F32, 1, 1, 0);
    if (!b) return NULL;
    PyObject *ret = NULL;
    if (!PyArray_IS_C_CONTIGUOUS(b) || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "_stream_read(): a contiguous array and threads >= 1");
    } else {
        float s;
        Py_BEGIN_ALLOW_THREADS
        s = csa_stream_read(PyArray_DATA(b), PyArray_DIM(b, 0), threads);
        Py_END_ALLOW_THREADS
        ret = PyFloat_FromDouble(s);
    }
    Py_DECREF(b);
    return ret;
}

/* How this module was built: OpenMP or serial, compiler, architecture, the ISA levels
 * compiled in.  deepseek_csa.build_info() wraps it; the import warns from it. */
static PyObject *py_build_info(PyObject *self, PyObject *noargs)
{
#ifdef _OPENMP
    PyObject *omp = Py_True, *omp_version = PyLong_FromLong(_OPENMP);
#else
    PyObject *omp = Py_False, *omp_version = Py_None;
    Py_INCREF(Py_None);
#endif
#if defined(__x86_64__) && defined(__GNUC__)
    const char *arch = "x86_64";
#if defined(CSA_HAVE_AMX)
    const char *levels = "ref base avx2 avx512 amx";
#else
    const char *levels = "ref base avx2 avx512";
#endif
#elif defined(__aarch64__)
    const char *arch = "aarch64", *levels = "ref base";
#else
    const char *arch = "other", *levels = "ref base";
#endif
    if (!omp_version) return NULL;
    const int f = csa_cpu_features();
    char features[64];
    snprintf(features, sizeof features, "%s%s%s", f & CSA_CPU_VNNI_VBMI ? "vnni_vbmi " : "",
             f & CSA_CPU_BF16 ? "bf16 " : "", f & CSA_CPU_AMX_INT8 ? "amx_int8" : "");
    for (size_t n = strlen(features); n && features[n - 1] == ' ';) features[--n] = 0;
    return Py_BuildValue("{s:O,s:N,s:s,s:s,s:s,s:s}", "openmp", omp, "openmp_version", omp_version,
                         "compiler", __VERSION__, "arch", arch, "isa_levels", levels,
                         "cpu_features", features);
}

PyMethodDef csa_bench_methods[] = {
    {"_build_info", py_build_info, METH_NOARGS,
     "_build_info() -> dict: openmp (bool), openmp_version (_OPENMP or None), compiler,\n"
     "arch, isa_levels (space-separated levels compiled in), cpu_features (space-separated:\n"
     "vnni_vbmi, bf16, amx_int8 -- extra paths the avx512 and amx levels take on this CPU)"},
    {"_peak_fma", py_peak_fma, METH_VARARGS, "_peak_fma(iters, threads) -> flops done at the current ISA level"},
    {"_peak_amx_bf16", py_peak_amx_bf16, METH_VARARGS,
     "_peak_amx_bf16(iters, threads) -> flops done, or None below ISA level amx"},
    {"_peak_fma_shape", py_peak_fma_shape, METH_NOARGS,
     "_peak_fma_shape() -> {isa, vec_bytes, accumulators} of _peak_fma at the current level"},
    {"_peak_idot", py_peak_idot, METH_VARARGS,
     "_peak_idot(iters, threads) -> 8-bit integer dot-product ops done (2 a byte product) at\n"
     "the current ISA level, in the FP4 indexer's instruction mix"},
    {"_peak_idot_shape", py_peak_idot_shape, METH_NOARGS,
     "_peak_idot_shape() -> {isa, vec_bytes, accumulators, instruction} of _peak_idot"},
    {"_stream_triad", py_stream_triad, METH_VARARGS, "_stream_triad(a, b, c, threads)"},
    {"_stream_read", py_stream_read, METH_VARARGS, "_stream_read(b, threads) -> float"},
    {NULL, NULL, 0, NULL},
};
