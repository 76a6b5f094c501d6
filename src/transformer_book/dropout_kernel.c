/* Dropout in one pass (appendix C; transformer_book/dropout_kernel.py).

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

/* y (n) = x (n) with each element kept when its 16 bits, read as a signed number, reach
   `lowest` (of -32768 ... 32767), and scaled. */
void dropout_apply(const float *x, float *y, long n, uint64_t seed, int32_t lowest, float scale,
                   int threads) {
    long words = n / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long w = 0; w < words; w++) {
        uint64_t bits = mix(seed + (uint64_t)(w + 1) * GOLDEN);
        for (int lane = 0; lane < 4; lane++) {
            int16_t r = (int16_t)(bits >> (16 * lane));
            y[4 * w + lane] = x[4 * w + lane] * (r >= lowest ? scale : 0.0f);
        }
    }
    if (words * 4 < n) { /* the last, partial word */
        uint64_t bits = mix(seed + (uint64_t)(words + 1) * GOLDEN);
        for (long i = words * 4; i < n; i++) {
            int16_t r = (int16_t)(bits >> (16 * (i - words * 4)));
            y[i] = x[i] * (r >= lowest ? scale : 0.0f);
        }
    }
}
