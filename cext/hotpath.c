/* domus._hotpath: the service's data path in C.
 *
 * FastPath answers the requests that make up nearly all of a service's
 * traffic -- PUT, GET, DELETE, CONTAINS, PUT_MANY, GET_MANY that succeed --
 * without running Python code, and drains a UDP socket with one recvfrom and
 * one sendmsg per datagram.  It is an accelerator for
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
 *   dhts         dict: DHT id -> dict: bucket -> repository, holding only the
 *                active DHTs (the handler keeps it up to date).
 *   generations  the reply cache's list [current, previous] of dicts
 *                token (request bytes 4..16) -> reply bytes; the Python
 *                ReplyCache rotates it in place.
 * A repository is driven directly when its type is exactly dict or the
 * `dict_type` given (DictRepository, a dict subclass whose methods mean
 * exactly the dict's), or when it is an instance of the C RBTree type (through
 * the capsule API of domus._rbtree).  Such a repository's Python-level methods
 * are not called, so an RBTree subclass must not give put/get/delete/contains
 * another meaning.  Other dict subclasses may keep state beside the dict's
 * (an index, a counter), so they are declined.
 *
 * No Python code runs while a request is handled (bytes keys hash and
 * compare in C), but every object used across a call that allocates is held
 * by a strong reference anyway.  Functions return HANDLED (1), DECLINED (0)
 * or -1 with an exception set.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "rbtree_api.h"

/* The wire format; domus/protocol.py is the reference (the tests check the
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
#define ST_OK 0x00
#define ST_NOT_FOUND 0x01
#define REQUEST_HEADER_SIZE 16
#define REPLY_HEADER_SIZE 8
#define TOKEN_OFFSET 4              /* request id and client id */
#define TOKEN_SIZE 12
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

#define HANDLED 1
#define DECLINED 0

typedef struct {
    PyObject_HEAD
    PyObject *dhts;
    PyObject *generations;
    PyObject *rbtree_type;              /* or NULL */
    PyObject *dict_type;                /* or NULL */
    const DomusRBTreeAPI *tree_api;     /* NULL: trees are declined */
    Py_ssize_t current_limit;
    unsigned char *buffer;              /* serve()'s datagram, made lazily */
    unsigned long long requests;
    unsigned long long replayed;
    unsigned long long fallbacks;
    unsigned long long send_errors;
    unsigned long long recv_errors;
    unsigned long long by_op[256];
} FastPath;

typedef enum { REPO_UNSUPPORTED, REPO_DICT, REPO_TREE } RepoKind;

/* A bucket's repository, with a strong reference. */
typedef struct {
    PyObject *object;
    RepoKind kind;
} Repo;

/* A handled request's answer: the whole reply as bytes, or a reply header
 * followed by a stored value (GET), which serve() sends without copying. */
typedef struct {
    PyObject *whole;                        /* new reference or NULL */
    unsigned char head[REPLY_HEADER_SIZE];
    PyObject *value;                        /* new reference or NULL */
} Reply;

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

/* Writes the 8-byte reply header for `request` (whose id it echoes). */
static void
write_reply_header(unsigned char *out, int status,
                   const unsigned char *request)
{
    out[0] = REPLY_MAGIC;
    out[1] = PROTOCOL_VERSION;
    out[2] = (unsigned char)status;
    out[3] = 0;
    memcpy(out + 4, request + 4, 4);
}

/* A new bytes object: the reply header and `body_size` zero bytes.  Never a
 * shared singleton (it is at least 8 bytes), so it may be filled in until
 * another reference to it is handed out. */
static PyObject *
new_reply(int status, const unsigned char *request, Py_ssize_t body_size)
{
    PyObject *reply = PyBytes_FromStringAndSize(NULL,
                                                REPLY_HEADER_SIZE + body_size);
    if (reply == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(reply);
    write_reply_header(out, status, request);
    memset(out + REPLY_HEADER_SIZE, 0, (size_t)body_size);
    return reply;
}

static void
reply_clear(Reply *reply)
{
    Py_CLEAR(reply->whole);
    Py_CLEAR(reply->value);
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
    return REPO_UNSUPPORTED;
}

/* The bucket table of an active DHT: a borrowed reference in *buckets.
 * HANDLED, DECLINED (no such DHT here, or not a dict), or -1. */
static int
find_buckets(FastPath *self, uint32_t dht_id, PyObject **buckets)
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
    if (!PyDict_Check(found)) {
        return DECLINED;
    }
    *buckets = found;
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

/* 1 with a borrowed reference in *value, 0 if absent, -1 on error. */
static int
repo_get(FastPath *self, Repo repo, PyObject *key, PyObject **value)
{
    PyObject *found;
    if (repo.kind == REPO_DICT) {
        found = PyDict_GetItemWithError(repo.object, key);
    }
    else {
        found = self->tree_api->get(repo.object, key);
    }
    if (found == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    *value = found;
    return 1;
}

/* 1 if present, 0 if absent, -1 on error. */
static int
repo_contains(FastPath *self, Repo repo, PyObject *key)
{
    if (repo.kind == REPO_DICT) {
        return PyDict_Contains(repo.object, key);
    }
    return self->tree_api->contains(repo.object, key);
}

/* 1 if the key was new, 0 if its value was replaced, -1 on error (nothing
 * changed). */
static int
repo_put(FastPath *self, Repo repo, PyObject *key, PyObject *value)
{
    if (repo.kind == REPO_DICT) {
        /* One lookup: storing a new key is what grows the dict. */
        Py_ssize_t before = PyDict_GET_SIZE(repo.object);
        if (PyDict_SetItem(repo.object, key, value) < 0) {
            return -1;
        }
        return PyDict_GET_SIZE(repo.object) > before;
    }
    return self->tree_api->put(repo.object, key, value);
}

/* 1 if removed, 0 if absent, -1 on error. */
static int
repo_remove(FastPath *self, Repo repo, PyObject *key)
{
    if (repo.kind == REPO_DICT) {
        return PyDict_DelItem(repo.object, key) < 0 ? -1 : 1;
    }
    return self->tree_api->remove(repo.object, key);
}

/* ------------------------------------------------------------ the reply cache
 *
 * The cache is two generations of dicts in a list owned by the Python
 * ReplyCache, which rotates them in place.  A token is looked up in both;
 * a new reply goes into the current one.  C never rotates: a change that
 * would grow the current generation past `current_limit` is declined, and
 * the Python handler stores it and rotates early.
 */

/* New references to the two generations.  DECLINED if the list is not the
 * [dict, dict] it should be. */
static int
cache_generations(FastPath *self, PyObject **current, PyObject **previous)
{
    PyObject *generations = self->generations;
    if (generations == NULL || !PyList_CheckExact(generations)
            || PyList_GET_SIZE(generations) != 2) {
        return DECLINED;
    }
    PyObject *first = PyList_GET_ITEM(generations, 0);
    PyObject *second = PyList_GET_ITEM(generations, 1);
    if (!PyDict_CheckExact(first) || !PyDict_CheckExact(second)) {
        return DECLINED;
    }
    Py_INCREF(first);
    Py_INCREF(second);
    *current = first;
    *previous = second;
    return HANDLED;
}

/* A borrowed reference to the cached reply for `token`, or NULL: absent
 * (no exception) or error. */
static PyObject *
cache_lookup(PyObject *current, PyObject *previous, PyObject *token)
{
    PyObject *cached = PyDict_GetItemWithError(current, token);
    if (cached == NULL && !PyErr_Occurred()) {
        cached = PyDict_GetItemWithError(previous, token);
    }
    return cached;
}

/* ------------------------------------------------------------ single keys */

/* Parses a PUT/GET/DELETE/CONTAINS body up to its key and finds the
 * repository: HANDLED with a new reference in repo->object and the key's
 * end offset in *key_end; DECLINED for anything the Python handler refuses
 * (truncated, empty or oversized key, unknown DHT or bucket); or -1. */
static int
parse_keyed(FastPath *self, const unsigned char *data, Py_ssize_t size,
            Repo *repo, Py_ssize_t *key_end)
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
    int found = find_buckets(self, dht_id, &buckets);
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

static PyObject *
key_bytes(const unsigned char *data, Py_ssize_t key_end)
{
    return PyBytes_FromStringAndSize((const char *)data + KEYED_END,
                                     key_end - KEYED_END);
}

/* GET and CONTAINS. */
static int
handle_read(FastPath *self, int op, const unsigned char *data,
            Py_ssize_t size, Py_ssize_t limit, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    int result = parse_keyed(self, data, size, &repo, &key_end);
    if (result != HANDLED) {
        return result;
    }
    PyObject *key = NULL;
    if (key_end != size) {
        result = DECLINED;          /* bytes after the key */
        goto done;
    }
    key = key_bytes(data, key_end);
    if (key == NULL) {
        result = -1;
        goto done;
    }
    int present;
    if (op == OP_CONTAINS) {
        present = repo_contains(self, repo, key);
    }
    else {
        PyObject *value = NULL;
        present = repo_get(self, repo, key, &value);
        if (present == 1) {
            if (!PyBytes_Check(value)) {
                result = DECLINED;
                goto done;
            }
            if (PyBytes_GET_SIZE(value) + REPLY_HEADER_SIZE > limit) {
                result = DECLINED;  /* REPLY_TOO_LARGE */
                goto done;
            }
            Py_INCREF(value);
            reply->value = value;
        }
    }
    if (present < 0) {
        result = -1;
        goto done;
    }
    write_reply_header(reply->head, present ? ST_OK : ST_NOT_FOUND, data);
    result = HANDLED;
done:
    Py_XDECREF(key);
    Py_DECREF(repo.object);
    return result;
}

/* PUT.  The reply enters the cache before the record changes and leaves it
 * again if the change fails, so a change and its cached reply go together;
 * the `created` byte is written once the change is made, before anything
 * else can see the reply. */
static int
change_put(FastPath *self, const unsigned char *data, Py_ssize_t size,
           PyObject *current, PyObject *token, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    int result = parse_keyed(self, data, size, &repo, &key_end);
    if (result != HANDLED) {
        return result;
    }
    PyObject *key = NULL, *value = NULL, *answer = NULL;
    Py_ssize_t rest = size - key_end;
    if (rest < 4) {
        result = DECLINED;
        goto done;
    }
    uint32_t value_length = read_u32(data + key_end);
    if ((uint64_t)value_length != (uint64_t)(rest - 4)
            || value_length > MAX_VALUE_BYTES) {
        result = DECLINED;
        goto done;
    }
    key = key_bytes(data, key_end);
    value = PyBytes_FromStringAndSize((const char *)data + key_end + 4,
                                      (Py_ssize_t)value_length);
    answer = new_reply(ST_OK, data, 1);
    if (key == NULL || value == NULL || answer == NULL
            || PyDict_SetItem(current, token, answer) < 0) {
        result = -1;
        goto done;
    }
    int created = repo_put(self, repo, key, value);
    if (created < 0) {
        PyObject *type, *exc, *traceback;
        PyErr_Fetch(&type, &exc, &traceback);
        if (PyDict_DelItem(current, token) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, exc, traceback);
        result = -1;
        goto done;
    }
    PyBytes_AS_STRING(answer)[REPLY_HEADER_SIZE] = (char)created;
    reply->whole = answer;
    answer = NULL;
    result = HANDLED;
done:
    Py_XDECREF(key);
    Py_XDECREF(value);
    Py_XDECREF(answer);
    Py_DECREF(repo.object);
    return result;
}

/* DELETE.  Cache and change go together, as for PUT. */
static int
change_delete(FastPath *self, const unsigned char *data, Py_ssize_t size,
              PyObject *current, PyObject *token, Reply *reply)
{
    Repo repo;
    Py_ssize_t key_end;
    int result = parse_keyed(self, data, size, &repo, &key_end);
    if (result != HANDLED) {
        return result;
    }
    PyObject *key = NULL, *answer = NULL;
    if (key_end != size) {
        result = DECLINED;
        goto done;
    }
    key = key_bytes(data, key_end);
    if (key == NULL) {
        result = -1;
        goto done;
    }
    PyObject *value = NULL;
    int present = repo_get(self, repo, key, &value);
    if (present < 0) {
        result = -1;
        goto done;
    }
    if (present && !PyBytes_Check(value)) {
        result = DECLINED;      /* the Python handler decides what that means */
        goto done;
    }
    answer = new_reply(present ? ST_OK : ST_NOT_FOUND, data, 0);
    if (answer == NULL || PyDict_SetItem(current, token, answer) < 0) {
        result = -1;
        goto done;
    }
    if (present && repo_remove(self, repo, key) < 0) {
        PyObject *type, *exc, *traceback;
        PyErr_Fetch(&type, &exc, &traceback);
        if (PyDict_DelItem(current, token) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, exc, traceback);
        result = -1;
        goto done;
    }
    reply->whole = answer;
    answer = NULL;
    result = HANDLED;
done:
    Py_XDECREF(key);
    Py_XDECREF(answer);
    Py_DECREF(repo.object);
    return result;
}

/* ------------------------------------------------------------ batches */

/* One entry of a PUT_MANY or GET_MANY, with strong references. */
typedef struct {
    Repo repo;
    PyObject *key;
    PyObject *value;
} Entry;

static void
entries_free(Entry *entries, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(entries[i].repo.object);
        Py_XDECREF(entries[i].key);
        Py_XDECREF(entries[i].value);
    }
    PyMem_Free(entries);
}

/* Parses every entry of a PUT_MANY (`put` true) or GET_MANY body, checking
 * it whole -- lengths, limits, buckets, trailing bytes -- and making the key
 * (and value) objects before anything is changed.  HANDLED with *out (the
 * entries, to free with entries_free) and *count; DECLINED; or -1. */
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
    int result = find_buckets(self, dht_id, &buckets);
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
        }
        Entry *entry = &entries[made];
        Py_INCREF(last.object);
        entry->repo = last;
        entry->key = PyBytes_FromStringAndSize((const char *)data + key_start,
                                               key_length);
        if (entry->key == NULL) {
            result = -1;
            goto fail;
        }
        if (put) {
            entry->value = PyBytes_FromStringAndSize(
                (const char *)data + key_end, (Py_ssize_t)value_length);
            if (entry->value == NULL) {
                result = -1;
                goto fail;
            }
        }
        offset = value_end;
    }
    if (offset != end) {
        result = DECLINED;      /* stray bytes after the entries */
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

/* PUT_MANY: every entry is checked and made before the first is applied.
 * If applying one fails (memory), the entries before it stay applied and
 * the reply leaves the cache: the Python handler then applies the whole
 * request again, which stores the same values. */
static int
change_put_many(FastPath *self, const unsigned char *data, Py_ssize_t size,
                PyObject *current, PyObject *token, Reply *reply)
{
    Entry *entries;
    Py_ssize_t count;
    int result = parse_batch(self, data, size, 1, &entries, &count);
    if (result != HANDLED) {
        return result;
    }
    PyObject *answer = new_reply(ST_OK, data, 4);
    if (answer == NULL || PyDict_SetItem(current, token, answer) < 0) {
        result = -1;
        goto done;
    }
    unsigned created = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int new_key = repo_put(self, entries[i].repo, entries[i].key,
                               entries[i].value);
        if (new_key < 0) {
            PyObject *type, *exc, *traceback;
            PyErr_Fetch(&type, &exc, &traceback);
            if (PyDict_DelItem(current, token) < 0) {
                PyErr_Clear();
            }
            PyErr_Restore(type, exc, traceback);
            result = -1;
            goto done;
        }
        created += (unsigned)new_key;
    }
    unsigned char *body = (unsigned char *)PyBytes_AS_STRING(answer)
                          + REPLY_HEADER_SIZE;
    write_u16(body, (uint16_t)count);
    write_u16(body + 2, (uint16_t)created);
    reply->whole = answer;
    answer = NULL;
    result = HANDLED;
done:
    Py_XDECREF(answer);
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
        PyObject *value = NULL;
        int present = repo_get(self, entry->repo, entry->key, &value);
        if (present < 0) {
            result = -1;
            goto done;
        }
        if (present && !PyBytes_Check(value)) {
            result = DECLINED;
            goto done;
        }
        reply_size += 4 + (present ? (long long)PyBytes_GET_SIZE(value) : 0);
        if (reply_size > (long long)limit) {
            break;      /* the client asks again for the rest */
        }
        Py_XINCREF(value);
        entry->value = value;
    }
    if (count > 0 && answered == 0) {
        result = DECLINED;      /* REPLY_TOO_LARGE */
        goto done;
    }
    Py_ssize_t total = REPLY_HEADER_SIZE + 2;
    for (Py_ssize_t i = 0; i < answered; i++) {
        total += 4 + (entries[i].value ? PyBytes_GET_SIZE(entries[i].value)
                                       : 0);
    }
    PyObject *answer = PyBytes_FromStringAndSize(NULL, total);
    if (answer == NULL) {
        result = -1;
        goto done;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(answer);
    write_reply_header(out, ST_OK, data);
    write_u16(out + REPLY_HEADER_SIZE, (uint16_t)answered);
    out += REPLY_HEADER_SIZE + 2;
    for (Py_ssize_t i = 0; i < answered; i++) {
        PyObject *value = entries[i].value;
        if (value == NULL) {
            write_u32(out, MISSING);
            out += 4;
            continue;
        }
        Py_ssize_t length = PyBytes_GET_SIZE(value);
        write_u32(out, (uint32_t)length);
        memcpy(out + 4, PyBytes_AS_STRING(value), (size_t)length);
        out += 4 + length;
    }
    reply->whole = answer;
    result = HANDLED;
done:
    entries_free(entries, count);
    return result;
}

/* ------------------------------------------------------------ dispatch */

/* PUT, DELETE, PUT_MANY: answered from the reply cache when the token is
 * there (in either generation), else applied and their reply cached. */
static int
handle_change(FastPath *self, int op, const unsigned char *data,
              Py_ssize_t size, Reply *reply)
{
    PyObject *current, *previous;
    int result = cache_generations(self, &current, &previous);
    if (result != HANDLED) {
        return result;
    }
    PyObject *token = PyBytes_FromStringAndSize(
        (const char *)data + TOKEN_OFFSET, TOKEN_SIZE);
    if (token == NULL) {
        result = -1;
        goto done;
    }
    PyObject *cached = cache_lookup(current, previous, token);
    if (cached != NULL) {
        if (!PyBytes_Check(cached)) {
            result = DECLINED;
            goto done;
        }
        Py_INCREF(cached);
        reply->whole = cached;
        self->replayed++;
        result = HANDLED;
        goto done;
    }
    if (PyErr_Occurred()) {
        result = -1;
        goto done;
    }
    if (PyDict_GET_SIZE(current) >= self->current_limit) {
        /* Storing this reply would fill the current generation: the Python
         * handler stores it and rotates early. */
        result = DECLINED;
        goto done;
    }
    switch (op) {
    case OP_PUT:
        result = change_put(self, data, size, current, token, reply);
        break;
    case OP_DELETE:
        result = change_delete(self, data, size, current, token, reply);
        break;
    default:
        result = change_put_many(self, data, size, current, token, reply);
        break;
    }
done:
    Py_XDECREF(token);
    Py_DECREF(current);
    Py_DECREF(previous);
    return result;
}

/* Answers one request: HANDLED with *reply filled (the caller clears it),
 * DECLINED with nothing changed, or -1 with an exception set.  Counts the
 * request (handled or declined) in the counters. */
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
            result = handle_change(self, op, data, size, reply);
            break;
        default:
            break;
        }
        if (result == HANDLED) {
            self->requests++;
            self->by_op[op]++;
            return HANDLED;
        }
    }
    reply_clear(reply);
    if (result == DECLINED) {
        self->fallbacks++;
    }
    return result;
}

/* ------------------------------------------------------------ the type */

static int
FastPath_init(FastPath *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"dhts", "generations", "rbtree_type",
                             "current_limit", "dict_type", NULL};
    PyObject *dhts, *generations, *rbtree_type = Py_None;
    PyObject *dict_type = Py_None;
    Py_ssize_t current_limit = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!|O$nO:FastPath", kwlist,
                                     &PyDict_Type, &dhts, &PyList_Type,
                                     &generations, &rbtree_type,
                                     &current_limit, &dict_type)) {
        return -1;
    }
    if (rbtree_type != Py_None && !PyType_Check(rbtree_type)) {
        PyErr_SetString(PyExc_TypeError,
                        "rbtree_type must be the RBTree type or None");
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
    if (current_limit < 0) {
        PyErr_SetString(PyExc_ValueError, "current_limit must be >= 0");
        return -1;
    }
    const DomusRBTreeAPI *tree_api = NULL;
    if (rbtree_type != Py_None) {
        /* Trees are driven only if domus._rbtree's C API is there and is
         * the API of this very type; otherwise they take the Python path. */
        tree_api = PyCapsule_Import(DOMUS_RBTREE_CAPSULE, 0);
        if (tree_api == NULL) {
            PyErr_Clear();
        }
        else if ((PyObject *)tree_api->type != rbtree_type) {
            tree_api = NULL;
        }
    }
    Py_INCREF(dhts);
    Py_XSETREF(self->dhts, dhts);
    Py_INCREF(generations);
    Py_XSETREF(self->generations, generations);
    if (rbtree_type == Py_None) {
        Py_CLEAR(self->rbtree_type);
    }
    else {
        Py_INCREF(rbtree_type);
        Py_XSETREF(self->rbtree_type, rbtree_type);
    }
    if (dict_type == Py_None) {
        Py_CLEAR(self->dict_type);
    }
    else {
        Py_INCREF(dict_type);
        Py_XSETREF(self->dict_type, dict_type);
    }
    self->tree_api = tree_api;
    self->current_limit = current_limit;
    return 0;
}

static int
FastPath_traverse(FastPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dhts);
    Py_VISIT(self->generations);
    Py_VISIT(self->rbtree_type);
    Py_VISIT(self->dict_type);
    return 0;
}

static int
FastPath_clear(FastPath *self)
{
    Py_CLEAR(self->dhts);
    Py_CLEAR(self->generations);
    Py_CLEAR(self->rbtree_type);
    Py_CLEAR(self->dict_type);
    self->tree_api = NULL;
    return 0;
}

static void
FastPath_dealloc(FastPath *self)
{
    PyObject_GC_UnTrack(self);
    FastPath_clear(self);
    PyMem_Free(self->buffer);
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
    PyObject *out = PyBytes_FromStringAndSize(NULL,
                                              REPLY_HEADER_SIZE + value_size);
    if (out != NULL) {
        memcpy(PyBytes_AS_STRING(out), reply->head, REPLY_HEADER_SIZE);
        if (value_size) {
            memcpy(PyBytes_AS_STRING(out) + REPLY_HEADER_SIZE,
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
    Reply reply = {NULL, {0}, NULL};
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

/* Sends a handled reply to `peer`, never blocking; a failure is counted
 * (the client retries). */
static void
send_reply(FastPath *self, int fd, Reply *reply,
           const struct sockaddr_storage *peer, socklen_t peer_length)
{
    struct iovec parts[2];
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
        parts[0].iov_len = REPLY_HEADER_SIZE;
        message.msg_iovlen = 1;
        if (reply->value != NULL) {
            parts[1].iov_base = PyBytes_AS_STRING(reply->value);
            parts[1].iov_len = (size_t)PyBytes_GET_SIZE(reply->value);
            message.msg_iovlen = 2;
        }
    }
    ssize_t sent;
    do {
        sent = sendmsg(fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent < 0) {
        self->send_errors++;
    }
}

PyDoc_STRVAR(FastPath_serve_doc,
"serve($self, /, fd, fallback, max_datagrams=256)\n--\n\n"
"Drain the non-blocking UDP socket `fd`: answer each datagram C can handle\n"
"and call fallback(data, peer) for the others.  Stops when the socket is\n"
"empty or after max_datagrams; returns how many datagrams were read.\n"
"Errors caused by earlier datagrams (ECONNREFUSED, ...) are counted in\n"
"recv_errors / send_errors and do not stop it.");

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
    if (self->buffer == NULL) {
        self->buffer = PyMem_Malloc(RECV_BUFFER_SIZE);
        if (self->buffer == NULL) {
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t received = 0;
    for (Py_ssize_t attempt = 0; attempt < max_datagrams; attempt++) {
        struct sockaddr_storage peer;
        socklen_t peer_length = sizeof(peer);
        ssize_t size = recvfrom(fd, self->buffer, RECV_BUFFER_SIZE,
                                MSG_DONTWAIT, (struct sockaddr *)&peer,
                                &peer_length);
        if (size < 0) {
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
                self->recv_errors++;
                continue;
            }
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        received++;
        Reply reply = {NULL, {0}, NULL};
        int result = handle_request(self, self->buffer, size,
                                    MAX_UDP_PAYLOAD, &reply);
        if (result < 0) {
            return NULL;
        }
        if (result == HANDLED) {
            send_reply(self, fd, &reply, &peer, peer_length);
            reply_clear(&reply);
            continue;
        }
        PyObject *data = PyBytes_FromStringAndSize((const char *)self->buffer,
                                                   size);
        if (data == NULL) {
            return NULL;
        }
        PyObject *address = peer_address(&peer);
        if (address == NULL) {
            Py_DECREF(data);
            return NULL;
        }
        PyObject *done = PyObject_CallFunctionObjArgs(fallback, data, address,
                                                      NULL);
        Py_DECREF(data);
        Py_DECREF(address);
        if (done == NULL) {
            return NULL;
        }
        Py_DECREF(done);
    }
    return PyLong_FromSsize_t(received);
}

static PyObject *
FastPath_get_by_op(FastPath *self, void *closure)
{
    PyObject *counts = PyList_New(256);
    if (counts == NULL) {
        return NULL;
    }
    for (Py_ssize_t op = 0; op < 256; op++) {
        PyObject *count = PyLong_FromUnsignedLongLong(self->by_op[op]);
        if (count == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyList_SET_ITEM(counts, op, count);
    }
    return counts;
}

static PyMethodDef FastPath_methods[] = {
    {"handle", (PyCFunction)(void (*)(void))FastPath_handle,
     METH_VARARGS | METH_KEYWORDS, FastPath_handle_doc},
    {"serve", (PyCFunction)(void (*)(void))FastPath_serve,
     METH_VARARGS | METH_KEYWORDS, FastPath_serve_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef FastPath_members[] = {
    {"requests", T_ULONGLONG, offsetof(FastPath, requests), READONLY,
     "requests answered in C"},
    {"replayed", T_ULONGLONG, offsetof(FastPath, replayed), READONLY,
     "changes answered from the reply cache in C"},
    {"fallbacks", T_ULONGLONG, offsetof(FastPath, fallbacks), READONLY,
     "requests declined to the Python handler"},
    {"send_errors", T_ULONGLONG, offsetof(FastPath, send_errors), READONLY,
     "replies serve() could not send (the client retries)"},
    {"recv_errors", T_ULONGLONG, offsetof(FastPath, recv_errors), READONLY,
     "errors serve() read from the socket and went past"},
    {"current_limit", T_PYSSIZET, offsetof(FastPath, current_limit),
     READONLY, "most entries C lets the current cache generation hold"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef FastPath_getset[] = {
    {"by_op", (getter)FastPath_get_by_op, NULL,
     "requests answered in C, per op code (a list of 256 counts)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(FastPath_doc,
"FastPath(dhts, generations, rbtree_type=None, *,\n"
"         current_limit=sys.maxsize, dict_type=None)\n\n"
"The C data path of a service.  `dhts` maps each active DHT's id to its\n"
"dict of bucket -> repository; `generations` is the reply cache's\n"
"[current, previous] list.  Both stay owned (and updated) by Python.\n"
"Repositories that are exactly dicts or `dict_type`, or instances of\n"
"`rbtree_type` (driven through domus._rbtree's C API), are handled in C;\n"
"others are declined.\n"
"A change that would grow the current generation past `current_limit`\n"
"is declined, so the Python cache can rotate early.");

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
    .m_doc = "The service's data path in C (see domus.hotpath).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    if (PyType_Ready(&FastPathType) < 0) {
        return NULL;
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
                                       RECV_BUFFER_SIZE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&FastPathType);
    if (PyModule_AddObject(module, "FastPath",
                           (PyObject *)&FastPathType) < 0) {
        Py_DECREF(&FastPathType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
