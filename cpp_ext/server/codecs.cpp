// See codecs.h; torch_bps/_reference/codecs.py is the reference, the error texts its texts.
#include "server/codecs.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <utility>

#include "common/errors.h"

namespace bps::server {

namespace {

uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

float loadFloat(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

uint32_t loadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

uint64_t onebitBytes(uint64_t n) { return 4 + 4 * ((n + 31) / 32); }

unsigned long long ull(uint64_t v) { return static_cast<unsigned long long>(v); }

// GCC's vector extension (SSE2 on x86-64, a target's own vectors elsewhere): the loops spelled in it do lane for lane
// the scalar arithmetic, which the compiler left unvectorized.
using F4 = float __attribute__((vector_size(16)));
using I4 = int32_t __attribute__((vector_size(16)));
using D2 = double __attribute__((vector_size(16)));
using I2 = int64_t __attribute__((vector_size(16)));

// Top-k reads each element once: one pass scores every row and collects the candidate rows, those scoring at least a
// threshold read from a sample; only the candidates are then sorted out.

struct Candidate {
  float score;
  uint32_t row;
};

// A row's score: the f32 sum of its |x| in column order, NaN counted as +inf.
float rowScore(const float* x, uint64_t w) {
  float m = 0;
  for (uint64_t c = 0; c < w; ++c) m += std::fabs(x[c]);
  return std::isnan(m) ? INFINITY : m;
}

// A score at least k rows reach with high probability, from a sample of rows: the rows scoring at least it hold
// the k largest. 0 (every row) where a sample cannot narrow them. It decides how much is sorted, never the result.
float candidateThreshold(const CodecSpec& s, uint64_t round, const float* x) {
  // A 64th of the rows, 1024 to 4096: a larger sample costs more random reads and leaves fewer candidates.
  uint64_t rows = s.rows(), w = s.width, m = std::min(rows, std::clamp<uint64_t>(rows / 64, 1024, 4096));
  double expected = double(s.k()) * double(m) / double(rows);  // sampled rows scoring above the k-th largest
  auto j = uint64_t(expected + 4 * std::sqrt(expected) + 4);  // 4 standard deviations over: rarely too few
  if (j >= m) return 0;
  // The rows first, each fetched as it is drawn, then their scores: the reads overlap instead of waiting in turn.
  std::vector<uint64_t> at(m);
  for (uint64_t i = 0; i < m; ++i) {
    at[i] = uint64_t((unsigned __int128)splitmix(round * m + i) * rows >> 64) * w;  // in [0, rows), no division
    __builtin_prefetch(x + at[i]);
  }
  std::vector<float> sample(m);
  for (uint64_t i = 0; i < m; ++i) sample[i] = rowScore(x + at[i], w);
  std::nth_element(sample.begin(), sample.begin() + j, sample.end(), std::greater<float>());
  return sample[j];
}

// Append the rows scoring >= t to `out`, in row order. A NaN score fails `m < t` as +inf does.
void collectCandidates(const CodecSpec& s, const float* x, float t, std::vector<Candidate>& out) {
  constexpr uint64_t kGroup = 16;
  uint64_t w = s.width, rows = s.rows(), r = 0;
  auto take = [&](uint64_t r, float m) {
    if (!(m < t)) out.push_back({std::isnan(m) ? INFINITY : m, uint32_t(r)});
  };
  if (w == 1) {  // the dense case: 16 scores compared at once (in vectors), only those passing taken
    const F4 ts = {t, t, t, t};
    const I4 lanes = {1, 2, 4, 8};
    for (; r + kGroup <= rows; r += kGroup) {
      uint32_t passed = 0;  // bit j: row r + j scores >= t (or NaN)
      for (uint64_t q = 0; q < kGroup / 4; ++q) {
        F4 v;
        std::memcpy(&v, x + r + 4 * q, 16);
        I4 bits = ~((F4)((I4)v & INT32_MAX) < ts) & lanes;
        passed |= uint32_t(bits[0] | bits[1] | bits[2] | bits[3]) << (4 * q);
      }
      for (; passed; passed &= passed - 1) {
        uint64_t j = r + uint64_t(__builtin_ctz(passed));
        take(j, std::fabs(x[j]));
      }
    }
  }
  for (; r < rows; ++r) take(r, rowScore(x + r * w, w));
}

// The k rows of largest score, the lower index on a tie, in index order: every candidate above the k-th largest
// score, then those at it in index order until there are k. `c` holds every row scoring >= the k-th largest.
std::vector<uint32_t> chooseRows(const std::vector<Candidate>& c, uint64_t k) {
  std::vector<float> sorted(c.size());
  for (uint64_t i = 0; i < c.size(); ++i) sorted[i] = c[i].score;
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
  float kth = sorted[k - 1];
  uint64_t above = 0;
  for (const Candidate& e : c) above += e.score > kth;
  std::vector<uint32_t> rows;
  rows.reserve(k);
  for (uint64_t i = 0, ties = k - above; i < c.size(); ++i) {
    bool take = c[i].score > kth;
    if (!take && c[i].score == kth && ties > 0) {
      take = true;
      --ties;
    }
    if (take) rows.push_back(c[i].row);
  }
  return rows;
}

// Top-k of x; x is left holding the residual.
void encodeTopk(const CodecSpec& s, uint64_t round, float* x, uint8_t* out) {
  uint64_t k = s.k(), w = s.width;
  std::vector<Candidate> candidates;
  collectCandidates(s, x, candidateThreshold(s, round, x), candidates);
  if (candidates.size() < k) {  // the sample misjudged: every row is a candidate
    candidates.clear();
    collectCandidates(s, x, 0, candidates);
  }
  std::vector<uint32_t> rows = chooseRows(candidates, k);
  uint8_t* v = out + 4 * k;
  for (uint64_t j = 0; j < k; ++j) {
    uint32_t r = rows[j];
    std::memcpy(out + 4 * j, &r, 4);
    for (uint64_t c = 0; c < w; ++c) {
      float& e = x[uint64_t(r) * w + c];
      std::memcpy(v + 4 * (j * w + c), &e, 4);
      e -= e;
    }
  }
}

// Onebit's second pass: the scale (the mean |x|, from its lanes: encode), then a sign bit per element, x left the
// residual x - decode(out).
void encodeSigns(const CodecSpec& s, const double (&lanes)[8], float* x, uint8_t* out) {
  double total = lanes[0];
  for (int j = 1; j < 8; ++j) total += lanes[j];
  float scale = static_cast<float>(total / double(s.elements));
  std::memcpy(out, &scale, 4);
  uint8_t* bits = out + 4;
  std::memset(bits, 0, s.wireBytes - 4);
  // In vectors: x < 0 is a lane's sign bit, and x -= (negative ? -scale : scale).
  const I4 scaleBits = (I4)F4{scale, scale, scale, scale}, low = {1, 2, 4, 8}, high = {16, 32, 64, 128};
  uint64_t full = s.elements / 8;
  for (uint64_t b = 0; b < full; ++b) {
    F4 xl, xh;
    std::memcpy(&xl, x + 8 * b, 16);
    std::memcpy(&xh, x + 8 * b + 4, 16);
    I4 nl = xl < 0, nh = xh < 0;  // -1 where negative
    xl -= (F4)(scaleBits ^ (nl & INT32_MIN));
    xh -= (F4)(scaleBits ^ (nh & INT32_MIN));
    std::memcpy(x + 8 * b, &xl, 16);
    std::memcpy(x + 8 * b + 4, &xh, 16);
    I4 set = (nl & low) | (nh & high);
    bits[b] = uint8_t(set[0] | set[1] | set[2] | set[3]);
  }
  for (uint64_t i = 8 * full; i < s.elements; ++i) {
    bool negative = x[i] < 0;
    bits[i >> 3] |= uint8_t(negative) << (i & 7);
    x[i] -= negative ? -scale : scale;
  }
}

// A onebit round in two passes over x (the residual): x = (the pushes summed in order) * scale + x, its |x| summed
// into encode's lanes on the way, then encodeSigns. The same arithmetic as decodeAdd of each push into a zeroed
// accumulator followed by encode of acc * scale + x, element by element; `pushes` are `count` payloads end to end.
void closeOnebit(const CodecSpec& s, const uint8_t* pushes, uint64_t count, float scale, float* x, uint8_t* out) {
  // Each push's 4 values of each half byte looked up, so the adds vectorize: the same adds as element by element.
  std::vector<std::array<std::array<float, 4>, 16>> nibbles(count);
  for (uint64_t w = 0; w < count; ++w) {
    float sc = loadFloat(pushes + w * s.wireBytes);
    for (int v = 0; v < 16; ++v) {
      for (int j = 0; j < 4; ++j) nibbles[w][v][j] = (v >> j) & 1 ? -sc : sc;
    }
  }
  const uint8_t* bits = pushes + 4;
  // In vectors: 8 elements a step, their |x| into the lanes as doubles.
  D2 sums[4] = {};  // encode's lanes 0-1, 2-3, 4-5, 6-7
  const F4 scales = {scale, scale, scale, scale};
  auto addAbs = [](D2& lane, D2 v) { lane += (D2)((I2)v & I2{INT64_MAX, INT64_MAX}); };
  uint64_t full = s.elements / 8;
  for (uint64_t b = 0; b < full; ++b) {
    F4 lo = {}, hi = {};
    for (uint64_t w = 0; w < count; ++w) {
      uint8_t byte = bits[w * s.wireBytes + b];
      F4 l, h;
      std::memcpy(&l, nibbles[w][byte & 15].data(), 16);
      std::memcpy(&h, nibbles[w][byte >> 4].data(), 16);
      lo += l;
      hi += h;
    }
    F4 xl, xh;
    std::memcpy(&xl, x + 8 * b, 16);
    std::memcpy(&xh, x + 8 * b + 4, 16);
    xl = lo * scales + xl;
    xh = hi * scales + xh;
    std::memcpy(x + 8 * b, &xl, 16);
    std::memcpy(x + 8 * b + 4, &xh, 16);
    addAbs(sums[0], D2{xl[0], xl[1]});
    addAbs(sums[1], D2{xl[2], xl[3]});
    addAbs(sums[2], D2{xh[0], xh[1]});
    addAbs(sums[3], D2{xh[2], xh[3]});
  }
  double lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = sums[j / 2][j % 2];
  for (uint64_t i = 8 * full; i < s.elements; ++i) {
    float a = 0;
    for (uint64_t w = 0; w < count; ++w) {
      float sc = loadFloat(pushes + w * s.wireBytes);
      a += (bits[w * s.wireBytes + (i >> 3)] >> (i & 7)) & 1 ? -sc : sc;
    }
    x[i] = a * scale + x[i];
    lanes[i & 7] += std::fabs(double(x[i]));
  }
  encodeSigns(s, lanes, x, out);
}

}  // namespace

CodecSpec CodecSpec::fromWord(uint32_t word, uint64_t denseBytes, uint64_t wireBytes, uint64_t key) {
  CodecSpec spec;
  spec.id = word & 0xff;
  spec.width = spec.id == kCodecTopk ? word >> 8 : 1;
  spec.elements = denseBytes / 4;
  spec.wireBytes = wireBytes;
  spec.key = key;
  return spec;
}

uint64_t CodecSpec::k() const {
  if (id == kCodecTopk) return width ? wireBytes / (4 * (1 + uint64_t(width))) : 0;
  if (id == kCodecRandomk) return wireBytes / 4;
  return 0;
}

std::string codecName(uint32_t word) {
  switch (word & 0xff) {
    case kCodecNone:
      return "no codec";
    case kCodecOnebit:
      return "onebit";
    case kCodecTopk:
      return formatText("topk (width %u)", word >> 8);
    case kCodecRandomk:
      return "randomk";
    default:
      return formatText("codec %u", word & 0xff);
  }
}

std::string checkDeclaration(const CodecSpec& s) {
  if (s.elements == 0) return "a compressed key holds at least one fp32 element";
  if (s.id == kCodecOnebit) {
    if (s.wireBytes != onebitBytes(s.elements)) {
      return formatText("onebit over %llu elements carries %llu bytes, not %llu", ull(s.elements),
                        ull(onebitBytes(s.elements)), ull(s.wireBytes));
    }
    return "";
  }
  if (s.id == kCodecTopk) {
    uint64_t row = 4 * (1 + uint64_t(s.width));
    if (s.width == 0 || s.elements % s.width) {
      return formatText("topk rows of width %u do not divide %llu elements", s.width, ull(s.elements));
    }
    if (s.wireBytes % row || s.k() == 0 || s.k() > s.rows()) {
      return formatText("topk carries 1 to %llu rows of %llu bytes, not %llu bytes", ull(s.rows()), ull(row),
                        ull(s.wireBytes));
    }
    return "";
  }
  if (s.id == kCodecRandomk) {
    if (s.wireBytes % 4 || s.k() == 0 || s.k() > s.elements) {
      return formatText("randomk carries 1 to %llu fp32 values, not %llu bytes", ull(s.elements), ull(s.wireBytes));
    }
    return "";
  }
  return formatText("unknown codec %u (1: onebit, 2: topk, 3: randomk)", s.id);
}

std::string checkPayload(const CodecSpec& s, const uint8_t* p, size_t size) {
  if (size != s.wireBytes) {
    return formatText("a %s push carries %llu bytes, not %llu", codecName(s.id | s.width << 8).c_str(),
                      ull(s.wireBytes), ull(size));
  }
  if (s.id == kCodecOnebit) {
    float scale = loadFloat(p);
    if (!std::isfinite(scale) || scale < 0) return formatText("onebit scale %g is not finite and >= 0", scale);
    return "";
  }
  uint64_t k = s.k(), values = s.id == kCodecTopk ? k * s.width : k;
  const uint8_t* v = s.id == kCodecTopk ? p + 4 * k : p;
  if (s.id == kCodecTopk) {
    for (uint64_t j = 0; j < k; ++j) {
      uint32_t row = loadU32(p + 4 * j);
      if (row >= s.rows()) {
        return formatText("topk row %llu's index %u is out of range (%llu rows)", ull(j), row, ull(s.rows()));
      }
    }
  }
  for (uint64_t i = 0; i < values; ++i) {
    float x = loadFloat(v + 4 * i);
    if (!std::isfinite(x)) return formatText("value %llu is %g, not finite", ull(i), x);
  }
  return "";
}

void randomIndices(uint64_t key, uint64_t round, uint64_t n, uint64_t k, uint64_t* out) {
  uint64_t h1 = splitmix(key * 0x9E3779B97F4A7C15ULL + round), h2 = splitmix(h1);
  uint64_t a = h1 % n, s = (h2 % n) | 1;
  while (std::gcd(s, n) != 1) s += 2;  // a stride coprime with n: k distinct indices
  uint64_t step = s % n, idx = a;
  for (uint64_t i = 0; i < k; ++i) {
    out[i] = idx;
    idx += step;
    if (idx >= n) idx -= n;
  }
}

void decodeAdd(const CodecSpec& s, uint64_t round, const uint8_t* p, float* acc) {
  if (s.id == kCodecTopk) {
    uint64_t k = s.k(), w = s.width;
    const uint8_t* v = p + 4 * k;
    for (uint64_t j = 0; j < k; ++j) __builtin_prefetch(acc + uint64_t(loadU32(p + 4 * j)) * w, 1);  // overlapped
    for (uint64_t j = 0; j < k; ++j) {
      float* row = acc + uint64_t(loadU32(p + 4 * j)) * w;
      for (uint64_t c = 0; c < w; ++c) row[c] += loadFloat(v + 4 * (j * w + c));
    }
  } else if (s.id == kCodecRandomk) {
    std::vector<uint64_t> idx(s.k());
    randomIndices(s.key, round, s.elements, s.k(), idx.data());
    for (uint64_t i = 0; i < idx.size(); ++i) acc[idx[i]] += loadFloat(p + 4 * i);
  }
}

void encode(const CodecSpec& s, uint64_t round, float* x, uint8_t* out) {
  if (s.id == kCodecOnebit) {
    // |x| summed in double, element i into lane i % 8 in index order, then the lanes in order: one fixed order
    // (the reference's), with eight independent chains instead of one.
    double lanes[8] = {};
    uint64_t full = s.elements / 8;
    for (uint64_t b = 0; b < full; ++b) {
      for (int j = 0; j < 8; ++j) lanes[j] += std::fabs(double(x[8 * b + j]));
    }
    for (uint64_t i = 8 * full; i < s.elements; ++i) lanes[i & 7] += std::fabs(double(x[i]));
    encodeSigns(s, lanes, x, out);
  } else if (s.id == kCodecTopk) {
    encodeTopk(s, round, x, out);
  } else if (s.id == kCodecRandomk) {
    std::vector<uint64_t> idx(s.k());
    randomIndices(s.key, round, s.elements, s.k(), idx.data());
    for (uint64_t i = 0; i < idx.size(); ++i) {
      float& e = x[idx[i]];
      std::memcpy(out + 4 * i, &e, 4);
      e -= e;
    }
  }
}

float topkThreshold(const CodecSpec& s, uint64_t round, const float* x) {
  return candidateThreshold(s, round, x);
}

void CodecKey::add(std::vector<float>& acc, uint64_t round, const uint8_t* payload) {
  if (acc.empty() && !spare_.empty()) {
    acc = std::move(spare_.back());
    spare_.pop_back();
  }
  if (keepsPushes()) {  // kept as it came (wireBytes is a multiple of 4), for close
    size_t at = acc.size();
    acc.resize(at + spec_.wireBytes / 4);
    std::memcpy(acc.data() + at, payload, spec_.wireBytes);
    return;
  }
  if (acc.empty()) acc.assign(spec_.elements, 0.0f);
  decodeAdd(spec_, round, payload, acc.data());
}

transport::Message CodecKey::close(std::vector<float>&& acc, uint64_t round, float scale) {
  if (residual_.empty()) residual_.assign(spec_.elements, 0.0f);
  // x = acc * scale + residual is made in the residual's place, where encoding leaves the next residual.
  float* x = residual_.data();
  transport::Message out = transport::Message::ofSize(spec_.wireBytes);
  const auto* pushes = reinterpret_cast<const uint8_t*>(acc.data());
  uint64_t count = keepsPushes() ? acc.size() * 4 / spec_.wireBytes : 0;
  if (spec_.id == kCodecOnebit) {
    closeOnebit(spec_, pushes, count, scale, x, out.data());
  } else if (spec_.id == kCodecTopk) {
    foldTopk(round, pushes, count, scale, x);
    encodeTopk(spec_, round, x, out.data());
  } else {
    float* a = acc.data();
    for (uint64_t i = 0; i < spec_.elements; ++i) {
      x[i] = a[i] * scale + x[i];
      a[i] = 0;  // for the next round
    }
    encode(spec_, round, x, out.data());
  }
  if (keepsPushes()) acc.clear();
  spare_.push_back(std::move(acc));
  return out;
}

// x = (the round's pushes summed in order) * scale + x on the rows they name, summed in sum_, which is left zeroed;
// a dense pass would read and write every row for the 1% named. Elsewhere the sum is +0, and +0 * scale + x is x:
// x is never -0 (it starts at +0, a sum begun at +0 never makes -0, and encoding leaves x - x), the one x it changes.
void CodecKey::foldTopk(uint64_t round, const uint8_t* pushes, uint64_t count, float scale, float* x) {
  if (sum_.empty()) sum_.assign(spec_.elements, 0.0f);
  uint64_t k = spec_.k(), w = spec_.width;
  auto row = [&](uint64_t p, uint64_t j) { return uint64_t(loadU32(pushes + p * spec_.wireBytes + 4 * j)) * w; };
  for (uint64_t p = 0; p < count; ++p) {
    for (uint64_t j = 0; j < k; ++j) __builtin_prefetch(x + row(p, j), 1);  // x is read next; decodeAdd fetches sum_
    decodeAdd(spec_, round, pushes + p * spec_.wireBytes, sum_.data());
  }
  for (uint64_t p = 0; p < count; ++p) {
    for (uint64_t j = 0; j < k; ++j) {  // a row named twice: its sum is +0 the second time, and x + 0 is x
      for (uint64_t c = row(p, j), end = c + w; c < end; ++c) {
        x[c] = sum_[c] * scale + x[c];
        sum_[c] = 0;
      }
    }
  }
}

void CodecKey::giveBack(std::vector<float>&& acc) {
  if (keepsPushes()) {
    acc.clear();
    spare_.push_back(std::move(acc));
  } else if (acc.size() == spec_.elements) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    spare_.push_back(std::move(acc));
  }
  acc = {};
}

}  // namespace bps::server
