/* phasewatch.proxy._native: the module, and the bindings of the pure parts (scan.c, itl.c);
 * the thread's types are in relay_py.c.
 *
 * Invariants: only this file and relay_py.c touch Python objects, always with the GIL held;
 * module init checks every call it makes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "itl.h"
#include "relay_py.h"
#include "scan.h"

/* -- the ITL arithmetic --------------------------------------------------------------------- */

/* replay_exact(events, seen, last, largest, total, bounds, exemplars): `pw_itl_replay` over
 * int64 triples; returns (gaps as doubles' bytes, tokens per event as int64s' bytes or None
 * when each carried one, [(bucket, count)] or None, sum, [(bucket, gap)], seen, last, total,
 * largest). */
static PyObject *replay_exact(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer ev, bd;
    long long seen, last;
    double largest, total;
    int exemplars;
    if (!PyArg_ParseTuple(args, "y*LLddy*p", &ev, &seen, &last, &largest, &total, &bd,
                          &exemplars))
        return NULL;
    PyObject *gaps_of = NULL, *tokens_of = NULL, *marked = NULL, *counts = NULL, *result = NULL;
    int64_t *tally = NULL, *tokens = NULL;
    double *mark = NULL, *gaps = NULL;
    if (ev.len % 24 != 0 || bd.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "events are int64 triples and bounds doubles");
        goto done;
    }
    size_t n = (size_t)ev.len / 24, nb = (size_t)bd.len / 8;
    tally = malloc((nb ? nb : 1) * sizeof *tally);
    mark = malloc((nb ? nb : 1) * sizeof *mark);
    gaps = malloc((n ? n : 1) * sizeof *gaps);
    tokens = malloc((n ? n : 1) * sizeof *tokens);
    if (tally == NULL || mark == NULL || gaps == NULL || tokens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    pw_itl st = {.seen = seen, .last = last, .largest = largest, .total = total};
    double sum;
    size_t kept = pw_itl_replay(&st, ev.buf, n, bd.buf, nb, exemplars, gaps, tokens, tally,
                                mark, &sum);
    int several = 0;
    int64_t observed = 0;
    for (size_t i = 0; i < kept; i++) several |= tokens[i] > 1;
    for (size_t i = 0; i < nb; i++) observed += tally[i];
    gaps_of = PyBytes_FromStringAndSize((const char *)gaps, (Py_ssize_t)(kept * sizeof *gaps));
    tokens_of = several ? PyBytes_FromStringAndSize((const char *)tokens,
                                                    (Py_ssize_t)(kept * sizeof *tokens))
                        : Py_NewRef(Py_None);
    marked = PyList_New(0);
    if (gaps_of == NULL || tokens_of == NULL || marked == NULL) goto done;
    if (observed > 0) {
        counts = PyList_New(0);
        if (counts == NULL) goto done;
        for (size_t i = 0; i < nb; i++) {
            PyObject *pair = NULL;
            if (tally[i] > 0) {
                pair = Py_BuildValue("(nL)", (Py_ssize_t)i, (long long)tally[i]);
                if (pair == NULL || PyList_Append(counts, pair) < 0) goto pair_failed;
                Py_CLEAR(pair);
            }
            if (!isnan(mark[i])) {
                pair = Py_BuildValue("(nd)", (Py_ssize_t)i, mark[i]);
                if (pair == NULL || PyList_Append(marked, pair) < 0) goto pair_failed;
                Py_CLEAR(pair);
            }
            continue;
        pair_failed:
            Py_XDECREF(pair);
            goto done;
        }
    } else {
        counts = Py_NewRef(Py_None);
        sum = 0.0;
    }
    result = Py_BuildValue("(OOOdOLLdd)", gaps_of, tokens_of, counts, sum, marked,
                           (long long)st.seen, (long long)st.last, st.total, st.largest);
done:
    Py_XDECREF(gaps_of);
    Py_XDECREF(tokens_of);
    Py_XDECREF(marked);
    Py_XDECREF(counts);
    free(tally);
    free(mark);
    free(gaps);
    free(tokens);
    PyBuffer_Release(&ev);
    PyBuffer_Release(&bd);
    return result;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* nearest_ranks(values, q1, q2): the nearest-rank q1 and q2 percentiles of a writable buffer
 * of doubles (an array('d')), which is left sorted; (None, None) when it is empty. What
 * `percentile(sorted(values), q)` gives (app/phasewatch/core/quantiles.py), with no float object per
 * value (gap_summary.py). */
static PyObject *nearest_ranks(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer vb;
    double q1, q2;
    if (!PyArg_ParseTuple(args, "w*dd", &vb, &q1, &q2)) return NULL;
    if (vb.len % 8 != 0) {
        PyBuffer_Release(&vb);
        PyErr_SetString(PyExc_ValueError, "values are doubles");
        return NULL;
    }
    Py_ssize_t n = vb.len / 8;
    double *v = vb.buf;
    PyObject *result;
    if (n == 0) {
        result = Py_BuildValue("(OO)", Py_None, Py_None);
    } else {
        qsort(v, (size_t)n, sizeof *v, compare_doubles);
        Py_ssize_t r1 = (Py_ssize_t)ceil(q1 * (double)n) - 1;
        Py_ssize_t r2 = (Py_ssize_t)ceil(q2 * (double)n) - 1;
        r1 = r1 < 0 ? 0 : (r1 >= n ? n - 1 : r1);
        r2 = r2 < 0 ? 0 : (r2 >= n ? n - 1 : r2);
        result = Py_BuildValue("(dd)", v[r1], v[r2]);
    }
    PyBuffer_Release(&vb);
    return result;
}

/* -- reading events ------------------------------------------------------------------------- */

/* token_event(event) -> (completion, prompt or None, cut_from, cut_to) when the event (one
 * whole `data: ...\n\n`) is plainly a running token chunk, else None (`pw_token_event`). */
static PyObject *token_event(PyObject *Py_UNUSED(m), PyObject *arg) {
    char *d;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(arg, &d, &n) < 0) return NULL;
    int64_t completion, prompt;
    size_t cut_from, cut_to;
    if (!pw_token_event(d, (size_t)n, &completion, &prompt, &cut_from, &cut_to))
        Py_RETURN_NONE;
    if (prompt < 0)
        return Py_BuildValue("(LOnn)", (long long)completion, Py_None, (Py_ssize_t)cut_from,
                             (Py_ssize_t)cut_to);
    return Py_BuildValue("(LLnn)", (long long)completion, (long long)prompt,
                         (Py_ssize_t)cut_from, (Py_ssize_t)cut_to);
}

/* Scanner(strip, hold, pending): `pw_take` with its state, for the tests that hold the native
 * leg's reading to the Python path's, byte for byte. */
typedef struct {
    PyObject_HEAD
    pw_scan scan;
} ScannerObject;

static int Scanner_init(ScannerObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"strip", "hold", "pending", NULL};
    int strip, hold, pending = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "pp|p", names, &strip, &hold, &pending))
        return -1;
    memset(&self->scan, 0, sizeof self->scan);
    self->scan.strip = strip;
    self->scan.hold = hold;
    self->scan.pending = pending;
    self->scan.last_completion = -1;
    return 0;
}

/* take(data, now) -> (verdict, consumed, output, events as int64 triples' bytes). */
static PyObject *Scanner_take(ScannerObject *self, PyObject *args) {
    Py_buffer in;
    long long now;
    if (!PyArg_ParseTuple(args, "y*L", &in, &now)) return NULL;
    pw_buf out = {0};
    pw_log log = {0};
    size_t used = 0;
    int verdict = pw_take(&self->scan, in.buf, (size_t)in.len, now, &out, &log, &used);
    PyObject *result = Py_BuildValue("(iny#y#)", verdict, (Py_ssize_t)used,
                                     out.data ? out.data : "", (Py_ssize_t)out.len,
                                     log.v ? (const char *)log.v : "",
                                     (Py_ssize_t)(log.len * sizeof(int64_t)));
    pw_buf_free(&out);
    pw_log_free(&log);
    PyBuffer_Release(&in);
    return result;
}

static PyObject *Scanner_get_held(ScannerObject *self, void *Py_UNUSED(c)) {
    return Py_BuildValue("(nL)", (Py_ssize_t)self->scan.held, (long long)self->scan.held_ns);
}

static PyObject *Scanner_get_done_ns(ScannerObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromLongLong((long long)self->scan.done_ns);
}

static PyMethodDef Scanner_methods[] = {
    {"take", (PyCFunction)Scanner_take, METH_VARARGS, NULL},
    {NULL},
};

static PyGetSetDef Scanner_getset[] = {
    {"held", (getter)Scanner_get_held, NULL, "(bytes held at the front, their read time)", NULL},
    {"done_ns", (getter)Scanner_get_done_ns, NULL, "the read time of [DONE] (0: not yet)", NULL},
    {NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phasewatch.proxy._native.Scanner",
    .tp_basicsize = sizeof(ScannerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_methods = Scanner_methods,
    .tp_getset = Scanner_getset,
};


static PyMethodDef module_methods[] = {
    {"replay_exact", replay_exact, METH_VARARGS, NULL},
    {"nearest_ranks", nearest_ranks, METH_VARARGS, NULL},
    {"token_event", token_event, METH_O, NULL},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The native leg of the relay: its readers of stream bytes, its thread, the ITL "
    "arithmetic (see app/phasewatch/proxy/native.py).",
    -1, module_methods,
};

static int add_type(PyObject *m, PyTypeObject *type, const char *name) {
    if (PyType_Ready(type) < 0) return -1;
    return PyModule_AddObjectRef(m, name, (PyObject *)type);
}

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (add_type(m, &ScannerType, "Scanner") < 0
        || PyModule_AddIntConstant(m, "TAKE_ON", PW_TAKE_ON) < 0
        || PyModule_AddIntConstant(m, "TAKE_BACK", PW_TAKE_BACK) < 0
        || PyModule_AddIntConstant(m, "TAKE_ENDED", PW_TAKE_ENDED) < 0
        || PyModule_AddIntConstant(m, "IN_CAP", PW_IN_CAP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef __linux__
    if (add_type(m, &StreamType, "Stream") < 0 || add_type(m, &RelayType, "Relay") < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
