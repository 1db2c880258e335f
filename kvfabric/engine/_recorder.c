/* The engine's compiled part (kvfabric.engine.compiled wraps it): the plain recording of the four frequent pool
   calls (the Python hooks in kvfabric/engine/pool.py are the reference, the fallback and the slow path), and a
   free's steering candidates in one pass (freed_candidates, near the end; kvfabric/engine/steering/victims.py's
   freed_candidates_py is its reference).

   columns(blocks, names, pool=None) -> tuple of lists: for each name in names, the list of that attribute of
   every block, in the blocks' order; with pool given, only of the blocks whose .pool is pool.

   Hook(kind, original, slow, recorder, ...): a callable that stands in for one of vLLM's BlockPool methods
   (get_new_blocks, touch, free_blocks, cache_full_blocks). Called, it either passes the call whole to ``slow``
   (the Python hook for that method, which calls vLLM itself) or, in the common case, takes the fast path: it
   calls vLLM's method with the arguments exactly as received (vectorcall: nothing repacked) and appends the same
   record the Python hook makes, applying it as Recorder.add does (the steering keeper's handler, then the record
   list). The fast path is taken only when the Python hook would do nothing but record: the recorder is on and of
   exactly the Recorder type it was built for (so a subclass's add is honoured), no admission gate (it changes
   cache_full_blocks' mask), the recorder's clock is time.time_ns (a replay's simulated clock is not), the record
   list is a plain list (or None: not recording), and the arguments have the shape vLLM 0.26/0.33 pass. Anything
   else takes the slow path, so behaviour is always the Python hook's; tests compare the two record by record.

   Why compiled: these calls run on vLLM's scheduler thread, a few thousand times per second, each between long
   stretches of vLLM's own work. Their cost is mostly the interpreter's: a frame, argument repacking (vLLM passes
   cache_full_blocks keywords), one list comprehension per field, a few method calls, all in cold caches.

   Safety: vLLM's result or exception is returned or raised unchanged; a failure while recording is passed to
   the recorder's failed(where, exc), which turns recording off, as the Python hook's except clause does. Fields
   are read at slot offsets only for objects of exactly the type the offset came from, where the attribute is a
   plain object slot; anything else goes through getattr. Nothing is mutated but new objects, the record list
   and the recorder's victims slot (set to None, as the Python hook does). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_NAMES 4
#ifndef READ_RESTRICTED /* (named Py_AUDIT_READ since 3.12) */
#define READ_RESTRICTED Py_AUDIT_READ
#endif

/* ---- fields of blocks ---------------------------------------------------------------------------------------- */

/* The offset of ``name`` on ``tp`` when it is a plain object slot, else -1. */
static Py_ssize_t
slot_offset(PyTypeObject *tp, PyObject *name)
{
    PyObject *d = _PyType_Lookup(tp, name); /* borrowed; no error set */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if ((m->type != T_OBJECT_EX && m->type != T_OBJECT) || (m->flags & READ_RESTRICTED))
        return -1;
    return m->offset;
}

/* New reference to ``b``'s attribute ``name`` (slot at ``off`` when off >= 0), or NULL with an exception. */
static PyObject *
field(PyObject *b, PyObject *name, Py_ssize_t off)
{
    if (off < 0)
        return PyObject_GetAttr(b, name);
    PyObject *v = *(PyObject **)((char *)b + off);
    if (v == NULL) {
        PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%U'", Py_TYPE(b)->tp_name, name);
        return NULL;
    }
    return Py_NewRef(v);
}

static PyObject *pool_name; /* "pool", interned at import */

/* A tuple of k new lists: for each of names[0..k), that attribute of each of items[0..n) (only of the items whose
   .pool is ``pool`` unless pool is NULL or None). NULL with an exception on failure. */
static PyObject *
read_columns(PyObject *const *items, Py_ssize_t n, PyObject *const *names, Py_ssize_t k, PyObject *pool)
{
    int filtered = pool != NULL && pool != Py_None;
    PyObject *out = PyTuple_New(k);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < k; j++) {
        /* Unfiltered, every block has a place: the lists are filled in place. */
        PyObject *l = PyList_New(filtered ? 0 : n);
        if (l == NULL)
            goto fail;
        PyTuple_SET_ITEM(out, j, l);
    }
    PyTypeObject *tp = NULL;
    Py_ssize_t off[MAX_NAMES] = {-1, -1, -1, -1}, pool_off = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = items[i];
        if (Py_TYPE(b) != tp) {
            tp = Py_TYPE(b);
            for (Py_ssize_t j = 0; j < k; j++)
                off[j] = slot_offset(tp, names[j]);
            pool_off = filtered ? slot_offset(tp, pool_name) : -1;
        }
        if (filtered) {
            PyObject *p = field(b, pool_name, pool_off);
            if (p == NULL)
                goto fail;
            Py_DECREF(p); /* (compared by identity only) */
            if (p != pool)
                continue;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *v = field(b, names[j], off[j]);
            if (v == NULL)
                goto fail;
            PyObject *l = PyTuple_GET_ITEM(out, j);
            if (!filtered) {
                PyList_SET_ITEM(l, i, v); /* steals v */
            } else {
                int rc = PyList_Append(l, v);
                Py_DECREF(v);
                if (rc < 0)
                    goto fail;
            }
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(columns_doc,
"columns(blocks, names, pool=None) -> tuple[list, ...]\n\n"
"For each name in names (a tuple of 1 to 4 str), the list of that attribute of every block, in order; with pool\n"
"given, only of the blocks whose .pool is pool.");

static PyObject *
columns(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "columns(blocks, names, pool=None) takes 2 or 3 arguments");
        return NULL;
    }
    PyObject *names = args[1], *pool = nargs == 3 ? args[2] : Py_None;
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) < 1 || PyTuple_GET_SIZE(names) > MAX_NAMES) {
        PyErr_SetString(PyExc_TypeError, "names must be a tuple of 1 to 4 attribute names");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(names); j++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(names, j))) {
            PyErr_SetString(PyExc_TypeError, "names must be a tuple of 1 to 4 attribute names");
            return NULL;
        }
    }
    PyObject *seq = PySequence_Fast(args[0], "blocks must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *out = read_columns(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq),
                                 &PyTuple_GET_ITEM(names, 0), PyTuple_GET_SIZE(names), pool);
    Py_DECREF(seq);
    return out;
}

/* ---- the hooks ----------------------------------------------------------------------------------------------- */

enum { K_ALLOCATED, K_TOUCHED, K_FREED, K_SEALED, K_KINDS };
static const char *const kind_names[K_KINDS] = {"get_new_blocks", "touch", "free_blocks", "cache_full_blocks"};
static const char *const failure_names[K_KINDS] = {"recording an allocation", "recording a touch",
                                                   "recording a free", "recording a seal"};
static const long op_codes[K_KINDS] = {4, 5, 6, 7}; /* records.ALLOCATED, TOUCHED, FREED, SEALED (checked) */

/* The Recorder's slots the fast path reads. */
enum { R_ON, R_KEEPER, R_LOG, R_GATE, R_RID, R_VICTIMS, R_STEPPER, R_HANDOVER_AT, R_HANDOVER, R_FAMILIES, R_CLOCK,
       R_SLOTS };
static const char *const recorder_slots[R_SLOTS] = {"on", "keeper", "log", "gate", "rid", "victims", "stepper",
                                                   "handover_at", "handover", "families", "clock"};

/* cache_full_blocks' parameters, as vLLM 0.26/0.33 name them. */
enum { P_REQUEST, P_BLOCKS, P_CACHED, P_FULL, P_BLOCK_SIZE, P_GROUP, P_MASK, P_PARAMS };
static const char *const seal_params[P_PARAMS] = {"request", "blocks", "num_cached_blocks", "num_full_blocks",
                                                  "block_size", "kv_cache_group_id", "block_mask"};

static PyObject *s_block_id, *s_ref_cnt, *s_current_step, *s_block_hashes, *s_request_id, *s_family_of,
    *s_failed, *s_handler, *s_append, *s_monotonic, *s_params[P_PARAMS];
static PyObject *time_module, *wall_clock; /* the time module; time.time_ns as it was at import */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
    PyObject *original;      /* vLLM's bound method */
    PyObject *slow;          /* the Python hook: the whole call goes there unless the fast path applies */
    PyObject *recorder;
    PyTypeObject *recorder_type;
    PyObject *owner;         /* free_blocks: record only this pool's blocks (None: all) */
    PyObject *hash_name;     /* the block's hash attribute ("_block_hash" where block_hash is its property) */
    long hash_block_size;    /* the pool's hash block size, 0 when it has none */
    Py_ssize_t handover_records;
    Py_ssize_t r_off[R_SLOTS];
} Hook;

static inline PyObject *
rslot(Hook *h, int which) /* borrowed; NULL when the slot is empty */
{
    return *(PyObject **)((char *)h->recorder + h->r_off[which]);
}

static int64_t
clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Whether this call may take the fast path (see the top of the file); no exception is ever set. */
static int
fast_path_applies(Hook *h, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (Py_TYPE(h->recorder) != h->recorder_type || rslot(h, R_ON) != Py_True || rslot(h, R_CLOCK) != wall_clock)
        return 0;
    PyObject *log = rslot(h, R_LOG);
    if (log == NULL || !(log == Py_None || PyList_CheckExact(log)))
        return 0;
    switch (h->kind) {
    case K_ALLOCATED:
        return 1;
    case K_TOUCHED: /* touch(blocks): a list of blocks (0.33), not a tuple of per-group lists (older releases) */
    case K_FREED:   /* free_blocks(ordered_blocks) */
        if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0))
            return 0;
        if (h->kind == K_TOUCHED)
            return PyList_CheckExact(args[0]) &&
                   (PyList_GET_SIZE(args[0]) == 0 || !(PyList_Check(PyList_GET_ITEM(args[0], 0)) ||
                                                       PyTuple_Check(PyList_GET_ITEM(args[0], 0))));
        return 1;
    case K_SEALED:
        return rslot(h, R_GATE) == Py_None;
    }
    return 0;
}

/* What Recorder.add does with ``record`` (stolen): apply it to the keeper, if any (the keeper's handler for its op,
   if it has one), then append it to the record list, if recording, and hand over when due. -1 with an exception
   on failure. */
static int
append_record(Hook *h, PyObject *record)
{
    if (record == NULL)
        return -1;
    PyObject *keeper = rslot(h, R_KEEPER);
    if (keeper != NULL && keeper != Py_None) {
        PyObject *apply = PyObject_CallMethodOneArg(keeper, s_handler, PyTuple_GET_ITEM(record, 0));
        if (apply == NULL) {
            Py_DECREF(record);
            return -1;
        }
        PyObject *res = apply == Py_None ? Py_NewRef(Py_None) : PyObject_CallOneArg(apply, record);
        Py_DECREF(apply);
        if (res == NULL) {
            Py_DECREF(record);
            return -1;
        }
        Py_DECREF(res);
    }
    PyObject *log = rslot(h, R_LOG);
    if (log == NULL || log == Py_None) {
        Py_DECREF(record);
        return 0;
    }
    if (!PyList_CheckExact(log)) { /* (the keeper replaced it: Recorder.add appends to whatever it is) */
        PyObject *res = PyObject_CallMethodOneArg(log, s_append, record);
        Py_DECREF(record);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    } else {
        int rc = PyList_Append(log, record);
        Py_DECREF(record);
        if (rc < 0)
            return -1;
    }
    Py_ssize_t pending = PyObject_Length(log);
    if (pending < 0)
        return -1;
    int due = pending >= h->handover_records;
    if (!due) {
        PyObject *at = rslot(h, R_HANDOVER_AT);
        double when = at == NULL ? 0.0 : PyFloat_AsDouble(at);
        if (when == -1.0 && PyErr_Occurred())
            return -1;
        /* time.monotonic(), looked up as Recorder.add looks it up (tests freeze it) */
        PyObject *monotonic = PyObject_GetAttr(time_module, s_monotonic);
        PyObject *now = monotonic == NULL ? NULL : PyObject_CallNoArgs(monotonic);
        Py_XDECREF(monotonic);
        double t = now == NULL ? -1.0 : PyFloat_AsDouble(now);
        Py_XDECREF(now);
        if (t == -1.0 && PyErr_Occurred())
            return -1;
        due = t >= when;
    }
    if (due) {
        PyObject *handover = rslot(h, R_HANDOVER);
        if (handover == NULL) {
            PyErr_SetString(PyExc_AttributeError, "the recorder has no handover");
            return -1;
        }
        PyObject *res = PyObject_CallNoArgs(handover);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    }
    return 0;
}

/* (ts, step): the record's timestamp and scheduler step, as new references; -1 with an exception on failure. */
static int
stamp(Hook *h, PyObject **ts, PyObject **step)
{
    *ts = PyLong_FromLongLong(clock_ns(CLOCK_REALTIME)); /* time.time_ns() */
    if (*ts == NULL)
        return -1;
    PyObject *stepper = rslot(h, R_STEPPER);
    *step = (stepper == NULL || stepper == Py_None) ? PyLong_FromLong(0)
                                                   : PyObject_GetAttr(stepper, s_current_step);
    if (*step == NULL) {
        Py_CLEAR(*ts);
        return -1;
    }
    return 0;
}

static PyObject *
borrowed_or_none(PyObject *o)
{
    return Py_NewRef(o == NULL ? Py_None : o);
}

/* The record of a call that moved ref counts: (op, ts, step, rid, ids, refs). */
static int
record_refs(Hook *h, PyObject *blocks, PyObject *owner)
{
    PyObject *names[2] = {s_block_id, s_ref_cnt};
    PyObject *cols = read_columns(&PyList_GET_ITEM(blocks, 0), PyList_GET_SIZE(blocks), names, 2, owner);
    if (cols == NULL)
        return -1;
    PyObject *ts, *step;
    if (stamp(h, &ts, &step) < 0) {
        Py_DECREF(cols);
        return -1;
    }
    PyObject *rec = Py_BuildValue("(lNNNOO)", op_codes[h->kind], ts, step, borrowed_or_none(rslot(h, R_RID)),
                                  PyTuple_GET_ITEM(cols, 0), PyTuple_GET_ITEM(cols, 1));
    Py_DECREF(cols);
    return append_record(h, rec);
}

static int
record_allocation(Hook *h, PyObject *blocks)
{
    if (!PyList_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "get_new_blocks returned no list");
        return -1;
    }
    PyObject *names[1] = {s_block_id};
    PyObject *cols = read_columns(&PyList_GET_ITEM(blocks, 0), PyList_GET_SIZE(blocks), names, 1, NULL);
    if (cols == NULL)
        return -1;
    /* (The victims steering chose inside this call ride in its record: no record of their own.) */
    PyObject **victims_slot = (PyObject **)((char *)h->recorder + h->r_off[R_VICTIMS]);
    PyObject *victims = *victims_slot == NULL ? Py_NewRef(Py_None) : *victims_slot; /* (owned now) */
    *victims_slot = Py_NewRef(Py_None);
    PyObject *ts, *step;
    if (stamp(h, &ts, &step) < 0) {
        Py_DECREF(cols);
        Py_DECREF(victims);
        return -1;
    }
    PyObject *rec = Py_BuildValue("(lNNNON)", op_codes[K_ALLOCATED], ts, step, borrowed_or_none(rslot(h, R_RID)),
                                  PyTuple_GET_ITEM(cols, 0), victims);
    Py_DECREF(cols);
    return append_record(h, rec);
}

/* The family of ``request``: the recorder's cached one, else Recorder.family_of (which caches it). */
static PyObject *
family_of(Hook *h, PyObject *request, PyObject *rid)
{
    PyObject *families = rslot(h, R_FAMILIES);
    if (families != NULL && PyDict_CheckExact(families)) {
        PyObject *fam = PyDict_GetItemWithError(families, rid);
        if (fam != NULL && !(PyUnicode_CheckExact(fam) && PyUnicode_GET_LENGTH(fam) == 0))
            return Py_NewRef(fam);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_CallMethodOneArg(h->recorder, s_family_of, request);
}

/* cache_full_blocks' record (see records.py, SEALED), from its bound arguments. */
static int
record_seal(Hook *h, PyObject *const *p)
{
    PyObject *request = p[P_REQUEST], *blocks = p[P_BLOCKS], *mask = p[P_MASK];
    Py_ssize_t start = PyLong_AsSsize_t(p[P_CACHED]), end = PyLong_AsSsize_t(p[P_FULL]);
    long block_size = PyLong_AsLong(p[P_BLOCK_SIZE]);
    if (PyErr_Occurred())
        return -1;
    if (start >= end)
        return 0;
    if (!PyList_Check(blocks) || start < 0 || end > PyList_GET_SIZE(blocks)) {
        PyErr_SetString(PyExc_ValueError, "cache_full_blocks: blocks do not cover num_full_blocks");
        return -1;
    }
    PyObject *rid = NULL, *family = NULL, *hashes = NULL, *prev = NULL, *parent_raw = NULL, *cols = NULL,
             *ts = NULL, *step = NULL, *ids = NULL, *raws = NULL;
    int rc = -1;
    if ((rid = PyObject_GetAttr(request, s_request_id)) == NULL)
        goto done;
    if ((family = family_of(h, request, rid)) == NULL)
        goto done;
    if (h->hash_block_size == 0 || h->hash_block_size == block_size) {
        if ((hashes = PyObject_GetAttr(request, s_block_hashes)) == NULL)
            goto done;
        if (!PyList_Check(hashes))
            Py_CLEAR(hashes); /* (not vLLM's list: read what the blocks store) */
    }
    if (start > 0) {
        if ((prev = PyObject_GetAttr(PyList_GET_ITEM(blocks, start - 1), s_block_id)) == NULL)
            goto done;
        if (hashes != NULL && start - 1 < PyList_GET_SIZE(hashes))
            parent_raw = Py_NewRef(PyList_GET_ITEM(hashes, start - 1));
    }
    PyObject *const *sealed = &PyList_GET_ITEM(blocks, start);
    if (hashes != NULL && (mask == NULL || mask == Py_None) && PyList_GET_SIZE(hashes) >= end) {
        /* Every block got its position's hash (a null block's is dropped by its id, as vLLM skips it). */
        PyObject *names[1] = {s_block_id};
        if ((cols = read_columns(sealed, end - start, names, 1, NULL)) == NULL)
            goto done;
        ids = Py_NewRef(PyTuple_GET_ITEM(cols, 0));
        if ((raws = PyList_GetSlice(hashes, start, end)) == NULL)
            goto done;
    } else { /* some blocks masked, or hashes of another block size: read what vLLM stored */
        PyObject *names[2] = {s_block_id, h->hash_name};
        if ((cols = read_columns(sealed, end - start, names, 2, NULL)) == NULL)
            goto done;
        ids = Py_NewRef(PyTuple_GET_ITEM(cols, 0));
        raws = Py_NewRef(PyTuple_GET_ITEM(cols, 1));
    }
    if (stamp(h, &ts, &step) < 0)
        goto done;
    rc = append_record(h, Py_BuildValue("(lOOOOnOOOO)", op_codes[K_SEALED], ts, step, rid, family, start,
                                        prev ? prev : Py_None, ids, raws, parent_raw ? parent_raw : Py_None));
done:
    Py_XDECREF(rid);
    Py_XDECREF(family);
    Py_XDECREF(hashes);
    Py_XDECREF(prev);
    Py_XDECREF(parent_raw);
    Py_XDECREF(cols);
    Py_XDECREF(ts);
    Py_XDECREF(step);
    Py_XDECREF(ids);
    Py_XDECREF(raws);
    return rc;
}

/* Bind cache_full_blocks' arguments (borrowed) by position or keyword; 0 when the call has another shape. */
static int
bind_seal(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **p)
{
    if (nargs > P_PARAMS)
        return 0;
    for (int i = 0; i < P_PARAMS; i++)
        p[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int found = 0;
        for (int i = 0; i < P_PARAMS && !found; i++) {
            if (name == s_params[i] || PyUnicode_Compare(name, s_params[i]) == 0) {
                if (p[i] != NULL)
                    return 0; /* (given twice: vLLM will say so) */
                p[i] = args[nargs + k];
                found = 1;
            }
        }
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (!found)
            return 0;
    }
    for (int i = 0; i < P_MASK; i++) /* (block_mask may be absent: vLLM's default is None) */
        if (p[i] == NULL)
            return 0;
    return 1;
}

/* KVFabric failed while recording: pass the exception to recorder.failed(where, exc) (it counts, logs once and
   turns recording off). Never raises: vLLM is not affected. */
static void
recording_failed(Hook *h)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *where = PyUnicode_FromString(failure_names[h->kind]);
    PyObject *res = where == NULL ? NULL
                                  : PyObject_CallMethodObjArgs(h->recorder, s_failed, where,
                                                               value ? value : Py_None, NULL);
    if (res == NULL)
        PyErr_Clear();
    Py_XDECREF(res);
    Py_XDECREF(where);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static PyObject *
Hook_vectorcall(Hook *h, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!fast_path_applies(h, args, nargs, kwnames))
        return PyObject_Vectorcall(h->slow, args, nargsf, kwnames);
    PyObject *result = NULL;
    int rc = 0;
    switch (h->kind) {
    case K_ALLOCATED:
        result = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
        if (result != NULL && rslot(h, R_ON) == Py_True)
            rc = record_allocation(h, result);
        break;
    case K_TOUCHED:
        result = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
        if (result != NULL && rslot(h, R_ON) == Py_True)
            rc = record_refs(h, args[0], NULL);
        break;
    case K_FREED: {
        /* The iterable is read once (vLLM passes reversed(...)): vLLM gets the list, the record reads it. */
        PyObject *blocks = PySequence_List(args[0]);
        if (blocks == NULL)
            return NULL; /* (as the Python hook's list() would raise, before vLLM's call) */
        result = PyObject_CallOneArg(h->original, blocks);
        if (result != NULL && rslot(h, R_ON) == Py_True)
            rc = record_refs(h, blocks, h->owner);
        Py_DECREF(blocks);
        break;
    }
    case K_SEALED: {
        PyObject *p[P_PARAMS];
        if (!bind_seal(args, nargs, kwnames, p))
            return PyObject_Vectorcall(h->slow, args, nargsf, kwnames);
        result = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
        if (result != NULL && rslot(h, R_ON) == Py_True)
            rc = record_seal(h, p);
        break;
    }
    }
    if (rc < 0)
        recording_failed(h);
    return result;
}

static PyObject *
Hook_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static int
Hook_traverse(Hook *h, visitproc visit, void *arg)
{
    Py_VISIT(h->original);
    Py_VISIT(h->slow);
    Py_VISIT(h->recorder);
    Py_VISIT(h->recorder_type);
    Py_VISIT(h->owner);
    Py_VISIT(h->hash_name);
    return 0;
}

static int
Hook_clear(Hook *h)
{
    Py_CLEAR(h->original);
    Py_CLEAR(h->slow);
    Py_CLEAR(h->recorder);
    Py_CLEAR(h->recorder_type);
    Py_CLEAR(h->owner);
    Py_CLEAR(h->hash_name);
    return 0;
}

static void
Hook_dealloc(Hook *h)
{
    PyObject_GC_UnTrack(h);
    Hook_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *
Hook_get_wrapped(Hook *h, void *Py_UNUSED(closure))
{
    return Py_NewRef(h->original);
}

static PyObject *
Hook_get_slow(Hook *h, void *Py_UNUSED(closure))
{
    return Py_NewRef(h->slow);
}

static PyObject *
Hook_get_name(Hook *h, void *Py_UNUSED(closure))
{
    return PyUnicode_FromFormat("kvfabric_%s", kind_names[h->kind]);
}

static PyGetSetDef Hook_getset[] = {
    {"__wrapped__", (getter)Hook_get_wrapped, NULL, "vLLM's method.", NULL},
    {"slow", (getter)Hook_get_slow, NULL, "The Python hook (the reference, and the path of every other call).", NULL},
    {"__name__", (getter)Hook_get_name, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *
Hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"method", "original", "slow", "recorder", "owner", "hash_name", "hash_block_size",
                             "handover_records", "op", NULL};
    const char *method;
    PyObject *original, *slow, *recorder, *owner, *hash_name, *hash_block_size;
    Py_ssize_t handover_records;
    long op;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOOOOUOnl:Hook", kwlist, &method, &original, &slow, &recorder,
                                     &owner, &hash_name, &hash_block_size, &handover_records, &op))
        return NULL;
    int kind = -1;
    for (int k = 0; k < K_KINDS; k++)
        if (strcmp(method, kind_names[k]) == 0)
            kind = k;
    if (kind < 0) {
        PyErr_Format(PyExc_ValueError, "no compiled hook for %s", method);
        return NULL;
    }
    if (op != op_codes[kind]) {
        PyErr_Format(PyExc_ValueError, "%s records op %ld here, %ld in records.py", method, op_codes[kind], op);
        return NULL;
    }
    if (!PyCallable_Check(original) || !PyCallable_Check(slow) || handover_records < 1) {
        PyErr_SetString(PyExc_TypeError, "original and slow must be callable, handover_records positive");
        return NULL;
    }
    long hbs = 0;
    if (hash_block_size != Py_None && ((hbs = PyLong_AsLong(hash_block_size)) == -1 && PyErr_Occurred()))
        return NULL;
    Hook *h = (Hook *)type->tp_alloc(type, 0);
    if (h == NULL)
        return NULL;
    for (int i = 0; i < R_SLOTS; i++) {
        PyObject *name = PyUnicode_InternFromString(recorder_slots[i]);
        if (name == NULL) {
            Py_DECREF(h);
            return NULL;
        }
        h->r_off[i] = slot_offset(Py_TYPE(recorder), name);
        Py_DECREF(name);
        if (h->r_off[i] < 0) {
            PyErr_Format(PyExc_TypeError, "the recorder has no slot %s", recorder_slots[i]);
            Py_DECREF(h);
            return NULL;
        }
    }
    h->vectorcall = (vectorcallfunc)Hook_vectorcall;
    h->kind = kind;
    h->original = Py_NewRef(original);
    h->slow = Py_NewRef(slow);
    h->recorder = Py_NewRef(recorder);
    h->recorder_type = (PyTypeObject *)Py_NewRef((PyObject *)Py_TYPE(recorder));
    h->owner = Py_NewRef(owner);
    h->hash_name = Py_NewRef(hash_name);
    h->hash_block_size = hbs;
    h->handover_records = handover_records;
    return (PyObject *)h;
}

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfabric.engine._recorder.Hook",
    .tp_basicsize = sizeof(Hook),
    .tp_dealloc = (destructor)Hook_dealloc,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_call = Hook_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = PyDoc_STR("Hook(method, original, slow, recorder, owner, hash_name, hash_block_size, "
                        "handover_records, op): one BlockPool method, recorded (see the module's source)."),
    .tp_traverse = (traverseproc)Hook_traverse,
    .tp_clear = (inquiry)Hook_clear,
    .tp_getset = Hook_getset,
    .tp_new = Hook_new,
};

PyDoc_STRVAR(freed_candidates_doc,
"freed_candidates(ids, refs, blocks, field, null, chain, names, hash64) -> (ids, parents)\n\n"
"The blocks of one free that become candidates (see kvfabric.engine.steering.victims.freed_candidates_py, the reference).");

/* One free's candidates, in one pass: steering's hot path (a call per vLLM free), fused here because each of its
   Python passes over the free's blocks (read vLLM's hashes, filter, digest, name, link) pays the cold caches
   again. Checked inputs; on an error, names already written stay (each is a block's true content digest). */
static PyObject *
freed_candidates(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *ids, *refs, *blocks, *field, *names, *hash64;
    long null;
    int chain;
    if (!PyArg_ParseTuple(args, "O!O!O!UlpOO:freed_candidates", &PyList_Type, &ids, &PyList_Type, &refs,
                          &PyList_Type, &blocks, &field, &null, &chain, &names, &hash64))
        return NULL;
    if (names != Py_None && !PyList_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "names must be a list or None");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(refs) != n) {
        PyErr_SetString(PyExc_ValueError, "ids and refs must have one length");
        return NULL;
    }
    Py_ssize_t nblocks = PyList_GET_SIZE(blocks);
    Py_ssize_t nnames = names == Py_None ? 0 : PyList_GET_SIZE(names);
    PyObject *out = PyList_New(0);
    PyObject *parents = chain ? PyList_New(0) : NULL;
    if (out == NULL || (chain && parents == NULL))
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        int nonzero = PyObject_IsTrue(PyList_GET_ITEM(refs, i));
        if (nonzero < 0)
            goto fail;
        if (nonzero)
            continue; /* another request still holds it */
        PyObject *idobj = PyList_GET_ITEM(ids, i);
        Py_ssize_t b = PyLong_AsSsize_t(idobj);
        if (b == -1 && PyErr_Occurred())
            goto fail;
        if (b < 0 || b >= nblocks || (names != Py_None && b >= nnames)) {
            PyErr_Format(PyExc_IndexError, "block %zd is outside the pool", b);
            goto fail;
        }
        PyObject *raw = PyObject_GetAttr(PyList_GET_ITEM(blocks, b), field);
        if (raw == NULL)
            goto fail;
        if (raw == Py_None) { /* (not cached: reusing it evicts nothing) */
            Py_DECREF(raw);
            continue;
        }
        if (names != Py_None) {
            PyObject *d;
            if (PyBytes_CheckExact(raw) && PyBytes_GET_SIZE(raw) >= 8) { /* schema.hash64: the first 8 bytes */
                const unsigned char *c = (const unsigned char *)PyBytes_AS_STRING(raw);
                uint64_t u = 0;
                for (int k = 7; k >= 0; k--)
                    u = (u << 8) | c[k];
                int64_t v;
                memcpy(&v, &u, sizeof v);
                d = PyLong_FromLongLong((long long)v);
            } else {
                d = PyObject_CallOneArg(hash64, raw);
            }
            Py_DECREF(raw);
            if (d == NULL)
                goto fail;
            PyList_SetItem(names, b, d);
        } else {
            Py_DECREF(raw);
        }
        if (PyList_Append(out, idobj) < 0)
            goto fail;
        if (chain) {
            PyObject *p = i + 1 < n ? PyList_GET_ITEM(ids, i + 1) : NULL;
            long pv = p == NULL ? -1 : PyLong_AsLong(p);
            if (pv == -1 && PyErr_Occurred())
                goto fail;
            PyObject *po = (p != NULL && pv != null) ? (Py_INCREF(p), p) : PyLong_FromLong(-1);
            if (po == NULL || PyList_Append(parents, po) < 0) {
                Py_XDECREF(po);
                goto fail;
            }
            Py_DECREF(po);
        }
    }
    PyObject *result = PyTuple_Pack(2, out, chain ? parents : Py_None);
    Py_DECREF(out);
    Py_XDECREF(parents);
    return result;
fail:
    Py_XDECREF(out);
    Py_XDECREF(parents);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"columns", (PyCFunction)(void (*)(void))columns, METH_FASTCALL, columns_doc},
    {"freed_candidates", (PyCFunction)freed_candidates, METH_VARARGS, freed_candidates_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvfabric.engine._recorder", "The hook's plain recording, compiled (see compiled.py).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

static int
intern_all(void)
{
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN(pool_name, "pool");
    INTERN(s_block_id, "block_id");
    INTERN(s_ref_cnt, "ref_cnt");
    INTERN(s_current_step, "current_step");
    INTERN(s_block_hashes, "block_hashes");
    INTERN(s_request_id, "request_id");
    INTERN(s_family_of, "family_of");
    INTERN(s_failed, "failed");
    INTERN(s_handler, "handler");
    INTERN(s_append, "append");
    INTERN(s_monotonic, "monotonic");
    for (int i = 0; i < P_PARAMS; i++)
        INTERN(s_params[i], seal_params[i]);
#undef INTERN
    return 0;
}

PyMODINIT_FUNC
PyInit__recorder(void)
{
    if (intern_all() < 0 || PyType_Ready(&HookType) < 0)
        return NULL;
    if ((time_module = PyImport_ImportModule("time")) == NULL)
        return NULL;
    if ((wall_clock = PyObject_GetAttrString(time_module, "time_ns")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Hook", (PyObject *)&HookType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
