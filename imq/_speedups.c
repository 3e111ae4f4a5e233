/*
 * imq._speedups: the iterator's per-message decode, compiled.
 *
 * decode_run(keys, values, shard) builds the same objects as the pure-Python
 * imq.iterator._decode: IteratedMessage(shard, Message(QueueKey(lt, hash), src, dst, body))
 * from stored message rows (key: partition u16 | shard (12) | lt u64 BE | hash (32);
 * value: dst wc+128 | dst account (32) | src wc+128 | src account (32) | body).
 * The value types are tuple subclasses registered once with init(); allocating
 * them here skips four Python-level tuple.__new__ calls per message, which is
 * where the pure-Python iterator spends most of its time (benchmarks/README.md).
 *
 * Optional: setup.py builds it when a C compiler is present; imq.iterator falls
 * back to the pure-Python decode otherwise, with identical results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KEY_LEN 54
#define QK_AT 14
#define ADDR_LEN 33
#define HEADER_LEN 66

static PyTypeObject *t_iterated, *t_message, *t_queue_key, *t_address;

static PyObject *
new_tuple(PyTypeObject *type, Py_ssize_t n)
{
    return type->tp_alloc(type, n);
}

static PyObject *
make_address(const unsigned char *raw)
{
    PyObject *addr = new_tuple(t_address, 2);
    if (addr == NULL)
        return NULL;
    PyObject *wc = PyLong_FromLong((long)raw[0] - 128);
    PyObject *account = PyBytes_FromStringAndSize((const char *)raw + 1, 32);
    if (wc == NULL || account == NULL) {
        Py_XDECREF(wc);
        Py_XDECREF(account);
        Py_DECREF(addr);
        return NULL;
    }
    PyTuple_SET_ITEM(addr, 0, wc);
    PyTuple_SET_ITEM(addr, 1, account);
    return addr;
}

static PyObject *
make_key(const unsigned char *k)
{
    unsigned long long lt = 0;
    for (int i = 0; i < 8; i++)
        lt = (lt << 8) | k[QK_AT + i];
    PyObject *key = new_tuple(t_queue_key, 2);
    if (key == NULL)
        return NULL;
    PyObject *lt_obj = PyLong_FromUnsignedLongLong(lt);
    PyObject *hash = PyBytes_FromStringAndSize((const char *)k + QK_AT + 8, 32);
    if (lt_obj == NULL || hash == NULL) {
        Py_XDECREF(lt_obj);
        Py_XDECREF(hash);
        Py_DECREF(key);
        return NULL;
    }
    PyTuple_SET_ITEM(key, 0, lt_obj);
    PyTuple_SET_ITEM(key, 1, hash);
    return key;
}

/* One row -> IteratedMessage, or NULL with an exception set. */
static PyObject *
decode_row(PyObject *shard, PyObject *key_obj, PyObject *value_obj)
{
    if (!PyBytes_Check(key_obj) || !PyBytes_Check(value_obj)) {
        PyErr_SetString(PyExc_TypeError, "message rows must be bytes");
        return NULL;
    }
    Py_ssize_t vlen = PyBytes_GET_SIZE(value_obj);
    if (PyBytes_GET_SIZE(key_obj) != KEY_LEN || vlen < HEADER_LEN) {
        PyErr_SetString(PyExc_ValueError, "message row too short");
        return NULL;
    }
    const unsigned char *k = (const unsigned char *)PyBytes_AS_STRING(key_obj);
    const unsigned char *v = (const unsigned char *)PyBytes_AS_STRING(value_obj);
    PyObject *message = new_tuple(t_message, 4);
    if (message == NULL)
        return NULL;
    PyObject *fields[4];
    fields[0] = make_key(k);
    fields[1] = make_address(v + ADDR_LEN);
    fields[2] = make_address(v);
    fields[3] = PyBytes_FromStringAndSize((const char *)v + HEADER_LEN, vlen - HEADER_LEN);
    for (int i = 0; i < 4; i++) {
        if (fields[i] == NULL) {
            for (int j = 0; j < 4; j++)
                Py_XDECREF(fields[j]);
            Py_DECREF(message);
            return NULL;
        }
    }
    for (int i = 0; i < 4; i++)
        PyTuple_SET_ITEM(message, i, fields[i]);
    PyObject *item = new_tuple(t_iterated, 2);
    if (item == NULL) {
        Py_DECREF(message);
        return NULL;
    }
    Py_INCREF(shard);
    PyTuple_SET_ITEM(item, 0, shard);
    PyTuple_SET_ITEM(item, 1, message);
    return item;
}

static PyObject *
decode_run(PyObject *self, PyObject *args)
{
    PyObject *keys, *values, *shard;
    if (!PyArg_ParseTuple(args, "O!O!O:decode_run", &PyList_Type, &keys, &PyList_Type,
                          &values, &shard))
        return NULL;
    if (t_iterated == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "imq._speedups.init() was not called");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(values) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and values differ in length");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = decode_row(shard, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(values, i));
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* Big-endian bytes (at most 8) as an unsigned integer, as int.from_bytes(v, "big"). */
static unsigned long long
be_prefix(const unsigned char *p, Py_ssize_t n)
{
    unsigned long long x = 0;
    for (Py_ssize_t i = 0; i < n && i < 8; i++)
        x = (x << 8) | p[i];
    return x;
}

/* Lexicographic compare of two byte strings, as bytes.__lt__ does. */
static int
bytes_cmp(PyObject *a, PyObject *b)
{
    Py_ssize_t la = PyBytes_GET_SIZE(a), lb = PyBytes_GET_SIZE(b);
    int c = memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), la < lb ? la : lb);
    if (c != 0)
        return c;
    return la < lb ? -1 : la > lb;
}

static PyObject *
row_error(PyObject *exc, const char *what, PyObject *key)
{
    PyObject *args = Py_BuildValue("(sO)", what, key);
    if (args != NULL) {
        PyErr_SetObject(exc, args);
        Py_DECREF(args);
    }
    return NULL;
}

/*
 * fill_run(source, head_key, head_value, bound, limit, wc_byte, prefix_len, want, shard)
 *   -> (batch, last_key, pending_key, pending_value, skipped, more)
 *
 * One run of the merge iterator: decode the head row, then pull (key, value) rows from
 * `source` while they stay below `bound` (a full message key in the same shard's key
 * space, or None), up to `limit` accepted rows. A row is accepted when its destination
 * workchain byte is `wc_byte` and (prefix_len == 0 or the top prefix_len bits of its
 * destination account equal `want`); other rows are skipped (counted). The first accepted
 * row past the bound or the limit comes back as pending; None when the source ended.
 * `last_key` is the key of the last row consumed (accepted or skipped). `more` is always
 * False here (the limit counts accepted rows, so a pending row is always found).
 * Errors: ValueError/TypeError with args (what, key) for a malformed row.
 */
static PyObject *
fill_run(PyObject *self, PyObject *args)
{
    PyObject *source, *head_key, *head_value, *bound, *shard;
    Py_ssize_t limit;
    int wc_byte, prefix_len;
    unsigned long long want;
    if (!PyArg_ParseTuple(args, "OOOOniiKO:fill_run", &source, &head_key, &head_value, &bound,
                          &limit, &wc_byte, &prefix_len, &want, &shard))
        return NULL;
    if (t_iterated == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "imq._speedups.init() was not called");
        return NULL;
    }
    if (bound != Py_None && !PyBytes_Check(bound)) {
        PyErr_SetString(PyExc_TypeError, "bound must be bytes or None");
        return NULL;
    }
    if (prefix_len < 0 || prefix_len > 64) {
        PyErr_SetString(PyExc_ValueError, "prefix_len out of range");
        return NULL;
    }
    iternextfunc next = Py_TYPE(source)->tp_iternext;
    if (next == NULL) {
        PyErr_SetString(PyExc_TypeError, "source must be an iterator");
        return NULL;
    }
    int shift = 64 - prefix_len;
    PyObject *batch = PyList_New(0);
    if (batch == NULL)
        return NULL;
    PyObject *item = decode_row(shard, head_key, head_value);
    if (item == NULL) {
        Py_DECREF(batch);
        if (PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return row_error(PyExc_ValueError, "undecodable message row", head_key);
        }
        return NULL;
    }
    if (PyList_Append(batch, item) < 0) {
        Py_DECREF(item);
        Py_DECREF(batch);
        return NULL;
    }
    Py_DECREF(item);
    Py_ssize_t accepted = 1, skipped = 0;
    PyObject *last = head_key; /* borrowed while it is head_key, owned otherwise */
    Py_INCREF(last);
    PyObject *pending = NULL;
    for (;;) {
        PyObject *row = next(source);
        if (row == NULL) {
            if (PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_StopIteration))
                    goto fail;
                PyErr_Clear();
            }
            break;
        }
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(row, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(row, 1))) {
            Py_DECREF(row);
            PyErr_SetString(PyExc_TypeError, "source rows must be (bytes, bytes)");
            goto fail;
        }
        PyObject *k = PyTuple_GET_ITEM(row, 0), *v = PyTuple_GET_ITEM(row, 1);
        Py_ssize_t vlen = PyBytes_GET_SIZE(v);
        const unsigned char *vb = (const unsigned char *)PyBytes_AS_STRING(v);
        if (vlen == 0) {
            row_error(PyExc_ValueError, "empty message value", k);
            Py_DECREF(row);
            goto fail;
        }
        int ok = vb[0] == wc_byte;
        if (ok && prefix_len != 0)
            ok = (be_prefix(vb + 1, vlen - 1) >> shift) == want;
        if (!ok) {
            skipped++;
            Py_INCREF(k);
            Py_SETREF(last, k);
            Py_DECREF(row);
            continue;
        }
        if (accepted == limit || (bound != Py_None && bytes_cmp(k, bound) >= 0)) {
            pending = row;
            break;
        }
        item = decode_row(shard, k, v);
        if (item == NULL) {
            if (PyErr_ExceptionMatches(PyExc_ValueError) ||
                PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                row_error(PyExc_ValueError, "undecodable message row", k);
            }
            Py_DECREF(row);
            goto fail;
        }
        if (PyList_Append(batch, item) < 0) {
            Py_DECREF(item);
            Py_DECREF(row);
            goto fail;
        }
        Py_DECREF(item);
        accepted++;
        Py_INCREF(k);
        Py_SETREF(last, k);
        Py_DECREF(row);
    }
    PyObject *pk = pending ? PyTuple_GET_ITEM(pending, 0) : Py_None;
    PyObject *pv = pending ? PyTuple_GET_ITEM(pending, 1) : Py_None;
    PyObject *out = Py_BuildValue("(NNOOnO)", batch, last, pk, pv, skipped, Py_False);
    Py_XDECREF(pending);
    return out;
fail:
    Py_DECREF(batch);
    Py_DECREF(last);
    return NULL;
}

static int
take_type(PyObject *obj, PyTypeObject **slot)
{
    if (!PyType_Check(obj) || !PyType_IsSubtype((PyTypeObject *)obj, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "init() takes four tuple subclasses");
        return -1;
    }
    Py_INCREF(obj);
    Py_XSETREF(*slot, (PyTypeObject *)obj);
    return 0;
}

static PyObject *
init(PyObject *self, PyObject *args)
{
    PyObject *iterated, *message, *queue_key, *address;
    if (!PyArg_ParseTuple(args, "OOOO:init", &iterated, &message, &queue_key, &address))
        return NULL;
    if (take_type(iterated, &t_iterated) || take_type(message, &t_message) ||
        take_type(queue_key, &t_queue_key) || take_type(address, &t_address))
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS,
     "init(IteratedMessage, Message, QueueKey, Address): register the value types."},
    {"decode_run", decode_run, METH_VARARGS,
     "decode_run(keys, values, shard) -> list[IteratedMessage]"},
    {"fill_run", fill_run, METH_VARARGS,
     "fill_run(source, head_key, head_value, bound, limit, wc_byte, prefix_len, want, shard)"
     " -> (batch, last_key, pending_key, pending_value, skipped, more)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "imq._speedups",
    "Compiled per-message decode of the merge iterator (optional).", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
