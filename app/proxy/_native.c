/* The relay's native leg: the middle of a stream, relayed below Python.
 *
 * Once a stream's tokens are counted exactly (its running usage, timing.py) and every event so
 * far was a whole chunk, the relay hands both sockets of the exchange to this module's thread.
 * The thread reads the upstream, takes each HTTP/1.1 chunk that is exactly one running token
 * event (the same test as `StreamFeed._token_chunk`: one choice, `"finish_reason":null`, no
 * `error`, a compact `"usage":{...}`), stamps it with the read's CLOCK_MONOTONIC time (the
 * clock of `time.perf_counter_ns()`), logs (time, completion tokens, prompt tokens), cuts the
 * usage when the client did not ask for it, and writes it to the client as one chunk: an
 * epoll loop, one read and one send per read, no Python. It also takes the stream's tail as
 * the Python path forwards it: the terminal chunk (a `finish_reason` set; its running usage cut
 * too), the closing usage chunk (cut when the client did not ask for it), `[DONE]`, and the
 * body's last chunk, and writes the response's end (the 0-size chunk) with that last read's
 * output; the stream then comes back once, ended (END_BODY, `end_written`), for Python to
 * complete its exchange (the record, the server's cycle). Such an ending is published without
 * a wake-up of the event loop: Python takes it on its next wake-up for anything else (each
 * read of a client's bytes, each pass of the live registry: `ended()`), or the thread wakes it
 * `QUIET_NS` later at most; at once when a request is queued behind it on its client's
 * connection (`urge`). Anything else (the role
 * chunk before, an error, a chunk it cannot read plainly, anything after `[DONE]`, a body that
 * ends before it, a broken socket, the relay asking) hands the stream back to Python with the
 * bytes it has not taken, and Python goes on from exactly there: every byte and every timing
 * definition is that of the Python path, which replays the logged events into the stream's
 * `StreamTiming`.
 *
 * A terminal chunk of a stream whose closing usage chunk is to be cut is held by the Python
 * path until the event after it (stream.py: it takes the usage chunk's fingerprint). So the
 * thread holds it too, relaying nothing more, until a whole chunk follows it: the usage chunk
 * is cut and its fingerprint spliced into the held chunk where vLLM writes it; any other chunk
 * hands the stream back with the held chunk's own read time (`held`, `held_ns`). Nothing
 * reaches the client later than it would have.
 *
 * A stream may also come to the thread as soon as its request is sent (`start(..., head=...)`):
 * the thread then reads the upstream's head too. A `200` event stream, chunked, with a head it
 * reads plainly (see `head_take`) is the usual answer: the thread writes the client's head
 * (Python's parts around the upstream's headers, filtered as `client_response_headers` does)
 * in the same write as the first token, and keeps a copy of the upstream's head for Python to
 * parse for its own state (`head`). Until the first token the thread takes only a plain token
 * chunk with a count, or vLLM's role chunk (no output, count 0). Any other head goes back to
 * Python with every byte read and nothing written, as if the thread had never had it; any other
 * first event, from that event's first byte, the client's head having gone out.
 *
 * Sockets: the thread works on duplicates of the two descriptors, so that a close by the event
 * loop never leaves it writing to a reused number. While it holds a stream, the event loop has
 * paused reading the upstream and writes nothing to the client (it still reads the client, and
 * so still hears a disconnect). A client that stops reading stops the upstream's reads here,
 * as in the Python path, and `blocked_since` says since when.
 *
 * The front (front.py): a stream started at its head with `keep` (the event loop paused its
 * reads of that client; the thread hears the client's hang-up itself) keeps both connections
 * at a clean end, the client's buffer drained. The thread then reads the client's next request
 * (`front_ready`). A plain one (`front_request`: a streamed completion or chat request with a
 * `Content-Length` body of JSON in UTF-8 that `plan_request` would plan by appending
 * `stream_options`) it sends upstream on the kept connection, with the headers the Python path
 * forwards, and relays on a stream object Python stocked (`stock`) as one started at its head;
 * Python looks at it later (`front_started`) or at its end. Anything else, the upstream's close
 * while idle, the keep-alive timeout (`front_expire`) or shutdown (`front_stop`) lets the front
 * go (`closed()`), with the bytes read of a request not taken; a front's stream that comes back
 * early takes the front's connection object with it (`front_conn`) for Python to take over.
 *
 * Python talks to the thread through one mutex and two eventfds: `wake` (Python -> thread: a
 * stream to stop) and `notify` (thread -> Python, read by the event loop: streams handed back;
 * at once, but for the quiet endings above).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define IN_CAP (64 * 1024)    /* a chunk longer than this goes back to Python */
#define HEAD_CAP (16 * 1024)  /* an upstream head longer than this goes back to Python */
#define MAX_EVENTS 256
#define MAX_TOKEN_COUNT (1LL << 24)  /* events.MAX_TOKEN_COUNT: a larger count is not one */
#define NATIVE_THREAD_NAME "pw-native-relay"  /* 15 characters: Linux's limit */

/* Where a stream started at its head stands with the upstream's head. */
enum { HEAD_NONE = 0, HEAD_WAIT = 1, HEAD_TAKEN = 2 };

/* Why a stream came back (Python reads these as `Ending` in native.py). */
enum { END_NONE = 0, END_HANDOVER = 1, END_ASKED = 2, END_UPSTREAM_EOF = 3,
       END_UPSTREAM_ERROR = 4, END_CLIENT_ERROR = 5, END_BODY = 6 };

typedef struct Stream Stream;
typedef struct Front Front;

typedef struct {
    PyObject_HEAD
    int epfd, wake_fd, notify_fd;
    pthread_t thread;
    int running;
    pthread_mutex_t lock;
    Stream *active;   /* held by the thread (under lock) */
    Stream *done;     /* handed back, waiting for `finished()`, oldest first (under lock) */
    Stream *done_tail;
    Stream *retired;  /* handed back in the current epoll batch (the thread's own) */
    int closing;
    int64_t quiet_since; /* (thread) the oldest stream published without a wake (0: none) */
    int64_t quiet_ns;    /* how long such a stream waits at most (`QUIET_NS` unless told) */
    /* The front: client connections the thread keeps between requests. */
    Front *fronts;       /* kept: idle or answering a request (under lock) */
    Front *closed;       /* let go, waiting for Python (`closed()`, under lock) */
    Stream *spares;      /* Python's streams for the front's requests (under lock) */
    int front_on;        /* `front_config` was given */
    int f_date_on;       /* the server writes a `date` header */
    int f_unseen;        /* front streams Python has not looked at yet (`front_started`) */
    int py_in_flight;    /* Python's requests in flight, as it last said (`in_flight`) */
    int64_t f_expire;    /* idle fronts waiting since before this go back (`front_expire`) */
    char *f_rest; Py_ssize_t f_rest_len;      /* the server's headers after `date` */
    char *f_prefix; Py_ssize_t f_prefix_len;  /* the upstream's base path */
    char *f_host; Py_ssize_t f_host_len;      /* the upstream's host header */
    char *f_admin; Py_ssize_t f_admin_len;    /* the admin token header (never forwarded) */
    Py_ssize_t f_max_body;
    uint64_t f_rng;      /* request ids (not secrets) */
    char f_date[40]; int64_t f_date_s;
} Relay;

struct Stream {
    PyObject_HEAD
    PyObject *owner;          /* Python's, untouched here */
    Stream *next, *prev;      /* in `active`, or `next` alone in `done` */
    Relay *relay;
    int up, client;           /* duplicated descriptors (-1 once closed) */
    int strip;                /* cut the running usage */
    int stop_asked;           /* under lock */
    int urgent;               /* under lock: its end is published with a wake-up (`urge`) */
    int ending;               /* END_*; set by the thread when it hands the stream back */
    int err;                  /* errno of a broken socket */
    int blocked;              /* waiting for the client to take `out` */
    int watch_client;         /* the client's hang-up is in the epoll set too (`watch_client`) */
    int hold;                 /* hold a terminal chunk until a whole chunk follows it */
    int end_written;          /* END_BODY: the response's end went into `out` (see `unsent`) */
    Py_ssize_t held;          /* bytes at the front of `in` held so (0: none) */
    int64_t held_ns;          /* the time of the read that completed the held chunk */
    int64_t last_completion;  /* the running count of the last event logged (-1: none) */
    /* Thread-only buffers. */
    char *in; Py_ssize_t in_len;
    char *out; Py_ssize_t out_len, out_off, out_cap;
    /* Shared under lock. */
    int64_t *log; Py_ssize_t log_len, log_cap;   /* (time, completion, prompt) triples */
    int64_t last_read_ns, blocked_since_ns, leftover_ns;
    int64_t done_ns;          /* the time of the read that brought `[DONE]` (0: not yet) */
    int64_t polled_ns;        /* the last `poll` (0: none) */
    int unpolled_first;       /* started at its head, and no poll has taken its first token */
    /* A stream started at its head (`start(..., head=...)`). */
    int head_state;           /* HEAD_*: HEAD_WAIT until the upstream's head is taken */
    int pending;              /* no token yet: only a first token or the role chunk is taken */
    char *head_pre, *head_rid, *head_post;  /* the client head's parts from Python */
    Py_ssize_t head_pre_len, head_rid_len, head_post_len;
    char *head_raw; Py_ssize_t head_raw_len;  /* the upstream's head once taken (under lock) */
    int64_t head_ns;          /* the time of the read that completed it */
    /* The front. */
    PyObject *keep;           /* Python's connection object: keep the connection at a clean end */
    Front *kept;              /* the front kept at that end (dormant until `lend()`) */
    Front *front;             /* the front whose request this stream answers */
    int front_request;        /* started by the front: the facts below are set */
    int64_t f_arrival_ns, f_wall_ns, f_sent_ns;
    char f_rid[208];
    char *f_model; Py_ssize_t f_model_len;    /* the body's `model` value, as JSON */
    int f_endpoint;           /* 0 completions, 1 chat */
    int f_seen;               /* Python has looked at it (`front_started`) */
    int f_in_flight;          /* requests in flight when it arrived */
    char *f_req; Py_ssize_t f_req_len;  /* the client's request, as read */
    PyObject *f_conn;         /* the front's connection object, once the front went with it */
};

struct Front {
    Relay *relay;
    int client, up;           /* owned duplicates (-1 once closed) */
    PyObject *owner;          /* Python's connection object; its reference goes with `closed()` */
    Front *next, *prev;       /* in `fronts` or (next alone) `closed` */
    char *buf; Py_ssize_t len, cap;  /* the client's bytes of the next request */
    int64_t first_ns, first_wall_ns;
    int64_t idle_ns;          /* since when it waits for a request */
    Stream *stream;           /* the stream answering its request (NULL: idle) */
    int why;                  /* FRONT_* once let go */
    /* The stream Python started that kept it has not been taken by Python yet: let go, it
     * waits in `closed` until then, so that Python hears of the stream's end (and gives the
     * connections to the front) before it hears of the front's. */
    int keeper_unseen;
};

enum { FRONT_EOF = 1, FRONT_PYTHON = 2, FRONT_STREAM = 3, FRONT_ASKED = 4, FRONT_BROKEN = 5,
       FRONT_EXPIRED = 6 };
#define FRONT_CAP (64 * 1024)  /* a longer request goes to Python */
#define FRONT_BUF 4096  /* a front's buffer to begin with (doubled up to FRONT_CAP) */

static PyTypeObject StreamType;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void wake(int fd) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof one);
    (void)r;
}

/* -- reading one event the way StreamFeed._token_chunk does --------------------------------- */

static const char *find(const char *h, Py_ssize_t n, const char *needle, Py_ssize_t m) {
    return (const char *)memmem(h, (size_t)n, needle, (size_t)m);
}

static Py_ssize_t count(const char *h, Py_ssize_t n, const char *needle, Py_ssize_t m) {
    Py_ssize_t c = 0;
    const char *p = h, *end = h + n;
    while ((p = find(p, end - p, needle, m)) != NULL) { c++; p += m; }
    return c;
}

static const char *rfind(const char *h, Py_ssize_t n, const char *needle, Py_ssize_t m) {
    for (Py_ssize_t i = n - m; i >= 0; i--)
        if (h[i] == needle[0] && memcmp(h + i, needle, (size_t)m) == 0) return h + i;
    return NULL;
}

#define LIT(s) s, (Py_ssize_t)(sizeof(s) - 1)

/* A JSON integer as orjson reads it into a Python int (no leading zeros, at most 18 digits);
 * returns the position after it, or NULL. */
static const char *json_int(const char *p, const char *end, int64_t *value) {
    int neg = 0;
    if (p < end && *p == '-') { neg = 1; p++; }
    const char *digits = p;
    int64_t v = 0;
    while (p < end && *p >= '0' && *p <= '9') { v = v * 10 + (*p - '0'); p++; }
    Py_ssize_t n = p - digits;
    if (n == 0 || n > 18 || (n > 1 && digits[0] == '0')) return NULL;
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return NULL;  /* a float */
    *value = neg ? -v : v;
    return p;
}

/* A compact object of integer, null and (nested) object values; at the top level, the values
 * of completion_tokens and prompt_tokens (-2: absent, -1: null; the last one wins, as in
 * orjson). Anything else (strings, floats, spaces, escapes) is NULL: Python reads it. */
static const char *usage_object(const char *p, const char *end, int depth,
                                int64_t *completion, int64_t *prompt) {
    if (depth > 4 || p >= end || *p != '{') return NULL;
    p++;
    if (p < end && *p == '}') return p + 1;
    for (;;) {
        if (p >= end || *p != '"') return NULL;
        const char *key = ++p;
        while (p < end && *p != '"' && *p != '\\') p++;
        if (p >= end || *p != '"') return NULL;
        Py_ssize_t key_len = p - key;
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
            p = usage_object(p, end, depth + 1, &ignore_c, &ignore_p);
            if (p == NULL || slot != NULL) return NULL;  /* a count that is an object */
        } else if (end - p >= 4 && memcmp(p, "null", 4) == 0) {
            p += 4;
            if (slot != NULL) *slot = -1;
        } else {
            int64_t v;
            p = json_int(p, end, &v);
            if (p == NULL) return NULL;
            if (slot != NULL) {
                /* Kept out of the -1/-2 codes, and past MAX_TOKEN_COUNT not a count
                 * (events.token_count): Python reads it. */
                if (v < 0 || v > MAX_TOKEN_COUNT) return NULL;
                *slot = v;
            }
        }
        if (p < end && *p == ',') { p++; continue; }
        if (p < end && *p == '}') return p + 1;
        return NULL;
    }
}

/* StreamFeed.feed's usual read: exactly one whole one-line event of a JSON object. */
static int one_line_event(const char *d, Py_ssize_t n) {
    if (n < 10 || memcmp(d, "data: {\"", 8) != 0 || memcmp(d + n - 3, "}\n\n", 3) != 0)
        return 0;
    return memchr(d, '\r', (size_t)n) == NULL && memchr(d, '\n', (size_t)(n - 2)) == NULL;
}

/* The event's compact `"usage":{...}` (events.usage_span: the last `"usage":{` and its balanced
 * closing brace), read: its counts (completion_tokens an int), and the span strip_usage cuts. */
static int usage_in(const char *d, Py_ssize_t n, int64_t *completion, int64_t *prompt,
                    Py_ssize_t *cut_from, Py_ssize_t *cut_to) {
    const char *start = rfind(d, n, LIT("\"usage\":{"));
    if (start == NULL) return 0;
    const char *open = start + 8, *end = d + n;
    int64_t c = -2, p = -2;
    const char *close = usage_object(open, end, 0, &c, &p);
    if (close == NULL || c < 0) return 0;  /* completion_tokens must be an int */
    /* usage_span's own balancing, on the raw bytes, must end where the object does. */
    const char *brace = memchr(open, '}', (size_t)(end - open));
    while (brace != NULL) {
        Py_ssize_t opens = 0, closes = 0;
        for (const char *q = open; q <= brace; q++) {
            if (*q == '{') opens++;
            else if (*q == '}') closes++;
        }
        if (opens == closes) break;
        brace = memchr(brace + 1, '}', (size_t)(end - brace - 1));
    }
    if (brace == NULL || brace + 1 != close) return 0;
    *completion = c;
    *prompt = p;  /* -2 absent and -1 null are both None to Python */
    Py_ssize_t from = start - d;
    *cut_from = (from > 0 && d[from - 1] == ',') ? from - 1 : from;
    *cut_to = close - d;
    return 1;
}

/* Is this chunk one whole running token event? Then its counts and the usage's span. */
static int token_event(const char *d, Py_ssize_t n, int64_t *completion, int64_t *prompt,
                       Py_ssize_t *cut_from, Py_ssize_t *cut_to) {
    if (!one_line_event(d, n)) return 0;
    /* StreamFeed._token_chunk's tests. */
    if (find(d, n, LIT("\"choices\":[{")) == NULL || find(d, n, LIT("\"error\":")) != NULL)
        return 0;
    if (count(d, n, LIT("\"finish_reason\":")) != 1
        || find(d, n, LIT("\"finish_reason\":null")) == NULL)
        return 0;
    return usage_in(d, n, completion, prompt, cut_from, cut_to);
}

/* A terminal chunk (stream.py, `info.finished`): one whole one-line event with a choice whose
 * `finish_reason` is a string, and no error. */
static int terminal_event(const char *d, Py_ssize_t n) {
    return one_line_event(d, n) && find(d, n, LIT("\"choices\":[{")) != NULL
           && find(d, n, LIT("\"error\":")) == NULL
           && find(d, n, LIT("\"finish_reason\":\"")) != NULL;
}

/* The closing usage chunk (events.Kind.USAGE): `"choices":[]` and a compact usage, no error. */
static int usage_event(const char *d, Py_ssize_t n, int64_t *completion, int64_t *prompt) {
    Py_ssize_t from, to;
    return one_line_event(d, n) && find(d, n, LIT("\"choices\":[]")) != NULL
           && find(d, n, LIT("\"choices\":[{")) == NULL
           && find(d, n, LIT("\"error\":")) == NULL
           && usage_in(d, n, completion, prompt, &from, &to);
}

#define FINGERPRINT_KEY "\"system_fingerprint\":"

/* events.system_fingerprint: the event's fingerprint as its JSON string, quotes included (0:
 * none, or not a string). */
static int fingerprint_of(const char *d, Py_ssize_t n, const char **fp, Py_ssize_t *fn) {
    const char *key = rfind(d, n, LIT(FINGERPRINT_KEY));
    if (key == NULL) return 0;
    const char *start = key + sizeof(FINGERPRINT_KEY) - 1, *end = d + n;
    if (start >= end || *start != '"') return 0;
    for (const char *q = start + 1; q < end; q++) {
        if (*q != '"') continue;
        Py_ssize_t backslashes = 0;
        while (q[-1 - backslashes] == '\\') backslashes++;
        if (backslashes % 2 == 0) { *fp = start; *fn = q + 1 - start; return 1; }
    }
    return 0;
}

/* -- the thread ---------------------------------------------------------------------------- */

/* The HTTP/1.1 chunk at `f`: 1 whole (its size, and the length of its size line with CRLF in
 * `*head`), 0 not all here yet, -1 not one the thread reads (extensions, bad framing). */
static int chunk_at(const char *f, const char *end, size_t *size, Py_ssize_t *head) {
    const char *q = f;
    size_t n = 0;
    while (q < end && q - f < 8) {
        char ch = *q;
        int v = (ch >= '0' && ch <= '9') ? ch - '0' : (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10
                : (ch >= 'A' && ch <= 'F') ? ch - 'A' + 10 : -1;
        if (v < 0) break;
        n = n * 16 + (size_t)v;
        q++;
    }
    if (q == end) return 0;  /* the size line is not all here yet */
    if (q == f || *q != '\r') return -1;
    if (end - q < 2) return 0;
    if (q[1] != '\n') return -1;
    *size = n;
    *head = q + 2 - f;
    if (n == 0) return 1;  /* the last chunk: its size line is enough to end the body */
    if (*head + (Py_ssize_t)n + 2 > IN_CAP) return -1;
    if (end - f < *head + (Py_ssize_t)n + 2) return 0;
    if (f[*head + n] != '\r' || f[*head + n + 1] != '\n') return -1;
    return 1;
}

static int out_reserve(Stream *s, Py_ssize_t more) {
    if (s->out_len + more <= s->out_cap) return 0;
    Py_ssize_t cap = s->out_cap ? s->out_cap : 4096;
    while (cap < s->out_len + more) cap *= 2;
    char *p = realloc(s->out, (size_t)cap);
    if (p == NULL) return -1;
    s->out = p; s->out_cap = cap;
    return 0;
}

static int out_chunk(Stream *s, const char *a, Py_ssize_t an, const char *b, Py_ssize_t bn) {
    if (out_reserve(s, an + bn + 24) < 0) return -1;
    /* the chunk-size line, lower-case hex as the Python path writes it (no printf per chunk) */
    size_t size = (size_t)(an + bn);
    char hex[2 * sizeof size];
    int h = 0;
    do { hex[h++] = "0123456789abcdef"[size & 15]; size >>= 4; } while (size);
    while (h) s->out[s->out_len++] = hex[--h];
    s->out[s->out_len++] = '\r'; s->out[s->out_len++] = '\n';
    memcpy(s->out + s->out_len, a, (size_t)an); s->out_len += an;
    if (bn) { memcpy(s->out + s->out_len, b, (size_t)bn); s->out_len += bn; }
    memcpy(s->out + s->out_len, "\r\n", 2); s->out_len += 2;
    return 0;
}

static int log_events(Stream *s, const int64_t *ev, Py_ssize_t n) {
    if (s->log_len + n * 3 > s->log_cap) {
        Py_ssize_t cap = s->log_cap ? s->log_cap : 3 * 64;
        while (cap < s->log_len + n * 3) cap *= 2;
        int64_t *p = realloc(s->log, (size_t)cap * sizeof *p);
        if (p == NULL) return -1;
        s->log = p; s->log_cap = cap;
    }
    memcpy(s->log + s->log_len, ev, (size_t)n * 3 * sizeof *ev);
    s->log_len += n * 3;
    return 0;
}

/* While the client is not taking what is written, the upstream is not read: only one of the two
 * descriptors is in the epoll set at a time (an idle one would report a hang-up forever). */
static void block(Stream *s) {
    struct epoll_event ev = {.events = EPOLLOUT | (s->watch_client ? EPOLLRDHUP : 0),
                             .data.ptr = (char *)s + 1};
    epoll_ctl(s->relay->epfd, EPOLL_CTL_DEL, s->up, NULL);
    epoll_ctl(s->relay->epfd, s->watch_client ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s->client, &ev);
    s->blocked = 1;
}

static void unblock(Stream *s) {
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
    if (s->watch_client) {
        struct epoll_event hangup = {.events = EPOLLRDHUP, .data.ptr = (char *)s + 1};
        epoll_ctl(s->relay->epfd, EPOLL_CTL_MOD, s->client, &hangup);
    } else {
        epoll_ctl(s->relay->epfd, EPOLL_CTL_DEL, s->client, NULL);
    }
    epoll_ctl(s->relay->epfd, EPOLL_CTL_ADD, s->up, &ev);
    s->blocked = 0;
}

/* A stream whose client the event loop does not read (its connections may be kept by the
 * front): the thread hears the client's hang-up itself, at once, as the event loop would. */
static int watch_client(Stream *s) {
    struct epoll_event hangup = {.events = EPOLLRDHUP, .data.ptr = (char *)s + 1};
    if (epoll_ctl(s->relay->epfd, EPOLL_CTL_ADD, s->client, &hangup) != 0) return -1;
    s->watch_client = 1;
    return 0;
}

/* Hand the stream back (thread only, lock held): out of epoll and `active`, its descriptors
 * closed; Python hears of it when the current batch of events is done (`publish`), so that
 * nothing later in the batch can touch a stream Python has already let go. */
static void front_let_go(Relay *r, Front *f, int why);

static void hand_back(Relay *r, Stream *s, int ending) {
    s->ending = ending;
    /* Out of the set before the close: the event loop's own descriptors keep the sockets open,
     * and with them the registration. Only one of the two is in the set (`block`). */
    if (s->up >= 0) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->blocked ? s->client : s->up, NULL);
    if (s->up >= 0 && s->watch_client && !s->blocked)
        epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->client, NULL);
    s->watch_client = 0;
    if (s->up >= 0) close(s->up);
    if (s->client >= 0) close(s->client);
    s->up = s->client = -1;
    if (s->front != NULL) {  /* the front's descriptors were the stream's: it goes too, and
                              * its connection object with the stream (`front_conn`) */
        Front *f = s->front;
        s->front = NULL;
        f->stream = NULL;
        f->client = f->up = -1;
        s->f_conn = f->owner;
        f->owner = NULL;
        front_let_go(r, f, FRONT_STREAM);
    }
    if (s->front_request && !s->f_seen) { s->f_seen = 1; r->f_unseen--; }
    if (s->prev) s->prev->next = s->next; else r->active = s->next;
    if (s->next) s->next->prev = s->prev;
    s->prev = NULL;
    s->next = r->retired;
    r->retired = s;
}

static void publish(Relay *r) {
    if (r->retired == NULL) return;
    int urgent = 0;
    Stream *oldest = NULL;  /* `retired` is newest first: Python takes them in their order */
    while (r->retired != NULL) {
        Stream *s = r->retired;
        r->retired = s->next;
        s->next = oldest;
        oldest = s;
    }
    pthread_mutex_lock(&r->lock);
    while (oldest != NULL) {
        Stream *s = oldest;
        oldest = s->next;
        s->next = NULL;
        if (r->done_tail != NULL) r->done_tail->next = s; else r->done = s;
        r->done_tail = s;
        /* Quiet: ended, the response's end written and taken by the client's socket, and no
         * request waiting behind it (`urge`). */
        if (!(s->ending == END_BODY && s->end_written && s->out_len == 0 && !s->urgent))
            urgent = 1;
    }
    pthread_mutex_unlock(&r->lock);
    if (urgent) { wake(r->notify_fd); r->quiet_since = 0; }
    else if (r->quiet_since == 0) r->quiet_since = now_ns();
}

/* A stream that ended with its response's end written waits at most this long for the event
 * loop to take it (`ended()`, on its own wake-ups) before the thread wakes it (`notify`). The
 * client has its whole response; what waits is its record, its last figures and the server's
 * cycle (a request after it on the same connection takes it first, client_leg.py; one already
 * queued behind it, pipelined, asks for a wake-up: `urge`). */
#define QUIET_NS (20 * 1000000LL)

static int quiet_timeout_ms(Relay *r) {
    if (r->quiet_since == 0) return -1;
    int64_t left = r->quiet_since + r->quiet_ns - now_ns();
    if (left > 0) return (int)((left + 999999) / 1000000);
    int waiting;
    pthread_mutex_lock(&r->lock);
    waiting = r->done != NULL;
    pthread_mutex_unlock(&r->lock);
    r->quiet_since = 0;
    if (waiting) wake(r->notify_fd);
    return -1;
}

/* Send what is waiting for the client; 0 all sent, 1 blocked, -1 the client's socket broke. */
static int flush(Stream *s) {
    while (s->out_off < s->out_len) {
        ssize_t w = send(s->client, s->out + s->out_off, (size_t)(s->out_len - s->out_off),
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) { s->out_off += w; continue; }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
        s->err = w < 0 ? errno : EPIPE;
        return -1;
    }
    s->out_len = s->out_off = 0;
    return 0;
}

/* Write the held terminal chunk `d` (`n` bytes) as the Python path writes it once the usage
 * chunk after it is cut (stream.py `_stamped`): its running usage cut when asked (the span at
 * `cut_from`..`cut_to`), then the usage chunk's fingerprint `fp` (none: NULL) where vLLM writes
 * it (events.add_fingerprint: before the last `}`, unless it has one). 0 done, -1 no memory. */
static int out_stamped(Stream *s, const char *d, Py_ssize_t n, Py_ssize_t cut_from,
                       Py_ssize_t cut_to, const char *fp, Py_ssize_t fn) {
    char *buf = malloc((size_t)(n + fn + sizeof(FINGERPRINT_KEY) + 1));
    if (buf == NULL) return -1;
    Py_ssize_t m = 0;
    if (s->strip) {
        memcpy(buf, d, (size_t)cut_from); m = cut_from;
        memcpy(buf + m, d + cut_to, (size_t)(n - cut_to)); m += n - cut_to;
    } else {
        memcpy(buf, d, (size_t)n); m = n;
    }
    int rc;
    const char *brace = rfind(buf, m, LIT("}"));
    if (fp == NULL || brace == NULL || find(buf, m, LIT(FINGERPRINT_KEY)) != NULL) {
        rc = out_chunk(s, buf, m, NULL, 0);
    } else {
        Py_ssize_t at = brace - buf, kn = (Py_ssize_t)sizeof(FINGERPRINT_KEY) - 1;
        memmove(buf + at + 1 + kn + fn, buf + at, (size_t)(m - at));
        buf[at] = ',';
        memcpy(buf + at + 1, FINGERPRINT_KEY, (size_t)kn);
        memcpy(buf + at + 1 + kn, fp, (size_t)fn);
        rc = out_chunk(s, buf, m + 1 + kn + fn, NULL, 0);
    }
    free(buf);
    return rc;
}

/* -- the upstream's head, for a stream started at it --------------------------------------- */

static int tchar(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
           || (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

static int name_is(const char *n, Py_ssize_t len, const char *lit) {
    return (size_t)len == strlen(lit) && strncasecmp(n, lit, (size_t)len) == 0;
}

/* Response headers that describe one hop: never forwarded (asgi.HOP_BY_HOP). */
static int hop_by_hop(const char *n, Py_ssize_t len) {
    static const char *const names[] = {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length", NULL};
    for (int i = 0; names[i] != NULL; i++)
        if (name_is(n, len, names[i])) return 1;
    return 0;
}

/* One header line of a head, from `line` to the CRLF at `end`: a token, a colon (`*colon`),
 * the value from its first non-blank (`*value`, as httptools reads it). -1: not one read
 * plainly. */
static int header_at(const char *line, const char *end, const char **colon,
                     const char **value) {
    const char *c = memchr(line, ':', (size_t)(end - line));
    if (c == NULL || c == line) return -1;
    for (const char *q = line; q < c; q++)
        if (!tchar((unsigned char)*q)) return -1;
    const char *v = c + 1;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    *colon = c;
    *value = v;
    return 0;
}

static void out_put(Stream *s, const char *d, Py_ssize_t n) {
    memcpy(s->out + s->out_len, d, (size_t)n);
    s->out_len += n;
}

/* The upstream's head, while the thread waits for it: 1 taken (the client's head is in `out`,
 * the upstream's copied to `head_raw`, `in` starts with the body), 0 not all here yet, -1
 * Python's (nothing taken). Taken only when the Python path would start the same chunked
 * response (relay.py `on_head`) from a head it reads plainly: `HTTP/1.1 200`, a first
 * `content-type` of `text/event-stream`, one `transfer-encoding: chunked`, no
 * `content-length`, each header line a token, a colon and a value of visible characters (no
 * folded lines). The client's head is Python's prefix (status line, the server's own
 * headers), then the upstream's headers in order, names lower-cased, hop-by-hop ones left
 * out, values as httptools reads them (leading blanks dropped), then `x-request-id` unless
 * the upstream sent one, then Python's suffix: `begin_chunked`'s bytes. */
static int head_take(Stream *s, int64_t now) {
    const char *d = s->in;
    const char *stop = find(d, s->in_len, LIT("\r\n\r\n"));
    if (stop == NULL) return s->in_len >= HEAD_CAP ? -1 : 0;
    Py_ssize_t head_len = stop + 4 - d;
    if (head_len > HEAD_CAP) return -1;
    const char *eol = find(d, head_len, LIT("\r\n"));
    Py_ssize_t status_len = eol - d;
    if (status_len < 12 || memcmp(d, "HTTP/1.1 200", 12) != 0
        || (status_len > 12 && d[12] != ' '))
        return -1;
    for (const char *q = d + 12; q < eol; q++)
        if (((unsigned char)*q < 0x20 && *q != '\t') || *q == 0x7f) return -1;
    if (out_reserve(s, s->head_pre_len + head_len + s->head_rid_len + s->head_post_len) < 0)
        return -1;
    Py_ssize_t out0 = s->out_len;
    out_put(s, s->head_pre, s->head_pre_len);
    int chunked = 0, event_stream = 0, seen_type = 0, has_rid = 0;
    const char *line = eol + 2, *last = stop + 2;
    while (line < last) {
        const char *end = find(line, last - line, LIT("\r\n")), *colon, *value;
        if (header_at(line, end, &colon, &value) < 0) goto python;
        for (const char *q = value; q < end; q++) {
            unsigned char c = (unsigned char)*q;
            if ((c < 0x20 && c != '\t') || c == 0x7f) goto python;
        }
        Py_ssize_t name_len = colon - line, value_len = end - value;
        Py_ssize_t trimmed = value_len;  /* for comparing a value: trailing blanks aside */
        while (trimmed > 0 && (value[trimmed - 1] == ' ' || value[trimmed - 1] == '\t'))
            trimmed--;
        if (name_is(line, name_len, "content-length")) goto python;
        if (name_is(line, name_len, "transfer-encoding")) {
            if (chunked || !(trimmed == 7 && strncasecmp(value, "chunked", 7) == 0))
                goto python;
            chunked = 1;
        } else if (name_is(line, name_len, "content-type") && !seen_type) {
            seen_type = 1;
            event_stream = trimmed >= 17 && strncasecmp(value, "text/event-stream", 17) == 0;
        } else if (name_is(line, name_len, "x-request-id")) {
            has_rid = 1;
        }
        if (!hop_by_hop(line, name_len)) {
            for (const char *q = line; q < colon; q++)
                s->out[s->out_len++] = (*q >= 'A' && *q <= 'Z') ? (char)(*q + 32) : *q;
            out_put(s, ": ", 2);
            out_put(s, value, value_len);
            out_put(s, "\r\n", 2);
        }
        line = end + 2;
    }
    if (!chunked || !event_stream) goto python;
    if (!has_rid) out_put(s, s->head_rid, s->head_rid_len);
    out_put(s, s->head_post, s->head_post_len);
    char *raw = malloc((size_t)head_len);
    if (raw == NULL) goto python;
    memcpy(raw, d, (size_t)head_len);
    pthread_mutex_lock(&s->relay->lock);
    s->head_raw = raw;
    s->head_raw_len = head_len;
    s->head_ns = now;
    pthread_mutex_unlock(&s->relay->lock);
    s->head_state = HEAD_TAKEN;
    memmove(s->in, s->in + head_len, (size_t)(s->in_len - head_len));
    s->in_len -= head_len;
    return 1;
python:
    s->out_len = out0;
    return -1;
}

/* vLLM's role chunk, read as `classify` would: a chat choice whose delta is exactly the role
 * and an empty content, so no output (the one event with a count of 0 taken before the first
 * token: the Python path times nothing for it either). */
static int role_chunk(const char *d, Py_ssize_t n) {
    return find(d, n, LIT("\"delta\":{\"role\":\"assistant\",\"content\":\"\"}")) != NULL
           && count(d, n, LIT("\"delta\":")) == 1 && find(d, n, LIT("\"text\":")) == NULL;
}

enum { TAKE_ON = 0, TAKE_BACK = 1, TAKE_ENDED = 2 };

/* Take the whole chunks at the front of `in` that the thread relays as the Python path would:
 * running token chunks; then the stream's tail, the terminal chunk (held for the usage chunk's
 * fingerprint when that chunk is to be cut), the usage chunk, `[DONE]`, and the body's last
 * chunk. TAKE_BACK when the stream must go back to Python from the first chunk not taken,
 * TAKE_ENDED when the body ended cleanly with this read. */
static int take_chunks(Stream *s, int64_t now) {
    Py_ssize_t pos = 0;
    int back = TAKE_ON;
    int64_t ev[3 * 16];
    Py_ssize_t nev = 0;
    int64_t done_ns = 0;
    Relay *r = s->relay;
#define LOG_EVENT(t, c, p)                                                                \
    do {                                                                                  \
        ev[nev * 3] = (t); ev[nev * 3 + 1] = (c); ev[nev * 3 + 2] = (p);                  \
        if ((c) > s->last_completion) s->last_completion = (c);                           \
        if (++nev == 16) {                                                                \
            pthread_mutex_lock(&r->lock); log_events(s, ev, nev);                         \
            pthread_mutex_unlock(&r->lock); nev = 0;                                      \
        }                                                                                 \
    } while (0)
    while (pos < s->in_len) {
        const char *f = s->in + pos, *end = s->in + s->in_len;
        size_t size;
        Py_ssize_t head;
        int framed = chunk_at(f, end, &size, &head);
        if (framed == 0) break;  /* the rest of this chunk is still to come */
        if (framed < 0) { back = TAKE_BACK; break; }  /* extensions, or not a size: Python */
        if (size == 0) {
            /* The body's last chunk, after `[DONE]`, no trailer, nothing after it: the body
             * ended cleanly (Python writes the client's last chunk). Else Python ends it. */
            if ((s->done_ns || done_ns) && s->held == 0 && end - f == 5
                && memcmp(f, "0\r\n\r\n", 5) == 0) {
                pos += 5;
                back = TAKE_ENDED;
            } else {
                back = TAKE_BACK;
            }
            break;
        }
        if (s->done_ns || done_ns) { back = TAKE_BACK; break; }  /* more after `[DONE]` */
        Py_ssize_t whole = head + (Py_ssize_t)size + 2, n = (Py_ssize_t)size;
        const char *d = f + head;
        int64_t completion, prompt;
        Py_ssize_t cut_from, cut_to;
        int token = token_event(d, n, &completion, &prompt, &cut_from, &cut_to);
        int terminal = !token && terminal_event(d, n);
        if (terminal && !usage_in(d, n, &completion, &prompt, &cut_from, &cut_to)) {
            back = TAKE_BACK;
            break;
        }
        if (s->pending) {
            /* Before the first token (a stream started at its head): that token, or the role
             * chunk; anything else is Python's (how it times a first event depends on more
             * than the count). */
            if (!token || (completion == 0 && !role_chunk(d, n))) { back = TAKE_BACK; break; }
            if (completion > 0) s->pending = 0;
        }
        if (token || (terminal && !s->hold)) {
            /* A running token chunk, or a terminal chunk not held: relayed as it is, its
             * running usage cut when asked. */
            int rc = s->strip ? out_chunk(s, d, cut_from, d + cut_to, n - cut_to)
                              : out_chunk(s, d, n, NULL, 0);
            if (rc < 0) { back = TAKE_BACK; break; }
            LOG_EVENT(now, completion, prompt);
            pos += whole;
            continue;
        }
        if (terminal) {
            /* Held where it is (`in` is moved to start with it below) until a whole chunk
             * follows it: the usage chunk is cut, its fingerprint moved onto this one; any
             * other chunk, or the body's end, sends the stream back with it held. */
            if (s->held == 0) { s->held = whole; s->held_ns = now; }
            const char *g = f + whole;
            size_t next_size;
            Py_ssize_t next_head;
            int next = chunk_at(g, end, &next_size, &next_head);
            if (next == 0) break;
            int64_t seen = completion > s->last_completion ? completion : s->last_completion;
            int64_t usage_completion, usage_prompt;
            if (next < 0 || next_size == 0
                || !usage_event(g + next_head, (Py_ssize_t)next_size, &usage_completion,
                                &usage_prompt)
                || usage_completion > seen) {
                back = TAKE_BACK;
                break;
            }
            const char *fp = NULL;
            Py_ssize_t fn = 0;
            fingerprint_of(g + next_head, (Py_ssize_t)next_size, &fp, &fn);
            if (out_stamped(s, d, n, cut_from, cut_to, fp, fn) < 0) { back = TAKE_BACK; break; }
            LOG_EVENT(s->held_ns, completion, prompt);
            LOG_EVENT(now, usage_completion, usage_prompt);
            s->held = 0;
            pos += whole + next_head + (Py_ssize_t)next_size + 2;
            continue;
        }
        if (usage_event(d, n, &completion, &prompt)) {
            /* Counted tokens only if it raised the count, which the Python path would not. */
            if (s->last_completion < 0 || completion > s->last_completion) {
                back = TAKE_BACK;
                break;
            }
            if (!s->hold && out_chunk(s, d, n, NULL, 0) < 0) { back = TAKE_BACK; break; }
            LOG_EVENT(now, completion, prompt);  /* (cut when it is to be: `hold`) */
            pos += whole;
            continue;
        }
        if (n == 14 && memcmp(d, "data: [DONE]\n\n", 14) == 0) {
            if (out_chunk(s, d, n, NULL, 0) < 0) { back = TAKE_BACK; break; }
            done_ns = now;
            pos += whole;
            continue;
        }
        back = TAKE_BACK;  /* the role chunk, an error, anything else: Python's */
        break;
    }
#undef LOG_EVENT
    pthread_mutex_lock(&r->lock);
    if (nev) log_events(s, ev, nev);
    s->last_read_ns = now;
    if (done_ns) s->done_ns = done_ns;
    pthread_mutex_unlock(&r->lock);
    if (pos) {
        memmove(s->in, s->in + pos, (size_t)(s->in_len - pos));
        s->in_len -= pos;
    }
    return back;
}

/* -- the front: the next request on a kept client connection --------------------------- */

/* Let a front go (thread or Python, lock held): out of epoll and `fronts`, its descriptors
 * closed (unless a stream closed them), onto `closed` for Python with why; the event loop is
 * woken to take it. */
static void front_let_go(Relay *r, Front *f, int why) {
    if (f->client >= 0) {
        if (f->stream == NULL) epoll_ctl(r->epfd, EPOLL_CTL_DEL, f->client, NULL);
        close(f->client);
    }
    if (f->up >= 0) {
        if (f->stream == NULL) epoll_ctl(r->epfd, EPOLL_CTL_DEL, f->up, NULL);
        close(f->up);
    }
    f->client = f->up = -1;
    if (f->prev) f->prev->next = f->next; else r->fronts = f->next;
    if (f->next) f->next->prev = f->prev;
    f->prev = NULL;
    f->why = why;
    f->next = r->closed;
    r->closed = f;
    wake(r->notify_fd);
}

/* A stream ended cleanly, its response's end taken by the client's socket: its connection is
 * kept (lock held). A stream Python started leaves a dormant front for Python to lend or let
 * go (`kept`); a front's own stream leaves its front waiting for the next request. */
static void front_keep(Relay *r, Stream *s) {
    Front *f = s->front;
    if (f == NULL) {
        f = calloc(1, sizeof *f);
        char *buf = f != NULL ? malloc(FRONT_BUF) : NULL;
        if (buf == NULL) { free(f); return; }
        f->buf = buf;
        f->cap = FRONT_BUF;
        f->relay = r;
        f->owner = s->keep;  /* its reference moves to the front */
        s->keep = NULL;
        f->next = r->fronts;
        if (r->fronts) r->fronts->prev = f;
        r->fronts = f;
        s->kept = f;
        f->keeper_unseen = 1;
    } else {
        f->stream = NULL;
        s->front = NULL;
    }
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->up, NULL);
    if (s->watch_client) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->client, NULL);
    s->watch_client = 0;
    f->client = s->client;
    f->up = s->up;
    s->client = s->up = -1;
    f->len = 0;
    f->idle_ns = now_ns();
    /* Idle: the client's next request, and the upstream's close (or anything it sends). */
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = (char *)f + 2};
    struct epoll_event up = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = (char *)f + 3};
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, f->client, &ev) != 0) {
        front_let_go(r, f, FRONT_EOF);
    } else if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, f->up, &up) != 0) {
        front_let_go(r, f, FRONT_EOF);
    }
}

/* JSON, as strictly as orjson reads it: UTF-8 in strings, ASCII elsewhere (anything else:
 * Python's). */
static const char *json_ws(const char *p, const char *e) {
    while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

static int hexdigit(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* `p` at a byte past ASCII: past its UTF-8 sequence, or NULL when that is not one as a strict
 * decoder reads it (an overlong form, a surrogate, past U+10FFFF, cut short): orjson refuses
 * such a body, and Python answers it. */
static const char *utf8_sequence(const char *p, const char *e) {
    const unsigned char *u = (const unsigned char *)p;
    Py_ssize_t more;
    unsigned char low = 0x80, high = 0xBF;
    if (u[0] >= 0xC2 && u[0] <= 0xDF) more = 1;
    else if (u[0] >= 0xE0 && u[0] <= 0xEF) {
        more = 2;
        if (u[0] == 0xE0) low = 0xA0;  /* overlong below */
        else if (u[0] == 0xED) high = 0x9F;  /* U+D800..U+DFFF above */
    } else if (u[0] >= 0xF0 && u[0] <= 0xF4) {
        more = 3;
        if (u[0] == 0xF0) low = 0x90;
        else if (u[0] == 0xF4) high = 0x8F;  /* past U+10FFFF above */
    } else {
        return NULL;
    }
    if (e - p <= more || u[1] < low || u[1] > high) return NULL;
    for (Py_ssize_t i = 2; i <= more; i++)
        if (u[i] < 0x80 || u[i] > 0xBF) return NULL;
    return p + more + 1;
}

static const char *json_string(const char *p, const char *e, int *escaped) {
    if (p >= e || *p != '"') return NULL;
    p++;
    while (p < e) {
        unsigned char c = (unsigned char)*p;
        if (c == '"') return p + 1;
        if (c < 0x20) return NULL;
        if (c >= 0x80) {
            if ((p = utf8_sequence(p, e)) == NULL) return NULL;
            continue;
        }
        if (c == '\\') {
            if (escaped) *escaped = 1;
            p++;
            if (p >= e) return NULL;
            if (*p == 'u') {
                if (e - p < 5 || !hexdigit(p[1]) || !hexdigit(p[2]) || !hexdigit(p[3])
                    || !hexdigit(p[4]))
                    return NULL;
                /* a surrogate's escape: orjson's rules for pairs are Python's to apply */
                if ((p[1] == 'd' || p[1] == 'D') && strchr("89abcdefABCDEF", p[2]) != NULL)
                    return NULL;
                p += 5;
                continue;
            }
            /* (strchr finds the literal's own NUL) */
            if (*p == 0 || strchr("\"\\/bfnrt", *p) == NULL) return NULL;
        }
        p++;
    }
    return NULL;
}

static const char *json_number(const char *p, const char *e) {
    if (p < e && *p == '-') p++;
    if (p >= e) return NULL;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') { while (p < e && *p >= '0' && *p <= '9') p++; }
    else return NULL;
    if (p < e && *p == '.') {
        p++;
        if (p >= e || !(*p >= '0' && *p <= '9')) return NULL;
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        if (p >= e || !(*p >= '0' && *p <= '9')) return NULL;
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    return p;
}

static const char *json_value(const char *p, const char *e, int depth) {
    if (p >= e || depth > 64) return NULL;
    switch (*p) {
    case '"': return json_string(p, e, NULL);
    case 't': return (e - p >= 4 && memcmp(p, "true", 4) == 0) ? p + 4 : NULL;
    case 'f': return (e - p >= 5 && memcmp(p, "false", 5) == 0) ? p + 5 : NULL;
    case 'n': return (e - p >= 4 && memcmp(p, "null", 4) == 0) ? p + 4 : NULL;
    case '[':
        p = json_ws(p + 1, e);
        if (p < e && *p == ']') return p + 1;
        for (;;) {
            p = json_value(p, e, depth + 1);
            if (p == NULL) return NULL;
            p = json_ws(p, e);
            if (p < e && *p == ',') { p = json_ws(p + 1, e); continue; }
            if (p < e && *p == ']') return p + 1;
            return NULL;
        }
    case '{':
        p = json_ws(p + 1, e);
        if (p < e && *p == '}') return p + 1;
        for (;;) {
            p = json_string(p, e, NULL);
            if (p == NULL) return NULL;
            p = json_ws(p, e);
            if (p >= e || *p != ':') return NULL;
            p = json_value(json_ws(p + 1, e), e, depth + 1);
            if (p == NULL) return NULL;
            p = json_ws(p, e);
            if (p < e && *p == ',') { p = json_ws(p + 1, e); continue; }
            if (p < e && *p == '}') return p + 1;
            return NULL;
        }
    default: return json_number(p, e);
    }
}

/* A non-empty object's members, one at a time: `*p` at a member's key (after `{`, or after
 * the last call), its key (unescaped, else NULL: Python's) and value spans out, `*p` moved
 * past its separator; 1 another member follows, 0 this was the last (`*p` past the `}`), -1
 * not read plainly. */
static int json_member(const char **p, const char *e, int depth, const char **key,
                       Py_ssize_t *key_len, const char **value, Py_ssize_t *value_len) {
    int escaped = 0;
    const char *q = json_string(*p, e, &escaped);
    if (q == NULL || escaped) return -1;
    *key = *p + 1;
    *key_len = q - *p - 2;
    q = json_ws(q, e);
    if (q >= e || *q != ':') return -1;
    *value = json_ws(q + 1, e);
    q = json_value(*value, e, depth);
    if (q == NULL) return -1;
    *value_len = q - *value;
    q = json_ws(q, e);
    if (q < e && *q == ',') { *p = json_ws(q + 1, e); return 1; }
    if (q < e && *q == '}') { *p = q + 1; return 0; }
    return -1;
}

/* `p` at an object: past its `{` to its first member; NULL when it is not one or empty. */
static const char *json_members(const char *p, const char *e) {
    if (p >= e || *p != '{') return NULL;
    p = json_ws(p + 1, e);
    return (p < e && *p == '}') ? NULL : p;
}

static int is_literal(const char *value, Py_ssize_t len, const char *lit) {
    return (size_t)len == strlen(lit) && memcmp(value, lit, (size_t)len) == 0;
}

/* The client's own `stream_options` (an object): 1 when it asks for usage on every chunk
 * (`include_usage` and `continuous_usage_stats` both `true`, the last of each name as
 * orjson keeps it), which `plan_request` forwards as it is; 0 anything else. */
static int options_continuous(const char *p, const char *e) {
    int usage = 0, continuous = 0, more = 1;
    if ((p = json_members(p, e)) == NULL) return 0;
    while (more) {
        const char *key, *value;
        Py_ssize_t key_len, value_len;
        if ((more = json_member(&p, e, 2, &key, &key_len, &value, &value_len)) < 0) return 0;
        int yes = is_literal(value, value_len, "true");
        if (is_literal(key, key_len, "include_usage")) usage = yes;
        else if (is_literal(key, key_len, "continuous_usage_stats")) continuous = yes;
    }
    return usage && continuous;
}

/* The plan `plan_request` makes, for the plain cases alone: a JSON object with `"stream":
 * true`, `n` absent, null or 1, no escaped key, and either no `stream_options` (1: the member
 * is appended, usage cut from the client's stream) or the client's own asking for usage on
 * every chunk (2: the body goes as it is, and so does the stream); the `model` value's span.
 * 0 anything else (Python's). */
static int body_plain(const char *b, Py_ssize_t n, const char **model, Py_ssize_t *model_len) {
    const char *p = json_ws(b, b + n), *e = b + n;
    int stream = 0, single = 1, options = 0, more = 1;
    *model = NULL;
    *model_len = 0;
    if ((p = json_members(p, e)) == NULL) return 0;
    while (more) {
        const char *key, *value;
        Py_ssize_t key_len, value_len;
        if ((more = json_member(&p, e, 1, &key, &key_len, &value, &value_len)) < 0) return 0;
        if (is_literal(key, key_len, "stream"))
            stream = is_literal(value, value_len, "true");
        else if (is_literal(key, key_len, "stream_options"))
            options = options_continuous(value, value + value_len) ? 2 : -1;
        else if (is_literal(key, key_len, "n"))
            single = is_literal(value, value_len, "null") || is_literal(value, value_len, "1");
        else if (is_literal(key, key_len, "model")) {
            *model = value;
            *model_len = value_len;
        }
    }
    if (json_ws(p, e) != e || !stream || !single || options < 0) return 0;
    return options == 2 ? 2 : 1;
}

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static int64_t wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The `date` header as uvicorn writes it (RFC 7231's IMF-fixdate), made once a second. */
static const char *http_date(Relay *r, int64_t wall) {
    int64_t sec = wall / 1000000000LL;
    if (sec != r->f_date_s) {
        static const char *days[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
        static const char *months[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug",
                                       "Sep", "Oct", "Nov", "Dec"};
        time_t t = (time_t)sec;
        struct tm tm;
        gmtime_r(&t, &tm);
        snprintf(r->f_date, sizeof r->f_date, "%s, %02d %s %04d %02d:%02d:%02d GMT",
                 days[tm.tm_wday], tm.tm_mday, months[tm.tm_mon], tm.tm_year + 1900,
                 tm.tm_hour, tm.tm_min, tm.tm_sec);
        r->f_date_s = sec;
    }
    return r->f_date;
}

static int grow(char **buf, Py_ssize_t *len, Py_ssize_t *cap, const char *d, Py_ssize_t n) {
    if (*len + n > *cap) {
        Py_ssize_t c = *cap ? *cap : 1024;
        while (c < *len + n) c *= 2;
        char *p = realloc(*buf, (size_t)c);
        if (p == NULL) return -1;
        *buf = p; *cap = c;
    }
    memcpy(*buf + *len, d, (size_t)n);
    *len += n;
    return 0;
}

#define PUT(d, n) do { if (grow(&req, &req_len, &req_cap, (d), (n)) < 0) goto fail; } while (0)
#define PUTS(s) PUT((s), (Py_ssize_t)strlen(s))

/* Send all of a request to the upstream; 0 sent, else how much went before it failed (so
 * -1: nothing). A request longer than the socket's room waits for the upstream to read it,
 * at most SEND_WAIT_MS in all (an upstream reads a request at once). */
#define SEND_WAIT_MS 1000
static Py_ssize_t send_all(int fd, const char *d, Py_ssize_t n) {
    Py_ssize_t off = 0;
    int waited = 0;
    while (off < n) {
        ssize_t w = send(fd, d + off, (size_t)(n - off), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) { off += w; continue; }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && waited < SEND_WAIT_MS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            poll(&p, 1, 10);
            waited += 10;
            continue;
        }
        return off > 0 ? off : -1;
    }
    return 0;
}

/* The request at the front of `buf`: 1 taken (sent upstream, its stream started), 0 not all
 * here yet, -1 Python's (nothing taken). */
static int front_request(Relay *r, Front *f) {
    const char *d = f->buf;
    Py_ssize_t len = f->len;
    const char *stop = find(d, len, LIT("\r\n\r\n"));
    if (stop == NULL) return len >= HEAD_CAP ? -1 : 0;
    Py_ssize_t head_len = stop + 4 - d;
    const char *eol = find(d, head_len, LIT("\r\n"));
    Py_ssize_t line_len = eol - d;
    int endpoint;
    const char *target;
    Py_ssize_t target_len;
    if (line_len == 29 && memcmp(d, "POST /v1/completions HTTP/1.1", 29) == 0) {
        endpoint = 0; target = d + 5; target_len = 15;
    } else if (line_len == 34 && memcmp(d, "POST /v1/chat/completions HTTP/1.1", 34) == 0) {
        endpoint = 1; target = d + 5; target_len = 20;
    } else {
        return -1;
    }
    /* The headers: forwarded ones copied, as the Python path forwards them. */
    char *req = NULL;
    Py_ssize_t req_len = 0, req_cap = 0;
    Py_ssize_t body_len = -1;
    const char *rid = NULL;
    Py_ssize_t rid_len = 0;
    Stream *s = NULL;
    int broken = 0;
    PUTS("POST ");
    PUT(r->f_prefix, r->f_prefix_len);
    PUT(target, target_len);
    PUTS(" HTTP/1.1\r\nhost: ");
    PUT(r->f_host, r->f_host_len);
    PUTS("\r\n");
    const char *line = eol + 2, *last = stop + 2;
    while (line < last) {
        const char *end = find(line, last - line, LIT("\r\n")), *colon, *value;
        if (header_at(line, end, &colon, &value) < 0) goto python;
        Py_ssize_t value_len = end - value;
        while (value_len > 0 && (value[value_len - 1] == ' ' || value[value_len - 1] == '\t'))
            value_len--;
        for (Py_ssize_t i = 0; i < value_len; i++) {
            unsigned char c = (unsigned char)value[i];
            if ((c < 0x20 && c != '\t') || c >= 0x7f) goto python;
        }
        Py_ssize_t name_len = colon - line;
        if (name_is(line, name_len, "content-length")) {
            if (body_len >= 0 || value_len == 0 || value_len > 12) goto python;
            body_len = 0;
            for (Py_ssize_t i = 0; i < value_len; i++) {
                if (value[i] < '0' || value[i] > '9') goto python;
                body_len = body_len * 10 + (value[i] - '0');
            }
        } else if (name_is(line, name_len, "connection")) {
            if (!(value_len == 10 && strncasecmp(value, "keep-alive", 10) == 0)) goto python;
        } else if (name_is(line, name_len, "transfer-encoding") || name_is(line, name_len, "expect")
                   || name_is(line, name_len, "upgrade")
                   || name_is(line, name_len, "x-phasewatch-run-id")) {
            goto python;
        } else if (name_is(line, name_len, "x-request-id")) {
            if (rid != NULL || value_len == 0 || value_len > 200) goto python;
            rid = value; rid_len = value_len;
        } else if (!hop_by_hop(line, name_len)
                   && !(name_len == r->f_admin_len
                        && strncasecmp(line, r->f_admin, (size_t)name_len) == 0)) {
            for (const char *q = line; q < colon; q++) {
                char c = (*q >= 'A' && *q <= 'Z') ? (char)(*q + 32) : *q;
                PUT(&c, 1);
            }
            PUTS(": ");
            PUT(value, value_len);
            PUTS("\r\n");
        }
        line = end + 2;
    }
    if (body_len < 0 || body_len > r->f_max_body || head_len + body_len > FRONT_CAP) goto python;
    if (len < head_len + body_len) { free(req); return 0; }
    if (len > head_len + body_len) goto python;  /* pipelined behind it: Python's */
    const char *body = d + head_len, *model;
    Py_ssize_t model_len;
    int plan = body_plain(body, body_len, &model, &model_len);
    if (plan == 0) goto python;
    pthread_mutex_lock(&r->lock);
    s = r->spares;
    if (s != NULL) r->spares = s->next;
    pthread_mutex_unlock(&r->lock);
    if (s == NULL) goto python;
    s->next = NULL;
    if (s->in == NULL && (s->in = malloc(IN_CAP)) == NULL) goto spare;
    if (rid == NULL) {
        uint64_t a = splitmix(&r->f_rng), b = splitmix(&r->f_rng);
        snprintf(s->f_rid, sizeof s->f_rid, "%016llx%016llx", (unsigned long long)a,
                 (unsigned long long)b);
        rid = s->f_rid; rid_len = 32;
    } else {
        memcpy(s->f_rid, rid, (size_t)rid_len);  /* at most 200 bytes (above) */
        s->f_rid[rid_len] = 0;
    }
    /* The body with `stream_options` appended before its closing brace (`_with_options`). */
    Py_ssize_t text = body_len;
    while (text > 0 && strchr(" \t\r\n", body[text - 1]) != NULL) text--;
    static const char member[] =
        ",\"stream_options\":{\"include_usage\":true,\"continuous_usage_stats\":true}";
    Py_ssize_t new_len = body_len + (Py_ssize_t)sizeof(member) - 1;
    char cl[64];
    if (plan == 2) new_len = body_len;  /* the client's own options: the body as it came */
    PUTS("x-request-id: ");
    PUT(rid, rid_len);
    snprintf(cl, sizeof cl, "\r\ncontent-length: %lld\r\n\r\n", (long long)new_len);
    PUTS(cl);
    if (plan == 2) {
        PUT(body, body_len);
    } else {
        PUT(body, text - 1);
        PUT(member, (Py_ssize_t)sizeof(member) - 1);
        PUT(body + text - 1, body_len - text + 1);
    }
    /* The stream, as `start(..., head=...)` makes one. */
    int64_t wall = f->first_wall_ns;
    char pre[128];
    int pre_n = r->f_date_on
        ? snprintf(pre, sizeof pre, "HTTP/1.1 200 OK\r\ndate: %s\r\n", http_date(r, wall_ns()))
        : snprintf(pre, sizeof pre, "HTTP/1.1 200 OK\r\n");
    s->head_pre = malloc((size_t)(pre_n + r->f_rest_len + 1));
    s->head_rid = malloc((size_t)rid_len + 20);
    s->head_post = malloc(32);
    s->f_model = model_len ? malloc((size_t)model_len) : NULL;
    s->f_req = malloc((size_t)len);
    if (s->head_pre == NULL || s->head_rid == NULL || s->head_post == NULL
        || (model_len && s->f_model == NULL) || s->f_req == NULL)
        goto spare;
    memcpy(s->f_req, d, (size_t)len);
    s->f_req_len = len;
    memcpy(s->head_pre, pre, (size_t)pre_n);
    memcpy(s->head_pre + pre_n, r->f_rest, (size_t)r->f_rest_len);
    s->head_pre_len = pre_n + r->f_rest_len;
    memcpy(s->head_rid, "x-request-id: ", 14);
    memcpy(s->head_rid + 14, rid, (size_t)rid_len);
    memcpy(s->head_rid + 14 + rid_len, "\r\n", 2);
    s->head_rid_len = 14 + rid_len + 2;
    memcpy(s->head_post, "transfer-encoding: chunked\r\n\r\n", 30);
    s->head_post_len = 30;
    if (model_len) memcpy(s->f_model, model, (size_t)model_len);
    s->f_model_len = model_len;
    int64_t sending_ns = now_ns();  /* the relay starting to send it (proxy queue's end) */
    Py_ssize_t failed = send_all(f->up, req, req_len);
    if (failed != 0) {  /* nothing went: Python's, on the same connection; part went: it is
                         * closed, and the request goes to Python for a new one */
        broken = failed > 0;
        goto spare;
    }
    free(req);
    s->up = f->up;
    s->client = f->client;
    s->strip = s->hold = plan == 1;  /* usage the client did not ask for is cut */
    s->last_completion = -1;
    s->head_state = HEAD_WAIT;
    s->pending = 1;
    s->unpolled_first = 1;
    s->front = f;
    s->front_request = 1;
    s->f_arrival_ns = f->first_ns;
    s->f_wall_ns = wall;
    s->f_sent_ns = sending_ns;
    s->f_endpoint = endpoint;
    s->last_read_ns = s->polled_ns = now_ns();
    f->stream = s;
    f->len = 0;
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, f->client, NULL);
    epoll_ctl(r->epfd, EPOLL_CTL_DEL, f->up, NULL);
    pthread_mutex_lock(&r->lock);
    s->f_in_flight = r->py_in_flight + r->f_unseen;
    r->f_unseen++;
    s->next = r->active;
    if (r->active) r->active->prev = s;
    r->active = s;
    pthread_mutex_unlock(&r->lock);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
    epoll_ctl(r->epfd, EPOLL_CTL_ADD, s->up, &ev);
    watch_client(s);
    return 1;
spare:
    free(s->head_pre); free(s->head_rid); free(s->head_post); free(s->f_model); free(s->f_req);
    s->head_pre = s->head_rid = s->head_post = s->f_model = s->f_req = NULL;
    pthread_mutex_lock(&r->lock);
    s->next = r->spares;
    r->spares = s;
    pthread_mutex_unlock(&r->lock);
fail:
python:
    free(req);
    return broken ? -2 : -1;
}

#undef PUT
#undef PUTS

/* An idle front's upstream closed, or sent what nobody asked for: the front goes back to
 * Python, with what the client sent of its next request so far. */
static void front_upstream(Relay *r, Front *f) {
    if (f->up < 0 || f->stream != NULL) return;
    pthread_mutex_lock(&r->lock);
    front_let_go(r, f, FRONT_BROKEN);
    pthread_mutex_unlock(&r->lock);
}

/* A kept front's client is readable: the next request's bytes, or its close. */
static void front_ready(Relay *r, Front *f) {
    if (f->client < 0 || f->stream != NULL) return;
    if (f->len >= f->cap) {
        char *bigger = f->cap < FRONT_CAP ? realloc(f->buf, (size_t)f->cap * 2) : NULL;
        if (bigger == NULL) {
            pthread_mutex_lock(&r->lock); front_let_go(r, f, FRONT_PYTHON);
            pthread_mutex_unlock(&r->lock); return;
        }
        f->buf = bigger;
        f->cap *= 2;
    }
    ssize_t n = recv(f->client, f->buf + f->len, (size_t)(f->cap - f->len), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) {
        pthread_mutex_lock(&r->lock); front_let_go(r, f, f->len ? FRONT_PYTHON : FRONT_EOF);
        pthread_mutex_unlock(&r->lock); return;
    }
    if (f->len == 0) { f->first_ns = now_ns(); f->first_wall_ns = wall_ns(); }
    f->len += n;
    int taken = front_request(r, f);
    if (taken < 0) {
        pthread_mutex_lock(&r->lock);
        front_let_go(r, f, taken == -2 ? FRONT_BROKEN : FRONT_PYTHON);
        pthread_mutex_unlock(&r->lock);
    }
}

/* The upstream is readable: one read, its chunks taken, sent on. */
static void upstream_ready(Relay *r, Stream *s) {
    if (s->in_len >= IN_CAP) { pthread_mutex_lock(&r->lock); hand_back(r, s, END_HANDOVER);
                               pthread_mutex_unlock(&r->lock); return; }
    ssize_t n = recv(s->up, s->in + s->in_len, (size_t)(IN_CAP - s->in_len), MSG_DONTWAIT);
    int64_t now = now_ns();
    int ending = END_NONE;
    if (n > 0) {
        s->in_len += n;
        s->leftover_ns = now;
        int taken = TAKE_ON;
        int head = s->head_state == HEAD_WAIT ? head_take(s, now) : 1;
        if (head < 0) {
            taken = TAKE_BACK;  /* not a head the thread takes: Python reads it all */
        } else if (head == 0) {  /* the head is not all here yet */
            pthread_mutex_lock(&r->lock);
            s->last_read_ns = now;
            pthread_mutex_unlock(&r->lock);
        } else {
            taken = take_chunks(s, now);
        }
        if (taken == TAKE_BACK) ending = END_HANDOVER;
        else if (taken == TAKE_ENDED) ending = END_BODY;
    } else if (n == 0) {
        ending = END_UPSTREAM_EOF;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        return;
    } else {
        s->err = errno;
        ending = END_UPSTREAM_ERROR;
    }
    /* At the body's end, this read's output goes out with the response's end (the 0-size
     * chunk), here; or, without the memory for it, from Python. */
    int sent = 0;
    if (ending == END_BODY && out_chunk(s, "", 0, NULL, 0) == 0) s->end_written = 1;
    if (ending != END_BODY || s->end_written) sent = flush(s);
    pthread_mutex_lock(&r->lock);
    if (sent < 0) {
        hand_back(r, s, END_CLIENT_ERROR);
    } else if (ending != END_NONE) {  /* at the end, what the client did not take is `unsent` */
        if (ending == END_BODY && sent == 0 && s->end_written && s->in_len == 0 && s->held == 0
            && (s->keep != NULL || s->front != NULL) && !r->closing && r->front_on)
            front_keep(r, s);
        hand_back(r, s, ending);
    } else if (sent == 1) {
        s->blocked_since_ns = now;
        block(s);
    }
    pthread_mutex_unlock(&r->lock);
}

/* The blocked client can take more (or its socket broke). */
static void client_ready(Relay *r, Stream *s, uint32_t events) {
    if (!(events & (EPOLLERR | EPOLLHUP | EPOLLRDHUP)) && !s->blocked) return;
    int sent = (events & (EPOLLERR | EPOLLHUP | EPOLLRDHUP)) ? -1 : flush(s);
    if (sent < 0 && !s->err) s->err = EPIPE;
    pthread_mutex_lock(&r->lock);
    if (sent < 0) {
        hand_back(r, s, END_CLIENT_ERROR);
    } else if (sent == 0) {
        s->blocked_since_ns = 0;
        unblock(s);
    }
    pthread_mutex_unlock(&r->lock);
}

static void *run(void *arg) {
    Relay *r = arg;
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(r->epfd, evs, MAX_EVENTS, quiet_timeout_ms(r));
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (int i = 0; i < n; i++) {
            void *ptr = evs[i].data.ptr;
            if (ptr == NULL) {  /* Python asked: stop streams, or close */
                uint64_t v;
                ssize_t rd = read(r->wake_fd, &v, sizeof v);
                (void)rd;
                pthread_mutex_lock(&r->lock);
                Stream *s = r->active;
                while (s != NULL) {
                    Stream *next = s->next;
                    if (s->stop_asked || r->closing) hand_back(r, s, END_ASKED);
                    s = next;
                }
                /* The front stopped, or idle connections expire: they go back (the server's
                 * keep-alive timeout applies to them from there). */
                if (!r->front_on || r->f_expire) {
                    Front *f = r->fronts;
                    while (f != NULL) {
                        Front *next = f->next;
                        if (f->stream == NULL && !r->front_on)
                            front_let_go(r, f, f->len ? FRONT_PYTHON : FRONT_ASKED);
                        else if (f->stream == NULL && f->len == 0 && f->idle_ns < r->f_expire)
                            front_let_go(r, f, FRONT_EXPIRED);
                        f = next;
                    }
                    r->f_expire = 0;
                }
                int closing = r->closing;
                pthread_mutex_unlock(&r->lock);
                if (closing) { publish(r); return NULL; }
                continue;
            }
            uintptr_t tag = (uintptr_t)ptr & 3;
            if (tag == 2) { front_ready(r, (Front *)((uintptr_t)ptr & ~(uintptr_t)3)); continue; }
            if (tag == 3) { front_upstream(r, (Front *)((uintptr_t)ptr & ~(uintptr_t)3)); continue; }
            Stream *s = (Stream *)((uintptr_t)ptr & ~(uintptr_t)3);
            if (s->up < 0) continue;  /* handed back earlier in this batch */
            if (tag) client_ready(r, s, evs[i].events);
            else if (!s->blocked) upstream_ready(r, s);
        }
        publish(r);
    }
    return NULL;
}

/* -- Python: Stream ------------------------------------------------------------------------ */

static void Stream_dealloc(Stream *s) {
    Py_XDECREF(s->owner);
    Py_XDECREF(s->keep);
    Py_XDECREF(s->f_conn);
    free(s->f_model);
    free(s->f_req);
    free(s->in); free(s->out); free(s->log);
    free(s->head_pre); free(s->head_rid); free(s->head_post); free(s->head_raw);
    Py_XDECREF((PyObject *)s->relay);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Stream_poll(Stream *s, PyObject *Py_UNUSED(ignored)) {
    /* (events, last read, blocked since): the events logged since the last poll, as bytes of
     * native int64 triples; the time of the last read; when the client stopped reading (0). */
    Relay *r = s->relay;
    PyObject *events;
    int64_t last, blocked;
    pthread_mutex_lock(&r->lock);  /* the thread holds it briefly and never needs the GIL */
    events = PyBytes_FromStringAndSize((const char *)s->log, s->log_len * 8);
    for (Py_ssize_t i = 1; s->unpolled_first && i < s->log_len; i += 3)
        if (s->log[i] > 0) s->unpolled_first = 0;  /* a running completion count past 0 */
    s->log_len = 0;
    s->polled_ns = now_ns();
    last = s->last_read_ns;
    blocked = s->blocked_since_ns;
    pthread_mutex_unlock(&r->lock);
    if (events == NULL) return NULL;
    return Py_BuildValue("(NLL)", events, (long long)last, (long long)blocked);
}

static PyObject *Stream_clocks(Stream *s, PyObject *Py_UNUSED(ignored)) {
    /* (last read, blocked since), as `poll` gives them, leaving the logged events where they
     * are: what the live registry's timeouts read on a pass that replays nothing. */
    Relay *r = s->relay;
    int64_t last, blocked;
    pthread_mutex_lock(&r->lock);
    last = s->last_read_ns;
    blocked = s->blocked_since_ns;
    pthread_mutex_unlock(&r->lock);
    return Py_BuildValue("(LL)", (long long)last, (long long)blocked);
}

static PyObject *Stream_urge(Stream *s, PyObject *Py_UNUSED(ignored)) {
    /* A request waits behind this stream's response on its client's connection: its end is
     * published with a wake-up of the event loop, not quietly; if it was already, the event
     * loop is woken now to take it. */
    Relay *r = s->relay;
    pthread_mutex_lock(&r->lock);
    s->urgent = 1;
    int ended = s->ending != END_NONE;
    pthread_mutex_unlock(&r->lock);
    if (ended) wake(r->notify_fd);
    Py_RETURN_NONE;
}

static PyObject *Stream_stop(Stream *s, PyObject *Py_UNUSED(ignored)) {
    Relay *r = s->relay;
    pthread_mutex_lock(&r->lock);
    s->stop_asked = 1;
    pthread_mutex_unlock(&r->lock);
    wake(r->wake_fd);
    Py_RETURN_NONE;
}

static PyObject *Stream_leftover(Stream *s, void *Py_UNUSED(c)) {
    /* After the hand-back: the upstream's bytes not taken (from a chunk's first byte). */
    if (s->ending == END_NONE) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(s->in, s->in_len);
}

static PyObject *Stream_unsent(Stream *s, void *Py_UNUSED(c)) {
    /* After the hand-back: framed output the client has not taken yet. */
    if (s->ending == END_NONE || s->ending == END_CLIENT_ERROR) return PyBytes_FromString("");
    return PyBytes_FromStringAndSize(s->out + s->out_off, s->out_len - s->out_off);
}

static PyObject *Stream_done_ns(Stream *s, void *Py_UNUSED(c)) {
    /* The time of the read that brought `[DONE]` (0: it has not come). */
    Relay *r = s->relay;
    pthread_mutex_lock(&r->lock);
    int64_t done = s->done_ns;
    pthread_mutex_unlock(&r->lock);
    return PyLong_FromLongLong((long long)done);
}

static PyObject *Stream_head(Stream *s, void *Py_UNUSED(c)) {
    /* The upstream's head, once the thread has taken it (None: not, or never). */
    Relay *r = s->relay;
    PyObject *head = NULL;
    pthread_mutex_lock(&r->lock);
    if (s->head_raw != NULL) head = PyBytes_FromStringAndSize(s->head_raw, s->head_raw_len);
    pthread_mutex_unlock(&r->lock);
    if (head == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return head;
}

static PyObject *Stream_kept(Stream *s, void *Py_UNUSED(c)) {
    /* A front was kept at this stream's clean end (its connections are the thread's). */
    Relay *r = s->relay;
    pthread_mutex_lock(&r->lock);
    int kept = s->kept != NULL;
    pthread_mutex_unlock(&r->lock);
    return PyBool_FromLong(kept);
}

static PyObject *Stream_front(Stream *s, void *Py_UNUSED(c)) {
    /* A front's request: (request id, arrival, wall clock at arrival, sending, model JSON or
     * None, endpoint 0/1, requests in flight at arrival); None for a stream Python started. */
    if (!s->front_request) Py_RETURN_NONE;
    PyObject *model = s->f_model != NULL
        ? PyBytes_FromStringAndSize(s->f_model, s->f_model_len) : Py_NewRef(Py_None);
    if (model == NULL) return NULL;
    return Py_BuildValue("(yLLLNii)", s->f_rid, (long long)s->f_arrival_ns,
                         (long long)s->f_wall_ns, (long long)s->f_sent_ns, model, s->f_endpoint,
                         s->f_in_flight);
}

static PyObject *Stream_front_request(Stream *s, void *Py_UNUSED(c)) {
    /* A front's request: the client's bytes as the thread read them (None: not one). */
    if (s->f_req == NULL) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(s->f_req, s->f_req_len);
}

static PyMemberDef Stream_members[] = {
    {"owner", T_OBJECT, offsetof(Stream, owner), 0, "the relay's exchange"},
    {"ending", T_INT, offsetof(Stream, ending), READONLY, "why it came back (0: it has not)"},
    {"errno", T_INT, offsetof(Stream, err), READONLY, "errno of a broken socket"},
    {"leftover_ns", T_LONGLONG, offsetof(Stream, leftover_ns), READONLY,
     "time of the read the leftover (after `held`) came in"},
    {"end_written", T_INT, offsetof(Stream, end_written), READONLY,
     "(ENDED) the response's end went out with the rest, but for what `unsent` holds"},
    {"held", T_PYSSIZET, offsetof(Stream, held), READONLY,
     "bytes at the leftover's front held as a terminal chunk (0: none)"},
    {"held_ns", T_LONGLONG, offsetof(Stream, held_ns), READONLY,
     "time of the read that completed the held chunk"},
    {"head_ns", T_LONGLONG, offsetof(Stream, head_ns), READONLY,
     "time of the read that completed the upstream's head (once `head` is not None)"},
    {"front_conn", T_OBJECT, offsetof(Stream, f_conn), READONLY,
     "a front's stream: its connection object, once the front went with it"},
    {NULL},
};

static PyGetSetDef Stream_getset[] = {
    {"leftover", (getter)Stream_leftover, NULL, NULL, NULL},
    {"unsent", (getter)Stream_unsent, NULL, NULL, NULL},
    {"done_ns", (getter)Stream_done_ns, NULL, NULL, NULL},
    {"head", (getter)Stream_head, NULL, NULL, NULL},
    {"kept", (getter)Stream_kept, NULL, NULL, NULL},
    {"front", (getter)Stream_front, NULL, NULL, NULL},
    {"front_request", (getter)Stream_front_request, NULL, NULL, NULL},
    {NULL},
};

static PyMethodDef Stream_methods[] = {
    {"poll", (PyCFunction)Stream_poll, METH_NOARGS, NULL},
    {"clocks", (PyCFunction)Stream_clocks, METH_NOARGS, NULL},
    {"stop", (PyCFunction)Stream_stop, METH_NOARGS, NULL},
    {"urge", (PyCFunction)Stream_urge, METH_NOARGS, NULL},
    {NULL},
};

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phasewatch.proxy._native.Stream",
    .tp_basicsize = sizeof(Stream),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Stream_dealloc,
    .tp_members = Stream_members,
    .tp_getset = Stream_getset,
    .tp_methods = Stream_methods,
};

/* -- Python: Relay ------------------------------------------------------------------------- */

static PyObject *Relay_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    /* Relay(quiet_ms=20): how long a stream that ended quietly waits for the event loop's own
     * wake-up at most (tests lengthen it, to tell a wake-up asked for from this one). */
    static char *names[] = {"quiet_ms", NULL};
    long long quiet_ms = QUIET_NS / 1000000;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|L", names, &quiet_ms)) return NULL;
    if (quiet_ms < 0) {
        PyErr_SetString(PyExc_ValueError, "quiet_ms must not be negative");
        return NULL;
    }
    Relay *r = (Relay *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    r->quiet_ns = (int64_t)quiet_ms * 1000000;
    r->epfd = r->wake_fd = r->notify_fd = -1;
    pthread_mutex_init(&r->lock, NULL);
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    r->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    r->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->epfd < 0 || r->wake_fd < 0 || r->notify_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(r->epfd, EPOLL_CTL_ADD, r->wake_fd, &ev);
    if (pthread_create(&r->thread, NULL, run, r) != 0) {
        PyErr_SetString(PyExc_OSError, "could not start the native relay's thread");
        Py_DECREF(r);
        return NULL;
    }
    r->running = 1;
    /* Named for `top -H`, perf and the overhead benchmark's split of the process's CPU. */
    pthread_setname_np(r->thread, NATIVE_THREAD_NAME);
    return (PyObject *)r;
}

static void fronts_let_go(Relay *r);
static PyObject *Relay_closed(Relay *r, PyObject *ignored);

static void relay_join(Relay *r) {
    if (!r->running) return;
    pthread_mutex_lock(&r->lock);
    r->closing = 1;
    pthread_mutex_unlock(&r->lock);
    wake(r->wake_fd);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(r->thread, NULL);
    Py_END_ALLOW_THREADS
    r->running = 0;
}

static void Relay_dealloc(Relay *r) {
    relay_join(r);
    Stream *s = r->done;
    while (s != NULL) { Stream *next = s->next; Py_DECREF(s); s = next; }
    r->done = r->done_tail = NULL;
    s = r->spares;
    while (s != NULL) { Stream *next = s->next; Py_DECREF(s); s = next; }
    r->spares = NULL;
    fronts_let_go(r);
    for (Front *f = r->closed; f != NULL; f = f->next) f->keeper_unseen = 0;  /* all go */
    Py_XDECREF(Relay_closed(r, NULL));
    free(r->f_rest); free(r->f_prefix); free(r->f_host); free(r->f_admin);
    if (r->epfd >= 0) close(r->epfd);
    if (r->wake_fd >= 0) close(r->wake_fd);
    if (r->notify_fd >= 0) close(r->notify_fd);
    pthread_mutex_destroy(&r->lock);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Relay_start(Relay *r, PyObject *args) {
    /* start(upstream_fd, client_fd, strip, hold, owner, head=None) -> Stream; `head`: (prefix,
     * request id line, suffix) of the client's head, to take the stream from the upstream's
     * head on (its request just sent) rather than from a chunk boundary of its body. */
    int up, client, strip, hold;
    PyObject *owner, *head = Py_None, *keep = Py_None;
    const char *pre = NULL, *rid = NULL, *post = NULL;
    Py_ssize_t pre_len = 0, rid_len = 0, post_len = 0;
    if (!PyArg_ParseTuple(args, "iippO|OO", &up, &client, &strip, &hold, &owner, &head, &keep))
        return NULL;
    if (head != Py_None && !PyArg_ParseTuple(head, "y#y#y#", &pre, &pre_len, &rid, &rid_len,
                                             &post, &post_len))
        return NULL;
    if (!r->running || r->closing) {
        PyErr_SetString(PyExc_RuntimeError, "the native relay is closed");
        return NULL;
    }
    Stream *s = PyObject_New(Stream, &StreamType);
    if (s == NULL) return NULL;
    memset((char *)s + sizeof(PyObject), 0, sizeof(Stream) - sizeof(PyObject));
    s->up = s->client = -1;
    Py_INCREF(owner);
    s->owner = owner;
    Py_INCREF(r);
    s->relay = r;
    s->strip = strip;
    s->hold = hold;
    s->last_completion = -1;
    if (keep != Py_None && r->front_on) { Py_INCREF(keep); s->keep = keep; }
    if (head != Py_None) {
        s->head_state = HEAD_WAIT;
        s->pending = 1;
        s->unpolled_first = 1;
        s->head_pre = malloc((size_t)pre_len + 1);
        s->head_rid = malloc((size_t)rid_len + 1);
        s->head_post = malloc((size_t)post_len + 1);
        if (s->head_pre == NULL || s->head_rid == NULL || s->head_post == NULL) {
            Py_DECREF(s);
            return PyErr_NoMemory();
        }
        memcpy(s->head_pre, pre, (size_t)pre_len); s->head_pre_len = pre_len;
        memcpy(s->head_rid, rid, (size_t)rid_len); s->head_rid_len = rid_len;
        memcpy(s->head_post, post, (size_t)post_len); s->head_post_len = post_len;
    }
    s->in = malloc(IN_CAP);
    s->up = fcntl(up, F_DUPFD_CLOEXEC, 0);
    s->client = fcntl(client, F_DUPFD_CLOEXEC, 0);
    if (s->in == NULL || s->up < 0 || s->client < 0) {
        if (s->up >= 0) close(s->up);
        if (s->client >= 0) close(s->client);
        s->up = s->client = -1;
        Py_DECREF(s);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* Linked first (the thread unlinks what it hands back), then in the epoll set; held by
     * the thread until `finished()` returns it. */
    Py_INCREF(s);
    pthread_mutex_lock(&r->lock);
    s->next = r->active;
    if (r->active) r->active->prev = s;
    r->active = s;
    pthread_mutex_unlock(&r->lock);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
    /* A stream that may keep its connections: the event loop paused its reads of the client. */
    if ((s->keep != NULL && watch_client(s) != 0)
            || epoll_ctl(r->epfd, EPOLL_CTL_ADD, s->up, &ev) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (s->watch_client) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->client, NULL);
        pthread_mutex_lock(&r->lock);
        if (s->prev) s->prev->next = s->next; else r->active = s->next;
        if (s->next) s->next->prev = s->prev;
        pthread_mutex_unlock(&r->lock);
        close(s->up); close(s->client);
        s->up = s->client = -1;
        Py_DECREF(s);
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static PyObject *take_done(Relay *r);

static PyObject *Relay_finished(Relay *r, PyObject *Py_UNUSED(ignored)) {
    /* The streams handed back since the last call, in the order they were (a stream that kept
     * a front before its front's own); the notification read (the event loop calls this when
     * `fileno()` is readable). */
    uint64_t v;
    ssize_t rd = read(r->notify_fd, &v, sizeof v);
    (void)rd;
    return take_done(r);
}

static PyObject *Relay_ended(Relay *r, PyObject *Py_UNUSED(ignored)) {
    /* As `finished()`, without reading the notification: for the event loop's own wake-ups,
     * which take the streams that ended quietly (their response's end written). */
    return take_done(r);
}

static PyObject *take_done(Relay *r) {
    pthread_mutex_lock(&r->lock);
    Stream *s = r->done;
    r->done = r->done_tail = NULL;
    for (Stream *t = s; t != NULL; t = t->next)
        if (t->kept != NULL) t->kept->keeper_unseen = 0;  /* (alive until then: `closed()`) */
    pthread_mutex_unlock(&r->lock);
    PyObject *list = PyList_New(0);
    while (s != NULL) {
        Stream *next = s->next;
        s->next = NULL;
        if (list != NULL && PyList_Append(list, (PyObject *)s) < 0) Py_CLEAR(list);
        Py_DECREF(s);  /* the thread's reference */
        s = next;
    }
    return list;
}

static PyObject *Relay_due(Relay *r, PyObject *args) {
    /* due(replay_before, idle_before, stall_before) -> the owners of the streams held now that
     * the live registry's pass must look at (live.py): not polled since `replay_before`,
     * started at the head with no poll yet that took its first token, silent since
     * `idle_before` (or with no read yet), or with the client not reading since
     * `stall_before`. One walk under the lock, so that a pass costs no Python for the streams
     * that need nothing; their owners decide on exact clocks. */
    long long replay_before, idle_before, stall_before;
    if (!PyArg_ParseTuple(args, "LLL", &replay_before, &idle_before, &stall_before))
        return NULL;
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    pthread_mutex_lock(&r->lock);
    for (Stream *s = r->active; s != NULL; s = s->next) {
        if (s->owner == NULL || s->owner == Py_None || (s->front_request && !s->f_seen)) continue;
        if (s->polled_ns <= replay_before || s->unpolled_first || s->last_read_ns < idle_before
                || (s->blocked_since_ns && s->blocked_since_ns < stall_before)) {
            if (PyList_Append(list, s->owner) < 0) { Py_CLEAR(list); break; }
        }
    }
    pthread_mutex_unlock(&r->lock);
    return list;
}

static char *dup_bytes(const char *d, Py_ssize_t n) {
    char *p = malloc((size_t)n + 1);
    if (p != NULL) { memcpy(p, d, (size_t)n); p[n] = 0; }
    return p;
}

static PyObject *Relay_front_config(Relay *r, PyObject *args) {
    /* front_config(date, server headers after date, upstream base path, upstream host header,
     * admin token header, max body): the front takes plain requests from here on. */
    const char *rest, *prefix, *host, *admin;
    Py_ssize_t rest_len, prefix_len, host_len, admin_len, max_body;
    int date_on;
    if (!PyArg_ParseTuple(args, "py#y#y#y#n", &date_on, &rest, &rest_len, &prefix, &prefix_len,
                          &host, &host_len, &admin, &admin_len, &max_body))
        return NULL;
    r->f_date_on = date_on;
    pthread_mutex_lock(&r->lock);
    int set = r->front_on;
    pthread_mutex_unlock(&r->lock);
    if (set) { PyErr_SetString(PyExc_RuntimeError, "the front is configured"); return NULL; }
    r->f_rest = dup_bytes(rest, rest_len); r->f_rest_len = rest_len;
    r->f_prefix = dup_bytes(prefix, prefix_len); r->f_prefix_len = prefix_len;
    r->f_host = dup_bytes(host, host_len); r->f_host_len = host_len;
    r->f_admin = dup_bytes(admin, admin_len); r->f_admin_len = admin_len;
    r->f_max_body = max_body;
    r->f_rng = (uint64_t)wall_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)r;
    if (!r->f_rest || !r->f_prefix || !r->f_host || !r->f_admin) return PyErr_NoMemory();
    pthread_mutex_lock(&r->lock);
    r->front_on = 1;
    pthread_mutex_unlock(&r->lock);
    Py_RETURN_NONE;
}

static PyObject *Relay_stock(Relay *r, PyObject *args) {
    /* stock(owner, target): streams for the front's requests, owned by `owner`, made up to
     * `target` at the thread's hand (their read buffers are the thread's to allocate, as it
     * takes one); returns how many it has. */
    PyObject *owner;
    Py_ssize_t target, have = 0;
    if (!PyArg_ParseTuple(args, "On", &owner, &target)) return NULL;
    pthread_mutex_lock(&r->lock);
    for (Stream *s = r->spares; s != NULL; s = s->next) have++;
    pthread_mutex_unlock(&r->lock);
    for (Py_ssize_t i = have; i < target; i++) {
        Stream *s = PyObject_New(Stream, &StreamType);
        if (s == NULL) return NULL;
        memset((char *)s + sizeof(PyObject), 0, sizeof(Stream) - sizeof(PyObject));
        s->up = s->client = -1;
        s->owner = Py_NewRef(owner);
        s->relay = (Relay *)Py_NewRef((PyObject *)r);
        pthread_mutex_lock(&r->lock);  /* its reference is the thread's from here */
        s->next = r->spares;
        r->spares = s;
        pthread_mutex_unlock(&r->lock);
        have++;
    }
    return PyLong_FromSsize_t(have);
}

static PyObject *Relay_closed(Relay *r, PyObject *Py_UNUSED(ignored)) {
    /* The fronts let go since the last call: (owner, why, bytes the thread read of a request
     * it did not take, when the first came). */
    pthread_mutex_lock(&r->lock);
    Front *f = r->closed, *waiting = NULL;
    r->closed = NULL;
    while (f != NULL) {  /* those whose keeper Python has not taken stay (`keeper_unseen`) */
        Front *next = f->next;
        if (f->keeper_unseen) { f->next = waiting; waiting = f; }
        else { f->next = r->closed; r->closed = f; }
        f = next;
    }
    f = r->closed;
    r->closed = waiting;
    pthread_mutex_unlock(&r->lock);
    PyObject *list = PyList_New(0);
    while (f != NULL) {
        Front *next = f->next;
        if (f->owner != NULL) {  /* (else it went with its stream: `front_conn`) */
            PyObject *item = Py_BuildValue("(Niy#L)", f->owner, f->why, f->buf,
                                           f->why == FRONT_PYTHON || f->why == FRONT_BROKEN
                                               ? f->len : (Py_ssize_t)0,
                                           (long long)(f->len ? f->first_ns : 0));
            if (item == NULL || list == NULL || PyList_Append(list, item) < 0) Py_CLEAR(list);
            Py_XDECREF(item);
        }
        free(f->buf);
        free(f);
        f = next;
    }
    return list;
}

static PyObject *Relay_front_started(Relay *r, PyObject *Py_UNUSED(ignored)) {
    /* The front's streams held now that Python has not looked at yet (then it has). */
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    pthread_mutex_lock(&r->lock);
    for (Stream *s = r->active; s != NULL && r->f_unseen > 0; s = s->next) {
        if (!s->front_request || s->f_seen) continue;
        if (PyList_Append(list, (PyObject *)s) < 0) { Py_CLEAR(list); break; }
        s->f_seen = 1;
        r->f_unseen--;
    }
    pthread_mutex_unlock(&r->lock);
    return list;
}

static PyObject *Relay_front_stop(Relay *r, PyObject *Py_UNUSED(ignored)) {
    /* The front takes no more requests: idle connections go back to Python (`closed()`),
     * and each answering one at its request's end. */
    pthread_mutex_lock(&r->lock);
    r->front_on = 0;
    pthread_mutex_unlock(&r->lock);
    wake(r->wake_fd);
    Py_RETURN_NONE;
}

static PyObject *Relay_front_expire(Relay *r, PyObject *args) {
    /* front_expire(before): the idle connections waiting for a request since before `before`
     * (perf_counter_ns) go back to Python. */
    long long before;
    if (!PyArg_ParseTuple(args, "L", &before)) return NULL;
    pthread_mutex_lock(&r->lock);
    r->f_expire = before > 0 ? before : 1;
    pthread_mutex_unlock(&r->lock);
    wake(r->wake_fd);
    Py_RETURN_NONE;
}

static PyObject *Relay_fileno(Relay *r, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(r->notify_fd);
}

static void fronts_let_go(Relay *r) {
    pthread_mutex_lock(&r->lock);
    while (r->fronts != NULL) front_let_go(r, r->fronts, FRONT_ASKED);
    pthread_mutex_unlock(&r->lock);
}

static PyObject *Relay_close(Relay *r, PyObject *Py_UNUSED(ignored)) {
    /* Stop the thread; streams it still held are handed back (ending ASKED) first. */
    relay_join(r);
    fronts_let_go(r);
    Py_RETURN_NONE;
}

static PyMethodDef Relay_methods[] = {
    {"start", (PyCFunction)Relay_start, METH_VARARGS, NULL},
    {"finished", (PyCFunction)Relay_finished, METH_NOARGS, NULL},
    {"ended", (PyCFunction)Relay_ended, METH_NOARGS, NULL},
    {"due", (PyCFunction)Relay_due, METH_VARARGS, NULL},
    {"fileno", (PyCFunction)Relay_fileno, METH_NOARGS, NULL},
    {"front_config", (PyCFunction)Relay_front_config, METH_VARARGS, NULL},
    {"stock", (PyCFunction)Relay_stock, METH_VARARGS, NULL},
    {"closed", (PyCFunction)Relay_closed, METH_NOARGS, NULL},
    {"front_started", (PyCFunction)Relay_front_started, METH_NOARGS, NULL},
    {"front_stop", (PyCFunction)Relay_front_stop, METH_NOARGS, NULL},
    {"front_expire", (PyCFunction)Relay_front_expire, METH_VARARGS, NULL},
    {"close", (PyCFunction)Relay_close, METH_NOARGS, NULL},
    {NULL},
};

static PyMemberDef Relay_members[] = {
    {"in_flight", T_INT, offsetof(Relay, py_in_flight), 0,
     "Python's requests in flight (for a front request's count at arrival)"},
    {"front_unseen", T_INT, offsetof(Relay, f_unseen), READONLY,
     "front requests in flight that Python has not looked at yet"},
    {NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phasewatch.proxy._native.Relay",
    .tp_basicsize = sizeof(Relay),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Relay_new,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_methods = Relay_methods,
    .tp_members = Relay_members,
};

/* -- Python: the replay's arithmetic ------------------------------------------------------ */

/* The first bucket whose upper bound holds `x` (bisect_left over sorted bounds). */
static Py_ssize_t bucket_of(const double *b, Py_ssize_t nb, double x) {
    Py_ssize_t lo = 0, hi = nb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (b[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* replay_exact(events, seen, last, largest, total, bounds, exemplars): what
 * `itl_replay.replay_py` computes (its docstring says what each value is), the same doubles
 * by the same operations in the same order. Its work and memory go with the events, not with
 * the tokens they say they carry: one gap and one count per event. */
static PyObject *replay_exact(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer ev, bd;
    long long seen, last;
    double largest, total;
    int exemplars;
    if (!PyArg_ParseTuple(args, "y*LLddy*p", &ev, &seen, &last, &largest, &total, &bd,
                          &exemplars))
        return NULL;
    PyObject *gaps_of = NULL, *tokens_of = NULL, *marked = NULL, *counts = NULL, *result = NULL;
    int64_t *tally = NULL;
    double *mark = NULL;  /* per bucket: the last gap that was the largest so far (NaN: none) */
    double *gaps = NULL;  /* one per event that carried tokens, in order: `gaps` */
    int64_t *tokens_in = NULL;  /* the tokens each of them carried: `tokens` */
    if (ev.len % 24 != 0 || bd.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "events are int64 triples and bounds doubles");
        goto done;
    }
    const int64_t *e = ev.buf;
    const double *b = bd.buf;
    Py_ssize_t n = ev.len / 24, nb = bd.len / 8, kept = 0;
    int several = 0;  /* an event carried more than one token */
    double sum = 0.0;
    int64_t observed = 0;
    tally = calloc((size_t)(nb ? nb : 1), sizeof *tally);
    mark = malloc((size_t)(nb ? nb : 1) * sizeof *mark);
    gaps = malloc((size_t)(n ? n : 1) * sizeof *gaps);
    tokens_in = malloc((size_t)(n ? n : 1) * sizeof *tokens_in);
    if (tally == NULL || mark == NULL || gaps == NULL || tokens_in == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nb; i++) mark[i] = NAN;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t completion = e[3 * i + 1], tokens = completion - seen;
        if (tokens <= 0 || completion > MAX_TOKEN_COUNT) continue;
        double gap = (double)(e[3 * i] - last) / 1e9 / (double)tokens;
        seen = completion;
        last = e[3 * i];
        total += gap * (double)tokens;
        gaps[kept] = gap;
        tokens_in[kept++] = tokens;
        if (tokens > 1) several = 1;
        int largest_yet = gap > largest;
        if (largest_yet) largest = gap;
        if (nb == 0) continue;
        Py_ssize_t bucket = bucket_of(b, nb, gap);
        tally[bucket] += tokens;
        sum += gap * (double)tokens;
        observed += tokens;
        if (largest_yet && exemplars) mark[bucket] = gap;
    }
    gaps_of = PyBytes_FromStringAndSize((const char *)gaps, kept * (Py_ssize_t)sizeof *gaps);
    if (gaps_of == NULL) goto done;
    tokens_of = several ? PyBytes_FromStringAndSize((const char *)tokens_in,
                                                    kept * (Py_ssize_t)sizeof *tokens_in)
                        : Py_NewRef(Py_None);
    if (tokens_of == NULL) goto done;
    if (observed > 0) {
        counts = PyList_New(0);
        marked = PyList_New(0);
        if (counts == NULL || marked == NULL) goto done;
        for (Py_ssize_t i = 0; i < nb; i++) {
            if (tally[i] > 0) {
                PyObject *pair = Py_BuildValue("(nL)", i, (long long)tally[i]);
                if (pair == NULL || PyList_Append(counts, pair) < 0) {
                    Py_XDECREF(pair);
                    goto done;
                }
                Py_DECREF(pair);
            }
            if (!isnan(mark[i])) {
                PyObject *pair = Py_BuildValue("(nd)", i, mark[i]);
                if (pair == NULL || PyList_Append(marked, pair) < 0) {
                    Py_XDECREF(pair);
                    goto done;
                }
                Py_DECREF(pair);
            }
        }
    } else {
        counts = Py_NewRef(Py_None);
        marked = PyList_New(0);
        if (marked == NULL) goto done;
    }
    result = Py_BuildValue("(OOOdOLLdd)", gaps_of, tokens_of, counts, sum, marked, seen, last,
                           total, largest);
done:
    Py_XDECREF(gaps_of);
    Py_XDECREF(tokens_of);
    Py_XDECREF(marked);
    Py_XDECREF(counts);
    free(tally);
    free(mark);
    free(gaps);
    free(tokens_in);
    PyBuffer_Release(&ev);
    PyBuffer_Release(&bd);
    return result;
}

/* -- Python: nearest_ranks ------------------------------------------------------------------ */

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static PyObject *nearest_ranks(PyObject *Py_UNUSED(m), PyObject *args) {
    /* nearest_ranks(values, q1, q2): the nearest-rank q1 and q2 percentiles of a writable
     * buffer of doubles (an array('d')), which is left sorted; (None, None) when it is empty.
     * What `percentile(sorted(values), q)` gives (app/core/quantiles.py), without a float
     * object per value (gap_summary.py). */
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
        Py_ssize_t r1 = (Py_ssize_t)ceil(q1 * (double)n) - 1, r2 = (Py_ssize_t)ceil(q2 * (double)n) - 1;
        r1 = r1 < 0 ? 0 : (r1 >= n ? n - 1 : r1);
        r2 = r2 < 0 ? 0 : (r2 >= n ? n - 1 : r2);
        result = Py_BuildValue("(dd)", v[r1], v[r2]);
    }
    PyBuffer_Release(&vb);
    return result;
}

static PyObject *body_plan(PyObject *Py_UNUSED(m), PyObject *arg) {
    /* body_plan(body): (the front's plan of a request body, `body_plain`: 0 Python's, 1
     * `stream_options` appended, 2 as it came; the `model` value's bytes, or None). For the
     * tests, which hold the front's reading of JSON to orjson's. */
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    const char *model;
    Py_ssize_t model_len;
    int plan = body_plain(b.buf, b.len, &model, &model_len);
    PyObject *out = model == NULL ? Py_BuildValue("(iO)", plan, Py_None)
                                  : Py_BuildValue("(iy#)", plan, model, model_len);
    PyBuffer_Release(&b);
    return out;
}

static PyMethodDef module_methods[] = {
    {"body_plan", body_plan, METH_O, NULL},
    {"replay_exact", replay_exact, METH_VARARGS, NULL},
    {"nearest_ranks", nearest_ranks, METH_VARARGS, NULL},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The relay's native leg (see native.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&RelayType) < 0 || PyType_Ready(&StreamType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RelayType);
    PyModule_AddObject(m, "Relay", (PyObject *)&RelayType);
    Py_INCREF(&StreamType);
    PyModule_AddObject(m, "Stream", (PyObject *)&StreamType);
    PyModule_AddIntConstant(m, "HANDOVER", END_HANDOVER);
    PyModule_AddIntConstant(m, "ASKED", END_ASKED);
    PyModule_AddIntConstant(m, "UPSTREAM_EOF", END_UPSTREAM_EOF);
    PyModule_AddIntConstant(m, "UPSTREAM_ERROR", END_UPSTREAM_ERROR);
    PyModule_AddIntConstant(m, "CLIENT_ERROR", END_CLIENT_ERROR);
    return m;
}
