/* CPU kernels for the decode step, built on first use by dist_infer/kernels/build.py.
 *
 * skinny_linear: y = x W^T for a few rows of x (a decode step of a small batch). Decode reads
 * every weight once per step, so the product is bound by how fast W streams from memory.
 * Walking W row by row is one sequential stream the hardware prefetcher follows at full
 * speed, and each W vector loaded feeds all M rows of x (x stays in L1). BLAS kernels tuned
 * for large M interleave several W rows and stream slower on this shape.
 *
 * With several rows the FMAs slow the loop enough that the hardware prefetcher alone keeps
 * too few lines in flight: an explicit prefetch into L2 32 KB ahead (past the end of W is
 * harmless) took 4 rows from 13-15 to 21-24 GB/s on the 2-core EPYC (docs/benchmarks.md).
 * One row runs fast enough without it, and slower with it.
 *
 * quant_linear: the same product with W weight-only quantized (int8 or packed 4-bit, a scale
 * and an optional zero per group of columns), for --quantization; dequantize_rows: such a W's rows
 * as fp32, for the batches too large for it (prefill), which a GEMM then takes.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"  /* the compiler checks each definition against its prototype */

#if defined(__AVX512F__)
#define VW 16
#include <immintrin.h>
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define PREFETCH_AHEAD 8192 /* floats: 32 KB */
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
typedef float f4 __attribute__((vector_size(4 * sizeof(float))));

/* Lanes [0, n) of t += lanes [n, 2n), as one vector of type T (n lanes). */
#define FOLD_HALF(T, t, n)                 \
    do {                                   \
        T lo_, hi_;                        \
        memcpy(&lo_, (t), sizeof lo_);     \
        memcpy(&hi_, (t) + (n), sizeof hi_); \
        lo_ += hi_;                        \
        memcpy((t), &lo_, sizeof lo_);     \
    } while (0)

/* The sum of a vector's lanes as a tree of halves (a chain of VW dependent scalar adds was a
 * third of a decode attention's time at heads of 32: one sum per key and query head). */
static inline float hsum(vf v) {
#if VW == 16
    return _mm512_reduce_add_ps((__m512)v);  /* the same tree, in registers: no store and reload */
#else
    float t[VW];
    memcpy(t, &v, sizeof v);
#if VW >= 8
    FOLD_HALF(f4, t, 4);
#endif
    return (t[0] + t[2]) + (t[1] + t[3]);
#endif
}

/* Rows [n0, n1) of W against M rows of x; M is a compile-time constant in each instance. */
#define SKINNY(M)                                                                              \
    static void skinny_##M(const float *x, const float *w, float *y, long K, long ldy,       \
                           long n0, long n1) {                                                \
        for (long n = n0; n < n1; n++) {                                                      \
            const float *row = w + n * K;                                                     \
            vf acc[M];                                                                        \
            for (int m = 0; m < M; m++) acc[m] = (vf){0};                                     \
            long k = 0;                                                                       \
            for (; k + VW <= K; k += VW) {                                                    \
                if (M > 1) __builtin_prefetch(row + k + PREFETCH_AHEAD, 0, 2);                \
                vf wv = load(row + k);                                                        \
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                           \
                    acc[m] += wv * load(x + m * K + k);                                       \
            }                                                                                 \
            for (int m = 0; m < M; m++) {                                                     \
                float s = hsum(acc[m]);                                                       \
                for (long kk = k; kk < K; kk++) s += row[kk] * x[m * K + kk];                 \
                y[m * ldy + n] = s;                                                           \
            }                                                                                 \
        }                                                                                     \
    }
SKINNY(1) SKINNY(2) SKINNY(3) SKINNY(4) SKINNY(5) SKINNY(6) SKINNY(7) SKINNY(8)

typedef void (*skinny_fn)(const float *, const float *, float *, long, long, long, long);
static const skinny_fn SKINNY_BY_ROWS[9] = {0, skinny_1, skinny_2, skinny_3, skinny_4,
                                            skinny_5, skinny_6, skinny_7, skinny_8};

/* y[M, N] = x[M, K] W[N, K]^T, all contiguous fp32; the rows of W split over `threads`. */
int skinny_linear(const float *x, const float *w, float *y, long M, long N, long K, int threads) {
    if (M < 1 || M > 8) return -1;
    skinny_fn fn = SKINNY_BY_ROWS[M];
    if (threads <= 1 || N < 64 * threads) {
        fn(x, w, y, K, N, 0, N);
        return 0;
    }
    long per = (N + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        long a = t * per, b = a + per < N ? a + per : N;
        if (a < b) fn(x, w, y, K, N, a, b);
    }
    return 0;
}

/* quant_linear: y = x W^T with W held weight-only quantized in groups of G columns,
 * W[n, k] = scales[n, k / G] * q[n, k] + zeros[n, k / G] (zeros NULL: 0). Decode streams the
 * integers (a quarter or an eighth of fp32's bytes) and widens them in registers, one group's
 * scale and zero applied as the values are converted, so no float weight is ever written.
 * q is int8, one value a byte (bits = 8), or two 4-bit values 0..15 a byte (bits = 4): in each
 * group byte j holds value j in its low nibble and value j + G/2 in its high one, so a vector of
 * bytes yields two vectors of consecutive values. Needs K % G == 0 and G % (2 VW) == 0; returns
 * -1 otherwise (the caller then uses torch). */
typedef unsigned char vub __attribute__((vector_size(VW)));
typedef int vi __attribute__((vector_size(VW * sizeof(int))));

#if VW == 16
/* AVX-512: a byte to a 32-bit lane in one instruction (sign- or zero-extending), then to float. */
static inline vf widen_s8(const signed char *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline void widen_u4(const unsigned char *p, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
/* int8 -> fp32 through the unsigned widening (x ^ 0x80 = x + 128 as a byte): GCC turns a signed
 * char vector's conversion into scalar code, the unsigned one into one instruction. */
static inline vf widen_s8(const signed char *p) {
    vub b, bias = (vub){0} + 0x80;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b ^ bias, vi) - 128, vf);
}

static inline void widen_u4(const unsigned char *p, vf *lo, vf *hi) {
    vub b, low_nibble = (vub){0} + 15;
    memcpy(&b, p, sizeof b);
    *lo = __builtin_convertvector(__builtin_convertvector(b & low_nibble, vi), vf);
    *hi = __builtin_convertvector(__builtin_convertvector(b >> 4, vi), vf);
}
#endif

/* One row of x (a batch-1 decode), where the widening dominates: a group's scale multiplies its
 * partial dot product once instead of every widened weight, and the zeros' share,
 * sum_g zeros[n, g] * (x's sum over group g), takes the group sums `xs` made once per call. About
 * 8 vector instructions per 32 weights instead of 11 (docs/benchmarks.md, "Weights that stay
 * quantized"). Two accumulators, alternate groups. */
/* Group g of one row's weights (bytes `row`) dotted with x's group: the partial sum, unscaled. */
static inline vf group_dot(const unsigned char *row, const float *x, long g, long G, int bits) {
    const float *xg = x + g * G;
    vf t;
    if (bits == 8) {
        const signed char *qg = (const signed char *)row + g * G;
        t = widen_s8(qg) * load(xg);
        t += widen_s8(qg + VW) * load(xg + VW);
        for (long k = 2 * VW; k < G; k += 2 * VW) {
            t += widen_s8(qg + k) * load(xg + k);
            t += widen_s8(qg + k + VW) * load(xg + k + VW);
        }
    } else {
        const unsigned char *qg = row + g * (G / 2);
        vf lo, hi;
        widen_u4(qg, &lo, &hi);
        t = lo * load(xg);
        t += hi * load(xg + G / 2);
        for (long k = VW; k < G / 2; k += VW) {
            widen_u4(qg + k, &lo, &hi);
            t += lo * load(xg + k);
            t += hi * load(xg + k + G / 2);
        }
    }
    return t;
}

static inline __attribute__((always_inline)) void
quant_row_impl(const float *x, const float *xs, const void *qv, const float *sc, const float *zr, float *y, long K,
               long G, int bits, long n0, long n1) {
    long groups = K / G, row_bytes = bits == 8 ? K : K / 2;
    for (long n = n0; n < n1; n++) {
        const unsigned char *row = (const unsigned char *)qv + n * row_bytes;
        const float *s = sc + n * groups;
        vf a0 = (vf){0}, a1 = (vf){0};
        long g = 0;
        for (; g + 2 <= groups; g += 2) {
            a0 += group_dot(row, x, g, G, bits) * s[g];
            a1 += group_dot(row, x, g + 1, G, bits) * s[g + 1];
        }
        if (g < groups) a0 += group_dot(row, x, g, G, bits) * s[g];
        float tail = 0.f;
        if (zr) { /* the zeros' share, a vector at a time (a chain of scalar adds rivals the row's own work) */
            const float *z = zr + n * groups;
            for (g = 0; g + VW <= groups; g += VW) a1 += load(z + g) * load(xs + g);
            for (; g < groups; g++) tail += z[g] * xs[g];
        }
        y[n] = hsum(a0 + a1) + tail;
    }
}

/* Two accumulators a row of x (alternate vectors): one would chain every FMA on the one before. */
#define QUANT(M)                                                                                  \
    static void quant_##M(const float *x, const void *qv, const float *sc, const float *zr,       \
                          float *y, long K, long G, int bits, long ldy, long n0, long n1) {        \
        long groups = K / G, row_bytes = bits == 8 ? K : K / 2;                                   \
        for (long n = n0; n < n1; n++) {                                                          \
            const unsigned char *row = (const unsigned char *)qv + n * row_bytes;                 \
            vf a0[M], a1[M];                                                                      \
            for (int m = 0; m < M; m++) a0[m] = a1[m] = (vf){0};                                  \
            for (long g = 0; g < groups; g++) {                                                   \
                vf s = (vf){0} + sc[n * groups + g], z = (vf){0} + (zr ? zr[n * groups + g] : 0.0f); \
                const float *xg = x + g * G;                                                      \
                if (bits == 8) {                                                                  \
                    const signed char *qg = (const signed char *)row + g * G;                     \
                    for (long k = 0; k < G; k += 2 * VW) {                                        \
                        vf w0 = widen_s8(qg + k) * s + z, w1 = widen_s8(qg + k + VW) * s + z;     \
                        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                     \
                            a0[m] += w0 * load(xg + m * K + k);                                   \
                            a1[m] += w1 * load(xg + m * K + k + VW);                              \
                        }                                                                         \
                    }                                                                             \
                } else {                                                                          \
                    const unsigned char *qg = row + g * (G / 2);                                  \
                    for (long k = 0; k < G / 2; k += VW) {                                        \
                        vf lo, hi;                                                                \
                        widen_u4(qg + k, &lo, &hi);                                               \
                        lo = lo * s + z;                                                          \
                        hi = hi * s + z;                                                          \
                        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                     \
                            a0[m] += lo * load(xg + m * K + k);                                   \
                            a1[m] += hi * load(xg + m * K + k + G / 2);                           \
                        }                                                                         \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int m = 0; m < M; m++) y[m * ldy + n] = hsum(a0[m] + a1[m]);                     \
        }                                                                                         \
    }
QUANT(1) QUANT(2) QUANT(3) QUANT(4) QUANT(5) QUANT(6) QUANT(7) QUANT(8)

typedef void (*quant_fn)(const float *, const void *, const float *, const float *, float *, long, long, int,
                         long, long, long);
static const quant_fn QUANT_BY_ROWS[9] = {0, quant_1, quant_2, quant_3, quant_4,
                                          quant_5, quant_6, quant_7, quant_8};

/* 4-bit, 4 to 8 rows of x: two rows of W a pass, so each vector of x loaded serves both (one row of W
 * a pass loads every x vector once per weight row and was bound by the loads; docs/benchmarks.md,
 * "Speculative decoding": a verifying step and a batch-8 decode step). Odd tails go to QUANT_BY_ROWS. */
#define QUANT4_PAIRS(M)                                                                           \
    static void quant4_pairs_##M(const float *x, const void *qv, const float *sc, const float *zr, \
                                 float *y, long K, long G, int bits, long ldy, long n0, long n1) { \
        long groups = K / G, row_bytes = K / 2, n = n0;                                           \
        for (; n + 2 <= n1; n += 2) {                                                             \
            const unsigned char *r0 = (const unsigned char *)qv + n * row_bytes, *r1 = r0 + row_bytes; \
            vf a[M], b[M];                                                                        \
            for (int m = 0; m < M; m++) a[m] = b[m] = (vf){0};                                    \
            for (long g = 0; g < groups; g++) {                                                   \
                vf s0 = (vf){0} + sc[n * groups + g], s1 = (vf){0} + sc[(n + 1) * groups + g];    \
                vf z0 = (vf){0} + (zr ? zr[n * groups + g] : 0.0f);                               \
                vf z1 = (vf){0} + (zr ? zr[(n + 1) * groups + g] : 0.0f);                         \
                const float *xg = x + g * G;                                                      \
                const unsigned char *q0 = r0 + g * (G / 2), *q1 = r1 + g * (G / 2);               \
                for (long k = 0; k < G / 2; k += VW) {                                            \
                    vf lo0, hi0, lo1, hi1;                                                        \
                    widen_u4(q0 + k, &lo0, &hi0);                                                 \
                    widen_u4(q1 + k, &lo1, &hi1);                                                 \
                    lo0 = lo0 * s0 + z0;                                                          \
                    hi0 = hi0 * s0 + z0;                                                          \
                    lo1 = lo1 * s1 + z1;                                                          \
                    hi1 = hi1 * s1 + z1;                                                          \
                    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                         \
                        vf xl = load(xg + m * K + k), xh = load(xg + m * K + k + G / 2);          \
                        a[m] += lo0 * xl;                                                         \
                        b[m] += lo1 * xl;                                                         \
                        a[m] += hi0 * xh;                                                         \
                        b[m] += hi1 * xh;                                                         \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int m = 0; m < M; m++) {                                                         \
                y[m * ldy + n] = hsum(a[m]);                                                      \
                y[m * ldy + n + 1] = hsum(b[m]);                                                  \
            }                                                                                     \
        }                                                                                         \
        if (n < n1) QUANT_BY_ROWS[M](x, qv, sc, zr, y, K, G, bits, ldy, n, n1);                   \
    }
QUANT4_PAIRS(4) QUANT4_PAIRS(5) QUANT4_PAIRS(6) QUANT4_PAIRS(7) QUANT4_PAIRS(8)

static const quant_fn QUANT4_PAIRS_BY_ROWS[9] = {0, 0, 0, 0, quant4_pairs_4,
                                                 quant4_pairs_5, quant4_pairs_6, quant4_pairs_7, quant4_pairs_8};

/* quant_row_impl with the GGUF blocks' group of 32 as a constant (straight-line groups), else as given. */
static void quant_row(const float *x, const float *xs, const void *qv, const float *sc, const float *zr, float *y,
                      long K, long G, int bits, long n0, long n1) {
    if (G == 32 && bits == 4)
        quant_row_impl(x, xs, qv, sc, zr, y, K, 32, 4, n0, n1);
    else if (G == 32 && bits == 8)
        quant_row_impl(x, xs, qv, sc, zr, y, K, 32, 8, n0, n1);
    else
        quant_row_impl(x, xs, qv, sc, zr, y, K, G, bits, n0, n1);
}

/* y[M, N] (row stride ldy) = x[M, K] W^T for 1 <= M <= 8; the rows of W split over `threads`. */
int quant_linear(const float *x, const void *q, const float *scales, const float *zeros, float *y,
                 long M, long N, long K, long G, int bits, long ldy, int threads) {
    if (M < 1 || M > 8 || G <= 0 || K % G || (bits != 8 && bits != 4) || G % (2 * VW))
        return -1;
    long groups = K / G;
    float *xs = M == 1 && zeros ? malloc(groups * sizeof(float)) : NULL;
    if (M == 1 && zeros && !xs) return -1;
    for (long g = 0; xs && g < groups; g++) {
        float t = 0.f;
        for (long k = 0; k < G; k++) t += x[g * G + k];
        xs[g] = t;
    }
    int workers = threads <= 1 || N < 64 * threads ? 1 : threads;
    long per = (N + workers - 1) / workers;
#pragma omp parallel for num_threads(workers) schedule(static) if (workers > 1)
    for (int t = 0; t < workers; t++) {
        long a = t * per, b = a + per < N ? a + per : N;
        if (a >= b) continue;
        if (M == 1)
            quant_row(x, xs, q, scales, zeros, y, K, G, bits, a, b);
        else if (bits == 4 && M >= 4 && VW == 16)  /* 2M accumulators: AVX-512's 32 registers hold them */
            QUANT4_PAIRS_BY_ROWS[M](x, q, scales, zeros, y, K, G, bits, ldy, a, b);
        else
            QUANT_BY_ROWS[M](x, q, scales, zeros, y, K, G, bits, ldy, a, b);
    }
    free(xs);
    return 0;
}

/* dequantize_rows: out[n, k] = scales[n, k / G] * q[n, k] + zeros[n, k / G] (zeros NULL: no add) for
 * rows [0, n_rows), q in quant_linear's layouts, out fp32 [n_rows, K] contiguous: a prefill batch's
 * weight, a block of rows at a time for a GEMM, in one pass (widen, scale, add, store) instead of
 * torch's several. The product is rounded before the zero is added, as QuantizedWeight.dequantize
 * does, so the values are the reference's bit for bit: no fused multiply-add. GCC contracts a * b + c
 * even across statements under its default -ffp-contract=fast, hence the attribute (file-wide flags
 * would also take the FMAs out of the other kernels); clang only contracts within one expression.
 * Needs K % G == 0 (and G even for bits 4); returns -1 otherwise, or for other bit widths. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_FP_CONTRACT
#endif

/* Rows [n0, n1); instantiated below with G, bits and whether there are zeros as constants for the
 * common groups, so a group's few vectors are straight-line code with no tail or branch left. */
NO_FP_CONTRACT static inline __attribute__((always_inline)) void
dequant_impl(const unsigned char *q, const float *sc, const float *zr, float *out, long K, long G, int bits,
             int has_zero, long n0, long n1) {
    long groups = K / G, row_bytes = bits == 8 ? K : K / 2, half = G / 2;
    for (long n = n0; n < n1; n++) {
        const unsigned char *row = q + n * row_bytes;
        for (long g = 0; g < groups; g++) {
            float s = sc[n * groups + g], z = has_zero ? zr[n * groups + g] : 0.0f;
            float *o = out + n * K + g * G;
            long k = 0;
            if (bits == 8) {
                const signed char *qg = (const signed char *)row + g * G;
                for (; k + VW <= G; k += VW) {
                    vf w = widen_s8(qg + k) * s;
                    if (has_zero) w = w + z;
                    memcpy(o + k, &w, sizeof w);
                }
                for (; k < G; k++) {
                    float w = (float)qg[k] * s;
                    o[k] = has_zero ? w + z : w;
                }
            } else {
                const unsigned char *qg = row + g * half;
                for (; k + VW <= half; k += VW) {
                    vf lo, hi;
                    widen_u4(qg + k, &lo, &hi);
                    lo = lo * s;
                    hi = hi * s;
                    if (has_zero) {
                        lo = lo + z;
                        hi = hi + z;
                    }
                    memcpy(o + k, &lo, sizeof lo);
                    memcpy(o + k + half, &hi, sizeof hi);
                }
                for (; k < half; k++) {
                    float lo = (float)(qg[k] & 15) * s, hi = (float)(qg[k] >> 4) * s;
                    o[k] = has_zero ? lo + z : lo;
                    o[k + half] = has_zero ? hi + z : hi;
                }
            }
        }
    }
}

#define DEQUANT_CASE(GC, BITS)                                                                             \
    if (G == (GC) && bits == (BITS)) {                                                                     \
        if (zr) dequant_impl(q, sc, zr, out, K, GC, BITS, 1, n0, n1);                                      \
        else dequant_impl(q, sc, zr, out, K, GC, BITS, 0, n0, n1);                                         \
        return;                                                                                            \
    }

NO_FP_CONTRACT static void dequant_block(const unsigned char *q, const float *sc, const float *zr, float *out,
                                         long K, long G, int bits, long n0, long n1) {
    DEQUANT_CASE(32, 4) DEQUANT_CASE(64, 4) DEQUANT_CASE(32, 8) DEQUANT_CASE(64, 8)
    dequant_impl(q, sc, zr, out, K, G, bits, zr != NULL, n0, n1);
}

/* The rows split over `threads` (the output rows are independent: no reduction). */
int dequantize_rows(const void *q, const float *scales, const float *zeros, float *out, long n_rows, long K,
                    long G, int bits, int threads) {
    if (n_rows < 0 || K <= 0 || G <= 0 || K % G || (bits != 8 && bits != 4) || (bits == 4 && G % 2))
        return -1;
    if (threads <= 1 || n_rows * K < 16384L * threads) {
        dequant_block(q, scales, zeros, out, K, G, bits, 0, n_rows);
        return 0;
    }
    long per = (n_rows + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        long a = t * per, b = a + per < n_rows ? a + per : n_rows;
        if (a < b) dequant_block(q, scales, zeros, out, K, G, bits, a, b);
    }
    return 0;
}

/* rms_norm: out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps), HF's RMSNorm in fp32; with
 * `residual` given, x[t] += residual[t] first (in place) and the sum is normalised: the
 * decoder layer's "add the branch, normalise for the next one" in one pass over the row. */
void rms_norm(float *x, const float *residual, const float *weight, float *out, long T, long H, float eps) {
    for (long t = 0; t < T; t++) {
        float *row = x + t * H;
        const float *res = residual ? residual + t * H : 0;
        vf acc = (vf){0};
        long i = 0;
        for (; i + VW <= H; i += VW) {
            vf v = load(row + i);
            if (res) {
                v += load(res + i);
                memcpy(row + i, &v, sizeof v);
            }
            acc += v * v;
        }
        float ss = hsum(acc);
        for (; i < H; i++) {
            if (res) row[i] += res[i];
            ss += row[i] * row[i];
        }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        float *o = out + t * H;
        for (i = 0; i < H; i++) o[i] = weight[i] * (row[i] * inv);
    }
}

/* rope_cache_write: rotary embedding (rotate-half convention) of q and k in place, then k and
 * v copied into their paged-cache slots. q/k/v rows may be strided views of the fused QKV
 * output (row strides ldq, ldk, ldv in floats); heads within a row are contiguous. With
 * q_heads = 0 only k and v are handled, with kv_heads = 0 only q (caches and slots unused). */
static inline void rotate(float *x, const float *c, const float *s, long half) {
    for (long i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

void rope_cache_write(float *q, float *k, const float *v, long ldq, long ldk, long ldv,
                      const float *cos, const float *sin, float *k_cache, float *v_cache,
                      const long *slots, long T, long q_heads, long kv_heads, long d) {
    long half = d / 2;
    for (long t = 0; t < T; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (long h = 0; h < q_heads; h++) rotate(q + t * ldq + h * d, c, s, half);
        for (long h = 0; h < kv_heads; h++) {
            float *kr = k + t * ldk + h * d;
            rotate(kr, c, s, half);
            memcpy(k_cache + (slots[t] * kv_heads + h) * d, kr, d * sizeof(float));
            memcpy(v_cache + (slots[t] * kv_heads + h) * d, v + t * ldv + h * d, d * sizeof(float));
        }
    }
}

/* decode_attention: one new query per sequence against its cached keys and values, read
 * through the block table (no gather into a padded batch, no mask). Keys [window_start, len)
 * are visible; query head h reads KV head h / (q_heads / kv_heads) (GQA/MQA).
 * q, out: [B, q_heads, d]; caches: [blocks, block_size, kv_heads, d]; tables: [B, width].
 * lse (NULL: not wanted): [B, q_heads], each row's log-sum-exp of its scaled scores, -inf with
 * no visible key (then the row's output is 0): a context-parallel rank's partial, merged by LSE.
 *
 * The keys split into chunks (flash-decoding): each (sequence, chunk) is a task, the threads
 * share the tasks, and each row's chunks merge by their log-sum-exp, so a long context spreads
 * over every thread even for one sequence. A task reads each block of K, then of V, front to
 * back (all the KV heads of a row together: one contiguous run per block), in three vectorised
 * passes: scores, exp, weighted sum. Reading one KV head at a time instead (a row's head at a
 * time, a key's block found by a division) the 2-core EPYC's one core read 4 KV heads of 32 at
 * 8K tokens at 3.4 GB/s; this way at 8.4-9.0. Prefetching the blocks ahead in software made no
 * difference, in order or shuffled. Returns -1 (nothing written) if the partials cannot be
 * allocated. */
#define DECODE_CHUNK_MIN 256   /* keys: 16 blocks of 16 */
#define DECODE_CHUNK_MAX 1024  /* each pass streams this far before the next pass starts over:
                                  one KV head of 64 read at 11.2 GB/s in chunks of 256, 12.7 of 1024 */

/* Keys per task: about 4 tasks per thread on the longest sequence, in whole DECODE_CHUNK_MINs. */
static long decode_chunk_len(long span, int threads) {
    long want = (span + 4 * threads - 1) / (4 * threads);
    want = (want + DECODE_CHUNK_MIN - 1) / DECODE_CHUNK_MIN * DECODE_CHUNK_MIN;
    return want < DECODE_CHUNK_MIN ? DECODE_CHUNK_MIN : want > DECODE_CHUNK_MAX ? DECODE_CHUNK_MAX : want;
}

typedef int vi __attribute__((vector_size(VW * sizeof(int))));

/* e^x for x <= 0 (scores minus their maximum), VW at a time: 2^n times Cephes' degree-6
 * polynomial on the remainder, within 2 ulp of expf; below -87 (e^x < 2^-125) it is 0. */
static inline vf exp_nonpositive(vf x) {
    vi tiny = x < -87.0f;
    vf f = x * 1.44269504f;
    vi n = __builtin_convertvector(f, vi);           /* truncates toward zero ... */
    n += (vi)(__builtin_convertvector(n, vf) > f);   /* ... so step down to the floor (true is -1) */
    f = __builtin_convertvector(n, vf);
    vf r = x - f * 0.693359375f + f * 2.12194440e-4f;  /* x - n ln 2 in two parts, exactly */
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;                         /* e^r, |r| <= ln 2 / 2 */
    vi bits = (vi)p + ((n + 1) << 23);              /* times 2^(n+1) ... */
    p = (vf)bits * 0.5f;                             /* ... halved: no exponent underflow at n = -126 */
    return (vf)((vi)p & ~tiny);
}

/* s[t] = e^(s[t] - m) for t in [lo, hi), vectorised; returns their sum. */
static float exp_and_sum(float *s, long lo, long hi, float m) {
    vf sum = (vf){0};
    long t;
    for (t = lo; t + VW <= hi; t += VW) {
        vf e = exp_nonpositive(load(s + t) - m);
        memcpy(s + t, &e, sizeof e);
        sum += e;
    }
    float total = hsum(sum);
    for (; t < hi; t++) total += (s[t] = expf(s[t] - m));
    return total;
}

/* All query heads q [q_heads, d] of one sequence against its keys [p0, p1); s: scratch of
 * q_heads * chunk floats. part[h * (d + 2) + ...] = (sum_k e^(s_k - m) v_k [d floats],
 * m, sum_k e^(s_k - m)) for query head h. */
static void decode_chunk(const float *restrict q, const float *k_cache, const float *v_cache, const long *table,
                         long q_heads, long kv_heads, long d, long block_size, float scale, long p0, long p1,
                         long chunk, float *restrict s, float *restrict part) {
    long n = p1 - p0, row = kv_heads * d, group = q_heads / kv_heads;
    for (long h = 0; h < q_heads; h++) {
        float *acc = part + h * (d + 2);
        for (long i = 0; i < d; i++) acc[i] = 0.f;
        acc[d] = -INFINITY;
        acc[d + 1] = 0.f;
    }
    if (n <= 0) return;
    long first = p0 / block_size, last = (p1 - 1) / block_size;
    /* scores: s[h * chunk + t] */
    for (long blk = first, t = 0; blk <= last; blk++) {
        long o0 = blk == first ? p0 % block_size : 0, o1 = blk == last ? (p1 - 1) % block_size + 1 : block_size;
        for (long o = o0; o < o1; o++, t++) {
            const float *kr = k_cache + (table[blk] * block_size + o) * row;
            for (long h = 0; h < q_heads; h++) {
                const float *qh = q + h * d, *kh = kr + (h / group) * d;
                vf acc = (vf){0};
                long i = 0;
                for (; i + VW <= d; i += VW) acc += load(qh + i) * load(kh + i);
                float v = hsum(acc);
                for (; i < d; i++) v += qh[i] * kh[i];
                s[h * chunk + t] = v * scale;
            }
        }
    }
    /* exp against each head's maximum, and the sums */
    for (long h = 0; h < q_heads; h++) {
        float *sh = s + h * chunk, m = -INFINITY;
        for (long t = 0; t < n; t++) m = sh[t] > m ? sh[t] : m;
        part[h * (d + 2) + d] = m;
        part[h * (d + 2) + d + 1] = exp_and_sum(sh, 0, n, m);
    }
    /* the weighted sum of the values: for each KV head, up to 4 of its query heads times 2 vectors
     * of d at a time (1 where d leaves one over) summed over the chunk's keys in registers (through
     * memory, a store and a reload per key, it was a quarter of the time); what d leaves below a
     * vector, one float at a time */
    for (long kvh = 0; kvh < kv_heads; kvh++) {
        for (long g0 = 0; g0 < group; g0 += 4) {
            long gn = group - g0 < 4 ? group - g0 : 4, h0 = kvh * group + g0;
            for (long i = 0; i < d;) {
                int nv = i + 2 * VW <= d ? 2 : i + VW <= d ? 1 : 0;  /* vectors of d this pass, 0: a float */
                vf a[4][2];
                float r[4] = {0.f, 0.f, 0.f, 0.f};
                for (int g = 0; g < 4; g++) a[g][0] = a[g][1] = (vf){0};
                for (long blk = first, t = 0; blk <= last; blk++) {
                    long o0 = blk == first ? p0 % block_size : 0;
                    long o1 = blk == last ? (p1 - 1) % block_size + 1 : block_size;
                    const float *vr = v_cache + (table[blk] * block_size + o0) * row + kvh * d + i;
                    for (long o = o0; o < o1; o++, t++, vr += row) {
                        if (nv == 2) {
                            vf v0 = load(vr), v1 = load(vr + VW);
                            for (int g = 0; g < 4; g++) {
                                if (g < gn) {
                                    float w = s[(h0 + g) * chunk + t];
                                    a[g][0] += w * v0;
                                    a[g][1] += w * v1;
                                }
                            }
                        } else if (nv == 1) {
                            vf v0 = load(vr);
                            for (int g = 0; g < 4; g++)
                                if (g < gn) a[g][0] += s[(h0 + g) * chunk + t] * v0;
                        } else {
                            for (int g = 0; g < 4; g++)
                                if (g < gn) r[g] += s[(h0 + g) * chunk + t] * vr[0];
                        }
                    }
                }
                for (long g = 0; g < gn; g++) {
                    float *acc = part + (h0 + g) * (d + 2) + i;
                    if (nv == 0) acc[0] = r[g];
                    for (int j = 0; j < nv; j++) memcpy(acc + j * VW, &a[g][j], sizeof(vf));
                }
                i += nv ? nv * VW : 1;
            }
        }
    }
}

/* silu_mul_rows: act[m, i] = silu(gate[m, i]) * up[m, i] for rows [gate (I) | up (I)] of gate_up,
 * the MLP's activation in the native stack (decode_stack.c), with the exp above: e = e^-|g| never
 * overflows, silu(g) = g / (1 + e) for g >= 0 and g e / (1 + e) below. libm's expf one value at a
 * time was a prompt chunk's largest single-threaded cost on many cores (docs/benchmarks.md). */
void silu_mul_rows(const float *gate_up, float *act, long M, long I, int threads) {
    int workers = threads > 1 && M * I >= 65536 ? threads : 1;
#pragma omp parallel for num_threads(workers) schedule(static) if (workers > 1)
    for (long m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *a = act + m * I;
        long i = 0;
        for (; i + VW <= I; i += VW) {
            vf x = load(g + i);
            vi below = x < 0;                                     /* lanes of all ones where x < 0 */
            vf e = exp_nonpositive((vf)((vi)x | (int)0x80000000u));  /* e^-|x|: the sign bit set */
            vf num = (vf)(((vi)(x * e) & below) | ((vi)x & ~below)), y = num / (1.0f + e) * load(u + i);
            memcpy(a + i, &y, sizeof y);
        }
        for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* causal_softmax_rows: each row r of scores s [rows, n] (row stride n) as probabilities over the
 * keys it sees, [lo, hi) with hi = seq_lens[r] - k0 and lo = hi - window (window > 0, else 0),
 * clamped at 0; the others 0. The prompt-chunk attention's softmax (decode_stack.c), vectorised
 * with the exp the decode attention uses: libm's expf was most of that attention's time. */
void causal_softmax_rows(float *s, long rows, long n, const long *seq_lens, long k0, long window) {
    for (long r = 0; r < rows; r++) {
        float *sr = s + r * n, m = -INFINITY;
        long hi = seq_lens[r] - k0, lo = window > 0 && hi > window ? hi - window : 0, t;
        hi = hi < n ? hi : n;
        for (t = lo; t < hi; t++) m = sr[t] > m ? sr[t] : m;
        float total = exp_and_sum(sr, lo, hi, m);
        float inv = total > 0.f ? 1.0f / total : 0.f;
        for (t = lo; t < hi; t++) sr[t] *= inv;
        if (lo > 0) memset(sr, 0, (size_t)lo * sizeof(float));
        if (hi < n) memset(sr + hi, 0, (size_t)(n - hi) * sizeof(float));
    }
}

/* partial_softmax_rows: scores s [rows, n] (row stride n) of query vectors against keys [p0, p0 + n)
 * of one sequence, vector v being row v / group's, which sees positions [seq_lens[r] - window (window
 * > 0, else 0), seq_lens[r]): e^(s - m) where it sees, 0 elsewhere, in place; m[v] the maximum over
 * what it sees (-inf where nothing) and sum[v] the sum. One chunk's part of an attention whose chunks
 * are merged afterwards (flash-decoding's rule), as decode_chunk's are. */
void partial_softmax_rows(float *s, long rows, long n, long group, const long *seq_lens, long p0, long window,
                          float *m, float *sum) {
    for (long v = 0; v < rows; v++) {
        float *sr = s + v * n, mx = -INFINITY, total = 0.f;
        long r = v / group, hi = seq_lens[r] - p0, lo = window > 0 ? seq_lens[r] - window - p0 : 0, t;
        lo = lo < 0 ? 0 : lo;
        hi = hi > n ? n : hi;
        for (t = lo; t < hi; t++) mx = sr[t] > mx ? sr[t] : mx;
        if (hi > lo) total = exp_and_sum(sr, lo, hi, mx);
        if (lo > 0) memset(sr, 0, (size_t)(lo < n ? lo : n) * sizeof(float));
        if (hi < n) memset(sr + (hi > 0 ? hi : 0), 0, (size_t)(n - (hi > 0 ? hi : 0)) * sizeof(float));
        m[v] = hi > lo ? mx : -INFINITY;
        sum[v] = total;
    }
}

/* merge_chunk_parts: one query head's attention output o [d] from its chunks' parts, `stride` floats
 * apart, each (sum_k e^(s_k - m) v_k [d], m, sum_k e^(s_k - m)) (decode_chunk's, split_attention's),
 * rescaled to their common maximum (flash-decoding's rule); zeros where no chunk saw a key. `lse`
 * (NULL: not wanted): the log-sum-exp of the scores. */
void merge_chunk_parts(const float *part, long chunks, long stride, long d, float *o, float *lse) {
    float m = -INFINITY, total = 0.f;
    for (long c = 0; c < chunks; c++) m = part[c * stride + d] > m ? part[c * stride + d] : m;
    for (long i = 0; i < d; i++) o[i] = 0.f;
    if (m > -INFINITY) {
        for (long c = 0; c < chunks; c++) {
            const float *p = part + c * stride;
            float w = p[d] > -INFINITY ? expf(p[d] - m) : 0.f;
            total += w * p[d + 1];
            for (long i = 0; i < d; i++) o[i] += w * p[i];
        }
        for (long i = 0; i < d; i++) o[i] /= total;
    }
    if (lse) *lse = m > -INFINITY ? m + logf(total) : -INFINITY;
}

int decode_attention(const float *q, const float *k_cache, const float *v_cache, const long *tables,
                     long width, const long *seq_lens, long window, long B, long q_heads, long kv_heads,
                     long d, long block_size, float scale, float *out, float *lse, int threads) {
    long span = 0;
    for (long b = 0; b < B; b++) {
        long len = seq_lens[b], start = window > 0 && len > window ? len - window : 0;
        span = len - start > span ? len - start : span;
    }
    long chunk = decode_chunk_len(span, threads > 1 ? threads : 1);
    long chunks = span > 0 ? (span + chunk - 1) / chunk : 1, tasks = B * chunks;
    long stride = q_heads * (d + 2), workers = threads > 1 && tasks > 1 ? (tasks < threads ? tasks : threads) : 1;
    float *parts = malloc(((size_t)tasks * stride + (size_t)workers * q_heads * chunk) * sizeof(float));
    if (!parts) return -1;
    float *scratch = parts + tasks * stride;
#pragma omp parallel for num_threads(workers) schedule(dynamic, 1)
    for (long task = 0; task < tasks; task++) {
#ifdef _OPENMP
        float *s = scratch + (long)omp_get_thread_num() * q_heads * chunk;
#else
        float *s = scratch;
#endif
        long b = task / chunks, c = task % chunks;
        long len = seq_lens[b], start = window > 0 && len > window ? len - window : 0;
        long p0 = start + c * chunk, p1 = p0 + chunk < len ? p0 + chunk : len;
        decode_chunk(q + b * q_heads * d, k_cache, v_cache, tables + b * width, q_heads, kv_heads, d, block_size,
                     scale, p0, p1, chunk, s, parts + task * stride);
    }
    for (long b = 0; b < B; b++)
        for (long h = 0; h < q_heads; h++)
            merge_chunk_parts(parts + b * chunks * stride + h * (d + 2), chunks, stride, d,
                              out + (b * q_heads + h) * d, lse ? lse + b * q_heads + h : NULL);
    free(parts);
    return 0;
}
