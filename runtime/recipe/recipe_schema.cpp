// The schema: every recipe key declared once (section, name, type, default through Recipe's own
// initialisers, meaning) and its TOML codec, which drive parsing, `--set`, did-you-mean, writing a
// recipe back and `titan3d keys` (recipe.cpp). A key's checks are in recipe_check.cpp.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <type_traits>

#include "runtime/recipe/recipe_detail.h"

namespace t3d::runtime {
namespace recipe_detail {

std::string where(const toml::value& v) {
  const auto loc = v.location();
  std::ostringstream os;
  os << loc.file_name();
  if (loc.line() > 0 && loc.file_name().rfind("--set", 0) != 0) os << ":" << loc.line();
  return os.str();
}

void fail(const std::string& origin, const std::string& key, const std::string& msg) {
  throw UserError("recipe error: " + origin + ": `" + key + "`: " + msg);
}

}  // namespace recipe_detail

namespace {

using recipe_detail::fail;
using recipe_detail::Field;
using recipe_detail::kMaxLayers;
using recipe_detail::where;

// toml11 clamps a decimal or hex literal beyond 64 bits to INT64_MAX / INT64_MIN without a word
// (istringstream's overflow contract). A value at either limit is therefore re-read from its own
// token: a literal that does not fit is refused, never clamped.
// The literal a value was parsed from, as written ("" if toml11 does not know it).
std::string token_of(const toml::value& v) {
  const auto loc = v.location();
  if (loc.column() < 1 || loc.column() - 1 >= loc.line_str().size()) return "";
  return loc.line_str().substr(loc.column() - 1, loc.region());
}

void refuse_clamped_integer(const toml::value& v, const std::string& key) {
  const int64_t x = v.as_integer();
  if (x != INT64_MAX && x != INT64_MIN) return;
  std::string token = token_of(v);
  token.erase(std::remove(token.begin(), token.end(), '_'), token.end());
  bool fits = false;
  if (!token.empty()) {
    std::string digits = token;
    int base = 10;
    bool negative = false;
    if (digits[0] == '+' || digits[0] == '-') negative = digits[0] == '-', digits.erase(0, 1);
    if (digits.size() > 2 && digits[0] == '0' &&
        std::string("xob").find(digits[1]) != std::string::npos)
      base = digits[1] == 'x' ? 16 : digits[1] == 'o' ? 8 : 2, digits.erase(0, 2);
    errno = 0;
    char* end = nullptr;
    const std::string text = (negative ? "-" : "") + digits;
    const long long parsed = std::strtoll(text.c_str(), &end, base);
    fits = errno == 0 && end && *end == '\0' && parsed == x;
  }
  if (!fits)
    fail(where(v), key,
         "integer " + (token.empty() ? std::to_string(x) : token) +
             " does not fit in 64 bits (at most 9223372036854775807); use a smaller value");
}

template <typename T>
struct TomlType;
template <>
struct TomlType<int64_t> {
  static constexpr const char* name = "integer";
  static int64_t get(const toml::value& v, bool& ok, const std::string& key) {
    ok = v.is_integer();
    if (ok) refuse_clamped_integer(v, key);
    return ok ? v.as_integer() : 0;
  }
  static std::string put(int64_t x) { return std::to_string(x); }
};
template <>
struct TomlType<double> {
  static constexpr const char* name = "float";
  static double get(const toml::value& v, bool& ok, const std::string& key) {
    ok = v.is_floating() || v.is_integer();  // `lr = 1` is a fine float
    if (v.is_integer()) refuse_clamped_integer(v, key);
    // No key means infinity or NaN (TOML spells them inf and nan; 1e999 overflows to inf).
    // toml11 clamps a literal beyond the double range (1e999) to ±DBL_MAX: refused as well.
    if (v.is_floating() && !(std::abs(v.as_floating()) < std::numeric_limits<double>::max()))
      fail(where(v), key, "must be a finite number, got " + token_of(v));
    return v.is_floating() ? v.as_floating() : ok ? static_cast<double>(v.as_integer()) : 0.0;
  }
  static std::string put(double x) {
    std::ostringstream os;
    os.precision(17);
    os << x;
    std::string s = os.str();
    if (s.find_first_of(".eE") == std::string::npos && s.find("inf") == std::string::npos &&
        s.find("nan") == std::string::npos)
      s += ".0";
    return s;
  }
};
template <>
struct TomlType<bool> {
  static constexpr const char* name = "boolean";
  static bool get(const toml::value& v, bool& ok, const std::string&) {
    ok = v.is_boolean();
    return ok && v.as_boolean();
  }
  static std::string put(bool x) { return x ? "true" : "false"; }
};
template <>
struct TomlType<std::string> {
  static constexpr const char* name = "string";
  static std::string get(const toml::value& v, bool& ok, const std::string&) {
    ok = v.is_string();
    return ok ? v.as_string().str : std::string();
  }
  static std::string put(const std::string& x) { return toml_string(x); }
};
// An enumerated key: a TOML string among Choices<E>::kAll, refused with the list otherwise.
template <typename E>
requires std::is_enum_v<E>
struct TomlType<E> {
  static constexpr const char* name = "string";
  static E get(const toml::value& v, bool& ok, const std::string& key) {
    ok = v.is_string();
    if (!ok) return E{};
    const std::string text = v.as_string().str;
    const auto value = parse_choice<E>(text);
    if (!value) fail(where(v), key, "\"" + text + "\" is not one of: " + choice_list<E>());
    return *value;
  }
  static std::string put(E x) { return toml_string(std::string(choice_name(x))); }
};

template <>
struct TomlType<ActivationCheckpoint> {
  static constexpr const char* name = "string";
  static ActivationCheckpoint get(const toml::value& v, bool& ok, const std::string& key) {
    ok = v.is_string();
    if (!ok) return {};
    const std::string text = v.as_string().str;
    if (text == "none") return {0};
    if (text == "full") return {1};
    if (text.rfind("every:", 0) == 0) {
      // At most 5 digits before converting: K ≤ kMaxLayers, and stoll never sees an overflow.
      const std::string k = text.substr(6);
      if (!k.empty() && k.size() <= 5 && std::all_of(k.begin(), k.end(), ::isdigit) &&
          std::stoll(k) >= 1 && std::stoll(k) <= kMaxLayers)
        return {std::stoll(k)};
    }
    fail(where(v), key,
         "\"" + text + "\" is not one of: none, full, every:K (1 ≤ K ≤ " +
             std::to_string(kMaxLayers) + ")");
  }
  static std::string put(const ActivationCheckpoint& x) { return toml_string(x.name()); }
};
template <>
struct TomlType<std::vector<int64_t>> {
  static constexpr const char* name = "array of integers";
  static std::vector<int64_t> get(const toml::value& v, bool& ok, const std::string& key) {
    std::vector<int64_t> out;
    ok = v.is_array();
    if (!ok) return out;
    for (const auto& e : v.as_array()) {
      if (!e.is_integer()) {
        ok = false;
        return {};
      }
      refuse_clamped_integer(e, key);
      out.push_back(e.as_integer());
    }
    return out;
  }
  static std::string put(const std::vector<int64_t>& x) {
    std::string s = "[";
    for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
    return s + "]";
  }
};

template <typename S, typename T>
Field field(const char* section, const char* key, S Recipe::*sect, T S::*member,
            const char* meaning) {
  Field f;
  f.section = section;
  f.key = key;
  f.type = TomlType<T>::name;
  f.meaning = meaning;
  const std::string full = std::string(section) + "." + key;
  f.read = [=](Recipe& r, const toml::value& v) {
    bool ok = false;
    T x = TomlType<T>::get(v, ok, full);
    if (!ok)
      fail(where(v), full,
           std::string("expected ") + TomlType<T>::name + ", got " + toml::format(v) + "\n    " +
               v.location().line_str());
    (r.*sect).*member = std::move(x);
  };
  f.write = [=](const Recipe& r) { return TomlType<T>::put((r.*sect).*member); };
  return f;
}

std::vector<Field> run_keys() {
  using R = Recipe;
  return {
      field("run", "name", &R::run, &RunConfig::name, "Run name; names the default run directory."),
      field("run", "dir", &R::run, &RunConfig::dir,
            "Run directory for logs, metrics, traces and snapshots. Empty: `runs/<run.name>`."),
      field("run", "log_level", &R::run, &RunConfig::log_level,
            "trace | debug | info | warn | error. `--log-level` overrides it."),
      field("run", "trace", &R::run, &RunConfig::trace,
            "Write a Chrome trace-event JSON per rank into the run directory."),
      field("run", "max_restarts", &R::run, &RunConfig::max_restarts,
            "Self-launched jobs: when a rank dies or hangs, relaunch from the newest complete "
            "snapshot (snapshot.resume = latest) at most this many times within "
            "run.restart_window_s; a step that fails twice the same way stops it. 0: never. "
            "`--max-restarts` overrides it."),
      field("run", "restart_window_s", &R::run, &RunConfig::restart_window_s,
            "The window run.max_restarts counts restarts in, seconds."),
      field("run", "hostfile", &R::run, &RunConfig::hostfile,
            "Self-launched jobs on several hosts: an Open MPI hostfile (`host slots=N` per line; "
            "ranks fill each host's slots in order), passed to mpirun, which reaches the hosts "
            "through its launch agent (ssh, or plm_rsh_agent). Empty: this host only."),
      field("run", "elastic", &R::run, &RunConfig::elastic,
            "Self-launched jobs with run.hostfile: when a restart finds a host unreachable, "
            "continue on the remaining hosts with a smaller dp (a divisor of parallel.dp that "
            "fits their slots) and the same train.global_batch, each replica taking more "
            "micro-batches, resharded from the newest snapshot; a mixture of experts folds "
            "parallel.ep into the smaller dp and takes the largest dp whose experts per rank fit "
            "hardware.hbm_gib (docs/moe.md). false: stop, naming the host."),
      field("run", "elastic_regrow_s", &R::run, &RunConfig::elastic_regrow_s,
            "After an elastic shrink: probe the dropped hosts this often (seconds); once all "
            "answer, the job stops at a snapshot of its step and continues on every host in its "
            "layout before the shrink (needs snapshot.every > 0). 0: stay shrunk."),
      field("run", "stop_grace_s", &R::run, &RunConfig::stop_grace_s,
            "Self-launched jobs: when mpirun itself gets SIGTERM (systemd's stop, a scheduler "
            "signalling every process of the job), the seconds it gives the ranks to finish their "
            "step and snapshot it before it SIGKILLs them (Open MPI's odls_base_sigkill_timeout). "
            "mpirun sleeps this long, twice, whenever it ends a job's ranks, also after a rank "
            "died: a restart then takes 2× longer to begin. Raise it when a step and its snapshot "
            "take longer than 1 s and such a SIGTERM may come; a SIGTERM to titan3d itself needs "
            "no grace."),
      field("run", "replay_every", &R::run, &RunConfig::replay_every,
            "Silent data corruption: every this many steps the data-parallel replicas compare a "
            "hash of their parameters, and each replica recomputes a peer's step (dp = 1: its "
            "own) and compares the gradient hashes before the reduction; a mismatch names the "
            "step, rank and host (docs/resilience.md, Replay). Costs one forward and backward "
            "more per check; under ZeRO 1-3 peers also recompute each owner's optimizer update "
            "at a check, and (as without replicas) a rank's parameters are hashed after every "
            "update and before the next. With parallel.ep > 1, ep must divide dp or be a "
            "multiple of it. 0: off."),
      field("run", "on_corruption", &R::run, &RunConfig::on_corruption,
            "stop | exclude: what a replay's mismatch (run.replay_every) does. stop: name the "
            "rank and host, keep the snapshots before it and exit 6. exclude: a self-launched "
            "job on several hosts (run.hostfile) continues without that host through the "
            "elastic shrink, from the last verified snapshot; under SLURM, "
            "scripts/slurm/train.sbatch submits the job again excluding that node; otherwise "
            "(one host, candidates on several hosts) as stop."),
  };
}

std::vector<Field> model_keys() {
  using R = Recipe;
  return {
      field("model", "vocab_size", &R::model, &ModelConfig::vocab_size,
            "Vocabulary size (256 for the byte-level tokenizer)."),
      field("model", "dim", &R::model, &ModelConfig::dim, "Hidden size."),
      field("model", "n_layers", &R::model, &ModelConfig::n_layers, "Transformer blocks."),
      field("model", "n_heads", &R::model, &ModelConfig::n_heads, "Attention (query) heads."),
      field("model", "n_kv_heads", &R::model, &ModelConfig::n_kv_heads,
            "Key/value heads for grouped-query attention; 0 means n_heads."),
      field("model", "head_dim", &R::model, &ModelConfig::explicit_head_dim,
            "Width of every attention head (even, for RoPE); 0 means dim / n_heads. Another "
            "value makes the attention n_heads·head_dim wide, independent of dim (Qwen3)."),
      field("model", "ffn_dim", &R::model, &ModelConfig::ffn_dim,
            "SwiGLU hidden size; 0 means LLaMA's rule: 8/3·dim rounded up to a multiple of 64."),
      field("model", "seq_len", &R::model, &ModelConfig::seq_len, "Tokens per sequence."),
      field("model", "rope_theta", &R::model, &ModelConfig::rope_theta, "RoPE base frequency."),
      field("model", "rope_scaling", &R::model, &ModelConfig::rope_scaling,
            "RoPE frequency scaling (transformers' rope_scaling, docs/training-math.md): none; "
            "linear (every frequency divided by rope_factor); llama3 (Llama 3.1+: wavelengths "
            "longer than rope_original_seq_len / rope_low_freq_factor divided by rope_factor, "
            "shorter than rope_original_seq_len / rope_high_freq_factor kept, smoothly between)."),
      field("model", "rope_factor", &R::model, &ModelConfig::rope_factor,
            "RoPE scaling factor (linear, llama3); 1 with rope_scaling = none."),
      field("model", "rope_low_freq_factor", &R::model, &ModelConfig::rope_low_freq_factor,
            "llama3 RoPE scaling: low_freq_factor (0 < it < rope_high_freq_factor)."),
      field("model", "rope_high_freq_factor", &R::model, &ModelConfig::rope_high_freq_factor,
            "llama3 RoPE scaling: high_freq_factor."),
      field("model", "rope_original_seq_len", &R::model, &ModelConfig::rope_original_seq_len,
            "llama3 RoPE scaling: the context the model was pretrained with "
            "(original_max_position_embeddings)."),
      field("model", "norm_eps", &R::model, &ModelConfig::norm_eps, "RMSNorm epsilon."),
      field("model", "tie_embeddings", &R::model, &ModelConfig::tie_embeddings,
            "Share the token embedding with the LM head."),
      field("model", "qkv_bias", &R::model, &ModelConfig::qkv_bias,
            "Biases on the q, k and v projections (Qwen2, Qwen2.5), added before RoPE; zero at "
            "initialisation and without weight decay."),
      field("model", "qk_norm", &R::model, &ModelConfig::qk_norm,
            "Per-head RMSNorm of q and k before RoPE (Qwen3, Qwen3-MoE): weights of head_dim "
            "shared by the heads, ones at initialisation and without weight decay."),
      field("model", "n_experts", &R::model, &ModelConfig::n_experts,
            "Mixture of experts (docs/moe.md): routed experts per MoE block; 0: a dense model."),
      field("model", "experts_per_token", &R::model, &ModelConfig::experts_per_token,
            "Routed experts each token goes to (top-k)."),
      field("model", "n_shared_experts", &R::model, &ModelConfig::n_shared_experts,
            "Shared experts: a SwiGLU of n_shared_experts·moe_ffn_dim on every token, added to "
            "the routed output."),
      field("model", "shared_expert_gate", &R::model, &ModelConfig::shared_expert_gate,
            "Qwen2-MoE's sigmoid gate on the shared experts: their output times sigmoid(u·w) "
            "per token, w (dim) per MoE block; needs n_shared_experts > 0 (docs/moe.md)."),
      field("model", "moe_ffn_dim", &R::model, &ModelConfig::moe_ffn_dim,
            "One expert's SwiGLU hidden size; 0 means model.ffn_dim."),
      field("model", "dense_layers", &R::model, &ModelConfig::dense_layers,
            "Leading blocks that keep the dense SwiGLU MLP (DeepSeek's first_k_dense_replace)."),
      field("model", "router_score", &R::model, &ModelConfig::router_score,
            "The router's score function: softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3)."),
      field("model", "router_norm_topk", &R::model, &ModelConfig::router_norm_topk,
            "Divide the chosen experts' gates by their sum."),
      field("model", "router_scale", &R::model, &ModelConfig::router_scale,
            "Multiply the gates by this (DeepSeek-V3's routed_scaling_factor)."),
      field("model", "router_bias_rate", &R::model, &ModelConfig::router_bias_rate,
            "Auxiliary-loss-free balancing: after each optimizer step every expert's selection "
            "bias moves by this toward balance, bias += rate·sign(mean − count); 0: off."),
      field("model", "router_aux_coef", &R::model, &ModelConfig::router_aux_coef,
            "Coefficient of the sequence-wise auxiliary balance loss (E·Σ f·P per sequence, "
            "averaged over the batch's sequences, summed over MoE blocks); 0: off."),
      field("model", "capacity_factor", &R::model, &ModelConfig::capacity_factor,
            "Token slots an expert takes per micro-batch of a rank, as a multiple of an even "
            "share: ceil(capacity_factor·N·K / E); later slots drop (docs/moe.md); 0: dropless."),
  };
}

std::vector<Field> parallel_keys() {
  using R = Recipe;
  return {
      field("parallel", "pp", &R::parallel, &ParallelConfig::pp, "Pipeline-parallel stages."),
      field("parallel", "dp", &R::parallel, &ParallelConfig::dp,
            "Data-parallel replicas; -1 means the rest of the world (world / (pp·cp·tp))."),
      field("parallel", "cp", &R::parallel, &ParallelConfig::cp,
            "Context-parallel ranks: each holds seq_len / cp positions of every sequence (two "
            "parts)."),
      field("parallel", "tp", &R::parallel, &ParallelConfig::tp,
            "Tensor-parallel ranks (innermost: contiguous ranks, keep inside a node)."),
      field("parallel", "ep", &R::parallel, &ParallelConfig::ep,
            "Expert-parallel ranks (mixture of experts): each holds n_experts / ep of the "
            "experts, and tokens travel to theirs by all-to-all. Carved out of the dp × cp ranks "
            "(ep divides dp·cp); expert gradients are summed over the dp·cp / ep ranks holding "
            "the same experts. See docs/parallelism.md."),
      field("parallel", "sequence_parallel", &R::parallel, &ParallelConfig::sequence_parallel,
            "Megatron sequence parallelism inside the tp group."),
      field("parallel", "schedule", &R::parallel, &ParallelConfig::schedule,
            "Pipeline schedule: gpipe | 1f1b | interleaved_1f1b | zb_h1 | zb_v."),
      field("parallel", "virtual_stages", &R::parallel, &ParallelConfig::virtual_stages,
            "Model chunks per pipeline stage (interleaved_1f1b needs > 1; zb_v always uses 2, "
            "left out means 2)."),
      field("parallel", "pipeline_split", &R::parallel, &ParallelConfig::pipeline_split,
            "First layer of stages 1..pp-1, strictly increasing; empty: balanced."),
      field("parallel", "zero", &R::parallel, &ParallelConfig::zero,
            "ZeRO stage: 0 none, 1 optimizer state sharded over dp × cp, 2 gradients sharded too "
            "(each rank keeps 1/(dp·cp) of them plus two staging buffers of the largest bucket), "
            "3 parameters sharded too (plus two gather buffers; each bucket is gathered before "
            "use, blocking). See docs/parallelism.md."),
      field(
          "parallel", "bucket_mb", &R::parallel, &ParallelConfig::bucket_mb,
          "Data-parallel gradient bucket size in MiB (a bucket is at least one layer): a bucket's "
          "reduction (over dp × cp) starts as soon as its layers' gradients are final, "
          "overlapping the rest of the backward. With ZeRO-2 and 3 it also sizes the staging "
          "(and gather) buffers: keep it well below the stage's gradients / dp."),
      field("parallel", "timeout_s", &R::parallel, &ParallelConfig::timeout_s,
            "A collective or P2P waiting longer than this aborts the job, naming the operation."),
      field("parallel", "device_comm", &R::parallel, &ParallelConfig::device_comm,
            "GPU ranks' tensor collectives, per group: auto (NCCL where every rank of the group "
            "has a GPU of its own and NCCL loads, else staged) | nccl (refused at start where it "
            "cannot be) | staged (device -> host -> MPI -> device). The log names each group's "
            "path; docs/gpu.md."),
  };
}

std::vector<Field> train_keys() {
  using R = Recipe;
  return {
      field("train", "steps", &R::train, &TrainConfig::steps, "Optimizer steps."),
      field("train", "global_batch", &R::train, &TrainConfig::global_batch,
            "Sequences per optimizer step over all dp ranks; divisible by dp·micro_batches."),
      field("train", "micro_batches", &R::train, &TrainConfig::micro_batches,
            "Micro-batches per dp rank and step (gradient accumulation / pipeline depth)."),
      field("train", "lr", &R::train, &TrainConfig::lr, "Peak learning rate."),
      field("train", "min_lr", &R::train, &TrainConfig::min_lr,
            "Where the decay heads: the lr step train.steps would have, so the last step's lr "
            "is still above it (docs/training-math.md)."),
      field("train", "warmup_steps", &R::train, &TrainConfig::warmup_steps,
            "Linear warm-up steps before the decay: 0-based step s < warmup_steps has "
            "lr·(s + 1)/warmup_steps."),
      field("train", "lr_decay", &R::train, &TrainConfig::lr_decay,
            "cosine | linear | sqrt | constant: how the lr falls from train.lr to train.min_lr "
            "over the decay steps (docs/training-math.md); constant: it stays at train.lr after "
            "the warm-up."),
      field("train", "decay_steps", &R::train, &TrainConfig::decay_steps,
            "Steps the decay takes, the last of train.steps: before them the lr stays at train.lr "
            "after the warm-up (warmup-stable-decay); 0: every step after the warm-up."),
      field("train", "weight_decay", &R::train, &TrainConfig::weight_decay,
            "AdamW decoupled weight decay, scaled by the lr (p·(1 − lr·wd)); every tensor but the "
            "RMSNorm weights (embedding and LM head included)."),
      field("train", "beta1", &R::train, &TrainConfig::beta1, "AdamW beta1."),
      field("train", "beta2", &R::train, &TrainConfig::beta2, "AdamW beta2."),
      field("train", "eps", &R::train, &TrainConfig::eps, "AdamW epsilon."),
      field("train", "grad_clip", &R::train, &TrainConfig::grad_clip,
            "Global gradient-norm clip: a norm above it scales the gradients by grad_clip/norm (no "
            "epsilon); 0 disables."),
      field("train", "seed", &R::train, &TrainConfig::seed,
            "Seed for initialisation and data sampling."),
      field("train", "precision", &R::train, &TrainConfig::precision,
            "fp32 | bf16 | auto. bf16: fp32 master weights and optimizer, bf16 stored activations, "
            "TP/PP traffic and (with a bf16-capable GEMM, see hardware.gemm) GEMM inputs with fp32 "
            "accumulation; with bf16 GEMMs on a CPU with AVX512-BF16 or on a GPU (head_dim <= 128) "
            "the attention tiles too (q, k, v, P and their gradients in bf16; softmax, logsumexp "
            "and every sum fp32). auto: "
            "bf16 where bf16 GEMMs measure faster on this machine, else fp32."),
      field("train", "activation_checkpoint", &R::train, &TrainConfig::activation_checkpoint,
            "none | full | every:K (recompute every K-th layer inside a stage)."),
      field("train", "dynamic_loss_scale", &R::train, &TrainConfig::dynamic_loss_scale,
            "Skip diverged steps (non-finite or exploding loss or gradients) instead of stopping; "
            "8 in a row end the run."),
      field("train", "val_every", &R::train, &TrainConfig::val_every,
            "Validation loss every N steps; 0 never."),
      field("train", "val_batches", &R::train, &TrainConfig::val_batches,
            "Global batches per validation."),
      field("train", "log_every", &R::train, &TrainConfig::log_every,
            "Console line every N steps (metrics.jsonl gets every step)."),
  };
}

std::vector<Field> data_keys() {
  using R = Recipe;
  return {
      field("data", "path", &R::data, &DataConfig::path,
            "Training data: a text file (read through data.tokenizer), a token .bin file, or a "
            "pattern of token files read in name order as one stream, e.g. "
            "\"data/train_*.bin\" (memory-mapped, docs/data.md)."),
      field("data", "format", &R::data, &DataConfig::format,
            "auto | text | bin (auto: .bin files are tokens, anything else text)."),
      field("data", "val_path", &R::data, &DataConfig::val_path,
            "Validation data, as data.path (a file or a pattern of token files); empty: hold "
            "out the last val_fraction of data.path."),
      field("data", "val_fraction", &R::data, &DataConfig::val_fraction,
            "Fraction of data.path held out for validation when val_path is empty."),
      field("data", "sampler", &R::data, &DataConfig::sampler,
            "random | sequential (0-based step s, row r starts at token ((s·B + r) mod W)·T, W = "
            "⌊(N − 1)/T⌋ whole windows of the N training tokens)."),
      field("data", "tokenizer", &R::data, &DataConfig::tokenizer,
            "bytes | a SentencePiece model file (titan3d tokenize) | a byte-level BPE "
            "tokenizer.json (GPT-2, Llama 3, Qwen2): how text files are read; model.vocab_size "
            "must hold its ids."),
      field("data", "bos", &R::data, &DataConfig::bos,
            "Start each text file, and generate's prompt, with the tokenizer's BOS id (<s>), as "
            "Hugging Face's LLaMA tokenizer does (add_bos_token; import sets it)."),
  };
}

std::vector<Field> snapshot_keys() {
  using R = Recipe;
  return {
      field("snapshot", "every", &R::snapshot, &SnapshotConfig::every,
            "Snapshot every N steps; 0 disables."),
      field("snapshot", "memory_every", &R::snapshot, &SnapshotConfig::memory_every,
            "Self-launched jobs: also keep a snapshot in host memory (/dev/shm, plus a copy on "
            "the next host) every N steps (none at a disk snapshot's step); a restart after a "
            "failure resumes from it when it is newer than the disk's and every shard has a "
            "living copy. 0: off."),
      field("snapshot", "dir", &R::snapshot, &SnapshotConfig::dir,
            "Snapshot directory; empty: <run.dir>/snapshots."),
      field("snapshot", "keep", &R::snapshot, &SnapshotConfig::keep,
            "Snapshots to retain (bases they depend on are kept too)."),
      field("snapshot", "full_every", &R::snapshot, &SnapshotConfig::full_every,
            "Every K-th snapshot is a full base; the others may be incremental."),
      field("snapshot", "incremental_min_unchanged", &R::snapshot,
            &SnapshotConfig::incremental_min_unchanged,
            "A snapshot is incremental (stores only the chunks whose content changed; restore "
            "reads the chain back to its full base) only when at least this share of all ranks' "
            "chunks was unchanged at the previous snapshot, which every snapshot measures; "
            "otherwise it is full and the log says why. 0: incremental whenever "
            "snapshot.full_every allows."),
      field("snapshot", "deflate", &R::snapshot, &SnapshotConfig::deflate,
            "zlib level 1-9 (after byte shuffle) for snapshot data; 0: uncompressed."),
      field("snapshot", "async", &R::snapshot, &SnapshotConfig::async,
            "Write snapshots on a background thread while training continues."),
      field("snapshot", "staging_gib", &R::snapshot, &SnapshotConfig::staging_gib,
            "Host memory per rank a snapshot is staged in, GiB; 0: half the rank's training "
            "state (params, grads, optimizer), on a GPU the whole snapshot, less where a host's "
            "ranks would need over 3/4 of the memory their training leaves. A larger snapshot is "
            "staged and written in waves: training waits while all but the last are written. A "
            "host without the memory for its ranks' staging is refused at start."),
      field("snapshot", "resume", &R::snapshot, &SnapshotConfig::resume,
            "Empty: fresh start; `latest`: newest complete snapshot in snapshot.dir; or a path."),
  };
}

std::vector<Field> hardware_keys() {
  using R = Recipe;
  return {
      field("hardware", "hbm_gib", &R::hardware, &HardwareConfig::hbm_gib,
            "Device-memory (arena) budget per rank, GiB."),
      field("hardware", "threads_per_rank", &R::hardware, &HardwareConfig::threads_per_rank,
            "BLAS threads per rank; 0: cores on this host / ranks on this host, at least 1."),
      field("hardware", "openblas_coretype", &R::hardware, &HardwareConfig::openblas_coretype,
            "auto: detect the CPU and set OPENBLAS_CORETYPE for the ranks; or a core name."),
      field("hardware", "gemm", &R::hardware, &HardwareConfig::gemm,
            "GEMM library of the linear layers: auto (measured at the model's shapes on this "
            "machine, cached: OpenBLAS unless another is over 5 % faster) | openblas (fp32 only) "
            "| onednn (bf16 inputs when train.precision is bf16)."),
      field("hardware", "device", &R::hardware, &HardwareConfig::device,
            "Where each rank computes: cpu | cuda (the GPU of its node-local rank modulo the "
            "GPUs it sees; several ranks may share one; docs/gpu.md) | auto (cuda where a GPU "
            "is visible, else cpu)."),
      field("hardware", "cluster", &R::hardware, &HardwareConfig::cluster,
            "Cluster TOML file (recipes/clusters/) that `titan3d plan` plans for when --cluster "
            "is not given; empty: this machine."),
  };
}

}  // namespace

const std::vector<recipe_detail::Field>& recipe_detail::schema() {
  static const std::vector<Field> fields = [] {
    std::vector<Field> all;
    for (const auto section :
         {run_keys, model_keys, parallel_keys, train_keys, data_keys, snapshot_keys, hardware_keys})
      for (Field& f : section()) all.push_back(std::move(f));
    return all;
  }();
  return fields;
}

}  // namespace t3d::runtime
