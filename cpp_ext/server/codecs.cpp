// See codecs.h; torch_bps/_reference/codecs.py is the reference, the error texts its texts.
#include "server/codecs.h"

#include <algorithm>
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

// Top-k reads each element once: one pass makes x (close's acc * scale + residual), every row's score and the
// candidate rows, those scoring at least a threshold read from a sample; only the candidates are then sorted out.

struct Candidate {
  float score;
  uint32_t row;
};

// A row's score: the f32 sum of its |x| in column order, NaN counted as +inf. With acc, x is acc * scale + x.
float rowScore(const float* x, const float* acc, float scale, uint64_t w) {
  float m = 0;
  for (uint64_t c = 0; c < w; ++c) m += std::fabs(acc ? acc[c] * scale + x[c] : x[c]);
  return std::isnan(m) ? INFINITY : m;
}

// A score at least k rows reach with high probability, from a sample of rows: the rows scoring at least it hold
// the k largest. 0 (every row) where a sample cannot narrow them. It decides how much is sorted, never the result.
float candidateThreshold(const CodecSpec& s, uint64_t round, const float* x, const float* acc, float scale) {
  // A 64th of the rows, 1024 to 4096: a larger sample costs more random reads and leaves fewer candidates.
  uint64_t rows = s.rows(), w = s.width, m = std::min(rows, std::clamp<uint64_t>(rows / 64, 1024, 4096));
  double expected = double(s.k()) * double(m) / double(rows);  // sampled rows scoring above the k-th largest
  auto j = uint64_t(expected + 4 * std::sqrt(expected) + 4);  // 4 standard deviations over: rarely too few
  if (j >= m) return 0;
  std::vector<float> sample(m);
  for (uint64_t i = 0; i < m; ++i) {
    uint64_t at = splitmix(round * m + i) % rows * w;
    sample[i] = rowScore(x + at, acc ? acc + at : nullptr, scale, w);
  }
  std::nth_element(sample.begin(), sample.begin() + j, sample.end(), std::greater<float>());
  return sample[j];
}

// Append the rows scoring >= t to `out`, in row order; with acc, first x = acc * scale + x, acc left zeroed. A
// block at a time, so that it is scored while in cache. A NaN score fails `m < t` as +inf does.
void collectCandidates(const CodecSpec& s, float* x, float* acc, float scale, float t, std::vector<Candidate>& out) {
  constexpr uint64_t kBlock = 1024, kGroup = 16;
  uint64_t w = s.width, rows = s.rows(), block = std::max<uint64_t>(1, kBlock / w);
  auto take = [&](uint64_t r, float m) {
    if (!(m < t)) out.push_back({std::isnan(m) ? INFINITY : m, uint32_t(r)});
  };
  for (uint64_t r0 = 0; r0 < rows; r0 += block) {
    uint64_t r1 = std::min(rows, r0 + block);
    if (acc) {
      for (uint64_t i = r0 * w; i < r1 * w; ++i) {
        x[i] = acc[i] * scale + x[i];
        acc[i] = 0;
      }
    }
    uint64_t r = r0;
    if (w == 1) {  // the dense case: a group of scores compared at once (vectorized), scanned only if one passes
      for (; r + kGroup <= r1; r += kGroup) {
        int hits = 0;
        for (uint64_t j = 0; j < kGroup; ++j) hits += !(std::fabs(x[r + j]) < t);
        if (hits) {
          for (uint64_t j = 0; j < kGroup; ++j) take(r + j, std::fabs(x[r + j]));
        }
      }
    }
    for (; r < r1; ++r) take(r, rowScore(x + r * w, nullptr, 1.0f, w));
  }
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

// Top-k of x, or with acc of acc * scale + x (acc left zeroed); x is left holding the residual.
void encodeTopk(const CodecSpec& s, uint64_t round, float* x, float* acc, float scale, uint8_t* out) {
  uint64_t k = s.k(), w = s.width;
  std::vector<Candidate> candidates;
  collectCandidates(s, x, acc, scale, candidateThreshold(s, round, x, acc, scale), candidates);
  if (candidates.size() < k) {  // the sample misjudged: every row is a candidate
    candidates.clear();
    collectCandidates(s, x, nullptr, 1.0f, 0, candidates);
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
  if (s.id == kCodecOnebit) {
    float scale = loadFloat(p);
    const uint8_t* bits = p + 4;
    // Each byte's 8 values looked up, so the adds vectorize: the same adds as element by element.
    float table[256][8];
    for (int b = 0; b < 256; ++b) {
      for (int j = 0; j < 8; ++j) table[b][j] = (b >> j) & 1 ? -scale : scale;
    }
    uint64_t full = s.elements / 8;
    for (uint64_t b = 0; b < full; ++b) {
      const float* t = table[bits[b]];
      float* a = acc + 8 * b;
      for (int j = 0; j < 8; ++j) a[j] += t[j];
    }
    for (uint64_t i = 8 * full; i < s.elements; ++i) acc[i] += (bits[i >> 3] >> (i & 7)) & 1 ? -scale : scale;
  } else if (s.id == kCodecTopk) {
    uint64_t k = s.k(), w = s.width;
    const uint8_t* v = p + 4 * k;
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
    double total = lanes[0];
    for (int j = 1; j < 8; ++j) total += lanes[j];
    float scale = static_cast<float>(total / double(s.elements));
    std::memcpy(out, &scale, 4);
    uint8_t* bits = out + 4;
    std::memset(bits, 0, s.wireBytes - 4);
    for (uint64_t b = 0; b < full; ++b) {
      float* xb = x + 8 * b;
      uint8_t byte = 0;
      for (int j = 0; j < 8; ++j) {
        bool negative = xb[j] < 0;
        byte |= uint8_t(negative) << j;
        xb[j] -= negative ? -scale : scale;
      }
      bits[b] = byte;
    }
    for (uint64_t i = 8 * full; i < s.elements; ++i) {
      bool negative = x[i] < 0;
      bits[i >> 3] |= uint8_t(negative) << (i & 7);
      x[i] -= negative ? -scale : scale;
    }
  } else if (s.id == kCodecTopk) {
    encodeTopk(s, round, x, nullptr, 1.0f, out);
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
  return candidateThreshold(s, round, x, nullptr, 1.0f);
}

void CodecKey::add(std::vector<float>& acc, uint64_t round, const uint8_t* payload) {
  if (acc.empty()) {
    if (spare_.empty()) {
      acc.assign(spec_.elements, 0.0f);
    } else {
      acc = std::move(spare_.back());
      spare_.pop_back();
    }
  }
  decodeAdd(spec_, round, payload, acc.data());
}

transport::Message CodecKey::close(std::vector<float>&& acc, uint64_t round, float scale) {
  if (residual_.empty()) residual_.assign(spec_.elements, 0.0f);
  // x = acc * scale + residual is made in the residual's place, where encoding leaves the next residual; acc is
  // zeroed in the same pass, for the next round.
  float *x = residual_.data(), *a = acc.data();
  transport::Message out = transport::Message::ofSize(spec_.wireBytes);
  if (spec_.id == kCodecTopk) {
    encodeTopk(spec_, round, x, a, scale, out.data());
  } else {
    for (uint64_t i = 0; i < spec_.elements; ++i) {
      x[i] = a[i] * scale + x[i];
      a[i] = 0;
    }
    encode(spec_, round, x, out.data());
  }
  spare_.push_back(std::move(acc));
  return out;
}

void CodecKey::giveBack(std::vector<float>&& acc) {
  if (acc.size() == spec_.elements) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    spare_.push_back(std::move(acc));
  }
  acc = {};
}

}  // namespace bps::server
