/* CPU decode kernels: a bf16 GEMV, the fused forward of a token's top-k routed experts (fp32 or bf16), and (in
 * the sections below) whole-layer kernels and the decoder stack of a decode step built from them.
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

/* ---- Vector lanes -----------------------------------------------------------------------------------------------
 * The dot products below are written once over a vector type `vf` of VL fp32 lanes: AVX-512 (16 lanes), AVX2 + FMA
 * (8 lanes), else a portable struct of 8 lanes whose loops the compiler vectorizes for whatever the target has (SSE2,
 * NEON, ...). Which one a build took is `openk3_isa()` (the build chooses by its -m flags: ops/cpu_kernels
 * builds the best this CPU runs, or the one OPENK3_CPU_ISA names). Only the order of the fp32 sums differs between
 * them. F16C is not used: widening bf16 is a 16-bit shift, which AVX2 does directly. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define OPENK3_ISA "avx512"
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
/* 16 bf16 -> 16 fp32: widen to 32 bits and shift into the high half (exact). */
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OPENK3_ISA "avx2"
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#else
#if defined(__ARM_NEON) || defined(__aarch64__)
#define OPENK3_ISA "portable-neon"
#else
#define OPENK3_ISA "portable"
#endif
#define VL 8
typedef struct {
    float v[VL];
} vf;
static inline vf vzero(void) {
    vf r;
    for (int l = 0; l < VL; l++) r.v[l] = 0.0f;
    return r;
}
static inline vf vload(const float *p) {
    vf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline vf vload_bf16(const uint16_t *p) {
    vf r;
    for (int l = 0; l < VL; l++) r.v[l] = bf16_to_f32(p[l]);
    return r;
}
static inline vf vfma(vf a, vf b, vf c) {
    for (int l = 0; l < VL; l++) c.v[l] += a.v[l] * b.v[l];
    return c;
}
static inline vf vadd(vf a, vf b) {
    for (int l = 0; l < VL; l++) a.v[l] += b.v[l];
    return a;
}
static inline float vsum(vf a) {
    float s = 0.0f;
    for (int l = 0; l < VL; l++) s += a.v[l];
    return s;
}
#endif

/* Which vector path this build took ("avx512", "avx2", "portable-neon" or "portable"). */
const char *openk3_isa(void) { return OPENK3_ISA; }

#define PREFETCH 1024 /* elements ahead: the next row's start while a row of 1024 ends */
#define prefetch(p) __builtin_prefetch((const void *)(p), 0, 3)

/* sum_i w[i] x[i] in fp32, w bf16. Four vector accumulators in flight: bound by loading w, not by the latency of
 * one chain of fused multiply-adds. */
static inline float dot_bf16(const uint16_t *w, const float *x, int64_t n) {
    int64_t i = 0;
    vf a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * VL <= n; i += 4 * VL) {
        prefetch(w + i + PREFETCH);
        prefetch(w + i + PREFETCH + 32);
        a0 = vfma(vload_bf16(w + i), vload(x + i), a0);
        a1 = vfma(vload_bf16(w + i + VL), vload(x + i + VL), a1);
        a2 = vfma(vload_bf16(w + i + 2 * VL), vload(x + i + 2 * VL), a2);
        a3 = vfma(vload_bf16(w + i + 3 * VL), vload(x + i + 3 * VL), a3);
    }
    float acc = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
    for (; i < n; i++) acc += bf16_to_f32(w[i]) * x[i];
    return acc;
}

static inline float dot_f32(const float *w, const float *x, int64_t n) {
    int64_t i = 0;
    vf a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * VL <= n; i += 4 * VL) {
        for (int64_t c = 0; c < 4 * VL; c += 16) prefetch(w + i + PREFETCH + c);
        a0 = vfma(vload(w + i), vload(x + i), a0);
        a1 = vfma(vload(w + i + VL), vload(x + i + VL), a1);
        a2 = vfma(vload(w + i + 2 * VL), vload(x + i + 2 * VL), a2);
        a3 = vfma(vload(w + i + 3 * VL), vload(x + i + 3 * VL), a3);
    }
    float acc = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
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

/* Four consecutive rows at once: four streams in flight and x loaded once for all four, each stream prefetched 16
 * KiB ahead. Measured with AVX-512 on the 2-core Intel machine (one process, old and new kernels interleaved): 6-10%
 * more bandwidth than one row at a time for rows of 1024 columns, but 15-20% less for rows of 512 (the routed
 * experts), so dot_rows takes it for rows of at least DOT4_MIN_COLUMNS only, and only in the AVX-512 build: on the
 * AVX2 machine (AMD Zen 3) it was slower at every width, and a bf16 decode step 16% faster without it. */
#define DOT4_MIN_COLUMNS 1024
#if defined(__AVX512F__)
#define USE_DOT4 1
#else /* AVX2 on an AMD Zen 3: one row at a time streamed 8-15% faster than four, rows of 1024 or 4096 x 1024 */
#define USE_DOT4 0
#endif
#define PREFETCH4_BYTES 16384
static inline void dot4_bf16(const uint16_t *w, const float *x, int64_t n, float *out) {
    const uint16_t *r[4] = {w, w + n, w + 2 * n, w + 3 * n};
    vf a[4], b[4];
    for (int q = 0; q < 4; q++) a[q] = b[q] = vzero();
    int64_t i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        const vf x0 = vload(x + i), x1 = vload(x + i + VL);
        for (int q = 0; q < 4; q++) {
            prefetch((const char *)(r[q] + i) + PREFETCH4_BYTES);
            a[q] = vfma(vload_bf16(r[q] + i), x0, a[q]);
            b[q] = vfma(vload_bf16(r[q] + i + VL), x1, b[q]);
        }
    }
    for (int q = 0; q < 4; q++) {
        float acc = vsum(vadd(a[q], b[q]));
        for (int64_t t = i; t < n; t++) acc += bf16_to_f32(r[q][t]) * x[t];
        out[q] = acc;
    }
}

static inline void dot4_f32(const float *w, const float *x, int64_t n, float *out) {
    const float *r[4] = {w, w + n, w + 2 * n, w + 3 * n};
    vf a[4], b[4];
    for (int q = 0; q < 4; q++) a[q] = b[q] = vzero();
    int64_t i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        const vf x0 = vload(x + i), x1 = vload(x + i + VL);
        for (int q = 0; q < 4; q++) {
            prefetch((const char *)(r[q] + i) + PREFETCH4_BYTES);
            a[q] = vfma(vload(r[q] + i), x0, a[q]);
            b[q] = vfma(vload(r[q] + i + VL), x1, b[q]);
        }
    }
    for (int q = 0; q < 4; q++) {
        float acc = vsum(vadd(a[q], b[q]));
        for (int64_t t = i; t < n; t++) acc += r[q][t] * x[t];
        out[q] = acc;
    }
}

/* out[q] = row (o + q) of W (n columns) dotted with x, for q < cnt <= 4. */
static inline void dot_rows(int is_bf16, const void *W, int64_t o, int64_t cnt, const float *x, int64_t n, float *out) {
    if (USE_DOT4 && cnt == 4 && n >= DOT4_MIN_COLUMNS) {
        if (is_bf16)
            dot4_bf16((const uint16_t *)W + o * n, x, n, out);
        else
            dot4_f32((const float *)W + o * n, x, n, out);
        return;
    }
    for (int64_t q = 0; q < cnt; q++) out[q] = dot_row(is_bf16, W, o + q, x, n);
}

/* The same rows of a gate and an up matrix: narrow rows alternate between the two (as one row at a time streams
 * best there; measured ~12% faster than four rows of one then four of the other). */
static inline void dot_pair_rows(int is_bf16, const void *W1, const void *W3, int64_t o, int64_t cnt, const float *x,
                                 int64_t n, float *a, float *b) {
    if (USE_DOT4 && cnt == 4 && n >= DOT4_MIN_COLUMNS) {
        dot_rows(is_bf16, W1, o, cnt, x, n, a);
        dot_rows(is_bf16, W3, o, cnt, x, n, b);
        return;
    }
    for (int64_t q = 0; q < cnt; q++) a[q] = dot_row(is_bf16, W1, o + q, x, n), b[q] = dot_row(is_bf16, W3, o + q, x, n);
}

/* Blocks of 4 rows: the parallel loops below run over blocks, block b of a matrix covering rows 4b .. 4b+3. */
#define BLOCKS(rows) (((rows) + 3) / 4)
#define BLOCK_ROWS(o, rows) ((rows) - (o) < 4 ? (rows) - (o) : 4)

/* Inside a parallel region (an orphaned omp for): y_j[m, o] = rnd(W_j[o] . x_m) for the nw matrices W_j [O_j, I] and
 * the M inputs x [M, I] (fp32), their rows split over the threads in blocks of 4. y_j [M, O_j] is the activation
 * dtype, or fp32 (rounded) with y_fp32. */
static void gemv_blocks(int is_bf16, int64_t nw, const void *const *W, const int64_t *O, const float *x, int64_t M,
                        int64_t I, void *const *y, int y_fp32) {
    int64_t B = 0;
    for (int64_t j = 0; j < nw; j++) B += BLOCKS(O[j]);
#pragma omp for schedule(static)
    for (int64_t bl = 0; bl < B; bl++) {
        int64_t j = 0, b = bl;
        while (b >= BLOCKS(O[j])) b -= BLOCKS(O[j++]);
        const int64_t o = 4 * b, cnt = BLOCK_ROWS(o, O[j]);
        float v[4];
        for (int64_t m = 0; m < M; m++) {
            dot_rows(is_bf16, W[j], o, cnt, x + m * I, I, v);
            for (int64_t q = 0; q < cnt; q++) {
                if (y_fp32)
                    ((float *)y[j])[m * O[j] + o + q] = is_bf16 ? round_bf16(v[q]) : v[q];
                else
                    store_any(is_bf16, y[j], m * O[j] + o + q, v[q]);
            }
        }
    }
}

int openk3_gemv_bf16(const uint16_t *x, const uint16_t *W, uint16_t *y, int64_t M, int64_t O, int64_t I) {
    if (M < 1 || M > MAX_ROWS) return 1;
    float *xf = malloc(sizeof(float) * (size_t)(M * I));
    if (!xf) return 2;
    for (int64_t i = 0; i < M * I; i++) xf[i] = bf16_to_f32(x[i]);
    const void *w = W;
    void *out = y;
#pragma omp parallel
    gemv_blocks(1, 1, &w, &O, xf, M, I, &out, 0);
    free(xf);
    return 0;
}

/* rnd(SiTU-GLU(rnd(a), rnd(b))) of one gate/up pair (ops/situ.py, fp32). */
static inline float situ(int is_bf16, float a, float b, float beta, float linear_beta) {
    if (is_bf16) a = round_bf16(a), b = round_bf16(b);
    const float gate = beta * tanhf(a / beta) * (1.0f / (1.0f + expf(-a)));
    const float v = gate * (linear_beta * tanhf(b / linear_beta));
    return is_bf16 ? round_bf16(v) : v;
}

/* Inside a parallel region, without a barrier at the end (the caller places one before reading h): the k experts'
 * hidden rows h[j, f] = rnd(SiTU(rnd(W1_j[f] . z), rnd(W3_j[f] . z))), W1_j, W3_j [F, I]. */
static void experts_gate_up(int is_bf16, int64_t k, int64_t F, int64_t I, const void *const *w1, const void *const *w3,
                            const float *z, float beta, float linear_beta, float *h) {
#pragma omp for schedule(static) nowait
    for (int64_t bl = 0; bl < k * BLOCKS(F); bl++) {
        const int64_t j = bl / BLOCKS(F), f = 4 * (bl % BLOCKS(F)), cnt = BLOCK_ROWS(f, F);
        float a[4], b[4];
        dot_pair_rows(is_bf16, w1[j], w3[j], f, cnt, z, I, a, b);
        for (int64_t q = 0; q < cnt; q++) h[j * F + f + q] = situ(is_bf16, a[q], b[q], beta, linear_beta);
    }
}

/* Inside a parallel region (ends with a barrier): the k experts' outputs eo[j, o] = rnd(W2_j[o] . h_j), W2_j [O, F]. */
static void experts_down(int is_bf16, int64_t k, int64_t O, int64_t F, const void *const *w2, const float *h, float *eo) {
#pragma omp for schedule(static)
    for (int64_t bl = 0; bl < k * BLOCKS(O); bl++) {
        const int64_t j = bl / BLOCKS(O), o = 4 * (bl % BLOCKS(O)), cnt = BLOCK_ROWS(o, O);
        float v[4];
        dot_rows(is_bf16, w2[j], o, cnt, h + j * F, F, v);
        for (int64_t q = 0; q < cnt; q++) eo[j * O + o + q] = is_bf16 ? round_bf16(v[q]) : v[q];
    }
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
        experts_gate_up(is_bf16, k, F, I, w1, w3, zf, beta, linear_beta, h);
#pragma omp barrier
        experts_down(is_bf16, k, O, F, w2, h, out);
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

static inline float sigmoidf(float z) { return 1.0f / (1.0f + expf(-z)); }

/* ---- KDA decode: a whole KDA layer's decode step, from its input to o_proj ------------------------------------
 * (model/kda.py, DECODE mode; one token per sequence, N <= MAX_ROWS.) rnd is as above (activation dtype). Phases:
 *   1. the input projections q0, k0, v0, g_out, f_a [*, P or K] and b [*, H]: rnd(W x)       (F.linear, no bias)
 *   2. f = rnd(W_fb f_a)                                                                      (f_b_proj)
 *   3. per sequence n and head h, channels c of the head (ch = h K + c):
 *      conv:  x1 = rnd(SiLU(sum_j w[ch, j] [tail; x0][j, ch]))  for q, k, v (ops/conv.py short_conv_few; fp32)
 *             new tail = the last W-1 rows of [tail; x0]
 *      q^ = x1_q / sqrt(sum_c x1_q^2 + 1e-6), same for k^   (ops/norm.py l2_norm; fp32, not rounded on decode)
 *      g  = lower_bound sigmoid(exp(A_log[h]) (f + dt_bias))   (ops/kda/ref.py kda_gate)
 *      beta = sigmoid(b)
 *      S  = exp(g) S;  e = v - S^T k^;  S = S + (beta k^) e^T;  o = rnd(S^T (scale q^))   (ops/kda/ref.py
 *           recurrence_step, fp32 state [K, V], V = K)
 *      o' = rnd(o / sqrt(mean o^2 + eps) * w_norm * sigmoid(g_out))   (ops/norm.py gated_rms_norm)
 *   4. out = rnd(W_o o')                                                                      (o_proj)
 * x [N, D], the matrices (proj[0..5] = W_q, W_k, W_v, W_g [P, D], W_fa [K, D], W_b [H, D]; W_fb [P, K]; W_o [D, P]),
 * the tails and out are in the activation dtype; the conv weights [P, W], A_log [H], dt_bias [P], w_norm [K] and
 * the state are fp32. Sequence n reads row rows_in[n] of the tails ([*, W-1, P] per projection) and of the state
 * ([*, H, K, K]) and writes row rows_out[n] of the outputs, which may be the inputs themselves (the serving pools,
 * updated in place: every element is read before it is written). */
#define MOE_MAX_TOP_K 64
#define MOE_MAX_EXPERTS_BITMAP 1024 /* bytes: up to 8192 experts (K3: 896) */
#define KDA_MAX_HEAD_DIM 512 /* the per-thread scratch of one head lives on the stack (K3: 128) */
static void kda_head(int is_bf16, int64_t n, int64_t h, int64_t H, int64_t K, int64_t W, const float *const *x0,
                     const void *const *tails_in, const float *state_in, const int64_t *rows_in,
                     void *const *tails_out, float *state_out, const int64_t *rows_out, const float *const *conv_w,
                     const float *f, const float *A_log, const float *dt_bias, float lower_bound, const float *b,
                     const float *gate, const float *w_norm, float eps, float scale, float *o_out, float *buf) {
    const int64_t P = H * K;
    float *qv = buf, *kv = buf + K, *vv = buf + 2 * K, *g = buf + 3 * K, *e = buf + 4 * K, *o = buf + 5 * K;
    float *const x1[3] = {qv, kv, vv};
    for (int p = 0; p < 3; p++) {
        const int64_t tail_in = rows_in[n] * (W - 1) * P, tail_out = rows_out[n] * (W - 1) * P;
        for (int64_t c = 0; c < K; c++) {
            const int64_t ch = h * K + c;
            const float *w = conv_w[p] + ch * W;
            float acc = 0.0f;
            for (int64_t j = 0; j < W - 1; j++) acc += w[j] * load_any(is_bf16, tails_in[p], tail_in + j * P + ch);
            const float cur = x0[p][n * P + ch];
            acc += w[W - 1] * cur;
            const float y = acc / (1.0f + expf(-acc));
            x1[p][c] = is_bf16 ? round_bf16(y) : y;
            for (int64_t j = 0; j < W - 2; j++) /* ascending: in place, row j+1 is read before it is written */
                store_any(is_bf16, tails_out[p], tail_out + j * P + ch,
                          load_any(is_bf16, tails_in[p], tail_in + (j + 1) * P + ch));
            store_any(is_bf16, tails_out[p], tail_out + (W - 2) * P + ch, cur);
        }
    }
    for (int p = 0; p < 2; p++) { /* l2 norm of q and k */
        float ss = 0.0f;
        for (int64_t c = 0; c < K; c++) ss += x1[p][c] * x1[p][c];
        const float r = 1.0f / sqrtf(ss + 1e-6f);
        for (int64_t c = 0; c < K; c++) x1[p][c] *= r;
    }
    const float a = expf(A_log[h]);
    for (int64_t c = 0; c < K; c++) g[c] = expf(lower_bound * sigmoidf(a * (f[n * P + h * K + c] + dt_bias[h * K + c])));
    const float beta = sigmoidf(b[n * H + h]);
    const float *S0 = state_in + (rows_in[n] * H + h) * K * K;
    float *S = state_out + (rows_out[n] * H + h) * K * K;
    for (int64_t v = 0; v < K; v++) e[v] = 0.0f;
    for (int64_t c = 0; c < K; c++) { /* decay, and S^T k^ on the decayed state */
        const float d = g[c], kc = kv[c];
        for (int64_t v = 0; v < K; v++) {
            const float sd = d * S0[c * K + v];
            S[c * K + v] = sd;
            e[v] += sd * kc;
        }
    }
    for (int64_t v = 0; v < K; v++) e[v] = vv[v] - e[v], o[v] = 0.0f;
    for (int64_t c = 0; c < K; c++) { /* delta write, then read with the scaled query */
        const float bk = beta * kv[c], sq = scale * qv[c];
        for (int64_t v = 0; v < K; v++) {
            const float sn = S[c * K + v] + bk * e[v];
            S[c * K + v] = sn;
            o[v] += sn * sq;
        }
    }
    float ss = 0.0f;
    for (int64_t v = 0; v < K; v++) {
        if (is_bf16) o[v] = round_bf16(o[v]);
        ss += o[v] * o[v];
    }
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    for (int64_t v = 0; v < K; v++) {
        const float y = o[v] * r * w_norm[v] * sigmoidf(gate[n * P + h * K + v]);
        o_out[n * P + h * K + v] = is_bf16 ? round_bf16(y) : y;
    }
}

int openk3_kda_decode(int is_bf16, int64_t N, int64_t D, int64_t H, int64_t K, int64_t W, const void *x,
                      const void *const *proj, const void *w_fb, const void *w_o, const void *const *tails_in,
                      const float *state_in, const int64_t *rows_in, void *const *tails_out, float *state_out,
                      const int64_t *rows_out, const float *const *conv_w, const float *A_log, const float *dt_bias,
                      float lower_bound, const float *w_norm, float eps, float scale, void *out) {
    if (N < 1 || N > MAX_ROWS || H < 1 || K < 1 || K > KDA_MAX_HEAD_DIM || W < 2) return 1;
    const int64_t P = H * K;
    /* fp32 buffers: x, the six projections (q0, k0, v0, g_out [P]; f_a [K]; b [H]), f [P], o' [P], per sequence */
    const int64_t rows[6] = {P, P, P, P, K, H};
    float *mem = malloc(sizeof(float) * (size_t)(N * (D + 4 * P + K + H + 2 * P)));
    if (!mem) return 2;
    float *xf = mem, *pr[6], *f, *o;
    pr[0] = xf + N * D;
    for (int j = 1; j < 6; j++) pr[j] = pr[j - 1] + N * rows[j - 1];
    f = pr[5] + N * H;
    o = f + N * P;
    for (int64_t i = 0; i < N * D; i++) xf[i] = load_any(is_bf16, x, i);
#pragma omp parallel
    {
        gemv_blocks(is_bf16, 6, proj, rows, xf, N, D, (void *const *)pr, 1); /* 1. the input projections */
        gemv_blocks(is_bf16, 1, &w_fb, &P, pr[4], N, K, (void *const *)&f, 1); /* 2. f_b_proj */
        float buf[6 * KDA_MAX_HEAD_DIM];
#pragma omp for schedule(static)
        for (int64_t nh = 0; nh < N * H; nh++) /* 3. conv, norms, gate, delta step, gated norm */
            kda_head(is_bf16, nh / H, nh % H, H, K, W, (const float *const *)pr, tails_in, state_in, rows_in, tails_out,
                     state_out, rows_out, conv_w, f, A_log, dt_bias, lower_bound, pr[5], pr[3], w_norm, eps, scale, o,
                     buf);
        gemv_blocks(is_bf16, 1, &w_o, &D, o, N, P, &out, 0); /* 4. o_proj */
    }
    free(mem);
    return 0;
}

/* ---- Block AttnRes mix, then the layer's RMSNorm --------------------------------------------------------------
 * (ops/attnres.py attn_res_mix, then ops/norm.py rms_norm; one token per row.) Per row t, over the S sources
 * V_s (the bank in order, the partial sum last), with q = f32(mix_w) f32(query):
 *   l_s = sum_c (V_s[c] / sqrt(mean V_s^2 + mix_eps)) q[c];  p = softmax(l);  h = rnd(sum_s p_s V_s)
 *   out = norm_w rnd(h / sqrt(mean h^2 + norm_eps))   (the product rounded once more; norm_w NULL: out = h)
 * Sources, out and the weights are all bf16 (is_bf16) or all fp32; sources [T, D] each, S <= 64. */
int openk3_mix_norm(int is_bf16, int64_t T, int64_t D, int64_t S, const void *const *src, const void *mix_w,
                    const void *query, float mix_eps, const void *norm_w, float norm_eps, void *out) {
    if (S < 1 || S > 64 || T < 1) return 1;
    float *q = malloc(sizeof(float) * (size_t)D);
    if (!q) return 2;
    for (int64_t c = 0; c < D; c++) q[c] = load_any(is_bf16, mix_w, c) * load_any(is_bf16, query, c);
    int failed = 0;
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        float p[64];
        float *V = malloc(sizeof(float) * (size_t)((S + 1) * D)); /* the sources in fp32, then h */
        if (!V) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *h = V + S * D, top = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
            float *v = V + s * D;
            for (int64_t c = 0; c < D; c++) v[c] = load_any(is_bf16, src[s], t * D + c);
            const float r = 1.0f / sqrtf(dot_f32(v, v, D) / (float)D + mix_eps);
            p[s] = dot_f32(v, q, D) * r; /* = sum_c (v[c] r) q[c] up to rounding */
            if (p[s] > top) top = p[s];
        }
        float z = 0.0f;
        for (int64_t s = 0; s < S; s++) p[s] = expf(p[s] - top), z += p[s];
        for (int64_t s = 0; s < S; s++) p[s] /= z;
        for (int64_t c = 0; c < D; c++) h[c] = 0.0f;
        for (int64_t s = 0; s < S; s++)
            for (int64_t c = 0; c < D; c++) h[c] += p[s] * V[s * D + c];
        if (is_bf16)
            for (int64_t c = 0; c < D; c++) h[c] = round_bf16(h[c]);
        if (norm_w == NULL) {
            for (int64_t c = 0; c < D; c++) store_any(is_bf16, out, t * D + c, h[c]);
        } else {
            const float r = 1.0f / sqrtf(dot_f32(h, h, D) / (float)D + norm_eps);
            for (int64_t c = 0; c < D; c++) {
                float nv = h[c] * r;
                if (is_bf16) nv = round_bf16(nv);
                store_any(is_bf16, out, t * D + c, load_any(is_bf16, norm_w, c) * nv);
            }
        }
        free(V);
    }
    free(q);
    return failed ? 2 : 0;
}

/* ---- A StableLatentMoE layer's decode step ---------------------------------------------------------------------
 * (model/moe.py StableLatentMoE.forward for one token; rnd as above.)
 *   s   = sigmoid(f32(x) f32(W_gate)^T)                      router scores, fp32 [E]        (ops/moe/route.py)
 *   idx = the k largest s + bias, ties to the lower expert id, ascending; or given (routing replay, ascending)
 *   w   = s[idx] / (sum s[idx] + 1e-20) (if renormalize), times scaling
 *   z   = rnd(W_down x)                                      routed_expert_down_proj       [Lt]
 *   y   = rnd(sum_j f32(w_j) rnd(W2_j rnd(SiTU(rnd(W1_j z), rnd(W3_j z)))))   the experts, as openk3_experts
 *   yn  = norm_w rnd(y / sqrt(mean y^2 + norm_eps))           routed_expert_norm (rms_norm's roundings)
 *   out = rnd(rnd(W_up yn) + s)                              routed_expert_up_proj, plus the shared experts
 *   s   = rnd(Ws_down rnd(SiTU(rnd(Ws_gate x), rnd(Ws_up x))))  (DenseMLP; ws_gate NULL: no shared experts)
 * in six parallel phases (the router with z and the shared gate/up; the top-k; the experts' W1/W3 with the shared
 * down; W2; the combine and norm; the up projection). x, out [D]; W_gate [E, D]; bias [E] fp32; W_down [Lt, D];
 * w1, w3 [E, F, Lt] and w2 [E, Lt, F] stacked; norm_w [Lt]; W_up [D, Lt]; Ws_gate, Ws_up [Fs, D]; Ws_down [D, Fs];
 * every tensor but bias bf16 (is_bf16) or fp32. Written back: idx [k] (int64), scores [E] and weights [k] (fp32). */
int openk3_moe_decode(int is_bf16, int64_t D, int64_t Lt, int64_t F, int64_t Fs, int64_t E, int64_t k, const void *x,
                      const void *w_gate, const float *bias, int renormalize, float scaling, int replay, int64_t *idx,
                      float *scores, float *weights, const void *w_down, const void *w1s, const void *w3s,
                      const void *w2s, const void *norm_w, float norm_eps, const void *w_up, const void *ws_gate,
                      const void *ws_up, const void *ws_down, float beta, float linear_beta, void *out) {
    if (k < 1 || k > E || k > MOE_MAX_TOP_K || E > 8 * MOE_MAX_EXPERTS_BITMAP) return 1;
    if (replay)
        for (int64_t j = 0; j < k; j++)
            if (idx[j] < 0 || idx[j] >= E || (j > 0 && idx[j] <= idx[j - 1])) return 3; /* in range, ascending, distinct */
    const int shared = ws_gate != NULL;
    if (!shared) Fs = 0;
    const size_t el = is_bf16 ? 2 : 4;
    const void *w1[MOE_MAX_TOP_K], *w3[MOE_MAX_TOP_K], *w2[MOE_MAX_TOP_K];
    float *buf = malloc(sizeof(float) * (size_t)(D + Lt + Fs + k * F + k * Lt + Lt + D));
    if (!buf) return 2;
    float *xf = buf, *z = xf + D, *hs = z + Lt, *h = hs + Fs, *eo = h + k * F, *yn = eo + k * Lt, *so = yn + Lt;
    for (int64_t i = 0; i < D; i++) xf[i] = load_any(is_bf16, x, i);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t bl = 0; bl < BLOCKS(E) + BLOCKS(Lt) + BLOCKS(Fs); bl++) {
            float a[4], b[4];
            if (bl < BLOCKS(E)) { /* router scores */
                const int64_t e = 4 * bl, cnt = BLOCK_ROWS(e, E);
                dot_rows(is_bf16, w_gate, e, cnt, xf, D, a);
                for (int64_t q = 0; q < cnt; q++) scores[e + q] = sigmoidf(a[q]);
            } else if (bl < BLOCKS(E) + BLOCKS(Lt)) {
                const int64_t o = 4 * (bl - BLOCKS(E)), cnt = BLOCK_ROWS(o, Lt);
                dot_rows(is_bf16, w_down, o, cnt, xf, D, a);
                for (int64_t q = 0; q < cnt; q++) z[o + q] = is_bf16 ? round_bf16(a[q]) : a[q];
            } else {
                const int64_t f = 4 * (bl - BLOCKS(E) - BLOCKS(Lt)), cnt = BLOCK_ROWS(f, Fs);
                dot_pair_rows(is_bf16, ws_gate, ws_up, f, cnt, xf, D, a, b);
                for (int64_t q = 0; q < cnt; q++) hs[f + q] = situ(is_bf16, a[q], b[q], beta, linear_beta);
            }
        }
#pragma omp single
        {
            if (!replay) { /* top-k of the biased scores; ties go to the lower expert id; then ascending */
                unsigned char taken[MOE_MAX_EXPERTS_BITMAP] = {0};
                for (int64_t j = 0; j < k; j++) {
                    int64_t best = -1;
                    float top = 0.0f;
                    for (int64_t e = 0; e < E; e++) {
                        if (taken[e >> 3] & (1u << (e & 7))) continue;
                        const float c = scores[e] + bias[e];
                        if (best < 0 || c > top || (isnan(c) && !isnan(top))) best = e, top = c;
                    }
                    taken[best >> 3] |= (unsigned char)(1u << (best & 7));
                    idx[j] = best;
                }
                for (int64_t j = 1; j < k; j++) /* insertion sort: k is small */
                    for (int64_t i = j; i > 0 && idx[i] < idx[i - 1]; i--) {
                        const int64_t t = idx[i];
                        idx[i] = idx[i - 1], idx[i - 1] = t;
                    }
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < k; j++) weights[j] = scores[idx[j]], sum += weights[j];
            for (int64_t j = 0; j < k; j++) {
                if (renormalize) weights[j] = weights[j] / (sum + 1e-20f);
                weights[j] *= scaling;
                w1[j] = (const char *)w1s + (size_t)(idx[j] * F * Lt) * el;
                w3[j] = (const char *)w3s + (size_t)(idx[j] * F * Lt) * el;
                w2[j] = (const char *)w2s + (size_t)(idx[j] * Lt * F) * el;
            }
        }
        experts_gate_up(is_bf16, k, F, Lt, w1, w3, z, beta, linear_beta, h);
#pragma omp for schedule(static)
        for (int64_t bl = 0; bl < BLOCKS(D); bl++) { /* the shared experts' down projection (none: no rows) */
            if (!shared) continue;
            const int64_t o = 4 * bl, cnt = BLOCK_ROWS(o, D);
            float a[4];
            dot_rows(is_bf16, ws_down, o, cnt, hs, Fs, a);
            for (int64_t q = 0; q < cnt; q++) so[o + q] = is_bf16 ? round_bf16(a[q]) : a[q];
        }
        experts_down(is_bf16, k, Lt, F, w2, h, eo);
#pragma omp single
        {
            float ss = 0.0f;
            for (int64_t o = 0; o < Lt; o++) {
                float acc = eo[o] * weights[0];
                for (int64_t j = 1; j < k; j++) acc = acc + eo[j * Lt + o] * weights[j];
                if (is_bf16) acc = round_bf16(acc);
                yn[o] = acc;
                ss += acc * acc;
            }
            const float rs = 1.0f / sqrtf(ss / (float)Lt + norm_eps);
            for (int64_t o = 0; o < Lt; o++) {
                float v = yn[o] * rs;
                if (is_bf16) v = round_bf16(v);
                v = load_any(is_bf16, norm_w, o) * v;
                yn[o] = is_bf16 ? round_bf16(v) : v;
            }
        }
#pragma omp for schedule(static)
        for (int64_t bl = 0; bl < BLOCKS(D); bl++) {
            const int64_t o = 4 * bl, cnt = BLOCK_ROWS(o, D);
            float v[4];
            dot_rows(is_bf16, w_up, o, cnt, yn, Lt, v);
            for (int64_t q = 0; q < cnt; q++) {
                const float u = is_bf16 ? round_bf16(v[q]) : v[q];
                store_any(is_bf16, out, o + q, shared ? u + so[o + q] : u);
            }
        }
    }
    free(buf);
    return 0;
}

/* ---- Gated MLA decode, in two calls around the cache append --------------------------------------------------
 * (model/mla.py GatedMLA.forward, DECODE mode, absorbed form of ops/attention/mla.py; one token per sequence,
 * N <= MAX_ROWS; rnd as above.)
 * openk3_mla_decode_in: the layer's new token, x [N, D] ->
 *   q [N, H * (nope + rope)] = rnd(W_qb cq),  cq = w_qa_norm rnd(q_a / sqrt(mean q_a^2 + eps)),  q_a = rnd(W_qa x)
 *   latent [N, r + rope] = [w_kv_norm rnd(c / sqrt(mean c^2 + eps)) ; k_pe],  [c ; k_pe] = rnd(W_kva x)
 *   g [N, H * Dv] = rnd(W_g x)
 * (the norms with rms_norm's roundings: rnd(w rnd(normed))); W_qa [Lq, D], W_qb [H Dqk, Lq], W_kva [r + rope, D],
 * W_g [H Dv, D], all in the activation dtype, like the outputs. */
int openk3_mla_decode_in(int is_bf16, int64_t N, int64_t D, int64_t Lq, int64_t Q, int64_t R, int64_t r, int64_t G,
                         const void *x, const void *w_qa, const void *qa_norm, const void *w_qb, const void *w_kva,
                         const void *kv_norm, const void *w_g, float eps, void *q, void *latent, void *g) {
    if (N < 1 || N > MAX_ROWS || r > R) return 1;
    float *mem = malloc(sizeof(float) * (size_t)(N * (D + Lq + R)));
    if (!mem) return 2;
    float *xf = mem, *qa = xf + N * D, *kv = qa + N * Lq;
    for (int64_t i = 0; i < N * D; i++) xf[i] = load_any(is_bf16, x, i);
    const void *in_w[3] = {w_qa, w_kva, w_g};
    const int64_t in_rows[3] = {Lq, R, G};
    void *in_out[3] = {qa, kv, g};
#pragma omp parallel
    {
        /* q_a and the latent projection to fp32 buffers (rounded), g straight to its output: one loop over all rows */
        gemv_blocks(is_bf16, 2, in_w, in_rows, xf, N, D, in_out, 1);
        gemv_blocks(is_bf16, 1, in_w + 2, in_rows + 2, xf, N, D, in_out + 2, 0);
#pragma omp single
        for (int64_t m = 0; m < N; m++) { /* the two norms (1e-6 in K3) */
            float *rows[2] = {qa + m * Lq, kv + m * R};
            const int64_t width[2] = {Lq, r};
            const void *w[2] = {qa_norm, kv_norm};
            for (int p = 0; p < 2; p++) {
                const float rs = 1.0f / sqrtf(dot_f32(rows[p], rows[p], width[p]) / (float)width[p] + eps);
                for (int64_t c = 0; c < width[p]; c++) {
                    float v = rows[p][c] * rs;
                    if (is_bf16) v = round_bf16(v);
                    v = load_any(is_bf16, w[p], c) * v;
                    rows[p][c] = is_bf16 ? round_bf16(v) : v;
                }
            }
            for (int64_t c = 0; c < R; c++) store_any(is_bf16, latent, m * R + c, kv[m * R + c]);
        }
        gemv_blocks(is_bf16, 1, &w_qb, &Q, qa, N, Lq, &q, 0);
    }
    free(mem);
    return 0;
}

/* openk3_mla_decode_out: attention over the cache and the gated output, per sequence n and head h:
 *   q_lat = W_uk[h]^T q_nope;  s_j = [q_lat ; q_pe] . latent_j * scale  (j < len[n]);  p = softmax(s)
 *   o[h] = rnd(W_uv[h]^T sum_j p_j c_j)      (ops/attention/mla.py mla_decode, fp32; c_j = latent_j[:r])
 *   out = rnd(W_o rnd(o rnd(sigmoid(g))))   (GatedMLA.output, o_proj)
 * q [N, H, nope + rope], latent [N, S, R] (positions past len[n] unread), g [N, H Dv], W_o [D, H Dv], out [N, D] in
 * the activation dtype; W_uk [H, nope, r] and W_uv^T [H, r, Dv] fp32 (`absorbed_weights`). */
int openk3_mla_decode_out(int is_bf16, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t r, int64_t Dv,
                          int64_t D, int64_t S, const void *q, const void *latent, const int64_t *len,
                          const float *w_uk, const float *w_uv, float scale, const void *g, const void *w_o,
                          void *out) {
    if (N < 1 || N > MAX_ROWS || S < 1) return 1;
    for (int64_t n = 0; n < N; n++)
        if (len[n] < 1 || len[n] > S) return 1;
    const int64_t R = r + rope, Dqk = nope + rope, HV = H * Dv;
    float *mem = malloc(sizeof(float) * (size_t)(N * S * R + N * HV));
    if (!mem) return 2;
    float *lat = mem, *o = lat + N * S * R;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N * S; i++) /* the latents in fp32 once (every head reads them) */
            for (int64_t c = 0; c < R; c++) lat[i * R + c] = load_any(is_bf16, latent, i * R + c);
        float *buf = malloc(sizeof(float) * (size_t)(R + S + r + Dv));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t nh = 0; nh < N * H; nh++) {
            if (!buf) continue;
            const int64_t n = nh / H, h = nh % H, L = len[n];
            float *qR = buf, *s = qR + R, *ol = s + S, *ov = ol + r;
            for (int64_t c = 0; c < r; c++) qR[c] = 0.0f;
            for (int64_t d = 0; d < nope; d++) {
                const float qd = load_any(is_bf16, q, (n * H + h) * Dqk + d);
                const float *wk = w_uk + (h * nope + d) * r;
                for (int64_t c = 0; c < r; c++) qR[c] += qd * wk[c];
            }
            for (int64_t c = 0; c < rope; c++) qR[r + c] = load_any(is_bf16, q, (n * H + h) * Dqk + nope + c);
            for (int64_t c = 0; c < R; c++) qR[c] *= scale;
            float top = -INFINITY;
            for (int64_t j = 0; j < L; j++) {
                s[j] = dot_f32(qR, lat + (n * S + j) * R, R);
                if (s[j] > top) top = s[j];
            }
            float z = 0.0f;
            for (int64_t j = 0; j < L; j++) s[j] = expf(s[j] - top), z += s[j];
            for (int64_t c = 0; c < r; c++) ol[c] = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                const float pj = s[j] / z, *lj = lat + (n * S + j) * R;
                for (int64_t c = 0; c < r; c++) ol[c] += pj * lj[c];
            }
            for (int64_t v = 0; v < Dv; v++) ov[v] = 0.0f;
            for (int64_t c = 0; c < r; c++) {
                const float oc = ol[c], *wv = w_uv + (h * r + c) * Dv;
                for (int64_t v = 0; v < Dv; v++) ov[v] += oc * wv[v];
            }
            for (int64_t v = 0; v < Dv; v++) {
                const int64_t i = n * HV + h * Dv + v;
                float sg = sigmoidf(load_any(is_bf16, g, i)), a = ov[v];
                if (is_bf16) sg = round_bf16(sg), a = round_bf16(a);
                const float y = a * sg;
                o[i] = is_bf16 ? round_bf16(y) : y;
            }
        }
        free(buf);
        if (!failed) gemv_blocks(is_bf16, 1, &w_o, &D, o, N, HV, &out, 0);
    }
    free(mem);
    return failed ? 2 : 0;
}

/* ---- The decoder stack of a decode step, in one call ------------------------------------------------------------
 * (model/model.py K3Model.forward over its layers, DECODE mode; model/attnres.py for the bank.) The layer kernels
 * above, called in the order the modules call them, with the Block AttnRes bookkeeping between them:
 *   x = mix_norm(bank + [P], attention site);  if block start: bank += [P]
 *   a = mixer(x) (KDA, or MLA around the append of the new latents to the paged pool);  P = a if block start else rnd(P + a)
 *   x = mix_norm(bank + [P], FFN site);  P = rnd(P + ffn(x)) (the dense MLP, or the MoE layer, token by token)
 * and after the last layer out = mix_norm(bank + [P], output site). Why one call: between ~50 kernel calls a step
 * spent ~10 ms in Python (module calls, checks, allocations) against ~30 ms of kernels for a bf16 decode step of
 * the benchmark model (benchmarks/results/cpu.md). Every field is 8 bytes (int64, double, pointer), so the ctypes
 * mirror (ops/cpu_kernels/stack.py) lays out exactly as this struct; activations are in the act dtype, as the
 * torch path keeps them. */
typedef struct {
    int64_t block_start, mixer, ffn; /* mixer 0: KDA, 1: MLA; ffn 0: dense MLP, 1: MoE */
    const void *mix_w[2], *query[2], *norm_w[2]; /* the attention site, then the FFN site */
    double mix_eps[2], norm_eps[2];
    /* KDA (openk3_kda_decode's arguments) */
    int64_t H, K, W;
    const void *const *proj;
    const void *w_fb, *w_o;
    const void *const *tails_in;
    const float *state_in;
    const int64_t *rows_in;
    void *const *tails_out;
    float *state_out;
    const int64_t *rows_out;
    const float *const *conv_w;
    const float *A_log, *dt_bias, *o_norm_w;
    double lower_bound, kda_eps, kda_scale;
    /* MLA (openk3_mla_decode_in / _out's arguments) and its paged pool [rows, R] in the act dtype */
    int64_t Lq, Q, R, r, G, Hm, nope, Dv;
    const void *w_qa, *qa_norm, *w_qb, *w_kva, *kv_norm, *w_g, *w_om;
    const float *w_uk, *w_uv;
    double mla_eps, mla_scale;
    void *pool;
    /* dense MLP (openk3_experts with k = 1) */
    int64_t F;
    const void *d_w1, *d_w3, *d_w2;
    /* MoE (openk3_moe_decode's arguments; idx, scores, weights: [T, k], [T, E], [T, k], per token) */
    int64_t Lt, Fe, Fs, E, k, renormalize, replay;
    const void *w_gate;
    const float *bias;
    double scaling;
    int64_t *idx;
    float *scores, *weights;
    const void *w_down, *w1s, *w3s, *w2s, *lat_norm_w;
    double lat_norm_eps;
    const void *w_up, *ws_gate, *ws_up, *ws_down;
    double beta, linear_beta;
} openk3_layer;

/* MLA positions of this step, shared by every MLA layer: the new latent of sequence n goes to pool row write[n];
 * its block is rows read[n, 0 .. S-1] (len[n] of them real). */
typedef struct {
    const int64_t *write, *read, *len;
    int64_t S;
} openk3_mla_rows;

int openk3_decode_stack(int is_bf16, int64_t N, int64_t D, int64_t L, const openk3_layer *layers,
                        const openk3_mla_rows *mla, const void *const *out_site, const double *out_eps,
                        const void *x, void *out) {
    if (N < 1 || N > MAX_ROWS || L < 1) return 1;
    const size_t el = is_bf16 ? 2 : 4, row = (size_t)(N * D) * el;
    int64_t nbank_max = 1, mla_max = 0;
    for (int64_t l = 0; l < L; l++) {
        nbank_max += layers[l].block_start != 0;
        if (layers[l].mixer == 1) {
            const openk3_layer *y = &layers[l];
            const int64_t need = N * (y->Q + y->R + y->G) + N * mla->S * y->R;
            if (need > mla_max) mla_max = need;
        }
    }
    if (nbank_max > 64) return 1;
    /* act-dtype buffers: the bank, P, x, a (one row block each), the MLA scratch */
    char *mem = malloc(row * (size_t)(nbank_max + 3) + (size_t)mla_max * el);
    if (!mem) return 2;
    char *bank = mem, *P = bank + row * (size_t)nbank_max, *xb = P + row, *ab = xb + row, *scratch = ab + row;
    const void *src[65];
    int64_t nbank = 0;
    int rc = 0;
    memcpy(P, x, row);
    for (int64_t l = 0; l < L && !rc; l++) {
        const openk3_layer *y = &layers[l];
        src[nbank] = P; /* src = the bank's blocks, then the partial sum */
        rc = openk3_mix_norm(is_bf16, N, D, nbank + 1, src, y->mix_w[0], y->query[0], (float)y->mix_eps[0],
                             y->norm_w[0], (float)y->norm_eps[0], xb);
        if (rc) break;
        if (y->block_start) {
            src[nbank] = bank + row * (size_t)nbank;
            memcpy(bank + row * (size_t)nbank++, P, row);
        }
        if (y->mixer == 0) {
            rc = openk3_kda_decode(is_bf16, N, D, y->H, y->K, y->W, xb, y->proj, y->w_fb, y->w_o, y->tails_in,
                                   y->state_in, y->rows_in, y->tails_out, y->state_out, y->rows_out, y->conv_w,
                                   y->A_log, y->dt_bias, (float)y->lower_bound, y->o_norm_w, (float)y->kda_eps,
                                   (float)y->kda_scale, ab);
        } else {
            char *q = scratch, *lat = q + (size_t)(N * y->Q) * el, *g = lat + (size_t)(N * y->R) * el;
            char *blk = g + (size_t)(N * y->G) * el;
            rc = openk3_mla_decode_in(is_bf16, N, D, y->Lq, y->Q, y->R, y->r, y->G, xb, y->w_qa, y->qa_norm, y->w_qb,
                                      y->w_kva, y->kv_norm, y->w_g, (float)y->mla_eps, q, lat, g);
            if (rc) break;
            const size_t lrow = (size_t)y->R * el;
            for (int64_t n = 0; n < N; n++) memcpy((char *)y->pool + (size_t)mla->write[n] * lrow, lat + n * lrow, lrow);
            for (int64_t i = 0; i < N * mla->S; i++)
                memcpy(blk + (size_t)i * lrow, (char *)y->pool + (size_t)mla->read[i] * lrow, lrow);
            rc = openk3_mla_decode_out(is_bf16, N, y->Hm, y->nope, y->R - y->r, y->r, y->Dv, D, mla->S, q, blk,
                                       mla->len, y->w_uk, y->w_uv, (float)y->mla_scale, g, y->w_om, ab);
        }
        if (rc) break;
        for (int64_t i = 0; i < N * D; i++) /* P = a at a block start, else rnd(P + a) */
            store_any(is_bf16, P, i, y->block_start ? load_any(is_bf16, ab, i) : load_any(is_bf16, P, i) + load_any(is_bf16, ab, i));
        src[nbank] = P;
        rc = openk3_mix_norm(is_bf16, N, D, nbank + 1, src, y->mix_w[1], y->query[1], (float)y->mix_eps[1],
                             y->norm_w[1], (float)y->norm_eps[1], xb);
        for (int64_t n = 0; n < N && !rc; n++) {
            const char *xn = xb + (size_t)(n * D) * el;
            char *an = ab + (size_t)(n * D) * el;
            if (y->ffn == 0) {
                rc = openk3_experts(is_bf16, xn, D, y->F, D, 1, &y->d_w1, &y->d_w3, &y->d_w2, NULL, (float)y->beta,
                                    (float)y->linear_beta, an);
            } else {
                rc = openk3_moe_decode(is_bf16, D, y->Lt, y->Fe, y->Fs, y->E, y->k, xn, y->w_gate, y->bias,
                                       (int)y->renormalize, (float)y->scaling, (int)y->replay, y->idx + n * y->k,
                                       y->scores + n * y->E, y->weights + n * y->k, y->w_down, y->w1s, y->w3s, y->w2s,
                                       y->lat_norm_w, (float)y->lat_norm_eps, y->w_up, y->ws_gate, y->ws_up,
                                       y->ws_down, (float)y->beta, (float)y->linear_beta, an);
                if (rc == 3) rc = 100 + (int)n; /* replayed routes of token n refused */
            }
        }
        if (rc) break;
        for (int64_t i = 0; i < N * D; i++) store_any(is_bf16, P, i, load_any(is_bf16, P, i) + load_any(is_bf16, ab, i));
    }
    if (!rc) {
        src[nbank] = P;
        rc = openk3_mix_norm(is_bf16, N, D, nbank + 1, src, out_site[0], out_site[1], (float)out_eps[0], out_site[2],
                             (float)out_eps[1], out);
    }
    free(mem);
    return rc;
}
