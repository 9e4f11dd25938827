/* decode_stack: a decode step (one new token for each of 1..8 sequences) through every decoder
 * layer of a Llama stage in one call.
 *
 * Each kernel a layer needs is already native (cpu_kernels.c), but called one by one from Python a
 * layer costs ~15 calls, and at batch 1 on the default model the interpreter and torch's dispatch
 * between them took about as long as the arithmetic (docs/benchmarks.md, "Weights that stay
 * quantized"). Here the same kernels run back to back in C, in the order and with the arithmetic of
 * the layer-by-layer path: input norm, QKV, rotary and the cache write, attention over the paged
 * cache, o_proj, the residual add with the next norm, gate/up, silu(gate) * up, down, the residual
 * add. Only the activation differs: libm's expf where torch uses its own vectorised exp.
 *
 * x [batch, hidden] is the residual stream, updated in place. Returns 0, -1 when a shape is outside
 * what the kernels take (nothing is half-done: checked before the first layer), -2 without memory.
 * Under tensor parallelism the caller runs each layer's two halves (decode_layer_part) with its
 * all-reduces between them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

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
} StackStep;

static int linear_fits(const StackLinear *w, long n, long k) {
    if (w->n != n || w->k != k || !w->w) return 0;
    if (w->bits == 32) return 1;
    /* quant_linear's groups: a multiple of 32 values (whole vectors, two for packed 4-bit) */
    return (w->bits == 8 || w->bits == 4) && w->scales && w->group > 0 && w->group % 32 == 0 && k % w->group == 0;
}

static int linear(const StackLinear *w, const float *x, float *y, long M, int threads) {
    if (w->bits == 32) return skinny_linear(x, (const float *)w->w, y, M, w->n, w->k, threads);
    return quant_linear(x, w->w, w->scales, w->zeros, y, M, w->n, w->k, w->group, (int)w->bits, w->n, threads);
}

/* act[m, i] = silu(gate[m, i]) * up[m, i] for gate_up rows [gate (I) | up (I)]. */
static void silu_mul(const float *gate_up, float *act, long M, long I) {
    for (long m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *a = act + m * I;
        for (long i = 0; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static int step_fits(const StackLayer *layers, long n_layers, const StackStep *st) {
    long H = st->hidden, d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d, I = st->intermediate;
    if (st->batch < 1 || st->batch > 8 || st->q_heads < 1 || st->kv_heads < 1 || st->q_heads % st->kv_heads ||
        d < 2 || d % 2 || st->block_size < 1)
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

/* The attention half: x += pending (the previous layer's MLP output, if any), the input norm, QKV,
 * rotary and the cache write, attention, o_proj into out (this rank's partial sum under tp). */
static int attention_part(const StackLayer *L, const StackStep *st, float *x, const float *pending, float *out,
                          Work *w) {
    long M = st->batch, H = st->hidden, d = st->head_dim, qd = st->q_heads * d, kvd = st->kv_heads * d;
    long width = qd + 2 * kvd;
    int threads = (int)st->threads, rc;
    rms_norm(x, pending, L->input_norm, w->normed, M, H, (float)st->eps);
    if ((rc = linear(&L->qkv, w->normed, w->qkv, M, threads)) != 0) return rc;
    rope_cache_write(w->qkv, w->qkv + qd, w->qkv + qd + kvd, width, width, width, st->cos, st->sin, L->k_cache,
                     L->v_cache, st->slots, M, st->q_heads, st->kv_heads, d);
    for (long m = 0; m < M; m++) memcpy(w->q + m * qd, w->qkv + m * width, qd * sizeof(float));
    if ((rc = decode_attention(w->q, L->k_cache, L->v_cache, st->tables, st->table_width, st->seq_lens, st->window,
                               M, st->q_heads, st->kv_heads, d, st->block_size, (float)st->scale, w->attn, NULL,
                               threads)) != 0)
        return rc;
    return linear(&L->o, w->attn, out, M, threads);
}

/* The MLP half: x += attention's output, the post-attention norm, gate/up, silu(gate) * up, down
 * into out (this rank's partial sum under tp). */
static int mlp_part(const StackLayer *L, const StackStep *st, float *x, const float *attention, float *out, Work *w) {
    long M = st->batch, I = st->intermediate;
    int rc;
    rms_norm(x, attention, L->post_norm, w->normed, M, st->hidden, (float)st->eps);
    if ((rc = linear(&L->gate_up, w->normed, w->gate_up, M, (int)st->threads)) != 0) return rc;
    silu_mul(w->gate_up, w->act, M, I);
    return linear(&L->down, w->act, out, M, (int)st->threads);
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
