#include <cstring>

#include "kernels/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"

namespace t3d::kernels {

void embedding_forward(const Exec& exec, float* out, const std::int32_t* tokens, const float* wte,
                       std::int64_t N, std::int64_t C, std::int64_t vocab_start,
                       std::int64_t vocab_end) {
  T3D_ON_GPU(exec,
             cuda::embedding_forward(*exec.stream, out, tokens, wte, N, C, vocab_start, vocab_end));
  T3D_ASSERT(vocab_start >= 0 && vocab_start <= vocab_end, "vocab slice [", vocab_start, ", ",
             vocab_end, ")");
  const std::size_t row_bytes = static_cast<std::size_t>(C) * sizeof(float);
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int64_t t = tokens[i];
    float* o = out + i * C;
    if (t >= vocab_start && t < vocab_end) {
      std::memcpy(o, wte + (t - vocab_start) * C, row_bytes);
    } else {
      std::memset(o, 0, row_bytes);
    }
  }
}

void embedding_backward(const Exec& exec, float* dwte, const float* dout,
                        const std::int32_t* tokens, std::int64_t N, std::int64_t C,
                        std::int64_t vocab_start, std::int64_t vocab_end) {
  T3D_ON_GPU(exec, cuda::embedding_backward(*exec.stream, dwte, dout, tokens, N, C, vocab_start,
                                            vocab_end));
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int64_t t = tokens[i];
    if (t < vocab_start || t >= vocab_end) continue;
    float* d = dwte + (t - vocab_start) * C;
    const float* g = dout + i * C;
    for (std::int64_t c = 0; c < C; ++c) d[c] += g[c];
  }
}

void check_token_ids(const std::int32_t* tokens, std::int64_t N, std::int64_t vocab_size) {
  for (std::int64_t i = 0; i < N; ++i) {
    T3D_USER_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size, "token id ", tokens[i],
                   " at position ", i, " is outside the vocabulary [0, ", vocab_size,
                   "); check model.vocab_size against the tokenizer that produced the data");
  }
}

}  // namespace t3d::kernels
