/* The native leg's readers of upstream bytes (see scan.h for the invariants).
 *
 * What is read here, and nowhere else in C: the HTTP/1.1 chunked framing of a streamed
 * response's body (never its head: httptools parses heads, in Python), one SSE event of
 * vLLM's compact JSON at a time (which kind of event it is, by byte patterns that cannot
 * occur inside a JSON string, where every quote is escaped), the integer counts of its
 * `usage` object, and the usage chunk's `system_fingerprint` string. The Python path calls
 * `pw_token_event` for its own fast path too (stream.py), so the test of a running token
 * chunk exists once.
 */
#define _GNU_SOURCE /* memmem */
#include "scan.h"

#include <stdlib.h>
#include <string.h>

#define LIT(s) s, (sizeof(s) - 1)
#define FINGERPRINT_KEY "\"system_fingerprint\":"

static const char *find(const char *h, size_t n, const char *needle, size_t m) {
    return (const char *)memmem(h, n, needle, m);
}

static size_t count(const char *h, size_t n, const char *needle, size_t m) {
    size_t c = 0;
    const char *p = h, *end = h + n;
    while ((p = find(p, (size_t)(end - p), needle, m)) != NULL) {
        c++;
        p += m;
    }
    return c;
}

static const char *rfind(const char *h, size_t n, const char *needle, size_t m) {
    if (n < m) return NULL;
    for (size_t i = n - m + 1; i-- > 0;)
        if (h[i] == needle[0] && memcmp(h + i, needle, m) == 0) return h + i;
    return NULL;
}

/* -- buffers ------------------------------------------------------------------------------ */

static int reserve(pw_buf *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more) cap *= 2;
    char *p = realloc(b->data, cap);
    if (p == NULL) return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

int pw_out_chunk(pw_buf *out, const char *a, size_t an, const char *b, size_t bn) {
    /* size line (at most 16 hex digits and CRLF), the data, CRLF */
    if (reserve(out, an + bn + 20) < 0) return -1;
    size_t size = an + bn;
    char hex[2 * sizeof size];
    int h = 0;
    do {
        hex[h++] = "0123456789abcdef"[size & 15];
        size >>= 4;
    } while (size);
    char *o = out->data + out->len;
    while (h) *o++ = hex[--h];
    *o++ = '\r';
    *o++ = '\n';
    if (an) memcpy(o, a, an);
    o += an;
    if (bn) memcpy(o, b, bn);
    o += bn;
    *o++ = '\r';
    *o++ = '\n';
    out->len = (size_t)(o - out->data);
    return 0;
}

int pw_log_add(pw_log *log, int64_t t, int64_t completion, int64_t prompt) {
    if (log->len + 3 > log->cap) {
        size_t cap = log->cap ? log->cap * 2 : 3 * 64;
        int64_t *p = realloc(log->v, cap * sizeof *p);
        if (p == NULL) return -1;
        log->v = p;
        log->cap = cap;
    }
    log->v[log->len++] = t;
    log->v[log->len++] = completion;
    log->v[log->len++] = prompt;
    return 0;
}

void pw_buf_free(pw_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->off = b->cap = 0;
}

void pw_log_free(pw_log *l) {
    free(l->v);
    l->v = NULL;
    l->len = l->cap = 0;
}

/* -- one event ---------------------------------------------------------------------------- */

/* A JSON integer as orjson reads it into a Python int (no leading zeros, at most 18 digits);
 * the position after it, or NULL (a float, or not a number). */
static const char *json_int(const char *p, const char *end, int64_t *value) {
    int neg = 0;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    const char *digits = p;
    int64_t v = 0; /* at most 18 digits are summed: no overflow */
    while (p < end && *p >= '0' && *p <= '9' && p - digits < 18) v = v * 10 + (*p++ - '0');
    size_t n = (size_t)(p - digits);
    if (n == 0 || (n > 1 && digits[0] == '0')) return NULL;
    /* a 19th digit (too long for Python's read to agree), a fraction or an exponent */
    if (p < end && ((*p >= '0' && *p <= '9') || *p == '.' || *p == 'e' || *p == 'E'))
        return NULL;
    *value = neg ? -v : v;
    return p;
}

/* A compact object of integer, null and (nested) object values; at the top level, the values
 * of completion_tokens and prompt_tokens (-2: absent, -1: null; the last one wins, as in
 * orjson). Anything else (strings, floats, spaces, escapes, a count out of range) is NULL:
 * Python reads it. */
static const char *usage_object(const char *p, const char *end, int depth, int64_t *completion,
                                int64_t *prompt) {
    if (depth > 4 || p >= end || *p != '{') return NULL;
    p++;
    if (p < end && *p == '}') return p + 1;
    for (;;) {
        if (p >= end || *p != '"') return NULL;
        const char *key = ++p;
        while (p < end && *p != '"' && *p != '\\') p++;
        if (p >= end || *p != '"') return NULL;
        size_t key_len = (size_t)(p - key);
        p++;
        if (p >= end || *p != ':') return NULL;
        p++;
        int64_t *slot = NULL;
        if (depth == 0 && key_len == 17 && memcmp(key, "completion_tokens", 17) == 0)
            slot = completion;
        else if (depth == 0 && key_len == 13 && memcmp(key, "prompt_tokens", 13) == 0)
            slot = prompt;
        if (p < end && *p == '{') {
            int64_t ignore_c, ignore_p;
            if (slot != NULL) return NULL; /* a count that is an object */
            p = usage_object(p, end, depth + 1, &ignore_c, &ignore_p);
            if (p == NULL) return NULL;
        } else if (end - p >= 4 && memcmp(p, "null", 4) == 0) {
            p += 4;
            if (slot != NULL) *slot = -1;
        } else {
            int64_t v;
            p = json_int(p, end, &v);
            if (p == NULL) return NULL;
            if (slot != NULL) {
                if (v < 0 || v > PW_MAX_TOKEN_COUNT) return NULL; /* not a count (events.py) */
                *slot = v;
            }
        }
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') return p + 1;
        return NULL;
    }
}

/* Exactly one whole one-line event of a JSON object: `data: {"` ... `}\n\n`, no CR, no other
 * LF (StreamFeed.feed's usual read). */
static int one_line_event(const char *d, size_t n) {
    if (n < 10 || memcmp(d, "data: {\"", 8) != 0 || memcmp(d + n - 3, "}\n\n", 3) != 0) return 0;
    return memchr(d, '\r', n) == NULL && memchr(d, '\n', n - 2) == NULL;
}

/* The event's compact `"usage":{...}`: the last `"usage":{` (events.usage_span) and the brace
 * that balances it, which must be where the object ends; its counts (completion an integer)
 * and the span that cutting it removes (with the comma before it). */
static int usage_in(const char *d, size_t n, int64_t *completion, int64_t *prompt,
                    size_t *cut_from, size_t *cut_to) {
    const char *start = rfind(d, n, LIT("\"usage\":{"));
    if (start == NULL) return 0;
    const char *open = start + 8, *end = d + n;
    int64_t c = -2, p = -2;
    const char *close = usage_object(open, end, 0, &c, &p);
    if (close == NULL || c < 0) return 0;
    /* usage_span balances braces on the raw bytes: the first point where they balance. */
    size_t depth = 0;
    const char *q = open;
    for (; q < end; q++) {
        if (*q == '{') depth++;
        else if (*q == '}' && --depth == 0) break;
    }
    if (q >= end || q + 1 != close) return 0;
    *completion = c;
    *prompt = p < 0 ? -1 : p;
    size_t from = (size_t)(start - d);
    *cut_from = (from > 0 && d[from - 1] == ',') ? from - 1 : from;
    *cut_to = (size_t)(close - d);
    return 1;
}

int pw_token_event(const char *d, size_t n, int64_t *completion, int64_t *prompt,
                   size_t *cut_from, size_t *cut_to) {
    if (!one_line_event(d, n)) return 0;
    if (find(d, n, LIT("\"choices\":[{")) == NULL || find(d, n, LIT("\"error\":")) != NULL)
        return 0;
    if (count(d, n, LIT("\"finish_reason\":")) != 1
        || find(d, n, LIT("\"finish_reason\":null")) == NULL)
        return 0;
    return usage_in(d, n, completion, prompt, cut_from, cut_to);
}

/* A terminal chunk (stream.py `info.finished`): a choice whose `finish_reason` is a string. */
static int terminal_event(const char *d, size_t n) {
    return one_line_event(d, n) && find(d, n, LIT("\"choices\":[{")) != NULL
           && find(d, n, LIT("\"error\":")) == NULL
           && find(d, n, LIT("\"finish_reason\":\"")) != NULL;
}

/* The closing usage chunk (events.Kind.USAGE): `"choices":[]`, a compact usage, no error. */
static int usage_event(const char *d, size_t n, int64_t *completion, int64_t *prompt) {
    size_t from, to;
    return one_line_event(d, n) && find(d, n, LIT("\"choices\":[]")) != NULL
           && find(d, n, LIT("\"choices\":[{")) == NULL && find(d, n, LIT("\"error\":")) == NULL
           && usage_in(d, n, completion, prompt, &from, &to);
}

/* vLLM's role chunk, as `classify` reads it: a chat delta of exactly the role and an empty
 * content, so no output (the one event with a count of 0 taken before the first token). */
static int role_chunk(const char *d, size_t n) {
    return find(d, n, LIT("\"delta\":{\"role\":\"assistant\",\"content\":\"\"}")) != NULL
           && count(d, n, LIT("\"delta\":")) == 1 && find(d, n, LIT("\"text\":")) == NULL;
}

/* events.system_fingerprint: the event's fingerprint as its JSON string, quotes included. */
static int fingerprint_of(const char *d, size_t n, const char **fp, size_t *fn) {
    const char *key = rfind(d, n, LIT(FINGERPRINT_KEY));
    if (key == NULL) return 0;
    const char *start = key + sizeof(FINGERPRINT_KEY) - 1, *end = d + n;
    if (start >= end || *start != '"') return 0;
    for (const char *q = start + 1; q < end; q++) {
        if (*q != '"') continue;
        size_t backslashes = 0; /* stops at `start`, a quote */
        while (q[-1 - (ptrdiff_t)backslashes] == '\\') backslashes++;
        if (backslashes % 2 == 0) {
            *fp = start;
            *fn = (size_t)(q + 1 - start);
            return 1;
        }
    }
    return 0;
}

/* The held terminal chunk `d` as the Python path writes it once the usage chunk after it is
 * cut (stream.py `_stamped`): its running usage cut when asked, then the fingerprint `fp`
 * (NULL: none) before its last `}` unless it has one (events.add_fingerprint). */
static int out_stamped(pw_scan *s, pw_buf *out, const char *d, size_t n, size_t cut_from,
                       size_t cut_to, const char *fp, size_t fn) {
    const size_t kn = sizeof(FINGERPRINT_KEY) - 1;
    char *buf = malloc(n + 1 + kn + fn);
    if (buf == NULL) return -1;
    size_t m;
    if (s->strip) {
        memcpy(buf, d, cut_from);
        memcpy(buf + cut_from, d + cut_to, n - cut_to);
        m = cut_from + (n - cut_to);
    } else {
        memcpy(buf, d, n);
        m = n;
    }
    int rc;
    const char *brace = rfind(buf, m, LIT("}"));
    if (fp == NULL || brace == NULL || find(buf, m, LIT(FINGERPRINT_KEY)) != NULL) {
        rc = pw_out_chunk(out, buf, m, NULL, 0);
    } else {
        size_t at = (size_t)(brace - buf);
        memmove(buf + at + 1 + kn + fn, buf + at, m - at);
        buf[at] = ',';
        memcpy(buf + at + 1, FINGERPRINT_KEY, kn);
        memcpy(buf + at + 1 + kn, fp, fn);
        rc = pw_out_chunk(out, buf, m + 1 + kn + fn, NULL, 0);
    }
    free(buf);
    return rc;
}

/* -- framing and the take loop ------------------------------------------------------------ */

int pw_chunk_at(const char *f, const char *end, size_t *size, size_t *head) {
    const char *q = f;
    size_t n = 0;
    while (q < end && q - f < 8) {
        char ch = *q;
        int v = (ch >= '0' && ch <= '9')   ? ch - '0'
                : (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10
                : (ch >= 'A' && ch <= 'F') ? ch - 'A' + 10
                                           : -1;
        if (v < 0) break;
        n = n * 16 + (size_t)v;
        q++;
    }
    if (q == end) return 0; /* the size line is not all here yet */
    if (q == f || *q != '\r') return -1;
    if (end - q < 2) return 0;
    if (q[1] != '\n') return -1;
    *size = n;
    *head = (size_t)(q + 2 - f);
    if (n == 0) return 1; /* the last chunk: its size line is enough to end the body */
    if (*head + n + 2 > PW_IN_CAP) return -1;
    if ((size_t)(end - f) < *head + n + 2) return 0;
    if (f[*head + n] != '\r' || f[*head + n + 1] != '\n') return -1;
    return 1;
}

int pw_take(pw_scan *s, const char *in, size_t in_len, int64_t now, pw_buf *out, pw_log *log,
            size_t *consumed) {
    size_t pos = 0;
    int verdict = PW_TAKE_ON;
    int64_t done_ns = s->done_ns;
    /* Where this chunk began: a failed allocation undoes the chunk's output and events, and
     * the stream goes back to Python from the chunk's first byte. */
    pw_scan saved = *s;
    size_t out_mark = 0, log_mark = 0;
    int64_t saved_done = done_ns;
#define LOG(t, c, p)                                                                            \
    do {                                                                                      \
        if (pw_log_add(log, (t), (c), (p)) < 0) goto nomem;                                   \
        if ((c) > s->last_completion) s->last_completion = (c);                               \
    } while (0)
    while (pos < in_len) {
        const char *f = in + pos, *end = in + in_len;
        saved = *s;
        saved_done = done_ns;
        out_mark = out->len;
        log_mark = log->len;
        size_t size, head;
        int framed = pw_chunk_at(f, end, &size, &head);
        if (framed == 0) break; /* the rest of this chunk is still to come */
        if (framed < 0) goto back;
        if (size == 0) {
            /* The body's last chunk, after `[DONE]`, with no trailer and nothing after it:
             * the body ended cleanly. Anything else about the end is Python's. */
            if (done_ns && s->held == 0 && (size_t)(end - f) == 5 && memcmp(f, "0\r\n\r\n", 5) == 0) {
                pos += 5;
                verdict = PW_TAKE_ENDED;
                break;
            }
            goto back;
        }
        if (done_ns) goto back; /* more after `[DONE]` */
        size_t whole = head + size + 2, n = size;
        const char *d = f + head;
        int64_t completion = -1, prompt = -1;
        size_t cut_from = 0, cut_to = 0;
        int token = pw_token_event(d, n, &completion, &prompt, &cut_from, &cut_to);
        int terminal = !token && terminal_event(d, n);
        if (terminal && !usage_in(d, n, &completion, &prompt, &cut_from, &cut_to)) goto back;
        if (s->pending) {
            /* Before the first token: that token, or the role chunk (how Python times any
             * other first event depends on more than its count). */
            if (!token || (completion == 0 && !role_chunk(d, n))) goto back;
            if (completion > 0) s->pending = 0;
        }
        if (token || (terminal && !s->hold)) {
            int rc = s->strip ? pw_out_chunk(out, d, cut_from, d + cut_to, n - cut_to)
                              : pw_out_chunk(out, d, n, NULL, 0);
            if (rc < 0) goto nomem;
            LOG(now, completion, prompt);
            pos += whole;
            continue;
        }
        if (terminal) {
            /* Held where it is until a whole chunk follows it: the usage chunk is cut and its
             * fingerprint moved onto this one; anything else sends the stream back with it
             * held (its own read time in `held_ns`). */
            if (s->held == 0) {
                s->held = whole;
                s->held_ns = now;
            }
            const char *g = f + whole;
            size_t next_size, next_head;
            int next = pw_chunk_at(g, end, &next_size, &next_head);
            if (next == 0) break;
            int64_t seen = completion > s->last_completion ? completion : s->last_completion;
            int64_t usage_completion, usage_prompt;
            if (next < 0 || next_size == 0
                || !usage_event(g + next_head, next_size, &usage_completion, &usage_prompt)
                || usage_completion > seen)
                goto back;
            const char *fp = NULL;
            size_t fn = 0;
            fingerprint_of(g + next_head, next_size, &fp, &fn);
            if (out_stamped(s, out, d, n, cut_from, cut_to, fp, fn) < 0) goto nomem;
            LOG(s->held_ns, completion, prompt);
            LOG(now, usage_completion, usage_prompt);
            s->held = 0;
            pos += whole + next_head + next_size + 2;
            continue;
        }
        if (usage_event(d, n, &completion, &prompt)) {
            /* Taken only if it raises no count (the Python path would count tokens for it). */
            if (s->last_completion < 0 || completion > s->last_completion) goto back;
            if (!s->hold && pw_out_chunk(out, d, n, NULL, 0) < 0) goto nomem;
            LOG(now, completion, prompt); /* (cut when the terminal chunk is held for it) */
            pos += whole;
            continue;
        }
        if (n == 14 && memcmp(d, "data: [DONE]\n\n", 14) == 0) {
            if (pw_out_chunk(out, d, n, NULL, 0) < 0) goto nomem;
            done_ns = now;
            pos += whole;
            continue;
        }
        goto back; /* the role chunk out of place, an error, anything else: Python's */
    }
    goto done;
nomem:
    *s = saved;
    done_ns = saved_done;
    out->len = out_mark;
    log->len = log_mark;
back:
    verdict = PW_TAKE_BACK;
done:
#undef LOG
    s->done_ns = done_ns;
    *consumed = pos;
    return verdict;
}
