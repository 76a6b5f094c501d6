/* Dropout in one pass (appendix C; transformer_book/fast/dropout_kernel.py).

   y[i] = x[i] * (keep(i) ? scale : 0), where keep(i) comes from 16 random bits per element:
   element i reads lane i % 4 of the 64-bit word i / 4, and a word is SplitMix64's output for
   its number, mix(seed + (i / 4 + 1) * golden), a hash of (seed, position). The bits of an
   element depend on nothing else: not on the thread that computes it, nor on how the work is
   split, so backward recomputes the forward's mask from the seed instead of storing it, and
   dropout_kernel.py computes the same bits with PyTorch's integer operators where this file
   cannot be compiled. Multiplying by 0 (not writing 0) keeps the sign of zeros and lets NaN
   through, as x * mask does. */

#include <stdint.h>

#define GOLDEN 0x9e3779b97f4a7c15ULL

static inline uint64_t mix(uint64_t z) { /* SplitMix64's finaliser */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* y[i] for the elements i of word w (count of them: 4, or fewer in the last word): kept when its
   16 bits, read as a signed number, reach `lowest` (of -32768 ... 32767), and scaled. With
   `relu`, negative elements are zeroed first (NaN passes, as in PyTorch's ReLU). Inlined with a
   constant `relu`, so each loop that calls it is vectorised for its case. */
static inline __attribute__((always_inline)) void word(const float *x, float *y, long w, int count, uint64_t seed,
                                                       int32_t lowest, float scale, int relu) {
    uint64_t bits = mix(seed + (uint64_t)(w + 1) * GOLDEN);
    for (int lane = 0; lane < count; lane++) {
        int16_t r = (int16_t)(bits >> (16 * lane));
        float v = x[4 * w + lane];
        y[4 * w + lane] = (relu && v < 0.0f ? 0.0f : v) * (r >= lowest ? scale : 0.0f);
    }
}

/* y (n) = x (n) dropped out; with `relu`, ReLU then dropout in one pass (the feed-forward
   network's hidden layer). */
void dropout_apply(const float *x, float *y, long n, uint64_t seed, int32_t lowest, float scale, int relu,
                   int threads) {
    long words = n / 4;
    if (relu) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long w = 0; w < words; w++) word(x, y, w, 4, seed, lowest, scale, 1);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long w = 0; w < words; w++) word(x, y, w, 4, seed, lowest, scale, 0);
    }
    if (words * 4 < n) word(x, y, words, (int)(n - words * 4), seed, lowest, scale, relu); /* a partial word */
}

/* grad_x (n) = grad_y * scale where y > 0, else 0: the gradient of ReLU then dropout, read off
   their output y, which is positive exactly where the input was and the element was kept. */
void relu_dropout_backward(const float *grad_y, const float *y, float *grad_x, long n, float scale,
                           int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) grad_x[i] = y[i] > 0.0f ? grad_y[i] * scale : 0.0f;
}
