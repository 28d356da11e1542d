/* libFuzzer target: `pw_itl_replay` (app/phasewatch/proxy/csrc/itl.c) over whatever counts and times an
 * upstream's usage can make it see: the input is the stream's state (count, time) and then
 * (time, count, prompt) int64 triples; bounds are the ITL histogram's shape, +Inf last.
 * Checked: one gap and one count per event at most; the tally holds every token observed;
 * every gap is a number.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "itl.h"

#define CHECK(cond) do { if (!(cond)) __builtin_trap(); } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 16) return 0;
    int64_t head[2];
    memcpy(head, data, 16);
    data += 16;
    size -= 16;
    size_t n = size / 24;
    int64_t *ev = malloc((n ? n : 1) * 24);
    double *gaps = malloc((n ? n : 1) * sizeof *gaps);
    int64_t *tokens = malloc((n ? n : 1) * sizeof *tokens);
    if (ev == NULL || gaps == NULL || tokens == NULL) goto done;
    memcpy(ev, data, n * 24);
    const double bounds[] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, INFINITY};
    const size_t nb = sizeof bounds / sizeof bounds[0];
    int64_t tally[sizeof bounds / sizeof bounds[0]];
    double mark[sizeof bounds / sizeof bounds[0]], sum;
    int64_t seen = head[0] & 0xFFFFFF; /* a running count is a count */
    pw_itl st = {.seen = seen, .last = head[1], .largest = 0.0, .total = 0.0};
    size_t kept = pw_itl_replay(&st, ev, n, bounds, nb, 1, gaps, tokens, tally, mark, &sum);
    CHECK(kept <= n);
    int64_t in_tally = 0, carried = 0;
    for (size_t i = 0; i < nb; i++) in_tally += tally[i];
    for (size_t i = 0; i < kept; i++) {
        CHECK(tokens[i] > 0 && !isnan(gaps[i]));
        carried += tokens[i];
    }
    CHECK(in_tally == carried);
done:
    free(ev);
    free(gaps);
    free(tokens);
    return 0;
}
