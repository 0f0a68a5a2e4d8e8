/* deepseek_csa._core: module init and run-time ISA control. */
#define CSA_GLUE_MAIN
#include "glue.h"

#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* the released kernel module's GEMMs, quantizers and Sinkhorn (py_gemm.c) */
extern PyMethodDef csa_gemm_methods[];


static PyObject *py_get_isa(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(csa_isa_name(csa_isa_get()));
}

static PyObject *py_best_isa(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(csa_isa_name(csa_isa_best()));
}

/* "'ref', 'base', ... or 'amx'", from csa_isa_name: the one list of level names. */
static PyObject *isa_choices(void)
{
    PyObject *r = PyUnicode_FromString("");
    for (int l = CSA_ISA_REF; r && l <= CSA_ISA_AMX; l++) {
        PyObject *t = PyUnicode_FromFormat("%U%s'%s'", r,
                                           l == CSA_ISA_REF ? "" : l == CSA_ISA_AMX ? " or " : ", ",
                                           csa_isa_name(l));
        Py_DECREF(r);
        r = t;
    }
    return r;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg)
{
    const char *s = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    for (int l = CSA_ISA_REF; s && l <= CSA_ISA_AMX; l++)
        if (strcmp(s, csa_isa_name(l)) == 0) return PyUnicode_FromString(csa_isa_name(csa_isa_set(l)));
    PyErr_Clear();
    PyObject *choices = isa_choices();
    if (choices) {
        PyErr_Format(PyExc_ValueError, "set_isa(): level must be %U, got %R", choices, arg);
        Py_DECREF(choices);
    }
    return NULL;
}

static PyObject *py_max_threads(PyObject *self, PyObject *noargs)
{
#ifdef _OPENMP
    return PyLong_FromLong(omp_get_max_threads());
#else
    return PyLong_FromLong(1);
#endif
}

static PyMethodDef core_methods[] = {
    {"get_isa", py_get_isa, METH_NOARGS, "get_isa()\n--\n\nThe ISA level kernels run at now."},
    {"best_isa", py_best_isa, METH_NOARGS,
     "best_isa()\n--\n\nThe highest ISA level this CPU supports."},
    {"set_isa", py_set_isa, METH_O,
     "set_isa(level)\n--\n\nRun kernels at 'ref' (scalar oracle), 'base', 'avx2', 'avx512' or\n"
     "'amx' (AVX-512 with the AVX512_BF16 and AMX-BF16 dot products for bfloat16 inputs),\n"
     "clamped to what the CPU supports; returns the level set.  The environment\n"
     "variable DEEPSEEK_CSA_ISA sets the starting level."},
    {"max_threads", py_max_threads, METH_NOARGS,
     "max_threads()\n--\n\nThreads an OpenMP region may use now (OMP_NUM_THREADS, threadpoolctl)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_core", "C kernels of deepseek_csa.", -1, core_methods,
};

PyMODINIT_FUNC PyInit__core(void)
{
    import_array();
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    /* ISA_LEVELS: the level names, lowest first (csa_isa_name order). */
    PyObject *levels = PyTuple_New(CSA_ISA_AMX + 1);
    for (int l = CSA_ISA_REF; levels && l <= CSA_ISA_AMX; l++) {
        PyObject *n = PyUnicode_FromString(csa_isa_name(l));
        if (!n) Py_CLEAR(levels);
        else PyTuple_SET_ITEM(levels, l, n);
    }
    if (!levels || PyModule_AddObject(m, "ISA_LEVELS", levels)) {
        Py_XDECREF(levels);
        Py_DECREF(m);
        return NULL;
    }
    PyMethodDef *tables[] = {csa_norm_rope_methods, csa_pool_methods, csa_index_methods,
                             csa_attn_methods, csa_quant_methods, csa_bench_methods,
                             csa_gemm_methods, csa_grad_attn_methods,
                             csa_grad_norm_pool_methods, csa_grad_index_methods};
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
        if (PyModule_AddFunctions(m, tables[i])) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
