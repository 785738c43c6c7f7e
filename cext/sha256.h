/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), written from the
 * standards, for the C programs that must derive a deployment's data key
 * from its secret (domus.wire.secret.Keys.from_secret) with nothing but a
 * compiler: domus-bench.  The results are those of Python's hashlib and
 * hmac, which tests/unit/test_bench_tools.py holds them to (through
 * `domus-bench --derive-key`).  Not for secrets in long-lived memory: it
 * does not wipe its state.
 */
#ifndef DOMUS_SHA256_H
#define DOMUS_SHA256_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint32_t state[8];
    unsigned char block[64];
    size_t filled;
    uint64_t total;
} DomusSha256;

static const uint32_t domus_sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

#define DOMUS_ROTR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

/* Compresses one 64-byte block into the state. */
static void
domus_sha256_block(DomusSha256 *s, const unsigned char *p)
{
    uint32_t w[64], a, b, c, d, e, f, g, h;
    for (int i = 0; i < 16; i++) {
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16
               | (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    }
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = DOMUS_ROTR32(w[i - 15], 7) ^ DOMUS_ROTR32(w[i - 15], 18)
                      ^ (w[i - 15] >> 3);
        uint32_t s1 = DOMUS_ROTR32(w[i - 2], 17) ^ DOMUS_ROTR32(w[i - 2], 19)
                      ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = s->state[0]; b = s->state[1]; c = s->state[2]; d = s->state[3];
    e = s->state[4]; f = s->state[5]; g = s->state[6]; h = s->state[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (DOMUS_ROTR32(e, 6) ^ DOMUS_ROTR32(e, 11) ^ DOMUS_ROTR32(e, 25))
                      + ((e & f) ^ (~e & g)) + domus_sha256_k[i] + w[i];
        uint32_t t2 = (DOMUS_ROTR32(a, 2) ^ DOMUS_ROTR32(a, 13) ^ DOMUS_ROTR32(a, 22))
                      + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    s->state[0] += a; s->state[1] += b; s->state[2] += c; s->state[3] += d;
    s->state[4] += e; s->state[5] += f; s->state[6] += g; s->state[7] += h;
}

static void
domus_sha256_init(DomusSha256 *s)
{
    static const uint32_t initial[8] = {
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
    };
    memcpy(s->state, initial, sizeof(initial));
    s->filled = 0;
    s->total = 0;
}

/* Takes `length` more bytes. */
static void
domus_sha256_update(DomusSha256 *s, const unsigned char *data, size_t length)
{
    s->total += length;
    while (length > 0) {
        size_t take = 64 - s->filled < length ? 64 - s->filled : length;
        memcpy(s->block + s->filled, data, take);
        s->filled += take;
        data += take;
        length -= take;
        if (s->filled == 64) {
            domus_sha256_block(s, s->block);
            s->filled = 0;
        }
    }
}

/* The 32-byte digest of the bytes taken (the state is spent). */
static void
domus_sha256_final(DomusSha256 *s, unsigned char out[32])
{
    uint64_t bits = s->total * 8;
    unsigned char pad = 0x80, zero = 0, length[8];
    domus_sha256_update(s, &pad, 1);
    while (s->filled != 56) {
        domus_sha256_update(s, &zero, 1);
    }
    for (int i = 0; i < 8; i++) {
        length[i] = (unsigned char)(bits >> (56 - 8 * i));
    }
    domus_sha256_update(s, length, 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(s->state[i] >> 24);
        out[4 * i + 1] = (unsigned char)(s->state[i] >> 16);
        out[4 * i + 2] = (unsigned char)(s->state[i] >> 8);
        out[4 * i + 3] = (unsigned char)s->state[i];
    }
}

/* HMAC-SHA256 of `data` under `key` (any length). */
static void
domus_hmac_sha256(const unsigned char *key, size_t key_length, const unsigned char *data,
                  size_t data_length, unsigned char out[32])
{
    unsigned char block[64], inner[32];
    DomusSha256 s;
    memset(block, 0, sizeof(block));
    if (key_length > 64) {
        domus_sha256_init(&s);
        domus_sha256_update(&s, key, key_length);
        domus_sha256_final(&s, block);
    }
    else {
        memcpy(block, key, key_length);
    }
    for (int i = 0; i < 64; i++) {
        block[i] ^= 0x36;
    }
    domus_sha256_init(&s);
    domus_sha256_update(&s, block, 64);
    domus_sha256_update(&s, data, data_length);
    domus_sha256_final(&s, inner);
    for (int i = 0; i < 64; i++) {
        block[i] ^= 0x36 ^ 0x5c;
    }
    domus_sha256_init(&s);
    domus_sha256_update(&s, block, 64);
    domus_sha256_update(&s, inner, 32);
    domus_sha256_final(&s, out);
}

#endif
