/* The victim index's bookkeeping and order, compiled (kvfabric.policies.native_index wraps it).

   Same rules as kvfabric/policies/index.py's VictimIndex, which stays the reference and the fallback:
     * a block is held at most once; candidates leave lowest (order key, arrival) first, where the order key is
       the block's key (heap mode) or its segment, clamp(trunc(key), 0, last) (segment mode);
     * descendants before ancestors: a block's key is clamped under its held parent's at insertion, and a block
       that reaches the top while children of it are held is deferred (taken out of the order) until its last
       held child leaves, then put back with the same key and arrival.
   Why compiled: on vLLM's scheduler thread these run once per free, touch and eviction, between long stretches of
   vLLM's own work, so their cost is mostly cache misses on per-block Python objects. Here a block's state is a
   few bytes in arrays (the per-block ones are the Python wrapper's array.array objects, so Python reads them
   directly) and the order is an indexed binary heap: O(log n) insert, remove and pop, no stale entries.

   Safety: every input is checked before anything changes (ids and parents in range, distinct, not held; keys
   not NaN), so a bad call raises a Python exception and leaves the state as it was; nothing here can write
   outside its arrays. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    long last; /* segment mode: the last segment; -1: heap mode (keys order as they are) */
    Py_buffer views[5];
    int nviews;
    uint8_t *held;
    double *keys;
    int32_t *link;
    int32_t *nkids;
    uint8_t *deferred;
    double *okey;     /* order key */
    int64_t *arrival; /* arrival number of each held block */
    int32_t *heap;    /* block ids, a binary heap by (okey, arrival) */
    int32_t *pos;     /* each block's place in heap, -1: not in it */
    int32_t *scratch; /* discard_all's orphaned parents */
    Py_ssize_t heap_len;
    Py_ssize_t size;
    long long arrivals;
    Py_ssize_t descents;
    Py_ssize_t restores;
} Core;

static inline int
less(const Core *c, int32_t a, int32_t b)
{
    double ka = c->okey[a], kb = c->okey[b];
    return ka < kb || (ka == kb && c->arrival[a] < c->arrival[b]);
}

static void
sift_up(Core *c, Py_ssize_t i)
{
    int32_t b = c->heap[i];
    while (i > 0) {
        Py_ssize_t p = (i - 1) >> 1;
        int32_t pb = c->heap[p];
        if (!less(c, b, pb))
            break;
        c->heap[i] = pb;
        c->pos[pb] = (int32_t)i;
        i = p;
    }
    c->heap[i] = b;
    c->pos[b] = (int32_t)i;
}

static void
sift_down(Core *c, Py_ssize_t i)
{
    int32_t b = c->heap[i];
    Py_ssize_t len = c->heap_len;
    for (;;) {
        Py_ssize_t l = 2 * i + 1;
        if (l >= len)
            break;
        Py_ssize_t m = (l + 1 < len && less(c, c->heap[l + 1], c->heap[l])) ? l + 1 : l;
        if (!less(c, c->heap[m], b))
            break;
        c->heap[i] = c->heap[m];
        c->pos[c->heap[i]] = (int32_t)i;
        i = m;
    }
    c->heap[i] = b;
    c->pos[b] = (int32_t)i;
}

/* b is held, not deferred and not in the heap (so the heap has room: it holds distinct blocks). */
static void
heap_push(Core *c, int32_t b)
{
    Py_ssize_t i = c->heap_len++;
    c->heap[i] = b;
    sift_up(c, i);
}

static void
heap_remove(Core *c, int32_t b)
{
    Py_ssize_t i = c->pos[b];
    if (i < 0)
        return;
    c->pos[b] = -1;
    Py_ssize_t last = --c->heap_len;
    if (i == last)
        return;
    int32_t m = c->heap[last];
    c->heap[i] = m;
    if (i > 0 && less(c, m, c->heap[(i - 1) >> 1]))
        sift_up(c, i);
    else
        sift_down(c, i);
}

static double
order_key(const Core *c, double k)
{
    if (c->last < 0)
        return k;
    if (!(k >= 1.0)) /* below 1: segment 0, as Python's int() then the clamp */
        return 0.0;
    if (k >= (double)c->last + 1.0)
        return (double)c->last;
    return trunc(k);
}

/* A deferred block's last held child left: it goes back in its place. */
static void
restore(Core *c, int32_t p)
{
    c->deferred[p] = 0;
    c->restores++;
    heap_push(c, p);
}

/* Block b leaves the candidates: its parent has one held child fewer. Returns the parent when that was its last
   held child and it waits deferred (the caller puts it back), else -1. */
static int32_t
drop_link(Core *c, int32_t b)
{
    int32_t p = c->link[b];
    if (p < 0)
        return -1;
    c->link[b] = -1;
    return (--c->nkids[p] == 0 && c->deferred[p]) ? p : -1;
}

static int
block_id(const Core *c, PyObject *o, int32_t *out, int allow_none)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < (allow_none ? -1 : 0) || v >= c->n) {
        PyErr_Format(PyExc_IndexError, "block %ld is outside the index (0..%zd)", v, c->n - 1);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static int
Core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"held", "keys", "link", "nkids", "deferred", "last_segment", NULL};
    PyObject *objs[5];
    long last = -1;
    if (c->nviews)
        return 0; /* (already set up: a second __init__ changes nothing) */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|l", kwlist, &objs[0], &objs[1], &objs[2], &objs[3],
                                     &objs[4], &last))
        return -1;
    static const char *formats[5] = {"B", "d", "i", "i", "B"};
    static const Py_ssize_t sizes[5] = {1, sizeof(double), 4, 4, 1};
    Py_ssize_t n = -1;
    for (int i = 0; i < 5; i++) {
        Py_buffer *v = &c->views[i];
        if (PyObject_GetBuffer(objs[i], v, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        c->nviews = i + 1;
        if (v->itemsize != sizes[i] || v->format == NULL || strcmp(v->format, formats[i]) != 0) {
            PyErr_Format(PyExc_TypeError, "%s: expected an array of type '%s'", kwlist[i], formats[i]);
            return -1;
        }
        Py_ssize_t len = v->len / v->itemsize;
        if (n >= 0 && len != n) {
            PyErr_SetString(PyExc_ValueError, "the arrays must have one length");
            return -1;
        }
        n = len;
    }
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many blocks");
        return -1;
    }
    c->n = n;
    c->last = last;
    c->held = c->views[0].buf;
    c->keys = c->views[1].buf;
    c->link = c->views[2].buf;
    c->nkids = c->views[3].buf;
    c->deferred = c->views[4].buf;
    Py_ssize_t m = n > 0 ? n : 1;
    c->okey = PyMem_Calloc(m, sizeof(double));
    c->arrival = PyMem_Calloc(m, sizeof(int64_t));
    c->heap = PyMem_Calloc(m, sizeof(int32_t));
    c->pos = PyMem_Malloc(m * sizeof(int32_t));
    c->scratch = PyMem_Calloc(m, sizeof(int32_t));
    if (!c->okey || !c->arrival || !c->heap || !c->pos || !c->scratch) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        c->pos[b] = -1;
        if (c->held[b] || c->deferred[b] || c->nkids[b] || c->link[b] != -1) {
            PyErr_SetString(PyExc_ValueError, "the arrays must start empty (held 0, link -1, nkids 0)");
            return -1;
        }
    }
    return 0;
}

static void
Core_dealloc(Core *c)
{
    for (int i = 0; i < c->nviews; i++)
        PyBuffer_Release(&c->views[i]);
    PyMem_Free(c->okey);
    PyMem_Free(c->arrival);
    PyMem_Free(c->heap);
    PyMem_Free(c->pos);
    PyMem_Free(c->scratch);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int
ready(const Core *c)
{
    if (c->okey == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the index core was not initialised");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(insert_doc,
"insert(ids, keys, parents)\n\n"
"Blocks ids (distinct, none held) become candidates, in this order, with keys (a list, clamped in place under\n"
"held parents' keys) and parents (the block holding each one's parent content, -1: none).");

static PyObject *
Core_insert(Core *c, PyObject *args)
{
    PyObject *ids, *keys, *parents;
    if (!ready(c) || !PyArg_ParseTuple(args, "O!O!O!:insert", &PyList_Type, &ids, &PyList_Type, &keys,
                                       &PyList_Type, &parents))
        return NULL;
    Py_ssize_t m = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(keys) != m || PyList_GET_SIZE(parents) != m) {
        PyErr_SetString(PyExc_ValueError, "ids, keys and parents must have one length");
        return NULL;
    }
    /* Check everything first; mark the ids (held = 2) to catch repeats, and unmark. */
    Py_ssize_t marked = 0;
    int bad = 0;
    for (Py_ssize_t i = 0; i < m && !bad; i++) {
        int32_t b, p;
        if (block_id(c, PyList_GET_ITEM(ids, i), &b, 0) < 0 || block_id(c, PyList_GET_ITEM(parents, i), &p, 1) < 0) {
            bad = 1;
            break;
        }
        double k = PyFloat_AsDouble(PyList_GET_ITEM(keys, i));
        if (k == -1.0 && PyErr_Occurred()) {
            bad = 1;
            break;
        }
        if (isnan(k) || c->held[b] || p == b) {
            PyErr_Format(PyExc_ValueError, "block %d: %s", (int)b,
                         isnan(k) ? "its key is NaN" : p == b ? "its own parent" : "already held or repeated");
            bad = 1;
            break;
        }
        c->held[b] = 2;
        c->scratch[marked++] = b;
    }
    for (Py_ssize_t i = 0; i < marked; i++)
        c->held[c->scratch[i]] = 0;
    if (bad)
        return NULL;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t b = (int32_t)PyLong_AsLong(PyList_GET_ITEM(ids, i));
        int32_t p = (int32_t)PyLong_AsLong(PyList_GET_ITEM(parents, i));
        double k = PyFloat_AsDouble(PyList_GET_ITEM(keys, i));
        if (p >= 0) {
            if (c->held[p] && c->keys[p] < k) { /* a child never outranks its held parent; ties go deeper-first */
                k = c->keys[p];
                PyObject *f = PyFloat_FromDouble(k);
                if (f == NULL) { /* (out of memory: the blocks before this one are in, consistently) */
                    c->size += i;
                    return NULL;
                }
                PyList_SetItem(keys, i, f);
            }
            c->link[b] = p;
            c->nkids[p]++;
        }
        c->held[b] = 1;
        c->keys[b] = k;
        c->okey[b] = order_key(c, k);
        c->arrival[b] = ++c->arrivals;
        heap_push(c, b);
    }
    c->size += m;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(discard_all_doc,
"discard_all(ids)\n\nBlocks ids leave the candidates (in use again); those not held are skipped.");

static PyObject *
Core_discard_all(Core *c, PyObject *arg)
{
    if (!ready(c))
        return NULL;
    PyObject *seq = PySequence_Fast(arg, "discard_all() takes a sequence of block ids");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t b;
        if (block_id(c, items[i], &b, 0) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_ssize_t orphaned = 0, gone = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t b = (int32_t)PyLong_AsLong(items[i]);
        if (!c->held[b])
            continue;
        c->held[b] = 0;
        gone++;
        if (c->deferred[b])
            c->deferred[b] = 0;
        else
            heap_remove(c, b);
        int32_t p = drop_link(c, b);
        if (p >= 0)
            c->scratch[orphaned++] = p; /* (a block is orphaned once: its count reaches 0 once here) */
    }
    c->size -= gone;
    for (Py_ssize_t i = 0; i < orphaned; i++) {
        int32_t p = c->scratch[i];
        if (c->deferred[p] && !c->nkids[p]) /* (one discarded here too is no longer deferred) */
            restore(c, p);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* The next victim (a held block with no held children), or -1 when none is held. */
static int32_t
take(Core *c)
{
    while (c->heap_len > 0) {
        int32_t b = c->heap[0];
        heap_remove(c, b);
        if (c->nkids[b]) {
            c->deferred[b] = 1; /* back in its place when its last held child leaves */
            c->descents++;
            continue;
        }
        c->held[b] = 0;
        c->size--;
        int32_t p = drop_link(c, b);
        if (p >= 0)
            restore(c, p);
        return b;
    }
    return -1;
}

PyDoc_STRVAR(pop_doc, "pop()\n\nTake the next victim, or None when nothing is held.");

static PyObject *
Core_pop(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (!ready(c))
        return NULL;
    int32_t b = take(c);
    if (b < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(b);
}

PyDoc_STRVAR(pop_n_doc, "pop_n(n)\n\nTake up to n victims, in order; fewer only when fewer are held.");

static PyObject *
Core_pop_n(Core *c, PyObject *arg)
{
    if (!ready(c))
        return NULL;
    Py_ssize_t want = PyLong_AsSsize_t(arg);
    if (want == -1 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < want; i++) {
        int32_t b = take(c);
        if (b < 0)
            break;
        PyObject *v = PyLong_FromLong(b);
        if (v == NULL || PyList_Append(out, v) < 0) {
            /* (b left the index already: out of memory here loses it from the order, never corrupts it) */
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {NULL, NULL, 0, NULL},
};

static PyMethodDef Core_methods[] = {
    {"insert", (PyCFunction)Core_insert, METH_VARARGS, insert_doc},
    {"discard_all", (PyCFunction)Core_discard_all, METH_O, discard_all_doc},
    {"pop", (PyCFunction)Core_pop, METH_NOARGS, pop_doc},
    {"pop_n", (PyCFunction)Core_pop_n, METH_O, pop_n_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *
Core_get_size(Core *c, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(c->size);
}

static PyObject *
Core_get_descents(Core *c, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(c->descents);
}

static PyObject *
Core_get_restores(Core *c, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(c->restores);
}

static PyGetSetDef Core_getset[] = {
    {"size", (getter)Core_get_size, NULL, "Candidates held (deferred ones included).", NULL},
    {"descents", (getter)Core_get_descents, NULL, "Times a block reached the top with held children.", NULL},
    {"restores", (getter)Core_get_restores, NULL, "Deferred blocks put back.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfabric.policies._order.Core",
    .tp_basicsize = sizeof(Core),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Core(held, keys, link, nkids, deferred, last_segment=-1): a victim index's state and order."),
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
    .tp_init = (initproc)Core_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfabric.policies._order", "The victim index's order, compiled (see native_index.py).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__order(void)
{
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
