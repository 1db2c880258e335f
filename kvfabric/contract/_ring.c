/* The ring's ordering, compiled (kvfabric/contract/ring.py is its only user; see its docstring for the layout).

   load_acquire(buffer, offset) -> int: the unsigned 64-bit word at ``offset`` of ``buffer``, read with acquire
   ordering: no later read or write of this thread (the payload copy that follows) can be seen before it.

   store_release(buffer, offset, value) -> None: ``value`` stored at ``offset`` with release ordering: every
   earlier write of this thread (the payload and its length) is visible to another core before the word is.

   Why: the ring passes messages between two processes with no lock and no system call; the producer publishes
   its write position after the bytes, the consumer its read position after copying them out. x86-64 keeps
   stores (and loads) in program order, so plain stores suffice there; aarch64 and other weakly ordered CPUs do
   not, and a reader could see a position before the bytes it covers. An acquire load paired with a release
   store is the C11 guarantee that it cannot, on every architecture (on x86-64 both compile to a plain mov).

   Safety: ``buffer`` is any object with a writable contiguous buffer (the ring's mmap); ``offset`` must be a
   multiple of 8 within it and the address 8-byte aligned (an mmap is page-aligned), else ValueError: a misaligned
   word could be torn. The atomics are lock-free (checked at compile time), so they work across processes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if !defined(__GNUC__) && !defined(__clang__)
#error "the ring's atomics need GCC or Clang (__atomic builtins)"
#endif

_Static_assert(__atomic_always_lock_free(sizeof(uint64_t), 0),
               "64-bit atomics must be lock-free: a lock would not be shared with the other process");

/* The aligned word at ``offset`` of ``view`` (acquired by the caller), or NULL with ValueError. */
static uint64_t *
word_at(Py_buffer *view, PyObject *offset_obj)
{
    Py_ssize_t offset = PyLong_AsSsize_t(offset_obj);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    if (offset < 0 || offset % 8 != 0 || offset > view->len - 8) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not an aligned 8-byte word within %zd bytes", offset,
                     view->len);
        return NULL;
    }
    char *p = (char *)view->buf + offset;
    if (((uintptr_t)p) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "the buffer is not 8-byte aligned");
        return NULL;
    }
    return (uint64_t *)p;
}

static PyObject *
load_acquire(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "load_acquire(buffer, offset)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t *w = word_at(&view, args[1]);
    uint64_t value = w == NULL ? 0 : __atomic_load_n(w, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    if (w == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *
store_release(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "store_release(buffer, offset, value)");
        return NULL;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(args[2]);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    uint64_t *w = word_at(&view, args[1]);
    if (w != NULL)
        __atomic_store_n(w, (uint64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    if (w == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load_acquire", (PyCFunction)(void (*)(void))load_acquire, METH_FASTCALL,
     "load_acquire(buffer, offset) -> int: the 64-bit word at offset, read with acquire ordering."},
    {"store_release", (PyCFunction)(void (*)(void))store_release, METH_FASTCALL,
     "store_release(buffer, offset, value): the 64-bit word at offset, written with release ordering."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfabric.contract._ring",
    "The shared-memory ring's acquire loads and release stores (see kvfabric/contract/ring.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__ring(void)
{
    return PyModule_Create(&module);
}
