// Compressed SUM keys on the server: sum the round's decoded pushes in fp32, in arrival order, and when the round
// closes encode the sum (plus this key's error feedback) once, which every pull reads. Random-k decodes each push as
// it comes; onebit and top-k keep their pushes and decode them when the round closes (CodecKey::add). docs/protocol.md ("Compressed keys")
// states the layouts and the arithmetic; torch_bps/_reference/codecs.py states them again in numpy, and
// tests/server/test_codecs.py holds the two to the same bits.
//
// Codecs: onebit (an fp32 scale, then one sign bit per element), top-k (k u32 row indices, then k rows of
// `width` fp32 values), random-k (k fp32 values at indices both ends derive from the key and round). The server's
// error feedback: the residual x - decode(encode(x)) of each round's result is kept per key and added into the
// next round's sum before it is encoded, so what the pull direction drops is sent later, not lost.
//
// Used by one thread only (the server's loop thread): nothing here locks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transport/message.h"

namespace bps::server {

enum CodecId : uint32_t { kCodecNone = 0, kCodecOnebit = 1, kCodecTopk = 2, kCodecRandomk = 3 };

// A compressed key's declaration: INIT's `codec` field is the codec word (id | width << 8), its `dense_bytes`
// the dense partition's bytes (fp32), its `nbytes` what a push and a pull carry.
struct CodecSpec {
  uint32_t id = kCodecNone;
  uint32_t width = 1;  // top-k: values per row
  uint64_t elements = 0;  // the dense partition's fp32 elements
  uint64_t wireBytes = 0;  // a push's and a pull's payload
  uint64_t key = 0;  // random-k: the key its indices derive from

  static CodecSpec fromWord(uint32_t word, uint64_t denseBytes, uint64_t wireBytes, uint64_t key);
  uint64_t rows() const { return width ? elements / width : 0; }
  uint64_t k() const;  // top-k: rows sent; random-k: elements sent
};

// "onebit", "topk (width 4)", ...: how error messages name a codec word.
std::string codecName(uint32_t word);
// Why a key of this spec cannot be declared, or "".
std::string checkDeclaration(const CodecSpec& spec);
// Why this push payload is malformed (length, an index out of range, a value or scale not finite), or "".
std::string checkPayload(const CodecSpec& spec, const uint8_t* payload, size_t size);
// acc[i] += the push's decoded value at i, in the payload's order: top-k and random-k (a onebit round's pushes are
// decoded together, by CodecKey::close).
void decodeAdd(const CodecSpec& spec, uint64_t round, const uint8_t* payload, float* acc);
// Encode x into `out` (spec.wireBytes), then leave x - decode(out) in x: the residual.
void encode(const CodecSpec& spec, uint64_t round, float* x, uint8_t* out);
// Top-k's candidate threshold for x in `round`: only the rows scoring at least it are sorted out for the k largest,
// unless fewer than k reach it. For the tests, which hold both cases to the reference.
float topkThreshold(const CodecSpec& spec, uint64_t round, const float* x);
// Random-k's k distinct indices of round `round`: (a + i * s) mod n, a and s drawn from (key, round).
void randomIndices(uint64_t key, uint64_t round, uint64_t n, uint64_t k, uint64_t* out);

// One compressed key's server state: its residual across rounds and its rounds' accumulators.
class CodecKey {
 public:
  explicit CodecKey(CodecSpec spec) : spec_(spec) {}
  const CodecSpec& spec() const { return spec_; }
  // Add a checked push into the round's accumulator (`acc` empty: a zeroed one is taken first). Onebit and top-k
  // rounds keep their pushes there as they came instead, for close: onebit decodes them all in one pass over the
  // key where each push would make one, top-k adds them into x on the rows they name alone.
  void add(std::vector<float>& acc, uint64_t round, const uint8_t* payload);
  // The round's result: (acc * scale + residual) encoded; the residual becomes what that encoding dropped.
  transport::Message close(std::vector<float>&& acc, uint64_t round, float scale);
  void giveBack(std::vector<float>&& acc);  // a failed round's accumulator

 private:
  bool keepsPushes() const { return spec_.id == kCodecOnebit || spec_.id == kCodecTopk; }
  void foldTopk(uint64_t round, const uint8_t* pushes, uint64_t count, float scale, float* x);

  CodecSpec spec_;
  std::vector<float> residual_;
  std::vector<float> sum_;  // top-k: where foldTopk adds up a round's pushes; zeroed between rounds
  std::vector<std::vector<float>> spare_;  // zeroed accumulators (onebit, top-k: emptied)
};

}  // namespace bps::server
