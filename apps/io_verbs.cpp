#include "apps/io_verbs.h"

#include <algorithm>
#include <cstdio>

#include "runtime/use/import.h"

namespace t3d::app {

// `tokenize`: no MPI.
int tokenize(const runtime::TokenizeOptions& o) {
  const runtime::TokenizeSummary s = runtime::run_tokenize(o);
  if (s.trained)
    std::fprintf(stderr, "tokenize: trained a %s tokenizer of %d ids on %s in %.1f s -> %s\n",
                 o.type.c_str(), s.vocab, o.input.c_str(), s.train_s, o.tokenizer.c_str());
  if (o.decode)
    std::fprintf(stderr, "tokenize: decoded %lld tokens of %s into %lld bytes\n",
                 static_cast<long long>(s.tokens), o.input.c_str(),
                 static_cast<long long>(s.bytes));
  else if (!o.out.empty())
    std::fprintf(stderr,
                 "tokenize: %s: %lld bytes -> %lld tokens (%.2f bytes/token) -> %s (version %d, "
                 "uint%d)\n",
                 o.input.c_str(), static_cast<long long>(s.bytes), static_cast<long long>(s.tokens),
                 s.bytes / std::max<double>(1, s.tokens), o.out.c_str(), s.version,
                 s.version == 2 ? 32 : 16);
  return 0;
}

// `import`: a Hugging Face directory into a snapshot, no MPI.
int import_model(const std::string& hf_dir, const std::string& out_dir) {
  const runtime::ImportSummary s = runtime::import_hf(hf_dir, out_dir);
  const auto& m = s.recipe.model;
  std::string dtypes;
  for (const auto& d : s.dtypes) dtypes += (dtypes.empty() ? "" : "/") + d;
  std::printf(
      "import %s: %lld tensors (%s), %.2f M parameters from %zu file(s): vocab %lld, dim "
      "%lld, %lld layers, %lld heads (%lld kv) of width %lld, ffn %lld, seq_len %lld, %s "
      "embeddings\n",
      hf_dir.c_str(), static_cast<long long>(s.tensors), dtypes.c_str(), s.parameters / 1e6,
      s.files.size(), static_cast<long long>(m.vocab_size), static_cast<long long>(m.dim),
      static_cast<long long>(m.n_layers), static_cast<long long>(m.n_heads),
      static_cast<long long>(m.n_kv_heads), static_cast<long long>(m.head_dim()),
      static_cast<long long>(m.ffn_dim), static_cast<long long>(m.seq_len),
      m.tie_embeddings ? "tied" : "untied");
  using Rope = kernels::RopeScaling::Kind;
  if (m.rope_scaling == Rope::kLinear)
    std::printf(
        "import: model.rope_scaling = \"linear\", rope_factor = %g (config.json's "
        "rope_scaling)\n",
        m.rope_factor);
  if (m.rope_scaling == Rope::kLlama3)
    std::printf(
        "import: model.rope_scaling = \"llama3\", rope_factor = %g, rope_low_freq_factor = %g, "
        "rope_high_freq_factor = %g, rope_original_seq_len = %lld (config.json's rope_scaling)\n",
        m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
        static_cast<long long>(m.rope_original_seq_len));
  for (const auto& note : s.notes) std::printf("import: %s\n", note.c_str());
  std::printf(
      "import: run.name = %s, data.tokenizer = %s, data.bos = %s, snapshot.every = %lld; every "
      "other key has its default (titan3d keys)\n",
      s.recipe.run.name.c_str(), s.tokenizer.c_str(), s.recipe.data.bos ? "true" : "false",
      static_cast<long long>(s.recipe.snapshot.every));
  std::printf(
      "import: snapshot %s (step 0); fine-tune with: titan3d resume %s --set "
      "train.steps=N ...\n",
      s.snapshot.c_str(), s.snapshot.c_str());
  return 0;
}

}  // namespace t3d::app
