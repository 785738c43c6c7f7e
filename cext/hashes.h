/* The two hash functions a DHT can name, written from the published
 * xxHash specification (doc/xxhash_spec.md of the xxHash project), so that
 * the C extensions build with nothing but a compiler and Python's headers:
 *
 *   domus_xxh64(data, size, seed)   XXH64
 *   domus_xxh3_64(data, size)       XXH3, 64-bit, seed 0, default secret
 *
 * Both give exactly the values of the reference implementation (the
 * `xxhash` Python package, which the pure-Python path uses):
 * tests/unit/test_codec.py compares them on every length up to 2,100 bytes
 * and on random inputs.  Inputs are read as little-endian words whatever
 * the machine's byte order, as the specification says.  Every function
 * reads exactly `size` bytes from `data` and nothing else.
 */
#ifndef DOMUS_HASHES_H
#define DOMUS_HASHES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define DOMUS_P32_1 0x9E3779B1U
#define DOMUS_P32_2 0x85EBCA77U
#define DOMUS_P32_3 0xC2B2AE3DU
#define DOMUS_P64_1 0x9E3779B185EBCA87ULL
#define DOMUS_P64_2 0xC2B2AE3D27D4EB4FULL
#define DOMUS_P64_3 0x165667B19E3779F9ULL
#define DOMUS_P64_4 0x85EBCA77C2B2AE63ULL
#define DOMUS_P64_5 0x27D4EB2F165667C5ULL

/* Little-endian reads that need no alignment. */
static inline uint32_t
domus_read32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16
           | (uint32_t)p[3] << 24;
}

static inline uint64_t
domus_read64(const uint8_t *p)
{
    return (uint64_t)domus_read32(p) | (uint64_t)domus_read32(p + 4) << 32;
}

static inline uint64_t
domus_rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t
domus_swap64(uint64_t x)
{
    return ((x << 56) & 0xff00000000000000ULL) | ((x << 40) & 0x00ff000000000000ULL)
           | ((x << 24) & 0x0000ff0000000000ULL) | ((x << 8) & 0x000000ff00000000ULL)
           | ((x >> 8) & 0x00000000ff000000ULL) | ((x >> 24) & 0x0000000000ff0000ULL)
           | ((x >> 40) & 0x000000000000ff00ULL) | ((x >> 56) & 0x00000000000000ffULL);
}

/* ---------------------------------------------------------------- XXH64 */

static inline uint64_t
domus_xxh64_round(uint64_t acc, uint64_t input)
{
    acc += input * DOMUS_P64_2;
    return domus_rotl64(acc, 31) * DOMUS_P64_1;
}

static inline uint64_t
domus_xxh64_merge(uint64_t acc, uint64_t lane)
{
    acc ^= domus_xxh64_round(0, lane);
    return acc * DOMUS_P64_1 + DOMUS_P64_4;
}

static inline uint64_t
domus_xxh64_avalanche(uint64_t h)
{
    h ^= h >> 33;
    h *= DOMUS_P64_2;
    h ^= h >> 29;
    h *= DOMUS_P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t
domus_xxh64(const void *data, size_t size, uint64_t seed)
{
    const uint8_t *p = (const uint8_t *)data;
    const uint8_t *end = p + size;
    uint64_t h;

    if (size >= 32) {
        uint64_t v1 = seed + DOMUS_P64_1 + DOMUS_P64_2, v2 = seed + DOMUS_P64_2;
        uint64_t v3 = seed, v4 = seed - DOMUS_P64_1;
        const uint8_t *limit = end - 32;
        do {
            v1 = domus_xxh64_round(v1, domus_read64(p));
            v2 = domus_xxh64_round(v2, domus_read64(p + 8));
            v3 = domus_xxh64_round(v3, domus_read64(p + 16));
            v4 = domus_xxh64_round(v4, domus_read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = domus_rotl64(v1, 1) + domus_rotl64(v2, 7) + domus_rotl64(v3, 12)
            + domus_rotl64(v4, 18);
        h = domus_xxh64_merge(h, v1);
        h = domus_xxh64_merge(h, v2);
        h = domus_xxh64_merge(h, v3);
        h = domus_xxh64_merge(h, v4);
    }
    else {
        h = seed + DOMUS_P64_5;
    }
    h += (uint64_t)size;
    while (end - p >= 8) {
        h ^= domus_xxh64_round(0, domus_read64(p));
        h = domus_rotl64(h, 27) * DOMUS_P64_1 + DOMUS_P64_4;
        p += 8;
    }
    if (end - p >= 4) {
        h ^= (uint64_t)domus_read32(p) * DOMUS_P64_1;
        h = domus_rotl64(h, 23) * DOMUS_P64_2 + DOMUS_P64_3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)*p * DOMUS_P64_5;
        h = domus_rotl64(h, 11) * DOMUS_P64_1;
        p++;
    }
    return domus_xxh64_avalanche(h);
}

/* ----------------------------------------------------------------- XXH3 */

#define DOMUS_XXH3_SECRET_SIZE 192
#define DOMUS_XXH3_STRIPE 64
#define DOMUS_XXH3_STRIPES_PER_BLOCK ((DOMUS_XXH3_SECRET_SIZE - DOMUS_XXH3_STRIPE) / 8)
#define DOMUS_XXH3_BLOCK (DOMUS_XXH3_STRIPE * DOMUS_XXH3_STRIPES_PER_BLOCK)

/* The specification's default secret. */
static const uint8_t domus_xxh3_secret[DOMUS_XXH3_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c,
    0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb,
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
    0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
    0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97,
    0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
    0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83,
    0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26,
    0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc,
    0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* The 128-bit product of a and b, its two halves xor-ed together. */
static inline uint64_t
domus_mul128_fold64(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__)
    unsigned __int128 product = (unsigned __int128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
#else
    uint64_t a_lo = a & 0xffffffffULL, a_hi = a >> 32;
    uint64_t b_lo = b & 0xffffffffULL, b_hi = b >> 32;
    uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo;
    uint64_t lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xffffffffULL);
    return lower ^ upper;
#endif
}

static inline uint64_t
domus_xxh3_avalanche(uint64_t h)
{
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

static inline uint64_t
domus_xxh3_rrmxmx(uint64_t h, uint64_t size)
{
    h ^= domus_rotl64(h, 49) ^ domus_rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ULL;
    h ^= (h >> 35) + size;
    h *= 0x9FB21C651E98DF25ULL;
    return h ^ (h >> 28);
}

static inline uint64_t
domus_xxh3_mix16(const uint8_t *p, const uint8_t *secret)
{
    return domus_mul128_fold64(domus_read64(p) ^ domus_read64(secret),
                               domus_read64(p + 8) ^ domus_read64(secret + 8));
}

/* One stripe of 64 bytes into the eight accumulators. */
static inline void
domus_xxh3_accumulate(uint64_t acc[8], const uint8_t *p, const uint8_t *secret)
{
    for (int i = 0; i < 8; i++) {
        uint64_t value = domus_read64(p + 8 * i);
        uint64_t keyed = value ^ domus_read64(secret + 8 * i);
        acc[i ^ 1] += value;
        acc[i] += (keyed & 0xffffffffULL) * (keyed >> 32);
    }
}

static inline void
domus_xxh3_scramble(uint64_t acc[8], const uint8_t *secret)
{
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= domus_read64(secret + 8 * i);
        acc[i] = a * DOMUS_P32_1;
    }
}

/* Inputs of more than 240 bytes. */
static inline uint64_t
domus_xxh3_long(const uint8_t *p, size_t size)
{
    const uint8_t *secret = domus_xxh3_secret;
    uint64_t acc[8] = {DOMUS_P32_3, DOMUS_P64_1, DOMUS_P64_2, DOMUS_P64_3,
                       DOMUS_P64_4, DOMUS_P32_2, DOMUS_P64_5, DOMUS_P32_1};
    size_t blocks = (size - 1) / DOMUS_XXH3_BLOCK;

    for (size_t block = 0; block < blocks; block++) {
        const uint8_t *start = p + block * DOMUS_XXH3_BLOCK;
        for (size_t stripe = 0; stripe < DOMUS_XXH3_STRIPES_PER_BLOCK; stripe++) {
            domus_xxh3_accumulate(acc, start + stripe * DOMUS_XXH3_STRIPE, secret + stripe * 8);
        }
        domus_xxh3_scramble(acc, secret + DOMUS_XXH3_SECRET_SIZE - DOMUS_XXH3_STRIPE);
    }
    size_t stripes = ((size - 1) - blocks * DOMUS_XXH3_BLOCK) / DOMUS_XXH3_STRIPE;
    const uint8_t *start = p + blocks * DOMUS_XXH3_BLOCK;
    for (size_t stripe = 0; stripe < stripes; stripe++) {
        domus_xxh3_accumulate(acc, start + stripe * DOMUS_XXH3_STRIPE, secret + stripe * 8);
    }
    domus_xxh3_accumulate(acc, p + size - DOMUS_XXH3_STRIPE,
                          secret + DOMUS_XXH3_SECRET_SIZE - DOMUS_XXH3_STRIPE - 7);

    uint64_t h = (uint64_t)size * DOMUS_P64_1;
    for (int i = 0; i < 4; i++) {
        h += domus_mul128_fold64(acc[2 * i] ^ domus_read64(secret + 11 + 16 * i),
                                 acc[2 * i + 1] ^ domus_read64(secret + 11 + 16 * i + 8));
    }
    return domus_xxh3_avalanche(h);
}

static inline uint64_t
domus_xxh3_64(const void *data, size_t size)
{
    const uint8_t *p = (const uint8_t *)data;
    const uint8_t *secret = domus_xxh3_secret;

    if (size == 0) {
        return domus_xxh64_avalanche(domus_read64(secret + 56) ^ domus_read64(secret + 64));
    }
    if (size <= 3) {
        uint32_t combined = (uint32_t)p[0] << 16 | (uint32_t)p[size >> 1] << 24
                            | (uint32_t)p[size - 1] | (uint32_t)size << 8;
        uint64_t flip = (uint64_t)(domus_read32(secret) ^ domus_read32(secret + 4));
        return domus_xxh64_avalanche((uint64_t)combined ^ flip);
    }
    if (size <= 8) {
        uint64_t flip = domus_read64(secret + 8) ^ domus_read64(secret + 16);
        uint64_t input = domus_read32(p + size - 4) + ((uint64_t)domus_read32(p) << 32);
        return domus_xxh3_rrmxmx(input ^ flip, size);
    }
    if (size <= 16) {
        uint64_t low = domus_read64(p) ^ (domus_read64(secret + 24) ^ domus_read64(secret + 32));
        uint64_t high = domus_read64(p + size - 8)
                        ^ (domus_read64(secret + 40) ^ domus_read64(secret + 48));
        uint64_t acc = size + domus_swap64(low) + high + domus_mul128_fold64(low, high);
        return domus_xxh3_avalanche(acc);
    }
    if (size <= 128) {
        uint64_t acc = (uint64_t)size * DOMUS_P64_1;
        if (size > 32) {
            if (size > 64) {
                if (size > 96) {
                    acc += domus_xxh3_mix16(p + 48, secret + 96);
                    acc += domus_xxh3_mix16(p + size - 64, secret + 112);
                }
                acc += domus_xxh3_mix16(p + 32, secret + 64);
                acc += domus_xxh3_mix16(p + size - 48, secret + 80);
            }
            acc += domus_xxh3_mix16(p + 16, secret + 32);
            acc += domus_xxh3_mix16(p + size - 32, secret + 48);
        }
        acc += domus_xxh3_mix16(p, secret);
        acc += domus_xxh3_mix16(p + size - 16, secret + 16);
        return domus_xxh3_avalanche(acc);
    }
    if (size <= 240) {
        uint64_t acc = (uint64_t)size * DOMUS_P64_1;
        size_t rounds = size / 16;
        for (size_t i = 0; i < 8; i++) {
            acc += domus_xxh3_mix16(p + 16 * i, secret + 16 * i);
        }
        acc = domus_xxh3_avalanche(acc);
        for (size_t i = 8; i < rounds; i++) {
            acc += domus_xxh3_mix16(p + 16 * i, secret + 16 * (i - 8) + 3);
        }
        acc += domus_xxh3_mix16(p + size - 16, secret + 136 - 17);
        return domus_xxh3_avalanche(acc);
    }
    return domus_xxh3_long(p, size);
}

#endif /* DOMUS_HASHES_H */
