/* The ITL arithmetic of an exactly counted stream: pure, no I/O, no Python.
 *
 * Given events as (read time ns, running completion count, prompt count) int64 triples, and
 * where the stream stood (its count `seen`, the time `last` it last rose, its largest gap and
 * gap total so far), each event whose count rose by k > 0 (and is a count: at most
 * PW_MAX_TOKEN_COUNT) carries k tokens, each with the gap (its time - last) / 1e9 / k seconds.
 * This is the one implementation of that rule: the Python path calls it per event and the
 * native leg's replay per batch (timing.py); app/phasewatch/proxy's Python oracle exists in the tests.
 */
#ifndef PW_ITL_H
#define PW_ITL_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int64_t seen;   /* the running count at the last token event */
    int64_t last;   /* the read time of that event */
    double largest; /* the stream's largest gap so far */
    double total;   /* the sum of gap x tokens so far */
} pw_itl;

/* Replay `n` triples at `ev`. Out, for the events that carried tokens, in order: `gaps` and
 * `tokens` (room for `n` each); per bucket of the histogram whose upper bounds are `bounds`
 * (`nb` of them, sorted; 0: no histogram): the samples in `tally` and, when `exemplars`, the
 * last gap that was the stream's largest so far in `mark` (NaN: none) (room for `nb` each);
 * the samples' sum in `*sum`. Returns how many events carried tokens. */
size_t pw_itl_replay(pw_itl *st, const int64_t *ev, size_t n, const double *bounds, size_t nb,
                     int exemplars, double *gaps, int64_t *tokens, int64_t *tally, double *mark,
                     double *sum);

#endif
