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
 */
#include <stddef.h>
#include <string.h>
#include <math.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define PREFETCH_AHEAD 8192 /* floats: 32 KB */
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
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
 * no visible key (then the row's output is 0): a context-parallel rank's partial, merged by LSE. */
int decode_attention(const float *q, const float *k_cache, const float *v_cache, const long *tables,
                     long width, const long *seq_lens, long window, long B, long q_heads, long kv_heads,
                     long d, long block_size, float scale, float *out, float *scratch, long scratch_len,
                     float *lse) {
    long group = q_heads / kv_heads;
    for (long b = 0; b < B; b++) {
        long len = seq_lens[b];
        long start = window > 0 && len > window ? len - window : 0;
        if (len - start > scratch_len) return -1;
        const long *table = tables + b * width;
        for (long h = 0; h < q_heads; h++) {
            const float *qh = q + (b * q_heads + h) * d;
            long kvh = h / group;
            float best = -INFINITY;
            for (long p = start; p < len; p++) {
                const float *kr = k_cache + ((table[p / block_size] * block_size + p % block_size) * kv_heads + kvh) * d;
                vf acc = (vf){0};
                long i = 0;
                for (; i + VW <= d; i += VW) acc += load(qh + i) * load(kr + i);
                float s = hsum(acc);
                for (; i < d; i++) s += qh[i] * kr[i];
                s *= scale;
                scratch[p - start] = s;
                if (s > best) best = s;
            }
            float total = 0.f;
            for (long p = start; p < len; p++) {
                float e = expf(scratch[p - start] - best);
                scratch[p - start] = e;
                total += e;
            }
            if (lse) lse[b * q_heads + h] = len > start ? best + logf(total) : -INFINITY;
            float *o = out + (b * q_heads + h) * d;
            for (long i = 0; i < d; i++) o[i] = 0.f;
            for (long p = start; p < len; p++) {
                const float *vr = v_cache + ((table[p / block_size] * block_size + p % block_size) * kv_heads + kvh) * d;
                float w = scratch[p - start] / total;
                for (long i = 0; i < d; i++) o[i] += w * vr[i];
            }
        }
    }
    return 0;
}
