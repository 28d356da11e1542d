/* The diagnosis's hottest loops in C: `average_ranks`, the loop of Cheng's beta draws and the
 * bootstrap's step per quantile rank (statistics.py). A diagnosis round runs them on thousands of values in a thread that shares
 * the GIL with the relay; in Python they were half of a round's CPU.
 *
 * Each gives what its Python reference in statistics.py gives, to the bit (the tests compare
 * them on random input): the same sort order (stable, by value), the same double arithmetic
 * in the same order, the same draws from the same `random.Random`. Where that cannot be
 * promised (a value that is not a float or an int a double holds exactly, a NaN),
 * `average_ranks` returns None and the caller runs the Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>

typedef struct {
    double value;
    Py_ssize_t index;
} Keyed;

static int compare_keyed(const void *a, const void *b) {
    const Keyed *x = a, *y = b;
    if (x->value < y->value) return -1;
    if (x->value > y->value) return 1;
    return (x->index > y->index) - (x->index < y->index);  /* stable: as `sorted` keeps ties */
}

/* The value as a double that compares with the others as the Python objects do; 0 when there
 * is none (not a float or int, an int past 2**53, a NaN). */
static int exact_double(PyObject *item, double *out) {
    if (PyFloat_CheckExact(item)) {
        *out = PyFloat_AS_DOUBLE(item);
        return !isnan(*out);
    }
    if (PyLong_Check(item)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        if (v > (1LL << 53) || v < -(1LL << 53)) return 0;
        *out = (double)v;
        return 1;
    }
    return 0;
}

static PyObject *average_ranks(PyObject *Py_UNUSED(m), PyObject *arg) {
    /* average_ranks(values) -> (ranks, ties) as statistics.average_ranks_py, or None. */
    PyObject *seq = PySequence_Fast(arg, "values must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *ranks = NULL, *ties = NULL, *result = NULL;
    double *by_position = NULL;
    Keyed *keyed = malloc((size_t)(n ? n : 1) * sizeof *keyed);
    if (keyed == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!exact_double(items[i], &keyed[i].value)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        keyed[i].index = i;
    }
    qsort(keyed, (size_t)n, sizeof *keyed, compare_keyed);
    by_position = malloc((size_t)(n ? n : 1) * sizeof *by_position);
    ties = PyList_New(0);
    ranks = PyList_New(n);
    if (by_position == NULL || ties == NULL || ranks == NULL) {
        if (by_position == NULL) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t p = 0; p < n; p++) by_position[p] = (double)(p + 1);
    for (Py_ssize_t p = 0; p + 1 < n;) {
        if (keyed[p].value != keyed[p + 1].value) { p++; continue; }
        Py_ssize_t first = p, last = p;  /* positions first .. last + 1 are one tie group */
        while (last + 2 < n && keyed[last + 1].value == keyed[last + 2].value) last++;
        Py_ssize_t size = last - first + 2;
        double average = (double)(first + last + 3) / 2.0;
        for (Py_ssize_t q = first; q <= last + 1; q++) by_position[q] = average;
        PyObject *s = PyLong_FromSsize_t(size);
        if (s == NULL || PyList_Append(ties, s) < 0) { Py_XDECREF(s); goto done; }
        Py_DECREF(s);
        p = last + 2;
    }
    for (Py_ssize_t p = 0; p < n; p++) {
        PyObject *r = PyFloat_FromDouble(by_position[p]);
        if (r == NULL) goto done;
        PyList_SET_ITEM(ranks, keyed[p].index, r);
    }
    result = PyTuple_Pack(2, ranks, ties);
done:
    Py_XDECREF(ranks);
    Py_XDECREF(ties);
    free(by_position);
    free(keyed);
    Py_DECREF(seq);
    return result;
}

static int draw(PyObject *uniform, double *out) {
    PyObject *u = PyObject_CallNoArgs(uniform);
    if (u == NULL) return 0;
    *out = PyFloat_AsDouble(u);
    Py_DECREF(u);
    return !(*out == -1.0 && PyErr_Occurred());
}

static PyObject *cheng_bb(PyObject *Py_UNUSED(m), PyObject *args) {
    /* cheng_bb(lo, hi, lo_first, k, uniform): k draws of Beta by Cheng's algorithm BB, both
     * shapes over 1 (lo <= hi; lo_first: the draw is for Beta(lo, hi), else Beta(hi, lo)),
     * `uniform` giving the uniforms (a `random.Random`'s `random`): the loop of
     * statistics.beta_draws_py, the same arithmetic in the same order. */
    double lo, hi;
    int lo_first;
    Py_ssize_t k;
    PyObject *uniform;
    if (!PyArg_ParseTuple(args, "ddpnO", &lo, &hi, &lo_first, &k, &uniform)) return NULL;
    const double log_4 = log(4.0), one_plus_log_5 = 1.0 + log(5.0), exp_max = log(DBL_MAX);
    double total = lo + hi;
    double spread = sqrt((total - 2.0) / (2.0 * lo * hi - total));
    double shift = lo + 1.0 / spread;
    PyObject *out = PyList_New(k < 0 ? 0 : k);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        double u1, u2, z, v, w, r, s, t;
        for (;;) {
            if (!draw(uniform, &u1)) goto fail;
            if (u1 <= 0.0) continue;  /* log(0): draw again (once in 2**53) */
            if (!draw(uniform, &u2)) goto fail;
            z = u1 * u1 * u2;
            v = spread * log(u1 / (1.0 - u1));
            w = v <= exp_max ? lo * exp(v) : DBL_MAX;
            r = shift * v - log_4;
            s = lo + r - w;
            if (s + one_plus_log_5 >= 5.0 * z || z <= 0.0) break;
            t = log(z);
            if (s > t || r + total * log(total / (hi + w)) >= t) break;
        }
        PyObject *x = PyFloat_FromDouble(lo_first ? w / (hi + w) : hi / (hi + w));
        if (x == NULL) goto fail;
        PyList_SET_ITEM(out, i, x);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *replicate_ranks(PyObject *Py_UNUSED(m), PyObject *args) {
    /* replicate_ranks(ordered, u, draws) -> (u', picked): one rank's step of
     * statistics.quantile_replicates_py. With draws, each u' = u + (1 - u) * draw (the next
     * order statistic of the same resample); without (None), u' is u. picked: the value of
     * `ordered` each u' falls on, ordered[min(n, max(1, ceil(n * u'))) - 1]. */
    PyObject *ordered_arg, *u_arg, *draws_arg;
    if (!PyArg_ParseTuple(args, "OOO", &ordered_arg, &u_arg, &draws_arg)) return NULL;
    PyObject *ordered = NULL, *u = NULL, *draws = NULL, *next = NULL, *picked = NULL;
    PyObject *result = NULL;
    ordered = PySequence_Fast(ordered_arg, "ordered must be a sequence");
    u = PySequence_Fast(u_arg, "u must be a sequence");
    if (ordered == NULL || u == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ordered), k = PySequence_Fast_GET_SIZE(u);
    if (draws_arg != Py_None) {
        draws = PySequence_Fast(draws_arg, "draws must be a sequence");
        if (draws == NULL) goto done;
        if (PySequence_Fast_GET_SIZE(draws) != k) {
            PyErr_SetString(PyExc_ValueError, "as many draws as replicates");
            goto done;
        }
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no values");
        goto done;
    }
    next = PyList_New(k);
    picked = PyList_New(k);
    if (next == NULL || picked == NULL) goto done;
    for (Py_ssize_t i = 0; i < k; i++) {
        double x = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(u, i));
        if (x == -1.0 && PyErr_Occurred()) goto done;
        if (draws != NULL) {
            double d = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(draws, i));
            if (d == -1.0 && PyErr_Occurred()) goto done;
            x = x + (1.0 - x) * d;
        }
        PyObject *xf = PyFloat_FromDouble(x);
        if (xf == NULL) goto done;
        PyList_SET_ITEM(next, i, xf);
        double c = ceil((double)n * x);
        Py_ssize_t at = c < 1.0 ? 1 : (c > (double)n ? n : (Py_ssize_t)c);
        PyList_SET_ITEM(picked, i, Py_NewRef(PySequence_Fast_GET_ITEM(ordered, at - 1)));
    }
    result = PyTuple_Pack(2, next, picked);
done:
    Py_XDECREF(ordered);
    Py_XDECREF(u);
    Py_XDECREF(draws);
    Py_XDECREF(next);
    Py_XDECREF(picked);
    return result;
}

static PyMethodDef methods[] = {
    {"replicate_ranks", replicate_ranks, METH_VARARGS, NULL},
    {"average_ranks", average_ranks, METH_O, NULL},
    {"cheng_bb", cheng_bb, METH_VARARGS, NULL},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stats", "The diagnosis's hot loops (see statistics.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__stats(void) { return PyModule_Create(&module); }
