/* The entry points of cpu_kernels.c that decode_stack.c composes (see each one's comment there). */
#ifndef DIST_INFER_CPU_KERNELS_H
#define DIST_INFER_CPU_KERNELS_H

int skinny_linear(const float *x, const float *w, float *y, long M, long N, long K, int threads);
int quant_linear(const float *x, const void *q, const float *scales, const float *zeros, float *y,
                 long M, long N, long K, long G, int bits, long ldy, int threads);
int dequantize_rows(const void *q, const float *scales, const float *zeros, float *out, long n_rows, long K,
                    long G, int bits, int threads);
void rms_norm(float *x, const float *residual, const float *weight, float *out, long T, long H, float eps);
void rope_cache_write(float *q, float *k, const float *v, long ldq, long ldk, long ldv,
                      const float *cos, const float *sin, float *k_cache, float *v_cache,
                      const long *slots, long T, long q_heads, long kv_heads, long d);
int decode_attention(const float *q, const float *k_cache, const float *v_cache, const long *tables,
                     long width, const long *seq_lens, long window, long B, long q_heads, long kv_heads,
                     long d, long block_size, float scale, float *out, float *lse, int threads);

void silu_mul_rows(const float *gate_up, float *act, long M, long I, int threads);
void causal_softmax_rows(float *s, long rows, long n, const long *seq_lens, long k0, long window);
void merge_chunk_parts(const float *part, long chunks, long stride, long d, float *o, float *lse);
void partial_softmax_rows(float *s, long rows, long n, long group, const long *seq_lens, long p0, long window,
                          float *m, float *sum);

#endif
