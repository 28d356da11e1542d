/* The Python types of the native leg's thread: `Relay` (the thread) and `Stream` (one stream
 * handed to it). native.py is their one user.
 *
 * Invariants:
 * - A `Stream` holds no Python object, so it cannot be part of a reference cycle. From
 *   `Relay.start` until `finished()` returns it, the relay's lists own a reference
 *   to it: the memory the thread works on cannot be freed under it.
 * - `pw_relay` memory is reference counted in C (relay.h) by the `Relay` object and each
 *   started stream (whose `poll` and `clocks` take its lock), so either may outlive the other.
 * - What the thread still may write is read under its lock; a stream's buffers are read only
 *   once it was handed back (`ending` set), when the thread no longer touches them.
 */
#define PY_SSIZE_T_CLEAN
#include "relay_py.h"
#ifdef __linux__

#include <stddef.h>
#include <time.h>

#include "relay.h"

typedef struct {
    PyObject_HEAD
    pw_stream s;
    pw_relay *relay; /* a reference, once started */
} StreamObject;

typedef struct {
    PyObject_HEAD
    pw_relay *relay; /* a reference */
} RelayObject;

#define STREAM_OF(p) ((StreamObject *)((char *)(p) - offsetof(StreamObject, s)))

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* -- Stream ---------------------------------------------------------------------------------- */

static void Stream_dealloc(StreamObject *so) {
    free(so->s.in);
    pw_buf_free(&so->s.out);
    pw_log_free(&so->s.log);
    if (so->relay != NULL) pw_relay_release(so->relay);
    Py_TYPE(so)->tp_free((PyObject *)so);
}

static int ending_of(StreamObject *so) {
    if (so->relay == NULL) return PW_END_NONE;
    pw_relay_lock(so->relay);
    int ending = so->s.ending;
    pw_relay_unlock(so->relay);
    return ending;
}

/* poll() -> (events since the last poll as int64 triples' bytes, last read, blocked since). */
static PyObject *Stream_poll(StreamObject *so, PyObject *Py_UNUSED(ignored)) {
    if (so->relay == NULL) return Py_BuildValue("(y#LL)", "", (Py_ssize_t)0, 0LL, 0LL);
    pw_stream *s = &so->s;
    pw_relay_lock(so->relay); /* held briefly by the thread, which never needs the GIL */
    PyObject *events = PyBytes_FromStringAndSize(s->log.v ? (const char *)s->log.v : "",
                                                 (Py_ssize_t)(s->log.len * sizeof(int64_t)));
    if (events != NULL) {
        for (size_t i = 1; s->awaiting_first && i < s->log.len; i += 3)
            if (s->log.v[i] > 0) s->awaiting_first = 0; /* a first token, to be replayed */
        s->log.len = 0;
        s->polled_ns = monotonic_ns();
    }
    int64_t last = s->last_read_ns, blocked = s->blocked_since_ns;
    pw_relay_unlock(so->relay);
    if (events == NULL) return NULL;
    return Py_BuildValue("(NLL)", events, (long long)last, (long long)blocked);
}

/* clocks() -> (last read, blocked since), leaving the events where they are. */
static PyObject *Stream_clocks(StreamObject *so, PyObject *Py_UNUSED(ignored)) {
    int64_t last = 0, blocked = 0;
    if (so->relay != NULL) {
        pw_relay_lock(so->relay);
        last = so->s.last_read_ns;
        blocked = so->s.blocked_since_ns;
        pw_relay_unlock(so->relay);
    }
    return Py_BuildValue("(LL)", (long long)last, (long long)blocked);
}

static PyObject *Stream_stop(StreamObject *so, PyObject *Py_UNUSED(ignored)) {
    if (so->relay != NULL) pw_relay_stop(so->relay, &so->s);
    Py_RETURN_NONE;
}

static PyObject *Stream_get_ending(StreamObject *so, void *Py_UNUSED(c)) {
    return PyLong_FromLong(ending_of(so));
}

/* The upstream's bytes the thread read and did not take, from a chunk's first byte. */
static PyObject *Stream_get_leftover(StreamObject *so, void *Py_UNUSED(c)) {
    if (ending_of(so) == PW_END_NONE) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(so->s.in ? so->s.in : "", (Py_ssize_t)so->s.in_len);
}

/* Framed output the client's socket has not taken. */
static PyObject *Stream_get_unsent(StreamObject *so, void *Py_UNUSED(c)) {
    int ending = ending_of(so);
    if (ending == PW_END_NONE || ending == PW_END_CLIENT_ERROR || so->s.out.data == NULL)
        return PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize(so->s.out.data + so->s.out.off,
                                     (Py_ssize_t)(so->s.out.len - so->s.out.off));
}

#define AFTER_HAND_BACK(name, expr)                                                             \
    static PyObject *Stream_get_##name(StreamObject *so, void *Py_UNUSED(c)) {                \
        if (ending_of(so) == PW_END_NONE) return PyLong_FromLong(0);                          \
        return PyLong_FromLongLong((long long)(expr));                                        \
    }
AFTER_HAND_BACK(errno, so->s.err)
AFTER_HAND_BACK(leftover_ns, so->s.leftover_ns)
AFTER_HAND_BACK(held, so->s.scan.held)
AFTER_HAND_BACK(held_ns, so->s.scan.held_ns)
AFTER_HAND_BACK(end_written, so->s.end_written)
#undef AFTER_HAND_BACK

static PyObject *Stream_get_done_ns(StreamObject *so, void *Py_UNUSED(c)) {
    int64_t done = 0;
    if (so->relay != NULL) {
        pw_relay_lock(so->relay);
        done = so->s.done_ns;
        pw_relay_unlock(so->relay);
    }
    return PyLong_FromLongLong((long long)done);
}

static PyMethodDef Stream_methods[] = {
    {"poll", (PyCFunction)Stream_poll, METH_NOARGS, NULL},
    {"clocks", (PyCFunction)Stream_clocks, METH_NOARGS, NULL},
    {"stop", (PyCFunction)Stream_stop, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef Stream_getset[] = {
    {"ending", (getter)Stream_get_ending, NULL, "why it came back (0: it has not)", NULL},
    {"errno", (getter)Stream_get_errno, NULL, "errno of a broken socket or a fault", NULL},
    {"leftover", (getter)Stream_get_leftover, NULL, "the upstream's bytes not taken", NULL},
    {"leftover_ns", (getter)Stream_get_leftover_ns, NULL, "the read time of the leftover",
     NULL},
    {"held", (getter)Stream_get_held, NULL, "leftover bytes held as a terminal chunk", NULL},
    {"held_ns", (getter)Stream_get_held_ns, NULL, "the read time of the held chunk", NULL},
    {"unsent", (getter)Stream_get_unsent, NULL, "output the client has not taken", NULL},
    {"end_written", (getter)Stream_get_end_written, NULL,
     "(ENDED) the response's end went out with the rest but for `unsent`", NULL},
    {"done_ns", (getter)Stream_get_done_ns, NULL, "the read time of [DONE] (0: not yet)", NULL},
    {NULL},
};

PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phasewatch.proxy._native.Stream",
    .tp_basicsize = sizeof(StreamObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Stream_dealloc,
    .tp_methods = Stream_methods,
    .tp_getset = Stream_getset,
};

/* -- Relay ----------------------------------------------------------------------------------- */

static PyObject *Relay_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    /* Relay(): no arguments. */
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "", names)) return NULL;
    RelayObject *ro = (RelayObject *)type->tp_alloc(type, 0);
    if (ro == NULL) return NULL;
    int err = 0;
    ro->relay = pw_relay_new(&err);
    if (ro->relay == NULL) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(ro);
        return NULL;
    }
    return (PyObject *)ro;
}

/* The streams handed back, oldest first, and the notification read; without the
 * memory for the list they go back to the relay's list, never lost. */
static PyObject *take_done(RelayObject *ro) {
    pw_stream *first = pw_relay_take_done(ro->relay, 1);
    Py_ssize_t n = 0;
    for (pw_stream *s = first; s != NULL; s = s->next) n++;
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        pw_relay_requeue(ro->relay, first); /* taken again by the next call */
        return NULL;
    }
    for (Py_ssize_t i = 0; first != NULL; i++) {
        pw_stream *s = first;
        first = s->next;
        s->next = NULL;
        PyList_SET_ITEM(list, i, (PyObject *)STREAM_OF(s)); /* the lists' reference */
    }
    return list;
}

static void Relay_dealloc(RelayObject *ro) {
    if (ro->relay != NULL) {
        Py_BEGIN_ALLOW_THREADS
        pw_relay_close(ro->relay);
        Py_END_ALLOW_THREADS
        pw_stream *s = pw_relay_take_done(ro->relay, 0);
        while (s != NULL) {
            pw_stream *next = s->next;
            s->next = NULL;
            Py_DECREF(STREAM_OF(s));
            s = next;
        }
        pw_relay_release(ro->relay);
    }
    Py_TYPE(ro)->tp_free((PyObject *)ro);
}

/* start(upstream_fd, client_fd, strip, hold, pending=False) -> Stream: the thread takes the
 * stream from a chunk boundary of its body; `pending`: no token yet (only the first token's
 * chunk or the role chunk are taken before it). OSError when the thread cannot take it. */
static PyObject *Relay_start(RelayObject *ro, PyObject *args, PyObject *kw) {
    static char *names[] = {"upstream_fd", "client_fd", "strip", "hold", "pending", NULL};
    int up, client, strip, hold, pending = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iipp|p", names, &up, &client, &strip, &hold,
                                     &pending))
        return NULL;
    StreamObject *so = PyObject_New(StreamObject, &StreamType);
    if (so == NULL) return NULL;
    memset(&so->s, 0, sizeof so->s);
    so->relay = NULL;
    so->s.up = so->s.client = -1;
    so->s.scan.strip = strip;
    so->s.scan.hold = hold;
    so->s.scan.pending = pending;
    so->s.scan.last_completion = -1;
    Py_INCREF(so); /* the relay's lists' reference, if the thread takes it */
    if (pw_relay_start(ro->relay, &so->s, up, client) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(so);
        Py_DECREF(so);
        return NULL;
    }
    pw_relay_hold(ro->relay);
    so->relay = ro->relay;
    return (PyObject *)so;
}

static PyObject *Relay_finished(RelayObject *ro, PyObject *Py_UNUSED(ignored)) {
    return take_done(ro);
}

typedef struct {
    PyObject *list;
    int64_t replay_before, idle_before, stall_before;
} Due;

static void due_one(pw_stream *s, void *ctx) {
    Due *due = ctx;
    if (due->list == NULL) return;
    if (s->polled_ns <= due->replay_before || s->awaiting_first
        || s->last_read_ns < due->idle_before
        || (s->blocked_since_ns && s->blocked_since_ns < due->stall_before)) {
        if (PyList_Append(due->list, (PyObject *)STREAM_OF(s)) < 0) Py_CLEAR(due->list);
    }
}

/* due(replay_before, idle_before, stall_before) -> the held streams a pass of the live
 * registry must look at: not polled since `replay_before`, taken before their first token
 * with no poll that saw it, silent since `idle_before`, or whose client has not taken what
 * was written since `stall_before`. One walk under the lock. */
static PyObject *Relay_due(RelayObject *ro, PyObject *args) {
    long long replay_before, idle_before, stall_before;
    if (!PyArg_ParseTuple(args, "LLL", &replay_before, &idle_before, &stall_before))
        return NULL;
    Due due = {PyList_New(0), replay_before, idle_before, stall_before};
    if (due.list == NULL) return NULL;
    pw_relay_each_held(ro->relay, due_one, &due);
    return due.list; /* NULL with MemoryError set when an append failed */
}

static PyObject *Relay_fileno(RelayObject *ro, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(pw_relay_notify_fd(ro->relay));
}

/* close(): the thread stops; every stream it held comes back (`finished()`). */
static PyObject *Relay_close(RelayObject *ro, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    pw_relay_close(ro->relay);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Relay_fault(RelayObject *ro, PyObject *Py_UNUSED(ignored)) {
    pw_relay_inject_fault(ro->relay);
    Py_RETURN_NONE;
}

static PyObject *Relay_get_failed(RelayObject *ro, void *Py_UNUSED(c)) {
    return PyLong_FromLong(pw_relay_failed(ro->relay));
}

static PyMethodDef Relay_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Relay_start, METH_VARARGS | METH_KEYWORDS, NULL},
    {"finished", (PyCFunction)Relay_finished, METH_NOARGS, NULL},
    {"due", (PyCFunction)Relay_due, METH_VARARGS, NULL},
    {"fileno", (PyCFunction)Relay_fileno, METH_NOARGS, NULL},
    {"close", (PyCFunction)Relay_close, METH_NOARGS, NULL},
    {"fault", (PyCFunction)Relay_fault, METH_NOARGS,
     "For the tests: the thread fails on its next turn as if epoll_wait had."},
    {NULL},
};

static PyGetSetDef Relay_getset[] = {
    {"failed", (getter)Relay_get_failed, NULL, "the thread's errno if it failed, else 0", NULL},
    {NULL},
};

PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phasewatch.proxy._native.Relay",
    .tp_basicsize = sizeof(RelayObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Relay_new,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_methods = Relay_methods,
    .tp_getset = Relay_getset,
};

#endif /* __linux__ */
