// The server's arithmetic (see sums.h). Plain loops the compiler vectorizes; the extension is built for the
// baseline x86-64 ISA, so on x86-64 the bf16 loops are also built for x86-64-v3 (AVX2) and picked at load time, and
// the fp16 ones use F16C's conversions where the CPU has them (the compiler does not vectorize _Float16's).
#include "server/sums.h"

#include <bit>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BPS_F16C 1
#endif

#include "server/rounds.h"

namespace bps::server {

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BPS_WIDE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define BPS_WIDE_CLONES
#endif

constexpr uint16_t kFloat16 = 3, kBFloat16 = 4;

// A loop the compiler vectorizes; integers go through their unsigned type, so sums wrap as torch's do.
template <typename T>
void addLoop(T* __restrict dst, const T* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

template <typename T>
void addAs(uint8_t* dst, const uint8_t* src, size_t n) {
  addLoop(reinterpret_cast<T*>(dst), reinterpret_cast<const T*>(src), n / sizeof(T));
}

// bf16 is the top half of an fp32: widening is exact.
inline float fromBf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// Rounded as c10::BFloat16 rounds (round_to_nearest_even), NaN to 0x7FC0 as torch's kernels give it.
inline uint16_t toBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint16_t rounded = static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFF) >> 16);
  return f != f ? uint16_t{0x7FC0} : rounded;
}

// The four passes a widened round makes (sums.h), for bf16.
BPS_WIDE_CLONES void widenSumBf16(float* __restrict acc, const uint16_t* __restrict a, const uint16_t* __restrict b,
                                  size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = fromBf16(a[i]) + fromBf16(b[i]);
}

BPS_WIDE_CLONES void addBf16(float* __restrict acc, const uint16_t* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += fromBf16(src[i]);
}

BPS_WIDE_CLONES void finishBf16(uint16_t* __restrict dst, const float* __restrict acc, const uint16_t* __restrict src,
                                size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) dst[i] = toBf16((acc[i] + fromBf16(src[i])) * scale);
}

BPS_WIDE_CLONES void pairBf16(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) dst[i] = toBf16((fromBf16(dst[i]) + fromBf16(src[i])) * scale);
}

// fp16, one element at a time: _Float16 converts by IEEE rules (to nearest, ties to even, overflow to infinity), as
// torch's Half does. Also the vector loops' tails.
void widenSumHalfScalar(float* acc, const _Float16* a, const _Float16* b, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<float>(a[i]) + static_cast<float>(b[i]);
}

void addHalfScalar(float* acc, const _Float16* src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += static_cast<float>(src[i]);
}

void finishHalfScalar(_Float16* dst, const float* acc, const _Float16* src, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>((acc[i] + static_cast<float>(src[i])) * scale);
}

void pairHalfScalar(_Float16* dst, const _Float16* src, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<_Float16>((static_cast<float>(dst[i]) + static_cast<float>(src[i])) * scale);
  }
}

#ifdef BPS_F16C
// fp16 eight at a time: F16C's conversions, the ones torch's own kernels use, with the same rounding.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

bool hasF16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

__attribute__((target("avx2,f16c"))) inline __m256 load8(const _Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx2,f16c"))) inline void store8(_Float16* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, kNearest));
}

__attribute__((target("avx2,f16c"))) void widenSumHalfF16c(float* acc, const _Float16* a, const _Float16* b,
                                                            size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_add_ps(load8(a + i), load8(b + i)));
  widenSumHalfScalar(acc + i, a + i, b + i, n - i);
}

__attribute__((target("avx2,f16c"))) void addHalfF16c(float* acc, const _Float16* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), load8(src + i)));
  addHalfScalar(acc + i, src + i, n - i);
}

__attribute__((target("avx2,f16c"))) void finishHalfF16c(_Float16* dst, const float* acc, const _Float16* src,
                                                          size_t n, float scale) {
  size_t i = 0;
  __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(acc + i), load8(src + i)), s));
  finishHalfScalar(dst + i, acc + i, src + i, n - i, scale);
}

__attribute__((target("avx2,f16c"))) void pairHalfF16c(_Float16* dst, const _Float16* src, size_t n, float scale) {
  size_t i = 0;
  __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_mul_ps(_mm256_add_ps(load8(dst + i), load8(src + i)), s));
  pairHalfScalar(dst + i, src + i, n - i, scale);
}
#define BPS_HALF(name, ...) return hasF16c() ? name##F16c(__VA_ARGS__) : name##Scalar(__VA_ARGS__)
#else
#define BPS_HALF(name, ...) return name##Scalar(__VA_ARGS__)
#endif

// Received frames hold whole elements and are 2-byte aligned at least, which is all 16-bit loads need.
inline const _Float16* half(const uint8_t* p) { return reinterpret_cast<const _Float16*>(p); }
inline _Float16* half(uint8_t* p) { return reinterpret_cast<_Float16*>(p); }
inline const uint16_t* bf16(const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bf16(uint8_t* p) { return reinterpret_cast<uint16_t*>(p); }

[[noreturn]] void notWidened(uint16_t dtype) {
  throw RoundError{kInternal, formatText("dtype code %u is not summed in fp32", dtype)};
}

}  // namespace

void addInPlace(uint16_t dtype, uint8_t* dst, const uint8_t* src, size_t n) {
  switch (dtype) {
    case 1: return addAs<float>(dst, src, n);
    case 2: return addAs<double>(dst, src, n);
    case 5: return addAs<uint32_t>(dst, src, n);
    case 6: return addAs<uint64_t>(dst, src, n);
    case 7: return addAs<uint8_t>(dst, src, n);
    case 8: return addAs<uint8_t>(dst, src, n);  // int8 wraps as uint8 does
    default: throw RoundError{kInternal, formatText("no addition in place for dtype code %u", dtype)};
  }
}

bool sumsWidened(uint16_t dtype) { return dtype == kFloat16 || dtype == kBFloat16; }

void widenSum(uint16_t dtype, float* acc, const uint8_t* a, const uint8_t* b, size_t count) {
  if (dtype == kBFloat16) return widenSumBf16(acc, bf16(a), bf16(b), count);
  if (dtype == kFloat16) BPS_HALF(widenSumHalf, acc, half(a), half(b), count);
  notWidened(dtype);
}

void addWidened(uint16_t dtype, float* acc, const uint8_t* src, size_t count) {
  if (dtype == kBFloat16) return addBf16(acc, bf16(src), count);
  if (dtype == kFloat16) BPS_HALF(addHalf, acc, half(src), count);
  notWidened(dtype);
}

void finishSum(uint16_t dtype, uint8_t* dst, const float* acc, const uint8_t* src, size_t count, float scale) {
  if (dtype == kBFloat16) return finishBf16(bf16(dst), acc, bf16(src), count, scale);
  if (dtype == kFloat16) BPS_HALF(finishHalf, half(dst), acc, half(src), count, scale);
  notWidened(dtype);
}

void sumPair(uint16_t dtype, uint8_t* dst, const uint8_t* src, size_t count, float scale) {
  if (dtype == kBFloat16) return pairBf16(bf16(dst), bf16(src), count, scale);
  if (dtype == kFloat16) BPS_HALF(pairHalf, half(dst), half(src), count, scale);
  notWidened(dtype);
}

}  // namespace bps::server
