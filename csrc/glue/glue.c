#include "glue.h"

#include <stdio.h>
#include <string.h>

static const char *dtypes_str(int dtypes)
{
    switch (dtypes) {
    case CSA_F32: return "float32";
    case CSA_F32 | CSA_BF16: return "float32 or bfloat16";
    case CSA_BF16: return "bfloat16";
    case CSA_I32: return "int32";
    case CSA_BOOL: return "bool";
    default: return "float32, int32, bool or bfloat16";
    }
}

const char *csa_shape_str(PyArrayObject *a, char *buf, size_t n)
{
    size_t k = 0;
    int nd = PyArray_NDIM(a);
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < nd && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld",
                              (long long)PyArray_DIM(a, i));
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

int csa_is_bf16(PyArrayObject *a)
{
    const char *name = PyArray_DESCR(a)->typeobj->tp_name;
    size_t n = strlen(name);
    return PyArray_ITEMSIZE(a) == 2 && n >= 8 && strcmp(name + n - 8, "bfloat16") == 0;
}

PyArrayObject *csa_empty_like_dtype(PyArrayObject *proto, int ndim, const npy_intp *shape)
{
    PyArray_Descr *d = PyArray_DESCR(proto);
    Py_INCREF(d);
    return (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, d, ndim, (npy_intp *)shape,
                                                 NULL, NULL, 0, NULL);
}

/* torch's objects that csa_torch_view compares against, looked up once (torch and
 * ml_dtypes cannot be unloaded, so the references stay valid; the GIL guards the
 * first lookup).  Looking them up on every call was most of a decode call's cost:
 * rms_norm [1, 4096] with three tensor arguments took 4.1 us against 1.2 us for
 * ndarrays (Sapphire Rapids Xeon). */
static struct {
    PyObject *torch, *tensor, *parameter, *bf16, *u8, *i16, *ml_bf16, *to_dlpack, *grad_enabled;
    PyObject *s_modules_torch, *s_requires_grad, *s_is_neg, *s_dtype;
    PyArray_Descr *bf16_descr;
} tv;

static int tv_init(PyObject *tm)
{
    if (tv.torch == tm) return 1;
    if (!tv.s_dtype) {
        tv.s_requires_grad = PyUnicode_InternFromString("requires_grad");
        tv.s_is_neg = PyUnicode_InternFromString("is_neg");
        tv.s_dtype = PyUnicode_InternFromString("dtype");
        if (!tv.s_requires_grad || !tv.s_is_neg || !tv.s_dtype) {
            Py_CLEAR(tv.s_requires_grad);
            Py_CLEAR(tv.s_is_neg);
            Py_CLEAR(tv.s_dtype);
            PyErr_Clear();
            return 0;
        }
    }
    PyObject *tensor = PyObject_GetAttrString(tm, "Tensor");
    PyObject *bf = PyObject_GetAttrString(tm, "bfloat16");
    PyObject *u8 = PyObject_GetAttrString(tm, "uint8");
    PyObject *i16 = PyObject_GetAttrString(tm, "int16");
    if (!tensor || !PyType_Check(tensor) || !bf || !u8 || !i16) {
        Py_XDECREF(tensor);
        Py_XDECREF(bf);
        Py_XDECREF(u8);
        Py_XDECREF(i16);
        PyErr_Clear();
        return 0;
    }
    /* the fast view's pieces (csa_torch_view): missing ones leave it off */
    PyObject *nn = PyObject_GetAttrString(tm, "nn");
    PyObject *param = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
    PyObject *c = PyObject_GetAttrString(tm, "_C");
    PyObject *dl = c ? PyObject_GetAttrString(c, "_to_dlpack") : NULL;
    PyObject *ge = PyObject_GetAttrString(tm, "is_grad_enabled");
    Py_XDECREF(nn);
    Py_XDECREF(c);
    PyErr_Clear();
    Py_INCREF(tm);
    tv.torch = tm;
    tv.tensor = tensor;
    tv.parameter = param && PyType_Check(param) ? param : NULL;
    if (!tv.parameter) Py_XDECREF(param);
    tv.to_dlpack = dl && ge ? dl : NULL;
    tv.grad_enabled = dl && ge ? ge : NULL;
    if (!tv.to_dlpack) {
        Py_XDECREF(dl);
        Py_XDECREF(ge);
    }
    tv.bf16 = bf;
    tv.u8 = u8;
    tv.i16 = i16;
    return 1;
}

/* The ml_dtypes.bfloat16 dtype (a borrowed reference), or NULL with no exception. */
static PyArray_Descr *ml_bf16_descr(void)
{
    if (!tv.ml_bf16) {
        PyObject *mld = PyImport_ImportModule("ml_dtypes");
        tv.ml_bf16 = mld ? PyObject_GetAttrString(mld, "bfloat16") : NULL;
        Py_XDECREF(mld);
    }
    if (tv.ml_bf16 && !tv.bf16_descr && !PyArray_DescrConverter(tv.ml_bf16, &tv.bf16_descr))
        tv.bf16_descr = NULL;
    PyErr_Clear();
    return tv.bf16_descr;
}

/* The head of a tensor description in DLPack's C ABI (the unversioned
 * DLManagedTensor that torch._C._to_dlpack puts in a capsule named "dltensor" starts
 * with it): only what the fast view reads. */
typedef struct {
    void *data;
    int32_t device_type, device_id;   /* device_type 1: CPU */
    int32_t ndim;
    uint8_t code, bits;               /* code 0 int, 1 uint, 2 float, 4 bfloat, 6 bool */
    uint16_t lanes;
    int64_t *shape, *strides;         /* strides in elements; NULL: C-contiguous */
    uint64_t byte_offset;
} dl_head;

/* The NumPy type of a DLPack element type, -1 for one this view leaves to the slow
 * path (float8 and other formats NumPy lacks, complex, vectors). */
static int dl_npy_type(const dl_head *t)
{
    if (t->lanes != 1) return -1;
    switch (t->code * 256 + t->bits) {
    case 0 * 256 + 8: return NPY_INT8;
    case 0 * 256 + 16: return NPY_INT16;
    case 0 * 256 + 32: return NPY_INT32;
    case 0 * 256 + 64: return NPY_INT64;
    case 1 * 256 + 8: return NPY_UINT8;
    case 2 * 256 + 16: return NPY_FLOAT16;
    case 2 * 256 + 32: return NPY_FLOAT32;
    case 2 * 256 + 64: return NPY_FLOAT64;
    case 6 * 256 + 8: return NPY_BOOL;
    default: return -1;
    }
}

/* What fast_view leaves to the slow view (anything unusual). */
enum { TV_UNSETTLED = -1 };

/* The fast view of a plain CPU tensor (exactly torch.Tensor or nn.Parameter): its
 * data pointer, shape, strides, dtype and device read from one DLPack description
 * (torch._C._to_dlpack) and wrapped in an ndarray whose base is the tensor, instead
 * of Tensor.numpy(), whose argument parsing and checks cost twice as much (0.34
 * against 0.80 us from Python, rms_norm's [1, 4096], Sapphire Rapids Xeon at load 4).
 * It refuses what Tensor.numpy() refuses, in the slow view's order: bfloat16 without
 * CSA_TV_BF16, then off the CPU, then requiring grad while grad mode is on, unless
 * CSA_TV_DETACH (the data is read, never recorded); a tensor with its negative bit set goes to the slow view.
 * Returns the view (*status CSA_TV_OK), or NULL without an exception and *status
 * CSA_TV_REFUSED, CSA_TV_NO_VIEW or TV_UNSETTLED. */
static PyObject *fast_view(PyObject *obj, int flags, int *status)
{
    *status = TV_UNSETTLED;
    PyObject *cap = PyObject_CallOneArg(tv.to_dlpack, obj);
    const dl_head *t = cap ? PyCapsule_GetPointer(cap, "dltensor") : NULL;
    if (!t) {
        Py_XDECREF(cap);
        PyErr_Clear();
        return NULL;
    }
    PyObject *res = NULL;
    PyArray_Descr *descr = NULL;
    const int nd = t->ndim;
    if (nd < 0 || nd > NPY_MAXDIMS || t->lanes != 1) goto done;
    if (t->code == 4 && t->bits == 16) {
        if (!(flags & CSA_TV_BF16)) {
            *status = CSA_TV_REFUSED;
            goto done;
        }
        if (!(descr = ml_bf16_descr())) goto done;
        Py_INCREF(descr);
    } else if ((flags & CSA_TV_BYTES) && t->bits == 8) {
        descr = PyArray_DescrFromType(NPY_UINT8);
    } else {
        const int ty = dl_npy_type(t);
        if (ty < 0) goto done;
        descr = PyArray_DescrFromType(ty);
    }
    if (!descr) goto done;
    if (t->device_type != 1) {
        *status = CSA_TV_NO_VIEW;
        goto done;
    }
    PyObject *rg = PyObject_GetAttr(obj, tv.s_requires_grad);
    const int needs_grad = rg == Py_True;
    if (!rg) goto done;
    Py_DECREF(rg);
    if (needs_grad && !(flags & CSA_TV_DETACH)) {
        PyObject *ge = PyObject_CallNoArgs(tv.grad_enabled);
        const int enabled = ge != Py_False;   /* on, or unknown */
        Py_XDECREF(ge);
        if (enabled) {
            *status = CSA_TV_NO_VIEW;
            goto done;
        }
    }
    PyObject *neg = PyObject_CallMethodNoArgs(obj, tv.s_is_neg);
    const int is_neg = neg != Py_False;   /* set, or unknown */
    Py_XDECREF(neg);
    if (is_neg) goto done;
    npy_intp shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    const npy_intp isz = PyDataType_ELSIZE(descr);
    for (int i = nd - 1; i >= 0; i--) {
        shape[i] = (npy_intp)t->shape[i];
        strides[i] = t->strides ? (npy_intp)t->strides[i] * isz
                                : (i == nd - 1 ? isz : strides[i + 1] * shape[i + 1]);
    }
    /* a tensor with no elements may have no memory: NumPy would then allocate (and
     * own) some, so point it anywhere valid; nothing is read or written there */
    static double no_elements;
    char *data = t->data ? (char *)t->data + t->byte_offset : (char *)&no_elements;
    res = PyArray_NewFromDescr(&PyArray_Type, descr, nd, shape, strides, data,
                               NPY_ARRAY_WRITEABLE, NULL);   /* steals descr */
    descr = NULL;
    if (res) {
        Py_INCREF(obj);
        if (PyArray_SetBaseObject((PyArrayObject *)res, obj) < 0) Py_CLEAR(res);
    }
    if (res) *status = CSA_TV_OK;
done:
    Py_XDECREF(descr);
    PyErr_Clear();
    Py_DECREF(cap);   /* its destructor releases torch's description (not the memory) */
    return res;
}

/* The slow view (glue.h): Tensor.numpy(), bfloat16 tensors viewed as int16 and then as
 * ml_dtypes.bfloat16, 1-byte ones as uint8; the fast view's fallback for subclasses,
 * float8 / float4 tensors and anything it does not recognize. */
static PyObject *slow_view(PyObject *obj, PyObject *dt, int flags, int *status)
{
    const int is_bf = dt == tv.bf16, is_u8 = dt == tv.u8;
    int one_byte = 0;
    if (!is_bf && !is_u8 && (flags & CSA_TV_BYTES)) {
        PyObject *isz = PyObject_GetAttrString(dt, "itemsize");
        one_byte = isz && PyLong_Check(isz) && PyLong_AsLong(isz) == 1;
        Py_XDECREF(isz);
        PyErr_Clear();
    }
    if (is_bf && !(flags & CSA_TV_BF16)) {
        *status = CSA_TV_REFUSED;
        return NULL;
    }
    /* the base tensor: detached when asked and it requires grad (a view of the
     * data: what the kernels read is never recorded by autograd anyway) */
    PyObject *base = obj;
    Py_INCREF(base);
    if (flags & CSA_TV_DETACH) {
        PyObject *rg = PyObject_GetAttrString(obj, "requires_grad");
        const int needs = rg == Py_True;
        Py_XDECREF(rg);
        PyErr_Clear();
        if (needs) {
            Py_DECREF(base);
            base = PyObject_CallMethod(obj, "detach", NULL);
        }
    }
    PyObject *res = NULL;
    if (!base) {
        res = NULL;
    } else if (is_bf) {
        ml_bf16_descr();
        PyObject *v = tv.ml_bf16 ? PyObject_CallMethod(base, "view", "O", tv.i16) : NULL;
        PyObject *np = v ? PyObject_CallMethod(v, "numpy", NULL) : NULL;
        res = np ? PyObject_CallMethod(np, "view", "O", tv.ml_bf16) : NULL;
        Py_XDECREF(v);
        Py_XDECREF(np);
    } else if (one_byte && (flags & CSA_TV_BYTES)) {
        PyObject *v = PyObject_CallMethod(base, "view", "O", tv.u8);
        res = v ? PyObject_CallMethod(v, "numpy", NULL) : NULL;
        Py_XDECREF(v);
    } else {
        res = PyObject_CallMethod(base, "numpy", NULL);
    }
    Py_XDECREF(base);
    if (!res || !PyArray_Check(res)) {
        Py_XDECREF(res);
        *status = CSA_TV_NO_VIEW;
        PyErr_Clear();
        return NULL;
    }
    *status = CSA_TV_OK;
    return res;
}

/* The one place torch tensors become ndarrays (glue.h): the fast view for plain
 * tensors, the slow one for the rest and for what the fast one does not settle. */
PyObject *csa_torch_view(PyObject *obj, int flags, int *status, char *dtname, size_t n)
{
    *status = CSA_TV_NOT_TENSOR;
    if (dtname && n) dtname[0] = 0;
    if (PyArray_Check(obj)) return NULL;
    if (!tv.torch) {
        PyObject *mods = PySys_GetObject("modules");
        PyObject *tm = mods ? PyDict_GetItemString(mods, "torch") : NULL;
        if (!tm || !tv_init(tm)) return NULL;
    }
    const int plain = Py_TYPE(obj) == (PyTypeObject *)tv.tensor ||
                      (tv.parameter && Py_TYPE(obj) == (PyTypeObject *)tv.parameter);
    if (!plain && !PyObject_TypeCheck(obj, (PyTypeObject *)tv.tensor)) return NULL;
    if (dtname && n) {
        PyObject *dt = PyObject_GetAttrString(obj, "dtype");
        PyObject *ds = dt ? PyObject_Str(dt) : NULL;
        const char *nm = ds ? PyUnicode_AsUTF8(ds) : NULL;
        if (nm) snprintf(dtname, n, "%s", nm);
        Py_XDECREF(ds);
        Py_XDECREF(dt);
        PyErr_Clear();
    }
    if (plain && tv.to_dlpack) {
        PyObject *res = fast_view(obj, flags, status);
        if (*status != TV_UNSETTLED) return res;
        *status = CSA_TV_NOT_TENSOR;
    }
    PyObject *dt = PyObject_GetAttr(obj, tv.s_dtype);
    if (!dt) {
        PyErr_Clear();
        *status = CSA_TV_NO_VIEW;
        return NULL;
    }
    PyObject *res = slow_view(obj, dt, flags, status);
    Py_DECREF(dt);
    return res;
}

PyArrayObject *csa_u8_view(PyObject *obj)
{
    if (PyArray_Check(obj)) {
        if (PyArray_TYPE((PyArrayObject *)obj) != NPY_UINT8) return NULL;
        Py_INCREF(obj);
        return (PyArrayObject *)obj;
    }
    int st;
    PyObject *a = csa_torch_view(obj, 0, &st, NULL, 0);
    if (a && PyArray_TYPE((PyArrayObject *)a) == NPY_UINT8) return (PyArrayObject *)a;
    Py_XDECREF(a);
    return NULL;
}

static int dtype_ok(PyArrayObject *a, int dtypes)
{
    int t = PyArray_TYPE(a);
    if ((dtypes & CSA_F32) && t == NPY_FLOAT32) return 1;
    if ((dtypes & CSA_I32) && (t == NPY_INT32 || (t == NPY_INT && sizeof(int) == 4))) return 1;
    if ((dtypes & CSA_BOOL) && t == NPY_BOOL) return 1;
    if ((dtypes & CSA_BF16) && csa_is_bf16(a)) return 1;
    return 0;
}

int csa_self_overlap(PyArrayObject *a)
{
    /* Sufficient test for distinct elements: sorted by |stride|, each stride must step
     * past the whole extent of the faster axes.  Conservative: a few exotic
     * as_strided layouts that do not overlap are reported too. */
    int nd = PyArray_NDIM(a), n = 0;
    npy_intp st[NPY_MAXDIMS], dm[NPY_MAXDIMS];
    for (int i = 0; i < nd; i++) {
        if (PyArray_DIM(a, i) == 0) return 0;
        if (PyArray_DIM(a, i) == 1) continue;
        npy_intp s = PyArray_STRIDE(a, i);
        st[n] = s < 0 ? -s : s;
        dm[n] = PyArray_DIM(a, i);
        n++;
    }
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && st[j] < st[j - 1]; j--) {
            npy_intp t = st[j]; st[j] = st[j - 1]; st[j - 1] = t;
            t = dm[j]; dm[j] = dm[j - 1]; dm[j - 1] = t;
        }
    npy_intp ext = PyArray_ITEMSIZE(a);
    for (int i = 0; i < n; i++) {
        if (st[i] < ext) return 1;
        ext = st[i] * (dm[i] - 1) + ext;   /* fits: numpy bounds the array's span */
    }
    return 0;
}

PyArrayObject *csa_array(PyObject *obj, const char *fn, const char *name, int dtypes,
                         int min_ndim, int max_ndim, int writeable)
{
    if (obj == NULL || obj == Py_None) {
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array, got None", fn, name,
                     dtypes_str(dtypes));
        return NULL;
    }
    PyArrayObject *a;
    int tfail = CSA_TV_NOT_TENSOR;
    if (PyArray_Check(obj)) {
        Py_INCREF(obj);
        a = (PyArrayObject *)obj;
    } else if ((a = (PyArrayObject *)csa_torch_view(obj, dtypes & CSA_BF16 ? CSA_TV_BF16 : 0,
                                                    &tfail, NULL, 0)) != NULL) {
        /* a CPU torch tensor, viewed without a copy */
    } else if (tfail == CSA_TV_REFUSED) {
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array, got a torch bfloat16 tensor",
                     fn, name, dtypes_str(dtypes));
        return NULL;
    } else if (tfail == CSA_TV_NO_VIEW) {
        PyObject *dt = PyObject_GetAttrString(obj, "dtype");
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s(): '%s' must be a %s array; got a torch tensor (dtype %S) that NumPy "
                     "cannot view without a copy (on a GPU, or requiring grad: pass "
                     "t.detach().cpu())",
                     fn, name, dtypes_str(dtypes), dt ? dt : Py_None);
        Py_XDECREF(dt);
        return NULL;
    } else {
        a = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
        if (!a) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array, got %s", fn, name,
                         dtypes_str(dtypes), Py_TYPE(obj)->tp_name);
            return NULL;
        }
        if (PyArray_NDIM(a) == 0 && !PyArray_Check(obj) && !PyObject_CheckBuffer(obj) &&
            !PyObject_HasAttrString(obj, "__array__")) {
            Py_DECREF(a);
            PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array, got %s", fn, name,
                         dtypes_str(dtypes), Py_TYPE(obj)->tp_name);
            return NULL;
        }
    }
    if (!dtype_ok(a, dtypes)) {
        PyObject *d = PyObject_Str((PyObject *)PyArray_DESCR(a));
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a %s array, got dtype %s", fn, name,
                     dtypes_str(dtypes), d ? PyUnicode_AsUTF8(d) : "?");
        Py_XDECREF(d);
        Py_DECREF(a);
        return NULL;
    }
    int nd = PyArray_NDIM(a);
    if (nd < min_ndim || nd > max_ndim) {
        char buf[256];
        if (min_ndim == max_ndim)
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must have %d dimensions, got %d (shape %s)",
                         fn, name, min_ndim, nd, csa_shape_str(a, buf, sizeof buf));
        else
            PyErr_Format(PyExc_ValueError,
                         "%s(): '%s' must have %d to %d dimensions, got %d (shape %s)", fn, name,
                         min_ndim, max_ndim, nd, csa_shape_str(a, buf, sizeof buf));
        Py_DECREF(a);
        return NULL;
    }
    int well_behaved = PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a);
    if (writeable) {
        if (!PyArray_ISWRITEABLE(a)) {
            PyErr_Format(PyExc_ValueError, "%s(): '%s' is read-only; it is written in place",
                         fn, name);
            Py_DECREF(a);
            return NULL;
        }
        if (!well_behaved) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): '%s' is unaligned or byte-swapped; it is written in place, so "
                         "pass an aligned native-endian array",
                         fn, name);
            Py_DECREF(a);
            return NULL;
        }
        if (!PyArray_Check(obj) && PyArray_CHKFLAGS(a, NPY_ARRAY_OWNDATA)) {
            /* e.g. a list: the conversion made a copy, so writing to it would be lost. */
            PyErr_Format(PyExc_TypeError,
                         "%s(): '%s' is written in place, so it must be an array or tensor; "
                         "a %s would be converted to a temporary copy and the result lost",
                         fn, name, Py_TYPE(obj)->tp_name);
            Py_DECREF(a);
            return NULL;
        }
        if (csa_self_overlap(a)) {
            char buf[256];
            PyErr_Format(PyExc_ValueError,
                         "%s(): '%s' is written but its elements may overlap in memory (a zero "
                         "or overlapping stride, e.g. from broadcasting; shape %s); pass a "
                         "copy",
                         fn, name, csa_shape_str(a, buf, sizeof buf));
            Py_DECREF(a);
            return NULL;
        }
    } else if (!well_behaved) {
        /* With a NULL dtype PyArray_FromArray keeps the byte-swapped descriptor (the
         * kernel would then read big-endian floats as native ones): ask for the
         * native dtype explicitly. */
        PyArray_Descr *native = PyArray_DescrFromType(PyArray_TYPE(a));
        if (!native) {
            Py_DECREF(a);
            return NULL;
        }
        PyArrayObject *c = (PyArrayObject *)PyArray_FromArray(
            a, native, NPY_ARRAY_ALIGNED | NPY_ARRAY_NOTSWAPPED | NPY_ARRAY_ENSURECOPY);
        Py_DECREF(a);
        if (!c) return NULL;
        a = c;
    }
    return a;
}

int csa_check_dim(PyArrayObject *a, const char *fn, const char *name, int axis, npy_intp want,
                  const char *what)
{
    if (PyArray_DIM(a, axis) == want) return 0;
    char buf[256];
    PyErr_Format(PyExc_ValueError, "%s(): '%s' must have shape[%d] == %lld (%s), got shape %s",
                 fn, name, axis, (long long)want, what, csa_shape_str(a, buf, sizeof buf));
    return -1;
}

static void span(PyArrayObject *a, char **lo, char **hi)
{
    char *p = PyArray_BYTES(a), *q = p;
    for (int i = 0; i < PyArray_NDIM(a); i++) {
        npy_intp ext = (PyArray_DIM(a, i) - 1) * PyArray_STRIDE(a, i);
        if (PyArray_DIM(a, i) == 0) {
            *lo = *hi = p;
            return;
        }
        if (ext > 0) q += ext;
        else p += ext;
    }
    *lo = p;
    *hi = q + PyArray_ITEMSIZE(a);
}

int csa_may_overlap(PyArrayObject *a, PyArrayObject *b)
{
    char *alo, *ahi, *blo, *bhi;
    span(a, &alo, &ahi);
    span(b, &blo, &bhi);
    if (alo == ahi || blo == bhi) return 0;
    return alo < bhi && blo < ahi;
}

static int dtype_flag(int npy_type)
{
    return npy_type == NPY_INT32 ? CSA_I32 : npy_type == NPY_BOOL ? CSA_BOOL : CSA_F32;
}

PyArrayObject *csa_out_array(PyObject *out_arg, const char *fn, int ndim, const npy_intp *shape,
                             PyArrayObject *proto, int npy_type, PyArrayObject **inputs,
                             int n_in, int flags, int *inplace)
{
    return csa_out_array_named(out_arg, fn, "out", ndim, shape, proto, npy_type, inputs, n_in,
                               flags, inplace);
}

PyArrayObject *csa_out_array_named(PyObject *out_arg, const char *fn, const char *name, int ndim,
                                   const npy_intp *shape, PyArrayObject *proto, int npy_type,
                                   PyArrayObject **inputs, int n_in, int flags, int *inplace)
{
    const int bf16 = proto && csa_is_bf16(proto);
    if (proto) npy_type = NPY_FLOAT32;
    if (inplace) *inplace = 0;
    if (out_arg == NULL || out_arg == Py_None) {
        if (bf16) return csa_empty_like_dtype(proto, ndim, shape);
        return (PyArrayObject *)PyArray_EMPTY(ndim, (npy_intp *)shape, npy_type, 0);
    }
    PyArrayObject *o = csa_array(out_arg, fn, name, bf16 ? CSA_BF16 : dtype_flag(npy_type), ndim,
                                 ndim, 1);
    if (!o) return NULL;
    for (int i = 0; i < ndim; i++) {
        if (PyArray_DIM(o, i) != shape[i]) {
            char got[256], want[256];
            size_t k = 0;
            k += (size_t)snprintf(want + k, sizeof want - k, "[");
            for (int j = 0; j < ndim && k < sizeof want; j++)
                k += (size_t)snprintf(want + k, sizeof want - k, j ? ", %lld" : "%lld",
                                      (long long)shape[j]);
            if (k < sizeof want) snprintf(want + k, sizeof want - k, "]");
            PyErr_Format(PyExc_ValueError, "%s(): '%s' must have shape %s, got %s", fn, name, want,
                         csa_shape_str(o, got, sizeof got));
            Py_DECREF(o);
            return NULL;
        }
    }
    if ((flags & CSA_OUT_MAY_ALIAS) && n_in > 0 && inputs[0] && csa_same_view(o, inputs[0])) {
        if (inplace) *inplace = 1;
        inputs++;
        n_in--;
    }
    for (int i = 0; i < n_in; i++) {
        if (inputs[i] && csa_may_overlap(o, inputs[i])) {
            PyErr_Format(PyExc_ValueError, "%s(): '%s' overlaps an input; pass a separate array%s",
                         fn, name, (flags & CSA_OUT_MAY_ALIAS) ? " or the input itself (in place)" : "");
            Py_DECREF(o);
            return NULL;
        }
    }
    return o;
}

PyArrayObject *csa_work_array(PyArrayObject *out, int layout)
{
    const int nd = PyArray_NDIM(out);
    const int ok = layout == CSA_WORK_C_CONTIG
                       ? PyArray_IS_C_CONTIGUOUS(out)
                       : (nd == 0 || PyArray_DIM(out, nd - 1) <= 1 || csa_stride(out, nd - 1) == 1);
    if (ok) {
        Py_INCREF(out);
        return out;
    }
    return csa_empty_like_dtype(out, nd, PyArray_DIMS(out));
}

PyArrayObject *csa_unit_inner(PyArrayObject *a)
{
    const int nd = PyArray_NDIM(a);
    if (nd == 0 || PyArray_DIM(a, nd - 1) <= 1 || csa_stride(a, nd - 1) == 1) {
        Py_INCREF(a);
        return a;
    }
    return (PyArrayObject *)PyArray_NewCopy(a, NPY_CORDER);
}

int csa_same_view(PyArrayObject *a, PyArrayObject *b)
{
    if (PyArray_BYTES(a) != PyArray_BYTES(b) || PyArray_NDIM(a) != PyArray_NDIM(b)) return 0;
    for (int i = 0; i < PyArray_NDIM(a); i++)
        if (PyArray_DIM(a, i) != PyArray_DIM(b, i) ||
            (PyArray_DIM(a, i) > 1 && PyArray_STRIDE(a, i) != PyArray_STRIDE(b, i)))
            return 0;
    return 1;
}

int csa_run_rows(PyArrayObject *src, PyArrayObject *dst, const char *fn, csa_rows_kernel kernel,
                 const void *params)
{
    const int nd = PyArray_NDIM(src);
    const int inplace = src == dst;
    PyArrayObject *s = src, *t = dst, *scopy = NULL, *tcopy = NULL;
    csa_idx rows, ssr, str;
    int rc = -1;
    if (csa_fold_rows(src, &rows, &ssr)) {
        if (!(scopy = (PyArrayObject *)PyArray_NewCopy(src, NPY_CORDER))) goto done;
        s = scopy;
        if (inplace) t = scopy;
    }
    if (!inplace && csa_fold_rows(dst, &rows, &str)) {
        if (!(tcopy = csa_empty_like_dtype(dst, nd, PyArray_DIMS(dst)))) goto done;
        t = tcopy;
    }
    csa_fold_rows(s, &rows, &ssr);
    csa_fold_rows(t, &rows, &str);
    const csa_idx d = PyArray_DIM(s, nd - 1);
    const int bf16 = csa_is_bf16(s);
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = kernel(PyArray_DATA(s), rows, d, ssr, csa_stride(s, nd - 1), PyArray_DATA(t), str,
                csa_stride(t, nd - 1), bf16, params);
    Py_END_ALLOW_THREADS
    if (st) {
        csa_raise_status(st, fn);
        goto done;
    }
    if (inplace && scopy && PyArray_CopyInto(dst, scopy)) goto done;
    if (tcopy && PyArray_CopyInto(dst, tcopy)) goto done;
    rc = 0;
done:
    Py_XDECREF(scopy);
    Py_XDECREF(tcopy);
    return rc;
}

int csa_fold_rows(PyArrayObject *a, csa_idx *rows, csa_idx *row_stride)
{
    int nd = PyArray_NDIM(a);
    csa_idx r = 1, st = 0;
    int have = 0;
    for (int i = nd - 2; i >= 0; i--) {
        csa_idx n = PyArray_DIM(a, i), s = csa_stride(a, i);
        if (n == 1) continue;
        if (!have) {
            st = s;
            r = n;
            have = 1;
        } else if (s == st * r) {
            r *= n;
        } else {
            return -1;
        }
    }
    for (int i = 0; i < nd - 1; i++)
        if (PyArray_DIM(a, i) == 0) r = 0;
    *rows = r;
    *row_stride = have ? st : 0;
    return 0;
}

/* glue.h */
int csa_grad_dtype_arg(PyObject *o, const char *fn, PyArrayObject **proto)
{
    *proto = NULL;
    if (o == Py_None) return 0;
    PyArray_Descr *d = NULL;
    if (!PyArray_DescrConverter(o, &d)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s(): 'grad_dtype' must be None, 'float32' or 'bfloat16', got %R",
                     fn, o);
        return -1;
    }
    if (d->type_num == NPY_FLOAT32) {
        Py_DECREF(d);
        return 0;
    }
    PyArrayObject *t = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, d, 0, NULL, NULL,
                                                              NULL, 0, NULL);
    if (!t) return -1;
    if (!csa_is_bf16(t)) {
        PyErr_Format(PyExc_ValueError, "%s(): 'grad_dtype' must be None, 'float32' or 'bfloat16', got %R",
                     fn, o);
        Py_DECREF(t);
        return -1;
    }
    *proto = t;
    return 1;
}

PyObject *csa_finish(int status, const char *fn, PyObject *out_arg, PyArrayObject *out,
                     PyArrayObject *work)
{
    if (status) return csa_raise_status(status, fn);
    if (work && work != out && PyArray_CopyInto(out, work)) return NULL;
    PyObject *r = (out_arg && out_arg != Py_None) ? out_arg : (PyObject *)out;
    Py_INCREF(r);
    return r;
}

PyObject *csa_raise_status(int status, const char *fn)
{
    switch (status) {
    case CSA_ENOMEM:
        PyErr_Format(PyExc_MemoryError, "%s(): out of memory for scratch space", fn);
        break;
    case CSA_EINDEX:
        PyErr_Format(PyExc_IndexError, "%s(): index out of range", fn);
        break;
    default:
        PyErr_Format(PyExc_RuntimeError, "%s(): internal error (status %d)", fn, status);
    }
    return NULL;
}

int csa_int_arg(PyObject *obj, const char *fn, const char *name, long long lo, long long hi,
                long long *out)
{
    if (!obj || PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be an int, got %s", fn, name,
                     obj ? Py_TYPE(obj)->tp_name : "nothing");
        return -1;
    }
    PyObject *i = PyNumber_Index(obj);
    if (!i) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s(): '%s' must be in [%lld, %lld], got %S", fn, name, lo,
                     hi, obj);
        return -1;
    }
    *out = v;
    return 0;
}

int csa_float_arg(PyObject *obj, const char *fn, const char *name, double *out)
{
    if (!obj || PyBool_Check(obj) || !(PyFloat_Check(obj) || PyIndex_Check(obj) ||
                                       PyNumber_Check(obj)) || PyComplex_Check(obj) ||
        (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) > 0)) {
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a real number, got %s", fn, name,
                     obj ? Py_TYPE(obj)->tp_name : "nothing");
        return -1;
    }
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): '%s' must be a real number, got %s", fn, name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = v;
    return 0;
}

PyObject *csa_value_error_f(const char *fn, const char *name, const char *want, double got)
{
    char buf[64];
    snprintf(buf, sizeof buf, "%.17g", got);
    PyErr_Format(PyExc_ValueError, "%s(): '%s' must be %s, got %s", fn, name, want, buf);
    return NULL;
}
