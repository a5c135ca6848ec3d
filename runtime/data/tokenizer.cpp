#include "runtime/data/tokenizer.h"

#include "kernels/check.h"

namespace t3d::runtime {

std::vector<uint16_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint16_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

namespace {
template <typename T>
std::string decode_impl(std::span<const T> tokens) {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto t = static_cast<int64_t>(tokens[i]);
    T3D_USER_CHECK(t >= 0 && t < ByteTokenizer::kVocabSize, "byte tokenizer: token ", t,
                   " at position ", i,
                   " is outside [0, 256); the ids come from another vocabulary");
    out[i] = static_cast<char>(static_cast<unsigned char>(t));
  }
  return out;
}
}  // namespace

std::string ByteTokenizer::decode(std::span<const int32_t> tokens) const {
  return decode_impl(tokens);
}
std::string ByteTokenizer::decode(std::span<const uint16_t> tokens) const {
  return decode_impl(tokens);
}

}  // namespace t3d::runtime
