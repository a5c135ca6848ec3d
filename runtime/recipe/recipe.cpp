// One file for the whole recipe on purpose: the schema table (every key once, its Field rows)
// drives the TOML codec, `--set`, `titan3d keys` and writing a recipe back; validation and world
// resolution read the typed Recipe it fills, naming each key and where it was set. Splitting them
// would put a key's type, default and checks in different files.
#include "runtime/recipe/recipe.h"

#include <strings.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <toml.hpp>
#include <type_traits>

#include "kernels/check.h"
#include "runtime/data/text_tokenizer.h"

namespace t3d::runtime {
namespace {

// ---- Located errors -------------------------------------------------------------------------

// Where each key's value came from ("recipe.toml:12" or "--set parallel.tp=3"), for messages
// raised after parsing (combinations, world size).
using Origins = std::map<std::string, std::string>;

std::string where(const toml::value& v) {
  const auto loc = v.location();
  std::ostringstream os;
  os << loc.file_name();
  if (loc.line() > 0 && loc.file_name().rfind("--set", 0) != 0) os << ":" << loc.line();
  return os.str();
}

[[noreturn]] void fail(const std::string& origin, const std::string& key, const std::string& msg) {
  throw UserError("recipe error: " + origin + ": `" + key + "`: " + msg);
}

// ---- The schema: every key, declared once ------------------------------------------------------

using Check = std::function<std::string(const Recipe&)>;  // "" when fine, else the complaint

struct Field {
  std::string section, key, type, meaning;
  std::function<void(Recipe&, const toml::value&)> read;  // throws UserError on a wrong type
  std::function<std::string(const Recipe&)> write;        // value as a TOML literal
  std::string full() const { return section + "." + key; }
};

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

// Every K-th block recomputed: K ≤ the most layers a model may have.
constexpr int64_t kMaxLayers = int64_t{1} << 14;

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

const std::vector<Field>& schema() {
  using R = Recipe;
  static const std::vector<Field> fields = {
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

      field("model", "vocab_size", &R::model, &ModelConfig::vocab_size,
            "Vocabulary size (256 for the byte-level tokenizer)."),
      field("model", "dim", &R::model, &ModelConfig::dim, "Hidden size."),
      field("model", "n_layers", &R::model, &ModelConfig::n_layers, "Transformer blocks."),
      field("model", "n_heads", &R::model, &ModelConfig::n_heads, "Attention (query) heads."),
      field("model", "n_kv_heads", &R::model, &ModelConfig::n_kv_heads,
            "Key/value heads for grouped-query attention; 0 means n_heads."),
      field("model", "ffn_dim", &R::model, &ModelConfig::ffn_dim,
            "SwiGLU hidden size; 0 means LLaMA's rule: 8/3·dim rounded up to a multiple of 64."),
      field("model", "seq_len", &R::model, &ModelConfig::seq_len, "Tokens per sequence."),
      field("model", "rope_theta", &R::model, &ModelConfig::rope_theta, "RoPE base frequency."),
      field("model", "norm_eps", &R::model, &ModelConfig::norm_eps, "RMSNorm epsilon."),
      field("model", "tie_embeddings", &R::model, &ModelConfig::tie_embeddings,
            "Share the token embedding with the LM head."),
      field("model", "n_experts", &R::model, &ModelConfig::n_experts,
            "Mixture of experts (docs/moe.md): routed experts per MoE block; 0: a dense model."),
      field("model", "experts_per_token", &R::model, &ModelConfig::experts_per_token,
            "Routed experts each token goes to (top-k)."),
      field("model", "n_shared_experts", &R::model, &ModelConfig::n_shared_experts,
            "Shared experts: a SwiGLU of n_shared_experts·moe_ffn_dim on every token, added to "
            "the routed output."),
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

      field("train", "steps", &R::train, &TrainConfig::steps, "Optimizer steps."),
      field("train", "global_batch", &R::train, &TrainConfig::global_batch,
            "Sequences per optimizer step over all dp ranks; divisible by dp·micro_batches."),
      field("train", "micro_batches", &R::train, &TrainConfig::micro_batches,
            "Micro-batches per dp rank and step (gradient accumulation / pipeline depth)."),
      field("train", "lr", &R::train, &TrainConfig::lr, "Peak learning rate."),
      field("train", "min_lr", &R::train, &TrainConfig::min_lr,
            "Where the cosine decay heads: the lr step train.steps would have, so the last "
            "step's lr is still above it (docs/training-math.md)."),
      field("train", "warmup_steps", &R::train, &TrainConfig::warmup_steps,
            "Linear warm-up steps before the cosine decay: 0-based step s < warmup_steps has "
            "lr·(s + 1)/warmup_steps."),
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
            "accumulation; with bf16 GEMMs on a CPU with AVX512-BF16 the attention tiles too (q, "
            "k, v, P and their gradients in bf16; softmax, logsumexp and every sum fp32). auto: "
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

      field("data", "path", &R::data, &DataConfig::path,
            "Training data: a text file (read through data.tokenizer) or a token .bin file."),
      field("data", "format", &R::data, &DataConfig::format,
            "auto | text | bin (auto: .bin files are tokens, anything else text)."),
      field("data", "val_path", &R::data, &DataConfig::val_path,
            "Validation data; empty: hold out the last val_fraction of data.path."),
      field("data", "val_fraction", &R::data, &DataConfig::val_fraction,
            "Fraction of data.path held out for validation when val_path is empty."),
      field("data", "sampler", &R::data, &DataConfig::sampler,
            "random | sequential (0-based step s, row r starts at token ((s·B + r) mod W)·T, W = "
            "⌊(N − 1)/T⌋ whole windows of the N training tokens)."),
      field("data", "tokenizer", &R::data, &DataConfig::tokenizer,
            "bytes | a SentencePiece model file (titan3d tokenize): how text files are read; "
            "model.vocab_size must hold its ids."),
      field("data", "bos", &R::data, &DataConfig::bos,
            "Start each text file, and generate's prompt, with the tokenizer's BOS id (<s>), as "
            "Hugging Face's LLaMA tokenizer does (add_bos_token; import sets it)."),

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
            "state (params, grads, optimizer), less where a host's ranks would need over 3/4 of "
            "the memory their training leaves. A larger snapshot is staged and written in waves: "
            "training "
            "waits while all but the last are written. A host without the memory for its ranks' "
            "staging is refused at start."),
      field("snapshot", "resume", &R::snapshot, &SnapshotConfig::resume,
            "Empty: fresh start; `latest`: newest complete snapshot in snapshot.dir; or a path."),

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
      field("hardware", "cluster", &R::hardware, &HardwareConfig::cluster,
            "Cluster TOML file (recipes/clusters/) that `titan3d plan` plans for when --cluster "
            "is not given; empty: this machine."),
  };
  return fields;
}

// ---- Validation of values and combinations ------------------------------------------------------

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
  v.require(m.dim % m.n_heads == 0, "model.n_heads",
            "model.dim = " + is(m.dim) + " is not divisible by n_heads = " + is(m.n_heads));
  v.require(m.head_dim() % 2 == 0, "model.n_heads",
            "head_dim = dim / n_heads = " + is(m.head_dim()) + " must be even for RoPE");
  v.require(
      m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
      "n_heads = " + is(m.n_heads) + " must be a multiple of n_kv_heads = " + is(m.n_kv_heads));
  v.require(m.ffn_dim >= 1, "model.ffn_dim", "must be positive (0 means the LLaMA rule)");
  v.require(m.seq_len >= 1, "model.seq_len", "must be positive, got " + is(m.seq_len));
  v.require(m.rope_theta > 0, "model.rope_theta", "must be positive");
  v.require(m.norm_eps > 0, "model.norm_eps", "must be positive");
  v.require(m.n_experts >= 0 && m.n_experts <= kernels::kMaxExperts, "model.n_experts",
            "must lie in [0, " + is(kernels::kMaxExperts) + "] (0: dense), got " + is(m.n_experts));
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
    const double moe_blocks = m.moe() ? static_cast<double>(m.n_layers - m.dense_layers) : 0;
    const double dense_blocks = L - moe_blocks;
    const double E = static_cast<double>(m.n_experts), Fe = static_cast<double>(m.moe_ffn_dim);
    const double Fs = static_cast<double>(m.shared_ffn_dim());
    const double K = static_cast<double>(m.experts_per_token), P = static_cast<double>(p.ep);
    const double activations =
        std::max(rows, 1.0) * T *
        (L * (16.0 * C + static_cast<double>(m.n_heads) * T) + dense_blocks * 4.0 * F +
         moe_blocks * (E + 2.0 * K + P * K * (4.0 * Fe + 2.0 * C) + 4.0 * Fs) + 2.0 * m.vocab_size);
    v.require(activations <= kMaxElements, "train.global_batch",
              "one micro-batch of global_batch / (dp·micro_batches) = " + is(rows) +
                  " sequences of seq_len = " + is(m.seq_len) + " needs about " +
                  is(activations * 4 / double(int64_t{1} << 40)) +
                  " TiB of activations per rank, far beyond any device; lower "
                  "train.global_batch or model.seq_len, or raise train.micro_batches");
    const double experts = moe_blocks * E * 3.0 * C * Fe;
    const double params = L * 4.0 * C * C + dense_blocks * 3.0 * C * F +
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
  v.require(t.weight_decay >= 0, "train.weight_decay", "must be ≥ 0");
  v.require(t.beta1 >= 0 && t.beta1 < 1, "train.beta1", "must lie in [0, 1)");
  v.require(t.beta2 >= 0 && t.beta2 < 1, "train.beta2", "must lie in [0, 1)");
  v.require(t.eps > 0, "train.eps", "must be positive");
  v.require(t.grad_clip >= 0, "train.grad_clip", "must be ≥ 0 (0 disables clipping)");
  v.require(t.val_every >= 0, "train.val_every", "must be ≥ 0 (0: never)");
  v.require(t.val_batches >= 1, "train.val_batches", "must be positive");
  v.require(t.log_every >= 1, "train.log_every", "must be positive");
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

void validate(const Recipe& r) {
  validate_limits(r);
  validate_model(r);
  validate_parallel(r);
  validate_train(r);
  validate_data_snapshot_run(r);
}

// ---- Parsing --------------------------------------------------------------------------------

// toml11 parses nested arrays and inline tables by recursion (and frees them so too): a few
// thousand levels exhaust the stack. Recipes need two, so the text is scanned first and more than
// kMaxNesting levels of [ or { (outside strings and comments) are refused, naming the line. Dotted
// keys (a.b.c) nest tables the same way and are bounded alike.
constexpr int kMaxNesting = 32;

void check_nesting(const std::string& text, const std::string& name) {
  int depth = 0;
  size_t line = 1;
  const auto refuse = [&](const char* what) {
    throw UserError("recipe error: " + name +
                    (name.rfind("--set", 0) == 0 ? "" : ":" + std::to_string(line)) + ": " + what +
                    " nested more than " + std::to_string(kMaxNesting) +
                    " levels deep; a recipe needs at most 2");
  };
  int dots = 0;  // dots in the key being read on this line (before '=' or ']')
  bool in_key = true;
  std::string open;  // the brackets open here, innermost last
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line, dots = 0, in_key = depth == 0;
      continue;
    }
    if (c == '#') {  // comment to the end of the line
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
      continue;
    }
    if (c == '"' || c == '\'') {
      const bool multi = text.compare(i, 3, std::string(3, c)) == 0;
      const std::string close = multi ? std::string(3, c) : std::string(1, c);
      size_t j = i + close.size();
      for (; j < text.size(); ++j) {
        if (c == '"' && text[j] == '\\') {
          ++j;
          continue;
        }
        if (text[j] == '\n') {
          if (!multi) break;  // an unterminated string: toml11 reports it
          ++line;
        }
        if (text.compare(j, close.size(), close) == 0) break;
      }
      i = std::min(j + close.size() - 1, text.size());
      continue;
    }
    if (c == '[' || c == '{') {
      if (++depth > kMaxNesting) refuse("arrays or inline tables");
      open.push_back(c);
      if (c == '{') in_key = true;
    } else if (c == ']' || c == '}') {
      depth = std::max(0, depth - 1);
      if (!open.empty()) open.pop_back();
    } else if (c == '=' || c == ',') {
      in_key =
          c == ',' && !open.empty() && open.back() == '{';  // a key follows in { a = 1, b = 2 }
      dots = 0;
    } else if (c == '.' && in_key) {
      if (++dots > kMaxNesting) refuse("dotted keys");
    }
  }
}

toml::value parse_toml(std::istream& in, const std::string& name) {
  try {
    return toml::parse(in, name);
  } catch (const toml::syntax_error& e) {
    throw UserError(std::string("recipe error: not valid TOML:\n") + e.what());
  }
}

void apply_override(toml::value& root, const Override& o) {
  const auto dot = o.key.find('.');
  const std::string label = "--set " + o.key + "=" + o.value;
  T3D_USER_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < o.key.size(),
                 "recipe error: ", label, ": the key must be section.key, e.g. parallel.tp");
  const std::string section = o.key.substr(0, dot), key = o.key.substr(dot + 1);
  // One line only: a value with a line break would smuggle in more TOML (or be cut at it).
  T3D_USER_CHECK(o.value.find_first_of("\n\r") == std::string::npos, "recipe error: --set ", o.key,
                 ": the value spans several lines; give it on one line");
  check_nesting(o.value, label);
  toml::value value;
  try {
    std::istringstream in("v = " + o.value);
    value = toml::parse(in, label).as_table().at("v");
  } catch (const std::exception&) {
    // Not a TOML literal: take it as a bare string (`--set run.dir=/tmp/x`).
    std::istringstream in("v = " + TomlType<std::string>::put(o.value));
    value = toml::parse(in, label).as_table().at("v");
  }
  auto& table = root.as_table();
  if (!table.count(section)) table[section] = toml::table{};
  T3D_USER_CHECK(table[section].is_table(), "recipe error: ", label, ": `", section,
                 "` is not a table in the recipe");
  table[section].as_table()[key] = value;
}

}  // namespace

LayoutProblem layout_problem(const ModelConfig& m, const ParallelConfig& p, const TrainConfig& t) {
  // The first check that fails is the answer; later checks divide by what earlier ones found
  // positive.
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
  if (m.n_heads % p.tp != 0)
    return {"parallel.tp", "model.n_heads = " + is(m.n_heads) + " is not divisible by tp = " +
                               is(p.tp) + "; each tp rank must hold whole heads"};
  if (m.n_kv_heads % p.tp != 0)
    return {"parallel.tp",
            "model.n_kv_heads = " + is(m.n_kv_heads) + " is not divisible by tp = " + is(p.tp)};
  if (m.vocab_size % p.tp != 0)
    return {"parallel.tp", "model.vocab_size = " + is(m.vocab_size) + " is not divisible by tp = " +
                               is(p.tp) + " (vocab-parallel embedding and loss)"};
  if (m.ffn_dim % p.tp != 0)
    return {"parallel.tp",
            "model.ffn_dim = " + is(m.ffn_dim) + " is not divisible by tp = " + is(p.tp)};
  if (m.moe() && (m.moe_ffn_dim % p.tp != 0 || m.moe_ffn_dim / p.tp * m.dim % 16 != 0))
    return {"parallel.tp", "model.moe_ffn_dim = " + is(m.moe_ffn_dim) +
                               " must split over tp = " + is(p.tp) +
                               " into slices whose matrices (slice·dim) are multiples of 16 "
                               "floats"};
  if (m.moe() && m.shared_ffn_dim() % p.tp != 0)
    return {"parallel.tp", "the shared experts' width n_shared_experts·moe_ffn_dim = " +
                               is(m.shared_ffn_dim()) + " is not divisible by tp = " + is(p.tp)};
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
  if (p.zero < 0 || p.zero > 3) return {"parallel.zero", "must be 0, 1, 2 or 3, got " + is(p.zero)};
  if (p.dp >= 1 && t.global_batch % (p.dp * t.micro_batches) != 0)
    return {"train.global_batch", "global_batch = " + is(t.global_batch) +
                                      " is not divisible by dp·micro_batches = " + is(p.dp) + "·" +
                                      is(t.micro_batches)};
  return {};
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        // TOML forbids raw control characters (and DEL) in a basic string.
        if (c < 0x20 || c == 0x7f) {
          char esc[8];
          std::snprintf(esc, sizeof(esc), "\\u%04X", c);
          out += esc;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

Override parse_override(const std::string& text) {
  const auto eq = text.find('=');
  T3D_USER_CHECK(eq != std::string::npos && eq > 0, "--set ", text,
                 ": expected section.key=value, e.g. --set parallel.tp=2");
  return {text.substr(0, eq), text.substr(eq + 1)};
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest_key(const std::string& unknown) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& f : schema()) {
    const size_t d = edit_distance(unknown, f.full());
    if (d < best_d) best_d = d, best = f.full();
  }
  return best_d <= std::max<size_t>(2, unknown.size() / 3) ? best : "";
}

Recipe parse_recipe(const std::string& toml_text, const std::string& source_name,
                    const std::vector<Override>& overrides) {
  check_nesting(toml_text, source_name);
  std::istringstream in(toml_text);
  toml::value root = parse_toml(in, source_name);
  for (const auto& o : overrides) apply_override(root, o);

  Recipe r;
  r.source = source_name;
  Origins origins;
  std::set<std::string> known;
  for (const auto& f : schema()) known.insert(f.full());

  // Unknown sections and keys first: a typo must not silently leave a default in place.
  for (const auto& [section, body] : root.as_table()) {
    if (!body.is_table()) {
      const std::string hint = closest_key(section);
      fail(where(body), section,
           "top-level keys are not allowed; put it in a section such as [run]" +
               (hint.empty() ? "" : ". Did you mean `" + hint + "`?"));
    }
    for (const auto& [key, value] : body.as_table()) {
      const std::string full = section + "." + key;
      if (known.count(full)) continue;
      const std::string hint = closest_key(full);
      fail(where(value), full,
           "unknown key" + (hint.empty() ? std::string(". See docs/recipe.md for every key")
                                         : ". Did you mean `" + hint + "`?"));
    }
  }
  for (const auto& f : schema()) {
    const auto& table = root.as_table();
    auto s = table.find(f.section);
    if (s == table.end()) continue;
    auto k = s->second.as_table().find(f.key);
    if (k == s->second.as_table().end()) continue;
    f.read(r, k->second);
    origins[f.full()] = where(k->second);
  }
  // Derived defaults.
  if (r.model.n_kv_heads == 0) r.model.n_kv_heads = r.model.n_heads;
  if (r.model.ffn_dim == 0) r.model.ffn_dim = (8 * r.model.dim / 3 + 63) / 64 * 64;
  if (r.model.moe_ffn_dim == 0) r.model.moe_ffn_dim = r.model.ffn_dim;
  // zb_v runs two chunks per stage; an explicit value that says otherwise is refused below.
  if (r.parallel.schedule == parallel::ScheduleKind::kZBV &&
      !origins.count("parallel.virtual_stages"))
    r.parallel.virtual_stages = 2;
  if (r.run.dir.empty()) r.run.dir = "runs/" + r.run.name;
  if (r.snapshot.dir.empty()) r.snapshot.dir = r.run.dir + "/snapshots";
  r.key_origins = std::move(origins);
  validate(r);
  return r;
}

Recipe load_recipe(const std::string& path, const std::vector<Override>& overrides) {
  // A directory opens as an empty stream on Linux: it must not read as an empty recipe.
  struct stat st {};
  T3D_USER_CHECK(stat(path.c_str(), &st) == 0, "recipe error: cannot open recipe file `", path,
                 "`: ", std::strerror(errno),
                 " (check the path; it is relative to the current directory)");
  T3D_USER_CHECK(!S_ISDIR(st.st_mode), "recipe error: `", path,
                 "` is a directory, not a recipe file; give a .toml file such as ", path,
                 "/default.toml");
  std::ifstream in(path);
  T3D_USER_CHECK(in.good(), "recipe error: cannot read recipe file `", path,
                 "`: ", std::strerror(errno), " (check its permissions)");
  std::stringstream text;
  text << in.rdbuf();
  T3D_USER_CHECK(!in.bad(), "recipe error: cannot read recipe file `", path,
                 "`: ", std::strerror(errno));
  return parse_recipe(text.str(), path, overrides);
}

std::string Recipe::origin(const std::string& key) const {
  auto it = key_origins.find(key);
  return it != key_origins.end() ? it->second : source + " (default value)";
}

int64_t Recipe::micro_batch_rows() const {
  return rows_per_micro(train.global_batch, static_cast<int>(std::max<int64_t>(parallel.dp, 1)),
                        static_cast<int>(train.micro_batches));
}

int64_t Recipe::world_size() const {
  return parallel.pp * std::max<int64_t>(parallel.dp, 1) * parallel.cp * parallel.tp;
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

std::string Recipe::to_toml() const {
  // A value the parser derives from other keys is written as left out when it equals what they
  // derive, so a recipe read back (a snapshot's, restart.toml) derives it again from what an
  // override changes: `--set run.dir=B` on a resume moves the snapshots to B/snapshots too.
  Recipe stored = *this;
  if (stored.snapshot.dir == stored.run.dir + "/snapshots") stored.snapshot.dir.clear();
  if (stored.run.dir == "runs/" + stored.run.name) stored.run.dir.clear();
  const int64_t derived_virtual_stages = parallel.schedule == parallel::ScheduleKind::kZBV ? 2 : 1;
  std::string out, section;
  for (const auto& f : schema()) {
    if (f.section != section) {
      out += (section.empty() ? "[" : "\n[") + f.section + "]\n";
      section = f.section;
    }
    if (f.full() == "parallel.virtual_stages" && parallel.virtual_stages == derived_virtual_stages)
      continue;
    out += f.key + " = " + f.write(stored) + "\n";
  }
  return out;
}

std::vector<KeyDoc> recipe_key_docs() {
  const Recipe defaults;
  std::vector<KeyDoc> docs;
  for (const auto& f : schema()) docs.push_back({f.full(), f.type, f.write(defaults), f.meaning});
  return docs;
}

std::string ActivationCheckpoint::name() const {
  if (every == 0) return "none";
  if (every == 1) return "full";
  return "every:" + std::to_string(every);
}

std::string recipe_keys_table() {
  const auto cell = [](std::string s) {  // a '|' would end a Markdown table cell
    for (size_t i = 0; (i = s.find('|', i)) != std::string::npos; i += 2) s.insert(i, "\\");
    return s;
  };
  std::string out = "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const auto& k : recipe_key_docs())
    out += "| `" + k.key + "` | " + k.type + " | `" + k.default_value + "` | " + cell(k.meaning) +
           " |\n";
  return out;
}

}  // namespace t3d::runtime
