/* libFuzzer target: `pw_take` (app/phasewatch/proxy/csrc/scan.c) as the relay's thread drives it.
 *
 * Input: one byte of flags (strip, hold, pending), one byte seeding where the bytes are split
 * into reads, then the upstream's body bytes. Each read is appended to what the last call left
 * (as relay.c keeps `in`), and taken until the stream would go back to Python or end.
 * Checked on every call: nothing is consumed past the input; the output is whole HTTP/1.1
 * chunks; the log holds whole triples, of counts a timing can take; a held chunk lies inside
 * what is left. ASan and UBSan check every read and write.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scan.h"

#define CHECK(cond) do { if (!(cond)) __builtin_trap(); } while (0)

/* The output must parse back as whole chunks, none empty (the body's end is the relay's). */
static void check_chunks(const pw_buf *out) {
    size_t pos = 0;
    while (pos < out->len) {
        size_t size, head;
        int framed = pw_chunk_at(out->data + pos, out->data + out->len, &size, &head);
        CHECK(framed == 1 && size > 0);
        pos += head + size + 2;
    }
    CHECK(pos == out->len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    pw_scan s = {.strip = data[0] & 1, .hold = (data[0] >> 1) & 1,
                 .pending = (data[0] >> 2) & 1, .last_completion = -1};
    uint32_t seed = data[1] * 2654435761u + 1;
    data += 2;
    size -= 2;
    char *in = malloc(PW_IN_CAP);
    if (in == NULL) return 0;
    size_t in_len = 0, pos = 0;
    int64_t now = 1;
    int verdict = PW_TAKE_ON;
    while (pos < size && verdict == PW_TAKE_ON) {
        seed = seed * 1103515245u + 12345u;
        size_t piece = 1 + (seed >> 16) % 700;
        if (piece > size - pos) piece = size - pos;
        if (piece > PW_IN_CAP - in_len) piece = PW_IN_CAP - in_len;
        if (piece == 0) break; /* full: the relay hands such a stream back */
        memcpy(in + in_len, data + pos, piece);
        in_len += piece;
        pos += piece;
        pw_buf out = {0};
        pw_log log = {0};
        size_t used = 0;
        verdict = pw_take(&s, in, in_len, now++, &out, &log, &used);
        CHECK(used <= in_len);
        CHECK(verdict == PW_TAKE_ON || verdict == PW_TAKE_BACK || verdict == PW_TAKE_ENDED);
        CHECK(log.len % 3 == 0);
        for (size_t i = 0; i < log.len; i += 3) {
            CHECK(log.v[i + 1] >= 0 && log.v[i + 1] <= PW_MAX_TOKEN_COUNT);
            CHECK(log.v[i + 2] >= -1 && log.v[i + 2] <= PW_MAX_TOKEN_COUNT);
        }
        CHECK(s.held <= in_len - used);
        check_chunks(&out);
        pw_buf_free(&out);
        pw_log_free(&log);
        memmove(in, in + used, in_len - used);
        in_len -= used;
    }
    free(in);
    return 0;
}
