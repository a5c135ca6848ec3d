// Validation of a parsed recipe: each key's bounds ("Limits"), its value, and the combinations,
// among them the one rule of which layouts train (layout_problem), which the planner asks too.
// Every complaint names the key and where it was set (Recipe::origin).
#include <strings.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <type_traits>

#include "kernels/check.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/recipe/recipe_detail.h"

namespace t3d::runtime {
namespace {

using recipe_detail::fail;
using recipe_detail::kMaxLayers;

// Upper bounds (docs/recipe.md, "Limits"): far beyond any real run, small enough that every size
// the trainer derives fits in 64 bits (validate_train's rough counts of the parameters and the
// activations, a mixture of experts' included). The experts' bound is kernels::kMaxExperts, which
// the MoE kernels share.
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxDim = int64_t{1} << 17;
constexpr int64_t kMaxFfn = int64_t{1} << 20;
constexpr int64_t kMaxSeqLen = int64_t{1} << 24;
constexpr int64_t kMaxRanks = int64_t{1} << 20;  // each of pp, dp, cp, tp, ep; pp·dp·cp·tp
constexpr int64_t kMaxBatch = int64_t{1} << 30;  // global_batch, micro_batches, val_batches
constexpr int64_t kMaxTokensPerStep = int64_t{1} << 36;  // global_batch · seq_len
constexpr int64_t kMaxSteps = int64_t{1} << 40;
constexpr double kMaxElements = double(int64_t{1} << 50);  // activations, parameters (floats)
constexpr int64_t kMaxThreads = 4096;
constexpr double kMaxBucketMb = 1 << 20;
constexpr double kMinTimeoutS = 1.0;
constexpr double kMaxTimeoutS = 1e7;
constexpr double kMaxHbmGib = 1 << 20;

// OpenBLAS's own core names (DYNAMIC_ARCH builds, x86-64 and arm64), matched case-insensitively
// as OpenBLAS does; a name it does not know would silently fall back to generic kernels.
bool is_known_openblas_coretype(const std::string& name) {
  static const char* const kNames[] = {
      "auto",         "Katmai",         "Coppermine", "Northwood",    "Prescott",
      "Banias",       "Atom",           "Core2",      "Penryn",       "Dunnington",
      "Nehalem",      "Athlon",         "Opteron",    "Opteron_SSE3", "Barcelona",
      "Nano",         "Sandybridge",    "Bobcat",     "Bulldozer",    "Piledriver",
      "Haswell",      "Steamroller",    "Excavator",  "Zen",          "SkylakeX",
      "Cooperlake",   "SapphireRapids", "ARMV8",      "CortexA53",    "CortexA55",
      "CortexA57",    "CortexA72",      "CortexA73",  "CortexX1",     "CortexA710",
      "NeoverseN1",   "NeoverseN2",     "NeoverseV1", "NeoverseV2",   "ThunderX",
      "ThunderX2T99", "ThunderX3T110",  "TSV110",     "EMAG8180",     "FALKOR",
      "A64FX",        "ARMV8SVE"};
  for (const char* k : kNames)
    if (strcasecmp(k, name.c_str()) == 0) return true;
  return false;
}

class Validator {
 public:
  explicit Validator(const Recipe& r) : r_(r) {}

  void require(bool ok, const std::string& key, const std::string& msg) const {
    if (!ok) fail(origin(key), key, msg);
  }
  std::string origin(const std::string& key) const { return r_.origin(key); }
  void one_of(const std::string& key, const std::string& value,
              std::initializer_list<const char*> allowed) const {
    std::string list;
    for (const char* a : allowed) {
      if (value == a) return;
      list += list.empty() ? a : std::string(", ") + a;
    }
    fail(origin(key), key, "\"" + value + "\" is not one of: " + list);
  }

 private:
  const Recipe& r_;
};

using parallel::ScheduleKind;

// A number as a message shows it.
template <typename T>
std::string is(T x) {
  if constexpr (std::is_floating_point_v<T>) {
    std::ostringstream os;
    os << x;
    return os.str();
  } else {
    return std::to_string(x);
  }
}

// Upper bounds, checked first: every product the later checks form (pp·dp·cp·tp,
// dp·micro_batches, pp·virtual_stages, global_batch·seq_len) then fits in 64 bits, and the
// trainer's sizes cannot overflow.
void validate_limits(const Recipe& r) {
  const Validator v(r);
  const auto& m = r.model;
  const auto& p = r.parallel;
  const auto& t = r.train;

  const auto at_most = [&](const std::string& key, int64_t x, int64_t limit) {
    v.require(x <= limit, key,
              is(x) + " is larger than " + is(limit) +
                  ", the most titan3d accepts (docs/recipe.md, \"Limits\")");
  };
  at_most("model.vocab_size", m.vocab_size, kMaxVocab);
  at_most("model.dim", m.dim, kMaxDim);
  at_most("model.n_layers", m.n_layers, kMaxLayers);
  at_most("model.n_heads", m.n_heads, kMaxDim);
  at_most("model.n_kv_heads", m.n_kv_heads, kMaxDim);
  at_most("model.head_dim", m.explicit_head_dim, kMaxDim);
  at_most("model.ffn_dim", m.ffn_dim, kMaxFfn);
  at_most("model.seq_len", m.seq_len, kMaxSeqLen);
  at_most("parallel.pp", p.pp, kMaxRanks);
  at_most("parallel.dp", p.dp, kMaxRanks);
  at_most("parallel.cp", p.cp, kMaxRanks);
  at_most("parallel.tp", p.tp, kMaxRanks);
  at_most("parallel.ep", p.ep, kMaxRanks);
  at_most("parallel.virtual_stages", p.virtual_stages, kMaxLayers);
  at_most("train.global_batch", t.global_batch, kMaxBatch);
  at_most("train.micro_batches", t.micro_batches, kMaxBatch);
  at_most("train.steps", t.steps, kMaxSteps);
  at_most("train.warmup_steps", t.warmup_steps, kMaxSteps);
  at_most("train.val_every", t.val_every, kMaxSteps);
  at_most("train.val_batches", t.val_batches, kMaxBatch);
  at_most("train.log_every", t.log_every, kMaxSteps);
  at_most("snapshot.every", r.snapshot.every, kMaxSteps);
  at_most("snapshot.memory_every", r.snapshot.memory_every, kMaxSteps);
  at_most("snapshot.keep", r.snapshot.keep, kMaxRanks);
  at_most("snapshot.full_every", r.snapshot.full_every, kMaxRanks);
  at_most("hardware.threads_per_rank", r.hardware.threads_per_rank, kMaxThreads);
  {
    // Each factor is at most kMaxRanks = 2^20 here, so the products cannot overflow.
    const int64_t world = p.pp * std::max<int64_t>(p.dp, 1) * p.cp * p.tp;
    v.require(world <= kMaxRanks, "parallel.dp",
              "pp·dp·cp·tp = " + is(p.pp) + "·" + is(p.dp) + "·" + is(p.cp) + "·" + is(p.tp) +
                  " = " + is(world) + " ranks, more than the " + is(kMaxRanks) +
                  " titan3d accepts");
  }
  v.require(t.global_batch * m.seq_len <= kMaxTokensPerStep, "train.global_batch",
            "global_batch·seq_len = " + is(t.global_batch) + "·" + is(m.seq_len) +
                " tokens per step is more than " + is(kMaxTokensPerStep) +
                " (docs/recipe.md, \"Limits\")");
  v.require(r.parallel.bucket_mb <= kMaxBucketMb, "parallel.bucket_mb",
            "must be at most " + is(kMaxBucketMb) + " MiB, got " + is(r.parallel.bucket_mb));
  v.require(p.timeout_s >= kMinTimeoutS && p.timeout_s <= kMaxTimeoutS, "parallel.timeout_s",
            "must lie in [" + is(kMinTimeoutS) + ", " + is(kMaxTimeoutS) + "] seconds, got " +
                is(p.timeout_s) + ": a shorter wait mistakes an ordinary step for a hang");
  v.require(r.hardware.hbm_gib <= kMaxHbmGib, "hardware.hbm_gib",
            "must be at most " + is(kMaxHbmGib) + " GiB, got " + is(r.hardware.hbm_gib));
  v.require(is_known_openblas_coretype(r.hardware.openblas_coretype), "hardware.openblas_coretype",
            "\"" + r.hardware.openblas_coretype +
                "\" is not an OpenBLAS core name: use auto, or one such as Haswell, SkylakeX, "
                "Zen, Sandybridge, Nehalem, Core2, Prescott, NeoverseN1, ARMV8");
}

void validate_model(const Recipe& r) {
  const Validator v(r);
  const auto& m = r.model;
  v.require(m.vocab_size >= 2, "model.vocab_size", "must be at least 2, got " + is(m.vocab_size));
  v.require(m.dim >= 1, "model.dim", "must be positive, got " + is(m.dim));
  v.require(m.n_layers >= 1, "model.n_layers", "must be positive, got " + is(m.n_layers));
  v.require(m.n_heads >= 1, "model.n_heads", "must be positive, got " + is(m.n_heads));
  v.require(m.n_kv_heads >= 0, "model.n_kv_heads", "must be ≥ 0 (0 means n_heads)");
  v.require(m.explicit_head_dim >= 0, "model.head_dim",
            "must be ≥ 0 (0 means dim / n_heads), got " + is(m.explicit_head_dim));
  if (m.explicit_head_dim == 0) {
    v.require(m.dim % m.n_heads == 0, "model.n_heads",
              "model.dim = " + is(m.dim) + " is not divisible by n_heads = " + is(m.n_heads) +
                  "; choose n_heads that divides it, or set model.head_dim");
    v.require(m.head_dim() % 2 == 0, "model.n_heads",
              "head_dim = dim / n_heads = " + is(m.head_dim()) + " must be even for RoPE");
  } else {
    v.require(m.head_dim() % 2 == 0, "model.head_dim",
              "must be even for RoPE (it rotates pairs), got " + is(m.head_dim()));
  }
  v.require(
      m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
      "n_heads = " + is(m.n_heads) + " must be a multiple of n_kv_heads = " + is(m.n_kv_heads));
  v.require(m.ffn_dim >= 1, "model.ffn_dim", "must be positive (0 means the LLaMA rule)");
  v.require(m.seq_len >= 1, "model.seq_len", "must be positive, got " + is(m.seq_len));
  v.require(m.rope_theta > 0, "model.rope_theta", "must be positive");
  v.require(m.norm_eps > 0, "model.norm_eps", "must be positive");
  v.require(m.n_experts >= 0 && m.n_experts <= kernels::kMaxExperts, "model.n_experts",
            "must lie in [0, " + is(kernels::kMaxExperts) + "] (0: dense), got " + is(m.n_experts));
  v.require(!m.shared_expert_gate || (m.moe() && m.n_shared_experts > 0),
            "model.shared_expert_gate",
            "gates the shared experts' output: it needs model.n_experts > 0 and "
            "model.n_shared_experts > 0");
  if (!m.moe()) return;
  v.require(m.experts_per_token >= 1 && m.experts_per_token <= m.n_experts,
            "model.experts_per_token",
            "must lie in [1, n_experts = " + is(m.n_experts) + "], got " + is(m.experts_per_token));
  v.require(m.n_shared_experts >= 0 && m.n_shared_experts <= kernels::kMaxExperts,
            "model.n_shared_experts",
            "must lie in [0, " + is(kernels::kMaxExperts) + "], got " + is(m.n_shared_experts));
  v.require(
      m.moe_ffn_dim >= 1 && m.moe_ffn_dim <= kMaxFfn, "model.moe_ffn_dim",
      "must lie in [1, " + is(kMaxFfn) + "] (0 means model.ffn_dim), got " + is(m.moe_ffn_dim));
  // The experts' matrices lie back to back in the arena, which aligns every tensor to 16 floats.
  v.require(m.moe_ffn_dim * m.dim % 16 == 0, "model.moe_ffn_dim",
            "moe_ffn_dim·dim = " + is(m.moe_ffn_dim) + "·" + is(m.dim) +
                " must be a multiple of 16 (the experts' matrices are stacked)");
  v.require(m.dense_layers >= 0 && m.dense_layers < m.n_layers, "model.dense_layers",
            "must lie in [0, n_layers = " + is(m.n_layers) +
                "): at least one block must be a mixture of experts, got " + is(m.dense_layers));
  v.require(m.router_scale > 0 && std::isfinite(m.router_scale), "model.router_scale",
            "must be a positive number, got " + is(m.router_scale));
  v.require(m.router_bias_rate >= 0 && std::isfinite(m.router_bias_rate), "model.router_bias_rate",
            "must be ≥ 0 (0: off), got " + is(m.router_bias_rate));
  v.require(m.router_aux_coef >= 0 && std::isfinite(m.router_aux_coef), "model.router_aux_coef",
            "must be ≥ 0 (0: off), got " + is(m.router_aux_coef));
  v.require(m.capacity_factor >= 0 && std::isfinite(m.capacity_factor), "model.capacity_factor",
            "must be ≥ 0 (0: dropless), got " + is(m.capacity_factor));
}

// RoPE scaling: the chosen kind's parameters in range, and a parameter the kind does not read left
// at its default (a factor set while rope_scaling = none would silently do nothing).
void validate_rope(const Recipe& r) {
  const Validator v(r);
  const auto& m = r.model;
  using Kind = kernels::RopeScaling::Kind;
  const ModelConfig defaults;
  const std::string kind =
      "model.rope_scaling = \"" + std::string(choice_name(m.rope_scaling)) + "\"";
  const auto unread = [&](bool at_default, const char* key, const char* reader) {
    v.require(at_default, key,
              std::string("is read only by ") + reader + ", but " + kind +
                  ": leave it out, or set model.rope_scaling");
  };
  if (m.rope_scaling == Kind::kNone)
    unread(m.rope_factor == defaults.rope_factor, "model.rope_factor",
           "model.rope_scaling = \"linear\" or \"llama3\"");
  else
    v.require(m.rope_factor > 0, "model.rope_factor",
              "must be positive with " + kind + ", got " + is(m.rope_factor));
  if (m.rope_scaling != Kind::kLlama3) {
    const char* llama3 = "model.rope_scaling = \"llama3\"";
    unread(m.rope_low_freq_factor == defaults.rope_low_freq_factor, "model.rope_low_freq_factor",
           llama3);
    unread(m.rope_high_freq_factor == defaults.rope_high_freq_factor, "model.rope_high_freq_factor",
           llama3);
    unread(m.rope_original_seq_len == defaults.rope_original_seq_len, "model.rope_original_seq_len",
           llama3);
    return;
  }
  v.require(m.rope_low_freq_factor > 0, "model.rope_low_freq_factor",
            "must be positive, got " + is(m.rope_low_freq_factor));
  v.require(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor",
            "must be larger than model.rope_low_freq_factor = " + is(m.rope_low_freq_factor) +
                ", got " + is(m.rope_high_freq_factor));
  v.require(m.rope_original_seq_len >= 1 && m.rope_original_seq_len <= kMaxSeqLen,
            "model.rope_original_seq_len",
            "must lie in [1, " + is(kMaxSeqLen) + "], got " + is(m.rope_original_seq_len));
}

// ep must divide dp·cp (MeshShape::ep_group): said alike before and after dp = -1 resolves.
std::string ep_fold_complaint(const ParallelConfig& p) {
  return "ep = " + is(p.ep) + " does not divide dp·cp = " + is(p.dp) + "·" + is(p.cp) + " = " +
         is(p.dp * p.cp) +
         ": the EP groups are carved out of the dp × cp ranks (docs/parallelism.md); choose an ep "
         "that divides dp·cp, or more dp ranks";
}

void validate_parallel(const Recipe& r) {
  const Validator v(r);
  const auto& p = r.parallel;
  const LayoutProblem layout = layout_problem(r.model, p, r.train);
  v.require(layout.none(), layout.key, layout.reason);
  v.require(p.bucket_mb > 0, "parallel.bucket_mb", "must be positive");
  v.require(p.timeout_s > 0, "parallel.timeout_s", "must be positive seconds");
  v.require(p.device_comm != DeviceComm::kNccl || r.hardware.device != kernels::DeviceChoice::kCpu,
            "parallel.device_comm",
            "\"nccl\" moves tensors between GPUs, but hardware.device = \"cpu\": set "
            "hardware.device = \"cuda\", or parallel.device_comm = \"auto\"");
}

void validate_train(const Recipe& r) {
  const Validator v(r);
  const auto& m = r.model;
  const auto& p = r.parallel;
  const auto& t = r.train;
  v.require(t.steps >= 0, "train.steps", "must be ≥ 0");
  v.require(t.global_batch >= 1, "train.global_batch", "must be positive");
  {
    // The bounds above keep each count in range but not their product: a rough count of one
    // micro-batch's activations and of the parameters (doubles, no overflow) keeps every byte
    // size the model derives far inside 64 bits. Below these limits the arena's own check against
    // hardware.hbm_gib says whether the run fits. Per block: attention and norms; a dense block's
    // SwiGLU (F); a mixture of experts' router (E), routed experts (E of width Fe; an EP rank
    // takes the K routed rows of every token of its ep ranks) and shared experts (width Fs).
    // rows_per_micro's rows, in doubles: this guard must not overflow on the values it refuses.
    const double rows = static_cast<double>(t.global_batch) /
                        (static_cast<double>(std::max<int64_t>(p.dp, 1)) * t.micro_batches);
    const double T = static_cast<double>(m.seq_len), L = static_cast<double>(m.n_layers);
    const double C = static_cast<double>(m.dim), F = static_cast<double>(m.ffn_dim);
    const double A = static_cast<double>(m.attention_width());  // C unless model.head_dim
    const double moe_blocks = m.moe() ? static_cast<double>(m.n_layers - m.dense_layers) : 0;
    const double dense_blocks = L - moe_blocks;
    const double E = static_cast<double>(m.n_experts), Fe = static_cast<double>(m.moe_ffn_dim);
    const double Fs = static_cast<double>(m.shared_ffn_dim());
    const double K = static_cast<double>(m.experts_per_token), P = static_cast<double>(p.ep);
    const double activations =
        std::max(rows, 1.0) * T *
        (L * (8.0 * C + 8.0 * A + static_cast<double>(m.n_heads) * T) + dense_blocks * 4.0 * F +
         moe_blocks * (E + 2.0 * K + P * K * (4.0 * Fe + 2.0 * C) + 4.0 * Fs) + 2.0 * m.vocab_size);
    v.require(activations <= kMaxElements, "train.global_batch",
              "one micro-batch of global_batch / (dp·micro_batches) = " + is(rows) +
                  " sequences of seq_len = " + is(m.seq_len) + " needs about " +
                  is(activations * 4 / double(int64_t{1} << 40)) +
                  " TiB of activations per rank, far beyond any device; lower "
                  "train.global_batch or model.seq_len, or raise train.micro_batches");
    const double experts = moe_blocks * E * 3.0 * C * Fe;
    const double params = L * 4.0 * C * A + dense_blocks * 3.0 * C * F +
                          moe_blocks * (E * C + 3.0 * C * Fs) + experts + 2.0 * m.vocab_size * C;
    v.require(params <= kMaxElements, experts > params / 2 ? "model.n_experts" : "model.dim",
              "the model has about " + is(params) + " parameters, " + is(experts) +
                  " of them routed experts (model.dim, n_layers, ffn_dim, vocab_size; "
                  "n_experts·3·dim·moe_ffn_dim per mixture-of-experts block, n_shared_experts), "
                  "far beyond any device");
  }
  v.require(t.lr > 0 && std::isfinite(t.lr), "train.lr", "must be a positive number");
  v.require(t.min_lr >= 0 && t.min_lr <= t.lr, "train.min_lr", "must lie in [0, train.lr]");
  v.require(t.warmup_steps >= 0, "train.warmup_steps", "must be ≥ 0");
  v.require(t.decay_steps >= 0 && t.decay_steps <= std::max<int64_t>(0, t.steps - t.warmup_steps),
            "train.decay_steps",
            "must lie in [0, train.steps − train.warmup_steps] (0: every step after the warm-up "
            "decays)");
  v.require(t.decay_steps == 0 || t.lr_decay != LrDecay::kConstant, "train.decay_steps",
            "must be 0 with train.lr_decay = \"constant\", which does not decay");
  v.require(t.weight_decay >= 0, "train.weight_decay", "must be ≥ 0");
  v.require(t.beta1 >= 0 && t.beta1 < 1, "train.beta1", "must lie in [0, 1)");
  v.require(t.beta2 >= 0 && t.beta2 < 1, "train.beta2", "must lie in [0, 1)");
  v.require(t.eps > 0, "train.eps", "must be positive");
  v.require(t.grad_clip >= 0, "train.grad_clip", "must be ≥ 0 (0 disables clipping)");
  v.require(t.val_every >= 0, "train.val_every", "must be ≥ 0 (0: never)");
  v.require(t.val_batches >= 1, "train.val_batches", "must be positive");
  v.require(t.log_every >= 1, "train.log_every", "must be positive");
}

// run.replay_every and what it does not cover yet (issue 43's later parts).
void validate_replay(const Recipe& r) {
  const Validator v(r);
  v.require(r.run.replay_every >= 0, "run.replay_every",
            "must be ≥ 0 (0: off), got " + is(r.run.replay_every));
  if (r.run.replay_every == 0) return;
  // Expert parallelism's all-to-alls mix the tokens of an EP group's dp coordinates: whole EP
  // groups replay whole EP groups (replay.cpp), so a group must lie inside one cp rank's dp
  // coordinates or hold all of them.
  const int64_t ep = r.parallel.ep, dp = r.parallel.dp;
  v.require(ep <= 1 || dp % ep == 0 || ep % dp == 0, "run.replay_every",
            "needs parallel.ep to divide parallel.dp or be a multiple of it (an expert-parallel "
            "group replays another whole), got ep = " +
                is(ep) + ", dp = " + is(dp) + "; set run.replay_every = 0 or change the layout");
}

void validate_data_snapshot_run(const Recipe& r) {
  const Validator v(r);
  v.require(r.data.val_fraction >= 0 && r.data.val_fraction < 1, "data.val_fraction",
            "must lie in [0, 1)");
  v.require(!r.data.path.empty(), "data.path", "must name a file");
  v.require(!r.data.tokenizer.empty(), "data.tokenizer",
            "must be \"bytes\" or a SentencePiece model file");
  v.require(
      !r.data.bos || r.data.tokenizer != kByteTokenizerName, "data.bos",
      "needs a SentencePiece data.tokenizer with a BOS id (<s>); the byte tokenizer has none");

  v.require(r.snapshot.every >= 0, "snapshot.every", "must be ≥ 0 (0: off)");
  v.require(r.snapshot.memory_every >= 0, "snapshot.memory_every",
            "must be ≥ 0 (0: off), got " + is(r.snapshot.memory_every));
  v.require(r.snapshot.keep >= 1, "snapshot.keep", "must keep at least 1");
  v.require(r.snapshot.full_every >= 1, "snapshot.full_every", "must be ≥ 1");
  v.require(r.snapshot.deflate >= 0 && r.snapshot.deflate <= 9, "snapshot.deflate",
            "must be a zlib level 0-9 (0: uncompressed)");

  v.one_of("run.log_level", r.run.log_level, {"trace", "debug", "info", "warn", "error"});
  v.require(r.run.max_restarts >= 0 && r.run.max_restarts <= 1000, "run.max_restarts",
            "must lie in [0, 1000], got " + std::to_string(r.run.max_restarts));
  v.require(r.run.stop_grace_s >= 1 && r.run.stop_grace_s <= 86400, "run.stop_grace_s",
            "must be from 1 to 86400 (seconds), got " + is(r.run.stop_grace_s));
  v.require(r.run.elastic_regrow_s >= 0, "run.elastic_regrow_s",
            "must be ≥ 0 (seconds; 0: stay shrunk), got " + is(r.run.elastic_regrow_s));
  v.require(r.run.restart_window_s > 0, "run.restart_window_s",
            "must be positive (seconds), got " + is(r.run.restart_window_s));
  validate_replay(r);
  v.require(r.hardware.hbm_gib > 0, "hardware.hbm_gib", "must be positive");
  v.require(r.snapshot.incremental_min_unchanged >= 0 && r.snapshot.incremental_min_unchanged <= 1,
            "snapshot.incremental_min_unchanged",
            "must be a share between 0 and 1, got " + is(r.snapshot.incremental_min_unchanged));
  v.require(r.snapshot.staging_gib >= 0 && r.snapshot.staging_gib <= kMaxHbmGib,
            "snapshot.staging_gib",
            "must be between 0 (half the training state) and " + is(kMaxHbmGib) + " GiB, got " +
                is(r.snapshot.staging_gib));
  v.require(r.hardware.threads_per_rank >= 0, "hardware.threads_per_rank", "must be ≥ 0");
}

}  // namespace

void recipe_detail::validate(const Recipe& r) {
  validate_limits(r);
  validate_model(r);
  validate_rope(r);
  validate_parallel(r);
  validate_train(r);
  validate_data_snapshot_run(r);
}

namespace {

// Each rank count at least 1, and what cp and tp split divides by them.
LayoutProblem split_problem(const ModelConfig& m, const ParallelConfig& p) {
  if (p.pp < 1) return {"parallel.pp", "must be ≥ 1, got " + is(p.pp)};
  if (p.tp < 1) return {"parallel.tp", "must be ≥ 1, got " + is(p.tp)};
  if (p.cp < 1) return {"parallel.cp", "must be ≥ 1, got " + is(p.cp)};
  if (p.dp < 1 && p.dp != -1)
    return {"parallel.dp", "must be ≥ 1, or -1 for the rest of the world; got " + is(p.dp)};
  if (p.cp > 1 && m.seq_len % (2 * p.cp) != 0)
    return {"parallel.cp", "model.seq_len = " + is(m.seq_len) +
                               " is not divisible by 2·cp = " + is(2 * p.cp) +
                               "; each cp rank holds two equal parts of every sequence (the "
                               "zig-zag split)"};
  // What tp splits whole, in the order they are checked.
  const struct {
    const char* key;
    int64_t size;
    const char* why;
  } tp_splits[] = {{"model.n_heads", m.n_heads, "; each tp rank must hold whole heads"},
                   {"model.n_kv_heads", m.n_kv_heads, ""},
                   {"model.vocab_size", m.vocab_size, " (vocab-parallel embedding and loss)"},
                   {"model.ffn_dim", m.ffn_dim, ""}};
  for (const auto& split : tp_splits)
    if (split.size % p.tp != 0)
      return {"parallel.tp", std::string(split.key) + " = " + is(split.size) +
                                 " is not divisible by tp = " + is(p.tp) + split.why};
  if (m.moe() && (m.moe_ffn_dim % p.tp != 0 || m.moe_ffn_dim / p.tp * m.dim % 16 != 0))
    return {"parallel.tp", "model.moe_ffn_dim = " + is(m.moe_ffn_dim) +
                               " must split over tp = " + is(p.tp) +
                               " into slices whose matrices (slice·dim) are multiples of 16 "
                               "floats"};
  if (m.moe() && m.shared_ffn_dim() % p.tp != 0)
    return {"parallel.tp", "the shared experts' width n_shared_experts·moe_ffn_dim = " +
                               is(m.shared_ffn_dim()) + " is not divisible by tp = " + is(p.tp)};
  return {};
}

// Expert parallelism: ep against the experts and the dp × cp ranks it is carved from.
LayoutProblem expert_problem(const ModelConfig& m, const ParallelConfig& p) {
  if (p.ep < 1)
    return {"parallel.ep", "must be ≥ 1 (1: every rank holds every expert), got " + is(p.ep)};
  if (p.ep != 1 && !m.moe())
    return {"parallel.ep", "ep = " + is(p.ep) +
                               " spreads experts over ranks, but the model has none "
                               "(model.n_experts = 0); set parallel.ep = 1 or give the model "
                               "experts"};
  if (m.moe() && m.n_experts % p.ep != 0)
    return {"parallel.ep", "model.n_experts = " + is(m.n_experts) + " is not divisible by ep = " +
                               is(p.ep) + "; each EP rank holds n_experts / ep experts"};
  if (p.dp >= 1 && p.dp * p.cp % p.ep != 0) return {"parallel.ep", ep_fold_complaint(p)};
  if (m.moe() && m.router_aux_coef != 0 && p.cp != 1)
    return {"model.router_aux_coef",
            "the sequence-wise auxiliary loss needs whole sequences on a rank: parallel.cp = 1, "
            "or router_aux_coef = 0 (router_bias_rate balances without it)"};
  return {};
}

// The pipeline: virtual stages against the schedule, micro-batches, and the layers per chunk.
LayoutProblem pipeline_problem(const ModelConfig& m, const ParallelConfig& p,
                               const TrainConfig& t) {
  if (p.virtual_stages < 1) return {"parallel.virtual_stages", "must be ≥ 1"};
  // ZB-V folds exactly two chunks per stage into a V: pp = 1 has nothing to fold.
  if (p.schedule == ScheduleKind::kZBV && p.pp < 2)
    return {"parallel.schedule", "zb_v needs parallel.pp ≥ 2 (got " + is(p.pp) +
                                     "): one stage has no pipeline bubble to fill; use 1f1b"};
  if (p.schedule == ScheduleKind::kZBV && p.virtual_stages != 2)
    return {"parallel.virtual_stages",
            "virtual_stages = " + is(p.virtual_stages) +
                " contradicts parallel.schedule = \"zb_v\", which always places 2 chunks per "
                "stage (a V); leave virtual_stages out or set it to 2"};
  // interleaved_1f1b with one chunk per stage is 1F1B with a longer warm-up: it trains.
  if (p.virtual_stages != 1 && p.schedule != ScheduleKind::kInterleaved1F1B &&
      p.schedule != ScheduleKind::kZBV)
    return {"parallel.virtual_stages",
            "virtual_stages > 1 needs parallel.schedule = \"interleaved_1f1b\" (or \"zb_v\", "
            "which uses 2)"};
  if (p.virtual_stages != 1 && p.pp == 1)
    return {"parallel.virtual_stages",
            "virtual stages interleave chunks over pipeline stages; they need parallel.pp > 1"};
  if (t.micro_batches < 1) return {"train.micro_batches", "must be positive"};
  if (p.schedule == ScheduleKind::kInterleaved1F1B && t.micro_batches % p.pp != 0)
    return {"train.micro_batches", "interleaved_1f1b needs micro_batches (" + is(t.micro_batches) +
                                       ") to be a multiple of pp (" + is(p.pp) +
                                       "), as Megatron does"};
  // Chunks need not hold equally many layers: parallel::split_layers balances them (or takes
  // pipeline_split), one layer at least each.
  if (m.n_layers < p.pp * p.virtual_stages)
    return {"parallel.pp", "model.n_layers = " + is(m.n_layers) +
                               " is fewer than pp·virtual_stages = " + is(p.pp * p.virtual_stages) +
                               " pipeline chunks"};
  if (!p.pipeline_split.empty()) {
    if (static_cast<int64_t>(p.pipeline_split.size()) != p.pp * p.virtual_stages - 1)
      return {"parallel.pipeline_split",
              "needs pp·virtual_stages - 1 = " + is(p.pp * p.virtual_stages - 1) +
                  " split points, got " + is(p.pipeline_split.size())};
    int64_t prev = 0;
    for (int64_t s : p.pipeline_split) {
      if (s <= prev || s >= m.n_layers)
        return {"parallel.pipeline_split",
                "split points must increase strictly within (0, n_layers = " + is(m.n_layers) +
                    "); got " + is(s)};
      prev = s;
    }
  }
  return {};
}

}  // namespace

LayoutProblem layout_problem(const ModelConfig& m, const ParallelConfig& p, const TrainConfig& t) {
  // The first check that fails is the answer; later checks divide by what earlier ones found
  // positive.
  if (LayoutProblem problem = split_problem(m, p); !problem.none()) return problem;
  if (LayoutProblem problem = expert_problem(m, p); !problem.none()) return problem;
  if (LayoutProblem problem = pipeline_problem(m, p, t); !problem.none()) return problem;
  if (p.zero < 0 || p.zero > 3) return {"parallel.zero", "must be 0, 1, 2 or 3, got " + is(p.zero)};
  if (p.dp >= 1 && t.global_batch % (p.dp * t.micro_batches) != 0)
    return {"train.global_batch", "global_batch = " + is(t.global_batch) +
                                      " is not divisible by dp·micro_batches = " + is(p.dp) + "·" +
                                      is(t.micro_batches)};
  return {};
}

void Recipe::resolve_world(int64_t world) {
  const int64_t fixed = parallel.pp * parallel.cp * parallel.tp;
  const std::string layout = "pp·cp·tp = " + std::to_string(parallel.pp) + "·" +
                             std::to_string(parallel.cp) + "·" + std::to_string(parallel.tp);
  const bool resolves_dp = parallel.dp == -1;
  if (resolves_dp) {
    T3D_USER_CHECK(world % fixed == 0, "recipe error: ", origin("parallel.dp"),
                   ": `parallel.dp` = -1: the world of ", world, " ranks is not divisible by ",
                   layout, "; launch a multiple of ", fixed, " ranks");
    parallel.dp = world / fixed;
  }
  // What validation skipped while dp was -1, by the same rule.
  const LayoutProblem problem = layout_problem(model, parallel, train);
  if (!problem.none())
    fail(origin(problem.key), problem.key,
         problem.reason + (resolves_dp
                               ? " (dp = -1 resolved from a world of " + std::to_string(world) + ")"
                               : ""));
  T3D_USER_CHECK(world_size() == world, "recipe error: ", origin("parallel.dp"),
                 ": `parallel`: the recipe asks for pp·dp·cp·tp = ", parallel.pp, "·", parallel.dp,
                 "·", parallel.cp, "·", parallel.tp, " = ", world_size(),
                 " ranks but the launcher started ", world,
                 "; launch that many ranks, or set parallel.dp = -1 to use the whole world");
}

}  // namespace t3d::runtime
