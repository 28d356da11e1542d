/* The native leg's thread: relays the middle and tail of streams handed to it by Python.
 *
 * Ownership (who may touch what, and when):
 * - A stream's two sockets are the thread's from `pw_relay_start` until it hands the stream
 *   back: it works on duplicates of the descriptors (closing them at the hand-back), and in
 *   that time the event loop neither reads nor writes either socket, and has both out of its
 *   own poll set (app/phasewatch/proxy/native.py). Each descriptor is in at most one epoll set at a time.
 * - `pw_stream` memory belongs to its Python object (module.c), which the relay's lists keep
 *   a reference to from `pw_relay_start` until Python takes the stream back
 *   (`pw_relay_take_done`). The thread never touches a Python object, a reference count or
 *   the GIL.
 * - Fields marked (thread) are the thread's alone while the stream is held, and Python's
 *   after it is handed back; fields marked (lock) are read and written under the relay's
 *   mutex, which no one holds across a blocking call.
 * - Python -> thread: `wake_fd` (a stream to stop, or close). Thread -> Python: `notify_fd`,
 *   readable as soon as streams were handed back (after each batch of events).
 * Bounds: at most PW_IN_CAP bytes of unparsed upstream input per stream; the output buffer
 *   holds one read's output (the upstream is not read while the client is not taking it).
 * The thread makes no blocking call but epoll_wait: reads and sends are non-blocking.
 */
#ifndef PW_RELAY_H
#define PW_RELAY_H
#ifdef __linux__

#include <pthread.h>
#include <stdint.h>

#include "scan.h"

/* Why the thread handed a stream back (Python reads these as `Ending` in native.py). */
enum {
    PW_END_NONE = 0,
    PW_END_HANDOVER = 1,      /* a chunk it does not take plainly: Python goes on from it */
    PW_END_ASKED = 2,         /* Python asked (`pw_relay_stop`), or the relay is closing */
    PW_END_UPSTREAM_EOF = 3,  /* the upstream closed its side */
    PW_END_UPSTREAM_ERROR = 4,/* reading the upstream failed (`err`) */
    PW_END_CLIENT_ERROR = 5,  /* the client hung up, or writing to it failed */
    PW_END_BODY = 6,          /* the body ended cleanly after [DONE]; the response's end written */
    PW_END_FAULT = 7,         /* the thread failed (`err`): Python ends it with an in-band error */
};

typedef struct pw_relay pw_relay;
typedef struct pw_stream pw_stream;

struct pw_stream {
    pw_stream *next, *prev; /* in `active` or (next alone) the hand-back lists (lock) */
    pw_relay *relay;
    int up, client;         /* the thread's duplicates (-1: closed) */
    unsigned in_set;        /* (thread) which of them are in the epoll set */
    int blocked;            /* (thread) waiting for the client to take `out` */
    int watch_input;        /* (thread) the client's own bytes are still watched for */
    pw_scan scan;           /* (thread) */
    char *in;               /* (thread) unparsed upstream bytes */
    size_t in_len, in_cap;  /* (thread) in_cap doubles from 4 KiB up to PW_IN_CAP */
    pw_buf out;             /* (thread) output not yet taken by the client's socket */
    int64_t leftover_ns;    /* (thread) the read time of the last bytes put in `in` */
    int ending;             /* (thread) PW_END_*, set as it is handed back */
    int err;                /* (thread) errno for UPSTREAM_ERROR, CLIENT_ERROR, FAULT */
    int end_written;        /* (thread) BODY: the response's end went into `out` */
    /* (lock) */
    pw_log log;             /* events since Python's last poll */
    int64_t last_read_ns;   /* the last read from the upstream (or the start) */
    int64_t blocked_since_ns; /* since when the client has not taken `out` (0: it has) */
    int64_t polled_ns;      /* Python's last poll */
    int64_t done_ns;        /* the read time of [DONE] (0: not yet) */
    int awaiting_first;     /* taken before its first token, and no poll has seen it yet */
    int stop_asked;
};

/* A new relay and its thread; NULL with `*err` set (errno) on failure. */
pw_relay *pw_relay_new(int *err);

/* Hand a stream to the thread: `s` zeroed but for `scan`; the descriptors are
 * duplicated here. 0, or -1 with errno (nothing is held then). */
int pw_relay_start(pw_relay *r, pw_stream *s, int up_fd, int client_fd);

/* Ask the thread to hand `s` back (PW_END_ASKED) if it still holds it. */
void pw_relay_stop(pw_relay *r, pw_stream *s);

/* The streams handed back since the last call, oldest first (linked by `next`); their
 * references are the caller's from here. `drain` reads the notification too. */
pw_stream *pw_relay_take_done(pw_relay *r, int drain);

/* Put streams taken by `pw_relay_take_done` back at the front of its list. */
void pw_relay_requeue(pw_relay *r, pw_stream *first);

/* Stop the thread, every stream it held handed back (PW_END_ASKED); idempotent. */
void pw_relay_close(pw_relay *r);

/* The relay's memory is shared by its Python object and each stream object that used it (a
 * stream's `poll` takes the lock): each holds a reference, taken and dropped with the GIL
 * held. The last one frees it; the relay must be closed and its lists taken by then. */
void pw_relay_hold(pw_relay *r);
void pw_relay_release(pw_relay *r);

/* For the tests: the thread fails on its next turn as if epoll_wait had (EIO). */
void pw_relay_inject_fault(pw_relay *r);

int pw_relay_notify_fd(const pw_relay *r);

/* The thread's failure (its errno), 0 while it runs or after a clean close. */
int pw_relay_failed(pw_relay *r);

void pw_relay_lock(pw_relay *r);
void pw_relay_unlock(pw_relay *r);

/* Under the lock: the held streams, for `fn`. */
void pw_relay_each_held(pw_relay *r, void (*fn)(pw_stream *, void *), void *ctx);

#endif /* __linux__ */
#endif
