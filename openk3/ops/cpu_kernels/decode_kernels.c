/* CPU decode kernels: a bf16 GEMV, and the fused forward of a token's top-k routed experts (fp32 or bf16).
 *
 * Why: decode reads every active weight once per token, so it is bound by memory bandwidth. PyTorch's bf16
 * matrix-vector product on CPU (oneDNN/MKL at M = 1) reaches 7-10 GB/s here against 16-19 GB/s for its fp32 one,
 * so a bf16 model decoded no faster than an fp32 one; and a token's k experts cost ~70 small torch ops per MoE
 * layer (routing by expert, three products and the 8-op SiTU per expert, the combine), more time than their
 * weights take to stream. Both kernels stream each weight row once, widen bf16 to fp32 with a shift (exact),
 * multiply and accumulate in fp32, and round where the torch reference rounds (to nearest even):
 *
 *   gemv:     y[m, o] = rnd(sum_i x[m, i] W[o, i])                                    (F.linear, no bias)
 *   experts:  a = rnd(W1_j z), b = rnd(W3_j z), h_j = rnd(SiTU(a, b)), o_j = rnd(W2_j h_j),
 *             y = rnd(sum_j f32(o_j) w_j)  in the given order of j (ascending expert id)
 *                                     (model/moe.py: expert_forward + combine_topk; k = 1 without weights:
 *                                      layers.DenseMLP)
 *
 * with rnd = round to bf16 for bf16 tensors and the identity for fp32. SiTU-GLU (ops/situ.py) in fp32:
 * (b1 tanh(a / b1) sigmoid(a)) (b2 tanh(b / b2)). The sums differ from torch's only in order, and tanh/exp from
 * torch's vector versions by an ulp or so (tested against the torch path in tests/ops/test_decode_kernels.py).
 * Rows are split across the OpenMP threads; the library is linked against the libgomp torch has already loaded,
 * so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 8

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX512F__
#include <immintrin.h>
#define PREFETCH 1024 /* elements ahead: the next row's start while a row of 1024 ends */
/* 16 bf16 -> 16 fp32: widen to 32 bits and shift into the high half (exact). */
static inline __m512 load16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* sum_i w[i] x[i] in fp32, w bf16. Four vector accumulators in flight: bound by loading w, not by the latency of
 * one chain of fused multiply-adds. */
static inline float dot_bf16(const uint16_t *w, const float *x, int64_t n) {
    int64_t i = 0;
    float acc = 0.0f;
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        _mm_prefetch((const char *)(w + i + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH + 32), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(load16(w + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(load16(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
        a2 = _mm512_fmadd_ps(load16(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
        a3 = _mm512_fmadd_ps(load16(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; i < n; i++) acc += bf16_to_f32(w[i]) * x[i];
    return acc;
}

static inline float dot_f32(const float *w, const float *x, int64_t n) {
    int64_t i = 0;
    float acc = 0.0f;
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        _mm_prefetch((const char *)(w + i + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH + 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH + 48), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; i < n; i++) acc += w[i] * x[i];
    return acc;
}

/* Row `r` of a bf16 (is_bf16) or fp32 matrix with `n` columns, dotted with x. */
static inline float dot_row(int is_bf16, const void *W, int64_t r, const float *x, int64_t n) {
    return is_bf16 ? dot_bf16((const uint16_t *)W + r * n, x, n) : dot_f32((const float *)W + r * n, x, n);
}

static inline float load_any(int is_bf16, const void *p, int64_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_any(int is_bf16, void *p, int64_t i, float v) {
    if (is_bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

int openk3_gemv_bf16(const uint16_t *x, const uint16_t *W, uint16_t *y, int64_t M, int64_t O, int64_t I) {
    if (M < 1 || M > MAX_ROWS) return 1;
    float *xf = malloc(sizeof(float) * (size_t)(M * I));
    if (!xf) return 2;
    for (int64_t i = 0; i < M * I; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < O; o++)
        for (int64_t m = 0; m < M; m++) y[m * O + o] = f32_to_bf16(dot_bf16(W + o * I, xf + m * I, I));
    free(xf);
    return 0;
}

/* One token's k experts: z [I]; w1[j], w3[j] [F, I]; w2[j] [O, F]; weights [k] fp32 or NULL (k = 1: the plain MLP
 * output); y [O]. All tensors bf16 (is_bf16) or all fp32, row-major and contiguous. */
int openk3_experts(int is_bf16, const void *z, int64_t I, int64_t F, int64_t O, int64_t k, const void *const *w1,
                   const void *const *w3, const void *const *w2, const float *weights, float beta, float linear_beta,
                   void *y) {
    if (k < 1 || (weights == NULL && k != 1)) return 1;
    float *zf = malloc(sizeof(float) * (size_t)(I + k * F + k * O));
    if (!zf) return 2;
    float *h = zf + I, *out = h + k * F;
    for (int64_t i = 0; i < I; i++) zf[i] = load_any(is_bf16, z, i);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < k * F; r++) {
            int64_t j = r / F, f = r % F;
            float a = dot_row(is_bf16, w1[j], f, zf, I), b = dot_row(is_bf16, w3[j], f, zf, I);
            if (is_bf16) a = round_bf16(a), b = round_bf16(b);
            float gate = beta * tanhf(a / beta) * (1.0f / (1.0f + expf(-a)));
            float up = linear_beta * tanhf(b / linear_beta);
            float v = gate * up;
            h[r] = is_bf16 ? round_bf16(v) : v;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < k * O; r++) {
            int64_t j = r / O, o = r % O;
            float v = dot_row(is_bf16, w2[j], o, h + j * F, F);
            out[r] = is_bf16 ? round_bf16(v) : v;
        }
#pragma omp for schedule(static)
        for (int64_t o = 0; o < O; o++) {
            float acc = out[o];
            if (weights) {
                acc = out[o] * weights[0];
                for (int64_t j = 1; j < k; j++) acc = acc + out[j * O + o] * weights[j];
            }
            store_any(is_bf16, y, o, acc);
        }
    }
    free(zf);
    return 0;
}
