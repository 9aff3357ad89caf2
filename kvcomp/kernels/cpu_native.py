"""A fused C kernel for quantized decode attention on the CPU, compiled on first use.

Torch on a CPU runs a decode step's attention as a series of passes over memory (unpack, convert, scale,
matmul); over a quantized cache that costs more than plain attention over the float cache, which is why
KIVI-style implementations are often *slower* than no compression on CPUs. This kernel does what the Triton
kernel does on a GPU: one pass over the packed codes per (row, KV head), dequantizing in registers, the
query group sharing every byte read (logits of all query rows, one softmax, then values). A second entry
point, :func:`quant_key_logits`, gives the logits of every quantized key alone (SpeCache scores its low-bit copy
with them and hands them back to :func:`quant_attention`, which then skips the key codes).

The same library holds kvcomp's other native CPU paths, each used only where its ``supports_*`` check (or a None
return) says the inputs qualify: float decode attention (:func:`decode_attention`), KVTC's attention over its
live codes (:func:`kvtc_attention`), a prompt's causal attention with H2O's received attention or KVzip's
reconstruction score (:func:`prompt_attention`, :func:`reconstruction_attention`), CriticalKV's projected value
norms (:func:`projected_norms`), FreeKV's page bounds and speculation check (:func:`page_scores`,
:func:`speculation_check`), top-k (:func:`top_ascending`), in-place eviction (:func:`evict_lowest`), the tiers'
reads and writes (:func:`gather_tokens`, :func:`pwrite_tokens`) and a one-row linear layer (:func:`linear`).

It is compiled with the system C compiler (``$CC``, default ``cc``) into ``$KVCOMP_CACHE/kernels`` the first
time it is needed (about a second) and loaded with ctypes. Float32 CPU tensors only; anything else, no
compiler, or ``KVCOMP_NATIVE=0`` falls back to :func:`kvcomp.kernels.quant_cpu.quant_attention`. Same
signature and result as :func:`kvcomp.kernels.quant_ref.quant_attention`.

A cached library is loaded only when it and its directory belong to the current user and nobody else may write
them (loading a library runs its code): otherwise the library is rebuilt (a planted or tampered file is
replaced); a directory of this user's that others may write is made private first, and one that is not this
user's (or a link) is not used: the library is then built and loaded from a private temporary directory.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from kvcomp.files import cache_dir

SOURCE = r"""
#include <errno.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4)));  /* for pointers into float buffers */

static inline v16f load16(const float* p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16f v) { memcpy(p, &v, sizeof v); }

/* 16 bytes from p, zero-extended to 16 int32 lanes: one instruction with AVX-512 (gcc 12 lowers
   __builtin_convertvector of a byte vector to a byte-at-a-time sequence). */
static inline v16i widen(v16b x) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32((__m128i)x);
#else
    return __builtin_convertvector(x, v16i);
#endif
}

static inline v16i widen16(const uint8_t* p) {
    v16b raw;
    memcpy(&raw, p, 16);
    return widen(raw);
}

static inline float hsum16(v16f v) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
               + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* e^x of 16 lanes (x <= 0 here; Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, relative error about
   1e-7): 0 where x < -87 (so -inf gives 0), the rule a softmax needs; not for x > 88. */
static inline v16f exp16(v16f x) {
    const v16i tiny = x < -87.0f;
    x = x - (v16f)((v16i)x & tiny);  /* the masked lanes become 0 (their result is masked below) */
    v16f fx = x * 1.44269504088896341f + 0.5f;
    v16i n = __builtin_convertvector(fx, v16i);       /* truncation; floor for the negative ones: */
    n -= (v16i)(__builtin_convertvector(n, v16f) > fx) & 1;
    const v16f nf = __builtin_convertvector(n, v16f);
    x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    const v16f z = x * x;
    v16f y = 1.9875691500e-4f * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    const v16f scale = (v16f)((n + 127) << 23);
    return (v16f)((v16i)(y * scale) & ~tiny);
}

/* One token's W packed bytes (W % 16 == 0) as D = W * P floats in plane-major order, 16 at a time: chunk
   p * W / 16 + j holds channels (16 j + i) * P + p, i < 16. */
static inline void unpack16(const uint8_t* restrict src, int64_t W, int bits, v16f_u* restrict codes) {
    const int per_byte = 8 / bits, mask = (1 << bits) - 1;
    const int64_t chunks = W / 16;
    for (int64_t j = 0; j < chunks; j++) {
        const v16i x = widen16(src + 16 * j);
        for (int p = 0; p < per_byte; p++) codes[p * chunks + j] = __builtin_convertvector((x >> (p * bits)) & mask, v16f);
    }
}

/* One token's codes as floats in plane-major order: column p * W + j holds channel j * P + p (code p of byte
   j), so every loop is contiguous and vectorises. */
static inline void unpack_planes(const uint8_t* restrict src, int64_t w, int bits, float* restrict dst) {
    const int per_byte = 8 / bits, mask = (1 << bits) - 1;
    for (int p = 0; p < per_byte; p++) {
        const int shift = p * bits;
        float* o = dst + p * w;
        for (int64_t j = 0; j < w; j++) o[j] = (float)((src[j] >> shift) & mask);
    }
}

static inline float dot(const float* restrict a, const float* restrict b, int64_t d) {
    float s = 0.0f;
    if (d == 64) { for (int i = 0; i < 64; i++) s += a[i] * b[i]; return s; }  /* the common head dims, */
    if (d == 128) { for (int i = 0; i < 128; i++) s += a[i] * b[i]; return s; } /* unrolled by the compiler */
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* o[i] += a * x[i] for i < n (the common sizes unrolled). */
static inline void axpy(float* restrict o, float a, const float* restrict x, int64_t n) {
    if (n == 64) { for (int i = 0; i < 64; i++) o[i] += a * x[i]; return; }
    if (n == 128) { for (int i = 0; i < 128; i++) o[i] += a * x[i]; return; }
    for (int64_t i = 0; i < n; i++) o[i] += a * x[i];
}

/* o[i] = a * x[i] for i < n. */
static inline void scale(float* restrict o, float a, const float* restrict x, int64_t n) {
    if (n == 16) { for (int i = 0; i < 16; i++) o[i] = a * x[i]; return; }
    if (n == 32) { for (int i = 0; i < 32; i++) o[i] = a * x[i]; return; }
    for (int64_t i = 0; i < n; i++) o[i] = a * x[i];
}

/* The values of one group of G tokens for up to four query rows: acc[r][c] += sum_i p[r][i] * s[i][g(c)] *
   code[i][c] (p rows T apart, acc rows D apart; c in the column order of unpack16, g(c) its value scale of J
   per token), 64 columns at a time: the tokens' codes unpacked in registers once for all rows, the sixteen
   accumulators in registers. D, the bit width, J and the row count are constants of each inlined copy; every
   16-column vector lies within one scale's channels (D / J / (8 / bits) % 16 == 0). */
static inline __attribute__((always_inline)) void values_rows(float* restrict acc, const float* restrict p, int64_t T,
                                                              const float* restrict s, const uint8_t* restrict vc,
                                                              int64_t G, const int D, const int bits, const int J,
                                                              const int rows) {
    const int W = D * bits / 8, chunks = W / 16, per_byte = 8 / bits, run = D / J / per_byte;
    const v16i mask = (v16i){0} + ((1 << bits) - 1);
    for (int block = 0; block < D / 64; block++) {
        v16f a[4][4];
        for (int r = 0; r < rows; r++)
            for (int u = 0; u < 4; u++) a[r][u] = load16(acc + r * D + 64 * block + 16 * u);
        for (int64_t i = 0; i < G; i++) {
            v16f x[4];
            for (int u = 0; u < 4; u++) {  /* vector 4 block + u: bytes 16 j.., code plane q */
                const int j = (4 * block + u) % chunks, q = (4 * block + u) / chunks;
                x[u] = __builtin_convertvector((widen16(vc + i * W + 16 * j) >> (q * bits)) & mask, v16f);
            }
            for (int r = 0; r < rows; r++)
                for (int u = 0; u < 4; u++)
                    a[r][u] += (p[r * T + i] * s[i * J + ((4 * block + u) % chunks) * 16 / run]) * x[u];
        }
        for (int r = 0; r < rows; r++)
            for (int u = 0; u < 4; u++) store16(acc + r * D + 64 * block + 16 * u, a[r][u]);
    }
}

/* Which (D, bits, J) values_rows has a copy for: D = 64 with one scale per token (SpeCache's copy), one per 32
   channels (the quant compressor's default) or, at 8 bits, one per 16. At D = 128 and 256 the buffered path
   below measured as fast or faster (Gemma 3 270M's shape: one KV head, four query rows), so it keeps them. */
static int register_values(int64_t D, int bits, int64_t J) {
    return D == 64 && ((J == 1 && (bits == 2 || bits == 4 || bits == 8)) || (J == 2 && (bits == 4 || bits == 8))
                       || (J == 4 && bits == 8));
}

static void values_dispatch(float* acc, const float* p, int64_t T, const float* s, const uint8_t* vc, int64_t G,
                            int64_t D, int bits, int64_t J, int64_t rows) {
#define ROWS(d, b, j) do { if (rows == 4) values_rows(acc, p, T, s, vc, G, d, b, j, 4); \
                           else if (rows == 3) values_rows(acc, p, T, s, vc, G, d, b, j, 3); \
                           else if (rows == 2) values_rows(acc, p, T, s, vc, G, d, b, j, 2); \
                           else values_rows(acc, p, T, s, vc, G, d, b, j, 1); } while (0)
    (void)D;  /* 64: see register_values */
    if (J == 1 && bits == 2) ROWS(64, 2, 1);
    else if (J == 1 && bits == 4) ROWS(64, 4, 1);
    else if (J == 1) ROWS(64, 8, 1);
    else if (J == 2 && bits == 4) ROWS(64, 4, 2);
    else if (J == 2) ROWS(64, 8, 2);
    else ROWS(64, 8, 4);
#undef ROWS
}

/* The visibility rule of kvcomp.ops.visible: a key at kp is visible to a query at qp when
   qp - window < kp <= qp (window 0: no lower bound); a query that sees no key at all sees every slot. */
#define VISIBLE(kp, hi, lo) ((int64_t)(kp) <= (hi) && (int64_t)(kp) >= (lo))

/* A 16 x 16 byte transpose: t[j][l] = r[l][j] (interleaving bytes, then pairs, quads and octets of rows). */
#define SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
static inline void transpose16(const v16b* restrict r, v16b* restrict t) {
    v16b a[8][2], b[4][4], c[2][8];
    for (int p = 0; p < 8; p++) {  /* a[p][h]: columns 8h..8h+7 of rows 2p, 2p+1 */
        a[p][0] = SHUF(r[2 * p], r[2 * p + 1], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        a[p][1] = SHUF(r[2 * p], r[2 * p + 1], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    }
    for (int q = 0; q < 4; q++)  /* b[q][k]: columns 4k..4k+3 of rows 4q..4q+3 */
        for (int h = 0; h < 2; h++) {
            b[q][2 * h] = SHUF(a[2 * q][h], a[2 * q + 1][h], 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
            b[q][2 * h + 1] = SHUF(a[2 * q][h], a[2 * q + 1][h], 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15,
                                   30, 31);
        }
    for (int o = 0; o < 2; o++)  /* c[o][k]: columns 2k, 2k+1 of rows 8o..8o+7 */
        for (int k = 0; k < 4; k++) {
            c[o][2 * k] = SHUF(b[2 * o][k], b[2 * o + 1][k], 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            c[o][2 * k + 1] = SHUF(b[2 * o][k], b[2 * o + 1][k], 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                   30, 31);
        }
    for (int k = 0; k < 8; k++) {  /* column 2k, then 2k + 1, of all 16 rows */
        t[2 * k] = SHUF(c[0][k], c[1][k], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        t[2 * k + 1] = SHUF(c[0][k], c[1][k], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
}
#undef SHUF

/* Sixteen tokens at once, one per vector lane (kc: their [16, W] packed codes, W % 16 == 0): acc[k][l] =
   sum_c s_k[c] * code_c(token l) for up to four plane-major scaled query rows s_k (rows > 3: the fourth too). No
   horizontal sums, and each unpacked code vector serves every row. */
static inline void tile_logits16(const uint8_t* restrict kc, int64_t W, int bits, int rows,
                                 const float* restrict s0, const float* restrict s1, const float* restrict s2,
                                 const float* restrict s3, v16f* restrict acc) {
    const int per_byte = 8 / bits, mask = (1 << bits) - 1;
    v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t j0 = 0; j0 < W; j0 += 16) {
        v16b r[16], t[16];
        for (int l = 0; l < 16; l++) memcpy(&r[l], kc + l * W + j0, 16);
        transpose16(r, t);
        for (int j = 0; j < 16; j++) {
            const v16i x = widen(t[j]);
            for (int p = 0; p < per_byte; p++) {
                const v16f code = __builtin_convertvector((x >> (p * bits)) & mask, v16f);
                const int64_t col = p * W + j0 + j;
                a0 += s0[col] * code; a1 += s1[col] * code; a2 += s2[col] * code;
                if (rows > 3) a3 += s3[col] * code;
            }
        }
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
}

/* Raw logits (q . k_hat + q . z) * scaling of one group of G tokens for the M query rows of one (row, KV head):
   qb [M, D]; s, z [D] the group's key scale and zero; kc [G, W] its packed codes; channel[c]: original channel
   of plane-major column c; scaled_q [M, D] and codes [D] are scratch. Writes out[m * stride + i]. */
static void group_logits(const float* restrict qb, const float* restrict s, const float* restrict z,
                         const uint8_t* restrict kc, int64_t M, int64_t D, int64_t W, int64_t G, int bits,
                         const int64_t* restrict channel, float* restrict scaled_q, float* restrict codes,
                         float* restrict out, int64_t stride, float scaling) {
    float bias[M > 0 ? M : 1];  /* logit = sum_d (q_d * s_d) * c_d + sum_d q_d * z_d */
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < D; c++) scaled_q[m * D + c] = qb[m * D + channel[c]] * s[channel[c]];
        bias[m] = dot(qb + m * D, z, D);
    }
    /* Sixteen tokens per vector (tile_logits16), at every width: on SmolLM2's shapes (D = 64, groups of 64, 2
       threads) the whole kernel at 8K takes 213 against 443 us at 4 bits and 251 against 296 at 8 bits, once the
       bytes widen in one instruction (widen). codes: a zero row for the unused query rows. */
    if (W % 16 == 0 && G % 16 == 0) {
        memset(codes, 0, sizeof(float) * D);
        for (int64_t i = 0; i < G; i += 16)
            for (int64_t m = 0; m < M; m += 4) {
                const float* rows[4];
                for (int k = 0; k < 4; k++) rows[k] = m + k < M ? scaled_q + (m + k) * D : codes;
                v16f acc[4];
                tile_logits16(kc + i * W, W, bits, (int)(M - m), rows[0], rows[1], rows[2], rows[3], acc);
                for (int k = 0; k < 4 && m + k < M; k++)
                    store16(out + (m + k) * stride + i, (acc[k] + bias[m + k]) * scaling);
            }
        return;
    }
    for (int64_t i = 0; i < G; i++) {
        unpack_planes(kc + i * W, W, bits, codes);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {  /* four query rows per pass over the codes */
            const float *s0 = scaled_q + m * D, *s1 = s0 + D, *s2 = s1 + D, *s3 = s2 + D;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            for (int64_t c = 0; c < D; c++) {
                const float x = codes[c];
                a0 += s0[c] * x; a1 += s1[c] * x; a2 += s2[c] * x; a3 += s3[c] * x;
            }
            out[m * stride + i] = (a0 + bias[m]) * scaling;
            out[(m + 1) * stride + i] = (a1 + bias[m + 1]) * scaling;
            out[(m + 2) * stride + i] = (a2 + bias[m + 2]) * scaling;
            out[(m + 3) * stride + i] = (a3 + bias[m + 3]) * scaling;
        }
        if (m + 3 <= M) {  /* three rows (a GQA group of 3) in one pass */
            const float *s0 = scaled_q + m * D, *s1 = s0 + D, *s2 = s1 + D;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f;
            for (int64_t c = 0; c < D; c++) {
                const float x = codes[c];
                a0 += s0[c] * x; a1 += s1[c] * x; a2 += s2[c] * x;
            }
            out[m * stride + i] = (a0 + bias[m]) * scaling;
            out[(m + 1) * stride + i] = (a1 + bias[m + 1]) * scaling;
            out[(m + 2) * stride + i] = (a2 + bias[m + 2]) * scaling;
            m += 3;
        }
        for (; m < M; m++) out[m * stride + i] = (dot(scaled_q + m * D, codes, D) + bias[m]) * scaling;
    }
}

/* The full-precision (residual) tokens of a quantized or coded cache, in two segments read in place: the
   attention sinks (n0 per (row, KV head) bh), then the window (n1): keys k0, k1 and values v0, v1
   [BH, n_i, D], positions p0, p1 [BH, n_i]. Residual slot t of bh is the sinks' slot t below n0, else the
   window's slot t - n0. n0 = 0: one segment. */
typedef struct {
    const float *k0, *v0, *k1, *v1;
    const int32_t *p0, *p1;
    int64_t n0, n1;
} residual_t;

static inline const float* residual_key(const residual_t* r, int64_t bh, int64_t t, int64_t D) {
    return t < r->n0 ? r->k0 + (bh * r->n0 + t) * D : r->k1 + (bh * r->n1 + t - r->n0) * D;
}

static inline const float* residual_value(const residual_t* r, int64_t bh, int64_t t, int64_t D) {
    return t < r->n0 ? r->v0 + (bh * r->n0 + t) * D : r->v1 + (bh * r->n1 + t - r->n0) * D;
}

static inline int32_t residual_position(const residual_t* r, int64_t bh, int64_t t) {
    return t < r->n0 ? r->p0[bh * r->n0 + t] : r->p1[bh * r->n1 + t - r->n0];
}

/* One query row's logits over T slots, the first T - R already scaled and masked: the R residual
   (full-precision) keys' logits of (row, KV head) bh (visible range [lo, hi]; res NULL when R = 0),
   soft-capping, and a softmax with the head's sink logit (NULL: none). */
static void residual_softmax(float* restrict row, int64_t T, int64_t R, const float* restrict qm,
                             const residual_t* res, int64_t bh, int64_t D, int64_t hi,
                             int64_t lo, float scaling, float softcap, const float* sink) {
    const int64_t L = T - R;
    for (int64_t t = 0; t < R; t++)
        row[L + t] = VISIBLE(residual_position(res, bh, t), hi, lo)
                         ? dot(qm, residual_key(res, bh, t, D), D) * scaling : -INFINITY;
    if (softcap > 0.0f)
        for (int64_t t = 0; t < T; t++)
            if (row[t] != -INFINITY) row[t] = softcap * tanhf(row[t] / softcap);
    const float s = sink ? *sink : -INFINITY;
    float top = s, sum = 0.0f;
    for (int64_t t = 0; t < T; t++) top = row[t] > top ? row[t] : top;
    int64_t t = 0;
    v16f acc = {0};
    for (; t + 16 <= T; t += 16) {
        const v16f e = exp16(load16(row + t) - top);
        store16(row + t, e);
        acc += e;
    }
    sum = hsum16(acc);
    for (; t < T; t++) { row[t] = expf(row[t] - top); sum += row[t]; }
    if (sink) sum += expf(s - top);
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < T; t++) row[t] *= inv;
}

/* Inside a parallel region (orphaned omp for): first[bh], the lowest position of (row, KV head) bh over its L
   coded and residual slots (a query below it sees no key). */
static void lowest_positions(int64_t* first, const int32_t* pos, const residual_t* res, int64_t BH, int64_t L) {
    #pragma omp for schedule(static)
    for (int64_t bh = 0; bh < BH; bh++) {
        int64_t lowest = INT64_MAX;
        for (int64_t t = 0; t < L; t++) if (pos[bh * L + t] < lowest) lowest = pos[bh * L + t];
        for (int64_t t = 0; t < res->n0 + res->n1; t++) {
            const int64_t p = residual_position(res, bh, t);
            if (p < lowest) lowest = p;
        }
        first[bh] = lowest;
    }
}

/* Inside a parallel region: residual_softmax for every query row of logits [BH, M, T] (q [BH, M, D], row m is
   query m % n of the group; a query that sees no key sees every slot). */
static void softmax_rows(float* logits, const float* q, const int64_t* qpos, const int64_t* first,
                         const residual_t* res, int64_t BH, int64_t H, int64_t M, int64_t n, int64_t T, int64_t D,
                         int64_t window, float scaling, float softcap, const float* sinks) {
    #pragma omp for collapse(2) schedule(static)
    for (int64_t bh = 0; bh < BH; bh++) {
        for (int64_t m = 0; m < M; m++) {
            const int64_t qpm = qpos[(bh / H) * n + m % n];
            const int blind = first[bh] > qpm;
            const int64_t hi = blind ? INT64_MAX : qpm, lo = blind || window <= 0 ? INT64_MIN : qpm - window + 1;
            residual_softmax(logits + (bh * M + m) * T, T, res->n0 + res->n1, q + (bh * M + m) * D, res, bh, D,
                             hi, lo, scaling, softcap,
                             sinks ? sinks + (bh % H) * (M / n) + m / n : NULL);
        }
    }
}

static void plane_channels(int64_t* channel, int64_t D, int64_t W, int bits) {
    const int64_t P = 8 / bits;
    for (int64_t c = 0; c < D; c++) channel[c] = (c % W) * P + c / W;
}

/* Scaled logits of every quantized key for M query rows per (row, KV head), no masking: q [BH, M, D];
   kc [BH, L, W]; ks, kz [BH, L / G, D]; out [BH, M, L]; work [BH * chunks, M * D + D]. */
void quant_key_logits_f32(const float* q, const uint8_t* kc, const float* ks, const float* kz, float* out,
                          float* work, int64_t B, int64_t H, int64_t M, int64_t L, int64_t G, int64_t D, int64_t W,
                          int64_t chunks, int bits, float scaling, int threads) {
    const int64_t BH = B * H, NG = L / G, per_chunk = (NG + chunks - 1) / chunks;
    int64_t channel[D > 0 ? D : 1];
    plane_channels(channel, D, W, bits);
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < BH; bh++) {
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            float* scaled_q = work + (bh * chunks + chunk) * (M * D + D);
            const int64_t g_end = (chunk + 1) * per_chunk < NG ? (chunk + 1) * per_chunk : NG;
            for (int64_t grp = chunk * per_chunk; grp < g_end; grp++)
                group_logits(q + bh * M * D, ks + (bh * NG + grp) * D, kz + (bh * NG + grp) * D,
                             kc + (bh * L + grp * G) * W, M, D, W, G, bits, channel, scaled_q, scaled_q + M * D,
                             out + bh * M * L + grp * G, L, scaling);
        }
    }
}

/* q [BH, M, D] (row m is query m % n of the group's head m / n); qpos [B, n]; kc, vc [BH, L, W];
   ks, kz [BH, L / G, D]; vs, vz [BH, L, J]; pos [BH, L]; hk, hv [BH, R0, D], hpos [BH, R0] (the sinks) and
   rk, rv [BH, R, D], rpos [BH, R] (the window): the full-precision tokens (residual_t); out [BH, M, D];
   logits [BH, M, L + R0 + R]; window: sliding window (0: none); softcap: logit soft-cap (0: none);
   sinks: [H * M / n] sink logits per query head (NULL: none); key_logits [BH, M, L]: the quantized keys'
   scaled logits when the caller has them (quant_key_logits_f32; NULL: computed here);
   work [BH * chunks, M * D + 2 * D + G * D]; partial [BH * chunks, M, D]. Each row's groups are split into
   `chunks` ranges that threads take in parallel (keys, then values into per-chunk partial sums).
   Needs D % P == 0 and (D / J) % P == 0 (P = 8 / bits codes per byte). */
void quant_attention_f32(const float* q, const int64_t* qpos, const uint8_t* kc, const float* ks, const float* kz,
                         const uint8_t* vc, const float* vs, const float* vz, const int32_t* pos,
                         const float* rk, const float* rv, const int32_t* rpos, float* out, float* logits,
                         float* work, float* partial, int64_t B, int64_t H, int64_t M, int64_t n, int64_t L,
                         int64_t G, int64_t R, int64_t D, int64_t J, int64_t W, int64_t chunks, int bits,
                         float scaling, int threads, int64_t window, float softcap, const float* sinks,
                         const float* key_logits, const float* hk, const float* hv, const int32_t* hpos,
                         int64_t R0) {
    const residual_t res = {hk, hv, rk, rv, hpos, rpos, R0, R};
    /* run: columns of a channel group per plane */
    const int64_t BH = B * H, T = L + R0 + R, P = 8 / bits, run = D / J / P;
    const int64_t NG = L / G, per_chunk = (NG + chunks - 1) / chunks;
    /* The values' vector path: 16 columns per vector, each inside one value channel group (group_of[k]). */
    const int vector = W % 16 == 0 && run % 16 == 0 && D % 64 == 0 && D <= 256;
    const int64_t K = D / 16;
    int64_t group_of[16] = {0};
    if (vector)
        for (int64_t k = 0; k < K; k++) group_of[k] = (k % (W / 16)) / (run / 16);
    int64_t first[BH > 0 ? BH : 1], channel[D > 0 ? D : 1];  /* channel[c]: original channel of column c */
    plane_channels(channel, D, W, bits);
    #pragma omp parallel num_threads(threads)
    {
        lowest_positions(first, pos, &res, BH, L);
        /* Keys: each group's logits (or the caller's), then the visibility rule. */
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                const int64_t* qp = qpos + (bh / H) * n;
                float* lg = logits + bh * M * T;
                int64_t row_pos[M > 0 ? M : 1], row_lo[M > 0 ? M : 1];  /* each row's visible range of positions */
                for (int64_t m = 0; m < M; m++) {
                    const int blind = first[bh] > qp[m % n];  /* sees no key: sees every slot */
                    row_pos[m] = blind ? INT64_MAX : qp[m % n];
                    row_lo[m] = blind || window <= 0 ? INT64_MIN : qp[m % n] - window + 1;
                }
                float* scaled_q = work + (bh * chunks + chunk) * (M * D + 2 * D + G * D);  /* plane-major q * key scale */
                const int64_t g_end = (chunk + 1) * per_chunk < NG ? (chunk + 1) * per_chunk : NG;
                for (int64_t grp = chunk * per_chunk; grp < g_end; grp++) {
                    if (key_logits) {
                        for (int64_t m = 0; m < M; m++)
                            memcpy(lg + m * T + grp * G, key_logits + (bh * M + m) * L + grp * G, sizeof(float) * G);
                    } else {
                        group_logits(q + bh * M * D, ks + (bh * NG + grp) * D, kz + (bh * NG + grp) * D,
                                     kc + (bh * L + grp * G) * W, M, D, W, G, bits, channel, scaled_q,
                                     scaled_q + M * D, lg + grp * G, T, scaling);
                    }
                    const int32_t* gp = pos + bh * L + grp * G;
                    for (int64_t m = 0; m < M; m++) {  /* a select per row over the group's slots (vectorised) */
                        float* row = lg + m * T + grp * G;
                        const int64_t hi = row_pos[m], lo = row_lo[m];
                        for (int64_t i = 0; i < G; i++) row[i] = VISIBLE(gp[i], hi, lo) ? row[i] : -INFINITY;
                    }
                }
            }
        }
        /* Residual keys, then soft-capping and a softmax (with the head's sink) per query row. */
        softmax_rows(logits, q, qpos, first, &res, BH, H, M, n, T, D, window, scaling, softcap, sinks);
        /* Values: acc_c += (p * s_j) * c_c + p * z_j, j the channel group of column c. */
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                const float* lg = logits + bh * M * T;
                float* acc = partial + (bh * chunks + chunk) * M * D;
                float* zero_acc = work + (bh * chunks + chunk) * (M * D + 2 * D + G * D);  /* [M, J]: sum of p * z_j */
                float* codes = zero_acc + M * D;
                float* block = codes + 2 * D;  /* [G, D]: one group's codes * their token's channel-group scale */
                memset(acc, 0, sizeof(float) * M * D);
                memset(zero_acc, 0, sizeof(float) * M * J);
                const int64_t t_end = (chunk + 1) * per_chunk * G < L ? (chunk + 1) * per_chunk * G : L;
                /* The registers' path where values_rows has a copy for this head dim, width and J. */
                const int regs = vector && register_values(D, bits, J);
                for (int64_t t0 = chunk * per_chunk * G; t0 < t_end && regs; t0 += G) {
                    const float* z = vz + (bh * L + t0) * J;
                    for (int64_t m = 0; m < M; m++) {
                        const float* p = lg + m * T + t0;
                        for (int64_t j = 0; j < J; j++) {
                            float zsum = 0.0f;
                            for (int64_t i = 0; i < G; i++) zsum += p[i] * z[i * J + j];
                            zero_acc[m * J + j] += zsum;
                        }
                    }
                    for (int64_t m0 = 0; m0 < M; m0 += 4)
                        values_dispatch(acc + m0 * D, lg + m0 * T + t0, T, vs + (bh * L + t0) * J,
                                        vc + (bh * L + t0) * W, G, D, bits, J, M - m0 < 4 ? M - m0 : 4);
                }
                for (int64_t t0 = chunk * per_chunk * G; t0 < t_end && vector && !regs; t0 += G) {
                    /* 16 columns per vector (each within one channel group): a group's codes are unpacked once,
                       and each row multiplies its probability by the token's group scale instead of the codes. */
                    for (int64_t t = t0; t < t0 + G; t++)
                        unpack16(vc + (bh * L + t) * W, W, bits, (v16f_u*)(block + (t - t0) * D));
                    for (int64_t m = 0; m < M; m++) {
                        const float* p = lg + m * T + t0;
                        const float* z = vz + (bh * L + t0) * J;
                        float zsum[16] = {0};  /* J <= D / 16 here */
                        for (int64_t i = 0; i < G; i++)
                            for (int64_t j = 0; j < J; j++) zsum[j] += p[i] * z[i * J + j];
                        for (int64_t j = 0; j < J; j++) zero_acc[m * J + j] += zsum[j];
                        for (int64_t k = 0; k < K; k += 4) {  /* four accumulators in registers (K % 4 == 0) */
                            const int64_t j0 = group_of[k], j1 = group_of[k + 1], j2 = group_of[k + 2],
                                          j3 = group_of[k + 3];
                            v16f a0 = load16(acc + m * D + 16 * k), a1 = load16(acc + m * D + 16 * k + 16),
                                 a2 = load16(acc + m * D + 16 * k + 32), a3 = load16(acc + m * D + 16 * k + 48);
                            for (int64_t i = 0; i < G; i++) {
                                const float* sc = vs + (bh * L + t0 + i) * J;
                                const float* x = block + i * D + 16 * k;
                                a0 += (p[i] * sc[j0]) * load16(x);
                                a1 += (p[i] * sc[j1]) * load16(x + 16);
                                a2 += (p[i] * sc[j2]) * load16(x + 32);
                                a3 += (p[i] * sc[j3]) * load16(x + 48);
                            }
                            store16(acc + m * D + 16 * k, a0); store16(acc + m * D + 16 * k + 16, a1);
                            store16(acc + m * D + 16 * k + 32, a2); store16(acc + m * D + 16 * k + 48, a3);
                        }
                    }
                }
                for (int64_t t0 = chunk * per_chunk * G; t0 < t_end && !vector; t0 += G) {
                    for (int64_t t = t0; t < t0 + G; t++) {
                        unpack_planes(vc + (bh * L + t) * W, W, bits, codes);
                        const float* s = vs + (bh * L + t) * J;
                        const float* z = vz + (bh * L + t) * J;
                        float* scaled = block + (t - t0) * D;
                        for (int64_t plane = 0; plane < P; plane++)
                            for (int64_t j = 0; j < J; j++)
                                scale(scaled + plane * W + j * run, s[j], codes + plane * W + j * run, run);
                        for (int64_t m = 0; m < M; m++)
                            for (int64_t j = 0; j < J; j++) zero_acc[m * J + j] += lg[m * T + t] * z[j];
                    }
                    /* Each query row walks the group with its accumulator in registers (D = 64 unrolled). */
                    for (int64_t m = 0; m < M; m++) {
                        const float* p = lg + m * T + t0;
                        float* o = acc + m * D;
                        if (D == 64) {
                            float r[64];
                            for (int c = 0; c < 64; c++) r[c] = o[c];
                            for (int64_t i = 0; i < G; i++)
                                for (int c = 0; c < 64; c++) r[c] += p[i] * block[i * 64 + c];
                            for (int c = 0; c < 64; c++) o[c] = r[c];
                        } else {
                            for (int64_t i = 0; i < G; i++) axpy(o, p[i], block + i * D, D);
                        }
                    }
                }
                for (int64_t m = 0; m < M; m++)  /* the zero points' term, once per column */
                    for (int64_t plane = 0; plane < P; plane++)
                        for (int64_t j = 0; j < J; j++)
                            for (int64_t i = 0; i < run; i++) acc[m * D + plane * W + j * run + i] += zero_acc[m * J + j];
            }
        }
        /* Sum the chunks in the original channel order, then the residual values. */
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            float* ob = out + bh * M * D;
            memset(ob, 0, sizeof(float) * M * D);
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                const float* acc = partial + (bh * chunks + chunk) * M * D;
                for (int64_t m = 0; m < M; m++)
                    for (int64_t c = 0; c < D; c++) ob[m * D + channel[c]] += acc[m * D + c];
            }
            const float* lg = logits + bh * M * T;
            for (int64_t t = 0; t < R0 + R; t++) {
                const float* v = residual_value(&res, bh, t, D);
                for (int64_t m = 0; m < M; m++) {
                    const float p = lg[m * T + L + t];
                    float* o = ob + m * D;
                    for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
                }
            }
        }
    }
}

/* KVTC's live codes of one token, one KV head and one kind, as floats in coding order: cnt[0], cnt[1], cnt[2]
   components stored at 2, 4 and 8 bits, 5, 2 and 1 to a byte (lut3 [256 * 5], lut15 [256 * 2]: a byte's
   digits as floats). Returns the number of components. */
static inline int64_t unpack_live(const uint8_t* restrict p, const int64_t* restrict cnt,
                                  const float* restrict lut3, const float* restrict lut15, float* restrict o) {
    const int64_t n3 = cnt[0], n15 = cnt[1], n8 = cnt[2];
    int64_t j = 0;
    for (; j + 5 <= n3; j += 5, p++) memcpy(o + j, lut3 + 5 * *p, 5 * sizeof(float));
    if (j < n3) memcpy(o + j, lut3 + 5 * *p++, sizeof(float) * (n3 - j));
    o += n3;
#if defined(__AVX512BW__)
    /* 16 bytes at a time: byte = lo + 15 hi, hi = (byte * 137) >> 11 (exact below 256), the digits interleaved
       lo, hi as floats, exactly n15 of them stored. */
    for (j = 0; 2 * j < n15; j += 16) {
        const int64_t left = n15 - 2 * j, bytes = (left + 1) / 2;
        const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes >= 16 ? 0xffff : (1u << bytes) - 1, p + j));
        const __m512i hi = _mm512_srli_epi32(_mm512_mullo_epi32(x, _mm512_set1_epi32(137)), 11);
        const __m512 lo_f = _mm512_cvtepi32_ps(_mm512_sub_epi32(x, _mm512_mullo_epi32(hi, _mm512_set1_epi32(15))));
        const __m512 hi_f = _mm512_cvtepi32_ps(hi);
        const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
        _mm512_mask_storeu_ps(o + 2 * j, left >= 16 ? 0xffff : (1u << left) - 1,
                              _mm512_permutex2var_ps(lo_f, first, hi_f));
        if (left > 16)
            _mm512_mask_storeu_ps(o + 2 * j + 16, left >= 32 ? 0xffff : (1u << (left - 16)) - 1,
                                  _mm512_permutex2var_ps(lo_f, second, hi_f));
    }
    p += (n15 + 1) / 2;
#else
    for (j = 0; j + 2 <= n15; j += 2, p++) memcpy(o + j, lut15 + 2 * *p, 2 * sizeof(float));
    if (j < n15) o[j] = lut15[2 * *p++];
#endif
    o += n15;
    for (j = 0; j + 16 <= n8; j += 16) store16(o + j, __builtin_convertvector(widen16(p + j), v16f));
    for (; j < n8; j++) o[j] = p[j];
    return n3 + n15 + n8;
}

/* acc[m * QS + s] += sum_j p[m][j] * tile[j * SP + s] for s < SP and acc[m * QS + SP] += sum_j p[m][j], over the
   tile's G rows (p[m][j] = lg[m * T + idx[j]]): the SP / 16 accumulators of a row stay in registers. SP is a
   constant of each inlined copy. */
static inline __attribute__((always_inline)) void values_tile(float* restrict acc, int64_t QS,
                                                              const float* restrict lg, int64_t T, int64_t M,
                                                              const int64_t* restrict idx, int64_t G,
                                                              const float* restrict tile, const int SP) {
    for (int64_t m = 0; m < M; m++) {
        float* a = acc + m * QS;
        v16f r[SP / 16];
        float mass = 0.0f;
        for (int k = 0; k < SP / 16; k++) r[k] = load16(a + 16 * k);
        for (int64_t j = 0; j < G; j++) {
            const float pj = lg[m * T + idx[j]];
            mass += pj;
            for (int k = 0; k < SP / 16; k++) r[k] += pj * load16(tile + j * SP + 16 * k);
        }
        for (int k = 0; k < SP / 16; k++) store16(a + 16 * k, r[k]);
        a[SP] += mass;
    }
}

/* values_tile for SP = 64 and M <= 4 rows: every row's sums in registers, so that each token's codes are loaded
   once for all rows (the same sums in the same order). */
static inline void values_tile_rows64(float* restrict acc, int64_t QS, const float* restrict lg, int64_t T,
                                      int64_t M, const int64_t* restrict idx, int64_t G, const float* restrict tile) {
    v16f r[4][4];
    float mass[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int m = 0; m < 4 && m < M; m++)
        for (int u = 0; u < 4; u++) r[m][u] = load16(acc + m * QS + 16 * u);
    for (int64_t j = 0; j < G; j++) {
        const float* tj = tile + j * 64;
        const v16f v0 = load16(tj), v1 = load16(tj + 16), v2 = load16(tj + 32), v3 = load16(tj + 48);
        for (int m = 0; m < 4; m++) {
            if (m >= M) break;
            const float pj = lg[m * T + idx[j]];
            mass[m] += pj;
            r[m][0] += pj * v0; r[m][1] += pj * v1; r[m][2] += pj * v2; r[m][3] += pj * v3;
        }
    }
    for (int m = 0; m < 4 && m < M; m++) {
        for (int u = 0; u < 4; u++) store16(acc + m * QS + 16 * u, r[m][u]);
        acc[m * QS + 64] += mass[m];
    }
}

/* values_tile for any SP (a multiple of 16), the accumulators in memory. */
static void values_tile_any(float* restrict acc, int64_t QS, const float* restrict lg, int64_t T, int64_t M,
                            const int64_t* restrict idx, int64_t G, const float* restrict tile, int64_t SP) {
    for (int64_t m = 0; m < M; m++) {
        float* a = acc + m * QS;
        for (int64_t j = 0; j < G; j++) {
            const float pj = lg[m * T + idx[j]];
            for (int64_t s = 0; s < SP; s += 16) store16(a + s, load16(a + s) + pj * load16(tile + j * SP + s));
            a[SP] += pj;
        }
    }
}

/* r[i] = the sum of the 16 lanes of a[i], for 16 vectors at once (a transposing tree: 15 adds and 30 shuffles
   where 16 separate horizontal sums take about 100 operations). */
#define SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
static inline v16f hsum16x16(const v16f* restrict a) {
    v16f c[8], d[4], e[2];
    for (int j = 0; j < 8; j++)
        c[j] = SHUF(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUF(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        d[j] = SHUF(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUF(c[2 * j], c[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        e[j] = SHUF(d[2 * j], d[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUF(d[2 * j], d[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef SHUF

/* D = 64: the scaled logits of 16 consecutive keys (64 floats apart) for one query row, into out[0..15]. */
static inline void logits16_d64(const float* restrict qm, const float* restrict kr, float scaling,
                                float* restrict out) {
    const v16f q0 = load16(qm), q1 = load16(qm + 16), q2 = load16(qm + 32), q3 = load16(qm + 48);
    v16f a[16];
    for (int i = 0; i < 16; i++) {
        const float* kt = kr + 64 * i;
        a[i] = load16(kt) * q0 + load16(kt + 16) * q1 + load16(kt + 32) * q2 + load16(kt + 48) * q3;
    }
    store16(out, hsum16x16(a) * scaling);
}

/* kr = RoPE of k (D channels, the first RD rotated: rotate-half with this position's cos, sin [RD / 2], the
   halves of the rotate-half table being equal). */
static inline void rotate_key(float* restrict kr, const float* restrict k, const float* restrict cs,
                              const float* restrict sn, int64_t RD, int64_t D) {
    const int64_t half = RD / 2;
    if (RD == 64 && D == 64) {
        for (int i = 0; i < 32; i++) {
            kr[i] = k[i] * cs[i] - k[i + 32] * sn[i];
            kr[i + 32] = k[i + 32] * cs[i] + k[i] * sn[i];
        }
        return;
    }
    for (int64_t i = 0; i < half; i++) {
        kr[i] = k[i] * cs[i] - k[i + half] * sn[i];
        kr[i + half] = k[i + half] * cs[i] + k[i] * sn[i];
    }
    for (int64_t i = RD; i < D; i++) kr[i] = k[i];
}

/* Four keys at once for D = 64: k[j] = o + sum_s c[j * S + s] * w[s] (w [ns, 64]), the sixteen accumulators
   (4 tokens x 64 channels) in registers so that every weight load serves the four tokens. */
static void keys4_d64(const float* restrict c, int64_t S, int64_t ns, const float* restrict w,
                      const float* restrict o, float* restrict k) {
    v16f a[4][4];
    for (int u = 0; u < 4; u++) {
        const v16f ou = load16(o + 16 * u);
        for (int j = 0; j < 4; j++) a[j][u] = ou;
    }
    for (int64_t s = 0; s < ns; s++) {
        v16f ws[4];
        for (int u = 0; u < 4; u++) ws[u] = load16(w + s * 64 + 16 * u);
        for (int j = 0; j < 4; j++) {
            const float x = c[j * S + s];
            for (int u = 0; u < 4; u++) a[j][u] += x * ws[u];
        }
    }
    for (int j = 0; j < 4; j++)
        for (int u = 0; u < 4; u++) store16(k + 64 * j + 16 * u, a[j][u]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVTC_INT_KEYS 1
/* unpack_live as int16 codes (lut3: a byte's ternary digits as int16), for keys rebuilt in integers. */
static inline int64_t unpack_live_i16(const uint8_t* restrict p, const int64_t* restrict cnt,
                                      const int16_t* restrict lut3, int16_t* restrict o) {
    const int64_t n3 = cnt[0], n15 = cnt[1], n8 = cnt[2];
    int64_t j = 0;
    for (; j + 5 <= n3; j += 5, p++) memcpy(o + j, lut3 + 5 * *p, 5 * sizeof(int16_t));
    if (j < n3) memcpy(o + j, lut3 + 5 * *p++, sizeof(int16_t) * (n3 - j));
    o += n3;
    /* 15-level codes, byte = lo + 15 hi, 16 bytes at a time: hi = (byte * 137) >> 11 (exact below 256), each
       int32 lane lo | hi << 16, the two int16 in order (an odd count's last hi is the packing's zero, written
       over by what follows or by the pad below). */
    for (j = 0; j < (n15 + 1) / 2; j += 16) {
        const int64_t left = (n15 + 1) / 2 - j;
        const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p + j));
        const __m512i hi = _mm512_srli_epi32(_mm512_mullo_epi32(x, _mm512_set1_epi32(137)), 11);
        const __m512i lo = _mm512_sub_epi32(x, _mm512_mullo_epi32(hi, _mm512_set1_epi32(15)));
        _mm512_mask_storeu_epi32(o + 2 * j, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    p += (n15 + 1) / 2;
    o += n15;
    for (j = 0; j + 16 <= n8; j += 16)
        _mm256_storeu_si256((__m256i*)(o + j), _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + j))));
    for (; j < n8; j++) o[j] = p[j];
    if ((n3 + n15 + n8) & 1) o[n8] = 0;  /* an odd count's last pair is completed by a zero code */
    return n3 + n15 + n8;
}

/* acc += the pairwise int16 products of x and w summed per int32 lane (vpdpwssd). In asm: gcc 12 copies every
   accumulator of the intrinsic's tied operand to another register and back each time (and spills one). */
static inline __m512i dpwssd(__m512i acc, __m512i x, __m512i w) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
}

/* Channels d0 .. d0 + 16 NU of four keys rebuilt in integers: k[j] = o + sc * sum_s c[j * cs + s] * w16[s]
   over np pairs of components, w16 [np][D][2] (each channel's two components side by side, the layout of
   vpdpwssd: 32 products an instruction where a float FMA does 16), summed exactly in int32. */
static inline __attribute__((always_inline)) void keys4_i16_block(
        const int16_t* restrict c, int64_t cs, int64_t np, const int16_t* restrict w, const float* restrict sc,
        const float* restrict o, float* restrict k, int64_t D, int64_t d0, const int NU) {
    __m512i a[4][4];
    for (int j = 0; j < 4; j++)
        for (int u = 0; u < NU; u++) a[j][u] = _mm512_setzero_si512();
    for (int64_t p = 0; p < np; p++) {
        __m512i ws[4];
        for (int u = 0; u < NU; u++) ws[u] = _mm512_loadu_si512(w + 2 * (p * D + d0 + 16 * u));
        for (int j = 0; j < 4; j++) {
            int32_t pair;
            memcpy(&pair, c + j * cs + 2 * p, sizeof pair);
            const __m512i x = _mm512_set1_epi32(pair);
            for (int u = 0; u < NU; u++) a[j][u] = dpwssd(a[j][u], x, ws[u]);
        }
    }
    for (int u = 0; u < NU; u++) {
        const v16f ou = load16(o + d0 + 16 * u), su = load16(sc + d0 + 16 * u);
        for (int j = 0; j < 4; j++) store16(k + j * D + d0 + 16 * u, ou + su * (v16f)_mm512_cvtepi32_ps(a[j][u]));
    }
}

/* Four keys (D % 16 == 0) from their int16 codes: keys4_i16_block over every 64 channels, then the rest. */
static void keys4_i16(const int16_t* restrict c, int64_t cs, int64_t np, const int16_t* restrict w,
                      const float* restrict sc, const float* restrict o, float* restrict k, int64_t D) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) keys4_i16_block(c, cs, np, w, sc, o, k, D, d0, 4);
    switch ((D - d0) / 16) {
        case 3: keys4_i16_block(c, cs, np, w, sc, o, k, D, d0, 3); break;
        case 2: keys4_i16_block(c, cs, np, w, sc, o, k, D, d0, 2); break;
        case 1: keys4_i16_block(c, cs, np, w, sc, o, k, D, d0, 1); break;
        default: break;
    }
}
#else
#define KVTC_INT_KEYS 0
#endif

/* Whether kvtc_attention_f32 rebuilds keys in integers when given an int16 basis (AVX-512 VNNI compiled in). */
int kvtc_int_keys(void) { return KVTC_INT_KEYS; }

/* KVTC decode attention over live codes. q [BH, M, D] (row m: query m % n); qpos [B, n]; kc [BH, L, Wk],
   vc [BH, L, Wv] packed codes; pos [BH, L] (>= P: a hole); cnt [H, 2, 3] components per width of each KV head's
   keys and values; wk, wv [H, S, D] and ok, ov [H, D]: a key is RoPE(codes @ wk + ok), a value codes @ wv + ov;
   cos_t, sin_t [P, RD / 2] by position (RD rotary channels; the first half of rotate-half's table); rk, rv
   [BH, R, D], rpos [BH, R]: the full-precision window, hk, hv [BH, R0, D], hpos [BH, R0] the sinks
   (residual_t); out [BH, M, D]; logits [BH, M, L + R0 + R]; work
   [BH * chunks, 16 * Sp + 32 * D]; partial
   [BH * chunks, M, Sp + 1] (Sp: S rounded up to a multiple of 16, the components past a head's count zero).
   Keys: each coded token's key is rebuilt once (unpack, S x D multiply-adds, rotation) and shared by the group's
   M rows; or, given qk [BH * chunks, M, Sp + 1] (keys coded after RoPE), each chunk first projects its queries,
   qk[m, s] = wk[s] . q[m] and qk[m, Sp] = ok . q[m], and a logit is qk[m, Sp] + codes . qk[m] (Sp multiply-adds,
   nothing rebuilt or rotated), sixteen tokens unpacked at a time. Given wk16 [H, ceil(S / 2), D, 2] int16 and ks
   [H, D] with wk[h, s, d] = ks[h, d] * wk16[h, s / 2, d, s % 2] (the basis on an int16 grid, D % 16 == 0), keys
   are rebuilt from int16 codes (lut3i: the ternary digits as int16) in exact int32 sums where VNNI is compiled
   in (twice the multiply-adds an instruction), else from wk as floats: the same keys to float rounding. Values:
   the probabilities are applied to the codes and projected once per row at the end. */
void kvtc_attention_f32(const float* q, const int64_t* qpos, const uint8_t* kc, const uint8_t* vc,
                        const int32_t* pos, const int64_t* cnt, const float* wk, const float* ok, const float* wv,
                        const float* ov, const float* cos_t, const float* sin_t, const float* lut3,
                        const float* lut15, const float* rk, const float* rv, const int32_t* rpos, float* out,
                        float* logits, float* work, float* partial, int64_t B, int64_t H, int64_t M, int64_t n,
                        int64_t L, int64_t R, int64_t D, int64_t S, int64_t RD, int64_t P, int64_t Wk, int64_t Wv,
                        int64_t chunks, float scaling, int threads, int64_t window, float softcap,
                        const float* sinks, float* qk, const int16_t* wk16, const float* ks,
                        const int16_t* lut3i, const float* hk, const float* hv, const int32_t* hpos, int64_t R0) {
    const residual_t res = {hk, hv, rk, rv, hpos, rpos, R0, R};
    const int64_t BH = B * H, T = L + R0 + R, per_chunk = (L + chunks - 1) / chunks;
    const int64_t Sp = (S + 15) / 16 * 16, QS = Sp + 1, WS = 16 * Sp + 32 * D;  /* padded components, strides */
    int64_t first[BH > 0 ? BH : 1];
    #pragma omp parallel num_threads(threads)
    {
        lowest_positions(first, pos, &res, BH, L);
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                const int64_t h = bh % H, *qp = qpos + (bh / H) * n;
                const float *w = wk + h * S * D, *o = ok + h * D;
                float *c = work + (bh * chunks + chunk) * WS, *k = c + 16 * Sp, *kr = k + 16 * D;
                float* lg = logits + bh * M * T;
                int64_t hi[M > 0 ? M : 1], lo[M > 0 ? M : 1];
                for (int64_t m = 0; m < M; m++) {
                    const int blind = first[bh] > qp[m % n];  /* sees no key: sees every slot */
                    hi[m] = blind ? INT64_MAX : qp[m % n];
                    lo[m] = blind || window <= 0 ? INT64_MIN : qp[m % n] - window + 1;
                }
                const int64_t t_end = (chunk + 1) * per_chunk < L ? (chunk + 1) * per_chunk : L;
                float* qr = qk ? qk + (bh * chunks + chunk) * M * QS : NULL;
                if (qr) {  /* zero past the head's components, so that the dots run over Sp (codes zero there too) */
                    const int64_t nk = cnt[h * 6] + cnt[h * 6 + 1] + cnt[h * 6 + 2];
                    for (int64_t m = 0; m < M; m++) {
                        const float* qm = q + (bh * M + m) * D;
                        for (int64_t s = 0; s < Sp; s++) qr[m * QS + s] = s < nk ? dot(w + s * D, qm, D) : 0.0f;
                        qr[m * QS + Sp] = dot(o, qm, D);
                    }
                }
                if (qr) {  /* keys coded after RoPE: 16 tokens unpacked at a time, then each row's dots with them */
                    memset(c, 0, sizeof(float) * 16 * Sp);  /* past the head's components: zero */
                    for (int64_t t0 = chunk * per_chunk; t0 < t_end; t0 += 16) {
                        const int64_t G = t_end - t0 < 16 ? t_end - t0 : 16;
                        const int32_t* tp = pos + bh * L + t0;
                        for (int64_t i = 0; i < G; i++)
                            unpack_live(kc + (bh * L + t0 + i) * Wk, cnt + h * 6, lut3, lut15, c + i * Sp);
                        for (int64_t m = 0; m < M; m++) {  /* (a short tile's other rows: earlier codes, unread) */
                            const float* qm = qr + m * QS;
                            float* row = lg + m * T + t0;
                            v16f a[16];
                            for (int i = 0; i < 16; i++) {
                                const float* ci = c + i * Sp;
                                a[i] = load16(ci) * load16(qm);
                                for (int64_t s = 16; s < Sp; s += 16) a[i] += load16(ci + s) * load16(qm + s);
                            }
                            const v16f dots = hsum16x16(a);
                            for (int64_t i = 0; i < G; i++)
                                row[i] = VISIBLE(tp[i], hi[m], lo[m]) ? (qm[Sp] + dots[i]) * scaling : -INFINITY;
                        }
                    }
                    continue;
                }
                /* Keys without RoPE: up to 16 seen tokens at a time, each key rebuilt once for the group's rows
                   (four at a time), rotated, then each row's logits of the 16 reduced together. */
#if KVTC_INT_KEYS
                int16_t* c16 = wk16 && D % 16 == 0 ? (int16_t*)c : NULL;  /* 16 tokens' codes, Sp apart */
                if (c16) memset(c16, 0, sizeof(int16_t) * 16 * Sp);
#endif
                for (int64_t t = chunk * per_chunk; t < t_end;) {
                    int64_t idx[16], G = 0, ns = 0;
                    for (; t < t_end && G < 16; t++) {
                        const int32_t kp = pos[bh * L + t];
                        int seen = 0;
                        for (int64_t m = 0; m < M; m++) seen |= VISIBLE(kp, hi[m], lo[m]);
                        if (!seen) {  /* a hole, or outside every row's window: not rebuilt */
                            for (int64_t m = 0; m < M; m++) lg[m * T + t] = -INFINITY;
                            continue;
                        }
                        const uint8_t* src = kc + (bh * L + t) * Wk;
#if KVTC_INT_KEYS
                        if (c16) ns = unpack_live_i16(src, cnt + h * 6, lut3i, c16 + G * Sp);
                        else
#endif
                        ns = unpack_live(src, cnt + h * 6, lut3, lut15, c + G * S);
                        idx[G++] = t;
                    }
                    if (G == 0) continue;
                    for (int64_t j = 0; j < G; j += 4) {  /* (a short group's other rows: earlier codes, unread) */
#if KVTC_INT_KEYS
                        if (c16) {
                            keys4_i16(c16 + j * Sp, Sp, (ns + 1) / 2, wk16 + h * ((S + 1) / 2) * D * 2, ks + h * D, o,
                                      k + j * D, D);
                            continue;
                        }
#endif
                        if (D == 64 && j + 4 <= G) keys4_d64(c + j * S, S, ns, w, o, k + j * D);
                        else
                            for (int64_t i = j; i < G && i < j + 4; i++) {
                                memcpy(k + i * D, o, sizeof(float) * D);
                                for (int64_t s = 0; s < ns; s++) axpy(k + i * D, c[i * S + s], w + s * D, D);
                            }
                    }
                    for (int64_t i = 0; i < G; i++) {
                        const int32_t kp = pos[bh * L + idx[i]];
                        const int64_t at = kp >= 0 && kp < P ? kp : 0;
                        rotate_key(kr + i * D, k + i * D, cos_t + at * (RD / 2), sin_t + at * (RD / 2), RD, D);
                    }
                    for (int64_t m = 0; m < M; m++) {
                        const float* qm = q + (bh * M + m) * D;
                        float l16[16];
                        if (D == 64 && G == 16) logits16_d64(qm, kr, scaling, l16);
                        else
                            for (int64_t i = 0; i < G; i++) l16[i] = dot(qm, kr + i * D, D) * scaling;
                        for (int64_t i = 0; i < G; i++)
                            lg[m * T + idx[i]] = VISIBLE(pos[bh * L + idx[i]], hi[m], lo[m]) ? l16[i] : -INFINITY;
                    }
                }
            }
        }
        softmax_rows(logits, q, qpos, first, &res, BH, H, M, n, T, D, window, scaling, softcap, sinks);
        /* Values: acc[m, s] += p * code_s and acc[m, S] += p per chunk. */
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                const int64_t h = bh % H;
                const float* lg = logits + bh * M * T;
                float* acc = partial + (bh * chunks + chunk) * M * QS;
                float* c = work + (bh * chunks + chunk) * WS;
                memset(acc, 0, sizeof(float) * M * QS);
                memset(c, 0, sizeof(float) * 16 * Sp);  /* past the head's components: zero */
                const int64_t t_end = (chunk + 1) * per_chunk < L ? (chunk + 1) * per_chunk : L;
                for (int64_t t0 = chunk * per_chunk; t0 < t_end; t0 += 16) {
                    /* The tile's tokens that some row attends, unpacked; then every row's sums over them. */
                    const int64_t end = t_end - t0 < 16 ? t_end : t0 + 16;
                    int64_t idx[16], G = 0;
                    for (int64_t t = t0; t < end; t++) {
                        int any = 0;
                        for (int64_t m = 0; m < M && !any; m++) any = lg[m * T + t] != 0.0f;
                        if (!any) continue;
                        unpack_live(vc + (bh * L + t) * Wv, cnt + h * 6 + 3, lut3, lut15, c + G * Sp);
                        idx[G++] = t;
                    }
                    if (Sp == 64 && M <= 4) values_tile_rows64(acc, QS, lg, T, M, idx, G, c);
                    else if (Sp == 64) values_tile(acc, QS, lg, T, M, idx, G, c, 64);
                    else if (Sp == 128) values_tile(acc, QS, lg, T, M, idx, G, c, 128);
                    else if (Sp == 256) values_tile(acc, QS, lg, T, M, idx, G, c, 256);
                    else values_tile_any(acc, QS, lg, T, M, idx, G, c, Sp);
                }
            }
        }
        /* Sum the chunks, project once per row, then the residual values. */
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            const int64_t h = bh % H;
            const float *w = wv + h * S * D, *o = ov + h * D, *lg = logits + bh * M * T;
            float* sum = work + bh * chunks * WS;  /* the chunks' keys pass is over: reuse */
            for (int64_t m = 0; m < M; m++) {
                memset(sum, 0, sizeof(float) * QS);
                for (int64_t chunk = 0; chunk < chunks; chunk++) {
                    const float* a = partial + ((bh * chunks + chunk) * M + m) * QS;
                    for (int64_t s = 0; s < QS; s++) sum[s] += a[s];
                }
                float* ob = out + (bh * M + m) * D;
                scale(ob, sum[Sp], o, D);
                for (int64_t s = 0; s < S; s++) if (sum[s] != 0.0f) axpy(ob, sum[s], w + s * D, D);
                for (int64_t t = 0; t < R0 + R; t++) {
                    const float p = lg[m * T + L + t];
                    if (p != 0.0f) axpy(ob, p, residual_value(&res, bh, t, D), D);
                }
            }
        }
    }
}

/* y [O] = W [O, I] x [I] (+ b [O]): one token through a linear layer, four weight rows per pass over x, the
   rows split between the threads (each row summed by one thread in one order: the result does not depend on
   the thread count). A decode step reads every weight once, so this is a stream over W: about 42 GB/s here
   against 16 for torch's matrix product with one row (SmolLM2-135M's 211 layers, 2 threads). */
void linear_f32(const float* W, const float* x, const float* b, float* y, int64_t O, int64_t I, int threads) {
    const int64_t I16 = I / 16 * 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o0 = 0; o0 < O; o0 += 4) {
        const int64_t n = O - o0 < 4 ? O - o0 : 4;
        const float* w = W + o0 * I;
        float r[4];
        if (n == 4) {
            v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < I16; i += 16) {
                const v16f xv = load16(x + i);
                a0 += load16(w + i) * xv; a1 += load16(w + I + i) * xv;
                a2 += load16(w + 2 * I + i) * xv; a3 += load16(w + 3 * I + i) * xv;
            }
            r[0] = hsum16(a0); r[1] = hsum16(a1); r[2] = hsum16(a2); r[3] = hsum16(a3);
        } else {
            for (int64_t j = 0; j < n; j++) {
                v16f a = {0};
                for (int64_t i = 0; i < I16; i += 16) a += load16(w + j * I + i) * load16(x + i);
                r[j] = hsum16(a);
            }
        }
        for (int64_t j = 0; j < n; j++) {
            for (int64_t i = I16; i < I; i++) r[j] += w[j * I + i] * x[i];
            y[o0 + j] = b ? r[j] + b[o0 + j] : r[j];
        }
    }
}

/* D = 64, M <= 4 rows: acc[m] (64 floats, D apart) = sum_t p[m * L + t] * v[t] over t in [t0, t1), the rows'
   sums in registers. */
static inline void values_d64(float* restrict acc, const float* restrict pr, int64_t L, int64_t M,
                              const float* restrict vr, int64_t t0, int64_t t1) {
    v16f r[4][4] = {{{0}}};
    for (int64_t t = t0; t < t1; t++) {
        const float* vt = vr + 64 * t;
        const v16f v0 = load16(vt), v1 = load16(vt + 16), v2 = load16(vt + 32), v3 = load16(vt + 48);
        for (int m = 0; m < 4; m++) {
            if (m >= M) break;
            const float p = pr[m * L + t];
            r[m][0] += p * v0; r[m][1] += p * v1; r[m][2] += p * v2; r[m][3] += p * v3;
        }
    }
    for (int m = 0; m < M && m < 4; m++)
        for (int u = 0; u < 4; u++) store16(acc + m * 64 + 16 * u, r[m][u]);
}

/* Decode attention over float keys and values that every query row sees (no mask to apply), with its
   probabilities: q [BH, M, D] (the M query rows of each KV head), keys and values of (row b, KV head h) at
   k + b * kb + h * kh (and v alike), token t D floats after token t - 1; out [BH, M, D], probs [BH, M, L],
   partial [BH, C, M, D]. Tokens go in chunks of `chunk` (C of them) so that few KV heads still share the
   threads; the chunking does not depend on B, so a row's result is the same alone and in a batch. Soft-capping
   and sink logits (sinks [H, M] or NULL) as residual_softmax applies them. */
void decode_attention_f32(const float* q, const float* k, const float* v, float* out, float* probs,
                          float* partial, int64_t B, int64_t H, int64_t M, int64_t L, int64_t D, int64_t kb,
                          int64_t kh, int64_t vb, int64_t vh, int64_t chunk, float scaling, float softcap,
                          const float* sinks, int threads) {
    const int64_t BH = B * H, C = (L + chunk - 1) / chunk;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            for (int64_t c = 0; c < C; c++) {
                const float* kr = k + (bh / H) * kb + (bh % H) * kh;
                const float* qm = q + bh * M * D;
                float* pr = probs + bh * M * L;
                const int64_t end = (c + 1) * chunk < L ? (c + 1) * chunk : L;
                int64_t t = c * chunk;
                if (D == 64)  /* sixteen keys per row at a time, their sums reduced together */
                    for (; t + 16 <= end; t += 16)
                        for (int64_t m = 0; m < M; m++) logits16_d64(qm + m * D, kr + t * D, scaling, pr + m * L + t);
                for (; t < end; t++)
                    for (int64_t m = 0; m < M; m++) pr[m * L + t] = dot(qm + m * D, kr + t * D, D) * scaling;
            }
        }
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++)
            for (int64_t m = 0; m < M; m++)
                residual_softmax(probs + (bh * M + m) * L, L, 0, NULL, NULL, 0, D, 0, 0, scaling, softcap,
                                 sinks ? sinks + (bh % H) * M + m : NULL);
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            for (int64_t c = 0; c < C; c++) {
                const float* vr = v + (bh / H) * vb + (bh % H) * vh;
                const float* pr = probs + bh * M * L;
                float* acc = partial + (bh * C + c) * M * D;
                const int64_t end = (c + 1) * chunk < L ? (c + 1) * chunk : L;
                if (D == 64 && M <= 4) {  /* the rows' sums in registers */
                    values_d64(acc, pr, L, M, vr, c * chunk, end);
                    continue;
                }
                memset(acc, 0, M * D * sizeof(float));
                for (int64_t t = c * chunk; t < end; t++)
                    for (int64_t m = 0; m < M; m++) axpy(acc + m * D, pr[m * L + t], vr + t * D, D);
            }
        }
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++) {
            for (int64_t m = 0; m < M; m++) {
                float* o = out + (bh * M + m) * D;
                memcpy(o, partial + bh * C * M * D + m * D, D * sizeof(float));
                for (int64_t c = 1; c < C; c++) axpy(o, 1.0f, partial + ((bh * C + c) * M + m) * D, D);
            }
        }
    }
}

/* The lane-wise maximum (a vector ?: is C++ only in gcc). */
static inline v16f max16(v16f a, v16f b) {
    const v16i g = a > b;
    return (v16f)(((v16i)a & g) | ((v16i)b & ~g));
}

/* 16 query rows (qt [16, D], scaled) times the 16 keys of a transposed block (kt [D, 16]): the rows' logits,
   16 apart LS floats at lg (one register per row; each key vector feeds 16 multiply-adds). */
static inline __attribute__((always_inline)) void tile_qk(const float* restrict qt, const float* restrict kt,
                                                          int64_t D, float* restrict lg, int64_t LS) {
    v16f a[16];
    for (int r = 0; r < 16; r++) a[r] = (v16f){0};
    for (int64_t d = 0; d < D; d++) {
        const v16f kv = load16(kt + 16 * d);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) a[r] += qt[r * D + d] * kv;
    }
    for (int r = 0; r < 16; r++) store16(lg + r * LS, a[r]);
}

/* acc[r * D + c] += sum_{j < T} p[r * LS + j] * v[j * D + c] for 16 rows and every channel c (D % 16 == 0):
   256 keys at a time, each of their 16-channel slices summed in registers, so the rows' probabilities are read
   once from memory (their 16 KB stay in L1 across the slices) and a chunk's values from L2. */
static void tile_values(const float* restrict p, int64_t LS, const float* restrict v, int64_t D, int64_t T,
                        float* restrict acc) {
    for (int64_t j0 = 0; j0 < T; j0 += 256) {
        const int64_t j1 = j0 + 256 < T ? j0 + 256 : T;
        for (int64_t c = 0; c < D; c += 16) {
            v16f a[16];
            for (int r = 0; r < 16; r++) a[r] = load16(acc + r * D + c);
            for (int64_t j = j0; j < j1; j++) {
                const v16f vv = load16(v + j * D + c);
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) a[r] += p[r * LS + j] * vv;
            }
            for (int r = 0; r < 16; r++) store16(acc + r * D + c, a[r]);
        }
    }
}

/* Attention of n queries over nc context keys they all see and over their own n keys, causally (query t sees
   context keys 0..nc-1 and its own keys 0..t; D % 16 == 0), with a statistic of the probabilities:
   q [B, H, G, n, D] (the G query heads of KV head h), ck, cv [B, H, nc, D], k, v [B, H, n, D];
   out [B, H, G, n, D] (NULL: not computed). The statistic, into stat:
   - hi <= lo: the attention each key receives, summed over the queries and the query group (H2O's),
     [B, H, nc + n] (context keys, then own keys);
   - hi > lo: KVzip's reconstruction score of context keys lo..hi-1, [B, H, hi - lo]: the largest, over the
     queries and the group, of a key's probability renormalised over context keys 0..protect-1, lo..hi-1 and
     the own keys.
   Scratch: keys_t [B, H, KB, D, 16] (the context keys, then the own ones, in transposed blocks of 16 each side,
   KB = ceil(nc / 16) + ceil(n / 16)), work [threads, 32 * D + 16 * LS] (LS = 16 * KB + 16: a padded stride, so
   16 rows do not share cache sets) and slots: [B * H * G, W, LS] for the sums, [threads, B, H, hi - lo] for the
   maxima. A work item is 16 queries of one head: their logits against every key block they see, kept in `work`
   (no n x n matrix), a softmax, the statistic and the value sums. Sums go in waves of W query blocks (the last
   ones first: the longest rows), each wave's slots added in a fixed order; maxima do not depend on an order: the
   result is the same for any threads or B. */
void prompt_attention_f32(const float* q, const float* ck, const float* cv, const float* k, const float* v,
                          float* out, float* stat, float* keys_t, float* slots, float* work, int64_t B, int64_t H,
                          int64_t G, int64_t nc, int64_t n, int64_t D, int64_t W, float scaling, int64_t protect,
                          int64_t lo, int64_t hi, int threads) {
    const int64_t NC = (nc + 15) / 16, NB = (n + 15) / 16, KB = NC + NB, C0 = 16 * NC;
    const int64_t LS = 16 * KB + 16, BH = B * H, BHG = BH * G, S = hi > lo ? hi - lo : 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < BH; bh++)
            for (int64_t jb = 0; jb < KB; jb++) {
                float* kt = keys_t + (bh * KB + jb) * D * 16;
                const int own = jb >= NC;
                const int64_t len = own ? n : nc;
                const float* src = own ? k + bh * n * D : ck + bh * nc * D;
                for (int i = 0; i < 16; i++) {
                    const int64_t j = (own ? jb - NC : jb) * 16 + i;
                    for (int64_t d = 0; d < D; d++) kt[d * 16 + i] = j < len ? src[j * D + d] : 0.0f;
                }
            }
        const int tid = omp_get_thread_num();
        float* qt = work + tid * (32 * D + 16 * LS);
        float* acc = qt + 16 * D;
        float* lg = acc + 16 * D;
        float* best = slots + tid * BH * S;
        if (S) {
            memset(best, 0, sizeof(float) * BH * S);
        } else {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < BH * (nc + n); i++) stat[i] = 0.0f;
        }
        const int64_t step = S ? NB : W;  /* maxima: one wave */
        for (int64_t top = NB; top > 0; top -= step) {
            const int64_t bottom = top > step ? top - step : 0;
            #pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < BHG * (top - bottom); it++) {
                const int64_t tile = top - 1 - it / BHG, bhg = it % BHG, bh = bhg / G;
                const int64_t t0 = tile * 16, R = n - t0 < 16 ? n - t0 : 16, T = C0 + 16 * (tile + 1);
                const float* qr = q + (bhg * n + t0) * D;
                for (int r = 0; r < 16; r++)  /* the scale folded into the queries; rows past n zero */
                    for (int64_t d = 0; d < D; d++) qt[r * D + d] = r < R ? qr[r * D + d] * scaling : 0.0f;
                for (int64_t jb = 0; jb < NC + tile + 1; jb++)
                    tile_qk(qt, keys_t + (bh * KB + jb) * D * 16, D, lg + jb * 16, LS);
                float inv[16], part[16];
                for (int r = 0; r < 16; r++) {
                    float* row = lg + r * LS;
                    for (int64_t j = nc; j < C0; j++) row[j] = -INFINITY;  /* the context's padding */
                    for (int i = r + 1; i < 16; i++) row[C0 + t0 + i] = -INFINITY;  /* keys after the query */
                    v16f m = load16(row);
                    for (int64_t j = 16; j < T; j += 16) m = max16(load16(row + j), m);
                    float mx = m[0];
                    for (int i = 1; i < 16; i++) mx = m[i] > mx ? m[i] : mx;
                    v16f sum = {0};
                    for (int64_t j = 0; j < T; j += 16) {
                        const v16f e = exp16(load16(row + j) - mx);
                        store16(row + j, e);
                        sum += e;
                    }
                    const float total = hsum16(sum);
                    inv[r] = r < R ? 1.0f / total : 0.0f;
                    if (S && r < R) {  /* the renormalising sum: protected keys, the scored ones, the own keys */
                        float kept = 0.0f;
                        for (int64_t j = 0; j < protect && j < nc; j++) kept += row[j];
                        for (int64_t j = lo; j < hi; j++) kept += row[j];
                        v16f ownsum = {0};
                        for (int64_t j = C0; j < T; j += 16) ownsum += load16(row + j);
                        part[r] = 1.0f / (kept + hsum16(ownsum));
                    }
                }
                if (S) {
                    float* mine = best + bh * S;
                    for (int r = 0; r < R; r++) {
                        const float* row = lg + r * LS + lo;
                        const float w = part[r];
                        int64_t j = 0;
                        for (; j + 16 <= S; j += 16) store16(mine + j, max16(load16(row + j) * w, load16(mine + j)));
                        for (; j < S; j++) mine[j] = row[j] * w > mine[j] ? row[j] * w : mine[j];
                    }
                } else {
                    float* col = slots + (bhg * W + tile - bottom) * LS;
                    for (int64_t j = 0; j < T; j += 16) {
                        v16f c = {0};
                        for (int r = 0; r < 16; r++) c += load16(lg + r * LS + j) * inv[r];
                        store16(col + j, c);
                    }
                }
                if (out) {
                    memset(acc, 0, sizeof(float) * 16 * D);
                    if (nc) tile_values(lg, LS, cv + bh * nc * D, D, nc, acc);
                    tile_values(lg + C0, LS, v + bh * n * D, D, t0 + R, acc);
                    float* o = out + (bhg * n + t0) * D;
                    for (int r = 0; r < R; r++)
                        for (int64_t c = 0; c < D; c += 16) store16(o + r * D + c, load16(acc + r * D + c) * inv[r]);
                }
            }
            if (S) continue;
            const int64_t reach = nc + (top * 16 < n ? top * 16 : n);  /* the keys this wave's queries see */
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < BH * reach; i++) {
                const int64_t bh = i / reach, j = i % reach;
                const int64_t c = j < nc ? j : C0 + j - nc, first = j < nc ? bottom : (j - nc) / 16;
                float sum = 0.0f;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t tile = first > bottom ? first : bottom; tile < top; tile++)
                        sum += slots[((bh * G + g) * W + tile - bottom) * LS + c];
                stat[bh * (nc + n) + j] += sum;
            }
        }
        if (S) {
            #pragma omp barrier
            const int team = omp_get_num_threads();
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < BH * S; i++) {
                float m = slots[i];
                for (int t = 1; t < team; t++) m = slots[t * BH * S + i] > m ? slots[t * BH * S + i] : m;
                stat[i] = m;
            }
        }
    }
}

/* CriticalKV's projected value norms: out[bh, t] = sum_o |sum_d v[bh, t, d] * w[h, d, o]| / G over the
   O = G * hidden outputs of KV head h's query group (O % 16 == 0): v [BH, L, D], w [H, D, O], out [BH, L].
   Sixteen tokens times sixteen outputs at a time, one register per token, the absolute values summed as they
   come (the [L, O] product is never in memory). */
void projected_norms_f32(const float* v, const float* w, float* out, int64_t B, int64_t H, int64_t L, int64_t D,
                         int64_t O, int64_t G, int threads) {
    const int64_t T = (L + 15) / 16;
    #pragma omp parallel num_threads(threads)
    {
        float* vt = malloc(sizeof(float) * 16 * D);
        #pragma omp for collapse(2) schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++)
            for (int64_t tile = 0; tile < T; tile++) {
                const int64_t t0 = tile * 16, R = L - t0 < 16 ? L - t0 : 16;
                const float* wh = w + (bh % H) * D * O;
                for (int r = 0; r < 16; r++)
                    for (int64_t d = 0; d < D; d++) vt[r * D + d] = r < R ? v[(bh * L + t0 + r) * D + d] : 0.0f;
                v16f sums[16];
                for (int r = 0; r < 16; r++) sums[r] = (v16f){0};
                for (int64_t o = 0; o < O; o += 16) {
                    v16f a[16];
                    for (int r = 0; r < 16; r++) a[r] = (v16f){0};
                    for (int64_t d = 0; d < D; d++) {
                        const v16f wv = load16(wh + d * O + o);
#pragma GCC unroll 16
                        for (int r = 0; r < 16; r++) a[r] += vt[r * D + d] * wv;
                    }
                    for (int r = 0; r < 16; r++) sums[r] += (v16f)((v16i)a[r] & 0x7fffffff);
                }
                const v16f total = hsum16x16(sums) * (1.0f / (float)G);
                for (int r = 0; r < R; r++) out[bh * L + t0 + r] = total[r];
            }
        free(vt);
    }
}

/* Quest's page bound maximized over each KV head's query group: out[bh, p] = max over g of
   sum_d max(q[bh, g, d] * hi[bh, p, d], q[bh, g, d] * lo[bh, p, d]); q [BH, G, D], hi and lo [BH, P, D]. */
void page_scores_f32(const float* q, const float* hi, const float* lo, float* out, int64_t BH, int64_t G,
                     int64_t P, int64_t D, int threads) {
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < BH; bh++) {
        for (int64_t p = 0; p < P; p++) {
            const float* h = hi + (bh * P + p) * D;
            const float* l = lo + (bh * P + p) * D;
            float best = -INFINITY;
            for (int64_t g = 0; g < G; g++) {
                const float* qg = q + (bh * G + g) * D;
                float s = 0.0f;
                for (int64_t d = 0; d < D; d++) {
                    const float a = qg[d] * h[d], b = qg[d] * l[d];
                    s += a > b ? a : b;
                }
                best = s > best ? s : best;
            }
            out[bh * P + p] = best;
        }
    }
}

/* The check of a speculative prefetch (FreeKV, SpeCache), for each of BH KV heads: cos[bh], the mean over its G
   query rows of the cosine between q and prev (D floats each, in double: x.y / (max(|x|, eps) max(|y|, eps)));
   held[bh, i], whether units[bh, i] (< 0: never) is one of spec[bh, :k2] (< 0: none): a merge when both rows
   ascend, else every pair; recall[bh], the share of the k units held (1 when k == 0). */
void speculation_check_f32(const float* q, const float* prev, const int64_t* units, const int64_t* spec,
                           int64_t BH, int64_t G, int64_t D, int64_t k, int64_t k2, float* cos, uint8_t* held,
                           float* recall) {
    for (int64_t bh = 0; bh < BH; bh++) {
        double total = 0.0;
        for (int64_t g = 0; g < G; g++) {
            const float* x = q + (bh * G + g) * D;
            const float* y = prev + (bh * G + g) * D;
            double xy = 0.0, xx = 0.0, yy = 0.0;
            for (int64_t d = 0; d < D; d++) {
                xy += (double)x[d] * y[d];
                xx += (double)x[d] * x[d];
                yy += (double)y[d] * y[d];
            }
            total += xy / (fmax(sqrt(xx), 1e-8) * fmax(sqrt(yy), 1e-8));
        }
        cos[bh] = (float)(total / (double)G);
        const int64_t* u = units + bh * k;
        const int64_t* s = spec + bh * k2;
        uint8_t* h = held + bh * k;
        int ascending = 1;
        for (int64_t i = 1; i < k && ascending; i++) ascending = u[i] > u[i - 1];
        for (int64_t j = 1; j < k2 && ascending; j++) ascending = s[j] > s[j - 1];
        int64_t hits = 0;
        for (int64_t i = 0, j = 0; i < k; i++) {
            h[i] = 0;
            if (u[i] < 0) continue;
            if (ascending) {
                while (j < k2 && s[j] < u[i]) j++;
                h[i] = j < k2 && s[j] == u[i];
            } else {
                for (int64_t m = 0; m < k2 && !h[i]; m++) h[i] = s[m] == u[i];
            }
            hits += h[i];
        }
        recall[bh] = k ? (float)hits / (float)k : 1.0f;
    }
}

/* One token out of every (row b, KV head h) of an unpadded store of L slots, in place: the slot with the lowest
   score (scores at b * sb + h * sh, slot after slot; NaN ranks above every number, as top-k ranks it; ties:
   the lowest position, positions at b * pb + h * ph) takes the last slot's token in each of the n per-slot
   tensors, tensor i at bases[i] with byte strides layout[4 i .. 4 i + 2] (row, head, slot) and
   layout[4 i + 3] bytes per slot. drop [B, H] receives the evicted slots. */
void evict_lowest_f32(const float* scores, int64_t sb, int64_t sh, const int32_t* pos, int64_t pb, int64_t ph,
                      int64_t B, int64_t H, int64_t L, int64_t n, char* const* bases, const int64_t* layout,
                      int64_t* drop) {
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float* s = scores + b * sb + h * sh;
            const int32_t* p = pos + b * pb + h * ph;
            int64_t low = 0;
            float best = isnan(s[0]) ? INFINITY : s[0];
            for (int64_t t = 1; t < L; t++) {
                const float x = isnan(s[t]) ? INFINITY : s[t];
                if (x < best || (x == best && p[t] < p[low])) { best = x; low = t; }
            }
            drop[b * H + h] = low;
            for (int64_t i = 0; i < n; i++) {
                const int64_t* f = layout + 4 * i;
                char* row = bases[i] + b * f[0] + h * f[1];
                if (low != L - 1) memcpy(row + low * f[2], row + (L - 1) * f[2], (size_t)f[3]);
            }
        }
    }
}

/* Rows `flat` (n of them, `row` bytes each; row r at byte offset r * row of the file `fd`) into rows `pos` of
   out, through the page cache without mapping the file. Rows of ascending indices at most `gap` bytes apart
   whose span fits `bounce` (`size` bytes) are one pread into it, then copied out (one read of a few large spans
   costs less than many small ones, or one preadv of many pieces); consecutive rows going to consecutive places
   are read into out directly. Returns 0, -errno of a failed read, or -EIO for a short one. */
static int64_t pread_rows(int fd, const int64_t* flat, const int64_t* pos, int64_t n, int64_t row, char* out,
                          char* bounce, int64_t size, int64_t gap) {
    int64_t i = 0;
    while (i < n) {
        int64_t j = i;
        while (j + 1 < n && flat[j + 1] > flat[j] && (flat[j + 1] - flat[j] - 1) * row <= gap
               && (flat[j + 1] - flat[i] + 1) * row <= size)
            j++;
        const int64_t want = (flat[j] - flat[i] + 1) * row;
        const int direct = flat[j] - flat[i] == j - i && pos[j] - pos[i] == j - i;
        char* dst = direct ? out + pos[i] * row : bounce;
        int64_t done = 0;
        while (done < want) {
            const ssize_t got = pread(fd, dst + done, (size_t)(want - done), (off_t)(flat[i] * row + done));
            if (got < 0 && errno == EINTR) continue;
            if (got < 0) return -errno;
            if (got == 0) return -EIO;
            done += got;
        }
        if (!direct)
            for (int64_t r = i; r <= j; r++)
                memcpy(out + pos[r] * row, bounce + (flat[r] - flat[i]) * row, (size_t)row);
        i = j + 1;
    }
    return 0;
}

/* The tiers' blocked storage (kvcomp.tiers): token t of head j (of bh) is row ((t / block) * bh + j) * block
   + t % block, `row` bytes (the token's K and V). */
static inline int64_t token_row(int64_t t, int64_t j, int64_t bh, int64_t block) {
    return ((t / block) * bh + j) * block + t % block;
}

/* Tokens `index` ([bh, k], long; < 0: nothing, a zero row) of the blocked storage into out ([bh, k] rows), read
   from the file `fd` (pread_rows, `flat` and `pos` scratch of bh * k) or, with fd < 0, copied from `base`.
   Returns the rows read, -ERANGE for an index at or past `length` (nothing is read then), or pread_rows' error. */
int64_t gather_tokens(int fd, const char* base, const int64_t* index, int64_t bh, int64_t k, int64_t length,
                      int64_t block, int64_t row, char* out, int64_t* flat, int64_t* pos, char* bounce,
                      int64_t size, int64_t gap) {
    for (int64_t i = 0; i < bh * k; i++)
        if (index[i] >= length) return -ERANGE;
    int64_t n = 0;
    for (int64_t j = 0; j < bh; j++)
        for (int64_t i = 0; i < k; i++) {
            const int64_t t = index[j * k + i], at = j * k + i;
            if (t < 0) {
                memset(out + at * row, 0, (size_t)row);
                continue;
            }
            flat[n] = token_row(t, j, bh, block);
            pos[n++] = at;
        }
    if (fd < 0) {
        for (int64_t r = 0; r < n; r++) memcpy(out + pos[r] * row, base + flat[r] * row, (size_t)row);
        return n;
    }
    const int64_t rc = pread_rows(fd, flat, pos, n, row, out, bounce, size, gap);
    return rc < 0 ? rc : n;
}

/* Tokens [start, start + n) of each of the bh heads into the blocked storage in the file `fd`: a token's row is
   its key then its value (`half` bytes each, the keys at k and the values at v, [bh, n] of them each), one
   pwritev per head and block (nothing mapped into this process). Returns 0 or -errno of a failed write (-EIO
   for one that wrote nothing). */
int64_t pwrite_tokens(int fd, const char* k, const char* v, int64_t bh, int64_t n, int64_t start, int64_t block,
                      int64_t half) {
    struct iovec iov[2 * 64];
    for (int64_t j = 0; j < bh; j++)
        for (int64_t i = 0; i < n;) {
            int64_t take = block - (start + i) % block < n - i ? block - (start + i) % block : n - i;
            if (take > 64) take = 64;
            for (int64_t r = 0; r < take; r++) {
                iov[2 * r].iov_base = (void*)(k + (j * n + i + r) * half);
                iov[2 * r + 1].iov_base = (void*)(v + (j * n + i + r) * half);
                iov[2 * r].iov_len = iov[2 * r + 1].iov_len = (size_t)half;
            }
            int64_t at = token_row(start + i, j, bh, block) * 2 * half, left = 2 * take * half;
            struct iovec* next = iov;
            int count = (int)(2 * take);
            while (left > 0) {
                const ssize_t put = pwritev(fd, next, count, (off_t)at);
                if (put < 0 && errno == EINTR) continue;
                if (put < 0) return -errno;
                if (put == 0) return -EIO;
                at += put;
                left -= put;
                for (ssize_t done = put; done > 0 && count > 0;) {  /* past what was written */
                    if ((size_t)done >= next->iov_len) {
                        done -= (ssize_t)next->iov_len;
                        next++;
                        count--;
                    } else {
                        next->iov_base = (char*)next->iov_base + done;
                        next->iov_len -= (size_t)done;
                        done = 0;
                    }
                }
            }
            i += take;
        }
    return 0;
}

/* A float's bits as an unsigned key in the float order (NaN above +inf, as torch.topk ranks it). */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The bin of `remaining` counted from the top of hist[0..n) (summed over its four interleaved copies), and
   `remaining` reduced by the counts of the bins above it. */
static inline int64_t top_bin(const int32_t (*hist)[2048], int64_t n, int64_t* remaining) {
    int64_t b = n - 1;
    for (; b > 0; b--) {
        const int64_t count = (int64_t)hist[0][b] + hist[1][b] + hist[2][b] + hist[3][b];
        if (count >= *remaining) break;
        *remaining -= count;
    }
    return b;
}

/* For each of R rows of L scores: the indices of its k largest, in ascending index order (ties at the k-th
   value: the lowest indices). A radix select finds the k-th largest key: its top 11 bits over the row (four
   interleaved histograms, so equal bins do not chain increments), the next 11 and the last 10 over the few keys
   sharing those top bits; then one pass writes the indices above it and the first ones equal to it, so no
   sort is needed. 1 <= k <= L; work [R, L]. */
void top_ascending_f32(const float* scores, int64_t* out, uint32_t* work, int64_t R, int64_t L, int64_t k,
                       int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < R; r++) {
        const float* row = scores + r * L;
        uint32_t* keys = work + r * L;
        int32_t hist[4][2048];
        memset(hist, 0, sizeof hist);
        int64_t i = 0;
        for (; i + 4 <= L; i += 4)
            for (int u = 0; u < 4; u++) {
                keys[i + u] = order_key(row[i + u]);
                hist[u][keys[i + u] >> 21]++;
            }
        for (; i < L; i++) {
            keys[i] = order_key(row[i]);
            hist[0][keys[i] >> 21]++;
        }
        int64_t remaining = k;  /* how many of the keys sharing the prefix found so far are still to take */
        const uint32_t top = (uint32_t)top_bin(hist, 2048, &remaining);
        /* The keys sharing the top bits, compacted to the front of this row's work (read before written). */
        int64_t n = 0;
        for (i = 0; i < L; i++)
            if (keys[i] >> 21 == top) keys[n++] = keys[i];
        memset(hist, 0, sizeof hist);
        for (i = 0; i < n; i++) hist[i & 3][(keys[i] >> 10) & 2047]++;
        const uint32_t mid = (uint32_t)top_bin(hist, 2048, &remaining);
        memset(hist, 0, sizeof hist);
        for (i = 0; i < n; i++)
            if (((keys[i] >> 10) & 2047) == mid) hist[i & 3][keys[i] & 1023]++;
        const uint32_t kth = top << 21 | mid << 10 | (uint32_t)top_bin(hist, 1024, &remaining);
        int64_t* o = out + r * k;
        int64_t m = 0;
        for (i = 0; i < L; i++) {
            const uint32_t key = order_key(row[i]);
            if (key > kth || (key == kth && remaining-- > 0)) o[m++] = i;
        }
    }
}
"""

# Reductions vectorise with reassociation; -ffinite-math-only (part of -ffast-math) would break -inf masking.
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math"]
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def enabled() -> bool:
    return os.environ.get("KVCOMP_NATIVE", "1") != "0"


def _build_dir() -> Path:
    return cache_dir() / "kernels"


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None (with one warning) when it cannot be built."""
    global _lib
    if _lib is None:
        _lib = _compile() or False
    return _lib or None


def library_path() -> Path:
    """Where the compiled kernel is cached (named by a digest of the source, flags, compiler and platform)."""
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS) + compiler + sys.platform).encode()).hexdigest()[:16]
    return _build_dir() / f"quant_attention_{digest}.so"


def untrusted(path: Path) -> str | None:
    """Why ``path`` must not be loaded or built into (None: owned by this user, writable by no one else)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _build(compiler: str, target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "quant_attention.c"
        src.write_text(SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(src), "-o", str(built), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.chmod(built, 0o755)  # whatever the umask: a cached library must not be writable by others
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file


def _compile() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    target = library_path()
    private = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        problem = untrusted(target.parent)
        if problem and problem.startswith("is writable"):  # our own directory: make it private (its files are
            os.chmod(target.parent, 0o700)  # still checked one by one below)
            warnings.warn(f"kvcomp: the kernel cache {target.parent} {problem}; made it private (mode 700).",
                          stacklevel=3)
            problem = None
        if problem:
            warnings.warn(f"kvcomp: the kernel cache {target.parent} {problem}; building the native kernel in a "
                          "private temporary directory instead (not cached).", stacklevel=3)
            private = tempfile.mkdtemp(prefix="kvcomp-kernel-")
            target = Path(private) / target.name
        elif os.path.lexists(target) and (problem := untrusted(target)):
            warnings.warn(f"kvcomp: not loading the cached native kernel {target}: it {problem}. Rebuilding it.",
                          stacklevel=3)
            os.remove(target)
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        warnings.warn(f"kvcomp: the native CPU kernel is unavailable ({err} {detail.decode()[:300]}); "
                      "using the torch implementation.", stacklevel=3)
        return None
    finally:
        if private is not None:  # a loaded library stays mapped
            shutil.rmtree(private, ignore_errors=True)
    fn = lib.quant_attention_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 16 + [ctypes.c_int64] * 11 + [ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                                                    ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                                                    ctypes.c_void_p] + _RESIDUAL_HEAD_ARGS
    fn = lib.quant_key_logits_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
    fn = lib.top_ascending_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn = lib.decode_attention_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10 + [ctypes.c_float] * 2 + [ctypes.c_void_p,
                                                                                          ctypes.c_int]
    fn = lib.prompt_attention_f32
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p] * 10 + [ctypes.c_int64] * 7 + [ctypes.c_float] + [ctypes.c_int64] * 3
                   + [ctypes.c_int])
    fn = lib.projected_norms_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_int]
    fn = lib.gather_tokens
    fn.restype = ctypes.c_int64
    fn.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 4
                   + [ctypes.c_int64] * 2)
    fn = lib.pwrite_tokens
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5
    fn = lib.page_scores_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    fn = lib.speculation_check_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 3
    fn = lib.evict_lowest_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [
        ctypes.c_void_p] * 3
    fn = lib.linear_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    fn = lib.kvtc_attention_f32
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p] * 21 + [ctypes.c_int64] * 13 + [ctypes.c_float, ctypes.c_int, ctypes.c_int64,
                                                                      ctypes.c_float] + [ctypes.c_void_p] * 5
                   + _RESIDUAL_HEAD_ARGS)
    lib.kvtc_int_keys.restype = ctypes.c_int
    lib.kvtc_int_keys.argtypes = []
    return lib


_RESIDUAL_HEAD_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_int64]  # the sinks' keys, values, positions and count


def _head_args(head: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, b: int, h: int, d: int) -> list:
    """The trailing arguments of quant_attention_f32 / kvtc_attention_f32 for the residual's first segment
    (``residual_t`` in the C source: the attention sinks, ``[B, H_kv, R0, D]`` keys and values and ``[B, H_kv,
    R0]`` positions, read in place of being concatenated with the window), or none. Returns the pointers and
    R0 followed by the contiguous tensors, which the caller holds until the call returns."""
    if head is None or head[2].shape[-1] == 0:
        return [None, None, None, 0]
    keys, values, positions = head
    r0 = positions.shape[-1]
    if keys.shape != (b, h, r0, d) or values.shape != keys.shape:
        raise ValueError(f"head keys and values must be [{b}, {h}, R0, {d}] with positions [{b}, {h}, R0]; got "
                         f"{tuple(keys.shape)}, {tuple(values.shape)} and {tuple(positions.shape)}.")
    held = [keys.contiguous(), values.contiguous(), positions.to(torch.int32).contiguous()]
    return [t.data_ptr() for t in held] + [r0] + held


def supports(q: torch.Tensor, value_scale: torch.Tensor, bits: int, *tensors: torch.Tensor) -> bool:
    """Whether :func:`quant_attention` runs these inputs: float32 CPU tensors, and value channel groups made of
    whole bit planes (``(D / J) % (8 / bits) == 0``)."""
    d, per_byte = q.shape[-1], 8 // bits
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32
            and all(t.dtype == torch.float32 for t in (value_scale, *tensors))
            and d % value_scale.shape[-1] == 0 and (d // value_scale.shape[-1]) % per_byte == 0
            and load() is not None)


def quant_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    positions: torch.Tensor,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    residual_positions: torch.Tensor,
    bits: int,
    scaling: float,
    block_tokens: int = 1024,
    sentinel: int = 2**30,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_logits: torch.Tensor | None = None,
    head: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """See :func:`kvcomp.kernels.quant_ref.quant_attention` (float32 CPU tensors; ``block_tokens`` unused:
    the kernel holds one token's codes at a time). ``key_logits``: the quantized keys' scaled logits
    ``[B, H_kv, G * n, N * G]`` when the caller computed them already (:func:`quant_key_logits`, as a retrieval
    method does to score its tokens); the kernel then masks and reuses them instead of reading the key codes.
    ``head``: full-precision tokens attended before the residual ones (keys, values, positions: the attention
    sinks), read where they are instead of concatenated with the window at every step."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use kvcomp.kernels.quant_cpu.quant_attention")
    b, hq, n, d = q.shape
    h, n_groups, group = positions.shape[1], positions.shape[2], positions.shape[3]
    r = residual_positions.shape[-1]
    rows = hq // h * n
    length = n_groups * group
    tensors = [
        q.reshape(b, h, rows, d).contiguous(), q_pos.to(torch.int64).contiguous(),
        key_codes.contiguous(), key_scale.contiguous(), key_zero.contiguous(),
        value_codes.contiguous(), value_scale.contiguous(), value_zero.contiguous(),
        positions.to(torch.int32).contiguous(),
        residual_keys.contiguous(), residual_values.contiguous(), residual_positions.to(torch.int32).contiguous(),
    ]
    sinks = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    threads = max(1, torch.get_num_threads())
    chunks = _chunks(n_groups, b * h, threads)
    if key_logits is not None:
        if key_logits.shape != (b, h, rows, length) or key_logits.dtype != torch.float32:
            raise ValueError(f"key_logits must be float32 {(b, h, rows, length)}; got {key_logits.dtype} "
                             f"{tuple(key_logits.shape)}.")
        key_logits = key_logits.contiguous()
    first = _head_args(head, b, h, d)
    out = torch.empty(b, h, rows, d, dtype=torch.float32)
    logits = torch.empty(b * h, rows, length + first[3] + r, dtype=torch.float32)
    work = torch.empty(b * h * chunks, rows * d + 2 * d + group * d, dtype=torch.float32)
    partial = torch.empty(b * h * chunks, rows, d, dtype=torch.float32)
    lib.quant_attention_f32(
        *[t.data_ptr() for t in tensors], out.data_ptr(), logits.data_ptr(), work.data_ptr(), partial.data_ptr(),
        b, h, rows, n, length, group, r, d, value_scale.shape[-1], key_codes.shape[-1], chunks, bits,
        float(scaling), threads, int(window or 0), float(softcap or 0.0), None if sinks is None else sinks.data_ptr(),
        None if key_logits is None else key_logits.data_ptr(), *first[:4],
    )
    return out.reshape(b, hq, n, d)


def _chunks(n_groups: int, rows_and_heads: int, threads: int) -> int:
    """Split each (row, KV head)'s groups over the threads when there are fewer such pairs than threads."""
    return max(1, min(n_groups, -(-2 * threads // rows_and_heads))) if threads > 1 else 1


def supports_logits(q: torch.Tensor, key_scale: torch.Tensor) -> bool:
    """Whether :func:`quant_key_logits` runs these inputs (float32 CPU tensors, the kernel built)."""
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32 and key_scale.dtype == torch.float32
            and load() is not None)


def quant_key_logits(q: torch.Tensor, key_codes: torch.Tensor, key_scale: torch.Tensor, key_zero: torch.Tensor,
                     bits: int, scaling: float) -> torch.Tensor:
    """Scaled logits ``scaling * q . k_hat`` of every quantized key, unmasked, read once from the packed codes.

    q: ``[B, H_q, n, D]``; key_codes ``[B, H_kv, N, G, D * bits / 8]``, key_scale / key_zero ``[B, H_kv, N, D]``
    (:func:`kvcomp.kernels.quant_ref.quantize_keys`). Returns ``[B, H_kv, H_q / H_kv * n, N * G]`` float32: row
    ``m`` is query ``m % n`` of query head ``m // n`` of the KV head's group.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use kvcomp.kernels.retrieval_ref")
    b, hq, n, d = q.shape
    h, n_groups, group = key_codes.shape[1], key_codes.shape[2], key_codes.shape[3]
    rows, length = hq // h * n, n_groups * group
    threads = max(1, torch.get_num_threads())
    chunks = _chunks(n_groups, b * h, threads)
    qc = q.reshape(b, h, rows, d).contiguous()
    codes, scale, zero = key_codes.contiguous(), key_scale.contiguous(), key_zero.contiguous()
    out = torch.empty(b, h, rows, length, dtype=torch.float32)
    work = torch.empty(b * h * chunks, rows * d + d, dtype=torch.float32)
    lib.quant_key_logits_f32(qc.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(),
                             work.data_ptr(), b, h, rows, length, group, d, key_codes.shape[-1], chunks, bits,
                             float(scaling), threads)
    return out


_LIVE_DIGITS: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _digits(base: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[256 * k]``: the ``k`` base-``base`` digits of every byte, lowest first (KVTC's live packing)."""
    if (base, dtype) not in _LIVE_DIGITS:
        byte = torch.arange(256)
        _LIVE_DIGITS[base, dtype] = torch.stack([(byte // base**i) % base for i in range(k)], 1).to(dtype).reshape(-1)
    return _LIVE_DIGITS[base, dtype]


def int_keys() -> bool:
    """Whether :func:`kvtc_attention` rebuilds keys in integers when given ``int_keys`` (AVX-512 VNNI)."""
    lib = load() if enabled() else None
    return bool(lib is not None and lib.kvtc_int_keys())


def supports_kvtc(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether :func:`kvtc_attention` runs these inputs (float32 CPU tensors, the kernel built)."""
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and load() is not None)


def kvtc_attention(q: torch.Tensor, q_pos: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                   positions: torch.Tensor, counts: torch.Tensor, key_weight: torch.Tensor, key_offset: torch.Tensor,
                   value_weight: torch.Tensor, value_offset: torch.Tensor, cos: torch.Tensor | None,
                   sin: torch.Tensor | None, residual_keys: torch.Tensor, residual_values: torch.Tensor,
                   residual_positions: torch.Tensor,
                   scaling: float, window: int | None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None,
                   int_keys: tuple[torch.Tensor, torch.Tensor] | None = None,
                   head: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, H_q, n, D]`` (positions ``q_pos`` ``[B, n]``) over KVTC's live codes and
    its full-precision tokens, read once from the packed codes (:mod:`compressors.kvtc`).

    key_codes ``[B, H_kv, L, W_k]``, value_codes ``[B, H_kv, L, W_v]`` uint8 and positions ``[B, H_kv, L]``
    (``>= len(cos)``: no token); counts ``[H_kv, 2, 3]`` components stored at 2, 4 and 8 bits per KV head for keys
    and values (coding order); a key is ``rotate(codes @ key_weight[h] + key_offset[h])`` (``[H_kv, S, D]``,
    ``[H_kv, D]``; cos, sin ``[P, RD / 2]`` by position, the first half of rotate-half's table (its halves are
    equal; :meth:`compressors.kvtc.KVTC.rope_half_table`); None for keys coded after RoPE: a key is then
    ``codes @ key_weight[h] + key_offset[h]`` and each query is projected on it once instead of rebuilding the
    keys), a value ``codes @ value_weight[h] + value_offset[h]``.
    residual_*: the full-precision tokens ``[B, H_kv, R, D]``, positions ``[B, H_kv, R]``; ``head`` (keys,
    values, positions) more of them attended first, read in place (the sinks; :func:`quant_attention`). The
    layer's window,
    soft-cap and sink logits ``[H_q]`` as in :func:`quant_attention`. ``int_keys``: ``(pairs, scale)`` from
    :func:`kvcomp.transform_coding.int16_grid` of ``key_weight`` (which must then lie on that grid): keys rebuilt
    in int32 sums where :func:`int_keys` (rotated keys only). Returns ``[B, H_q, n, D]`` float32."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use KVTC's torch path")
    b, hq, n, d = q.shape
    h, length, r = positions.shape[1], positions.shape[2], residual_positions.shape[-1]
    rows, s = hq // h * n, key_weight.shape[1]
    if value_weight.shape[1] != s:
        raise ValueError(f"key and value weights must share S; got {s} and {value_weight.shape[1]}.")
    threads = max(1, torch.get_num_threads())
    chunks = max(1, min(-(-length // 64), -(-2 * threads // (b * h)))) if threads > 1 and length else 1
    qk, padded = None, -(-s // 16) * 16  # the kernel runs over components in whole vectors of 16
    if cos is None:  # post-RoPE keys: each chunk projects its query rows on the key components (scratch here)
        qk = torch.empty(b * h * chunks, rows, padded + 1, dtype=torch.float32)
        cos = sin = key_offset.new_zeros(1, 0)
    tensors = [q.reshape(b, h, rows, d).contiguous(), q_pos.to(torch.int64).contiguous(), key_codes.contiguous(),
               value_codes.contiguous(), positions.to(torch.int32).contiguous(), counts.to(torch.int64).contiguous(),
               key_weight.contiguous(), key_offset.contiguous(), value_weight.contiguous(), value_offset.contiguous(),
               cos.contiguous(), sin.contiguous(), _digits(3, 5), _digits(15, 2), residual_keys.contiguous(),
               residual_values.contiguous(), residual_positions.to(torch.int32).contiguous()]
    sinks = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    if int_keys is not None:
        pairs, key_scale = int_keys
        if pairs.shape != (h, -(-s // 2), d, 2) or pairs.dtype != torch.int16 or key_scale.shape != (h, d):
            raise ValueError(f"int_keys must be int16 pairs [{h}, {-(-s // 2)}, {d}, 2] and scales [{h}, {d}] "
                             f"(kvcomp.transform_coding.int16_grid of key_weight); got {tuple(pairs.shape)} "
                             f"{pairs.dtype} and {tuple(key_scale.shape)}.")
        tensors += [pairs.contiguous(), key_scale.to(torch.float32).contiguous(), _digits(3, 5, torch.int16)]
    first = _head_args(head, b, h, d)
    out = torch.empty(b, h, rows, d, dtype=torch.float32)
    logits = torch.empty(b * h, rows, length + first[3] + r, dtype=torch.float32)
    work = torch.empty(b * h * chunks, 16 * padded + 32 * d, dtype=torch.float32)
    partial = torch.empty(b * h * chunks, rows, padded + 1, dtype=torch.float32)
    lib.kvtc_attention_f32(
        *[t.data_ptr() for t in tensors[:17]], out.data_ptr(), logits.data_ptr(), work.data_ptr(),
        partial.data_ptr(), b, h, rows, n, length, r, d, s, 2 * cos.shape[-1], cos.shape[0], key_codes.shape[-1],
        value_codes.shape[-1], chunks, float(scaling), threads, int(window or 0), float(softcap or 0.0),
        None if sinks is None else sinks.data_ptr(), None if qk is None else qk.data_ptr(),
        *([t.data_ptr() for t in tensors[17:]] if int_keys is not None and qk is None else [None] * 3), *first[:4],
    )
    return out.reshape(b, hq, n, d)


def supports_pages(q: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor, reduce: str) -> bool:
    """Whether :func:`page_scores` runs these inputs: float32 CPU tensors, the maximum over the query group."""
    return (enabled() and reduce == "max" and q.device.type == "cpu"
            and all(t.dtype == torch.float32 for t in (q, page_max, page_min)) and load() is not None)


def page_scores(q: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor, reduce: str = "max") -> torch.Tensor:
    """:func:`kvcomp.kernels.retrieval_ref.page_scores` with ``reduce="max"``, in one pass over the digests."""
    b, hq, _, d = q.shape
    h, pages = page_max.shape[1], page_max.shape[2]
    out = torch.empty(b, h, pages, dtype=torch.float32)
    if out.numel():  # (the contiguous tensors are held until the call returns; under 2^16 multiply-adds, a
        # second thread's start costs more than it saves: SmolLM2 at 2K, 64 pages)
        q, page_max, page_min = q.contiguous(), page_max.contiguous(), page_min.contiguous()
        load().page_scores_f32(q.data_ptr(), page_max.data_ptr(), page_min.data_ptr(), out.data_ptr(), b * h,
                               hq // h, pages, d, max(1, min(torch.get_num_threads(), out.numel() * (hq // h) * d >> 16)))
    return out


def speculation_check(qg: torch.Tensor, prev: torch.Tensor, units: torch.Tensor, spec: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`kvcomp.kernels.retrieval_ref.speculation_check` in one call (float32 CPU queries, int64 units);
    None when the kernel is off or unavailable or the inputs do not qualify."""
    if not (enabled() and qg.device.type == "cpu" and qg.dtype == prev.dtype == torch.float32
            and units.dtype == spec.dtype == torch.int64 and units.device.type == spec.device.type == "cpu"):
        return None
    lib = load()
    if lib is None:
        return None
    b, h, g, d = qg.shape
    k, k2 = units.shape[-1], spec.shape[-1]
    qg, prev, units, spec = qg.contiguous(), prev.contiguous(), units.contiguous(), spec.contiguous()
    held = torch.empty(b, h, k, dtype=torch.bool)
    recall, cos = torch.empty(b, h), torch.empty(b, h)
    lib.speculation_check_f32(qg.data_ptr(), prev.data_ptr(), units.data_ptr(), spec.data_ptr(), b * h, g, d, k, k2,
                              cos.data_ptr(), held.data_ptr(), recall.data_ptr())
    return held, recall, cos


READ_SPAN = 1 << 18  # bytes of the file one read covers at most (the rows between wanted ones are read too)
READ_GAP = 1 << 14  # bytes between two wanted rows read along with them rather than start another read


def gather_tokens(fd: int, storage: torch.Tensor | None, index: torch.Tensor, length: int, block: int,
                  out: torch.Tensor) -> int | None:
    """Tokens ``index`` (``[B, H, k]`` int64; ``< 0``: a zero row, nothing read) of a tier's blocked storage
    (:mod:`kvcomp.tiers`: token ``t`` of head ``j`` is row ``((t // block) * B * H + j) * block + t % block``)
    into ``out`` (``[B, H, k, ...]``, contiguous, CPU, one row per token), from the open file ``fd`` with
    ``pread`` (the page cache's bytes copied, nothing mapped into this process; rows close together share a
    read) or, with ``fd < 0``, copied from ``storage`` (contiguous, CPU). Returns the rows read; None when the
    kernel is off or unavailable or the tensors do not qualify (nothing read); ``IndexError`` for an index at or
    past ``length`` (nothing read), ``OSError`` when a read fails."""
    row = out[0, 0, 0].numel() * out.element_size() if out.numel() else 0
    if not (enabled() and row and out.device.type == "cpu" and out.is_contiguous()
            and index.device.type == "cpu" and index.dtype == torch.int64
            and (fd >= 0 or (storage is not None and storage.device.type == "cpu" and storage.is_contiguous()
                             and storage.dtype == out.dtype))):
        return None
    lib = load()
    if lib is None:
        return None
    index = index.contiguous()
    scratch = torch.empty(2, index.numel(), dtype=torch.int64)
    bounce = _bounce() if fd >= 0 else None
    rc = lib.gather_tokens(fd, None if storage is None else storage.data_ptr(), index.data_ptr(),
                           index.shape[0] * index.shape[1], index.shape[2], length, block, row, out.data_ptr(),
                           scratch[0].data_ptr(), scratch[1].data_ptr(), None if bounce is None else bounce.data_ptr(),
                           READ_SPAN, READ_GAP)
    if rc == -errno.ERANGE:
        raise IndexError(f"token index beyond the {length} stored")
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return rc


def pwrite_tokens(fd: int, k: torch.Tensor, v: torch.Tensor, start: int, block: int) -> bool:
    """Keys and values ``k``, ``v`` (``[B, H, n, D]``) as tokens ``[start, start + n)`` of the blocked storage
    (:func:`gather_tokens`; a token's row is its key then its value) in the open file ``fd``, with ``pwritev``
    (nothing mapped into this process, K and V not interleaved in memory first). False (nothing written) when
    the kernel is off or unavailable; ``OSError`` when a write fails."""
    if not (enabled() and k.device.type == "cpu" and v.device.type == "cpu" and k.numel()
            and k.shape == v.shape and k.dtype == v.dtype):
        return False
    lib = load()
    if lib is None:
        return False
    k, v = k.contiguous(), v.contiguous()
    b, h, n, d = k.shape
    rc = lib.pwrite_tokens(fd, k.data_ptr(), v.data_ptr(), b * h, n, start, block, d * k.element_size())
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return True


_bounces = threading.local()


def _bounce() -> torch.Tensor:
    """This thread's buffer for :func:`gather_tokens`' spans (allocated once: a fresh 256 KiB buffer each call
    is a fresh mapping, faulted in page by page)."""
    buffer = getattr(_bounces, "buffer", None)
    if buffer is None:
        buffer = _bounces.buffer = torch.empty(READ_SPAN, dtype=torch.uint8)
    return buffer


def supports_top(scores: torch.Tensor) -> bool:
    """Whether :func:`top_ascending` runs these scores (float32 on the CPU, the kernel built)."""
    return enabled() and scores.device.type == "cpu" and scores.dtype == torch.float32 and load() is not None


def top_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` (int64) of the ``k`` largest ``scores`` along the last dimension, ascending; ties at
    the k-th value take the lowest indices (NaN ranks above +inf, as in ``torch.topk``). ``0 <= k <= L``."""
    length = scores.shape[-1]
    if not 0 <= k <= length:
        raise ValueError(f"top_ascending: k={k} outside [0, {length}].")
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use kvcomp.kernels.top_ascending")
    out = torch.empty(*scores.shape[:-1], k, dtype=torch.int64)
    if k == 0 or out.numel() == 0:
        return out
    flat = scores.reshape(-1, length).contiguous()
    work = torch.empty(flat.shape, dtype=torch.int32)
    lib.top_ascending_f32(flat.data_ptr(), out.data_ptr(), work.data_ptr(), flat.shape[0], length, k,
                             max(1, min(torch.get_num_threads(), flat.shape[0])))
    return out


def supports_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` runs these inputs: float32 CPU tensors whose keys and values are rows of
    ``D`` contiguous floats, token after token (any batch and head strides: a growable store's views)."""
    d = q.shape[-1]
    return (enabled() and q.device.type == "cpu" and all(t.dtype == torch.float32 for t in (q, k, v))
            and all(t.stride(-1) == 1 and t.stride(-2) == d for t in (k, v)) and load() is not None)


DECODE_CHUNK = 256  # tokens per work item of decode_attention (fixed: a row's result does not depend on B)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per row over keys and values it all sees (no mask): ``q`` ``[B, H_kv, M, D]`` (the
    query rows of each KV head), ``k``, ``v`` ``[B, H_kv, L, D]``; ``sinks``: :meth:`AttentionSpec.grouped_sinks`
    for these rows or None. Returns the output ``[B, H_kv, M, D]`` and the float32 probabilities
    ``[B, H_kv, M, L]``, in one pass over the keys and one over the values (torch needs a matmul, a softmax and
    a second matmul, each a pass over memory)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use kvcomp.ops.attention_probs")
    b, h, m, d = q.shape
    length = k.shape[2]
    q = q.contiguous()
    sinks = None if sinks is None else sinks.detach().to(torch.float32).reshape(h, m).contiguous()
    chunks = max(1, -(-length // DECODE_CHUNK))
    out = torch.empty(b, h, m, d, dtype=torch.float32)
    probs = torch.empty(b, h, m, length, dtype=torch.float32)
    partial = torch.empty(b * h * chunks, m, d, dtype=torch.float32)
    if length == 0:
        raise ValueError("decode_attention needs at least one key.")
    lib.decode_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), probs.data_ptr(),
                             partial.data_ptr(), b, h, m, length, d, k.stride(0), k.stride(1), v.stride(0),
                             v.stride(1), DECODE_CHUNK, float(scaling), float(softcap or 0.0),
                             None if sinks is None else sinks.data_ptr(),
                             max(1, min(torch.get_num_threads(), b * h * chunks)))
    return out, probs


def supports_prompt(q: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether :func:`prompt_attention` and :func:`reconstruction_attention` run these inputs (queries, then
    keys and values; None: absent): float32 CPU tensors, ``D`` a multiple of 16."""
    return (enabled() and q.shape[-1] % 16 == 0
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, *tensors) if t is not None)
            and load() is not None)


PROMPT_WAVE_ROWS = 32  # query heads x 16-query blocks per wave of prompt_attention (fixed: no dependence on threads)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scaling: float,
                     context: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of a block of ``n`` queries over its own keys (query ``t`` sees own keys ``0..t``) and
    over the ``nc`` keys of ``context`` (``(keys, values)``, seen by every query; None: none), with no window,
    soft-cap or sinks, and the attention each key receives, summed over the queries and the query group:
    ``q`` ``[B, H_q, n, D]``, ``k``, ``v`` ``[B, H_kv, n, D]`` -> (received ``[B, H_kv, nc + n]`` (context keys
    first), out ``[B, H_q, n, D]`` or None without ``v``), what :func:`kvcomp.ops.received_attention` returns to
    float rounding, without the probabilities in memory (:func:`supports_prompt` first). The same for any
    thread count or batch."""
    return _prompt(q, k, v, scaling, context, 0, 0, 0)


def reconstruction_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                             context: tuple[torch.Tensor, torch.Tensor], protected: int, start: int, stop: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzip's scoring pass (:func:`compressors.kvzip.attend_and_score` on a full-attention layer whose context
    keys every query sees; no soft-cap or sinks): the attention of the repetition queries ``q`` ``[B, H_q, n, D]``
    over the ``context`` ``(keys, values)`` ``[B, H_kv, nc, D]`` and, causally, their own ``k``, ``v`` ->
    (scores ``[B, H_kv, stop - start]``: the largest probability any query of a KV head's group gives context key
    ``start + i``, renormalised over context keys ``0..protected-1``, ``start..stop-1`` and the own keys;
    out ``[B, H_q, n, D]``)."""
    if not 0 <= start < stop <= context[0].shape[2]:
        raise ValueError(f"scored keys [{start}, {stop}) must lie in the {context[0].shape[2]} context keys")
    return _prompt(q, k, v, scaling, context, protected, start, stop)


def _prompt(q, k, v, scaling, context, protected, start, stop):
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use kvcomp.ops.received_attention")
    b, hq, n, d = q.shape
    h = k.shape[1]
    ck, cv = (None, None) if context is None else (context[0].contiguous(), context[1].contiguous())
    nc = 0 if ck is None else ck.shape[2]
    blocks = -(-nc // 16) + -(-n // 16)
    stride, wave = 16 * blocks + 16, min(-(-n // 16), max(1, -(-PROMPT_WAVE_ROWS // hq)))
    threads = max(1, min(torch.get_num_threads(), b * hq * -(-n // 16)))
    q, k = q.contiguous(), k.contiguous()
    v = None if v is None else v.contiguous()
    scored = stop - start
    stat = torch.empty(b, h, scored if scored else nc + n, dtype=torch.float32)
    out = None if v is None else torch.empty(b, hq, n, d, dtype=torch.float32)
    keys_t = torch.empty(b * h * blocks * d * 16, dtype=torch.float32)
    slots = torch.empty(threads * b * h * scored if scored else b * hq * wave * stride, dtype=torch.float32)
    work = torch.empty(threads * (32 * d + 16 * stride), dtype=torch.float32)
    if n:
        lib.prompt_attention_f32(q.data_ptr(), None if ck is None else ck.data_ptr(),
                                 None if cv is None else cv.data_ptr(), k.data_ptr(),
                                 None if v is None else v.data_ptr(), None if out is None else out.data_ptr(),
                                 stat.data_ptr(), keys_t.data_ptr(), slots.data_ptr(), work.data_ptr(), b, h, hq // h,
                                 nc, n, d, max(1, wave), float(scaling), protected, start, stop, threads)
    return stat, out


def projected_norms(values: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor | None:
    """CriticalKV's ``||v W_o[h_q]||_1`` averaged over each KV head's ``groups`` query heads
    (:func:`compressors.criticalkv.projected_value_norm`), in one pass without the ``[L, G * hidden]`` product in
    memory: ``values`` ``[B, H_kv, L, D]``, ``weight`` ``[H_kv, D, G * hidden]`` (the group's output-projection
    slices side by side) -> ``[B, H_kv, L]`` float32; None (nothing computed) unless both are float32 CPU tensors,
    ``G * hidden`` a multiple of 16, and the kernel is on."""
    h, d, outputs = weight.shape
    if not (enabled() and values.device.type == weight.device.type == "cpu" and outputs % 16 == 0
            and values.dtype == weight.dtype == torch.float32 and values.shape[1] == h and values.shape[3] == d):
        return None
    lib = load()
    if lib is None:
        return None
    b, _, length, _ = values.shape
    values, weight = values.contiguous(), weight.contiguous()
    out = torch.empty(b, h, length, dtype=torch.float32)
    tiles = b * h * -(-length // 16)
    if tiles:
        lib.projected_norms_f32(values.data_ptr(), weight.data_ptr(), out.data_ptr(), b, h, length, d, outputs,
                                groups, max(1, min(torch.get_num_threads(), tiles)))
    return out


def supports_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` runs this layer call: one float32 CPU row (``x.numel() == in_features``), a
    contiguous float32 weight, no autograd."""
    return (enabled() and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.dim() == 2 and x.numel() == weight.shape[1]
            and weight.is_contiguous() and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and load() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` of one row ``x`` (any leading dims of size 1) in one pass over the weight
    (:func:`supports_linear` first). Equal to torch's to float rounding, not bit for bit."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use torch.nn.functional.linear")
    out_features, in_features = weight.shape
    x_row = x.detach().reshape(in_features).contiguous()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    lib.linear_f32(weight.data_ptr(), x_row.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                   out_features, in_features, max(1, min(torch.get_num_threads(), -(-out_features // 4))))
    return out


def evict_lowest(scores: torch.Tensor, positions: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Evict, in place, the lowest-scoring slot of every row and KV head of an unpadded store: the last slot's
    token is written over it in each of ``tensors`` (its per-slot tensors ``[B, H_kv, L, ...]``, positions
    included); ties go to the lowest position, NaN ranks above every number. ``scores`` ``[B, H_kv, L]``,
    ``positions`` int32. Returns the evicted slots ``[B, H_kv, 1]`` (int64), or None (nothing done) when the
    inputs are not CPU tensors whose slots are contiguous rows, the scores float32, or the kernel is off."""
    if not (enabled() and scores.device.type == "cpu" and scores.dtype == torch.float32
            and positions.dtype == torch.int32 and scores.stride(-1) == 1 and positions.stride(-1) == 1):
        return None
    b, h, length = positions.shape
    layout = []
    for t in tensors:  # [B, H_kv, L] or [B, H_kv, L, D] with rows of D contiguous elements
        size = t.element_size()
        row = size * (t.shape[3] if t.dim() == 4 else 1)
        if t.device.type != "cpu" or t.dim() not in (3, 4) or (t.dim() == 4 and t.stride(3) != 1):
            return None
        layout += [t.stride(0) * size, t.stride(1) * size, t.stride(2) * size, row]
    lib = load()
    if lib is None:
        return None
    drop = torch.empty(b, h, 1, dtype=torch.int64)
    bases = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    lib.evict_lowest_f32(scores.data_ptr(), scores.stride(0), scores.stride(1), positions.data_ptr(),
                         positions.stride(0), positions.stride(1), b, h, length, len(tensors), bases,
                         (ctypes.c_int64 * len(layout))(*layout), drop.data_ptr())
    return drop
