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

static PyObject *py_peak_amx_bf16(PyObject *self, PyObject *args)
{
    return peak_call(args, "_peak_amx_bf16", csa_peak_amx_bf16);
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

PyMethodDef csa_bench_methods[] = {
    {"_peak_fma", py_peak_fma, METH_VARARGS, "_peak_fma(iters, threads) -> flops done"},
    {"_peak_amx_bf16", py_peak_amx_bf16, METH_VARARGS,
     "_peak_amx_bf16(iters, threads) -> flops done (0 below ISA level amx)"},
    {"_stream_triad", py_stream_triad, METH_VARARGS, "_stream_triad(a, b, c, threads)"},
    {NULL, NULL, 0, NULL},
};
