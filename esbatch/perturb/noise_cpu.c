/* The philox ES noise on the CPU (esbatch/perturb/noise.py has the recipe, philox.py the eager torch definition
 * these functions reproduce bit for bit). Integer arithmetic throughout; the only float operations are (float)z of
 * an int32 (correctly rounded) and a multiplication by 2^-28 (exact), so compiler flags cannot change a value.
 * Built on first use by esbatch/perturb/cpu_kernel.py (cpu_lib: the system compiler, CPU_FLAGS, no -march) into
 * the user's cache (ESBATCH_NOISE_CACHE, default ~/.cache/esbatch) and loaded with ctypes; jobs.py cuts tensors
 * into calls of the exported functions and runs them over torch's threads.
 *
 * Three paths with the same bits: a portable scalar one, and on x86-64 an AVX2 one (8 Philox blocks per step) and
 * an AVX-512F one (16 per step), each compiled with a function-level target attribute and chosen at run time
 * (__builtin_cpu_supports, esbatch_noise_simd), so one cached binary is safe on every x86-64 CPU that shares the
 * cache folder. A call's `simd` argument caps the path (2 AVX-512, 1 AVX2, 0 scalar; CPU_SIMD,
 * ESBATCH_NOISE_SIMD): the widest allowed path runs first, the next narrower one its remainder, and the scalar
 * path the ragged ends, other CPUs and `simd = 0` (the tests compare every path with the numpy reference). */
#include <stdint.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ESBATCH_AVX2 1
#endif

#define M0 0xD2511F53u
#define M1 0xCD9E8D57u
#define W0 0x9E3779B9u
#define W1 0xBB67AE85u

/* ------------------------------------------------------------------------------------------- scalar */

static inline void philox4x32_10(uint32_t x[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; ++r) {
        uint64_t p0 = (uint64_t)M0 * x[0];
        uint64_t p1 = (uint64_t)M1 * x[2];
        uint32_t y0 = (uint32_t)(p1 >> 32) ^ x[1] ^ k0;
        uint32_t y2 = (uint32_t)(p0 >> 32) ^ x[3] ^ k1;
        x[0] = y0; x[1] = (uint32_t)p1; x[2] = y2; x[3] = (uint32_t)p0;
        k0 += W0; k1 += W1;
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

static inline float rademacher(uint32_t w) { return (w >> 31) ? -1.0f : 1.0f; }

/* the lanes of block b that fall in [start, end) */
static void partial(uint64_t b, uint64_t start, uint64_t end, uint32_t k0, uint32_t k1, const int32_t *table,
                    int kind, float *out) {
    uint32_t x[4] = {(uint32_t)b, (uint32_t)(b >> 32), 0u, 0u};
    philox4x32_10(x, k0, k1);
    for (int lane = 0; lane < 4; ++lane) {
        uint64_t i = b * 4 + (uint64_t)lane;
        if (i >= start && i < end) out[i - start] = kind ? rademacher(x[lane]) : gauss(x[lane], table);
    }
}

/* the 4 * n elements of whole blocks first .. first + n - 1 into o */
static void scalar_blocks(uint64_t first, int64_t n, uint32_t k0, uint32_t k1, const int32_t *table, int kind,
                          float *o) {
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
                uint64_t p0 = (uint64_t)M0 * x0[j];
                uint64_t p1 = (uint64_t)M1 * x2[j];
                uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1[j] ^ r0;
                uint32_t y2 = (uint32_t)(p0 >> 32) ^ x3[j] ^ r1;
                x0[j] = y0; x1[j] = (uint32_t)p1; x2[j] = y2; x3[j] = (uint32_t)p0;
            }
            r0 += W0; r1 += W1;
        }
        float *ob = o + 4 * j0;
        if (kind) {
            for (int j = 0; j < nb; ++j) {
                ob[4 * j] = rademacher(x0[j]); ob[4 * j + 1] = rademacher(x1[j]);
                ob[4 * j + 2] = rademacher(x2[j]); ob[4 * j + 3] = rademacher(x3[j]);
            }
        } else {
            for (int j = 0; j < nb; ++j) {
                ob[4 * j] = gauss(x0[j], table); ob[4 * j + 1] = gauss(x1[j], table);
                ob[4 * j + 2] = gauss(x2[j], table); ob[4 * j + 3] = gauss(x3[j], table);
            }
        }
    }
}

/* --------------------------------------------------------------------------------------------- AVX2 */

#ifdef ESBATCH_AVX2
#define AVX2 __attribute__((target("avx2"))) static inline

/* (hi, lo) words of a * m in each of the 8 lanes: _mm256_mul_epu32 multiplies the even lanes (the low words of
 * the 64-bit lanes), so the odd lanes are shifted down and multiplied separately */
AVX2 void mulhilo8(__m256i a, __m256i m, __m256i *hi, __m256i *lo) {
    __m256i pe = _mm256_mul_epu32(a, m);
    __m256i po = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
    *lo = _mm256_blend_epi32(pe, _mm256_slli_epi64(po, 32), 0xAA);
}

/* eps of 8 words: gauss() lane by lane, with the same integers */
AVX2 __m256 gauss8(__m256i w, const int32_t *table) {
    const __m256i one = _mm256_set1_epi32(1), lo32 = _mm256_set1_epi64x(0xFFFFFFFF);
    __m256i m = _mm256_and_si256(w, _mm256_set1_epi32(0x7FFFFFFF));
    /* octave, exactly: m >> 8 < 2^23 converts to fp32 without rounding, so its exponent field is
     * floor(log2 m) - 8 + 127 for m >= 256 and 0 below; sh = max(floor(log2 m) - 10, 0) = max(field - 129, 0) */
    __m256i e = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_srli_epi32(m, 8))), 23);
    __m256i sh = _mm256_max_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(129)), _mm256_setzero_si256());
    __m256i idx = _mm256_add_epi32(_mm256_srlv_epi32(m, sh), _mm256_add_epi32(_mm256_slli_epi32(sh, 10), sh));
    __m256i fmask = _mm256_sub_epi32(_mm256_sllv_epi32(one, sh), one); /* 2^sh - 1 */
    __m256i f = _mm256_and_si256(m, fmask);
    /* the pairs (T[idx], T[idx + 1]) as 8 scalar 64-bit loads: faster on the Zen 3 this was measured on than two
     * 8-lane vpgatherdd or two 4-lane vpgatherdq (1.1-1.4 against 1.4-2.2 ns per word). Loading elements 0 1 4 5
     * into a and 2 3 6 7 into b makes the even/odd word shuffle below come out in element order. */
    uint32_t ix[8];
    _mm256_storeu_si256((__m256i *)ix, idx);
    int64_t p[8];
    for (int i = 0; i < 8; ++i) memcpy(&p[i], table + ix[i], 8);
    __m256 a = _mm256_castsi256_ps(_mm256_setr_epi64x(p[0], p[1], p[4], p[5]));
    __m256 b = _mm256_castsi256_ps(_mm256_setr_epi64x(p[2], p[3], p[6], p[7]));
    __m256i lo = _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
    __m256i ad = _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
    /* (d * f) >> sh with d = T[idx + 1] - T[idx] (an arithmetic shift of a 64-bit product; AVX2 has no 64-bit
     * arithmetic shift). The table is non-increasing (z falls with m; tests/unit/test_noise.py checks it), so
     * ad = -d >= 0, and with q = ad * f (< 2^26 * 2^20): floor(-q / 2^sh) = -((q + 2^sh - 1) >> sh), a logical
     * shift. ad does not wrap: entries are in [0, 2^31). The 32 x 32 -> 64 products: even lanes, then odd. */
    __m256i qe = _mm256_add_epi64(_mm256_mul_epu32(ad, f), _mm256_and_si256(fmask, lo32));
    __m256i qo = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(ad, 32), _mm256_srli_epi64(f, 32)),
                                  _mm256_srli_epi64(fmask, 32));
    qe = _mm256_srlv_epi64(qe, _mm256_and_si256(sh, lo32));
    qo = _mm256_srlv_epi64(qo, _mm256_srli_epi64(sh, 32)); /* < 2^31: the low word of each 64-bit lane */
    __m256i z = _mm256_sub_epi32(lo, _mm256_blend_epi32(qe, _mm256_slli_epi64(qo, 32), 0xAA));
    __m256i s = _mm256_srai_epi32(w, 31);
    z = _mm256_sub_epi32(_mm256_xor_si256(z, s), s); /* -z where the sign bit is set */
    return _mm256_mul_ps(_mm256_cvtepi32_ps(z), _mm256_set1_ps(0x1p-28f));
}

AVX2 __m256 rademacher8(__m256i w) {
    __m256i sign = _mm256_and_si256(w, _mm256_set1_epi32((int)0x80000000u));
    return _mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_set1_epi32(0x3F800000))); /* +-1.0f */
}

AVX2 __m256 eps8(__m256i w, const int32_t *table, int kind) {
    return kind ? rademacher8(w) : gauss8(w, table);
}

/* blocks first .. first + 8 (n / 8) - 1, 8 per step (block first + j + l in lane l); returns the blocks done.
 * (Two or four groups of 8 interleaved were measured no faster: the rounds are throughput-bound, not latency.) */
__attribute__((target("avx2"))) static int64_t avx2_blocks(uint64_t first, int64_t n, uint32_t k0, uint32_t k1,
                                                           const int32_t *table, int kind, float *o) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), top = _mm256_set1_epi32((int)0x80000000u);
    const __m256i m0 = _mm256_set1_epi32((int)M0), m1 = _mm256_set1_epi32((int)M1);
    int64_t done = n - n % 8;
    for (int64_t j = 0; j < done; j += 8) {
        uint64_t b = first + (uint64_t)j;
        __m256i base = _mm256_set1_epi32((int)(uint32_t)b);
        __m256i x0 = _mm256_add_epi32(base, iota);
        /* the high counter word: +1 in lanes whose low word wrapped (unsigned x0 < base) */
        __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(base, top), _mm256_xor_si256(x0, top));
        __m256i x1 = _mm256_sub_epi32(_mm256_set1_epi32((int)(uint32_t)(b >> 32)), wrapped);
        __m256i x2 = _mm256_setzero_si256(), x3 = _mm256_setzero_si256();
        uint32_t r0 = k0, r1 = k1;
        for (int r = 0; r < 10; ++r) {
            __m256i hi0, lo0, hi1, lo1;
            mulhilo8(x0, m0, &hi0, &lo0);
            mulhilo8(x2, m1, &hi1, &lo1);
            x0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), _mm256_set1_epi32((int)r0));
            x2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), _mm256_set1_epi32((int)r1));
            x1 = lo1;
            x3 = lo0;
            r0 += W0; r1 += W1;
        }
        /* word k of the block in lane l goes to ob[4 l + k]: eps of each word vector, then a 4 x 8 transpose */
        __m256i e0 = _mm256_castps_si256(eps8(x0, table, kind)), e1 = _mm256_castps_si256(eps8(x1, table, kind));
        __m256i e2 = _mm256_castps_si256(eps8(x2, table, kind)), e3 = _mm256_castps_si256(eps8(x3, table, kind));
        __m256i t0 = _mm256_unpacklo_epi32(e0, e1), t1 = _mm256_unpackhi_epi32(e0, e1); /* lanes 01|45, 23|67 */
        __m256i t2 = _mm256_unpacklo_epi32(e2, e3), t3 = _mm256_unpackhi_epi32(e2, e3);
        __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2); /* blocks 0|4, 1|5 */
        __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3); /* blocks 2|6, 3|7 */
        float *ob = o + 4 * j;
        _mm256_storeu_si256((__m256i *)ob, _mm256_permute2x128_si256(u0, u1, 0x20));
        _mm256_storeu_si256((__m256i *)(ob + 8), _mm256_permute2x128_si256(u2, u3, 0x20));
        _mm256_storeu_si256((__m256i *)(ob + 16), _mm256_permute2x128_si256(u0, u1, 0x31));
        _mm256_storeu_si256((__m256i *)(ob + 24), _mm256_permute2x128_si256(u2, u3, 0x31));
    }
    return done;
}

__attribute__((target("avx2"))) static int64_t avx2_gauss_words(const uint32_t *w, int64_t n, const int32_t *table,
                                                                float *out) {
    int64_t done = n - n % 8;
    for (int64_t i = 0; i < done; i += 8)
        _mm256_storeu_ps(out + i, gauss8(_mm256_loadu_si256((const __m256i *)(w + i)), table));
    return done;
}

/* ------------------------------------------------------------------------------------------ AVX-512 */

/* The AVX2 recipe 16 lanes wide (16 Philox blocks per step), with AVX-512F's 64-bit arithmetic shift and masked
 * blends in place of AVX2's workarounds: the same integers, so the same bits. */
#define AVX512 __attribute__((target("avx512f"))) static inline

AVX512 void mulhilo16(__m512i a, __m512i m, __m512i *hi, __m512i *lo) {
    __m512i pe = _mm512_mul_epu32(a, m);
    __m512i po = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe, 32), po);
    *lo = _mm512_mask_blend_epi32(0xAAAA, pe, _mm512_slli_epi64(po, 32));
}

AVX512 __m512 gauss16(__m512i w, const int32_t *table) {
    const __m512i lo32 = _mm512_set1_epi64(0xFFFFFFFF);
    __m512i m = _mm512_and_si512(w, _mm512_set1_epi32(0x7FFFFFFF));
    /* the octave as in gauss8: the exponent field of (float)(m >> 8), exact */
    __m512i e = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srli_epi32(m, 8))), 23);
    __m512i sh = _mm512_max_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(129)), _mm512_setzero_si512());
    __m512i idx = _mm512_add_epi32(_mm512_srlv_epi32(m, sh), _mm512_add_epi32(_mm512_slli_epi32(sh, 10), sh));
    __m512i f = _mm512_and_si512(m, _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), sh),
                                                     _mm512_set1_epi32(1))); /* m mod 2^sh */
    /* (T[idx], T[idx + 1]) as one 64-bit gather per lane, lanes 0-7 then 8-15; lo = T[idx] and T[idx + 1] are
     * their even and odd words */
    __m512i pa = _mm512_i32gather_epi64(_mm512_castsi512_si256(idx), (const void *)table, 4);
    __m512i pb = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(idx, 1), (const void *)table, 4);
    __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512i lo = _mm512_permutex2var_epi32(pa, even, pb);
    __m512i d = _mm512_sub_epi32(_mm512_permutex2var_epi32(pa, _mm512_add_epi32(even, _mm512_set1_epi32(1)), pb), lo);
    /* (d * f) >> sh, arithmetic, on the signed 64-bit products: even lanes, then odd */
    __m512i qe = _mm512_srav_epi64(_mm512_mul_epi32(d, f), _mm512_and_si512(sh, lo32));
    __m512i qo = _mm512_srav_epi64(_mm512_mul_epi32(_mm512_srli_epi64(d, 32), _mm512_srli_epi64(f, 32)),
                                   _mm512_srli_epi64(sh, 32));
    __m512i z = _mm512_add_epi32(lo, _mm512_mask_blend_epi32(0xAAAA, qe, _mm512_slli_epi64(qo, 32)));
    __m512i s = _mm512_srai_epi32(w, 31);
    z = _mm512_sub_epi32(_mm512_xor_si512(z, s), s);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(z), _mm512_set1_ps(0x1p-28f));
}

AVX512 __m512 eps16(__m512i w, const int32_t *table, int kind) {
    if (kind) {
        __m512i sign = _mm512_and_si512(w, _mm512_set1_epi32((int)0x80000000u));
        return _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x3F800000)));
    }
    return gauss16(w, table);
}

__attribute__((target("avx512f"))) static int64_t avx512_blocks(uint64_t first, int64_t n, uint32_t k0, uint32_t k1,
                                                               const int32_t *table, int kind, float *o) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i m0 = _mm512_set1_epi32((int)M0), m1 = _mm512_set1_epi32((int)M1);
    int64_t done = n - n % 16;
    for (int64_t j = 0; j < done; j += 16) {
        uint64_t b = first + (uint64_t)j;
        __m512i base = _mm512_set1_epi32((int)(uint32_t)b);
        __m512i x0 = _mm512_add_epi32(base, iota);
        __mmask16 wrapped = _mm512_cmplt_epu32_mask(x0, base); /* the low word wrapped: carry into the high */
        __m512i hi = _mm512_set1_epi32((int)(uint32_t)(b >> 32));
        __m512i x1 = _mm512_mask_add_epi32(hi, wrapped, hi, _mm512_set1_epi32(1));
        __m512i x2 = _mm512_setzero_si512(), x3 = _mm512_setzero_si512();
        uint32_t r0 = k0, r1 = k1;
        for (int r = 0; r < 10; ++r) {
            __m512i hi0, lo0, hi1, lo1;
            mulhilo16(x0, m0, &hi0, &lo0);
            mulhilo16(x2, m1, &hi1, &lo1);
            x0 = _mm512_xor_si512(_mm512_xor_si512(hi1, x1), _mm512_set1_epi32((int)r0));
            x2 = _mm512_xor_si512(_mm512_xor_si512(hi0, x3), _mm512_set1_epi32((int)r1));
            x1 = lo1;
            x3 = lo0;
            r0 += W0; r1 += W1;
        }
        __m512i e0 = _mm512_castps_si512(eps16(x0, table, kind)), e1 = _mm512_castps_si512(eps16(x1, table, kind));
        __m512i e2 = _mm512_castps_si512(eps16(x2, table, kind)), e3 = _mm512_castps_si512(eps16(x3, table, kind));
        /* word k of block l to ob[4 l + k]: the AVX2 unpacks leave blocks l, l + 4, l + 8, l + 12 in the four
         * 128-bit lanes of u_l; a 4 x 4 transpose of 128-bit lanes puts them in order */
        __m512i t0 = _mm512_unpacklo_epi32(e0, e1), t1 = _mm512_unpackhi_epi32(e0, e1);
        __m512i t2 = _mm512_unpacklo_epi32(e2, e3), t3 = _mm512_unpackhi_epi32(e2, e3);
        __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
        __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
        __m512i v0 = _mm512_shuffle_i32x4(u0, u1, 0x44), v1 = _mm512_shuffle_i32x4(u0, u1, 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(u2, u3, 0x44), v3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
        float *ob = o + 4 * j;
        _mm512_storeu_si512((void *)ob, _mm512_shuffle_i32x4(v0, v2, 0x88));
        _mm512_storeu_si512((void *)(ob + 16), _mm512_shuffle_i32x4(v0, v2, 0xDD));
        _mm512_storeu_si512((void *)(ob + 32), _mm512_shuffle_i32x4(v1, v3, 0x88));
        _mm512_storeu_si512((void *)(ob + 48), _mm512_shuffle_i32x4(v1, v3, 0xDD));
    }
    return done;
}

__attribute__((target("avx512f"))) static int64_t avx512_gauss_words(const uint32_t *w, int64_t n,
                                                                    const int32_t *table, float *out) {
    int64_t done = n - n % 16;
    for (int64_t i = 0; i < done; i += 16)
        _mm512_storeu_ps(out + i, gauss16(_mm512_loadu_si512((const void *)(w + i)), table));
    return done;
}
#endif

/* ------------------------------------------------------------------------------------------- exports */

/* the widest path this CPU takes (compiled in and supported): 2 AVX-512, 1 AVX2, 0 scalar. A call's `simd`
 * argument caps it (0: scalar only, 1: at most AVX2), so tests can compare every path on one machine. */
int esbatch_noise_simd(void) {
#ifdef ESBATCH_AVX2
    __builtin_cpu_init(); /* idempotent; needed if called before the constructors run */
    if (__builtin_cpu_supports("avx512f")) return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

static int level(int simd) {
    int have = esbatch_noise_simd();
    return simd < have ? simd : have;
}

/* eps of elements start .. start + count - 1 into out; kind 0: gauss, 1: rademacher; simd: the widest path allowed
 * (0 scalar, 1 AVX2, 2 AVX-512) */
void esbatch_noise(uint64_t start, int64_t count, uint32_t k0, uint32_t k1, const int32_t *table, int kind,
                   int simd, float *out) {
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
    int64_t n = (int64_t)(last - first), done = 0;
#ifdef ESBATCH_AVX2
    int lv = level(simd);
    if (lv >= 2) done = avx512_blocks(first, n, k0, k1, table, kind, o);
    if (lv >= 1) done += avx2_blocks(first + (uint64_t)done, n - done, k0, k1, table, kind, o + 4 * done);
#else
    (void)simd;
#endif
    scalar_blocks(first + (uint64_t)done, n - done, k0, k1, table, kind, o + 4 * done);
}

/* the Gaussian transform alone, of n given words (tests: octave edges no Philox word is likely to hit) */
void esbatch_gauss_words(const uint32_t *w, int64_t n, const int32_t *table, int simd, float *out) {
    int64_t done = 0;
#ifdef ESBATCH_AVX2
    int lv = level(simd);
    if (lv >= 2) done = avx512_gauss_words(w, n, table, out);
    if (lv >= 1) done += avx2_gauss_words(w + done, n - done, table, out + done);
#else
    (void)simd;
#endif
    for (int64_t i = done; i < n; ++i) out[i] = gauss(w[i], table);
}

/* dst[i] = base[i] + scale * eps_i for elements start .. start + count - 1: an ES perturbation of an fp32 tensor in
 * one pass over memory (eps stays in a stack buffer). The same two roundings as torch's eps.mul_(scale).add_(base)
 * (an fp32 multiply, then an fp32 add): -ffp-contract=off keeps them from fusing into one FMA. */
#define AXPY_BLOCK 2048
void esbatch_noise_axpy(uint64_t start, int64_t count, uint32_t k0, uint32_t k1, const int32_t *table, int kind,
                        int simd, float scale, const float *base, float *dst) {
    float buf[AXPY_BLOCK];
    for (int64_t j = 0; j < count; j += AXPY_BLOCK) {
        int64_t m = count - j < AXPY_BLOCK ? count - j : AXPY_BLOCK;
        esbatch_noise(start + (uint64_t)j, m, k0, k1, table, kind, simd, buf);
        const float *b = base + j;
        float *d = dst + j;
        for (int64_t i = 0; i < m; ++i) {
            float e = buf[i] * scale;
            d[i] = e + b[i];
        }
    }
}

/* acc[i] = fma(w, e[i], acc[i]) for i < m: torch's acc.add_(e, alpha=w) on fp32 CPU tensors, whose vectorized
 * and scalar loops both compute one fused multiply-add (tests/unit/test_noise.py compares them bit for bit) */
#ifdef ESBATCH_AVX2
__attribute__((target("avx512f"))) static int64_t fma_avx512(float *acc, float w, const float *e, int64_t m) {
    int64_t done = m - m % 16;
    __m512 wv = _mm512_set1_ps(w);
    for (int64_t i = 0; i < done; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(e + i), _mm512_loadu_ps(acc + i)));
    return done;
}

__attribute__((target("avx2,fma"))) static int64_t fma_avx2(float *acc, float w, const float *e, int64_t m) {
    int64_t done = m - m % 8;
    __m256 wv = _mm256_set1_ps(w);
    for (int64_t i = 0; i < done; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(e + i), _mm256_loadu_ps(acc + i)));
    return done;
}
#endif

static void fma_block(float *acc, float w, const float *e, int64_t m, int lv) {
    int64_t done = 0;
#ifdef ESBATCH_AVX2
    if (lv >= 2) done = fma_avx512(acc, w, e, m);
    else if (lv >= 1 && __builtin_cpu_supports("fma")) done = fma_avx2(acc, w, e, m);
#else
    (void)lv;
#endif
    for (int64_t i = done; i < m; ++i) acc[i] = fmaf(w, e[i], acc[i]); /* correctly rounded, also without FMA */
}

/* out[i] = sum over directions d, in order, of w[d] * eps_d[i] for elements start .. start + count - 1 (keys
 * k0[d], k1[d]): the accumulation of an ES update, with the same roundings as starting from zeros and calling
 * torch's acc.add_(eps_d, alpha=w[d]) per direction, in one pass over out (eps and the running sum of a block
 * stay in cache) instead of a write and a read-modify-write per direction. */
void esbatch_noise_accumulate(uint64_t start, int64_t count, int nd, const uint32_t *k0, const uint32_t *k1,
                              const float *w, const int32_t *table, int kind, int simd, float *out) {
    float buf[AXPY_BLOCK];
    int lv = level(simd);
    for (int64_t j = 0; j < count; j += AXPY_BLOCK) {
        int64_t m = count - j < AXPY_BLOCK ? count - j : AXPY_BLOCK;
        float *acc = out + j;
        memset(acc, 0, (size_t)m * sizeof(float));
        for (int d = 0; d < nd; ++d) {
            esbatch_noise(start + (uint64_t)j, m, k0[d], k1[d], table, kind, simd, buf);
            fma_block(acc, w[d], buf, m, lv);
        }
    }
}

/* The whole ES update of elements start .. start + count - 1 of an fp32 center, in one pass: per element
 *     acc = sum_d w[d] * eps_d   (esbatch_noise_accumulate's fused multiply-adds)
 *     a   = acc * scale          (one fp32 rounding: torch's acc.mul_(scale))
 *     dst = dst + a              (one fp32 rounding: torch's dst.add_(acc))
 * and returns sum a^2 in double (the update's squared L2 over these elements). */
double esbatch_noise_update(uint64_t start, int64_t count, int nd, const uint32_t *k0, const uint32_t *k1,
                            const float *w, const int32_t *table, int kind, int simd, float scale, float *dst) {
    float acc[AXPY_BLOCK];
    double sq = 0.0;
    for (int64_t j = 0; j < count; j += AXPY_BLOCK) {
        int64_t m = count - j < AXPY_BLOCK ? count - j : AXPY_BLOCK;
        esbatch_noise_accumulate(start + (uint64_t)j, m, nd, k0, k1, w, table, kind, simd, acc);
        float *d = dst + j;
        for (int64_t i = 0; i < m; ++i) {
            float a = acc[i] * scale;
            sq += (double)a * (double)a;
            d[i] = d[i] + a;
        }
    }
    return sq;
}
