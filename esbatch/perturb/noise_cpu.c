/* The philox ES noise on the CPU (esbatch/perturb/noise.py has the recipe and the bit-identity argument).
 * Integer arithmetic throughout; the only float operations are (float)z of an int32 (correctly rounded) and a
 * multiplication by 2^-28 (exact), so compiler flags cannot change a value. Built on first use by noise.py. */
#include <stdint.h>
#include <string.h>

static inline void philox4x32_10(uint32_t x[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; ++r) {
        uint64_t p0 = (uint64_t)0xD2511F53u * x[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * x[2];
        uint32_t y0 = (uint32_t)(p1 >> 32) ^ x[1] ^ k0;
        uint32_t y2 = (uint32_t)(p0 >> 32) ^ x[3] ^ k1;
        x[0] = y0; x[1] = (uint32_t)p1; x[2] = y2; x[3] = (uint32_t)p0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
}

static inline float gauss(uint32_t w, const int32_t *table) {
    uint32_t m = w & 0x7FFFFFFFu;
    double dm = (double)m; /* exact (m < 2^31): its exponent field is floor(log2 m) + 1023 */
    uint64_t bits;
    memcpy(&bits, &dm, sizeof bits);
    int k = (int)(bits >> 52) - 1023; /* m = 0: -1023 */
    int sh = k > 10 ? k - 10 : 0;
    uint32_t idx = (m >> sh) + 1025u * (uint32_t)sh;
    int64_t f = (int64_t)(m & ((1u << sh) - 1u));
    int64_t lo = table[idx];
    int64_t d = (int64_t)table[idx + 1] - lo;
    int64_t z = lo + ((d * f) >> sh); /* arithmetic shift (gcc, clang): floor, as in the torch and numpy code */
    int32_t zs = (int32_t)((w >> 31) ? -z : z);
    return (float)zs * 0x1p-28f;
}

/* the lanes of block b that fall in [start, end) */
static void partial(uint64_t b, uint64_t start, uint64_t end, uint32_t k0, uint32_t k1, const int32_t *table,
                    int kind, float *out) {
    uint32_t x[4] = {(uint32_t)b, (uint32_t)(b >> 32), 0u, 0u};
    philox4x32_10(x, k0, k1);
    for (int lane = 0; lane < 4; ++lane) {
        uint64_t i = b * 4 + (uint64_t)lane;
        if (i >= start && i < end) out[i - start] = kind ? ((x[lane] >> 31) ? -1.0f : 1.0f) : gauss(x[lane], table);
    }
}

/* eps of elements start .. start + count - 1 into out; kind 0: gauss, 1: rademacher. */
void esbatch_noise(uint64_t start, int64_t count, uint32_t k0, uint32_t k1, const int32_t *table, int kind,
                   float *out) {
    if (count <= 0) return;
    uint64_t end = start + (uint64_t)count;
    uint64_t first = (start + 3) / 4, last = end / 4; /* whole blocks: first .. last - 1 */
    if (first > last) { /* inside one block */
        partial(start / 4, start, end, k0, k1, table, kind, out);
        return;
    }
    if (start % 4) partial(start / 4, start, end, k0, k1, table, kind, out);
    if (end % 4) partial(last, start, end, k0, k1, table, kind, out);
    float *o = out + (first * 4 - start);
    int64_t n = (int64_t)(last - first);
    /* BATCH blocks at a time, word by word across blocks, so the compiler can vectorize the rounds */
    enum { BATCH = 16 };
    for (int64_t j0 = 0; j0 < n; j0 += BATCH) {
        int nb = n - j0 < BATCH ? (int)(n - j0) : BATCH;
        uint32_t x0[BATCH], x1[BATCH], x2[BATCH], x3[BATCH];
        for (int j = 0; j < BATCH; ++j) {
            uint64_t b = first + (uint64_t)(j0 + j);
            x0[j] = (uint32_t)b; x1[j] = (uint32_t)(b >> 32); x2[j] = 0u; x3[j] = 0u;
        }
        uint32_t r0 = k0, r1 = k1;
        for (int r = 0; r < 10; ++r) {
            for (int j = 0; j < BATCH; ++j) {
                uint64_t p0 = (uint64_t)0xD2511F53u * x0[j];
                uint64_t p1 = (uint64_t)0xCD9E8D57u * x2[j];
                uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1[j] ^ r0;
                uint32_t y2 = (uint32_t)(p0 >> 32) ^ x3[j] ^ r1;
                x0[j] = y0; x1[j] = (uint32_t)p1; x2[j] = y2; x3[j] = (uint32_t)p0;
            }
            r0 += 0x9E3779B9u; r1 += 0xBB67AE85u;
        }
        float *ob = o + 4 * j0;
        if (kind) {
            for (int j = 0; j < nb; ++j) {
                ob[4 * j] = (x0[j] >> 31) ? -1.0f : 1.0f; ob[4 * j + 1] = (x1[j] >> 31) ? -1.0f : 1.0f;
                ob[4 * j + 2] = (x2[j] >> 31) ? -1.0f : 1.0f; ob[4 * j + 3] = (x3[j] >> 31) ? -1.0f : 1.0f;
            }
        } else {
            for (int j = 0; j < nb; ++j) {
                ob[4 * j] = gauss(x0[j], table); ob[4 * j + 1] = gauss(x1[j], table);
                ob[4 * j + 2] = gauss(x2[j], table); ob[4 * j + 3] = gauss(x3[j], table);
            }
        }
    }
}
