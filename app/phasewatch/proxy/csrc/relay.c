/* The native leg's thread (see relay.h for who owns what).
 *
 * One epoll loop. For each held stream, the upstream's socket is in the set for reading
 * unless the client is not taking what was written (`blocked`: then the client's socket is
 * watched for room instead, so back-pressure reaches the engine as through any TCP proxy).
 * The client's socket is always watched for its hang-up, and for its own bytes until some
 * come (`watch_input`): a request pipelined behind this response, left in the socket for the
 * server to read once the stream is back. Each upstream read is taken by `pw_take` (scan.c)
 * and what it produced is sent at once; anything it does not take plainly hands the stream
 * back to Python at that byte.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "relay.h"
#ifdef __linux__

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_EVENTS 256
#define THREAD_NAME "pw-native-relay" /* 15 characters, Linux's limit */
#define IN_FIRST (4 * 1024)           /* a stream's input buffer to begin with (then doubled) */
#define IN_UP 1u
#define IN_CLIENT 2u
#define CLIENT_TAG 1u /* epoll data: the stream's address, +1 for its client's socket */

struct pw_relay {
    int epfd, wake_fd, notify_fd;
    pthread_t thread;
    int running;                 /* the thread was started and not joined (Python's) */
    pthread_mutex_t lock;
    pw_stream *active;           /* (lock) held */
    pw_stream *done, *done_tail; /* (lock) handed back, oldest first, for Python */
    pw_stream *retired;          /* (thread) handed back in the current batch, newest first */
    int closing;                 /* (lock) */
    int failed;                  /* (lock) the thread's errno when epoll_wait failed */
    int inject_fault;            /* (lock) tests: fail as epoll_wait would */
    int refs;                    /* (GIL) the Python objects that use this memory */
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter_ns()'s clock */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void wake(int fd) {
    uint64_t one = 1;
    ssize_t w = write(fd, &one, sizeof one); /* an eventfd: never blocks (EFD_NONBLOCK) */
    (void)w;
}

void pw_relay_lock(pw_relay *r) { pthread_mutex_lock(&r->lock); }
void pw_relay_unlock(pw_relay *r) { pthread_mutex_unlock(&r->lock); }
int pw_relay_notify_fd(const pw_relay *r) { return r->notify_fd; }

/* -- registration -------------------------------------------------------------------------- */

static int client_events(const pw_stream *s) {
    return EPOLLRDHUP | (s->watch_input ? EPOLLIN : 0) | (s->blocked ? EPOLLOUT : 0);
}

/* Register (or re-register) the client's socket for what the stream now waits for. */
static int watch_client(pw_relay *r, pw_stream *s) {
    struct epoll_event ev = {.events = (uint32_t)client_events(s),
                             .data.ptr = (char *)s + CLIENT_TAG};
    int op = (s->in_set & IN_CLIENT) ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
    if (epoll_ctl(r->epfd, op, s->client, &ev) != 0) return -1;
    s->in_set |= IN_CLIENT;
    return 0;
}

static int watch_upstream(pw_relay *r, pw_stream *s, int on) {
    if (on && !(s->in_set & IN_UP)) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
        if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, s->up, &ev) != 0) return -1;
        s->in_set |= IN_UP;
    } else if (!on && (s->in_set & IN_UP)) {
        if (epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->up, NULL) != 0) return -1;
        s->in_set &= ~IN_UP;
    }
    return 0;
}

/* -- handing back ---------------------------------------------------------------------------- */

/* (thread, lock held) Out of the set and of `active`, the duplicates closed; Python hears of
 * it when the current batch is done (`publish`), so nothing later in the batch can touch a
 * stream Python has let go. Removed from the set before the close: the event loop's own
 * descriptors keep the sockets, and with them a registration, alive. */
static void hand_back(pw_relay *r, pw_stream *s, int ending, int err) {
    s->ending = ending;
    if (err && !s->err) s->err = err;
    if (s->in_set & IN_UP) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->up, NULL);
    if (s->in_set & IN_CLIENT) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->client, NULL);
    s->in_set = 0;
    close(s->up);
    close(s->client);
    s->up = s->client = -1;
    if (s->prev) s->prev->next = s->next;
    else r->active = s->next;
    if (s->next) s->next->prev = s->prev;
    s->prev = NULL;
    s->next = r->retired;
    r->retired = s;
}

/* (thread) The batch's hand-backs go to Python, in the order they happened, and the event
 * loop is woken at once: until it takes a stream back, neither side reads its client's socket,
 * and a request the client sends after the response's end waits for that. */
static void publish(pw_relay *r) {
    if (r->retired == NULL) return;
    pw_stream *oldest = NULL;
    while (r->retired != NULL) {
        pw_stream *s = r->retired;
        r->retired = s->next;
        s->next = oldest;
        oldest = s;
    }
    pthread_mutex_lock(&r->lock);
    while (oldest != NULL) {
        pw_stream *s = oldest;
        oldest = s->next;
        s->next = NULL;
        if (r->done_tail != NULL) r->done_tail->next = s;
        else r->done = s;
        r->done_tail = s;
    }
    pthread_mutex_unlock(&r->lock);
    wake(r->notify_fd);
}

/* -- one stream's I/O ------------------------------------------------------------------------ */

/* Send what waits for the client: 0 all sent, 1 blocked, -1 its socket broke (`err`). */
static int flush(pw_stream *s) {
    while (s->out.off < s->out.len) {
        ssize_t w = send(s->client, s->out.data + s->out.off, s->out.len - s->out.off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            s->out.off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 1;
        s->err = w < 0 ? errno : EPIPE;
        return -1;
    }
    s->out.len = s->out.off = 0;
    return 0;
}

/* Room for the next read: the input buffer doubled up to PW_IN_CAP when full. 0, or -1 when
 * it is at the cap (a chunk that long is Python's) or no memory. */
static int input_room(pw_stream *s) {
    if (s->in_len < s->in_cap) return 0;
    if (s->in_cap >= PW_IN_CAP) return -1;
    size_t bigger = s->in_cap * 2 > PW_IN_CAP ? PW_IN_CAP : s->in_cap * 2;
    char *p = realloc(s->in, bigger);
    if (p == NULL) return -1;
    s->in = p;
    s->in_cap = bigger;
    return 0;
}

static void upstream_ready(pw_relay *r, pw_stream *s) {
    int ending = PW_END_NONE, err = 0;
    if (input_room(s) < 0) {
        pthread_mutex_lock(&r->lock);
        hand_back(r, s, PW_END_HANDOVER, 0);
        pthread_mutex_unlock(&r->lock);
        return;
    }
    ssize_t got = recv(s->up, s->in + s->in_len, s->in_cap - s->in_len, MSG_DONTWAIT);
    int64_t now = now_ns();
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (got == 0) {
        ending = PW_END_UPSTREAM_EOF;
    } else if (got < 0) {
        ending = PW_END_UPSTREAM_ERROR;
        err = errno;
    }
    pthread_mutex_lock(&r->lock);
    if (got > 0) {
        s->in_len += (size_t)got;
        s->leftover_ns = now;
        size_t used = 0;
        int verdict = pw_take(&s->scan, s->in, s->in_len, now, &s->out, &s->log, &used);
        if (used) {
            memmove(s->in, s->in + used, s->in_len - used);
            s->in_len -= used;
        }
        s->done_ns = s->scan.done_ns;
        if (verdict == PW_TAKE_BACK) ending = PW_END_HANDOVER;
        else if (verdict == PW_TAKE_ENDED) ending = PW_END_BODY;
    }
    s->last_read_ns = now;
    pthread_mutex_unlock(&r->lock);
    /* At the body's end the response's end goes out with this read's output; without the
     * memory for it, Python writes both. */
    if (ending == PW_END_BODY && pw_out_chunk(&s->out, "", 0, NULL, 0) == 0) s->end_written = 1;
    int sent = (ending != PW_END_BODY || s->end_written) ? flush(s) : 0;
    pthread_mutex_lock(&r->lock);
    if (sent < 0) {
        hand_back(r, s, PW_END_CLIENT_ERROR, 0);
    } else if (ending != PW_END_NONE) {
        hand_back(r, s, ending, err); /* what the client did not take goes back as `unsent` */
    } else if (sent == 1) {
        s->blocked_since_ns = now;
        s->blocked = 1;
        if (watch_upstream(r, s, 0) < 0 || watch_client(r, s) < 0)
            hand_back(r, s, PW_END_FAULT, errno);
    }
    pthread_mutex_unlock(&r->lock);
}

static void client_ready(pw_relay *r, pw_stream *s, uint32_t events) {
    if (events & (EPOLLERR | EPOLLHUP | EPOLLRDHUP)) { /* hung up, or half-closed: gone */
        pthread_mutex_lock(&r->lock);
        hand_back(r, s, PW_END_CLIENT_ERROR, EPIPE);
        pthread_mutex_unlock(&r->lock);
        return;
    }
    if ((events & EPOLLIN) && s->watch_input) {
        /* The client sent more: a request waits behind this response. Its bytes stay in the
         * socket for the server to read after the hand-back. */
        s->watch_input = 0;
        pthread_mutex_lock(&r->lock);
        if (watch_client(r, s) < 0) hand_back(r, s, PW_END_FAULT, errno);
        pthread_mutex_unlock(&r->lock);
        if (s->ending != PW_END_NONE) return;
    }
    if (!(events & EPOLLOUT) || !s->blocked) return;
    int sent = flush(s);
    if (sent == 1) return;
    pthread_mutex_lock(&r->lock);
    if (sent < 0) {
        hand_back(r, s, PW_END_CLIENT_ERROR, 0);
    } else {
        s->blocked_since_ns = 0;
        s->blocked = 0;
        if (watch_client(r, s) < 0 || watch_upstream(r, s, 1) < 0)
            hand_back(r, s, PW_END_FAULT, errno);
    }
    pthread_mutex_unlock(&r->lock);
}

/* -- the loop ------------------------------------------------------------------------------ */

/* (lock held) Hand back every held stream: all of them (`all`), else those Python asked for. */
static void hand_back_asked(pw_relay *r, int all, int ending, int err) {
    pw_stream *s = r->active;
    while (s != NULL) {
        pw_stream *next = s->next;
        if (all || s->stop_asked) hand_back(r, s, ending, err);
        s = next;
    }
}

/* The loop cannot go on: every held stream goes back to Python, which sends what was read for
 * it and ends it with an in-band error, and is told why (`pw_relay_failed`); the thread ends. */
static void fail(pw_relay *r, int err) {
    pthread_mutex_lock(&r->lock);
    r->failed = err;
    hand_back_asked(r, 1, PW_END_FAULT, err);
    pthread_mutex_unlock(&r->lock);
    publish(r);
    wake(r->notify_fd);
}

static void *run(void *arg) {
    pw_relay *r = arg;
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(r->epfd, evs, MAX_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            fail(r, errno);
            return NULL;
        }
        for (int i = 0; i < n; i++) {
            void *ptr = evs[i].data.ptr;
            if (ptr == NULL) { /* Python asked: streams to stop, or close */
                uint64_t v;
                ssize_t rd = read(r->wake_fd, &v, sizeof v);
                (void)rd;
                pthread_mutex_lock(&r->lock);
                int closing = r->closing, faulty = r->inject_fault;
                if (!faulty) hand_back_asked(r, closing, PW_END_ASKED, 0);
                pthread_mutex_unlock(&r->lock);
                if (faulty) {
                    fail(r, EIO);
                    return NULL;
                }
                if (closing) {
                    publish(r);
                    return NULL;
                }
                continue;
            }
            uintptr_t tag = (uintptr_t)ptr & CLIENT_TAG;
            pw_stream *s = (pw_stream *)((uintptr_t)ptr & ~(uintptr_t)CLIENT_TAG);
            if (s->ending != PW_END_NONE) continue; /* handed back earlier in this batch */
            if (tag) {
                client_ready(r, s, evs[i].events);
            } else if (!s->blocked) {
                upstream_ready(r, s);
            }
        }
        publish(r);
    }
}

/* -- Python's side (called with the GIL, never by the thread) ------------------------------ */

pw_relay *pw_relay_new(int *err) {
    pw_relay *r = calloc(1, sizeof *r);
    if (r == NULL) {
        *err = ENOMEM;
        return NULL;
    }
    r->refs = 1;
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    r->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    r->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (r->epfd < 0 || r->wake_fd < 0 || r->notify_fd < 0
        || epoll_ctl(r->epfd, EPOLL_CTL_ADD, r->wake_fd, &ev) != 0) {
        *err = errno;
        goto fail;
    }
    if (pthread_mutex_init(&r->lock, NULL) != 0) {
        *err = ENOMEM;
        goto fail;
    }
    int rc = pthread_create(&r->thread, NULL, run, r);
    if (rc != 0) {
        *err = rc;
        pthread_mutex_destroy(&r->lock);
        goto fail;
    }
    r->running = 1;
    pthread_setname_np(r->thread, THREAD_NAME); /* for top -H, perf and the benchmark */
    return r;
fail:
    if (r->epfd >= 0) close(r->epfd);
    if (r->wake_fd >= 0) close(r->wake_fd);
    if (r->notify_fd >= 0) close(r->notify_fd);
    free(r);
    return NULL;
}

int pw_relay_start(pw_relay *r, pw_stream *s, int up_fd, int client_fd) {
    s->relay = r;
    s->up = s->client = -1;
    s->in_cap = IN_FIRST;
    s->in = malloc(IN_FIRST);
    if (s->in == NULL) {
        errno = ENOMEM;
        return -1;
    }
    s->up = fcntl(up_fd, F_DUPFD_CLOEXEC, 0);
    s->client = fcntl(client_fd, F_DUPFD_CLOEXEC, 0);
    int err = 0;
    if (s->up < 0 || s->client < 0) err = errno;
    s->watch_input = 1;
    s->last_read_ns = s->polled_ns = now_ns();
    s->awaiting_first = s->scan.pending;
    pthread_mutex_lock(&r->lock);
    if (!err && (r->closing || r->failed || !r->running)) err = ESHUTDOWN;
    /* Linked and registered under the lock: the thread sees it whole or not at all. */
    if (!err && (watch_upstream(r, s, 1) < 0 || watch_client(r, s) < 0)) err = errno;
    if (!err) {
        s->next = r->active;
        if (r->active) r->active->prev = s;
        r->active = s;
    } else {
        if (s->in_set & IN_UP) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->up, NULL);
        if (s->in_set & IN_CLIENT) epoll_ctl(r->epfd, EPOLL_CTL_DEL, s->client, NULL);
        s->in_set = 0;
    }
    pthread_mutex_unlock(&r->lock);
    if (err) {
        if (s->up >= 0) close(s->up);
        if (s->client >= 0) close(s->client);
        s->up = s->client = -1;
        errno = err;
        return -1;
    }
    return 0;
}

void pw_relay_stop(pw_relay *r, pw_stream *s) {
    pthread_mutex_lock(&r->lock);
    int held = s->relay == r && s->ending == PW_END_NONE && s->up >= 0;
    if (held) s->stop_asked = 1;
    pthread_mutex_unlock(&r->lock);
    if (held) wake(r->wake_fd);
}

pw_stream *pw_relay_take_done(pw_relay *r, int drain) {
    if (drain) {
        uint64_t v;
        ssize_t rd = read(r->notify_fd, &v, sizeof v);
        (void)rd;
    }
    pthread_mutex_lock(&r->lock);
    pw_stream *s = r->done;
    r->done = r->done_tail = NULL;
    pthread_mutex_unlock(&r->lock);
    return s;
}

void pw_relay_requeue(pw_relay *r, pw_stream *first) {
    if (first == NULL) return;
    pw_stream *last = first;
    while (last->next != NULL) last = last->next;
    pthread_mutex_lock(&r->lock);
    last->next = r->done;
    if (r->done == NULL) r->done_tail = last;
    r->done = first;
    pthread_mutex_unlock(&r->lock);
}

void pw_relay_close(pw_relay *r) {
    if (!r->running) return;
    pthread_mutex_lock(&r->lock);
    r->closing = 1;
    pthread_mutex_unlock(&r->lock);
    wake(r->wake_fd);
    pthread_join(r->thread, NULL); /* (the caller has let go of the GIL) */
    r->running = 0;
}

int pw_relay_failed(pw_relay *r) {
    pthread_mutex_lock(&r->lock);
    int failed = r->failed;
    pthread_mutex_unlock(&r->lock);
    return failed;
}

void pw_relay_each_held(pw_relay *r, void (*fn)(pw_stream *, void *), void *ctx) {
    pthread_mutex_lock(&r->lock);
    for (pw_stream *s = r->active; s != NULL; s = s->next) fn(s, ctx);
    pthread_mutex_unlock(&r->lock);
}

void pw_relay_inject_fault(pw_relay *r) {
    pthread_mutex_lock(&r->lock);
    r->inject_fault = 1;
    pthread_mutex_unlock(&r->lock);
    wake(r->wake_fd);
}

void pw_relay_hold(pw_relay *r) { r->refs++; }

void pw_relay_release(pw_relay *r) {
    if (--r->refs > 0) return;
    close(r->epfd);
    close(r->wake_fd);
    close(r->notify_fd);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

#endif /* __linux__ */
