/* domus-bench: a load generator that speaks the Domus data protocol itself
 * (docs/protocol.md), as redis-benchmark or memtier_benchmark do for Redis.
 *
 * A few threads, each with one UDP socket connected to one service and many
 * requests in flight on it (each in a slot: the request id names the slot,
 * so a reply finds its request at once; a late reply to a slot since reused
 * is counted and dropped).  Requests are PUT, GET or a mix, on keys
 * "<prefix><n>" (str keys) for n drawn uniformly or Zipf-distributed from
 * a key space; a PUT's value is a function of its key (its text repeated to
 * the value size; msgpack bin unless --codec raw), so what was written can
 * be checked afterwards by any client.  In a secure deployment every
 * request is sealed (time and SipHash-2-4 MAC under the data key derived
 * from the secret file) and every reply's MAC is checked, as the Python
 * clients do.
 *
 * Closed loop (no --rate): every free slot sends at once; throughput is as
 * fast as the service (or this program) goes.  Open loop (--rate R): the
 * n-th request of a thread is *intended* at start + n / (R / threads), and
 * its latency runs from that intended time, not from when it could be sent:
 * a service that stalls is charged for every request it delayed, not just
 * the one in flight (no coordinated omission).  Latencies go into a
 * log-bucketed histogram (HdrHistogram's layout: 128 sub-buckets per power
 * of two, so any value is reported within 1 %).
 *
 * The bucket -> service map: this program talks to one service, and is told
 * the DHT's id and bucket count (and hash).  With a DHT stored on one
 * service every bucket is there; otherwise --bucket-range FIRST:END keeps
 * to the keys of the buckets that service stores (the key space is then the
 * first --keys such keys).
 *
 * Exit status: 0 done, 1 the service answered nothing, 2 bad arguments
 * or secret.  Everything it prints is derived from what it measured.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../hashes.h"
#include "../sha256.h"
#include "../siphash.h"

#define REQUEST_MAGIC 0xD0
#define REPLY_MAGIC 0xD1
#define PROTOCOL_VERSION 1
#define OP_PUT 0x01
#define OP_GET 0x02
#define ST_OK 0x00
#define ST_NOT_FOUND 0x01
#define ST_BUSY 0x21
#define REQUEST_HEADER 16
#define REPLY_HEADER 8
#define REQUEST_TRAILER 12
#define REPLY_TRAILER 8
#define MAX_DATAGRAM 60000
#define RECV_SIZE 65536
#define BATCH 64
#define SLOT_BITS 12
#define MAX_INFLIGHT (1 << SLOT_BITS)
#define MAX_KEY_TEXT 200
#define STATUSES 256

/* ---------------------------------------------------------------- options */

enum { OPS_PUT, OPS_GET, OPS_MIXED };

typedef struct {
    char service[256];
    uint32_t dht_id;
    int have_dht;
    uint64_t buckets;
    int bucket_bits;
    int hash_xxh64;
    uint64_t range_first, range_end;
    int ops;
    double get_ratio;
    uint64_t keys;
    char prefix[64];
    size_t value_size;
    int codec_raw;
    int zipf;
    double zipf_theta;
    double rate;
    int threads;
    int inflight;
    double seconds;
    double warmup;
    double timeout;
    int preload;
    int json;
    int echo;
    int redis;
    uint64_t seed;
    int secure;
    unsigned char data_key[16];
    char secret_source[512];
} Options;

static Options opt;

static const char *status_name(int status);

static void
die(int status, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fputs("domus-bench: ", stderr);
    vfprintf(stderr, format, args);
    fputc('\n', stderr);
    va_end(args);
    exit(status);
}

/* Monotonic time in nanoseconds. */
static inline uint64_t
mono_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
}

/* The wall clock's seconds modulo 2^32: a request's time (as
 * domus.wire.auth.now_seconds reads it). */
static inline uint32_t
wall_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (uint32_t)now.tv_sec;
}

static inline void
put_u16(unsigned char *p, uint16_t v)
{
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
}

static inline void
put_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static inline uint32_t
get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline void
put_u64(unsigned char *p, uint64_t v)
{
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

static inline uint64_t
get_u64(const unsigned char *p)
{
    return (uint64_t)get_u32(p) << 32 | get_u32(p + 4);
}

/* ------------------------------------------------------------ the secret */

/* Reads the deployment secret as domus.wire.secret.load does (64 hex
 * digits, readable by its owner only, 16 bytes at least) and derives the
 * data key: HMAC-SHA256(secret, "domus data plane v1")[:16].  Exits with
 * status 2 and a message naming the file on any problem. */
static void
load_secret(const char *path, unsigned char key[16])
{
    struct stat info;
    char text[1024];
    unsigned char secret[512], digest[32];
    size_t length = 0, digits = 0;
    FILE *file;

    if (stat(path, &info) != 0) {
        die(2, "the deployment secret file %s: %s; give the one the supervisor made "
               "(<its data dir>/secret) with --secret-file or $DOMUS_SECRET_FILE, or "
               "--insecure for a deployment without one", path, strerror(errno));
    }
    if (info.st_mode & (S_IRWXG | S_IRWXO)) {
        die(2, "the deployment secret file %s may be read by others (mode %o); "
               "`chmod 600 %s`", path, (unsigned)(info.st_mode & 07777), path);
    }
    file = fopen(path, "r");
    if (file == NULL) {
        die(2, "cannot read the deployment secret file %s: %s", path, strerror(errno));
    }
    length = fread(text, 1, sizeof(text) - 1, file);
    fclose(file);
    text[length] = '\0';
    while (length > 0 && (text[length - 1] == '\n' || text[length - 1] == '\r'
                          || text[length - 1] == ' ' || text[length - 1] == '\t')) {
        text[--length] = '\0';
    }
    const char *start = text;
    while (*start == ' ' || *start == '\t' || *start == '\n') {
        start++;
    }
    length = strlen(start);
    if (length == 0 || length % 2 != 0 || length / 2 > sizeof(secret)) {
        die(2, "%s is not a Domus deployment secret (64 hex digits)", path);
    }
    for (digits = 0; digits < length; digits += 2) {
        unsigned int byte;
        if (sscanf(start + digits, "%2x", &byte) != 1
            || strchr("0123456789abcdefABCDEF", start[digits]) == NULL
            || strchr("0123456789abcdefABCDEF", start[digits + 1]) == NULL) {
            die(2, "%s is not a Domus deployment secret (64 hex digits)", path);
        }
        secret[digits / 2] = (unsigned char)byte;
    }
    if (length / 2 < 16) {
        die(2, "the deployment secret in %s is %zu bytes; it needs 16 at least", path,
            length / 2);
    }
    static const char label[] = "domus data plane v1";
    domus_hmac_sha256(secret, length / 2, (const unsigned char *)label, sizeof(label) - 1,
                      digest);
    memcpy(key, digest, 16);
}

/* ---------------------------------------------------------------- keys */

/* "<prefix><index>" as text; returns its length. */
static inline size_t
key_text(uint64_t index, char *out)
{
    size_t prefix = strlen(opt.prefix);
    char digits[24];
    size_t count = 0;
    memcpy(out, opt.prefix, prefix);
    do {
        digits[count++] = (char)('0' + index % 10);
        index /= 10;
    } while (index > 0);
    for (size_t i = 0; i < count; i++) {
        out[prefix + i] = digits[count - 1 - i];
    }
    return prefix + count;
}

/* The encoded key (tag 0x03, UTF-8) of key index `index`; returns its
 * length. */
static inline size_t
encoded_key(uint64_t index, unsigned char *out)
{
    out[0] = 0x03;
    return 1 + key_text(index, (char *)out + 1);
}

static inline uint64_t
bucket_of(const unsigned char *key, size_t length)
{
    uint64_t hash = opt.hash_xxh64 ? domus_xxh64(key, length, 0) : domus_xxh3_64(key, length);
    return opt.bucket_bits == 0 ? 0 : hash >> (64 - opt.bucket_bits);
}

/* The key space: index i of [0, keys) is key number space[i] (the i-th key
 * in the bucket range), or i itself when every bucket is in range. */
static uint64_t *space;

static void
build_space(void)
{
    if (opt.range_first == 0 && opt.range_end == opt.buckets) {
        return;
    }
    unsigned char key[MAX_KEY_TEXT];
    uint64_t found = 0, candidate = 0;
    space = malloc(opt.keys * sizeof(*space));
    if (space == NULL) {
        die(2, "no memory for a key space of %llu keys", (unsigned long long)opt.keys);
    }
    while (found < opt.keys) {
        size_t length = encoded_key(candidate, key);
        uint64_t bucket = bucket_of(key, length);
        if (bucket >= opt.range_first && bucket < opt.range_end) {
            space[found++] = candidate;
        }
        candidate++;
        if (candidate > opt.keys * 1000 + 1000000) {
            die(2, "buckets [%llu, %llu) of %llu hold too few keys to find %llu",
                (unsigned long long)opt.range_first, (unsigned long long)opt.range_end,
                (unsigned long long)opt.buckets, (unsigned long long)opt.keys);
        }
    }
}

static inline uint64_t
key_number(uint64_t index)
{
    return space == NULL ? index : space[index];
}

/* The value of a PUT of key text `text`: the text repeated to
 * opt.value_size bytes, behind a msgpack bin header unless raw.  Returns
 * the bytes written to `out`. */
static size_t
value_of(const char *text, size_t text_length, unsigned char *out)
{
    size_t header = 0, size = opt.value_size;
    if (!opt.codec_raw) {
        if (size < 256) {
            out[0] = 0xc4;
            out[1] = (unsigned char)size;
            header = 2;
        }
        else if (size < 65536) {
            out[0] = 0xc5;
            put_u16(out + 1, (uint16_t)size);
            header = 3;
        }
        else {
            out[0] = 0xc6;
            put_u32(out + 1, (uint32_t)size);
            header = 5;
        }
    }
    for (size_t done = 0; done < size;) {
        size_t take = size - done < text_length ? size - done : text_length;
        memcpy(out + header + done, text, take);
        done += take;
    }
    return header + size;
}

/* --------------------------------------------------------------- random */

typedef struct {
    uint64_t state;
} Random;

/* splitmix64: a fast generator, plenty for choosing keys. */
static inline uint64_t
random_next(Random *r)
{
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline double
random_unit(Random *r)
{
    return (double)(random_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

/* Zipf over [0, n) with exponent theta (< 1), by Gray et al.'s method
 * ("Quickly generating billion-record synthetic databases", 1994), as
 * YCSB's ZipfianGenerator: rank 0 is the most frequent. */
static double zipf_zetan, zipf_alpha, zipf_eta, zipf_half_pow;

static void
zipf_setup(uint64_t n, double theta)
{
    double zeta2 = 1.0 + pow(0.5, theta);
    zipf_zetan = 0.0;
    for (uint64_t i = 1; i <= n; i++) {
        zipf_zetan += 1.0 / pow((double)i, theta);
    }
    zipf_alpha = 1.0 / (1.0 - theta);
    zipf_eta = (1.0 - pow(2.0 / (double)n, 1.0 - theta)) / (1.0 - zeta2 / zipf_zetan);
    zipf_half_pow = 1.0 + pow(0.5, theta);
}

static inline uint64_t
zipf_next(Random *r, uint64_t n)
{
    double u = random_unit(r), uz = u * zipf_zetan;
    if (uz < 1.0) {
        return 0;
    }
    if (uz < zipf_half_pow) {
        return n > 1 ? 1 : 0;
    }
    uint64_t rank = (uint64_t)((double)n * pow(zipf_eta * u - zipf_eta + 1.0, zipf_alpha));
    return rank < n ? rank : n - 1;
}

/* ------------------------------------------------------------ histogram */

/* HdrHistogram's layout: values below 256 ns exactly, then per power of
 * two 128 sub-buckets, so a bucket spans under 1 % of its values. */
#define SUB_BITS 7
#define SUB_COUNT (1 << SUB_BITS)
#define HIST_SIZE (2 * SUB_COUNT + (64 - SUB_BITS - 1) * SUB_COUNT)

typedef struct {
    uint64_t counts[HIST_SIZE];
    uint64_t total, max, min;
    double sum;
} Histogram;

static inline int
hist_index(uint64_t value)
{
    if (value < 2 * SUB_COUNT) {
        return (int)value;
    }
    int top = 63 - __builtin_clzll(value);
    int shift = top - SUB_BITS;
    return 2 * SUB_COUNT + (shift - 1) * SUB_COUNT + (int)((value >> shift) - SUB_COUNT);
}

/* The highest value that lands in bucket `index`. */
static uint64_t
hist_upper(int index)
{
    if (index < 2 * SUB_COUNT) {
        return (uint64_t)index;
    }
    int shift = (index - 2 * SUB_COUNT) / SUB_COUNT + 1;
    uint64_t sub = (uint64_t)((index - 2 * SUB_COUNT) % SUB_COUNT) + SUB_COUNT;
    return ((sub + 1) << shift) - 1;
}

static inline void
hist_record(Histogram *h, uint64_t value)
{
    h->counts[hist_index(value)]++;
    h->total++;
    h->sum += (double)value;
    if (value > h->max) {
        h->max = value;
    }
    if (value < h->min) {
        h->min = value;
    }
}

static void
hist_merge(Histogram *into, const Histogram *from)
{
    for (int i = 0; i < HIST_SIZE; i++) {
        into->counts[i] += from->counts[i];
    }
    into->total += from->total;
    into->sum += from->sum;
    if (from->max > into->max) {
        into->max = from->max;
    }
    if (from->min < into->min) {
        into->min = from->min;
    }
}

/* The value at quantile q (0..1): the upper end of the bucket holding the
 * ceil(q * total)-th value, never more than the largest value recorded. */
static uint64_t
hist_quantile(const Histogram *h, double q)
{
    if (h->total == 0) {
        return 0;
    }
    uint64_t rank = (uint64_t)ceil(q * (double)h->total), seen = 0;
    if (rank < 1) {
        rank = 1;
    }
    for (int i = 0; i < HIST_SIZE; i++) {
        seen += h->counts[i];
        if (seen >= rank) {
            uint64_t upper = hist_upper(i);
            return upper < h->max ? upper : h->max;
        }
    }
    return h->max;
}

/* ---------------------------------------------------------------- threads */

typedef struct {
    int busy;
    int op;
    uint32_t request_id;
    uint64_t key_index;
    uint64_t intended;      /* ns: when it was meant to go (open loop) or went */
    uint64_t sent_at;       /* ns: when it went */
    unsigned char stamp[4];
    size_t length;
    unsigned char *datagram;
    /* --redis: the slot is a TCP connection, one request at a time */
    int fd;
    size_t received;
    unsigned char *reply;
} Slot;

typedef struct {
    int index;
    pthread_t thread;
    int fd;
    Random random;
    unsigned char client_id[8];
    uint32_t sequence;
    Slot *slots;
    int *free_slots;
    int free_count;
    unsigned char *receive;
    Histogram hist;
    uint64_t sent, replies, measured, timeouts, late, bad_mac, bad_reply, busy_replies;
    uint64_t wrong_value, statuses[STATUSES];
    uint64_t unsent;        /* open loop: intended in time, never sent */
    /* preload: key numbers [preload_next, preload_end) still to write, and
     * those whose PUT timed out, to write again */
    uint64_t preload_next, preload_end, preload_done, preload_lost;
    uint64_t *retry;
    size_t retry_count;
} Worker;

static uint64_t run_start, measure_start, measure_end;
static int phase_preload;

static int
connect_service(void)
{
    char host[256], *colon;
    struct addrinfo hints, *found;
    snprintf(host, sizeof(host), "%s", opt.service);
    colon = strrchr(host, ':');
    if (colon == NULL) {
        die(2, "--service %s: give HOST:PORT", opt.service);
    }
    *colon = '\0';
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    int status = getaddrinfo(host, colon + 1, &hints, &found);
    if (status != 0) {
        die(2, "--service %s: %s", opt.service, gai_strerror(status));
    }
    int fd = socket(found->ai_family, SOCK_DGRAM, 0);
    if (fd < 0 || connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
        die(2, "cannot reach %s over UDP: %s", opt.service, strerror(errno));
    }
    freeaddrinfo(found);
    int size = 4 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
    return fd;
}

/* Fills slot `index` with the next request (its op, key and bytes, sealed
 * if secure); returns 0, or -1 when the preload has nothing left to send. */
static int
prepare(Worker *w, int index, uint64_t intended, uint32_t now_seconds)
{
    Slot *slot = &w->slots[index];
    unsigned char *p = slot->datagram, *key;
    char text[MAX_KEY_TEXT];
    uint64_t number;
    int op;

    if (phase_preload) {
        if (w->retry_count > 0) {
            number = w->retry[--w->retry_count];
        }
        else if (w->preload_next < w->preload_end) {
            number = key_number(w->preload_next++);
        }
        else {
            return -1;
        }
        op = OP_PUT;
    }
    else {
        uint64_t index_in_space = opt.zipf ? zipf_next(&w->random, opt.keys)
                                           : random_next(&w->random) % opt.keys;
        number = key_number(index_in_space);
        if (opt.ops == OPS_PUT) {
            op = OP_PUT;
        }
        else if (opt.ops == OPS_GET) {
            op = OP_GET;
        }
        else {
            op = random_unit(&w->random) < opt.get_ratio ? OP_GET : OP_PUT;
        }
    }
    w->sequence++;
    slot->request_id = (w->sequence << SLOT_BITS) | (uint32_t)index;
    slot->op = op;
    slot->key_index = number;
    slot->intended = intended;
    slot->sent_at = mono_ns();
    slot->busy = 1;

    p[0] = REQUEST_MAGIC;
    p[1] = PROTOCOL_VERSION;
    p[2] = (unsigned char)op;
    p[3] = (unsigned char)(opt.bucket_bits + 1);
    put_u32(p + 4, slot->request_id);
    memcpy(p + 8, w->client_id, 8);
    put_u32(p + 16, opt.dht_id);
    key = p + 26;
    key[0] = 0x03;
    size_t text_length = key_text(number, text);
    memcpy(key + 1, text, text_length);
    size_t key_length = text_length + 1;
    put_u32(p + 20, (uint32_t)bucket_of(key, key_length));
    put_u16(p + 24, (uint16_t)key_length);
    size_t length = 26 + key_length;
    if (op == OP_PUT) {
        size_t value_length = value_of(text, text_length, p + length + 4);
        put_u32(p + length, (uint32_t)value_length);
        length += 4 + value_length;
    }
    if (opt.secure && !opt.echo) {
        put_u32(slot->stamp, now_seconds);
        memcpy(p + length, slot->stamp, 4);
        length += 4;
        put_u64(p + length, domus_siphash24(opt.data_key, p, length));
        length += 8;
    }
    slot->length = length;
    return 0;
}

/* Checks and takes one datagram that came back: finds its slot, checks the
 * reply (and its MAC), records its latency. */
static void
take_reply(Worker *w, const unsigned char *data, size_t length, uint64_t now)
{
    if (length < (opt.echo ? REQUEST_HEADER : REPLY_HEADER)) {
        w->bad_reply++;
        return;
    }
    uint32_t request_id = get_u32(data + 4);
    int index = (int)(request_id & (MAX_INFLIGHT - 1));
    if (index >= opt.inflight || !w->slots[index].busy
        || w->slots[index].request_id != request_id) {
        w->late++;
        return;
    }
    Slot *slot = &w->slots[index];
    int refused = 0;            /* a BUSY: not served, not measured */
    if (opt.echo) {
        if (length != slot->length || memcmp(data, slot->datagram, length) != 0) {
            w->bad_reply++;
            return;
        }
    }
    else {
        if (data[0] != REPLY_MAGIC) {
            w->bad_reply++;
            return;
        }
        if (opt.secure) {
            if (length < REPLY_HEADER + REPLY_TRAILER) {
                w->bad_mac++;
                return;
            }
            DomusSip sip;
            domus_sip_init(&sip, opt.data_key);
            domus_sip_update(&sip, data, length - REPLY_TRAILER);
            domus_sip_update(&sip, w->client_id, 8);
            domus_sip_update(&sip, slot->stamp, 4);
            if (domus_sip_final(&sip) != get_u64(data + length - REPLY_TRAILER)) {
                w->bad_mac++;
                return;
            }
            length -= REPLY_TRAILER;
        }
        w->statuses[data[2]]++;
        refused = data[2] == ST_BUSY;
        if (slot->op == OP_GET && data[2] == ST_OK) {
            char text[MAX_KEY_TEXT];
            unsigned char expected[16];
            size_t text_length = key_text(slot->key_index, text);
            /* the value's first bytes, as domus-bench would have written it */
            size_t check = length - REPLY_HEADER;
            size_t header = opt.codec_raw ? 0 : (opt.value_size < 256 ? 2
                                                 : opt.value_size < 65536 ? 3 : 5);
            if (check != header + opt.value_size) {
                w->wrong_value++;
            }
            else {
                size_t sample = opt.value_size < sizeof(expected) ? opt.value_size
                                                                  : sizeof(expected);
                for (size_t i = 0; i < sample; i++) {
                    expected[i] = (unsigned char)text[i % text_length];
                }
                if (memcmp(data + REPLY_HEADER + header, expected, sample) != 0) {
                    w->wrong_value++;
                }
            }
        }
        if (phase_preload) {
            if (data[2] == ST_OK) {
                w->preload_done++;
            }
            else if (data[2] == 0x1A) {           /* MOVING: again, later */
                w->retry[w->retry_count++] = slot->key_index;
            }
            else {
                die(1, "preload: a PUT to %s was answered %s: %.*s", opt.service,
                    status_name(data[2]), (int)(length - REPLY_HEADER), data + REPLY_HEADER);
            }
        }
    }
    w->replies++;
    if (!phase_preload && slot->intended >= measure_start && slot->intended < measure_end) {
        if (refused) {
            /* (the service refused it: the request was not served, and
             * counting its quick refusal as a served request's latency and
             * throughput would flatter an overloaded service) */
            w->busy_replies++;
        }
        else {
            w->measured++;
            hist_record(&w->hist, now > slot->intended ? now - slot->intended : 0);
        }
    }
    slot->busy = 0;
    w->free_slots[w->free_count++] = index;
}

/* Frees the slots whose request has waited longer than the timeout (a
 * lost datagram); a preload's PUT is sent again. */
static void
expire(Worker *w, uint64_t now, uint64_t sent_before)
{
    for (int i = 0; i < opt.inflight; i++) {
        Slot *slot = &w->slots[i];
        if (slot->busy && slot->sent_at < sent_before) {
            slot->busy = 0;
            w->free_slots[w->free_count++] = i;
            if (phase_preload) {
                w->retry[w->retry_count++] = slot->key_index;
                if (++w->preload_lost > 1000 + opt.keys / 10) {
                    die(1, "preload: %s does not answer (%llu PUTs lost)", opt.service,
                        (unsigned long long)w->preload_lost);
                }
            }
            else if (slot->intended >= measure_start && slot->intended < measure_end) {
                w->timeouts++;
            }
        }
    }
    (void)now;
}

/* One thread's run: until `until` (ns), or, preloading, until its keys are
 * all written; then waits for what is in flight (up to the timeout). */
static void
run_phase(Worker *w, uint64_t until, double rate)
{
    struct mmsghdr out[BATCH], in[BATCH];
    struct iovec out_iov[BATCH], in_iov[BATCH];
    uint64_t timeout_ns = (uint64_t)(opt.timeout * 1e9);
    uint64_t interval = rate > 0 ? (uint64_t)(1e9 / rate) : 0;
    uint64_t next_intended = mono_ns() + (interval * (uint64_t)w->index) / (uint64_t)opt.threads;
    uint64_t last_expire = mono_ns();
    int sending = 1;

    for (int i = 0; i < BATCH; i++) {
        memset(&in[i], 0, sizeof(in[i]));
        in_iov[i].iov_base = w->receive + (size_t)i * RECV_SIZE;
        in_iov[i].iov_len = RECV_SIZE;
        in[i].msg_hdr.msg_iov = &in_iov[i];
        in[i].msg_hdr.msg_iovlen = 1;
    }
    for (;;) {
        uint64_t now = mono_ns();
        /* Open loop: every request intended before `until` is sent, late
         * if it must (its latency counts from its intended time), unless
         * the service is a whole timeout behind: the rest is counted
         * unsent.  Closed loop: nothing is sent after `until`. */
        if (sending && (interval > 0 ? next_intended >= until : now >= until)) {
            sending = 0;
        }
        if (sending && interval > 0 && !phase_preload && now >= until + timeout_ns) {
            w->unsent += (until - next_intended) / interval;
            sending = 0;
        }
        if (phase_preload && sending && w->retry_count == 0
            && w->preload_next >= w->preload_end) {
            sending = 0;
        }
        if (!sending && w->free_count == opt.inflight) {
            break;
        }
        if (!sending && now >= until + 2 * timeout_ns && !phase_preload) {
            break;
        }
        /* send what is due */
        int count = 0;
        uint32_t seconds = opt.secure ? wall_seconds() : 0;
        while (sending && count < BATCH && w->free_count > 0
               && (interval == 0 || next_intended <= now)) {
            int index = w->free_slots[w->free_count - 1];
            if (prepare(w, index, interval == 0 ? now : next_intended, seconds) != 0) {
                break;
            }
            w->free_count--;
            next_intended += interval;
            out_iov[count].iov_base = w->slots[index].datagram;
            out_iov[count].iov_len = w->slots[index].length;
            memset(&out[count], 0, sizeof(out[count]));
            out[count].msg_hdr.msg_iov = &out_iov[count];
            out[count].msg_hdr.msg_iovlen = 1;
            count++;
        }
        for (int done = 0; done < count;) {
            int sent = sendmmsg(w->fd, out + done, (unsigned)(count - done), 0);
            if (sent < 0) {
                if (errno == EINTR || errno == EAGAIN || errno == ENOBUFS
                    || errno == ECONNREFUSED) {
                    /* not sent: the slot waits out its timeout as lost */
                    done++;
                    continue;
                }
                die(1, "sending to %s: %s", opt.service, strerror(errno));
            }
            done += sent;
        }
        w->sent += (uint64_t)count;
        /* take what came back */
        int got = recvmmsg(w->fd, in, BATCH, MSG_DONTWAIT, NULL);
        if (got > 0) {
            now = mono_ns();
            for (int i = 0; i < got; i++) {
                take_reply(w, w->receive + (size_t)i * RECV_SIZE, in[i].msg_len, now);
            }
        }
        else if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR
                 && errno != ECONNREFUSED) {
            die(1, "receiving from %s: %s", opt.service, strerror(errno));
        }
        now = mono_ns();
        if (now - last_expire > 10000000ull) {
            if (now > timeout_ns) {
                expire(w, now, now - timeout_ns);
            }
            last_expire = now;
        }
        if (got <= 0 && count == 0) {
            /* nothing to do: wait for a reply, or until the next send is due */
            int wait_ms = 10;
            if (sending && interval > 0 && w->free_count > 0) {
                uint64_t due = next_intended > now ? next_intended - now : 0;
                if (due < 1000000ull) {
                    struct timespec pause = {0, (long)due};
                    struct pollfd ready = {w->fd, POLLIN, 0};
                    ppoll(&ready, 1, &pause, NULL);
                    continue;
                }
                wait_ms = (int)(due / 1000000ull);
                if (wait_ms > 10) {
                    wait_ms = 10;
                }
            }
            struct pollfd ready = {w->fd, POLLIN, 0};
            poll(&ready, 1, wait_ms);
        }
    }
}


/* ------------------------------------------------------------- --redis */

/* With --redis the same key choice, values and clock drive a Redis server
 * (RESP over TCP, as redis-benchmark -P 1 does): each slot is a connection
 * with one request at a time, so --inflight is the connection count, and
 * an open-loop request waits for a free connection with its clock already
 * running, as a Domus request waits for a free slot. */
#define REDIS_REPLY_SIZE (MAX_DATAGRAM + 64)

static int
connect_redis(void)
{
    char host[256], *colon;
    struct addrinfo hints, *found;
    snprintf(host, sizeof(host), "%s", opt.service);
    colon = strrchr(host, ':');
    if (colon == NULL) {
        die(2, "--service %s: give HOST:PORT", opt.service);
    }
    *colon = '\0';
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int status = getaddrinfo(host, colon + 1, &hints, &found);
    if (status != 0) {
        die(2, "--service %s: %s", opt.service, gai_strerror(status));
    }
    int fd = socket(found->ai_family, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
        die(1, "cannot connect to Redis at %s: %s", opt.service, strerror(errno));
    }
    freeaddrinfo(found);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

/* Fills slot `index` with a RESP SET or GET (the same keys and values as
 * the Domus requests, without the key's type tag). */
static int
prepare_redis(Worker *w, int index, uint64_t intended)
{
    Slot *slot = &w->slots[index];
    char text[MAX_KEY_TEXT];
    uint64_t number;
    int op;
    if (phase_preload) {
        if (w->preload_next >= w->preload_end) {
            return -1;
        }
        number = key_number(w->preload_next++);
        op = OP_PUT;
    }
    else {
        uint64_t in_space = opt.zipf ? zipf_next(&w->random, opt.keys)
                                     : random_next(&w->random) % opt.keys;
        number = key_number(in_space);
        op = opt.ops == OPS_PUT ? OP_PUT : opt.ops == OPS_GET ? OP_GET
             : random_unit(&w->random) < opt.get_ratio ? OP_GET : OP_PUT;
    }
    size_t text_length = key_text(number, text);
    char *p = (char *)slot->datagram;
    int n;
    if (op == OP_PUT) {
        n = sprintf(p, "*3\r\n$3\r\nSET\r\n$%zu\r\n", text_length);
        memcpy(p + n, text, text_length);
        n += (int)text_length;
        n += sprintf(p + n, "\r\n$%zu\r\n", opt.value_size);
        for (size_t done = 0; done < opt.value_size;) {
            size_t take = opt.value_size - done < text_length ? opt.value_size - done
                                                              : text_length;
            memcpy(p + n + done, text, take);
            done += take;
        }
        n += (int)opt.value_size;
    }
    else {
        n = sprintf(p, "*2\r\n$3\r\nGET\r\n$%zu\r\n", text_length);
        memcpy(p + n, text, text_length);
        n += (int)text_length;
    }
    memcpy(p + n, "\r\n", 2);
    slot->length = (size_t)n + 2;
    slot->op = op;
    slot->key_index = number;
    slot->intended = intended;
    slot->sent_at = mono_ns();
    slot->received = 0;
    slot->busy = 1;
    return 0;
}

/* The length of the whole RESP reply at the start of `data`, 0 if it has
 * not all come yet, -1 if it is not one redis-benchmark's commands give. */
static long
redis_reply_length(const unsigned char *data, size_t size)
{
    const unsigned char *end = memchr(data, '\n', size);
    if (end == NULL) {
        return 0;
    }
    size_t line = (size_t)(end - data) + 1;
    if (data[0] == '+' || data[0] == '-' || data[0] == ':') {
        return (long)line;
    }
    if (data[0] == '$') {
        long count = strtol((const char *)data + 1, NULL, 10);
        if (count < 0) {
            return (long)line;
        }
        return size >= line + (size_t)count + 2 ? (long)(line + (size_t)count + 2) : 0;
    }
    return -1;
}

static void
run_redis_phase(Worker *w, uint64_t until, double rate)
{
    struct epoll_event events[BATCH];
    uint64_t interval = rate > 0 ? (uint64_t)(1e9 / rate) : 0;
    uint64_t next_intended = mono_ns() + (interval * (uint64_t)w->index) / (uint64_t)opt.threads;
    uint64_t timeout_ns = (uint64_t)(opt.timeout * 1e9);
    int sending = 1;
    int watch = epoll_create1(0);
    if (watch < 0) {
        die(1, "epoll_create1: %s", strerror(errno));
    }
    for (int i = 0; i < opt.inflight; i++) {
        struct epoll_event event = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(watch, EPOLL_CTL_ADD, w->slots[i].fd, &event) != 0) {
            die(1, "epoll_ctl: %s", strerror(errno));
        }
    }
    for (;;) {
        uint64_t now = mono_ns();
        if (sending && ((interval > 0 ? next_intended >= until : now >= until)
                        || (phase_preload && w->preload_next >= w->preload_end))) {
            sending = 0;
        }
        if (sending && interval > 0 && !phase_preload && now >= until + timeout_ns) {
            w->unsent += (until - next_intended) / interval;
            sending = 0;
        }
        if (!sending && (w->free_count == opt.inflight
                         || (!phase_preload && now >= until + 2 * timeout_ns))) {
            break;
        }
        int sent = 0;
        while (sending && w->free_count > 0 && (interval == 0 || next_intended <= now)) {
            int index = w->free_slots[w->free_count - 1];
            if (prepare_redis(w, index, interval == 0 ? now : next_intended) != 0) {
                break;
            }
            w->free_count--;
            next_intended += interval;
            Slot *slot = &w->slots[index];
            for (size_t done = 0; done < slot->length;) {
                ssize_t n = send(slot->fd, slot->datagram + done, slot->length - done,
                                 MSG_NOSIGNAL);
                if (n < 0) {
                    if (errno == EINTR || errno == EAGAIN) {
                        struct pollfd out = {slot->fd, POLLOUT, 0};
                        poll(&out, 1, 100);
                        continue;
                    }
                    die(1, "sending to Redis at %s: %s", opt.service, strerror(errno));
                }
                done += (size_t)n;
            }
            sent++;
        }
        w->sent += (uint64_t)sent;
        /* Wait for a reply or the next send, to the nanosecond (ppoll on
         * the epoll descriptor), as the Domus path does: epoll_wait's
         * millisecond timeout of 0 for a send due within a millisecond
         * would spin, and a spinning client sees replies sooner than a
         * sleeping one, which would make the two curves unlike. */
        uint64_t wait_ns = 10000000ull;
        if (sending && interval > 0 && w->free_count > 0) {
            uint64_t due = next_intended > now ? next_intended - now : 0;
            if (due < wait_ns) {
                wait_ns = due;
            }
        }
        int ready = epoll_wait(watch, events, BATCH, 0);
        if (ready == 0 && wait_ns > 0) {
            struct timespec pause = {(time_t)(wait_ns / 1000000000ull),
                                     (long)(wait_ns % 1000000000ull)};
            struct pollfd readable = {watch, POLLIN, 0};
            ppoll(&readable, 1, &pause, NULL);
            ready = epoll_wait(watch, events, BATCH, 0);
        }
        if (ready <= 0) {
            continue;
        }
        now = mono_ns();
        for (int i = 0; i < ready; i++) {
            int index = (int)events[i].data.u32;
            Slot *slot = &w->slots[index];
            if (!slot->busy) {
                die(1, "Redis at %s sent what was not asked", opt.service);
            }
            ssize_t n = recv(slot->fd, slot->reply + slot->received,
                             REDIS_REPLY_SIZE - slot->received, MSG_DONTWAIT);
            if (n <= 0) {
                if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
                    continue;
                }
                die(1, "Redis at %s closed a connection", opt.service);
            }
            slot->received += (size_t)n;
            long whole = redis_reply_length(slot->reply, slot->received);
            if (whole == 0) {
                continue;
            }
            if (whole < 0 || slot->reply[0] == '-') {
                w->bad_reply++;
            }
            else if (slot->op == OP_GET && slot->reply[0] == '$' && slot->reply[1] == '-') {
                w->statuses[ST_NOT_FOUND]++;
            }
            else {
                w->statuses[ST_OK]++;
            }
            w->replies++;
            if (phase_preload) {
                w->preload_done++;
            }
            else if (slot->intended >= measure_start && slot->intended < measure_end) {
                w->measured++;
                hist_record(&w->hist, now > slot->intended ? now - slot->intended : 0);
            }
            slot->busy = 0;
            w->free_slots[w->free_count++] = index;
        }
    }
    for (int i = 0; i < opt.inflight; i++) {
        Slot *slot = &w->slots[i];
        if (slot->busy && slot->intended >= measure_start && slot->intended < measure_end) {
            w->timeouts++;          /* unanswered when the run ended */
        }
    }
    close(watch);
}

static void *
preload_thread(void *argument)
{
    Worker *w = argument;
    if (opt.redis) {
        run_redis_phase(w, UINT64_MAX, 0);
    }
    else {
        run_phase(w, UINT64_MAX, 0);
    }
    return NULL;
}

static void *
measure_thread(void *argument)
{
    Worker *w = argument;
    if (opt.redis) {
        run_redis_phase(w, measure_end, opt.rate / opt.threads);
    }
    else {
        run_phase(w, measure_end, opt.rate / opt.threads);
    }
    return NULL;
}

/* --------------------------------------------------------------- output */

static const char *
status_name(int status)
{
    static const struct {
        int code;
        const char *name;
    } names[] = {
        {0x00, "OK"}, {0x01, "NOT_FOUND"}, {0x10, "MALFORMED"}, {0x11, "BAD_VERSION"},
        {0x12, "UNKNOWN_OP"}, {0x13, "UNKNOWN_DHT"}, {0x14, "NOT_OWNER"},
        {0x15, "TOO_LARGE"}, {0x16, "INACTIVE"}, {0x17, "STORAGE_ERROR"},
        {0x18, "REPLY_TOO_LARGE"}, {0x19, "UNSUPPORTED"}, {0x1A, "MOVING"},
        {0x1B, "STALE_LAYOUT"}, {0x1C, "DATA_LOST"}, {0x1D, "STALE_REQUEST"},
        {0x1E, "STORAGE_FULL"}, {0x1F, "INTERNAL"}, {0x20, "CONTROL_ERROR"},
        {0x21, "BUSY"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (names[i].code == status) {
            return names[i].name;
        }
    }
    return "UNKNOWN";
}

static void
usage(FILE *out)
{
    fputs(
        "usage: domus-bench --service HOST:PORT --dht-id ID [options]\n"
        "  A load generator speaking the Domus data protocol (UDP) to one service.\n"
        "  --service HOST:PORT   the service (its UDP port)\n"
        "  --dht-id ID           the DHT's id (`domus dht info NAME` shows it)\n"
        "  --buckets B           the DHT's bucket count, a power of two (default 1)\n"
        "  --hash xxh3|xxh64     the DHT's hash function (default xxh3)\n"
        "  --bucket-range F:E    only keys of buckets [F, E), those this service stores\n"
        "                        (default: every bucket, a DHT stored on this service)\n"
        "  --op put|get|mixed    what to send (default put)\n"
        "  --get-ratio R         share of GETs in --op mixed (default 0.9)\n"
        "  --keys N              the key space: keys <prefix>0 .. (default 100000)\n"
        "  --key-prefix P        (default \"bench:\")\n"
        "  --value-size N        bytes of each PUT's value (default 64)\n"
        "  --codec msgpack|raw   a DHT's codec: msgpack wraps values as bin (default)\n"
        "  --distribution uniform|zipf  (default uniform)\n"
        "  --zipf-theta T        Zipf exponent, 0 < T < 1 (default 0.99)\n"
        "  --rate R              open loop at R requests/s in all (default: closed loop)\n"
        "  --threads T           threads, one socket each (default 1)\n"
        "  --inflight N          requests in flight per thread, <= 4096 (default 32)\n"
        "  --seconds S           measured time (default 5)\n"
        "  --warmup S            unmeasured time first (default 0.5)\n"
        "  --timeout S           a request unanswered this long is lost (default 1)\n"
        "  --preload             PUT every key of the key space once before measuring\n"
        "  --secret-file F       the deployment secret (else $DOMUS_SECRET_FILE,\n"
        "                        else ./domus-data/supervisor/secret if it exists)\n"
        "  --insecure            no secret: a deployment run --insecure\n"
        "  --echo                the service echoes datagrams (domus-udp-echo)\n"
        "  --redis               the service is a Redis server: SET/GET over TCP, one\n"
        "                        connection per --inflight, one request at a time each\n"
        "  --seed N              of the key choice (default 1)\n"
        "  --json                print one JSON object instead of text\n"
        "  --derive-key F        print the data key of secret file F (hex) and exit\n",
        out);
}

static double
number_argument(const char *name, const char *text)
{
    char *end;
    errno = 0;
    double value = strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !isfinite(value)) {
        die(2, "%s %s: not a number", name, text);
    }
    return value;
}

static void
parse(int argc, char **argv)
{
    const char *secret_file = NULL;
    int insecure = 0;
    memset(&opt, 0, sizeof(opt));
    opt.buckets = 1;
    opt.range_end = UINT64_MAX;
    opt.ops = OPS_PUT;
    opt.get_ratio = 0.9;
    opt.keys = 100000;
    snprintf(opt.prefix, sizeof(opt.prefix), "bench:");
    opt.value_size = 64;
    opt.zipf_theta = 0.99;
    opt.threads = 1;
    opt.inflight = 32;
    opt.seconds = 5;
    opt.warmup = 0.5;
    opt.timeout = 1;
    opt.seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *name = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
#define NEEDS_VALUE() do { if (value == NULL) die(2, "%s needs a value", name); i++; } while (0)
        if (!strcmp(name, "-h") || !strcmp(name, "--help")) {
            usage(stdout);
            exit(0);
        }
        else if (!strcmp(name, "--service")) {
            NEEDS_VALUE();
            snprintf(opt.service, sizeof(opt.service), "%s", value);
        }
        else if (!strcmp(name, "--dht-id")) {
            NEEDS_VALUE();
            double id = number_argument(name, value);
            if (id < 0 || id > 4294967295.0 || id != floor(id)) {
                die(2, "--dht-id %s: a DHT id is an integer in [0, 2^32)", value);
            }
            opt.dht_id = (uint32_t)id;
            opt.have_dht = 1;
        }
        else if (!strcmp(name, "--buckets")) {
            NEEDS_VALUE();
            double count = number_argument(name, value);
            if (count < 1 || count > 4294967296.0 || count != floor(count)
                || ((uint64_t)count & ((uint64_t)count - 1)) != 0) {
                die(2, "--buckets %s: a bucket count is a power of two, 1 to 2^32", value);
            }
            opt.buckets = (uint64_t)count;
        }
        else if (!strcmp(name, "--hash")) {
            NEEDS_VALUE();
            if (!strcmp(value, "xxh64")) {
                opt.hash_xxh64 = 1;
            }
            else if (strcmp(value, "xxh3") != 0) {
                die(2, "--hash %s: domus-bench knows xxh3 and xxh64", value);
            }
        }
        else if (!strcmp(name, "--bucket-range")) {
            NEEDS_VALUE();
            unsigned long long first, end;
            char extra;
            if (sscanf(value, "%llu:%llu%c", &first, &end, &extra) != 2 || first >= end) {
                die(2, "--bucket-range %s: give FIRST:END with FIRST < END", value);
            }
            opt.range_first = first;
            opt.range_end = end;
        }
        else if (!strcmp(name, "--op")) {
            NEEDS_VALUE();
            if (!strcmp(value, "put")) {
                opt.ops = OPS_PUT;
            }
            else if (!strcmp(value, "get")) {
                opt.ops = OPS_GET;
            }
            else if (!strcmp(value, "mixed")) {
                opt.ops = OPS_MIXED;
            }
            else {
                die(2, "--op %s: put, get or mixed", value);
            }
        }
        else if (!strcmp(name, "--get-ratio")) {
            NEEDS_VALUE();
            opt.get_ratio = number_argument(name, value);
            if (opt.get_ratio < 0 || opt.get_ratio > 1) {
                die(2, "--get-ratio %s: between 0 and 1", value);
            }
        }
        else if (!strcmp(name, "--keys")) {
            NEEDS_VALUE();
            double keys = number_argument(name, value);
            if (keys < 1 || keys > 1e10 || keys != floor(keys)) {
                die(2, "--keys %s: a whole number of keys, 1 or more", value);
            }
            opt.keys = (uint64_t)keys;
        }
        else if (!strcmp(name, "--key-prefix")) {
            NEEDS_VALUE();
            if (strlen(value) >= sizeof(opt.prefix)) {
                die(2, "--key-prefix: at most %zu bytes", sizeof(opt.prefix) - 1);
            }
            snprintf(opt.prefix, sizeof(opt.prefix), "%s", value);
        }
        else if (!strcmp(name, "--value-size")) {
            NEEDS_VALUE();
            double size = number_argument(name, value);
            if (size < 0 || size != floor(size) || size > 59000) {
                die(2, "--value-size %s: 0 to 59000 bytes (a value must fit a datagram; "
                       "larger values go over TCP, which domus-bench does not speak)", value);
            }
            opt.value_size = (size_t)size;
        }
        else if (!strcmp(name, "--codec")) {
            NEEDS_VALUE();
            if (!strcmp(value, "raw")) {
                opt.codec_raw = 1;
            }
            else if (strcmp(value, "msgpack") != 0) {
                die(2, "--codec %s: msgpack or raw (values are bytes either way)", value);
            }
        }
        else if (!strcmp(name, "--distribution")) {
            NEEDS_VALUE();
            if (!strcmp(value, "zipf")) {
                opt.zipf = 1;
            }
            else if (strcmp(value, "uniform") != 0) {
                die(2, "--distribution %s: uniform or zipf", value);
            }
        }
        else if (!strcmp(name, "--zipf-theta")) {
            NEEDS_VALUE();
            opt.zipf_theta = number_argument(name, value);
            if (opt.zipf_theta <= 0 || opt.zipf_theta >= 1) {
                die(2, "--zipf-theta %s: between 0 and 1, both excluded", value);
            }
        }
        else if (!strcmp(name, "--rate")) {
            NEEDS_VALUE();
            opt.rate = number_argument(name, value);
            if (opt.rate <= 0) {
                die(2, "--rate %s: requests per second, more than 0", value);
            }
        }
        else if (!strcmp(name, "--threads")) {
            NEEDS_VALUE();
            double threads = number_argument(name, value);
            if (threads < 1 || threads > 256 || threads != floor(threads)) {
                die(2, "--threads %s: 1 to 256", value);
            }
            opt.threads = (int)threads;
        }
        else if (!strcmp(name, "--inflight")) {
            NEEDS_VALUE();
            double inflight = number_argument(name, value);
            if (inflight < 1 || inflight > MAX_INFLIGHT || inflight != floor(inflight)) {
                die(2, "--inflight %s: 1 to %d per thread", value, MAX_INFLIGHT);
            }
            opt.inflight = (int)inflight;
        }
        else if (!strcmp(name, "--seconds")) {
            NEEDS_VALUE();
            opt.seconds = number_argument(name, value);
            if (opt.seconds <= 0) {
                die(2, "--seconds %s: more than 0", value);
            }
        }
        else if (!strcmp(name, "--warmup")) {
            NEEDS_VALUE();
            opt.warmup = number_argument(name, value);
            if (opt.warmup < 0) {
                die(2, "--warmup %s: 0 or more", value);
            }
        }
        else if (!strcmp(name, "--timeout")) {
            NEEDS_VALUE();
            opt.timeout = number_argument(name, value);
            if (opt.timeout <= 0) {
                die(2, "--timeout %s: more than 0", value);
            }
        }
        else if (!strcmp(name, "--seed")) {
            NEEDS_VALUE();
            opt.seed = (uint64_t)number_argument(name, value);
        }
        else if (!strcmp(name, "--secret-file")) {
            NEEDS_VALUE();
            secret_file = value;
        }
        else if (!strcmp(name, "--derive-key")) {
            NEEDS_VALUE();
            unsigned char key[16];
            load_secret(value, key);
            for (int k = 0; k < 16; k++) {
                printf("%02x", key[k]);
            }
            printf("\n");
            exit(0);
        }
        else if (!strcmp(name, "--insecure")) {
            insecure = 1;
        }
        else if (!strcmp(name, "--preload")) {
            opt.preload = 1;
        }
        else if (!strcmp(name, "--json")) {
            opt.json = 1;
        }
        else if (!strcmp(name, "--echo")) {
            opt.echo = 1;
        }
        else if (!strcmp(name, "--redis")) {
            opt.redis = 1;
        }
        else {
            usage(stderr);
            die(2, "unknown argument %s", name);
        }
#undef NEEDS_VALUE
    }
    if (opt.service[0] == '\0') {
        usage(stderr);
        die(2, "--service HOST:PORT is required");
    }
    if (opt.redis && opt.echo) {
        die(2, "--redis and --echo: give one");
    }
    if (opt.redis) {
        opt.echo = 0;
        insecure = 1;               /* Redis has no Domus secret */
        secret_file = NULL;
        opt.have_dht = 1;
    }
    if (!opt.have_dht && !opt.echo) {
        die(2, "--dht-id is required (`domus dht info NAME` shows a DHT's id)");
    }
    opt.bucket_bits = __builtin_ctzll(opt.buckets);
    if (opt.range_end == UINT64_MAX) {
        opt.range_end = opt.buckets;
    }
    if (opt.range_end > opt.buckets) {
        die(2, "--bucket-range: the DHT has %llu buckets", (unsigned long long)opt.buckets);
    }
    if (opt.inflight > MAX_INFLIGHT) {
        die(2, "--inflight: at most %d", MAX_INFLIGHT);
    }
    if (strlen(opt.prefix) + 21 + 1 > MAX_KEY_TEXT) {
        die(2, "--key-prefix too long");
    }
    if (secret_file != NULL && insecure) {
        die(2, "--secret-file and --insecure: give one");
    }
    if (!insecure && !opt.echo) {
        const char *path = secret_file;
        if (path == NULL) {
            const char *named = getenv("DOMUS_SECRET_FILE");
            if (named != NULL && named[0] != '\0') {
                path = named;
            }
            else if (access("domus-data/supervisor/secret", F_OK) == 0) {
                path = "domus-data/supervisor/secret";
            }
        }
        if (path == NULL) {
            die(2, "no deployment secret: give --secret-file (or $DOMUS_SECRET_FILE), "
                   "or --insecure for a deployment run without one");
        }
        load_secret(path, opt.data_key);
        opt.secure = 1;
        snprintf(opt.secret_source, sizeof(opt.secret_source), "%s", path);
    }
}

static void
json_string(const char *text)
{
    putchar('"');
    for (const char *p = text; *p; p++) {
        if (*p == '"' || *p == '\\') {
            printf("\\%c", *p);
        }
        else if ((unsigned char)*p < 0x20) {
            printf("\\u%04x", *p);
        }
        else {
            putchar(*p);
        }
    }
    putchar('"');
}

int
main(int argc, char **argv)
{
    parse(argc, argv);
    build_space();
    if (opt.zipf) {
        zipf_setup(opt.keys, opt.zipf_theta);
    }
    size_t datagram_size = REQUEST_HEADER + 14 + MAX_KEY_TEXT + 8 + opt.value_size
                           + REQUEST_TRAILER;
    if (datagram_size > MAX_DATAGRAM) {
        die(2, "--value-size %zu makes datagrams over %d bytes", opt.value_size, MAX_DATAGRAM);
    }
    Worker *workers = calloc((size_t)opt.threads, sizeof(Worker));
    if (workers == NULL) {
        die(2, "no memory");
    }
    uint64_t per_thread = opt.keys / (uint64_t)opt.threads;
    for (int t = 0; t < opt.threads; t++) {
        Worker *w = &workers[t];
        w->index = t;
        w->fd = opt.redis ? -1 : connect_service();
        w->random.state = opt.seed * 0x9E3779B97F4A7C15ull + (uint64_t)t;
        uint64_t id = random_next(&w->random) ^ mono_ns();
        Random id_random = {id ^ (uint64_t)getpid() << 32 ^ (uint64_t)t};
        put_u64(w->client_id, random_next(&id_random));
        w->slots = calloc((size_t)opt.inflight, sizeof(Slot));
        w->free_slots = calloc((size_t)opt.inflight, sizeof(int));
        w->retry = calloc((size_t)opt.inflight, sizeof(uint64_t));
        w->receive = malloc((size_t)BATCH * RECV_SIZE);
        if (!w->slots || !w->free_slots || !w->retry || !w->receive) {
            die(2, "no memory");
        }
        for (int i = 0; i < opt.inflight; i++) {
            w->slots[i].datagram = malloc(datagram_size + 128);
            if (w->slots[i].datagram == NULL) {
                die(2, "no memory");
            }
            if (opt.redis) {
                w->slots[i].fd = connect_redis();
                w->slots[i].reply = malloc(REDIS_REPLY_SIZE);
                if (w->slots[i].reply == NULL) {
                    die(2, "no memory");
                }
            }
            w->free_slots[w->free_count++] = opt.inflight - 1 - i;
        }
        w->hist.min = UINT64_MAX;
        w->preload_next = per_thread * (uint64_t)t;
        w->preload_end = t == opt.threads - 1 ? opt.keys : per_thread * (uint64_t)(t + 1);
    }

    double preload_seconds = 0;
    uint64_t preloaded = 0;
    if (opt.preload && !opt.echo) {
        /* preload_next/end are indices in the key space (prepare maps them) */
        phase_preload = 1;
        uint64_t began = mono_ns();
        for (int t = 0; t < opt.threads; t++) {
            pthread_create(&workers[t].thread, NULL, preload_thread, &workers[t]);
        }
        for (int t = 0; t < opt.threads; t++) {
            pthread_join(workers[t].thread, NULL);
            preloaded += workers[t].preload_done;
        }
        preload_seconds = (double)(mono_ns() - began) / 1e9;
        phase_preload = 0;
        for (int t = 0; t < opt.threads; t++) {
            workers[t].sent = workers[t].replies = 0;
            memset(workers[t].statuses, 0, sizeof(workers[t].statuses));
        }
    }

    run_start = mono_ns();
    measure_start = run_start + (uint64_t)(opt.warmup * 1e9);
    measure_end = measure_start + (uint64_t)(opt.seconds * 1e9);
    for (int t = 0; t < opt.threads; t++) {
        pthread_create(&workers[t].thread, NULL, measure_thread, &workers[t]);
    }
    Histogram total;
    memset(&total, 0, sizeof(total));
    total.min = UINT64_MAX;
    uint64_t sent = 0, replies = 0, measured = 0, timeouts = 0, late = 0, bad_mac = 0;
    uint64_t busy_replies = 0;
    uint64_t bad_reply = 0, wrong = 0, unsent = 0, statuses[STATUSES] = {0};
    for (int t = 0; t < opt.threads; t++) {
        Worker *w = &workers[t];
        pthread_join(w->thread, NULL);
        hist_merge(&total, &w->hist);
        sent += w->sent;
        replies += w->replies;
        measured += w->measured;
        timeouts += w->timeouts;
        late += w->late;
        busy_replies += w->busy_replies;
        bad_mac += w->bad_mac;
        bad_reply += w->bad_reply;
        wrong += w->wrong_value;
        unsent += w->unsent;
        for (int s = 0; s < STATUSES; s++) {
            statuses[s] += w->statuses[s];
        }
    }
    double throughput = (double)measured / opt.seconds;
    const char *op_name = opt.ops == OPS_PUT ? "put" : opt.ops == OPS_GET ? "get" : "mixed";
    double q[] = {0.5, 0.9, 0.99, 0.999};
    const char *q_names[] = {"p50", "p90", "p99", "p99.9"};
    if (opt.json) {
        printf("{\"service\": ");
        json_string(opt.service);
        printf(", \"dht_id\": %u, \"buckets\": %llu, \"op\": \"%s\", \"get_ratio\": %g, "
               "\"keys\": %llu, \"value_size\": %zu, \"distribution\": \"%s\", "
               "\"secure\": %s, \"echo\": %s, \"redis\": %s, \"threads\": %d, "
               "\"inflight\": %d, "
               "\"seconds\": %g, \"warmup\": %g, ",
               opt.dht_id, (unsigned long long)opt.buckets, op_name, opt.get_ratio,
               (unsigned long long)opt.keys, opt.value_size, opt.zipf ? "zipf" : "uniform",
               opt.secure ? "true" : "false", opt.echo ? "true" : "false",
               opt.redis ? "true" : "false", opt.threads,
               opt.inflight, opt.seconds, opt.warmup);
        if (opt.rate > 0) {
            printf("\"target_rate\": %.1f, ", opt.rate);
        }
        else {
            printf("\"target_rate\": null, ");
        }
        printf("\"preloaded\": %llu, \"preload_seconds\": %.3f, ",
               (unsigned long long)preloaded, preload_seconds);
        printf("\"requests\": %llu, \"throughput\": %.1f, \"sent\": %llu, \"replies\": %llu, "
               "\"timeouts\": %llu, \"busy\": %llu, \"late_replies\": %llu, \"bad_mac\": %llu, "
               "\"bad_replies\": %llu, \"wrong_values\": %llu, \"unsent\": %llu, "
               "\"latency_us\": {",
               (unsigned long long)measured, throughput, (unsigned long long)sent,
               (unsigned long long)replies, (unsigned long long)timeouts,
               (unsigned long long)busy_replies, (unsigned long long)late, (unsigned long long)bad_mac,
               (unsigned long long)bad_reply, (unsigned long long)wrong,
               (unsigned long long)unsent);
        for (int i = 0; i < 4; i++) {
            printf("\"%s\": %.1f, ", q_names[i], (double)hist_quantile(&total, q[i]) / 1e3);
        }
        printf("\"max\": %.1f, \"mean\": %.1f}, \"statuses\": {",
               (double)total.max / 1e3,
               total.total ? total.sum / (double)total.total / 1e3 : 0.0);
        int first = 1;
        for (int s = 0; s < STATUSES; s++) {
            if (statuses[s]) {
                printf("%s\"%s\": %llu", first ? "" : ", ", status_name(s),
                       (unsigned long long)statuses[s]);
                first = 0;
            }
        }
        printf("}}\n");
    }
    else {
        printf("domus-bench: %s on %s, DHT %u (%llu buckets), %s%s\n", op_name, opt.service,
               opt.dht_id, (unsigned long long)opt.buckets,
               opt.redis ? "Redis (RESP over TCP)" : opt.echo ? "echo"
               : opt.secure ? "sealed with the secret of " : "insecure",
               opt.secure && !opt.echo ? opt.secret_source : "");
        printf("  keys %llu (%s), values %zu bytes, %d thread(s) x %d in flight, ",
               (unsigned long long)opt.keys, opt.zipf ? "zipf" : "uniform", opt.value_size,
               opt.threads, opt.inflight);
        if (opt.rate > 0) {
            printf("open loop at %.0f/s\n", opt.rate);
        }
        else {
            printf("closed loop\n");
        }
        if (opt.preload) {
            printf("  preloaded %llu keys in %.2f s\n", (unsigned long long)preloaded,
                   preload_seconds);
        }
        printf("  %llu requests served in %.2f s: %.0f requests/s\n",
               (unsigned long long)measured, opt.seconds, throughput);
        if (busy_replies > 0) {
            printf("  refused BUSY (not served, not counted above): %llu\n",
                   (unsigned long long)busy_replies);
        }
        printf("  latency (us): p50 %.1f  p90 %.1f  p99 %.1f  p99.9 %.1f  max %.1f\n",
               (double)hist_quantile(&total, 0.5) / 1e3, (double)hist_quantile(&total, 0.9) / 1e3,
               (double)hist_quantile(&total, 0.99) / 1e3,
               (double)hist_quantile(&total, 0.999) / 1e3, (double)total.max / 1e3);
        printf("  statuses:");
        for (int s = 0; s < STATUSES; s++) {
            if (statuses[s]) {
                printf(" %s %llu", status_name(s), (unsigned long long)statuses[s]);
            }
        }
        printf("\n  lost (timed out) %llu, late replies %llu, bad MACs %llu, bad replies %llu, "
               "wrong values %llu\n", (unsigned long long)timeouts, (unsigned long long)late,
               (unsigned long long)bad_mac, (unsigned long long)bad_reply,
               (unsigned long long)wrong);
        if (unsent > 0) {
            printf("  unsent %llu: the service fell over a timeout behind the rate asked\n",
                   (unsigned long long)unsent);
        }
    }
    return replies == 0 ? 1 : 0;
}
