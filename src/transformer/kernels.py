"""Compiled CPU kernels torch lacks: a fast transposing copy of a 16-bit (bf16) matrix, the
post-norm residual sub-layer's add, dropout and LayerNorm in one pass, forward and backward,
and the per-row scaling around an int8 product.

Not in the paper. On an AMX CPU, oneDNN multiplies bf16 at ~2,000 GFLOP/s when its left
operand is row-major, but at half that when the operand is a transposed view, as it is in every
weight gradient of y = x W^T: dW = dy^T x, a reduction over the batch's rows, which both
operands hold as their leading dimension (docs/performance.md, "Round twenty-five"). From a
row-major copy of dy^T (or of x^T) the same product runs at the full rate, but torch's
transposing copies of bf16 run at 4-12 GB/s, which eats the gain; this module's copy runs at
15-27 GB/s on two threads (cache-blocked 8 x 8 transposes in SSE2, which every x86-64 CPU has).

Each of a base model's 30 sub-layers ends in LayerNorm(x + Dropout(f)) (§3.1, §5.4): in torch,
five passes over (N, D) bf16 forward (scale, mask, add, LayerNorm's statistics and its output)
and three more backward beside LayerNorm's own, whose bf16 kernel also sums the gain's and
bias's gradients in bf16 (errors of 6-10% of the largest, against 2^-9 here). `residual_norm`
does the forward in one pass over the rows (fp32 inside, each of torch's bf16 roundings kept:
s = x + t is the same bits), `residual_norm_backward` the backward in another, with AVX-512F
(docs/performance.md, "Round twenty-seven"). CPUs without AVX-512F keep torch's ops.

`translate.Int8Linear` quantizes each input row on its own range around fbgemm's int8 product:
in torch five ops before it (|x|, the row maxima, a clamp, their inverses, the scaling) and two
after (the rows scaled back, the bias); `int8_rows_in` and `int8_rows_out_` do each side in one
pass, the same bits (AVX-512, or AVX2), which takes 2-7% off a greedy search at the peers' W2
shape (docs/performance.md, "Round thirty-seven"). They are called without holding the GIL. On a
CPU without VNNI (a Zen 3) the product itself is `int8_product` (AVX2): 8-bit weights, exact
int32 sums (vpmaddwd on int16 pairs; the weights held as int8 and widened a panel at a time),
where fbgemm's AVX2 kernel saturates with 8-bit weights and takes 7-bit ones ("Round
sixty-eight", "Round sixty-nine").

A decoding step's attention (`model._attention_rowwise` with a cache) is, in torch, four passes
over the step's keys and values, each (batch, head) a tiny product; `step_attention` takes each
(batch, head) in one pass (AVX-512), the next head's rows requested meanwhile and the keys a
mask leaves out not read: a W2 search 5-6% faster greedy, 12% beam 4 (docs/performance.md,
"Round thirty-eight"); an AVX2 form with FMA for CPUs without AVX-512. Its values are eq. (1)'s
to fp32 rounding, not torch's bits.

Beam search cuts each live row of a step's log-probabilities to its best 2K tokens
(`search._rows_best`); in torch's ops four passes, one of them a topk that at V = 8,000 falls on
torch's full sort. `row_top` takes each row in one pass, a vector compare against the 2K-th best
so far (AVX-512, or AVX2), ties to the first column: the quickstart model's beam-4 search 5-12%
faster, W2's 3% (docs/performance.md, "Round forty-one"). It is called without holding the GIL.

A bf16 training step's attention (`attention_train`, `model._PackedAttention`) takes each
(sentence, head) as one task reading and writing the packed rows in place (docs/performance.md,
"Round forty-nine"); on a CPU with AMX its six products run on AMX's tiles, bf16 operands and
fp32 sums ("Round fifty-one"), on one with AVX-512 BF16 but no AMX (Zen 4, Zen 5) on its dot
products, the same operands and sums ("Round sixty-five"), elsewhere on AVX-512's fp32 lanes
(`attention_products`).

There too a square layer's weight gradient, (512 x ~3,900) x (~3,900 x 512) in a W1 step, which
oneDNN ran at ~800 GFLOP/s in the step (its other shapes at 1,400-1,950), runs on AMX's tiles
(`weight_grad`): two threads each sum half the rows in fp32, the halves added and rounded once,
the same bits on any number of threads, ~1,100 GFLOP/s in the step ("Round fifty-two").

With bf16 parameters the optimizer's step (`optim.MixedPrecisionAdam`) was five torch passes
over every parameter: each bf16 gradient copied to fp32, scaled in place, its norm, torch's
fused Adam on the fp32 masters, the masters copied back to bf16. `adam_sum_squares` and
`adam_update` take it in two: the norm, then one pass that scales each gradient as it reads it
and writes the master, both moments and the bf16 parameter, `_fused_adam_`'s operations in its
order, the same bits (AVX-512; docs/performance.md, "Round thirty-nine").

The kernels are C, compiled on first use with the system's C compiler (`$CC`, else `cc`, `gcc`
or `clang`) into a cache folder (`$TRANSFORMER_KERNELS`, else `$XDG_CACHE_HOME/transformer`,
else `~/.cache/transformer`), keyed by the source's and compiler's hash, and loaded with
ctypes; they are checked against torch once before they are used. A process without a C
compiler (a slim container image, a copied environment), or whose compiler fails, loads one
built ahead for this source instead: `transformer kernels` (`build_ahead`) keeps a copy in the
package's own folder (`PREBUILT`), which goes wherever the package is installed or copied, and
the cache folder is searched too. Where none can be had (another architecture, no compiler and
nothing built ahead, a read-only home) `transposed` is torch's own copy, `fused_supported()` is
False, and `unavailable()` says why; on x86-64 that is a warning, as decoding then runs at
78-81% of its speed (docs/decoding.md, "The compiled kernels"). Nothing in a model file reaches
this code.

    out = transposed(x)      # (C, R) contiguous, the same values as x.t().contiguous()
    y, s, mean, rstd = residual_norm(x, f, keep, scale, weight, bias, eps)
    dx, df, dw, db = residual_norm_backward(gy, s, mean, rstd, weight, keep, scale)
    xs, top = int8_rows_in(x, nonnegative, tiny)   # x * (1 / top), top each row's max |x|
    q, top = int8_rows_u8(x, nonnegative, tiny, levels, zero)   # the same, rounded to u8
    y = int8_rows_out_(y, top, bias)               # y * top + bias, in place
    y = int8_product(q, zero, step, int8_pack(ints), n, scales, top, bias)  # exact, AVX2
    out = step_attention(q, k, v, bias, c)         # softmax(q k^T / c + bias) v, per head
    ids, values = row_top(x, n)                    # each row's n largest, in one pass
    s = adam_sum_squares(grads, scale)             # sum of (g * scale)^2, in fp64
    adam_update(masters, exp_avgs, exp_avg_sqs, grads, params, steps, lr, betas, eps, scale)
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from transformer import cpuinfo

logger = logging.getLogger(__name__)

# OpenMP's threads share out the copy's 32 x 32 tiles; below this many elements one thread
# does it all (a guard against waking the pool for tiny copies; the threshold not tuned).
MIN_THREADED = 1 << 16

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

/* an 8 x 8 block of 16-bit values: s (row stride ls) -> d (row stride ld), transposed */
static inline void t8x8(const uint16_t *s, int64_t ls, uint16_t *d, int64_t ld) {
  __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0 * ls));
  __m128i r1 = _mm_loadu_si128((const __m128i *)(s + 1 * ls));
  __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * ls));
  __m128i r3 = _mm_loadu_si128((const __m128i *)(s + 3 * ls));
  __m128i r4 = _mm_loadu_si128((const __m128i *)(s + 4 * ls));
  __m128i r5 = _mm_loadu_si128((const __m128i *)(s + 5 * ls));
  __m128i r6 = _mm_loadu_si128((const __m128i *)(s + 6 * ls));
  __m128i r7 = _mm_loadu_si128((const __m128i *)(s + 7 * ls));
  __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
  __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
  __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
  __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
  __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  _mm_storeu_si128((__m128i *)(d + 0 * ld), _mm_unpacklo_epi64(b0, b4));
  _mm_storeu_si128((__m128i *)(d + 1 * ld), _mm_unpackhi_epi64(b0, b4));
  _mm_storeu_si128((__m128i *)(d + 2 * ld), _mm_unpacklo_epi64(b1, b5));
  _mm_storeu_si128((__m128i *)(d + 3 * ld), _mm_unpackhi_epi64(b1, b5));
  _mm_storeu_si128((__m128i *)(d + 4 * ld), _mm_unpacklo_epi64(b2, b6));
  _mm_storeu_si128((__m128i *)(d + 5 * ld), _mm_unpackhi_epi64(b2, b6));
  _mm_storeu_si128((__m128i *)(d + 6 * ld), _mm_unpacklo_epi64(b3, b7));
  _mm_storeu_si128((__m128i *)(d + 7 * ld), _mm_unpackhi_epi64(b3, b7));
}

/* the block of up to 32 x 32 at rows i0 and columns c0 of s (R x C, row stride ls) into d (its
   rows R values long), by t8x8 where it can, value by value at the block's edges */
static void tile16(const uint16_t *s, int64_t ls, uint16_t *d, int64_t R, int64_t C, int64_t i0,
                   int64_t c0) {
  const int64_t i1 = i0 + 32 < R ? i0 + 32 : R, c1 = c0 + 32 < C ? c0 + 32 : C;
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) t8x8(s + i * ls + c, ls, d + c * R + i, R);
    for (; c < c1; ++c)
      for (int64_t k = i; k < i + 8; ++k) d[c * R + k] = s[k * ls + c];
  }
  for (; i < i1; ++i)
    for (int64_t c = c0; c < c1; ++c) d[c * R + i] = s[i * ls + c];
}

/* d (cols x rows, contiguous) = s (rows x cols, row stride ls) transposed, in 32 x 32 tiles
   shared out among nthreads OpenMP threads (torch's own pool: the process has one libgomp) */
int transpose16(const uint16_t *s, uint16_t *d, int64_t rows, int64_t cols, int64_t ls,
                int nthreads) {
  const int64_t T = 32, nr = (rows + T - 1) / T, nc = (cols + T - 1) / T;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
  for (int64_t bi = 0; bi < nr; ++bi)
    for (int64_t bj = 0; bj < nc; ++bj) tile16(s, ls, d, rows, cols, bi * T, bj * T);
  return 0;
}

/* ---- the post-norm residual sub-layer (§3.1, §5.4): y = LayerNorm(x + Dropout(f)) ---- */

typedef union { uint32_t u; float f; } bits32;
static inline float bf(uint16_t h) { bits32 v; v.u = (uint32_t)h << 16; return v.f; }
/* fp32 -> bf16 to nearest even, a NaN made quiet: torch's c10::BFloat16 conversion */
static inline uint16_t tobf(float f) {
  bits32 v; v.f = f;
  return (uint16_t)(f != f ? 0x7fc0u : (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#define AVX512 __attribute__((target("avx512f")))
AVX512 static inline __m512 ld16(const uint16_t *p) { /* 16 bf16 -> fp32 */
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AVX512 static inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
AVX512 static inline __m256i narrow(__m512 v) { /* tobf, 16 at a time */
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
AVX512 static inline __m512 ldk(const uint8_t *p) { /* 16 keep bytes (0 or 1) -> fp32 */
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The cache lines of [p, p + bytes) asked for ahead of their reads (a prefetch never faults: p
   may lie past the data). A stream the step reads once from memory came at a third to a half
   of the memory's rate on the AMX Xeon guest, its hardware prefetcher short of it: the
   gradients' sum of squares 1.25-1.8x as fast with its next 2 kB asked for, the loss's softmax
   1.14x (docs/performance.md, "Round fifty-five"). FETCH_AHEAD: how far ahead, in bytes. */
#define FETCH_AHEAD 2048
static inline void fetch(const void *p, int64_t bytes) {
  for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch((const char *)p + x, _MM_HINT_T0);
}

/* rows [r0, r1) of d values: s = x + t with t = (f * scale) * keep, or t = f without keep,
   each op rounded to bf16 as torch's are; y = (s - mean) * rstd * w + b, over fp32 s kept in
   buf (d floats); s, mean and rstd kept for the backward */
AVX512 static void norm_fwd_rows(const uint16_t *x, const uint16_t *f, const uint8_t *keep,
                                 float scale, const float *w, const float *b, float eps,
                                 int64_t d, int64_t r0, int64_t r1, uint16_t *s, uint16_t *y,
                                 float *mean, float *rstd, float *buf) {
  const int64_t dv = d & ~(int64_t)15;
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t *xr = x + r * d, *fr = f + r * d;
    const uint8_t *kr = keep ? keep + r * d : 0;
    uint16_t *sr = s + r * d, *yr = y + r * d;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < dv; j += 16) {
      __m512 t = ld16(fr + j);
      if (kr) t = _mm512_mul_ps(widen(narrow(_mm512_mul_ps(t, vs))), ldk(kr + j));
      __m256i h = narrow(_mm512_add_ps(ld16(xr + j), t));
      __m512 v = widen(h);
      _mm256_storeu_si256((__m256i *)(sr + j), h);
      _mm512_storeu_ps(buf + j, v);
      acc = _mm512_add_ps(acc, v);
    }
    float sum = _mm512_reduce_add_ps(acc);
    for (int64_t j = dv; j < d; ++j) {
      float t = kr ? bf(tobf(bf(fr[j]) * scale)) * (float)kr[j] : bf(fr[j]);
      sr[j] = tobf(bf(xr[j]) + t);
      buf[j] = bf(sr[j]);
      sum += buf[j];
    }
    const float mu = sum / (float)d;
    const __m512 vmu = _mm512_set1_ps(mu);
    __m512 vacc = _mm512_setzero_ps();
    for (int64_t j = 0; j < dv; j += 16) {
      __m512 c = _mm512_sub_ps(_mm512_loadu_ps(buf + j), vmu);
      vacc = _mm512_fmadd_ps(c, c, vacc);
    }
    float var = _mm512_reduce_add_ps(vacc);
    for (int64_t j = dv; j < d; ++j) var += (buf[j] - mu) * (buf[j] - mu);
    const float rs = 1.f / sqrtf(var / (float)d + eps);
    const __m512 vrs = _mm512_set1_ps(rs);
    mean[r] = mu;
    rstd[r] = rs;
    for (int64_t j = 0; j < dv; j += 16) {
      __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(buf + j), vmu), vrs);
      __m512 o = _mm512_fmadd_ps(c, _mm512_loadu_ps(w + j), _mm512_loadu_ps(b + j));
      _mm256_storeu_si256((__m256i *)(yr + j), narrow(o));
    }
    for (int64_t j = dv; j < d; ++j) yr[j] = tobf((buf[j] - mu) * rs * w[j] + b[j]);
  }
}

/* its gradient for rows [r0, r1): x_hat = (s - mean) * rstd (kept in buf), dx = rstd * (g w -
   mean(g w) - x_hat mean(g w x_hat)) in bf16, df = (dx * keep) * scale (or dx); the rows' sums
   of g x_hat and g added into dw and db (fp32) */
AVX512 static void norm_bwd_rows(const uint16_t *gy, const uint16_t *s, const float *mean,
                                 const float *rstd, const float *w, const uint8_t *keep,
                                 float scale, int64_t d, int64_t r0, int64_t r1, uint16_t *dx,
                                 uint16_t *df, float *dw, float *db, float *buf) {
  const int64_t dv = d & ~(int64_t)15;
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t *gr = gy + r * d, *sr = s + r * d;
    const uint8_t *kr = keep ? keep + r * d : 0;
    uint16_t *dxr = dx + r * d, *dfr = df + r * d;
    const float mu = mean[r], rs = rstd[r];
    const __m512 vmu = _mm512_set1_ps(mu), vrs = _mm512_set1_ps(rs);
    __m512 va = _mm512_setzero_ps(), vc = _mm512_setzero_ps();
    for (int64_t j = 0; j < dv; j += 16) {
      __m512 xh = _mm512_mul_ps(_mm512_sub_ps(ld16(sr + j), vmu), vrs), g = ld16(gr + j);
      __m512 gw = _mm512_mul_ps(g, _mm512_loadu_ps(w + j));
      _mm512_storeu_ps(buf + j, xh);
      _mm512_storeu_ps(dw + j, _mm512_fmadd_ps(g, xh, _mm512_loadu_ps(dw + j)));
      _mm512_storeu_ps(db + j, _mm512_add_ps(g, _mm512_loadu_ps(db + j)));
      va = _mm512_add_ps(va, gw);
      vc = _mm512_fmadd_ps(gw, xh, vc);
    }
    float a = _mm512_reduce_add_ps(va), c = _mm512_reduce_add_ps(vc);
    for (int64_t j = dv; j < d; ++j) {
      float xh = (bf(sr[j]) - mu) * rs, g = bf(gr[j]);
      buf[j] = xh;
      dw[j] += g * xh;
      db[j] += g;
      a += g * w[j];
      c += g * w[j] * xh;
    }
    a /= (float)d;
    c /= (float)d;
    const __m512 vA = _mm512_set1_ps(a), vC = _mm512_set1_ps(c);
    for (int64_t j = 0; j < dv; j += 16) {
      __m512 gw = _mm512_mul_ps(ld16(gr + j), _mm512_loadu_ps(w + j));
      __m512 t = _mm512_fnmadd_ps(_mm512_loadu_ps(buf + j), vC, _mm512_sub_ps(gw, vA));
      __m256i h = narrow(_mm512_mul_ps(vrs, t));
      _mm256_storeu_si256((__m256i *)(dxr + j), h);
      if (kr) h = narrow(_mm512_mul_ps(_mm512_mul_ps(widen(h), ldk(kr + j)), vs));
      _mm256_storeu_si256((__m256i *)(dfr + j), h);
    }
    for (int64_t j = dv; j < d; ++j) {
      dxr[j] = tobf(rs * ((bf(gr[j]) * w[j] - a) - buf[j] * c));
      dfr[j] = kr ? tobf(bf(dxr[j]) * (float)kr[j] * scale) : dxr[j];
    }
  }
}

static void my_rows(int64_t n, int64_t *r0, int64_t *r1) { /* this thread's share, in order */
  int64_t nt = omp_get_num_threads(), t = omp_get_thread_num(), q = n / nt, m = n % nt;
  *r0 = t * q + (t < m ? t : m);
  *r1 = *r0 + q + (t < m);
}

/* x, f, s, y: (n, d) bf16; keep: (n, d) bytes or NULL; w, b: d floats; mean, rstd: n floats;
   work: nthreads * d floats */
int residual_norm_fwd(const uint16_t *x, const uint16_t *f, const uint8_t *keep, float scale,
                      const float *w, const float *b, float eps, int64_t n, int64_t d,
                      uint16_t *s, uint16_t *y, float *mean, float *rstd, float *work,
                      int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    my_rows(n, &r0, &r1);
    norm_fwd_rows(x, f, keep, scale, w, b, eps, d, r0, r1, s, y, mean, rstd,
                  work + omp_get_thread_num() * d);
  }
  return 0;
}

/* gy, s, dx, df: (n, d) bf16; dw, db: d floats, written (the threads' partial sums added in
   thread order: the same bits run after run at one thread count); work: nthreads * 3 * d */
int residual_norm_bwd(const uint16_t *gy, const uint16_t *s, const float *mean,
                      const float *rstd, const float *w, const uint8_t *keep, float scale,
                      int64_t n, int64_t d, uint16_t *dx, uint16_t *df, float *dw, float *db,
                      float *work, int nthreads) {
  int teams = 1;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    float *part = work + omp_get_thread_num() * 3 * d;
    for (int64_t j = 0; j < 2 * d; ++j) part[j] = 0.f;
    my_rows(n, &r0, &r1);
    norm_bwd_rows(gy, s, mean, rstd, w, keep, scale, d, r0, r1, dx, df, part, part + d,
                  part + 2 * d);
#pragma omp single
    teams = omp_get_num_threads();
  }
  for (int64_t j = 0; j < d; ++j) dw[j] = db[j] = 0.f;
  for (int t = 0; t < teams; ++t)
    for (int64_t j = 0; j < d; ++j) {
      dw[j] += work[t * 3 * d + j];
      db[j] += work[t * 3 * d + d + j];
    }
  return 0;
}
/* ---- §3.3 eq. (2)'s max(0, h) on bf16, in place, and its gradient ---- */

/* h (n bf16 values) = max(0, h): a negative value that is not a NaN (its bits 0x8000 to
   0xff80) becomes +0, everything else (NaNs too) is left as it is */
AVX512 static void relu_span(uint16_t *h, int64_t i0, int64_t i1) {
  const __m512i lo = _mm512_set1_epi32(0x8000), span = _mm512_set1_epi32(0xff80 - 0x8000);
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    if (!(i & 31)) _mm_prefetch((const char *)(h + i) + FETCH_AHEAD, _MM_HINT_T0);
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i)));
    __mmask16 neg = _mm512_cmple_epu32_mask(_mm512_sub_epi32(v, lo), span);
    v = _mm512_maskz_mov_epi32(~neg, v);
    _mm256_storeu_si256((__m256i *)(h + i), _mm512_cvtepi32_epi16(v));
  }
  for (; i < i1; ++i)
    if ((uint16_t)(h[i] - 0x8000u) <= 0xff80u - 0x8000u) h[i] = 0;
}

/* dh = g, and +0 where h <= 0 (+0, or bits 0x8000 to 0xff80: -0 and the negative values):
   torch's threshold_backward, which passes the gradient at a NaN */
AVX512 static void relu_grad_span(const uint16_t *g, const uint16_t *h, uint16_t *dh,
                                  int64_t i0, int64_t i1) {
  const __m512i lo = _mm512_set1_epi32(0x8000), span = _mm512_set1_epi32(0xff80 - 0x8000);
  const __m512i zero = _mm512_setzero_si512();
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i)));
    __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i)));
    __mmask16 off = _mm512_cmple_epu32_mask(_mm512_sub_epi32(v, lo), span)
                    | _mm512_cmpeq_epi32_mask(v, zero);
    d = _mm512_maskz_mov_epi32(~off, d);
    _mm256_storeu_si256((__m256i *)(dh + i), _mm512_cvtepi32_epi16(d));
  }
  for (; i < i1; ++i)
    dh[i] = (h[i] == 0 || (uint16_t)(h[i] - 0x8000u) <= 0xff80u - 0x8000u) ? 0 : g[i];
}

static void my_span(int64_t n, int64_t *i0, int64_t *i1) { /* whole 64-value blocks */
  int64_t blocks = (n + 63) / 64, b0, b1;
  my_rows(blocks, &b0, &b1);
  *i0 = b0 * 64 < n ? b0 * 64 : n;
  *i1 = b1 * 64 < n ? b1 * 64 : n;
}

/* out (n, d) fp32 = x (n, bf16 rows of d, d a multiple of 16) widened, minus e (d floats) from
   every row: torch's x.float() - e, in one pass whose stores go around the caches (out is fresh,
   and larger than they are where it is used: the loss's (V, D) gradient) */
AVX512 static void widen_minus_rows(const uint16_t *x, int64_t r0, int64_t r1, int64_t d,
                                    const float *e, float *out) {
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = 0; j < d; j += 16) {
      const __m512 v = _mm512_sub_ps(ld16(x + i * d + j), _mm512_loadu_ps(e + j));
      if (((uintptr_t)(out + i * d + j) & 63) == 0) _mm512_stream_ps(out + i * d + j, v);
      else _mm512_storeu_ps(out + i * d + j, v);
    }
  _mm_sfence();
}

int widen_minus(const uint16_t *x, int64_t n, int64_t d, const float *e, float *out,
                int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    my_rows(n, &r0, &r1);
    widen_minus_rows(x, r0, r1, d, e, out);
  }
  return 0;
}

/* ---- the packed path's embedding sub-layer (§3.4, §3.5, §5.4) ---- */

enum { EMBED_AHEAD = 8 }; /* the rows asked for this many rows ahead of their turn */

/* n rows of d bf16 values (d a multiple of 16): out_i = (((W[ids_i] es) + t[pos_i]) s) keep_i,
   each product and sum rounded to bf16 where torch's ops (model._embed_packed: a lookup, `*`,
   `+`, `_KeepScale`) round them; keep NULL: no dropout (s unused) */
AVX512 static void embed_rows(const uint16_t *w, const int64_t *ids, const uint16_t *t,
                              const int64_t *pos, int64_t r0, int64_t r1, int64_t d, float es,
                              const uint8_t *keep, float s, uint16_t *out) {
  const __m512 ves = _mm512_set1_ps(es), vs = _mm512_set1_ps(s);
  for (int64_t i = r0; i < r1; ++i) {
    if (i + EMBED_AHEAD < r1) fetch(w + ids[i + EMBED_AHEAD] * d, d * 2); /* a scattered row */
    const uint16_t *wr = w + ids[i] * d, *tr = t + pos[i] * d;
    const uint8_t *kr = keep ? keep + i * d : NULL;
    for (int64_t j = 0; j < d; j += 16) {
      __m512 x = widen(narrow(_mm512_mul_ps(ld16(wr + j), ves)));
      x = widen(narrow(_mm512_add_ps(x, ld16(tr + j))));
      if (kr) x = _mm512_mul_ps(widen(narrow(_mm512_mul_ps(x, vs))), ldk(kr + j));
      _mm256_storeu_si256((__m256i *)(out + i * d + j), narrow(x));
    }
  }
}

int embed_fwd(const uint16_t *w, const int64_t *ids, const uint16_t *t, const int64_t *pos,
              int64_t n, int64_t d, float es, const uint8_t *keep, float s, uint16_t *out,
              int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    my_rows(n, &r0, &r1);
    embed_rows(w, ids, t, pos, r0, r1, d, es, keep, s, out);
  }
  return 0;
}

/* its gradient into the fp32 rows mg (V, d) of the weight's master: mg[ids_i] += ((g_i keep_i)
   s) es, rounded to bf16 after each product as torch's ops round them (`_KeepScale`'s backward,
   `*`'s), added in fp32 in the order of i (index_add_'s); a thread adds the rows of its share
   of the vocabulary, so each row's sum keeps that order */
AVX512 static void embed_grad_rows(const uint16_t *g, const int64_t *ids, int64_t n, int64_t d,
                                   float es, const uint8_t *keep, float s, float *mg, int64_t v0,
                                   int64_t v1) {
  const __m512 ves = _mm512_set1_ps(es), vs = _mm512_set1_ps(s);
  for (int64_t i = 0; i < n; ++i) {
    if (i + EMBED_AHEAD < n && ids[i + EMBED_AHEAD] >= v0 && ids[i + EMBED_AHEAD] < v1)
      fetch(mg + ids[i + EMBED_AHEAD] * d, d * 4);
    if (ids[i] < v0 || ids[i] >= v1) continue;
    const uint16_t *gr = g + i * d;
    const uint8_t *kr = keep ? keep + i * d : NULL;
    float *m = mg + ids[i] * d;
    for (int64_t j = 0; j < d; j += 16) {
      __m512 x = ld16(gr + j);
      if (kr) x = widen(narrow(_mm512_mul_ps(widen(narrow(_mm512_mul_ps(x, ldk(kr + j)))), vs)));
      x = widen(narrow(_mm512_mul_ps(x, ves)));
      _mm512_storeu_ps(m + j, _mm512_add_ps(_mm512_loadu_ps(m + j), x));
    }
  }
}

int embed_bwd(const uint16_t *g, const int64_t *ids, int64_t n, int64_t d, float es,
              const uint8_t *keep, float s, float *mg, int64_t vocab, int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t v0, v1;
    my_rows(vocab, &v0, &v1);
    embed_grad_rows(g, ids, n, d, es, keep, s, mg, v0, v1);
  }
  return 0;
}

int relu16(uint16_t *h, int64_t n, int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t i0, i1;
    my_span(n, &i0, &i1);
    relu_span(h, i0, i1);
  }
  return 0;
}

int relu16_grad(const uint16_t *g, const uint16_t *h, uint16_t *dh, int64_t n, int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t i0, i1;
    my_span(n, &i0, &i1);
    relu_grad_span(g, h, dh, i0, i1);
  }
  return 0;
}
/* ---- §5.4 dropout's mask: numpy's PCG64 (XSL-RR 128/64) bits, compared 16 at a time ---- */

typedef unsigned __int128 u128;
#define PCG_MULT (((u128)0x2360ed051fc65da4ULL << 64) | 0x4385df649fccf645ULL)

static inline uint64_t pcg_output(u128 s) {
  uint64_t x = (uint64_t)(s >> 64) ^ (uint64_t)s;
  unsigned rot = (unsigned)(s >> 122);
  return (x >> rot) | (x << ((-rot) & 63u));
}

/* the state `delta` steps on (state = state * MULT + inc per step), in log2(delta) steps */
static u128 pcg_advance(u128 state, u128 inc, uint64_t delta) {
  u128 acc_mult = 1, acc_plus = 0, mult = PCG_MULT, plus = inc;
  for (; delta; delta >>= 1) {
    if (delta & 1) {
      acc_mult *= mult;
      acc_plus = acc_plus * mult + plus;
    }
    plus = (mult + 1) * plus;
    mult *= mult;
  }
  return acc_mult * state + acc_plus;
}

#define PCG_BLOCK 16 /* outputs a run makes before they are compared */

/* keep[i] = (piece i of the outputs r, 16 bits each, low bits first) >= thr, i < 4 * m */
static inline void compare16(const uint64_t *r, int64_t m, uint32_t thr, uint8_t *keep) {
  uint16_t pieces[4 * PCG_BLOCK];
  memcpy(pieces, r, (size_t)m * 8); /* x86-64 is little-endian: piece i at 16-bit index i */
  for (int64_t i = 0; i < 4 * m; ++i) keep[i] = pieces[i] >= thr;
}

/* keep[i] = (the i-th 16-bit piece of numpy's PCG64(state, inc).random_raw(), low bits first)
   >= thr, for i in [0, n); the outputs shared out among the threads in order, each thread's
   in four interleaved runs (one 128-bit product each: four hide its latency) */
int dropout_keep(uint64_t state_hi, uint64_t state_lo, uint64_t inc_hi, uint64_t inc_lo,
                 uint32_t thr, uint8_t *keep, int64_t n, int nthreads) {
  const u128 state = ((u128)state_hi << 64) | state_lo, inc = ((u128)inc_hi << 64) | inc_lo;
  const int64_t full = n / 4; /* outputs whose four pieces are all used */
#pragma omp parallel num_threads(nthreads)
  {
    int64_t o0, o1;
    my_rows(full, &o0, &o1);
    const int64_t q = (o1 - o0) / 4; /* each run's outputs; the last few are run 3's */
    int64_t at[4];
    u128 s[4];
    uint64_t r[4][PCG_BLOCK];
    for (int l = 0; l < 4; ++l) {
      at[l] = o0 + l * q;
      s[l] = pcg_advance(state, inc, (uint64_t)at[l]);
    }
    for (int64_t j = 0; j < q; j += PCG_BLOCK) {
      const int64_t m = q - j < PCG_BLOCK ? q - j : PCG_BLOCK;
      for (int64_t i = 0; i < m; ++i)
        for (int l = 0; l < 4; ++l) {
          s[l] = s[l] * PCG_MULT + inc;
          r[l][i] = pcg_output(s[l]);
        }
      for (int l = 0; l < 4; ++l) compare16(r[l], m, thr, keep + 4 * (at[l] + j));
    }
    for (int64_t o = o0 + 4 * q; o < o1; ++o) {
      s[3] = s[3] * PCG_MULT + inc;
      r[3][0] = pcg_output(s[3]);
      compare16(r[3], 1, thr, keep + 4 * o);
    }
  }
  if (n > 4 * full) { /* the last output's first n % 4 pieces */
    uint8_t last[4];
    uint64_t r = pcg_output(pcg_advance(state, inc, (uint64_t)full + 1));
    compare16(&r, 1, thr, last);
    memcpy(keep + 4 * full, last, (size_t)(n - 4 * full));
  }
  return 0;
}

/* ---- §3.2.1 eq. (1)'s softmax over masked, scaled scores, and its gradient ---- */

/* exp(x) for x <= 0 (the scores less their row's max), to ~1 ulp: 2^n exp(r), |r| <= ln 2 / 2,
   a degree-6 polynomial; below -104 it is 0 */
AVX512 static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

#define AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl")))
AVX512BW static inline __mmask16 first16(int64_t n) { /* lanes 0 .. min(n, 16) - 1 */
  return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* rows [r0, r1) of (B, H, Tq, Tk), row r = ((b H + h) Tq + i): w = softmax(v) with v_j =
   bf16(x_j / c) (c > 0; c = 0: x_j) where mask[b mb + h mh + i mi + j mj] is nonzero (mask
   NULL: everywhere), -inf elsewhere; a row with no legal key gets w = 0. buf: Tk rounded up to
   16 floats, written with whole vectors only (a vector load of smaller stores stalls). Each
   row is read whole before it is written: w may be x. */
AVX512BW static void softmax_rows(const uint16_t *x, const uint8_t *mask, int64_t H,
                                  int64_t Tq, int64_t Tk, int64_t mb, int64_t mh, int64_t mi,
                                  int64_t mj, float c, int64_t r0, int64_t r1, uint16_t *w,
                                  float *buf) {
  const int64_t tp = (Tk + 15) & ~(int64_t)15;
  const __m512 vninf = _mm512_set1_ps(-__builtin_inff()), vc = _mm512_set1_ps(c);
  uint8_t row_mask[16];
  int64_t i = r0 % Tq, h = (r0 / Tq) % H, b = r0 / (Tq * H); /* counted on, not divided */
  for (int64_t r = r0; r < r1; ++r, ++i) {
    if (i == Tq) {
      i = 0;
      if (++h == H) h = 0, ++b;
    }
    const uint16_t *xr = x + r * Tk;
    const uint8_t *mr = mask ? mask + b * mb + h * mh + i * mi : 0;
    __m512 top = vninf;
    __mmask16 nan = 0;
    for (int64_t j = 0; j < tp; j += 16) {
      if (!(j & 31)) _mm_prefetch((const char *)(xr + j) + FETCH_AHEAD, _MM_HINT_T0);
      const __mmask16 in = first16(Tk - j);
      __m512 v = widen(_mm256_maskz_loadu_epi16(in, xr + j));
      if (c > 0.f) v = widen(narrow(_mm512_div_ps(v, vc)));
      __mmask16 legal = in;
      if (mr) {
        const uint8_t *mk = mr + j * mj;
        if (mj != 1) { /* a mask strided along the keys: its bytes gathered first */
          for (int64_t k = 0; k < 16; ++k) row_mask[k] = j + k < Tk ? mk[k * mj] : 0;
          mk = row_mask;
        }
        legal = _mm512_mask_cmpneq_epi32_mask(
            in, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(in, mk)), _mm512_setzero_si512());
      }
      v = _mm512_mask_mov_ps(vninf, legal, v);
      _mm512_storeu_ps(buf + j, v);
      top = _mm512_max_ps(top, v);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan) { /* a NaN among the legal values: a NaN row, as torch's softmax (exp_nonpositive
                  and max would drop it) */
      for (int64_t j = 0; j < Tk; ++j) w[r * Tk + j] = 0x7fc0;
      continue;
    }
    float t = _mm512_reduce_max_ps(top);
    if (t == -__builtin_inff()) t = -3.40282347e38f; /* no legal key: exp(-inf) = 0 */
    const __m512 vt = _mm512_set1_ps(t);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < tp; j += 16) {
      __m512 v = _mm512_loadu_ps(buf + j);
      __mmask16 legal = _mm512_cmp_ps_mask(v, vninf, _CMP_NEQ_UQ);
      __m512 e = _mm512_maskz_mov_ps(legal, exp_nonpositive(_mm512_sub_ps(v, vt)));
      _mm512_storeu_ps(buf + j, e);
      acc = _mm512_add_ps(acc, e);
    }
    float sum = _mm512_reduce_add_ps(acc);
    const __m512 vs = _mm512_set1_ps(sum < 1.f ? 1.f : sum); /* a legal row's sum is >= 1 */
    /* With no mask (the loss's rows, V wide) times 1 / sum: a division per value took a
       quarter of the time there. The attention's rows keep the division (their bits). */
    const __m512 vr = _mm512_div_ps(_mm512_set1_ps(1.f), vs);
    for (int64_t j = 0; j < tp; j += 16) {
      const __mmask16 in = first16(Tk - j);
      const __m512 e = _mm512_loadu_ps(buf + j);
      __m256i o = narrow(mask ? _mm512_div_ps(e, vs) : _mm512_mul_ps(e, vr));
      _mm256_mask_storeu_epi16(w + r * Tk + j, in, o);
    }
  }
}

/* its gradient for rows [r0, r1): dx = bf16(bf16(w (g - sum_k g_k w_k)) / c) (c = 0: no
   division): torch's softmax backward, then the division's, each rounded to bf16 */
AVX512BW static void softmax_grad_rows(const uint16_t *g, const uint16_t *w, int64_t Tk,
                                       float c, int64_t r0, int64_t r1, uint16_t *dx) {
  const __m512 vc = _mm512_set1_ps(c);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t *gr = g + r * Tk, *wr = w + r * Tk;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < Tk; j += 16) {
      const __mmask16 in = first16(Tk - j);
      acc = _mm512_fmadd_ps(widen(_mm256_maskz_loadu_epi16(in, gr + j)),
                            widen(_mm256_maskz_loadu_epi16(in, wr + j)), acc);
    }
    const __m512 vd = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
    for (int64_t j = 0; j < Tk; j += 16) {
      const __mmask16 in = first16(Tk - j);
      __m512 gv = widen(_mm256_maskz_loadu_epi16(in, gr + j));
      __m512 wv = widen(_mm256_maskz_loadu_epi16(in, wr + j));
      __m512 hv = widen(narrow(_mm512_mul_ps(wv, _mm512_sub_ps(gv, vd))));
      if (c > 0.f) hv = _mm512_div_ps(hv, vc);
      _mm256_mask_storeu_epi16(dx + r * Tk + j, in, narrow(hv));
    }
  }
}

int masked_softmax_fwd(const uint16_t *x, const uint8_t *mask, int64_t B, int64_t H,
                       int64_t Tq, int64_t Tk, int64_t mb, int64_t mh, int64_t mi, int64_t mj,
                       float c, uint16_t *w, float *work, int nthreads) {
  const int64_t tp = (Tk + 15) & ~(int64_t)15;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    my_rows(B * H * Tq, &r0, &r1);
    softmax_rows(x, mask, H, Tq, Tk, mb, mh, mi, mj, c, r0, r1, w,
                 work + omp_get_thread_num() * tp);
  }
  return 0;
}

int masked_softmax_bwd(const uint16_t *g, const uint16_t *w, int64_t rows, int64_t Tk, float c,
                       uint16_t *dx, int nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    my_rows(rows, &r0, &r1);
    softmax_grad_rows(g, w, Tk, c, r0, r1, dx);
  }
  return 0;
}

/* ---- a training step's eq. (1) (§3.2.1, §3.2.2) read from and written to packed rows ---- */

/* One (batch row, head) of `model.Packing`'s batch. Query i's projected row is packed row
   qrow[i] (-1: a padding position, not packed), key (value) j's is krow[j]; key j is legal if
   packed, kmask[j] nonzero (kmask NULL: all) and, causal, j <= i (§3.2.3). The legal keys'
   positions go to kj, ascending; their count is returned. */
static int64_t legal_keys(const int64_t *krow, const uint8_t *kmask, int64_t Tk, int64_t *kj) {
  int64_t n = 0;
  for (int64_t j = 0; j < Tk; ++j)
    if (krow[j] >= 0 && (!kmask || kmask[j])) kj[n++] = j;
  return n;
}

/* The packed queries' positions qi (ascending) and each one's count of legal keys nr (all nk,
   or under the causal mask those at j <= i); returns how many */
static int64_t packed_queries(const int64_t *qrow, int64_t Tq, const int64_t *kj, int64_t nk,
                              int causal, int64_t *qi, int64_t *nr) {
  int64_t nq = 0, n = causal ? 0 : nk;
  for (int64_t i = 0; i < Tq; ++i) {
    if (causal)
      while (n < nk && kj[n] <= i) ++n;
    if (qrow[i] >= 0) qi[nq] = i, nr[nq++] = n;
  }
  return nq;
}

/* C[r, 16 U columns] (+)= sum over k < K of A[r ar + k ak] B[k ldb + ..], r < R: R x U
   accumulators in registers, each B vector read once for the R rows */
#define GEMM_TILE(R, U)                                                                      \
  AVX512 static void tile##R##U(const float *A, int64_t ar, int64_t ak, const float *B,      \
                                int64_t ldb, int64_t K, float *C, int64_t ldc, int add) {    \
    __m512 c[R][U];                                                                          \
    for (int r = 0; r < R; ++r)                                                              \
      for (int u = 0; u < U; ++u)                                                            \
        c[r][u] = add ? _mm512_loadu_ps(C + r * ldc + 16 * u) : _mm512_setzero_ps();         \
    for (int64_t k = 0; k < K; ++k, A += ak, B += ldb) {                                     \
      __m512 b[U];                                                                           \
      for (int u = 0; u < U; ++u) b[u] = _mm512_loadu_ps(B + 16 * u);                        \
      for (int r = 0; r < R; ++r) {                                                          \
        const __m512 a = _mm512_set1_ps(A[r * ar]);                                          \
        for (int u = 0; u < U; ++u) c[r][u] = _mm512_fmadd_ps(a, b[u], c[r][u]);             \
      }                                                                                      \
    }                                                                                        \
    for (int r = 0; r < R; ++r)                                                              \
      for (int u = 0; u < U; ++u) _mm512_storeu_ps(C + r * ldc + 16 * u, c[r][u]);           \
  }
GEMM_TILE(1, 1) GEMM_TILE(1, 2) GEMM_TILE(1, 3) GEMM_TILE(1, 4)
GEMM_TILE(2, 1) GEMM_TILE(2, 2) GEMM_TILE(2, 3) GEMM_TILE(2, 4)
GEMM_TILE(3, 1) GEMM_TILE(3, 2) GEMM_TILE(3, 3) GEMM_TILE(3, 4)
GEMM_TILE(4, 1) GEMM_TILE(4, 2) GEMM_TILE(4, 3) GEMM_TILE(4, 4)
typedef void (*gemm_tile)(const float *, int64_t, int64_t, const float *, int64_t, int64_t,
                          float *, int64_t, int);
static const gemm_tile GEMM_TILES[4][4] = {{tile11, tile12, tile13, tile14},
                                           {tile21, tile22, tile23, tile24},
                                           {tile31, tile32, tile33, tile34},
                                           {tile41, tile42, tile43, tile44}};

/* C (M, N) (+)= A (M, K) B (K, N), fp32: A's element (r, k) at A[r ar + k ak], B row-major
   (stride ldb), C row-major (stride ldc), N a multiple of 16; in tiles of 4 rows x 64 columns */
static void gemm(const float *A, int64_t ar, int64_t ak, const float *B, int64_t ldb, int64_t M,
                 int64_t K, int64_t N, float *C, int64_t ldc, int add) {
  for (int64_t r = 0; r < M; r += 4)
    for (int64_t c = 0; c < N; c += 64)
      GEMM_TILES[(M - r < 4 ? M - r : 4) - 1][(N - c < 64 ? (N - c) / 16 : 4) - 1](
          A + r * ar, ar, ak, B + c, ldb, K, C + r * ldc + c, ldc, add);
}

/* fp32 copies of bf16 rows, D values (a multiple of 16) each: x's rows rows[sel[m]] (stride
   ld) for m < n, as rows (n, D) into r, or transposed (D, tp) into t, columns n .. tp zero */
AVX512 static void rows_f32(const uint16_t *x, int64_t ld, const int64_t *rows,
                            const int64_t *sel, int64_t n, int64_t D, float *r) {
  for (int64_t m = 0; m < n; ++m) {
    const uint16_t *xr = x + rows[sel[m]] * ld;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(r + m * D + d, ld16(xr + d));
  }
}
AVX512 static void cols_f32(const uint16_t *x, int64_t ld, const int64_t *rows,
                            const int64_t *sel, int64_t n, int64_t D, int64_t tp, float *t) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t m = n; m < tp; ++m) t[d * tp + m] = 0.f;
  float blk[16 * 16];
  for (int64_t m0 = 0; m0 < n; m0 += 16) {
    const int64_t mn = n - m0 < 16 ? n - m0 : 16;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      for (int64_t m = 0; m < mn; ++m)
        _mm512_storeu_ps(blk + m * 16, ld16(x + rows[sel[m0 + m]] * ld + d0));
      for (int64_t d = 0; d < 16; ++d)
        for (int64_t m = 0; m < mn; ++m) t[(d0 + d) * tp + m0 + m] = blk[m * 16 + d];
    }
  }
}

/* fp32 rows (n, D) rounded to bf16 into x's rows rows[sel[m]] */
#define ROWS_BF16(NAME, TARGET, NARROW)                                                      \
  TARGET static void NAME(const float *r, int64_t n, int64_t D, const int64_t *rows,         \
                          const int64_t *sel, uint16_t *x, int64_t ld) {                     \
    for (int64_t m = 0; m < n; ++m) {                                                        \
      uint16_t *xr = x + rows[sel[m]] * ld;                                                  \
      for (int64_t d = 0; d < D; d += 16)                                                    \
        _mm256_storeu_si256((__m256i *)(xr + d), NARROW(_mm512_loadu_ps(r + m * D + d)));   \
    }                                                                                        \
  }
ROWS_BF16(rows_bf16, AVX512, narrow)

/* C's nq rows = A's (row stride ar) times B, in blocks of 4 rows, each over the keys its last
   row may see (nr: ascending): the keys are B's columns (keys_are_k 0: N, rounded up to 16;
   K = fixed) or the sum's index (keys_are_k 1: K; N = fixed) */
static void blocks_times(const float *A, int64_t ar, const float *B, int64_t ldb, int64_t nq,
                         int64_t fixed, const int64_t *nr, int keys_are_k, float *C,
                         int64_t ldc) {
  for (int64_t r = 0; r < nq; r += 4) {
    const int64_t R = nq - r < 4 ? nq - r : 4, n = nr[r + R - 1];
    if (keys_are_k)
      gemm(A + r * ar, ar, 1, B, ldb, R, n, fixed, C + r * ldc, ldc, 0);
    else
      gemm(A + r * ar, ar, 1, B, ldb, R, fixed, (n + 15) & ~(int64_t)15, C + r * ldc, ldc, 0);
  }
}

/* Sixteen rows' reductions at once, each row's value the bits of _mm512_reduce_max_ps /
   _mm512_reduce_add_ps on its vector a[r] (gcc's order: the upper half op the lower, then the
   upper 128 bits op the lower, then lanes 0, 1 op 2, 3, then lane 0 op lane 1): the same tree
   for all sixteen side by side, where a row at a time waited on each level's latency in turn.
   Row r's result lands in lane 4 (r % 4) + r / 4 (`ROW_LANE`). */
#define ROW_LANE(r) (4 * ((r) % 4) + (r) / 4)
#define REDUCE16(NAME, OP)                                                                    \
  AVX512BW static inline __m512 NAME(const __m512 *a) {                                      \
    __m512 z[8], w[4], t[2];                                                                 \
    for (int i = 0; i < 8; ++i) /* rows 2i, 2i + 1: 256-bit halves, upper op lower */        \
      z[i] = OP(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee),                          \
                _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44));                         \
    for (int i = 0; i < 4; ++i) /* rows 4i .. 4i + 3, a 128-bit block each: upper op lower */ \
      w[i] = OP(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xdd),                          \
                _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x88));                         \
    for (int i = 0; i < 2; ++i) /* lanes 0, 1 op 2, 3 of each block */                       \
      t[i] = OP(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),                             \
                _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xee));                            \
    return OP(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xdd));     \
  }
REDUCE16(max16_rows, _mm512_max_ps)
REDUCE16(sum16_rows, _mm512_add_ps)

/* lane `lane` of x in every lane */
AVX512BW static inline __m512 lane_all(__m512 x, int lane) {
  return _mm512_permutexvar_ps(_mm512_set1_epi32(lane), x);
}

/* Sixteen queries' softmax over their legal keys, row r's scores s + r ld (fp32, n[r] legal
   keys; read and written to up16(n[r])): exp(score inv_c - the row's max) in place, zeros
   past n[r]; returns each row's 1 / sum in its `ROW_LANE` (0: no legal key). A row's values
   are those of its own two reductions one row at a time (`REDUCE16`'s order). */
AVX512BW static inline __m512 exp_rows16(float *s, int64_t ld, const int64_t *n, float inv_c) {
  const __m512 vninf = _mm512_set1_ps(-__builtin_inff()), vic = _mm512_set1_ps(inv_c);
  __m512 top[16], acc[16];
  __mmask16 any = 0;
  for (int r = 0; r < 16; ++r) {
    float *sr = s + r * ld;
    top[r] = vninf;
    for (int64_t m = 0; m < n[r]; m += 16) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + m), vic);
      x = _mm512_mask_mov_ps(vninf, first16(n[r] - m), x);
      _mm512_storeu_ps(sr + m, x);
      top[r] = _mm512_max_ps(top[r], x);
    }
    if (n[r]) any |= (__mmask16)(1u << ROW_LANE(r));
  }
  const __m512 tops = _mm512_maskz_mov_ps(any, max16_rows(top)); /* 0 where no legal key */
  for (int r = 0; r < 16; ++r) {
    float *sr = s + r * ld;
    const __m512 vt = lane_all(tops, ROW_LANE(r));
    acc[r] = _mm512_setzero_ps();
    for (int64_t m = 0; m < n[r]; m += 16) {
      const __mmask16 in = first16(n[r] - m);
      __m512 e = exp_nonpositive(_mm512_maskz_sub_ps(in, _mm512_loadu_ps(sr + m), vt));
      e = _mm512_maskz_mov_ps(in, e);
      _mm512_storeu_ps(sr + m, e);
      acc[r] = _mm512_add_ps(acc[r], e);
    }
  }
  return _mm512_maskz_div_ps(any, _mm512_set1_ps(1.f), sum16_rows(acc));
}

/* forward of one (batch row, head): out row qrow[i] = P_i V with P_i = bf16(softmax(q_i k^T
   inv_c over its legal keys)), kept in p (Tq, Tk) over the legal keys in order (zeros past
   them and for unpacked queries); a query with no legal key gets zeros. q, k, v, out point
   at the head's first column. Scratch: kt (D, tp), vs (Tk, Dv), qf (Tq, D), s (Tq, tp),
   o (Tq, Dv) floats; kj, qi, nr (Tk or Tq each) int64. */
AVX512BW static void attn_fwd_head(const uint16_t *q, int64_t lq, const uint16_t *k,
                                   const uint16_t *v, int64_t lk, const int64_t *qrow,
                                   const int64_t *krow, const uint8_t *kmask, int causal,
                                   int64_t Tq, int64_t Tk, int64_t D, int64_t Dv, float inv_c,
                                   uint16_t *out, int64_t lo, uint16_t *p, float *kt, float *vs,
                                   float *qf, float *s, float *o, int64_t *kj, int64_t *qi,
                                   int64_t *nr) {
  const int64_t nk = legal_keys(krow, kmask, Tk, kj), tp = (nk + 15) & ~(int64_t)15;
  const int64_t nq = packed_queries(qrow, Tq, kj, nk, causal, qi, nr);
  memset(p, 0, (size_t)(Tq * Tk) * 2);
  if (nq == 0) return;
  cols_f32(k, lk, krow, kj, nk, D, tp, kt);
  rows_f32(v, lk, krow, kj, nk, Dv, vs);
  rows_f32(q, lq, qrow, qi, nq, D, qf);
  blocks_times(qf, D, kt, tp, nq, D, nr, 0, s, tp); /* scores */
  for (int64_t c0 = 0; c0 < nq; c0 += 16) { /* 16 rows' softmax at once (`exp_rows16`) */
    int64_t n16[16];
    for (int r = 0; r < 16; ++r) n16[r] = c0 + r < nq ? nr[c0 + r] : 0;
    const __m512 inv = exp_rows16(s + c0 * tp, tp, n16, inv_c);
    for (int r = 0; r < 16 && c0 + r < nq; ++r) {
      const int64_t c = c0 + r, n = n16[r], np = (n + 15) & ~(int64_t)15;
      float *sr = s + c * tp;
      uint16_t *pr = p + qi[c] * Tk;
      const __m512 vs1 = lane_all(inv, ROW_LANE(r));
      for (int64_t m = 0; m < np; m += 16) {
        __m256i w = narrow(_mm512_mul_ps(_mm512_loadu_ps(sr + m), vs1));
        _mm512_storeu_ps(sr + m, widen(w));
        _mm256_mask_storeu_epi16(pr + m, first16(n - m), w);
      }
      for (int64_t m = np; m < tp; m += 16) _mm512_storeu_ps(sr + m, _mm512_setzero_ps());
    }
  }
  blocks_times(s, tp, vs, Dv, nq, Dv, nr, 1, o, Dv); /* P V */
  rows_bf16(o, nq, Dv, qrow, qi, out, lo);
}

/* a head's key gradients dka (nk, D) and dva (nk, Dv), fp32, rounded into each packed key's
   row of dk and dv (stride ldk) at this head's columns; zeros for a key no query may see */
#define HEAD_KEYS_OUT(NAME, TARGET, NARROW)                                                  \
  TARGET static void NAME(const int64_t *krow, const int64_t *kj, int64_t nk, int64_t Tk,    \
                          int64_t D, int64_t Dv, const float *dka, const float *dva,         \
                          uint16_t *dk, uint16_t *dv, int64_t ldk) {                         \
    for (int64_t j = 0, m = 0; j < Tk; ++j) {                                                \
      if (krow[j] < 0) continue;                                                             \
      uint16_t *dkr = dk + krow[j] * ldk, *dvr = dv + krow[j] * ldk;                         \
      if (m < nk && kj[m] == j) {                                                            \
        for (int64_t d = 0; d < D; d += 16)                                                  \
          _mm256_storeu_si256((__m256i *)(dkr + d), NARROW(_mm512_loadu_ps(dka + m * D + d))); \
        for (int64_t d = 0; d < Dv; d += 16)                                                 \
          _mm256_storeu_si256((__m256i *)(dvr + d),                                          \
                              NARROW(_mm512_loadu_ps(dva + m * Dv + d)));                    \
        ++m;                                                                                 \
      } else {                                                                               \
        memset(dkr, 0, (size_t)D * 2);                                                       \
        memset(dvr, 0, (size_t)Dv * 2);                                                      \
      }                                                                                      \
    }                                                                                        \
  }
HEAD_KEYS_OUT(head_keys_out, AVX512, narrow)

/* its gradient: g's rows (stride lg) as out's; dq's as q's (stride ldq); dk's, dv's as k's and
   v's (stride ldk): each packed row of this batch row written at this head's columns, zeros
   for a key no query may see. Scratch: kr (Tk, D), vt (Dv, tp), qf (Tq, D), gf (Tq, Dv),
   pf, ds (Tq, tp each), dqf (Tq, D), dka (Tk, D), dva (Tk, Dv) floats; kj, qi, nr. */
AVX512BW static void attn_bwd_head(const uint16_t *g, int64_t lg, const uint16_t *q, int64_t lq,
                                   const uint16_t *k, const uint16_t *v, int64_t lk,
                                   const int64_t *qrow, const int64_t *krow,
                                   const uint8_t *kmask, int causal, int64_t Tq, int64_t Tk,
                                   int64_t D, int64_t Dv, float inv_c, const uint16_t *p,
                                   uint16_t *dq, int64_t ldq, uint16_t *dk, uint16_t *dv,
                                   int64_t ldk, float *kr, float *vt, float *qf, float *gf,
                                   float *pf, float *ds, float *dqf, float *dka, float *dva,
                                   int64_t *kj, int64_t *qi, int64_t *nr) {
  const int64_t nk = legal_keys(krow, kmask, Tk, kj), tp = (nk + 15) & ~(int64_t)15;
  const int64_t nq = packed_queries(qrow, Tq, kj, nk, causal, qi, nr);
  if (nq) {
    rows_f32(k, lk, krow, kj, nk, D, kr);
    cols_f32(v, lk, krow, kj, nk, Dv, tp, vt);
    rows_f32(q, lq, qrow, qi, nq, D, qf);
    rows_f32(g, lg, qrow, qi, nq, Dv, gf);
    blocks_times(gf, Dv, vt, tp, nq, Dv, nr, 0, ds, tp); /* dP = g V^T */
    const __m512 vic = _mm512_set1_ps(inv_c);
    for (int64_t c = 0; c < nq; ++c) {
      const int64_t n = nr[c], np = (n + 15) & ~(int64_t)15;
      const uint16_t *pr = p + qi[c] * Tk;
      float *pfr = pf + c * tp, *dsr = ds + c * tp;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t m = 0; m < np; m += 16) {
        __m512 w = widen(_mm256_maskz_loadu_epi16(first16(n - m), pr + m));
        _mm512_storeu_ps(pfr + m, w);
        acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(dsr + m), acc);
      }
      const __m512 vd = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
      for (int64_t m = 0; m < np; m += 16) { /* dS = P (dP - sum P dP) inv_c */
        __m512 w = _mm512_loadu_ps(pfr + m);
        __m512 x = _mm512_mul_ps(w, _mm512_sub_ps(_mm512_loadu_ps(dsr + m), vd));
        _mm512_storeu_ps(dsr + m, _mm512_mul_ps(x, vic));
      }
      for (int64_t m = np; m < tp; m += 16) {
        _mm512_storeu_ps(pfr + m, _mm512_setzero_ps());
        _mm512_storeu_ps(dsr + m, _mm512_setzero_ps());
      }
    }
    blocks_times(ds, tp, kr, D, nq, D, nr, 1, dqf, D); /* dq = dS K */
    rows_bf16(dqf, nq, D, qrow, qi, dq, ldq);
    gemm(ds, 1, tp, qf, D, nk, nq, D, dka, D, 0);  /* dk = dS^T q */
    gemm(pf, 1, tp, gf, Dv, nk, nq, Dv, dva, Dv, 0); /* dv = P^T g */
  } else {
    memset(dka, 0, (size_t)(nk * D) * 4);
    memset(dva, 0, (size_t)(nk * Dv) * 4);
  }
  head_keys_out(krow, kj, nk, Tk, D, Dv, dka, dva, dk, dv, ldk);
}

/* 16 x 16 32-bit values transposed in registers */
AVX512BW static inline void t16x16(__m512i *r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

/* d (32 rows of stride ld) = the 32 x 32 block of s (rows of stride ls) transposed, its rows
   from n on (n < 32) read as zeros: each pair of s's rows made into words (even columns' values
   and odd columns' values), two 16 x 16 transposes of the words, and each of d's 32 rows one
   whole 64-byte store (d's row 2w holds, as its word i, rows 2i and 2i + 1 of column 2w) */
AVX512BW static inline void t32x32(const uint16_t *s, int64_t ls, int64_t n, uint16_t *d,
                                   int64_t ld) {
  const __m512i lo16 = _mm512_set1_epi32(0xffff), hi16 = _mm512_set1_epi32((int)0xffff0000u);
  const __m512i zero = _mm512_setzero_si512();
  __m512i e[16], o[16];
  for (int i = 0; i < 16; ++i) {
    const __m512i a = 2 * i < n ? _mm512_loadu_si512((const void *)(s + 2 * i * ls)) : zero;
    const __m512i b =
        2 * i + 1 < n ? _mm512_loadu_si512((const void *)(s + (2 * i + 1) * ls)) : zero;
    e[i] = _mm512_or_si512(_mm512_and_si512(a, lo16), _mm512_slli_epi32(b, 16));
    o[i] = _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, hi16));
  }
  t16x16(e);
  t16x16(o);
  for (int w = 0; w < 16; ++w) {
    _mm512_storeu_si512((void *)(d + 2 * w * ld), e[w]);
    _mm512_storeu_si512((void *)(d + (2 * w + 1) * ld), o[w]);
  }
}

/* transpose16 on AVX-512 (F, BW, VL): its whole 32 x 32 blocks by t32x32, each asking for the
   lines of the block PF_AHEAD to its right (s's to be read, d's to be written) while it is
   copied. In a W1 step the copies' inputs and outputs are not in the cache: there t8x8's
   16-byte stores (four calls to each 64-byte line of d) ran at 6-15 GB/s, read and written;
   the step's 76 copies took 48.9 ms, now 39.0 (a cold 3,888 x 512: 0.89 -> 0.45 ms; 32,000 x
   512: 6.3-10.5 -> 4.8-5.1 ms; docs/performance.md, "Round fifty-four"). A block 2, 4 or 8
   ahead: 40-47 ms. */
#define PF_AHEAD 1
AVX512BW int transpose16_wide(const uint16_t *s, uint16_t *d, int64_t rows, int64_t cols,
                              int64_t ls, int nthreads) {
  const int64_t T = 32, nr = (rows + T - 1) / T, nc = (cols + T - 1) / T;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
  for (int64_t bi = 0; bi < nr; ++bi)
    for (int64_t bj = 0; bj < nc; ++bj) {
      const int64_t i0 = bi * T, c0 = bj * T;
      if (i0 + T <= rows && c0 + T <= cols) {
        const int64_t cn = c0 + PF_AHEAD * T; /* a later block of the same rows of s */
        if (cn + T <= cols)
          for (int r = 0; r < 32; ++r) {
            _mm_prefetch((const char *)(s + (i0 + r) * ls + cn), _MM_HINT_T0);
            __builtin_prefetch((const char *)(d + (cn + r) * rows + i0), 1, 3);
            __builtin_prefetch((const char *)(d + (cn + r) * rows + i0) + 63, 1, 3);
          }
        t32x32(s + i0 * ls + c0, ls, T, d + c0 * rows + i0, rows);
      } else {
        tile16(s, ls, d, rows, cols, i0, c0);
      }
    }
  return 0;
}

/* ---- the same two heads' products on AMX: bf16 tiles, fp32 sums ---- */

/* Where the compiler knows AMX's intrinsics (gcc 11, clang 12 on). The products above run on
   AVX-512's fp32 lanes at ~100 GFLOP/s on two cores of the AMX Xeon; its tiles multiply bf16 at
   ~20x that, and AVX-512 BF16's dot products (no tiles: Zen 4, Zen 5) at ~2x the lanes' rate
   on a Zen 4. Each operand is an exact bf16 value either way (q, k, v, g, the bf16 weights P)
   and the sums are fp32 either way, in another order; dS, fp32, goes in as two bf16 parts
   (hi = bf16(dS), lo = bf16(dS - hi)): ~16 bits of its 24. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMXBW __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
/* AVX-512 BF16 without the tiles: VDPBF16PS's dot products and VCVTNEPS2BF16 (Zen 4 and 5 have
   them, and every AMX CPU) */
#define BF16BW __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
/* where the training attention's products run: 0 AVX-512's fp32 lanes, 1 AMX's tiles, 2 AVX-512
   BF16's dot products (`attention_bf16`) */
static int attn_bf16 = 0;
#endif

#ifdef HAVE_AMX
/* `narrow` by the CPU's own conversion (VCVTNEPS2BF16, AVX512-BF16: every AMX CPU, Zen 4 and
   5): one instruction where `narrow` takes seven, the same round to nearest even, but an fp32
   denormal (below 2^-126) taken as zero and a NaN's sign kept. The training attention's
   outputs in bf16 products (its weights P, out, dS's two parts, dq, dk, dv) round with it. */
BF16BW static inline __m256i narrow_hw(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
ROWS_BF16(rows_bf16_hw, BF16BW, narrow_hw)
HEAD_KEYS_OUT(head_keys_out_hw, BF16BW, narrow_hw)
#endif

/* AMX's tiles for this process: Linux grants them once asked (1), or not (0, as without AMX) */
int amx_permit(void) {
#ifdef HAVE_AMX
  static int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return 0;
#endif
}

/* Where the training attention's products run (`attn_bf16`): mode 1 asks for AMX's tiles, 2
   for AVX-512 BF16's dot products (the caller knows the CPU has them: every AMX CPU does), 0
   for the fp32 lanes; < 0: no change. Linux gives a process the tiles' state only when asked
   (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; oneDNN asks the same for its own
   products): the tiles refused, the dot products. Returns the mode now. */
int attention_bf16(int mode) {
#ifdef HAVE_AMX
  if (mode < 0) return attn_bf16;
  attn_bf16 = mode == 1 ? (amx_permit() ? 1 : 2) : mode == 2 ? 2 : 0;
  return attn_bf16;
#else
  (void)mode;
  return 0;
#endif
}

#ifdef HAVE_AMX
typedef uint32_t __attribute__((may_alias)) word32;
static inline int64_t up16(int64_t n) { return (n + 15) & ~(int64_t)15; }
static inline int64_t up32(int64_t n) { return (n + 31) & ~(int64_t)31; }

/* tiles 0-3 (C: 16 x 16 fp32), 4-5 (A: 16 x 32 bf16) and 6-7 (B: 16 x 16 bf16 pairs), this
   thread's until `amx_stop`; oneDNN configures its own for each of its products */
AMXBW static void amx_start(void) {
  struct {
    uint8_t palette, start_row, zero[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  /* not gcc 12's _tile_loadconfig, whose asm names only the first 8 bytes as read: the
     stores of the rest were dropped as dead */
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}
AMXBW static void amx_stop(void) { _tile_release(); }

/* C (M x N fp32, row stride ldc) = A B (+ A2 B), or C += that where acc: A, A2 (M x K bf16,
   row stride lda), B as pairs of its rows (K/2 rows of N words (b[2r][j], b[2r+1][j]), row
   stride ldb words); M and N multiples of 16, K of 32. In blocks of 2 x 2 tiles (four
   independent sums: one tile's chain of products waits on each product's latency). lim 1: a
   block's columns only to up16(its last row's keys, nr), lim 2: its sum only to up32 of them
   (the weights past them are zero); nr ascending. */
AMXBW static void amx_gemm(const uint16_t *A, const uint16_t *A2, int64_t lda, const word32 *B,
                           int64_t ldb, int64_t M, int64_t N, int64_t K, float *C, int64_t ldc,
                           const int64_t *nr, int64_t nq, int lim, int acc) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;
  for (int64_t m = 0; m < M; m += 32) {
    const int rows2 = m + 16 < M;
    int64_t n1 = N, k1 = K;
    if (lim) {
      const int64_t last = m + (rows2 ? 31 : 15);
      const int64_t keys = nr[last < nq ? last : nq - 1];
      if (lim == 1) n1 = up16(keys);
      else k1 = up32(keys);
    }
    const uint16_t *a = A + m * lda, *a2 = A2 ? A2 + m * lda : NULL;
    float *c = C + m * ldc;
    for (int64_t n = 0; n < n1; n += 32) {
      const int cols2 = n + 16 < n1;
      if (acc) {
        _tile_loadd(0, c + n, sc);
        if (cols2) _tile_loadd(1, c + n + 16, sc);
        if (rows2) {
          _tile_loadd(2, c + 16 * ldc + n, sc);
          if (cols2) _tile_loadd(3, c + 16 * ldc + n + 16, sc);
        }
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k = 0; k < k1; k += 32) {
        const word32 *b = B + (k / 2) * ldb + n;
        _tile_loadd(6, b, sb);
        if (cols2) _tile_loadd(7, b + 16, sb);
        for (int part = 0; part < (a2 ? 2 : 1); ++part) {
          const uint16_t *ap = (part ? a2 : a) + k;
          _tile_loadd(4, ap, sa);
          _tile_dpbf16ps(0, 4, 6);
          if (cols2) _tile_dpbf16ps(1, 4, 7);
          if (rows2) {
            _tile_loadd(5, ap + 16 * lda, sa);
            _tile_dpbf16ps(2, 5, 6);
            if (cols2) _tile_dpbf16ps(3, 5, 7);
          }
        }
      }
      _tile_stored(0, c + n, sc);
      if (cols2) _tile_stored(1, c + n + 16, sc);
      if (rows2) {
        _tile_stored(2, c + 16 * ldc + n, sc);
        if (cols2) _tile_stored(3, c + 16 * ldc + n + 16, sc);
      }
    }
  }
}

/* C[4 rows, 16 U columns] = A B (+ A2 B) on AVX-512 BF16's dot products, A and A2 (row stride
   lda) bf16, B as amx_gemm's pairs (row stride ldb words), over the first K values of the sum
   (K even): VDPBF16PS adds to each fp32 lane the products of a pair (A's two values broadcast,
   B's word), 4 x U sums in registers, each B vector read once for the 4 rows. The sums' order
   is the lanes' own: pair by pair, A's part then A2's. */
#define DOT_TILE(U)                                                                          \
  BF16BW static void dot4x##U(const uint16_t *A, const uint16_t *A2, int64_t lda,             \
                              const word32 *B, int64_t ldb, int64_t K, float *C,              \
                              int64_t ldc) {                                                  \
    __m512 c[4][U];                                                                          \
    for (int r = 0; r < 4; ++r)                                                              \
      for (int u = 0; u < U; ++u) c[r][u] = _mm512_setzero_ps();                             \
    for (int64_t k = 0; k < K; k += 2, B += ldb) {                                           \
      __m512bh b[U];                                                                         \
      for (int u = 0; u < U; ++u)                                                            \
        b[u] = (__m512bh)_mm512_loadu_si512((const void *)(B + 16 * u));                     \
      for (int r = 0; r < 4; ++r) {                                                          \
        const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const word32 *)(A + r * lda + k));  \
        for (int u = 0; u < U; ++u) c[r][u] = _mm512_dpbf16_ps(c[r][u], a, b[u]);            \
        if (A2) {                                                                            \
          const __m512bh a2 =                                                                \
              (__m512bh)_mm512_set1_epi32(*(const word32 *)(A2 + r * lda + k));              \
          for (int u = 0; u < U; ++u) c[r][u] = _mm512_dpbf16_ps(c[r][u], a2, b[u]);         \
        }                                                                                    \
      }                                                                                      \
    }                                                                                        \
    for (int r = 0; r < 4; ++r)                                                              \
      for (int u = 0; u < U; ++u) _mm512_storeu_ps(C + r * ldc + 16 * u, c[r][u]);           \
  }
DOT_TILE(1) DOT_TILE(2) DOT_TILE(3) DOT_TILE(4)
typedef void (*dot_tile)(const uint16_t *, const uint16_t *, int64_t, const word32 *, int64_t,
                         int64_t, float *, int64_t);
static const dot_tile DOT_TILES[4] = {dot4x1, dot4x2, dot4x3, dot4x4};

/* amx_gemm's C = A B (+ A2 B) on the dot products (`dot4x`), for the M rows, N columns and K
   sums the caller reads and has (C's rows from up4(M), columns from up16(N) not written; the
   operands as amx_gemm's, padded with zeros at least to up4 rows and up16 columns, K to even);
   lim as amx_gemm's but per block of 4 rows, the sum to the last row's keys rounded to even */
BF16BW static void dot_gemm(const uint16_t *A, const uint16_t *A2, int64_t lda, const word32 *B,
                            int64_t ldb, int64_t M, int64_t N, int64_t K, float *C,
                            int64_t ldc, const int64_t *nr, int64_t nq, int lim) {
  for (int64_t m = 0; m < M; m += 4) {
    int64_t n1 = up16(N), k1 = (K + 1) & ~(int64_t)1;
    if (lim) {
      const int64_t keys = nr[m + 3 < nq ? m + 3 : nq - 1];
      if (lim == 1) n1 = up16(keys);
      else k1 = (keys + 1) & ~(int64_t)1;
    }
    for (int64_t n = 0; n < n1; n += 64)
      DOT_TILES[(n1 - n < 64 ? (n1 - n) / 16 : 4) - 1](A + m * lda, A2 ? A2 + m * lda : NULL,
                                                       lda, B + n, ldb, k1, C + m * ldc + n,
                                                       ldc);
  }
}

/* the training attention's C = A B (+ A2 B), as amx_gemm's (acc 0), on the bf16 products this
   process takes (`attn_bf16`): for the M rows, N columns and K sums the caller reads and has,
   the operands padded with zeros to up16(M) rows, up16(N) columns and up32(K), as the tiles
   read them (the dot products read less) */
BF16BW static void bf16_gemm(const uint16_t *A, const uint16_t *A2, int64_t lda,
                             const word32 *B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                             float *C, int64_t ldc, const int64_t *nr, int64_t nq, int lim) {
  if (attn_bf16 == 1)
    amx_gemm(A, A2, lda, B, ldb, up16(M), up16(N), up32(K), C, ldc, nr, nq, lim, 0);
  else
    dot_gemm(A, A2, lda, B, ldb, M, N, K, C, ldc, nr, nq, lim);
}

/* x's rows rows[sel[m]] (m < n, D bf16 values) as M rows of W (zeros past D and past n) */
static void rows_pad(const uint16_t *x, int64_t ld, const int64_t *rows, const int64_t *sel,
                     int64_t n, int64_t M, int64_t D, int64_t W, uint16_t *r) {
  for (int64_t m = 0; m < M; ++m) {
    uint16_t *rr = r + m * W;
    if (m < n) {
      memcpy(rr, x + rows[sel[m]] * ld, (size_t)D * 2);
      memset(rr + D, 0, (size_t)(W - D) * 2);
    } else {
      memset(rr, 0, (size_t)W * 2);
    }
  }
}

/* the same rows' words (pairs of values) transposed: t (W/2, N), t[r][m] = row m's values
   2r, 2r + 1; zeros past n and past D: B = x^T in pairs, for a product A x^T (N a multiple
   of 16, D of 16, W of 32); rows NULL: x's first n rows in order */
BF16BW static void words_t(const uint16_t *x, int64_t ld, const int64_t *rows,
                           const int64_t *sel, int64_t n, int64_t N, int64_t D, int64_t W,
                           word32 *t) {
  __m512i r[16];
  for (int64_t m0 = 0; m0 < N; m0 += 16)
    for (int64_t w0 = 0; w0 < D / 2; w0 += 16) {
      const __mmask16 in = w0 + 16 <= D / 2 ? 0xffff : 0xff; /* D / 2: a multiple of 8 */
      for (int i = 0; i < 16; ++i)
        r[i] = m0 + i < n ? _mm512_maskz_loadu_epi32(
                                in, x + (rows ? rows[sel[m0 + i]] : m0 + i) * ld + 2 * w0)
                          : _mm512_setzero_si512();
      t16x16(r);
      for (int i = 0; i < (in == 0xffff ? 16 : 8); ++i)
        _mm512_storeu_si512((void *)(t + (w0 + i) * N + m0), r[i]);
    }
  memset(t + D / 2 * N, 0, (size_t)((W - D) / 2 * N) * 4);
}

/* the same rows two by two: t (K2/2, D) words, t[r][e] = (row 2r's e-th, row 2r+1's e-th);
   zero rows past n: B = x in pairs, for a product A x (D a multiple of 16) */
BF16BW static void pairs(const uint16_t *x, int64_t ld, const int64_t *rows, const int64_t *sel,
                         int64_t n, int64_t K2, int64_t D, word32 *t) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t r = 0; r < K2 / 2; ++r) {
    const uint16_t *a = 2 * r < n ? x + rows[sel[2 * r]] * ld : NULL;
    const uint16_t *b = 2 * r + 1 < n ? x + rows[sel[2 * r + 1]] * ld : NULL;
    for (int64_t e = 0; e < D; e += 16) {
      __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + e))) : zero;
      __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + e))) : zero;
      _mm512_storeu_si512((void *)(t + r * D + e), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

/* d (C x Rp, row stride ldd) = s's first Rp rows transposed (s: rows of stride lds, C 16-bit
   values each), its rows from R on as zeros; Rp and C multiples of 32: t32x32's blocks */
BF16BW static void t16_rows(const uint16_t *s, int64_t lds, int64_t R, int64_t Rp, int64_t C,
                            uint16_t *d, int64_t ldd) {
  for (int64_t i0 = 0; i0 < Rp; i0 += 32)
    for (int64_t j0 = 0; j0 < C; j0 += 32)
      t32x32(i0 < R ? s + i0 * lds + j0 : s, lds, R - i0, d + j0 * ldd + i0, ldd);
}

/* a batch row's legal keys (kj[0 .. *nk)) and packed queries (kj + Tk: their positions, kj + Tk
   + Tq: their counts of legal keys; *nq of them), as `legal_keys` and `packed_queries`: the
   bf16 products' drivers share them across the row's heads */
static void batch_lists(const int64_t *qrow, const int64_t *krow, const uint8_t *kmask,
                        int causal, int64_t Tq, int64_t Tk, int64_t *kj, int64_t *nk,
                        int64_t *nq) {
  *nk = legal_keys(krow, kmask, Tk, kj);
  *nq = packed_queries(qrow, Tq, kj, *nk, causal, kj + Tk, kj + Tk + Tq);
}

/* `attn_fwd_head` with bf16 products (`bf16_gemm`: the same softmax, the same outputs), given
   the batch row's lists (`batch_lists`: kj, qi, nr; nk keys, nq queries). Scratch: qa (up32(Tq),
   up32(D)) bf16, kb (up32(D) / 2, up32(Tk)) words, s (up32(Tq), up32(Tk)), o (up32(Tq), Dv)
   floats, pa (up32(Tq), up32(Tk)) bf16, vb (up32(Tk) / 2, Dv) words. */
BF16BW static void attn_fwd_head_bf16(const uint16_t *q, int64_t lq, const uint16_t *k,
                                      const uint16_t *v, int64_t lk, const int64_t *qrow,
                                      const int64_t *krow, int64_t Tq, int64_t Tk, int64_t D,
                                      int64_t Dv, float inv_c, uint16_t *out, int64_t lo,
                                      uint16_t *p, uint16_t *qa, word32 *kb, float *s, float *o,
                                      uint16_t *pa, word32 *vb,
                                      const int64_t *kj, const int64_t *qi, const int64_t *nr,
                                      int64_t nk, int64_t nq) {
  memset(p, 0, (size_t)(Tq * Tk) * 2);
  if (nq == 0) return;
  const int64_t M = up16(nq), N = up16(nk), K2 = up32(nk), Dp = up32(D);
  rows_pad(q, lq, qrow, qi, nq, M, D, Dp, qa);
  words_t(k, lk, krow, kj, nk, N, D, Dp, kb);
  bf16_gemm(qa, NULL, Dp, kb, N, nq, nk, D, s, N, nr, nq, 1); /* scores */
  for (int64_t c0 = 0; c0 < M; c0 += 16) { /* 16 rows' softmax at once (`exp_rows16`) */
    int64_t n16[16];
    for (int r = 0; r < 16; ++r) n16[r] = c0 + r < nq ? nr[c0 + r] : 0;
    const __m512 inv = exp_rows16(s + c0 * N, N, n16, inv_c);
    for (int r = 0; r < 16; ++r) {
      const int64_t c = c0 + r, n = n16[r], np = up16(n);
      const float *sr = s + c * N;
      uint16_t *par = pa + c * K2;
      const __m512 vs1 = lane_all(inv, ROW_LANE(r));
      for (int64_t m = 0; m < np; m += 16) {
        __m256i w = narrow_hw(_mm512_mul_ps(_mm512_loadu_ps(sr + m), vs1));
        _mm256_storeu_si256((__m256i *)(par + m), w); /* zeros past n */
        _mm256_mask_storeu_epi16(p + qi[c] * Tk + m, first16(n - m), w);
      }
      for (int64_t m = np; m < K2; m += 16)
        _mm256_storeu_si256((__m256i *)(par + m), _mm256_setzero_si256());
    }
  }
  pairs(v, lk, krow, kj, nk, K2, Dv, vb);
  bf16_gemm(pa, NULL, K2, vb, Dv, nq, Dv, nk, o, Dv, nr, nq, 2); /* P V */
  rows_bf16_hw(o, nq, Dv, qrow, qi, out, lo);
}

/* `attn_bwd_head` with bf16 products, given the batch row's lists as
   `attn_fwd_head_bf16`. Scratch: ga (up32(Tq), up32(Dv)) bf16, vt
   (up32(Dv) / 2, up32(Tk)) words, dp (up32(Tq), up32(Tk)) floats, dsh, dsl, pb (up32(Tq),
   up32(Tk)) and dth, dtl, pt (up32(Tk), up32(Tq)) bf16, kp (up32(Tk) / 2, D), qp (up32(Tq) / 2,
   D), gp (up32(Tq) / 2, Dv) words, dqf (up32(Tq), D), dka (up32(Tk), D), dva (up32(Tk), Dv)
   floats. */
BF16BW static void attn_bwd_head_bf16(const uint16_t *g, int64_t lg, const uint16_t *q,
                                      int64_t lq, const uint16_t *k, const uint16_t *v, int64_t lk,
                                      const int64_t *qrow, const int64_t *krow, int64_t Tk,
                                      int64_t D, int64_t Dv, float inv_c, const uint16_t *p,
                                      uint16_t *dq, int64_t ldq, uint16_t *dk, uint16_t *dv,
                                      int64_t ldk, uint16_t *ga, word32 *vt, float *dp,
                                      uint16_t *dsh, uint16_t *dsl, uint16_t *pb, uint16_t *dth,
                                      uint16_t *dtl, uint16_t *pt, word32 *kp, word32 *qp,
                                      word32 *gp, float *dqf, float *dka, float *dva,
                                      const int64_t *kj, const int64_t *qi, const int64_t *nr,
                                      int64_t nk, int64_t nq) {
  const int64_t N = up16(nk);
  if (nq) {
    const int64_t M = up16(nq), M2 = up32(nq), K2 = up32(nk), Dvp = up32(Dv);
    rows_pad(g, lg, qrow, qi, nq, M, Dv, Dvp, ga);
    words_t(v, lk, krow, kj, nk, N, Dv, Dvp, vt);
    bf16_gemm(ga, NULL, Dvp, vt, N, nq, nk, Dv, dp, N, nr, nq, 1); /* dP = g V^T */
    const __m512 vic = _mm512_set1_ps(inv_c);
    for (int64_t c = 0; c < M2; ++c) {
      const int64_t n = c < nq ? nr[c] : 0, np = up16(n);
      const uint16_t *pr = c < nq ? p + qi[c] * Tk : NULL;
      float *dpr = dp + c * N;
      uint16_t *hr = dsh + c * K2, *lr = dsl + c * K2, *wr = pb + c * K2;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t m = 0; m < np; m += 16) {
        __m512 w = widen(_mm256_maskz_loadu_epi16(first16(n - m), pr + m));
        acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(dpr + m), acc);
      }
      const __m512 vd = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
      for (int64_t m = 0; m < np; m += 16) { /* dS = P (dP - sum P dP) inv_c, as two bf16 */
        __m256i wb = _mm256_maskz_loadu_epi16(first16(n - m), pr + m);
        __m512 w = widen(wb);
        __m512 x = _mm512_mul_ps(w, _mm512_sub_ps(_mm512_loadu_ps(dpr + m), vd));
        x = _mm512_mul_ps(x, vic);
        __m256i h = narrow_hw(x);
        _mm256_storeu_si256((__m256i *)(hr + m), h);
        _mm256_storeu_si256((__m256i *)(lr + m), narrow_hw(_mm512_sub_ps(x, widen(h))));
        _mm256_storeu_si256((__m256i *)(wr + m), wb);
      }
      for (int64_t m = np; m < K2; m += 16) {
        _mm256_storeu_si256((__m256i *)(hr + m), _mm256_setzero_si256());
        _mm256_storeu_si256((__m256i *)(lr + m), _mm256_setzero_si256());
        _mm256_storeu_si256((__m256i *)(wr + m), _mm256_setzero_si256());
      }
    }
    pairs(k, lk, krow, kj, nk, K2, D, kp);
    bf16_gemm(dsh, dsl, K2, kp, D, nq, D, nk, dqf, D, nr, nq, 2); /* dq = dS K */
    rows_bf16_hw(dqf, nq, D, qrow, qi, dq, ldq);
    t16_rows(dsh, K2, M2, M2, K2, dth, M2);
    t16_rows(dsl, K2, M2, M2, K2, dtl, M2);
    t16_rows(pb, K2, M2, M2, K2, pt, M2);
    pairs(q, lq, qrow, qi, nq, M2, D, qp);
    pairs(g, lg, qrow, qi, nq, M2, Dv, gp);
    bf16_gemm(dth, dtl, M2, qp, D, nk, D, nq, dka, D, NULL, 0, 0); /* dk = dS^T q */
    bf16_gemm(pt, NULL, M2, gp, Dv, nk, Dv, nq, dva, Dv, NULL, 0, 0); /* dv = P^T g */
  } else {
    memset(dka, 0, (size_t)(nk * D) * 4);
    memset(dva, 0, (size_t)(nk * Dv) * 4);
  }
  head_keys_out_hw(krow, kj, nk, Tk, D, Dv, dka, dva, dk, dv, ldk);
}
#endif

/* A hint to bring a batch row's packed rows (n bytes each from x, stride ld elements) into L2:
   the next batch row's, whole rows in order (the per-head hints fetch 128 scattered bytes a
   row, one stall each); write 1: lines about to be written. Only the rows i = part (mod
   parts): one head's share (`prefetch_batch_row`). */
static void prefetch_l2(const uint16_t *x, int64_t ld, const int64_t *rows, int64_t T,
                        int64_t n, int write, int64_t part, int64_t parts) {
  for (int64_t i = part; i < T; i += parts)
    if (rows[i] >= 0)
      for (int64_t off = 0; off < n; off += 64) {
        if (write)
          __builtin_prefetch((const char *)(x + rows[i] * ld) + off, 1, 2);
        else
          _mm_prefetch((const char *)(x + rows[i] * ld) + off, _MM_HINT_T1);
      }
}

/* the hints for a thread's next batch row (b + the thread count: OpenMP hands out whole batch
   rows in turn; qrow, krow point at its rows): its rows of q, k, v (and g), to be read, of
   out (dq, dk, dv) and its weights p, to be written (read in the backward). Head `part` of
   this batch row asks for the part-th of H shares (every H-th row, one head's weights): the
   ~2,500 lines at once, at the first head, were mostly not there when asked for on a Zen 4
   (the kernel at the W1 batch's heads, one thread: 32.1 / 59.0 -> 21.9-25.7 / 46.0-51.9 us a
   batch row, forward / backward; docs/performance.md, "Round sixty-five"). */
static void prefetch_batch_row(const uint16_t *q, int64_t lq, const uint16_t *k,
                               const uint16_t *v, int64_t lk, const uint16_t *g, int64_t lg,
                               const int64_t *qrow, const int64_t *krow, int64_t Tq,
                               int64_t Tk, int64_t H, int64_t D, int64_t Dv, const uint16_t *p,
                               int p_write, uint16_t *out, int64_t lo, uint16_t *dk,
                               uint16_t *dv, int64_t ldk, int64_t part) {
  prefetch_l2(q, lq, qrow, Tq, H * D * 2, 0, part, H);
  prefetch_l2(k, lk, krow, Tk, H * D * 2, 0, part, H);
  prefetch_l2(v, lk, krow, Tk, H * Dv * 2, 0, part, H);
  if (g) prefetch_l2(g, lg, qrow, Tq, H * Dv * 2, 0, part, H);
  for (int64_t off = part * Tq * Tk * 2; off < (part + 1) * Tq * Tk * 2; off += 64) {
    if (p_write)
      __builtin_prefetch((const char *)p + off, 1, 2);
    else
      _mm_prefetch((const char *)p + off, _MM_HINT_T1);
  }
  prefetch_l2(out, lo, qrow, Tq, H * (g ? D : Dv) * 2, 1, part, H); /* out, or dq */
  if (dk) {
    prefetch_l2(dk, ldk, krow, Tk, H * D * 2, 1, part, H);
    prefetch_l2(dv, ldk, krow, Tk, H * Dv * 2, 1, part, H);
  }
}

/* A hint to bring rows[i]'s D bf16 values from x (stride ld) into L1, for i < n (-1: none):
   the next head's, while this one is computed (its rows are scattered: one stall each) */
static void prefetch_rows(const uint16_t *x, int64_t ld, const int64_t *rows, int64_t n,
                          int64_t D) {
  for (int64_t i = 0; i < n; ++i)
    if (rows[i] >= 0)
      for (int64_t off = 0; off < D * 2; off += 64)
        _mm_prefetch((const char *)(x + rows[i] * ld) + off, _MM_HINT_T0);
}

/* the same for head h's query, key and value rows of one batch row */
static void prefetch_head(const uint16_t *q, int64_t lq, const uint16_t *k, const uint16_t *v,
                          int64_t lk, const int64_t *qrow, const int64_t *krow, int64_t Tq,
                          int64_t Tk, int64_t D, int64_t Dv, int64_t h) {
  prefetch_rows(q + h * D, lq, qrow, Tq, D);
  prefetch_rows(k + h * D, lk, krow, Tk, D);
  prefetch_rows(v + h * Dv, lk, krow, Tk, Dv);
}

#ifdef HAVE_AMX
/* bytes of `n` values of `size` each, rounded up to whole 64-byte lines */
static inline size_t line_bytes(int64_t n, int64_t size) {
  return ((size_t)(n * size) + 63) & ~(size_t)63;
}

/* one block of 64-byte lines for n scratch parts of these sizes (each whole lines), part[i]
   the i-th; NULL where there is no memory */
static char *carve(const size_t *sizes, int n, char **part) {
  size_t total = 0;
  for (int i = 0; i < n; ++i) total += sizes[i];
  char *block = aligned_alloc(64, total);
  part[0] = block;
  for (int i = 1; i < n; ++i) part[i] = part[i - 1] + sizes[i - 1];
  return block;
}

#endif

/* The (B x H) heads shared out among nthreads OpenMP threads. q: packed rows of stride lq, head
   h's D values at column h D; k and v: rows of stride lk, head h's at columns h D of k and h Dv
   of v (k and v may be one tensor's two halves); qrow (B, Tq), krow (B, Tk): packed row or -1;
   kmask (B, Tk) bytes or NULL; out: rows of stride lo, head h's at h Dv; p: (B, H, Tq, Tk) bf16.
   D and Dv multiples of 16. Returns -1 where scratch could not be had. */
int attention_train_fwd(const uint16_t *q, int64_t lq, const uint16_t *k, const uint16_t *v,
                        int64_t lk, const int64_t *qrow, const int64_t *krow,
                        const uint8_t *kmask, int causal, int64_t B, int64_t H, int64_t Tq,
                        int64_t Tk, int64_t D, int64_t Dv, float inv_c, uint16_t *out,
                        int64_t lo, uint16_t *p, int nthreads) {
  const int64_t tp = (Tk + 15) & ~(int64_t)15;
  int failed = 0;
#ifdef HAVE_AMX
  const int bf16 = attn_bf16; /* the products in bf16 (tiles or dot products): their parts */
  const int64_t TQ = up32(Tq), TK = up32(Tk), Dp = up32(D);
  const size_t sizes[6] = {line_bytes(TQ * Dp, 2), line_bytes(Dp / 2 * TK, 4),
                           line_bytes(TQ * TK, 4), line_bytes(TQ * Dv, 4),
                           line_bytes(TQ * TK, 2), line_bytes(TK / 2 * Dv, 4)};
#endif
#pragma omp parallel num_threads(nthreads)
  {
    void *scratch; /* the fp32 lanes' floats, or the bf16 products' parts */
#ifdef HAVE_AMX
    char *part[6];
    if (bf16) {
      scratch = carve(sizes, 6, part);
      if (bf16 == 1) amx_start();
    } else
#endif
      scratch = malloc((size_t)(D * tp + Tk * Dv + Tq * D + Tq * tp + Tq * Dv) * 4);
    int64_t *kj = malloc((size_t)(Tk + 2 * Tq) * 8);
#ifdef HAVE_AMX
    int64_t listed = -1, nk = 0, nq = 0; /* the batch row whose lists kj, qi, nr hold */
#endif
#pragma omp for schedule(dynamic, H)
    for (int64_t r = 0; r < B * H; ++r) {
      if (!scratch || !kj) {
        failed = 1;
        continue;
      }
      const int64_t b = r / H, h = r % H;
      if (b + nthreads < B)
        prefetch_batch_row(q, lq, k, v, lk, NULL, 0, qrow + (b + nthreads) * Tq,
                           krow + (b + nthreads) * Tk, Tq, Tk, H, D, Dv,
                           p + (b + nthreads) * H * Tq * Tk, 1, out, lo, NULL, NULL, 0, h);
      if (h + 1 < H)
        prefetch_head(q, lq, k, v, lk, qrow + b * Tq, krow + b * Tk, Tq, Tk, D, Dv, h + 1);
#ifdef HAVE_AMX
      if (bf16) {
        if (b != listed) { /* a batch row's heads share its lists: a thread has them in turn */
          batch_lists(qrow + b * Tq, krow + b * Tk, kmask ? kmask + b * Tk : NULL, causal, Tq,
                      Tk, kj, &nk, &nq);
          listed = b;
        }
        attn_fwd_head_bf16(q + h * D, lq, k + h * D, v + h * Dv, lk, qrow + b * Tq,
                           krow + b * Tk, Tq, Tk, D, Dv, inv_c, out + h * Dv, lo,
                           p + r * Tq * Tk, (uint16_t *)part[0], (word32 *)part[1],
                           (float *)part[2], (float *)part[3], (uint16_t *)part[4],
                           (word32 *)part[5], kj, kj + Tk, kj + Tk + Tq, nk, nq);
        continue;
      }
#endif
      float *kt = scratch, *vs = kt + D * tp, *qf = vs + Tk * Dv, *s = qf + Tq * D;
      attn_fwd_head(q + h * D, lq, k + h * D, v + h * Dv, lk, qrow + b * Tq, krow + b * Tk,
                    kmask ? kmask + b * Tk : NULL, causal, Tq, Tk, D, Dv, inv_c, out + h * Dv,
                    lo, p + r * Tq * Tk, kt, vs, qf, s, s + Tq * tp, kj, kj + Tk, kj + Tk + Tq);
    }
#ifdef HAVE_AMX
    if (bf16 == 1) amx_stop();
#endif
    free(scratch);
    free(kj);
  }
  return failed ? -1 : 0;
}

/* its gradient: g as out; dq as q (stride ldq); dk, dv as k, v (stride ldk) */
int attention_train_bwd(const uint16_t *g, int64_t lg, const uint16_t *q, int64_t lq,
                        const uint16_t *k, const uint16_t *v, int64_t lk, const int64_t *qrow,
                        const int64_t *krow, const uint8_t *kmask, int causal, int64_t B,
                        int64_t H, int64_t Tq, int64_t Tk, int64_t D, int64_t Dv, float inv_c,
                        const uint16_t *p, uint16_t *dq, int64_t ldq, uint16_t *dk,
                        uint16_t *dv, int64_t ldk, int nthreads) {
  const int64_t tp = (Tk + 15) & ~(int64_t)15;
  int failed = 0;
#ifdef HAVE_AMX
  const int bf16 = attn_bf16; /* the products in bf16 (tiles or dot products): their parts */
  const int64_t TQ = up32(Tq), TK = up32(Tk), Dvp = up32(Dv);
  const size_t sizes[15] = {
      line_bytes(TQ * Dvp, 2), line_bytes(Dvp / 2 * TK, 4), line_bytes(TQ * TK, 4),
      line_bytes(TQ * TK, 2),  line_bytes(TQ * TK, 2),      line_bytes(TQ * TK, 2),
      line_bytes(TK * TQ, 2),  line_bytes(TK * TQ, 2),      line_bytes(TK * TQ, 2),
      line_bytes(TK / 2 * D, 4), line_bytes(TQ / 2 * D, 4), line_bytes(TQ / 2 * Dv, 4),
      line_bytes(TQ * D, 4),   line_bytes(TK * D, 4),       line_bytes(TK * Dv, 4)};
#endif
#pragma omp parallel num_threads(nthreads)
  {
    void *scratch; /* the fp32 lanes' floats, or the bf16 products' parts */
#ifdef HAVE_AMX
    char *t[15];
    if (bf16) {
      scratch = carve(sizes, 15, t);
      if (bf16 == 1) amx_start();
    } else
#endif
      scratch = malloc((size_t)(2 * Tk * D + Dv * tp + 2 * Tq * D + Tq * Dv + 2 * Tq * tp +
                                Tk * Dv) * 4);
    int64_t *kj = malloc((size_t)(Tk + 2 * Tq) * 8);
#ifdef HAVE_AMX
    int64_t listed = -1, nk = 0, nq = 0; /* the batch row whose lists kj, qi, nr hold */
#endif
#pragma omp for schedule(dynamic, H)
    for (int64_t r = 0; r < B * H; ++r) {
      if (!scratch || !kj) {
        failed = 1;
        continue;
      }
      const int64_t b = r / H, h = r % H;
      if (b + nthreads < B)
        prefetch_batch_row(q, lq, k, v, lk, g, lg, qrow + (b + nthreads) * Tq,
                           krow + (b + nthreads) * Tk, Tq, Tk, H, D, Dv,
                           p + (b + nthreads) * H * Tq * Tk, 0, dq, ldq, dk, dv, ldk, h);
      if (h + 1 < H) {
        prefetch_rows(g + (h + 1) * Dv, lg, qrow + b * Tq, Tq, Dv);
        prefetch_head(q, lq, k, v, lk, qrow + b * Tq, krow + b * Tk, Tq, Tk, D, Dv, h + 1);
      }
#ifdef HAVE_AMX
      if (bf16) {
        if (b != listed) {
          batch_lists(qrow + b * Tq, krow + b * Tk, kmask ? kmask + b * Tk : NULL, causal, Tq,
                      Tk, kj, &nk, &nq);
          listed = b;
        }
        attn_bwd_head_bf16(g + h * Dv, lg, q + h * D, lq, k + h * D, v + h * Dv, lk,
                           qrow + b * Tq, krow + b * Tk, Tk, D, Dv, inv_c, p + r * Tq * Tk,
                           dq + h * D, ldq, dk + h * D, dv + h * Dv, ldk, (uint16_t *)t[0],
                           (word32 *)t[1], (float *)t[2],
                           (uint16_t *)t[3], (uint16_t *)t[4], (uint16_t *)t[5],
                           (uint16_t *)t[6], (uint16_t *)t[7], (uint16_t *)t[8], (word32 *)t[9],
                           (word32 *)t[10], (word32 *)t[11], (float *)t[12], (float *)t[13],
                           (float *)t[14], kj, kj + Tk, kj + Tk + Tq, nk, nq);
        continue;
      }
#endif
      float *kr = scratch, *vt = kr + Tk * D, *qf = vt + Dv * tp, *gf = qf + Tq * D;
      float *pf = gf + Tq * Dv, *ds = pf + Tq * tp, *dqf = ds + Tq * tp, *dka = dqf + Tq * D;
      attn_bwd_head(g + h * Dv, lg, q + h * D, lq, k + h * D, v + h * Dv, lk, qrow + b * Tq,
                    krow + b * Tk, kmask ? kmask + b * Tk : NULL, causal, Tq, Tk, D, Dv, inv_c,
                    p + r * Tq * Tk, dq + h * D, ldq, dk + h * D, dv + h * Dv, ldk, kr, vt, qf,
                    gf, pf, ds, dqf, dka, dka + Tk * D, kj, kj + Tk, kj + Tk + Tq);
    }
#ifdef HAVE_AMX
    if (bf16 == 1) amx_stop();
#endif
    free(scratch);
    free(kj);
  }
  return failed ? -1 : 0;
}

/* ---- a linear layer's weight gradient on AMX: dW = g^T x over the rows ---- */

#ifdef HAVE_AMX

/* t (R x N words) = x's first 2R rows (stride ldx) in pairs, t[r][j] = (x[2r][j], x[2r + 1][j]),
   its rows from K on as zeros; N a multiple of 16 */
AMXBW static void pairs_rows(const uint16_t *x, int64_t ldx, int64_t K, int64_t R, int64_t N,
                             word32 *t) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t *a = 2 * r < K ? x + 2 * r * ldx : NULL;
    const uint16_t *b = 2 * r + 1 < K ? x + (2 * r + 1) * ldx : NULL;
    for (int64_t e = 0; e < N; e += 16) {
      const __m512i lo =
          a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + e))) : zero;
      const __m512i hi =
          b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + e))) : zero;
      _mm512_storeu_si512((void *)(t + r * N + e), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

/* d (M x N bf16, row stride ldd) = c + c2 (M x N fp32 each) rounded; N a multiple of 16 */
AMXBW static void sums2_bf16(const float *c, const float *c2, int64_t M, int64_t N, uint16_t *d,
                             int64_t ldd) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < N; j += 16)
      _mm256_storeu_si256(
          (__m256i *)(d + m * ldd + j),
          narrow(_mm512_add_ps(_mm512_loadu_ps(c + m * N + j), _mm512_loadu_ps(c2 + m * N + j))));
}
#endif

/* dW (M x N bf16, row stride ldo) = g^T x, the sum over K rows: g (K x M) and x (K x N) bf16
   rows of strides ldg and ldx; M a multiple of 32, N of 16. oneDNN runs this shape (K long, M
   and N short) at about half its rate for the others: from the transposed view g^T, and from a
   row-major copy on one of its two threads. The rows go in two halves, each summed on its own
   in fp32 by a thread (or a team, each member some of dW's rows), KC rows at a time: that block
   of g's columns transposed and of x's rows in pairs, in the thread's own scratch while L2
   holds them; then dW = bf16(half 1 + half 2), so the bits are the same on any number of
   threads. -1: no scratch, -2: no tiles. */
int weight_grad_amx(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx, int64_t K,
                    int64_t M, int64_t N, uint16_t *out, int64_t ldo, int nthreads) {
#ifdef HAVE_AMX
  enum { KC = 256 }; /* A and B 256 KB each at M = N = 512, beside the half's 1 MB of sums */
  if (!amx_permit()) return -2;
  const int64_t chunks = (K + KC - 1) / KC, blocks = M / 32;
  const int T = nthreads >= 2 ? nthreads & ~1 : 1, teams = T >= 2 ? T / 2 : 1;
  float *c = aligned_alloc(64, line_bytes(2 * M * N, 4));
  if (!c) return -1;
  int failed = 0;
#pragma omp parallel num_threads(T)
  {
    const int t = omp_get_thread_num();
    const int64_t i = T >= 2 ? t / 2 : 0;
    const int64_t m0 = blocks * i / teams * 32, m1 = blocks * (i + 1) / teams * 32;
    uint16_t *a = aligned_alloc(64, line_bytes((m1 - m0) * KC, 2));
    word32 *b = aligned_alloc(64, line_bytes(KC / 2 * N, 4));
    if (m1 > m0 && (!a || !b)) {
      failed = 1;
    } else if (m1 > m0) { /* (a team of 4 or more threads may have no rows at M = 32) */
      amx_start();
      for (int half = T >= 2 ? t % 2 : 0; half < 2; half += T >= 2 ? 2 : 1) {
        const int64_t c0 = chunks * half / 2, c1 = chunks * (half + 1) / 2;
        float *ch = c + half * M * N + m0 * N;
        if (c1 == c0) memset(ch, 0, (size_t)((m1 - m0) * N) * 4);
        for (int64_t j = c0; j < c1; ++j) {
          const int64_t k0 = j * KC, kv = K - k0 < KC ? K - k0 : KC, kc = up32(kv);
          t16_rows(g + k0 * ldg + m0, ldg, kv, kc, m1 - m0, a, kc);
          pairs_rows(x + k0 * ldx, ldx, kv, kc / 2, N, b);
          amx_gemm(a, NULL, kc, b, N, m1 - m0, N, kc, ch, N, NULL, 0, 0, j > c0);
        }
      }
      amx_stop();
    }
    free(a);
    free(b);
#pragma omp barrier
    if (!failed) {
      const int64_t r0 = M * t / T, r1 = M * (t + 1) / T;
      sums2_bf16(c + r0 * N, c + M * N + r0 * N, r1 - r0, N, out + r0 * ldo, ldo);
    }
  }
  free(c);
  return failed ? -1 : 0;
#else
  (void)g, (void)ldg, (void)x, (void)ldx, (void)K, (void)M, (void)N, (void)out, (void)ldo;
  (void)nthreads;
  return -2;
#endif
}

/* ---- a bf16 decoder's output projection, its logits in fp32, on AMX ---- */

#ifdef HAVE_AMX
enum { PROJ_CH = 512 }; /* W's rows summed before their logits are written: 512 KB at rp 256 */

/* project_amx's chunks c0 to c1 of PROJ_CH of W's rows, for rows r0 to r0 + rn of h (B = b,
   padded to rp columns): a chunk's sums into s (PROJ_CH x rp fp32, 32 of W's rows a product),
   then written into their columns of the output rows 16 x 16 at a time, transposed in
   registers (a row's logits of the chunk are PROJ_CH contiguous floats) */
AMXBW static void project_chunks(int64_t r0, int64_t rn, int64_t rp, const word32 *b,
                                 const uint16_t *w, int64_t ldw, int64_t V, int64_t D,
                                 int64_t c0, int64_t c1, float *s, uint16_t *a, float *out,
                                 int64_t ldo) {
  __m512i e[16];
  amx_start();
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t v0 = c * PROJ_CH, m = V - v0 < PROJ_CH ? V - v0 : PROJ_CH;
    for (int64_t q0 = 0; q0 < m; q0 += 32) {
      const int64_t mq = m - q0 < 32 ? m - q0 : 32, mp = up16(mq);
      const uint16_t *wa = w + (v0 + q0) * ldw;
      int64_t lda = ldw;
      if (mq != mp) { /* the last rows, padded with zeros to a whole tile */
        for (int64_t q = 0; q < mp; ++q)
          if (q < mq) memcpy(a + q * D, wa + q * ldw, (size_t)D * 2);
          else memset(a + q * D, 0, (size_t)D * 2);
        wa = a, lda = D;
      }
      amx_gemm(wa, NULL, lda, b, rp, mp, rp, D, s + q0 * rp, rp, NULL, 0, 0, 0);
    }
    for (int64_t r = 0; r < rn; r += 16) /* s[q][r]: row r0 + r's logit of token v0 + q */
      for (int64_t q = 0; q < m; q += 16) {
        float *o = out + (r0 + r) * ldo + v0 + q;
        if (q + 16 <= m && r + 16 <= rn) { /* a whole block: no masks */
          for (int i = 0; i < 16; ++i)
            e[i] = _mm512_loadu_si512((const void *)(s + (q + i) * rp + r));
          t16x16(e);
          for (int i = 0; i < 16; ++i) _mm512_storeu_si512((void *)(o + i * ldo), e[i]);
          continue;
        }
        for (int i = 0; i < 16; ++i)
          e[i] = q + i < m ? _mm512_loadu_si512((const void *)(s + (q + i) * rp + r))
                           : _mm512_setzero_si512();
        t16x16(e);
        const __mmask16 k = m - q >= 16 ? 0xffff : (__mmask16)((1u << (m - q)) - 1);
        for (int i = 0; i < 16 && r + i < rn; ++i)
          _mm512_mask_storeu_ps(o + i * ldo, k, _mm512_castsi512_ps(e[i]));
      }
  }
  amx_stop();
}
#endif

/* logits (R x V fp32, row stride ldo) = h W^T for a bf16 decoder's outputs h (R x D, row
   stride ldh) and the pre-softmax projection W (V x D, row stride ldw), D a multiple of 32.
   oneDNN's bf16 product rounds each logit to bf16 (steps of 1/16 between 8 and 16), and beam
   search ranks those. Here each logit is the fp32 sum of its D products of bf16 values, in an
   order that depends on neither R, the row's place, nor the thread count: a sentence's logits
   are the same in any batch. W's rows are the tiles' A operand where they lie, h's rows read
   as words (pairs of columns) and transposed the B operand, RC rows of h a pass; each thread
   takes chunks of PROJ_CH of W's rows, sums their logits into its scratch and writes them
   into their columns of the output rows. -1: no scratch, -2: no tiles, -3: D not a multiple
   of 32. */
int project_amx(const uint16_t *h, int64_t ldh, int64_t R, const uint16_t *w, int64_t ldw,
                int64_t V, int64_t D, float *out, int64_t ldo, int nthreads) {
#ifdef HAVE_AMX
  enum { RC = 256 }; /* B = D/2 x RC words: 256 KB at D = 512, in L2 beside the scratch */
  if (D % 32) return -3;
  if (!amx_permit()) return -2;
  const int64_t chunks = (V + PROJ_CH - 1) / PROJ_CH, rc = up16(R < RC ? R : RC);
  const int T = nthreads >= 1 ? nthreads : 1;
  word32 *b = aligned_alloc(64, line_bytes(D / 2 * rc, 4));
  if (!b) return -1;
  int failed = 0;
  for (int64_t r0 = 0; r0 < R && !failed; r0 += RC) {
    const int64_t rn = R - r0 < RC ? R - r0 : RC, rp = up16(rn);
#pragma omp parallel num_threads(T)
    {
      const int t = omp_get_thread_num();
      if (t == 0) /* b (D/2 x rp words): b[i][r] = h[r][2i, 2i+1], zeros past rn */
        words_t(h + r0 * ldh, ldh, NULL, NULL, rn, rp, D, D, b);
      float *s = aligned_alloc(64, line_bytes(PROJ_CH * rp, 4));
      uint16_t *a = aligned_alloc(64, line_bytes(32 * D, 2)); /* the last rows, padded */
#pragma omp barrier
      if (!s || !a) {
        failed = 1;
      } else {
        project_chunks(r0, rn, rp, b, w, ldw, V, D, chunks * t / T, chunks * (t + 1) / T, s,
                       a, out, ldo);
      }
      free(s);
      free(a);
    }
  }
  free(b);
  return failed ? -1 : 0;
#else
  (void)h, (void)ldh, (void)R, (void)w, (void)ldw, (void)V, (void)D, (void)out, (void)ldo;
  (void)nthreads;
  return -2;
#endif
}

/* ---- a linear layer's bias gradient: the column sums of (n, c) bf16, in fp32 ---- */

/* part[j] += sum of x[r, j] over rows [r0, r1), four rows at a time */
AVX512 static void column_sums_rows(const uint16_t *x, int64_t c, int64_t r0, int64_t r1,
                                    float *part) {
  const int64_t cv = c & ~(int64_t)15;
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint16_t *a = x + r * c, *b = a + c, *d = b + c, *e = d + c;
    for (int64_t j = 0; j < cv; j += 16) {
      __m512 s = _mm512_add_ps(_mm512_add_ps(ld16(a + j), ld16(b + j)),
                               _mm512_add_ps(ld16(d + j), ld16(e + j)));
      _mm512_storeu_ps(part + j, _mm512_add_ps(_mm512_loadu_ps(part + j), s));
    }
    for (int64_t j = cv; j < c; ++j) part[j] += (bf(a[j]) + bf(b[j])) + (bf(d[j]) + bf(e[j]));
  }
  for (; r < r1; ++r) {
    const uint16_t *a = x + r * c;
    for (int64_t j = 0; j < cv; j += 16)
      _mm512_storeu_ps(part + j, _mm512_add_ps(_mm512_loadu_ps(part + j), ld16(a + j)));
    for (int64_t j = cv; j < c; ++j) part[j] += bf(a[j]);
  }
}

/* out[j] = sum over the n rows of x[r, j], or where h: of dh = relu16_grad's (g = x, h), dh
   written as it goes; each thread's rows (`my_rows`), then the threads' parts in order. work:
   nthreads * c floats. */
static int sums_of_rows(const uint16_t *x, const uint16_t *h, uint16_t *dh, int64_t n,
                        int64_t c, float *out, float *work, int nthreads) {
  int teams = 1;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    float *part = work + omp_get_thread_num() * c;
    for (int64_t j = 0; j < c; ++j) part[j] = 0.f;
    my_rows(n, &r0, &r1);
    if (!h) column_sums_rows(x, c, r0, r1, part);
    else
      for (int64_t r = r0; r < r1; r += 4) { /* 4 rows' dh, summed while L1 holds them */
        const int64_t e = r + 4 < r1 ? r + 4 : r1;
        relu_grad_span(x, h, dh, r * c, e * c);
        column_sums_rows(dh, c, r, e, part);
      }
#pragma omp single
    teams = omp_get_num_threads();
  }
  for (int64_t j = 0; j < c; ++j) out[j] = 0.f;
  for (int t = 0; t < teams; ++t)
    for (int64_t j = 0; j < c; ++j) out[j] += work[t * c + j];
  return 0;
}

/* out[j] = sum over the n rows of x[r, j]; work: nthreads * c floats */
int column_sums(const uint16_t *x, int64_t n, int64_t c, float *out, float *work, int nthreads) {
  return sums_of_rows(x, NULL, NULL, n, c, out, work, nthreads);
}

/* relu16_grad's dh (n, c) and, in the same pass, its column sums into out (c floats): 4 rows at
   a time, summed as `column_sums_rows` sums them (in 4-row groups), so the sums have
   `column_sums`'s bits (the bias gradient of the layer before a ReLU; the second read of dh
   was 12 ms of a W1 step). work: nthreads * c floats. */
int relu16_grad_sums(const uint16_t *g, const uint16_t *h, uint16_t *dh, int64_t n, int64_t c,
                     float *out, float *work, int nthreads) {
  return sums_of_rows(g, h, dh, n, c, out, work, nthreads);
}
/* ---- §5.3 Adam over the fp32 masters of bf16 (or fp32) parameters, in two passes ---- */

/* Not in the paper (it trained in fp32). torch takes the mixed-precision step in five passes:
   each bf16 gradient copied to fp32, scaled by 1 / tokens in place, its norm, torch's fused
   Adam (`_fused_adam_`), the masters copied back to bf16. Here: the gradients' sum of squares
   (read once), then one pass that scales each gradient as it is read and updates the master,
   both moments and the bf16 parameter, with the same operations as `_fused_adam_` in the same
   order, each rounded to fp32 (the `_round` intrinsics: the compiler may not contract them
   into an FMA that torch does not do), so the same bits. A tensor's gradient: kind 0 none
   (zeros, as `master_grads` makes), 1 bf16, 2 fp32. h: the lerp coefficient, beta2, 1 - beta2,
   eps, the scale, the clip factor; flags: 1 the moment's lerp with a small weight (exp_avg as
   its base), 2 scaled, 4 clipped. */
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ADAM_BLOCK 8192 /* the sum of squares in blocks, added in order: any thread count */

/* 16 floats at p, the lanes of k: without a mask when k is all of them (masked loads and stores
   cost 1.7x here); a constant k, inlined, leaves one of the two */
#define ADAM_INLINE AVX512BW static inline __attribute__((always_inline))
ADAM_INLINE __m512 adam_ld(const float *p, __mmask16 k) {
  return k == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p);
}
ADAM_INLINE void adam_st(float *p, __mmask16 k, __m512 v) {
  if (k == 0xffff) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, k, v);
}

ADAM_INLINE __m512 adam_grad(const void *g, int kind, int64_t i, __mmask16 k, int flags,
                             const float *h) {
  const uint16_t *g16 = (const uint16_t *)g + i;
  __m512 x = kind == 1   ? (k == 0xffff ? ld16(g16) : widen(_mm256_maskz_loadu_epi16(k, g16)))
             : kind == 2 ? adam_ld((const float *)g + i, k)
                         : _mm512_setzero_ps();
  if (flags & 2) x = _mm512_mul_round_ps(x, _mm512_set1_ps(h[4]), RN);
  if (flags & 4) x = _mm512_mul_round_ps(x, _mm512_set1_ps(h[5]), RN);
  return x;
}

/* (g * scale)^2 of 16 values added into a and b (fp64) */
AVX512BW static inline void adam_sq16(__m512 x, __m512d *a, __m512d *b) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m512d hi = _mm512_cvtps_pd(upper);
  *a = _mm512_fmadd_pd(lo, lo, *a);
  *b = _mm512_fmadd_pd(hi, hi, *b);
}

/* the sum of squares of a gradient's values [i0, i1), the next 2 kB asked for every 64 values */
AVX512BW static double adam_sumsq_span(const void *g, int kind, int64_t i0, int64_t i1,
                                       int flags, const float *h) {
  __m512d a = _mm512_setzero_pd(), b = _mm512_setzero_pd();
  const int64_t size = kind == 2 ? 4 : 2;
  int64_t i = i0;
  for (; i + 16 <= i1 && kind; i += 16) { /* whole vectors without masks */
    if (!((i - i0) & 63)) fetch((const char *)g + i * size + FETCH_AHEAD, 64 * size);
    adam_sq16(adam_grad(g, kind, i, 0xffff, flags & 2, h), &a, &b);
  }
  for (; i < i1 && kind; i += 16)
    adam_sq16(adam_grad(g, kind, i, first16(i1 - i), flags & 2, h), &a, &b);
  return _mm512_reduce_add_pd(_mm512_add_pd(a, b));
}

/* 16 values' update: x the gradient, *mv and *vv the moments in and out, pv the master; the
   new master returned. last: the count of a tensor's last values (under 16), else 16. */
AVX512BW static inline __m512 adam16(__m512 x, __m512 pv, __m512 *mv, __m512 *vv, __m512 coeff,
                                     int small, __m512 beta2, __m512 c2, __m512 eps, __m512 ss,
                                     __m512 bc, int64_t last) {
  /* exp_avg.lerp_(grad, 1 - beta1): fmadd(coeff, g - m, base), torch's one FMA */
  *mv = _mm512_fmadd_ps(coeff, _mm512_sub_round_ps(x, *mv, RN), small ? *mv : x);
  /* exp_avg_sq * beta2 + (1 - beta2) g g: torch's build contracts its last product and the
     sum into one FMA; in a tensor's last r < 16 values (its scalar loop) the same for the
     first 8 (r >= 8: the compiler's one 8-wide block), the rest fma(v, beta2, (c2 g) g) */
  const __m512 c2x = _mm512_mul_round_ps(c2, x, RN);
  __m512 sq = _mm512_fmadd_ps(c2x, x, _mm512_mul_round_ps(*vv, beta2, RN));
  if (last < 16) {
    const __mmask16 scalar = (__mmask16)(0xffffu << (last & 8));
    const __m512 tail = _mm512_fmadd_ps(*vv, beta2, _mm512_mul_round_ps(c2x, x, RN));
    sq = _mm512_mask_mov_ps(sq, scalar, tail);
  }
  *vv = sq;
  const __m512 den = _mm512_add_round_ps(
      _mm512_div_round_ps(_mm512_sqrt_round_ps(sq, RN), bc, RN), eps, RN);
  return _mm512_add_round_ps(pv, _mm512_div_round_ps(_mm512_mul_round_ps(ss, *mv, RN), den, RN),
                             RN);
}

/* the update of 16 values from i (k: the lanes; last: as adam16's) */
ADAM_INLINE void adam_block(float *p, float *m, float *v, const void *g, int kind, void *q,
                            int qkind, int64_t i, __mmask16 k, int64_t last, __m512 coeff,
                            __m512 beta2, __m512 c2, __m512 eps, __m512 ss, __m512 bc,
                            int flags, const float *h) {
  __m512 mv = adam_ld(m + i, k), vv = adam_ld(v + i, k);
  const __m512 pv = adam16(adam_grad(g, kind, i, k, flags, h), adam_ld(p + i, k), &mv, &vv,
                           coeff, flags & 1, beta2, c2, eps, ss, bc, last);
  adam_st(p + i, k, pv);
  adam_st(m + i, k, mv);
  adam_st(v + i, k, vv);
  if (qkind == 1) {
    if (k == 0xffff) _mm256_storeu_si256((__m256i *)((uint16_t *)q + i), narrow(pv));
    else _mm256_mask_storeu_epi16((uint16_t *)q + i, k, narrow(pv));
  } else if (qkind == 2) {
    adam_st((float *)q + i, k, pv);
  }
}

AVX512BW static void adam_span(float *p, float *m, float *v, const void *g, int kind, void *q,
                               int qkind, int64_t i0, int64_t i1, float step, float bc2,
                               int flags, const float *h) {
  const __m512 coeff = _mm512_set1_ps(h[0]), beta2 = _mm512_set1_ps(h[1]);
  const __m512 c2 = _mm512_set1_ps(h[2]), eps = _mm512_set1_ps(h[3]);
  const __m512 ss = _mm512_set1_ps(step), bc = _mm512_set1_ps(bc2);
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16)
    adam_block(p, m, v, g, kind, q, qkind, i, 0xffff, 16, coeff, beta2, c2, eps, ss, bc, flags,
               h);
  for (; i < i1; i += 16)
    adam_block(p, m, v, g, kind, q, qkind, i, first16(i1 - i), i1 - i, coeff, beta2, c2, eps, ss,
               bc, flags, h);
}

/* out = sum over the nt tensors of g^2 (scaled as flags & 2), in fp64 */
int adam_sumsq(int64_t nt, void *const *g, const int32_t *kind, const int64_t *n, int flags,
               const float *h, double *out, int nthreads) {
  int64_t blocks = 0;
  for (int64_t t = 0; t < nt; ++t) blocks += (n[t] + ADAM_BLOCK - 1) / ADAM_BLOCK;
  double *part = (double *)malloc((blocks ? blocks : 1) * sizeof(double));
  if (!part) return 1;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t b0, b1, t = 0, first = 0;
    my_rows(blocks, &b0, &b1);
    for (int64_t b = b0; b < b1; ++b) {
      while (b >= first + (n[t] + ADAM_BLOCK - 1) / ADAM_BLOCK)
        first += (n[t++] + ADAM_BLOCK - 1) / ADAM_BLOCK;
      const int64_t i0 = (b - first) * ADAM_BLOCK;
      const int64_t i1 = i0 + ADAM_BLOCK < n[t] ? i0 + ADAM_BLOCK : n[t];
      part[b] = adam_sumsq_span(g[t], kind[t], i0, i1, flags, h);
    }
  }
  double s = 0.0;
  for (int64_t b = 0; b < blocks; ++b) s += part[b];
  free(part);
  *out = s;
  return 0;
}

/* One Adam step of nt tensors: p (fp32 masters), m, v (the moments) updated in place; q: the
   model's parameter (qkind 1 bf16, 2 fp32, 0 none) given p's new value. step: -lr / (1 -
   beta1^t), bc2: sqrt(1 - beta2^t), each tensor's as fp32. Units of 16 values shared out. */
int adam_update(int64_t nt, float *const *p, float *const *m, float *const *v, void *const *g,
                const int32_t *kind, void *const *q, const int32_t *qkind, const int64_t *n,
                const float *step, const float *bc2, int flags, const float *h, int nthreads) {
  int64_t units = 0;
  for (int64_t t = 0; t < nt; ++t) units += (n[t] + 15) / 16;
#pragma omp parallel num_threads(nthreads)
  {
    int64_t u0, u1, first = 0;
    my_rows(units, &u0, &u1);
    for (int64_t t = 0; t < nt && first < u1; first += (n[t] + 15) / 16, ++t) {
      const int64_t a = u0 > first ? u0 - first : 0, last = first + (n[t] + 15) / 16;
      const int64_t b = (u1 < last ? u1 : last) - first;
      if (a >= b) continue;
      adam_span(p[t], m[t], v[t], g[t], kind[t], q[t], qkind[t], a * 16,
                b * 16 < n[t] ? b * 16 : n[t], step[t], bc2[t], flags, h);
    }
  }
  return 0;
}

/* ---- a decoding step's attention (§3.2.1 eq. 1) for CPU inference, one (batch, head) at a
   time: s_j = q . k_j (/ c where c > 0) + bias_j, w = softmax(s), out = sum_j w_j v_j, in fp32
   (bf16 values widened). Not in the paper: torch takes four passes over the step's keys and
   values, each (batch, head) a tiny product; here each head's keys and values are read once,
   the next head's requested meanwhile (_mm_prefetch: each head's rows start a new run, which
   the hardware's prefetcher learns too late), and keys the bias masks (-inf) are not read at
   all (a beam's other beams' histories, a source's padding). ---- */
/* one head's Tq queries (rows qi apart) against L keys: element x of key j at k + j kj + x kc,
   rows (kc == 1; fp32, or bf16 where kbf16, widened) or rows of K^T (kj == 1; fp32); values row
   j at v + j vj (fp32 or bf16); bias (i, j) at bias + i mi + j mj, or NULL; out (Tq, dv)
   contiguous, fp32 or bf16. s: L floats, idx: L ints. pk, pv: the next head's keys and values
   (NULL: none), fetched into the cache. */
AVX512BW static void step_head(const float *q, int64_t qi, const float *k, int kbf16, int64_t kj,
                               int64_t kc, const void *v, int vbf16, int64_t vj,
                               const float *bias, int64_t mi, int64_t mj, int64_t Tq, int64_t L,
                               int64_t d, int64_t dv, float c, void *out, int obf16, float *s,
                               int32_t *idx, const float *pk, const char *pv) {
  const __m512 vninf = _mm512_set1_ps(-INFINITY);
  const int64_t vsize = vbf16 ? 2 : 4, ksize = kbf16 ? 2 : 4;
  for (int64_t i = 0; i < Tq; ++i) {
    const float *qr = q + i * qi, *br = bias ? bias + i * mi : NULL;
    int64_t n = 0; /* the scores s[0, n): of keys idx[0, n) (rows), or of keys 0 .. n - 1 */
    if (kc == 1) { /* key rows: the keys the bias leaves listed (no branch), a dot product each */
      if (br)
        for (int64_t j = 0; j < L; ++j) idx[n] = (int32_t)j, n += br[j * mj] != -INFINITY;
      else
        for (; n < L; ++n) idx[n] = (int32_t)n;
      for (int64_t m = 0; m < n; ++m) {
        if (pk && i == 0) /* the next head's key rows, spread over this head's */
          for (int64_t j = m * L / n; j < (m + 1) * L / n; ++j)
            for (int64_t x = 0; x < d * ksize; x += 64)
              _mm_prefetch((const char *)pk + j * kj * ksize + x, _MM_HINT_T0);
        const char *kr = (const char *)k + idx[m] * kj * ksize;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t x = 0; x < d; x += 16) {
          const __mmask16 in = first16(d - x);
          const __m512 kx = kbf16 ? widen(_mm256_maskz_loadu_epi16(in, (const uint16_t *)kr + x))
                                  : _mm512_maskz_loadu_ps(in, (const float *)kr + x);
          acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, qr + x), kx, acc);
        }
        float sc = _mm512_reduce_add_ps(acc);
        if (c > 0.f) sc = sc / c;
        s[m] = br ? sc + br[idx[m] * mj] : sc;
      }
    } else { /* rows of K^T: the scores are their sum weighted by q, up to the last legal key */
      n = L;
      if (br)
        while (n > 0 && br[(n - 1) * mj] == -INFINITY) --n;
      for (int64_t j = 0; j < n; j += 64) {
        const __mmask16 m0 = first16(n - j), m1 = n - j > 16 ? first16(n - j - 16) : 0,
                        m2 = n - j > 32 ? first16(n - j - 32) : 0,
                        m3 = n - j > 48 ? first16(n - j - 48) : 0;
        /* two sums of K^T's rows, even and odd x (one chain of d dependent FMAs would wait
           on each one's latency), added at the end */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, e0 = a0, e1 = a0, e2 = a0,
               e3 = a0;
        for (int64_t x = 0; x < d; x += 2) {
          const float *kr = k + x * kc + j;
          if (pk && i == 0) /* the next head's rows x and x + 1 beside this head's */
            for (int64_t z = 0; z < 64 && j + z < L; z += 16) {
              _mm_prefetch((const char *)(pk + x * kc + j + z), _MM_HINT_T0);
              if (x + 1 < d)
                _mm_prefetch((const char *)(pk + (x + 1) * kc + j + z), _MM_HINT_T0);
            }
          const __m512 qx = _mm512_set1_ps(qr[x]);
          a0 = _mm512_fmadd_ps(qx, _mm512_maskz_loadu_ps(m0, kr), a0);
          if (m1) a1 = _mm512_fmadd_ps(qx, _mm512_maskz_loadu_ps(m1, kr + 16), a1);
          if (m2) a2 = _mm512_fmadd_ps(qx, _mm512_maskz_loadu_ps(m2, kr + 32), a2);
          if (m3) a3 = _mm512_fmadd_ps(qx, _mm512_maskz_loadu_ps(m3, kr + 48), a3);
          if (x + 1 == d) break;
          const __m512 qy = _mm512_set1_ps(qr[x + 1]);
          kr += kc;
          e0 = _mm512_fmadd_ps(qy, _mm512_maskz_loadu_ps(m0, kr), e0);
          if (m1) e1 = _mm512_fmadd_ps(qy, _mm512_maskz_loadu_ps(m1, kr + 16), e1);
          if (m2) e2 = _mm512_fmadd_ps(qy, _mm512_maskz_loadu_ps(m2, kr + 32), e2);
          if (m3) e3 = _mm512_fmadd_ps(qy, _mm512_maskz_loadu_ps(m3, kr + 48), e3);
        }
        const __m512 a[4] = {_mm512_add_ps(a0, e0), _mm512_add_ps(a1, e1), _mm512_add_ps(a2, e2),
                             _mm512_add_ps(a3, e3)};
        for (int u = 0; u < 4 && j + 16 * u < n; ++u) {
          const int64_t j0 = j + 16 * u;
          const __mmask16 in = first16(n - j0);
          __m512 sc = a[u];
          if (c > 0.f) sc = _mm512_div_ps(sc, _mm512_set1_ps(c));
          if (br) {
            float b[16] = {0};
            for (int64_t z = 0; z < 16 && j0 + z < n; ++z) b[z] = br[(j0 + z) * mj];
            sc = _mm512_add_ps(sc, _mm512_loadu_ps(b));
          }
          _mm512_mask_storeu_ps(s + j0, in, sc);
        }
      }
    }
    /* the softmax over s[0, n): keys at -inf get 0; no legal key at all, every weight 0 */
    __m512 top = vninf;
    for (int64_t j = 0; j < n; j += 16)
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(vninf, first16(n - j), s + j));
    const float mx = _mm512_reduce_max_ps(top);
    float sum = 0.f;
    if (mx != -INFINITY) {
      const __m512 vt = _mm512_set1_ps(mx);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = first16(n - j);
        const __m512 x = _mm512_mask_loadu_ps(vninf, in, s + j);
        const __mmask16 legal = _mm512_cmp_ps_mask(x, vninf, _CMP_NEQ_UQ);
        const __m512 e = _mm512_maskz_mov_ps(legal, exp_nonpositive(_mm512_sub_ps(x, vt)));
        _mm512_mask_storeu_ps(s + j, in, e);
        acc = _mm512_add_ps(acc, e);
      }
      sum = _mm512_reduce_add_ps(acc);
      const __m512 vs = _mm512_set1_ps(sum);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = first16(n - j);
        _mm512_mask_storeu_ps(s + j, in, _mm512_div_ps(_mm512_maskz_loadu_ps(in, s + j), vs));
      }
    }
    /* out = sum_j w_j v_j in key order, 64 values at a time; keys of weight 0 not read */
    if (pv && i == 0 && !(sum > 0.f && n > 0)) /* the next head's value rows (else below) */
      for (int64_t j = 0; j < L; ++j)
        for (int64_t x = 0; x < dv * vsize; x += 64)
          _mm_prefetch(pv + j * vj * vsize + x, _MM_HINT_T0);
    for (int64_t x = 0; x < dv; x += 64) {
      const __mmask16 m0 = first16(dv - x), m1 = dv - x > 16 ? first16(dv - x - 16) : 0,
                      m2 = dv - x > 32 ? first16(dv - x - 32) : 0,
                      m3 = dv - x > 48 ? first16(dv - x - 48) : 0;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t m = 0; sum > 0.f && m < n; ++m) {
        if (pv && i == 0 && x == 0) /* the next head's value rows, spread over this head's */
          for (int64_t j = m * L / n; j < (m + 1) * L / n; ++j)
            for (int64_t z = 0; z < dv * vsize; z += 64)
              _mm_prefetch(pv + j * vj * vsize + z, _MM_HINT_T0);
        if (s[m] == 0.f) continue;
        const int64_t j = kc == 1 ? idx[m] : m;
        const __m512 w = _mm512_set1_ps(s[m]);
        if (vbf16) {
          const uint16_t *vr = (const uint16_t *)v + j * vj + x;
          a0 = _mm512_fmadd_ps(w, widen(_mm256_maskz_loadu_epi16(m0, vr)), a0);
          if (m1) a1 = _mm512_fmadd_ps(w, widen(_mm256_maskz_loadu_epi16(m1, vr + 16)), a1);
          if (m2) a2 = _mm512_fmadd_ps(w, widen(_mm256_maskz_loadu_epi16(m2, vr + 32)), a2);
          if (m3) a3 = _mm512_fmadd_ps(w, widen(_mm256_maskz_loadu_epi16(m3, vr + 48)), a3);
        } else {
          const float *vr = (const float *)v + j * vj + x;
          a0 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m0, vr), a0);
          if (m1) a1 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m1, vr + 16), a1);
          if (m2) a2 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m2, vr + 32), a2);
          if (m3) a3 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m3, vr + 48), a3);
        }
      }
      if (obf16) {
        uint16_t *o = (uint16_t *)out + i * dv + x;
        _mm256_mask_storeu_epi16(o, m0, narrow(a0));
        if (m1) _mm256_mask_storeu_epi16(o + 16, m1, narrow(a1));
        if (m2) _mm256_mask_storeu_epi16(o + 32, m2, narrow(a2));
        if (m3) _mm256_mask_storeu_epi16(o + 48, m3, narrow(a3));
      } else {
        float *o = (float *)out + i * dv + x;
        _mm512_mask_storeu_ps(o, m0, a0);
        if (m1) _mm512_mask_storeu_ps(o + 16, m1, a1);
        if (m2) _mm512_mask_storeu_ps(o + 32, m2, a2);
        if (m3) _mm512_mask_storeu_ps(o + 48, m3, a3);
      }
    }
  }
}


/* ---- `translate.Int8Linear`'s rows: each input row on its own 8-bit range, each output row
   scaled back (not in the paper). The same bits as its torch ops, one pass each. ---- */

/* top[r] = max(max_j |x[r, j]| (nonneg: max_j x[r, j]), tiny), NaN where the row has one
   (torch's amax, then clamp_min); xs[r, j] = x[r, j] * (1 / top[r]) (reciprocal, multiply).
   With q (not NULL) the 8-bit inputs instead of xs: q[r, j] = round(xs[r, j] * levels) + zp to
   nearest even, saturated to 0 .. 255, a NaN's as zp (xs not written). */
AVX512 static inline void store_u8(uint8_t *q, __m512 xs, __m512 levels, int zp, __mmask16 t) {
  __m512 v = _mm512_mul_ps(xs, levels);
  v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_setzero_ps());
  __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(zp));
  i = _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(255)), _mm512_setzero_si512());
  _mm512_mask_cvtepi32_storeu_epi8(q, t, i);
}
AVX512 int int8_rows_in(const float *x, int64_t rows, int64_t k, int nonneg, float tiny,
                        float *xs, float *top, int nthreads, uint8_t *q, float levels, int zp) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * k;
    float *o = q ? NULL : xs + r * k;
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
      __m512 v = _mm512_loadu_ps(xr + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, nonneg ? v : _mm512_abs_ps(v));
    }
    if (j < k) { /* the tail: the lanes past k read as -inf (nonneg) or 0, neither a maximum */
      __mmask16 t = (__mmask16)((1u << (k - j)) - 1);
      __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(nonneg ? -INFINITY : 0.f), t, xr + j);
      nan |= _mm512_mask_cmp_ps_mask(t, v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, nonneg ? v : _mm512_abs_ps(v));
    }
    float mx = _mm512_reduce_max_ps(m);
    mx = nan ? NAN : (mx < tiny ? tiny : mx);
    top[r] = mx;
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_set1_ps(mx));
    if (q) {
      const __m512 lv = _mm512_set1_ps(levels);
      uint8_t *qr = q + r * k;
      for (j = 0; j + 16 <= k; j += 16)
        store_u8(qr + j, _mm512_mul_ps(_mm512_loadu_ps(xr + j), inv), lv, zp, 0xffff);
      if (j < k) {
        __mmask16 t = (__mmask16)((1u << (k - j)) - 1);
        store_u8(qr + j, _mm512_mul_ps(_mm512_maskz_loadu_ps(t, xr + j), inv), lv, zp, t);
      }
      continue;
    }
    for (j = 0; j + 16 <= k; j += 16)
      _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_loadu_ps(xr + j), inv));
    if (j < k) {
      __mmask16 t = (__mmask16)((1u << (k - j)) - 1);
      _mm512_mask_storeu_ps(o + j, t, _mm512_mul_ps(_mm512_maskz_loadu_ps(t, xr + j), inv));
    }
  }
  return 0;
}

/* y[r, j] = y[r, j] * top[r], then + bias[j] (bias may be NULL): a multiply and an add, each
   rounded (the empty asm keeps the compiler from fusing them into one FMA) */
AVX512 int int8_rows_out(float *y, int64_t rows, int64_t n, const float *top, const float *bias,
                         int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t r = 0; r < rows; ++r) {
    float *yr = y + r * n;
    __m512 s = _mm512_set1_ps(top[r]);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(yr + j), s);
      if (bias) {
        __asm__("" : "+v"(p));
        p = _mm512_add_ps(p, _mm512_loadu_ps(bias + j));
      }
      _mm512_storeu_ps(yr + j, p);
    }
    if (j < n) {
      __mmask16 t = (__mmask16)((1u << (n - j)) - 1);
      __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(t, yr + j), s);
      if (bias) {
        __asm__("" : "+v"(p));
        p = _mm512_add_ps(p, _mm512_maskz_loadu_ps(t, bias + j));
      }
      _mm512_mask_storeu_ps(yr + j, t, p);
    }
  }
  return 0;
}
/* The same two on AVX2 (8 lanes; CPUs without AVX-512, as Zen 3, where auto picks int8) */
#define AVX2 __attribute__((target("avx2")))
AVX2 static inline __m256i first_lanes8(int64_t n) { /* lanes 0 .. n - 1 set */
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

AVX2 static inline void store_u8_avx2(uint8_t *q, __m256 xs, __m256 levels, int zp, int64_t n) {
  __m256 v = _mm256_mul_ps(xs, levels);
  v = _mm256_andnot_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), v); /* a NaN's lanes: 0 */
  __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(zp));
  i = _mm256_max_epi32(_mm256_min_epi32(i, _mm256_set1_epi32(255)), _mm256_setzero_si256());
  int32_t lanes[8];
  _mm256_storeu_si256((__m256i *)lanes, i);
  for (int64_t l = 0; l < n; ++l) q[l] = (uint8_t)lanes[l];
}
AVX2 int int8_rows_in_avx2(const float *x, int64_t rows, int64_t k, int nonneg, float tiny,
                           float *xs, float *top, int nthreads, uint8_t *q, float levels,
                           int zp) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * k;
    float *o = q ? NULL : xs + r * k;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_set1_ps(-INFINITY);
    int nan = 0;
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
      __m256 v = _mm256_loadu_ps(xr + j);
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, nonneg ? v : _mm256_and_ps(v, magnitude));
    }
    if (j < k) { /* the lanes past k read as 0, or -inf where nonneg: neither a maximum */
      __m256i t = first_lanes8(k - j);
      __m256 v = _mm256_maskload_ps(xr + j, t);
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      if (nonneg) v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, _mm256_castsi256_ps(t));
      m = _mm256_max_ps(m, nonneg ? v : _mm256_and_ps(v, magnitude));
    }
    float lanes[8], mx;
    _mm256_storeu_ps(lanes, m);
    mx = lanes[0];
    for (int i = 1; i < 8; ++i) mx = lanes[i] > mx ? lanes[i] : mx;
    mx = nan ? NAN : (mx < tiny ? tiny : mx);
    top[r] = mx;
    __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_set1_ps(mx));
    if (q) {
      const __m256 lv = _mm256_set1_ps(levels);
      uint8_t *qr = q + r * k;
      for (j = 0; j < k; j += 8) {
        const int64_t n = k - j < 8 ? k - j : 8;
        __m256 v = _mm256_maskload_ps(xr + j, first_lanes8(n));
        store_u8_avx2(qr + j, _mm256_mul_ps(v, inv), lv, zp, n);
      }
      continue;
    }
    for (j = 0; j + 8 <= k; j += 8)
      _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(xr + j), inv));
    if (j < k) {
      __m256i t = first_lanes8(k - j);
      _mm256_maskstore_ps(o + j, t, _mm256_mul_ps(_mm256_maskload_ps(xr + j, t), inv));
    }
  }
  return 0;
}

AVX2 int int8_rows_out_avx2(float *y, int64_t rows, int64_t n, const float *top,
                            const float *bias, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t r = 0; r < rows; ++r) {
    float *yr = y + r * n;
    __m256 s = _mm256_set1_ps(top[r]);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(yr + j), s);
      if (bias) {
        __asm__("" : "+x"(p));
        p = _mm256_add_ps(p, _mm256_loadu_ps(bias + j));
      }
      _mm256_storeu_ps(yr + j, p);
    }
    if (j < n) {
      __m256i t = first_lanes8(n - j);
      __m256 p = _mm256_mul_ps(_mm256_maskload_ps(yr + j, t), s);
      if (bias) {
        __asm__("" : "+x"(p));
        p = _mm256_add_ps(p, _mm256_maskload_ps(bias + j, t));
      }
      _mm256_maskstore_ps(yr + j, t, p);
    }
  }
  return 0;
}
/* `translate.Int8Linear`'s product on AVX2 with 8-bit weights, exact: y[r, c] = (((float)(sum_j
   (q[r, j] - zp) w[c, j]) * step) * cs[c]) * top[r] (+ bias[c]), each multiply and the add
   rounded on its own, the sum an exact int32: the bits of oneDNN's int8 product on a VNNI CPU
   (its sums, x the inputs' step, x the weight row's scale), then `int8_rows_out`'s. A CPU
   without VNNI (a Zen 3) has AVX2's vpmaddubsw for u8 x s8, which sums two products in int16
   and saturates with 8-bit weights (fbgemm's kernel there takes 7-bit ones); vpmaddwd sums two
   int16 x int16 products in int32: exact for any 8-bit values, ~0.8x vpmaddubsw's rate in the
   same loops (docs/performance.md, "Round sixty-seven"). The weights are packed once
   (`kernels.int8_pack`) as int8: for each block of 8 columns and each pair of k, 16 bytes
   (column 0's two, column 1's, ...), which vpmovsxbw widens to the 16 int16 vpmaddwd reads;
   columns past n and a k past an odd k are 0. Each row of q is widened once to int16 (q - zp,
   k padded to even) at the start of `work`. The tiles are 4 rows x 24 columns of int32 sums
   (`i8_sums43`), threads taking whole panels of 24 columns; each panel's weights widened once
   into the thread's part of `work` for all the rows of a chunk, by the chunk's first 4 rows'
   tile (`i8_sums43_widen`; widened in the loop by each tile, they ran at 0.64-0.71x: "Round
   sixty-eight"), the next panel's bytes fetched meanwhile; a chunk of 1-3 rows reads each
   weight once and widens it as it reads. int8 packs: half the bytes of int16 ones (round
   sixty-eight's), which a decoder's layers read from memory at every step: the projection
   ~1.08x and 1-4 rows 1.03-2.08x faster, W2 within 3% ("Round sixty-nine"). */
AVX2 static inline int32_t load32(const int16_t *a) {
  int32_t v;
  memcpy(&v, a, 4);
  return v;
}
/* 16 packed int8 weights (a block's pair of k) widened to the 16 int16 vpmaddwd reads */
AVX2 static inline __m256i i8_load_wide(const int8_t *s) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)s));
}

/* The whole tile's sums, 4 rows x 3 blocks, in 16 registers: the 12 sums, two blocks' weights,
   the row's value and a product; the third block's weights read from memory by each of the 4
   rows' products (1.7 loads a cycle at two products a cycle). Each product and its add are one
   asm block: in C, gcc 12 copied every sum to another register after each add (the sums in an
   array: ~half the rate) or sent one to the stack. */
#define I8_MADD(sum, weights, where)                                                             \
  __asm__("vpmaddwd %[w], %[x], %[t]\n\tvpaddd %[t], %[c], %[c]"                                   \
          : [c] "+x"(sum), [t] "=&x"(t)                                                          \
          : [x] "x"(x), [w] where(weights))
#define I8_ROW(r)                                                                                \
  x = _mm256_set1_epi32(load32(a##r + 2 * i));                                                   \
  I8_MADD(c##r##0, *(const __m256i *)(p0 + 16 * i), "m");                                        \
  I8_MADD(c##r##1, w1, "x");                                                                     \
  I8_MADD(c##r##2, w2, "x");
#define I8_ROWS /* the tile's 12 products of a pair of k, row by row */                        \
  __m256i x, t;                                                                                  \
  I8_ROW(0) I8_ROW(1) I8_ROW(2) I8_ROW(3)
#define I8_SUMS_ZERO                                                                             \
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;   \
  __m256i c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
#define I8_SUMS_OUT                                                                              \
  acc[0][0] = c00, acc[0][1] = c01, acc[0][2] = c02, acc[1][0] = c10, acc[1][1] = c11;          \
  acc[1][2] = c12, acc[2][0] = c20, acc[2][1] = c21, acc[2][2] = c22, acc[3][0] = c30;          \
  acc[3][1] = c31, acc[3][2] = c32;
AVX2 static void i8_sums43(const int16_t *a, int64_t kp, const int16_t *pb, int64_t k2,
                           __m256i acc[4][3]) {
  const int16_t *a0 = a, *a1 = a + kp, *a2 = a + 2 * kp, *a3 = a + 3 * kp;
  const int16_t *p0 = pb, *p1 = pb + k2 * 16, *p2 = pb + 2 * k2 * 16;
  I8_SUMS_ZERO
  for (int64_t i = 0; i < k2; ++i) {
    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p1 + 16 * i));
    const __m256i w2 = _mm256_loadu_si256((const __m256i *)(p2 + 16 * i));
    I8_ROWS
  }
  I8_SUMS_OUT
}
/* i8_sums43 for the first 4 rows of a chunk, from the panel's int8 bytes pb8: each register of
   weights widened (vpmovsxbw) and stored into `wide` for the chunk's other rows' tiles as it is
   first used, instead of a pass of its own before them (3-6% of a 64-row chunk's time at k =
   512). Blocks 1 and 2 widened into registers, block 0 stored and read back by the rows'
   products from `wide`, as i8_sums43 reads it from the widened panel: the same 16 registers. */
AVX2 static void i8_sums43_widen(const int16_t *a, int64_t kp, const int8_t *pb8, int16_t *wide,
                                 int64_t k2, __m256i acc[4][3]) {
  const int16_t *a0 = a, *a1 = a + kp, *a2 = a + 2 * kp, *a3 = a + 3 * kp, *p0 = wide;
  I8_SUMS_ZERO
  for (int64_t i = 0; i < k2; ++i) {
    _mm256_storeu_si256((__m256i *)(wide + 16 * i), i8_load_wide(pb8 + 16 * i));
    const __m256i w1 = i8_load_wide(pb8 + (k2 + i) * 16);
    const __m256i w2 = i8_load_wide(pb8 + (2 * k2 + i) * 16);
    _mm256_storeu_si256((__m256i *)(wide + (k2 + i) * 16), w1);
    _mm256_storeu_si256((__m256i *)(wide + (2 * k2 + i) * 16), w2);
    I8_ROWS
  }
  I8_SUMS_OUT
}
#undef I8_SUMS_OUT
#undef I8_SUMS_ZERO
#undef I8_ROWS
#undef I8_ROW
#undef I8_MADD

/* A tile's sums acc (R rows x U blocks of 8 columns, from row r0 and block b0) scaled, biased and
   written into y (row stride n). */
AVX2 static inline __attribute__((always_inline)) void
i8_out(__m256i acc[4][3], int R, int U, int64_t r0, int64_t b0, int64_t n, float step,
       const float *cs, const float *top, const float *bias, float *y) {
  for (int u = 0; u < U; ++u) {
    const int64_t c = 8 * (b0 + u), left = n - c;
    const __m256i t = first_lanes8(left);
    const __m256 s = left >= 8 ? _mm256_loadu_ps(cs + c) : _mm256_maskload_ps(cs + c, t);
    __m256 bv = _mm256_setzero_ps();
    if (bias) bv = left >= 8 ? _mm256_loadu_ps(bias + c) : _mm256_maskload_ps(bias + c, t);
    for (int r = 0; r < R; ++r) {
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][u]), _mm256_set1_ps(step));
      v = _mm256_mul_ps(v, s);
      v = _mm256_mul_ps(v, _mm256_set1_ps(top[r0 + r]));
      if (bias) {
        __asm__("" : "+x"(v)); /* a multiply and an add, each rounded: no FMA */
        v = _mm256_add_ps(v, bv);
      }
      float *o = y + (r0 + r) * n + c;
      if (left >= 8)
        _mm256_storeu_ps(o, v);
      else
        _mm256_maskstore_ps(o, t, v);
    }
  }
}

/* R rows (1..4) x U blocks of 8 columns (1..3) from row r0 and block b0, the panel's weights
   pb widened (`i8_widen`), or where w8 its int8 bytes, widened here as they are read (a chunk
   of fewer than 4 rows: each weight read once); the constants R, U and w8 unroll its loops
   where it is inlined. */
AVX2 static inline __attribute__((always_inline)) void
i8_tile(const int16_t *a, int64_t kp, const void *pb, int w8, int64_t k2, int R, int U,
        int64_t r0, int64_t b0, int64_t n, float step, const float *cs, const float *top,
        const float *bias, float *y) {
  __m256i acc[4][3];
  const int16_t *ar = a + r0 * kp;
  if (R == 4 && U == 3 && !w8) {
    i8_sums43(ar, kp, (const int16_t *)pb, k2, acc);
  } else {
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k2; ++i) {
      __m256i b[3];
      for (int u = 0; u < U; ++u)
        b[u] = w8 ? i8_load_wide((const int8_t *)pb + (u * k2 + i) * 16)
                  : _mm256_loadu_si256((const __m256i *)((const int16_t *)pb + (u * k2 + i) * 16));
      for (int r = 0; r < R; ++r) {
        const __m256i av = _mm256_set1_epi32(load32(ar + r * kp + 2 * i));
        for (int u = 0; u < U; ++u)
          acc[r][u] = _mm256_add_epi32(acc[r][u], _mm256_madd_epi16(av, b[u]));
      }
    }
  }
  i8_out(acc, R, U, r0, b0, n, step, cs, top, bias, y);
}

#define I8_TILE(R, U, W8) i8_tile(a, kp, pb, W8, k2, R, U, r0, b0, n, step, cs, top, bias, y)
#define I8_LAST(W8)                                                                              \
  switch ((m - r0) * 4 + U) {                                                                    \
  case 13: I8_TILE(3, 1, W8); break;                                                             \
  case 14: I8_TILE(3, 2, W8); break;                                                             \
  case 15: I8_TILE(3, 3, W8); break;                                                             \
  case 9: I8_TILE(2, 1, W8); break;                                                              \
  case 10: I8_TILE(2, 2, W8); break;                                                             \
  case 11: I8_TILE(2, 3, W8); break;                                                             \
  case 5: I8_TILE(1, 1, W8); break;                                                              \
  case 6: I8_TILE(1, 2, W8); break;                                                              \
  case 7: I8_TILE(1, 3, W8); break;                                                              \
  default: break; /* no rows left */                                                             \
  }
/* A panel's tiles for m rows: pb its weights widened, or where w8 (m < 4) its int8 bytes. */
AVX2 static void i8_tiles(const int16_t *a, int64_t kp, const void *pb, int w8, int64_t k2,
                          int64_t m, int64_t b0, int U, int64_t n, float step, const float *cs,
                          const float *top, const float *bias, float *y) {
  int64_t r0 = 0;
  if (w8) {
    I8_LAST(1)
    return;
  }
  for (; r0 + 4 <= m; r0 += 4) {
    if (U == 3) I8_TILE(4, 3, 0);
    else if (U == 2) I8_TILE(4, 2, 0);
    else I8_TILE(4, 1, 0);
  }
  I8_LAST(0)
}
#undef I8_LAST
#undef I8_TILE

/* count int8 weights -> int16 (count a multiple of 16: whole blocks of k pairs) */
AVX2 static void i8_widen(const int8_t *s, int16_t *d, int64_t count) {
  for (int64_t j = 0; j < count; j += 16)
    _mm256_storeu_si256((__m256i *)(d + j), i8_load_wide(s + j));
}

/* work: the rows widened (m x kp int16), then nthreads parts of 48 k2 int16 for the widened
   panels */
AVX2 int int8_product_avx2(const uint8_t *q, int64_t m, int64_t k, int zp, const int8_t *p,
                           int64_t n, float step, const float *cs, const float *top,
                           const float *bias, float *y, int16_t *work, int nthreads) {
  const int64_t k2 = (k + 1) / 2, kp = 2 * k2, blocks = (n + 7) / 8, panels = (blocks + 2) / 3;
  const int64_t mc = (524288 / (2 * kp)) / 4 * 4 > 4 ? (524288 / (2 * kp)) / 4 * 4 : 4;
  int16_t *a = work;
#pragma omp parallel num_threads(nthreads)
  {
    int16_t *wide = work + m * kp + (int64_t)omp_get_thread_num() * 48 * k2;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      const uint8_t *qr = q + r * k;
      int16_t *ar = a + r * kp;
      const __m256i z = _mm256_set1_epi16((int16_t)zp);
      int64_t j = 0;
      for (; j + 16 <= k; j += 16) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qr + j)));
        _mm256_storeu_si256((__m256i *)(ar + j), _mm256_sub_epi16(v, z));
      }
      for (; j < k; ++j) ar[j] = (int16_t)(qr[j] - zp);
      if (kp > k) ar[k] = 0;
    }
    /* The rows in chunks of ~512 KiB of `a` (the panels' weights read and widened once a
       chunk, not the whole of `a` read once a panel: an encoder's thousands of rows), each
       thread the same share of the panels in every chunk. */
    for (int64_t r0 = 0; r0 < m; r0 += mc) {
      const int64_t rows = m - r0 < mc ? m - r0 : mc;
#pragma omp for schedule(static) nowait
      for (int64_t pnl = 0; pnl < panels; ++pnl) {
        const int64_t b0 = 3 * pnl;
        const int U = blocks - b0 < 3 ? (int)(blocks - b0) : 3;
        const int8_t *pb = p + b0 * k2 * 16;
        if (pnl + 1 < panels) { /* the next panel's bytes on their way to L2 */
          const int64_t next = (blocks - b0 - 3 < 3 ? blocks - b0 - 3 : 3) * k2 * 16;
          for (int64_t o = 0; o < next; o += 64)
            _mm_prefetch((const char *)(pb + U * k2 * 16) + o, _MM_HINT_T1);
        }
        const int16_t *ac = a + r0 * kp;
        const float *tc = top + r0;
        float *yc = y + r0 * n;
        if (rows < 4) { /* each weight read once: widened as it is read */
          i8_tiles(ac, kp, pb, 1, k2, rows, b0, U, n, step, cs, tc, bias, yc);
        } else if (U == 3) { /* the first 4 rows widen the panel for the others */
          __m256i acc[4][3];
          i8_sums43_widen(ac, kp, pb, wide, k2, acc);
          i8_out(acc, 4, 3, 0, b0, n, step, cs, tc, bias, yc);
          i8_tiles(ac + 4 * kp, kp, wide, 0, k2, rows - 4, b0, U, n, step, cs, tc + 4, bias,
                   yc + 4 * n);
        } else { /* the last panel, of 1 or 2 blocks */
          i8_widen(pb, wide, U * k2 * 16);
          i8_tiles(ac, kp, wide, 0, k2, rows, b0, U, n, step, cs, tc, bias, yc);
        }
      }
    }
  }
  return 0;
}
/* A decoding step's attention on AVX2 with FMA (8 lanes; CPUs without AVX-512, as Zen 3): the
   same work as `step_head` above, in the same order of keys, with its own roundings. */
#define AVX2FMA __attribute__((target("avx2,fma")))
AVX2FMA static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
AVX2FMA static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
AVX2FMA static inline __m256 ld8(const float *p, int64_t n) { /* min(n, 8) floats, the rest 0 */
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes8(n));
}
AVX2FMA static inline __m256 ld8bf(const uint16_t *p, int64_t n) { /* the same of bf16 */
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128((const __m128i *)p);
  } else {
    uint16_t t[8] = {0};
    for (int64_t z = 0; z < n; ++z) t[z] = p[z];
    h = _mm_loadu_si128((const __m128i *)t);
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AVX2FMA static inline __m256 ld8or(const float *p, int64_t n, __m256 fill) { /* the rest: fill */
  if (n >= 8) return _mm256_loadu_ps(p);
  const __m256i in = first_lanes8(n);
  return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, in), _mm256_castsi256_ps(in));
}
AVX2FMA static inline void st8(float *p, __m256 v, int64_t n) { /* min(n, 8) floats */
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, first_lanes8(n), v);
}
/* exp(x) for x <= 0 (and -inf), as exp_nonpositive; below -87 it gives e^-87 (2^n must stay a
   normal number without AVX-512's scalef), nothing beside a softmax's largest term e^0 = 1 */
AVX2FMA static inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

AVX2FMA static void step_head_avx2(const float *q, int64_t qi, const float *k, int kbf16,
                                   int64_t kj, int64_t kc, const void *v, int vbf16, int64_t vj,
                                   const float *bias, int64_t mi, int64_t mj, int64_t Tq,
                                   int64_t L, int64_t d, int64_t dv, float c, void *out,
                                   int obf16, float *s, int32_t *idx, const float *pk,
                                   const char *pv) {
  const __m256 vninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
  const int64_t vsize = vbf16 ? 2 : 4, ksize = kbf16 ? 2 : 4;
  for (int64_t i = 0; i < Tq; ++i) {
    const float *qr = q + i * qi, *br = bias ? bias + i * mi : NULL;
    int64_t n = 0;
    if (kc == 1) {
      if (br)
        for (int64_t j = 0; j < L; ++j) idx[n] = (int32_t)j, n += br[j * mj] != -INFINITY;
      else
        for (; n < L; ++n) idx[n] = (int32_t)n;
      for (int64_t m = 0; m < n; ++m) {
        if (pk && i == 0)
          for (int64_t j = m * L / n; j < (m + 1) * L / n; ++j)
            for (int64_t x = 0; x < d * ksize; x += 64)
              _mm_prefetch((const char *)pk + j * kj * ksize + x, _MM_HINT_T0);
        const char *kr = (const char *)k + idx[m] * kj * ksize;
        __m256 acc = zero;
        for (int64_t x = 0; x < d; x += 8) {
          const __m256 kx = kbf16 ? ld8bf((const uint16_t *)kr + x, d - x)
                                  : ld8((const float *)kr + x, d - x);
          acc = _mm256_fmadd_ps(ld8(qr + x, d - x), kx, acc);
        }
        float sc = hsum8(acc);
        if (c > 0.f) sc = sc / c;
        s[m] = br ? sc + br[idx[m] * mj] : sc;
      }
    } else {
      n = L;
      if (br)
        while (n > 0 && br[(n - 1) * mj] == -INFINITY) --n;
      for (int64_t j = 0; j < n; j += 32) {
        __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, e0 = zero, e1 = zero, e2 = zero,
               e3 = zero;
        const int64_t w = n - j;
        for (int64_t x = 0; x < d; x += 2) {
          const float *kr = k + x * kc + j;
          if (pk && i == 0)
            for (int64_t z = 0; z < 32 && j + z < L; z += 16) {
              _mm_prefetch((const char *)(pk + x * kc + j + z), _MM_HINT_T0);
              if (x + 1 < d)
                _mm_prefetch((const char *)(pk + (x + 1) * kc + j + z), _MM_HINT_T0);
            }
          const __m256 qx = _mm256_set1_ps(qr[x]);
          a0 = _mm256_fmadd_ps(qx, ld8(kr, w), a0);
          if (w > 8) a1 = _mm256_fmadd_ps(qx, ld8(kr + 8, w - 8), a1);
          if (w > 16) a2 = _mm256_fmadd_ps(qx, ld8(kr + 16, w - 16), a2);
          if (w > 24) a3 = _mm256_fmadd_ps(qx, ld8(kr + 24, w - 24), a3);
          if (x + 1 == d) break;
          const __m256 qy = _mm256_set1_ps(qr[x + 1]);
          kr += kc;
          e0 = _mm256_fmadd_ps(qy, ld8(kr, w), e0);
          if (w > 8) e1 = _mm256_fmadd_ps(qy, ld8(kr + 8, w - 8), e1);
          if (w > 16) e2 = _mm256_fmadd_ps(qy, ld8(kr + 16, w - 16), e2);
          if (w > 24) e3 = _mm256_fmadd_ps(qy, ld8(kr + 24, w - 24), e3);
        }
        const __m256 a[4] = {_mm256_add_ps(a0, e0), _mm256_add_ps(a1, e1),
                             _mm256_add_ps(a2, e2), _mm256_add_ps(a3, e3)};
        for (int u = 0; u < 4 && j + 8 * u < n; ++u) {
          const int64_t j0 = j + 8 * u;
          __m256 sc = a[u];
          if (c > 0.f) sc = _mm256_div_ps(sc, _mm256_set1_ps(c));
          if (br) {
            float b[8] = {0};
            for (int64_t z = 0; z < 8 && j0 + z < n; ++z) b[z] = br[(j0 + z) * mj];
            sc = _mm256_add_ps(sc, _mm256_loadu_ps(b));
          }
          st8(s + j0, sc, n - j0);
        }
      }
    }
    __m256 top = vninf;
    for (int64_t j = 0; j < n; j += 8) top = _mm256_max_ps(top, ld8or(s + j, n - j, vninf));
    const float mx = hmax8(top);
    float sum = 0.f;
    if (mx != -INFINITY) {
      const __m256 vt = _mm256_set1_ps(mx);
      __m256 acc = zero;
      for (int64_t j = 0; j < n; j += 8) {
        const __m256 x = ld8or(s + j, n - j, vninf);
        const __m256 legal = _mm256_cmp_ps(x, vninf, _CMP_NEQ_UQ);
        const __m256 e = _mm256_and_ps(legal, exp8_nonpositive(_mm256_sub_ps(x, vt)));
        st8(s + j, e, n - j);
        acc = _mm256_add_ps(acc, e);
      }
      sum = hsum8(acc);
      const __m256 vs = _mm256_set1_ps(sum);
      for (int64_t j = 0; j < n; j += 8) st8(s + j, _mm256_div_ps(ld8(s + j, n - j), vs), n - j);
    }
    if (pv && i == 0 && !(sum > 0.f && n > 0))
      for (int64_t j = 0; j < L; ++j)
        for (int64_t x = 0; x < dv * vsize; x += 64)
          _mm_prefetch(pv + j * vj * vsize + x, _MM_HINT_T0);
    for (int64_t x = 0; x < dv; x += 32) {
      const int64_t w = dv - x;
      __m256 a[4] = {zero, zero, zero, zero};
      for (int64_t m = 0; sum > 0.f && m < n; ++m) {
        if (pv && i == 0 && x == 0)
          for (int64_t j = m * L / n; j < (m + 1) * L / n; ++j)
            for (int64_t z = 0; z < dv * vsize; z += 64)
              _mm_prefetch(pv + j * vj * vsize + z, _MM_HINT_T0);
        if (s[m] == 0.f) continue;
        const int64_t j = kc == 1 ? idx[m] : m;
        const __m256 wt = _mm256_set1_ps(s[m]);
        for (int u = 0; u < 4 && w > 8 * u; ++u) {
          const __m256 r = vbf16 ? ld8bf((const uint16_t *)v + j * vj + x + 8 * u, w - 8 * u)
                                 : ld8((const float *)v + j * vj + x + 8 * u, w - 8 * u);
          a[u] = _mm256_fmadd_ps(wt, r, a[u]);
        }
      }
      for (int u = 0; u < 4 && w > 8 * u; ++u) {
        if (obf16) {
          float t[8];
          _mm256_storeu_ps(t, a[u]);
          uint16_t *o = (uint16_t *)out + i * dv + x + 8 * u;
          for (int64_t z = 0; z < 8 && z < w - 8 * u; ++z) o[z] = tobf(t[z]);
        } else {
          st8((float *)out + i * dv + x + 8 * u, a[u], w - 8 * u);
        }
      }
    }
  }
}

/* q (B, H, Tq, d): element (b, h, i, x) at q + b qb + h qh + i qi + x; keys (B, H, L, d) at
   k + b kb + h kh + j kj + x kc (kc == 1, fp32 or bf16 (kbf16); or kj == 1, fp32); values
   (B, H, L, dv) at v + b vb + h vh + j vj + x, fp32 or bf16 (vbf16); bias at bias + b mb +
   h mh + i mi + j mj (0 strides: shared), or NULL; out (B, H, Tq, dv) contiguous, fp32 or bf16
   (obf16); work: nthreads x 2L floats.
   The heads are shared out among nthreads OpenMP threads; each is computed the same way
   whichever thread takes it and whatever else is in the batch, by `step_head` where avx512
   (AVX-512 F, BW and VL), else by `step_head_avx2` (AVX2 and FMA): only the form called needs
   its instructions. */
int step_attention(const float *q, int64_t qb, int64_t qh, int64_t qi, const void *k, int kbf16,
                   int64_t kb, int64_t kh, int64_t kj, int64_t kc, const void *v, int vbf16,
                   int64_t vb, int64_t vh, int64_t vj, const float *bias, int64_t mb, int64_t mh,
                   int64_t mi, int64_t mj, int64_t B, int64_t H, int64_t Tq, int64_t L, int64_t d,
                   int64_t dv, float c, void *out, int obf16, float *work, int nthreads,
                   int avx512) {
  const int64_t vsize = vbf16 ? 2 : 4, osize = obf16 ? 2 : 4, ksize = kbf16 ? 2 : 4;
  void (*head)(const float *, int64_t, const float *, int, int64_t, int64_t, const void *, int,
               int64_t, const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               float, void *, int, float *, int32_t *, const float *, const char *) =
      avx512 ? step_head : step_head_avx2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t r = 0; r < B * H; ++r) {
    const int64_t b = r / H, h = r % H, b1 = (r + 1) / H, h1 = (r + 1) % H;
    float *s = work + omp_get_thread_num() * 2 * L;
    const int last = r + 1 == B * H;
    head(q + b * qb + h * qh, qi, (const float *)((const char *)k + (b * kb + h * kh) * ksize),
         kbf16, kj, kc, (const char *)v + (b * vb + h * vh) * vsize, vbf16, vj,
         bias ? bias + b * mb + h * mh : NULL, mi, mj, Tq, L, d, dv, c,
         (char *)out + r * Tq * dv * osize, obf16, s, (int32_t *)(s + L),
         last ? NULL : (const float *)((const char *)k + (b1 * kb + h1 * kh) * ksize),
         last ? NULL : (const char *)v + (b1 * vb + h1 * vh) * vsize);
  }
  return 0;
}

/* ---- beam search's candidates: each row's n largest values (search._rows_best) ---- */

/* A row's best so far, vals[0 .. m) from the largest down and ids their columns: (v, j) goes
   after every value >= v (a column seen earlier keeps its place in a tie); slot m - 1 is free,
   or holds the one that drops out. vals hold rank keys: a NaN ranks as -inf (never a better
   candidate than a number). */
static inline void top_insert(float *vals, int64_t *ids, int64_t m, float v, int64_t j) {
  int64_t i = m - 1;
  for (; i > 0 && vals[i - 1] < v; --i) {
    vals[i] = vals[i - 1];
    ids[i] = ids[i - 1];
  }
  vals[i] = v;
  ids[i] = j;
}

/* The columns of `bits` (bit b: column j + b) whose values beat the n-th best, in column order;
   returns the new n-th best */
static inline float top_take(const float *x, int64_t j, uint32_t bits, float *vals,
                             int64_t *ids, int64_t n) {
  float thr = vals[n - 1];
  while (bits) {
    const int b = __builtin_ctz(bits);
    bits &= bits - 1;
    if (x[j + b] > thr) {
      top_insert(vals, ids, n, x[j + b], j + b);
      thr = vals[n - 1];
    }
  }
  return thr;
}

/* A row's columns n .. V against its best n (ranked in vals, ids): 64 at a time, a vector
   compare against the n-th best (a column rarely beats it), then the tail 16 at a time with
   the lanes past V left out */
AVX512 static void top_scan16(const float *x, int64_t V, int64_t n, float *vals, int64_t *ids) {
  float thr = vals[n - 1];
  int64_t j = n;
  for (; j + 64 <= V; j += 64) {
    const __m512 t = _mm512_set1_ps(thr);
    const __mmask16 m0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), t, _CMP_GT_OQ);
    const __mmask16 m1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 16), t, _CMP_GT_OQ);
    const __mmask16 m2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 32), t, _CMP_GT_OQ);
    const __mmask16 m3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 48), t, _CMP_GT_OQ);
    if (m0 | m1 | m2 | m3) {
      thr = top_take(x, j, m0, vals, ids, n);
      thr = top_take(x, j + 16, m1, vals, ids, n);
      thr = top_take(x, j + 32, m2, vals, ids, n);
      thr = top_take(x, j + 48, m3, vals, ids, n);
    }
  }
  for (; j < V; j += 16) {
    const __mmask16 in = V - j >= 16 ? 0xffff : (__mmask16)((1u << (V - j)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(in, x + j);
    thr = top_take(x, j, _mm512_mask_cmp_ps_mask(in, v, _mm512_set1_ps(thr), _CMP_GT_OQ), vals,
                   ids, n);
  }
}

/* The same on AVX2: 32 at a time, the tail 8 at a time (the lanes past V read as 0 and left out
   of the mask): the same columns */
AVX2 static uint32_t gt8(const float *p, __m256 t) {
  return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), t, _CMP_GT_OQ));
}
AVX2 static void top_scan8(const float *x, int64_t V, int64_t n, float *vals, int64_t *ids) {
  float thr = vals[n - 1];
  int64_t j = n;
  for (; j + 32 <= V; j += 32) {
    const __m256 t = _mm256_set1_ps(thr);
    const uint32_t m0 = gt8(x + j, t), m1 = gt8(x + j + 8, t), m2 = gt8(x + j + 16, t),
                   m3 = gt8(x + j + 24, t);
    if (m0 | m1 | m2 | m3) {
      thr = top_take(x, j, m0, vals, ids, n);
      thr = top_take(x, j + 8, m1, vals, ids, n);
      thr = top_take(x, j + 16, m2, vals, ids, n);
      thr = top_take(x, j + 24, m3, vals, ids, n);
    }
  }
  for (; j < V; j += 8) {
    const int64_t left = V - j < 8 ? V - j : 8;
    const __m256 v = _mm256_maskload_ps(x + j, first_lanes8(left));
    const uint32_t in = (1u << left) - 1;
    thr = top_take(x, j, (uint32_t)_mm256_movemask_ps(
        _mm256_cmp_ps(v, _mm256_set1_ps(thr), _CMP_GT_OQ)) & in, vals, ids, n);
  }
}

/* x (rows, V) fp32 rows -> ids (rows, n) the columns of each row's n largest values (1 <= n
   <= V), from the largest down, a tie to the column first in the row, a NaN ranked as -inf
   (never above a number); vals (rows, n) their values as x holds them. One pass over each
   row: its first n columns ranked, then the rest scanned by `top_scan16` where avx512 (AVX-512
   F), else by `top_scan8` (AVX2): the same columns as a scan one column at a time, whatever the
   vector width. The rows are shared out among nthreads OpenMP threads. */
int row_top(const float *x, int64_t rows, int64_t V, int64_t n, int64_t *ids, float *vals,
            int nthreads, int avx512) {
  void (*scan)(const float *, int64_t, int64_t, float *, int64_t *) =
      avx512 ? top_scan16 : top_scan8;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * V;
    float *vr = vals + r * n;
    int64_t *ir = ids + r * n;
    for (int64_t j = 0; j < n; ++j) /* the first n, ranked */
      top_insert(vr, ir, j + 1, xr[j] != xr[j] ? -INFINITY : xr[j], j);
    scan(xr, V, n, vr, ir);
    for (int64_t i = 0; i < n; ++i) vr[i] = xr[ir[i]]; /* the values (a NaN's own, not -inf) */
  }
  return 0;
}
"""

# -O3: the dropout mask's four PCG64 runs stay in registers (0.57 against 1.9 ms at -O2 for
# 2M values, 2 threads); the other kernels as fast or faster.
_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp"]
# This CPU's feature flags, read from /proc/cpuinfo once for the ISA choices below.
_CPU_FLAGS = cpuinfo.cpu_flags()
# The residual LayerNorm's, ReLU's and the attention softmax's rows are AVX-512 code (F, BW and
# VL: every AVX-512 CPU but the Xeon Phi has the three); without it the CPU keeps torch's ops.
_AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= _CPU_FLAGS
# `Int8Linear`'s row kernels run in AVX-512 (F), or AVX2 where a CPU has no AVX-512.
_ROWS_ISA = "avx512" if _AVX512 else "avx2" if "avx2" in _CPU_FLAGS else None
# `int8_product` is AVX2's code alone (a CPU without VNNI runs it: `translate.int8_avx2`).
_INT8_AVX2 = "avx2" in _CPU_FLAGS
# A decoding step's attention (`step_attention`) in AVX-512 (F, BW, VL), or AVX2 with FMA.
_ATTENTION_ISA = "avx512" if _AVX512 else "avx2" if {"avx2", "fma"} <= _CPU_FLAGS else None
# A training step's attention (`attention_train`) multiplies bf16 in bf16 products: on AMX's
# tiles where the CPU has them, its heads' products on AVX-512's fp32 lanes having run at ~100
# GFLOP/s, 11% of a W1 step on the AMX Xeon (docs/performance.md, "Round fifty-one"); else on
# AVX-512 BF16's dot products (VDPBF16PS: twice the fp32 lanes' rate on a Zen 4, "Round
# sixty-five"). TRANSFORMER_ATTENTION_BF16=0 (or the older TRANSFORMER_ATTENTION_AMX=0) keeps the
# lanes (a before/after); `attention_bf16` and `attention_products` switch it in a process.
_AMX = {"amx_tile", "amx_bf16"} <= _CPU_FLAGS and _AVX512
_DOTS = "avx512_bf16" in _CPU_FLAGS and _AVX512
_ATTENTION_OFF_BY = next(  # the variable that keeps the lanes, for `describe`
    (
        v
        for v in ("TRANSFORMER_ATTENTION_BF16", "TRANSFORMER_ATTENTION_AMX")
        if os.environ.get(v) == "0"
    ),
    None,
)
ATTENTION_BF16 = _ATTENTION_OFF_BY is None
# `attention_products`' names for the C side's modes (`attention_bf16` in the source)
_PRODUCTS = ("lanes", "tiles", "dots")
# A bf16 linear layer's weight gradient dW = g^T x (`weight_grad`) multiplies on AMX's tiles
# too: oneDNN ran the square layers' (512 x 3,888) x (3,888 x 512) at ~1,100 GFLOP/s alone and
# ~850 in a W1 step, the rest of the step's products at 1,500-1,900 (docs/performance.md,
# "Round fifty-two"). TRANSFORMER_WEIGHT_GRAD_AMX=0 keeps oneDNN's; `weight_grad_amx`
# switches it in a process.
WEIGHT_GRAD_AMX = os.environ.get("TRANSFORMER_WEIGHT_GRAD_AMX", "1") != "0"
# A bf16 decoder's pre-softmax projection (`project`) multiplies on AMX's tiles as well, its
# logits summed and kept in fp32: oneDNN's bf16 product rounds them to bf16, steps of 1/16
# between 8 and 16 that beam search ranks (docs/performance.md, "Round fifty-three").
# TRANSFORMER_PROJECT_AMX=0 keeps oneDNN's; `project_amx` switches it in a process.
PROJECT_AMX = os.environ.get("TRANSFORMER_PROJECT_AMX", "1") != "0"
# The two switches in this process (`weight_grad_amx`, `project_amx`): the variables' values
# until switched.
_TILES_ON = {"weight_grad": WEIGHT_GRAD_AMX, "project": PROJECT_AMX}
_LIB: ctypes.PyDLL | None = None
_NOGIL: ctypes.CDLL | None = None  # the same library, called without the GIL
_PATH: Path | None = None  # the file `_LIB` was loaded from
_WHY: str | None = None  # why there is no library, once `_library` has tried
_TRIED = False
# Libraries built ahead (`build_ahead`, `transformer kernels`) for a process without a C
# compiler: the package's own folder goes wherever the package is installed or copied (a
# container image's second stage, an environment copied to a machine without gcc).
PREBUILT = Path(__file__).resolve().parent / "compiled"
NO_COMPILER = "no C compiler ($CC, cc, gcc or clang) on PATH"
_LOADING = threading.Lock()


def cache_dir() -> Path:
    """Where built kernels are kept: $TRANSFORMER_KERNELS, else the user's cache folder."""
    if os.environ.get("TRANSFORMER_KERNELS"):
        return Path(os.environ["TRANSFORMER_KERNELS"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transformer"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _source_key() -> str:
    """The hash of the source and flags: a library of another version never matches it."""
    return hashlib.sha256("\0".join([_SOURCE, *_FLAGS]).encode()).hexdigest()[:16]


class CompileError(OSError):
    """The C compiler failed on the source (as against a folder that cannot be written)."""


def _compile(cc: str, src: Path, out: Path) -> subprocess.CompletedProcess:
    """`cc` with `_FLAGS` on the C file `src`, into the shared library `out` (its own function:
    the tests' empty cache folders copy a build of the same source, compiler and flags)."""
    return subprocess.run([cc, *_FLAGS, "-o", str(out), str(src)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _library_name(cc: str) -> str:
    """The file name of the library this source, its flags and the compiler `cc` build."""
    compiler = hashlib.sha256(os.path.realpath(cc).encode()).hexdigest()[:8]
    return f"kernels-{_source_key()}-{compiler}.so"


def _build(cc: str, folder: Path | None = None) -> Path:
    """The shared library for this source and compiler, compiled once into `folder` (default
    the cache folder)."""
    folder = cache_dir() if folder is None else folder
    path = folder / _library_name(cc)
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(_SOURCE)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        part = Path(name)
        try:
            done = _compile(cc, src, part)
            if done.returncode != 0:
                raise CompileError(f"{cc} failed: {done.stderr.strip().splitlines()[:1]}")
            os.replace(part, path)  # whole or not at all: another process may be loading it
        finally:
            part.unlink(missing_ok=True)
    return path


def _check(lib: ctypes.PyDLL) -> None:
    """Raise unless the library's copy equals torch's on shapes with every kind of edge, and
    (on an AVX-512F CPU) its residual LayerNorm agrees with torch's, forward and backward."""
    for fn in (lib.transpose16, lib.transpose16_wide) if _AVX512 else (lib.transpose16,):
        for rows, cols in ((1, 1), (8, 8), (37, 70), (300, 260)):  # whole blocks and edges
            x = torch.arange(rows * cols, dtype=torch.int16).reshape(rows, cols)
            out = torch.empty((cols, rows), dtype=torch.int16)
            fn(x.data_ptr(), out.data_ptr(), rows, cols, cols, 2)
            if not torch.equal(out, x.t()):
                raise OSError("its transposing copy differs from torch's")
    if not _AVX512:
        return
    g = torch.Generator().manual_seed(0)
    x, f, gy = (torch.randn(5, 40, generator=g).to(torch.bfloat16) for _ in range(3))
    keep = torch.rand(5, 40, generator=g) >= 0.25
    w, b = torch.rand(40, generator=g) + 0.5, torch.randn(40, generator=g)
    y, s, mean, rstd = _residual_norm(lib, x, f, keep, 4 / 3, w, b, 1e-5)
    dx, df, dw, db = _residual_norm_backward(lib, gy, s, mean, rstd, w, keep, 4 / 3)
    with torch.enable_grad():  # (first called inside a forward, perhaps)
        xs = x.double().requires_grad_()
        t = (f * (4 / 3)).mul_(keep.to(torch.bfloat16)).double()
        ref = torch.nn.functional.layer_norm(xs + t, (40,), w.double(), b.double(), 1e-5)
        # The sum's gradient is the same vector-Jacobian product; `backward(gy)` with a
        # gradient given would import torch's symbolic shapes (sympy): 0.2 s of every start.
        (ref * gy.double()).sum().backward()
    ok = torch.equal(s, (xs + t).detach().to(torch.bfloat16))
    for ours, theirs in ((y, ref.detach()), (dx, xs.grad)):
        ok = ok and bool(((ours.double() - theirs).abs() <= 1e-2 * theirs.abs().max()).all())
    if not ok:
        raise OSError("its residual LayerNorm differs from torch's")


def _gomp() -> set[str]:
    """The OpenMP runtimes mapped into this process (torch's, and any a package bundles)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line}


def _library() -> ctypes.PyDLL | None:
    if not _TRIED:
        with _LOADING:  # threads asking at once (decoding streams): one loads, the rest wait
            if not _TRIED:
                _load()
    return _LIB


def built_ahead() -> list[Path]:
    """The libraries built ahead for this source, newest first: in the cache folder (built
    there by another compiler, or put there by `build_ahead`), then in `PREBUILT`."""
    found: list[Path] = []
    for folder in dict.fromkeys((cache_dir(), PREBUILT)):
        try:
            paths = sorted(
                folder.glob(f"kernels-{_source_key()}-*.so"),
                key=lambda p: p.stat().st_mtime_ns, reverse=True,
            )  # fmt: skip
        except OSError:  # an unreadable folder, a file gone meanwhile
            continue
        found += [p for p in paths if p not in found]
    return found


def _load() -> None:
    """Build (or find), load and check the library: `_LIB` and `_NOGIL`, or `_WHY` not."""
    global _LIB, _NOGIL, _PATH, _WHY, _TRIED
    try:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise OSError(f"the kernel is for x86-64, this CPU is {platform.machine()}")
        problems, built, unwritable = [], None, False
        cc = _compiler()
        if cc is not None:
            try:
                built = _build(cc)
                _LIB, _NOGIL = _opened(built, cc)
                _PATH = Path(_LIB._name)
            except (CompileError, subprocess.SubprocessError) as e:
                problems.append(str(e))
            except OSError as e:  # the cache folder: a read-only or missing home (`docker -u`)
                problems.append(str(e))
                unwritable = True
        else:
            problems.append(NO_COMPILER)
        ahead = [p for p in built_ahead() if p != built] if _LIB is None else []
        for path in ahead:
            try:
                _LIB, _NOGIL = _opened(path, None)
                _PATH = path
                logger.info("compiled kernels built ahead: %s (%s)", _PATH, problems[0])
                break
            except OSError as e:
                problems.append(f"{path}: {e}")
        if _LIB is None and unwritable:
            try:
                _LIB, _NOGIL, _PATH = _built_privately(cc, problems[0])
            except (OSError, subprocess.SubprocessError) as e:
                problems.append(f"built in a temporary folder: {e}")
        if _LIB is None:
            if not ahead:
                problems.append(f"nothing built ahead (`transformer kernels`) in {PREBUILT}")
            raise OSError("; ".join(problems))
    except (OSError, subprocess.SubprocessError) as e:
        _LIB = _NOGIL = _PATH = None
        _WHY = str(e)
        if platform.machine().lower() in ("x86_64", "amd64"):  # a reason a user can remove
            logger.warning(
                "torch's ops instead of the compiled kernels (%s): decoding runs at ~80%% of "
                "its speed; `transformer kernels` builds them ahead where there is a C compiler, "
                'for a copy of this environment without one (docs/decoding.md, "The compiled '
                'kernels")',
                _WHY,
            )
        else:
            logger.info("torch's ops instead of the compiled kernels (%s)", _WHY)
    finally:
        _TRIED = True  # last: a thread that sees it sees _LIB (or _WHY) as it will stay


def _built_privately(cc: str, why: str) -> tuple[ctypes.PyDLL, ctypes.CDLL, Path]:
    """The library built for this process alone, in a folder of its own that only its user can
    write (`mkdtemp`: no other user's file is ever loaded), removed at exit. For a cache folder
    that cannot be written (`why`): a container run as a user without a home (`docker run -u`:
    HOME=/), a read-only home. ~1.2 s a process (the build)."""
    folder = Path(tempfile.mkdtemp(prefix="transformer-kernels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    lib, free = _opened(_build(cc, folder), cc, folder)
    logger.info(
        "compiled kernels built for this process alone in %s (%s): set TRANSFORMER_KERNELS to "
        "a folder it may write, or run `transformer kernels` in the environment's image",
        folder, why,
    )  # fmt: skip
    return lib, free, Path(lib._name)


def _opened(
    path: Path, cc: str | None, folder: Path | None = None
) -> tuple[ctypes.PyDLL, ctypes.CDLL]:
    """The library at `path`, loaded, its functions typed and checked against torch; with `cc`
    (the file is one it built into `folder`, default the cache folder), a damaged file is built
    again once."""
    before = _gomp()
    try:
        lib = ctypes.PyDLL(str(path))  # holds the GIL: a wait for it costs more than the copy
    except OSError:  # a damaged file in the cache (a full disk, a copy cut short): again
        if cc is None:
            raise
        path.unlink(missing_ok=True)
        lib = ctypes.PyDLL(str(_build(cc, folder)))
    added = _gomp() - before
    if added:  # its threads would spin beside torch's: slower than torch's own copy
        raise OSError(f"it loaded a second OpenMP runtime ({', '.join(sorted(added))})")
    for fn in (lib.transpose16, lib.transpose16_wide):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.residual_norm_fwd.argtypes = [p, p, p, f32, p, p, f32, i64, i64, p, p, p, p, p, i32]
    lib.residual_norm_bwd.argtypes = [p, p, p, p, p, p, f32, i64, i64, p, p, p, p, p, i32]
    lib.residual_norm_fwd.restype = lib.residual_norm_bwd.restype = ctypes.c_int
    lib.relu16.argtypes, lib.relu16_grad.argtypes = [p, i64, i32], [p, p, p, i64, i32]
    lib.relu16.restype = lib.relu16_grad.restype = ctypes.c_int
    u64 = ctypes.c_uint64
    lib.dropout_keep.argtypes = [u64, u64, u64, u64, ctypes.c_uint32, p, i64, i32]
    lib.dropout_keep.restype = ctypes.c_int
    lib.masked_softmax_fwd.argtypes = [p, p] + [i64] * 8 + [f32, p, p, i32]
    lib.masked_softmax_bwd.argtypes = [p, p, i64, i64, f32, p, i32]
    lib.masked_softmax_fwd.restype = lib.masked_softmax_bwd.restype = ctypes.c_int
    lib.column_sums.argtypes, lib.column_sums.restype = [p, i64, i64, p, p, i32], ctypes.c_int
    lib.relu16_grad_sums.argtypes = [p, p, p, i64, i64, p, p, i32]
    lib.relu16_grad_sums.restype = ctypes.c_int
    lib.embed_fwd.argtypes = [p, p, p, p, i64, i64, f32, p, f32, p, i32]
    lib.embed_bwd.argtypes = [p, p, i64, i64, f32, p, f32, p, i64, i32]
    lib.embed_fwd.restype = lib.embed_bwd.restype = ctypes.c_int
    lib.widen_minus.argtypes, lib.widen_minus.restype = [p, i64, i64, p, p, i32], ctypes.c_int
    lib.adam_sumsq.argtypes = [i64, p, p, p, i32, p, p, i32]
    lib.adam_update.argtypes = [i64, p, p, p, p, p, p, p, p, p, p, i32, p, i32]
    lib.adam_sumsq.restype = lib.adam_update.restype = ctypes.c_int
    with torch.inference_mode(False):  # first called in a translation's, perhaps
        _check(lib)
    # `Int8Linear`'s row kernels and a step's attention let go of the GIL: a projection's
    # rows in a batch of beams take a millisecond or more, which another decoding stream
    # (translate.py) can spend in Python meanwhile.
    free = ctypes.CDLL(lib._name)
    for isa in ("", "_avx2"):
        rows_in, rows_out = (
            getattr(free, "int8_rows_in" + isa),
            getattr(free, "int8_rows_out" + isa),
        )
        rows_in.argtypes, rows_out.argtypes = (
            [p, i64, i64, i32, f32, p, p, i32, p, f32, i32],
            [p, i64, i64, p, p, i32],
        )
        rows_in.restype = rows_out.restype = ctypes.c_int
    free.int8_product_avx2.argtypes = [p, i64, i64, i32, p, i64, f32, p, p, p, p, p, i32]
    free.int8_product_avx2.restype = ctypes.c_int
    free.step_attention.argtypes = (
        [p, i64, i64, i64, p, i32, i64, i64, i64, i64, p, i32, i64, i64, i64, p]
        + [i64] * 10
        + [f32, p, i32, p, i32, i32]
    )
    free.step_attention.restype = ctypes.c_int
    free.row_top.argtypes, free.row_top.restype = [p, i64, i64, i64, p, p, i32, i32], i32
    # A training step's attention lets go of the GIL too: the weight-gradient helper
    # (gradhelper.py) runs beside its backward.
    free.attention_train_fwd.argtypes = [p, i64, p, p, i64, p, p, p, i32] + [i64] * 6
    free.attention_train_fwd.argtypes += [f32, p, i64, p, i32]
    free.attention_train_bwd.argtypes = [p, i64, p, i64, p, p, i64, p, p, p, i32] + [i64] * 6
    free.attention_train_bwd.argtypes += [f32, p, p, i64, p, p, i64, i32]
    free.attention_train_fwd.restype = free.attention_train_bwd.restype = ctypes.c_int
    lib.attention_bf16.argtypes, lib.attention_bf16.restype = [i32], i32
    lib.attention_bf16(_PRODUCTS.index(_bf16_products() if ATTENTION_BF16 else "lanes"))
    free.weight_grad_amx.argtypes = [p, i64, p, i64, i64, i64, i64, p, i64, i32]
    free.weight_grad_amx.restype = lib.amx_permit.restype = ctypes.c_int
    free.project_amx.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, i32]
    free.project_amx.restype = ctypes.c_int
    return lib, free


def _bf16_products() -> str:
    """The bf16 products this CPU has for `attention_train`: "tiles" (AMX-BF16), else "dots"
    (AVX-512 BF16), else "lanes" (none: the fp32 lanes)."""
    return "tiles" if _AMX else "dots" if _DOTS else "lanes"


def attention_products(which: str | None = None) -> str:
    """Where `attention_train` and its backward multiply in this process: "tiles" (AMX's: bf16
    operands, fp32 sums), "dots" (AVX-512 BF16's VDPBF16PS: the same operands and sums, 2 x 16
    at a time) or "lanes" (AVX-512's fp32 lanes: the operands widened to fp32). `which` sets it
    first, taken only where the CPU has it (both bf16 kinds on an AMX CPU) and the compiler
    knew the instructions (gcc 11, clang 12 on), else the lanes; the tiles, where Linux does
    not give the process them, the dot products."""
    if which is not None and which not in _PRODUCTS:
        raise ValueError(f"attention_products: {which!r} is not one of {', '.join(_PRODUCTS)}")
    if _library() is None:
        return "lanes"
    if which is not None:
        has = {"lanes": True, "tiles": _AMX, "dots": _DOTS}[which]
        _LIB.attention_bf16(_PRODUCTS.index(which) if has else 0)
    return _PRODUCTS[_LIB.attention_bf16(-1)]


def attention_bf16(on: bool | None = None) -> bool:
    """Whether `attention_train` multiplies in bf16 (`attention_products`: the tiles or the dot
    products) rather than on the fp32 lanes; `on` switches first: True to the best bf16
    products the CPU has, False to the lanes."""
    if on is not None:
        attention_products(_bf16_products() if on else "lanes")
    return attention_products() != "lanes"


# Rounds fifty-one to sixty-four's name for the switch, which their scripts under
# benchmarks/results call: on an AMX CPU the same tiles.
attention_amx = attention_bf16


def amx_tiles() -> bool:
    """Whether the kernels can multiply on AMX's tiles in this process: the CPU has AMX-BF16 (and
    AVX-512 F, BW, VL), the compiler knew AMX's instructions (gcc 11, clang 12 on), and Linux
    gives the process the tiles (5.16 on; asked once)."""
    return _AMX and _library() is not None and bool(_LIB.amx_permit())


def _tiles_switch(name: str, on: bool | None) -> bool:
    """Whether the tile kernel `name` of `_TILES_ON` runs (`amx_tiles`, and not switched off);
    `on` sets it first."""
    if on is not None:
        _TILES_ON[name] = bool(on)
    return _TILES_ON[name] and amx_tiles()


def weight_grad_amx(on: bool | None = None) -> bool:
    """Whether `weight_grad` multiplies on AMX's tiles (`amx_tiles`, and not switched off); `on`
    sets it first."""
    return _tiles_switch("weight_grad", on)


def weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """dW = g^T x (M, N) for a linear layer's output gradient g (K, M) and input x (K, N), bf16
    CPU rows: the sum over the K rows on AMX's tiles in fp32, rounded to bf16 once, the same bits
    on any number of threads. None where it does not run (`weight_grad_amx` off, the fused
    kernels off, M not a multiple of 32 or N of 16, a row not contiguous): the caller multiplies
    with torch."""
    if not (FUSED and weight_grad_amx()) or g.dim() != 2 or x.dim() != 2:
        return None
    (rows, m), n = g.shape, x.size(1)
    if rows == 0 or x.size(0) != rows or m % 32 or n % 16:
        return None
    for t in (g, x):
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(1) != 1:
            return None
        if t.stride(0) < t.size(1):
            return None
    out = torch.empty((m, n), dtype=torch.bfloat16)
    args = (g.data_ptr(), g.stride(0), x.data_ptr(), x.stride(0), rows, m, n, out.data_ptr(), n)
    rc = _NOGIL.weight_grad_amx(*args, torch.get_num_threads())
    if rc == -1:
        raise MemoryError(f"no memory for the scratch of a ({m} x {rows}) x ({rows} x {n}) product")
    return out if rc == 0 else None


def project_amx(on: bool | None = None) -> bool:
    """Whether `project` multiplies on AMX's tiles (`amx_tiles`, and not switched off); `on`
    sets it first."""
    return _tiles_switch("project", on)


def project(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """Logits h W^T (..., V) in fp32 for bf16 CPU rows h (..., D) and a projection w (V, D): each
    the fp32 sum of its D products on AMX's tiles, not rounded to bf16, and the same for a row in
    any batch, at any place in it and on any number of threads. None where it does not run
    (`project_amx` off, the fused kernels off, D not a multiple of 32, w's rows not
    contiguous): the caller multiplies with torch."""
    if not (FUSED and project_amx()) or w.dim() != 2 or h.dim() == 0:
        return None
    (v, d), lead = w.shape, h.shape[:-1]
    if h.size(-1) != d or d % 32 or v == 0 or h.numel() == 0:
        return None
    for t in (h, w):
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.requires_grad:
            return None
    if w.stride(1) != 1 or w.stride(0) < d:
        return None
    rows = h.reshape(-1, d)
    if rows.stride(1) != 1 or rows.stride(0) < d or rows.stride(0) % 2 or rows.data_ptr() % 4:
        rows = rows.contiguous()  # the kernel reads h's rows as 32-bit words
    out = torch.empty((rows.size(0), v), dtype=torch.float32)
    args = (rows.data_ptr(), rows.stride(0), rows.size(0), w.data_ptr(), w.stride(0), v, d)
    rc = _NOGIL.project_amx(*args, out.data_ptr(), v, torch.get_num_threads())
    if rc == -1:
        raise MemoryError(f"no memory for the scratch of a ({rows.size(0)} x {d}) projection")
    return out.view(*lead, v) if rc == 0 else None


def unavailable() -> str | None:
    """None when the compiled kernel is in use, else why not (builds it on first call)."""
    _library()
    return _WHY


def library_path() -> Path | None:
    """The file the compiled kernels were loaded from (building them first where needed), or
    None where there are none (`unavailable`)."""
    _library()
    return _PATH


def build_ahead(into: Path | None = None) -> Path:
    """The library in use (built first where needed), copied into `into` (default `PREBUILT`),
    where a process without a C compiler finds it (`built_ahead`: in the cache folder,
    `$TRANSFORMER_KERNELS`, or in `PREBUILT`); returns the copy's path. In `PREBUILT`, the
    libraries of other versions of the source are removed. Raises OSError where there is no
    library (`unavailable`'s reason) or the folder cannot be written (the file is whole or not
    there: `checkpoint.replace_atomic`)."""
    why = unavailable()
    if why is not None:
        raise OSError(why)
    from transformer.checkpoint import replace_atomic

    def copy(tmp: Path) -> None:
        shutil.copyfile(_PATH, tmp)
        os.chmod(tmp, 0o755)

    folder = PREBUILT if into is None else Path(into)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / _PATH.name
    if not (target.exists() and os.path.samefile(target, _PATH)):
        replace_atomic(target, copy)
    if folder == PREBUILT:  # ours alone: an upgraded package's source leaves its old ones
        for old in folder.glob("kernels-*.so"):
            if not old.name.startswith(f"kernels-{_source_key()}-"):
                old.unlink(missing_ok=True)
    return target


def describe() -> list[str]:
    """What the compiled kernels do on this machine, a line each (after `unavailable`)."""
    if unavailable() is not None:
        return [f"not in use: {unavailable()}"]
    off = "off (TRANSFORMER_FUSED_KERNELS=0)"
    training = "AVX-512" if _AVX512 else "not on this CPU (no AVX-512 F, BW and VL)"
    rows = _ROWS_ISA or "not on this CPU (neither AVX-512 nor AVX2)"
    attention = _ATTENTION_ISA or "not on this CPU (neither AVX-512 nor AVX2 with FMA)"
    weight_grads = _tiles_said(
        "weight_grad", "AMX tiles", "torch's product", "TRANSFORMER_WEIGHT_GRAD_AMX"
    )
    logits = _tiles_said(
        "project", "AMX tiles, fp32 logits", "torch's product, bf16 logits",
        "TRANSFORMER_PROJECT_AMX",
    )  # fmt: skip
    return [
        f"in use: {_PATH}",
        "bf16 weight gradients' transposing copy, the dropout mask: x86-64",
        f"bf16 training's residual LayerNorm, ReLU, attention softmax, Adam's step: "
        f"{training if FUSED else off}",
        f"int8 decoding's input rows, a beam's best tokens: {rows if FUSED else off}",
        f"a decoding step's attention: {attention if FUSED else off}",
        f"bf16 training's square weight gradients: {weight_grads if FUSED else off}",
        f"bf16 training's attention products: {_attention_products() if FUSED else off}",
        f"bf16 decoding's output logits: {logits if FUSED else off}",
    ]


def _tiles_said(name: str, on: str, off: str, variable: str) -> str:
    """Where the tile kernel `name`'s products run, for `describe`: `on` where on the tiles."""
    if _tiles_switch(name, None):
        return on
    if _AMX and not _TILES_ON[name]:
        return f"{off} ({variable}=0)"
    return off


def _attention_products() -> str:
    """Where `attention_train`'s products run, for `describe`."""
    which = attention_products()
    if which == "tiles":
        return "AMX tiles"
    if which == "dots":
        return "AVX-512 BF16 dot products"
    if not _AVX512:
        return "not on this CPU (no AVX-512 F, BW and VL)"
    if _DOTS and not ATTENTION_BF16:
        return f"AVX-512 fp32 ({_ATTENTION_OFF_BY}=0)"
    return "AVX-512 fp32"


def transposed(x: torch.Tensor) -> torch.Tensor:
    """x (R, C) -> a contiguous (C, R) copy of x^T: the compiled kernel for a CPU tensor of
    2-byte elements whose rows are contiguous, torch's copy otherwise (the same values)."""
    ok = x.dim() == 2 and x.device.type == "cpu" and x.element_size() == 2
    if not (ok and x.stride(1) == 1 and x.stride(0) >= x.size(1)) or _library() is None:
        return x.t().contiguous()
    rows, cols = x.shape
    out = torch.empty((cols, rows), dtype=x.dtype)
    if x.numel():
        copy = _LIB.transpose16_wide if _AVX512 else _LIB.transpose16
        copy(x.data_ptr(), out.data_ptr(), rows, cols, x.stride(0), _threads(x.numel()))
    return out


# The fused training kernels (residual LayerNorm, ReLU, the attention softmax) may be used:
# `TRANSFORMER_FUSED_KERNELS=0` keeps torch's ops (a check, a before/after); the transposing copy
# and the dropout mask (the same bits either way) are not affected.
FUSED = os.environ.get("TRANSFORMER_FUSED_KERNELS", "1") != "0"


def fused_supported() -> bool:
    """Whether the fused kernels (`residual_norm`, `relu_`, `masked_softmax`) run here: `FUSED`,
    the library built, and the CPU has AVX-512 F, BW and VL."""
    return FUSED and _AVX512 and _library() is not None


def fused_takes(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels may take these tensors: each contiguous bf16 on the CPU,
    `fused_supported()`, not inside torch.compile's trace (the callers' gate before a kernel;
    `_require` is the kernels' own check, which raises)."""
    return (
        all(
            t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
            for t in tensors
        )
        and not torch.compiler.is_compiling()
        and fused_supported()
    )


def _threads(n: int) -> int:
    """OpenMP threads for a kernel over n values: torch's count, one below MIN_THREADED."""
    return torch.get_num_threads() if n >= MIN_THREADED else 1


def _require(what: str, *tensors: torch.Tensor, bf16: bool = True, rows: bool = False) -> None:
    """Raise RuntimeError unless the fused kernels run here (`rows`: the int8 row kernels,
    `rows_supported`), ValueError naming `what` unless every tensor is a contiguous CPU tensor
    (and bf16, with `bf16`)."""
    if not (rows_supported() if rows else fused_supported()):
        lacking = "no AVX2" if rows else "no AVX-512"
        raise RuntimeError(f"{what}: not on this machine ({unavailable() or lacking})")
    for t in tensors:
        if not (t.is_contiguous() and t.device.type == "cpu") or (
            bf16 and t.dtype != torch.bfloat16
        ):
            raise ValueError(f"{what}: contiguous {'bf16 ' if bf16 else ''}CPU tensors")


def _residual_norm(lib, x, f, keep, scale, weight, bias, eps):
    n, d = x.shape
    y, s = torch.empty_like(x), torch.empty_like(x)
    mean, rstd = torch.empty(n), torch.empty(n)
    w, b = weight.detach().float().contiguous(), bias.detach().float().contiguous()
    threads = _threads(x.numel())
    work = torch.empty(threads * d)
    lib.residual_norm_fwd(
        x.data_ptr(), f.data_ptr(), None if keep is None else keep.data_ptr(), scale,
        w.data_ptr(), b.data_ptr(), eps, n, d, s.data_ptr(), y.data_ptr(), mean.data_ptr(),
        rstd.data_ptr(), work.data_ptr(), threads,
    )  # fmt: skip
    return y, s, mean, rstd


def _residual_norm_backward(lib, gy, s, mean, rstd, weight, keep, scale):
    n, d = s.shape
    dx, df = torch.empty_like(s), torch.empty_like(s)
    dw, db = torch.empty(d), torch.empty(d)
    w = weight.detach().float().contiguous()
    threads = _threads(s.numel())
    work = torch.empty(threads * 3 * d)
    lib.residual_norm_bwd(
        gy.data_ptr(), s.data_ptr(), mean.data_ptr(), rstd.data_ptr(), w.data_ptr(),
        None if keep is None else keep.data_ptr(), scale, n, d, dx.data_ptr(), df.data_ptr(),
        dw.data_ptr(), db.data_ptr(), work.data_ptr(), threads,
    )  # fmt: skip
    return dx, df, dw, db


def _rows(what: str, *tensors: torch.Tensor, keep: torch.Tensor | None) -> None:
    """`_require` for (N, D) bf16 tensors of one shape and a bool mask of it (or None)."""
    _require(what, *tensors)
    if keep is not None:
        _require(what, keep, bf16=False)
    if any(t.shape != tensors[0].shape for t in (*tensors, keep) if t is not None):
        raise ValueError(f"{what}: (N, D) tensors of one shape")


def residual_norm(x, f, keep, scale: float, weight, bias, eps: float):
    """LayerNorm(s) with s = x + (f * scale) * keep (keep None: s = x + f), in one pass.

    x, f: (N, D) bf16, contiguous; keep: (N, D) bool or None; weight, bias: (D,). Returns y
    (N, D) bf16, and for `residual_norm_backward` s (bf16, the same bits as torch's x + t),
    mean and 1 / std (N,) fp32. Only where `fused_supported()`.
    """
    _rows("residual_norm", x, f, keep=keep)
    return _residual_norm(_LIB, x, f, keep, scale, weight, bias, eps)


def residual_norm_backward(gy, s, mean, rstd, weight, keep, scale: float):
    """The gradients of `residual_norm`'s y = LayerNorm(s) from gy (N, D) bf16: dx (= ds) and
    df = (dx * keep) * scale (keep None: dx), bf16, and the gain's and bias's, (D,) fp32."""
    _rows("residual_norm_backward", gy, s, keep=keep)
    return _residual_norm_backward(_LIB, gy, s, mean, rstd, weight, keep, scale)


def relu_(h: torch.Tensor) -> torch.Tensor:
    """§3.3's max(0, h) in place on a contiguous bf16 CPU tensor: torch's values (a NaN stays
    one, -0 becomes +0). Only where `fused_supported()` (the same library and CPU)."""
    _require("relu", h)
    if h.numel():
        _LIB.relu16(h.data_ptr(), h.numel(), _threads(h.numel()))
    return h


def relu_grad(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The gradient through `relu_`'s output h: g, with +0 where h <= 0 (torch's
    threshold_backward: a NaN passes it); a new tensor."""
    _require("relu", g, h)
    if g.shape != h.shape:
        raise ValueError("relu_grad: the gradient and the output differ in shape")
    out = torch.empty_like(h)
    if h.numel():
        _LIB.relu16_grad(g.data_ptr(), h.data_ptr(), out.data_ptr(), h.numel(), _threads(h.numel()))
    return out


def relu_grad_sums(g: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`relu_grad`(g, h) for (N, C) rows, and its `column_sums` (bf16) from the same pass: the
    same values and bits as the two calls, dh read once where they read it twice."""
    _require("relu", g, h)
    if g.shape != h.shape or h.dim() != 2:
        raise ValueError("relu_grad_sums: a gradient and an output of the same (N, C) shape")
    n, c = h.shape
    out, sums = torch.empty_like(h), torch.empty(c)
    threads = _threads(h.numel())
    work = torch.empty(threads * c)
    args = (g.data_ptr(), h.data_ptr(), out.data_ptr(), n, c, sums.data_ptr(), work.data_ptr())
    _LIB.relu16_grad_sums(*args, threads)
    return out, sums.to(h.dtype)


def embed(
    weight: torch.Tensor,
    ids: torch.Tensor,
    table: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    keep: torch.Tensor | None,
    keep_scale: float,
) -> torch.Tensor:
    """The packed path's embedding sub-layer in one pass (`model._embed_packed`): row i is
    ((weight[ids[i]] * scale) + table[pos[i]]) * keep_scale * keep[i], rounded to bf16 after
    each product and sum as those torch ops round them (keep None: no dropout). weight (V, D)
    and table (T, D) bf16, ids and pos (N,) int64 (checked in range), keep (N, D) bool; D a
    multiple of 16. Only where `fused_supported()`."""
    _require("embed", weight, table)
    _require("embed", ids, pos, bf16=False)
    n, d = ids.numel(), weight.size(-1)
    _embed_checks("embed", weight, ids, keep, n, d)
    if table.dim() != 2 or table.size(1) != d or pos.dtype != torch.int64 or pos.numel() != n:
        raise ValueError("embed: a (T, D) table and int64 positions, one a row")
    if n and not (0 <= int(pos.min()) and int(pos.max()) < table.size(0)):
        raise ValueError("embed: positions outside the table")
    out = torch.empty((n, d), dtype=torch.bfloat16)
    km = None if keep is None else keep.view(torch.uint8).data_ptr()
    _LIB.embed_fwd(
        weight.data_ptr(), ids.data_ptr(), table.data_ptr(), pos.data_ptr(), n, d, scale, km,
        keep_scale, out.data_ptr(), _threads(n * d),
    )  # fmt: skip
    return out


def embed_backward(
    g: torch.Tensor,
    ids: torch.Tensor,
    scale: float,
    keep: torch.Tensor | None,
    keep_scale: float,
    master_grad: torch.Tensor,
) -> None:
    """`embed`'s gradient added into master_grad (V, D) fp32 in place: row ids[i] gets
    ((g[i] * keep[i]) * keep_scale) * scale, each product rounded to bf16, added in fp32 in
    the order of i (index_add_'s bits)."""
    _require("embed_backward", g)
    _require("embed_backward", ids, master_grad, bf16=False)
    if master_grad.dtype != torch.float32:
        raise ValueError("embed_backward: an fp32 master gradient")
    n, d = ids.numel(), g.size(-1)
    _embed_checks("embed_backward", master_grad, ids, keep, n, d)
    if g.shape != (n, d) or not g.is_contiguous():
        raise ValueError("embed_backward: a contiguous (N, D) gradient")
    km = None if keep is None else keep.view(torch.uint8).data_ptr()
    _LIB.embed_bwd(
        g.data_ptr(), ids.data_ptr(), n, d, scale, km, keep_scale, master_grad.data_ptr(),
        master_grad.size(0), _threads(n * d),
    )  # fmt: skip


def _embed_checks(what: str, rows: torch.Tensor, ids, keep, n: int, d: int) -> None:
    """`embed`'s and `embed_backward`'s shared shape checks (ValueError naming `what`): rows
    (V, D), the weight or its master's gradient, with D a multiple of 16 and every id < V."""
    if rows.dim() != 2 or d % 16 or ids.dtype != torch.int64:
        raise ValueError(f"{what}: a (V, D) weight with D a multiple of 16 and int64 ids")
    if n and not (0 <= int(ids.min()) and int(ids.max()) < rows.size(0)):
        raise ValueError(f"{what}: ids outside the weight's rows")
    if keep is not None and (
        keep.dtype != torch.bool or keep.shape != (n, d) or not keep.is_contiguous()
    ):
        raise ValueError(f"{what}: a contiguous (N, D) bool keep mask")


def pcg64_keep(state: int, inc: int, threshold: int, n: int) -> torch.Tensor | None:
    """(n,) bool: True where the 16-bit piece i of numpy's `PCG64` random_raw() stream from
    this state (its `.state["state"]`: state and inc) is >= threshold: `model.dropout_keep`'s
    mask, the same bits as numpy's, on the threads. None where the library is not built."""
    if _library() is None:
        return None
    keep = torch.empty(n, dtype=torch.bool)
    m = (1 << 64) - 1
    if n:
        _LIB.dropout_keep(
            state >> 64, state & m, inc >> 64, inc & m, threshold, keep.data_ptr(), n,
            _threads(n),
        )  # fmt: skip
    return keep


def masked_softmax(x: torch.Tensor, mask: torch.Tensor, c: float) -> torch.Tensor:
    """softmax over the last dimension of bf16(x / c) (c = 0: of x) with -inf where `mask`
    (bool, broadcastable to x's (B, H, Tq, Tk)) is False, w = 0 in a row with no legal key;
    x contiguous bf16. `model.attention`'s `scores / sqrt(d_k)` and `masked_softmax` in one
    pass, fp32 inside, the output bf16. Only where `fused_supported()`."""
    _require("masked_softmax", x)
    if x.dim() != 4:
        raise ValueError("masked_softmax: a contiguous (B, H, Tq, Tk) bf16 CPU tensor")
    if mask.dtype != torch.bool:
        raise ValueError("masked_softmax: a bool mask")
    m = mask.expand(x.shape)  # strides 0 where it broadcasts
    B, H, Tq, Tk = x.shape
    w = torch.empty_like(x)
    if x.numel():
        threads = _threads(x.numel())
        work = torch.empty(threads * ((Tk + 15) // 16 * 16))
        _LIB.masked_softmax_fwd(
            x.data_ptr(), m.data_ptr(), B, H, Tq, Tk, *m.stride(), c, w.data_ptr(),
            work.data_ptr(), threads,
        )  # fmt: skip
    return w


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension of x (n, V), contiguous bf16, written over x: fp32
    inside (`masked_softmax`'s rows with every class legal), the output rounded to bf16 once.
    The chunked loss's (n, V) softmax (loss.py): torch's bf16 kernel ran ~2x slower there.
    Only where `fused_supported()`."""
    _require("softmax_", x)
    if x.dim() != 2:
        raise ValueError("softmax_: a contiguous (n, V) bf16 CPU tensor")
    n, v = x.shape
    if x.numel():
        threads = _threads(x.numel())
        work = torch.empty(threads * ((v + 15) // 16 * 16))
        _LIB.masked_softmax_fwd(
            x.data_ptr(), None, 1, 1, n, v, 0, 0, 0, 0, 0.0, x.data_ptr(), work.data_ptr(), threads
        )  # fmt: skip
    return x


def masked_softmax_backward(g: torch.Tensor, w: torch.Tensor, c: float) -> torch.Tensor:
    """The gradient of `masked_softmax` with respect to x, from g and its output w (bf16, one
    shape, contiguous): torch's softmax backward rounded to bf16, then divided by c (c = 0:
    not) and rounded again, as the two ops it replaces give it."""
    _require("masked_softmax_backward", g, w)
    if g.shape != w.shape:
        raise ValueError("masked_softmax_backward: g and w of one shape")
    dx = torch.empty_like(w)
    if w.numel():
        tk = w.size(-1)
        _LIB.masked_softmax_bwd(
            g.data_ptr(), w.data_ptr(), w.numel() // tk, tk, c, dx.data_ptr(), _threads(w.numel())
        )
    return dx


def widen_minus(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x.float() - e for x (N, D) bf16 and e (D,) fp32, D a multiple of 16: the same values, in
    one pass (the chunked loss's (V, D) weight gradient; loss._minus_q). Only where
    `fused_supported()`."""
    _require("widen_minus", x)
    _require("widen_minus", e, bf16=False)
    if x.dim() != 2 or x.size(1) % 16 or e.dtype != torch.float32 or e.shape != (x.size(1),):
        raise ValueError("widen_minus: x (N, D) with D a multiple of 16 and e (D,) fp32")
    out = torch.empty(x.shape, dtype=torch.float32)
    if x.numel():
        _LIB.widen_minus(x.data_ptr(), x.size(0), x.size(1), e.data_ptr(), out.data_ptr(),
                         _threads(x.numel()))  # fmt: skip
    return out


def column_sums(x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """x (N, C) bf16, contiguous -> (C,) in x's dtype (fp32 with `fp32`): the column sums,
    accumulated in fp32 on the threads (a linear layer's bias gradient, the loss's sum over
    classes of the output weight; torch's bf16 `sum(0)` is slower, and an fp32 sum(0) needs an
    fp32 copy first). Only where `fused_supported()`."""
    _require("column_sums", x)
    if x.dim() != 2:
        raise ValueError("column_sums: a contiguous (N, C) bf16 CPU tensor")
    n, c = x.shape
    out = torch.empty(c)
    threads = _threads(x.numel())
    work = torch.empty(threads * c)
    _LIB.column_sums(x.data_ptr(), n, c, out.data_ptr(), work.data_ptr(), threads)
    return out if fp32 else out.to(x.dtype)


def _f32(x: float) -> float:
    """x rounded to fp32 (to nearest even), as C's (float) cast of a double."""
    return struct.unpack("f", struct.pack("f", x))[0]


_ADAM_KINDS = {torch.bfloat16: 1, torch.float32: 2}  # the library's kinds (0: None)


def _adam_problem(what: str, i: int, t: torch.Tensor | None, shape=None, fp32: bool = False) -> str:
    """Why tensor t (None: none) cannot be read: not a contiguous CPU tensor of the library's
    kinds (fp32 alone with `fp32`), or not of `shape`; "" if it can."""
    if t is None:
        return ""
    kinds = (torch.float32,) if fp32 else _ADAM_KINDS
    if t.dtype not in kinds or not t.is_contiguous() or t.device.type != "cpu":
        return f"{what} {i} is not a contiguous {'fp32' if fp32 else 'bf16 or fp32'} CPU tensor"
    if shape is not None and t.shape != shape:
        return f"{what} {i} has shape {tuple(t.shape)}, its master {tuple(shape)}"
    return ""


def adam_problem(masters, grads, params) -> str | None:
    """Why `adam_update` cannot take these tensors (None: it can): contiguous fp32 CPU masters,
    each gradient and each parameter None or a contiguous bf16 or fp32 CPU tensor of its
    master's shape."""
    for i, (m, g, q) in enumerate(zip(masters, grads, params, strict=True)):
        problem = (
            _adam_problem("master", i, m, fp32=True)
            or _adam_problem("gradient", i, g, m.shape)
            or _adam_problem("parameter", i, q, m.shape)
        )
        if problem:
            return problem
    return None


def _adam_call(tensors) -> tuple[ctypes.Array, ctypes.Array]:
    """The tensors' addresses and kinds (0 for None) as the library's arrays."""
    return (
        (ctypes.c_void_p * len(tensors))(*(0 if t is None else t.data_ptr() for t in tensors)),
        (ctypes.c_int32 * len(tensors))(
            *(0 if t is None else _ADAM_KINDS[t.dtype] for t in tensors)
        ),
    )


def adam_sum_squares(grads: list[torch.Tensor | None], scale: float = 1.0) -> float:
    """The sum over every gradient of (g * scale)^2, each product rounded to fp32 as torch's
    in-place `mul_` rounds it (scale 1: not multiplied), summed in fp64 in a fixed order (the
    same at any thread count). None is a gradient of zeros. Only where `fused_supported()`."""
    _require("adam_sum_squares")
    for i, g in enumerate(grads):
        problem = _adam_problem("gradient", i, g, None)
        if problem:
            raise ValueError(f"adam_sum_squares: {problem}")
    n = [0 if g is None else g.numel() for g in grads]
    (addresses, kinds), out = _adam_call(grads), ctypes.c_double()
    h = (ctypes.c_float * 6)(0.0, 0.0, 0.0, 0.0, scale, 1.0)
    failed = _LIB.adam_sumsq(
        len(grads), addresses, kinds, (ctypes.c_int64 * len(n))(*n), 2 if scale != 1.0 else 0,
        h, ctypes.byref(out), _threads(sum(n)),
    )  # fmt: skip
    if failed:  # its few kB of partial sums could not be allocated
        raise MemoryError("adam_sum_squares: out of memory")
    return out.value


def adam_update(
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    params: list[torch.Tensor | None],
    steps: list[float],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    scale: float = 1.0,
    clip: float = 1.0,
) -> None:
    """§5.3 Adam, in one pass: each gradient g (None: zeros) made (g * scale) * clip (each
    product rounded to fp32; a factor of 1 not applied), then `torch._fused_adam_`'s update of
    master, exp_avg and exp_avg_sq at the tensor's step count t (already counted), the same
    bits; each parameter (None: none) given its master's new value (bf16: to nearest even, as
    torch's copy). Only where `fused_supported()`.

    Raises:
        ValueError: `adam_problem`'s reason, or a moment not the shape of its master.
    """
    _require("adam_update")
    problem = adam_problem(masters, grads, params)
    for i, (m, a, b) in enumerate(zip(masters, exp_avgs, exp_avg_sqs, strict=True)):
        if not problem and any(
            t is None or _adam_problem("", i, t, m.shape, fp32=True) for t in (a, b)
        ):
            problem = f"the moments of master {i} are not contiguous fp32 tensors of its shape"
    if problem:
        raise ValueError(f"adam_update: {problem}")
    beta1, beta2 = betas
    # torch's (FusedAdamKernel.cpp): the step count read as a double, the bias corrections in
    # double, then each factor made fp32; exp_avg.lerp_(g, 1 - beta1) as one FMA with
    # exp_avg (a weight under 0.5) or g as its base.
    weight = _f32(1.0 - beta1)
    small = abs(weight) < 0.5
    coeff = weight if small else _f32(weight - 1.0)
    step = [_f32(-lr / (1.0 - beta1**t)) for t in steps]
    bc2 = [_f32(math.sqrt(1.0 - beta2**t)) for t in steps]
    flags = int(small) | (2 if scale != 1.0 else 0) | (4 if clip != 1.0 else 0)
    h = (ctypes.c_float * 6)(coeff, _f32(beta2), _f32(1.0 - beta2), _f32(eps), scale, clip)
    nt, n = len(masters), [m.numel() for m in masters]
    floats = ctypes.c_float * nt
    (g, g_kinds), (q, q_kinds) = _adam_call(grads), _adam_call(params)
    p, m, v = (_adam_call(ts)[0] for ts in (masters, exp_avgs, exp_avg_sqs))
    _LIB.adam_update(
        nt, p, m, v, g, g_kinds, q, q_kinds, (ctypes.c_int64 * nt)(*n), floats(*step),
        floats(*bc2), flags, h, _threads(sum(n)),
    )  # fmt: skip


def rows_supported() -> bool:
    """Whether `int8_rows_in` and `int8_rows_out_` run here: `FUSED`, the library built, and
    the CPU has AVX-512 F or AVX2 (`_ROWS_ISA`)."""
    return FUSED and _ROWS_ISA is not None and _library() is not None


def _row_kernel(side: str):
    """The library's `int8_rows_{side}` in the form of this CPU's instruction set (`_ROWS_ISA`):
    the AVX-512 form would be an illegal instruction on a CPU with AVX2 alone."""
    return getattr(_NOGIL, f"int8_rows_{side}" + ("" if _ROWS_ISA == "avx512" else "_avx2"))


def int8_rows_in(x: torch.Tensor, nonnegative: bool, tiny: float):
    """`translate.Int8Linear`'s input rows in one pass: x (..., K) fp32, contiguous -> (xs, top),
    top (..., 1) = each row's largest |x| (`nonnegative`: largest x) but at least `tiny` (NaN
    where the row has one), xs = x * (1 / top). Only where `rows_supported()`."""
    return _int8_rows("int8_rows_in", x, nonnegative, tiny, torch.float32)


def int8_rows_u8(x: torch.Tensor, nonnegative: bool, tiny: float, levels: float, zero: int):
    """`int8_rows_in`'s rows quantized in the same pass: x (..., K) fp32, contiguous -> (q,
    top), q (..., K) uint8 = round(x * (1 / top) * levels) + zero (to nearest even, then
    saturated to 0 .. 255; where x * (1 / top) is NaN, zero), top as `int8_rows_in`'s. The
    inputs of oneDNN's int8 product (`translate.Int8Linear`). Only where `rows_supported()`."""
    return _int8_rows("int8_rows_u8", x, nonnegative, tiny, torch.uint8, levels, zero)


def _int8_rows(what, x, nonnegative, tiny, dtype, levels=0.0, zero=0):
    """The library's `int8_rows_in` for `what`: the rows x * (1 / top) in fp32 (`dtype`), or
    rounded to uint8 on (levels, zero); and top."""
    _require(what, x, bf16=False, rows=True)
    if x.dtype != torch.float32 or x.dim() == 0:
        raise ValueError(f"{what}: a contiguous fp32 CPU tensor of rows")
    out, top = torch.empty(x.shape, dtype=dtype), torch.empty(x.shape[:-1] + (1,))
    if x.numel():
        k, u8 = x.size(-1), dtype == torch.uint8
        _row_kernel("in")(x.data_ptr(), x.numel() // k, k, int(nonnegative), tiny,
                          None if u8 else out.data_ptr(), top.data_ptr(), _threads(x.numel()),
                          out.data_ptr() if u8 else None, levels, zero)  # fmt: skip
    return out, top


def int8_rows_out_(y: torch.Tensor, top: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`translate.Int8Linear`'s output rows in one pass, in place: y (..., N) fp32 times its
    row's top (..., 1), then plus bias (N,) (None: none), each rounded on its own (never one
    fused multiply-add). Only where `rows_supported()`."""
    _require("int8_rows_out_", y, top, *(() if bias is None else (bias,)), bf16=False, rows=True)
    n = y.size(-1) if y.dim() else 0
    ok = y.dtype == top.dtype == torch.float32 and top.numel() * n == y.numel()
    if not ok or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != n)):
        raise ValueError("int8_rows_out_: fp32 rows, one top per row and one bias per column")
    if y.numel():
        b = None if bias is None else bias.data_ptr()
        _row_kernel("out")(y.data_ptr(), top.numel(), n, top.data_ptr(), b, _threads(y.numel()))
    return y


def int8_product_supported() -> bool:
    """Whether `int8_pack` and `int8_product` run here: `FUSED`, the library built, and the
    CPU has AVX2 (any x86-64 CPU since 2013-2015; their code is AVX2's alone)."""
    return FUSED and _INT8_AVX2 and _library() is not None


# `int8_product`'s int32 sums are exact while k x 255 x 127 < 2^31 (u8 inputs less a zero point,
# int8 weights): k up to 66,311.
INT8_PRODUCT_MAX_K = 65536


def int8_pack(ints: torch.Tensor) -> torch.Tensor:
    """`int8_product`'s packed weights: ints (N, K) int8 (an `Int8Linear`'s integer weights,
    out x in) -> (ceil(N / 8), ceil(K / 2), 16) int8, for each block of 8 columns and pair of
    k the 8 columns' two values (0 past N and past an odd K), which the product widens to
    int16 a panel at a time. Only where `int8_product_supported()`."""
    if not int8_product_supported():
        raise RuntimeError(f"int8_pack: not on this machine ({unavailable() or 'no AVX2'})")
    ok = ints.dtype == torch.int8 and ints.dim() == 2 and ints.device.type == "cpu"
    if not ok or not ints.is_contiguous():
        raise ValueError("int8_pack: a contiguous (out, in) int8 CPU tensor")
    n, k = ints.shape
    if k > INT8_PRODUCT_MAX_K:
        raise ValueError(f"int8_pack: at most {INT8_PRODUCT_MAX_K} inputs, got {k}")
    blocks, k2 = (n + 7) // 8, (k + 1) // 2
    padded = ints
    if (8 * blocks, 2 * k2) != (n, k):
        padded = torch.zeros(8 * blocks, 2 * k2, dtype=torch.int8)  # zeros past N and K
        padded[:n, :k] = ints
    packed = torch.empty(blocks, k2, 8, 2, dtype=torch.int8)  # its own memory, not ints'
    return packed.copy_(padded.view(blocks, 8, k2, 2).transpose(1, 2)).view(blocks, k2, 16)


def int8_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`int8_pack`'s weights back as (n, k) int8: the integers it packed."""
    blocks, k2 = packed.shape[:2]
    ints = packed.view(blocks, k2, 8, 2).transpose(1, 2).reshape(blocks * 8, k2 * 2)
    return ints[:n, :k].contiguous()


def int8_product(
    q: torch.Tensor,
    zero: int,
    step: float,
    packed: torch.Tensor,
    n: int,
    scales: torch.Tensor,
    top: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`translate.Int8Linear`'s product of 8-bit rows on AVX2 with 8-bit weights, exact: q (M,
    K) uint8 rows (`int8_rows_u8`'s) less `zero` times the weights `packed` by `int8_pack`
    (N columns), each int32 sum (exact) -> fp32 * step (the inputs' grid step, in fp32), *
    scales[c] (N,), * top[r] (M, 1), + bias[c] (N,; None: none), each rounded on its own: (M,
    N) fp32, the bits of oneDNN's int8 product (`onednn::qlinear_pointwise`, which scales its
    sums by step, then by scales) and `int8_rows_out_` on a VNNI CPU; a row's values the same
    in any batch and on any number of threads. Only where `int8_product_supported()`."""
    if not int8_product_supported():
        raise RuntimeError(f"int8_product: not on this machine ({unavailable() or 'no AVX2'})")
    tensors = (q, packed, scales, top) + (() if bias is None else (bias,))
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
        raise ValueError("int8_product: contiguous CPU tensors")
    if q.dtype != torch.uint8 or q.dim() != 2 or packed.dtype != torch.int8 or not 0 <= zero < 256:
        raise ValueError("int8_product: (M, K) uint8 rows, a zero point in 0..255, int8_pack's")
    m, k = q.shape
    if packed.shape != ((n + 7) // 8, (k + 1) // 2, 16) or k > INT8_PRODUCT_MAX_K:
        raise ValueError(f"int8_product: weights packed for {k} inputs, {n} outputs (int8_pack)")
    fp32 = all(t.dtype == torch.float32 for t in (scales, top) + tensors[4:])
    sizes = (scales.numel(), top.numel(), n if bias is None else bias.numel())
    if not fp32 or sizes != (n, m, n):
        raise ValueError("int8_product: fp32 scales (N,), top (M, 1) and bias (N,)")
    y = torch.empty(m, n)
    if m and n:
        # The rows widened (m x 2 k2 int16), then each thread's widened panel (48 k2).
        threads, k2 = _threads(m * n * max(k, 1) // 64), (k + 1) // 2
        work = torch.empty(2 * k2 * m + 48 * k2 * threads, dtype=torch.int16)
        b = None if bias is None else bias.data_ptr()
        _NOGIL.int8_product_avx2(q.data_ptr(), m, k, zero, packed.data_ptr(), n, step,
                                 scales.data_ptr(), top.data_ptr(), b, y.data_ptr(),
                                 work.data_ptr(), threads)  # fmt: skip
    return y


# `row_top` ranks this many columns a row at most: its insertion into a row's best n costs ~n
# for each column that enters, and beam sizes past 32 are rare enough for torch's topk.
ROW_TOP_MAX = 64


def row_top_problem(x: torch.Tensor, n: int) -> str | None:
    """Why `row_top` cannot take the n best of x's rows (None: it can): the kernel not here
    (AVX-512 F or AVX2, `_ROWS_ISA`), or x not (R, V) fp32 contiguous on the CPU, or n not in
    1 .. min(V, ROW_TOP_MAX)."""
    if not rows_supported():
        return unavailable() or "neither AVX-512 nor AVX2"
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        return "an (R, V) fp32 CPU tensor"
    if not x.is_contiguous():
        return "contiguous rows"
    if not 1 <= n <= min(x.size(1), ROW_TOP_MAX):
        return f"1 <= n <= min(V, {ROW_TOP_MAX}) (n = {n}, V = {x.size(1)})"
    return None


def row_top(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's n largest values in one pass: x (R, V) fp32 -> (ids (R, n) int64, values (R,
    n) fp32 as x holds them), from the largest down; of equal values the column first in the
    row ranks first, and a NaN ranks as -inf (never above a number). Beam search's
    candidates (`search._rows_best`): torch's topk over V = 32,000 is a partial sort of every
    row, this a vector compare against the n-th best so far, the rare column that beats it
    inserted in order. The same columns in the AVX-512 and AVX2 forms and on any thread count."""
    problem = row_top_problem(x, n)
    if problem:
        raise ValueError(f"row_top: {problem}")
    R, V = x.shape
    ids, values = torch.empty((R, n), dtype=torch.int64), torch.empty((R, n))
    if R:  # the last argument: which form runs (`_ROWS_ISA`)
        _NOGIL.row_top(x.data_ptr(), R, V, n, ids.data_ptr(), values.data_ptr(),
                       _threads(x.numel()), int(_ROWS_ISA == "avx512"))  # fmt: skip
    return ids, values


def attention_supported() -> bool:
    """Whether `step_attention` runs here: `FUSED`, the library built, and the CPU has AVX-512
    F, BW and VL, or AVX2 and FMA (`_ATTENTION_ISA`)."""
    return FUSED and _ATTENTION_ISA is not None and _library() is not None


def step_attention_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why `step_attention` cannot read q, k and v as they are (None: it can): their dtypes,
    device, shapes, or a layout other than rows (or fp32 K^T's columns) with stride 1."""
    narrow = (torch.float32, torch.bfloat16)
    cpu = all(t.device.type == "cpu" for t in (q, k, v))
    if not (cpu and q.dtype == torch.float32 and k.dtype in narrow and v.dtype in narrow):
        return "fp32 CPU q, fp32 or bf16 k and v"
    B, H, _, d = q.shape
    L = k.size(-2)
    if k.shape != (B, H, L, d) or v.dim() != 4 or v.shape[:3] != (B, H, L):
        return f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not match"
    columns = k.stride(-1) != 1 and k.stride(-2) == 1 and k.dtype == torch.float32
    if q.stride(-1) != 1 or v.stride(-1) != 1 or not (k.stride(-1) == 1 or columns):
        return "q's, k's and v's rows contiguous (or fp32 k's columns)"
    return None


def step_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, c: float
) -> torch.Tensor:
    """A decoding step's softmax(q k^T / c + bias) v (§3.2.1 eq. 1; c = 0: q is prescaled) on
    the CPU, each (batch, head) in one pass over its keys and values, fp32 inside: q (B, H, Tq,
    d) fp32, k (B, H, L, d) fp32 or bf16 with contiguous rows (stride 1 along d), or fp32 with
    contiguous columns (stride 1 along L: a view of K^T), v (B, H, L, dv) fp32 or bf16 with
    contiguous rows (bf16 keys and values widened as they are read, not copied), bias
    None or fp32 broadcastable to (B, H, Tq, L) (0, or -inf for keys not to attend; such keys
    are not read). Returns (B, H, Tq, dv) in v's dtype; a query with no legal key gets zeros.
    Each (batch, head)'s values do not depend on the rest of the batch or on the threads.
    Only where `attention_supported()`."""
    if not attention_supported():
        lacking = unavailable() or "neither AVX-512 nor AVX2 with FMA"
        raise RuntimeError(f"step_attention: not on this machine ({lacking})")
    problem = step_attention_problem(q, k, v)
    if problem:
        raise ValueError(f"step_attention: {problem}")
    B, H, Tq, d = q.shape
    L, dv = k.size(-2), v.size(-1)
    if bias is not None:
        if bias.dtype != torch.float32 or bias.device.type != "cpu":
            raise ValueError("step_attention: an fp32 CPU bias")
        bias = bias.expand(B, H, Tq, L)
    out = torch.empty((B, H, Tq, dv), dtype=v.dtype)
    if out.numel() == 0:
        return out
    threads = _threads(B * H * L * max(d, dv))
    work = torch.empty(threads * 2 * max(L, 1))
    kb, kh, kj, kc = k.stride()  # the kernel reads rows where kc == 1, else columns
    ms = (0, 0, 0, 0) if bias is None else bias.stride()
    # the last argument: which form runs (`_ATTENTION_ISA`)
    _NOGIL.step_attention(
        q.data_ptr(), *q.stride()[:3], k.data_ptr(), int(k.dtype == torch.bfloat16), kb, kh, kj,
        kc, v.data_ptr(), int(v.dtype == torch.bfloat16), *v.stride()[:3],
        None if bias is None else bias.data_ptr(), *ms, B, H, Tq, L, d, dv, c, out.data_ptr(),
        int(v.dtype == torch.bfloat16), work.data_ptr(), threads, int(_ATTENTION_ISA == "avx512"),
    )  # fmt: skip
    return out


def attention_train_problem(q: torch.Tensor, kv: torch.Tensor, heads: int) -> str | None:
    """Why `attention_train` cannot read the projections q and kv as they are (None: it can):
    their device, dtype, layout, or head widths (`model._packed_attention_takes` asks this)."""
    if q.device.type != "cpu" or kv.device.type != "cpu":
        return "CPU tensors"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or q.dim() != 2 or kv.dim() != 2:
        return "bf16 q (Nq, H*D) and kv (Nk, H*(D+Dv))"
    if q.stride(1) != 1 or kv.stride(1) != 1:  # rows apart by any stride (a stacked q, kv)
        return "q and kv with contiguous rows"
    if heads < 1 or q.size(1) % heads or kv.size(1) % heads:
        return f"{heads} heads do not divide q's and kv's widths"
    D = q.size(1) // heads
    Dv = kv.size(1) // heads - D
    if D < 16 or Dv < 16 or D % 16 or Dv % 16:
        return f"head widths {D} and {Dv} not multiples of 16"
    return None


def _packed_problem(q, kv, qrow, krow, kmask, heads: int) -> str | None:
    """Why `attention_train` cannot take these operands (None: it can)."""
    problem = attention_train_problem(q, kv, heads)
    if problem:
        return problem
    if qrow.device.type != "cpu" or krow.device.type != "cpu":
        return "CPU tensors"
    if qrow.dtype != torch.int64 or krow.dtype != torch.int64 or qrow.dim() != 2 or krow.dim() != 2:
        return "int64 row maps (B, Tq) and (B, Tk)"
    if qrow.size(0) != krow.size(0) or not (qrow.is_contiguous() and krow.is_contiguous()):
        return "contiguous row maps of one batch"
    if kmask is not None and (
        kmask.dtype != torch.bool or kmask.shape != krow.shape or not kmask.is_contiguous()
    ):
        return "a contiguous (B, Tk) bool key mask"
    for rows, n, what in ((qrow, q.size(0), "query"), (krow, kv.size(0), "key")):
        if rows.numel() and not (-1 <= int(rows.min()) and int(rows.max()) < n):
            return f"a {what} row map outside its {n} rows"
    return None


def attention_train(
    q: torch.Tensor,
    kv: torch.Tensor,
    qrow: torch.Tensor,
    krow: torch.Tensor,
    kmask: torch.Tensor | None,
    causal: bool,
    heads: int,
    inv_c: float,
    mapped: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.2.2's heads of eq. (1) for a training step, read from and written to packed rows
    (`model.Packing`), with no (B, H, T, D) copies: q (Nq, H*D) bf16 projected queries, kv
    (Nk, H*D + H*Dv) bf16 keys then values; qrow (B, Tq) and krow (B, Tk) int64, each
    position's packed row (-1: not packed; no row for two positions, as `model.Packing` makes
    them: each (batch row, head) writes its rows unlocked); kmask (B, Tk) bool or None: the
    keys allowed; causal: query i sees keys j <= i (§3.2.3); inv_c: the scores' factor
    (1 / sqrt(d_k)).
    Returns out (Nq, H*Dv) bf16, each packed query's attended values (zeros for a query with
    no legal key, and for the rows from `mapped` on, which no position maps to), and p (B, H,
    Tq, Tk) bf16, the weights over each query's legal keys in order, for the backward.

    Each (batch row, head) is one task: its legal keys' rows widened to fp32 once, the scores
    in fp32, the softmax in fp32 (`exp_nonpositive`), the weights rounded to bf16, then
    weights x values in fp32, rounded to bf16 once. Only where `fused_supported()`."""
    _require("attention_train")
    problem = _packed_problem(q, kv, qrow, krow, kmask, heads)
    if problem:
        raise ValueError(f"attention_train: {problem}")
    (B, Tq), Tk = qrow.shape, krow.size(1)
    D, Dv = q.size(1) // heads, kv.size(1) // heads - q.size(1) // heads
    out = torch.empty((q.size(0), heads * Dv), dtype=torch.bfloat16)
    p = torch.empty((B, heads, Tq, Tk), dtype=torch.bfloat16)
    out[mapped:] = 0
    if B * Tq and Tk:
        km = None if kmask is None else kmask.view(torch.uint8).data_ptr()
        done = _NOGIL.attention_train_fwd(
            q.data_ptr(), q.stride(0), kv.data_ptr(), kv[:, heads * D :].data_ptr(), kv.stride(0),
            qrow.data_ptr(), krow.data_ptr(), km, int(causal), B, heads, Tq, Tk, D, Dv, inv_c,
            out.data_ptr(), out.stride(0), p.data_ptr(), _threads(B * heads * Tq * Tk * D),
        )  # fmt: skip
        if done != 0:
            raise MemoryError("attention_train: no memory for its scratch")
    elif B * Tq:
        out.zero_()
    return out, p


def attention_train_backward(
    g: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    p: torch.Tensor,
    qrow: torch.Tensor,
    krow: torch.Tensor,
    kmask: torch.Tensor | None,
    causal: bool,
    heads: int,
    inv_c: float,
    q_mapped: int,
    k_mapped: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `attention_train`'s out with respect to q and kv, from g (Nq, H*Dv)
    bf16 and its p: dq (Nq, H*D) and dkv (Nk, H*(D+Dv)) bf16, zeros at the rows no position
    maps to (from q_mapped, k_mapped on) and at keys no query may see. Per (batch row, head),
    fp32 inside: dP = g V^T, dS = P (dP - sum P dP) inv_c, dq = dS K, dk = dS^T q, dv = P^T g,
    each rounded to bf16 once. out: (dq, dkv) to write into (bf16, q's and kv's shapes, rows
    contiguous: the two column blocks of one stacked gradient), else new tensors."""
    _require("attention_train_backward")
    problem = _packed_problem(q, kv, qrow, krow, kmask, heads)
    D = q.size(1) // max(heads, 1)
    Dv = kv.size(1) // max(heads, 1) - D
    if problem is None and not all(
        t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu" for t in (g, p)
    ):
        problem = "a contiguous bf16 gradient and weights"
    if problem is None and (g.shape != (q.size(0), heads * Dv) or p.shape != (
        qrow.size(0), heads, qrow.size(1), krow.size(1)
    )):  # fmt: skip
        problem = "g's or p's shape does not match"
    if problem is None and out is not None and not all(
        o.dtype == torch.bfloat16 and o.device.type == "cpu" and o.shape == t.shape
        and o.stride(1) == 1
        for o, t in zip(out, (q, kv), strict=True)
    ):  # fmt: skip
        problem = "out is not bf16 dq and dkv of q's and kv's shapes with contiguous rows"
    if problem:
        raise ValueError(f"attention_train_backward: {problem}")
    (B, Tq), Tk = qrow.shape, krow.size(1)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype), torch.empty(kv.shape, dtype=kv.dtype)
    dq, dkv = out
    dq[q_mapped:] = 0
    dkv[k_mapped:] = 0
    if B * Tq and Tk:
        km = None if kmask is None else kmask.view(torch.uint8).data_ptr()
        done = _NOGIL.attention_train_bwd(
            g.data_ptr(), g.stride(0), q.data_ptr(), q.stride(0), kv.data_ptr(),
            kv[:, heads * D :].data_ptr(), kv.stride(0), qrow.data_ptr(), krow.data_ptr(), km,
            int(causal), B, heads, Tq, Tk, D, Dv, inv_c, p.data_ptr(), dq.data_ptr(),
            dq.stride(0), dkv.data_ptr(), dkv[:, heads * D :].data_ptr(), dkv.stride(0),
            _threads(B * heads * Tq * Tk * D),
        )  # fmt: skip
        if done != 0:
            raise MemoryError("attention_train_backward: no memory for its scratch")
    else:
        dq.zero_()
        dkv.zero_()
    return dq, dkv
