/* A matrix product for the few rows of a decoding step (appendix C; transformer_book/fast/few_rows.py).

   y (m, n) = x (m, k) @ W^T + bias, for m a few rows (a decoding step has one per sequence) and
   W (n, k) packed once into panels of LANES outputs: panels[p][j][c] = W[p * LANES + c][j], zeros
   past row n. With few rows every weight is used only m times, so the product is as fast as the
   weights stream in from memory: this loop reads each panel once, front to back, asking for the
   bytes AHEAD of it early, and keeps the sums of up to ROWS rows in registers meanwhile.

   Every output is summed in the same order (j = 0, 1, ..., k - 1, then the bias), whatever the
   number of rows, the row's place among them, or the number of threads: a row's result does not
   depend on the rows beside it. Compiled by few_rows.py with -O3 -march=native -fopenmp; the
   vector type is GCC's and Clang's generic vector, which each CPU's compiler maps to its own
   registers (two SSE or NEON registers, one AVX register). */

#include <string.h>

#define LANES 8   /* outputs per panel: one vector of 8 floats */
#define ROWS 8    /* rows summed at once: 8 vector accumulators */
#define AHEAD 1024 /* floats (4 KB) between the panel being read and the one asked for */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

/* y[r][first + c] for rows r < rows and outputs c < width, from one panel. Always inlined with
   a constant `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void panel_product(
    int rows, const float *x, long k, const float *panel, const float *bias, float *y, long n,
    long first, long width) {
    vec sum[ROWS] = {0};
    for (long j = 0; j < k; j++) {
        vec w;
        memcpy(&w, panel + j * LANES, sizeof w);
        __builtin_prefetch(panel + j * LANES + AHEAD);
        for (int r = 0; r < rows; r++) sum[r] += x[r * k + j] * w;
    }
    for (int r = 0; r < rows; r++) {
        float out[LANES];
        memcpy(out, &sum[r], sizeof out);
        for (long c = 0; c < width; c++) y[r * n + first + c] = out[c] + (bias ? bias[first + c] : 0.0f);
    }
}

static void panel_rows(int rows, const float *x, long k, const float *panel, const float *bias,
                       float *y, long n, long first, long width) {
    switch (rows) { /* one copy of the loop per row count */
    case 8: panel_product(8, x, k, panel, bias, y, n, first, width); break;
    case 7: panel_product(7, x, k, panel, bias, y, n, first, width); break;
    case 6: panel_product(6, x, k, panel, bias, y, n, first, width); break;
    case 5: panel_product(5, x, k, panel, bias, y, n, first, width); break;
    case 4: panel_product(4, x, k, panel, bias, y, n, first, width); break;
    case 3: panel_product(3, x, k, panel, bias, y, n, first, width); break;
    case 2: panel_product(2, x, k, panel, bias, y, n, first, width); break;
    case 1: panel_product(1, x, k, panel, bias, y, n, first, width); break;
    }
}

/* x (m, k) and y (m, n) row-major; panels as above; bias (n) or NULL. Threads share the panels. */
void few_rows_linear(const float *x, const float *panels, const float *bias, float *y, long m,
                     long n, long k, int threads) {
    long count = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < count; p++) {
        long first = p * LANES, width = n - first < LANES ? n - first : LANES;
        for (long r = 0; r < m; r += ROWS) {
            int rows = m - r < ROWS ? (int)(m - r) : ROWS;
            panel_rows(rows, x + r * k, k, panels + p * k * LANES, bias, y + r * n, n, first, width);
        }
    }
}

int few_rows_lanes(void) { return LANES; }

/* Attention for one query per (sequence, head): a decoding step's new position against the keys
   and values of every position so far (the KV cache), or of the source (cross-attention). Like
   the products, it reads a lot (every key and value) to compute little.

   For sequence b and head h: s[j] = scale * (q . k[j]) for the keys j < len with mask[j] != 0,
   then out = sum_j softmax(s)[j] * v[j]; a query that may attend to no key gets zeros (as
   PyTorch's fused kernel gives). q, k and v are read through strides (in floats) for the
   sequence, the head and (k, v) the position, the features being contiguous; the mask, when
   given, through strides in bytes for the sequence, the head and the position (0 where it
   broadcasts). The output is the heads side by side, out[b][h * dim + d]: merged already.
   Each (sequence, head) is computed by one thread in a fixed order, so its result does not
   depend on the rows beside it or on the number of threads. */

#define KEYS 4 /* keys whose dot products are summed side by side */

static inline float lane_sum(vec a) { /* a fixed tree: the same order every time */
    float l[LANES];
    memcpy(l, &a, sizeof l);
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* s[j + i] = q . k[j + i] for i < n. Always inlined with a constant n: the sums stay in registers. */
static inline __attribute__((always_inline)) void dots(int n, const float *restrict q, const float *restrict k,
                                                       long k_j, long j, long dim, float *restrict s) {
    long chunks = dim / LANES;
    vec acc[KEYS] = {0};
    for (long c = 0; c < chunks; c++) {
        vec a;
        memcpy(&a, q + c * LANES, sizeof a);
        for (int i = 0; i < n; i++) {
            vec w;
            memcpy(&w, k + (j + i) * k_j + c * LANES, sizeof w);
            acc[i] += a * w;
        }
    }
    for (int i = 0; i < n; i++) {
        float dot = lane_sum(acc[i]);
        for (long d = chunks * LANES; d < dim; d++) dot += q[d] * k[(j + i) * k_j + d];
        s[j + i] = dot;
    }
}

static void one_query(const float *restrict q, const float *restrict k, long k_j, const float *restrict v,
                      long v_j, const unsigned char *restrict mask, long m_j, float *restrict out, long len,
                      long dim, float scale, float *restrict s) {
    long j = 0;
    for (; j + KEYS <= len; j += KEYS) dots(KEYS, q, k, k_j, j, dim, s);
    for (; j < len; j++) dots(1, q, k, k_j, j, dim, s);
    float top = -__builtin_inff();
    for (j = 0; j < len; j++) {
        s[j] = mask && !mask[j * m_j] ? -__builtin_inff() : s[j] * scale;
        top = s[j] > top || s[j] != s[j] ? s[j] : top; /* a NaN score makes the output NaN, as the formula does */
    }
    for (long d = 0; d < dim; d++) out[d] = 0.0f;
    if (top == -__builtin_inff()) return; /* no key to attend to */
    float total = 0.0f;
    for (j = 0; j < len; j++) {
        s[j] = __builtin_expf(s[j] - top); /* exp(-inf) = 0: a masked key adds nothing */
        total += s[j];
    }
    float inverse = 1.0f / total;
    for (j = 0; j < len; j++) {
        const float *vv = v + j * v_j;
        float p = s[j] * inverse;
        for (long d = 0; d < dim; d++) out[d] += p * vv[d];
    }
}

void few_rows_attention(const float *q, long q_b, long q_h, const float *k, long k_b, long k_h, long k_j,
                        const float *v, long v_b, long v_h, long v_j, const unsigned char *mask, long m_b,
                        long m_h, long m_j, float *out, float *scores, long batch, long heads, long len, long dim,
                        float scale, int threads) {
    /* scores: batch * heads * len floats of scratch, one row per (sequence, head). Threads only
       when there is enough to share: starting them costs more than a small step. */
#pragma omp parallel for schedule(static) num_threads(threads) if (batch * heads * len * dim >= (1L << 14))
    for (long bh = 0; bh < batch * heads; bh++) {
        long b = bh / heads, h = bh % heads;
        one_query(q + b * q_b + h * q_h, k + b * k_b + h * k_h, k_j, v + b * v_b + h * v_h, v_j,
                  mask ? mask + b * m_b + h * m_h : 0, m_j, out + bh * dim, len, dim, scale, scores + bh * len);
    }
}
