/* The thin CPython + NumPy layer: parse, validate while holding the GIL, release
 * the GIL, call a kernel, raise after the GIL is back.  Every glue file includes
 * this header; the NumPy C-API version is pinned here and nowhere else. */
#ifndef CSA_GLUE_H
#define CSA_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_25_API_VERSION
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL csa_ARRAY_API
#ifndef CSA_GLUE_MAIN
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "../csa.h"

/* Method tables, one per concern; module.c adds them all to the module. */
extern PyMethodDef csa_norm_rope_methods[];
extern PyMethodDef csa_pool_methods[];
extern PyMethodDef csa_index_methods[];
extern PyMethodDef csa_attn_methods[];
extern PyMethodDef csa_quant_methods[];
extern PyMethodDef csa_bench_methods[];
/* Backward kernels (docs/kernels.md, "Gradients"), one table per concern. */
extern PyMethodDef csa_grad_attn_methods[];       /* py_grad_attn.c */
extern PyMethodDef csa_grad_norm_pool_methods[];  /* py_grad_norm_pool.c */
extern PyMethodDef csa_grad_index_methods[];      /* py_grad_index.c */

/* Accepted dtypes of an argument (a bit set). */
#define CSA_F32 1
#define CSA_I32 2
#define CSA_BOOL 4
#define CSA_BF16 8   /* ml_dtypes.bfloat16 arrays; torch bfloat16 tensors are viewed as one */

/* Returns a new reference to an ndarray view of `obj` (an ndarray, or anything with
 * __array__ / the buffer protocol such as a CPU torch tensor) WITHOUT copying and
 * without converting its dtype, or NULL with an exception that names `fn` and
 * `name`: TypeError for a dtype outside `dtypes`, ValueError for a rank outside
 * [min_ndim, max_ndim] or a read-only array when `writeable`.  Unaligned or
 * byte-swapped read-only inputs are copied (never misread); writeable ones raise. */
PyArrayObject *csa_array(PyObject *obj, const char *fn, const char *name, int dtypes,
                         int min_ndim, int max_ndim, int writeable);

/* A torch tensor as an ndarray over its memory, without a copy: the one way the glue
 * views tensors.  bfloat16 tensors become ml_dtypes.bfloat16 arrays with CSA_TV_BF16
 * (else *status = CSA_TV_REFUSED); 1-byte dtypes (float8_*, float4_e2m1fn_x2, ...)
 * become uint8 with CSA_TV_BYTES; with CSA_TV_DETACH a tensor that requires grad is
 * read as data (else it is refused while grad mode is on, as Tensor.numpy() does).
 * Plain tensors (torch.Tensor, nn.Parameter) are read from their DLPack description,
 * without Tensor.numpy(); subclasses and unusual tensors go through Tensor.numpy().
 * Returns a new reference (an ndarray whose base is the tensor), or NULL without an
 * exception and *status CSA_TV_NOT_TENSOR (obj is not a torch tensor, or torch is not
 * imported) or CSA_TV_NO_VIEW (NumPy cannot view it: on a GPU, requiring grad, a dtype
 * NumPy lacks).  dtname (n bytes, may be NULL) receives str(tensor.dtype), "" for a
 * non-tensor. */
enum { CSA_TV_BF16 = 1, CSA_TV_BYTES = 2, CSA_TV_DETACH = 4 };
enum { CSA_TV_OK = 0, CSA_TV_NOT_TENSOR = 1, CSA_TV_NO_VIEW = 2, CSA_TV_REFUSED = 3 };
PyObject *csa_torch_view(PyObject *obj, int flags, int *status, char *dtname, size_t n);

/* A new reference to obj as a uint8 ndarray when it is a uint8 ndarray or torch
 * tensor (FP4 rows, packed codes), else NULL without an exception. */
PyArrayObject *csa_u8_view(PyObject *obj);

/* 1 if a holds bfloat16 (ml_dtypes.bfloat16). */
int csa_is_bf16(PyArrayObject *a);

/* New uninitialized C-contiguous array of `shape` with the dtype of `proto`. */
PyArrayObject *csa_empty_like_dtype(PyArrayObject *proto, int ndim, const npy_intp *shape);

/* Stride of `axis` in elements (validated arrays are aligned, so it divides). */
static inline csa_idx csa_stride(PyArrayObject *a, int axis)
{
    return (csa_idx)(PyArray_STRIDE(a, axis) / PyArray_ITEMSIZE(a));
}

/* "[2, 3, 4]" of an array's shape, into buf. */
const char *csa_shape_str(PyArrayObject *a, char *buf, size_t n);

/* ValueError unless a.shape[axis] == want: "fn(): 'name' must have shape[axis] ==
 * want (what), got shape [..]". */
int csa_check_dim(PyArrayObject *a, const char *fn, const char *name, int axis,
                  npy_intp want, const char *what);

/* The result array of a call.  `out_arg` None: a new, uninitialized C-contiguous
 * array of `shape` (every kernel writes every element of its result), in the dtype of
 * `proto` when it is given (float32 or bfloat16, like it), else of `npy_type`
 * (NPY_FLOAT32, NPY_INT32 or NPY_BOOL).  Otherwise `out_arg` must be a writeable
 * array of exactly that dtype and shape that does not overlap any of the `n_in`
 * inputs (NULL entries are skipped); with CSA_OUT_MAY_ALIAS it may instead be the
 * same view as inputs[0] (in place), and *inplace (if not NULL) says so.
 * Returns a new reference, or NULL with the exception set. */
enum { CSA_OUT_MAY_ALIAS = 1 };
PyArrayObject *csa_out_array(PyObject *out_arg, const char *fn, int ndim, const npy_intp *shape,
                             PyArrayObject *proto, int npy_type, PyArrayObject **inputs,
                             int n_in, int flags, int *inplace);

/* csa_out_array for a result whose argument is called `name` instead of 'out' (the
 * several results of a backward call: grad_q=, grad_kv=, ...); errors name it. */
PyArrayObject *csa_out_array_named(PyObject *out_arg, const char *fn, const char *name, int ndim,
                                   const npy_intp *shape, PyArrayObject *proto, int npy_type,
                                   PyArrayObject **inputs, int n_in, int flags, int *inplace);

/* What a kernel writes for the result `out`: `out` itself when its layout suits the
 * kernel (CSA_WORK_UNIT_INNER: unit stride on the last axis; CSA_WORK_C_CONTIG:
 * C-contiguous), else a new temporary C-contiguous array of its shape and dtype,
 * which csa_finish copies into `out`.  A new reference either way; NULL on error. */
enum { CSA_WORK_UNIT_INNER = 1, CSA_WORK_C_CONTIG = 2 };
PyArrayObject *csa_work_array(PyArrayObject *out, int layout);

/* A view of `a` whose last axis has unit stride (what the tuned kernels stream):
 * `a` itself or a C-contiguous copy.  Always a NEW reference: the caller keeps (and
 * still releases) its own reference to `a`.  NULL on error. */
PyArrayObject *csa_unit_inner(PyArrayObject *a);

/* 1 if a and b are the same view of the same memory (same data pointer, shape and
 * strides on every axis longer than 1): the in-place use of an `out=` argument. */
int csa_same_view(PyArrayObject *a, PyArrayObject *b);

/* A kernel over the rows of [rows, d] arrays (x read, out written; one dtype,
 * float32, or bfloat16 when `bf16`), with the strides of each in elements;
 * `params` is the kernel's own. */
typedef int (*csa_rows_kernel)(const void *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                               csa_idx sx_col, void *out, csa_idx so_row, csa_idx so_col,
                               int bf16, const void *params);

/* Runs `kernel` from src to dst ([..., d] each, one dtype) with the GIL released,
 * folding the leading axes into rows, through contiguous copies when a layout cannot
 * be folded.  dst == src means in place.  Returns 0, or -1 with an exception set
 * (a bad kernel status raised as csa_raise_status does). */
int csa_run_rows(PyArrayObject *src, PyArrayObject *dst, const char *fn, csa_rows_kernel kernel,
                 const void *params);

/* 1 if the memory spans of a and b overlap. */
int csa_may_overlap(PyArrayObject *a, PyArrayObject *b);

/* Folds the leading ndim-1 axes of `a` into one row axis with a single stride, if
 * its layout allows; returns 0 and sets rows/row_stride, or -1 when it does not. */
int csa_fold_rows(PyArrayObject *a, csa_idx *rows, csa_idx *row_stride);

/* The dtype a backward's grad_dtype= names: 0 float32 (None too), 1 bfloat16 with
 * *proto a new 0-d array of it (the proto of csa_out_array_named), -1 with a ValueError
 * naming the argument. */
int csa_grad_dtype_arg(PyObject *o, const char *fn, PyArrayObject **proto);

/* The end of a call that returns an array: raises for a bad kernel status, copies
 * the kernel's `work` buffer into `out` when they differ (work may be NULL), and
 * returns a new reference to what the caller gets: their `out_arg` object when they
 * passed one, else `out`; NULL on error. */
PyObject *csa_finish(int status, const char *fn, PyObject *out_arg, PyArrayObject *out,
                     PyArrayObject *work);

/* Raises the exception for a kernel status (after the GIL is back); returns NULL. */
PyObject *csa_raise_status(int status, const char *fn);

/* Parses a Python int that must lie in [lo, hi]; names the argument on error. */
int csa_int_arg(PyObject *obj, const char *fn, const char *name, long long lo, long long hi,
                long long *out);

/* 1 if two elements of `a` may share memory (zero or overlapping strides). csa_array
 * rejects such arrays when they are written. */
int csa_self_overlap(PyArrayObject *a);

/* Parses a real number (float, int, numpy scalar; not bool/complex/str) into *out;
 * TypeError naming the argument otherwise. */
int csa_float_arg(PyObject *obj, const char *fn, const char *name, double *out);

/* Sets "fn(): 'name' must be <want>, got <got>" as a ValueError; returns NULL. */
PyObject *csa_value_error_f(const char *fn, const char *name, const char *want, double got);

#endif
