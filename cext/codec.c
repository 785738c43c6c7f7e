/* domus._codec: the client's per-request work in C.
 *
 * Every function here has a pure-Python reference of the same name in
 * domus/client/codec.py and produces byte-identical messages, identical buckets
 * and the same exceptions (domus.errors.KeyTypeError, KeyTooLarge,
 * ProtocolError) with the same messages; tests/unit/test_codec.py runs both
 * on random inputs.  docs/protocol.md is the wire format.
 *
 * Memory rules: every length read from a reply is checked against the bytes
 * that remain before anything is read; every object kept across a call into
 * Python code (a hash callable, next_id) is owned, so nothing a callback does
 * to the caller's lists can leave a dangling pointer here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

#include "hashes.h"  /* XXH3 and XXH64, from their specification */
#include "siphash.h" /* SipHash-2-4, the MAC of datagrams */

/* ------------------------------------------------------------ the protocol
 * These mirror domus/wire/protocol.py and domus/wire/keys.py. */

#define REQUEST_MAGIC 0xD0
#define VERSION 1
#define OP_PUT 0x01
#define OP_PUT_IF_ABSENT 0x0E
#define OP_DELETE_IF 0x0F
/* (the keyed ops whose key is followed by a u32 length and its bytes) */
#define VALUED_OP(op) ((op) == OP_PUT || (op) == OP_PUT_IF_ABSENT || (op) == OP_DELETE_IF)
#define OP_PUT_MANY 0x05
#define OP_GET_MANY 0x06

#define REQUEST_HEADER_SIZE 16
#define REPLY_HEADER_SIZE 8
#define REQUEST_ID_OFFSET 4
#define KEYED_SIZE 10           /* dht u32, bucket u32, key length u16 */
#define BATCH_SIZE 6            /* dht u32, count u16 */
#define BATCH_OVERHEAD (REQUEST_HEADER_SIZE + BATCH_SIZE)
#define PUT_ENTRY_SIZE 10       /* bucket u32, key length u16, value length u32 */
#define GET_ENTRY_SIZE 6        /* bucket u32, key length u16 */
#define SCAN_REPLY_SIZE 10      /* scan id u32, next offset u32, count u16 */
#define SCAN_ENTRY_SIZE 6       /* key length u16, value length u32 */
#define MAX_KEY_BYTES 8192
#define MAX_BATCH 0xFFFF
#define MISSING 0xFFFFFFFFu

/* Key tags, in the order their keys sort (domus/wire/keys.py says how). */
#define TAG_NEGBIG 0x00         /* int < -2**63: u16 0xFFFF - L, NOT of the magnitude */
#define TAG_INT64 0x01          /* int in [-2**63, 2**63): key + 2**63, u64 */
#define TAG_POSBIG 0x02         /* int >= 2**63: u16 L, the L-byte magnitude */
#define TAG_STR 0x03
#define TAG_BYTES 0x04
#define TAG_TUPLE 0x05          /* elements, 0x00 escaped as 0x00 0xFF, each ended by 0x00 */
#define MAX_TUPLE_DEPTH 32
#define BIGINT_LENGTH_SIZE 2    /* the u16 before a big int's magnitude */
#define INT64_OFFSET (UINT64_C(1) << 63)

/* Hash functions computed here; any other is a Python callable. */
#define HASH_XXH3 1
#define HASH_XXH64 2

/* Shifts that leave a bucket in a u32: 2**32 buckets at most. */
#define MIN_SHIFT 32
#define MAX_SHIFT 64

#define RECV_BUFFER_SIZE 65536

typedef struct {
    PyObject *ProtocolError;
    PyObject *KeyTypeError;
    PyObject *KeyTooLarge;
    PyObject *ValueDecodeError;
    PyObject *pack_value;     /* domus.wire.values.pack_value: msgpack, for the rest */
    PyObject *unpack_value;   /* domus.wire.values.unpack_value */
    PyTypeObject *Filling;    /* bytes_to_fill's writable buffers */
} codec_state;

static inline codec_state *
get_state(PyObject *module)
{
    return (codec_state *)PyModule_GetState(module);
}

static inline void
put_u16(unsigned char *at, uint32_t value)
{
    at[0] = (unsigned char)(value >> 8);
    at[1] = (unsigned char)value;
}

static inline void
put_u32(unsigned char *at, uint32_t value)
{
    at[0] = (unsigned char)(value >> 24);
    at[1] = (unsigned char)(value >> 16);
    at[2] = (unsigned char)(value >> 8);
    at[3] = (unsigned char)value;
}

static inline void
put_u64(unsigned char *at, uint64_t value)
{
    put_u32(at, (uint32_t)(value >> 32));
    put_u32(at + 4, (uint32_t)value);
}

static inline uint32_t
get_u16(const unsigned char *at)
{
    return ((uint32_t)at[0] << 8) | at[1];
}

static inline uint32_t
get_u32(const unsigned char *at)
{
    return ((uint32_t)at[0] << 24) | ((uint32_t)at[1] << 16)
           | ((uint32_t)at[2] << 8) | at[3];
}

static inline uint64_t
get_u64(const unsigned char *at)
{
    return ((uint64_t)get_u32(at) << 32) | get_u32(at + 4);
}

/* The 16-byte request header of a request whose buckets are hash >> shift:
 * byte 3 says so (1 + log2 of the bucket count, as the Python reference's
 * numbered()). */
static void
put_request_header(unsigned char *at, int op, uint32_t request_id,
                   uint64_t client_id, int shift)
{
    at[0] = REQUEST_MAGIC;
    at[1] = VERSION;
    at[2] = (unsigned char)op;
    at[3] = (unsigned char)(65 - shift);
    put_u32(at + 4, request_id);
    put_u64(at + 8, client_id);
}

/* ------------------------------------------------------------ arguments */

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)",
                     name, expected, nargs);
        return -1;
    }
    return 0;
}

/* An int in [0, maximum]: 0, or -1 with TypeError/OverflowError set. */
static int
unsigned_arg(PyObject *obj, uint64_t maximum, const char *what, uint64_t *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s",
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();   /* negative, or over 64 bits: reported below */
    }
    else if (value <= maximum) {
        *out = value;
        return 0;
    }
    PyErr_Format(PyExc_OverflowError, "%s must be in [0, %llu]",
                 what, (unsigned long long)maximum);
    return -1;
}

static int
shift_arg(PyObject *obj, int *shift)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "shift must be an int, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow;
    long value = PyLong_AsLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || value < MIN_SHIFT || value > MAX_SHIFT) {
        PyErr_Format(PyExc_ValueError,
                     "shift must be in [%d, %d] (a bucket is a u32)",
                     MIN_SHIFT, MAX_SHIFT);
        return -1;
    }
    *shift = (int)value;
    return 0;
}

static int
bytes_arg(PyObject *obj, const char *what)
{
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes, not %.100s",
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ keys */

/* The canonical encoding of a key, as a tag and a payload that is either
 * in `int64`, inside the key object itself (borrowed: the caller keeps the
 * key alive) or inside `holder` (owned). */
typedef struct {
    unsigned char tag;
    const char *payload;
    Py_ssize_t payload_size;
    unsigned char int64[8];
    PyObject *holder;
} KeyParts;

static void
key_parts_clear(KeyParts *parts)
{
    Py_CLEAR(parts->holder);
}

static int
key_too_large(codec_state *state, Py_ssize_t encoded_size)
{
    PyErr_Format(state->KeyTooLarge,
                 "key is %zd bytes encoded, over the limit of %d; hash long keys "
                 "down (e.g. hashlib.sha256) first", encoded_size, MAX_KEY_BYTES);
    return -1;
}

/* The bit length of a non-negative exact int, or -1 with an exception set.
 * CPython has no public C call for it: _PyLong_NumBits up to 3.12 (its
 * signature changes after), int.bit_length from 3.13 on. */
static int64_t
magnitude_bits(PyObject *magnitude)
{
#if PY_VERSION_HEX < 0x030D0000
    size_t bits = _PyLong_NumBits(magnitude);
    if (bits == (size_t)-1 && PyErr_Occurred()) {
        return -1;
    }
    return (int64_t)bits;
#else
    PyObject *bits = PyObject_CallMethod(magnitude, "bit_length", NULL);
    if (bits == NULL) {
        return -1;
    }
    long long count = PyLong_AsLongLong(bits);
    Py_DECREF(bits);
    return count;
#endif
}

/* Write the non-negative exact int `magnitude` as `length` big-endian
 * unsigned bytes at `at`, `length` being at least its byte length: 0, or
 * -1 with an exception set.  3.13 made the call public (and changed the
 * private one's signature). */
static int
magnitude_to_bytes(PyObject *magnitude, unsigned char *at, Py_ssize_t length)
{
#if PY_VERSION_HEX < 0x030D0000
    return _PyLong_AsByteArray((PyLongObject *)magnitude, at, (size_t)length, 0, 0);
#else
    Py_ssize_t needed = PyLong_AsNativeBytes(
        magnitude, at, length, Py_ASNATIVEBYTES_BIG_ENDIAN
        | Py_ASNATIVEBYTES_UNSIGNED_BUFFER | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (needed < 0) {
        return -1;
    }
    if (needed > length) {
        PyErr_SetString(PyExc_SystemError, "a big int key outgrew its computed length");
        return -1;
    }
    return 0;
#endif
}

/* An int outside [-2**63, 2**63) (`negative`: below it), as
 * domus.wire.keys._encode_bigint: tag 0x02, u16 L and the L-byte minimal
 * big-endian magnitude; or tag 0x00, u16 (0xFFFF - L) and the magnitude's
 * bytes inverted, so that byte order is numeric order.  Works on the value
 * (an int subclass's __abs__ or __int__ is never called). */
static int
bigint_parts(codec_state *state, PyObject *key, int negative, KeyParts *parts)
{
    /* int's own abs: an exact int whatever the key's type. */
    PyObject *magnitude = PyLong_Type.tp_as_number->nb_absolute(key);
    if (magnitude == NULL) {
        return -1;
    }
    int64_t bits = magnitude_bits(magnitude);
    if (bits < 0) {
        goto fail;
    }
    if (bits > (int64_t)MAX_KEY_BYTES * 8) {
        /* Over the limit: report the size without making the bytes. */
        key_too_large(state, 1 + BIGINT_LENGTH_SIZE + (Py_ssize_t)((bits + 7) / 8));
        goto fail;
    }
    Py_ssize_t length = (Py_ssize_t)((bits + 7) / 8);
    Py_ssize_t payload_size = BIGINT_LENGTH_SIZE + length;
    if (1 + payload_size > MAX_KEY_BYTES) {
        key_too_large(state, 1 + payload_size);
        goto fail;
    }
    PyObject *payload = PyBytes_FromStringAndSize(NULL, payload_size);
    if (payload == NULL) {
        goto fail;
    }
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(payload);
    if (magnitude_to_bytes(magnitude, at + BIGINT_LENGTH_SIZE, length) < 0) {
        Py_DECREF(payload);
        goto fail;
    }
    Py_DECREF(magnitude);
    if (negative) {
        parts->tag = TAG_NEGBIG;
        put_u16(at, (uint32_t)(0xFFFF - length));
        for (Py_ssize_t index = BIGINT_LENGTH_SIZE; index < payload_size; index++) {
            at[index] = (unsigned char)~at[index];
        }
    }
    else {
        parts->tag = TAG_POSBIG;
        put_u16(at, (uint32_t)length);
    }
    parts->payload = (const char *)at;
    parts->payload_size = payload_size;
    parts->holder = payload;
    return 0;
fail:
    Py_DECREF(magnitude);
    return -1;
}

static int key_parts_at(codec_state *state, PyObject *key, KeyParts *parts, int depth);

/* A tuple key ``depth`` tuples deep, as domus.wire.keys._encode_tuple: tag
 * 0x05, then each element's own encoding with every 0x00 byte followed by
 * 0xFF, and a 0x00 after each element.  The payload is a bytes object owned
 * by parts->holder.  0, or -1 with the reference's exception set: an
 * element's (KeyTypeError, KeyTooLarge), KeyTypeError past MAX_TUPLE_DEPTH,
 * KeyTooLarge (with the whole encoded size, counted but not stored past the
 * limit) for a tuple over MAX_KEY_BYTES. */
static int
tuple_parts(codec_state *state, PyObject *key, KeyParts *parts, int depth)
{
    if (depth >= MAX_TUPLE_DEPTH) {
        PyErr_Format(state->KeyTypeError, "a tuple key may hold tuples %d deep at most",
                     MAX_TUPLE_DEPTH);
        return -1;
    }
    /* The payload (after the tag) holds MAX_KEY_BYTES - 1 bytes at most. */
    unsigned char *buffer = PyMem_Malloc(MAX_KEY_BYTES);
    if (buffer == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t size = 0;   /* the payload's size so far (bytes past the limit only counted) */
    for (Py_ssize_t index = 0; index < PyTuple_GET_SIZE(key); index++) {
        /* Owned while its parts may point into it. */
        PyObject *element = Py_NewRef(PyTuple_GET_ITEM(key, index));
        KeyParts inner;
        if (key_parts_at(state, element, &inner, depth + 1) < 0) {
            Py_DECREF(element);
            PyMem_Free(buffer);
            return -1;
        }
        const unsigned char *payload = (const unsigned char *)inner.payload;
        for (Py_ssize_t at = -1; at < inner.payload_size; at++) {
            unsigned char byte = at < 0 ? inner.tag : payload[at];
            if (size < MAX_KEY_BYTES) {
                buffer[size] = byte;
            }
            size++;
            if (byte == 0x00) {
                if (size < MAX_KEY_BYTES) {
                    buffer[size] = 0xFF;
                }
                size++;
            }
        }
        if (size < MAX_KEY_BYTES) {
            buffer[size] = 0x00;
        }
        size++;
        key_parts_clear(&inner);
        Py_DECREF(element);
    }
    if (1 + size > MAX_KEY_BYTES) {
        PyMem_Free(buffer);
        return key_too_large(state, 1 + size);
    }
    PyObject *holder = PyBytes_FromStringAndSize((const char *)buffer, size);
    PyMem_Free(buffer);
    if (holder == NULL) {
        return -1;
    }
    parts->tag = TAG_TUPLE;
    parts->payload = PyBytes_AS_STRING(holder);
    parts->payload_size = size;
    parts->holder = holder;
    return 0;
}

/* Fill *parts with the canonical encoding of key, exactly as
 * domus.wire.keys.encode_key: 0, or -1 with KeyTypeError, KeyTooLarge (or what
 * bytes() of a bytearray/memoryview raised) set.  On success the caller
 * calls key_parts_clear. */
static int
key_parts(codec_state *state, PyObject *key, KeyParts *parts)
{
    return key_parts_at(state, key, parts, 0);
}

/* key_parts of a key that is an element of tuples ``depth`` deep. */
static int
key_parts_at(codec_state *state, PyObject *key, KeyParts *parts, int depth)
{
    parts->holder = NULL;
    if (PyLong_Check(key)) {   /* int, bool, IntEnum, ...: by value */
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(key, &overflow);
        if (value == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow) {
            return bigint_parts(state, key, overflow < 0, parts);
        }
        parts->tag = TAG_INT64;
        put_u64(parts->int64, (uint64_t)value ^ INT64_OFFSET);   /* + 2**63, mod 2**64 */
        parts->payload = (const char *)parts->int64;
        parts->payload_size = 8;
        return 0;
    }
    if (PyUnicode_Check(key)) {   /* str or a subclass: by value */
#if PY_VERSION_HEX < 0x030C0000
        if (PyUnicode_READY(key) < 0) {
            return -1;
        }
#endif
        parts->tag = TAG_STR;
        if (PyUnicode_IS_ASCII(key)) {
            parts->payload = (const char *)PyUnicode_DATA(key);
            parts->payload_size = PyUnicode_GET_LENGTH(key);
        }
        else {
            PyObject *encoded = PyUnicode_AsEncodedString(key, "utf-8", "surrogatepass");
            if (encoded == NULL) {
                return -1;
            }
            parts->holder = encoded;
            parts->payload = PyBytes_AS_STRING(encoded);
            parts->payload_size = PyBytes_GET_SIZE(encoded);
        }
    }
    else if (PyBytes_CheckExact(key)) {   /* not a subclass: the reference refuses those */
        parts->tag = TAG_BYTES;
        parts->payload = PyBytes_AS_STRING(key);
        parts->payload_size = PyBytes_GET_SIZE(key);
    }
    else if (PyByteArray_Check(key) || PyMemoryView_Check(key)) {
        /* bytes(key), then encoded as that. */
        PyObject *as_bytes = PyObject_Bytes(key);
        if (as_bytes == NULL) {
            return -1;
        }
        if (key_parts(state, as_bytes, parts) < 0) {
            Py_DECREF(as_bytes);
            return -1;
        }
        if (parts->holder == NULL) {
            parts->holder = as_bytes;   /* the payload is inside it */
        }
        else {
            Py_DECREF(as_bytes);
        }
        return 0;
    }
    else if (PyTuple_Check(key)) {   /* a tuple or a subclass (a namedtuple): its elements */
        return tuple_parts(state, key, parts, depth);
    }
    else {
        PyObject *name = PyType_GetName(Py_TYPE(key));
        if (name != NULL) {
            PyErr_Format(state->KeyTypeError,
                         "a Domus key must be int, str, bytes or a tuple of those, not %U; "
                         "convert it first (for example str(key))", name);
            Py_DECREF(name);
        }
        return -1;
    }
    if (1 + parts->payload_size > MAX_KEY_BYTES) {
        key_too_large(state, 1 + parts->payload_size);
        key_parts_clear(parts);
        return -1;
    }
    return 0;
}

static PyObject *
key_parts_bytes(const KeyParts *parts)
{
    PyObject *encoded = PyBytes_FromStringAndSize(NULL, 1 + parts->payload_size);
    if (encoded != NULL) {
        char *at = PyBytes_AS_STRING(encoded);
        at[0] = (char)parts->tag;
        memcpy(at + 1, parts->payload, (size_t)parts->payload_size);
    }
    return encoded;
}

PyDoc_STRVAR(encode_key_doc,
"encode_key(key, /)\n--\n\n"
"The canonical bytes of key (domus.wire.keys.encode_key); KeyTypeError or\n"
"KeyTooLarge for keys Domus cannot store.");

static PyObject *
codec_encode_key(PyObject *module, PyObject *key)
{
    KeyParts parts;
    if (key_parts(get_state(module), key, &parts) < 0) {
        return NULL;
    }
    PyObject *encoded = key_parts_bytes(&parts);
    key_parts_clear(&parts);
    return encoded;
}

PyDoc_STRVAR(encode_keys_doc,
"encode_keys(keys, /)\n--\n\n"
"[encode_key(key) for key in keys], for a list or tuple.");

static PyObject *
codec_encode_keys(PyObject *module, PyObject *keys)
{
    codec_state *state = get_state(module);
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        PyErr_Format(PyExc_TypeError, "keys must be a list or a tuple, not %.100s",
                     Py_TYPE(keys)->tp_name);
        return NULL;
    }
    PyObject *result = PyList_New(0);
    if (result == NULL) {
        return NULL;
    }
    /* The size is read again each time: bytes() of a bytearray subclass
     * may run Python code that changes the list. */
    for (Py_ssize_t index = 0; index < PySequence_Fast_GET_SIZE(keys); index++) {
        PyObject *key = Py_NewRef(PySequence_Fast_GET_ITEM(keys, index));
        KeyParts parts;
        int failed = key_parts(state, key, &parts);
        Py_DECREF(key);
        if (failed) {
            Py_DECREF(result);
            return NULL;
        }
        PyObject *encoded = key_parts_bytes(&parts);
        key_parts_clear(&parts);
        if (encoded == NULL || PyList_Append(result, encoded) < 0) {
            Py_XDECREF(encoded);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(encoded);
    }
    return result;
}

/* ------------------------------------------------------------ hashing */

/* A DHT's hash function: one computed here (code), or a Python callable
 * from encoded key to an unsigned 64-bit int. */
typedef struct {
    int code;
    PyObject *callable;   /* borrowed */
} Hasher;

static int
hasher_arg(PyObject *obj, Hasher *hasher)
{
    hasher->code = 0;
    hasher->callable = NULL;
    if (PyLong_CheckExact(obj)) {
        long code = PyLong_AsLong(obj);
        if (code == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (code != HASH_XXH3 && code != HASH_XXH64) {
            PyErr_Format(PyExc_ValueError, "unknown hash code %ld", code);
            return -1;
        }
        hasher->code = (int)code;
        return 0;
    }
    if (!PyCallable_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "hasher must be a hash code or a callable, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    hasher->callable = obj;
    return 0;
}

/* The 64-bit hash of an encoded key.  `encoded` is the key as a bytes object
 * if the caller has one (NULL: made when the callable needs it).  0 or -1. */
static int
hash_key(const Hasher *hasher, const char *data, Py_ssize_t size, PyObject *encoded,
         uint64_t *hash)
{
    if (hasher->code == HASH_XXH3) {
        *hash = domus_xxh3_64(data, (size_t)size);
        return 0;
    }
    if (hasher->code == HASH_XXH64) {
        *hash = domus_xxh64(data, (size_t)size, 0);
        return 0;
    }
    PyObject *argument = encoded != NULL ? Py_NewRef(encoded)
                                         : PyBytes_FromStringAndSize(data, size);
    if (argument == NULL) {
        return -1;
    }
    PyObject *result = PyObject_CallOneArg(hasher->callable, argument);
    Py_DECREF(argument);
    if (result == NULL) {
        return -1;
    }
    if (!PyLong_Check(result)) {
        PyErr_Format(PyExc_TypeError, "the hash function returned %.100s, not an int",
                     Py_TYPE(result)->tp_name);
        Py_DECREF(result);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(result);
    Py_DECREF(result);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *hash = value;
    return 0;
}

/* hash >> shift, where a shift of 64 (one bucket) gives 0. */
static inline uint32_t
bucket_from_hash(uint64_t hash, int shift)
{
    return shift >= 64 ? 0 : (uint32_t)(hash >> shift);
}

PyDoc_STRVAR(bucket_of_doc,
"bucket_of(hasher, shift, encoded_key, /)\n--\n\n"
"The bucket of an encoded key: its hash >> shift.");

static PyObject *
codec_bucket_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Hasher hasher;
    int shift;
    uint64_t hash;
    if (check_nargs("bucket_of", nargs, 3) < 0 || hasher_arg(args[0], &hasher) < 0
        || shift_arg(args[1], &shift) < 0 || bytes_arg(args[2], "encoded_key") < 0) {
        return NULL;
    }
    if (hash_key(&hasher, PyBytes_AS_STRING(args[2]), PyBytes_GET_SIZE(args[2]), args[2],
                 &hash) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLong(bucket_from_hash(hash, shift));
}

/* ------------------------------------------------------------ single keys */

PyDoc_STRVAR(keyed_doc,
"keyed(op, request_id, client_id, dht_id, hasher, shift, key, value, /)\n--\n\n"
"(message, bucket) of a PUT, GET, DELETE, CONTAINS, PUT_IF_ABSENT or\n"
"DELETE_IF request for key.  value is the packed value of a PUT or\n"
"PUT_IF_ABSENT, or the digest of a DELETE_IF (its u32 length is added),\n"
"None or b\"\" otherwise.");

static PyObject *
codec_keyed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    codec_state *state = get_state(module);
    uint64_t op, request_id, client_id, dht_id;
    Hasher hasher;
    int shift;
    if (check_nargs("keyed", nargs, 8) < 0
        || unsigned_arg(args[0], 0xFF, "op", &op) < 0
        || unsigned_arg(args[1], 0xFFFFFFFFu, "request_id", &request_id) < 0
        || unsigned_arg(args[2], UINT64_MAX, "client_id", &client_id) < 0
        || unsigned_arg(args[3], 0xFFFFFFFFu, "dht_id", &dht_id) < 0
        || hasher_arg(args[4], &hasher) < 0 || shift_arg(args[5], &shift) < 0) {
        return NULL;
    }
    PyObject *value = args[7];
    if (value != Py_None && bytes_arg(value, "value") < 0) {
        return NULL;
    }
    Py_ssize_t value_size = value == Py_None ? 0 : PyBytes_GET_SIZE(value);

    KeyParts parts;
    if (key_parts(state, args[6], &parts) < 0) {
        return NULL;
    }
    PyObject *message = NULL, *result = NULL;
    Py_ssize_t key_size = 1 + parts.payload_size;
    Py_ssize_t size = REQUEST_HEADER_SIZE + KEYED_SIZE + key_size;
    if (VALUED_OP(op)) {
        if ((uint64_t)value_size > 0xFFFFFFFFu) {
            PyErr_SetString(PyExc_OverflowError, "a value must be under 4 GiB");
            goto done;
        }
        size += 4 + value_size;
    }
    else if (value_size) {
        PyErr_Format(PyExc_ValueError, "only PUT, PUT_IF_ABSENT and DELETE_IF carry bytes "
                     "after the key, not op 0x%02x", (int)op);
        goto done;
    }
    message = PyBytes_FromStringAndSize(NULL, size);
    if (message == NULL) {
        goto done;
    }
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(message);
    unsigned char *key_at = at + REQUEST_HEADER_SIZE + KEYED_SIZE;
    key_at[0] = parts.tag;
    memcpy(key_at + 1, parts.payload, (size_t)parts.payload_size);
    uint64_t hash;
    if (hash_key(&hasher, (const char *)key_at, key_size, NULL, &hash) < 0) {
        goto done;
    }
    uint32_t bucket = bucket_from_hash(hash, shift);
    put_request_header(at, (int)op, (uint32_t)request_id, client_id, shift);
    put_u32(at + REQUEST_HEADER_SIZE, (uint32_t)dht_id);
    put_u32(at + REQUEST_HEADER_SIZE + 4, bucket);
    put_u16(at + REQUEST_HEADER_SIZE + 8, (uint32_t)key_size);
    if (VALUED_OP(op)) {
        unsigned char *value_at = key_at + key_size;
        put_u32(value_at, (uint32_t)value_size);
        if (value_size) {
            memcpy(value_at + 4, PyBytes_AS_STRING(value), (size_t)value_size);
        }
    }
    PyObject *bucket_number = PyLong_FromUnsignedLong(bucket);
    if (bucket_number == NULL) {
        goto done;
    }
    result = PyTuple_Pack(2, message, bucket_number);
    Py_DECREF(bucket_number);
done:
    Py_XDECREF(message);
    key_parts_clear(&parts);
    return result;
}

/* ------------------------------------------------------------ batches */

/* Keys grouped by the channel that owns their bucket, in the order the
 * Python reference groups them (a dict keyed by channel, in order of first
 * appearance).  `index` gives the dict's equality; `seen` caches it by
 * identity (open addressing, owned references, so no address is reused
 * while cached). */
typedef struct {
    PyObject *channel;    /* owned */
    Py_ssize_t count;     /* members */
    Py_ssize_t first;     /* where its members start in `order` */
} Group;

typedef struct {
    PyObject *index;      /* dict: channel -> group number */
    Group *groups;
    Py_ssize_t group_count;
    Py_ssize_t group_capacity;
    PyObject **seen;      /* owned; NULL: empty slot */
    Py_ssize_t *seen_group;
    size_t seen_mask;
    Py_ssize_t seen_used;
} Grouping;

static int
grouping_init(Grouping *grouping)
{
    memset(grouping, 0, sizeof(*grouping));
    grouping->index = PyDict_New();
    grouping->seen_mask = 15;
    grouping->seen = PyMem_Calloc(grouping->seen_mask + 1, sizeof(PyObject *));
    grouping->seen_group = PyMem_Calloc(grouping->seen_mask + 1, sizeof(Py_ssize_t));
    if (grouping->index == NULL || grouping->seen == NULL || grouping->seen_group == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
grouping_clear(Grouping *grouping)
{
    Py_CLEAR(grouping->index);
    for (Py_ssize_t number = 0; number < grouping->group_count; number++) {
        Py_CLEAR(grouping->groups[number].channel);
    }
    PyMem_Free(grouping->groups);
    grouping->groups = NULL;
    if (grouping->seen != NULL) {
        for (size_t slot = 0; slot <= grouping->seen_mask; slot++) {
            Py_CLEAR(grouping->seen[slot]);
        }
    }
    PyMem_Free(grouping->seen);
    PyMem_Free(grouping->seen_group);
    grouping->seen = NULL;
    grouping->seen_group = NULL;
}

static inline size_t
pointer_slot(const void *pointer, size_t mask)
{
    uintptr_t bits = (uintptr_t)pointer;
    return (size_t)((bits >> 4) ^ (bits >> 12)) & mask;
}

static int
seen_insert(Grouping *grouping, PyObject *channel, Py_ssize_t number)
{
    if ((size_t)(grouping->seen_used + 1) * 2 > grouping->seen_mask + 1) {
        size_t old_mask = grouping->seen_mask, mask = old_mask * 2 + 1;
        PyObject **seen = PyMem_Calloc(mask + 1, sizeof(PyObject *));
        Py_ssize_t *seen_group = PyMem_Calloc(mask + 1, sizeof(Py_ssize_t));
        if (seen == NULL || seen_group == NULL) {
            PyMem_Free(seen);
            PyMem_Free(seen_group);
            PyErr_NoMemory();
            return -1;
        }
        for (size_t slot = 0; slot <= old_mask; slot++) {
            if (grouping->seen[slot] != NULL) {
                size_t to = pointer_slot(grouping->seen[slot], mask);
                while (seen[to] != NULL) {
                    to = (to + 1) & mask;
                }
                seen[to] = grouping->seen[slot];
                seen_group[to] = grouping->seen_group[slot];
            }
        }
        PyMem_Free(grouping->seen);
        PyMem_Free(grouping->seen_group);
        grouping->seen = seen;
        grouping->seen_group = seen_group;
        grouping->seen_mask = mask;
    }
    size_t slot = pointer_slot(channel, grouping->seen_mask);
    while (grouping->seen[slot] != NULL) {
        slot = (slot + 1) & grouping->seen_mask;
    }
    grouping->seen[slot] = Py_NewRef(channel);
    grouping->seen_group[slot] = number;
    grouping->seen_used++;
    return 0;
}

/* The group number of channel, adding a group the first time: >= 0, or -1
 * with an exception (an unhashable channel, like the reference's dict). */
static Py_ssize_t
group_of(Grouping *grouping, PyObject *channel)
{
    size_t slot = pointer_slot(channel, grouping->seen_mask);
    while (grouping->seen[slot] != NULL) {
        if (grouping->seen[slot] == channel) {
            return grouping->seen_group[slot];
        }
        slot = (slot + 1) & grouping->seen_mask;
    }
    Py_ssize_t number;
    PyObject *found = PyDict_GetItemWithError(grouping->index, channel);
    if (found != NULL) {
        number = PyLong_AsSsize_t(found);
    }
    else {
        if (PyErr_Occurred()) {
            return -1;
        }
        if (grouping->group_count == grouping->group_capacity) {
            Py_ssize_t capacity = grouping->group_capacity ? grouping->group_capacity * 2 : 8;
            Group *groups = PyMem_Realloc(grouping->groups, (size_t)capacity * sizeof(Group));
            if (groups == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            grouping->groups = groups;
            grouping->group_capacity = capacity;
        }
        number = grouping->group_count;
        PyObject *boxed = PyLong_FromSsize_t(number);
        if (boxed == NULL) {
            return -1;
        }
        int failed = PyDict_SetItem(grouping->index, channel, boxed);
        Py_DECREF(boxed);
        if (failed) {
            return -1;
        }
        Group *group = &grouping->groups[number];
        group->channel = Py_NewRef(channel);
        group->count = 0;
        group->first = 0;
        grouping->group_count++;
    }
    if (seen_insert(grouping, channel, number) < 0) {
        return -1;
    }
    return number;
}

/* What a batch call groups: for each of its n keys (in `keys`, a tuple of
 * bytes) the bucket and group, then `order`: the key positions grouped,
 * each group's in key order. */
typedef struct {
    Grouping grouping;
    Py_ssize_t count;
    uint32_t *buckets;
    Py_ssize_t *group_numbers;
    Py_ssize_t *order;
} Plan;

static void
plan_clear(Plan *plan)
{
    grouping_clear(&plan->grouping);
    PyMem_Free(plan->buckets);
    PyMem_Free(plan->group_numbers);
    PyMem_Free(plan->order);
    plan->buckets = NULL;
    plan->group_numbers = NULL;
    plan->order = NULL;
}

/* Group the n keys `keys[i]` (i in [0, n)).  0, or -1 with an exception
 * (TypeError for a key that is not bytes, IndexError for a bucket past the
 * end of an owners list, what the hash callable or an owners map raised).
 * owners is a list indexed by bucket, or any object whose [bucket] is the
 * owner (a domus.placement.bucketmap.BucketMap). */
static int
plan_groups(Plan *plan, PyObject *keys, const Hasher *hasher, int shift, PyObject *owners)
{
    Py_ssize_t count = PyTuple_GET_SIZE(keys);
    memset(plan, 0, sizeof(*plan));
    plan->count = count;
    if (grouping_init(&plan->grouping) < 0) {
        return -1;
    }
    size_t slots = count ? (size_t)count : 1;
    plan->buckets = PyMem_Malloc(slots * sizeof(uint32_t));
    plan->group_numbers = PyMem_Malloc(slots * sizeof(Py_ssize_t));
    plan->order = PyMem_Malloc(slots * sizeof(Py_ssize_t));
    if (plan->buckets == NULL || plan->group_numbers == NULL || plan->order == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *key = PyTuple_GET_ITEM(keys, index);
        if (bytes_arg(key, "an encoded key") < 0) {
            return -1;
        }
        if (PyBytes_GET_SIZE(key) > 0xFFFF) {
            PyErr_Format(PyExc_OverflowError, "an encoded key of %zd bytes does not fit "
                         "the protocol's u16 length", PyBytes_GET_SIZE(key));
            return -1;
        }
        uint64_t hash;
        if (hash_key(hasher, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), key, &hash) < 0) {
            return -1;
        }
        uint32_t bucket = bucket_from_hash(hash, shift);
        PyObject *channel;
        if (PyList_CheckExact(owners)) {
            /* The list may have changed under a hash callable: check each time. */
            if ((size_t)bucket >= (size_t)PyList_GET_SIZE(owners)) {
                PyErr_SetString(PyExc_IndexError, "list index out of range");
                return -1;
            }
            channel = Py_NewRef(PyList_GET_ITEM(owners, bucket));
        }
        else {
            /* A map too big to unfold into a list (domus.placement.bucketmap): ask it. */
            PyObject *number = PyLong_FromUnsignedLong(bucket);
            if (number == NULL) {
                return -1;
            }
            channel = PyObject_GetItem(owners, number);
            Py_DECREF(number);
            if (channel == NULL) {
                return -1;
            }
        }
        Py_ssize_t number = group_of(&plan->grouping, channel);
        Py_DECREF(channel);
        if (number < 0) {
            return -1;
        }
        plan->buckets[index] = bucket;
        plan->group_numbers[index] = number;
        plan->grouping.groups[number].count++;
    }
    Py_ssize_t first = 0;
    for (Py_ssize_t number = 0; number < plan->grouping.group_count; number++) {
        Group *group = &plan->grouping.groups[number];
        group->first = first;
        first += group->count;
        group->count = 0;   /* counted again while filling `order` */
    }
    for (Py_ssize_t index = 0; index < count; index++) {
        Group *group = &plan->grouping.groups[plan->group_numbers[index]];
        plan->order[group->first + group->count++] = index;
    }
    return 0;
}

/* The next request id from the caller's callable: 0 or -1. */
static int
next_request_id(PyObject *next_id, uint32_t *request_id)
{
    PyObject *result = PyObject_CallNoArgs(next_id);
    if (result == NULL) {
        return -1;
    }
    uint64_t value;
    int failed = unsigned_arg(result, 0xFFFFFFFFu, "a request id", &value);
    Py_DECREF(result);
    if (failed) {
        return -1;
    }
    *request_id = (uint32_t)value;
    return 0;
}

/* Append (channel, message) to requests, taking the message: 0 or -1. */
static int
append_request(PyObject *requests, PyObject *channel, PyObject *message)
{
    PyObject *request = PyTuple_Pack(2, channel, message);
    Py_DECREF(message);
    if (request == NULL) {
        return -1;
    }
    int failed = PyList_Append(requests, request);
    Py_DECREF(request);
    return failed;
}

static int
limit_arg(PyObject *obj, Py_ssize_t *limit)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "limit must be an int, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow;
    long value = PyLong_AsLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || value < 1 || value > MAX_BATCH) {
        PyErr_Format(PyExc_ValueError, "limit must be in [1, %d]", MAX_BATCH);
        return -1;
    }
    *limit = (Py_ssize_t)value;
    return 0;
}

static int
max_datagram_arg(PyObject *obj, Py_ssize_t *max_datagram)
{
    uint64_t value;
    if (unsigned_arg(obj, PY_SSIZE_T_MAX, "max_datagram", &value) < 0) {
        return -1;
    }
    *max_datagram = (Py_ssize_t)value;
    return 0;
}

/* The length of the next run of a group's members (starting at member
 * `start` of `count`) that fits one datagram and `limit` entries; an entry
 * too big for a datagram gets a run of its own (domus.client.codec.chunks). */
static Py_ssize_t
run_length(const Py_ssize_t *sizes, Py_ssize_t start, Py_ssize_t count,
           Py_ssize_t limit, Py_ssize_t max_datagram, Py_ssize_t *run_size)
{
    Py_ssize_t size = BATCH_OVERHEAD, length = 0;
    for (Py_ssize_t member = start; member < count; member++) {
        if (length && (size + sizes[member] > max_datagram || length >= limit)) {
            break;
        }
        size += sizes[member];
        length++;
    }
    *run_size = size;
    return length;
}

PyDoc_STRVAR(put_many_requests_doc,
"put_many_requests(keys, values, hasher, shift, owners, dht_id, next_id,\n"
"                  client_id, max_datagram, limit, /)\n--\n\n"
"PUT_MANY messages for encoded keys and packed values: a list of\n"
"(channel, message), the keys grouped by owners[bucket] and cut into runs\n"
"that fit max_datagram bytes and limit entries.  next_id() gives each\n"
"message's request id, in order.");

static PyObject *
codec_put_many_requests(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Hasher hasher;
    int shift;
    uint64_t dht_id, client_id;
    Py_ssize_t max_datagram, limit;
    if (check_nargs("put_many_requests", nargs, 10) < 0
        || hasher_arg(args[2], &hasher) < 0 || shift_arg(args[3], &shift) < 0
        || unsigned_arg(args[5], 0xFFFFFFFFu, "dht_id", &dht_id) < 0
        || unsigned_arg(args[7], UINT64_MAX, "client_id", &client_id) < 0
        || max_datagram_arg(args[8], &max_datagram) < 0 || limit_arg(args[9], &limit) < 0) {
        return NULL;
    }
    if (!PyList_CheckExact(args[4]) && !PyMapping_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "owners must be a list or a bucket map");
        return NULL;
    }
    PyObject *owners = args[4], *next_id = args[6];
    /* Snapshots: nothing a callback does to the caller's lists matters. */
    PyObject *keys = PySequence_Tuple(args[0]);
    PyObject *values = keys != NULL ? PySequence_Tuple(args[1]) : NULL;
    PyObject *requests = NULL;
    Py_ssize_t *sizes = NULL;
    Plan plan;
    memset(&plan, 0, sizeof(plan));
    if (values == NULL) {
        goto fail;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(values) != count) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd values", count,
                     PyTuple_GET_SIZE(values));
        goto fail;
    }
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *value = PyTuple_GET_ITEM(values, index);
        if (bytes_arg(value, "a packed value") < 0) {
            goto fail;
        }
        if ((uint64_t)PyBytes_GET_SIZE(value) > 0xFFFFFFFFu) {
            PyErr_SetString(PyExc_OverflowError, "a value must be under 4 GiB");
            goto fail;
        }
    }
    if (plan_groups(&plan, keys, &hasher, shift, owners) < 0) {
        goto fail;
    }
    sizes = PyMem_Malloc((count ? (size_t)count : 1) * sizeof(Py_ssize_t));
    requests = PyList_New(0);
    if (sizes == NULL || requests == NULL) {
        if (sizes == NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    for (Py_ssize_t number = 0; number < plan.grouping.group_count; number++) {
        Group *group = &plan.grouping.groups[number];
        const Py_ssize_t *members = plan.order + group->first;
        for (Py_ssize_t member = 0; member < group->count; member++) {
            Py_ssize_t index = members[member];
            sizes[member] = PUT_ENTRY_SIZE + PyBytes_GET_SIZE(PyTuple_GET_ITEM(keys, index))
                            + PyBytes_GET_SIZE(PyTuple_GET_ITEM(values, index));
        }
        Py_ssize_t start = 0;
        while (start < group->count) {
            Py_ssize_t size;
            Py_ssize_t length = run_length(sizes, start, group->count, limit, max_datagram,
                                           &size);
            uint32_t request_id;
            if (next_request_id(next_id, &request_id) < 0) {
                goto fail;
            }
            PyObject *message = PyBytes_FromStringAndSize(NULL, size);
            if (message == NULL) {
                goto fail;
            }
            unsigned char *at = (unsigned char *)PyBytes_AS_STRING(message);
            put_request_header(at, OP_PUT_MANY, request_id, client_id, shift);
            put_u32(at + REQUEST_HEADER_SIZE, (uint32_t)dht_id);
            put_u16(at + REQUEST_HEADER_SIZE + 4, (uint32_t)length);
            at += BATCH_OVERHEAD;
            for (Py_ssize_t member = start; member < start + length; member++) {
                Py_ssize_t index = members[member];
                PyObject *key = PyTuple_GET_ITEM(keys, index);
                PyObject *value = PyTuple_GET_ITEM(values, index);
                Py_ssize_t key_size = PyBytes_GET_SIZE(key);
                Py_ssize_t value_size = PyBytes_GET_SIZE(value);
                put_u32(at, plan.buckets[index]);
                put_u16(at + 4, (uint32_t)key_size);
                put_u32(at + 6, (uint32_t)value_size);
                at += PUT_ENTRY_SIZE;
                memcpy(at, PyBytes_AS_STRING(key), (size_t)key_size);
                at += key_size;
                if (value_size) {
                    memcpy(at, PyBytes_AS_STRING(value), (size_t)value_size);
                }
                at += value_size;
            }
            if (append_request(requests, group->channel, message) < 0) {
                goto fail;
            }
            start += length;
        }
    }
    plan_clear(&plan);
    PyMem_Free(sizes);
    Py_DECREF(keys);
    Py_DECREF(values);
    return requests;
fail:
    plan_clear(&plan);
    PyMem_Free(sizes);
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(requests);
    return NULL;
}

PyDoc_STRVAR(get_many_requests_doc,
"get_many_requests(keys, pending, hasher, shift, owners, dht_id, next_id,\n"
"                  client_id, limits, max_datagram, /)\n--\n\n"
"GET_MANY messages for keys[p] for p in pending: (requests, batches), where\n"
"requests is a list of (channel, message) and batches[i] the positions\n"
"(items of pending) that message i asks for.  limits maps a channel to the\n"
"most entries per message (default 65535).");

static PyObject *
codec_get_many_requests(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Hasher hasher;
    int shift;
    uint64_t dht_id, client_id;
    Py_ssize_t max_datagram;
    if (check_nargs("get_many_requests", nargs, 10) < 0
        || hasher_arg(args[2], &hasher) < 0 || shift_arg(args[3], &shift) < 0
        || unsigned_arg(args[5], 0xFFFFFFFFu, "dht_id", &dht_id) < 0
        || unsigned_arg(args[7], UINT64_MAX, "client_id", &client_id) < 0
        || max_datagram_arg(args[9], &max_datagram) < 0) {
        return NULL;
    }
    if (!PyList_CheckExact(args[4]) && !PyMapping_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "owners must be a list or a bucket map");
        return NULL;
    }
    if (!PyDict_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "limits must be a dict");
        return NULL;
    }
    PyObject *owners = args[4], *next_id = args[6], *limits = args[8];
    PyObject *all_keys = PySequence_Tuple(args[0]);
    PyObject *pending = all_keys != NULL ? PySequence_Tuple(args[1]) : NULL;
    PyObject *keys = NULL, *requests = NULL, *batches = NULL, *result = NULL;
    Py_ssize_t *sizes = NULL;
    Plan plan;
    memset(&plan, 0, sizeof(plan));
    if (pending == NULL) {
        goto done;
    }
    /* The pending keys, as the reference's [keys[p] for p in pending]. */
    Py_ssize_t count = PyTuple_GET_SIZE(pending), key_count = PyTuple_GET_SIZE(all_keys);
    keys = PyTuple_New(count);
    if (keys == NULL) {
        goto done;
    }
    for (Py_ssize_t local = 0; local < count; local++) {
        PyObject *position = PyTuple_GET_ITEM(pending, local);
        if (!PyLong_Check(position)) {
            PyErr_Format(PyExc_TypeError, "list indices must be integers or slices, not %.100s",
                         Py_TYPE(position)->tp_name);
            goto done;
        }
        Py_ssize_t index = PyLong_AsSsize_t(position);
        if (index == -1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_SetString(PyExc_IndexError, "cannot fit 'int' into an index-sized integer");
            }
            goto done;
        }
        if (index < 0) {
            index += key_count;
        }
        if (index < 0 || index >= key_count) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto done;
        }
        PyTuple_SET_ITEM(keys, local, Py_NewRef(PyTuple_GET_ITEM(all_keys, index)));
    }
    if (plan_groups(&plan, keys, &hasher, shift, owners) < 0) {
        goto done;
    }
    sizes = PyMem_Malloc((count ? (size_t)count : 1) * sizeof(Py_ssize_t));
    requests = PyList_New(0);
    batches = PyList_New(0);
    if (sizes == NULL || requests == NULL || batches == NULL) {
        if (sizes == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    for (Py_ssize_t number = 0; number < plan.grouping.group_count; number++) {
        Group *group = &plan.grouping.groups[number];
        const Py_ssize_t *members = plan.order + group->first;
        Py_ssize_t limit = MAX_BATCH;
        PyObject *found = PyDict_GetItemWithError(limits, group->channel);
        if (found != NULL) {
            Py_INCREF(found);
            int failed = limit_arg(found, &limit);
            Py_DECREF(found);
            if (failed) {
                goto done;
            }
        }
        else if (PyErr_Occurred()) {
            goto done;
        }
        for (Py_ssize_t member = 0; member < group->count; member++) {
            sizes[member] = GET_ENTRY_SIZE
                            + PyBytes_GET_SIZE(PyTuple_GET_ITEM(keys, members[member]));
        }
        Py_ssize_t start = 0;
        while (start < group->count) {
            Py_ssize_t size;
            Py_ssize_t length = run_length(sizes, start, group->count, limit, max_datagram,
                                           &size);
            uint32_t request_id;
            if (next_request_id(next_id, &request_id) < 0) {
                goto done;
            }
            PyObject *positions = PyList_New(length);
            if (positions == NULL) {
                goto done;
            }
            for (Py_ssize_t member = start; member < start + length; member++) {
                PyList_SET_ITEM(positions, member - start,
                                Py_NewRef(PyTuple_GET_ITEM(pending, members[member])));
            }
            int failed = PyList_Append(batches, positions);
            Py_DECREF(positions);
            if (failed) {
                goto done;
            }
            PyObject *message = PyBytes_FromStringAndSize(NULL, size);
            if (message == NULL) {
                goto done;
            }
            unsigned char *at = (unsigned char *)PyBytes_AS_STRING(message);
            put_request_header(at, OP_GET_MANY, request_id, client_id, shift);
            put_u32(at + REQUEST_HEADER_SIZE, (uint32_t)dht_id);
            put_u16(at + REQUEST_HEADER_SIZE + 4, (uint32_t)length);
            at += BATCH_OVERHEAD;
            for (Py_ssize_t member = start; member < start + length; member++) {
                Py_ssize_t index = members[member];
                PyObject *key = PyTuple_GET_ITEM(keys, index);
                Py_ssize_t key_size = PyBytes_GET_SIZE(key);
                put_u32(at, plan.buckets[index]);
                put_u16(at + 4, (uint32_t)key_size);
                at += GET_ENTRY_SIZE;
                memcpy(at, PyBytes_AS_STRING(key), (size_t)key_size);
                at += key_size;
            }
            if (append_request(requests, group->channel, message) < 0) {
                goto done;
            }
            start += length;
        }
    }
    result = PyTuple_Pack(2, requests, batches);
done:
    plan_clear(&plan);
    PyMem_Free(sizes);
    Py_XDECREF(all_keys);
    Py_XDECREF(pending);
    Py_XDECREF(keys);
    Py_XDECREF(requests);
    Py_XDECREF(batches);
    return result;
}

/* ------------------------------------------------------------ replies */

static PyObject *
protocol_error(codec_state *state, const char *message)
{
    PyErr_SetString(state->ProtocolError, message);
    return NULL;
}

PyDoc_STRVAR(decode_get_many_reply_doc,
"decode_get_many_reply(reply, /)\n--\n\n"
"The values of an OK GET_MANY reply in request order (None: absent);\n"
"ProtocolError if it is malformed.");

static PyObject *
codec_decode_get_many_reply(PyObject *module, PyObject *reply)
{
    codec_state *state = get_state(module);
    if (bytes_arg(reply, "reply") < 0) {
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(reply);
    Py_ssize_t size = PyBytes_GET_SIZE(reply), offset = REPLY_HEADER_SIZE;
    if (size < offset + 2) {
        return protocol_error(state, "get_many reply truncated before its count");
    }
    uint32_t count = get_u16(data + offset);
    offset += 2;
    PyObject *values = PyList_New(0);
    if (values == NULL) {
        return NULL;
    }
    for (uint32_t entry = 0; entry < count; entry++) {
        if (size - offset < 4) {
            Py_DECREF(values);
            return protocol_error(state, "get_many reply truncated");
        }
        uint32_t length = get_u32(data + offset);
        offset += 4;
        PyObject *value;
        if (length == MISSING) {
            value = Py_NewRef(Py_None);
        }
        else {
            if ((uint64_t)length > (uint64_t)(size - offset)) {
                Py_DECREF(values);
                return protocol_error(state, "get_many reply value runs past the end");
            }
            value = PyBytes_FromStringAndSize((const char *)data + offset, length);
            if (value == NULL) {
                Py_DECREF(values);
                return NULL;
            }
            offset += length;
        }
        int failed = PyList_Append(values, value);
        Py_DECREF(value);
        if (failed) {
            Py_DECREF(values);
            return NULL;
        }
    }
    if (offset != size) {
        Py_DECREF(values);
        return protocol_error(state, "get_many reply has stray bytes");
    }
    return values;
}

PyDoc_STRVAR(decode_scan_reply_doc,
"decode_scan_reply(reply, /)\n--\n\n"
"(scan id, next offset, [(key, value), ...]) of an OK SCAN reply;\n"
"ProtocolError if it is malformed.");

static PyObject *
codec_decode_scan_reply(PyObject *module, PyObject *reply)
{
    codec_state *state = get_state(module);
    if (bytes_arg(reply, "reply") < 0) {
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(reply);
    Py_ssize_t size = PyBytes_GET_SIZE(reply), offset = REPLY_HEADER_SIZE;
    if (size < offset + SCAN_REPLY_SIZE) {
        return protocol_error(state, "scan reply truncated");
    }
    uint32_t scan_id = get_u32(data + offset);
    uint32_t next_offset = get_u32(data + offset + 4);
    uint32_t count = get_u16(data + offset + 8);
    offset += SCAN_REPLY_SIZE;
    PyObject *entries = PyList_New(0);
    if (entries == NULL) {
        return NULL;
    }
    for (uint32_t entry = 0; entry < count; entry++) {
        if (size - offset < SCAN_ENTRY_SIZE) {
            Py_DECREF(entries);
            return protocol_error(state, "scan reply truncated");
        }
        uint64_t key_length = get_u16(data + offset);
        uint64_t value_length = get_u32(data + offset + 2);
        offset += SCAN_ENTRY_SIZE;
        if (key_length + value_length > (uint64_t)(size - offset)) {
            Py_DECREF(entries);
            return protocol_error(state, "scan reply entry runs past the end");
        }
        PyObject *pair = Py_BuildValue("(y#y#)", (const char *)data + offset,
                                       (Py_ssize_t)key_length,
                                       (const char *)data + offset + key_length,
                                       (Py_ssize_t)value_length);
        if (pair == NULL) {
            Py_DECREF(entries);
            return NULL;
        }
        offset += (Py_ssize_t)(key_length + value_length);
        int failed = PyList_Append(entries, pair);
        Py_DECREF(pair);
        if (failed) {
            Py_DECREF(entries);
            return NULL;
        }
    }
    if (offset != size) {
        Py_DECREF(entries);
        return protocol_error(state, "scan reply has stray bytes");
    }
    PyObject *result = Py_BuildValue("(kkO)", (unsigned long)scan_id,
                                     (unsigned long)next_offset, entries);
    Py_DECREF(entries);
    return result;
}

/* ------------------------------------------------------------ values
 *
 * Values are msgpack (domus.wire.values).  msgpack.packb builds a Packer for
 * every call, which costs more than everything else a put does, so the
 * common cases are encoded here: exact None, bool, int (64-bit), float, str,
 * bytes, and lists, tuples and dicts of those nested at most MAX_FAST_DEPTH
 * deep, byte for byte as msgpack.packb(value, use_bin_type=True) and
 * msgpack.unpackb(data, raw=False, strict_map_key=False).  Anything else
 * (other types, ext types, deeper nesting, bad data) "bails out" to
 * domus.wire.values, which is msgpack itself, so every other result and every
 * error is msgpack's own. */

#define MAX_FAST_DEPTH 32

enum { FAST_OK = 0, FAST_BAIL = 1 };   /* and -1: an exception is set */

/* A growing output buffer that starts on the stack. */
typedef struct {
    unsigned char *data;
    Py_ssize_t size;
    Py_ssize_t capacity;
    unsigned char small[256];
} Buffer;

static void
buffer_init(Buffer *buffer)
{
    buffer->data = buffer->small;
    buffer->size = 0;
    buffer->capacity = (Py_ssize_t)sizeof(buffer->small);
}

static void
buffer_free(Buffer *buffer)
{
    if (buffer->data != buffer->small) {
        PyMem_Free(buffer->data);
    }
    buffer_init(buffer);
}

/* Room for `extra` more bytes: a pointer to them (size not yet advanced),
 * or NULL with MemoryError. */
static unsigned char *
buffer_reserve(Buffer *buffer, Py_ssize_t extra)
{
    if (extra > PY_SSIZE_T_MAX / 2 - buffer->size) {
        PyErr_NoMemory();
        return NULL;
    }
    if (buffer->size + extra > buffer->capacity) {
        Py_ssize_t capacity = buffer->capacity * 2;
        if (capacity < buffer->size + extra) {
            capacity = buffer->size + extra;
        }
        unsigned char *data;
        if (buffer->data == buffer->small) {
            data = PyMem_Malloc((size_t)capacity);
            if (data != NULL) {
                memcpy(data, buffer->small, (size_t)buffer->size);
            }
        }
        else {
            data = PyMem_Realloc(buffer->data, (size_t)capacity);
        }
        if (data == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        buffer->data = data;
        buffer->capacity = capacity;
    }
    return buffer->data + buffer->size;
}

static int
buffer_put(Buffer *buffer, const void *bytes, Py_ssize_t size)
{
    unsigned char *at = buffer_reserve(buffer, size);
    if (at == NULL) {
        return -1;
    }
    if (size) {
        memcpy(at, bytes, (size_t)size);
    }
    buffer->size += size;
    return 0;
}

/* A type byte and a big-endian number of `width` bytes (0, 1, 2, 4, 8). */
static int
buffer_put_number(Buffer *buffer, unsigned char type, uint64_t number, int width)
{
    unsigned char *at = buffer_reserve(buffer, 1 + width);
    if (at == NULL) {
        return -1;
    }
    at[0] = type;
    for (int index = 0; index < width; index++) {
        at[1 + index] = (unsigned char)(number >> (8 * (width - 1 - index)));
    }
    buffer->size += 1 + width;
    return 0;
}

/* The smallest msgpack int, as msgpack chooses it. */
static int
pack_signed(Buffer *buffer, long long value)
{
    if (value >= 0) {
        uint64_t number = (uint64_t)value;
        if (number < 0x80) {
            return buffer_put_number(buffer, (unsigned char)number, 0, 0);
        }
        if (number <= 0xFF) {
            return buffer_put_number(buffer, 0xCC, number, 1);
        }
        if (number <= 0xFFFF) {
            return buffer_put_number(buffer, 0xCD, number, 2);
        }
        if (number <= 0xFFFFFFFFu) {
            return buffer_put_number(buffer, 0xCE, number, 4);
        }
        return buffer_put_number(buffer, 0xCF, number, 8);
    }
    uint64_t bits = (uint64_t)value;   /* two's complement, modulo 2**64 */
    if (value >= -0x20) {
        return buffer_put_number(buffer, (unsigned char)bits, 0, 0);
    }
    if (value >= -0x80) {
        return buffer_put_number(buffer, 0xD0, bits & 0xFF, 1);
    }
    if (value >= -0x8000) {
        return buffer_put_number(buffer, 0xD1, bits & 0xFFFF, 2);
    }
    if (value >= -0x80000000LL) {
        return buffer_put_number(buffer, 0xD2, bits & 0xFFFFFFFFu, 4);
    }
    return buffer_put_number(buffer, 0xD3, bits, 8);
}

/* A length-prefixed header: `small_base | length` below `small_limit`
 * (0: no such form), else the 8-, 16- or 32-bit form (type 0: none). */
static int
pack_length(Buffer *buffer, uint64_t length, unsigned char small_base, uint64_t small_limit,
            unsigned char type8, unsigned char type16, unsigned char type32)
{
    if (length < small_limit) {
        return buffer_put_number(buffer, (unsigned char)(small_base | length), 0, 0);
    }
    if (type8 && length <= 0xFF) {
        return buffer_put_number(buffer, type8, length, 1);
    }
    if (length <= 0xFFFF) {
        return buffer_put_number(buffer, type16, length, 2);
    }
    return buffer_put_number(buffer, type32, length, 4);
}

/* Append the msgpack of obj: FAST_OK, FAST_BAIL (not a fast case; nothing
 * meaningful appended) or -1 with an exception. */
static int
pack_fast(Buffer *buffer, PyObject *obj, int depth)
{
    if (obj == Py_None) {
        return buffer_put_number(buffer, 0xC0, 0, 0);
    }
    if (obj == Py_True || obj == Py_False) {
        return buffer_put_number(buffer, obj == Py_True ? 0xC3 : 0xC2, 0, 0);
    }
    if (PyLong_CheckExact(obj)) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (value == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow == 0) {
            return pack_signed(buffer, value);
        }
        if (overflow < 0) {
            return FAST_BAIL;   /* under -2**63: msgpack's OverflowError */
        }
        unsigned long long number = PyLong_AsUnsignedLongLong(obj);
        if (number == (unsigned long long)-1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return -1;
            }
            PyErr_Clear();
            return FAST_BAIL;
        }
        return buffer_put_number(buffer, 0xCF, number, 8);
    }
    if (PyFloat_CheckExact(obj)) {
        double value = PyFloat_AS_DOUBLE(obj);
        uint64_t bits;
        memcpy(&bits, &value, sizeof(bits));
        return buffer_put_number(buffer, 0xCB, bits, 8);
    }
    if (PyUnicode_CheckExact(obj)) {
        Py_ssize_t length;
        const char *text;
        if (PyUnicode_IS_ASCII(obj)) {
            text = (const char *)PyUnicode_DATA(obj);
            length = PyUnicode_GET_LENGTH(obj);
        }
        else {
            text = PyUnicode_AsUTF8AndSize(obj, &length);
            if (text == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
                    return -1;
                }
                PyErr_Clear();   /* lone surrogates: msgpack refuses them */
                return FAST_BAIL;
            }
        }
        if ((uint64_t)length > 0xFFFFFFFFu) {
            return FAST_BAIL;
        }
        if (pack_length(buffer, (uint64_t)length, 0xA0, 32, 0xD9, 0xDA, 0xDB) < 0) {
            return -1;
        }
        return buffer_put(buffer, text, length);
    }
    if (PyBytes_CheckExact(obj)) {
        Py_ssize_t length = PyBytes_GET_SIZE(obj);
        if ((uint64_t)length > 0xFFFFFFFFu) {
            return FAST_BAIL;
        }
        if (pack_length(buffer, (uint64_t)length, 0, 0, 0xC4, 0xC5, 0xC6) < 0) {
            return -1;
        }
        return buffer_put(buffer, PyBytes_AS_STRING(obj), length);
    }
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        if (depth >= MAX_FAST_DEPTH) {
            return FAST_BAIL;
        }
        /* No Python code runs while packing: the size cannot change. */
        Py_ssize_t count = PySequence_Fast_GET_SIZE(obj);
        if ((uint64_t)count > 0xFFFFFFFFu) {
            return FAST_BAIL;
        }
        if (pack_length(buffer, (uint64_t)count, 0x90, 16, 0, 0xDC, 0xDD) < 0) {
            return -1;
        }
        PyObject **items = PySequence_Fast_ITEMS(obj);
        for (Py_ssize_t index = 0; index < count; index++) {
            int status = pack_fast(buffer, items[index], depth + 1);
            if (status != FAST_OK) {
                return status;
            }
        }
        return FAST_OK;
    }
    if (PyDict_CheckExact(obj)) {
        if (depth >= MAX_FAST_DEPTH) {
            return FAST_BAIL;
        }
        Py_ssize_t count = PyDict_GET_SIZE(obj);
        if ((uint64_t)count > 0xFFFFFFFFu) {
            return FAST_BAIL;
        }
        if (pack_length(buffer, (uint64_t)count, 0x80, 16, 0, 0xDE, 0xDF) < 0) {
            return -1;
        }
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(obj, &position, &key, &value)) {
            int status = pack_fast(buffer, key, depth + 1);
            if (status == FAST_OK) {
                status = pack_fast(buffer, value, depth + 1);
            }
            if (status != FAST_OK) {
                return status;
            }
        }
        return FAST_OK;
    }
    return FAST_BAIL;
}

/* The packed value: the fast encoding, or domus.wire.values.pack_value's. */
static PyObject *
pack_one(codec_state *state, Buffer *buffer, PyObject *value)
{
    buffer->size = 0;
    int status = pack_fast(buffer, value, 0);
    if (status == FAST_OK) {
        return PyBytes_FromStringAndSize((const char *)buffer->data, buffer->size);
    }
    if (status < 0) {
        return NULL;
    }
    PyObject *packed = PyObject_CallOneArg(state->pack_value, value);
    if (packed != NULL && !PyBytes_Check(packed)) {
        PyErr_SetString(PyExc_TypeError, "domus.wire.values.pack_value did not return bytes");
        Py_CLEAR(packed);
    }
    return packed;
}

PyDoc_STRVAR(pack_value_doc,
"pack_value(value, /)\n--\n\n"
"The bytes stored for value (domus.wire.values.pack_value); ValueTypeError if\n"
"it has none.");

static PyObject *
codec_pack_value(PyObject *module, PyObject *value)
{
    Buffer buffer;
    buffer_init(&buffer);
    PyObject *packed = pack_one(get_state(module), &buffer, value);
    buffer_free(&buffer);
    return packed;
}

PyDoc_STRVAR(pack_values_doc,
"pack_values(values, /)\n--\n\n"
"[pack_value(value) for value in values], for a list or tuple.");

static PyObject *
codec_pack_values(PyObject *module, PyObject *values)
{
    codec_state *state = get_state(module);
    if (!PyList_Check(values) && !PyTuple_Check(values)) {
        PyErr_Format(PyExc_TypeError, "values must be a list or a tuple, not %.100s",
                     Py_TYPE(values)->tp_name);
        return NULL;
    }
    PyObject *result = PyList_New(0);
    if (result == NULL) {
        return NULL;
    }
    Buffer buffer;
    buffer_init(&buffer);
    /* The size is read again each time: the msgpack fallback runs Python code. */
    for (Py_ssize_t index = 0; index < PySequence_Fast_GET_SIZE(values); index++) {
        PyObject *value = Py_NewRef(PySequence_Fast_GET_ITEM(values, index));
        PyObject *packed = pack_one(state, &buffer, value);
        Py_DECREF(value);
        if (packed == NULL || PyList_Append(result, packed) < 0) {
            Py_XDECREF(packed);
            Py_DECREF(result);
            buffer_free(&buffer);
            return NULL;
        }
        Py_DECREF(packed);
    }
    buffer_free(&buffer);
    return result;
}

typedef struct {
    const unsigned char *data;
    Py_ssize_t size;
    Py_ssize_t offset;
} Reader;

/* The next `width` bytes as a big-endian number, or -1 (nothing read) if
 * fewer remain. */
static int
read_number(Reader *reader, int width, uint64_t *number)
{
    if (reader->size - reader->offset < width) {
        return -1;
    }
    uint64_t result = 0;
    for (int index = 0; index < width; index++) {
        result = (result << 8) | reader->data[reader->offset + index];
    }
    reader->offset += width;
    *number = result;
    return 0;
}

/* A signed number of `width` bytes in two's complement. */
static long long
signed_from(uint64_t bits, int width)
{
    uint64_t sign = (uint64_t)1 << (8 * width - 1);
    if (!(bits & sign)) {
        return (long long)bits;
    }
    /* -(2**(8w) - bits), computed without overflow. */
    uint64_t magnitude = width == 8 ? ~bits + 1 : (sign << 1) - bits;
    if (width == 8 && magnitude == sign) {
        return LLONG_MIN;
    }
    return -(long long)magnitude;
}

static int unpack_fast(Reader *reader, int depth, PyObject **out);

static int
unpack_str(Reader *reader, uint64_t length, PyObject **out)
{
    if ((uint64_t)(reader->size - reader->offset) < length) {
        return FAST_BAIL;
    }
    PyObject *text = PyUnicode_DecodeUTF8((const char *)reader->data + reader->offset,
                                          (Py_ssize_t)length, NULL);
    if (text == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            return -1;
        }
        PyErr_Clear();
        return FAST_BAIL;
    }
    reader->offset += (Py_ssize_t)length;
    *out = text;
    return FAST_OK;
}

static int
unpack_bin(Reader *reader, uint64_t length, PyObject **out)
{
    if ((uint64_t)(reader->size - reader->offset) < length) {
        return FAST_BAIL;
    }
    *out = PyBytes_FromStringAndSize((const char *)reader->data + reader->offset,
                                     (Py_ssize_t)length);
    if (*out == NULL) {
        return -1;
    }
    reader->offset += (Py_ssize_t)length;
    return FAST_OK;
}

static int
unpack_array(Reader *reader, uint64_t count, int depth, PyObject **out)
{
    /* Each item takes a byte at least: a larger count is bad data. */
    if (depth >= MAX_FAST_DEPTH || count > (uint64_t)(reader->size - reader->offset)) {
        return FAST_BAIL;
    }
    PyObject *list = PyList_New((Py_ssize_t)count);
    if (list == NULL) {
        return -1;
    }
    for (Py_ssize_t index = 0; index < (Py_ssize_t)count; index++) {
        PyObject *item;
        int status = unpack_fast(reader, depth + 1, &item);
        if (status != FAST_OK) {
            Py_DECREF(list);   /* items not set yet are NULL: fine */
            return status;
        }
        PyList_SET_ITEM(list, index, item);
    }
    *out = list;
    return FAST_OK;
}

static int
unpack_map(Reader *reader, uint64_t count, int depth, PyObject **out)
{
    if (depth >= MAX_FAST_DEPTH || count > (uint64_t)(reader->size - reader->offset) / 2) {
        return FAST_BAIL;
    }
    PyObject *dict = PyDict_New();
    if (dict == NULL) {
        return -1;
    }
    for (uint64_t index = 0; index < count; index++) {
        PyObject *key, *value;
        int status = unpack_fast(reader, depth + 1, &key);
        if (status != FAST_OK) {
            Py_DECREF(dict);
            return status;
        }
        status = unpack_fast(reader, depth + 1, &value);
        if (status != FAST_OK) {
            Py_DECREF(key);
            Py_DECREF(dict);
            return status;
        }
        int failed = PyDict_SetItem(dict, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (failed) {
            Py_DECREF(dict);
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                return -1;
            }
            PyErr_Clear();   /* an unhashable key: msgpack says so itself */
            return FAST_BAIL;
        }
    }
    *out = dict;
    return FAST_OK;
}

/* Read one msgpack object: FAST_OK (*out set, owned), FAST_BAIL (not a
 * fast case, or bad data: msgpack decides) or -1 with an exception. */
static int
unpack_fast(Reader *reader, int depth, PyObject **out)
{
    uint64_t number;
    if (read_number(reader, 1, &number) < 0) {
        return FAST_BAIL;
    }
    unsigned int type = (unsigned int)number;
    if (type <= 0x7F || type >= 0xE0) {   /* fixint */
        *out = PyLong_FromLong(type <= 0x7F ? (long)type : (long)type - 0x100);
        return *out != NULL ? FAST_OK : -1;
    }
    if (type <= 0x8F) {
        return unpack_map(reader, type & 0x0F, depth, out);
    }
    if (type <= 0x9F) {
        return unpack_array(reader, type & 0x0F, depth, out);
    }
    if (type <= 0xBF) {
        return unpack_str(reader, type & 0x1F, out);
    }
    int width;
    switch (type) {
    case 0xC0:
        *out = Py_NewRef(Py_None);
        return FAST_OK;
    case 0xC2:
        *out = Py_NewRef(Py_False);
        return FAST_OK;
    case 0xC3:
        *out = Py_NewRef(Py_True);
        return FAST_OK;
    case 0xC4: case 0xC5: case 0xC6:
        width = 1 << (type - 0xC4);
        if (read_number(reader, width, &number) < 0) {
            return FAST_BAIL;
        }
        return unpack_bin(reader, number, out);
    case 0xCA: {
        if (read_number(reader, 4, &number) < 0) {
            return FAST_BAIL;
        }
        uint32_t bits = (uint32_t)number;
        float value;
        memcpy(&value, &bits, sizeof(value));
        *out = PyFloat_FromDouble((double)value);
        return *out != NULL ? FAST_OK : -1;
    }
    case 0xCB: {
        if (read_number(reader, 8, &number) < 0) {
            return FAST_BAIL;
        }
        double value;
        memcpy(&value, &number, sizeof(value));
        *out = PyFloat_FromDouble(value);
        return *out != NULL ? FAST_OK : -1;
    }
    case 0xCC: case 0xCD: case 0xCE: case 0xCF:
        width = 1 << (type - 0xCC);
        if (read_number(reader, width, &number) < 0) {
            return FAST_BAIL;
        }
        *out = PyLong_FromUnsignedLongLong(number);
        return *out != NULL ? FAST_OK : -1;
    case 0xD0: case 0xD1: case 0xD2: case 0xD3:
        width = 1 << (type - 0xD0);
        if (read_number(reader, width, &number) < 0) {
            return FAST_BAIL;
        }
        *out = PyLong_FromLongLong(signed_from(number, width));
        return *out != NULL ? FAST_OK : -1;
    case 0xD9: case 0xDA: case 0xDB:
        width = 1 << (type - 0xD9);
        if (read_number(reader, width, &number) < 0) {
            return FAST_BAIL;
        }
        return unpack_str(reader, number, out);
    case 0xDC: case 0xDD:
        if (read_number(reader, type == 0xDC ? 2 : 4, &number) < 0) {
            return FAST_BAIL;
        }
        return unpack_array(reader, number, depth, out);
    case 0xDE: case 0xDF:
        if (read_number(reader, type == 0xDE ? 2 : 4, &number) < 0) {
            return FAST_BAIL;
        }
        return unpack_map(reader, number, depth, out);
    default:   /* 0xC1 (never used), ext types: msgpack's business */
        return FAST_BAIL;
    }
}

/* The value stored as data[0:size]: the fast decoding, or
 * domus.wire.values.unpack_value's (its result or its error). */
static PyObject *
unpack_one(codec_state *state, const unsigned char *data, Py_ssize_t size)
{
    Reader reader = {data, size, 0};
    PyObject *value = NULL;
    int status = unpack_fast(&reader, 0, &value);
    if (status == FAST_OK) {
        if (reader.offset == size) {
            return value;
        }
        Py_DECREF(value);   /* extra bytes: msgpack's ExtraData */
    }
    else if (status < 0) {
        return NULL;
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)data, size);
    if (raw == NULL) {
        return NULL;
    }
    value = PyObject_CallOneArg(state->unpack_value, raw);
    Py_DECREF(raw);
    return value;
}

PyDoc_STRVAR(unpack_value_doc,
"unpack_value(data, offset, /)\n--\n\n"
"The value stored as data[offset:] (domus.wire.values.unpack_value).");

static PyObject *
codec_unpack_value(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t offset;
    if (check_nargs("unpack_value", nargs, 2) < 0 || bytes_arg(args[0], "data") < 0
        || unsigned_arg(args[1], PY_SSIZE_T_MAX, "offset", &offset) < 0) {
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    if ((Py_ssize_t)offset > size) {
        offset = (uint64_t)size;   /* as data[offset:] */
    }
    return unpack_one(get_state(module), (const unsigned char *)PyBytes_AS_STRING(args[0])
                      + offset, size - (Py_ssize_t)offset);
}

/* If the exception set is a ValueDecodeError, replaces it with the same
 * error naming the key wanted[position], as the reference's
 * `raise exc.with_key(wanted[position])` does; an exception raised on the
 * way (wanted[position] fails) is set instead.  Any other exception is
 * left as it is.  An exception is set on return. */
static void
name_the_key(codec_state *state, PyObject *wanted, PyObject *position)
{
    if (!PyErr_ExceptionMatches(state->ValueDecodeError)) {
        return;
    }
    PyObject *type, *error, *traceback;
    PyErr_Fetch(&type, &error, &traceback);
    PyErr_NormalizeException(&type, &error, &traceback);
    PyObject *key = PyObject_GetItem(wanted, position);
    PyObject *method = key != NULL ? PyUnicode_FromString("with_key") : NULL;
    PyObject *named = method != NULL
                      ? PyObject_CallMethodObjArgs(error, method, key, NULL) : NULL;
    if (named != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(named), named);
        Py_DECREF(named);
    }
    Py_XDECREF(method);
    Py_XDECREF(key);
    if (!PyErr_Occurred()) {    /* with_key returned NULL without an error */
        PyErr_Restore(type, error, traceback);
        return;
    }
    Py_XDECREF(type);
    Py_XDECREF(error);
    Py_XDECREF(traceback);
}

PyDoc_STRVAR(get_many_take_doc,
"get_many_take(reply, batch, wanted, found, unpack, /)\n--\n\n"
"Take in an OK GET_MANY reply: for each value present, in order,\n"
"found[wanted[batch[i]]] = unpack(value) (unpack None: unpack_value).\n"
"Returns how many entries the reply answers; ProtocolError (and nothing\n"
"taken) if it is malformed.  A value that cannot be decoded stops the\n"
"taking with its ValueDecodeError, naming its key (the values before it\n"
"are taken).");

static PyObject *
codec_get_many_take(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    codec_state *state = get_state(module);
    if (check_nargs("get_many_take", nargs, 5) < 0 || bytes_arg(args[0], "reply") < 0) {
        return NULL;
    }
    PyObject *reply = args[0], *batch = args[1], *wanted = args[2], *found = args[3];
    PyObject *unpack = args[4];
    if (!PyList_Check(batch)) {
        PyErr_SetString(PyExc_TypeError, "batch must be a list");
        return NULL;
    }
    if (unpack != Py_None && !PyCallable_Check(unpack)) {
        PyErr_SetString(PyExc_TypeError, "unpack must be None or a callable");
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(reply);
    Py_ssize_t size = PyBytes_GET_SIZE(reply), offset = REPLY_HEADER_SIZE;
    /* First the whole reply is checked, as decode_get_many_reply does. */
    if (size < offset + 2) {
        return protocol_error(state, "get_many reply truncated before its count");
    }
    uint32_t count = get_u16(data + offset);
    offset += 2;
    for (uint32_t entry = 0; entry < count; entry++) {
        if (size - offset < 4) {
            return protocol_error(state, "get_many reply truncated");
        }
        uint32_t length = get_u32(data + offset);
        offset += 4;
        if (length != MISSING) {
            if ((uint64_t)length > (uint64_t)(size - offset)) {
                return protocol_error(state, "get_many reply value runs past the end");
            }
            offset += length;
        }
    }
    if (offset != size) {
        return protocol_error(state, "get_many reply has stray bytes");
    }
    /* Then taken in, every length known to be in bounds. */
    offset = REPLY_HEADER_SIZE + 2;
    for (uint32_t entry = 0; entry < count; entry++) {
        /* The batch is read again each time: unpack and hashing run Python. */
        if ((Py_ssize_t)entry >= PyList_GET_SIZE(batch)) {
            break;
        }
        uint32_t length = get_u32(data + offset);
        offset += 4;
        if (length == MISSING) {
            continue;
        }
        PyObject *position = Py_NewRef(PyList_GET_ITEM(batch, entry));
        PyObject *value;
        if (unpack == Py_None) {
            value = unpack_one(state, data + offset, (Py_ssize_t)length);
        }
        else {
            PyObject *raw = PyBytes_FromStringAndSize((const char *)data + offset, length);
            value = raw != NULL ? PyObject_CallOneArg(unpack, raw) : NULL;
            Py_XDECREF(raw);
        }
        offset += length;
        if (value == NULL) {
            name_the_key(state, wanted, position);
        }
        PyObject *key = value != NULL ? PyObject_GetItem(wanted, position) : NULL;
        int failed = key == NULL || PyObject_SetItem(found, key, value) < 0;
        Py_DECREF(position);
        Py_XDECREF(value);
        Py_XDECREF(key);
        if (failed) {
            return NULL;
        }
    }
    return PyLong_FromUnsignedLong(count);
}

/* ------------------------------------------------------------ MAC
 * The trailers of sealed datagrams (domus/wire/auth.py is the reference,
 * docs/protocol.md "Sealed datagrams" the format): a request ends with the
 * client's time (u32) and SipHash-2-4 of the request and that time (u64);
 * a reply ends with SipHash-2-4 of the reply, the request's client id and
 * its time.  The client's side of both is here: sealing a request and
 * opening its reply, in the round trip below and on their own for the
 * event-driven clients. */

#define REQUEST_TRAILER 12      /* time u32, mac u64 */
#define REPLY_TRAILER 8         /* mac u64 */
#define STAMP_SIZE 4
#define SIP_KEY_SIZE 16

/* The wall clock's seconds, modulo 2^32, read as Python's time.time()
 * reads it (CLOCK_REALTIME, as the service's C path does), so that a
 * request sealed here carries the time auth.now_seconds() would give. */
static uint32_t
wall_seconds(void)
{
    struct timespec now;
    if (clock_gettime(CLOCK_REALTIME, &now) != 0) {
        return (uint32_t)time(NULL);
    }
    return (uint32_t)now.tv_sec;
}

/* A SipHash key argument: bytes of 16.  0, or -1 with TypeError/ValueError
 * set (the messages of siphash24 and its Python twin). */
static int
key_arg(PyObject *obj)
{
    if (bytes_arg(obj, "key") < 0) {
        return -1;
    }
    if (PyBytes_GET_SIZE(obj) != SIP_KEY_SIZE) {
        PyErr_SetString(PyExc_ValueError, "a SipHash key is 16 bytes");
        return -1;
    }
    return 0;
}

/* The time a request is sealed with: `obj` (an int in [0, 2^32)) or, for
 * None, this clock's.  0, or -1 with TypeError/OverflowError set. */
static int
seconds_arg(PyObject *obj, uint32_t *seconds)
{
    if (obj == Py_None) {
        *seconds = wall_seconds();
        return 0;
    }
    uint64_t value;
    if (unsigned_arg(obj, UINT32_MAX, "seconds", &value) < 0) {
        return -1;
    }
    *seconds = (uint32_t)value;
    return 0;
}

/* Writes message (size bytes) and its trailer, time then MAC, to `out`
 * (size + REQUEST_TRAILER bytes; may be where message already is). */
static void
seal_into(unsigned char *out, const unsigned char key[SIP_KEY_SIZE],
          const unsigned char *message, size_t size, uint32_t seconds)
{
    if (out != message) {
        memcpy(out, message, size);
    }
    put_u32(out + size, seconds);
    put_u64(out + size + STAMP_SIZE, domus_siphash24(key, out, size + STAMP_SIZE));
}

/* The SipHash state after a reply's bytes and the client id it answers:
 * what every stamp of the request's tries continues from. */
static void
reply_mac_prefix(DomusSip *sip, const unsigned char key[SIP_KEY_SIZE],
                 const unsigned char *reply, size_t reply_size,
                 const unsigned char *client_id, size_t client_id_size)
{
    domus_sip_init(sip, key);
    domus_sip_update(sip, reply, reply_size);
    domus_sip_update(sip, client_id, client_id_size);
}

/* Whether the sealed reply's MAC (its last 8 bytes) checks for a request
 * sealed at `stamp`, given the state after its reply and client id. */
static int
reply_mac_checks(const DomusSip *prefix, const unsigned char *datagram, size_t size,
                 const unsigned char *stamp, size_t stamp_size)
{
    DomusSip sip = *prefix;
    domus_sip_update(&sip, stamp, stamp_size);
    return domus_sip_final(&sip) == get_u64(datagram + size - REPLY_TRAILER);
}

/* The client id a request carries: its bytes [8, 16), as far as it has
 * them (as Python's request[8:16]). */
static void
client_id_of(const unsigned char *request, size_t size, const unsigned char **client_id,
             size_t *client_id_size)
{
    size_t end = size < REQUEST_HEADER_SIZE ? size : REQUEST_HEADER_SIZE;
    *client_id = request + (size < 8 ? size : 8);
    *client_id_size = end > 8 ? end - 8 : 0;
}

PyDoc_STRVAR(siphash24_doc,
"siphash24(key, data, /)\n--\n\n"
"SipHash-2-4 of bytes data under the 16-byte key, an int: the MAC of\n"
"datagrams (domus.wire.auth; siphash24_reference there is its twin).");

static PyObject *
codec_siphash24(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("siphash24", nargs, 2) < 0 || bytes_arg(args[0], "key") < 0
        || bytes_arg(args[1], "data") < 0) {
        return NULL;
    }
    if (PyBytes_GET_SIZE(args[0]) != 16) {
        PyErr_SetString(PyExc_ValueError, "a SipHash key is 16 bytes");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(domus_siphash24(
        (const unsigned char *)PyBytes_AS_STRING(args[0]),
        (const unsigned char *)PyBytes_AS_STRING(args[1]),
        (size_t)PyBytes_GET_SIZE(args[1])));
}

PyDoc_STRVAR(seal_request_doc,
"seal_request(key, message, /, seconds=None)\n--\n\n"
"message with its trailer: the time (u32; seconds, or this clock's) and\n"
"SipHash-2-4 under the 16-byte key of the message and that time (u64).\n"
"The twin of domus.wire.auth.seal_request_reference.");

static PyObject *
codec_seal_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                   PyObject *kwnames)
{
    /* seconds may be given by name, as the Python twin's may */
    Py_ssize_t named = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (named > 1 || (named == 1 && PyUnicode_CompareWithASCIIString(
                                        PyTuple_GET_ITEM(kwnames, 0), "seconds") != 0)) {
        PyErr_SetString(PyExc_TypeError,
                        "seal_request() takes only seconds as a keyword argument");
        return NULL;
    }
    if (nargs + named != 2 && nargs + named != 3) {
        PyErr_Format(PyExc_TypeError, "seal_request() takes 2 or 3 arguments (%zd given)",
                     nargs + named);
        return NULL;
    }
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "seal_request() takes key and message by position");
        return NULL;
    }
    uint32_t seconds;
    if (key_arg(args[0]) < 0 || bytes_arg(args[1], "message") < 0
        || seconds_arg(nargs + named == 3 ? args[2] : Py_None, &seconds) < 0) {
        return NULL;
    }
    size_t size = (size_t)PyBytes_GET_SIZE(args[1]);
    if (size > (size_t)(PY_SSIZE_T_MAX - REQUEST_TRAILER)) {
        return PyErr_NoMemory();
    }
    PyObject *sealed = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(size + REQUEST_TRAILER));
    if (sealed == NULL) {
        return NULL;
    }
    seal_into((unsigned char *)PyBytes_AS_STRING(sealed),
              (const unsigned char *)PyBytes_AS_STRING(args[0]),
              (const unsigned char *)PyBytes_AS_STRING(args[1]), size, seconds);
    return sealed;
}

PyDoc_STRVAR(open_reply_doc,
"open_reply(key, datagram, client_id, stamp, /)\n--\n\n"
"The reply (datagram without its MAC) if its MAC checks for the request\n"
"of client_id sealed at stamp, else None.  The twin of\n"
"domus.wire.auth.open_reply_reference.");

static PyObject *
codec_open_reply(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("open_reply", nargs, 4) < 0 || key_arg(args[0]) < 0
        || bytes_arg(args[1], "datagram") < 0 || bytes_arg(args[2], "client_id") < 0
        || bytes_arg(args[3], "stamp") < 0) {
        return NULL;
    }
    const unsigned char *datagram = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    size_t size = (size_t)PyBytes_GET_SIZE(args[1]);
    if (size < REPLY_TRAILER + 1) {
        Py_RETURN_NONE;
    }
    DomusSip prefix;
    reply_mac_prefix(&prefix, (const unsigned char *)PyBytes_AS_STRING(args[0]), datagram,
                     size - REPLY_TRAILER, (const unsigned char *)PyBytes_AS_STRING(args[2]),
                     (size_t)PyBytes_GET_SIZE(args[2]));
    if (!reply_mac_checks(&prefix, datagram, size,
                          (const unsigned char *)PyBytes_AS_STRING(args[3]),
                          (size_t)PyBytes_GET_SIZE(args[3]))) {
        Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize((const char *)datagram,
                                     (Py_ssize_t)(size - REPLY_TRAILER));
}

PyDoc_STRVAR(open_reply_to_doc,
"open_reply_to(key, datagram, request, stamps, /)\n--\n\n"
"The reply to request (unsealed) if its MAC checks for one of the\n"
"request's tries, sealed at stamps (a list or tuple of bytes, the newest\n"
"tried first), else None.  The twin of\n"
"domus.wire.auth.open_reply_to_reference.");

static PyObject *
codec_open_reply_to(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("open_reply_to", nargs, 4) < 0 || key_arg(args[0]) < 0
        || bytes_arg(args[1], "datagram") < 0 || bytes_arg(args[2], "request") < 0) {
        return NULL;
    }
    PyObject *stamps = args[3];
    if (!PyList_Check(stamps) && !PyTuple_Check(stamps)) {
        PyErr_Format(PyExc_TypeError, "stamps must be a list or a tuple of bytes, not %.100s",
                     Py_TYPE(stamps)->tp_name);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(stamps);
    PyObject **items = PySequence_Fast_ITEMS(stamps);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (bytes_arg(items[i], "a stamp") < 0) {
            return NULL;
        }
    }
    const unsigned char *datagram = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    size_t size = (size_t)PyBytes_GET_SIZE(args[1]);
    if (size < REPLY_TRAILER + 1) {
        Py_RETURN_NONE;
    }
    const unsigned char *client_id;
    size_t client_id_size;
    client_id_of((const unsigned char *)PyBytes_AS_STRING(args[2]),
                 (size_t)PyBytes_GET_SIZE(args[2]), &client_id, &client_id_size);
    DomusSip prefix;
    reply_mac_prefix(&prefix, (const unsigned char *)PyBytes_AS_STRING(args[0]), datagram,
                     size - REPLY_TRAILER, client_id, client_id_size);
    for (Py_ssize_t i = count - 1; i >= 0; i--) {
        /* (the list cannot change under us: nothing here runs Python) */
        if (reply_mac_checks(&prefix, datagram, size,
                             (const unsigned char *)PyBytes_AS_STRING(items[i]),
                             (size_t)PyBytes_GET_SIZE(items[i]))) {
            return PyBytes_FromStringAndSize((const char *)datagram,
                                             (Py_ssize_t)(size - REPLY_TRAILER));
        }
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ round trips */

enum { IO_REPLY, IO_TIMEOUT, IO_INTERRUPTED, IO_ERROR };

/* The longest spin roundtrip() accepts. */
#define MAX_SPIN_SECONDS 0.01

/* A request sealed in a buffer of this size or less is sealed on the
 * stack; a larger one in memory of its own. */
#define SMALL_REQUEST 1024

/* Received datagrams land here; one buffer per thread, since the GIL is
 * released while a round trip waits. */
static _Thread_local unsigned char recv_buffer[RECV_BUFFER_SIZE];

/* One round trip: what is sent, and what a datagram must be to be its
 * reply.  Plain: any datagram of REPLY_HEADER_SIZE bytes or more with the
 * request's id (bytes 4..8).  Keyed (a secure deployment): the same of the
 * datagram without its MAC, and the MAC checks for the request's client id
 * and time: what auth.open_reply_to takes, so a forged, unsealed or short
 * datagram is skipped as a stale one is. */
typedef struct {
    const unsigned char *message;       /* as sent (sealed, when keyed) */
    size_t size;
    int keyed;
    const unsigned char *key;           /* SIP_KEY_SIZE bytes, when keyed */
    const unsigned char *client_id;     /* the request's bytes [8, 16) */
    size_t client_id_size;
    const unsigned char *stamp;         /* its time, in its trailer */
} Exchange;

/* The length of the reply in a received datagram of `length` bytes
 * (without its MAC, when keyed), or -1 if the datagram is not the reply to
 * this exchange's request. */
static ssize_t
reply_length(const Exchange *exchange, const unsigned char *datagram, ssize_t length)
{
    ssize_t reply = exchange->keyed ? length - REPLY_TRAILER : length;
    if (reply < REPLY_HEADER_SIZE
        || memcmp(datagram + REQUEST_ID_OFFSET, exchange->message + REQUEST_ID_OFFSET,
                  4) != 0) {
        return -1;
    }
    if (exchange->keyed) {
        DomusSip prefix;
        reply_mac_prefix(&prefix, exchange->key, datagram, (size_t)reply,
                         exchange->client_id, exchange->client_id_size);
        if (!reply_mac_checks(&prefix, datagram, (size_t)length, exchange->stamp,
                              STAMP_SIZE)) {
            return -1;
        }
    }
    return reply;
}

static double
monotonic_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Milliseconds for poll() until deadline, rounded up so that a wake-up
 * never comes before it. */
static int
poll_timeout(double deadline)
{
    double left = deadline - monotonic_seconds();
    if (left <= 0) {
        return 0;
    }
    double milliseconds = left * 1000.0 + 1.0;
    return milliseconds > 3600e3 ? 3600 * 1000 : (int)milliseconds;
}

/* Right after sending, poll the socket for the reply for up to `spin`
 * seconds (never past the deadline), yielding the CPU between polls, before
 * the caller goes to sleep in poll().  A reply that comes back within the
 * spin then costs neither this process a sleep and a wake-up nor the
 * service the work of waking it, which on virtual machines is a large part
 * of a round trip (see docs/architecture.md, "Waiting for a reply").
 * IO_REPLY, IO_INTERRUPTED, IO_ERROR, or IO_TIMEOUT when the spin ran out
 * (datagrams that are not the reply, read meanwhile, are skipped, as in
 * roundtrip_io). */
static int
spin_for_reply(int fd, const Exchange *exchange, double deadline, double spin,
               ssize_t *received, int *error)
{
    double until = monotonic_seconds() + spin;
    if (until > deadline) {
        until = deadline;
    }
    do {
        ssize_t length = recv(fd, recv_buffer, RECV_BUFFER_SIZE, MSG_DONTWAIT);
        if (length >= 0) {
            ssize_t reply = reply_length(exchange, recv_buffer, length);
            if (reply >= 0) {
                *received = reply;
                return IO_REPLY;
            }
            continue;   /* not the reply: look again at once */
        }
        if (errno == EINTR) {
            return IO_INTERRUPTED;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *error = errno;
            return IO_ERROR;
        }
        sched_yield();
    } while (monotonic_seconds() < until);
    return IO_TIMEOUT;
}

/* Send the exchange's message (unless *sent) and receive datagrams until
 * one is its reply (reply_length: the others are stale replies to earlier
 * requests, or not the service's, and are skipped) or the deadline passes.
 * Runs without the GIL: touches no Python object.  Returns IO_REPLY
 * (*received set to the reply's length, at the start of recv_buffer),
 * IO_TIMEOUT, IO_INTERRUPTED (EINTR: the caller runs signal handlers and
 * calls again) or IO_ERROR (*error set). */
static int
roundtrip_io(int fd, const Exchange *exchange, double deadline, double spin, int *sent,
             ssize_t *received, int *error)
{
    for (;;) {
        if (!*sent) {
            ssize_t written = send(fd, exchange->message, exchange->size, MSG_DONTWAIT);
            if (written >= 0) {
                *sent = 1;
                if (spin > 0) {
                    int outcome = spin_for_reply(fd, exchange, deadline, spin, received,
                                                 error);
                    if (outcome != IO_TIMEOUT) {
                        return outcome;
                    }
                    continue;   /* no reply yet: go and sleep for it */
                }
                /* The reply cannot be there yet: wait for it rather than
                 * spend a recv on finding the socket empty. */
                goto wait;
            }
            if (errno == EINTR) {
                return IO_INTERRUPTED;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                *error = errno;
                return IO_ERROR;
            }
        }
        else {
            for (;;) {
                ssize_t length = recv(fd, recv_buffer, RECV_BUFFER_SIZE, MSG_DONTWAIT);
                if (length < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK) {
                        break;
                    }
                    if (errno == EINTR) {
                        return IO_INTERRUPTED;
                    }
                    *error = errno;
                    return IO_ERROR;
                }
                ssize_t reply = reply_length(exchange, recv_buffer, length);
                if (reply >= 0) {
                    *received = reply;
                    return IO_REPLY;
                }
                if (monotonic_seconds() >= deadline) {
                    return IO_TIMEOUT;
                }
            }
        }
    wait:;
        struct pollfd waiting = {fd, *sent ? POLLIN : POLLOUT, 0};
        int ready = poll(&waiting, 1, poll_timeout(deadline));
        if (ready < 0) {
            if (errno == EINTR) {
                return IO_INTERRUPTED;
            }
            *error = errno;
            return IO_ERROR;
        }
        if (ready == 0 && monotonic_seconds() >= deadline) {
            return IO_TIMEOUT;
        }
    }
}

/* Runs the exchange: the reply (a new reference), Py_None on timeout, or
 * NULL with OSError (or a signal handler's exception) set. */
static PyObject *
run_exchange(int fd, const Exchange *exchange, double timeout, double spin)
{
    double deadline = monotonic_seconds() + timeout;
    int sent = 0;
    for (;;) {
        ssize_t received = 0;
        int error = 0, outcome;
        Py_BEGIN_ALLOW_THREADS
        outcome = roundtrip_io(fd, exchange, deadline, sent ? 0.0 : spin, &sent, &received,
                               &error);
        Py_END_ALLOW_THREADS
        switch (outcome) {
        case IO_REPLY:
            return PyBytes_FromStringAndSize((const char *)recv_buffer, received);
        case IO_TIMEOUT:
            Py_RETURN_NONE;
        case IO_INTERRUPTED:
            if (PyErr_CheckSignals() < 0) {
                return NULL;
            }
            continue;
        default:
            errno = error;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
}

PyDoc_STRVAR(roundtrip_doc,
"roundtrip(fd, message, timeout, spin=0.0, key=None, seconds=None, /)\n--\n\n"
"Send message on the connected UDP socket fd and wait up to timeout\n"
"seconds (the GIL released) for the reply with its request id, skipping\n"
"stale replies.  For the first spin seconds (at most 0.01) it polls the\n"
"socket, yielding the CPU between polls, before it sleeps.  With key (a\n"
"secure deployment's 16-byte data key) the message is sent sealed at\n"
"seconds (None: this clock's), as domus.wire.auth.seal_request seals it,\n"
"and only a reply whose MAC checks for it is taken (a forged, unsealed or\n"
"short one is skipped), returned without its MAC.  The reply, or None on\n"
"timeout; OSError (e.g. ConnectionRefusedError) if the socket reports\n"
"one.  domus.client.codec.roundtrip_reference is its twin.");

static PyObject *
codec_roundtrip(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3 || nargs > 6) {
        PyErr_Format(PyExc_TypeError, "roundtrip() takes 3 to 6 arguments (%zd given)", nargs);
        return NULL;
    }
    double spin = 0.0;
    if (nargs >= 4) {
        spin = PyFloat_AsDouble(args[3]);
        if (spin == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
        if (!(spin >= 0.0) || spin > MAX_SPIN_SECONDS) {
            PyErr_SetString(PyExc_ValueError, "spin must be in [0, 0.01] seconds");
            return NULL;
        }
    }
    uint64_t fd;
    if (unsigned_arg(args[0], INT_MAX, "fd", &fd) < 0 || bytes_arg(args[1], "message") < 0) {
        return NULL;
    }
    double timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (!(timeout >= 0.0) || timeout > 1e6) {
        PyErr_SetString(PyExc_ValueError, "timeout must be in [0, 1e6] seconds");
        return NULL;
    }
    PyObject *message = args[1];
    if (PyBytes_GET_SIZE(message) < REQUEST_ID_OFFSET + 4) {
        PyErr_SetString(PyExc_ValueError, "a request has at least 8 bytes");
        return NULL;
    }
    PyObject *key = nargs >= 5 ? args[4] : Py_None;
    PyObject *when = nargs >= 6 ? args[5] : Py_None;
    uint32_t seconds = 0;
    if ((key != Py_None && key_arg(key) < 0)
        || ((key != Py_None || when != Py_None) && seconds_arg(when, &seconds) < 0)) {
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(message);
    size_t size = (size_t)PyBytes_GET_SIZE(message);
    Exchange exchange = {data, size, 0, NULL, NULL, 0, NULL};
    if (key == Py_None) {
        return run_exchange((int)fd, &exchange, timeout, spin);
    }
    /* Sealed here, then sent: the request with its time and MAC. */
    unsigned char small[SMALL_REQUEST];
    unsigned char *sealed = small;
    if (size > SMALL_REQUEST - REQUEST_TRAILER) {
        if (size > (size_t)(PY_SSIZE_T_MAX - REQUEST_TRAILER)) {
            return PyErr_NoMemory();
        }
        sealed = PyMem_Malloc(size + REQUEST_TRAILER);
        if (sealed == NULL) {
            return PyErr_NoMemory();
        }
    }
    const unsigned char *key_bytes = (const unsigned char *)PyBytes_AS_STRING(key);
    seal_into(sealed, key_bytes, data, size, seconds);
    exchange.message = sealed;
    exchange.size = size + REQUEST_TRAILER;
    exchange.keyed = 1;
    exchange.key = key_bytes;
    client_id_of(data, size, &exchange.client_id, &exchange.client_id_size);
    exchange.stamp = sealed + size;
    /* (message and key stay alive meanwhile: the caller holds them) */
    PyObject *reply = run_exchange((int)fd, &exchange, timeout, spin);
    if (sealed != small) {
        PyMem_Free(sealed);
    }
    return reply;
}

/* ------------------------------------------------------- bytes to fill */

/* A writable buffer over a new bytes object's own storage, holding the
 * bytes: what bytes_to_fill hands out for a receive to fill in place. */
typedef struct {
    PyObject_HEAD
    PyObject *bytes;
} Filling;

static int
filling_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    PyObject *bytes = ((Filling *)self)->bytes;
    return PyBuffer_FillInfo(view, self, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes),
                             0, flags);
}

static void
filling_dealloc(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    Py_CLEAR(((Filling *)self)->bytes);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyType_Slot filling_slots[] = {
    {Py_bf_getbuffer, filling_getbuffer},
    {Py_tp_dealloc, filling_dealloc},
    {Py_tp_doc, "A writable buffer over the bytes bytes_to_fill made (see there)."},
    {0, NULL}
};

static PyType_Spec filling_spec = {
    .name = "domus._codec.Filling",
    .basicsize = sizeof(Filling),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = filling_slots,
};

PyDoc_STRVAR(bytes_to_fill_doc,
"bytes_to_fill(size) -> (bytes, buffer)\n\n"
"A new bytes object of `size` bytes, not yet written, and a writable buffer\n"
"over those same bytes (it keeps them alive): a large value received piece\n"
"by piece (recv_into) lands in the bytes object handed to the caller, with\n"
"no copy after, and each piece can be hashed as it comes.  The bytes must\n"
"not be used, nor hashed (hash() caches), before they are all written.");

static PyObject *
codec_bytes_to_fill(PyObject *module, PyObject *arg)
{
    Py_ssize_t size = PyLong_AsSsize_t(arg);
    if (size < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "bytes_to_fill: size must be >= 0");
        }
        return NULL;
    }
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, size);
    if (bytes == NULL) {
        return NULL;
    }
    PyTypeObject *type = get_state(module)->Filling;
    Filling *filling = PyObject_New(Filling, type);
    if (filling == NULL) {
        Py_DECREF(bytes);
        return NULL;
    }
    filling->bytes = Py_NewRef(bytes);
    return Py_BuildValue("(NN)", bytes, (PyObject *)filling);
}

/* ------------------------------------------------------------ the module */

static PyMethodDef codec_methods[] = {
    {"encode_key", (PyCFunction)codec_encode_key, METH_O, encode_key_doc},
    {"encode_keys", (PyCFunction)codec_encode_keys, METH_O, encode_keys_doc},
    {"bucket_of", (PyCFunction)(void (*)(void))codec_bucket_of, METH_FASTCALL, bucket_of_doc},
    {"keyed", (PyCFunction)(void (*)(void))codec_keyed, METH_FASTCALL, keyed_doc},
    {"put_many_requests", (PyCFunction)(void (*)(void))codec_put_many_requests, METH_FASTCALL,
     put_many_requests_doc},
    {"get_many_requests", (PyCFunction)(void (*)(void))codec_get_many_requests, METH_FASTCALL,
     get_many_requests_doc},
    {"decode_get_many_reply", (PyCFunction)codec_decode_get_many_reply, METH_O,
     decode_get_many_reply_doc},
    {"decode_scan_reply", (PyCFunction)codec_decode_scan_reply, METH_O,
     decode_scan_reply_doc},
    {"pack_value", (PyCFunction)codec_pack_value, METH_O, pack_value_doc},
    {"pack_values", (PyCFunction)codec_pack_values, METH_O, pack_values_doc},
    {"unpack_value", (PyCFunction)(void (*)(void))codec_unpack_value, METH_FASTCALL,
     unpack_value_doc},
    {"get_many_take", (PyCFunction)(void (*)(void))codec_get_many_take, METH_FASTCALL,
     get_many_take_doc},
    {"roundtrip", (PyCFunction)(void (*)(void))codec_roundtrip, METH_FASTCALL, roundtrip_doc},
    {"siphash24", (PyCFunction)(void (*)(void))codec_siphash24, METH_FASTCALL, siphash24_doc},
    {"seal_request", (PyCFunction)(void (*)(void))codec_seal_request,
     METH_FASTCALL | METH_KEYWORDS, seal_request_doc},
    {"open_reply", (PyCFunction)(void (*)(void))codec_open_reply, METH_FASTCALL,
     open_reply_doc},
    {"open_reply_to", (PyCFunction)(void (*)(void))codec_open_reply_to, METH_FASTCALL,
     open_reply_to_doc},
    {"bytes_to_fill", (PyCFunction)codec_bytes_to_fill, METH_O, bytes_to_fill_doc},
    {NULL, NULL, 0, NULL}
};

static int
codec_exec(PyObject *module)
{
    codec_state *state = get_state(module);
    PyObject *errors = PyImport_ImportModule("domus.errors");
    if (errors == NULL) {
        return -1;
    }
    state->ProtocolError = PyObject_GetAttrString(errors, "ProtocolError");
    state->KeyTypeError = PyObject_GetAttrString(errors, "KeyTypeError");
    state->KeyTooLarge = PyObject_GetAttrString(errors, "KeyTooLarge");
    state->ValueDecodeError = PyObject_GetAttrString(errors, "ValueDecodeError");
    Py_DECREF(errors);
    if (state->ProtocolError == NULL || state->KeyTypeError == NULL
        || state->KeyTooLarge == NULL || state->ValueDecodeError == NULL) {
        return -1;
    }
    PyObject *values = PyImport_ImportModule("domus.wire.values");
    if (values == NULL) {
        return -1;
    }
    state->pack_value = PyObject_GetAttrString(values, "pack_value");
    state->unpack_value = PyObject_GetAttrString(values, "unpack_value");
    Py_DECREF(values);
    if (state->pack_value == NULL || state->unpack_value == NULL) {
        return -1;
    }
    state->Filling = (PyTypeObject *)PyType_FromModuleAndSpec(module, &filling_spec, NULL);
    if (state->Filling == NULL) {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "HASH_XXH3", HASH_XXH3) < 0
        || PyModule_AddIntConstant(module, "HASH_XXH64", HASH_XXH64) < 0
        || PyModule_AddIntConstant(module, "MAX_KEY_BYTES", MAX_KEY_BYTES) < 0) {
        return -1;
    }
    return 0;
}

static int
codec_traverse(PyObject *module, visitproc visit, void *arg)
{
    codec_state *state = get_state(module);
    Py_VISIT(state->ProtocolError);
    Py_VISIT(state->KeyTypeError);
    Py_VISIT(state->KeyTooLarge);
    Py_VISIT(state->ValueDecodeError);
    Py_VISIT(state->pack_value);
    Py_VISIT(state->unpack_value);
    Py_VISIT(state->Filling);
    return 0;
}

static int
codec_clear(PyObject *module)
{
    codec_state *state = get_state(module);
    Py_CLEAR(state->ProtocolError);
    Py_CLEAR(state->KeyTypeError);
    Py_CLEAR(state->KeyTooLarge);
    Py_CLEAR(state->ValueDecodeError);
    Py_CLEAR(state->pack_value);
    Py_CLEAR(state->unpack_value);
    Py_CLEAR(state->Filling);
    return 0;
}

static void
codec_free(void *module)
{
    codec_clear((PyObject *)module);
}

static PyModuleDef_Slot codec_slots[] = {
    {Py_mod_exec, codec_exec},
    {0, NULL}
};

PyDoc_STRVAR(codec_doc,
"The client's per-request encoding and round trips in C; domus.client.codec holds\n"
"the pure-Python reference of every function and picks one of the two.");

static struct PyModuleDef codec_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "domus._codec",
    .m_doc = codec_doc,
    .m_size = sizeof(codec_state),
    .m_methods = codec_methods,
    .m_slots = codec_slots,
    .m_traverse = codec_traverse,
    .m_clear = codec_clear,
    .m_free = codec_free,
};

PyMODINIT_FUNC
PyInit__codec(void)
{
    return PyModuleDef_Init(&codec_module);
}
