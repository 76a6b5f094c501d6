/* A matrix product for the few rows of a decoding step (appendix C; transformer_book/few_rows.py).

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
