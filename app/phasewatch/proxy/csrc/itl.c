/* The ITL arithmetic (see itl.h). The same doubles by the same operations, in the same order,
 * as the Python oracle (tests/support/itl_oracle.py), which the tests hold it to. */
#include "itl.h"

#include <math.h>

#include "scan.h" /* PW_MAX_TOKEN_COUNT */

/* The first bucket whose upper bound holds `x` (bisect_left over sorted bounds). */
static size_t bucket_of(const double *b, size_t nb, double x) {
    size_t lo = 0, hi = nb;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (b[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

size_t pw_itl_replay(pw_itl *st, const int64_t *ev, size_t n, const double *bounds, size_t nb,
                     int exemplars, double *gaps, int64_t *tokens, int64_t *tally, double *mark,
                     double *sum) {
    size_t kept = 0;
    for (size_t i = 0; i < nb; i++) {
        tally[i] = 0;
        mark[i] = NAN;
    }
    *sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        int64_t completion = ev[3 * i + 1];
        if (completion < 0 || completion > PW_MAX_TOKEN_COUNT) continue; /* not a count */
        int64_t k = completion - st->seen; /* both in [0, PW_MAX_TOKEN_COUNT] */
        if (k <= 0) continue;
        int64_t elapsed;
        double gap;
        if (__builtin_sub_overflow(ev[3 * i], st->last, &elapsed))
            gap = ((double)ev[3 * i] - (double)st->last) / 1e9 / (double)k; /* not our clock */
        else
            gap = (double)elapsed / 1e9 / (double)k;
        st->seen = completion;
        st->last = ev[3 * i];
        st->total += gap * (double)k;
        gaps[kept] = gap;
        tokens[kept++] = k;
        int largest_yet = gap > st->largest;
        if (largest_yet) st->largest = gap;
        if (nb == 0) continue;
        size_t bucket = bucket_of(bounds, nb, gap);
        if (bucket == nb) bucket = nb - 1; /* past the last bound: the +Inf bucket's place */
        tally[bucket] += k;
        *sum += gap * (double)k;
        if (largest_yet && exemplars) mark[bucket] = gap;
    }
    return kept;
}
