// The recipe: a TOML file parsed into typed structs, validated strictly, overridable from the
// command line (`--set parallel.tp=2`). Every key is declared once in recipe_schema.cpp, which
// also drives unknown-key suggestions, docs/recipe.md and writing a recipe back out; its checks
// are in recipe_check.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "parallel/schedule_kind.h"
#include "runtime/data/data_choices.h"

namespace t3d::runtime {

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;  // bytes (hardware.hbm_gib and the like)

// train.precision: fp32, or bf16 (fp32 master weights; bf16 stored activations, traffic and, with
// a bf16 GEMM, GEMM inputs), or auto (resolved at start by measuring:
// runtime/machine/gemm_choice.h).
enum class TrainPrecision { kFp32, kBf16, kAuto };
// hardware.gemm: the linear layers' GEMM library, auto resolved like train.precision.
enum class GemmLibrary { kAuto, kOpenBlas, kOneDnn };
// train.lr_decay: the shape of the learning rate's decay after the warm-up (and the stable phase
// train.decay_steps leaves): runtime/train/training_math.h, docs/training-math.md.
enum class LrDecay { kCosine, kLinear, kSqrt, kConstant };

// run.on_corruption: what a replay's mismatch does (docs/resilience.md#replay).
enum class OnCorruption { kStop, kExclude };

// parallel.device_comm: how a GPU rank's tensor collectives travel, per group (docs/gpu.md):
// NCCL where the group's ranks each have a GPU of their own and NCCL loads (auto), NCCL or a
// refusal at start (nccl), or staged through host memory over MPI always (staged).
enum class DeviceComm { kAuto, kNccl, kStaged };

// train.activation_checkpoint, spelled none | full | every:K.
struct ActivationCheckpoint {
  int64_t every = 0;  // 0 none; 1 full (every block recomputed); K: every K-th block of a stage
  std::string name() const;
  friend bool operator==(const ActivationCheckpoint&, const ActivationCheckpoint&) = default;
};

// Every value of an enumerated recipe key with its spelling: Choices<E>::kAll is the one table
// parsing, writing back, error messages and `titan3d keys` read.
template <typename E>
struct Choices;
template <>
struct Choices<TrainPrecision> {
  static constexpr std::array<std::pair<TrainPrecision, std::string_view>, 3> kAll = {{
      {TrainPrecision::kFp32, "fp32"},
      {TrainPrecision::kBf16, "bf16"},
      {TrainPrecision::kAuto, "auto"},
  }};
};
template <>
struct Choices<LrDecay> {
  static constexpr std::array<std::pair<LrDecay, std::string_view>, 4> kAll = {{
      {LrDecay::kCosine, "cosine"},
      {LrDecay::kLinear, "linear"},
      {LrDecay::kSqrt, "sqrt"},
      {LrDecay::kConstant, "constant"},
  }};
};
template <>
struct Choices<GemmLibrary> {
  static constexpr std::array<std::pair<GemmLibrary, std::string_view>, 3> kAll = {{
      {GemmLibrary::kAuto, "auto"},
      {GemmLibrary::kOpenBlas, "openblas"},
      {GemmLibrary::kOneDnn, "onednn"},
  }};
};
// hardware.device: where a rank computes (kernels/device.h).
template <>
struct Choices<kernels::DeviceChoice> {
  static constexpr std::array<std::pair<kernels::DeviceChoice, std::string_view>, 3> kAll = {{
      {kernels::DeviceChoice::kCpu, "cpu"},
      {kernels::DeviceChoice::kCuda, "cuda"},
      {kernels::DeviceChoice::kAuto, "auto"},
  }};
};
template <>
struct Choices<DeviceComm> {
  static constexpr std::array<std::pair<DeviceComm, std::string_view>, 3> kAll = {{
      {DeviceComm::kAuto, "auto"},
      {DeviceComm::kNccl, "nccl"},
      {DeviceComm::kStaged, "staged"},
  }};
};
template <>
struct Choices<OnCorruption> {
  static constexpr std::array<std::pair<OnCorruption, std::string_view>, 2> kAll = {{
      {OnCorruption::kStop, "stop"},
      {OnCorruption::kExclude, "exclude"},
  }};
};
template <>
struct Choices<parallel::ScheduleKind> {
  static constexpr const auto& kAll = parallel::kScheduleKindNames;
};
template <>
struct Choices<kernels::RouterScore> {
  static constexpr std::array<std::pair<kernels::RouterScore, std::string_view>, 2> kAll = {{
      {kernels::RouterScore::kSoftmax, "softmax"},
      {kernels::RouterScore::kSigmoid, "sigmoid"},
  }};
};
template <>
struct Choices<kernels::RopeScaling::Kind> {
  static constexpr std::array<std::pair<kernels::RopeScaling::Kind, std::string_view>, 3> kAll = {{
      {kernels::RopeScaling::Kind::kNone, "none"},
      {kernels::RopeScaling::Kind::kLinear, "linear"},
      {kernels::RopeScaling::Kind::kLlama3, "llama3"},
  }};
};
template <>
struct Choices<DataFormat> {
  static constexpr const auto& kAll = kDataFormatNames;
};
template <>
struct Choices<SampleMode> {
  static constexpr const auto& kAll = kSampleModeNames;
};

template <typename E>
constexpr std::string_view choice_name(E value) {
  for (const auto& [v, name] : Choices<E>::kAll)
    if (v == value) return name;
  return "?";
}
template <typename E>
constexpr std::optional<E> parse_choice(std::string_view text) {
  for (const auto& [v, name] : Choices<E>::kAll)
    if (name == text) return v;
  return std::nullopt;
}
// "a, b, c": the spellings, for messages.
template <typename E>
std::string choice_list() {
  std::string out;
  for (const auto& [v, name] : Choices<E>::kAll)
    out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

struct RunConfig {
  std::string name = "titan3d";
  std::string dir;  // empty: runs/<name>
  std::string log_level = "info";
  bool trace = false;
  // Self-launched jobs: relaunches from the newest snapshot after a rank died or hung, at most
  // this many within restart_window_s (runtime/supervise/supervisor.h).
  int64_t max_restarts = 3;
  double restart_window_s = 3600;
  // Self-launched jobs on several hosts: an Open MPI hostfile ("host slots=N" lines); empty:
  // this host only.
  std::string hostfile;
  // When a restart finds a host of the hostfile unreachable, continue on the others with a
  // smaller dp and the same global batch (more micro-batches per replica) instead of stopping.
  bool elastic = false;
  // After such a shrink: seconds between probes of the dropped hosts; once all answer, the job
  // stops at a snapshot and continues on every host in the layout it had. 0: stay shrunk.
  double elastic_regrow_s = 60;
  // Self-launched jobs: seconds Open MPI gives the ranks to finish a stop (their step and its
  // snapshot) after it forwards them SIGTERM, before it SIGKILLs them; mpirun waits as long
  // after a rank fails, so a restart waits for it.
  double stop_grace_s = 1;
  // Silent data corruption: every replay_every steps the data-parallel replicas compare parameter
  // hashes and each replays a peer's step, comparing gradient hashes (runtime/train/replay.h).
  // 0: off.
  int64_t replay_every = 0;
  OnCorruption on_corruption = OnCorruption::kStop;
};

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t dim = 256;
  int64_t n_layers = 4;
  int64_t n_heads = 8;
  int64_t n_kv_heads = 0;  // 0: same as n_heads
  // model.head_dim: each head's width when it is not dim / n_heads (Qwen3, Llama 3.2's config
  // key); 0: dim / n_heads. Read through head_dim().
  int64_t explicit_head_dim = 0;
  int64_t ffn_dim = 0;  // 0: LLaMA's rule, 8/3·dim rounded up to a multiple of 64
  int64_t seq_len = 128;
  double rope_theta = 10000.0;
  // RoPE scaling (transformers' rope_scaling; kernels/ops.h has the frequencies): none, linear
  // (rope_factor) or llama3 (rope_factor, the two frequency factors and the pretraining context
  // rope_original_seq_len). A key the chosen kind does not read keeps its default (checked).
  kernels::RopeScaling::Kind rope_scaling = kernels::RopeScaling::Kind::kNone;
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_seq_len = 8192;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;
  // Biases on the q, k and v projections (Qwen2, Qwen2.5), added before RoPE.
  bool qkv_bias = false;
  // Per-head RMSNorm of q and k (Qwen3, Qwen3-MoE): each head's head_dim values normalised with
  // norm_eps and scaled by q_norm / k_norm (head_dim weights shared by the heads), after the
  // projections and their biases, before RoPE.
  bool qk_norm = false;
  // Mixture of experts (docs/moe.md): blocks from dense_layers on replace the SwiGLU MLP by
  // n_experts routed SwiGLU experts of width moe_ffn_dim, experts_per_token of them per token,
  // plus n_shared_experts on every token (one SwiGLU of n_shared_experts·moe_ffn_dim).
  int64_t n_experts = 0;  // 0: dense (every block a SwiGLU MLP)
  int64_t experts_per_token = 2;
  int64_t n_shared_experts = 0;
  // Qwen2-MoE's sigmoid gate on the shared experts' output: y = routed + sigmoid(u · w) · Shared(u)
  // with w (dim) per MoE block (docs/moe.md); needs n_shared_experts > 0.
  bool shared_expert_gate = false;
  int64_t moe_ffn_dim = 0;   // 0: ffn_dim
  int64_t dense_layers = 0;  // leading blocks that keep the dense MLP
  kernels::RouterScore router_score = kernels::RouterScore::kSoftmax;
  bool router_norm_topk = true;  // gates divided by their sum over the chosen experts
  double router_scale = 1.0;     // gates multiplied by this
  double router_bias_rate = 0;   // aux-loss-free balancing: bias step per optimizer step; 0: off
  double router_aux_coef = 0;    // sequence-wise auxiliary balance loss coefficient; 0: off
  double capacity_factor = 0;    // 0: dropless

  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : dim / n_heads; }
  int64_t attention_width() const { return n_heads * head_dim(); }  // q_proj's rows, o_proj's cols
  // The RoPE table's scaling, as the kernels take it.
  kernels::RopeScaling rope() const {
    return {rope_scaling, rope_factor, rope_low_freq_factor, rope_high_freq_factor,
            static_cast<double>(rope_original_seq_len)};
  }
  bool moe() const { return n_experts > 0; }
  // Block `layer` is a mixture of experts (else a dense SwiGLU MLP).
  bool moe_block(int64_t layer) const { return moe() && layer >= dense_layers; }
  bool dense_blocks() const { return !moe() || dense_layers > 0; }
  int64_t shared_ffn_dim() const { return n_shared_experts * moe_ffn_dim; }
};

struct ParallelConfig {
  int64_t pp = 1;
  int64_t dp = 1;  // -1: the rest of the world
  int64_t cp = 1;
  int64_t tp = 1;
  int64_t ep = 1;  // expert parallelism, folded into dp × cp (docs/parallelism.md)
  bool sequence_parallel = false;
  parallel::ScheduleKind schedule = parallel::ScheduleKind::k1F1B;
  int64_t virtual_stages = 1;
  std::vector<int64_t> pipeline_split;  // explicit first layer of stages 1..pp-1; empty: balanced
  int64_t zero = 0;                     // ZeRO stage 0..3
  double bucket_mb = 4.0;               // data-parallel gradient bucket size
  double timeout_s = 300.0;             // hang watchdog for every collective
  DeviceComm device_comm = DeviceComm::kAuto;  // a GPU rank's tensor collectives
};

struct TrainConfig {
  int64_t steps = 100;
  int64_t global_batch = 8;   // sequences per optimizer step, over all dp ranks
  int64_t micro_batches = 1;  // per dp rank and step
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 10;
  LrDecay lr_decay = LrDecay::kCosine;
  int64_t decay_steps = 0;  // 0: every step after the warm-up decays; K: only the last K
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // 0: off
  int64_t seed = 1234;
  TrainPrecision precision = TrainPrecision::kFp32;
  ActivationCheckpoint activation_checkpoint;
  bool dynamic_loss_scale = false;
  int64_t val_every = 50;  // 0: never
  int64_t val_batches = 4;
  int64_t log_every = 1;
};

struct DataConfig {
  std::string path = "data/fortunes.txt";
  DataFormat format = DataFormat::kAuto;
  std::string val_path;  // empty: hold out val_fraction of path
  double val_fraction = 0.05;
  SampleMode sampler = SampleMode::kRandom;
  std::string tokenizer = "bytes";  // bytes | a SentencePiece model file (data/text_tokenizer.h)
  bool bos = false;  // each text file (and generate's prompt) starts with the tokenizer's BOS id
};

struct SnapshotConfig {
  int64_t every = 0;  // steps; 0: off
  // The memory tier (docs/resilience.md): a snapshot into /dev/shm and a buddy host's every N
  // steps, which a restart after a failure prefers when it is newer than the disk's; 0: off.
  int64_t memory_every = 0;
  std::string dir;  // empty: <run.dir>/snapshots
  int64_t keep = 3;
  int64_t full_every = 4;
  // An incremental snapshot is taken only when at least this share of all chunks did not change
  // since the snapshot before it (measured each time); 0: whenever full_every allows.
  double incremental_min_unchanged = 0.5;
  int64_t deflate = 0;  // zlib level after HDF5 shuffle; 0: uncompressed (docs/snapshot-format.md)
  bool async = true;
  std::string resume;  // empty | latest | path
  // Host staging cap per rank, GiB; 0: half of the rank's training state (params, grads and
  // optimizer state), less where a host's ranks would need over 3/4 of the memory training
  // leaves. A snapshot larger than the cap is staged and written in waves.
  double staging_gib = 0;
};

struct HardwareConfig {
  double hbm_gib = 4.0;                    // arena budget per rank
  int64_t threads_per_rank = 0;            // 0: cores / ranks on this host, at least 1
  std::string openblas_coretype = "auto";  // auto: detect; otherwise passed to OpenBLAS as is
  GemmLibrary gemm = GemmLibrary::kAuto;
  kernels::DeviceChoice device = kernels::DeviceChoice::kCpu;
  std::string cluster;  // the cluster file `plan` plans for without --cluster; empty: this machine
};

struct Recipe {
  RunConfig run;
  ModelConfig model;
  ParallelConfig parallel;
  TrainConfig train;
  DataConfig data;
  SnapshotConfig snapshot;
  HardwareConfig hardware;

  std::string source;  // file the recipe came from ("<string>" for text)
  // "file:line" (or "--set k=v") each key was read from, for errors raised after parsing.
  std::map<std::string, std::string> key_origins;
  std::string origin(const std::string& key) const;
  // Ranks the recipe asks for; dp = -1 counts as 1 until resolve_world() fills it in.
  int64_t world_size() const;
  // Sequences in one micro-batch of one dp rank (rows_per_micro; dp = -1 counts as 1 until
  // resolve_world() fills it in). UserError naming train.global_batch unless it divides.
  int64_t micro_batch_rows() const;
  // Fills dp = -1 from the world size, then checks layout_problem and pp·dp·cp·tp == world
  // (UserError otherwise).
  void resolve_world(int64_t world);
  // Effective recipe as TOML text (overrides applied): snapshots and `plan` write it. Every key,
  // but values derived from other keys (run.dir, snapshot.dir, parallel.virtual_stages) are
  // written as left out when they equal what is derived.
  std::string to_toml() const;
};

// Why titan3d cannot train a layout: the recipe key to change and what is wrong with it.
struct LayoutProblem {
  std::string key;  // "" when there is no problem
  std::string reason;
  bool none() const { return key.empty(); }
};

// The one rule of which layouts train (docs/recipe.md, "Layouts"): pp, dp, cp, tp, ep,
// schedule, virtual_stages, pipeline_split, zero and train.micro_batches against the model and
// train.global_batch. Recipe validation and the planner (runtime/cost) both ask it; the planner
// adds only what its cluster decides. dp = -1 skips what needs dp (resolve_world asks again).
// Expects the model's own keys valid (validate_model) and every count within the "Limits".
LayoutProblem layout_problem(const ModelConfig& model, const ParallelConfig& parallel,
                             const TrainConfig& train);

// One `--set a.b=value` override; value is a TOML literal, or a bare string.
struct Override {
  std::string key;
  std::string value;
};
Override parse_override(const std::string& text);  // UserError on "a.b" without '='

// `s` as a TOML basic string literal that parses back to exactly `s`: quotes, backslashes and
// every control character escaped. Use it to splice any text (a path, a name) into TOML.
std::string toml_string(const std::string& s);

// Parse, apply overrides, validate. UserError naming the file, line and key on any problem.
Recipe load_recipe(const std::string& path, const std::vector<Override>& overrides = {});
Recipe parse_recipe(const std::string& toml_text, const std::string& source_name,
                    const std::vector<Override>& overrides = {});

// Every key the schema knows, "section.key", with type, default and meaning (for docs and tests).
struct KeyDoc {
  std::string key, type, default_value, meaning;
};
std::vector<KeyDoc> recipe_key_docs();
// The Markdown table of every key (`titan3d keys`), which docs/recipe.md carries verbatim.
std::string recipe_keys_table();

// Levenshtein distance (for "did you mean" suggestions, here and in the cluster file).
size_t edit_distance(const std::string& a, const std::string& b);

// Levenshtein-closest known key, or "" when nothing is reasonably close.
std::string closest_key(const std::string& unknown);

}  // namespace t3d::runtime
