/* domus._hotpath: the service's data path in C.
 *
 * FastPath answers the requests that make up nearly all of a service's
 * traffic -- PUT, GET, DELETE, CONTAINS, PUT_MANY, GET_MANY, PUT_IF_ABSENT,
 * DELETE_IF that succeed --
 * without running Python code, and drains a UDP socket in batches (recvmmsg,
 * sendmmsg), from the reactor (serve()) or from a thread of its own that
 * takes turns with the reactor thread (start_thread(); see "the serving
 * thread").  It is an accelerator for
 * domus.service.handler.RequestHandler.handle, which stays the reference:
 *
 *   - A reply FastPath gives is byte-identical to the one the Python handler
 *     gives for the same request in the same state, and it changes the
 *     repositories and the reply cache exactly as the Python handler would.
 *   - Everything else (other ops, errors of any kind, repositories it cannot
 *     drive) is *declined*: handle() returns None having changed nothing, and
 *     the caller asks the Python handler, which writes the full error reply.
 *
 * The state is owned by Python and shared, not copied:
 *   dhts         dict: DHT id -> (dict: bucket -> repository, layout), holding
 *                only the active DHTs (the handler keeps it up to date);
 *                `layout` is an int, replicated << 17 | guarded << 16 |
 *                numbering << 8 | tag: whether the DHT is replicated (its
 *                changes go to the bucket's backups first: see
 *                "replication"; an optional third item maps each bucket
 *                stored here to its backups' addresses), whether changes go
 *                to Python (a disk DHT near its reserve), the request
 *                header byte 3 that numbers buckets as this service does
 *                (a request that says another numbering is declined, and
 *                the Python handler translates it), and the reply header
 *                byte 3 that tells clients this service's layout version.
 *   cache        the reply cache, a ReplyCache (defined here: tables in C,
 *                read and filled by C without Python objects; the Python
 *                side rotates it).
 * A repository is driven directly when its type is exactly dict or the
 * `dict_type` given (DictRepository, a dict subclass whose methods mean
 * exactly the dict's), when it is an instance of the C RecordTree type
 * (RBTreeRepository, through the capsule API of domus._recordtree: keys and
 * values go in and out as the bytes the datagram carries, never as Python
 * objects, and a GET copies the stored value straight into its reply), or
 * when it is an instance of DatabaseRepository, defined here
 * (BerkeleyRepository): a repository whose records sit in a database object
 * with Berkeley DB's calling conventions, whose bound get/put/exists/delete
 * methods are C functions that C calls directly, and whose record count C
 * keeps.  Such a repository's Python-level methods are not called, so a
 * RecordTree or DatabaseRepository subclass must not give
 * put/get/delete/contains another meaning.  Other dict subclasses may keep
 * state beside the dict's (an index, a counter), so they are declined.
 *
 * A database call that fails (a Berkeley DB error: a full disk, a corrupt
 * page, a cache out of room) is not an error of the C path: C undoes what
 * the request changed, clears the exception and declines, and the Python
 * handler meets the failure again and answers STORAGE_ERROR.  A record tree
 * that has no memory for a record is declined the same way (the tree is
 * unchanged; its repository's put answers StorageFault).
 *
 * No Python code runs while a request is handled (bytes keys hash and
 * compare in C; berkeleydb's methods are C and run no Python code, though
 * they release the GIL around each call into libdb, which a service, having
 * no other threads, does not notice), but every object used across a call
 * that allocates is held by a strong reference anyway.  Functions return
 * HANDLED (1), DECLINED (0) or -1 with an exception set.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "hashes.h"
#include "recordtree_api.h"
#include "siphash.h"

/* The wire format; domus/wire/protocol.py is the reference (the tests check the
 * constants exported below against it). */
#define REQUEST_MAGIC 0xD0
#define REPLY_MAGIC 0xD1
#define PROTOCOL_VERSION 1
#define OP_PUT 0x01
#define OP_GET 0x02
#define OP_DELETE 0x03
#define OP_CONTAINS 0x04
#define OP_PUT_MANY 0x05
#define OP_GET_MANY 0x06
#define OP_REPLICATE 0x0D
#define OP_PUT_IF_ABSENT 0x0E
#define OP_DELETE_IF 0x0F
#define DIGEST_BYTES 8              /* DELETE_IF's: XXH64 (seed 0) of the value */
#define ST_OK 0x00
#define ST_NOT_FOUND 0x01
#define ST_BUSY 0x21
#define REQUEST_HEADER_SIZE 16
#define REPLY_HEADER_SIZE 8
#define TOKEN_OFFSET 4              /* request id and client id */
#define TOKEN_SIZE 12
/* A reply cache key: the token, then the XXH64 of the whole request under
 * the cache's seed (big-endian), so that another request under a reused
 * request id is not taken for a retry (domus.service.replycache.cache_key). */
#define CACHE_KEY_SIZE 20
#define KEYED_END 26                /* header, dht u32, bucket u32, klen u16 */
#define BATCH_END 22                /* header, dht u32, count u16 */
#define PUT_ENTRY_SIZE 10           /* bucket u32, klen u16, vlen u32 */
#define GET_ENTRY_SIZE 6            /* bucket u32, klen u16 */
#define MAX_KEY_BYTES 8192
#define MAX_VALUE_BYTES (16 * 1024 * 1024)
#define MAX_UDP_PAYLOAD 65507
#define MISSING 0xFFFFFFFFu
/* Larger than any UDP payload (65,535 - 8), so no datagram is cut. */
#define RECV_BUFFER_SIZE 65536
/* A secure deployment's datagrams (domus.wire.auth): a request ends with
 * its client's time (u32) and a MAC (u64), a reply with a MAC (u64); a
 * request more than TIME_WINDOW seconds from this clock is Python's to
 * answer (STALE_REQUEST). */
#define REQUEST_TRAILER 12
#define REPLY_TRAILER 8
#define TIME_WINDOW 5
/* One request in SAMPLE_EVERY answered here is sampled, (DHT id, bucket),
 * into a ring of SAMPLE_RING entries that the service drains on each
 * heartbeat: which buckets are hot, for the cost of a mask and a store. */
#define SAMPLE_EVERY 16
#define SAMPLE_RING 4096
/* Each bucket's changes made here are counted in one of GENERATIONS
 * counters (by a hash of DHT id and bucket; two buckets may share one), so
 * that a SCAN can tell that a bucket has not changed since a snapshot of
 * its keys was taken and share that snapshot (a counter that moved is only
 * ever a snapshot taken afresh). */
#define GENERATIONS 4096
/* Overload: the service is *behind* when, over a whole SHED_INTERVAL, every
 * datagram it read had waited more than shed_after in the socket's queue (a
 * standing queue, as CoDel tells one from a burst), and stays behind until
 * an interval in which one had waited less than half that.  While behind,
 * a datagram that waited more than shed_after is answered BUSY unserved.
 * A burst (or a pause of the process) that drains within an interval sheds
 * nothing.
 * A socket buffer that holds less than shed_after of work never lets a
 * datagram wait that long: the kernel drops what does not fit instead,
 * and clients see timeouts, not BUSY.  So an interval in which the kernel
 * dropped datagrams (SO_RXQ_OVFL's count moved) with at least
 * SHED_MIN_DATAGRAMS read is behind too, and the limit past which a
 * datagram is shed becomes half the longest wait of that interval (half
 * of what the full buffer holds), until the service is no longer behind.
 * domus.service.udp.Shedder is the Python twin. */
#define SHED_INTERVAL_NS 100000000LL
/* ... and a standing queue is one of at least SHED_MIN_DATAGRAMS datagrams
 * an interval: a few requests that waited because the process was not
 * scheduled (a machine shared with other work) are late, not a queue. */
#define SHED_MIN_DATAGRAMS 32
/* A shed request's BUSY carries a retry-after (u16, milliseconds): one
 * interval, doubling with each interval the service has been behind in a
 * row, up to 2 s, so that the clients of a service long behind come back
 * later and fewer datagrams are spent on refusals. */
#define RETRY_AFTER_MAX_MS 2000

/* The layout's flags (see `dhts` above). */
#define LAYOUT_GUARDED 0x10000L
#define LAYOUT_REPLICATED 0x20000L

#define HANDLED 1
#define DECLINED 0
/* A change to a replicated bucket sent to its backups: answered later,
 * when they have taken it (see "replication"). */
#define QUEUED 2
/* What a repository function returns when a database call failed: its
 * exception is cleared, and that call changed nothing. */
#define FAILED (-2)

/* A repository whose records are in a database object (a Berkeley DB DB):
 * its bound methods, the conventions they follow, and its record count.
 * The methods, or all of them, are NULL until __init__ has run; such a
 * repository is declined. */
typedef struct {
    PyObject_HEAD
    PyObject *get;              /* get(key) -> bytes or None */
    PyObject *put;              /* put(key, value[, txn, flags]) */
    PyObject *exists;           /* exists(key) -> bool */
    PyObject *remove;           /* delete(key) */
    PyObject *no_overwrite;     /* the flags that make put refuse a key */
    PyObject *key_exists;       /* what put raises when it refuses */
    PyObject *not_found;        /* what delete raises for an absent key */
    /* A bytearray shared by the repositories of one cache that cannot
     * evict (a RAM environment's), or NULL: its first byte is set when a
     * put found the cache full (it raised MemoryError or `no_memory`), and
     * cleared when a delete gives room back.  While it is set, puts fail
     * at once rather than have Berkeley DB search its cache for room for
     * four seconds, each time, to fail anyway. */
    PyObject *room;
    PyObject *no_memory;
    Py_ssize_t record_count;
} DatabaseRepository;

static PyTypeObject DatabaseRepositoryType;

typedef struct {
    PyObject_HEAD
    PyObject *dhts;
    PyObject *cache;                    /* a ReplyCache */
    PyObject *tree_type;                /* or NULL */
    PyObject *dict_type;                /* or NULL */
    const DomusRecordTreeAPI *tree_api; /* NULL: trees are declined */
    unsigned char layout_tag;           /* the request's DHT's, for its reply */
    struct Batch *batch;                /* serve()'s and the thread's, made lazily */
    unsigned long long requests;
    unsigned long long replayed;
    unsigned long long fallbacks;
    /* (written by the serving thread without the GIL: atomic) */
    _Atomic unsigned long long send_errors;
    _Atomic unsigned long long recv_errors;
    unsigned long long bytes_received;  /* datagrams serve() read */
    _Atomic unsigned long long bytes_sent;  /* replies serve() sent */
    unsigned long long by_op[256];
    unsigned long long by_status[256];  /* replies given, by status byte */
    int keyed;                          /* a secure deployment: datagrams carry MACs */
    unsigned char key[16];              /* the data plane's SipHash key */
    unsigned long long unauthenticated; /* datagrams dropped: no MAC, or a wrong one */
    unsigned long long sampled;         /* samples taken since the last take */
    uint64_t samples[SAMPLE_RING];      /* dht id << 32 | bucket */
    unsigned long long busy;            /* changes refused: the reply cache is full */
    unsigned long long shed;            /* datagrams answered BUSY: they waited too long */
    long long shed_after_ns;            /* how long is too long; <= 0: never shed */
    long long interval_end_ns;          /* the end of this shedding interval */
    long long interval_min_ns;          /* the least wait seen in it */
    long long interval_count;           /* datagrams read in it */
    long long interval_max_ns;          /* the longest wait seen in it */
    long long shed_limit_ns;            /* while behind, shed what waited longer */
    uint32_t kernel_drops;              /* SO_RXQ_OVFL's count, as last read */
    uint32_t interval_drops;            /* ... as the interval began */
    int behind;                         /* the last interval said: shed */
    int behind_streak;                  /* intervals behind in a row (<= 6) */
    int reply_factor;                   /* insecure: replies <= factor * request; 0: any */
    uint64_t generations_of[GENERATIONS];   /* changes per bucket (hashed) */
    /* The serving thread (see "the serving thread" below). */
    pthread_t thread;
    int thread_running;                 /* started and not yet stopped */
    unsigned long thread_generation;    /* the fork_generation it was started in */
    atomic_int thread_stopping;
    int thread_fd;                      /* the socket */
    int thread_wake_fd;                 /* the reactor's eventfd */
    int thread_stop_fd;                 /* the thread's own eventfd */
    PyObject *thread_queue;             /* list: what C declined, for the reactor */
    PyObject *thread_baton;             /* Baton */
    unsigned long long thread_errors;   /* batches the thread failed to handle */
    /* Replication (see "replication" below). */
    PyObject *backup;                   /* the FastPath of the backups held here, or NULL */
    PyObject *holders;                  /* the request's DHT's bucket -> backups (borrowed) */
    long found_layout;                  /* the request's DHT's layout (find_buckets) */
    const struct sockaddr_storage *current_peer;    /* the datagram handled, or NULL */
    socklen_t current_peer_length;
    const unsigned char *current_stamp; /* its time (a secure deployment), or NULL */
    int apply_replicated;               /* apply a replicated change here (its backups have it) */
    struct Forwards *forwards;          /* made by start_thread, NULL otherwise */
    unsigned long long forwarded;       /* changes sent to backups from C */
    unsigned long long forward_resends; /* REPLICATEs sent again (no answer in time) */
    unsigned long long forward_failures;/* changes failed: a backup did not take them */
    unsigned long long replicated;      /* REPLICATEs applied here as a backup, in C */
    unsigned long long late_answers;    /* backups' answers to REPLICATEs no longer waited for */
    long long spin_ns;                  /* the serving thread reads this long before it sleeps */
    unsigned long long spun;            /* batches it read so, without sleeping */
} FastPath;

typedef enum {
    REPO_UNSUPPORTED, REPO_DICT, REPO_TREE, REPO_DATABASE
} RepoKind;

/* A bucket's repository, with a strong reference. */
typedef struct {
    PyObject *object;
    RepoKind kind;
} Repo;

/* The most body bytes a reply keeps after its header in Reply.head: a
 * PUT's (1) and a PUT_MANY's (4), so that a change's reply, fresh or from
 * the reply cache, is sent without making a bytes object. */
#define REPLY_HEAD_BODY 4

/* A handled request's answer: the whole reply as bytes, or a reply header
 * (and `body` more bytes of it) followed by a stored value (GET), which
 * serve() sends without copying. */
typedef struct {
    PyObject *whole;                        /* new reference or NULL */
    unsigned char head[REPLY_HEADER_SIZE + REPLY_HEAD_BODY];
    int body;                               /* bytes of head after the header */
    PyObject *value;                        /* new reference or NULL */
} Reply;

/* Datagrams read (recvmmsg) and replies sent (sendmmsg) at a time. */
#define BATCH_SIZE 32
/* Batches the serving thread handles at most before it lets the GIL and
 * the baton go (as many datagrams as the reactor's doRead reads at most,
 * domus.service.udp.MAX_DATAGRAMS). */
#define THREAD_ROUNDS 8

/* A batch of datagrams and C's replies to them (see "batches" below). */
typedef struct Batch {
    struct mmsghdr in[BATCH_SIZE];
    struct iovec into[BATCH_SIZE];
    struct sockaddr_storage peers[BATCH_SIZE];
    union {
        struct cmsghdr align;
        char bytes[CMSG_SPACE(sizeof(struct timespec)) + CMSG_SPACE(sizeof(uint32_t))];
    } controls[BATCH_SIZE];
    unsigned char *buffers;             /* BATCH_SIZE * RECV_BUFFER_SIZE */
    struct mmsghdr out[BATCH_SIZE];
    struct iovec parts[BATCH_SIZE][3];
    unsigned char macs[BATCH_SIZE][REPLY_TRAILER];
    Reply replies[BATCH_SIZE];
    int pending;                        /* replies in out[0..pending) */
    int sent;                           /* of those, how many batch_send went past */
} Batch;

static void batch_settle(FastPath *self, Batch *batch);
static void batch_free(Batch *batch);

static inline int
recvmmsg_count(Py_ssize_t left)
{
    return left < BATCH_SIZE ? (int)left : BATCH_SIZE;
}

/* ------------------------------------------------------------ bytes */

static inline uint32_t
read_u32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16)
           | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline uint16_t
read_u16(const unsigned char *p)
{
    return (uint16_t)(((unsigned)p[0] << 8) | (unsigned)p[1]);
}

static inline uint64_t
read_u64(const unsigned char *p)
{
    return ((uint64_t)read_u32(p) << 32) | read_u32(p + 4);
}

static inline void
write_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static inline void
write_u16(unsigned char *p, uint16_t v)
{
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
}

/* Writes the 8-byte reply header for `request` (whose id it echoes), with
 * the layout tag of the request's DHT. */
static void
write_reply_header(unsigned char *out, int status,
                   const unsigned char *request, unsigned char layout_tag)
{
    out[0] = REPLY_MAGIC;
    out[1] = PROTOCOL_VERSION;
    out[2] = (unsigned char)status;
    out[3] = layout_tag;
    memcpy(out + 4, request + 4, 4);
}

/* A new bytes object: the reply header and `body_size` zero bytes.  Never a
 * shared singleton (it is at least 8 bytes), so it may be filled in until
 * another reference to it is handed out. */
static PyObject *
new_reply(int status, const unsigned char *request, Py_ssize_t body_size,
          unsigned char layout_tag)
{
    PyObject *reply = PyBytes_FromStringAndSize(NULL,
                                                REPLY_HEADER_SIZE + body_size);
    if (reply == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(reply);
    write_reply_header(out, status, request, layout_tag);
    memset(out + REPLY_HEADER_SIZE, 0, (size_t)body_size);
    return reply;
}

static void
reply_clear(Reply *reply)
{
    Py_CLEAR(reply->whole);
    Py_CLEAR(reply->value);
    reply->body = 0;
}

/* ------------------------------------------------------------ repositories */

static RepoKind
repo_kind(FastPath *self, PyObject *repo)
{
    if (PyDict_CheckExact(repo)
            || (self->dict_type != NULL
                && Py_IS_TYPE(repo, (PyTypeObject *)self->dict_type))) {
        return REPO_DICT;
    }
    if (self->tree_api != NULL && PyObject_TypeCheck(repo,
                                                     self->tree_api->type)) {
        return REPO_TREE;
    }
    if (PyObject_TypeCheck(repo, &DatabaseRepositoryType)
            && ((DatabaseRepository *)repo)->get != NULL) {
        return REPO_DATABASE;
    }
    return REPO_UNSUPPORTED;
}

/* The bucket table of an active DHT, for a request whose header byte 3
 * (its bucket numbering) is `numbering` and which changes records if
 * `changing`: a borrowed reference in *buckets, and the DHT's layout tag in
 * self->layout_tag.  HANDLED; DECLINED (no such DHT here, an entry of
 * another shape, a request numbered otherwise than the DHT -- the Python
 * handler translates it --, or a change to a replicated DHT); or -1. */
static int
find_buckets(FastPath *self, uint32_t dht_id, unsigned char numbering,
             int changing, PyObject **buckets)
{
    if (self->dhts == NULL) {
        return DECLINED;
    }
    PyObject *id = PyLong_FromUnsignedLong(dht_id);
    if (id == NULL) {
        return -1;
    }
    PyObject *found = PyDict_GetItemWithError(self->dhts, id);
    Py_DECREF(id);
    if (found == NULL) {
        return PyErr_Occurred() ? -1 : DECLINED;
    }
    if (!PyTuple_CheckExact(found)
            || (PyTuple_GET_SIZE(found) != 2 && PyTuple_GET_SIZE(found) != 3)
            || !PyDict_Check(PyTuple_GET_ITEM(found, 0))
            || !PyLong_CheckExact(PyTuple_GET_ITEM(found, 1))) {
        return DECLINED;
    }
    long layout = PyLong_AsLong(PyTuple_GET_ITEM(found, 1));
    if (layout < 0 || layout > (LAYOUT_GUARDED | LAYOUT_REPLICATED | 0xFFFF)) {
        PyErr_Clear();
        return DECLINED;
    }
    if (numbering != 0 && numbering != (unsigned char)(layout >> 8)) {
        return DECLINED;
    }
    PyObject *holders = PyTuple_GET_SIZE(found) == 3 ? PyTuple_GET_ITEM(found, 2) : NULL;
    self->holders = holders != NULL && PyDict_Check(holders) ? holders : NULL;
    self->found_layout = layout;        /* (before a decline: handle_change reads it) */
    if (changing && ((layout & LAYOUT_GUARDED)
                     || ((layout & LAYOUT_REPLICATED) && !self->apply_replicated))) {
        return DECLINED;
    }
    self->layout_tag = (unsigned char)(layout & 0xFF);
    *buckets = PyTuple_GET_ITEM(found, 0);
    return HANDLED;
}

/* The repository of `bucket`, with a new reference in repo->object.
 * HANDLED, DECLINED (not stored here, or a kind C cannot drive), or -1. */
static int
find_repo(FastPath *self, PyObject *buckets, uint32_t bucket, Repo *repo)
{
    PyObject *number = PyLong_FromUnsignedLong(bucket);
    if (number == NULL) {
        return -1;
    }
    PyObject *found = PyDict_GetItemWithError(buckets, number);
    Py_DECREF(number);
    if (found == NULL) {
        return PyErr_Occurred() ? -1 : DECLINED;
    }
    RepoKind kind = repo_kind(self, found);
    if (kind == REPO_UNSUPPORTED) {
        return DECLINED;
    }
    Py_INCREF(found);
    repo->object = found;
    repo->kind = kind;
    return HANDLED;
}

/* Calls one of a database's methods (holding it across the call, which
 * releases the GIL): a new reference, or NULL with the exception set. */
static PyObject *
database_call(PyObject *method, PyObject *const *args, size_t count)
{
    Py_INCREF(method);
    PyObject *result = PyObject_Vectorcall(method, args, count, NULL);
    Py_DECREF(method);
    return result;
}

/* 1 with a new reference in *value, 0 if absent, FAILED. */
static int
database_get(DatabaseRepository *db, PyObject *key, PyObject **value)
{
    PyObject *found = database_call(db->get, &key, 1);
    if (found == NULL) {
        PyErr_Clear();
        return FAILED;
    }
    if (found == Py_None) {
        Py_DECREF(found);
        return 0;
    }
    *value = found;
    return 1;
}

/* 1 if present, 0 if absent, FAILED. */
static int
database_contains(DatabaseRepository *db, PyObject *key)
{
    PyObject *answer = database_call(db->exists, &key, 1);
    if (answer == NULL) {
        PyErr_Clear();
        return FAILED;
    }
    int present = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    if (present < 0) {
        PyErr_Clear();
        return FAILED;
    }
    return present;
}

/* Whether the repository's cache was found full (see `room`). */
static inline int
database_full(const DatabaseRepository *db)
{
    return db->room != NULL && PyByteArray_GET_SIZE(db->room) > 0
           && PyByteArray_AS_STRING(db->room)[0] != 0;
}

/* A put failed with the exception set: if for lack of room in the cache,
 * the cache is noted full (see `room`).  Keeps the exception. */
static void
database_note_failure(DatabaseRepository *db)
{
    if (db->room == NULL || PyByteArray_GET_SIZE(db->room) == 0) {
        return;
    }
    if (PyErr_ExceptionMatches(PyExc_MemoryError)
            || (db->no_memory != NULL && PyErr_ExceptionMatches(db->no_memory))) {
        PyByteArray_AS_STRING(db->room)[0] = 1;
    }
}

/* BerkeleyRepository.put: a put that refuses an existing key, then, if it
 * did, one that overwrites it.  1 if the key was new (counted), 0 if its
 * value was replaced, FAILED (nothing changed).  With `previous`, a
 * replaced value is read before it is overwritten and handed back in
 * *previous (a new reference), so that the change can be undone. */
static int
database_put(DatabaseRepository *db, PyObject *key, PyObject *value,
             PyObject **previous)
{
    if (database_full(db)) {
        return FAILED;      /* (Python refuses it, saying why, at once) */
    }
    PyObject *args[4] = {key, value, Py_None, db->no_overwrite};
    PyObject *done = database_call(db->put, args, 4);
    if (done != NULL) {
        Py_DECREF(done);
        db->record_count++;
        return 1;
    }
    int refused = PyErr_ExceptionMatches(db->key_exists);
    if (!refused) {
        database_note_failure(db);
    }
    PyErr_Clear();
    if (!refused) {
        return FAILED;
    }
    PyObject *old = NULL;
    if (previous != NULL && database_get(db, key, &old) != 1) {
        return FAILED;      /* (absent: only another writer could do that) */
    }
    done = database_call(db->put, args, 2);
    if (done == NULL) {
        database_note_failure(db);
        PyErr_Clear();
        Py_XDECREF(old);
        return FAILED;
    }
    Py_DECREF(done);
    if (previous != NULL) {
        *previous = old;
    }
    return 0;
}

/* 1 if removed (counted), 0 if absent, FAILED (nothing changed). */
static int
database_remove(DatabaseRepository *db, PyObject *key)
{
    PyObject *done = database_call(db->remove, &key, 1);
    if (done != NULL) {
        Py_DECREF(done);
        db->record_count--;
        if (database_full(db)) {
            PyByteArray_AS_STRING(db->room)[0] = 0;     /* (room given back) */
        }
        return 1;
    }
    int absent = PyErr_ExceptionMatches(db->not_found);
    PyErr_Clear();
    return absent ? 0 : FAILED;
}

/* A value found in a repository: a bytes object (a dict's or a database's),
 * or bytes in a record tree's arena (`object` NULL), which stay valid until
 * the tree next changes -- nothing changes a tree while a request is being
 * handled.  `size` is -1 for a value that is not bytes (only a dict can
 * hold one): the Python handler judges what that means. */
typedef struct {
    PyObject *object;           /* new reference, or NULL */
    const char *data;
    Py_ssize_t size;
} Found;

static void
found_clear(Found *found)
{
    Py_CLEAR(found->object);
    found->data = NULL;
    found->size = 0;
}

static PyObject *
bytes_of(const unsigned char *data, Py_ssize_t size)
{
    return PyBytes_FromStringAndSize((const char *)data, size);
}

/* 1 with the value in *value, 0 if absent, -1 on error, FAILED.  A tree
 * is searched with the key's bytes as they are; dicts and databases get a
 * key object. */
static int
repo_get(FastPath *self, Repo repo, const unsigned char *key,
         Py_ssize_t key_size, Found *value)
{
    if (repo.kind == REPO_TREE) {
        return self->tree_api->find(repo.object, (const char *)key, key_size,
                                    &value->data, &value->size);
    }
    PyObject *key_object = bytes_of(key, key_size);
    if (key_object == NULL) {
        return -1;
    }
    PyObject *found = NULL;
    int present;
    if (repo.kind == REPO_DATABASE) {
        present = database_get((DatabaseRepository *)repo.object, key_object,
                               &found);
    }
    else {
        found = PyDict_GetItemWithError(repo.object, key_object);
        present = found != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
        Py_XINCREF(found);
    }
    Py_DECREF(key_object);
    if (present == 1) {
        value->object = found;
        if (PyBytes_Check(found)) {
            value->data = PyBytes_AS_STRING(found);
            value->size = PyBytes_GET_SIZE(found);
        }
        else {
            value->data = NULL;
            value->size = -1;
        }
    }
    return present;
}

/* 1 if present, 0 if absent, -1 on error, FAILED. */
static int
repo_contains(FastPath *self, Repo repo, const unsigned char *key,
              Py_ssize_t key_size)
{
    if (repo.kind == REPO_TREE) {
        return self->tree_api->find(repo.object, (const char *)key, key_size,
                                    NULL, NULL);
    }
    PyObject *key_object = bytes_of(key, key_size);
    if (key_object == NULL) {
        return -1;
    }
    int present = repo.kind == REPO_DATABASE
        ? database_contains((DatabaseRepository *)repo.object, key_object)
        : PyDict_Contains(repo.object, key_object);
    Py_DECREF(key_object);
    return present;
}

/* 1 if the key was new, 0 if its value was replaced, -1 on error or FAILED
 * (nothing changed).  A tree stores the bytes as they are (FAILED if it has
 * no memory for them); dicts and databases get key and value objects.
 * `previous` as for database_put, which alone uses it. */
static int
repo_put(FastPath *self, Repo repo, const unsigned char *key,
         Py_ssize_t key_size, const unsigned char *value,
         Py_ssize_t value_size, PyObject **previous)
{
    if (repo.kind == REPO_TREE) {
        int created = self->tree_api->put(repo.object, (const char *)key,
                                          key_size, (const char *)value,
                                          value_size);
        if (created < 0 && PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Clear();
            return FAILED;
        }
        return created;
    }
    PyObject *key_object = bytes_of(key, key_size);
    PyObject *value_object = key_object ? bytes_of(value, value_size) : NULL;
    int created;
    if (value_object == NULL) {
        created = -1;
    }
    else if (repo.kind == REPO_DATABASE) {
        created = database_put((DatabaseRepository *)repo.object, key_object,
                               value_object, previous);
    }
    else {
        /* One lookup: storing a new key is what grows the dict. */
        Py_ssize_t before = PyDict_GET_SIZE(repo.object);
        created = PyDict_SetItem(repo.object, key_object, value_object) < 0
                  ? -1 : PyDict_GET_SIZE(repo.object) > before;
    }
    Py_XDECREF(key_object);
    Py_XDECREF(value_object);
    return created;
}

/* 1 if removed, 0 if absent, -1 on error or FAILED (nothing changed).
 * Dicts are asked only for a key they hold. */
static int
repo_remove(FastPath *self, Repo repo, const unsigned char *key,
            Py_ssize_t key_size)
{
    if (repo.kind == REPO_TREE) {
        return self->tree_api->remove(repo.object, (const char *)key,
                                      key_size);
    }
    PyObject *key_object = bytes_of(key, key_size);
    if (key_object == NULL) {
        return -1;
    }
    int removed;
    if (repo.kind == REPO_DATABASE) {
        removed = database_remove((DatabaseRepository *)repo.object,
                                  key_object);
    }
    else {
        removed = PyDict_DelItem(repo.object, key_object) < 0 ? -1 : 1;
    }
    Py_DECREF(key_object);
    return removed;
}

/* ------------------------------------------------------------ the reply cache
 *
 * ReplyCache (domus.service.replycache's CompactReplyCache derives from it;
 * its pure-Python twin is domus.service.replycache.ReplyCache, which the
 * tests hold it to) keeps each applied change's reply under its key
 * (cache_key: the request's token and a hash of its bytes) in two
 * generations, current and previous.  A key is looked up in both; a new
 * reply goes into the current one; rotate() drops the previous generation
 * and makes the current one previous.  A change that would grow the current
 * generation past `current_limit` is answered BUSY: no entry is dropped
 * before its time, so no retry can find its reply gone.
 *
 * A generation is two open-addressed tables (linear probing, at most
 * RC_LOAD_NUM / RC_LOAD_DEN full, any number of slots: a key's first slot
 * is its hash scaled to the table's size):
 *   small  24-byte slots: the key, then the reply inline -- status, layout
 *          tag and up to RC_INLINE_BODY body bytes; its magic, version and
 *          request id (the key's first 4 bytes) are implied.  Every reply
 *          of a single-key change (PUT, DELETE) is kept so.
 *   big    32-byte slots: the key and a buffer of its own holding the
 *          reply (u32 size, then the bytes): PUT_MANY's, and anything
 *          else put() is given.
 * A table is allocated on its first entry and grows by half as it fills
 * (never past the size that holds `current_limit` entries), so that it is
 * at least 8/15 full once grown: at most 45 bytes an inline entry, 30 when
 * full (doubling would leave it 2/5 full, 60 bytes, just after).  Growing is
 * incremental, so that no one change pays for moving millions of entries:
 * the new slot array takes the inserts, and each insert moves the entries
 * of the next RC_MIGRATE_STEP slots of the old array across (lookups look
 * in both; an old slot below the cursor has moved).  The new array of a
 * mapped size is made ahead, from 3/5 full, and its pages are written a
 * few per insert by 3/4 (rc_ahead), so that the growth's inserts do not
 * all pay the kernel for fresh pages at once.  The current
 * generation's small table starts at the size the last generation reached,
 * so that a steady load does not regrow it at all, and in the array of the
 * generation rotation drops when that is about the size (its slots carry
 * an epoch, so it needs no clearing; see rc_rotate).  Rotation frees the
 * rest of the previous generation (and the big table's buffers): no work
 * per inline entry.  Arrays of RC_MAP_AT bytes or more are mapped from the
 * kernel (rc_alloc), and one of RC_FREE_APART bytes or more is unmapped by
 * a short-lived thread of its own, since giving its pages back takes
 * milliseconds (nothing else touches it by then).
 *
 * Thread use: every function here runs holding the GIL (and, on a service,
 * the baton), as the dicts this replaces did; nothing here releases it.  A
 * caller that may release the GIL between two calls (a Berkeley DB put)
 * holds no pointer into a table across it, only the key. */

#define RC_SMALL_SLOT 24
#define RC_BIG_SLOT 32
#define RC_KIND 20              /* offset of the kind byte in every slot */
#define RC_INLINE_BODY 1
#define RC_MIN_SMALL 1024       /* slots of a small table's first allocation */
#define RC_MIN_BIG 16
#define RC_LOAD_NUM 4
#define RC_LOAD_DEN 5
#define RC_MIGRATE_STEP 8       /* old slots moved across per insert */
#define RC_FREE_APART (16u << 20)
#define RC_MAP_AT (1u << 20)    /* arrays this large are mapped, not malloc'd */
#define RC_PAGE 4096
/* The next array is made at 3/5 full and all its pages touched by 3/4
 * (a table grows at 4/5). */
#define RC_AHEAD_FROM_NUM 3
#define RC_AHEAD_FROM_DEN 5
#define RC_AHEAD_BY_NUM 3
#define RC_AHEAD_BY_DEN 4

/* A slot's kind byte: its epoch (the high 6 bits: the slot is empty
 * unless they are its array's epoch, 1..RC_EPOCHS) and what it holds (the
 * low 2 bits).  A fresh array is all zeros, empty in any epoch; an array
 * reused for another generation only needs its epoch moved on. */
enum {
    RC_INLINE = 1,              /* small: + the number of body bytes */
    RC_OUTSIDE = 3,             /* big: the reply is in a buffer */
    RC_WHAT = 3,
    RC_EPOCH_SHIFT = 2,
    RC_EPOCHS = 63
};

typedef struct {
    unsigned char *slots;       /* capacity * slot_size bytes, or NULL */
    size_t capacity;
    size_t count;               /* entries in slots */
    size_t slot_size;
    /* While growing: the last array, whose slots from `cursor` on have not
     * moved into `slots` yet (`old_left` entries); NULL otherwise. */
    unsigned char *old;
    size_t old_capacity;
    size_t cursor;
    size_t old_left;
    unsigned epoch;             /* the slots' epoch */
    unsigned old_epoch;         /* the old array's */
    /* The array the next growth will take, made once the table is
     * RC_AHEAD_FROM full and its pages touched a few per insert from then
     * on (rc_ahead); NULL otherwise. */
    unsigned char *ahead;
    size_t ahead_capacity;
    size_t ahead_touched;       /* bytes of it whose pages are touched */
    size_t ahead_from;          /* entries when it was made */
} RcTable;

#define RC_TABLE(size) ((RcTable){NULL, 0, 0, (size), NULL, 0, 0, 0, 1, 1, NULL, 0, 0, 0})

/* Whether `slot` holds an entry, in an array of epoch `epoch`. */
static inline int
rc_used(const unsigned char *slot, unsigned epoch)
{
    return slot[RC_KIND] != 0 && (unsigned)(slot[RC_KIND] >> RC_EPOCH_SHIFT) == epoch;
}

static inline unsigned char
rc_kind_byte(unsigned epoch, unsigned what)
{
    return (unsigned char)(epoch << RC_EPOCH_SHIFT | what);
}

typedef struct {
    RcTable small;
    RcTable big;
} RcGeneration;

typedef struct {
    PyObject_HEAD
    RcGeneration generations[2];        /* current, previous */
    Py_ssize_t current_limit;           /* most entries in the current one */
    size_t start_slots;                 /* the next current small table's size */
    size_t outside_bytes;               /* the big tables' buffers, in bytes */
    unsigned long long seed;            /* the keys' XXH64 seed */
    unsigned long long refused;         /* put()s refused: the cache was full */
    unsigned long long hits;            /* get()s that found a reply */
    /* The next current generation's small array, made before the rotation
     * when the one it drops will not do (prepare), its pages touched a few
     * per insert until then (rc_warm); NULL otherwise. */
    unsigned char *spare;
    size_t spare_capacity;
    size_t spare_touched;               /* bytes of it whose pages are touched */
    size_t spare_from;                  /* current entries when it was made */
    size_t spare_until;                 /* ... expected at the rotation */
} ReplyCache;

static PyTypeObject ReplyCacheType;

/* A key's hash: its bytes mixed (the last 8 are already an XXH64, but a
 * caller of put() may give any 20 bytes). */
static inline uint64_t
rc_hash(const unsigned char *key)
{
    uint64_t hash = read_u64(key + 12) ^ (read_u64(key + 4) * DOMUS_P64_1)
                    ^ ((uint64_t)read_u32(key) * DOMUS_P64_2);
    hash ^= hash >> 33;
    hash *= 0xFF51AFD7ED558CCDULL;
    hash ^= hash >> 33;
    hash *= 0xC4CEB9FE1A85EC53ULL;
    hash ^= hash >> 33;
    return hash;
}

/* The first slot `hash` probes in a table of `capacity` slots. */
static inline size_t
rc_home(uint64_t hash, size_t capacity)
{
    return (size_t)(((unsigned __int128)hash * capacity) >> 64);
}

/* Finds `key` in an array of `capacity` slots of `slot_size` bytes: its
 * slot, or NULL. */
static unsigned char *
rc_probe(unsigned char *slots, size_t capacity, size_t slot_size,
         unsigned epoch, const unsigned char *key, uint64_t hash)
{
    size_t index = rc_home(hash, capacity);
    for (;;) {
        unsigned char *slot = slots + index * slot_size;
        if (!rc_used(slot, epoch)) {
            return NULL;
        }
        if (memcmp(slot, key, CACHE_KEY_SIZE) == 0) {
            return slot;
        }
        if (++index == capacity) {
            index = 0;
        }
    }
}

/* The first empty slot of `hash`'s probe sequence in an array (which has
 * one: it is never full). */
static unsigned char *
rc_empty_slot(unsigned char *slots, size_t capacity, size_t slot_size,
              unsigned epoch, uint64_t hash)
{
    size_t index = rc_home(hash, capacity);
    for (;;) {
        unsigned char *slot = slots + index * slot_size;
        if (!rc_used(slot, epoch)) {
            return slot;
        }
        if (++index == capacity) {
            index = 0;
        }
    }
}

static inline size_t
rc_entries(const RcTable *table)
{
    return table->count + table->old_left;
}

/* The slot holding `key` (in the new array, or in the old one if it has
 * not moved yet), or NULL. */
static unsigned char *
rc_find(const RcTable *table, const unsigned char *key, uint64_t hash)
{
    if (table->count > 0) {
        unsigned char *slot = rc_probe(table->slots, table->capacity,
                                       table->slot_size, table->epoch, key, hash);
        if (slot != NULL) {
            return slot;
        }
    }
    if (table->old_left > 0) {
        unsigned char *slot = rc_probe(table->old, table->old_capacity,
                                       table->slot_size, table->old_epoch, key, hash);
        /* (below the cursor: moved, and since erased from the new array) */
        if (slot != NULL
                && (size_t)(slot - table->old) / table->slot_size >= table->cursor) {
            return slot;
        }
    }
    return NULL;
}

/* A new array of `count` zeroed slots of `size` bytes, or NULL.  A large
 * one is mapped from the kernel, not taken from malloc: a service's malloc
 * keeps blocks up to 32 MiB on its heap (domus.service.allocator), where
 * calloc must clear them at once -- 20 ms for 26 MB, on one change --
 * while a mapping's pages come zeroed when first touched. */
static unsigned char *
rc_alloc(size_t count, size_t size)
{
    if (count > SIZE_MAX / size) {
        return NULL;
    }
    if (count * size < RC_MAP_AT) {
        return calloc(count, size);
    }
    void *slots = mmap(NULL, count * size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return slots == MAP_FAILED ? NULL : slots;
}

/* Gives back an array rc_alloc made for `bytes` bytes. */
static void
rc_free(void *slots, size_t bytes)
{
    if (bytes < RC_MAP_AT) {
        free(slots);
    }
    else {
        munmap(slots, bytes);
    }
}

typedef struct {
    void *slots;
    size_t bytes;
} RcFreeing;

static void *
rc_free_later(void *arg)
{
    RcFreeing *freeing = arg;
    rc_free(freeing->slots, freeing->bytes);
    free(freeing);
    return NULL;
}

/* Gives back an array of `bytes` bytes: a large one on a thread of its own
 * (its pages going back to the kernel take milliseconds), with every
 * signal blocked there, or here if no thread can be made. */
static void
rc_release(unsigned char *slots, size_t bytes)
{
    if (slots == NULL) {
        return;
    }
    RcFreeing *freeing = bytes >= RC_FREE_APART ? malloc(sizeof(*freeing)) : NULL;
    if (freeing != NULL) {
        sigset_t all, before;
        pthread_attr_t attributes;
        freeing->slots = slots;
        freeing->bytes = bytes;
        sigfillset(&all);
        if (pthread_attr_init(&attributes) == 0) {
            pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
            pthread_sigmask(SIG_SETMASK, &all, &before);
            pthread_t thread;
            int made = pthread_create(&thread, &attributes, rc_free_later, freeing);
            pthread_sigmask(SIG_SETMASK, &before, NULL);
            pthread_attr_destroy(&attributes);
            if (made == 0) {
                return;
            }
        }
        free(freeing);
    }
    rc_free(slots, bytes);
}

/* Moves the entries of the old array's next `slots` slots (all of them:
 * SIZE_MAX) into the new one; frees the old array once none is left. */
static void
rc_migrate(RcTable *table, size_t slots)
{
    size_t size = table->slot_size;
    while (slots-- > 0 && table->old_left > 0) {
        const unsigned char *slot = table->old + table->cursor * size;
        table->cursor++;
        if (rc_used(slot, table->old_epoch)) {
            unsigned char *into = rc_empty_slot(table->slots, table->capacity, size,
                                                table->epoch, rc_hash(slot));
            memcpy(into, slot, size);
            into[RC_KIND] = rc_kind_byte(table->epoch, slot[RC_KIND] & RC_WHAT);
            table->count++;
            table->old_left--;
        }
    }
    if (table->old != NULL && table->old_left == 0) {
        rc_release(table->old, table->old_capacity * size);
        table->old = NULL;
        table->old_capacity = 0;
        table->cursor = 0;
    }
}

/* The slots a table needs to hold `entries` within its load factor. */
static inline size_t
rc_slots_for(size_t entries)
{
    return entries / RC_LOAD_NUM * RC_LOAD_DEN
           + (entries % RC_LOAD_NUM) * RC_LOAD_DEN / RC_LOAD_NUM + 2;
}

/* The size a table grows to next (`first` slots if it has none), at
 * most the size that holds `most` entries. */
static size_t
rc_next_capacity(const RcTable *table, size_t first, size_t most)
{
    size_t ceiling = rc_slots_for(most);
    size_t capacity = table->capacity ? table->capacity + table->capacity / 2 : first;
    return capacity > ceiling ? ceiling : capacity;
}

/* Writes to the pages of `array` from byte *touched on, up to `target`
 * bytes: a fresh mapping's pages are faulted in here, a few at a time,
 * not by the inserts that will land all over them. */
static void
rc_touch(unsigned char *array, size_t *touched, size_t target)
{
    volatile unsigned char *pages = array;
    while (*touched < target) {
        pages[*touched] = 0;
        *touched += RC_PAGE;
    }
}

/* Gives back the array made ahead of a growth, if any. */
static void
rc_drop_ahead(RcTable *table)
{
    rc_release(table->ahead, table->ahead_capacity * table->slot_size);
    table->ahead = NULL;
    table->ahead_capacity = table->ahead_touched = table->ahead_from = 0;
}

/* Gets a table's next array ready while it still has room, so that the
 * growth does not pay the kernel for the new array's pages: a fresh
 * mapping's page costs some 2-4 us here when first written, and a
 * growing table's inserts land all over the new array, so that its first
 * few thousand inserts would each fault a page (some 80 ms for 94 MB, in
 * the first 100 ms or so after the growth: the service's rate halves and
 * a queue builds).  From RC_AHEAD_FROM full, each insert writes to the
 * next few untouched pages of the next array, enough to have touched
 * them all by RC_AHEAD_BY full -- the same kernel work, spread thin
 * (about one page per 20-30 inserts).  Only for mapped arrays (malloc's
 * small ones are mostly reused memory); not while a growth is under way;
 * no array if there is no memory for it (the growth then tries itself). */
static void
rc_ahead(RcTable *table, size_t most)
{
    if (table->old_left > 0 || table->capacity == 0) {
        return;
    }
    size_t entries = rc_entries(table);
    if (table->ahead == NULL) {
        if (entries < table->capacity / RC_AHEAD_FROM_DEN * RC_AHEAD_FROM_NUM) {
            return;
        }
        size_t next = rc_next_capacity(table, 0, most);
        if (next <= table->capacity || next > SIZE_MAX / table->slot_size
                || next * table->slot_size < RC_MAP_AT) {
            return;
        }
        table->ahead = rc_alloc(next, table->slot_size);
        if (table->ahead == NULL) {
            return;
        }
        table->ahead_capacity = next;
        table->ahead_touched = 0;
        table->ahead_from = entries;
    }
    size_t bytes = table->ahead_capacity * table->slot_size;
    if (table->ahead_touched >= bytes) {
        return;
    }
    /* (as much of it touched as the inserts since it was made are of
     * those from then to RC_AHEAD_BY full) */
    size_t by = table->capacity / RC_AHEAD_BY_DEN * RC_AHEAD_BY_NUM;
    size_t span = by > table->ahead_from ? by - table->ahead_from : 1;
    size_t done = entries >= table->ahead_from ? entries - table->ahead_from + 1 : 1;
    /* (fewer entries than then: discards) */
    size_t target = done >= span ? bytes
                                 : (size_t)((unsigned __int128)bytes * done / span);
    rc_touch(table->ahead, &table->ahead_touched, target);
}

/* Makes room in the table for one more entry, moving some entries of a
 * growth under way across first: grows it by half (or allocates `first` slots),
 * never past the size that holds `most` entries, and moves its entries
 * into the new array a few at a time from then on.  0, or -1 (no memory,
 * no exception set; the table is as it was). */
static int
rc_reserve(RcTable *table, size_t first, size_t most)
{
    rc_migrate(table, RC_MIGRATE_STEP);
    size_t needed = rc_slots_for(rc_entries(table) + 1);
    if (table->capacity >= needed) {
        rc_ahead(table, most);
        return 0;
    }
    rc_migrate(table, SIZE_MAX);    /* (a growth outgrown: not with these sizes) */
    size_t capacity = rc_next_capacity(table, first, most);
    if (capacity < needed) {
        capacity = needed;
    }
    unsigned char *slots;
    if (table->ahead != NULL && table->ahead_capacity == capacity) {
        slots = table->ahead;       /* (its untouched pages, if any, fault as they fill) */
        table->ahead = NULL;
        table->ahead_capacity = table->ahead_touched = 0;
    }
    else {
        rc_drop_ahead(table);
        slots = rc_alloc(capacity, table->slot_size);
    }
    if (slots == NULL) {
        return -1;
    }
    if (table->count == 0) {
        rc_release(table->slots, table->capacity * table->slot_size);
    }
    else {
        table->old = table->slots;
        table->old_capacity = table->capacity;
        table->old_epoch = table->epoch;
        table->cursor = 0;
        table->old_left = table->count;
    }
    table->slots = slots;
    table->capacity = capacity;
    table->count = 0;
    table->epoch = 1;
    rc_migrate(table, RC_MIGRATE_STEP);
    return 0;
}

/* Takes `key` (which the table holds) out, moving the entries after it in
 * its array back so that no probe sequence is broken.  (An entry still in
 * the old array of a growth makes the growth finish first.) */
static void
rc_erase(RcTable *table, const unsigned char *key, uint64_t hash)
{
    unsigned char *slot = rc_probe(table->slots, table->capacity,
                                   table->slot_size, table->epoch, key, hash);
    if (slot == NULL) {
        rc_migrate(table, SIZE_MAX);
        slot = rc_probe(table->slots, table->capacity, table->slot_size, table->epoch,
                        key, hash);
        if (slot == NULL) {
            return;
        }
    }
    size_t size = table->slot_size;
    size_t hole = (size_t)(slot - table->slots) / size;
    size_t next = hole;
    for (;;) {
        if (++next == table->capacity) {
            next = 0;
        }
        unsigned char *moving = table->slots + next * size;
        if (!rc_used(moving, table->epoch)) {
            break;
        }
        size_t home = rc_home(rc_hash(moving), table->capacity);
        /* It may fill the hole unless its home lies in (hole, next]. */
        int stays = hole <= next ? (hole < home && home <= next)
                                 : (hole < home || home <= next);
        if (!stays) {
            memcpy(table->slots + hole * size, moving, size);
            hole = next;
        }
    }
    memset(table->slots + hole * size, 0, size);
    table->count--;
}

/* Calls `each(slot, arg)` on every entry of the table. */
static int
rc_each(const RcTable *table, int (*each)(const unsigned char *, void *), void *arg)
{
    size_t size = table->slot_size;
    for (size_t i = 0; table->count > 0 && i < table->capacity; i++) {
        const unsigned char *slot = table->slots + i * size;
        if (rc_used(slot, table->epoch) && each(slot, arg) < 0) {
            return -1;
        }
    }
    for (size_t i = table->cursor; table->old_left > 0 && i < table->old_capacity; i++) {
        const unsigned char *slot = table->old + i * size;
        if (rc_used(slot, table->old_epoch) && each(slot, arg) < 0) {
            return -1;
        }
    }
    return 0;
}

/* The bytes a table's arrays take. */
static inline size_t
rc_table_bytes(const RcTable *table)
{
    return (table->capacity + table->old_capacity + table->ahead_capacity) * table->slot_size;
}

/* A big slot's buffer: u32 size, then the reply. */
static inline unsigned char *
rc_buffer(const unsigned char *slot)
{
    unsigned char *buffer;
    memcpy(&buffer, slot + 24, sizeof(buffer));
    return buffer;
}

static inline uint32_t
rc_buffer_size(const unsigned char *buffer)
{
    uint32_t size;
    memcpy(&size, buffer, sizeof(size));
    return size;
}

static int
rc_free_buffer(const unsigned char *slot, void *cache)
{
    unsigned char *buffer = rc_buffer(slot);
    ((ReplyCache *)cache)->outside_bytes -= 4 + (size_t)rc_buffer_size(buffer);
    free(buffer);
    return 0;
}

/* Frees a generation's tables and buffers; returns how many entries it
 * held. */
static size_t
rc_generation_free(ReplyCache *cache, RcGeneration *generation)
{
    size_t dropped = rc_entries(&generation->small) + rc_entries(&generation->big);
    rc_each(&generation->big, rc_free_buffer, cache);
    RcTable *tables[2] = {&generation->small, &generation->big};
    for (int t = 0; t < 2; t++) {
        RcTable *table = tables[t];
        rc_release(table->slots, table->capacity * table->slot_size);
        rc_release(table->old, table->old_capacity * table->slot_size);
        rc_drop_ahead(table);
    }
    generation->small = RC_TABLE(RC_SMALL_SLOT);
    generation->big = RC_TABLE(RC_BIG_SLOT);
    return dropped;
}

static inline size_t
rc_generation_count(const RcGeneration *generation)
{
    return rc_entries(&generation->small) + rc_entries(&generation->big);
}

/* Whether a new entry must wait for the next rotation. */
static inline int
rc_full(const ReplyCache *cache)
{
    return rc_generation_count(&cache->generations[0])
           >= (size_t)cache->current_limit;
}

/* Where `key` is: its slot (and *big says which table's), or NULL. */
static unsigned char *
rc_lookup(const ReplyCache *cache, const unsigned char *key, int *big,
          RcTable **table)
{
    uint64_t hash = rc_hash(key);
    for (int g = 0; g < 2; g++) {
        RcTable *small = (RcTable *)&cache->generations[g].small;
        RcTable *large = (RcTable *)&cache->generations[g].big;
        unsigned char *slot = rc_find(small, key, hash);
        if (slot != NULL) {
            *big = 0;
            if (table) {
                *table = small;
            }
            return slot;
        }
        slot = rc_find(large, key, hash);
        if (slot != NULL) {
            *big = 1;
            if (table) {
                *table = large;
            }
            return slot;
        }
    }
    return NULL;
}

/* Whether `reply` (for `key`) can be kept inline: a reply header whose
 * request id is the key's, and at most RC_INLINE_BODY more bytes. */
static inline int
rc_fits_inline(const unsigned char *key, const unsigned char *reply,
               size_t size)
{
    return size >= REPLY_HEADER_SIZE && size <= REPLY_HEADER_SIZE + RC_INLINE_BODY
           && reply[0] == REPLY_MAGIC && reply[1] == PROTOCOL_VERSION
           && memcmp(reply + 4, key, 4) == 0;
}

static void
rc_drop_spare(ReplyCache *cache)
{
    rc_release(cache->spare, cache->spare_capacity * RC_SMALL_SLOT);
    cache->spare = NULL;
    cache->spare_capacity = cache->spare_touched = 0;
    cache->spare_from = cache->spare_until = 0;
}

/* Touches as much more of the spare array as the inserts since it was
 * made are of those expected before the rotation (all of it by 3/4 of
 * them): see prepare. */
static void
rc_warm(ReplyCache *cache)
{
    size_t bytes = cache->spare_capacity * RC_SMALL_SLOT;
    if (cache->spare == NULL || cache->spare_touched >= bytes) {
        return;
    }
    size_t entries = rc_entries(&cache->generations[0].small);
    size_t span = cache->spare_until > cache->spare_from
                  ? (cache->spare_until - cache->spare_from) / 4 * 3 : 0;
    size_t done = entries > cache->spare_from ? entries - cache->spare_from : 0;
    size_t target = span == 0 || done >= span
                    ? bytes : (size_t)((unsigned __int128)bytes * done / span);
    rc_touch(cache->spare, &cache->spare_touched, target);
}

/* Keeps `reply` under `key` in the current generation; the caller has
 * made sure that the key is in neither generation and that the cache is
 * not full.  0, or -1 with MemoryError set (nothing kept). */
static int
rc_store(ReplyCache *cache, const unsigned char *key,
         const unsigned char *reply, size_t size)
{
    RcGeneration *current = &cache->generations[0];
    uint64_t hash = rc_hash(key);
    if (rc_fits_inline(key, reply, size)) {
        if (rc_reserve(&current->small, cache->start_slots,
                       (size_t)cache->current_limit) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        RcTable *small = &current->small;
        unsigned char *slot = rc_empty_slot(small->slots, small->capacity,
                                            RC_SMALL_SLOT, small->epoch, hash);
        memcpy(slot, key, CACHE_KEY_SIZE);
        slot[RC_KIND] = rc_kind_byte(small->epoch,
                                     (unsigned)(RC_INLINE + (size - REPLY_HEADER_SIZE)));
        slot[21] = reply[2];
        slot[22] = reply[3];
        slot[23] = size > REPLY_HEADER_SIZE ? reply[REPLY_HEADER_SIZE] : 0;
        current->small.count++;
        rc_warm(cache);
        return 0;
    }
    if (size > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a reply of 4 GiB or more");
        return -1;
    }
    unsigned char *buffer = malloc(4 + size);
    if (buffer == NULL
            || rc_reserve(&current->big, RC_MIN_BIG,
                          (size_t)cache->current_limit) < 0) {
        free(buffer);
        PyErr_NoMemory();
        return -1;
    }
    uint32_t size32 = (uint32_t)size;
    memcpy(buffer, &size32, 4);
    memcpy(buffer + 4, reply, size);
    RcTable *big = &current->big;
    unsigned char *slot = rc_empty_slot(big->slots, big->capacity, RC_BIG_SLOT,
                                        big->epoch, hash);
    memcpy(slot, key, CACHE_KEY_SIZE);
    slot[RC_KIND] = rc_kind_byte(big->epoch, RC_OUTSIDE);
    memcpy(slot + 24, &buffer, sizeof(buffer));
    current->big.count++;
    cache->outside_bytes += 4 + size;
    return 0;
}

/* The size of the reply in `slot`, and its bytes copied to `out` (room for
 * REPLY_HEADER_SIZE + RC_INLINE_BODY bytes, or the size for a big one). */
static size_t
rc_reply_size(const unsigned char *slot, int big)
{
    if (big) {
        return rc_buffer_size(rc_buffer(slot));
    }
    return REPLY_HEADER_SIZE + (size_t)((slot[RC_KIND] & RC_WHAT) - RC_INLINE);
}

static void
rc_reply_copy(const unsigned char *slot, int big, unsigned char *out)
{
    if (big) {
        const unsigned char *buffer = rc_buffer(slot);
        memcpy(out, buffer + 4, rc_buffer_size(buffer));
        return;
    }
    out[0] = REPLY_MAGIC;
    out[1] = PROTOCOL_VERSION;
    out[2] = slot[21];
    out[3] = slot[22];
    memcpy(out + 4, slot, 4);
    if ((slot[RC_KIND] & RC_WHAT) > RC_INLINE) {
        out[REPLY_HEADER_SIZE] = slot[23];
    }
}

/* The reply in `slot` as a new bytes object. */
static PyObject *
rc_reply_bytes(const unsigned char *slot, int big)
{
    PyObject *reply = PyBytes_FromStringAndSize(NULL,
                                                (Py_ssize_t)rc_reply_size(slot, big));
    if (reply != NULL) {
        rc_reply_copy(slot, big, (unsigned char *)PyBytes_AS_STRING(reply));
    }
    return reply;
}

/* Overwrites byte `at` of the reply kept under `key`, if it is still
 * kept (the change it answers went on after it was stored). */
static void
rc_patch(ReplyCache *cache, const unsigned char *key, size_t at,
         const unsigned char *bytes, size_t count)
{
    int big;
    unsigned char *slot = rc_lookup(cache, key, &big, NULL);
    if (slot == NULL || at + count > rc_reply_size(slot, big)) {
        return;
    }
    if (big) {
        memcpy(rc_buffer(slot) + 4 + at, bytes, count);
        return;
    }
    for (size_t i = 0; i < count; i++) {
        if (at + i == 2) {
            slot[21] = bytes[i];
        }
        else if (at + i == 3) {
            slot[22] = bytes[i];
        }
        else if (at + i == REPLY_HEADER_SIZE) {
            slot[23] = bytes[i];
        }
    }
}

/* Takes the reply kept under `key` back out (its change failed); whether
 * there was one. */
static int
rc_remove(ReplyCache *cache, const unsigned char *key)
{
    int big;
    RcTable *table;
    unsigned char *slot = rc_lookup(cache, key, &big, &table);
    if (slot == NULL) {
        return 0;
    }
    if (big) {
        rc_free_buffer(slot, cache);
    }
    rc_erase(table, key, rc_hash(key));
    return 1;
}

/* Drops the previous generation and makes the current one previous;
 * returns how many entries were dropped.  The new current generation's
 * small table will start at the size that holds what the last one held
 * (an eighth more), so that a steady rate of changes does not regrow it;
 * and it starts in the dropped generation's small array, if that is at
 * least that size and at most twice it, in the next epoch: no page of it
 * is new to the process, so no insert pays the kernel for a page (a fresh
 * array's first touches cost some 2 us a 4 KiB page here, 60 ms for the
 * default cap's 120 MB, all in the first inserts of a generation).  An
 * array is reused for RC_EPOCHS - 1 generations, then freed: its slots of
 * an old epoch would read as that epoch's again. */
static size_t
rc_rotate(ReplyCache *cache)
{
    RcTable *dropped_small = &cache->generations[1].small;
    size_t dropped = rc_entries(dropped_small) + rc_entries(&cache->generations[1].big);
    unsigned char *reused = NULL;
    size_t reused_capacity = dropped_small->capacity;
    unsigned reused_epoch = dropped_small->epoch + 1;
    if (dropped_small->slots != NULL && reused_epoch <= RC_EPOCHS) {
        reused = dropped_small->slots;
        dropped_small->slots = NULL;
        dropped_small->capacity = 0;
        dropped_small->count = 0;
    }
    rc_generation_free(cache, &cache->generations[1]);
    size_t last = rc_entries(&cache->generations[0].small);
    cache->generations[1] = cache->generations[0];
    rc_drop_ahead(&cache->generations[1].small);     /* (it takes no more entries) */
    rc_drop_ahead(&cache->generations[1].big);
    cache->generations[0].small = RC_TABLE(RC_SMALL_SLOT);
    cache->generations[0].big = RC_TABLE(RC_BIG_SLOT);
    size_t start = rc_slots_for(last + last / 8);
    size_t ceiling = rc_slots_for((size_t)cache->current_limit);
    start = start < RC_MIN_SMALL ? RC_MIN_SMALL : start > ceiling ? ceiling : start;
    cache->start_slots = start;
    RcTable *small = &cache->generations[0].small;
    if (reused != NULL && reused_capacity >= start && reused_capacity / 2 <= start) {
        small->slots = reused;
        small->capacity = reused_capacity;
        small->epoch = reused_epoch;
        reused = NULL;
    }
    else if (cache->spare != NULL && cache->spare_capacity >= start / 3 * 2
             && cache->spare_capacity / 2 <= start) {
        /* (a little smaller than the last generation's size will do: it
         * grows, its next array made ahead) */
        small->slots = cache->spare;
        small->capacity = cache->spare_capacity;
        small->epoch = 1;
        cache->spare = NULL;
    }
    rc_release(reused, reused_capacity * RC_SMALL_SLOT);
    rc_drop_spare(cache);
    return dropped;
}

/* The cache key of request `data` into `out` (CACHE_KEY_SIZE bytes): its
 * token, then XXH64(data, seed) big-endian. */
static void
rc_key(unsigned long long seed, const unsigned char *data, Py_ssize_t size,
       unsigned char *out)
{
    memcpy(out, data + TOKEN_OFFSET, TOKEN_SIZE);
    uint64_t digest = domus_xxh64(data, (size_t)size, seed);
    for (int i = 0; i < 8; i++) {
        out[TOKEN_SIZE + i] = (unsigned char)(digest >> (56 - 8 * i));
    }
}

/* ------------------------------------------------------------ single keys */

/* Parses a PUT/GET/DELETE/CONTAINS body up to its key and finds the
 * repository: HANDLED with a new reference in repo->object and the key's
 * end offset in *key_end; DECLINED for anything the Python handler refuses
 * (truncated, empty or oversized key, unknown DHT or bucket); or -1. */
static int
parse_keyed(FastPath *self, const unsigned char *data, Py_ssize_t size,
            int changing, Repo *repo, Py_ssize_t *key_end)
{
    if (size < KEYED_END) {
        return DECLINED;
    }
    uint32_t dht_id = read_u32(data + 16);
    uint32_t bucket = read_u32(data + 20);
    uint16_t key_length = read_u16(data + 24);
    if (key_length == 0 || key_length > MAX_KEY_BYTES
            || (Py_ssize_t)KEYED_END + key_length > size) {
        return DECLINED;
    }
    PyObject *buckets;
    int found = find_buckets(self, dht_id, data[3], changing, &buckets);
    if (found != HANDLED) {
        return found;
    }
    found = find_repo(self, buckets, bucket, repo);
    if (found != HANDLED) {
        return found;
    }
    *key_end = KEYED_END + key_length;
    return HANDLED;
}

/* Writes a GET's OK reply to *reply (with the layout tag of the request's
 * DHT): the stored value, sent as it is (a bytes object), or copied from a
 * tree's arena into the reply.  HANDLED, DECLINED (not bytes, or too large
 * for `limit`: REPLY_TOO_LARGE), or -1.  Takes over value->object. */
static int
reply_value(const unsigned char *request, Found *value, Py_ssize_t limit,
            unsigned char layout_tag, Reply *reply)
{
    if (value->size < 0 || value->size + REPLY_HEADER_SIZE > limit) {
        found_clear(value);
        return DECLINED;
    }
    if (value->object != NULL) {
        write_reply_header(reply->head, ST_OK, request, layout_tag);
        reply->value = value->object;
        value->object = NULL;
        return HANDLED;
    }
    reply->whole = new_reply(ST_OK, request, value->size, layout_tag);
    if (reply->whole == NULL) {
        return -1;
    }
    memcpy(PyBytes_AS_STRING(reply->whole) + REPLY_HEADER_SIZE, value->data,
           (size_t)value->size);
    return HANDLED;
}

/* GET and CONTAINS. */
static int
handle_read(FastPath *self, int op, const unsigned char *data,
            Py_ssize_t size, Py_ssize_t limit, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    int result = parse_keyed(self, data, size, 0, &repo, &key_end);
    if (result != HANDLED) {
        return result;
    }
    if (key_end != size) {
        result = DECLINED;          /* bytes after the key */
        goto done;
    }
    const unsigned char *key = data + KEYED_END;
    Py_ssize_t key_size = key_end - KEYED_END;
    int present;
    if (op == OP_CONTAINS) {
        present = repo_contains(self, repo, key, key_size);
    }
    else {
        Found value = {NULL, NULL, 0};
        present = repo_get(self, repo, key, key_size, &value);
        if (present == 1) {
            result = reply_value(data, &value, limit, self->layout_tag, reply);
            goto done;
        }
    }
    if (present < 0) {
        result = present == FAILED ? DECLINED : -1;
        goto done;
    }
    write_reply_header(reply->head, present ? ST_OK : ST_NOT_FOUND, data,
                       self->layout_tag);
    result = HANDLED;
done:
    Py_DECREF(repo.object);
    return result;
}

/* PUT.  The reply enters the cache before the record changes and leaves it
 * again if the change fails, so a change and its cached reply go together;
 * the `created` byte is written into both once the change is made, before
 * anything else can see the reply.  A failed database put is declined. */
/* parse_keyed of a change whose key is followed by a u32 length and that
 * many bytes (PUT, PUT_IF_ABSENT, DELETE_IF), into *value_length (the
 * value within MAX_VALUE_BYTES); DECLINED, with no reference taken, if
 * the length does not match. */
static int
parse_valued(FastPath *self, const unsigned char *data, Py_ssize_t size,
             Repo *repo, Py_ssize_t *key_end, uint32_t *value_length)
{
    int result = parse_keyed(self, data, size, 1, repo, key_end);
    if (result != HANDLED) {
        return result;
    }
    Py_ssize_t rest = size - *key_end;
    *value_length = rest >= 4 ? read_u32(data + *key_end) : 0;
    if (rest < 4 || (uint64_t)*value_length != (uint64_t)(rest - 4)
            || *value_length > MAX_VALUE_BYTES) {
        Py_DECREF(repo->object);
        return DECLINED;
    }
    return HANDLED;
}

static int
change_put(FastPath *self, const unsigned char *data, Py_ssize_t size,
           ReplyCache *cache, const unsigned char *token, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    uint32_t value_length;
    int result = parse_valued(self, data, size, &repo, &key_end, &value_length);
    if (result != HANDLED) {
        return result;
    }
    unsigned char *answer = reply->head;
    write_reply_header(answer, ST_OK, data, self->layout_tag);
    answer[REPLY_HEADER_SIZE] = 0;
    if (rc_store(cache, token, answer, REPLY_HEADER_SIZE + 1) < 0) {
        result = -1;
        goto done;
    }
    int created = repo_put(self, repo, data + KEYED_END, key_end - KEYED_END,
                           data + key_end + 4, (Py_ssize_t)value_length, NULL);
    if (created < 0) {
        rc_remove(cache, token);
        result = created == FAILED ? DECLINED : -1;
        goto done;
    }
    answer[REPLY_HEADER_SIZE] = (unsigned char)created;
    if (created) {
        rc_patch(cache, token, REPLY_HEADER_SIZE, answer + REPLY_HEADER_SIZE, 1);
    }
    reply->body = 1;
    result = HANDLED;
done:
    Py_DECREF(repo.object);
    return result;
}

/* DELETE.  Cache and change go together, as for PUT.  A dict is read first
 * (a value that is not bytes is the Python handler's to judge); a tree or a
 * database is asked to delete the key straight away, and whether it was
 * there written into the reply afterwards. */
static int
change_delete(FastPath *self, const unsigned char *data, Py_ssize_t size,
              ReplyCache *cache, const unsigned char *token, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    int result = parse_keyed(self, data, size, 1, &repo, &key_end);
    if (result != HANDLED) {
        return result;
    }
    if (key_end != size) {
        result = DECLINED;
        goto done;
    }
    const unsigned char *key = data + KEYED_END;
    Py_ssize_t key_size = key_end - KEYED_END;
    int present = 1;
    if (repo.kind == REPO_DICT) {
        Found value = {NULL, NULL, 0};
        present = repo_get(self, repo, key, key_size, &value);
        if (present < 0) {
            result = -1;
            goto done;
        }
        int odd = present && value.size < 0;
        found_clear(&value);
        if (odd) {
            result = DECLINED;  /* the Python handler decides what that means */
            goto done;
        }
    }
    unsigned char *answer = reply->head;
    write_reply_header(answer, present ? ST_OK : ST_NOT_FOUND, data,
                       self->layout_tag);
    if (rc_store(cache, token, answer, REPLY_HEADER_SIZE) < 0) {
        result = -1;
        goto done;
    }
    if (present) {
        int removed = repo_remove(self, repo, key, key_size);
        if (removed < 0) {
            rc_remove(cache, token);
            result = removed == FAILED ? DECLINED : -1;
            goto done;
        }
        if (!removed) {
            answer[2] = ST_NOT_FOUND;
            rc_patch(cache, token, 2, answer + 2, 1);
        }
    }
    result = HANDLED;
done:
    Py_DECREF(repo.object);
    return result;
}

/* PUT_IF_ABSENT: the value stored only where the key is absent (`stored`
 * 1), else nothing changed (0).  Cache and change go together, as for PUT. */
static int
change_put_if_absent(FastPath *self, const unsigned char *data, Py_ssize_t size,
                     ReplyCache *cache, const unsigned char *token, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    uint32_t value_length;
    int result = parse_valued(self, data, size, &repo, &key_end, &value_length);
    if (result != HANDLED) {
        return result;
    }
    const unsigned char *key = data + KEYED_END;
    Py_ssize_t key_size = key_end - KEYED_END;
    int present = repo_contains(self, repo, key, key_size);
    if (present < 0) {
        result = present == FAILED ? DECLINED : -1;
        goto done;
    }
    unsigned char *answer = reply->head;
    write_reply_header(answer, ST_OK, data, self->layout_tag);
    answer[REPLY_HEADER_SIZE] = (unsigned char)!present;
    if (rc_store(cache, token, answer, REPLY_HEADER_SIZE + 1) < 0) {
        result = -1;
        goto done;
    }
    if (!present) {
        int created = repo_put(self, repo, key, key_size, data + key_end + 4,
                               (Py_ssize_t)value_length, NULL);
        if (created < 0) {
            rc_remove(cache, token);
            result = created == FAILED ? DECLINED : -1;
            goto done;
        }
    }
    reply->body = 1;
    result = HANDLED;
done:
    Py_DECREF(repo.object);
    return result;
}

/* DELETE_IF: the key deleted only while its value's digest (XXH64, seed 0,
 * big-endian) is the request's (`deleted` 1), else nothing changed (0);
 * NOT_FOUND if absent.  A dict value that is not bytes is declined.  Cache
 * and change go together, as for DELETE. */
static int
change_delete_if(FastPath *self, const unsigned char *data, Py_ssize_t size,
                 ReplyCache *cache, const unsigned char *token, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    uint32_t digest_length;
    int result = parse_valued(self, data, size, &repo, &key_end, &digest_length);
    if (result != HANDLED) {
        return result;
    }
    if (digest_length != DIGEST_BYTES) {
        result = DECLINED;
        goto done;
    }
    const unsigned char *key = data + KEYED_END;
    Py_ssize_t key_size = key_end - KEYED_END;
    Found value = {NULL, NULL, 0};
    int present = repo_get(self, repo, key, key_size, &value);
    if (present < 0) {
        result = present == FAILED ? DECLINED : -1;
        goto done;
    }
    int same = 0;
    if (present) {
        if (value.size < 0) {
            found_clear(&value);
            result = DECLINED;  /* the Python handler decides what that means */
            goto done;
        }
        uint64_t digest = domus_xxh64(value.data, (size_t)value.size, 0);
        same = digest == read_u64(data + key_end + 4);
        found_clear(&value);    /* (a tree's bytes are read before it changes) */
    }
    unsigned char *answer = reply->head;
    write_reply_header(answer, present ? ST_OK : ST_NOT_FOUND, data, self->layout_tag);
    answer[REPLY_HEADER_SIZE] = (unsigned char)same;
    if (rc_store(cache, token, answer, REPLY_HEADER_SIZE + present) < 0) {
        result = -1;
        goto done;
    }
    if (same) {
        int removed = repo_remove(self, repo, key, key_size);
        if (removed <= 0) {     /* (it was there a moment ago) */
            rc_remove(cache, token);
            result = removed == FAILED || removed == 0 ? DECLINED : -1;
            goto done;
        }
    }
    reply->body = present;
    result = HANDLED;
done:
    Py_DECREF(repo.object);
    return result;
}

/* ------------------------------------------------------------ batches */

/* One entry of a PUT_MANY or GET_MANY: its repository (a strong
 * reference), its key and value where the request carries them, and what
 * it found (GET_MANY).  `created` and `previous` say how a PUT_MANY changed
 * a database, to undo it. */
typedef struct {
    Repo repo;
    const unsigned char *key;
    Py_ssize_t key_size;
    const unsigned char *value;
    Py_ssize_t value_size;
    Found found;
    PyObject *previous;         /* the value a put replaced, or NULL */
    int created;
} Entry;

static void
entries_free(Entry *entries, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(entries[i].repo.object);
        found_clear(&entries[i].found);
        Py_XDECREF(entries[i].previous);
    }
    PyMem_Free(entries);
}

/* Parses every entry of a PUT_MANY (`put` true) or GET_MANY body, checking
 * it whole -- lengths, limits, buckets, trailing bytes -- before anything is
 * changed.  HANDLED with *out (the entries, to free with entries_free) and
 * *count; DECLINED; or -1.  A
 * PUT_MANY that would write to database repositories and to others is
 * declined (a DHT has one platform), so that one whose database fails can
 * always be undone whole. */
static int
parse_batch(FastPath *self, const unsigned char *data, Py_ssize_t size,
            int put, Entry **out, Py_ssize_t *count)
{
    if (size < BATCH_END) {
        return DECLINED;
    }
    uint32_t dht_id = read_u32(data + 16);
    Py_ssize_t total = read_u16(data + 20);
    const size_t entry_size = put ? PUT_ENTRY_SIZE : GET_ENTRY_SIZE;
    if ((uint64_t)total * (entry_size + 1) > (uint64_t)(size - BATCH_END)) {
        return DECLINED;        /* cannot hold that many non-empty keys */
    }
    PyObject *buckets;
    int result = find_buckets(self, dht_id, data[3], put, &buckets);
    if (result != HANDLED) {
        return result;
    }
    Py_INCREF(buckets);
    Entry *entries = PyMem_Calloc(total ? (size_t)total : 1, sizeof(Entry));
    if (entries == NULL) {
        Py_DECREF(buckets);
        PyErr_NoMemory();
        return -1;
    }
    const uint64_t end = (uint64_t)size;
    uint64_t offset = BATCH_END;
    uint32_t last_bucket = 0;
    Repo last = {NULL, REPO_UNSUPPORTED};
    int databases = 0, others = 0;
    Py_ssize_t made = 0;
    for (; made < total; made++) {
        if (offset + entry_size > end) {
            result = DECLINED;
            goto fail;
        }
        const unsigned char *at = data + offset;
        uint32_t bucket = read_u32(at);
        uint16_t key_length = read_u16(at + 4);
        uint32_t value_length = put ? read_u32(at + 6) : 0;
        uint64_t key_start = offset + entry_size;
        uint64_t key_end = key_start + key_length;
        uint64_t value_end = key_end + value_length;
        if (value_end > end || key_length == 0) {
            result = DECLINED;
            goto fail;
        }
        /* Python checks the limits of put_many entries only. */
        if (put && (key_length > MAX_KEY_BYTES
                    || value_length > MAX_VALUE_BYTES)) {
            result = DECLINED;
            goto fail;
        }
        if (last.object == NULL || bucket != last_bucket) {
            Py_CLEAR(last.object);
            result = find_repo(self, buckets, bucket, &last);
            if (result != HANDLED) {
                goto fail;
            }
            last_bucket = bucket;
            if (last.kind == REPO_DATABASE) {
                databases = 1;
            }
            else {
                others = 1;
            }
        }
        Entry *entry = &entries[made];
        Py_INCREF(last.object);
        entry->repo = last;
        entry->key = data + key_start;
        entry->key_size = key_length;
        entry->value = data + key_end;
        entry->value_size = (Py_ssize_t)value_length;
        offset = value_end;
    }
    if (offset != end || (put && databases && others)) {
        result = DECLINED;      /* stray bytes after the entries; a mix */
        goto fail;
    }
    Py_XDECREF(last.object);
    Py_DECREF(buckets);
    *out = entries;
    *count = total;
    return HANDLED;
fail:
    Py_XDECREF(last.object);
    Py_DECREF(buckets);
    entries_free(entries, total);
    return result;
}

/* Undoes the database puts of the first `applied` entries of a PUT_MANY,
 * last first (so a key put twice gets its first value back, then goes): a
 * created key is deleted, a replaced value put back.  Best effort: a
 * database that fails now keeps what it has.  Keeps any exception set. */
static void
undo_puts(Entry *entries, Py_ssize_t applied)
{
    PyObject *type, *exc, *traceback;
    PyErr_Fetch(&type, &exc, &traceback);
    for (Py_ssize_t i = applied - 1; i >= 0; i--) {
        Entry *entry = &entries[i];
        if (entry->repo.kind != REPO_DATABASE) {
            continue;
        }
        DatabaseRepository *db = (DatabaseRepository *)entry->repo.object;
        PyObject *key = bytes_of(entry->key, entry->key_size);
        if (key == NULL) {
            PyErr_Clear();
            continue;
        }
        if (entry->created) {
            /* (room an undo gives back was only just taken: a cache found
             * full stays so) */
            int full = database_full(db);
            (void)database_remove(db, key);
            if (full) {
                PyByteArray_AS_STRING(db->room)[0] = 1;
            }
        }
        else if (entry->previous != NULL) {
            PyObject *args[2] = {key, entry->previous};
            PyObject *done = database_call(db->put, args, 2);
            if (done == NULL) {
                PyErr_Clear();
            }
            Py_XDECREF(done);
        }
        Py_DECREF(key);
    }
    PyErr_Restore(type, exc, traceback);
}

/* Before a batch's entries[0..count) are applied (up to the first
 * DOMUS_RECORDTREE_PREFETCH of them): the record trees' descents of those
 * entries, walked together so that their cache misses overlap (see
 * prefetch in cext/recordtree_api.h).  Other kinds of repository are left
 * alone. */
static void
prefetch_entries(FastPath *self, const Entry *entries, Py_ssize_t count)
{
    PyObject *trees[DOMUS_RECORDTREE_PREFETCH];
    const char *keys[DOMUS_RECORDTREE_PREFETCH];
    Py_ssize_t key_sizes[DOMUS_RECORDTREE_PREFETCH];
    Py_ssize_t walks = 0;
    for (Py_ssize_t i = 0; i < count && i < DOMUS_RECORDTREE_PREFETCH; i++) {
        if (entries[i].repo.kind == REPO_TREE) {
            trees[walks] = entries[i].repo.object;
            keys[walks] = (const char *)entries[i].key;
            key_sizes[walks++] = entries[i].key_size;
        }
    }
    if (walks > 1) {
        self->tree_api->prefetch(trees, keys, key_sizes, walks);
    }
}

/* PUT_MANY: every entry is checked before the first is applied.  If a
 * database put fails, the entries before it are undone and the request is
 * declined.  If applying an entry to a dict or a tree fails (memory), the
 * entries before it stay applied and the reply leaves the cache (a tree's
 * failure is declined, a dict's raised): the Python handler then applies
 * the whole request again, which stores the same values. */
static int
change_put_many(FastPath *self, const unsigned char *data, Py_ssize_t size,
                ReplyCache *cache, const unsigned char *token, Reply *reply)
{
    Entry *entries;
    Py_ssize_t count;
    int result = parse_batch(self, data, size, 1, &entries, &count);
    if (result != HANDLED) {
        return result;
    }
    unsigned char *answer = reply->head;
    write_reply_header(answer, ST_OK, data, self->layout_tag);
    memset(answer + REPLY_HEADER_SIZE, 0, 4);
    if (rc_store(cache, token, answer, REPLY_HEADER_SIZE + 4) < 0) {
        result = -1;
        goto done;
    }
    unsigned created = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Entry *entry = &entries[i];
        if (i % DOMUS_RECORDTREE_PREFETCH == 0) {
            prefetch_entries(self, entry, count - i);
        }
        int new_key = repo_put(self, entry->repo, entry->key, entry->key_size,
                               entry->value, entry->value_size,
                               &entry->previous);
        if (new_key < 0) {
            undo_puts(entries, i);
            rc_remove(cache, token);
            result = new_key == FAILED ? DECLINED : -1;
            goto done;
        }
        entry->created = new_key;
        created += (unsigned)new_key;
    }
    unsigned char *body = answer + REPLY_HEADER_SIZE;
    write_u16(body, (uint16_t)count);
    write_u16(body + 2, (uint16_t)created);
    rc_patch(cache, token, REPLY_HEADER_SIZE, body, 4);
    reply->body = 4;
    result = HANDLED;
done:
    entries_free(entries, count);
    return result;
}

/* GET_MANY: the longest prefix of answers that fits `limit`, as the Python
 * handler computes it; DECLINED when not even the first fits. */
static int
handle_get_many(FastPath *self, const unsigned char *data, Py_ssize_t size,
                Py_ssize_t limit, Reply *reply)
{
    Entry *entries;
    Py_ssize_t count;
    int result = parse_batch(self, data, size, 0, &entries, &count);
    if (result != HANDLED) {
        return result;
    }
    long long reply_size = REPLY_HEADER_SIZE + 2;
    Py_ssize_t answered = 0;
    for (; answered < count; answered++) {
        Entry *entry = &entries[answered];
        Found *value = &entry->found;
        if (answered % DOMUS_RECORDTREE_PREFETCH == 0) {
            prefetch_entries(self, entry, count - answered);
        }
        int present = repo_get(self, entry->repo, entry->key, entry->key_size,
                               value);
        if (present < 0) {
            result = present == FAILED ? DECLINED : -1;
            goto done;
        }
        if (!present) {
            value->size = -2;   /* absent */
        }
        else if (value->size < 0) {
            result = DECLINED;  /* not bytes */
            goto done;
        }
        reply_size += 4 + (present ? (long long)value->size : 0);
        if (reply_size > (long long)limit) {
            found_clear(value);
            break;      /* the client asks again for the rest */
        }
    }
    if (count > 0 && answered == 0) {
        result = DECLINED;      /* REPLY_TOO_LARGE */
        goto done;
    }
    Py_ssize_t total = REPLY_HEADER_SIZE + 2;
    for (Py_ssize_t i = 0; i < answered; i++) {
        total += 4 + (entries[i].found.size >= 0 ? entries[i].found.size : 0);
    }
    PyObject *answer = PyBytes_FromStringAndSize(NULL, total);
    if (answer == NULL) {
        result = -1;
        goto done;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(answer);
    write_reply_header(out, ST_OK, data, self->layout_tag);
    write_u16(out + REPLY_HEADER_SIZE, (uint16_t)answered);
    out += REPLY_HEADER_SIZE + 2;
    for (Py_ssize_t i = 0; i < answered; i++) {
        const Found *value = &entries[i].found;
        if (value->size < 0) {
            write_u32(out, MISSING);
            out += 4;
            continue;
        }
        write_u32(out, (uint32_t)value->size);
        memcpy(out + 4, value->data, (size_t)value->size);
        out += 4 + value->size;
    }
    reply->whole = answer;
    result = HANDLED;
done:
    entries_free(entries, count);
    return result;
}

/* ------------------------------------------------------------ dispatch */

/* The index of the counter of (dht id, bucket) in generations_of. */
static inline size_t
generation_index(uint32_t dht_id, uint32_t bucket)
{
    uint64_t mixed = ((uint64_t)dht_id << 32 | bucket) * DOMUS_P64_1;
    return (size_t)(mixed >> 52) & (GENERATIONS - 1);
}

/* Counts a change applied here to each bucket the (well-formed, handled)
 * change request `data` names. */
static void
count_changes(FastPath *self, int op, const unsigned char *data,
              Py_ssize_t size)
{
    uint32_t dht_id = read_u32(data + 16);
    if (op != OP_PUT_MANY) {
        self->generations_of[generation_index(dht_id, read_u32(data + 20))]++;
        return;
    }
    Py_ssize_t at = BATCH_END;
    uint16_t count = read_u16(data + 20);
    for (uint16_t i = 0; i < count && at + PUT_ENTRY_SIZE <= size; i++) {
        uint32_t bucket = read_u32(data + at);
        Py_ssize_t key_length = read_u16(data + at + 4);
        Py_ssize_t value_length = read_u32(data + at + 6);
        self->generations_of[generation_index(dht_id, bucket)]++;
        at += PUT_ENTRY_SIZE + key_length + value_length;
    }
}

/* PUT, DELETE, PUT_MANY, PUT_IF_ABSENT, DELETE_IF: answered from the reply
 * cache when their key is
 * there (in either generation), else applied and their reply cached; BUSY
 * (not applied, not cached) when the current generation is full: an entry
 * that may still be retried is never dropped to make room.  No Python
 * object is made, on a hit or a store, but for a cached reply too large
 * for Reply.head (one put() was given by Python). */
static int forward_change(FastPath *self, int op, const unsigned char *data,
                          Py_ssize_t size, Reply *reply);

static int
apply_change(FastPath *self, int op, const unsigned char *data,
             Py_ssize_t size, Reply *reply);

/* What forward_change returns for a change to apply here at once: its DHT
 * is not replicated, or its bucket has no backup left. */
#define APPLY_HERE 3

/* A change: sent to its bucket's backups first when the bucket is
 * replicated and the serving thread forwards (QUEUED: see
 * "replication"), else applied here (apply_change). */
static int
handle_change(FastPath *self, int op, const unsigned char *data,
              Py_ssize_t size, Reply *reply)
{
    if (self->forwards == NULL || op == OP_PUT_MANY) {
        return apply_change(self, op, data, size, reply);
    }
    /* (tried as any change first: a replicated DHT's is declined, and
     * says so in found_layout; so an unreplicated change costs no more) */
    self->found_layout = 0;
    int result = apply_change(self, op, data, size, reply);
    if (result != DECLINED || (self->found_layout & (LAYOUT_REPLICATED | LAYOUT_GUARDED))
            != LAYOUT_REPLICATED) {
        return result;
    }
    result = forward_change(self, op, data, size, reply);
    if (result != APPLY_HERE) {
        return result;
    }
    self->apply_replicated = 1;
    result = apply_change(self, op, data, size, reply);
    self->apply_replicated = 0;
    return result;
}

/* The reply cached under `token`, into *reply: HANDLED (counted as
 * replayed), 0 when there is none, DECLINED (an entry too short to be a
 * reply), or -1. */
static int
reply_from_cache(FastPath *self, ReplyCache *cache, const unsigned char *token,
                 Reply *reply)
{
    int big;
    const unsigned char *cached = rc_lookup(cache, token, &big, NULL);
    if (cached == NULL) {
        return 0;
    }
    size_t cached_size = rc_reply_size(cached, big);
    if (cached_size >= REPLY_HEADER_SIZE
            && cached_size <= REPLY_HEADER_SIZE + REPLY_HEAD_BODY) {
        rc_reply_copy(cached, big, reply->head);
        reply->body = (int)(cached_size - REPLY_HEADER_SIZE);
    }
    else if (cached_size < 3) {
        return DECLINED;
    }
    else if ((reply->whole = rc_reply_bytes(cached, big)) == NULL) {
        return -1;
    }
    self->replayed++;
    return HANDLED;
}

/* Applies a change here: answered from the reply cache when its key is
 * there, else applied and its reply cached (see handle_change). */
static int
apply_change(FastPath *self, int op, const unsigned char *data,
             Py_ssize_t size, Reply *reply)
{
    if (self->cache == NULL) {
        return DECLINED;
    }
    ReplyCache *cache = (ReplyCache *)self->cache;
    Py_INCREF(cache);       /* (a database call may let other threads run) */
    unsigned char token[CACHE_KEY_SIZE];
    rc_key(cache->seed, data, size, token);
    int result = reply_from_cache(self, cache, token, reply);
    if (result != 0) {
        goto done;
    }
    if (rc_full(cache)) {
        /* (layout byte 0: the request is not parsed, its DHT not found) */
        write_reply_header(reply->head, ST_BUSY, data, 0);
        self->busy++;
        result = HANDLED;
        goto done;
    }
    switch (op) {
    case OP_PUT:
        result = change_put(self, data, size, cache, token, reply);
        break;
    case OP_DELETE:
        result = change_delete(self, data, size, cache, token, reply);
        break;
    case OP_PUT_IF_ABSENT:
        result = change_put_if_absent(self, data, size, cache, token, reply);
        break;
    case OP_DELETE_IF:
        result = change_delete_if(self, data, size, cache, token, reply);
        break;
    default:
        result = change_put_many(self, data, size, cache, token, reply);
        break;
    }
    if (result == HANDLED) {
        count_changes(self, op, data, size);
    }
done:
    Py_DECREF(cache);
    return result;
}

/* Notes the DHT and bucket of a handled request (a batch's first entry's)
 * in the sample ring. */
static void
sample_request(FastPath *self, int op, const unsigned char *data,
               Py_ssize_t size)
{
    Py_ssize_t at = (op == OP_PUT_MANY || op == OP_GET_MANY) ? BATCH_END
                                                             : REQUEST_HEADER_SIZE + 4;
    if (size < at + 4) {
        return;             /* an empty batch */
    }
    self->samples[self->sampled % SAMPLE_RING] =
        ((uint64_t)read_u32(data + 16) << 32) | read_u32(data + at);
    self->sampled++;
}

static int handle_replicate(FastPath *self, const unsigned char *data,
                            Py_ssize_t size, Py_ssize_t limit, Reply *reply);

/* Answers one request: HANDLED with *reply filled (the caller clears it),
 * QUEUED (a replicated change sent to its backups: answered later),
 * DECLINED with nothing changed, or -1 with an exception set.  Counts the
 * request (handled or declined) in the counters: a handled one by its op
 * and by its reply's status byte, as the Python handler counts the
 * requests it answers. */
static int
handle_request(FastPath *self, const unsigned char *data, Py_ssize_t size,
               Py_ssize_t limit, Reply *reply)
{
    int result = DECLINED;
    if (size >= REQUEST_HEADER_SIZE && data[0] == REQUEST_MAGIC
            && data[1] == PROTOCOL_VERSION) {
        int op = data[2];
        switch (op) {
        case OP_GET:
        case OP_CONTAINS:
            result = handle_read(self, op, data, size, limit, reply);
            break;
        case OP_GET_MANY:
            result = handle_get_many(self, data, size, limit, reply);
            break;
        case OP_PUT:
        case OP_DELETE:
        case OP_PUT_MANY:
        case OP_PUT_IF_ABSENT:
        case OP_DELETE_IF:
            result = handle_change(self, op, data, size, reply);
            break;
        case OP_REPLICATE:
            result = handle_replicate(self, data, size, limit, reply);
            break;
        default:
            break;
        }
        if (result == QUEUED) {
            /* (its reply, when its backups have it, is counted then) */
            self->requests++;
            self->by_op[op]++;
            return QUEUED;
        }
        if (result == HANDLED) {
            if ((self->requests++ & (SAMPLE_EVERY - 1)) == 0) {
                sample_request(self, op, data, size);
            }
            self->by_op[op]++;
            unsigned char status = reply->whole != NULL
                ? (unsigned char)PyBytes_AS_STRING(reply->whole)[2]
                : reply->head[2];
            self->by_status[status]++;
            return HANDLED;
        }
    }
    reply_clear(reply);
    if (result == DECLINED) {
        self->fallbacks++;
    }
    return result;
}

/* ------------------------------------------------------------ DatabaseRepository
 *
 * The C part of a repository kept in a database object: the database's
 * bound methods, which C calls, and the record count, which both C and the
 * Python subclass keep (C never counts a change it did not make, so the
 * count is right whichever path changed the database).  The Python
 * subclass (domus.storage.bsddb.BerkeleyRepository) does everything else,
 * and its put/get/delete/contains are the Python handler's reference.
 */

/* The bound method `name` of `database`, if it is a C function. */
static PyObject *
database_method(PyObject *database, const char *name)
{
    PyObject *method = PyObject_GetAttrString(database, name);
    if (method != NULL && !PyCFunction_Check(method)) {
        PyErr_Format(PyExc_TypeError,
                     "DatabaseRepository needs %.100s.%s to be a method "
                     "written in C (a berkeleydb DB's), not %.100s",
                     Py_TYPE(database)->tp_name, name,
                     Py_TYPE(method)->tp_name);
        Py_CLEAR(method);
    }
    return method;
}

static int
is_exception_class(PyObject *candidate)
{
    return PyType_Check(candidate)
           && PyType_IsSubtype((PyTypeObject *)candidate,
                               (PyTypeObject *)PyExc_BaseException);
}

static int
DatabaseRepository_init(DatabaseRepository *self, PyObject *args,
                        PyObject *kwds)
{
    static char *kwlist[] = {"database", "no_overwrite", "key_exists",
                             "not_found", "room", "no_memory", NULL};
    PyObject *database, *no_overwrite = NULL;
    PyObject *key_exists = NULL, *not_found = NULL;
    PyObject *room = Py_None, *no_memory = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds,
                                     "O|$O!OOOO:DatabaseRepository", kwlist,
                                     &database, &PyLong_Type, &no_overwrite,
                                     &key_exists, &not_found, &room, &no_memory)) {
        return -1;
    }
    if (room != Py_None && (!PyByteArray_Check(room) || PyByteArray_GET_SIZE(room) < 1)) {
        PyErr_SetString(PyExc_TypeError, "room must be a bytearray of at least one byte, "
                        "or None");
        return -1;
    }
    if (no_memory != Py_None && !is_exception_class(no_memory)) {
        PyErr_SetString(PyExc_TypeError, "no_memory must be an exception class or None");
        return -1;
    }
    if (no_overwrite == NULL || key_exists == NULL || not_found == NULL) {
        PyErr_SetString(PyExc_TypeError, "DatabaseRepository() needs the "
                        "keyword arguments no_overwrite, key_exists and "
                        "not_found");
        return -1;
    }
    if (!is_exception_class(key_exists) || !is_exception_class(not_found)) {
        PyErr_SetString(PyExc_TypeError,
                        "key_exists and not_found must be exception classes");
        return -1;
    }
    PyObject *get = database_method(database, "get");
    PyObject *put = get ? database_method(database, "put") : NULL;
    PyObject *exists = put ? database_method(database, "exists") : NULL;
    PyObject *remove = exists ? database_method(database, "delete") : NULL;
    if (remove == NULL) {
        Py_XDECREF(get);
        Py_XDECREF(put);
        Py_XDECREF(exists);
        return -1;
    }
    Py_XSETREF(self->get, get);
    Py_XSETREF(self->put, put);
    Py_XSETREF(self->exists, exists);
    Py_XSETREF(self->remove, remove);
    Py_INCREF(no_overwrite);
    Py_XSETREF(self->no_overwrite, no_overwrite);
    Py_INCREF(key_exists);
    Py_XSETREF(self->key_exists, key_exists);
    Py_INCREF(not_found);
    Py_XSETREF(self->not_found, not_found);
    Py_XSETREF(self->room, room != Py_None ? Py_NewRef(room) : NULL);
    Py_XSETREF(self->no_memory, no_memory != Py_None ? Py_NewRef(no_memory) : NULL);
    self->record_count = 0;
    return 0;
}

static int
DatabaseRepository_traverse(DatabaseRepository *self, visitproc visit,
                            void *arg)
{
    Py_VISIT(self->get);
    Py_VISIT(self->put);
    Py_VISIT(self->exists);
    Py_VISIT(self->remove);
    Py_VISIT(self->no_overwrite);
    Py_VISIT(self->key_exists);
    Py_VISIT(self->not_found);
    Py_VISIT(self->room);
    Py_VISIT(self->no_memory);
    return 0;
}

static int
DatabaseRepository_clear(DatabaseRepository *self)
{
    Py_CLEAR(self->get);
    Py_CLEAR(self->put);
    Py_CLEAR(self->exists);
    Py_CLEAR(self->remove);
    Py_CLEAR(self->no_overwrite);
    Py_CLEAR(self->key_exists);
    Py_CLEAR(self->not_found);
    Py_CLEAR(self->room);
    Py_CLEAR(self->no_memory);
    return 0;
}

static void
DatabaseRepository_dealloc(DatabaseRepository *self)
{
    PyObject_GC_UnTrack(self);
    DatabaseRepository_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef DatabaseRepository_members[] = {
    {"record_count", T_PYSSIZET, offsetof(DatabaseRepository, record_count),
     0, "records in the database; C counts the keys it creates and deletes, "
        "the Python subclass the ones it does"},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(DatabaseRepository_doc,
"DatabaseRepository(database, *, no_overwrite, key_exists, not_found,\n"
"                   room=None, no_memory=None)\n\n"
"Base of a repository whose records are in `database`, an object with\n"
"Berkeley DB's calling conventions whose methods are written in C:\n"
"get(key) -> bytes or None; put(key, value, txn, flags), which with\n"
"flags=no_overwrite raises `key_exists` rather than replace a value;\n"
"exists(key) -> bool; delete(key), which raises `not_found` for an absent\n"
"key.  FastPath answers requests on such a repository by calling those\n"
"methods directly, not the subclass's put/get/delete/contains, which must\n"
"therefore mean exactly that (BerkeleyRepository's do).  A failed call\n"
"makes FastPath undo the request's changes and decline it.\n"
"`record_count` starts at 0; whoever changes the database keeps it.\n"
"`room`, a bytearray shared by the repositories of a cache that cannot\n"
"evict (a RAM environment's): its first byte is set when a put raises\n"
"MemoryError or `no_memory` (the cache is full), and cleared when a\n"
"delete succeeds; while it is set, FastPath tries no put (it declines\n"
"them at once) and the subclass must refuse them as at once.");

static PyTypeObject DatabaseRepositoryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._hotpath.DatabaseRepository",
    .tp_basicsize = sizeof(DatabaseRepository),
    .tp_dealloc = (destructor)DatabaseRepository_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = DatabaseRepository_doc,
    .tp_traverse = (traverseproc)DatabaseRepository_traverse,
    .tp_clear = (inquiry)DatabaseRepository_clear,
    .tp_members = DatabaseRepository_members,
    .tp_init = (initproc)DatabaseRepository_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------ ReplyCache, the type */

static PyObject *
ReplyCache_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    ReplyCache *self = (ReplyCache *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    for (int g = 0; g < 2; g++) {
        self->generations[g].small = (RcTable){NULL, 0, 0, RC_SMALL_SLOT};
        self->generations[g].big = (RcTable){NULL, 0, 0, RC_BIG_SLOT};
    }
    self->start_slots = RC_MIN_SMALL;
    return (PyObject *)self;
}

static int
ReplyCache_init(ReplyCache *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"current_limit", "seed", NULL};
    Py_ssize_t current_limit;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|K:ReplyCache", kwlist,
                                     &current_limit, &seed)) {
        return -1;
    }
    if (current_limit < 0) {
        PyErr_Format(PyExc_ValueError, "current_limit must be >= 0, not %zd",
                     current_limit);
        return -1;
    }
    rc_generation_free(self, &self->generations[0]);
    rc_generation_free(self, &self->generations[1]);
    rc_drop_spare(self);
    self->current_limit = current_limit;
    self->start_slots = RC_MIN_SMALL;
    self->seed = seed;
    self->refused = 0;
    self->hits = 0;
    return 0;
}

static void
ReplyCache_dealloc(ReplyCache *self)
{
    rc_generation_free(self, &self->generations[0]);
    rc_generation_free(self, &self->generations[1]);
    rc_drop_spare(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* `key` as the 20 bytes of a cache key, or NULL with ValueError set. */
static const unsigned char *
rc_key_arg(PyObject *key)
{
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != CACHE_KEY_SIZE) {
        PyErr_Format(PyExc_ValueError, "a reply cache key is %d bytes "
                     "(ReplyCache.key(request)), not %R", CACHE_KEY_SIZE, key);
        return NULL;
    }
    return (const unsigned char *)PyBytes_AS_STRING(key);
}

PyDoc_STRVAR(ReplyCache_key_doc,
"key($self, request, /)\n--\n\n"
"The cache key of `request`: its token (bytes 4..16), then\n"
"XXH64(request, seed) big-endian (domus.service.replycache.cache_key).");

static PyObject *
ReplyCache_key(ReplyCache *self, PyObject *request)
{
    Py_buffer data;
    if (PyObject_GetBuffer(request, &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (data.len < TOKEN_OFFSET + TOKEN_SIZE) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "a request of %zd bytes has no token "
                     "(bytes 4..16)", data.len);
        return NULL;
    }
    PyObject *key = PyBytes_FromStringAndSize(NULL, CACHE_KEY_SIZE);
    if (key != NULL) {
        rc_key(self->seed, data.buf, data.len,
               (unsigned char *)PyBytes_AS_STRING(key));
    }
    PyBuffer_Release(&data);
    return key;
}

PyDoc_STRVAR(ReplyCache_get_doc,
"get($self, key, /)\n--\n\n"
"The reply kept under `key` (in either generation), or None; counts a\n"
"hit in `hits`.");

static PyObject *
ReplyCache_get(ReplyCache *self, PyObject *key)
{
    const unsigned char *bytes = rc_key_arg(key);
    if (bytes == NULL) {
        return NULL;
    }
    int big;
    const unsigned char *slot = rc_lookup(self, bytes, &big, NULL);
    if (slot == NULL) {
        Py_RETURN_NONE;
    }
    self->hits++;
    return rc_reply_bytes(slot, big);
}

PyDoc_STRVAR(ReplyCache_put_doc,
"put($self, key, reply, /)\n--\n\n"
"Keep the reply of a change; the first reply kept for a key stays.\n"
"False if the cache is full (nothing kept, counted in `refused`: the\n"
"caller must not have applied the change, see full()).");

static PyObject *
ReplyCache_put(ReplyCache *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put() takes a key and a reply");
        return NULL;
    }
    const unsigned char *key = rc_key_arg(args[0]);
    if (key == NULL) {
        return NULL;
    }
    if (!PyBytes_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "a reply is bytes, not %.100s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    int big;
    if (rc_lookup(self, key, &big, NULL) != NULL) {
        Py_RETURN_TRUE;
    }
    if (rc_full(self)) {
        self->refused++;
        Py_RETURN_FALSE;
    }
    if (rc_store(self, key, (const unsigned char *)PyBytes_AS_STRING(args[1]),
                 (size_t)PyBytes_GET_SIZE(args[1])) < 0) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(ReplyCache_discard_doc,
"discard($self, key, /)\n--\n\n"
"Forget the reply kept under `key`, if any (what C does when the change\n"
"a reply was kept for fails); whether there was one.");

static PyObject *
ReplyCache_discard(ReplyCache *self, PyObject *key)
{
    const unsigned char *bytes = rc_key_arg(key);
    if (bytes == NULL) {
        return NULL;
    }
    return PyBool_FromLong(rc_remove(self, bytes));
}

PyDoc_STRVAR(ReplyCache_full_doc,
"full($self, /)\n--\n\n"
"Whether a new entry must wait for the next rotation (the change that\n"
"would make it is refused: BUSY).");

static PyObject *
ReplyCache_full(ReplyCache *self, PyObject *unused)
{
    return PyBool_FromLong(rc_full(self));
}

PyDoc_STRVAR(ReplyCache_rotate_doc,
"rotate($self, /)\n--\n\n"
"Forget the previous generation and start a new current one; returns how\n"
"many entries were forgotten.  Frees the previous generation's tables\n"
"whole: no work per entry kept inline.");

static PyObject *
ReplyCache_rotate(ReplyCache *self, PyObject *unused)
{
    return PyLong_FromSize_t(rc_rotate(self));
}

PyDoc_STRVAR(ReplyCache_prepare_doc,
"prepare($self, elapsed, left, /)\n--\n\n"
"Get the next rotation's new generation ready, `left` seconds before it\n"
"and `elapsed` seconds after the last: if the array the rotation drops\n"
"will not hold what the current generation will have held by then (at\n"
"its rate so far), make one that will, and have the inserts from now on\n"
"touch its pages a few at a time, so that the new generation's first\n"
"inserts do not all fault fresh pages in.  Returns the slots of the array\n"
"made ready (0: none is needed, or it is too small to map).");

static PyObject *
ReplyCache_prepare(ReplyCache *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "prepare(elapsed, left)");
        return NULL;
    }
    double elapsed = PyFloat_AsDouble(args[0]);
    double left = PyFloat_AsDouble(args[1]);
    if ((elapsed == -1.0 || left == -1.0) && PyErr_Occurred()) {
        return NULL;
    }
    if (!(elapsed > 0) || !(left >= 0) || elapsed > 1e9 || left > 1e9) {
        PyErr_Format(PyExc_ValueError, "prepare: elapsed > 0 and left >= 0 seconds, "
                     "not %R and %R", args[0], args[1]);
        return NULL;
    }
    size_t entries = rc_entries(&self->generations[0].small);
    double expected = (double)entries * (elapsed + left) / elapsed;
    size_t ceiling = rc_slots_for((size_t)self->current_limit);
    size_t until = expected >= (double)self->current_limit
                   ? (size_t)self->current_limit : (size_t)expected;
    size_t start = rc_slots_for(until + until / 8);
    start = start < RC_MIN_SMALL ? RC_MIN_SMALL : start > ceiling ? ceiling : start;
    const RcTable *dropped = &self->generations[1].small;
    if ((dropped->slots != NULL && dropped->epoch + 1 <= RC_EPOCHS
         && dropped->capacity >= start && dropped->capacity / 2 <= start)
            || start * RC_SMALL_SLOT < RC_MAP_AT) {
        rc_drop_spare(self);
        return PyLong_FromLong(0);
    }
    if (self->spare == NULL || self->spare_capacity != start) {
        rc_drop_spare(self);
        self->spare = rc_alloc(start, RC_SMALL_SLOT);
        if (self->spare == NULL) {
            return PyLong_FromLong(0);      /* (the rotation makes its own) */
        }
        self->spare_capacity = start;
    }
    self->spare_from = entries;
    self->spare_until = until;
    return PyLong_FromSize_t(start);
}

typedef struct {
    PyObject *out;
    int big;
} RcDictFill;

static int
rc_dict_add(const unsigned char *slot, void *arg)
{
    RcDictFill *fill = arg;
    PyObject *key = PyBytes_FromStringAndSize((const char *)slot, CACHE_KEY_SIZE);
    PyObject *reply = key ? rc_reply_bytes(slot, fill->big) : NULL;
    int failed = reply == NULL || PyDict_SetItem(fill->out, key, reply) < 0;
    Py_XDECREF(key);
    Py_XDECREF(reply);
    return failed ? -1 : 0;
}

/* A generation's entries as a new dict: key -> reply. */
static PyObject *
rc_generation_dict(const RcGeneration *generation)
{
    RcDictFill fill = {PyDict_New(), 0};
    if (fill.out == NULL) {
        return NULL;
    }
    if (rc_each(&generation->small, rc_dict_add, &fill) < 0) {
        Py_DECREF(fill.out);
        return NULL;
    }
    fill.big = 1;
    if (rc_each(&generation->big, rc_dict_add, &fill) < 0) {
        Py_DECREF(fill.out);
        return NULL;
    }
    return fill.out;
}

PyDoc_STRVAR(ReplyCache_snapshot_doc,
"snapshot($self, /)\n--\n\n"
"[current, previous]: each generation's entries as a new dict, key ->\n"
"reply (for tests and the fuzzer, which compare caches).");

static PyObject *
ReplyCache_snapshot(ReplyCache *self, PyObject *unused)
{
    PyObject *current = rc_generation_dict(&self->generations[0]);
    PyObject *previous = current ? rc_generation_dict(&self->generations[1]) : NULL;
    PyObject *out = previous ? PyList_New(2) : NULL;
    if (out == NULL) {
        Py_XDECREF(current);
        Py_XDECREF(previous);
        return NULL;
    }
    PyList_SET_ITEM(out, 0, current);
    PyList_SET_ITEM(out, 1, previous);
    return out;
}

PyDoc_STRVAR(ReplyCache_restore_doc,
"restore($self, snapshot, /)\n--\n\n"
"Make the generations hold exactly `snapshot` ([current, previous] dicts\n"
"of key -> reply, as snapshot() gives), whatever current_limit says.");

static PyObject *
ReplyCache_restore(ReplyCache *self, PyObject *snapshot)
{
    if (!PyList_Check(snapshot) || PyList_GET_SIZE(snapshot) != 2
            || !PyDict_Check(PyList_GET_ITEM(snapshot, 0))
            || !PyDict_Check(PyList_GET_ITEM(snapshot, 1))) {
        PyErr_SetString(PyExc_TypeError, "a snapshot is a list of two dicts "
                        "(current, previous)");
        return NULL;
    }
    /* Checked whole first, so that a bad snapshot changes nothing. */
    for (int g = 0; g < 2; g++) {
        PyObject *entries = PyList_GET_ITEM(snapshot, g);
        Py_ssize_t at = 0;
        PyObject *key, *reply;
        while (PyDict_Next(entries, &at, &key, &reply)) {
            if (rc_key_arg(key) == NULL) {
                return NULL;
            }
            if (!PyBytes_Check(reply)) {
                PyErr_SetString(PyExc_TypeError, "a reply is bytes");
                return NULL;
            }
        }
    }
    Py_ssize_t limit = self->current_limit;
    self->current_limit = PY_SSIZE_T_MAX;
    rc_generation_free(self, &self->generations[0]);
    rc_generation_free(self, &self->generations[1]);
    rc_drop_spare(self);
    self->start_slots = RC_MIN_SMALL;
    int failed = 0;
    for (int g = 1; g >= 0 && !failed; g--) {
        PyObject *entries = PyList_GET_ITEM(snapshot, g);
        Py_ssize_t at = 0;
        PyObject *key, *reply;
        while (!failed && PyDict_Next(entries, &at, &key, &reply)) {
            const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(key);
            failed = rc_store(self, bytes,
                              (const unsigned char *)PyBytes_AS_STRING(reply),
                              (size_t)PyBytes_GET_SIZE(reply)) < 0;
        }
        if (g == 1) {
            /* what was stored goes to the previous generation */
            RcGeneration stored = self->generations[0];
            self->generations[0] = self->generations[1];
            self->generations[1] = stored;
        }
    }
    self->current_limit = limit;
    self->start_slots = RC_MIN_SMALL;
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static Py_ssize_t
ReplyCache_length(ReplyCache *self)
{
    return (Py_ssize_t)(rc_generation_count(&self->generations[0])
                        + rc_generation_count(&self->generations[1]));
}

static PyObject *
ReplyCache_get_memory(ReplyCache *self, void *closure)
{
    size_t bytes = self->outside_bytes + self->spare_capacity * RC_SMALL_SLOT;
    for (int g = 0; g < 2; g++) {
        const RcGeneration *generation = &self->generations[g];
        bytes += rc_table_bytes(&generation->small) + rc_table_bytes(&generation->big);
    }
    return PyLong_FromSize_t(bytes);
}

static PyMethodDef ReplyCache_methods[] = {
    {"key", (PyCFunction)ReplyCache_key, METH_O, ReplyCache_key_doc},
    {"get", (PyCFunction)ReplyCache_get, METH_O, ReplyCache_get_doc},
    {"put", (PyCFunction)(void (*)(void))ReplyCache_put, METH_FASTCALL,
     ReplyCache_put_doc},
    {"discard", (PyCFunction)ReplyCache_discard, METH_O, ReplyCache_discard_doc},
    {"full", (PyCFunction)ReplyCache_full, METH_NOARGS, ReplyCache_full_doc},
    {"rotate", (PyCFunction)ReplyCache_rotate, METH_NOARGS, ReplyCache_rotate_doc},
    {"prepare", (PyCFunction)(void (*)(void))ReplyCache_prepare, METH_FASTCALL,
     ReplyCache_prepare_doc},
    {"snapshot", (PyCFunction)ReplyCache_snapshot, METH_NOARGS,
     ReplyCache_snapshot_doc},
    {"restore", (PyCFunction)ReplyCache_restore, METH_O, ReplyCache_restore_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ReplyCache_members[] = {
    {"current_limit", T_PYSSIZET, offsetof(ReplyCache, current_limit), READONLY,
     "most entries the current generation holds; past it, changes are BUSY"},
    {"seed", T_ULONGLONG, offsetof(ReplyCache, seed), READONLY,
     "the keys' XXH64 seed"},
    {"refused", T_ULONGLONG, offsetof(ReplyCache, refused), 0,
     "put()s refused because the current generation was full"},
    {"hits", T_ULONGLONG, offsetof(ReplyCache, hits), 0,
     "get()s that found a reply (the C path's own are FastPath.replayed)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef ReplyCache_getset[] = {
    {"memory", (getter)ReplyCache_get_memory, NULL,
     "bytes the cache has allocated: its tables' slots (24 bytes each for\n"
     "inline replies, 32 for others, 5/4 to 15/8 slots an entry) and the\n"
     "buffers of the replies not kept inline", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods ReplyCache_as_sequence = {
    .sq_length = (lenfunc)ReplyCache_length,
};

PyDoc_STRVAR(ReplyCache_doc,
"ReplyCache(current_limit, seed=0)\n\n"
"The reply cache's tables in C (domus.service.replycache.CompactReplyCache\n"
"adds the ttl and the clock): two generations of fixed-size entries in\n"
"open-addressed tables, which a FastPath given this cache reads and fills\n"
"without calling Python.  The current generation holds at most\n"
"`current_limit` entries.");

static PyTypeObject ReplyCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._hotpath.ReplyCache",
    .tp_basicsize = sizeof(ReplyCache),
    .tp_dealloc = (destructor)ReplyCache_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = ReplyCache_doc,
    .tp_methods = ReplyCache_methods,
    .tp_members = ReplyCache_members,
    .tp_getset = ReplyCache_getset,
    .tp_as_sequence = &ReplyCache_as_sequence,
    .tp_init = (initproc)ReplyCache_init,
    .tp_new = ReplyCache_new,
};

/* ------------------------------------------------------------ the type */

struct Forwards;
static void forwards_free(struct Forwards *forwards);

static int
FastPath_init(FastPath *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"dhts", "cache", "tree_type", "dict_type", "key",
                             NULL};
    PyObject *dhts, *cache, *tree_type = Py_None;
    PyObject *dict_type = Py_None, *key = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!|O$OO:FastPath", kwlist,
                                     &PyDict_Type, &dhts, &ReplyCacheType,
                                     &cache, &tree_type, &dict_type, &key)) {
        return -1;
    }
    if (key != Py_None && !(PyBytes_Check(key) && PyBytes_GET_SIZE(key) == 16)) {
        PyErr_SetString(PyExc_TypeError, "key must be 16 bytes (the data plane's "
                        "SipHash key) or None");
        return -1;
    }
    if (tree_type != Py_None && !PyType_Check(tree_type)) {
        PyErr_SetString(PyExc_TypeError,
                        "tree_type must be the RecordTree type or None");
        return -1;
    }
    if (dict_type != Py_None
            && !(PyType_Check(dict_type)
                 && PyType_IsSubtype((PyTypeObject *)dict_type,
                                     &PyDict_Type))) {
        PyErr_SetString(PyExc_TypeError,
                        "dict_type must be a subclass of dict or None");
        return -1;
    }
    const DomusRecordTreeAPI *tree_api = NULL;
    if (tree_type != Py_None) {
        /* Trees are driven only if domus._recordtree's C API is there and is
         * the API of this very type; otherwise they take the Python path. */
        tree_api = PyCapsule_Import(DOMUS_RECORDTREE_CAPSULE, 0);
        if (tree_api == NULL) {
            PyErr_Clear();
        }
        else if ((PyObject *)tree_api->type != tree_type) {
            tree_api = NULL;
        }
    }
    Py_INCREF(dhts);
    Py_XSETREF(self->dhts, dhts);
    Py_INCREF(cache);
    Py_XSETREF(self->cache, cache);
    if (tree_type == Py_None) {
        Py_CLEAR(self->tree_type);
    }
    else {
        Py_INCREF(tree_type);
        Py_XSETREF(self->tree_type, tree_type);
    }
    if (dict_type == Py_None) {
        Py_CLEAR(self->dict_type);
    }
    else {
        Py_INCREF(dict_type);
        Py_XSETREF(self->dict_type, dict_type);
    }
    self->tree_api = tree_api;
    self->keyed = key != Py_None;
    if (self->keyed) {
        memcpy(self->key, PyBytes_AS_STRING(key), 16);
    }
    return 0;
}

static int
FastPath_traverse(FastPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dhts);
    Py_VISIT(self->cache);
    Py_VISIT(self->tree_type);
    Py_VISIT(self->dict_type);
    Py_VISIT(self->thread_queue);
    Py_VISIT(self->thread_baton);
    Py_VISIT(self->backup);
    return 0;
}

static int
FastPath_clear(FastPath *self)
{
    Py_CLEAR(self->dhts);
    Py_CLEAR(self->cache);
    Py_CLEAR(self->tree_type);
    Py_CLEAR(self->dict_type);
    Py_CLEAR(self->thread_queue);
    Py_CLEAR(self->thread_baton);
    Py_CLEAR(self->backup);
    self->tree_api = NULL;
    return 0;
}

static void
FastPath_dealloc(FastPath *self)
{
    PyObject_GC_UnTrack(self);
    FastPath_clear(self);
    if (self->batch != NULL) {
        batch_settle(self, self->batch);        /* (nothing is pending; to be sure) */
        batch_free(self->batch);
    }
    forwards_free(self->forwards);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The reply as one bytes object (a new reference); clears *reply. */
static PyObject *
reply_bytes(Reply *reply)
{
    if (reply->whole != NULL) {
        PyObject *whole = reply->whole;
        reply->whole = NULL;
        return whole;
    }
    Py_ssize_t value_size = reply->value ? PyBytes_GET_SIZE(reply->value)
                                         : 0;
    Py_ssize_t head_size = REPLY_HEADER_SIZE + reply->body;
    PyObject *out = PyBytes_FromStringAndSize(NULL, head_size + value_size);
    if (out != NULL) {
        memcpy(PyBytes_AS_STRING(out), reply->head, (size_t)head_size);
        if (value_size) {
            memcpy(PyBytes_AS_STRING(out) + head_size,
                   PyBytes_AS_STRING(reply->value), (size_t)value_size);
        }
    }
    reply_clear(reply);
    return out;
}

PyDoc_STRVAR(FastPath_handle_doc,
"handle($self, /, data, limit=65507)\n--\n\n"
"The reply to one request, byte-identical to RequestHandler.handle(data,\n"
"limit) with the same effects, or None (nothing changed) when the Python\n"
"handler must answer: other ops, errors, repositories C cannot drive.");

static PyObject *
FastPath_handle(FastPath *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"data", "limit", NULL};
    Py_buffer data;
    Py_ssize_t limit = MAX_UDP_PAYLOAD;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|n:handle", kwlist, &data,
                                     &limit)) {
        return NULL;
    }
    Reply reply = {NULL, {0}, 0, NULL};
    int result = handle_request(self, data.buf, data.len, limit, &reply);
    PyBuffer_Release(&data);
    if (result < 0) {
        return NULL;
    }
    if (result == DECLINED) {
        Py_RETURN_NONE;
    }
    return reply_bytes(&reply);
}

/* The peer as the socket module gives it: (host, port) for IPv4,
 * (host, port, flowinfo, scope_id) for IPv6. */
static PyObject *
peer_address(const struct sockaddr_storage *peer)
{
    char host[INET6_ADDRSTRLEN];
    if (peer->ss_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)peer;
        if (inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host)) == NULL) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        return Py_BuildValue("(si)", host, (int)ntohs(v4->sin_port));
    }
    if (peer->ss_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)peer;
        if (inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host)) == NULL) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        return Py_BuildValue("(siII)", host, (int)ntohs(v6->sin6_port),
                             (unsigned int)ntohl(v6->sin6_flowinfo),
                             (unsigned int)v6->sin6_scope_id);
    }
    PyErr_Format(PyExc_OSError, "datagram from address family %d",
                 (int)peer->ss_family);
    return NULL;
}

/* Errors a UDP socket reports for an earlier datagram (ICMP) or for lack of
 * resources now: the datagram concerned is lost, the service goes on. */
static int
is_transient(int error)
{
    switch (error) {
    case ECONNREFUSED:
    case ECONNRESET:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EHOSTDOWN:
    case ENETDOWN:
    case ETIMEDOUT:
    case EPROTO:
    case ENOPROTOOPT:
    case EMSGSIZE:
    case ENOBUFS:
    case ENOMEM:
    case EPERM:
        return 1;
    default:
        return 0;
    }
}

/* ------------------------------------------------------------ batches
 *
 * A socket is read BATCH_SIZE datagrams at a time (recvmmsg) and the
 * replies C gives are sent together (sendmmsg): the kernel's per-call cost
 * and the clock reads (the replay window, shedding) are paid once a batch.
 * A Batch holds a buffer per datagram and the replies prepared but not yet
 * sent; each reply owns its bytes (a stored value's bytes object, or a
 * copy), so it stays valid whatever later requests of the batch change.
 * Receiving and sending touch no Python object's state and run without
 * the GIL in the serving thread; preparing and settling (counting what was
 * sent, dropping the replies' references) need it. */

static void
batch_free(Batch *batch)
{
    if (batch != NULL) {
        PyMem_RawFree(batch->buffers);
        PyMem_RawFree(batch);
    }
}

/* A new, empty Batch (its buffers allocated but untouched, so only the
 * pages datagrams fill become resident), or NULL with MemoryError set. */
static Batch *
batch_new(void)
{
    Batch *batch = PyMem_RawCalloc(1, sizeof(Batch));
    if (batch == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    batch->buffers = PyMem_RawMalloc((size_t)BATCH_SIZE * RECV_BUFFER_SIZE);
    if (batch->buffers == NULL) {
        PyMem_RawFree(batch);
        PyErr_NoMemory();
        return NULL;
    }
    return batch;
}

/* Reads up to `count` datagrams from `fd` without blocking: how many
 * (>= 1), or -1 with errno set (EAGAIN: none waiting).  Needs no GIL. */
static int
batch_receive(int fd, Batch *batch, int count)
{
    for (int i = 0; i < count; i++) {
        batch->into[i].iov_base = batch->buffers + (size_t)i * RECV_BUFFER_SIZE;
        batch->into[i].iov_len = RECV_BUFFER_SIZE;
        struct msghdr *header = &batch->in[i].msg_hdr;
        memset(header, 0, sizeof(*header));
        header->msg_name = &batch->peers[i];
        header->msg_namelen = sizeof(batch->peers[i]);
        header->msg_iov = &batch->into[i];
        header->msg_iovlen = 1;
        header->msg_control = batch->controls[i].bytes;
        header->msg_controllen = sizeof(batch->controls[i].bytes);
        batch->in[i].msg_len = 0;
    }
    return recvmmsg(fd, batch->in, (unsigned int)count, MSG_DONTWAIT, NULL);
}

/* Seals a reply made of parts[0..count): its MAC (of the reply, the
 * request's client id and its time, as domus.wire.auth.seal_reply makes
 * it) is written to `mac` and added as part `count`; the new count. */
static size_t
seal_reply(FastPath *self, struct iovec *parts, size_t count,
           const unsigned char *request, const unsigned char *stamp, unsigned char *mac)
{
    DomusSip sip;
    domus_sip_init(&sip, self->key);
    for (size_t i = 0; i < count; i++) {
        domus_sip_update(&sip, parts[i].iov_base, parts[i].iov_len);
    }
    domus_sip_update(&sip, request + 8, 8);
    domus_sip_update(&sip, stamp, 4);
    uint64_t tag = domus_sip_final(&sip);
    for (int i = 0; i < REPLY_TRAILER; i++) {
        mac[i] = (unsigned char)(tag >> (56 - 8 * i));
    }
    parts[count].iov_base = mac;
    parts[count].iov_len = REPLY_TRAILER;
    return count + 1;
}

/* Adds `reply` (taken over: *reply is left empty) to the batch's replies
 * to send, to `peer`, sealed with a MAC when `stamp` is given (a secure
 * deployment: the MAC of the reply, the request's client id and its time,
 * as domus.wire.auth.seal_reply makes it). */
static void
batch_add_reply(FastPath *self, Batch *batch, Reply *reply,
                const struct sockaddr_storage *peer, socklen_t peer_length,
                const unsigned char *request, const unsigned char *stamp)
{
    int index = batch->pending++;
    Reply *kept = &batch->replies[index];
    *kept = *reply;
    reply->whole = NULL;
    reply->body = 0;
    reply->value = NULL;
    struct iovec *parts = batch->parts[index];
    struct msghdr *message = &batch->out[index].msg_hdr;
    memset(message, 0, sizeof(*message));
    message->msg_name = (void *)peer;
    message->msg_namelen = peer_length;
    message->msg_iov = parts;
    if (kept->whole != NULL) {
        parts[0].iov_base = PyBytes_AS_STRING(kept->whole);
        parts[0].iov_len = (size_t)PyBytes_GET_SIZE(kept->whole);
        message->msg_iovlen = 1;
    }
    else {
        parts[0].iov_base = kept->head;
        parts[0].iov_len = REPLY_HEADER_SIZE + (size_t)kept->body;
        message->msg_iovlen = 1;
        if (kept->value != NULL) {
            parts[1].iov_base = PyBytes_AS_STRING(kept->value);
            parts[1].iov_len = (size_t)PyBytes_GET_SIZE(kept->value);
            message->msg_iovlen = 2;
        }
    }
    if (stamp != NULL) {
        message->msg_iovlen = seal_reply(self, parts, message->msg_iovlen, request, stamp,
                                         batch->macs[index]);
    }
}

/* Sends the batch's pending replies, never blocking: a reply the kernel
 * refuses is counted (the client retries) and the rest still go; so are
 * the bytes sent (atomically).  Needs no GIL; batch_settle frees the
 * replies afterwards. */
static void
batch_send(FastPath *self, int fd, Batch *batch)
{
    int from = batch->sent;
    while (from < batch->pending) {
        int sent = sendmmsg(fd, batch->out + from,
                            (unsigned int)(batch->pending - from),
                            MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) {
                continue;
            }
            /* this one is lost (the client retries); go past it */
            atomic_fetch_add_explicit(&self->send_errors, 1, memory_order_relaxed);
            from++;
            continue;
        }
        unsigned long long sent_bytes = 0;
        for (int i = from; i < from + sent; i++) {
            sent_bytes += batch->out[i].msg_len;
        }
        atomic_fetch_add_explicit(&self->bytes_sent, sent_bytes, memory_order_relaxed);
        from += sent;
    }
    batch->sent = from;
}

/* Drops the sent replies (needs the GIL). */
static void
batch_settle(FastPath *self, Batch *batch)
{
    for (int i = 0; i < batch->pending; i++) {
        reply_clear(&batch->replies[i]);
    }
    batch->pending = 0;
    batch->sent = 0;
}

/* Whether to shed the datagram `message` (see SHED_INTERVAL_NS), read at
 * `now_ns` (its batch's clock): reads its kernel receive time
 * (SO_TIMESTAMPNS, which the caller switches on; a datagram without one is
 * never shed) and the kernel's drop count (SO_RXQ_OVFL, if on), and keeps
 * the interval's state. */
static int
should_shed(FastPath *self, struct msghdr *message, long long now_ns)
{
    long long received_ns = -1;
    for (struct cmsghdr *item = CMSG_FIRSTHDR(message); item != NULL;
         item = CMSG_NXTHDR(message, item)) {
        if (item->cmsg_level != SOL_SOCKET) {
            continue;
        }
        if (item->cmsg_type == SCM_TIMESTAMPNS
                && item->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
            struct timespec received;
            memcpy(&received, CMSG_DATA(item), sizeof(received));
            received_ns = (long long)received.tv_sec * 1000000000LL + received.tv_nsec;
        }
        else if (item->cmsg_type == SO_RXQ_OVFL
                 && item->cmsg_len >= CMSG_LEN(sizeof(uint32_t))) {
            memcpy(&self->kernel_drops, CMSG_DATA(item), sizeof(uint32_t));
        }
    }
    if (received_ns < 0) {
        return 0;
    }
    long long waited = now_ns - received_ns;
    long long target = self->shed_after_ns;
    if (received_ns >= self->interval_end_ns) {
        if (self->interval_end_ns != 0) {
            long long limit = self->behind ? self->shed_limit_ns : target;
            int enough = self->interval_count >= SHED_MIN_DATAGRAMS;
            int overflowed = enough && self->kernel_drops != self->interval_drops;
            int standing = enough && self->interval_min_ns > (self->behind ? limit / 2
                                                                             : limit);
            self->behind = standing || overflowed;
            if (!self->behind) {
                limit = target;
            }
            else if (overflowed) {
                long long half = self->interval_max_ns / 2;
                half = half > 1000000LL ? half : 1000000LL;     /* (1 ms at least) */
                limit = half < limit ? half : limit;
            }
            self->shed_limit_ns = limit;
            self->behind_streak = self->behind ? (self->behind_streak < 6
                                                  ? self->behind_streak + 1 : 6) : 0;
        }
        self->interval_min_ns = LLONG_MAX;
        self->interval_max_ns = 0;
        self->interval_count = 0;
        self->interval_drops = self->kernel_drops;
        self->interval_end_ns = received_ns + SHED_INTERVAL_NS;
    }
    self->interval_count++;
    if (waited < self->interval_min_ns) {
        self->interval_min_ns = waited;
    }
    if (waited > self->interval_max_ns) {
        self->interval_max_ns = waited;
    }
    return self->behind && waited > self->shed_limit_ns;
}

/* The retry-after of a shed request's BUSY (see RETRY_AFTER_MAX_MS). */
static uint16_t
retry_after_ms(FastPath *self)
{
    long long wait = (SHED_INTERVAL_NS / 1000000) << (self->behind_streak > 0
                                                      ? self->behind_streak - 1 : 0);
    return (uint16_t)(wait < RETRY_AFTER_MAX_MS ? wait : RETRY_AFTER_MAX_MS);
}

static void thread_wake(FastPath *self);

/* ------------------------------------------------------------ replication
 *
 * A replicated bucket's primary sends each change to the bucket's backups
 * before it applies it (domus.service.handler, "replication", is the
 * reference).  With the serving thread, C does so itself for PUT and
 * DELETE: the change is sent as a REPLICATE datagram from the service's
 * own UDP socket to each backup's, where the backup's C path applies it
 * (handle_replicate, through the FastPath of the backups held there) and
 * answers; once every backup has answered, the primary applies the change
 * (apply_change, caching its reply as always) and answers the client.
 *
 * Order.  Each backup must apply a bucket's changes in the order its
 * primary does.  So a bucket has a *line*: the changes to it not yet
 * applied here, first come first; only the first is sent, and the next
 * only once the first has been applied (or has failed).  The Python path's
 * replicated changes (PUT_MANY, values over TCP, whatever C declines)
 * take their turn in the same lines (claim/release: a change of several
 * buckets is in the line of each and goes when it is first in all of
 * them, so the lines, filled in one order, never wait on each other), so
 * the backups see one order whichever path a change took.
 *
 * Loss.  A REPLICATE not answered is sent again (after 20 ms, doubling up
 * to 320 ms); a backup that has applied it already answers again from its
 * reply cache (its entry is keyed by the client's own request), so a
 * change is applied once.  A change its backups have not all answered
 * within FWD_TIMEOUT_NS, or that a backup refused, fails: it is handed to
 * Python, which reports the backup to the supervisor (copy_failed) and
 * answers MOVING (nothing was acknowledged; the client retries).  So do
 * the other changes waiting for that backup.  When the supervisor takes a
 * backup off a bucket, the changes in flight stop waiting for it
 * (FastPath.recheck).
 *
 * A change its backups took but that C cannot apply here (the bucket
 * frozen for a move meanwhile, a database error) is handed to Python,
 * which applies it as handle(forward=False) does.  Everything here is
 * touched holding the baton and the GIL (on the serving thread, or on the
 * reactor thread through the methods), so it needs no lock of its own. */

#define FWD_SLOT_BITS 12
#define FWD_SLOTS (1 << FWD_SLOT_BITS)
#define FWD_MAX_HOLDERS 2
#define HOLDER_SIZE 6               /* IPv4 address and port, as Python packs them */
#define FWD_FIRST_RETRY_NS 20000000LL
#define FWD_MAX_RETRY_NS 320000000LL
#define FWD_TIMEOUT_NS 2000000000LL

enum { FWD_FREE = 0, FWD_C, FWD_PY };

typedef struct FwdNode {
    uint32_t slot;
    struct FwdNode *next;
} FwdNode;

typedef struct {
    uint64_t key;                   /* DHT id << 32 | bucket */
    FwdNode *head, *tail;
    int used;
} FwdLine;

typedef struct {
    int kind;
    uint32_t id;                    /* slot | generation << FWD_SLOT_BITS */
    uint32_t dht_id;
    int bucket_count;               /* the lines it is in */
    uint32_t *buckets;
    int waiting;                    /* lines in which it is not first yet */
    int started;
    /* FWD_C: the client's request, without its trailer, and where from */
    int op;
    unsigned char *request;
    Py_ssize_t size;
    unsigned char token[CACHE_KEY_SIZE];
    struct sockaddr_storage peer;
    socklen_t peer_length;
    unsigned char stamp[4];
    int stamped;
    struct sockaddr_in holders[FWD_MAX_HOLDERS];
    int holder_count;
    unsigned acked;                 /* a bit per holder that took it (or left) */
    uint32_t sent_time;             /* the REPLICATE's time (a secure deployment) */
    long long deadline_ns, retry_ns, backoff_ns;
} Forward;

/* What an answer to a slot's last REPLICATE, come after it was done with
 * (an answer to a resend, or the first answer to a change already failed),
 * is checked against: authentic and from a holder, it is counted
 * (late_answers) and dropped, neither malformed nor unauthenticated. */
typedef struct {
    uint32_t id;                    /* 0: none */
    uint32_t sent_time;
    unsigned char client[8];        /* the REPLICATE's client id */
    int holder_count;
    struct sockaddr_in holders[FWD_MAX_HOLDERS];
} FwdLast;

typedef struct Forwards {
    Forward slots[FWD_SLOTS];
    FwdLast last[FWD_SLOTS];
    uint32_t generations[FWD_SLOTS];
    uint32_t free_slots[FWD_SLOTS];
    int free_count;
    FwdLine *lines;
    size_t line_capacity;           /* a power of two */
    size_t line_count;
    int fd;                         /* the service's UDP socket */
    int started_c;                  /* C changes sent and not yet answered */
    _Atomic long long next_ns;      /* the next resend or timeout; 0: none */
    unsigned char out[RECV_BUFFER_SIZE + REQUEST_HEADER_SIZE + REQUEST_TRAILER];
} Forwards;

static long long
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

static Forwards *
forwards_new(int fd)
{
    Forwards *forwards = PyMem_RawCalloc(1, sizeof(Forwards));
    if (forwards == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    forwards->line_capacity = 256;
    forwards->lines = PyMem_RawCalloc(forwards->line_capacity, sizeof(FwdLine));
    if (forwards->lines == NULL) {
        PyMem_RawFree(forwards);
        PyErr_NoMemory();
        return NULL;
    }
    for (int i = 0; i < FWD_SLOTS; i++) {
        forwards->free_slots[i] = (uint32_t)(FWD_SLOTS - 1 - i);
    }
    forwards->free_count = FWD_SLOTS;
    forwards->fd = fd;
    return forwards;
}

static void
forward_clear(Forward *entry)
{
    PyMem_RawFree(entry->request);
    PyMem_RawFree(entry->buckets);
    memset(entry, 0, sizeof(*entry));
}

static void
forwards_free(Forwards *forwards)
{
    if (forwards == NULL) {
        return;
    }
    for (size_t i = 0; i < forwards->line_capacity; i++) {
        FwdNode *node = forwards->lines[i].used ? forwards->lines[i].head : NULL;
        while (node != NULL) {
            FwdNode *next = node->next;
            PyMem_RawFree(node);
            node = next;
        }
    }
    for (int i = 0; i < FWD_SLOTS; i++) {
        forward_clear(&forwards->slots[i]);
    }
    PyMem_RawFree(forwards->lines);
    PyMem_RawFree(forwards);
}

static size_t
line_home(uint64_t key, size_t capacity)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> 20) & (capacity - 1);
}

/* The line of `key`, made if `make` (NULL: none, or no memory with
 * `make`, MemoryError set). */
static FwdLine *
line_of(Forwards *forwards, uint64_t key, int make)
{
    if (make && (forwards->line_count + 1) * 2 > forwards->line_capacity) {
        size_t capacity = forwards->line_capacity * 2;
        FwdLine *lines = PyMem_RawCalloc(capacity, sizeof(FwdLine));
        if (lines == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        for (size_t i = 0; i < forwards->line_capacity; i++) {
            FwdLine *line = &forwards->lines[i];
            if (line->used) {
                size_t at = line_home(line->key, capacity);
                while (lines[at].used) {
                    at = (at + 1) & (capacity - 1);
                }
                lines[at] = *line;
            }
        }
        PyMem_RawFree(forwards->lines);
        forwards->lines = lines;
        forwards->line_capacity = capacity;
    }
    size_t mask = forwards->line_capacity - 1;
    size_t at = line_home(key, forwards->line_capacity);
    while (forwards->lines[at].used) {
        if (forwards->lines[at].key == key) {
            return &forwards->lines[at];
        }
        at = (at + 1) & mask;
    }
    if (!make) {
        return NULL;
    }
    FwdLine *line = &forwards->lines[at];
    line->used = 1;
    line->key = key;
    line->head = line->tail = NULL;
    forwards->line_count++;
    return line;
}

/* Takes an emptied line out of the table (linear probing: the entries
 * after it move back where their home allows). */
static void
line_remove(Forwards *forwards, FwdLine *line)
{
    size_t mask = forwards->line_capacity - 1;
    size_t hole = (size_t)(line - forwards->lines);
    size_t at = hole;
    forwards->lines[hole].used = 0;
    forwards->line_count--;
    for (;;) {
        at = (at + 1) & mask;
        if (!forwards->lines[at].used) {
            return;
        }
        size_t home = line_home(forwards->lines[at].key, forwards->line_capacity);
        /* (moves back unless its home lies after the hole, up to it) */
        if (((at - home) & mask) >= ((at - hole) & mask)) {
            forwards->lines[hole] = forwards->lines[at];
            forwards->lines[at].used = 0;
            hole = at;
        }
    }
}

/* A free slot, its entry cleared and given an id (-1: all in use). */
static int
forward_take_slot(Forwards *forwards, int kind, uint32_t dht_id)
{
    if (forwards->free_count == 0) {
        return -1;
    }
    uint32_t slot = forwards->free_slots[--forwards->free_count];
    Forward *entry = &forwards->slots[slot];
    memset(entry, 0, sizeof(*entry));
    entry->kind = kind;
    entry->dht_id = dht_id;
    uint32_t generation = ++forwards->generations[slot];
    entry->id = slot | (generation << FWD_SLOT_BITS);
    return (int)slot;
}

static void
forward_give_slot(Forwards *forwards, uint32_t slot)
{
    Forward *entry = &forwards->slots[slot];
    FwdLast *last = &forwards->last[slot];
    if (entry->kind == FWD_C && entry->started && entry->request != NULL) {
        last->id = entry->id;
        last->sent_time = entry->sent_time;
        memcpy(last->client, entry->request + 8, sizeof(last->client));
        last->holder_count = entry->holder_count;
        memcpy(last->holders, entry->holders, sizeof(last->holders));
    }
    else {
        last->id = 0;
    }
    forward_clear(entry);
    forwards->free_slots[forwards->free_count++] = slot;
}

/* Puts the entry in `slot` at the end of the line of each of its buckets:
 * 0, or -1 with MemoryError set (it is in none then). */
static int
forward_enqueue(Forwards *forwards, uint32_t slot)
{
    Forward *entry = &forwards->slots[slot];
    FwdNode *nodes[1];
    FwdNode **made = entry->bucket_count == 1 ? nodes
        : PyMem_RawCalloc((size_t)entry->bucket_count, sizeof(FwdNode *));
    if (made == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int failed = 0;
    for (int i = 0; i < entry->bucket_count; i++) {
        made[i] = PyMem_RawMalloc(sizeof(FwdNode));
        failed |= made[i] == NULL;
    }
    /* (lines made before a failure stay, empty, until one is needed again
     * and used; an empty line is harmless) */
    FwdLine *lines_ok = NULL;
    for (int i = 0; i < entry->bucket_count && !failed; i++) {
        uint64_t key = (uint64_t)entry->dht_id << 32 | entry->buckets[i];
        lines_ok = line_of(forwards, key, 1);
        failed |= lines_ok == NULL;
    }
    if (failed) {
        for (int i = 0; i < entry->bucket_count; i++) {
            PyMem_RawFree(made[i]);
        }
        if (made != nodes) {
            PyMem_RawFree(made);
        }
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        return -1;
    }
    entry->waiting = 0;
    for (int i = 0; i < entry->bucket_count; i++) {
        uint64_t key = (uint64_t)entry->dht_id << 32 | entry->buckets[i];
        FwdLine *line = line_of(forwards, key, 0);
        FwdNode *node = made[i];
        node->slot = slot;
        node->next = NULL;
        if (line->tail == NULL) {
            line->head = line->tail = node;
        }
        else {
            line->tail->next = node;
            line->tail = node;
            entry->waiting++;
        }
    }
    if (made != nodes) {
        PyMem_RawFree(made);
    }
    return 0;
}

/* Sends the REPLICATE of a C entry to each backup that has not taken it. */
static void
forward_send(FastPath *self, Forwards *forwards, Forward *entry)
{
    unsigned char *out = forwards->out;
    out[0] = REQUEST_MAGIC;
    out[1] = PROTOCOL_VERSION;
    out[2] = OP_REPLICATE;
    out[3] = 0;
    write_u32(out + 4, entry->id);
    memcpy(out + 8, entry->request + 8, 8);     /* (the client's id) */
    memcpy(out + REQUEST_HEADER_SIZE, entry->request, (size_t)entry->size);
    size_t length = REQUEST_HEADER_SIZE + (size_t)entry->size;
    if (self->keyed) {
        write_u32(out + length, entry->sent_time);
        uint64_t tag = domus_siphash24(self->key, out, length + 4);
        for (int i = 0; i < 8; i++) {
            out[length + 4 + i] = (unsigned char)(tag >> (56 - 8 * i));
        }
        length += REQUEST_TRAILER;
    }
    for (int i = 0; i < entry->holder_count; i++) {
        if (!(entry->acked & (1u << i))) {
            /* (a send that fails is a datagram lost: sent again later) */
            (void)sendto(forwards->fd, out, length, MSG_DONTWAIT | MSG_NOSIGNAL,
                         (const struct sockaddr *)&entry->holders[i],
                         sizeof(entry->holders[i]));
        }
    }
}

/* Appends `item` to the queue the reactor thread reads (see the serving
 * thread) and wakes it: 0, or -1 with an exception set. */
static int
forward_queue(FastPath *self, PyObject *item)
{
    if (item == NULL) {
        return -1;
    }
    int failed = PyList_Append(self->thread_queue, item);
    Py_DECREF(item);
    if (failed == 0) {
        thread_wake(self);
    }
    return failed;
}

/* An entry that is first in all its lines goes: a C change is sent to its
 * backups, a Python one's claim is handed back to Python (its int id in
 * the queue), which sends it.  0, or -1 with an exception set. */
static int
forward_start(FastPath *self, Forwards *forwards, uint32_t slot)
{
    Forward *entry = &forwards->slots[slot];
    entry->started = 1;
    if (entry->kind == FWD_PY) {
        return forward_queue(self, PyLong_FromUnsignedLong(entry->id));
    }
    long long now = monotonic_ns();
    entry->sent_time = (uint32_t)time(NULL);
    entry->deadline_ns = now + FWD_TIMEOUT_NS;
    entry->backoff_ns = FWD_FIRST_RETRY_NS;
    entry->retry_ns = now + entry->backoff_ns;
    forwards->started_c++;
    long long next = atomic_load(&forwards->next_ns);
    if (next == 0 || entry->retry_ns < next) {
        atomic_store(&forwards->next_ns, entry->retry_ns);
        if (self->thread_running && !pthread_equal(pthread_self(), self->thread)) {
            /* (the serving thread waits for less than it did now) */
            uint64_t one = 1;
            while (write(self->thread_stop_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
            }
        }
    }
    self->forwarded++;
    if (entry->acked != (1u << entry->holder_count) - 1) {
        forward_send(self, forwards, entry);
    }
    return 0;
}

/* The entry in `slot` leaves its lines and its slot is freed; where it
 * was first, the next in the line may now be first in all of its own
 * lines, and starts.  0, or -1 with an exception set (the lines are right
 * whatever happens). */
static int
forward_finish(FastPath *self, Forwards *forwards, uint32_t slot)
{
    Forward *entry = &forwards->slots[slot];
    if (entry->kind == FWD_C && entry->started) {
        forwards->started_c--;
    }
    int failed = 0;
    for (int i = 0; i < entry->bucket_count; i++) {
        uint64_t key = (uint64_t)entry->dht_id << 32 | entry->buckets[i];
        FwdLine *line = line_of(forwards, key, 0);
        FwdNode *before = NULL;
        FwdNode *node = line != NULL ? line->head : NULL;
        while (node != NULL && node->slot != slot) {
            before = node;
            node = node->next;
        }
        if (node == NULL) {
            continue;                   /* (never: it is in each) */
        }
        if (before != NULL) {
            before->next = node->next;  /* (not first: no one moves up) */
            if (line->tail == node) {
                line->tail = before;
            }
            PyMem_RawFree(node);
            continue;
        }
        line->head = node->next;
        PyMem_RawFree(node);
        if (line->head == NULL) {
            line->tail = NULL;
            line_remove(forwards, line);
            continue;
        }
        uint32_t next = line->head->slot;
        Forward *after = &forwards->slots[next];
        if (--after->waiting == 0 && !after->started) {
            failed |= forward_start(self, forwards, next) < 0;
        }
    }
    forward_give_slot(forwards, slot);
    return failed ? -1 : 0;
}

/* "host:port" of a holder (a new reference, or NULL). */
static PyObject *
holder_name(const struct sockaddr_in *holder)
{
    char host[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, &holder->sin_addr, host, sizeof(host)) == NULL) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyUnicode_FromFormat("%s:%d", host, (int)ntohs(holder->sin_port));
}

/* Hands a C entry to Python, in the queue: (request, peer, stamp, failed),
 * `failed` the list of the backups (host:port) that did not take it and
 * `why`, or None when they all did and Python is to apply it here. */
static int
forward_hand_over(FastPath *self, Forward *entry, int failed, const char *why)
{
    PyObject *request = PyBytes_FromStringAndSize((const char *)entry->request,
                                                  entry->size);
    PyObject *peer = request ? peer_address(&entry->peer) : NULL;
    PyObject *stamp = NULL;
    if (peer != NULL) {
        stamp = entry->stamped ? PyBytes_FromStringAndSize((const char *)entry->stamp, 4)
                               : Py_NewRef(Py_None);
    }
    PyObject *outcome = NULL;
    if (stamp != NULL) {
        if (!failed) {
            outcome = Py_NewRef(Py_None);
        }
        else {
            PyObject *holders = PyList_New(0);
            for (int i = 0; holders != NULL && i < entry->holder_count; i++) {
                if (entry->acked & (1u << i)) {
                    continue;
                }
                PyObject *name = holder_name(&entry->holders[i]);
                if (name == NULL || PyList_Append(holders, name) < 0) {
                    Py_CLEAR(holders);
                }
                Py_XDECREF(name);
            }
            if (holders != NULL) {
                outcome = Py_BuildValue("(Ns)", holders, why);
            }
        }
    }
    PyObject *item = outcome ? PyTuple_Pack(4, request, peer, stamp, outcome) : NULL;
    Py_XDECREF(request);
    Py_XDECREF(peer);
    Py_XDECREF(stamp);
    Py_XDECREF(outcome);
    return forward_queue(self, item);
}

static int send_reply_now(FastPath *self, int fd, Reply *reply,
                          const struct sockaddr_storage *peer, socklen_t peer_length,
                          const unsigned char *request, const unsigned char *stamp);

/* Every backup has taken the C entry in `slot`: applied here (its reply
 * cached) and answered, or handed to Python when C cannot apply it.
 * 0, or -1 with an exception set. */
static int
forward_done(FastPath *self, Forwards *forwards, uint32_t slot)
{
    Forward *entry = &forwards->slots[slot];
    Reply reply = {NULL, {0}, 0, NULL};
    self->apply_replicated = 1;
    int result = apply_change(self, entry->op, entry->request, entry->size, &reply);
    self->apply_replicated = 0;
    int failed = 0;
    if (result == HANDLED) {
        unsigned char status = reply.whole != NULL
            ? (unsigned char)PyBytes_AS_STRING(reply.whole)[2] : reply.head[2];
        self->by_status[status]++;
        failed = send_reply_now(self, forwards->fd, &reply, &entry->peer,
                                entry->peer_length, entry->request,
                                entry->stamped ? entry->stamp : NULL) < 0;
    }
    else {
        if (result < 0) {
            PyErr_Clear();      /* (Python meets it again, and says so) */
        }
        failed = forward_hand_over(self, entry, 0, NULL) < 0;
    }
    reply_clear(&reply);
    failed |= forward_finish(self, forwards, slot) < 0;
    return failed ? -1 : 0;
}

/* Whether C entry `entry` waits for one of `missing` (not taken yet). */
static int
forward_waits_for(const Forward *entry, const struct sockaddr_in *missing, int count)
{
    for (int i = 0; i < entry->holder_count; i++) {
        for (int j = 0; j < count; j++) {
            if (!(entry->acked & (1u << i))
                    && entry->holders[i].sin_addr.s_addr == missing[j].sin_addr.s_addr
                    && entry->holders[i].sin_port == missing[j].sin_port) {
                return 1;
            }
        }
    }
    return 0;
}

/* The C entry in `slot` failed (`why`): handed to Python with the
 * backups that did not take it; so are the other C changes waiting for
 * one of those backups, rather than each waiting for its own timeout.
 * 0, or -1 with an exception set. */
static int
forward_fail(FastPath *self, Forwards *forwards, uint32_t slot, const char *why)
{
    Forward *entry = &forwards->slots[slot];
    struct sockaddr_in missing[FWD_MAX_HOLDERS];
    int missing_count = 0;
    for (int i = 0; i < entry->holder_count; i++) {
        if (!(entry->acked & (1u << i))) {
            missing[missing_count++] = entry->holders[i];
        }
    }
    int failed = 0;
    /* (first the ones not first in their line, which leave it without
     * starting anyone; then those sent, whose leaving starts the next) */
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t other = 0; other < FWD_SLOTS; other++) {
            Forward *candidate = &forwards->slots[other];
            if (candidate->kind != FWD_C || candidate->started != pass
                    || !(other == slot
                         || forward_waits_for(candidate, missing, missing_count))) {
                continue;
            }
            self->forward_failures++;
            failed |= forward_hand_over(self, candidate, 1, why) < 0;
            failed |= forward_finish(self, forwards, other) < 0;
        }
    }
    return failed ? -1 : 0;
}

/* Resends what waited too long for an answer and fails what timed out;
 * sets next_ns.  0, or -1 with an exception set. */
static int
forwards_tick(FastPath *self, Forwards *forwards)
{
    long long now = monotonic_ns();
    long long next = 0;
    int failed = 0;
    for (uint32_t slot = 0; slot < FWD_SLOTS && forwards->started_c > 0; slot++) {
        Forward *entry = &forwards->slots[slot];
        if (entry->kind != FWD_C || !entry->started) {
            continue;
        }
        if (entry->acked == (1u << entry->holder_count) - 1) {
            failed |= forward_done(self, forwards, slot) < 0;   /* (see recheck) */
            continue;
        }
        if (now >= entry->deadline_ns) {
            failed |= forward_fail(self, forwards, slot, "no answer in time") < 0;
            continue;
        }
        if (now >= entry->retry_ns) {
            self->forward_resends++;
            forward_send(self, forwards, entry);
            entry->backoff_ns = entry->backoff_ns * 2 > FWD_MAX_RETRY_NS
                ? FWD_MAX_RETRY_NS : entry->backoff_ns * 2;
            entry->retry_ns = now + entry->backoff_ns;
            if (entry->retry_ns > entry->deadline_ns) {
                entry->retry_ns = entry->deadline_ns;
            }
        }
    }
    /* (the next one due, counting those started meanwhile) */
    for (uint32_t slot = 0; slot < FWD_SLOTS && forwards->started_c > 0; slot++) {
        Forward *entry = &forwards->slots[slot];
        if (entry->kind == FWD_C && entry->started
                && (next == 0 || entry->retry_ns < next)) {
            next = entry->retry_ns;
        }
    }
    atomic_store(&forwards->next_ns, forwards->started_c > 0 ? next : 0);
    return failed ? -1 : 0;
}

/* If a resend or a timeout is due: forwards_tick. */
static int
forwards_due(FastPath *self)
{
    Forwards *forwards = self->forwards;
    if (forwards == NULL) {
        return 0;
    }
    long long next = atomic_load(&forwards->next_ns);
    if (next == 0 || monotonic_ns() < next) {
        return 0;
    }
    return forwards_tick(self, forwards);
}

/* Whether an answer (`length` bytes before its trailer, if keyed) is
 * sealed as a backup seals its answer to a REPLICATE sent at `sent_time`
 * with client id `client` (always, on an insecure deployment). */
static int
answer_authentic(const FastPath *self, const unsigned char *data, Py_ssize_t length,
                 const unsigned char *client, uint32_t sent_time)
{
    if (!self->keyed) {
        return 1;
    }
    DomusSip sip;
    unsigned char time_bytes[4];
    write_u32(time_bytes, sent_time);
    domus_sip_init(&sip, self->key);
    domus_sip_update(&sip, data, (size_t)length);
    domus_sip_update(&sip, client, 8);
    domus_sip_update(&sip, time_bytes, 4);
    return domus_sip_final(&sip) == read_u64(data + length);
}

/* Which of `holders` sent the datagram (-1: none). */
static int
answer_holder(const struct sockaddr_in *holders, int count,
              const struct sockaddr_storage *peer)
{
    const struct sockaddr_in *from = (const struct sockaddr_in *)peer;
    for (int i = 0; i < count; i++) {
        if (holders[i].sin_addr.s_addr == from->sin_addr.s_addr
                && holders[i].sin_port == from->sin_port) {
            return i;
        }
    }
    return -1;
}

/* A datagram with a reply's magic, on a service that forwards: 1 if it is
 * a backup's answer to a REPLICATE in flight (taken), or an authentic
 * answer from a holder to the last REPLICATE of its slot, no longer waited
 * for (counted late_answers, dropped); 0 if not (it goes the way of any
 * datagram: dropped as unauthenticated on a secure deployment, counted
 * malformed by the Python handler on an insecure one), or -1 with an
 * exception set.  `size` is the whole datagram's. */
static int
forward_answered(FastPath *self, const unsigned char *data, Py_ssize_t size,
                 const struct sockaddr_storage *peer)
{
    Forwards *forwards = self->forwards;
    Py_ssize_t length = size - (self->keyed ? REPLY_TRAILER : 0);
    if (length < REPLY_HEADER_SIZE || peer->ss_family != AF_INET) {
        return 0;
    }
    uint32_t id = read_u32(data + 4);
    uint32_t slot = id & (FWD_SLOTS - 1);
    Forward *entry = &forwards->slots[slot];
    if (entry->kind != FWD_C || entry->id != id || !entry->started) {
        const FwdLast *last = &forwards->last[slot];
        if (id != 0 && last->id == id
                && answer_authentic(self, data, length, last->client, last->sent_time)
                && answer_holder(last->holders, last->holder_count, peer) >= 0) {
            self->late_answers++;
            return 1;
        }
        return 0;
    }
    if (!answer_authentic(self, data, length, entry->request + 8, entry->sent_time)) {
        return 0;                       /* (dropped as unauthenticated, below) */
    }
    int holder = answer_holder(entry->holders, entry->holder_count, peer);
    if (holder < 0) {
        return 0;
    }
    int status = data[2];
    int inner = length >= 2 * REPLY_HEADER_SIZE && data[REPLY_HEADER_SIZE] == REPLY_MAGIC
        ? data[REPLY_HEADER_SIZE + 2] : -1;
    if (status == ST_BUSY || inner == ST_BUSY) {
        return 1;                       /* (sent again when its time comes) */
    }
    if (status != ST_OK || (inner != ST_OK && inner != ST_NOT_FOUND)) {
        return forward_fail(self, forwards, slot, "the backup refused the change") < 0 ? -1 : 1;
    }
    entry->acked |= 1u << holder;
    if (entry->acked != (1u << entry->holder_count) - 1) {
        return 1;
    }
    return forward_done(self, forwards, slot) < 0 ? -1 : 1;
}

/* A change to a replicated bucket, from the datagram being handled
 * (self->current_peer), which apply_change declined: QUEUED in its
 * bucket's line (sent to the backups now if it is first); HANDLED with
 * *reply filled (BUSY);
 * APPLY_HERE (not replicated, or no backup left); DECLINED (Python's to
 * answer: it will forward it itself); or -1. */
static int
forward_change(FastPath *self, int op, const unsigned char *data,
               Py_ssize_t size, Reply *reply)
{
    Forwards *forwards = self->forwards;
    if (size < KEYED_END) {
        return DECLINED;
    }
    uint32_t dht_id = read_u32(data + 16);
    uint32_t bucket = read_u32(data + 20);
    uint16_t key_length = read_u16(data + 24);
    if (key_length == 0 || key_length > MAX_KEY_BYTES
            || (Py_ssize_t)KEYED_END + key_length > size) {
        return DECLINED;
    }
    PyObject *buckets;
    int found = find_buckets(self, dht_id, data[3], 0, &buckets);
    if (found != HANDLED) {
        return found;
    }
    if (!(self->found_layout & LAYOUT_REPLICATED)) {
        return APPLY_HERE;
    }
    PyObject *holders = self->holders;
    if ((self->found_layout & LAYOUT_GUARDED) || holders == NULL
            || self->current_peer == NULL || self->cache == NULL) {
        return DECLINED;
    }
    Repo repo;
    found = find_repo(self, buckets, bucket, &repo);
    if (found != HANDLED) {
        return found;
    }
    Py_DECREF(repo.object);
    /* (checked as the change itself is: one that every copy would refuse
     * is not sent, and Python says why) */
    Py_ssize_t key_end = KEYED_END + key_length;
    if (op == OP_PUT || op == OP_PUT_IF_ABSENT) {
        Py_ssize_t rest = size - key_end;
        if (rest < 4 || (uint64_t)read_u32(data + key_end) != (uint64_t)(rest - 4)
                || rest - 4 > MAX_VALUE_BYTES) {
            return DECLINED;
        }
    }
    else if (op == OP_DELETE_IF) {
        if (size - key_end != 4 + DIGEST_BYTES
                || read_u32(data + key_end) != DIGEST_BYTES) {
            return DECLINED;
        }
    }
    else if (key_end != size) {
        return DECLINED;
    }
    if (size + REQUEST_HEADER_SIZE + REQUEST_TRAILER > MAX_UDP_PAYLOAD) {
        return DECLINED;
    }
    PyObject *number = PyLong_FromUnsignedLong(bucket);
    if (number == NULL) {
        return -1;
    }
    PyObject *backups = PyDict_GetItemWithError(holders, number);
    Py_DECREF(number);
    if (backups == NULL) {
        return PyErr_Occurred() ? -1 : DECLINED;
    }
    if (!PyBytes_Check(backups) || PyBytes_GET_SIZE(backups) % HOLDER_SIZE != 0
            || PyBytes_GET_SIZE(backups) > FWD_MAX_HOLDERS * HOLDER_SIZE) {
        return DECLINED;
    }
    int holder_count = (int)(PyBytes_GET_SIZE(backups) / HOLDER_SIZE);
    if (holder_count == 0) {
        return APPLY_HERE;
    }
    /* (handle_change tried the change as any change first: its reply was
     * not in the cache, and the cache had room) */
    ReplyCache *cache = (ReplyCache *)self->cache;
    unsigned char token[CACHE_KEY_SIZE];
    rc_key(cache->seed, data, size, token);
    /* A retry of a change in its line waits with it (its reply goes
     * where the first try came from). */
    FwdLine *line = line_of(forwards, (uint64_t)dht_id << 32 | bucket, 0);
    for (FwdNode *node = line ? line->head : NULL; node != NULL; node = node->next) {
        Forward *entry = &forwards->slots[node->slot];
        if (entry->kind == FWD_C && memcmp(entry->token, token, CACHE_KEY_SIZE) == 0) {
            self->replayed++;
            return QUEUED;
        }
    }
    int slot = forward_take_slot(forwards, FWD_C, dht_id);
    if (slot < 0) {
        /* (too many changes waiting for backups: the client backs off,
         * nothing was applied) */
        write_reply_header(reply->head, ST_BUSY, data, 0);
        self->busy++;
        return HANDLED;
    }
    Forward *entry = &forwards->slots[slot];
    entry->buckets = PyMem_RawMalloc(sizeof(uint32_t));
    entry->request = PyMem_RawMalloc((size_t)size);
    if (entry->buckets == NULL || entry->request == NULL) {
        forward_give_slot(forwards, (uint32_t)slot);
        PyErr_NoMemory();
        return -1;
    }
    entry->buckets[0] = bucket;
    entry->bucket_count = 1;
    entry->op = op;
    memcpy(entry->request, data, (size_t)size);
    entry->size = size;
    memcpy(entry->token, token, CACHE_KEY_SIZE);
    memcpy(&entry->peer, self->current_peer, self->current_peer_length);
    entry->peer_length = self->current_peer_length;
    if (self->current_stamp != NULL) {
        memcpy(entry->stamp, self->current_stamp, 4);
        entry->stamped = 1;
    }
    const unsigned char *packed = (const unsigned char *)PyBytes_AS_STRING(backups);
    for (int i = 0; i < holder_count; i++) {
        struct sockaddr_in *holder = &entry->holders[i];
        holder->sin_family = AF_INET;
        memcpy(&holder->sin_addr.s_addr, packed + i * HOLDER_SIZE, 4);
        memcpy(&holder->sin_port, packed + i * HOLDER_SIZE + 4, 2);
    }
    entry->holder_count = holder_count;
    if (forward_enqueue(forwards, (uint32_t)slot) < 0) {
        forward_give_slot(forwards, (uint32_t)slot);
        return -1;
    }
    if (entry->waiting == 0 && forward_start(self, forwards, (uint32_t)slot) < 0) {
        return -1;
    }
    return QUEUED;
}

/* REPLICATE, at a backup: the change it carries applied to the backups
 * held here, by their FastPath (`backup`), as Python's _replicate_in does;
 * the reply is OK with the change's own reply after the header.  Declined
 * (for Python) when that FastPath declines the change. */
static int
handle_replicate(FastPath *self, const unsigned char *data, Py_ssize_t size,
                 Py_ssize_t limit, Reply *reply)
{
    if (self->backup == NULL) {
        return DECLINED;
    }
    const unsigned char *inner = data + REQUEST_HEADER_SIZE;
    Py_ssize_t inner_size = size - REQUEST_HEADER_SIZE;
    if (inner_size < 20 || inner[0] != REQUEST_MAGIC || inner[1] != PROTOCOL_VERSION
            || (inner[2] != OP_PUT && inner[2] != OP_DELETE && inner[2] != OP_PUT_MANY
                && inner[2] != OP_PUT_IF_ABSENT && inner[2] != OP_DELETE_IF)) {
        return DECLINED;
    }
    FastPath *backup = (FastPath *)self->backup;
    Py_INCREF(backup);
    Reply answer = {NULL, {0}, 0, NULL};
    int result = handle_request(backup, inner, inner_size, limit - REPLY_HEADER_SIZE,
                                &answer);
    if (result == HANDLED) {
        PyObject *change = reply_bytes(&answer);
        if (change == NULL) {
            result = -1;
        }
        else {
            reply->whole = new_reply(ST_OK, data, PyBytes_GET_SIZE(change), 0);
            if (reply->whole == NULL) {
                result = -1;
            }
            else {
                memcpy(PyBytes_AS_STRING(reply->whole) + REPLY_HEADER_SIZE,
                       PyBytes_AS_STRING(change), (size_t)PyBytes_GET_SIZE(change));
                self->replicated++;
            }
            Py_DECREF(change);
        }
    }
    else if (result != QUEUED) {
        reply_clear(&answer);
    }
    Py_DECREF(backup);
    return result == QUEUED ? DECLINED : result;
}

/* Sends one reply at once (sealed as batch_add_reply seals), outside a
 * batch; a reply the kernel refuses is counted, the client retries.  0. */
static int
send_reply_now(FastPath *self, int fd, Reply *reply,
               const struct sockaddr_storage *peer, socklen_t peer_length,
               const unsigned char *request, const unsigned char *stamp)
{
    struct iovec parts[3];
    unsigned char mac[REPLY_TRAILER];
    struct msghdr message;
    memset(&message, 0, sizeof(message));
    message.msg_name = (void *)peer;
    message.msg_namelen = peer_length;
    message.msg_iov = parts;
    if (reply->whole != NULL) {
        parts[0].iov_base = PyBytes_AS_STRING(reply->whole);
        parts[0].iov_len = (size_t)PyBytes_GET_SIZE(reply->whole);
        message.msg_iovlen = 1;
    }
    else {
        parts[0].iov_base = reply->head;
        parts[0].iov_len = REPLY_HEADER_SIZE + (size_t)reply->body;
        message.msg_iovlen = 1;
        if (reply->value != NULL) {
            parts[1].iov_base = PyBytes_AS_STRING(reply->value);
            parts[1].iov_len = (size_t)PyBytes_GET_SIZE(reply->value);
            message.msg_iovlen = 2;
        }
    }
    if (stamp != NULL) {
        message.msg_iovlen = seal_reply(self, parts, message.msg_iovlen, request, stamp, mac);
    }
    ssize_t sent;
    do {
        sent = sendmsg(fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent < 0) {
        atomic_fetch_add_explicit(&self->send_errors, 1, memory_order_relaxed);
    }
    else {
        atomic_fetch_add_explicit(&self->bytes_sent, (unsigned long long)sent,
                                  memory_order_relaxed);
    }
    return 0;
}

/* When the serving thread stops: every C change not yet answered is
 * handed to Python as failed (nothing was applied here; the client
 * retries), every Python claim waiting its turn is let go; the lines are
 * freed.  0, or -1 with an exception set. */
static int
forwards_stop(FastPath *self)
{
    Forwards *forwards = self->forwards;
    if (forwards == NULL) {
        return 0;
    }
    int failed = 0;
    for (uint32_t slot = 0; slot < FWD_SLOTS; slot++) {
        Forward *entry = &forwards->slots[slot];
        if (entry->kind == FWD_C) {
            /* (no backup failed: none is named, none reported) */
            entry->acked = (1u << entry->holder_count) - 1;
            failed |= forward_hand_over(self, entry, 1,
                                        "the service's serving thread stopped") < 0;
        }
        else if (entry->kind == FWD_PY && !entry->started) {
            failed |= forward_queue(self, PyLong_FromUnsignedLong(entry->id)) < 0;
        }
    }
    self->forwards = NULL;
    forwards_free(forwards);
    return failed ? -1 : 0;
}

/* What becomes of a datagram C declines: `fallback` is called with it at
 * once (serve(), on the reactor thread; the batch's earlier replies are
 * sent first, so replies leave in the order of their requests), or, from
 * the serving thread, (data, peer, stamp) is appended to `queue` for the
 * reactor thread, and `queued` set. */
typedef struct {
    int fd;
    PyObject *fallback;         /* borrowed, or NULL */
    PyObject *queue;            /* borrowed list, or NULL */
    int queued;
} Declined;

/* Answers the batch's first `count` datagrams, read at `now` (needs the
 * GIL): C's replies are added to the batch, the others are declined as
 * `declined` says.  0, or -1 with an exception set (the batch's pending
 * replies are still there to send). */
static int
batch_handle(FastPath *self, Batch *batch, int count,
             const struct timespec *now, Declined *declined)
{
    /* (`now` is CLOCK_REALTIME, as Python's time.time(): time() may read a
     * coarser clock that lags by a kernel tick after each second begins, and
     * then the two paths would judge a request at the replay window's edge
     * differently) */
    long long now_ns = (long long)now->tv_sec * 1000000000LL + now->tv_nsec;
    uint32_t now_s = (uint32_t)now->tv_sec;
    for (int i = 0; i < count; i++) {
        unsigned char *data = batch->buffers + (size_t)i * RECV_BUFFER_SIZE;
        struct msghdr *header = &batch->in[i].msg_hdr;
        const struct sockaddr_storage *peer = &batch->peers[i];
        socklen_t peer_length = header->msg_namelen;
        Py_ssize_t size = (Py_ssize_t)batch->in[i].msg_len;
        self->bytes_received += (unsigned long long)size;
        if (self->forwards != NULL && size > 0 && data[0] == REPLY_MAGIC) {
            int taken = forward_answered(self, data, size, peer);
            if (taken < 0) {
                return -1;
            }
            if (taken) {
                continue;
            }
        }
        const unsigned char *stamp = NULL;
        Py_ssize_t length = size;
        int fresh = 1;
        if (self->keyed) {
            /* (a request too short for a header, but sealed, is counted
             * malformed as any other: only the MAC decides what is dropped) */
            if (size < REQUEST_TRAILER
                    || domus_siphash24(self->key, data, (size_t)size - 8)
                       != read_u64(data + size - 8)) {
                self->unauthenticated++;      /* dropped: no reply at all */
                continue;
            }
            stamp = data + size - REQUEST_TRAILER;
            length = size - REQUEST_TRAILER;
            uint32_t skew = now_s - read_u32(stamp);
            fresh = skew <= TIME_WINDOW || (uint32_t)-skew <= TIME_WINDOW;
        }
        Reply reply = {NULL, {0}, 0, NULL};
        if (fresh && self->shed_after_ns > 0 && length >= REQUEST_HEADER_SIZE
                && data[0] == REQUEST_MAGIC && should_shed(self, header, now_ns)) {
            /* Behind: this request waited too long to be worth serving
             * (its client may have sent it again already).  BUSY costs no
             * work and tells the client to back off. */
            unsigned char busy[REPLY_HEADER_SIZE + 2];
            write_reply_header(busy, ST_BUSY, data, 0);
            write_u16(busy + REPLY_HEADER_SIZE, retry_after_ms(self));
            reply.whole = PyBytes_FromStringAndSize((const char *)busy, sizeof(busy));
            if (reply.whole == NULL) {
                return -1;
            }
            self->shed++;
            batch_add_reply(self, batch, &reply, peer, peer_length, data, stamp);
            continue;
        }
        Py_ssize_t limit = MAX_UDP_PAYLOAD - (stamp ? REPLY_TRAILER : 0);
        if (stamp == NULL && self->reply_factor > 0
                && (limit + self->reply_factor - 1) / self->reply_factor > length) {
            limit = length * self->reply_factor;   /* (anyone may spoof a source) */
        }
        self->current_peer = peer;
        self->current_peer_length = peer_length;
        self->current_stamp = stamp;
        int result = fresh ? handle_request(self, data, length, limit, &reply)
                           : DECLINED;
        self->current_peer = NULL;
        self->current_stamp = NULL;
        if (result < 0) {
            return -1;
        }
        if (result == QUEUED) {
            continue;
        }
        if (result == HANDLED) {
            batch_add_reply(self, batch, &reply, peer, peer_length, data, stamp);
            continue;
        }
        PyObject *request = PyBytes_FromStringAndSize((const char *)data, length);
        if (request == NULL) {
            return -1;
        }
        PyObject *address = peer_address(peer);
        if (address == NULL) {
            Py_DECREF(request);
            return -1;
        }
        PyObject *stamped = stamp ? PyBytes_FromStringAndSize((const char *)stamp, 4)
                                  : Py_NewRef(Py_None);
        if (stamped == NULL) {
            Py_DECREF(request);
            Py_DECREF(address);
            return -1;
        }
        int failed;
        if (declined->queue != NULL) {
            PyObject *item = PyTuple_Pack(3, request, address, stamped);
            failed = item == NULL || PyList_Append(declined->queue, item) < 0;
            Py_XDECREF(item);
            declined->queued |= !failed;
        }
        else {
            batch_send(self, declined->fd, batch);     /* (in order: see Declined) */
            batch_settle(self, batch);
            PyObject *done = PyObject_CallFunctionObjArgs(declined->fallback, request,
                                                          address, stamped, NULL);
            failed = done == NULL;
            Py_XDECREF(done);
        }
        Py_DECREF(request);
        Py_DECREF(address);
        Py_DECREF(stamped);
        if (failed) {
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(FastPath_serve_doc,
"serve($self, /, fd, fallback, max_datagrams=256)\n--\n\n"
"Drain the non-blocking UDP socket `fd`: answer each datagram C can handle\n"
"and call fallback(data, peer, stamp) for the others.  Stops when the\n"
"socket is empty or after max_datagrams; returns how many datagrams were\n"
"read.  Datagrams are read BATCH_SIZE at a time (recvmmsg) and C's replies\n"
"sent together (sendmmsg), those before a fallback's before it is called.\n"
"Errors caused by earlier datagrams (ECONNREFUSED, ...) are counted\n"
"in recv_errors / send_errors and do not stop it.\n"
"With a key (a secure deployment), a datagram whose MAC does not check is\n"
"dropped and counted (unauthenticated); the others are handled without\n"
"their trailer, their replies sent with theirs, and a request whose time\n"
"is not within TIME_WINDOW seconds of this clock goes to the fallback;\n"
"stamp is the request's time (4 bytes), or None without a key.\n"
"Overload: with shed_after_ns > 0 and the socket's SO_TIMESTAMPNS on, a\n"
"request that waited longer than that in the socket's queue while the\n"
"service is behind (a standing queue: see SHED_INTERVAL_NS) is answered\n"
"BUSY, unserved (counted: shed).  Without a key and with reply_factor > 0,\n"
"a reply is at most reply_factor times its request (larger ones go to the\n"
"fallback, which answers REPLY_TOO_LARGE).\n"
"Refused (RuntimeError) while the serving thread runs.");

static PyObject *
FastPath_serve(FastPath *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "fallback", "max_datagrams", NULL};
    int fd;
    PyObject *fallback;
    Py_ssize_t max_datagrams = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO|n:serve", kwlist, &fd,
                                     &fallback, &max_datagrams)) {
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return NULL;
    }
    if (self->thread_running) {
        PyErr_SetString(PyExc_RuntimeError,
                        "serve() while the serving thread reads the socket");
        return NULL;
    }
    if (self->batch == NULL && (self->batch = batch_new()) == NULL) {
        return NULL;
    }
    Batch *batch = self->batch;
    Declined declined = {fd, fallback, NULL, 0};
    Py_ssize_t received = 0;
    Py_ssize_t attempts = 0;    /* datagrams and errors read: at most max_datagrams */
    int failed = 0;
    while (attempts < max_datagrams) {
        Py_ssize_t left = max_datagrams - attempts;
        int count = recvmmsg_count(left);
        int got = batch_receive(fd, batch, count);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                break;
            }
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) {
                    return NULL;
                }
                continue;
            }
            if (is_transient(errno)) {
                atomic_fetch_add_explicit(&self->recv_errors, 1, memory_order_relaxed);
                attempts++;
                continue;
            }
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        received += got;
        attempts += got;
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        failed = batch_handle(self, batch, got, &now, &declined) < 0;
        batch_send(self, fd, batch);
        batch_settle(self, batch);
        if (failed) {
            return NULL;
        }
        if (got < count) {
            break;          /* the socket had no more */
        }
    }
    return PyLong_FromSsize_t(received);
}

/* ------------------------------------------------------------ the serving thread
 *
 * With the serving thread, the UDP socket is not read by the reactor: a C
 * thread waits for datagrams (poll, then recvmmsg) without the GIL, handles
 * a batch holding the GIL, and sends its replies without it again.  What
 * must not change is atomicity: a request served on the reactor thread
 * never saw Python's state half-updated (a bucket frozen for a move but the
 * fast table not yet updated, a reply cache mid-rotation), because nothing
 * else ran while Python code did.  The *baton* keeps that so: the reactor
 * thread holds it whenever it runs Python code and lets go of it only while
 * it is blocked in epoll (domus.service.udp wraps the reactor's poller), and
 * the serving thread handles a batch only while it holds it.  So a batch is
 * handled either between two of the reactor's turns or not at all, just as
 * doRead was.  The reactor thread has the right of way: while it waits for
 * the baton the serving thread does not take it again.  Requests C declines
 * are appended to a list for the reactor thread (woken through an eventfd),
 * whose Python handler answers them as before.
 *
 * The lock order is baton, then GIL, on both threads (Baton.acquire lets
 * the GIL go while it waits), so neither waits for what the other holds.
 * After a fork (services do not fork once serving, but a child must not
 * inherit a locked baton or a thread that is not there) a baton starts
 * afresh, and the child's FastPath has no serving thread. */

static unsigned long fork_generation;   /* bumped in every forked child */

static void
note_fork_in_child(void)
{
    fork_generation++;
}

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int held;
    pthread_t holder;           /* (while held) */
    int waiting;                /* reactor threads waiting for it */
    unsigned long generation;   /* fork_generation when lock was made */
} Baton;

static PyTypeObject BatonType;

/* Makes the baton's lock afresh if this process is a fork's child. */
static void
baton_check_fork(Baton *baton)
{
    if (baton->generation != fork_generation) {
        pthread_mutex_init(&baton->lock, NULL);
        pthread_cond_init(&baton->changed, NULL);
        baton->held = 0;
        baton->waiting = 0;
        baton->generation = fork_generation;
    }
}

/* Takes the baton, waiting for it; `first` gives the caller the right of
 * way over callers that are not first (the reactor thread is first, the
 * serving thread is not).  Needs no GIL; must not be called with it. */
static void
baton_take(Baton *baton, int first)
{
    pthread_mutex_lock(&baton->lock);
    if (first) {
        baton->waiting++;
        while (baton->held) {
            pthread_cond_wait(&baton->changed, &baton->lock);
        }
        baton->waiting--;
    }
    else {
        while (baton->held || baton->waiting) {
            pthread_cond_wait(&baton->changed, &baton->lock);
        }
    }
    baton->held = 1;
    baton->holder = pthread_self();
    pthread_mutex_unlock(&baton->lock);
}

/* Whether the calling thread holds the baton. */
static int
baton_mine(Baton *baton)
{
    pthread_mutex_lock(&baton->lock);
    int mine = baton->held && pthread_equal(baton->holder, pthread_self());
    pthread_mutex_unlock(&baton->lock);
    return mine;
}

/* Whether a reactor thread waits for the baton (its holder asks, to let
 * it go soon). */
static int
baton_wanted(Baton *baton)
{
    pthread_mutex_lock(&baton->lock);
    int wanted = baton->waiting > 0;
    pthread_mutex_unlock(&baton->lock);
    return wanted;
}

/* Lets go of the baton (its holder calls this). */
static void
baton_give(Baton *baton)
{
    pthread_mutex_lock(&baton->lock);
    baton->held = 0;
    pthread_cond_broadcast(&baton->changed);
    pthread_mutex_unlock(&baton->lock);
}

static PyObject *
Baton_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Baton() takes no arguments");
        return NULL;
    }
    Baton *self = (Baton *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (pthread_mutex_init(&self->lock, NULL) != 0
            || pthread_cond_init(&self->changed, NULL) != 0) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_OSError, "cannot make the baton's lock");
        return NULL;
    }
    self->generation = fork_generation;
    return (PyObject *)self;
}

static void
Baton_dealloc(Baton *self)
{
    pthread_cond_destroy(&self->changed);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(Baton_acquire_doc,
"acquire($self, /)\n--\n\n"
"Take the baton, waiting (without the GIL) while the serving thread holds\n"
"it; the caller has the right of way over serving threads.");

static PyObject *
Baton_acquire(Baton *self, PyObject *unused)
{
    baton_check_fork(self);
    Py_BEGIN_ALLOW_THREADS
    baton_take(self, 1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Baton_release_doc,
"release($self, /)\n--\n\n"
"Let go of the baton (RuntimeError if it is not held).");

static PyObject *
Baton_release(Baton *self, PyObject *unused)
{
    baton_check_fork(self);
    if (!baton_mine(self)) {
        PyErr_SetString(PyExc_RuntimeError, "release of a baton this thread does not hold");
        return NULL;
    }
    baton_give(self);
    Py_RETURN_NONE;
}

static PyObject *
Baton_get_held(Baton *self, void *closure)
{
    baton_check_fork(self);
    return PyBool_FromLong(baton_mine(self));
}

static PyMethodDef Baton_methods[] = {
    {"acquire", (PyCFunction)Baton_acquire, METH_NOARGS, Baton_acquire_doc},
    {"release", (PyCFunction)Baton_release, METH_NOARGS, Baton_release_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Baton_getset[] = {
    {"held", (getter)Baton_get_held, NULL, "whether the calling thread holds it", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Baton_doc,
"Baton()\n\n"
"The right to run the service's Python state: the reactor thread holds it\n"
"except while blocked in epoll, a FastPath's serving thread takes it to\n"
"handle a batch.  Not reentrant.");

static PyTypeObject BatonType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._hotpath.Baton",
    .tp_basicsize = sizeof(Baton),
    .tp_dealloc = (destructor)Baton_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Baton_doc,
    .tp_methods = Baton_methods,
    .tp_getset = Baton_getset,
    .tp_new = Baton_new,
};

/* Hands an error that stops the serving thread to the reactor thread: the
 * OSError is queued in place of a datagram (needs the GIL). */
static void
thread_report(FastPath *self, int error)
{
    errno = error;
    PyErr_SetFromErrno(PyExc_OSError);
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (value == NULL || PyList_Append(self->thread_queue, value) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

/* Wakes the reactor thread to read the queue (needs no GIL). */
static void
thread_wake(FastPath *self)
{
    uint64_t one = 1;
    ssize_t written;
    do {
        written = write(self->thread_wake_fd, &one, sizeof(one));
    } while (written < 0 && errno == EINTR);
    /* (EAGAIN: the counter is full, so the reactor is woken already) */
}

/* The serving thread (see above).  Runs until `thread_stopping` is set, or
 * until the socket fails in a way it cannot go past, which it queues as an
 * OSError for the reactor thread. */
static void *
serve_in_thread(void *argument)
{
    FastPath *self = argument;
    Batch *batch = self->batch;
    Baton *baton = (Baton *)self->thread_baton;
    int fd = self->thread_fd;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyThreadState *state = PyEval_SaveThread();
    int empty = 1;          /* the last read found the socket drained */
    int error = 0;
    while (!atomic_load(&self->thread_stopping)) {
        int got = -1;
        if (empty && self->spin_ns > 0) {
            /* (a moment of reading without sleeping, yielding the CPU to
             * whatever else may run, before poll: see spin_ns) */
            long long until = monotonic_ns() + self->spin_ns;
            do {
                got = batch_receive(fd, batch, BATCH_SIZE);
                if (got >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
                    break;
                }
                sched_yield();
            } while (monotonic_ns() < until && !atomic_load(&self->thread_stopping));
            if (got >= 0) {
                self->spun++;
            }
        }
        if (empty && got < 0) {
            struct pollfd ready[2] = {{fd, POLLIN, 0},
                                      {self->thread_stop_fd, POLLIN, 0}};
            /* (until the next resend of a replicated change, if any) */
            Forwards *forwards = self->forwards;
            long long due = forwards != NULL ? atomic_load(&forwards->next_ns) : 0;
            int timeout = -1;
            if (due != 0) {
                long long left = due - monotonic_ns();
                timeout = left <= 0 ? 0 : (int)((left + 999999) / 1000000);
            }
            int events = poll(ready, 2, timeout);
            if (events < 0 && errno != EINTR) {
                error = errno;
                break;
            }
            if (events == 0) {
                baton_take(baton, 0);
                PyEval_RestoreThread(state);
                if (forwards_due(self) < 0) {
                    self->thread_errors++;
                    PyErr_WriteUnraisable((PyObject *)self);
                }
                state = PyEval_SaveThread();
                baton_give(baton);
                continue;
            }
            if (ready[1].revents != 0) {
                /* (stopping, or woken to wait for a resend: see kick) */
                uint64_t count;
                while (read(self->thread_stop_fd, &count, sizeof(count)) < 0
                       && errno == EINTR) {
                }
                continue;
            }
            if (ready[0].revents & (POLLERR | POLLNVAL)) {
                if (ready[0].revents & POLLNVAL) {
                    error = EBADF;
                    break;
                }
                /* (POLLERR: an ICMP error; recvmmsg reports and clears it) */
            }
        }
        if (got < 0) {
            got = batch_receive(fd, batch, BATCH_SIZE);
        }
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                empty = errno != EINTR;
                continue;
            }
            if (is_transient(errno)) {
                atomic_fetch_add_explicit(&self->recv_errors, 1, memory_order_relaxed);
                empty = 0;
                continue;
            }
            error = errno;
            break;
        }
        empty = got < BATCH_SIZE;
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        baton_take(baton, 0);
        PyEval_RestoreThread(state);
        batch_settle(self, batch);
        Declined declined = {fd, NULL, self->thread_queue, 0};
        /* While the socket has more and the reactor thread does not wait
         * for the baton, the next batches are handled before the GIL goes
         * (up to THREAD_ROUNDS in all): when the reactor thread runs
         * Python without the baton (domus.service.udp, released), each
         * time the GIL changes hands costs a switch interval. */
        for (int round = 1; !atomic_load(&self->thread_stopping); round++) {
            if (batch_handle(self, batch, got, &now, &declined) < 0) {
                /* (a MemoryError, say: the datagram is lost, the client
                 * retries) */
                self->thread_errors++;
                PyErr_WriteUnraisable((PyObject *)self);
                break;
            }
            if (forwards_due(self) < 0) {
                self->thread_errors++;
                PyErr_WriteUnraisable((PyObject *)self);
            }
            if (empty || round >= THREAD_ROUNDS || baton_wanted(baton)) {
                break;
            }
            batch_send(self, fd, batch);
            batch_settle(self, batch);
            got = batch_receive(fd, batch, BATCH_SIZE);
            if (got <= 0) {
                /* (none, or an error: the loop above reads again, and
                 * waits or reports as it does for any read) */
                got = 0;
                empty = 0;
                break;
            }
            empty = got < BATCH_SIZE;
            clock_gettime(CLOCK_REALTIME, &now);
        }
        state = PyEval_SaveThread();
        baton_give(baton);
        if (declined.queued) {
            thread_wake(self);
        }
        batch_send(self, fd, batch);
    }
    baton_take(baton, 0);
    PyEval_RestoreThread(state);
    batch_settle(self, batch);
    if (error != 0) {
        thread_report(self, error);
    }
    state = PyEval_SaveThread();
    baton_give(baton);
    if (error != 0) {
        thread_wake(self);
    }
    PyEval_RestoreThread(state);
    PyGILState_Release(gil);
    return NULL;
}

PyDoc_STRVAR(FastPath_start_thread_doc,
"start_thread($self, /, fd, queue, wake_fd, baton)\n--\n\n"
"Serve the non-blocking UDP socket `fd` from a C thread of its own, in\n"
"batches, as serve() would, while holding `baton` (a Baton that the\n"
"reactor thread holds except while it waits in epoll).  What C declines\n"
"is appended to the list `queue` as (data, peer, stamp), and the eventfd\n"
"`wake_fd` written, for the reactor thread to answer in Python (holding\n"
"the baton); an error that stops the thread is appended as an OSError.\n"
"The caller keeps fd, queue and wake_fd open until stop_thread().");

static PyObject *
FastPath_start_thread(FastPath *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "queue", "wake_fd", "baton", NULL};
    int fd, wake_fd;
    PyObject *queue, *baton;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO!iO!:start_thread", kwlist,
                                     &fd, &PyList_Type, &queue, &wake_fd,
                                     &BatonType, &baton)) {
        return NULL;
    }
    if (self->thread_running && self->thread_generation == fork_generation) {
        PyErr_SetString(PyExc_RuntimeError, "the serving thread is running already");
        return NULL;
    }
    if (fd < 0 || wake_fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd and wake_fd must be open descriptors");
        return NULL;
    }
    if (self->batch == NULL && (self->batch = batch_new()) == NULL) {
        return NULL;
    }
    if (self->forwards == NULL && (self->forwards = forwards_new(fd)) == NULL) {
        return NULL;
    }
    int stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stop_fd < 0) {
        forwards_free(self->forwards);
        self->forwards = NULL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_INCREF(queue);
    Py_XSETREF(self->thread_queue, queue);
    Py_INCREF(baton);
    Py_XSETREF(self->thread_baton, baton);
    self->thread_fd = fd;
    self->thread_wake_fd = wake_fd;
    self->thread_stop_fd = stop_fd;
    atomic_store(&self->thread_stopping, 0);
    Py_INCREF(self);                /* the thread's own, dropped by stop_thread */
    int failed = pthread_create(&self->thread, NULL, serve_in_thread, self);
    if (failed != 0) {
        Py_DECREF(self);
        forwards_free(self->forwards);
        self->forwards = NULL;
        close(stop_fd);
        self->thread_stop_fd = -1;
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->thread_running = 1;
    self->thread_generation = fork_generation;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(FastPath_stop_thread_doc,
"stop_thread($self, /)\n--\n\n"
"Stop the serving thread and wait for it to end (a batch it had read but\n"
"not handled is dropped: its clients retry).  The caller, on the reactor\n"
"thread, holds the baton; it is let go of while the thread ends and taken\n"
"again.  Does nothing if no thread runs; in a forked child, forgets the\n"
"parent's thread.");

static PyObject *
FastPath_stop_thread(FastPath *self, PyObject *unused)
{
    if (!self->thread_running) {
        Py_RETURN_NONE;
    }
    self->thread_running = 0;
    if (self->thread_generation != fork_generation) {
        /* (a fork's child: the thread is the parent's; its reference to self
         * was copied with the rest and is dropped here) */
        close(self->thread_stop_fd);
        self->thread_stop_fd = -1;
        forwards_free(self->forwards);
        self->forwards = NULL;
        Py_DECREF(self);
        Py_RETURN_NONE;
    }
    Baton *baton = (Baton *)self->thread_baton;
    atomic_store(&self->thread_stopping, 1);
    uint64_t one = 1;
    ssize_t written;
    do {
        written = write(self->thread_stop_fd, &one, sizeof(one));
    } while (written < 0 && errno == EINTR);
    baton_check_fork(baton);
    int held = baton_mine(baton);
    Py_BEGIN_ALLOW_THREADS
    if (held) {
        baton_give(baton);
    }
    pthread_join(self->thread, NULL);
    if (held) {
        baton_take(baton, 1);
    }
    Py_END_ALLOW_THREADS
    /* (what waited for backups is Python's now: see forwards_stop) */
    if (forwards_stop(self) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
    close(self->thread_stop_fd);
    self->thread_stop_fd = -1;
    Py_DECREF(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(FastPath_claim_doc,
"claim($self, dht_id, buckets, /)\n--\n\n"
"A replicated change the Python handler sends to the backups of\n"
"`buckets` (of DHT `dht_id`) takes its turn in their lines (see\n"
"\"replication\" in cext/hotpath.c): (claim, ready).  When ready is\n"
"False, claim (an int) is appended to the serving thread's queue once it\n"
"is the change's turn.  The handler calls release(claim) once the\n"
"backups answered.  None when no serving thread forwards changes (the\n"
"handler goes ahead).  BufferError when too many changes wait.");

static PyObject *
FastPath_claim(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "claim(dht_id, buckets)");
        return NULL;
    }
    unsigned long dht_id = PyLong_AsUnsignedLong(args[0]);
    if (dht_id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (dht_id > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "dht_id is a u32");
        return NULL;
    }
    Forwards *forwards = self->forwards;
    if (forwards == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *buckets = PySequence_Fast(args[1], "buckets must be a sequence");
    if (buckets == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(buckets);
    if (count < 1 || count > 0xFFFF) {
        Py_DECREF(buckets);
        PyErr_SetString(PyExc_ValueError, "a claim names 1 to 65535 buckets");
        return NULL;
    }
    uint32_t *numbers = PyMem_RawMalloc((size_t)count * sizeof(uint32_t));
    if (numbers == NULL) {
        Py_DECREF(buckets);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long bucket = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(buckets, i));
        if ((bucket == (unsigned long)-1 && PyErr_Occurred()) || bucket > 0xFFFFFFFFUL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_OverflowError, "a bucket is a u32");
            }
            PyMem_RawFree(numbers);
            Py_DECREF(buckets);
            return NULL;
        }
        for (Py_ssize_t j = 0; j < i; j++) {
            if (numbers[j] == bucket) {
                PyErr_SetString(PyExc_ValueError, "a claim names each bucket once");
                PyMem_RawFree(numbers);
                Py_DECREF(buckets);
                return NULL;
            }
        }
        numbers[i] = (uint32_t)bucket;
    }
    Py_DECREF(buckets);
    int slot = forward_take_slot(forwards, FWD_PY, (uint32_t)dht_id);
    if (slot < 0) {
        PyMem_RawFree(numbers);
        PyErr_SetString(PyExc_BufferError, "too many replicated changes wait for backups");
        return NULL;
    }
    Forward *entry = &forwards->slots[slot];
    entry->buckets = numbers;
    entry->bucket_count = (int)count;
    if (forward_enqueue(forwards, (uint32_t)slot) < 0) {
        forward_give_slot(forwards, (uint32_t)slot);
        return NULL;
    }
    entry->started = entry->waiting == 0;
    return Py_BuildValue("(kO)", (unsigned long)entry->id,
                         entry->started ? Py_True : Py_False);
}

PyDoc_STRVAR(FastPath_release_doc,
"release($self, claim, /)\n--\n\n"
"The change of `claim` (see claim()) is done, or given up: it leaves its\n"
"lines, and the changes it held back go.  A claim not known is ignored.");

static PyObject *
FastPath_release(FastPath *self, PyObject *claim)
{
    unsigned long id = PyLong_AsUnsignedLong(claim);
    if (id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    Forwards *forwards = self->forwards;
    if (forwards == NULL || id > 0xFFFFFFFFUL) {
        Py_RETURN_NONE;
    }
    uint32_t slot = (uint32_t)id & (FWD_SLOTS - 1);
    Forward *entry = &forwards->slots[slot];
    if (entry->kind != FWD_PY || entry->id != (uint32_t)id) {
        Py_RETURN_NONE;
    }
    if (forward_finish(self, forwards, slot) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(FastPath_recheck_doc,
"recheck($self, dht_id, /)\n--\n\n"
"The backups of DHT `dht_id`'s buckets changed (its entry in `dhts`):\n"
"C changes waiting for a backup that no longer backs their bucket stop\n"
"waiting for it (applied and answered once the others have answered).");

static PyObject *
FastPath_recheck(FastPath *self, PyObject *arg)
{
    unsigned long dht_id = PyLong_AsUnsignedLong(arg);
    if (dht_id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    Forwards *forwards = self->forwards;
    if (forwards == NULL || self->dhts == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *found = PyDict_GetItemWithError(self->dhts, arg);
    if (found == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (!PyTuple_CheckExact(found) || PyTuple_GET_SIZE(found) != 3
            || !PyDict_Check(PyTuple_GET_ITEM(found, 2))) {
        Py_RETURN_NONE;
    }
    PyObject *table = PyTuple_GET_ITEM(found, 2);
    Py_INCREF(table);
    int due = 0;
    for (uint32_t slot = 0; slot < FWD_SLOTS; slot++) {
        Forward *entry = &forwards->slots[slot];
        if (entry->kind != FWD_C || entry->dht_id != (uint32_t)dht_id) {
            continue;
        }
        PyObject *number = PyLong_FromUnsignedLong(entry->buckets[0]);
        if (number == NULL) {
            Py_DECREF(table);
            return NULL;
        }
        PyObject *backups = PyDict_GetItemWithError(table, number);
        Py_DECREF(number);
        if (backups == NULL && PyErr_Occurred()) {
            Py_DECREF(table);
            return NULL;
        }
        if (backups == NULL || !PyBytes_Check(backups)) {
            continue;           /* (not a primary here now, or Python's: it fails or times out) */
        }
        const unsigned char *packed = (const unsigned char *)PyBytes_AS_STRING(backups);
        Py_ssize_t holders = PyBytes_GET_SIZE(backups) / HOLDER_SIZE;
        for (int i = 0; i < entry->holder_count; i++) {
            int still = 0;
            for (Py_ssize_t j = 0; j < holders && !still; j++) {
                still = memcmp(&entry->holders[i].sin_addr.s_addr, packed + j * HOLDER_SIZE, 4) == 0
                        && memcmp(&entry->holders[i].sin_port, packed + j * HOLDER_SIZE + 4, 2) == 0;
            }
            if (!still) {
                entry->acked |= 1u << i;
            }
        }
        if (entry->started && entry->acked == (1u << entry->holder_count) - 1) {
            due = 1;
        }
    }
    Py_DECREF(table);
    if (due) {
        /* (forwards_tick applies and answers them, and starts what they held back) */
        atomic_store(&forwards->next_ns, 1);
        if (forwards_due(self) < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
FastPath_get_forwarding(FastPath *self, void *closure)
{
    return PyBool_FromLong(self->forwards != NULL);
}

static PyObject *
FastPath_get_backup(FastPath *self, void *closure)
{
    return Py_NewRef(self->backup != NULL ? self->backup : Py_None);
}

static int
FastPath_set_backup(FastPath *self, PyObject *value, void *closure)
{
    if (value != NULL && value != Py_None && !PyObject_TypeCheck(value, Py_TYPE(self))) {
        PyErr_SetString(PyExc_TypeError, "backup must be a FastPath or None");
        return -1;
    }
    if (value == (PyObject *)self) {
        PyErr_SetString(PyExc_ValueError, "a FastPath cannot be its own backup");
        return -1;
    }
    Py_XSETREF(self->backup, value != NULL && value != Py_None ? Py_NewRef(value) : NULL);
    return 0;
}

static PyObject *
FastPath_get_threaded(FastPath *self, void *closure)
{
    return PyBool_FromLong(self->thread_running
                           && self->thread_generation == fork_generation);
}

/* A new list of the 256 counts in `table`, or NULL with an exception set. */
static PyObject *
count_list(const unsigned long long *table)
{
    PyObject *counts = PyList_New(256);
    if (counts == NULL) {
        return NULL;
    }
    for (Py_ssize_t index = 0; index < 256; index++) {
        PyObject *count = PyLong_FromUnsignedLongLong(table[index]);
        if (count == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyList_SET_ITEM(counts, index, count);
    }
    return counts;
}

static PyObject *
FastPath_get_by_op(FastPath *self, void *closure)
{
    return count_list(self->by_op);
}

static PyObject *
FastPath_get_send_errors(FastPath *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->send_errors));
}

static PyObject *
FastPath_get_recv_errors(FastPath *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->recv_errors));
}

static PyObject *
FastPath_get_bytes_sent(FastPath *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->bytes_sent));
}

static PyObject *
FastPath_get_by_status(FastPath *self, void *closure)
{
    return count_list(self->by_status);
}

PyDoc_STRVAR(FastPath_take_samples_doc,
"take_samples() -> (samples, taken)\n\n"
"The requests sampled since the last call (one in SAMPLE_EVERY answered\n"
"in C), each as dht_id << 32 | bucket, and how many were taken (more than\n"
"len(samples) if the ring of SAMPLE_RING went round); starts afresh.");

static PyObject *
FastPath_take_samples(FastPath *self, PyObject *unused)
{
    Py_ssize_t held = self->sampled < SAMPLE_RING ? (Py_ssize_t)self->sampled
                                                  : SAMPLE_RING;
    PyObject *samples = PyList_New(held);
    if (samples == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < held; i++) {
        PyObject *sample = PyLong_FromUnsignedLongLong(self->samples[i]);
        if (sample == NULL) {
            Py_DECREF(samples);
            return NULL;
        }
        PyList_SET_ITEM(samples, i, sample);
    }
    PyObject *result = Py_BuildValue("(NK)", samples, self->sampled);
    if (result != NULL) {
        self->sampled = 0;
    }
    return result;
}

PyDoc_STRVAR(FastPath_generation_doc,
"generation($self, dht_id, bucket, /)\n--\n\n"
"How many changes C has applied to that bucket (or to another bucket that\n"
"shares its counter): unchanged means the bucket has not changed here.");

static PyObject *
FastPath_generation(FastPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "generation() takes dht_id and bucket");
        return NULL;
    }
    unsigned long dht_id = PyLong_AsUnsignedLong(args[0]);
    if (dht_id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long bucket = PyLong_AsUnsignedLong(args[1]);
    if (bucket == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (dht_id > 0xFFFFFFFFUL || bucket > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "dht_id and bucket are u32");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(
        self->generations_of[generation_index((uint32_t)dht_id, (uint32_t)bucket)]);
}

static PyMethodDef FastPath_methods[] = {
    {"generation", (PyCFunction)(void (*)(void))FastPath_generation,
     METH_FASTCALL, FastPath_generation_doc},
    {"take_samples", (PyCFunction)FastPath_take_samples, METH_NOARGS,
     FastPath_take_samples_doc},
    {"handle", (PyCFunction)(void (*)(void))FastPath_handle,
     METH_VARARGS | METH_KEYWORDS, FastPath_handle_doc},
    {"serve", (PyCFunction)(void (*)(void))FastPath_serve,
     METH_VARARGS | METH_KEYWORDS, FastPath_serve_doc},
    {"start_thread", (PyCFunction)(void (*)(void))FastPath_start_thread,
     METH_VARARGS | METH_KEYWORDS, FastPath_start_thread_doc},
    {"stop_thread", (PyCFunction)FastPath_stop_thread, METH_NOARGS,
     FastPath_stop_thread_doc},
    {"claim", (PyCFunction)(void (*)(void))FastPath_claim, METH_FASTCALL,
     FastPath_claim_doc},
    {"release", (PyCFunction)FastPath_release, METH_O, FastPath_release_doc},
    {"recheck", (PyCFunction)FastPath_recheck, METH_O, FastPath_recheck_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef FastPath_members[] = {
    {"requests", T_ULONGLONG, offsetof(FastPath, requests), READONLY,
     "requests answered in C"},
    {"replayed", T_ULONGLONG, offsetof(FastPath, replayed), READONLY,
     "changes answered from the reply cache in C"},
    {"fallbacks", T_ULONGLONG, offsetof(FastPath, fallbacks), READONLY,
     "requests declined to the Python handler"},
    {"bytes_received", T_ULONGLONG, offsetof(FastPath, bytes_received),
     READONLY, "bytes of the datagrams serve() read (declined and dropped ones too)"},
    {"unauthenticated", T_ULONGLONG, offsetof(FastPath, unauthenticated), READONLY,
     "datagrams serve() dropped: too short for a MAC, or one that did not check"},
    {"cache", T_OBJECT, offsetof(FastPath, cache), READONLY,
     "the reply cache (a ReplyCache) C reads and fills"},
    {"busy", T_ULONGLONG, offsetof(FastPath, busy), READONLY,
     "changes answered BUSY in C: the reply cache's current generation was full"},
    {"shed", T_ULONGLONG, offsetof(FastPath, shed), READONLY,
     "datagrams serve() answered BUSY: they had waited over shed_after_ns"},
    {"shed_after_ns", T_LONGLONG, offsetof(FastPath, shed_after_ns), 0,
     "while behind, serve() answers BUSY to a datagram that waited longer "
     "(<= 0: never)"},
    {"behind", T_INT, offsetof(FastPath, behind), READONLY,
     "whether the last interval found a standing queue, or the kernel "
     "dropping datagrams (datagrams that waited longer than shed_limit_ns "
     "are shed)"},
    {"shed_limit_ns", T_LONGLONG, offsetof(FastPath, shed_limit_ns), READONLY,
     "while behind, what waited longer is shed: shed_after_ns, or half the "
     "longest wait of an interval in which the kernel dropped datagrams"},
    {"kernel_drops", T_UINT, offsetof(FastPath, kernel_drops), READONLY,
     "datagrams the kernel dropped, its socket buffer full (SO_RXQ_OVFL's "
     "count as last read, modulo 2**32; 0 unless the socket asks for it)"},
    {"thread_errors", T_ULONGLONG, offsetof(FastPath, thread_errors), READONLY,
     "batches the serving thread could not handle (an exception, written "
     "as unraisable; their datagrams are lost and retried)"},
    {"reply_factor", T_INT, offsetof(FastPath, reply_factor), 0,
     "without a key: a reply is at most this many times its request (0: any)"},
    {"forwarded", T_ULONGLONG, offsetof(FastPath, forwarded), READONLY,
     "replicated changes C sent to their backups"},
    {"forward_resends", T_ULONGLONG, offsetof(FastPath, forward_resends), READONLY,
     "REPLICATEs C sent again, not answered in time"},
    {"forward_failures", T_ULONGLONG, offsetof(FastPath, forward_failures), READONLY,
     "replicated changes C handed to Python as failed (a backup did not take them)"},
    {"replicated", T_ULONGLONG, offsetof(FastPath, replicated), READONLY,
     "REPLICATEs applied in C as a backup"},
    {"late_answers", T_ULONGLONG, offsetof(FastPath, late_answers), READONLY,
     "backups' answers to REPLICATEs C no longer waited for (answers to a resend, "
     "or to a change already failed), dropped"},
    {"spin_ns", T_LONGLONG, offsetof(FastPath, spin_ns), 0,
     "once the socket is empty, the serving thread reads it again, yielding "
     "the CPU in between, for this long before it sleeps in poll (0: never)"},
    {"spun", T_ULONGLONG, offsetof(FastPath, spun), READONLY,
     "batches the serving thread read while it spun, without sleeping"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef FastPath_getset[] = {
    {"by_op", (getter)FastPath_get_by_op, NULL,
     "requests answered in C, per op code (a list of 256 counts)", NULL},
    {"by_status", (getter)FastPath_get_by_status, NULL,
     "replies given in C, per status byte (a list of 256 counts)", NULL},
    {"send_errors", (getter)FastPath_get_send_errors, NULL,
     "replies C could not send (the client retries)", NULL},
    {"recv_errors", (getter)FastPath_get_recv_errors, NULL,
     "errors C read from the socket and went past", NULL},
    {"bytes_sent", (getter)FastPath_get_bytes_sent, NULL,
     "bytes of the replies C sent (not those the fallback sends)", NULL},
    {"threaded", (getter)FastPath_get_threaded, NULL,
     "whether a serving thread of this process reads the socket", NULL},
    {"forwarding", (getter)FastPath_get_forwarding, NULL,
     "whether C sends replicated changes to their backups (with the serving "
     "thread)", NULL},
    {"backup", (getter)FastPath_get_backup, (setter)FastPath_set_backup,
     "the FastPath of the backups held here, which applies the REPLICATEs "
     "this one reads (or None: they go to Python)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(FastPath_doc,
"FastPath(dhts, cache, tree_type=None, *, dict_type=None, key=None)\n\n"
"The C data path of a service.  `dhts` maps each active DHT's id to its\n"
"dict of bucket -> repository; `cache` is the reply cache (a ReplyCache),\n"
"which C reads and fills itself.  Both stay owned by Python.\n"
"Repositories that are exactly dicts or `dict_type`, instances of\n"
"`tree_type` (driven through domus._recordtree's C API) or of\n"
"DatabaseRepository (driven through their database's methods) are handled\n"
"in C; others are declined.\n"
"A change that would grow the cache's current generation past its\n"
"`current_limit` is answered BUSY (neither applied nor cached).");

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._hotpath.FastPath",
    .tp_basicsize = sizeof(FastPath),
    .tp_dealloc = (destructor)FastPath_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = FastPath_doc,
    .tp_traverse = (traverseproc)FastPath_traverse,
    .tp_clear = (inquiry)FastPath_clear,
    .tp_methods = FastPath_methods,
    .tp_members = FastPath_members,
    .tp_getset = FastPath_getset,
    .tp_init = (initproc)FastPath_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "domus._hotpath",
    .m_doc = "The service's data path in C (see domus.service.hotpath).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    if (PyType_Ready(&FastPathType) < 0
            || PyType_Ready(&DatabaseRepositoryType) < 0
            || PyType_Ready(&BatonType) < 0
            || PyType_Ready(&ReplyCacheType) < 0) {
        return NULL;
    }
    static int at_fork_noted;
    if (!at_fork_noted) {
        if (pthread_atfork(NULL, NULL, note_fork_in_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return NULL;
        }
        at_fork_noted = 1;
    }
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "MAX_KEY_BYTES", MAX_KEY_BYTES) < 0
            || PyModule_AddIntConstant(module, "MAX_VALUE_BYTES",
                                       MAX_VALUE_BYTES) < 0
            || PyModule_AddIntConstant(module, "MAX_UDP_PAYLOAD",
                                       MAX_UDP_PAYLOAD) < 0
            || PyModule_AddIntConstant(module, "RECV_BUFFER_SIZE",
                                       RECV_BUFFER_SIZE) < 0
            || PyModule_AddIntConstant(module, "SAMPLE_EVERY", SAMPLE_EVERY) < 0
            || PyModule_AddIntConstant(module, "BATCH_SIZE", BATCH_SIZE) < 0
            || PyModule_AddIntConstant(module, "SAMPLE_RING", SAMPLE_RING) < 0
            || PyModule_AddIntConstant(module, "ST_BUSY", ST_BUSY) < 0
            || PyModule_AddIntConstant(module, "CACHE_KEY_SIZE", CACHE_KEY_SIZE) < 0
            || PyModule_AddIntConstant(module, "GENERATIONS", GENERATIONS) < 0
            || PyModule_AddIntConstant(module, "SHED_INTERVAL_NS",
                                       (long)SHED_INTERVAL_NS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddType(module, &FastPathType) < 0
            || PyModule_AddType(module, &DatabaseRepositoryType) < 0
            || PyModule_AddType(module, &BatonType) < 0
            || PyModule_AddType(module, &ReplyCacheType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
