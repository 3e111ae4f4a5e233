/*
 * imq._speedups: the merge iterator's k-way merge and per-message decode, and the
 * write path's row encoding, compiled.
 *
 * merge_fill() merges the rows of several source shards in key order, one batch per call,
 * as the pure-Python imq.iterator merge does; decode_run(keys, values, shard) builds the
 * same objects as the pure-Python
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
#include <stddef.h>
#include <stdint.h>
#include <structmember.h>

/* The message row layout, as imq.storage.codec defines it (tests/unit/test_message_row_layout.py
 * pins each value to codec's). */
#define KEY_LEN 54        /* codec.MESSAGE_KEY_LEN */
#define QK_AT 14          /* codec.MESSAGE_PREFIX_LEN: where the queue key (lt, hash) starts */
#define LT_LEN 8          /* codec.LT_LEN */
#define HASH_LEN 32       /* codec.HASH_LEN */
#define ADDR_LEN 33       /* codec.ADDRESS_LEN: workchain + 128, then the account */
#define ACCOUNT_LEN 32    /* codec.ACCOUNT_LEN */
#define HEADER_LEN 66     /* codec.MESSAGE_VALUE_HEADER_LEN: dst address, then src address */
#define STAT_ENTRY_LEN 41 /* codec.STAT_ENTRY_LEN: address (33), count u64 */

static PyTypeObject *t_iterated, *t_message, *t_queue_key, *t_address;

/* Whether a registered type has the plain tuple layout (no instance dict, no weakref
 * slot: every class in its MRO declares __slots__ = ()); set by init(). */
static int plain_iterated, plain_message, plain_queue_key, plain_address;

static int
plain_layout(PyTypeObject *type)
{
    return type->tp_basicsize == PyTuple_Type.tp_basicsize &&
           type->tp_itemsize == PyTuple_Type.tp_itemsize && type->tp_dictoffset == 0 &&
           type->tp_weaklistoffset == 0;
}

/*
 * A new instance of one of the value types (tuple subclasses) holding `items` (new
 * references, all non-NULL; stolen, and released on failure).
 *
 * With the plain tuple layout (the value types of imq.types), the object is allocated
 * with PyObject_GC_NewVar and left out of the cyclic GC: each value type holds ints,
 * bytes and other such values only (never a mutable object), so it can never be part of
 * a reference cycle, as CPython decides for plain tuples of atoms. tp_alloc would zero
 * the items and track the object for the GC, both undone at once here. The items are
 * set before anyone sees the object. Any other layout goes through tp_alloc and stays
 * tracked.
 */
static PyObject *
pack(PyTypeObject *type, int plain, PyObject **items, Py_ssize_t n)
{
    PyTupleObject *obj;
    if (plain)
        obj = PyObject_GC_NewVar(PyTupleObject, type, n);
    else
        obj = (PyTupleObject *)type->tp_alloc(type, n);
    if (obj == NULL) {
        for (Py_ssize_t i = 0; i < n; i++)
            Py_DECREF(items[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        obj->ob_item[i] = items[i];
    return (PyObject *)obj;
}

static PyObject *
make_address(const unsigned char *raw)
{
    PyObject *items[2];
    items[0] = PyLong_FromLong((long)raw[0] - 128);
    if (items[0] == NULL)
        return NULL;
    items[1] = PyBytes_FromStringAndSize((const char *)raw + 1, ACCOUNT_LEN);
    if (items[1] == NULL) {
        Py_DECREF(items[0]);
        return NULL;
    }
    return pack(t_address, plain_address, items, 2);
}

/* Big-endian bytes (at most 8) as an unsigned integer, as int.from_bytes(v, "big"); with
 * a constant n, compilers make it one load and a byte swap. */
static inline unsigned long long
be_prefix(const unsigned char *p, Py_ssize_t n)
{
    unsigned long long x = 0;
    for (Py_ssize_t i = 0; i < n && i < 8; i++)
        x = (x << 8) | p[i];
    return x;
}

/* The QueueKey whose 40-byte form (lt u64 big-endian, then hash) starts at `qk`. */
static PyObject *
key_at(const unsigned char *qk)
{
    PyObject *items[2];
    items[0] = PyLong_FromUnsignedLongLong(be_prefix(qk, LT_LEN));
    if (items[0] == NULL)
        return NULL;
    items[1] = PyBytes_FromStringAndSize((const char *)qk + LT_LEN, HASH_LEN);
    if (items[1] == NULL) {
        Py_DECREF(items[0]);
        return NULL;
    }
    return pack(t_queue_key, plain_queue_key, items, 2);
}

/* The QueueKey of the message key `k` (its queue key at QK_AT). */
static PyObject *
make_key(const unsigned char *k)
{
    return key_at(k + QK_AT);
}

/*
 * The source and the destination of the previous row, reused when the next row names
 * the same account (consecutive messages often share one: a block's few senders, a
 * busy destination): an Address is immutable (a tuple subclass without instance dict),
 * so one object can serve both messages. One memo per merge_fill call; a miss costs one
 * 33-byte compare on top of building the Address. A process-wide cache of every address
 * was measured and dropped: with thousands of distinct accounts its slots and objects
 * are cold memory, and building a fresh Address from the allocator's warm free lists
 * was faster (1.99 vs 2.32 M msgs/s, bench_floor's workload, CPU time interleaved).
 */
typedef struct {
    unsigned char raw[2][ADDR_LEN];
    PyObject *addr[2]; /* owned, or NULL */
} AddrMemo;

static void
memo_clear(AddrMemo *memo)
{
    Py_CLEAR(memo->addr[0]);
    Py_CLEAR(memo->addr[1]);
}

static PyObject *
memo_address(AddrMemo *memo, int role, const unsigned char *raw)
{
    if (memo != NULL && memo->addr[role] != NULL && memcmp(memo->raw[role], raw, ADDR_LEN) == 0) {
        Py_INCREF(memo->addr[role]);
        return memo->addr[role];
    }
    PyObject *addr = make_address(raw);
    if (addr != NULL && memo != NULL) {
        Py_INCREF(addr);
        Py_XSETREF(memo->addr[role], addr);
        memcpy(memo->raw[role], raw, ADDR_LEN);
    }
    return addr;
}

/*
 * The body of a checked row held as the tuple `row` (key, value): the value bytes object
 * itself, its header cut off in place, when `row` and its value have no other holder
 * (a row fresh from a RocksDB cursor): no new object and no free a message, where a copy
 * costs both. The tuple then holds None in place of the value, and every pointer into
 * the value is stale. Otherwise (someone else holds either) a copy. A new reference, or
 * NULL with an exception set.
 */
static PyObject *
take_body(PyObject *row)
{
    PyObject *value = PyTuple_GET_ITEM(row, 1);
    Py_ssize_t n = PyBytes_GET_SIZE(value) - HEADER_LEN;
    char *s = PyBytes_AS_STRING(value);
    if (Py_REFCNT(row) != 1 || Py_REFCNT(value) != 1 || !PyBytes_CheckExact(value))
        return PyBytes_FromStringAndSize(s + HEADER_LEN, n);
    PyTuple_SET_ITEM(row, 1, Py_NewRef(Py_None)); /* the value is ours alone now */
    memmove(s, s + HEADER_LEN, (size_t)n);
    if (_PyBytes_Resize(&value, n) < 0) /* it releases the value on failure */
        return NULL;
    return value;
}

/* One checked row (a KEY_LEN key, a value of vlen >= HEADER_LEN bytes, in memory that
 * stays put meanwhile) -> IteratedMessage, or NULL with an exception set. With `row`
 * (the row's (key, value) tuple, k and v pointing into it), its body is taken from the
 * value when it can be (take_body): v is stale afterwards. */
static PyObject *
decode_at(PyObject *shard, const unsigned char *k, const unsigned char *v, Py_ssize_t vlen,
          AddrMemo *memo, PyObject *row)
{
    PyObject *fields[4];
    fields[0] = make_key(k);
    fields[1] = memo_address(memo, 0, v + ADDR_LEN);
    fields[2] = memo_address(memo, 1, v);
    fields[3] = NULL; /* last: it may cut the header the addresses were read from */
    if (fields[0] != NULL && fields[1] != NULL && fields[2] != NULL)
        fields[3] = row != NULL ? take_body(row)
                                : PyBytes_FromStringAndSize((const char *)v + HEADER_LEN,
                                                            vlen - HEADER_LEN);
    if (fields[0] == NULL || fields[1] == NULL || fields[2] == NULL || fields[3] == NULL) {
        for (int j = 0; j < 4; j++)
            Py_XDECREF(fields[j]);
        return NULL;
    }
    PyObject *item[2];
    item[1] = pack(t_message, plain_message, fields, 4);
    if (item[1] == NULL)
        return NULL;
    Py_INCREF(shard);
    item[0] = shard;
    return pack(t_iterated, plain_iterated, item, 2);
}

/* One row -> IteratedMessage, or NULL with an exception set. */
static PyObject *
decode_row(PyObject *shard, PyObject *key_obj, PyObject *value_obj, AddrMemo *memo)
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
    return decode_at(shard, (const unsigned char *)PyBytes_AS_STRING(key_obj),
                     (const unsigned char *)PyBytes_AS_STRING(value_obj), vlen, memo, NULL);
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
        /* Each row owned while decoded, the lists' lengths checked again: the decode
         * allocates, an allocation can run the cyclic GC, and a finalizer could change
         * the caller's lists (an audit, under AddressSanitizer). */
        if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(values) != n) {
            PyErr_SetString(PyExc_RuntimeError, "decode_run(): the lists changed size");
            Py_DECREF(out);
            return NULL;
        }
        PyObject *k = Py_NewRef(PyList_GET_ITEM(keys, i));
        PyObject *v = Py_NewRef(PyList_GET_ITEM(values, i));
        PyObject *item = decode_row(shard, k, v, NULL);
        Py_DECREF(k);
        Py_DECREF(v);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
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

/* The error of a message row whose value is shorter than its header (vlen < HEADER_LEN),
 * the pure-Python merge's: ValueError(what, key). Always NULL. */
static PyObject *
short_row_error(Py_ssize_t vlen, PyObject *key)
{
    return row_error(PyExc_ValueError, vlen == 0 ? "empty message value" : "message row too short",
                     key);
}

/* Whether a message row's value names a destination in the iterator's shard. */
static inline int
accepts(const unsigned char *vb, Py_ssize_t vlen, long wc_byte, long prefix_len, int shift,
        unsigned long long want)
{
    if (vb[0] != wc_byte)
        return 0;
    return prefix_len == 0 || (be_prefix(vb + 1, vlen - 1) >> shift) == want;
}

/* Negative, zero or positive as the queue key (lt, hash) of the message key at `a` orders
 * before, with or after the one at `b`: memcmp's order over their 40 bytes, with the lt
 * compared as one integer first (it nearly always decides) and the hash only on a tie,
 * inline where the merge compares keys once or more per message. */
static inline int
qk_cmp(const unsigned char *a, const unsigned char *b)
{
    unsigned long long x = be_prefix(a + QK_AT, LT_LEN), y = be_prefix(b + QK_AT, LT_LEN);
    if (x != y)
        return x < y ? -1 : 1;
    return memcmp(a + QK_AT + LT_LEN, b + QK_AT + LT_LEN, HASH_LEN);
}

/*
 * Pull rows from `source` until one is accepted: *head is then that row (a new reference),
 * or NULL when the rows ran out. Skipped rows are counted; *last_skip is the key of the
 * last one (a new reference), or NULL if none was skipped. Returns 0, or -1 with an
 * exception set (and both out-references cleared).
 */
static inline int
refill(PyObject *source, long wc_byte, long prefix_len, int shift, unsigned long long want,
       Py_ssize_t *skipped, PyObject **head, PyObject **last_skip)
{
    *head = *last_skip = NULL;
    /* PyIter_Check, not a test against _PyObject_NextNotImplemented: Python 3.13 took
     * that symbol out of its headers. */
    if (!PyIter_Check(source)) {
        PyErr_SetString(PyExc_TypeError, "sources must be iterators");
        return -1;
    }
    iternextfunc next = Py_TYPE(source)->tp_iternext;
    for (;;) {
        PyObject *row = next(source);
        if (row == NULL) {
            if (PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_StopIteration))
                    goto fail;
                PyErr_Clear();
            }
            return 0;
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
        if (vlen < HEADER_LEN) { /* corrupt, whether for this shard or not */
            short_row_error(vlen, k);
            Py_DECREF(row);
            goto fail;
        }
        if (!accepts(vb, vlen, wc_byte, prefix_len, shift, want)) {
            (*skipped)++;
            Py_INCREF(k);
            Py_XSETREF(*last_skip, k);
            Py_DECREF(row);
            continue;
        }
        if (PyBytes_GET_SIZE(k) != KEY_LEN) { /* compared in place by the merge: check it */
            row_error(PyExc_ValueError, "undecodable message row", k);
            Py_DECREF(row);
            goto fail;
        }
        *head = row;
        return 0;
    }
fail:
    Py_CLEAR(*last_skip);
    return -1;
}

/* list[i] = item, the list taking a reference of its own (the caller keeps its one); 0, or
 * -1 with an exception: merge_fill's lists are the caller's, and a source's next() (Python
 * code) may have shortened one, where PyList_SetItem raises IndexError. */
static int
list_put(PyObject *list, Py_ssize_t i, PyObject *item)
{
    Py_INCREF(item);
    return PyList_SetItem(list, i, item); /* it steals, even on failure */
}

/* Append source index `idx` to the list `ended`; 0, or -1 with an exception set. */
static int
append_index(PyObject *ended, Py_ssize_t idx)
{
    PyObject *i = PyLong_FromSsize_t(idx);
    if (i == NULL)
        return -1;
    int rc = PyList_Append(ended, i);
    Py_DECREF(i);
    return rc;
}

/* The 2-tuple (a, b) of two new references, which it takes over; NULL when either is
 * NULL (a failed allocation, its exception set) or the tuple cannot be made, with both
 * released. */
static PyObject *
pair_of(PyObject *a, PyObject *b)
{
    PyObject *pair = a == NULL || b == NULL ? NULL : PyTuple_New(2);
    if (pair == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, a);
    PyTuple_SET_ITEM(pair, 1, b);
    return pair;
}

/* The (key, value) pair of the row at `at` (its key, then a value of vlen bytes), a new
 * reference, or NULL with an exception. */
static PyObject *
row_at(const unsigned char *at, Py_ssize_t vlen)
{
    PyObject *k = PyBytes_FromStringAndSize((const char *)at, KEY_LEN);
    PyObject *v = k == NULL ? NULL : PyBytes_FromStringAndSize((const char *)at + KEY_LEN, vlen);
    return pair_of(k, v);
}

/* A source's pending accepted row inside merge_fill: a (key, value) tuple of a generic
 * source (owned), or a row read in place from a cached chunk (row NULL; k and v point into
 * the chunk, whose data merge_fill keeps alive). */
typedef struct {
    PyObject *row;
    const unsigned char *k, *v;
    Py_ssize_t vlen;
    int has;
} Head;

/*
 * What merge_fill keeps of one source for a call: the source itself and its shard
 * (references held for the call: a source another thread drops from `sources` while a
 * refill lets go of the GIL, or a shard a source's next() drops from `shards`, stays
 * alive until the call ends); for a source read in place, its chunks' data
 * (held for the call, so that every pointer into them stays valid); its pending row; and
 * the last key read when a streak of it ended (lastkeys[i] and final[i] at the end of the
 * call): an object (owned) or a pointer into a chunk, built once at the end however many
 * of its streaks ended in the call. One allocation for all the sources.
 */
typedef struct {
    PyObject *src, *shard, *data, *last_obj;
    const unsigned char *last_at;
    Head head;
} Source;

/* Release what `ss` holds of n sources, and the array. */
static void
source_release(Source *ss, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(ss[i].src);
        Py_XDECREF(ss[i].shard);
        Py_XDECREF(ss[i].data);
        Py_XDECREF(ss[i].last_obj);
        Py_XDECREF(ss[i].head.row);
    }
    PyMem_Free(ss);
}

/* The cache's rows, read in place (defined with ChunkRows below). */
static PyTypeObject ChunkRowsType;
static PyObject *chunk_source_data(PyObject *source, long wc_byte, long prefix_len,
                                   unsigned long long want);
static int chunk_refill(PyObject *source, Py_ssize_t *skipped, Head *head,
                        const unsigned char **last_skip, Py_ssize_t *skip_vlen);

/* refill() of source `idx` into heads[idx] and a skipped key: a new reference (generic
 * sources) or a pointer into a chunk (*skip_at). 0, or -1 with an exception. */
static inline int
refill_head(PyObject *source, int in_place, long wc_byte, long prefix_len, int shift,
            unsigned long long want, Py_ssize_t *skipped, Head *head, PyObject **last_skip,
            const unsigned char **skip_at)
{
    *last_skip = NULL;
    *skip_at = NULL;
    if (in_place)
        return chunk_refill(source, skipped, head, skip_at, NULL);
    PyObject *row;
    if (refill(source, wc_byte, prefix_len, shift, want, skipped, &row, last_skip) < 0)
        return -1;
    head->has = row != NULL;
    head->row = row;
    if (row != NULL) {
        PyObject *v = PyTuple_GET_ITEM(row, 1);
        head->k = (const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(row, 0));
        head->v = (const unsigned char *)PyBytes_AS_STRING(v);
        head->vlen = PyBytes_GET_SIZE(v);
    }
    return 0;
}

/* The skipped key of a refill, given as an object (its reference passes on) or as a
 * pointer into a chunk (built here): a new reference, or NULL with an exception. */
static PyObject *
skip_key(PyObject *last_skip, const unsigned char *skip_at)
{
    if (last_skip != NULL)
        return last_skip; /* the reference passes on */
    return PyBytes_FromStringAndSize((const char *)skip_at, KEY_LEN);
}

/* The pending row of a head as a (key, value) tuple, a new reference (the head gives up
 * its own), or NULL with an exception. */
static PyObject *
head_row(Head *head)
{
    if (head->row != NULL) {
        PyObject *row = head->row;
        head->row = NULL;
        return row;
    }
    return row_at(head->k, head->vlen); /* a chunk's row: its value follows its key */
}

/*
 * merge_fill(sources, heads, lastkeys, need, limit, wc_byte, prefix_len, want, shards,
 *            positions) -> (batch, final, records, ended, need_out, skipped)
 *
 * The merge iterator's k-way merge, one batch of up to `limit` messages per call. It
 * follows SEMANTICS §11.2 as imq.testing.model.ModelIterator does: before each message,
 * refill every source that has no pending row (recording the keys it skips), then take the
 * pending row with the smallest queue key (the lower source index on a tie).
 *
 *   sources   rows of each source shard: iterators of (key, value) bytes pairs
 *   heads     per source, its pending accepted row, or None (updated in place)
 *   lastkeys  per source, the key of the last row read from it, skipped or taken, or None
 *             (updated in place; a source's end check starts there)
 *   need      the sources to refill first: every source at the start, then what the
 *             previous call returned as need_out
 *   shards    per source, its ShardIdent (the IteratedMessage's first field)
 *   positions the consumer-visible position of each source (a key, or None): the refills
 *             that precede this call's first message belong to the next() that asked for
 *             it, so they are recorded here directly
 *
 *   batch     the messages, in order
 *   final     the positions once the whole batch has been consumed
 *   records   [(j, idx, key)]: just before message j (j >= 1) was taken, source idx's
 *             position moved to the skipped row `key` (what current_position() replays
 *             when the consumer stops inside the batch)
 *   ended     the sources whose rows ran out during this call (their end check is the
 *             caller's, before it hands out the batch)
 *   need_out  the sources to refill first at the next call
 *   skipped   rows skipped (not for this shard)
 *
 * An empty batch means that every source has run out. Each source takes at most one
 * comparison per message against each other pending row, in place (no key slicing).
 * A source that is the cache's filtered ChunkRows is read in place: its rows are compared
 * and decoded where the chunk holds them, with no (key, value) objects, and a skipped
 * row's key is built only where a position needs it (the same messages, positions and
 * counts as pulling its rows; a pending row left at the end of the call is built then).
 * Errors: ValueError/TypeError with args (what, key) for a malformed row.
 */
static PyObject *
merge_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "merge_fill() takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *sources = args[0], *heads = args[1], *lastkeys = args[2], *need = args[3];
    PyObject *shards = args[8], *positions = args[9];
    /* The numbers first: a non-int's __index__ is Python code, which could change the
     * lists after their lengths were read (an audit, under AddressSanitizer). */
    Py_ssize_t limit = PyLong_AsSsize_t(args[4]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    long wc_byte = PyLong_AsLong(args[5]);
    if (wc_byte == -1 && PyErr_Occurred())
        return NULL;
    long prefix_len = PyLong_AsLong(args[6]);
    if (prefix_len == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long want = PyLong_AsUnsignedLongLong(args[7]);
    if (want == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!PyList_CheckExact(sources) || !PyList_CheckExact(heads) || !PyList_CheckExact(lastkeys) ||
        !PyList_CheckExact(need) || !PyList_CheckExact(shards) || !PyList_CheckExact(positions)) {
        PyErr_SetString(PyExc_TypeError, "merge_fill() takes lists");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(sources);
    if (PyList_GET_SIZE(heads) != n || PyList_GET_SIZE(lastkeys) != n ||
        PyList_GET_SIZE(shards) != n || PyList_GET_SIZE(positions) != n) {
        PyErr_SetString(PyExc_ValueError, "merge_fill() lists differ in length");
        return NULL;
    }
    if (t_iterated == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "imq._speedups.init() was not called");
        return NULL;
    }
    if (prefix_len < 0 || prefix_len > 64) {
        PyErr_SetString(PyExc_ValueError, "prefix_len out of range");
        return NULL;
    }
    if (limit < 1)
        limit = 1;
    int shift = (int)(64 - prefix_len);

    Source *ss = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Source));
    PyObject *batch = NULL, *records = NULL, *ended = NULL, *final = NULL, *need_out = NULL;
    AddrMemo memo = {{{0}}, {NULL, NULL}};
    Py_ssize_t skipped = 0, count = 0;
    int heads_taken = 0; /* past the check of `heads`: a failure writes them back */
    if (ss == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* NULL: a generic source */
        ss[i].src = Py_NewRef(PyList_GET_ITEM(sources, i));
        ss[i].shard = Py_NewRef(PyList_GET_ITEM(shards, i));
        ss[i].data = chunk_source_data(ss[i].src, wc_byte, prefix_len, want);
        PyObject *head = PyList_GET_ITEM(heads, i);
        if (head == Py_None)
            continue;
        if (!PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(head, 0)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(head, 1)) ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(head, 0)) != KEY_LEN ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(head, 1)) < HEADER_LEN) {
            PyErr_SetString(PyExc_TypeError, "heads must hold message rows or None");
            goto fail;
        }
        Py_INCREF(head);
        ss[i].head.row = head;
        ss[i].head.has = 1;
        ss[i].head.k = (const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(head, 0));
        ss[i].head.v = (const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(head, 1));
        ss[i].head.vlen = PyBytes_GET_SIZE(PyTuple_GET_ITEM(head, 1));
    }
    heads_taken = 1;
    batch = PyList_New(limit);
    records = PyList_New(0);
    ended = PyList_New(0);
    final = PyList_GetSlice(positions, 0, n);
    if (batch == NULL || records == NULL || ended == NULL || final == NULL)
        goto fail;
    Py_SET_SIZE(batch, 0); /* the filled prefix: what a failure must release */
    PyObject **slots = ((PyListObject *)batch)->ob_item;
    /* The refills that precede the first message: every source in `need`. */
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(need); r++) {
        Py_ssize_t idx = PyLong_AsSsize_t(PyList_GET_ITEM(need, r));
        if (idx == -1 && PyErr_Occurred())
            goto fail;
        if (idx < 0 || idx >= n) {
            PyErr_SetString(PyExc_IndexError, "need names no source");
            goto fail;
        }
        if (ss[idx].head.has)
            continue;
        PyObject *last_skip;
        const unsigned char *skip_at;
        if (refill_head(ss[idx].src, ss[idx].data != NULL, wc_byte, prefix_len,
                        shift, want, &skipped, &ss[idx].head, &last_skip, &skip_at) < 0)
            goto fail;
        if (!ss[idx].head.has && append_index(ended, idx) < 0) {
            Py_XDECREF(last_skip);
            goto fail;
        }
        if (last_skip != NULL || skip_at != NULL) {
            PyObject *key = skip_key(last_skip, skip_at);
            if (key == NULL)
                goto fail;
            int failed = list_put(lastkeys, idx, key) < 0 || list_put(final, idx, key) < 0 ||
                         list_put(positions, idx, key) < 0;
            Py_DECREF(key);
            if (failed)
                goto fail;
        }
    }
    for (;;) {
        /* The pending row with the smallest queue key, and the runner-up: the first
         * source's rows are taken without a new scan while they stay below it (a block's
         * messages follow one another until another source's block interleaves). */
        Py_ssize_t best = -1, second = -1;
        const unsigned char *best_key = NULL, *second_key = NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!ss[i].head.has)
                continue;
            const unsigned char *k = ss[i].head.k;
            if (best < 0 || qk_cmp(k, best_key) < 0) {
                second = best;
                second_key = best_key;
                best = i;
                best_key = k;
            } else if (second < 0 || qk_cmp(k, second_key) < 0) {
                second = i;
                second_key = k;
            }
        }
        if (best < 0) {
            need_out = PyList_New(0);
            goto done;
        }
        /* Stream `best`: its rows stay local until the streak ends (heads[second], and so
         * second_key, is not touched meanwhile). */
        Head cur = ss[best].head; /* owned from here */
        ss[best].head.has = 0;
        ss[best].head.row = NULL;
        PyObject *source = ss[best].src;
        PyObject *shard = ss[best].shard;
        for (;;) {
            /* cur.v is stale from here: its body may be the row's value, cut in place */
            PyObject *item = decode_at(shard, cur.k, cur.v, cur.vlen, &memo, cur.row);
            if (item == NULL) {
                Py_XDECREF(cur.row);
                goto fail;
            }
            slots[count++] = item;
            Py_SET_SIZE(batch, count);
            Head next = {NULL, NULL, NULL, 0, 0};
            PyObject *last_skip = NULL;
            const unsigned char *skip_at = NULL;
            if (count < limit &&
                refill_head(source, ss[best].data != NULL, wc_byte, prefix_len, shift, want,
                            &skipped, &next, &last_skip, &skip_at) < 0) {
                Py_XDECREF(cur.row);
                goto fail;
            }
            if (next.has && count < limit) {
                int c = second < 0 ? -1 : qk_cmp(next.k, second_key);
                if (c < 0 || (c == 0 && best < second)) {
                    /* `best` gives the next message too: the skips before it are
                     * overwritten by its key in the positions, so none is recorded. */
                    Py_XDECREF(last_skip);
                    Py_XDECREF(cur.row);
                    cur = next;
                    continue;
                }
            }
            /* The streak ends. Without a refill (the batch is full) the source is refilled
             * first at the next call; otherwise its skips, if any, precede the batch's next
             * message (or the end of every source). */
            int has_skip = last_skip != NULL || skip_at != NULL;
            PyObject *key_obj = NULL; /* the source's last key: an object or in a chunk */
            const unsigned char *key_at = NULL;
            if (has_skip) {
                key_obj = last_skip; /* the reference passes on */
                key_at = skip_at;
            } else if (cur.row != NULL)
                key_obj = Py_NewRef(PyTuple_GET_ITEM(cur.row, 0));
            else
                key_at = cur.k;
            Py_XDECREF(cur.row);
            if (has_skip) { /* recorded now: the record needs the key's object */
                if (key_obj == NULL) {
                    key_obj = skip_key(NULL, key_at);
                    key_at = NULL;
                }
                PyObject *rec = key_obj == NULL ? NULL : Py_BuildValue("(nnO)", count, best, key_obj);
                if (rec == NULL || PyList_Append(records, rec) < 0) {
                    Py_XDECREF(rec);
                    Py_XDECREF(key_obj);
                    Py_XDECREF(next.row);
                    goto fail;
                }
                Py_DECREF(rec);
            }
            Py_XSETREF(ss[best].last_obj, key_obj);
            ss[best].last_at = key_at;
            if (count == limit) {
                need_out = Py_BuildValue("[n]", best);
                goto done;
            }
            if (next.has)
                ss[best].head = next;
            else if (append_index(ended, best) < 0)
                goto fail;
            break;
        }
    }
done:
    if (need_out == NULL)
        goto fail;
    /* The last key of each source whose streaks ended: lastkeys and final. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *last = ss[i].last_obj;
        ss[i].last_obj = NULL;
        if (last == NULL) {
            if (ss[i].last_at == NULL)
                continue;
            last = PyBytes_FromStringAndSize((const char *)ss[i].last_at, KEY_LEN);
            if (last == NULL) {
                Py_DECREF(need_out);
                goto fail;
            }
        }
        int failed = list_put(lastkeys, i, last) < 0 || list_put(final, i, last) < 0;
        Py_DECREF(last);
        if (failed) {
            Py_DECREF(need_out);
            goto fail;
        }
    }
    /* The pending rows go back to `heads`: rows of the cache's chunks are built now. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = ss[i].head.has ? head_row(&ss[i].head) : Py_NewRef(Py_None);
        ss[i].head.has = 0;
        if (row == NULL || PyList_SetItem(heads, i, row) < 0) { /* it steals row */
            Py_DECREF(need_out);
            goto fail;
        }
    }
    memo_clear(&memo);
    source_release(ss, n);
    return Py_BuildValue("(NNNNNn)", batch, final, records, ended, need_out, skipped);
fail:
    memo_clear(&memo);
    if (ss != NULL) {
        /* Keep what can be kept of the pending rows; the iterator reports the error. */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (heads_taken) {
                PyObject *row = ss[i].head.has ? head_row(&ss[i].head) : NULL;
                if (row == NULL) {
                    PyErr_Clear();
                    row = Py_NewRef(Py_None);
                }
                if (PyList_SetItem(heads, i, row) < 0) /* a shortened list: dropped */
                    PyErr_Clear();
            }
        }
        PyErr_Restore(exc_type, exc_value, exc_tb);
        source_release(ss, n);
    }
    Py_XDECREF(batch);
    Py_XDECREF(records);
    Py_XDECREF(ended);
    Py_XDECREF(final);
    return NULL;
}

static int
add_count(PyObject *counts, long partition, Py_ssize_t n)
{
    PyObject *key = PyLong_FromLong(partition);
    if (key == NULL)
        return -1;
    PyObject *old = PyDict_GetItemWithError(counts, key);
    if (old == NULL && PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    Py_ssize_t before = 0;
    if (old != NULL) {
        before = PyLong_AsSsize_t(old);
        if (before == -1 && PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
    }
    PyObject *total = PyLong_FromSsize_t(before + n);
    if (total == NULL) {
        Py_DECREF(key);
        return -1;
    }
    int rc = PyDict_SetItem(counts, key, total);
    Py_DECREF(key);
    Py_DECREF(total);
    return rc;
}

/* ---- the write path: message rows and statistics values ---------------------------- */

/* The workchain and account of an Address-shaped tuple; -1 with an exception. */
static int
address_parts(PyObject *addr, int *wc, PyObject **account)
{
    if (!PyTuple_Check(addr) || PyTuple_GET_SIZE(addr) != 2) {
        PyErr_SetString(PyExc_TypeError, "an address must be a (workchain, account) tuple");
        return -1;
    }
    long w = PyLong_AsLong(PyTuple_GET_ITEM(addr, 0));
    if (w == -1 && PyErr_Occurred())
        return -1;
    PyObject *acc = PyTuple_GET_ITEM(addr, 1);
    if (w < -128 || w > 127 || !PyBytes_Check(acc) || PyBytes_GET_SIZE(acc) != ACCOUNT_LEN) {
        PyErr_SetString(PyExc_ValueError, "bad address (workchain or account length)");
        return -1;
    }
    *wc = (int)w;
    *account = acc;
    return 0;
}

/* An Address (workchain, account) into 33 bytes: workchain + 128, then the account. */
static int
put_address(unsigned char *out, PyObject *addr)
{
    int wc;
    PyObject *account;
    if (address_parts(addr, &wc, &account) < 0)
        return -1;
    out[0] = (unsigned char)(wc + 128);
    memcpy(out + 1, PyBytes_AS_STRING(account), ACCOUNT_LEN);
    return 0;
}

/*
 * A bytes object of n bytes to write a row into, as a new reference. With spare == NULL,
 * or when someone else still holds *spare, a fresh one (kept in *spare, if given);
 * otherwise *spare itself, resized to n: only this call holds it, so nothing can see it
 * change. The rows a put() has copied (WriteBatch.put copies them into the batch and lets
 * go) are so written into the same two objects, which saves two allocations and two
 * deallocations a row; a put() that keeps its rows (a list, the in-memory store) gets
 * fresh objects every time. A bytes object caches its hash in a field that Python 3.11
 * deprecates (and uses) and 3.12 changes; the cache is reset here on 3.11, and on later
 * versions every row is fresh. Measured: about 0.25 ms less per 10,000-row diff.
 */
static PyObject *
row_bytes(PyObject **spare, Py_ssize_t n)
{
#if PY_VERSION_HEX < 0x030C0000
    if (spare != NULL && *spare != NULL && Py_REFCNT(*spare) == 1) {
        if (PyBytes_GET_SIZE(*spare) != n && _PyBytes_Resize(spare, n) < 0)
            return NULL; /* *spare was released and set to NULL */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
        ((PyBytesObject *)*spare)->ob_shash = -1;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
        Py_INCREF(*spare);
        return *spare;
    }
#endif
    PyObject *b = PyBytes_FromStringAndSize(NULL, n);
    if (b != NULL && spare != NULL) {
        Py_INCREF(b);
        Py_XSETREF(*spare, b);
    }
    return b;
}

/* The 40 bytes of a QueueKey (lt u64 big-endian, hash); 0, or -1 with an exception. */
static int
put_queue_key(unsigned char *out, PyObject *qk)
{
    if (!PyTuple_Check(qk) || PyTuple_GET_SIZE(qk) != 2) {
        PyErr_SetString(PyExc_TypeError, "a queue key must be an (lt, hash) tuple");
        return -1;
    }
    unsigned long long lt = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(qk, 0));
    if (lt == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    PyObject *hash = PyTuple_GET_ITEM(qk, 1);
    if (!PyBytes_Check(hash) || PyBytes_GET_SIZE(hash) != HASH_LEN) {
        PyErr_SetString(PyExc_ValueError, "a queue key's hash must be 32 bytes");
        return -1;
    }
    for (int i = 0; i < LT_LEN; i++)
        out[i] = (unsigned char)(lt >> (56 - 8 * i));
    memcpy(out + LT_LEN, PyBytes_AS_STRING(hash), HASH_LEN);
    return 0;
}

/* One Message -> (key, value) new references; partition already chosen. `spares` is
 * NULL or two reusable row objects (key, value) for row_bytes. */
static int
encode_message(PyObject *msg, const unsigned char *prefix, PyObject **key_out,
               PyObject **value_out, PyObject **spares)
{
    if (!PyTuple_Check(msg) || PyTuple_GET_SIZE(msg) != 4) {
        PyErr_SetString(PyExc_TypeError, "a message must be a (key, src, dst, body) tuple");
        return -1;
    }
    PyObject *body = PyTuple_GET_ITEM(msg, 3);
    if (!PyBytes_Check(body)) {
        PyErr_SetString(PyExc_TypeError, "a message body must be bytes");
        return -1;
    }
    unsigned char queue_key[LT_LEN + HASH_LEN];
    if (put_queue_key(queue_key, PyTuple_GET_ITEM(msg, 0)) < 0)
        return -1;
    Py_ssize_t blen = PyBytes_GET_SIZE(body);
    PyObject *value = row_bytes(spares == NULL ? NULL : &spares[1], HEADER_LEN + blen);
    if (value == NULL)
        return -1;
    unsigned char *vb = (unsigned char *)PyBytes_AS_STRING(value);
    if (put_address(vb, PyTuple_GET_ITEM(msg, 2)) < 0 ||
        put_address(vb + ADDR_LEN, PyTuple_GET_ITEM(msg, 1)) < 0) {
        Py_DECREF(value);
        return -1;
    }
    memcpy(vb + HEADER_LEN, PyBytes_AS_STRING(body), blen);
    PyObject *key = row_bytes(spares == NULL ? NULL : &spares[0], KEY_LEN);
    if (key == NULL) {
        Py_DECREF(value);
        return -1;
    }
    unsigned char *kb = (unsigned char *)PyBytes_AS_STRING(key);
    memcpy(kb, prefix, QK_AT);
    memcpy(kb + QK_AT, queue_key, LT_LEN + HASH_LEN);
    *key_out = key;
    *value_out = value;
    return 0;
}

/*
 * The messages of put_rows and encode_diff as a fast sequence (a new reference), after
 * checking the 12 shard bytes, which it copies into prefix[2..] (prefix[0..2], the
 * partition, starts at 0); NULL with an exception.
 */
static PyObject *
rows_input(PyObject *shard_b, PyObject *messages, unsigned char prefix[QK_AT])
{
    if (PyBytes_GET_SIZE(shard_b) != QK_AT - 2) {
        PyErr_SetString(PyExc_ValueError, "shard_bytes must be 12 bytes");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(messages, "messages must be a sequence");
    if (seq == NULL)
        return NULL;
    memcpy(prefix + 2, PyBytes_AS_STRING(shard_b), QK_AT - 2);
    prefix[0] = prefix[1] = 0;
    return seq;
}

/*
 * The partition of a message from `src` to `dst`: `partition_for` None gives 0; a dict
 * (a router's destination routes, when it routes no source) gives its value for `dst`,
 * 0 when absent, with no Python call; anything else is called as partition_for(src,
 * dst). -1 with an exception on failure, or if the partition is out of 0..65535.
 */
static long
route_message(PyObject *partition_for, PyObject *src, PyObject *dst)
{
    if (partition_for == Py_None)
        return 0;
    PyObject *part;
    if (PyDict_CheckExact(partition_for)) {
        part = PyDict_GetItemWithError(partition_for, dst); /* borrowed */
        if (part == NULL)
            return PyErr_Occurred() ? -1 : 0;
        Py_INCREF(part);
    } else {
        PyObject *pargs[2] = {src, dst};
        part = PyObject_Vectorcall(partition_for, pargs, 2, NULL);
        if (part == NULL)
            return -1;
    }
    long p = PyLong_AsLong(part);
    Py_DECREF(part);
    if (p == -1 && PyErr_Occurred())
        return -1;
    if (p < 0 || p > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "partition out of range");
        return -1;
    }
    return p;
}

/* The Tee (below): put_rows and encode_diff tell it what they are about to put. */
static PyTypeObject TeeType;
static void tee_expect(PyObject *put, Py_ssize_t bytes, Py_ssize_t rows);

/* When put is a Tee: the bytes and rows the messages of seq will put (tee_expect). */
static void
expect_rows_of(PyObject *put, PyObject *seq)
{
    if (!Py_IS_TYPE(put, &TeeType))
        return;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), bytes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *msg = PySequence_Fast_GET_ITEM(seq, i);
        if (PyTuple_Check(msg) && PyTuple_GET_SIZE(msg) == 4 &&
            PyBytes_Check(PyTuple_GET_ITEM(msg, 3)))
            bytes += KEY_LEN + HEADER_LEN + PyBytes_GET_SIZE(PyTuple_GET_ITEM(msg, 3));
    }
    tee_expect(put, bytes, n);
}

/*
 * Ask the memory for the objects of a message the loop will encode soon. A collator
 * builds a diff's messages one by one between everything else it allocates, so the nine
 * objects a message reaches (its tuple; the key, the two addresses and the body; the key's
 * lt and hash; the addresses' accounts) are scattered over its heap, and each load that
 * misses stalls the encoder: a profile of a 10,000-message apply put most of put_address's
 * time (7% of the apply) on the loads of an address and its account. The walk is a chain
 * of pointers, so it is asked for in three stages, one level deeper each: the message
 * PREFETCH_AHEAD messages ahead, the objects it holds half as far ahead (its tuple asked
 * for in the stage before), and what those hold a quarter as far. A stage reads only
 * objects the list holds now, and inside them only after checking the shapes
 * encode_message checks; a prefetch of a bad address does not fault. items and n are
 * re-read by the caller each message (put() may change a list). Measured: 11-12% less
 * CPU a 10,000-message apply (docs/architecture.md).
 */
enum { PREFETCH_AHEAD = 8 }; /* not a #define: those are the row layout, pinned by a test */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
/* Inlined before GCC's analysis of side effects, which takes a function that only
 * prefetches for one that does nothing and drops its calls (GCC 12 at -O2 and -O3). */
#define PREFETCH_INLINE static inline __attribute__((always_inline))
#else
#define PREFETCH(p) ((void)(p))
#define PREFETCH_INLINE static inline
#endif

PREFETCH_INLINE PyObject *
message_tuple(PyObject *msg)
{
    return PyTuple_Check(msg) && PyTuple_GET_SIZE(msg) == 4 ? msg : NULL;
}

PREFETCH_INLINE void
prefetch_pair_items(PyObject *pair, int from)
{
    if (PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2) {
        for (int k = from; k < 2; k++)
            PREFETCH(PyTuple_GET_ITEM(pair, k));
    }
}

PREFETCH_INLINE void
prefetch_messages(PyObject *const *items, Py_ssize_t n, Py_ssize_t i)
{
    if (i + PREFETCH_AHEAD < n)
        PREFETCH(items[i + PREFETCH_AHEAD]);
    if (i + PREFETCH_AHEAD / 2 < n) {
        PyObject *m = message_tuple(items[i + PREFETCH_AHEAD / 2]);
        if (m != NULL) {
            for (int k = 0; k < 4; k++)
                PREFETCH(PyTuple_GET_ITEM(m, k));
        }
    }
    if (i + PREFETCH_AHEAD / 4 < n) {
        PyObject *m = message_tuple(items[i + PREFETCH_AHEAD / 4]);
        if (m != NULL) {
            prefetch_pair_items(PyTuple_GET_ITEM(m, 0), 0); /* lt, hash */
            prefetch_pair_items(PyTuple_GET_ITEM(m, 1), 1); /* the source's account */
            prefetch_pair_items(PyTuple_GET_ITEM(m, 2), 1); /* the destination's account */
        }
    }
}

/*
 * put_rows(put, target, shard_bytes, messages, partition_for, counts) -> rows
 *
 * The C form of imq.storage.codec.put_message_rows: encode each Message of `messages`
 * (a sequence) as its stored row and call put(key, value, target); partition_for picks
 * the partition (see route_message: None, a dict of destination routes, or a callable
 * (src, dst) -> int). `counts` (a dict) receives messages per partition.
 */
static PyObject *
put_rows(PyObject *self, PyObject *args)
{
    PyObject *put, *target, *shard_b, *messages, *partition_for, *counts;
    if (!PyArg_ParseTuple(args, "OOO!OOO!:put_rows", &put, &target, &PyBytes_Type, &shard_b,
                          &messages, &partition_for, &PyDict_Type, &counts))
        return NULL;
    unsigned char prefix[QK_AT];
    PyObject *seq = rows_input(shard_b, messages, prefix);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    expect_rows_of(put, seq);
    long current = 0;
    Py_ssize_t in_current = 0; /* rows counted for `current` not yet added to counts */
    PyObject *msg = NULL;      /* owned: the message being put */
    for (Py_ssize_t i = 0; i < n; i++) {
        /* seq may be the caller's list, which put() or partition_for() may change (as in
         * encode_diff): re-read its size and hold the item while it is used */
        if (i >= PySequence_Fast_GET_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "messages changed size during put_rows");
            goto fail;
        }
        prefetch_messages(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), i);
        Py_XSETREF(msg, Py_NewRef(PySequence_Fast_GET_ITEM(seq, i)));
        if (partition_for != Py_None) {
            if (!PyTuple_Check(msg) || PyTuple_GET_SIZE(msg) != 4) {
                PyErr_SetString(PyExc_TypeError, "a message must be a (key, src, dst, body) tuple");
                goto fail;
            }
            long p = route_message(partition_for, PyTuple_GET_ITEM(msg, 1),
                                   PyTuple_GET_ITEM(msg, 2));
            if (p < 0)
                goto fail;
            if (p != current) {
                if (in_current && add_count(counts, current, in_current) < 0)
                    goto fail;
                in_current = 0;
                current = p;
                prefix[0] = (unsigned char)(p >> 8);
                prefix[1] = (unsigned char)p;
            }
        }
        PyObject *key, *value;
        if (encode_message(msg, prefix, &key, &value, NULL) < 0)
            goto fail;
        PyObject *cargs[3] = {key, value, target};
        PyObject *r = PyObject_Vectorcall(put, cargs, 3, NULL);
        Py_DECREF(key);
        Py_DECREF(value);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
        in_current++;
    }
    Py_CLEAR(msg);
    if (in_current && add_count(counts, current, in_current) < 0)
        goto fail;
    tee_expect(put, 0, 0);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
fail:
    Py_XDECREF(msg);
    tee_expect(put, 0, 0);
    Py_DECREF(seq);
    return NULL;
}

/*
 * stat_value(counts) -> bytes: a statistics value, one 41-byte entry per (Address, count)
 * item of the dict: workchain + 128, account (32), count (u64 BE); as codec.stat_value.
 */
static PyObject *
stat_value(PyObject *self, PyObject *counts)
{
    if (!PyDict_Check(counts)) {
        PyErr_SetString(PyExc_TypeError, "stat_value takes a dict");
        return NULL;
    }
    Py_ssize_t n = PyDict_GET_SIZE(counts);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * STAT_ENTRY_LEN);
    if (out == NULL)
        return NULL;
    unsigned char *b = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t pos = 0, i = 0;
    PyObject *addr, *count;
    while (PyDict_Next(counts, &pos, &addr, &count)) {
        if (i >= n) {
            PyErr_SetString(PyExc_RuntimeError, "dict changed size during stat_value");
            goto fail;
        }
        /* Held while used: a workchain's __index__ (PyLong_AsLong) may change the dict
         * and free the entry; the next PyDict_Next then sees the change. */
        Py_INCREF(addr);
        Py_INCREF(count);
        int bad = put_address(b + STAT_ENTRY_LEN * i, addr) < 0;
        unsigned long long c = bad ? 0 : PyLong_AsUnsignedLongLong(count);
        Py_DECREF(addr);
        Py_DECREF(count);
        if (bad || (c == (unsigned long long)-1 && PyErr_Occurred()))
            goto fail;
        for (int j = 0; j < 8; j++)
            b[STAT_ENTRY_LEN * i + ADDR_LEN + j] = (unsigned char)(c >> (56 - 8 * j));
        i++;
    }
    if (i != n || PyDict_GET_SIZE(counts) != n) {
        PyErr_SetString(PyExc_RuntimeError, "dict changed size during stat_value");
        goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* ---- the write path: a diff's record (msgpack) -------------------------------------- */

/*
 * diff_record(version, min_message, max_message, shards_messages_count, diff_hash,
 * processed_to, router_src, router_dst, seqno, prev_hash, partitions) -> bytes: the
 * stored record of a diff, byte for byte what codec.diff_record_value packs with
 * msgpack (use_bin_type=True): an array of the eleven fields, queue keys and shards and
 * addresses as bin, each mapping as an array of pairs sorted by key (shards and
 * addresses by their encoded bytes, which sort as the values do; partitions as ints).
 * The five mappings must be dicts. tests/unit/test_speedups_write.py compares it with
 * the Python packing.
 */
typedef struct {
    unsigned char *b;
    size_t n, cap;
} Buf;

static int
buf_reserve(Buf *o, size_t more)
{
    if (o->n + more <= o->cap)
        return 0;
    size_t cap = o->cap ? o->cap : 256;
    while (cap < o->n + more)
        cap *= 2;
    unsigned char *b = PyMem_Realloc(o->b, cap);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->b = b;
    o->cap = cap;
    return 0;
}

static int
mp_put(Buf *o, const void *src, size_t n)
{
    if (buf_reserve(o, n) < 0)
        return -1;
    memcpy(o->b + o->n, src, n);
    o->n += n;
    return 0;
}

static int
mp_be(Buf *o, unsigned char tag, unsigned long long v, int width)
{
    unsigned char t[9];
    t[0] = tag;
    for (int i = 0; i < width; i++)
        t[1 + i] = (unsigned char)(v >> (8 * (width - 1 - i)));
    return mp_put(o, t, (size_t)width + 1);
}

static int
mp_array(Buf *o, size_t n)
{
    if (n < 16) {
        unsigned char t = (unsigned char)(0x90 | n);
        return mp_put(o, &t, 1);
    }
    if (n < 0x10000)
        return mp_be(o, 0xdc, n, 2);
    if (n > 0xffffffffULL) {
        PyErr_SetString(PyExc_OverflowError, "a msgpack array holds at most 2**32 - 1 items");
        return -1;
    }
    return mp_be(o, 0xdd, n, 4);
}

static int
mp_bin(Buf *o, const unsigned char *src, size_t n)
{
    int r;
    if (n < 0x100)
        r = mp_be(o, 0xc4, n, 1);
    else if (n < 0x10000)
        r = mp_be(o, 0xc5, n, 2);
    else if (n <= 0xffffffffULL)
        r = mp_be(o, 0xc6, n, 4);
    else {
        PyErr_SetString(PyExc_OverflowError, "a msgpack bin holds at most 2**32 - 1 bytes");
        return -1;
    }
    return r < 0 ? -1 : mp_put(o, src, n);
}

/* A C integer as msgpack packs an int: the shortest form, unsigned types for values
 * >= 0 (positive fixint, uint8..uint64), signed ones below (negative fixint,
 * int8..int64). */
static int
mp_ll(Buf *o, long long x)
{
    if (x >= 0) {
        if (x < 0x80) {
            unsigned char t = (unsigned char)x;
            return mp_put(o, &t, 1);
        }
        if (x <= 0xff)
            return mp_be(o, 0xcc, (unsigned long long)x, 1);
        if (x <= 0xffff)
            return mp_be(o, 0xcd, (unsigned long long)x, 2);
        if (x <= 0xffffffffLL)
            return mp_be(o, 0xce, (unsigned long long)x, 4);
        return mp_be(o, 0xcf, (unsigned long long)x, 8);
    }
    if (x >= -32) {
        unsigned char t = (unsigned char)(0xe0 | (x + 32));
        return mp_put(o, &t, 1);
    }
    if (x >= -128)
        return mp_be(o, 0xd0, (unsigned long long)x & 0xff, 1);
    if (x >= -32768)
        return mp_be(o, 0xd1, (unsigned long long)x & 0xffff, 2);
    if (x >= -2147483648LL)
        return mp_be(o, 0xd2, (unsigned long long)x & 0xffffffffULL, 4);
    return mp_be(o, 0xd3, (unsigned long long)x, 8);
}

/* A Python int (not a bool), as mp_ll; 2**63..2**64-1 as uint64. */
static int
mp_int(Buf *o, PyObject *v)
{
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "an int was expected in a diff record");
        return -1;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow < 0) {
        PyErr_SetString(PyExc_OverflowError, "an int below -2**63 in a diff record");
        return -1;
    }
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        return mp_be(o, 0xcf, u, 8);
    }
    return mp_ll(o, x);
}

static int
mp_queue_key(Buf *o, PyObject *qk)
{
    unsigned char k[LT_LEN + HASH_LEN];
    if (put_queue_key(k, qk) < 0)
        return -1;
    return mp_bin(o, k, sizeof k);
}

static int
mp_bytes(Buf *o, PyObject *v)
{
    if (!PyBytes_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "bytes were expected in a diff record");
        return -1;
    }
    return mp_bin(o, (const unsigned char *)PyBytes_AS_STRING(v), (size_t)PyBytes_GET_SIZE(v));
}

#define SHARD_LEN 12 /* codec._SHARD: workchain + 2**31 (u32), prefix (u64), big-endian */

/* codec.shard_bytes of a checked (i32 workchain, u64 prefix): SHARD_LEN bytes at out. */
static void
shard_bytes_at(unsigned char *out, long long wc, unsigned long long prefix)
{
    unsigned long long w = (unsigned long long)(wc + 2147483648LL); /* codec._I32_OFFSET */
    for (int i = 0; i < 4; i++)
        out[i] = (unsigned char)(w >> (24 - 8 * i));
    for (int i = 0; i < 8; i++)
        out[4 + i] = (unsigned char)(prefix >> (56 - 8 * i));
}

/* A ShardIdent (workchain, prefix) as codec.shard_bytes encodes it. */
static int
put_shard(unsigned char *out, PyObject *shard)
{
    if (!PyTuple_Check(shard) || PyTuple_GET_SIZE(shard) != 2) {
        PyErr_SetString(PyExc_TypeError, "a shard must be a (workchain, prefix) tuple");
        return -1;
    }
    long wc = PyLong_AsLong(PyTuple_GET_ITEM(shard, 0));
    if (wc == -1 && PyErr_Occurred())
        return -1;
    unsigned long long prefix = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(shard, 1));
    if (prefix == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (wc < INT32_MIN || wc > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a shard's workchain must fit in 32 bits");
        return -1;
    }
    shard_bytes_at(out, wc, prefix);
    return 0;
}

/* One entry of a mapping being sorted: its key's bytes (or int), the value (owned: a
 * key's __index__ may change the dict and free it; see entries_free). */
typedef struct {
    unsigned char key[ADDR_LEN > SHARD_LEN ? ADDR_LEN : SHARD_LEN];
    size_t klen;
    long long ikey;
    PyObject *value;
} Entry;

static int
cmp_entry_bytes(const void *a, const void *b)
{
    const Entry *x = a, *y = b;
    return memcmp(x->key, y->key, x->klen < y->klen ? x->klen : y->klen);
}

static int
cmp_entry_int(const void *a, const void *b)
{
    long long x = ((const Entry *)a)->ikey, y = ((const Entry *)b)->ikey;
    return (x > y) - (x < y);
}

/* Release the first n entries' values, and the array. */
static void
entries_free(Entry *e, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(e[i].value);
    PyMem_Free(e);
}

/*
 * The entries of dict `d`, keys encoded by `kind` ('s': shard, 'i': int), sorted; a
 * PyMem array of *n entries (NULL and *n == 0 for an empty dict; NULL on error), each
 * holding its value (entries_free releases them). A key is held while it is encoded:
 * its workchain's __index__ may change the dict; the next PyDict_Next sees the change.
 */
static Entry *
sorted_entries(PyObject *d, char kind, Py_ssize_t *n)
{
    *n = 0;
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "a dict was expected in a diff record");
        return NULL;
    }
    Py_ssize_t size = PyDict_GET_SIZE(d);
    if (size == 0)
        return NULL;
    Entry *e = PyMem_Malloc((size_t)size * sizeof(Entry));
    if (e == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (i >= size)
            break;
        e[i].value = Py_NewRef(v);
        i++; /* entry i - 1 holds its value from here */
        int bad;
        if (kind == 's') {
            e[i - 1].klen = SHARD_LEN;
            Py_INCREF(k);
            bad = put_shard(e[i - 1].key, k) < 0;
            Py_DECREF(k);
        } else if (!PyLong_Check(k) || PyBool_Check(k)) {
            PyErr_SetString(PyExc_TypeError, "a partition must be an int");
            bad = 1;
        } else {
            e[i - 1].ikey = PyLong_AsLongLong(k); /* an int: no Python code runs */
            bad = e[i - 1].ikey == -1 && PyErr_Occurred();
        }
        if (bad)
            goto fail;
    }
    if (i != size || PyDict_GET_SIZE(d) != size) {
        PyErr_SetString(PyExc_RuntimeError, "dict changed size during diff_record");
        goto fail;
    }
    qsort(e, (size_t)size, sizeof(Entry), kind == 's' ? cmp_entry_bytes : cmp_entry_int);
    *n = size;
    return e;
fail:
    entries_free(e, i);
    return NULL;
}

/*
 * A dict as an array of [key, value] pairs sorted by key: keys of `kind` ('s': shards,
 * packed as bin; 'i': ints), values queue keys (bin) when `values_are_keys`, else ints.
 */
static int
mp_pairs(Buf *o, PyObject *d, char kind, int values_are_keys)
{
    Py_ssize_t n;
    Entry *e = sorted_entries(d, kind, &n);
    if (e == NULL && PyErr_Occurred())
        return -1;
    int r = mp_array(o, (size_t)n);
    for (Py_ssize_t i = 0; r == 0 && i < n; i++) {
        r = mp_array(o, 2);
        if (r == 0)
            r = kind == 's' ? mp_bin(o, e[i].key, SHARD_LEN) : mp_ll(o, e[i].ikey);
        if (r == 0)
            r = values_are_keys ? mp_queue_key(o, e[i].value) : mp_int(o, e[i].value);
    }
    entries_free(e, n);
    return r;
}

/* [[partition, sorted address bytes], ...] of a router's {partition: frozenset}. */
static int
mp_router(Buf *o, PyObject *d)
{
    Py_ssize_t n;
    Entry *e = sorted_entries(d, 'i', &n);
    if (e == NULL && PyErr_Occurred())
        return -1;
    int r = mp_array(o, (size_t)n);
    for (Py_ssize_t i = 0; r == 0 && i < n; i++) {
        PyObject *addrs = e[i].value;
        if (!PyAnySet_Check(addrs)) {
            PyErr_SetString(PyExc_TypeError, "a router's partition must hold a frozenset");
            r = -1;
            break;
        }
        Py_ssize_t m = PySet_GET_SIZE(addrs);
        Entry *a = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(Entry));
        if (a == NULL) {
            PyErr_NoMemory();
            r = -1;
            break;
        }
        Py_ssize_t j = 0;
        PyObject *it = PyObject_GetIter(addrs), *addr;
        if (it == NULL)
            r = -1;
        while (r == 0 && j < m && (addr = PyIter_Next(it)) != NULL) {
            a[j].klen = ADDR_LEN;
            r = put_address(a[j].key, addr);
            Py_DECREF(addr);
            j++;
        }
        Py_XDECREF(it);
        if (r == 0 && PyErr_Occurred())
            r = -1;
        if (r == 0 && j != m) {
            PyErr_SetString(PyExc_RuntimeError, "a router changed during diff_record");
            r = -1;
        }
        if (r == 0) {
            qsort(a, (size_t)m, sizeof(Entry), cmp_entry_bytes);
            r = mp_array(o, 2);
        }
        if (r == 0)
            r = mp_ll(o, e[i].ikey);
        if (r == 0)
            r = mp_array(o, (size_t)m);
        for (Py_ssize_t k = 0; r == 0 && k < m; k++)
            r = mp_bin(o, a[k].key, ADDR_LEN);
        PyMem_Free(a);
    }
    entries_free(e, n);
    return r;
}

static PyObject *
diff_record(PyObject *self, PyObject *args)
{
    PyObject *version, *min_message, *max_message, *counts, *diff_hash, *processed_to,
        *router_src, *router_dst, *seqno, *prev_hash, *partitions;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO:diff_record", &version, &min_message,
                          &max_message, &counts, &diff_hash, &processed_to, &router_src,
                          &router_dst, &seqno, &prev_hash, &partitions))
        return NULL;
    Buf o = {NULL, 0, 0};
    static const unsigned char nil = 0xc0;
    int r = mp_array(&o, 11);
    if (r == 0)
        r = mp_int(&o, version);
    if (r == 0)
        r = mp_queue_key(&o, min_message);
    if (r == 0)
        r = mp_queue_key(&o, max_message);
    if (r == 0)
        r = mp_pairs(&o, counts, 's', 0);
    if (r == 0)
        r = mp_bytes(&o, diff_hash);
    if (r == 0)
        r = mp_pairs(&o, processed_to, 's', 1);
    if (r == 0)
        r = mp_router(&o, router_src);
    if (r == 0)
        r = mp_router(&o, router_dst);
    if (r == 0)
        r = mp_int(&o, seqno);
    if (r == 0)
        r = prev_hash == Py_None ? mp_put(&o, &nil, 1) : mp_bytes(&o, prev_hash);
    if (r == 0)
        r = mp_pairs(&o, partitions, 'i', 0);
    PyObject *out = r == 0 ? PyBytes_FromStringAndSize((const char *)o.b, (Py_ssize_t)o.n) : NULL;
    PyMem_Free(o.b);
    return out;
}


/* ---- the write path: one pass over a diff ------------------------------------------ */

/*
 * One destination of a diff in one partition: the Address first seen for it (owned),
 * its workchain and account bytes, and how many messages go there. Entries keep the
 * order in which their destinations were first seen, as a dict counting them would.
 */
typedef struct {
    Py_hash_t hash;
    long partition;
    int wc;
    const unsigned char *account; /* inside addr's account bytes, alive while addr is */
    PyObject *addr;
    unsigned long long count;
} Dest;

typedef struct {
    Dest *entries;
    Py_ssize_t n, cap;   /* entries used / allocated */
    Py_ssize_t *slots;   /* open addressing: entry index + 1, 0 for empty */
    size_t mask;         /* slots - 1 (a power of two) */
} DestTable;

static void
dests_free(DestTable *t)
{
    for (Py_ssize_t i = 0; i < t->n; i++)
        Py_DECREF(t->entries[i].addr);
    PyMem_Free(t->entries);
    PyMem_Free(t->slots);
    t->entries = NULL;
    t->slots = NULL;
    t->n = t->cap = 0;
}

static int
dests_rehash(DestTable *t, size_t nslots)
{
    Py_ssize_t *slots = PyMem_Calloc(nslots, sizeof(Py_ssize_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = nslots - 1;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        size_t j = (size_t)t->entries[i].hash & mask;
        while (slots[j] != 0)
            j = (j + 1) & mask;
        slots[j] = i + 1;
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = mask;
    return 0;
}

/* The hash of an account's bytes, by content (a bytes subclass is hashed as bytes). */
static Py_hash_t
account_hash(PyObject *account)
{
    if (PyBytes_CheckExact(account))
        return PyObject_Hash(account); /* cached in the bytes object after the first call */
    PyObject *copy = PyBytes_FromStringAndSize(PyBytes_AS_STRING(account), ACCOUNT_LEN);
    if (copy == NULL)
        return -1;
    Py_hash_t h = PyObject_Hash(copy);
    Py_DECREF(copy);
    return h;
}

/* The entry of (partition, addr), created with count 0 if new; NULL with an exception. */
static Dest *
dests_find(DestTable *t, long partition, PyObject *addr, int wc, PyObject *account)
{
    Py_hash_t ah = account_hash(account);
    if (ah == -1 && PyErr_Occurred())
        return NULL;
    size_t h = (size_t)ah ^ ((size_t)(wc + 128) * 0x9E3779B97F4A7C15ULL) ^
               ((size_t)partition * 0xC2B2AE3D27D4EB4FULL);
    const unsigned char *acc = (const unsigned char *)PyBytes_AS_STRING(account);
    if (t->slots != NULL) {
        size_t j = h & t->mask;
        while (t->slots[j] != 0) {
            Dest *d = &t->entries[t->slots[j] - 1];
            if ((size_t)d->hash == h && d->partition == partition && d->wc == wc &&
                memcmp(d->account, acc, ACCOUNT_LEN) == 0)
                return d;
            j = (j + 1) & t->mask;
        }
    }
    if (t->n == t->cap) {
        Py_ssize_t cap = t->cap ? 2 * t->cap : 64;
        Dest *grown = PyMem_Realloc(t->entries, (size_t)cap * sizeof(Dest));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        t->entries = grown;
        t->cap = cap;
    }
    if (t->slots == NULL || (size_t)(t->n + 1) * 2 > t->mask + 1) {
        if (dests_rehash(t, t->slots == NULL ? 256 : 2 * (t->mask + 1)) < 0)
            return NULL;
    }
    Dest *d = &t->entries[t->n];
    d->hash = (Py_hash_t)h;
    d->partition = partition;
    d->wc = wc;
    d->account = acc;
    d->addr = addr;
    Py_INCREF(addr);
    d->count = 0;
    size_t j = h & t->mask;
    while (t->slots[j] != 0)
        j = (j + 1) & t->mask;
    t->slots[j] = ++t->n;
    return d;
}


static int
cmp_long(const void *a, const void *b)
{
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

/*
 * encode_diff(put, target, shard_bytes, messages, partition_for)
 *   -> (rows, [(partition, messages, stat_value), ...], [(workchain, messages), ...])
 *
 * Everything apply derives from a diff's messages, in one pass: encode each message as
 * its stored row and call put(key, value, target) (as put_rows), and count its
 * destination per partition. Returns the rows put, per partition in ascending order its
 * message count and statistics value (the bytes stat_value writes for the dict
 * DiffStatistics.from_diff counts: destinations in first-seen order), and per destination
 * workchain in ascending order its message count (what shards_messages_count sums).
 * partition_for picks the partition, as in put_rows (see route_message).
 */
static PyObject *
encode_diff(PyObject *self, PyObject *args)
{
    PyObject *put, *target, *shard_b, *messages, *partition_for;
    if (!PyArg_ParseTuple(args, "OOO!OO:encode_diff", &put, &target, &PyBytes_Type, &shard_b,
                          &messages, &partition_for))
        return NULL;
    unsigned char prefix[QK_AT];
    PyObject *seq = rows_input(shard_b, messages, prefix);
    if (seq == NULL)
        return NULL;
    DestTable table = {NULL, 0, 0, NULL, 0};
    unsigned long long per_wc[256] = {0};
    PyObject *out = NULL, *parts = NULL, *wcs = NULL;
    long *seen = NULL;
    long current = 0;
    PyObject *last_dst = NULL; /* owned: the previous message's destination object */
    PyObject *spares[2] = {NULL, NULL}; /* owned: the row objects reused (row_bytes) */
    long last_partition = -1;
    Dest *last = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    expect_rows_of(put, seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* seq may be a list that put() mutates: re-read its size and hold the item */
        if (i >= PySequence_Fast_GET_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "messages changed size during encode_diff");
            goto done;
        }
        prefetch_messages(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), i);
        PyObject *msg = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(msg);
        if (!PyTuple_Check(msg) || PyTuple_GET_SIZE(msg) != 4) {
            Py_DECREF(msg);
            PyErr_SetString(PyExc_TypeError, "a message must be a (key, src, dst, body) tuple");
            goto done;
        }
        PyObject *dst = PyTuple_GET_ITEM(msg, 2);
        long p = 0;
        if (partition_for != Py_None) {
            p = route_message(partition_for, PyTuple_GET_ITEM(msg, 1), dst);
            if (p < 0) {
                Py_DECREF(msg);
                goto done;
            }
            if (p != current) {
                current = p;
                prefix[0] = (unsigned char)(p >> 8);
                prefix[1] = (unsigned char)p;
            }
        }
        PyObject *key, *value;
        if (encode_message(msg, prefix, &key, &value, spares) < 0) {
            Py_DECREF(msg);
            goto done;
        }
        /* count the destination (encode_message checked it is a valid address) */
        Dest *d = last;
        if (d == NULL || dst != last_dst || p != last_partition) {
            int wc;
            PyObject *account;
            d = address_parts(dst, &wc, &account) < 0 ? NULL
                                                       : dests_find(&table, p, dst, wc, account);
            if (d == NULL) {
                Py_DECREF(key);
                Py_DECREF(value);
                Py_DECREF(msg);
                goto done;
            }
        }
        d->count++;
        per_wc[d->wc + 128]++;
        last = d;
        Py_INCREF(dst);
        Py_XSETREF(last_dst, dst);
        last_partition = p;
        PyObject *cargs[3] = {key, value, target};
        PyObject *r = PyObject_Vectorcall(put, cargs, 3, NULL);
        Py_DECREF(key);
        Py_DECREF(value);
        Py_DECREF(msg);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    /* the partitions, ascending */
    seen = PyMem_Malloc(sizeof(long) * (size_t)(table.n ? table.n : 1));
    if (seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t nparts = 0;
    for (Py_ssize_t i = 0; i < table.n; i++) {
        long p = table.entries[i].partition;
        int known = 0;
        for (Py_ssize_t j = 0; j < nparts && !known; j++)
            known = seen[j] == p;
        if (!known)
            seen[nparts++] = p;
    }
    qsort(seen, (size_t)nparts, sizeof(long), cmp_long);
    parts = PyList_New(nparts);
    if (parts == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < nparts; j++) {
        Py_ssize_t entries = 0;
        unsigned long long messages_in = 0;
        for (Py_ssize_t i = 0; i < table.n; i++) {
            if (table.entries[i].partition == seen[j]) {
                entries++;
                messages_in += table.entries[i].count;
            }
        }
        PyObject *value = PyBytes_FromStringAndSize(NULL, entries * STAT_ENTRY_LEN);
        if (value == NULL)
            goto done;
        unsigned char *b = (unsigned char *)PyBytes_AS_STRING(value);
        for (Py_ssize_t i = 0; i < table.n; i++) {
            Dest *d = &table.entries[i];
            if (d->partition != seen[j])
                continue;
            b[0] = (unsigned char)(d->wc + 128);
            memcpy(b + 1, d->account, ACCOUNT_LEN);
            for (int k = 0; k < 8; k++)
                b[ADDR_LEN + k] = (unsigned char)(d->count >> (56 - 8 * k));
            b += STAT_ENTRY_LEN;
        }
        PyObject *item = Py_BuildValue("(lKN)", seen[j], messages_in, value);
        if (item == NULL)
            goto done;
        PyList_SET_ITEM(parts, j, item);
    }
    wcs = PyList_New(0);
    if (wcs == NULL)
        goto done;
    for (int w = 0; w < 256; w++) {
        if (per_wc[w] == 0)
            continue;
        PyObject *item = Py_BuildValue("(iK)", w - 128, per_wc[w]);
        if (item == NULL || PyList_Append(wcs, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
    }
    out = Py_BuildValue("(nOO)", n, parts, wcs);
done:
    tee_expect(put, 0, 0);
    Py_XDECREF(spares[0]);
    Py_XDECREF(spares[1]);
    Py_XDECREF(last_dst);
    Py_XDECREF(parts);
    Py_XDECREF(wcs);
    PyMem_Free(seen);
    dests_free(&table);
    Py_DECREF(seq);
    return out;
}

/*
 * sources_in_shard(messages, workchain, prefix, prefix_len) -> bool
 *
 * True when the source address of every message lies in the shard (workchain, prefix
 * with prefix_len significant bits): its workchain is the shard's and the top prefix_len
 * bits of its account are the prefix's. False otherwise, or when a message is not
 * message-shaped: the caller then runs the pure-Python check, which names the address.
 */
static PyObject *
sources_in_shard(PyObject *self, PyObject *args)
{
    PyObject *messages, *prefix_obj;
    long long workchain;
    int prefix_len;
    if (!PyArg_ParseTuple(args, "OLOi:sources_in_shard", &messages, &workchain, &prefix_obj,
                          &prefix_len))
        return NULL;
    /* not "K", which takes any int modulo 2**64: a prefix is a u64 (OverflowError else) */
    unsigned long long shard_prefix = PyLong_AsUnsignedLongLong(prefix_obj);
    if (shard_prefix == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (prefix_len < 0 || prefix_len > 64) {
        PyErr_SetString(PyExc_ValueError, "prefix_len out of range");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(messages, "messages must be a sequence");
    if (seq == NULL)
        return NULL;
    int shift = 64 - prefix_len;
    unsigned long long want = prefix_len == 0 ? 0 : shard_prefix >> shift;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *last = NULL; /* the previous source checked: sources repeat */
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *msg = items[i];
        if (!PyTuple_Check(msg) || PyTuple_GET_SIZE(msg) != 4) {
            ok = 0;
            break;
        }
        PyObject *src = PyTuple_GET_ITEM(msg, 1);
        if (src == last)
            continue;
        if (!PyTuple_Check(src) || PyTuple_GET_SIZE(src) != 2 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(src, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(src, 1)) ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(src, 1)) != ACCOUNT_LEN) {
            ok = 0;
            break;
        }
        int overflow = 0;
        long long wc = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(src, 0), &overflow);
        if (overflow || wc != workchain) {
            ok = 0;
            break;
        }
        if (prefix_len != 0) {
            const unsigned char *acc =
                (const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(src, 1));
            ok = (be_prefix(acc, 8) >> shift) == want;
        }
        last = src;
    }
    Py_DECREF(seq);
    if (PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(ok);
}

/*
 * strictly_ascending(messages, message_type) -> bool
 *
 * True when every item of the sequence is exactly of message_type, with a queue key of
 * an int lt in u64 and a 32-byte hash, and the keys rise strictly (lt, then hash bytes):
 * the input is sorted and has no duplicate key, so QueueDiff needs neither a sort nor a
 * duplicate check. False otherwise (the caller then sorts and checks in Python).
 */
static PyObject *
strictly_ascending(PyObject *self, PyObject *args)
{
    PyObject *messages, *message_type;
    if (!PyArg_ParseTuple(args, "OO:strictly_ascending", &messages, &message_type))
        return NULL;
    PyObject *seq = PySequence_Fast(messages, "messages must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    unsigned long long prev_lt = 0;
    const char *prev_hash = NULL;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *msg = items[i];
        if ((PyObject *)Py_TYPE(msg) != message_type || !PyTuple_Check(msg) ||
            PyTuple_GET_SIZE(msg) != 4) {
            ok = 0;
            break;
        }
        PyObject *qk = PyTuple_GET_ITEM(msg, 0);
        if (!PyTuple_Check(qk) || PyTuple_GET_SIZE(qk) != 2 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(qk, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(qk, 1)) ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(qk, 1)) != HASH_LEN) {
            ok = 0;
            break;
        }
        unsigned long long lt = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(qk, 0));
        if (lt == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or too large: let Python decide */
            ok = 0;
            break;
        }
        const char *hash = PyBytes_AS_STRING(PyTuple_GET_ITEM(qk, 1));
        if (prev_hash != NULL &&
            (lt < prev_lt || (lt == prev_lt && memcmp(hash, prev_hash, HASH_LEN) <= 0))) {
            ok = 0;
            break;
        }
        prev_lt = lt;
        prev_hash = hash;
    }
    Py_DECREF(seq);
    return PyBool_FromLong(ok);
}

/*
 * tp_dealloc of the value types with the plain tuple layout, set by init() in place of
 * CPython's generic subtype_dealloc. For an instance of such a type (no finalizer, no
 * __dict__, no weak references, no slots) subtype_dealloc walks the bases to find
 * tuple's dealloc and checks for each of those; what it then does is all this does:
 * untrack the object (when tracked), release its items, free it and release its type
 * (an instance of a heap type holds one). The trashcan keeps a deep nesting from
 * exhausting the C stack, as for tuples. A merge frees four such objects a message.
 */
static void
value_dealloc(PyObject *op)
{
    PyTypeObject *type = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    Py_TRASHCAN_BEGIN(op, value_dealloc)
    for (Py_ssize_t i = Py_SIZE(op); --i >= 0;)
        Py_XDECREF(PyTuple_GET_ITEM(op, i));
    type->tp_free(op);
    Py_DECREF(type);
    Py_TRASHCAN_END
}

/* Whether value_dealloc may replace the dealloc of `type`: a class (a heap type) with the
 * plain tuple layout and neither __del__ nor a finalizer; its own subclasses keep
 * CPython's. */
static int
takes_value_dealloc(PyTypeObject *type, int plain)
{
    return plain && (type->tp_flags & Py_TPFLAGS_HEAPTYPE) &&
           (type->tp_flags & Py_TPFLAGS_HAVE_GC) && PyType_IsSubtype(type, &PyTuple_Type) &&
           type->tp_finalize == NULL && type->tp_del == NULL && type->tp_free == PyObject_GC_Del;
}

/* The four value types init() registered, and the dealloc each had before (CPython's), so
 * that value_deallocs(False) can put it back. */
static PyTypeObject *dealloc_types[4];
static destructor generic_deallocs[4];
static int value_deallocs_on;

/* Give each registered type that can take it value_dealloc (on) or its own dealloc back. */
static void
set_value_deallocs(int on)
{
    value_deallocs_on = on;
    int plains[4] = {plain_iterated, plain_message, plain_queue_key, plain_address};
    for (int i = 0; i < 4; i++) {
        PyTypeObject *type = dealloc_types[i];
        if (type != NULL && takes_value_dealloc(type, plains[i]))
            type->tp_dealloc = on ? value_dealloc : generic_deallocs[i];
    }
}

/* `set(on)` for a setting whose value is `was` now; returns `was` as a bool (the
 * switches tests and benchmarks flip: value_deallocs, value_constructors). */
static PyObject *
switch_setting(PyObject *on, int was, void (*set)(int))
{
    int flag = PyObject_IsTrue(on);
    if (flag < 0)
        return NULL;
    set(flag);
    return PyBool_FromLong(was);
}

/*
 * value_deallocs(on) -> bool: whether the value types free their instances through
 * value_dealloc (what init() sets) or through CPython's own dealloc, as on a machine
 * without this module (imq.iterator.pure_python() switches it off, so that a pure-Python
 * read measured in the same process costs what it costs there); returns the previous
 * setting. Either frees any instance correctly, whichever made it.
 */
static PyObject *
value_deallocs(PyObject *self, PyObject *on)
{
    return switch_setting(on, value_deallocs_on, set_value_deallocs);
}

/* The tp_new of a class that defines __new__ (CPython's slot_tp_new, which calls it),
 * learnt once from a probe class (find_class_new). */
static newfunc class_new;

/*
 * Whether `type` is a class (a heap type) over tuple whose instances tuple's own tp_new
 * builds correctly: going up its bases past the classes that define __new__ in Python,
 * the first tp_new met is tuple's. This is the check by which tuple.__new__ refuses a
 * type as "not safe": a C struct sequence (os.stat_result, a heap type in 3.11, with a
 * tuple's sizes, which plain_layout cannot tell apart) keeps hidden fields past its items
 * that its own tp_new fills and its dealloc and getters read. init() and value_new()
 * refuse such a type. Pointer and flag reads only (imq's classes sit two bases above
 * tuple).
 */
static int
tuple_class(PyTypeObject *type)
{
    if (!(type->tp_flags & Py_TPFLAGS_HEAPTYPE) ||
        !PyType_FastSubclass(type, Py_TPFLAGS_TUPLE_SUBCLASS))
        return 0;
    PyTypeObject *t = type;
    while (t != NULL && t->tp_new == class_new)
        t = t->tp_base;
    return t != NULL && t->tp_new == PyTuple_Type.tp_new;
}

/* Learn class_new from a class defining __new__; 0, or -1 with an exception. */
static int
find_class_new(void)
{
    PyObject *sm = PyStaticMethod_New(Py_None); /* never called: its presence sets tp_new */
    PyObject *probe = sm == NULL ? NULL
                                 : PyObject_CallFunction((PyObject *)&PyType_Type, "s(O){sO}",
                                                         "_probe", (PyObject *)&PyTuple_Type,
                                                         "__new__", sm);
    Py_XDECREF(sm);
    if (probe == NULL)
        return -1;
    class_new = ((PyTypeObject *)probe)->tp_new;
    Py_DECREF(probe);
    if (class_new == NULL || class_new == PyTuple_Type.tp_new) {
        PyErr_SetString(PyExc_ImportError, "imq._speedups: unexpected tp_new of a class");
        return -1;
    }
    return 0;
}

/*
 * The cache of fresh rows (imq.storage.cache) stores each segment's rows in *chunks*: a
 * `data` buffer holding the rows back to back (each its key, KEY_LEN bytes, then its
 * value) and an `offs` buffer of native uint32s, where each row starts in data,
 * ascending. A row's value runs to the next row's start (the last one's to the end of
 * data). Its *route* is the first ROUTE_LEN bytes of its value: the destination's
 * workchain byte and the top 8 bytes of its account, all the merge's test reads. One
 * chunk holds what one batch wrote to one segment: a memcpy a row to keep, no objects;
 * a read builds (key, value) pairs only for the rows it returns.
 */
#define ROUTE_LEN 9

typedef struct {
    Py_buffer data, offs;
    const unsigned char *d;
    const uint32_t *o;
    Py_ssize_t n;
} Chunk;

static void
chunk_release(Chunk *c)
{
    if (c->d != NULL) {
        PyBuffer_Release(&c->data);
        PyBuffer_Release(&c->offs);
        c->d = NULL;
    }
}

/* Views of a chunk's buffers (released with chunk_release); 0, or -1 with an exception. */
static int
chunk_open(PyObject *data, PyObject *offs, Chunk *c)
{
    c->d = NULL;
    if (PyObject_GetBuffer(data, &c->data, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(offs, &c->offs, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&c->data);
        return -1;
    }
    c->d = (const unsigned char *)c->data.buf;
    c->o = (const uint32_t *)c->offs.buf;
    c->n = c->offs.len / (Py_ssize_t)sizeof(uint32_t);
    if (c->offs.len % (Py_ssize_t)sizeof(uint32_t) != 0) {
        chunk_release(c);
        PyErr_SetString(PyExc_ValueError, "a chunk's offsets must be uint32s");
        return -1;
    }
    return 0;
}

static inline Py_ssize_t
row_end(const Chunk *c, Py_ssize_t i)
{
    return i + 1 < c->n ? (Py_ssize_t)c->o[i + 1] : c->data.len;
}

/* Where row i's value starts and how long it is (*vlen), checked against the chunk's
 * bounds: a row must lie inside data, after its offset, and hold a whole key. The cache
 * only holds chunks chunk_check passed; ChunkRows also takes any other (its callers'
 * lists), so each row it reads is checked here first, never read out of bounds (a
 * pointer to the row, or NULL with ValueError). */
static const unsigned char *
row_checked(const Chunk *c, Py_ssize_t i, Py_ssize_t *vlen)
{
    Py_ssize_t start = c->o[i], end = row_end(c, i);
    if (end > c->data.len || end - start < KEY_LEN) {
        PyErr_SetString(PyExc_ValueError, "a cached chunk must hold message rows");
        return NULL;
    }
    *vlen = end - start - KEY_LEN;
    return c->d + start;
}

/* -1, 0, 1 as row i's key orders before, with, after `key` (bytes order). The key is
 * what the data holds of it (data[o[i]:o[i] + KEY_LEN], as the pure-Python bisection
 * slices): a chunk not checked by chunk_check is read in its bounds only. Two
 * comparisons a bisection step. */
static inline int
cmp_row_key(const Chunk *c, Py_ssize_t i, const unsigned char *key, Py_ssize_t klen)
{
    Py_ssize_t at = c->o[i], rlen = c->data.len - at;
    if (rlen > KEY_LEN)
        rlen = KEY_LEN;
    else if (rlen < 0)
        rlen = 0;
    Py_ssize_t m = klen < rlen ? klen : rlen;
    int r = m > 0 ? memcmp(c->d + at, key, (size_t)m) : 0;
    if (r != 0)
        return r < 0 ? -1 : 1;
    return (rlen > klen) - (rlen < klen);
}

/*
 * chunk_check(data, offs) -> (rows, value_bytes, ascending)
 *
 * Checks a chunk before the cache takes it: the offsets ascend inside data from 0, each
 * row holds a key and a value with a whole message header. ValueError otherwise.
 * `ascending`: whether the keys strictly ascend (the cache sorts the chunk when not).
 */
static PyObject *
chunk_check(PyObject *self, PyObject *args)
{
    PyObject *data, *offs;
    if (!PyArg_ParseTuple(args, "OO:chunk_check", &data, &offs))
        return NULL;
    Chunk c;
    if (chunk_open(data, offs, &c) < 0)
        return NULL;
    int ascending = 1;
    Py_ssize_t value_bytes = 0;
    if (c.n == 0 ? c.data.len != 0 : c.o[0] != 0)
        goto bad;
    for (Py_ssize_t i = 0; i < c.n; i++) {
        Py_ssize_t start = c.o[i], end = row_end(&c, i);
        if (end > c.data.len || end - start < KEY_LEN + HEADER_LEN)
            goto bad;
        value_bytes += end - start - KEY_LEN;
        if (i > 0 && ascending && memcmp(c.d + c.o[i - 1], c.d + start, KEY_LEN) >= 0)
            ascending = 0;
    }
    chunk_release(&c);
    return Py_BuildValue("(nnO)", c.n, value_bytes, ascending ? Py_True : Py_False);
bad:
    chunk_release(&c);
    PyErr_SetString(PyExc_ValueError, "a cached chunk must hold message rows");
    return NULL;
}

/* chunk_bisect(data, offs, key) -> the first row whose key is >= key (bisect_left). */
static PyObject *
chunk_bisect(PyObject *self, PyObject *args)
{
    PyObject *data, *offs;
    Py_buffer key;
    if (!PyArg_ParseTuple(args, "OOy*:chunk_bisect", &data, &offs, &key))
        return NULL;
    Chunk c;
    if (chunk_open(data, offs, &c) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    Py_ssize_t lo = 0, hi = c.n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (cmp_row_key(&c, mid, (const unsigned char *)key.buf, key.len) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    chunk_release(&c);
    PyBuffer_Release(&key);
    return PyLong_FromSsize_t(lo);
}

/*
 * chunk_cut(data, offs, i, j) -> (data, offs)
 *
 * A chunk without its rows [i, j): two memcpys and the kept offsets past the cut moved
 * down, no row objects (what a delete that ends inside a chunk keeps of it).
 */
static PyObject *
chunk_cut(PyObject *self, PyObject *args)
{
    PyObject *data, *offs;
    Py_ssize_t i, j;
    if (!PyArg_ParseTuple(args, "OOnn:chunk_cut", &data, &offs, &i, &j))
        return NULL;
    Chunk c;
    if (chunk_open(data, offs, &c) < 0)
        return NULL;
    PyObject *nd = NULL, *no = NULL, *out = NULL;
    if (i < 0 || j < i || j > c.n) {
        PyErr_SetString(PyExc_ValueError, "rows to cut out of the chunk's range");
        goto done;
    }
    Py_ssize_t a = i < c.n ? (Py_ssize_t)c.o[i] : c.data.len; /* row i starts here */
    Py_ssize_t b = j < c.n ? (Py_ssize_t)c.o[j] : c.data.len; /* row j starts here */
    if (a > b || b > c.data.len) {
        PyErr_SetString(PyExc_ValueError, "a cached chunk must hold message rows");
        goto done;
    }
    nd = PyBytes_FromStringAndSize(NULL, c.data.len - (b - a));
    no = nd == NULL ? NULL
                    : PyBytes_FromStringAndSize(NULL, (c.n - (j - i)) * (Py_ssize_t)sizeof(uint32_t));
    if (no == NULL)
        goto done;
    char *d = PyBytes_AS_STRING(nd);
    memcpy(d, c.d, (size_t)a);
    memcpy(d + a, c.d + b, (size_t)(c.data.len - b));
    uint32_t *o = (uint32_t *)PyBytes_AS_STRING(no);
    memcpy(o, c.o, (size_t)i * sizeof(uint32_t));
    uint32_t shift = (uint32_t)(b - a);
    for (Py_ssize_t k = j; k < c.n; k++)
        o[i + k - j] = c.o[k] - shift;
    out = pair_of(nd, no);
    nd = no = NULL;
done:
    Py_XDECREF(nd);
    Py_XDECREF(no);
    chunk_release(&c);
    return out;
}

/*
 * chunk_pack(rows) -> (data, offs)
 *
 * A chunk of `rows`, a list of (key, value) bytes pairs in order: each row's key and
 * value one after another in data, its start in offs (what imq.storage.cache._pack
 * builds, in one allocation each). ValueError if a key is not a message key.
 */
static PyObject *
chunk_pack(PyObject *self, PyObject *rows)
{
    if (!PyList_CheckExact(rows)) {
        PyErr_SetString(PyExc_TypeError, "chunk_pack takes a list of rows");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows), total = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(row, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(row, 1))) {
            PyErr_SetString(PyExc_TypeError, "rows must be (bytes, bytes) pairs");
            return NULL;
        }
        if (PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, 0)) != KEY_LEN) {
            PyErr_SetString(PyExc_ValueError, "a cached row's key must be a message key");
            return NULL;
        }
        total += KEY_LEN + PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, 1));
    }
    if (total > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a chunk holds at most 4 GiB");
        return NULL;
    }
    PyObject *nd = PyBytes_FromStringAndSize(NULL, total);
    PyObject *no = nd == NULL ? NULL : PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint32_t));
    if (no == NULL) {
        Py_XDECREF(nd);
        return NULL;
    }
    char *d = PyBytes_AS_STRING(nd);
    uint32_t *o = (uint32_t *)PyBytes_AS_STRING(no);
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        PyObject *k = PyTuple_GET_ITEM(row, 0), *v = PyTuple_GET_ITEM(row, 1);
        o[r] = (uint32_t)at;
        memcpy(d + at, PyBytes_AS_STRING(k), KEY_LEN);
        memcpy(d + at + KEY_LEN, PyBytes_AS_STRING(v), (size_t)PyBytes_GET_SIZE(v));
        at += KEY_LEN + PyBytes_GET_SIZE(v);
    }
    return pair_of(nd, no);
}

/* The (key, value) pair of row i, a new reference, or NULL with an exception. */
static PyObject *
chunk_row(const Chunk *c, Py_ssize_t i)
{
    Py_ssize_t vlen;
    const unsigned char *at = row_checked(c, i, &vlen);
    return at == NULL ? NULL : row_at(at, vlen);
}

/*
 * ChunkRows(datas, offss, start, stop, reader=None) -> an iterator of (key, value) rows
 *
 * The rows of consecutive chunks in key order (datas[i], offss[i]: chunk i's buffers),
 * from row `start` of the first to row `stop` of the last (exclusive), every row of the
 * chunks between. With reader None, every row. With reader (wc_byte, prefix_len, want), the
 * merge iterator's destination test (merge_fill's), the rows the merge can tell apart:
 * every accepted row, and of each run of rejected rows only the last one. The merge
 * consumes a run of rejected rows whole, in one refill, and only its last key is ever
 * visible (the source's position), so merging these rows gives the same messages and the
 * same positions as merging every row. `dropped` counts the rows left out so far.
 *
 * Lazy: each row is built when the merge asks for it and freed once decoded, so a long
 * scan reuses the same few objects' memory, as a RocksDB cursor's rows do. merge_fill
 * builds none: it reads a scan filtered for its own reader in place (chunk_refill). The
 * chunks are never changed once the cache holds them; the iterator keeps them alive.
 */
typedef struct {
    PyObject_HEAD
    PyObject *datas, *offss; /* the chunks' buffers, kept alive */
    Chunk *chunks;          /* one view per chunk, opened when reached (d == NULL: closed) */
    Py_ssize_t nparts, part, row, stop; /* the current chunk, its next row and its end */
    Py_ssize_t first_start, last_stop;
    int filter, shift;
    long wc_byte, prefix_len;
    unsigned long long want;
    Py_ssize_t pending_part, pending_row; /* the last rejected row not yet returned */
    const unsigned char *held;            /* an accepted row due after a rejected one */
    Py_ssize_t held_vlen;
    Py_ssize_t dropped;
} ChunkRows;

static void
chunkrows_dealloc(ChunkRows *self)
{
    if (self->chunks != NULL) {
        for (Py_ssize_t p = 0; p < self->nparts; p++)
            chunk_release(&self->chunks[p]);
        PyMem_Free(self->chunks);
    }
    Py_XDECREF(self->datas);
    Py_XDECREF(self->offss);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Open chunk p's views if they are not (0, or -1 with an exception). */
static int
chunkrows_open(ChunkRows *self, Py_ssize_t p)
{
    if (self->chunks[p].d != NULL)
        return 0;
    return chunk_open(PyList_GET_ITEM(self->datas, p), PyList_GET_ITEM(self->offss, p),
                      &self->chunks[p]);
}

/* Release chunk p's views unless the pending row or the current chunk needs them. */
static void
chunkrows_drop(ChunkRows *self, Py_ssize_t p)
{
    if (p >= 0 && p != self->pending_part && p != self->part)
        chunk_release(&self->chunks[p]);
}

/* Move to chunk p (opening it): its first row and end. 0, or -1 with an exception. */
static int
chunkrows_enter(ChunkRows *self, Py_ssize_t p)
{
    Py_ssize_t left = self->part;
    self->part = p;
    chunkrows_drop(self, left);
    if (p >= self->nparts)
        return 0;
    if (chunkrows_open(self, p) < 0)
        return -1;
    Py_ssize_t n = self->chunks[p].n;
    self->row = p == 0 ? self->first_start : 0;
    self->stop = p == self->nparts - 1 ? self->last_stop : n;
    if (self->row < 0 || self->stop < self->row || self->stop > n) {
        PyErr_SetString(PyExc_ValueError, "start/stop out of the chunk's rows");
        return -1;
    }
    return 0;
}

/* Parse a reader (wc_byte, prefix_len, want), any sequence of three as in the pure-Python
 * _PyChunkRows, into the filter fields of `self`; None: no filter. 0, or -1 with the
 * exception the pure-Python form raises: OverflowError for a want out of u64 (not "K",
 * which takes any int modulo 2**64), ValueError for a prefix_len out of 0..64. */
static int
chunkrows_set_reader(ChunkRows *self, PyObject *reader)
{
    if (reader == Py_None)
        return 0;
    PyObject *t = PySequence_Tuple(reader), *want;
    if (t == NULL)
        return -1;
    int ok = PyArg_ParseTuple(t, "llO:reader", &self->wc_byte, &self->prefix_len, &want);
    if (ok) {
        self->want = PyLong_AsUnsignedLongLong(want);
        ok = !(self->want == (unsigned long long)-1 && PyErr_Occurred());
    }
    Py_DECREF(t);
    if (!ok)
        return -1;
    if (self->prefix_len < 0 || self->prefix_len > 64) {
        PyErr_SetString(PyExc_ValueError, "prefix_len out of range");
        return -1;
    }
    self->filter = 1;
    self->shift = (int)(64 - self->prefix_len);
    return 0;
}

/* A new ChunkRows over `datas` and `offss` (lists the new object takes over: stolen
 * references, never changed by anyone afterwards), filtered like `proto` (a reader
 * parsed by chunkrows_set_reader, or NULL: none). NULL with an exception on failure. */
static PyObject *
chunkrows_make(PyTypeObject *type, PyObject *datas, PyObject *offss, Py_ssize_t first_start,
               Py_ssize_t last_stop, const ChunkRows *proto)
{
    ChunkRows *self = (ChunkRows *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(datas);
        Py_DECREF(offss);
        return NULL;
    }
    self->datas = datas;
    self->offss = offss;
    self->pending_part = -1;
    self->part = -1;
    if (proto != NULL && proto->filter) {
        self->filter = 1;
        self->shift = proto->shift;
        self->wc_byte = proto->wc_byte;
        self->prefix_len = proto->prefix_len;
        self->want = proto->want;
    }
    Py_ssize_t n = PyList_GET_SIZE(datas);
    if (PyList_GET_SIZE(offss) != n) {
        PyErr_SetString(PyExc_ValueError, "datas and offss must be as long");
        goto fail;
    }
    self->chunks = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Chunk));
    if (self->chunks == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    self->nparts = n;
    self->first_start = first_start;
    self->last_stop = last_stop;
    if (n > 0) { /* check both ends now: the last chunk's view is opened and kept */
        if (chunkrows_open(self, n - 1) < 0)
            goto fail;
        Py_ssize_t last_n = self->chunks[n - 1].n;
        if (last_stop < 0 || last_stop > last_n || (n == 1 && first_start > last_stop)) {
            PyErr_SetString(PyExc_ValueError, "start/stop out of the chunk's rows");
            goto fail;
        }
        if (chunkrows_enter(self, 0) < 0)
            goto fail;
    } else {
        self->part = 0;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static PyObject *
chunkrows_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *datas, *offss, *reader = Py_None;
    Py_ssize_t first_start, last_stop;
    static char *kwlist[] = {"datas", "offss", "start", "stop", "reader", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!nn|O:ChunkRows", kwlist, &PyList_Type,
                                     &datas, &PyList_Type, &offss, &first_start, &last_stop,
                                     &reader))
        return NULL;
    ChunkRows proto = {0};
    if (chunkrows_set_reader(&proto, reader) < 0)
        return NULL;
    /* Copies of the lists: the caller's may change, the chunks in them do not. */
    PyObject *d = PyList_GetSlice(datas, 0, PyList_GET_SIZE(datas));
    if (d == NULL)
        return NULL;
    PyObject *o = PyList_GetSlice(offss, 0, PyList_GET_SIZE(offss));
    if (o == NULL) {
        Py_DECREF(d);
        return NULL;
    }
    return chunkrows_make(type, d, o, first_start, last_stop, &proto);
}

static PyObject *
chunkrows_next(ChunkRows *self)
{
    if (self->filter) { /* the walk merge_fill makes in place, as rows */
        if (self->held != NULL) {
            const unsigned char *at = self->held;
            self->held = NULL;
            return row_at(at, self->held_vlen);
        }
        Head head;
        const unsigned char *skip;
        Py_ssize_t skip_vlen, skipped = 0;
        if (chunk_refill((PyObject *)self, &skipped, &head, &skip, &skip_vlen) < 0)
            return NULL;
        if (skip != NULL) { /* the run's last rejected row first, then the accepted one */
            if (head.has) {
                self->held = head.k;
                self->held_vlen = head.vlen;
            }
            return row_at(skip, skip_vlen);
        }
        return head.has ? row_at(head.k, head.vlen) : NULL;
    }
    while (self->part < self->nparts) {
        if (self->row >= self->stop) {
            if (chunkrows_enter(self, self->part + 1) < 0)
                return NULL;
            continue;
        }
        return chunk_row(&self->chunks[self->part], self->row++);
    }
    return NULL;
}

/* merge_fill's in-place reading of a ChunkRows source filtered for merge_fill's own
 * reader: a new reference to its chunks' data list (what keeps every pointer into the
 * chunks valid during the call), or NULL (without an exception) when `source` is
 * anything else, or closed. */
static PyObject *
chunk_source_data(PyObject *source, long wc_byte, long prefix_len, unsigned long long want)
{
    if (!Py_IS_TYPE(source, &ChunkRowsType))
        return NULL;
    ChunkRows *self = (ChunkRows *)source;
    if (!self->filter || self->datas == NULL || self->held != NULL ||
        self->wc_byte != wc_byte || self->prefix_len != prefix_len || self->want != want)
        return NULL; /* (a row held for a pull: the pulls go on) */
    return Py_NewRef(self->datas);
}

/*
 * The filtered walk over a ChunkRows' chunks, building no row: moves past the next
 * accepted row and points `head` at it, or leaves it empty when the rows ran out;
 * *last_skip points at the rejected row just before it (the last one of its run, the
 * only one a filtered scan returns: counted in *skipped, the others in `dropped`), of
 * *skip_vlen value bytes (when skip_vlen is not NULL), or is NULL. merge_fill's refill
 * of a cached source, and chunkrows_next's filtered rows. The pointers stay valid while
 * the chunks' data is alive (the ChunkRows, or merge_fill, holds it). 0, or -1 with an
 * exception.
 */
static int
chunk_refill(PyObject *source, Py_ssize_t *skipped, Head *head,
             const unsigned char **last_skip, Py_ssize_t *skip_vlen)
{
    ChunkRows *self = (ChunkRows *)source;
    head->has = 0;
    head->row = NULL;
    *last_skip = NULL;
    while (self->part < self->nparts) {
        Py_ssize_t p = self->part;
        if (self->row >= self->stop) {
            if (chunkrows_enter(self, p + 1) < 0)
                return -1;
            continue;
        }
        const Chunk *c = &self->chunks[p];
        Py_ssize_t i = self->row++, vlen;
        const unsigned char *at = row_checked(c, i, &vlen);
        if (at == NULL)
            return -1;
        if (vlen < HEADER_LEN) { /* as refill(): corrupt, whether for this shard or not */
            PyObject *key = PyBytes_FromStringAndSize((const char *)at, KEY_LEN);
            if (key != NULL) {
                short_row_error(vlen, key);
                Py_DECREF(key);
            }
            return -1;
        }
        if (accepts(at + KEY_LEN, ROUTE_LEN, self->wc_byte, self->prefix_len, self->shift,
                    self->want)) {
            if (self->pending_part >= 0) { /* the run's last row: a skip */
                Py_ssize_t q = self->pending_part;
                const Chunk *qc = &self->chunks[q];
                *last_skip = qc->d + qc->o[self->pending_row];
                if (skip_vlen != NULL)
                    *skip_vlen = row_end(qc, self->pending_row) - qc->o[self->pending_row] - KEY_LEN;
                (*skipped)++;
                self->pending_part = -1;
                chunkrows_drop(self, q); /* the view only: the data stays alive */
            }
            head->has = 1;
            head->k = at;
            head->v = at + KEY_LEN;
            head->vlen = vlen;
            return 0;
        }
        if (self->pending_part >= 0) {
            self->dropped++;
            Py_ssize_t q = self->pending_part;
            self->pending_part = p;
            chunkrows_drop(self, q);
        }
        self->pending_part = p;
        self->pending_row = i;
    }
    if (self->pending_part >= 0) { /* the trailing run's last row */
        Py_ssize_t q = self->pending_part;
        const Chunk *qc = &self->chunks[q];
        *last_skip = qc->d + qc->o[self->pending_row];
        if (skip_vlen != NULL)
            *skip_vlen = row_end(qc, self->pending_row) - qc->o[self->pending_row] - KEY_LEN;
        (*skipped)++;
        self->pending_part = -1;
        chunkrows_drop(self, q);
    }
    return 0;
}

/* The store's cursor interface (imq.storage.rocks.Cursor's), so that a cached scan needs
 * no wrapper: `rows` and `items` are the iterator itself; `finish` has nothing to check
 * (the rows were in memory, nothing can end them early); `close` lets the chunks go and
 * keeps `dropped`. */
static PyObject *
chunkrows_self(PyObject *self, void *closure)
{
    Py_INCREF(self);
    return self;
}

static PyObject *
chunkrows_finish(PyObject *self, PyObject *last_key)
{
    Py_RETURN_NONE;
}

static PyObject *
chunkrows_close(ChunkRows *self, PyObject *unused)
{
    if (self->chunks != NULL) {
        for (Py_ssize_t p = 0; p < self->nparts; p++)
            chunk_release(&self->chunks[p]);
    }
    self->nparts = 0;
    self->part = 0;
    self->pending_part = -1;
    self->held = NULL;
    Py_CLEAR(self->datas);
    Py_CLEAR(self->offss);
    Py_RETURN_NONE;
}

static PyObject *
chunkrows_count(PyObject *self, PyObject *args)
{
    PyErr_SetString(PyExc_ValueError, "count needs a seekable cursor");
    return NULL;
}

static PyMethodDef chunkrows_methods[] = {
    {"finish", (PyCFunction)chunkrows_finish, METH_O,
     "finish(last_key): nothing to check, the rows were in memory."},
    {"close", (PyCFunction)chunkrows_close, METH_NOARGS,
     "close(): let the chunks go; the iterator is then exhausted, `dropped` is kept."},
    {"count", (PyCFunction)chunkrows_count, METH_VARARGS,
     "count(lo, hi): not available (raises ValueError), as on an unseekable cursor."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef chunkrows_getset[] = {
    {"rows", chunkrows_self, NULL, "the rows: the iterator itself", NULL},
    {"items", chunkrows_self, NULL, "the rows: the iterator itself", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef chunkrows_members[] = {
    {"dropped", T_PYSSIZET, offsetof(ChunkRows, dropped), READONLY,
     "rows left out so far (of runs of rejected rows, all but the last)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ChunkRowsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "imq._speedups.ChunkRows",
    .tp_basicsize = sizeof(ChunkRows),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ChunkRows(datas, offss, start, stop, reader=None): the rows of consecutive "
              "chunks, lazily, filtered for a reader (see imq.storage.cache).",
    .tp_new = chunkrows_new,
    .tp_dealloc = (destructor)chunkrows_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)chunkrows_next,
    .tp_members = chunkrows_members,
    .tp_methods = chunkrows_methods,
    .tp_getset = chunkrows_getset,
};

/* -1, 0, 1 as bytes a orders before, with, after bytes b. */
static inline int
bytes_cmp(PyObject *a, PyObject *b)
{
    Py_ssize_t la = PyBytes_GET_SIZE(a), lb = PyBytes_GET_SIZE(b);
    int r = memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)(la < lb ? la : lb));
    if (r != 0)
        return r < 0 ? -1 : 1;
    return la < lb ? -1 : (la > lb ? 1 : 0);
}

/* bisect_left over a list of bytes; -1 with an exception if an item is not bytes. */
static Py_ssize_t
bytes_bisect(PyObject *list, PyObject *key)
{
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(list);
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        PyObject *item = PyList_GET_ITEM(list, mid);
        if (!PyBytes_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "a segment's chunk keys must be bytes");
            return -1;
        }
        if (bytes_cmp(item, key) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The first row of chunk (data, offs) whose key is >= key; -1 with an exception. */
static Py_ssize_t
chunk_find(PyObject *data, PyObject *offs, PyObject *key)
{
    Chunk c;
    if (chunk_open(data, offs, &c) < 0)
        return -1;
    Py_ssize_t lo = 0, hi = c.n;
    const unsigned char *k = (const unsigned char *)PyBytes_AS_STRING(key);
    Py_ssize_t klen = PyBytes_GET_SIZE(key);
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (cmp_row_key(&c, mid, k, klen) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    chunk_release(&c);
    return lo;
}

/* Whether `hi` is the bound just past segment `prefix` (its last byte that is not 0xff
 * incremented, the 0xff bytes after it cut): a scan to the segment's end. */
static int
is_prefix_end(const unsigned char *prefix, Py_ssize_t plen, PyObject *hi)
{
    Py_ssize_t n = plen;
    while (n > 0 && prefix[n - 1] == 0xff)
        n--;
    if (n == 0 || PyBytes_GET_SIZE(hi) != n)
        return 0; /* an all-0xff prefix has no such bound */
    const unsigned char *h = (const unsigned char *)PyBytes_AS_STRING(hi);
    return memcmp(h, prefix, (size_t)(n - 1)) == 0 && h[n - 1] == prefix[n - 1] + 1;
}

static PyObject *s_floor, *s_firsts, *s_lasts, *s_datas, *s_offss;

/* One (lo, hi) of cache_scan: a new ChunkRows, Py_None (a new reference) when the cache
 * cannot answer, or NULL with an exception. */
static PyObject *
cache_scan_one(PyObject *segments, Py_ssize_t plen, PyObject *lo, PyObject *hi,
               const ChunkRows *proto)
{
    PyObject *seg = NULL, *floor = NULL, *firsts = NULL, *lasts = NULL, *datas = NULL,
             *offss = NULL, *result = NULL;
    if (PyBytes_GET_SIZE(lo) < plen)
        Py_RETURN_NONE;
    const unsigned char *lp = (const unsigned char *)PyBytes_AS_STRING(lo);
    PyObject *prefix = PyBytes_FromStringAndSize((const char *)lp, plen);
    if (prefix == NULL)
        return NULL;
    seg = PyDict_GetItemWithError(segments, prefix); /* borrowed */
    Py_DECREF(prefix);
    if (seg == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE; /* a segment the cache does not know */
    }
    Py_INCREF(seg);
    floor = PyObject_GetAttr(seg, s_floor);
    if (floor == NULL)
        goto done;
    if (!PyBytes_Check(floor)) {
        PyErr_SetString(PyExc_TypeError, "a segment's floor must be bytes");
        goto done;
    }
    int same_segment = PyBytes_GET_SIZE(hi) >= plen &&
                       memcmp(PyBytes_AS_STRING(hi), lp, (size_t)plen) == 0;
    if (bytes_cmp(lo, floor) <= 0 || !(same_segment || is_prefix_end(lp, plen, hi))) {
        result = Py_None; /* below the floor, or beyond the segment: RocksDB's */
        Py_INCREF(result);
        goto done;
    }
    firsts = PyObject_GetAttr(seg, s_firsts);
    lasts = firsts == NULL ? NULL : PyObject_GetAttr(seg, s_lasts);
    datas = lasts == NULL ? NULL : PyObject_GetAttr(seg, s_datas);
    offss = datas == NULL ? NULL : PyObject_GetAttr(seg, s_offss);
    if (offss == NULL)
        goto done;
    if (!PyList_Check(firsts) || !PyList_Check(lasts) || !PyList_Check(datas) ||
        !PyList_Check(offss) || PyList_GET_SIZE(lasts) != PyList_GET_SIZE(firsts) ||
        PyList_GET_SIZE(datas) != PyList_GET_SIZE(firsts) ||
        PyList_GET_SIZE(offss) != PyList_GET_SIZE(firsts)) {
        PyErr_SetString(PyExc_TypeError, "a segment's chunk lists must be lists in step");
        goto done;
    }
    Py_ssize_t k0 = bytes_bisect(lasts, lo); /* the first chunk not wholly below lo */
    Py_ssize_t k1 = k0 < 0 ? -1 : bytes_bisect(firsts, hi); /* the first wholly at or above hi */
    if (k1 < 0)
        goto done;
    Py_ssize_t start = 0, stop = 0;
    if (k0 >= k1) {
        k0 = k1 = 0;
    } else {
        if (bytes_cmp(PyList_GET_ITEM(firsts, k0), lo) < 0) {
            start = chunk_find(PyList_GET_ITEM(datas, k0), PyList_GET_ITEM(offss, k0), lo);
            if (start < 0)
                goto done;
        }
        PyObject *last_offs = PyList_GET_ITEM(offss, k1 - 1);
        if (bytes_cmp(PyList_GET_ITEM(lasts, k1 - 1), hi) >= 0) {
            stop = chunk_find(PyList_GET_ITEM(datas, k1 - 1), last_offs, hi);
        } else { /* the whole last chunk lies below hi: all its rows, no bisection */
            stop = PyObject_Size(last_offs);
            if (stop >= 0)
                stop /= (Py_ssize_t)sizeof(uint32_t);
        }
        if (stop < 0)
            goto done;
    }
    PyObject *d = PyList_GetSlice(datas, k0, k1);
    if (d == NULL)
        goto done;
    PyObject *o = PyList_GetSlice(offss, k0, k1);
    if (o == NULL) {
        Py_DECREF(d);
        goto done;
    }
    result = chunkrows_make(&ChunkRowsType, d, o, start, stop, proto);
done:
    Py_XDECREF(seg);
    Py_XDECREF(floor);
    Py_XDECREF(firsts);
    Py_XDECREF(lasts);
    Py_XDECREF(datas);
    Py_XDECREF(offss);
    return result;
}

/*
 * cache_scan(segments, prefix_len, bounds, reader) -> list
 *
 * imq.storage.cache.MessageCache.scan for each (lo, hi) of `bounds`, in one call: per
 * range a ChunkRows of the cached rows with lo <= key < hi (filtered for `reader`), or
 * None when the cache cannot tell them all (no known segment, lo at or below its floor,
 * hi beyond it). `segments` maps a segment's prefix to its _Segment (floor, and its
 * chunks' firsts, lasts, datas and offss lists, in step).
 */
static PyObject *
cache_scan(PyObject *self, PyObject *args)
{
    PyObject *segments, *bounds, *reader;
    Py_ssize_t plen;
    if (!PyArg_ParseTuple(args, "O!nO!O:cache_scan", &PyDict_Type, &segments, &plen,
                          &PyList_Type, &bounds, &reader))
        return NULL;
    if (plen < 1 || plen > KEY_LEN) {
        PyErr_SetString(PyExc_ValueError, "prefix_len out of range");
        return NULL;
    }
    ChunkRows proto = {0};
    if (chunkrows_set_reader(&proto, reader) < 0)
        return NULL;
    /* A copy of the list: a segment's attributes may be properties (Python code) that
     * change the caller's list; the copy holds every (lo, hi) pair, and the pairs their
     * bytes, for the whole call. */
    PyObject *pairs = PyList_AsTuple(bounds);
    if (pairs == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(pairs);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(pair, 0)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_TypeError, "bounds must be (lo, hi) pairs of bytes");
            goto fail;
        }
        PyObject *rows = cache_scan_one(segments, plen, PyTuple_GET_ITEM(pair, 0),
                                        PyTuple_GET_ITEM(pair, 1), &proto);
        if (rows == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, rows);
    }
    Py_DECREF(pairs);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(pairs);
    return NULL;
}

/*
 * message_bounds(partition, ranges) -> [(lo, hi)]
 *
 * codec.message_range of each QueueShardRange (its shard, from_key and to_key), hi
 * raised to lo when below it (an empty range): the stored-key bounds of the merge
 * iterator's scans, one per source shard.
 */
static PyObject *s_shard, *s_from_key, *s_to_key;

/* put_queue_key of the attribute `name` of `obj`; 0, or -1 with an exception. */
static int
put_queue_key_attr(unsigned char *out, PyObject *obj, PyObject *name)
{
    PyObject *qk = PyObject_GetAttr(obj, name);
    if (qk == NULL)
        return -1;
    int rc = put_queue_key(out, qk);
    Py_DECREF(qk);
    return rc;
}

/* One range's (lo, hi), a new reference, or NULL with an exception. */
static PyObject *
range_bounds(unsigned int partition, PyObject *r)
{
    unsigned char lo[KEY_LEN], hi[KEY_LEN];
    PyObject *shard = PyObject_GetAttr(r, s_shard);
    if (shard == NULL)
        return NULL;
    if (!PyTuple_Check(shard) || PyTuple_GET_SIZE(shard) != 2) {
        Py_DECREF(shard);
        PyErr_SetString(PyExc_TypeError, "a range's shard must be a ShardIdent");
        return NULL;
    }
    long long wc = PyLong_AsLongLong(PyTuple_GET_ITEM(shard, 0));
    unsigned long long prefix = wc == -1 && PyErr_Occurred()
                                    ? 0
                                    : PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(shard, 1));
    Py_DECREF(shard);
    if (PyErr_Occurred())
        return NULL;
    if (wc < -2147483648LL || wc > 2147483647LL) {
        PyErr_SetString(PyExc_ValueError, "a shard's workchain must be an i32");
        return NULL;
    }
    lo[0] = (unsigned char)(partition >> 8);
    lo[1] = (unsigned char)partition;
    shard_bytes_at(lo + 2, wc, prefix);
    memcpy(hi, lo, QK_AT);
    if (put_queue_key_attr(lo + QK_AT, r, s_from_key) < 0 ||
        put_queue_key_attr(hi + QK_AT, r, s_to_key) < 0)
        return NULL;
    PyObject *lo_b = PyBytes_FromStringAndSize((const char *)lo, KEY_LEN);
    if (lo_b == NULL)
        return NULL;
    PyObject *hi_b = memcmp(hi, lo, KEY_LEN) > 0
                         ? PyBytes_FromStringAndSize((const char *)hi, KEY_LEN)
                         : Py_NewRef(lo_b); /* an empty range ends where it starts */
    return pair_of(lo_b, hi_b);
}

static PyObject *
message_bounds(PyObject *self, PyObject *args)
{
    int partition;
    PyObject *ranges;
    if (!PyArg_ParseTuple(args, "iO:message_bounds", &partition, &ranges))
        return NULL;
    if (partition < 0 || partition > 0xffff) {
        PyErr_SetString(PyExc_ValueError, "a partition must be a u16");
        return NULL;
    }
    /* A tuple (the caller's own, or a copy of its list): reading a range's attributes runs
     * Python code (a property), which could change a list under the loop. */
    PyObject *seq = PySequence_Fast(ranges, "ranges must be a sequence");
    if (seq != NULL && !PyTuple_CheckExact(seq))
        Py_SETREF(seq, PySequence_Tuple(seq));
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = range_bounds((unsigned int)partition, PyTuple_GET_ITEM(seq, i));
        if (pair == NULL) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    Py_DECREF(seq);
    return out;
}

/*
 * Tee(put, segments, prefix_len): a put(key, value, target) for the write path's hot
 * loops (put_rows, encode_diff, the pure-Python encoders) that calls put(key, value,
 * target) and then keeps the row in the chunk of its segment: segments[key[:prefix_len]]
 * is a [data, offs] pair of bytearrays (created on first use) that the row's bytes and
 * its offset are appended to (a memcpy; no objects; see bytearray_add and tee_expect for
 * how their buffers grow). The RocksDB store hands one to a batch that writes message
 * rows, so that once the batch is written its rows can join the store's cache of fresh
 * rows. The previous row's segment is remembered, so a run of rows of one segment costs
 * a prefix comparison and two appends. `unordered` turns 1 when a row's key is not above
 * the previous row of its chunk; `invalid` when a row is not a message row (the store
 * then forgets its cache instead of keeping the batch).
 */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *put;
    PyObject *segments;     /* dict: prefix bytes -> [data, offs] */
    PyObject *data, *offs;  /* the previous row's chunk, or NULL */
    Py_ssize_t prefix_len;
    Py_ssize_t expect_bytes, expect_rows; /* what the caller is about to put (tee_expect) */
    int unordered, invalid;
    char last_prefix[64];
} Tee;

/* Whether this code may reallocate a bytearray's buffer: nothing exported, no offset. */
static inline int
buffer_movable(const PyByteArrayObject *b)
{
    return b->ob_exports == 0 && b->ob_start == b->ob_bytes;
}

/* Give a bytearray a buffer of `alloc` bytes (its bytes and size kept); 0 or -1. */
static int
bytearray_set_alloc(PyByteArrayObject *b, Py_ssize_t alloc)
{
    char *p = PyObject_Realloc(b->ob_bytes, (size_t)alloc);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->ob_bytes = b->ob_start = p;
    b->ob_alloc = alloc;
    return 0;
}

/*
 * Append n bytes to a bytearray; 0 or -1. Its buffer at least doubles when it must grow:
 * PyByteArray_Resize grows it by an eighth, and a realloc that cannot grow in place
 * copies the whole buffer, so a chunk of a few MB built row by row was copied about
 * eight times over (measured: most of what the Tee itself cost, beside the put it
 * calls). tee_expect sizes a diff's chunk ahead; chunk_trim gives the slack back
 * once the chunk is complete. A bytearray that is exported or offset (never one of a
 * Tee's) takes CPython's path.
 */
static inline int
bytearray_add(PyObject *ba, const void *src, Py_ssize_t n)
{
    PyByteArrayObject *b = (PyByteArrayObject *)ba;
    Py_ssize_t old = Py_SIZE(b);
    if (!buffer_movable(b)) {
        if (PyByteArray_Resize(ba, old + n) < 0)
            return -1;
        memcpy(PyByteArray_AS_STRING(ba) + old, src, (size_t)n);
        return 0;
    }
    if (n > PY_SSIZE_T_MAX / 2 - old - 1) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t need = old + n + 1; /* the trailing NUL a bytearray keeps */
    if (need > b->ob_alloc) {
        Py_ssize_t alloc = b->ob_alloc > PY_SSIZE_T_MAX / 2 ? need : 2 * b->ob_alloc;
        if (alloc < need)
            alloc = need;
        if (bytearray_set_alloc(b, alloc) < 0)
            return -1;
    }
    memcpy(b->ob_start + old, src, (size_t)n);
    Py_SET_SIZE(b, old + n);
    b->ob_start[old + n] = '\0';
    return 0;
}

/*
 * chunk_trim(buffer): give back what a bytearray holds beyond its bytes (the slack
 * bytearray_add leaves), so a cached chunk costs its size (glibc shrinks a large
 * buffer in place). Anything else, or an exported or offset bytearray, is left as it is.
 */
static PyObject *
chunk_trim(PyObject *self, PyObject *arg)
{
    if (PyByteArray_CheckExact(arg)) {
        PyByteArrayObject *b = (PyByteArrayObject *)arg;
        Py_ssize_t want = Py_SIZE(b) + 1;
        if (buffer_movable(b) && b->ob_bytes != NULL && b->ob_alloc > want &&
            bytearray_set_alloc(b, want) < 0)
            PyErr_Clear(); /* a failed shrink leaves the buffer as it was */
    }
    Py_RETURN_NONE;
}

/* Make room for n more bytes in a bytearray without changing its size; 0 or -1. */
static int
bytearray_reserve(PyObject *ba, Py_ssize_t n)
{
    PyByteArrayObject *b = (PyByteArrayObject *)ba;
    if (!buffer_movable(b) || n > PY_SSIZE_T_MAX / 2 - Py_SIZE(b) - 1)
        return 0;
    Py_ssize_t need = Py_SIZE(b) + n + 1;
    return need <= b->ob_alloc ? 0 : bytearray_set_alloc(b, need);
}

/*
 * Tell a Tee (put, when it is one) that about `bytes` bytes of rows in `rows` rows come
 * next (0, 0: nothing expected): a chunk it starts from empty meanwhile is allocated at
 * that size at once, so it never grows (a growth copies and touches fresh memory). A
 * diff whose rows go to two partitions reserves the whole diff for each chunk;
 * chunk_trim gives the rest back once the batch is written, and pages never written
 * cost nothing.
 */
static void
tee_expect(PyObject *put, Py_ssize_t bytes, Py_ssize_t rows)
{
    if (Py_IS_TYPE(put, &TeeType)) {
        ((Tee *)put)->expect_bytes = bytes;
        ((Tee *)put)->expect_rows = rows;
    }
}

static PyObject *
tee_vectorcall(PyObject *self_obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Tee *self = (Tee *)self_obj;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Tee takes (key, value, target)");
        return NULL;
    }
    PyObject *key = args[0], *value = args[1];
    PyObject *r = PyObject_Vectorcall(self->put, args, 3, NULL);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    if (self->invalid)
        Py_RETURN_NONE;
    if (!PyBytes_Check(key) || !PyBytes_Check(value) || PyBytes_GET_SIZE(key) != KEY_LEN ||
        PyBytes_GET_SIZE(value) < HEADER_LEN) {
        self->invalid = 1; /* not a message row: the cache must not keep this batch */
        Py_RETURN_NONE;
    }
    const char *kb = PyBytes_AS_STRING(key);
    if (self->data == NULL || memcmp(kb, self->last_prefix, (size_t)self->prefix_len) != 0) {
        PyObject *prefix = PyBytes_FromStringAndSize(kb, self->prefix_len);
        if (prefix == NULL)
            return NULL;
        PyObject *pair = PyDict_GetItemWithError(self->segments, prefix); /* borrowed */
        if (pair == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(prefix);
                return NULL;
            }
            PyObject *d = PyByteArray_FromStringAndSize(NULL, 0);
            PyObject *o = d == NULL ? NULL : PyByteArray_FromStringAndSize(NULL, 0);
            pair = o == NULL ? NULL : PyList_New(2);
            if (pair == NULL) {
                Py_XDECREF(d);
                Py_XDECREF(o);
                Py_DECREF(prefix);
                return NULL;
            }
            PyList_SET_ITEM(pair, 0, d);
            PyList_SET_ITEM(pair, 1, o);
            int failed = PyDict_SetItem(self->segments, prefix, pair);
            Py_DECREF(pair); /* the dict holds it */
            if (failed < 0) {
                Py_DECREF(prefix);
                return NULL;
            }
        }
        Py_DECREF(prefix);
        if (!PyList_Check(pair) || PyList_GET_SIZE(pair) != 2 ||
            !PyByteArray_Check(PyList_GET_ITEM(pair, 0)) ||
            !PyByteArray_Check(PyList_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_TypeError, "Tee's segments must map prefixes to [data, offs]");
            return NULL;
        }
        /* Both taken before either old one goes: a bytearray subclass's __del__ could
         * empty the (borrowed) pair (an audit, under AddressSanitizer). */
        PyObject *data = Py_NewRef(PyList_GET_ITEM(pair, 0));
        PyObject *offs = Py_NewRef(PyList_GET_ITEM(pair, 1));
        Py_XSETREF(self->data, data);
        Py_XSETREF(self->offs, offs);
        memcpy(self->last_prefix, kb, (size_t)self->prefix_len);
        if (self->expect_bytes > 0 && PyByteArray_GET_SIZE(self->data) == 0 &&
            (bytearray_reserve(self->data, self->expect_bytes) < 0 ||
             bytearray_reserve(self->offs, self->expect_rows * (Py_ssize_t)sizeof(uint32_t)) <
                 0))
            return NULL;
    }
    Py_ssize_t at = PyByteArray_GET_SIZE(self->data);
    Py_ssize_t nrows = PyByteArray_GET_SIZE(self->offs) / (Py_ssize_t)sizeof(uint32_t);
    Py_ssize_t vlen = PyBytes_GET_SIZE(value);
    if (at + KEY_LEN + vlen > (Py_ssize_t)UINT32_MAX) {
        self->invalid = 1; /* a chunk over 4 GiB: not kept */
        Py_RETURN_NONE;
    }
    if (nrows > 0 && !self->unordered) {
        uint32_t prev;
        memcpy(&prev, PyByteArray_AS_STRING(self->offs) + (nrows - 1) * sizeof(uint32_t),
               sizeof(uint32_t));
        if ((Py_ssize_t)prev + KEY_LEN > at) { /* a chunk someone else changed: not kept */
            self->invalid = 1;
            Py_RETURN_NONE;
        }
        if (memcmp(PyByteArray_AS_STRING(self->data) + prev, kb, KEY_LEN) >= 0)
            self->unordered = 1;
    }
    if (((PyByteArrayObject *)self->data)->ob_exports > 0 ||
        ((PyByteArrayObject *)self->offs)->ob_exports > 0) { /* fail before changing either */
        PyErr_SetString(PyExc_BufferError, "a chunk the Tee fills is exported: it cannot grow");
        return NULL;
    }
    uint32_t off = (uint32_t)at;
    if (bytearray_add(self->offs, &off, sizeof(off)) < 0 ||
        bytearray_add(self->data, kb, KEY_LEN) < 0 ||
        bytearray_add(self->data, PyBytes_AS_STRING(value), vlen) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
tee_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *put, *segments;
    Py_ssize_t prefix_len;
    static char *kwlist[] = {"put", "segments", "prefix_len", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!n:Tee", kwlist, &put, &PyDict_Type,
                                     &segments, &prefix_len))
        return NULL;
    if (prefix_len < 1 || prefix_len > 64) {
        PyErr_SetString(PyExc_ValueError, "prefix_len must be 1 to 64");
        return NULL;
    }
    Tee *self = (Tee *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = tee_vectorcall;
    Py_INCREF(put);
    self->put = put;
    Py_INCREF(segments);
    self->segments = segments;
    self->data = self->offs = NULL;
    /* A prefix past the key is the whole key (key[:prefix_len], as in _PyTee): every
     * row kept is a message row, KEY_LEN bytes. */
    self->prefix_len = prefix_len < KEY_LEN ? prefix_len : KEY_LEN;
    self->unordered = self->invalid = 0;
    return (PyObject *)self;
}

static int
tee_traverse(Tee *self, visitproc visit, void *arg)
{
    Py_VISIT(self->put);
    Py_VISIT(self->segments);
    Py_VISIT(self->data);
    Py_VISIT(self->offs);
    return 0;
}

static int
tee_clear(Tee *self)
{
    Py_CLEAR(self->put);
    Py_CLEAR(self->segments);
    Py_CLEAR(self->data);
    Py_CLEAR(self->offs);
    return 0;
}

static void
tee_dealloc(Tee *self)
{
    PyObject_GC_UnTrack(self);
    tee_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef tee_members[] = {
    {"unordered", T_INT, offsetof(Tee, unordered), READONLY,
     "1 once a row came at or below the previous row of its chunk"},
    {"invalid", T_INT, offsetof(Tee, invalid), READONLY,
     "1 once a row was not a message row (nothing of the batch may be cached)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject TeeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "imq._speedups.Tee",
    .tp_basicsize = sizeof(Tee),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Tee(put, segments, prefix_len): put(key, value, target), keeping each row "
              "in the [data, offs] chunk of segments[key[:prefix_len]].",
    .tp_new = tee_new,
    .tp_members = tee_members,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Tee, vectorcall),
    .tp_traverse = (traverseproc)tee_traverse,
    .tp_clear = (inquiry)tee_clear,
    .tp_dealloc = (destructor)tee_dealloc,
};

/* -- Guard: the iterator's source of batches, safe to pull from two threads ------------
 *
 * A QueueIterator is an itertools.chain whose source is the merge generator. A pull of a
 * generator another thread is running fails with ValueError ("generator already
 * executing"), on which a chain drops its source and then ends cleanly, for every
 * thread: two threads draining one iterator lost the rest of its range without a word.
 * Guard(gen, busy) pulls gen and hands out `busy` (an iterator that raises) to a pull
 * made while another is under way, so gen is never pulled twice at once and the range
 * goes on. In C, not Python: a Python frame between the chain and the generator is
 * where a signal handler's exception would land outside the generator's handler, and
 * the chain would drop its source on it just the same. */

typedef struct {
    PyObject_HEAD PyObject *gen;
    PyObject *busy;
    int running; /* a pull of gen is under way (in some thread) */
} Guard;

/* Busy is the Guard's own flag, tested and set with the GIL held and no Python code in
 * between, not gen's "already executing" ValueError: creating that exception (in a
 * thread inside an `except` block) can run the cyclic GC and a finalizer, where the first
 * thread could finish its pull; gen then no longer ran, the error was passed on, and the
 * chain ended the range (a review: 17 of 3,600 messages read, no error). */
static PyObject *
guard_next(Guard *self)
{
    PyObject *gen = self->gen;
    if (gen == NULL)
        return NULL;
    if (self->running) {
        Py_INCREF(self->busy);
        return self->busy;
    }
    self->running = 1;
    Py_INCREF(gen);
    PyObject *item = Py_TYPE(gen)->tp_iternext(gen);
    self->running = 0;
    Py_DECREF(gen);
    return item;
}

static PyObject *
guard_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *gen, *busy;
    static char *kwlist[] = {"gen", "busy", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Guard", kwlist, &gen, &busy))
        return NULL;
    if (Py_TYPE(gen)->tp_iternext == NULL || Py_TYPE(busy)->tp_iternext == NULL) {
        PyErr_SetString(PyExc_TypeError, "Guard takes two iterators");
        return NULL;
    }
    Guard *self = (Guard *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(gen);
    self->gen = gen;
    Py_INCREF(busy);
    self->busy = busy;
    return (PyObject *)self;
}

static int
guard_traverse(Guard *self, visitproc visit, void *arg)
{
    Py_VISIT(self->gen);
    Py_VISIT(self->busy);
    return 0;
}

static int
guard_clear(Guard *self)
{
    Py_CLEAR(self->gen);
    Py_CLEAR(self->busy);
    return 0;
}

static void
guard_dealloc(Guard *self)
{
    PyObject_GC_UnTrack(self);
    guard_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject GuardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "imq._speedups.Guard",
    .tp_basicsize = sizeof(Guard),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Guard(gen, busy): an iterator of gen's items that hands out busy to a "
              "pull made while another pull of gen is under way.",
    .tp_new = guard_new,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)guard_next,
    .tp_traverse = (traverseproc)guard_traverse,
    .tp_clear = (inquiry)guard_clear,
    .tp_dealloc = (destructor)guard_dealloc,
};

static PyObject *
init(PyObject *self, PyObject *args)
{
    PyObject *iterated, *message, *queue_key, *address;
    if (!PyArg_ParseTuple(args, "OOOO:init", &iterated, &message, &queue_key, &address))
        return NULL;
    /* Every argument is checked before anything changes: a failed init() leaves the
     * types registered before, their layout flags and their deallocs as they were (a
     * type replaced alone would be built with the flags of the one it replaced). */
    PyObject *given[4] = {iterated, message, queue_key, address};
    for (int i = 0; i < 4; i++) {
        if (!PyType_Check(given[i]) || !tuple_class((PyTypeObject *)given[i])) {
            PyErr_SetString(PyExc_TypeError, "init() takes four classes over tuple");
            return NULL;
        }
    }
    set_value_deallocs(0); /* the types registered before, if any, get their own back */
    memset(dealloc_types, 0, sizeof(dealloc_types));
    PyTypeObject **slots[4] = {&t_iterated, &t_message, &t_queue_key, &t_address};
    PyTypeObject *old[4];
    for (int i = 0; i < 4; i++) {
        old[i] = *slots[i];
        *slots[i] = (PyTypeObject *)Py_NewRef(given[i]);
    }
    plain_iterated = plain_layout(t_iterated);
    plain_message = plain_layout(t_message);
    plain_queue_key = plain_layout(t_queue_key);
    plain_address = plain_layout(t_address);
    PyTypeObject *types[4] = {t_iterated, t_message, t_queue_key, t_address};
    for (int i = 0; i < 4; i++) {
        dealloc_types[i] = types[i]; /* borrowed: t_* hold them */
        generic_deallocs[i] = types[i]->tp_dealloc;
    }
    set_value_deallocs(1);
    for (int i = 0; i < 4; i++) /* last: freeing a class may run Python code */
        Py_XDECREF(old[i]);
    Py_RETURN_NONE;
}

/*
 * Whether `item`, a field of a value, can never lead back to the value: an object the
 * cyclic GC does not handle (an int, bytes, str, float, None, a bool), or a tuple that
 * holds only such objects and is out of the GC for that reason: an exact tuple that
 * CPython untracked (what its own untracking of tuples trusts), or a value of a class
 * over tuple with the plain layout that pack() or value_new() left untracked. Any other
 * container may be untracked now and tracked later (an empty dict is untracked until a
 * container goes in), so a value holding it must stay tracked. ints and bytes, most
 * fields, are settled by the first test; a nested value (a Message's key and
 * addresses) by a few flag and size reads.
 */
static inline int
never_in_cycle(PyObject *item)
{
    if (!PyObject_IS_GC(item))
        return 1;
    if (!PyTuple_Check(item) || PyObject_GC_IsTracked(item))
        return 0;
    PyTypeObject *t = Py_TYPE(item);
    return t == &PyTuple_Type || (plain_layout(t) && tuple_class(t));
}

/*
 * value_new(cls, fields) -> tuple.__new__(cls, fields), left out of the cyclic GC when it
 * can never be part of a reference cycle: `cls` has the plain tuple layout (no __dict__,
 * no weak references: the value types of imq.types) and every field is an atom
 * (never_in_cycle: ints, bytes, and values built so). CPython untracks plain tuples of
 * such fields itself, but only at a collection, and never tuple subclasses: every value
 * a host keeps (a collator keeps the messages it builds until they are committed) would
 * otherwise be walked by every collection of the host's cyclic GC. Any other class over
 * tuple, or a field that is some other container, is built by tuple's tp_new and stays
 * tracked. `cls` must be tuple or a class over tuple (tuple_class): anything else is a
 * TypeError, as tuple.__new__ refuses it.
 */
static PyObject *
value_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "value_new() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *cls = args[0], *fields = args[1];
    if (!PyType_Check(cls) || !PyTuple_CheckExact(fields) ||
        (cls != (PyObject *)&PyTuple_Type && !tuple_class((PyTypeObject *)cls))) {
        PyErr_SetString(PyExc_TypeError,
                        "value_new(cls, fields): tuple or a class over tuple, and a tuple");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    Py_ssize_t n = PyTuple_GET_SIZE(fields);
    int plain = type != &PyTuple_Type && plain_layout(type);
    for (Py_ssize_t i = 0; plain && i < n; i++)
        plain = never_in_cycle(PyTuple_GET_ITEM(fields, i));
    if (!plain) {
        PyObject *call_args = PyTuple_Pack(1, fields);
        if (call_args == NULL)
            return NULL;
        PyObject *obj = PyTuple_Type.tp_new(type, call_args, NULL); /* safe: checked above */
        Py_DECREF(call_args);
        return obj;
    }
    for (Py_ssize_t i = 0; i < n; i++) /* pack steals them */
        Py_INCREF(PyTuple_GET_ITEM(fields, i));
    return pack(type, 1, ((PyTupleObject *)fields)->ob_item, n);
}

/*
 * Compiled constructors of QueueKey and Message (set_constructors), as the classes'
 * vectorcall: `QueueKey(lt, hash)` and `Message(key, src, dst[, body])` with the exact
 * types of the common case (an int in 0..=2^64-1 and 32 bytes; a QueueKey, two
 * Addresses, bytes) build the value here, as value_new would, without the Python __new__
 * (about 150 ns of each constructor's 200). Every other call (keywords, a subclass,
 * another type, a value out of range, a field the cyclic GC tracks) goes through
 * type.__call__ as it would without this: the class's __new__, which checks it and
 * raises what it raises, then __init__. The compiled path only ever takes arguments the
 * Python one accepts, and builds the same value from them.
 *
 * A class's tp_vectorcall is what a call of the class runs when set (CPython's own types
 * use it; it is never inherited, so subclasses keep the usual call); the classes' tp_new
 * stays CPython's, so `tuple.__new__(QueueKey, ...)` (namedtuple's _make and _replace,
 * pickle's older protocols) works as before. The compiled path holds only while the class
 * resolves __new__ and __init__ as it did when installed: a `__new__` or `__init__`
 * assigned later (a mock, a patch) sends every call through type.__call__.
 */
static PyTypeObject *key_installed, *message_installed; /* where they went (owned) */
/* What each class's __new__ and __init__ resolved to then (owned). */
static PyObject *key_new_then, *key_init_then, *message_new_then, *message_init_then;
/* The classes' version tags when last found unchanged: a tag that still matches spares
 * the two lookups (CPython gives a class a new tag whenever it or a base changes). */
static unsigned int key_version, message_version;
static int constructors_on;
static PyObject *s_dunder_new, *s_dunder_init;

/* Whether `type` still resolves __new__ and __init__ to `new_then` and `init_then`. Any
 * change to a class moves its version tag, harmless ones too (copyreg caching
 * __slotnames__ at the first pickle, a first read of __annotations__): the two lookups
 * then decide, and the new tag is kept when they find nothing changed. */
static inline int
unchanged(PyTypeObject *type, unsigned int *version, PyObject *new_then, PyObject *init_then)
{
    if (*version != 0 && type->tp_version_tag == *version &&
        (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG))
        return 1;
    /* _PyType_Lookup: borrowed references, no exception, no Python code (a class's dict
     * has str keys); it gives the class a tag if it has none. */
    if (_PyType_Lookup(type, s_dunder_new) != new_then ||
        _PyType_Lookup(type, s_dunder_init) != init_then)
        return 0;
    *version = (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ? type->tp_version_tag : 0;
    return 1;
}

/* Whether a call on `type` may build a QueueKey here: it is the registered QueueKey the
 * compiled constructor went to, with the plain layout, resolving __new__ and __init__
 * as then. */
static inline int
key_compiled(PyObject *type)
{
    return type == (PyObject *)t_queue_key && type == (PyObject *)key_installed &&
           plain_queue_key && unchanged(t_queue_key, &key_version, key_new_then, key_init_then);
}

/* type(*args, **kwnames) through type.__call__ (the class's __new__, then __init__). */
static PyObject *
generic_call(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    PyObject *positional = PyTuple_New(n);
    if (positional == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(positional, i, Py_NewRef(args[i]));
    PyObject *keywords = NULL;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        keywords = PyDict_New();
        for (Py_ssize_t i = 0; keywords != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
            if (PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0)
                Py_CLEAR(keywords);
        }
        if (keywords == NULL) {
            Py_DECREF(positional);
            return NULL;
        }
    }
    PyObject *obj = Py_TYPE(type)->tp_call(type, positional, keywords);
    Py_DECREF(positional);
    Py_XDECREF(keywords);
    return obj;
}

static PyObject *
key_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (kwnames == NULL && PyVectorcall_NARGS(nargsf) == 2 && key_compiled(type)) {
        PyObject *lt = args[0], *hash = args[1];
        if (PyLong_CheckExact(lt) && PyBytes_CheckExact(hash) &&
            PyBytes_GET_SIZE(hash) == HASH_LEN) {
            (void)PyLong_AsUnsignedLongLong(lt); /* OverflowError: < 0 or >= 2^64 */
            if (!PyErr_Occurred()) {
                PyObject *items[2] = {Py_NewRef(lt), Py_NewRef(hash)};
                return pack(t_queue_key, 1, items, 2);
            }
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                return NULL;
            PyErr_Clear(); /* out of range: the Python __new__ says so */
        }
    }
    return generic_call(type, args, nargsf, kwnames);
}

static PyObject *
message_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (type == (PyObject *)t_message && type == (PyObject *)message_installed &&
        t_queue_key == key_installed && plain_message && kwnames == NULL &&
        (n == 3 || n == 4) &&
        unchanged(t_message, &message_version, message_new_then, message_init_then)) {
        PyObject *key = args[0], *src = args[1], *dst = args[2];
        PyObject *body = n == 4 ? args[3] : NULL;
        if (Py_IS_TYPE(key, t_queue_key) && Py_IS_TYPE(src, t_address) &&
            Py_IS_TYPE(dst, t_address) && (body == NULL || PyBytes_CheckExact(body)) &&
            never_in_cycle(key) && never_in_cycle(src) && never_in_cycle(dst)) {
            PyObject *b = body != NULL ? Py_NewRef(body) : PyBytes_FromStringAndSize(NULL, 0);
            if (b == NULL)
                return NULL;
            PyObject *items[4] = {Py_NewRef(key), Py_NewRef(src), Py_NewRef(dst), b};
            return pack(t_message, 1, items, 4);
        }
    }
    return generic_call(type, args, nargsf, kwnames);
}

/*
 * key_from_bytes(cls, data) -> QueueKey: QueueKey.from_bytes (a classmethod over this
 * function). The key whose 40-byte form (lt, 8 bytes big-endian, then hash) is `data`
 * is built here when `cls` is the registered QueueKey, the compiled QueueKey constructor
 * would build `QueueKey(lt, hash)` (on, the class unchanged) and `data` is exactly 40
 * bytes; every other call is `cls._from_bytes(...)` with the same arguments, the Python
 * path (its checks, its errors, a subclass's or a patched class's own constructor).
 */
static PyObject *s_from_bytes_py;

static PyObject *
key_from_bytes(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "key_from_bytes(cls, data): no class");
        return NULL;
    }
    PyObject *cls = args[0];
    if (n == 2 && kwnames == NULL && constructors_on && PyBytes_CheckExact(args[1]) &&
        PyBytes_GET_SIZE(args[1]) == LT_LEN + HASH_LEN && key_compiled(cls))
        return key_at((const unsigned char *)PyBytes_AS_STRING(args[1]));
    PyObject *python = PyObject_GetAttr(cls, s_from_bytes_py);
    if (python == NULL)
        return NULL;
    PyObject *result = PyObject_Vectorcall(python, args + 1, n - 1, kwnames);
    Py_DECREF(python);
    return result;
}

/* Install (on) or take back (off) the compiled constructors on the classes
 * set_constructors() was given. */
static void
switch_constructors(int on)
{
    constructors_on = on;
    if (key_installed != NULL)
        key_installed->tp_vectorcall = on ? key_vectorcall : NULL;
    if (message_installed != NULL)
        message_installed->tp_vectorcall = on ? message_vectorcall : NULL;
}

/*
 * set_constructors(): give the QueueKey and Message registered with init() the compiled
 * constructors above, for as long as they resolve __new__ and __init__ as now. The
 * classes must be those init() registered, over tuple with the plain layout, without a
 * vectorcall of their own.
 */
static PyObject *
set_constructors(PyObject *self, PyObject *unused)
{
    switch_constructors(0); /* classes given before lose theirs */
    if (t_queue_key == NULL || t_message == NULL || !plain_queue_key || !plain_message ||
        t_queue_key == t_message || t_queue_key->tp_vectorcall != NULL ||
        t_message->tp_vectorcall != NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "set_constructors(): init() must first register a QueueKey and a "
                        "Message with the plain tuple layout");
        return NULL;
    }
    PyObject *found[4] = {
        _PyType_Lookup(t_queue_key, s_dunder_new), _PyType_Lookup(t_queue_key, s_dunder_init),
        _PyType_Lookup(t_message, s_dunder_new), _PyType_Lookup(t_message, s_dunder_init)};
    for (int i = 0; i < 4; i++) {
        if (found[i] == NULL) {
            PyErr_SetString(PyExc_TypeError, "set_constructors(): no __new__ or __init__");
            return NULL;
        }
    }
    PyObject *old[6] = {(PyObject *)key_installed, (PyObject *)message_installed, key_new_then,
                        key_init_then, message_new_then, message_init_then};
    key_new_then = Py_NewRef(found[0]);
    key_init_then = Py_NewRef(found[1]);
    message_new_then = Py_NewRef(found[2]);
    message_init_then = Py_NewRef(found[3]);
    key_installed = (PyTypeObject *)Py_NewRef((PyObject *)t_queue_key);
    message_installed = (PyTypeObject *)Py_NewRef((PyObject *)t_message);
    key_version = message_version = 0; /* the first call looks up and keeps the tags */
    switch_constructors(1);
    for (int i = 0; i < 6; i++) /* last: freeing them may run Python code */
        Py_XDECREF(old[i]);
    Py_RETURN_NONE;
}

/* value_constructors(on) -> bool: the compiled constructors on or off (off: as on a
 * machine without this module, imq.iterator.pure_python()); returns the previous one. */
static PyObject *
value_constructors(PyObject *self, PyObject *on)
{
    return switch_setting(on, constructors_on, switch_constructors);
}

static PyMethodDef methods[] = {
    {"set_constructors", set_constructors, METH_NOARGS,
     "set_constructors(): compiled QueueKey and Message constructors on the registered classes"},
    {"value_constructors", value_constructors, METH_O,
     "value_constructors(on): the compiled constructors on or off; returns the previous"},
    {"key_from_bytes", (PyCFunction)(void (*)(void))key_from_bytes,
     METH_FASTCALL | METH_KEYWORDS,
     "key_from_bytes(cls, data): QueueKey.from_bytes, as a classmethod: the key whose "
     "to_bytes() is data (40 bytes), built in C where cls._from_bytes(data) would build "
     "it by QueueKey(lt, hash); anything else goes to cls._from_bytes"},
    {"value_deallocs", value_deallocs, METH_O,
     "value_deallocs(on): free the value types' instances through imq's dealloc (on) or "
     "CPython's own"},
    {"init", init, METH_VARARGS,
     "init(IteratedMessage, Message, QueueKey, Address): register the value types."},
    {"decode_run", decode_run, METH_VARARGS,
     "decode_run(keys, values, shard) -> list[IteratedMessage]"},
    {"merge_fill", (PyCFunction)(void (*)(void))merge_fill, METH_FASTCALL,
     "merge_fill(sources, heads, lastkeys, need, limit, wc_byte, prefix_len, want, shards,"
     " positions) -> (batch, final, records, ended, need_out, skipped)"},
    {"put_rows", put_rows, METH_VARARGS,
     "put_rows(put, target, shard_bytes, messages, partition_for, counts) -> rows"},
    {"stat_value", stat_value, METH_O, "stat_value(counts: dict[Address, int]) -> bytes"},
    {"diff_record", diff_record, METH_VARARGS,
     "diff_record(version, min_message, max_message, shards_messages_count, diff_hash, "
     "processed_to, router_src, router_dst, seqno, prev_hash, partitions) -> bytes"},
    {"encode_diff", encode_diff, METH_VARARGS,
     "encode_diff(put, target, shard_bytes, messages, partition_for)"
     " -> (rows, [(partition, messages, stat_value)], [(workchain, messages)])"},
    {"sources_in_shard", sources_in_shard, METH_VARARGS,
     "sources_in_shard(messages, workchain, prefix, prefix_len) -> bool"},
    {"chunk_check", chunk_check, METH_VARARGS,
     "chunk_check(data, offs) -> (rows, value_bytes, ascending)"},
    {"chunk_bisect", chunk_bisect, METH_VARARGS, "chunk_bisect(data, offs, key) -> int"},
    {"chunk_trim", chunk_trim, METH_O,
     "chunk_trim(buffer): a bytearray's slack given back (what Tee's appends leave)"},
    {"chunk_cut", chunk_cut, METH_VARARGS,
     "chunk_cut(data, offs, i, j) -> (data, offs): the chunk without its rows [i, j)"},
    {"chunk_pack", chunk_pack, METH_O, "chunk_pack(rows) -> (data, offs): a chunk of rows"},
    {"cache_scan", cache_scan, METH_VARARGS,
     "cache_scan(segments, prefix_len, bounds, reader) -> list[ChunkRows | None]"},
    {"message_bounds", message_bounds, METH_VARARGS,
     "message_bounds(partition, ranges) -> [(lo, hi)]: the merge iterator's scan bounds"},
    {"value_new", (PyCFunction)(void (*)(void))value_new, METH_FASTCALL,
     "value_new(cls, fields) -> tuple.__new__(cls, fields), untracked by the cyclic GC when"
     " it can never be in a reference cycle"},
    {"strictly_ascending", strictly_ascending, METH_VARARGS,
     "strictly_ascending(messages, message_type) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "imq._speedups",
    "Compiled per-message decode of the merge iterator (optional).", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&TeeType) < 0 || PyType_Ready(&ChunkRowsType) < 0 ||
        PyType_Ready(&GuardType) < 0 || find_class_new() < 0)
        return NULL;
    if ((s_shard = PyUnicode_InternFromString("shard")) == NULL ||
        (s_from_key = PyUnicode_InternFromString("from_key")) == NULL ||
        (s_to_key = PyUnicode_InternFromString("to_key")) == NULL ||
        (s_floor = PyUnicode_InternFromString("floor")) == NULL ||
        (s_firsts = PyUnicode_InternFromString("firsts")) == NULL ||
        (s_lasts = PyUnicode_InternFromString("lasts")) == NULL ||
        (s_datas = PyUnicode_InternFromString("datas")) == NULL ||
        (s_offss = PyUnicode_InternFromString("offss")) == NULL ||
        (s_dunder_new = PyUnicode_InternFromString("__new__")) == NULL ||
        (s_dunder_init = PyUnicode_InternFromString("__init__")) == NULL ||
        (s_from_bytes_py = PyUnicode_InternFromString("_from_bytes")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddType(m, &TeeType) < 0 || PyModule_AddType(m, &ChunkRowsType) < 0 ||
        PyModule_AddType(m, &GuardType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
