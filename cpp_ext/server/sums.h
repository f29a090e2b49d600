// The server's arithmetic: adding pushes into a round's result. docs/protocol.md ("Summation") states the rule;
// torch_bps/_reference/rounds.py states it again in torch, and tests/server/test_server_rounds.py holds the two
// to the same bits.
//
// fp32, fp64 and the integers are added in place in their own type (integers wrap). fp16 and bf16 are widened:
// their pushes are added in an fp32 accumulator and the result is rounded once to the key's dtype, as torch
// rounds (to nearest, ties to even), when the round closes. Rounding at every add would make the error grow
// with the number of workers and depend on the order pushes arrive in; rounded once, a sum of 16-bit pushes
// is within half an ulp of the exact sum of their fp32 values up to fp32's own rounding.
#pragma once

#include <cstddef>
#include <cstdint>

namespace bps::server {

// Add `n` bytes of `src` into `dst` elementwise in `dtype` (a wire dtype code; integers wrap). Not for widened
// dtypes.
void addInPlace(uint16_t dtype, uint8_t* dst, const uint8_t* src, size_t n);

// Whether a SUM key of `dtype` is summed in an fp32 accumulator (fp16, bf16).
bool sumsWidened(uint16_t dtype);

// A widened round's passes over its pushes, in the order they arrive. With two pushes, one: sumPair. With more, the
// second makes the accumulator (widenSum), the next ones add into it (addWidened), and the last one is added and
// the sum rounded in the same pass (finishSum), into the first push's bytes, which become the result. A backup
// round's sum is scaled (by n / contributors) in fp32 before that rounding; `scale` 1 otherwise. Rounding is to
// nearest, ties to even, as torch rounds; a NaN stays a NaN. Each is the same bits as adding every push in fp32 in
// that order, multiplying by the scale in fp32 and rounding once at the end.
//
// acc[i] = float(a[i]) + float(b[i]), for `count` elements of the widened `dtype`.
void widenSum(uint16_t dtype, float* acc, const uint8_t* a, const uint8_t* b, size_t count);
// acc[i] += float(src[i]).
void addWidened(uint16_t dtype, float* acc, const uint8_t* src, size_t count);
// dst[i] = round((acc[i] + float(src[i])) * scale).
void finishSum(uint16_t dtype, uint8_t* dst, const float* acc, const uint8_t* src, size_t count, float scale);
// dst[i] = round((float(dst[i]) + float(src[i])) * scale).
void sumPair(uint16_t dtype, uint8_t* dst, const uint8_t* src, size_t count, float scale);

}  // namespace bps::server
