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
