/* SipHash-2-4 (Aumasson and Bernstein, "SipHash: a fast short-input PRF",
 * 2012), written from the paper: the MAC of Domus datagrams.  A 16-byte
 * key, any length of input (given in any number of pieces), a 64-bit
 * result; the same value as domus.wire.auth.siphash24_reference, which the
 * tests hold it to (and to the paper's test vectors).
 */
#ifndef DOMUS_SIPHASH_H
#define DOMUS_SIPHASH_H

#include <stddef.h>
#include <stdint.h>

#define DOMUS_SIP_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

#define DOMUS_SIP_ROUND(s)                                                   \
    do {                                                                     \
        (s)->v0 += (s)->v1; (s)->v1 = DOMUS_SIP_ROTL((s)->v1, 13);           \
        (s)->v1 ^= (s)->v0; (s)->v0 = DOMUS_SIP_ROTL((s)->v0, 32);           \
        (s)->v2 += (s)->v3; (s)->v3 = DOMUS_SIP_ROTL((s)->v3, 16);           \
        (s)->v3 ^= (s)->v2;                                                  \
        (s)->v0 += (s)->v3; (s)->v3 = DOMUS_SIP_ROTL((s)->v3, 21);           \
        (s)->v3 ^= (s)->v0;                                                  \
        (s)->v2 += (s)->v1; (s)->v1 = DOMUS_SIP_ROTL((s)->v1, 17);           \
        (s)->v1 ^= (s)->v2; (s)->v2 = DOMUS_SIP_ROTL((s)->v2, 32);           \
    } while (0)

/* A SipHash-2-4 computation under way: the state, the bytes of the word
 * being filled, and the length so far. */
typedef struct {
    uint64_t v0, v1, v2, v3;
    unsigned char word[8];
    size_t filled;
    uint64_t total;
} DomusSip;

/* A little-endian u64 from 8 bytes, whatever their alignment. */
static inline uint64_t
domus_sip_load64(const unsigned char *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16)
           | ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40)
           | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void
domus_sip_init(DomusSip *s, const unsigned char key[16])
{
    uint64_t k0 = domus_sip_load64(key), k1 = domus_sip_load64(key + 8);
    s->v0 = k0 ^ 0x736f6d6570736575ULL;
    s->v1 = k1 ^ 0x646f72616e646f6dULL;
    s->v2 = k0 ^ 0x6c7967656e657261ULL;
    s->v3 = k1 ^ 0x7465646279746573ULL;
    s->filled = 0;
    s->total = 0;
}

static inline void
domus_sip_word(DomusSip *s, uint64_t m)
{
    s->v3 ^= m;
    DOMUS_SIP_ROUND(s);
    DOMUS_SIP_ROUND(s);
    s->v0 ^= m;
}

/* Takes `length` more bytes of the input. */
static inline void
domus_sip_update(DomusSip *s, const unsigned char *data, size_t length)
{
    s->total += length;
    while (length > 0 && s->filled > 0) {
        s->word[s->filled++] = *data++;
        length--;
        if (s->filled == 8) {
            domus_sip_word(s, domus_sip_load64(s->word));
            s->filled = 0;
        }
    }
    for (; length >= 8; data += 8, length -= 8) {
        domus_sip_word(s, domus_sip_load64(data));
    }
    for (; length > 0; length--) {
        s->word[s->filled++] = *data++;
    }
}

/* The MAC of the input taken. */
static inline uint64_t
domus_sip_final(DomusSip *s)
{
    uint64_t last = (uint64_t)(s->total & 0xff) << 56;
    for (size_t i = 0; i < s->filled; i++) {
        last |= (uint64_t)s->word[i] << (8 * i);
    }
    domus_sip_word(s, last);
    s->v2 ^= 0xff;
    DOMUS_SIP_ROUND(s);
    DOMUS_SIP_ROUND(s);
    DOMUS_SIP_ROUND(s);
    DOMUS_SIP_ROUND(s);
    return s->v0 ^ s->v1 ^ s->v2 ^ s->v3;
}

/* SipHash-2-4 of one byte string. */
static inline uint64_t
domus_siphash24(const unsigned char key[16], const unsigned char *data, size_t length)
{
    DomusSip s;
    domus_sip_init(&s, key);
    domus_sip_update(&s, data, length);
    return domus_sip_final(&s);
}

#endif
