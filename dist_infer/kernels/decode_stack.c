/* decode_stack: a step through every decoder layer of a Llama stage in one call: a decode step (one
 * new token for each of 1..8 sequences), or any rows at all (a mixed step: prompt chunks beside
 * decodes) where the caller hands over a GEMM: BLAS's sgemm_, or oneDNN's dnnl_sgemm.
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
} StackStep;

typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *,
                         const int *);
typedef int (*dnnl_sgemm_fn)(char, char, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                             int64_t, float, float *, int64_t);

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

static int linear(const StackLinear *w, const float *x, float *y, long M, int threads, const StackStep *st) {
    if (M > MAX_SKINNY_ROWS) {
        if (w->bits != 32) return quant_gemm(w, x, y, M, threads, st);
        return gemm_rows(st, (const float *)w->w, x, y, M, w->n, w->n, w->k);
    }
    if (w->bits == 32) return skinny_linear(x, (const float *)w->w, y, M, w->n, w->k, threads);
    return quant_linear(x, w->w, w->scales, w->zeros, y, M, w->n, w->k, w->group, (int)w->bits, w->n, threads);
}

static int step_fits(const StackLayer *layers, long n_layers, const StackStep *st) {
    long H = st->hidden, d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d, I = st->intermediate;
    if (st->batch < 1 || (st->batch > MAX_SKINNY_ROWS && !st->sgemm) || st->q_heads < 1 || st->kv_heads < 1 ||
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

/* A prompt chunk's rows q [R, q_heads * d] (one sequence: table, each row's seq_len, ascending)
 * attending in two products per query head, as SDPA does: the sequence's keys and values gathered
 * from their blocks once, scores = Q K^T through the GEMM, each row's softmax over the keys it sees,
 * out = P V through the GEMM. One row at a time (decode_attention) would cost a dot product and a
 * horizontal sum per key, head and row: far slower than SDPA over long contexts (docs/benchmarks.md,
 * "Mixed steps in one native call"). */
static int chunk_attention(const float *q, const float *k_cache, const float *v_cache, const long *table,
                           const long *seq_lens, long R, const StackStep *st, float *out) {
    long d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d, group = st->q_heads / st->kv_heads;
    long bs = st->block_size, window = st->window, end = seq_lens[R - 1];
    long k0 = window > 0 && seq_lens[0] > window ? seq_lens[0] - window : 0, n = end - k0;
    int threads = st->threads > 1 ? (int)st->threads : 1;
    if (n <= 0) return -1;
    /* tasks: a query head and a block of rows each, about two a thread */
    long blocks = (2L * threads + st->q_heads - 1) / st->q_heads, most = (R + 15) / 16;
    blocks = blocks < most ? blocks : most;
    long rb = (R + blocks - 1) / blocks, tasks = st->q_heads * blocks;
    threads = tasks < threads ? (int)tasks : threads;  /* the scratch is one block of scores a worker */
    float *kv = malloc(((size_t)2 * n * kvd + (size_t)threads * rb * n) * sizeof(float));
    if (!kv) return -2;
    float *keys = kv, *values = kv + n * kvd, *scores = values + n * kvd;
    for (long p = k0; p < end;) {  /* a block's positions at a time: contiguous in the cache */
        long off = p % bs, take = bs - off < end - p ? bs - off : end - p, src = (table[p / bs] * bs + off) * kvd;
        memcpy(keys + (p - k0) * kvd, k_cache + src, (size_t)take * kvd * sizeof(float));
        memcpy(values + (p - k0) * kvd, v_cache + src, (size_t)take * kvd * sizeof(float));
        p += take;
    }
    const float scale = (float)st->scale;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (long task = 0; task < tasks; task++) {
        float *s = thread_slice(scores, rb * n);
        long h = task / blocks, r0 = task % blocks * rb, rows = R - r0 < rb ? R - r0 : rb, kvh = h / group;
        if (rows <= 0) continue;
        long ni = seq_lens[r0 + rows - 1] - k0;  /* the keys the block's rows see */
        if (gemm(st, 'T', 'N', ni, rows, d, scale, keys + kvh * d, kvd, q + r0 * qd + h * d, qd, s, ni) != 0) {
            failed = 1;
            continue;
        }
        causal_softmax_rows(s, rows, ni, seq_lens + r0, k0, window);
        if (gemm(st, 'N', 'N', d, rows, ni, 1.0f, values + kvh * d, kvd, s, ni, out + r0 * qd + h * d, qd) != 0)
            failed = 1;
    }
    free(kv);
    return failed ? -3 : 0;
}

/* Attention of every row: a sequence's run of CHUNK_ATTENTION_ROWS or more through chunk_attention,
 * the others (decodes, short chunks) row by row through decode_attention, consecutive ones together. */
static int attend_rows(const StackLayer *L, const StackStep *st, const float *q, float *out) {
    long qd = st->q_heads * st->head_dim, w = st->table_width, n_runs = st->runs ? st->n_runs : 1;
    long pending = 0;  /* first row of the stretch of short runs not yet attended */
    int rc = 0;
    for (long i = 0; i <= n_runs && rc == 0; i++) {
        long r0 = i < n_runs ? (st->runs ? st->runs[i] : 0) : st->batch;
        long r1 = i < n_runs ? (st->runs ? st->runs[i + 1] : st->batch) : st->batch;
        int chunked = st->runs && i < n_runs && st->sgemm && r1 - r0 >= CHUNK_ATTENTION_ROWS;
        if ((chunked || i == n_runs) && r0 > pending)
            rc = decode_attention(q + pending * qd, L->k_cache, L->v_cache, st->tables + pending * w, w,
                                  st->seq_lens + pending, st->window, r0 - pending, st->q_heads, st->kv_heads,
                                  st->head_dim, st->block_size, (float)st->scale, out + pending * qd, NULL,
                                  (int)st->threads);
        if (chunked && rc == 0) {
            rc = chunk_attention(q + r0 * qd, L->k_cache, L->v_cache, st->tables + r0 * w, st->seq_lens + r0, r1 - r0,
                                 st, out + r0 * qd);
            pending = r1;
        }
    }
    return rc;
}

/* The attention half: x += pending (the previous layer's MLP output, if any), the input norm, QKV,
 * rotary and the cache write, attention, o_proj into out (this rank's partial sum under tp). */
static int attention_part(const StackLayer *L, const StackStep *st, float *x, const float *pending, float *out,
                          Work *w) {
    long M = st->batch, H = st->hidden, d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d;
    long width = qd + 2 * kvd;
    int threads = (int)st->threads, rc;
    rms_norm(x, pending, L->input_norm, w->normed, M, H, (float)st->eps);
    if ((rc = linear(&L->qkv, w->normed, w->qkv, M, threads, st)) != 0) return rc;
    rope_cache_write(w->qkv, w->qkv + qd, w->qkv + qd + kvd, width, width, width, st->cos, st->sin, L->k_cache,
                     L->v_cache, st->slots, M, st->q_heads, st->kv_heads, d);
    for (long m = 0; m < M; m++) memcpy(w->q + m * qd, w->qkv + m * width, qd * sizeof(float));
    if ((rc = attend_rows(L, st, w->q, w->attn)) != 0) return rc;
    return linear(&L->o, w->attn, out, M, threads, st);
}

/* The MLP half: x += attention's output, the post-attention norm, gate/up, silu(gate) * up, down
 * into out (this rank's partial sum under tp). */
static int mlp_part(const StackLayer *L, const StackStep *st, float *x, const float *attention, float *out, Work *w) {
    long M = st->batch, I = st->intermediate;
    int rc;
    rms_norm(x, attention, L->post_norm, w->normed, M, st->hidden, (float)st->eps);
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
