// A small binary encoding for ledger records and snapshots: little-endian
// fixed integers, varints and length-prefixed strings. Private.
#ifndef DEEPNEX_GPU_CODEC_H_
#define DEEPNEX_GPU_CODEC_H_

#include <cstdint>
#include <cstring>
#include <string>

namespace deepnex::gpu {

class Encoder {
 public:
  explicit Encoder(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void Fixed32(uint32_t v) {
    char b[4];
    for (int i = 0; i < 4; ++i) b[i] = static_cast<char>(v >> (8 * i));
    out_->append(b, 4);
  }
  void Fixed64(uint64_t v) {
    char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(v >> (8 * i));
    out_->append(b, 8);
  }
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_->push_back(static_cast<char>(v | 0x80));
      v >>= 7;
    }
    out_->push_back(static_cast<char>(v));
  }
  // Zigzag, for values that may be negative.
  void Signed(int64_t v) {
    Varint((static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63));
  }
  void Str(const std::string& s) {
    Varint(s.size());
    out_->append(s);
  }

 private:
  std::string* out_;
};

// Every read returns false past the end; the caller turns that into DataLoss.
class Decoder {
 public:
  Decoder(const char* p, size_t n) : p_(p), end_(p + n) {}
  bool done() const { return p_ == end_; }
  bool U8(uint8_t* v) {
    if (p_ >= end_) return false;
    *v = static_cast<uint8_t>(*p_++);
    return true;
  }
  bool Varint(uint64_t* v) {
    uint64_t r = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ >= end_) return false;
      uint8_t b = static_cast<uint8_t>(*p_++);
      r |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) {
        *v = r;
        return true;
      }
    }
    return false;
  }
  bool Signed(int64_t* v) {
    uint64_t u;
    if (!Varint(&u)) return false;
    *v = static_cast<int64_t>((u >> 1) ^ (0 - (u & 1)));
    return true;
  }
  bool Int(int* v) {
    int64_t x;
    if (!Signed(&x)) return false;
    *v = static_cast<int>(x);
    return true;
  }
  bool Str(std::string* s) {
    uint64_t n;
    if (!Varint(&n) || n > static_cast<uint64_t>(end_ - p_)) return false;
    s->assign(p_, n);
    p_ += n;
    return true;
  }

 private:
  const char* p_;
  const char* end_;
};

inline uint32_t LoadFixed32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
inline uint64_t LoadFixed64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_CODEC_H_
