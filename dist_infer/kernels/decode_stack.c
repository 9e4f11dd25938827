/* decode_stack: a step through every decoder layer of a Llama stage in one call: a decode step (one
 * new token for each of 1..8 sequences), or any rows at all (a mixed step: prompt chunks beside
 * decodes) where the caller hands over a GEMM: BLAS's sgemm_, or oneDNN's dnnl_sgemm. Rows the caller
 * marks (a prompt's tokens, where bf16 prompts are asked for) take their linears' products in bf16 on
 * the CPU's bf16 matrix instructions through oneDNN's dnnl_gemm_bf16bf16f32 (fp32 accumulation and
 * output; everything else stays fp32), the others in fp32 from the same dequantized panels.
 *
 * Each kernel a layer needs is already native (cpu_kernels.c), but called one by one from Python a
 * layer costs ~15 calls, and at batch 1 on the default model the interpreter and torch's dispatch
 * between them took about as long as the arithmetic (docs/benchmarks.md, "Weights that stay
 * quantized"). Here the same kernels run back to back in C, in the order and with the arithmetic of
 * the layer-by-layer path: input norm, QKV, rotary and the cache write, attention over the paged
 * cache, o_proj, the residual add with the next norm, gate/up, silu(gate) * up, down, the residual
 * add. Only the activation differs: silu_mul_rows's vectorised exp where torch uses its own.
 *
 * Rows are independent but for attention, where each row is a query of its own: row r attends the
 * first seq_lens[r] keys of its block table (its position + 1: causal within a prompt chunk, whose
 * keys and values are all written before any row attends). A sequence's run of rows (a prompt
 * chunk) attends in two GEMMs per head (chunk_attention), other rows one by one (decode_attention).
 * Up to 8 rows the linears are the skinny / quant_linear kernels; past that the weights go to
 * the GEMM, dequantized a panel of rows at a time into a buffer that stays in the core's cache (a whole
 * matrix written to memory and read back, the torch path's way, bounds the product by that traffic
 * at a few dozen rows), and from WHOLE_GEMM_ROWS rows on many cores whole, into one product.
 *
 * x [batch, hidden] is the residual stream, updated in place. Returns 0, -1 when a shape is outside
 * what the kernels take (nothing is half-done: checked before the first layer), -2 without memory,
 * -3 where oneDNN's GEMM refused a product (the step is then half-done: its caller fails the step).
 * Under tensor parallelism the caller runs each layer's two halves (decode_layer_part) with its
 * all-reduces between them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MAX_SKINNY_ROWS 8  /* the rows skinny_linear and quant_linear take (build.py's MAX_ROWS) */

typedef struct {
    const void *w;        /* fp32 [n, k] (bits 32), else quant_linear's integers */
    const float *scales;  /* quant_linear's scales and zeros (NULL: none); unused for fp32 */
    const float *zeros;
    long n, k, group, bits;
} StackLinear;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    StackLinear qkv, o, gate_up, down;    /* qkv: q_heads, then kv_heads of keys, then of values */
    float *k_cache, *v_cache;             /* [blocks, block_size, kv_heads, head_dim] */
} StackLayer;

typedef struct {
    long batch, hidden, q_heads, kv_heads, head_dim, intermediate;
    const float *cos, *sin;               /* [batch, head_dim]: each sequence's new position */
    const long *slots;                    /* [batch]: where each new key and value go */
    const long *tables;                   /* [batch, table_width] block tables */
    const long *seq_lens;                 /* [batch], counting the new token */
    long table_width, window, block_size, threads;
    double eps, scale;
    void *sgemm;                          /* the GEMM (sgemm_row_major says which), or NULL: 1..8 rows only */
    long n_runs;                          /* the rows' sequences: rows [runs[i], runs[i + 1]) are one's */
    const long *runs;                     /* [n_runs + 1], or NULL: every row a sequence of its own */
    long sgemm_row_major;                 /* 0: a Fortran sgemm_ (LP64); 1: oneDNN's dnnl_sgemm */
    void *gemm_bf16;                      /* oneDNN's dnnl_gemm_bf16bf16f32, or NULL: no bf16 rows */
    const unsigned char *bf16_rows;       /* [batch]: 1 where a row's products take bf16 inputs (NULL: none is) */
} StackStep;

typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *,
                         const int *);
typedef int (*dnnl_sgemm_fn)(char, char, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                             int64_t, float, float *, int64_t);
typedef int (*dnnl_bf16_fn)(char, char, int64_t, int64_t, int64_t, float, const uint16_t *, int64_t,
                            const uint16_t *, int64_t, float, float *, int64_t);

/* C [m, n] = alpha op(A) op(B), column-major as BLAS has it, through the step's GEMM; 0, or -3
 * where oneDNN refused the arguments (C unwritten). oneDNN's is row-major, so it computes the same
 * product transposed (C^T = op(B)^T op(A)^T): on AMD cores it runs AVX-512 where MKL's sgemm takes
 * a slower path (docs/benchmarks.md, "oneDNN's GEMM"). */
static int gemm(const StackStep *st, char ta, char tb, long m, long n, long k, float alpha, const float *a, long lda,
                const float *b, long ldb, float *c, long ldc) {
    if (st->sgemm_row_major)
        return ((dnnl_sgemm_fn)st->sgemm)(tb, ta, n, m, k, alpha, b, ldb, a, lda, 0.0f, c, ldc) == 0 ? 0 : -3;
    const int mi = (int)m, ni = (int)n, ki = (int)k, la = (int)lda, lb = (int)ldb, lc = (int)ldc;
    const float zero = 0.0f;
    ((sgemm_fn)st->sgemm)(&ta, &tb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &zero, c, &lc);
    return 0;
}

#define CHUNK_ATTENTION_ROWS 8  /* a sequence's run of at least this many rows attends through sgemm */
#define SPLIT_MAX_ROWS 32  /* a run of 2 to this many fp32 rows over at least SPLIT_MIN_KEYS keys: */
#define SPLIT_MIN_KEYS 512  /* split_attention (a few rows over a long context) */
#define ATTENTION_BLOCK_ROWS 64  /* chunk_attention's blocks of rows: each takes the keys its last row sees */
#define WHOLE_GEMM_ROWS 128  /* from this many rows a whole matrix is dequantized into one product, */
#define WHOLE_GEMM_THREADS 8  /* on this many threads: on two, panels were faster at 128-256 rows */
#define PANEL_BYTES (512L * 1024)  /* a dequantized panel of weight rows: well inside a core's L2 */

static int linear_fits(const StackLinear *w, long n, long k) {
    if (w->n != n || w->k != k || !w->w) return 0;
    if (w->bits == 32) return 1;
    /* quant_linear's groups: a multiple of 32 values (whole vectors, two for packed 4-bit) */
    return (w->bits == 8 || w->bits == 4) && w->scales && w->group > 0 && w->group % 32 == 0 && k % w->group == 0;
}

/* This thread's slice of `size` floats of a scratch shared by a parallel region's threads. */
static inline float *thread_slice(float *scratch, long size) {
#ifdef _OPENMP
    return scratch + (long)omp_get_thread_num() * size;
#else
    return scratch + 0 * size;
#endif
}

/* y[:, n0:n0+np] = x W[n0:n0+np]^T (column-major: Y^T = W x^T), y's rows n apart. */
static int gemm_rows(const StackStep *st, const float *w, const float *x, float *y, long M, long np, long n, long K) {
    return gemm(st, 'T', 'N', np, M, K, 1.0f, w, K, x, K, y, n);
}

/* Many rows against a quantized W: panels of W's rows dequantized into each thread's buffer (the
 * values QuantizedWeight.dequantize gives, bit for bit) and multiplied there, the GEMM single-threaded
 * inside the parallel region. From WHOLE_GEMM_ROWS rows on WHOLE_GEMM_THREADS or more, writing W
 * out whole and handing the GEMM one product (its own blocking and threads: the torch path's way) wins; on
 * a few cores the panels, which stay in L2, win (docs/benchmarks.md, "Mixed steps in one native
 * call" and "Panels on two cores"). */
static int quant_gemm(const StackLinear *w, const float *x, float *y, long M, int threads, const StackStep *st) {
    long K = w->k, N = w->n, groups = K / w->group, row_bytes = w->bits == 8 ? K : K / 2;
    if (M >= WHOLE_GEMM_ROWS && threads >= WHOLE_GEMM_THREADS) {  /* one product, the GEMM's own threads */
        float *all = malloc((size_t)N * K * sizeof(float));
        if (!all) return -2;
        int rc = dequantize_rows(w->w, w->scales, w->zeros, all, N, K, w->group, (int)w->bits, threads) == 0
                     ? gemm_rows(st, all, x, y, M, N, N, K) : -1;
        free(all);
        return rc;
    }
    long P = PANEL_BYTES / (K * (long)sizeof(float)), share = (N + 2L * threads - 1) / (2L * threads);
    P = share < P ? (share + 15) / 16 * 16 : P / 16 * 16;  /* two panels a thread at least, where N allows */
    P = P < 16 ? 16 : P;
    long panels = (N + P - 1) / P, workers = threads > 1 ? (panels < threads ? panels : threads) : 1;
    float *buffers = malloc((size_t)workers * P * K * sizeof(float));
    if (!buffers) return -2;
    int failed = 0;
#pragma omp parallel for num_threads(workers) schedule(dynamic, 1) if (workers > 1)
    for (long p = 0; p < panels; p++) {
        float *buf = thread_slice(buffers, P * K);
        long n0 = p * P, np = N - n0 < P ? N - n0 : P;
        dequantize_rows((const unsigned char *)w->w + n0 * row_bytes, w->scales + n0 * groups,
                        w->zeros ? w->zeros + n0 * groups : NULL, buf, np, K, w->group, (int)w->bits, 1);
        if (gemm_rows(st, buf, x, y + n0, M, np, N, K) != 0) failed = 1;  /* (any thread: the same value) */
    }
    free(buffers);
    return failed ? -3 : 0;
}

/* bf16 as torch rounds it (to nearest, ties to even; a NaN stays a NaN). */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x rounded to bf16: sixteen at a time with AVX512-BF16's conversion where the compiler targets it
 * (the same rounding; a denormal input becomes zero, the instruction's rule), the rest one by one. */
static void to_bf16(const float *x, uint16_t *out, long n) {
    long i = 0;
#ifdef __AVX512BF16__
    for (; i + 16 <= n; i += 16) {
        __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        memcpy(out + i, &h, sizeof h);
    }
#endif
    for (; i < n; i++) out[i] = bf16_of(x[i]);
}

/* Rows of x (K floats each) that `flags` marks, rounded into the same rows of xb, over the threads. */
static void rows_to_bf16(const float *x, uint16_t *xb, const unsigned char *flags, long M, long K, int threads) {
    int workers = threads > 1 && M * K >= 32768 ? threads : 1;
#pragma omp parallel for num_threads(workers) schedule(static) if (workers > 1)
    for (long m = 0; m < M; m++)
        if (flags[m]) to_bf16(x + m * K, xb + m * K, K);
}

/* Whether the step has bf16 rows: its caller passes bf16_rows only where some row is marked. */
static int has_bf16_rows(const StackStep *st) {
    return st->gemm_bf16 && st->bf16_rows;
}

/* A panel W[n0:n0+np] against every row: the fp32 rows' stretches through the step's GEMM on the
 * fp32 panel, the bf16 rows' stretches through oneDNN's bf16 GEMM (fp32 accumulation and output)
 * on the panel rounded to bf16: the weights are read once for both kinds. */
static int panel_rows(const StackStep *st, const float *panel, const uint16_t *panel_b, const float *x,
                      const uint16_t *xb, float *y, long M, long np, long N, long K) {
    for (long r0 = 0; r0 < M;) {
        int b = st->bf16_rows[r0] != 0;
        long r1 = r0 + 1;
        while (r1 < M && (st->bf16_rows[r1] != 0) == b) r1++;
        int rc = b ? (((dnnl_bf16_fn)st->gemm_bf16)('N', 'T', r1 - r0, np, K, 1.0f, xb + r0 * K, K, panel_b, K, 0.0f,
                                                     y + r0 * N, N) == 0 ? 0 : -3)
                   : gemm_rows(st, panel, x + r0 * K, y + r0 * N, r1 - r0, np, N, K);
        if (rc != 0) return rc;
        r0 = r1;
    }
    return 0;
}

/* Rows some of which the step marks for bf16 (prompt tokens: engine/step_plan.py) against W, fp32 or
 * quantized: panels of W's rows (dequantized where quantized) in each thread's buffer, rounded to
 * bf16 beside, and each kind of row multiplied on its own copy (panel_rows). Which rows are bf16
 * depends only on the rows themselves, so a row's result does not depend on what shares its step. */
static int mixed_gemm(const StackLinear *w, const float *x, float *y, long M, int threads, const StackStep *st) {
    long K = w->k, N = w->n, groups = w->bits == 32 ? 0 : K / w->group, row_bytes = w->bits == 8 ? K : K / 2;
    long P = PANEL_BYTES / (K * (long)sizeof(float)), share = (N + 2L * threads - 1) / (2L * threads);
    P = share < P ? (share + 15) / 16 * 16 : P / 16 * 16;
    P = P < 16 ? 16 : P;
    long panels = (N + P - 1) / P, workers = threads > 1 ? (panels < threads ? panels : threads) : 1;
    uint16_t *xb = malloc((size_t)M * K * sizeof(uint16_t));
    float *buffers = malloc((size_t)workers * P * K * (sizeof(float) + sizeof(uint16_t)));
    if (!xb || !buffers) {
        free(xb);
        free(buffers);
        return -2;
    }
    rows_to_bf16(x, xb, st->bf16_rows, M, K, threads);
    uint16_t *halves = (uint16_t *)(buffers + workers * P * K);
    int failed = 0;
#pragma omp parallel for num_threads(workers) schedule(dynamic, 1) if (workers > 1)
    for (long p = 0; p < panels; p++) {
#ifdef _OPENMP
        long t = omp_get_thread_num();
#else
        long t = 0;
#endif
        float *buf = buffers + t * P * K;
        uint16_t *half = halves + t * P * K;
        long n0 = p * P, np = N - n0 < P ? N - n0 : P;
        const float *panel = (const float *)w->w + n0 * K;
        if (w->bits != 32) {
            dequantize_rows((const unsigned char *)w->w + n0 * row_bytes, w->scales + n0 * groups,
                            w->zeros ? w->zeros + n0 * groups : NULL, buf, np, K, w->group, (int)w->bits, 1);
            panel = buf;
        }
        to_bf16(panel, half, np * K);
        int rc = panel_rows(st, panel, half, x, xb, y + n0, M, np, N, K);
        if (rc != 0) failed = rc;  /* (any thread: -3 either way) */
    }
    free(buffers);
    free(xb);
    return failed;
}

static int linear(const StackLinear *w, const float *x, float *y, long M, int threads, const StackStep *st) {
    if (has_bf16_rows(st)) return mixed_gemm(w, x, y, M, threads, st);
    if (M > MAX_SKINNY_ROWS) {
        if (w->bits != 32) return quant_gemm(w, x, y, M, threads, st);
        return gemm_rows(st, (const float *)w->w, x, y, M, w->n, w->n, w->k);
    }
    if (w->bits == 32) return skinny_linear(x, (const float *)w->w, y, M, w->n, w->k, threads);
    return quant_linear(x, w->w, w->scales, w->zeros, y, M, w->n, w->k, w->group, (int)w->bits, w->n, threads);
}

static int step_fits(const StackLayer *layers, long n_layers, const StackStep *st) {
    long H = st->hidden, d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d, I = st->intermediate;
    if (st->batch < 1 || ((st->batch > MAX_SKINNY_ROWS || has_bf16_rows(st)) && !st->sgemm) ||
        st->q_heads < 1 || st->kv_heads < 1 ||
        st->q_heads % st->kv_heads || d < 2 || d % 2 || st->block_size < 1)
        return 0;
    for (long l = 0; l < n_layers; l++) {
        const StackLayer *L = layers + l;
        if (!linear_fits(&L->qkv, qd + 2 * kvd, H) || !linear_fits(&L->o, H, qd) ||
            !linear_fits(&L->gate_up, 2 * I, H) || !linear_fits(&L->down, H, I) || !L->k_cache || !L->v_cache)
            return 0;
    }
    return 1;
}

/* Each layer's scratch, sized for the step. */
typedef struct {
    float *normed, *qkv, *q, *attn, *gate_up, *act, *branch[2];
} Work;

static float *work_alloc(const StackStep *st, Work *w) {
    long M = st->batch, H = st->hidden, d = st->head_dim, I = st->intermediate;
    long qd = st->q_heads * d, width = qd + 2 * st->kv_heads * d;
    float *p = malloc((size_t)M * (3 * H + width + 2 * qd + 3 * I) * sizeof(float));
    if (!p) return NULL;
    w->normed = p;
    w->qkv = w->normed + M * H;
    w->q = w->qkv + M * width;
    w->attn = w->q + M * qd;
    w->gate_up = w->attn + M * qd;
    w->act = w->gate_up + M * 2 * I;
    w->branch[0] = w->act + M * I;
    w->branch[1] = w->branch[0] + M * H;
    return p;
}

/* Keys per split_attention task: about 4 tasks a thread, in multiples of 64, from 128 to 512 (a task's
 * keys and values, 2 x 512 x kv_heads x head_dim floats, stay in a core's L2 on the default model). */
static long split_keys(long n, int threads) {
    long want = (n + 4L * threads - 1) / (4L * threads);
    want = (want + 63) / 64 * 64;
    return want < 128 ? 128 : want > 512 ? 512 : want;
}

/* Keys and values of positions [p0, p1) of a sequence: in place where its blocks lie one after the
 * other in the cache (a sequence's blocks mostly do), else copied into kc and vc. */
static void chunk_keys(const float *k_cache, const float *v_cache, const long *table, long p0, long p1, long bs,
                       long kvd, float *kc, float *vc, const float **keys, const float **values) {
    long first = p0 / bs, last = (p1 - 1) / bs, b = first;
    while (b < last && table[b + 1] == table[b] + 1) b++;
    if (b == last) {
        *keys = k_cache + (table[first] * bs + p0 % bs) * kvd;
        *values = v_cache + (table[first] * bs + p0 % bs) * kvd;
        return;
    }
    for (long p = p0; p < p1;) {
        long off = p % bs, take = bs - off < p1 - p ? bs - off : p1 - p, src = (table[p / bs] * bs + off) * kvd;
        memcpy(kc + (p - p0) * kvd, k_cache + src, (size_t)take * kvd * sizeof(float));
        memcpy(vc + (p - p0) * kvd, v_cache + src, (size_t)take * kvd * sizeof(float));
        p += take;
    }
    *keys = kc;
    *values = vc;
}

/* Rows [r0, r0 + rows) of a run, query head h, attending keys [k0, k0 + ni): scores through the GEMM
 * into s, each row's softmax, out = P V through the GEMM; in bf16 (q, P and the keys' and values'
 * bf16 copies; fp32 scores, softmax and output) where `bf16`, into the thread's qb and pb. */
typedef struct {
    const float *keys, *values;         /* [n, kvd] fp32, gathered from the cache */
    const uint16_t *keys_b, *values_b;  /* their bf16 copies, or NULL where no row is bf16 */
    long n, k0;
} RunKeys;

static int attend_block(const StackStep *st, const RunKeys *kv, const float *q, const long *seq_lens, long r0,
                        long rows, long h, int bf16, float *s, uint16_t *qb, uint16_t *pb, float *out) {
    long d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d, kvh = h / (st->q_heads / st->kv_heads);
    long ni = seq_lens[r0 + rows - 1] - kv->k0;  /* the keys the block's rows see */
    const float scale = (float)st->scale;
    const float *qh = q + r0 * qd + h * d;
    float *oh = out + r0 * qd + h * d;
    if (!bf16) {
        if (gemm(st, 'T', 'N', ni, rows, d, scale, kv->keys + kvh * d, kvd, qh, qd, s, ni) != 0) return -3;
        causal_softmax_rows(s, rows, ni, seq_lens + r0, kv->k0, st->window);
        return gemm(st, 'N', 'N', d, rows, ni, 1.0f, kv->values + kvh * d, kvd, s, ni, oh, qd);
    }
    dnnl_bf16_fn bf = (dnnl_bf16_fn)st->gemm_bf16;
    for (long r = 0; r < rows; r++) to_bf16(qh + r * qd, qb + r * d, d);
    if (bf('N', 'T', rows, ni, d, scale, qb, d, kv->keys_b + kvh * d, kvd, 0.0f, s, ni) != 0) return -3;
    causal_softmax_rows(s, rows, ni, seq_lens + r0, kv->k0, st->window);
    to_bf16(s, pb, rows * ni);
    return bf('N', 'N', rows, d, ni, 1.0f, pb, ni, kv->values_b + kvh * d, kvd, 0.0f, oh, qd) == 0 ? 0 : -3;
}

/* A prompt chunk's rows q [R, q_heads * d] (one sequence: table, each row's seq_len, ascending)
 * attending in two products per query head, as SDPA does: the sequence's keys and values gathered
 * from their blocks once (read in place where the blocks lie one after the other), scores = Q K^T through the GEMM, each row's softmax over the keys it sees,
 * out = P V through the GEMM. One row at a time (decode_attention) would cost a dot product and a
 * horizontal sum per key, head and row: far slower than SDPA over long contexts (docs/benchmarks.md,
 * "Mixed steps in one native call"). Rows `flags` marks (NULL: none) take both products in bf16. */
static int chunk_attention(const float *q, const float *k_cache, const float *v_cache, const long *table,
                           const long *seq_lens, long R, const unsigned char *flags, const StackStep *st,
                           float *out) {
    long d = st->head_dim, kvd = st->kv_heads * d;
    long bs = st->block_size, window = st->window, end = seq_lens[R - 1];
    long k0 = window > 0 && seq_lens[0] > window ? seq_lens[0] - window : 0, n = end - k0;
    int threads = st->threads > 1 ? (int)st->threads : 1, any_bf16 = 0;
    if (n <= 0) return -1;
    for (long r = 0; flags && r < R; r++) any_bf16 |= flags[r] != 0;
    /* tasks: a query head and a block of rows each, about two a thread, and blocks of at most
     * ATTENTION_BLOCK_ROWS rows: a block's products take the keys its last row sees, so over a long
     * prompt one block for all would compute the whole square where causal attention needs half */
    long blocks = (2L * threads + st->q_heads - 1) / st->q_heads, most = (R + 15) / 16;
    long least = (R + ATTENTION_BLOCK_ROWS - 1) / ATTENTION_BLOCK_ROWS;
    blocks = blocks > least ? blocks : least;
    blocks = blocks < most ? blocks : most;
    long rb = (R + blocks - 1) / blocks, tasks = st->q_heads * blocks;
    threads = tasks < threads ? (int)tasks : threads;  /* the scratch is one block of scores a worker */
    size_t halves = any_bf16 ? (size_t)2 * n * kvd + (size_t)threads * rb * (n + d) : 0;
    float *mem = malloc(((size_t)2 * n * kvd + (size_t)threads * rb * n) * sizeof(float) + halves * sizeof(uint16_t));
    if (!mem) return -2;
    float *scores = mem + 2 * n * kvd;
    uint16_t *half = (uint16_t *)(scores + (size_t)threads * rb * n);
    const float *keys, *values;
    chunk_keys(k_cache, v_cache, table, k0, end, bs, kvd, mem, mem + n * kvd, &keys, &values);
    RunKeys kv = {keys, values, NULL, NULL, n, k0};
    if (any_bf16) {
        to_bf16(keys, half, n * kvd);
        to_bf16(values, half + n * kvd, n * kvd);
        kv.keys_b = half;
        kv.values_b = half + n * kvd;
    }
    uint16_t *thread_halves = half + 2 * n * kvd;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (long task = 0; task < tasks; task++) {
        float *s = thread_slice(scores, rb * n);
#ifdef _OPENMP
        uint16_t *pb = any_bf16 ? thread_halves + (long)omp_get_thread_num() * rb * (n + d) : NULL;
#else
        uint16_t *pb = any_bf16 ? thread_halves : NULL;
#endif
        uint16_t *qb = pb ? pb + rb * n : NULL;
        long h = task / blocks, r0 = task % blocks * rb, rows = R - r0 < rb ? R - r0 : rb;
        for (long a = r0; a < r0 + rows;) {  /* stretches of one kind: fp32 rows and bf16 rows */
            int bf16 = flags && flags[a];
            long b = a + 1;
            while (b < r0 + rows && (flags && flags[b]) == bf16) b++;
            if (attend_block(st, &kv, q, seq_lens, a, b - a, h, bf16, s, qb, pb, out) != 0) failed = 1;
            a = b;
        }
    }
    free(mem);
    return failed ? -3 : 0;
}

/* A few fp32 rows of one sequence over a long context (a failed-over request's recomputed tail,
 * proposals being verified, a prompt's last short chunk): the keys are split into chunks over the
 * threads, as decode_attention splits them for one row, and each chunk is read once for every row
 * and every query head of a KV head: scores = Q K^T and the chunk's part of P V through the GEMM,
 * then the chunks' parts merged. chunk_attention's split by head (on two threads, nine heads left
 * one idle a ninth of the time), its copy of the whole context into one buffer before any product,
 * and decode_attention's read of the context per row all cost more where rows are few and keys
 * many (docs/benchmarks.md, "KV mirroring"). */
static int split_attention(const float *q, const float *k_cache, const float *v_cache, const long *table,
                           const long *seq_lens, long R, const StackStep *st, float *out) {
    long d = st->head_dim, qh = st->q_heads, kvh = st->kv_heads, qd = qh * d, kvd = kvh * d, group = qh / kvh;
    long window = st->window, end = seq_lens[R - 1];
    long k0 = window > 0 && seq_lens[0] > window ? seq_lens[0] - window : 0, n = end - k0, V = R * group;
    int threads = st->threads > 1 ? (int)st->threads : 1;
    long C = split_keys(n, threads), chunks = (n + C - 1) / C, stride = R * qh * (d + 2);
    long scratch = 2 * C * kvd + V * (2 * d + C + 2);
    int workers = chunks < threads ? (int)chunks : threads, failed = 0;
    float *mem = malloc(((size_t)chunks * stride + (size_t)workers * scratch) * sizeof(float));
    if (!mem) return -2;
#pragma omp parallel for num_threads(workers) schedule(dynamic, 1) if (workers > 1)
    for (long c = 0; c < chunks; c++) {
        float *kc = thread_slice(mem + chunks * stride, scratch), *vc = kc + C * kvd, *qg = vc + C * kvd;
        float *s = qg + V * d, *og = s + V * C, *mx = og + V * d, *sum = mx + V, *part = mem + c * stride;
        long p0 = k0 + c * C, p1 = p0 + C < end ? p0 + C : end, len = p1 - p0;
        const float *keys, *values;
        chunk_keys(k_cache, v_cache, table, p0, p1, st->block_size, kvd, kc, vc, &keys, &values);
        for (long g = 0; g < kvh && !failed; g++) {
            for (long v = 0; v < V; v++) memcpy(qg + v * d, q + v / group * qd + (g * group + v % group) * d, d * sizeof(float));
            if (gemm(st, 'T', 'N', len, V, d, (float)st->scale, keys + g * d, kvd, qg, d, s, len) != 0) {
                failed = 1;
                break;
            }
            partial_softmax_rows(s, V, len, group, seq_lens, p0, window, mx, sum);
            if (gemm(st, 'N', 'N', d, V, len, 1.0f, values + g * d, kvd, s, len, og, d) != 0) {
                failed = 1;
                break;
            }
            for (long v = 0; v < V; v++) {
                float *dst = part + (v / group * qh + g * group + v % group) * (d + 2);
                memcpy(dst, og + v * d, d * sizeof(float));
                dst[d] = mx[v];
                dst[d + 1] = sum[v];
            }
        }
    }
    for (long i = 0; i < R * qh && !failed; i++)  /* row i / qh, head i % qh: its chunks merged */
        merge_chunk_parts(mem + i * (d + 2), chunks, stride, d, out + i / qh * qd + i % qh * d, NULL);
    free(mem);
    return failed ? -3 : 0;
}

static int marked(const unsigned char *flags, long n) {
    for (long i = 0; flags && i < n; i++)
        if (flags[i]) return 1;
    return 0;
}

/* Attention of every row: a sequence's run of 2 to SPLIT_MAX_ROWS fp32 rows over SPLIT_MIN_KEYS keys
 * or more through split_attention, one of CHUNK_ATTENTION_ROWS or more through chunk_attention,
 * and a run with bf16 rows however short (a prompt's rows attend the same way however it is chunked),
 * the others (decodes, short chunks) row by row through decode_attention, consecutive ones together. */
static int attend_rows(const StackLayer *L, const StackStep *st, const float *q, float *out) {
    long qd = st->q_heads * st->head_dim, w = st->table_width, n_runs = st->runs ? st->n_runs : 1;
    long pending = 0;  /* first row of the stretch of short runs not yet attended */
    int rc = 0;
    for (long i = 0; i <= n_runs && rc == 0; i++) {
        long r0 = i < n_runs ? (st->runs ? st->runs[i] : 0) : st->batch;
        long r1 = i < n_runs ? (st->runs ? st->runs[i + 1] : st->batch) : st->batch;
        const unsigned char *flags = has_bf16_rows(st) ? st->bf16_rows + r0 : NULL;
        long keys = i < n_runs ? st->seq_lens[r1 - 1] : 0;
        int split = st->runs && i < n_runs && st->sgemm && r1 - r0 >= 2 && r1 - r0 <= SPLIT_MAX_ROWS &&
                    keys >= SPLIT_MIN_KEYS && !marked(flags, r1 - r0);
        int chunked = !split && st->runs && i < n_runs && st->sgemm &&
                      (r1 - r0 >= CHUNK_ATTENTION_ROWS || marked(flags, r1 - r0));
        if ((chunked || split || i == n_runs) && r0 > pending)
            rc = decode_attention(q + pending * qd, L->k_cache, L->v_cache, st->tables + pending * w, w,
                                  st->seq_lens + pending, st->window, r0 - pending, st->q_heads, st->kv_heads,
                                  st->head_dim, st->block_size, (float)st->scale, out + pending * qd, NULL,
                                  (int)st->threads);
        if (chunked && rc == 0) {
            rc = chunk_attention(q + r0 * qd, L->k_cache, L->v_cache, st->tables + r0 * w, st->seq_lens + r0, r1 - r0,
                                 flags, st, out + r0 * qd);
            pending = r1;
        } else if (split && rc == 0) {
            rc = split_attention(q + r0 * qd, L->k_cache, L->v_cache, st->tables + r0 * w, st->seq_lens + r0, r1 - r0,
                                 st, out + r0 * qd);
            pending = r1;
        }
    }
    return rc;
}

/* The attention half: x += pending (the previous layer's MLP output, if any), the input norm, QKV,
 * rotary and the cache write, attention, o_proj into out (this rank's partial sum under tp). */
/* Row-wise work over the threads where a step has many rows (a prompt chunk): on few rows the
 * parallel region costs more than it saves, and with it the other threads would idle at the
 * GEMMs' barriers while one does it. */
#define ROWS_PER_THREAD 32
static int row_workers(const StackStep *st) {
    long most = st->batch / ROWS_PER_THREAD;
    return (int)(st->threads < most ? st->threads : most < 1 ? 1 : most);
}

/* rms_norm of every row (x += pending first), the rows split over the threads. */
static void norm_rows(const StackStep *st, float *x, const float *pending, const float *weight, float *out) {
    long M = st->batch, H = st->hidden;
    int workers = row_workers(st);
    long per = (M + workers - 1) / workers;
#pragma omp parallel for num_threads(workers) schedule(static) if (workers > 1)
    for (int t = 0; t < workers; t++) {
        long r0 = t * per, n = M - r0 < per ? M - r0 : per;
        if (n > 0) rms_norm(x + r0 * H, pending ? pending + r0 * H : NULL, weight, out + r0 * H, n, H, (float)st->eps);
    }
}

/* Rotary, the cache write and the queries' copy out of the fused QKV rows, over the threads. */
static void rope_rows(const StackLayer *L, const StackStep *st, Work *w) {
    long M = st->batch, d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d, width = qd + 2 * kvd;
    int workers = row_workers(st);
    long per = (M + workers - 1) / workers;
#pragma omp parallel for num_threads(workers) schedule(static) if (workers > 1)
    for (int t = 0; t < workers; t++) {
        long r0 = t * per, n = M - r0 < per ? M - r0 : per;
        if (n <= 0) continue;
        float *rows = w->qkv + r0 * width;
        rope_cache_write(rows, rows + qd, rows + qd + kvd, width, width, width, st->cos + r0 * d, st->sin + r0 * d,
                         L->k_cache, L->v_cache, st->slots + r0, n, st->q_heads, st->kv_heads, d);
        for (long m = r0; m < r0 + n; m++) memcpy(w->q + m * qd, w->qkv + m * width, qd * sizeof(float));
    }
}

static int attention_part(const StackLayer *L, const StackStep *st, float *x, const float *pending, float *out,
                          Work *w) {
    int threads = (int)st->threads, rc;
    norm_rows(st, x, pending, L->input_norm, w->normed);
    if ((rc = linear(&L->qkv, w->normed, w->qkv, st->batch, threads, st)) != 0) return rc;
    rope_rows(L, st, w);
    if ((rc = attend_rows(L, st, w->q, w->attn)) != 0) return rc;
    return linear(&L->o, w->attn, out, st->batch, threads, st);
}

/* The MLP half: x += attention's output, the post-attention norm, gate/up, silu(gate) * up, down
 * into out (this rank's partial sum under tp). */
static int mlp_part(const StackLayer *L, const StackStep *st, float *x, const float *attention, float *out, Work *w) {
    long M = st->batch, I = st->intermediate;
    int rc;
    norm_rows(st, x, attention, L->post_norm, w->normed);
    if ((rc = linear(&L->gate_up, w->normed, w->gate_up, M, (int)st->threads, st)) != 0) return rc;
    silu_mul_rows(w->gate_up, w->act, M, I, (int)st->threads);
    return linear(&L->down, w->act, out, M, (int)st->threads, st);
}

int decode_stack(const StackLayer *layers, long n_layers, const StackStep *st, float *x) {
    if (!step_fits(layers, n_layers, st)) return -1;
    Work w;
    float *mem = work_alloc(st, &w);
    if (!mem) return -2;
    int rc = 0;
    const float *pending = NULL;
    for (long l = 0; l < n_layers && rc == 0; l++) {
        rc = attention_part(layers + l, st, x, pending, w.branch[0], &w);
        if (rc == 0) rc = mlp_part(layers + l, st, x, w.branch[0], w.branch[1], &w);
        pending = w.branch[1];
    }
    if (rc == 0 && pending)
        for (long i = 0; i < st->batch * st->hidden; i++) x[i] += pending[i];
    free(mem);
    return rc == 0 ? 0 : -2;
}

/* One half of layer `l` (part 0: attention, 1: the MLP) for a tensor-parallel stage, whose caller
 * all-reduces `out` between the halves and hands it back as the next half's `pending` (NULL before
 * the first layer); after the last layer, x += pending is the caller's too. Returns as decode_stack. */
int decode_layer_part(const StackLayer *layers, long l, int part, const StackStep *st, float *x,
                      const float *pending, float *out) {
    if ((part != 0 && part != 1) || !step_fits(layers + l, 1, st)) return -1;
    Work w;
    float *mem = work_alloc(st, &w);
    if (!mem) return -2;
    int rc = part == 0 ? attention_part(layers + l, st, x, pending, out, &w)
                       : mlp_part(layers + l, st, x, pending, out, &w);
    free(mem);
    return rc == 0 ? 0 : -2;
}
