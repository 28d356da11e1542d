/* The native leg's readers of upstream bytes: pure functions, no I/O, no Python, no globals.
 *
 * Invariants:
 * - Every function reads only inside the [data, data + len) it is given and writes only into
 *   the buffers it is given (`pw_buf`, `pw_log`), which grow by realloc and never past what a
 *   caller's input can need (an event is at most PW_IN_CAP bytes).
 * - Nothing here allocates on the caller's behalf but those two buffers; a failed allocation
 *   is reported (PW_TAKE_BACK: the stream goes back to Python), never ignored.
 * - The rules are those the Python path applies (app/phasewatch/proxy/stream.py): whatever is not
 *   plainly one of the events below is left to Python, from its first byte.
 * Each entry point has a libFuzzer target (fuzz/) and is run under ASan and UBSan in CI.
 */
#ifndef PW_SCAN_H
#define PW_SCAN_H

#include <stddef.h>
#include <stdint.h>

#define PW_IN_CAP (64 * 1024)        /* a chunk longer than this goes back to Python */
#define PW_MAX_TOKEN_COUNT (1LL << 24) /* events.MAX_TOKEN_COUNT: a larger count is not one */

/* Output bytes, framed as HTTP/1.1 chunks for the client; `off` is what was sent of them. */
typedef struct {
    char *data;
    size_t len, off, cap;
} pw_buf;

/* Logged events as (read time, completion tokens, prompt tokens or -1) int64 triples. */
typedef struct {
    int64_t *v;
    size_t len, cap; /* in int64s */
} pw_log;

/* One stream's reading state across reads. */
typedef struct {
    int strip;               /* cut the running usage (the client did not ask for it) */
    int hold;                /* hold a terminal chunk for the usage chunk's fingerprint */
    int pending;             /* no token yet: only the first token's chunk or the role chunk */
    int64_t last_completion; /* the running count of the last event logged (-1: none) */
    size_t held;             /* bytes at the input's front held as a terminal chunk (0: none) */
    int64_t held_ns;         /* the read time of the held chunk */
    int64_t done_ns;         /* the read time of `data: [DONE]` (0: not yet) */
} pw_scan;

enum { PW_TAKE_ON = 0, PW_TAKE_BACK = 1, PW_TAKE_ENDED = 2 };

/* Take the whole chunks at the front of `in` that the native leg relays as the Python path
 * would (running token chunks, then the terminal chunk, the usage chunk, `[DONE]` and the
 * body's last chunk), appending their output to `out` and their events to `log`, all as
 * read at `now`. `*consumed` is how many bytes of `in` were taken (a held terminal chunk is
 * not: it stays at the front). Returns PW_TAKE_BACK when the stream must go back to Python
 * from the first byte not consumed, PW_TAKE_ENDED when the body ended cleanly, else
 * PW_TAKE_ON (wait for more bytes). */
int pw_take(pw_scan *s, const char *in, size_t in_len, int64_t now, pw_buf *out, pw_log *log,
            size_t *consumed);

/* One whole SSE event (`data: {...}\n\n`) that is plainly a running token chunk (one choice,
 * `"finish_reason":null`, no `error`, a compact `usage` with an integer completion count):
 * 1 and its counts (prompt -1: absent or null) and the span that cutting its usage removes,
 * [cut_from, cut_to); else 0. */
int pw_token_event(const char *d, size_t n, int64_t *completion, int64_t *prompt,
                   size_t *cut_from, size_t *cut_to);

/* The HTTP/1.1 chunk at the front of [f, end): 1 whole (its data size, and the length of its
 * size line with its CRLF in `*head`), 0 not all here yet, -1 not one the native leg reads
 * (extensions, bad framing, or longer than PW_IN_CAP). */
int pw_chunk_at(const char *f, const char *end, size_t *size, size_t *head);

/* Append one chunk (the bytes a then b) to `out`; -1 without memory. */
int pw_out_chunk(pw_buf *out, const char *a, size_t an, const char *b, size_t bn);

int pw_log_add(pw_log *log, int64_t t, int64_t completion, int64_t prompt);

void pw_buf_free(pw_buf *b);
void pw_log_free(pw_log *l);

#endif
