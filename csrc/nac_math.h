// Per-element math of the NAC losses, shared by the CPU kernel (nac_cpu.cpp) and the CUDA kernel
// (nac_cuda.cu) so that what CI runs on the CPU is the math the GPU runs.
//
// The function: docs/math.md [M:rows]; the gradients: [M:grad-query], [M:ga], [M:grad-r],
// [M:grad-keys], [M:grad-self-keys]; the stable per-element forms: [M:stable]; the noise:
// [M:philox].  Notation as in docs/math.md [M:notation].
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define NAC_HD __host__ __device__ __forceinline__
#else
#define NAC_HD inline
#endif

namespace nac {

// Primitives.  Device code and double use the math library.  Host float uses the vectorisable
// versions below: no libm calls, so GCC vectorises the elementwise loops that call them (libm's
// scalar tanhf/log1pf/expf calls keep those loops scalar: bench/results/cpu_micro.md).  Accuracy:
// a few ulp (Cephes polynomials), far inside the 1e-5 / 1e-4 budgets the tests check against
// float64.
NAC_HD double tanh_(double x) { return tanh(x); }
NAC_HD double exp_(double x) { return exp(x); }
NAC_HD double log1p_(double x) { return log1p(x); }
NAC_HD float abs_(float x) { return fabsf(x); }
NAC_HD double abs_(double x) { return fabs(x); }

#if defined(__CUDA_ARCH__)
NAC_HD float tanh_(float x) { return tanhf(x); }
NAC_HD float exp_(float x) { return expf(x); }
NAC_HD float log1p_(float x) { return log1pf(x); }
#else
inline float bits_to_float(int32_t b) { float f; memcpy(&f, &b, sizeof f); return f; }
inline int32_t float_to_bits(float f) { int32_t b; memcpy(&b, &f, sizeof b); return b; }

// exp(x), |rel err| < 2 ulp for x in [-87, 88] (clamped outside): Cody-Waite reduction by ln 2,
// Cephes degree-6 polynomial, 2^k built in the exponent bits.
inline float exp_(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * r * r + r + 1.0f) * bits_to_float((static_cast<int32_t>(k) + 127) << 23);
}

// log(x) for normal x > 0 (Cephes logf).
inline float log_(float x) {
  const int32_t b = float_to_bits(x);
  float e = static_cast<float>(((b >> 23) & 0xff) - 126);
  float m = bits_to_float((b & 0x807fffff) | 0x3f000000);  // mantissa in [0.5, 1)
  const bool low = m < 0.707106781186547524f;
  e = low ? e - 1.0f : e;
  m = low ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z - 2.12194440e-4f * e - 0.5f * z;
  return m + y + 0.693359375f * e;
}

// log(1 + x) for x >= 0, accurate for small x too (Goldberg: log(u) * x / (u - 1), u = 1 + x).
inline float log1p_(float x) {
  const float u = 1.0f + x;
  const float d = u - 1.0f;
  return d == 0.0f ? x : log_(u) * (x / d);
}

// tanh as in docs/math.md [M:stable]: Cephes odd polynomial for |x| < 0.625, else the exp form.
inline float tanh_(float x) {
  const float ax = x < 0 ? -x : x;
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float big = 1.0f - 2.0f / (exp_(2.0f * ax) + 1.0f);
  return ax < 0.625f ? small : (x < 0 ? -big : big);
}
#endif

// log sig(r) + log sig(-r), in the form of docs/math.md [M:stable] that is stable for any |r|.
template <typename T>
NAC_HD T log_sigmoid_pair(T r) {
  const T ar = abs_(r);
  return -ar - T(2) * log1p_(exp_(-ar));
}

// Numerically stable logistic sigmoid (docs/math.md [M:stable]).
template <typename T>
NAC_HD T sigmoid(T r) {
  const T e = exp_(-abs_(r));
  const T inv = T(1) / (T(1) + e);
  return r >= T(0) ? inv : e * inv;
}

// One element's share of 2 * bern_i (docs/math.md [M:bern]).
template <typename T>
NAC_HD T bern2_elem(T zt, T r) {
  return zt * r + log_sigmoid_pair(r);
}

// d loss_i / d r_id = sig(r) - (1 + zt) / 2, docs/math.md [M:grad-r], as (tanh(r/2) - zt) / 2
// [M:stable]: sig(r) - 1/2 cancels for small |r| (2.6e-4 relative error at |r| ~ 1e-3 with a 2-ulp
// exp), tanh_ keeps its relative precision there.
template <typename T>
NAC_HD T grad_r_elem(T zt, T r) {
  return T(0.5) * (tanh_(T(0.5) * r) - zt);
}

// ga_id of docs/math.md [M:ga], given sA = s * A_id (the softmax-weighted mean key, times s).
template <typename T>
NAC_HD T grad_a_elem(T m, T z, T sA, T r, T l2) {
  return (m * (sA - T(0.5) * r) + T(2) * l2 * z) * (T(1) - z * z);
}

// ---- Channel noise drawn from a seed: Philox4x32-10, docs/math.md [M:philox] ----
// The same function is written in kernels/nac_noise_triton.py and in torch ops
// (nac_fast/ops/reference.py: philox_noise), so every backend draws the same noise from the same
// seed; tests check them against each other and against Random123's known-answer vector.
NAC_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
  return (uint32_t)(((uint64_t)a * (uint64_t)b) >> 32);
}

NAC_HD uint32_t philox_first_word(uint64_t counter, uint64_t seed) {
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0u, c3 = 0u;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint32_t n0 = mulhi32(0xCD9E8D57u, c2) ^ c1 ^ k0;
    const uint32_t n2 = mulhi32(0xD2511F53u, c0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * c2;
    c3 = 0xD2511F53u * c0;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// A uint32 -> float in [0, 1), Triton's uint_to_uniform_float ([M:philox]); 4.6566127342e-10f is
// the largest scale with INT32_MAX * scale < 1 in float.
NAC_HD float uniform_from_word(uint32_t w) {
  int32_t i = (int32_t)w;
  if (i < 0) i = ~i;
  return (float)i * 4.6566127342e-10f;
}

NAC_HD float noise_sign(uint64_t seed, uint64_t element, float p) {
  return uniform_from_word(philox_first_word(element, seed)) < p ? -1.0f : 1.0f;
}

// The fp16 keys' backward's scale, docs/math.md [M:grad-scale]: (2^k, 2^-k) with
// gmax * 2^k in [2^13, 2^14), from gmax's exponent bits (exact: no log2), clamped so that both are
// normal floats (gmax = 0: 2^126; inf/NaN: 2^-115, which keeps them inf/NaN).  P^T (g 2^k) with
// P <= 1 then stays below fp16's 65504 and its terms stay normal, where P^T g itself fell below
// fp16's smallest subnormal (g = 1/n, P ~ 1/N).  The same function as kernels/nac_triton.py's
// _pow2_scale; tests/test_cuda_mma_numerics.py compiles this one on the host and compares.
struct Pow2Scale {
  float scale, inv;
};
NAC_HD Pow2Scale pow2_scale(float gmax) {
  uint32_t bits;
  memcpy(&bits, &gmax, sizeof bits);
  int b = 267 - static_cast<int>((bits >> 23) & 0xffu);
  b = b < 2 ? 2 : (b > 253 ? 253 : b);
  const uint32_t sb = static_cast<uint32_t>(b) << 23, ib = static_cast<uint32_t>(254 - b) << 23;
  Pow2Scale r;
  memcpy(&r.scale, &sb, sizeof sb);
  memcpy(&r.inv, &ib, sizeof ib);
  return r;
}

}  // namespace nac
