#include "runtime/stage/stage.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <string>

#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/gemm.h"
#include "kernels/memory_guard.h"
#include "parallel/zero.h"
#include "runtime/data/data_sampler.h"
#include "runtime/data/text_tokenizer.h"
#include "runtime/machine/machine.h"

namespace t3d::runtime {

using parallel::Dim;

namespace {

// train.precision = bf16 (the job's, resolved): activations stored and pipeline / TP traffic
// sent in bf16.
bool stores_bf16(const JobPrecision& p) { return p.train == TrainPrecision::kBf16; }

// The rank's device (hardware.device), logged. Every model and layout runs on a GPU (mixtures of
// experts through the MoE ops' CUDA twins, expert parallelism's rows staged as the other tensor
// collectives: docs/gpu.md).
std::unique_ptr<kernels::Device> open_device(const Job& job) {
  auto device = kernels::Device::open(job.recipe.hardware.device, job.env.local_rank);
  spdlog::info("device: {}", device->description());
  return device;
}

// Installs the job's GEMM algorithms on a GPU (runtime/machine/gpu_gemm_table.h). A GPU that
// cannot take them (another model or cuBLASLt than rank 0's) keeps cuBLASLt's heuristic answers.
void use_gemm_table(const kernels::Device& device, const std::string& table) {
  if (!device.on_gpu() || table.empty()) return;
  if (const std::string why = device.use_gemm_table(table); !why.empty())
    spdlog::warn(
        "GEMM algorithms: the job's table is not used on this rank ({}); each shape runs "
        "cuBLASLt's first heuristic answer, so its sums may differ from other ranks' in the last "
        "bits",
        why);
}

}  // namespace

StageGroups::StageGroups(const parallel::Mesh& mesh, const kernels::Device& device, DeviceComm key,
                         bool pp_in_send_order)
    : mesh_(mesh) {
  // Staged on the CPU where its device memory is guarded as a GPU's (T3D_GUARD_DEVICE_MEMORY=1:
  // MPI may not touch it, kernels/memory_guard.h), which also checks that staging changes no bit.
  const bool staged_on_cpu = kernels::memory_guard_on();
  // Collective over the world: with a GPU on any rank (hardware.device = "auto" over hosts with
  // and without), every rank decides every group below, a CPU rank's groups being staged.
  int gpus = device.on_gpu() ? 1 : 0;
  mesh.world().all_reduce(&gpus, 1, parallel::ReduceOp::max);
  if (gpus == 0) {
    // The ranks' tensors are host memory: the MPI communicators carry them (staged copies where
    // the device memory is guarded). "nccl" is refused.
    if (key == DeviceComm::kNccl)
      choose_device_comm(key, "every group (no rank has a GPU)", {RankDevice{}},
                         parallel::nccl_library());
    if (!staged_on_cpu) return;
    const kernels::Exec exec = device.exec(kernels::GemmKind::kOpenBlasF32);  // copies only
    tp_ = std::make_unique<parallel::StagedComm>(mesh.group(Dim::tp), exec);
    pp_ = std::make_unique<parallel::StagedComm>(mesh.group(Dim::pp), exec);
    cp_ = std::make_unique<parallel::StagedComm>(mesh.group(Dim::cp), exec);
    dp_cp_ = std::make_unique<parallel::StagedComm>(mesh.dp_cp(), exec);
    edp_ = std::make_unique<parallel::StagedComm>(mesh.edp(), exec);
    ep_ = std::make_unique<parallel::StagedComm>(mesh.ep(), exec);
    spdlog::info(
        "tensor collectives of tp, pp, cp, dp × cp, edp and ep staged through host memory "
        "(T3D_GUARD_DEVICE_MEMORY=1)");
    return;
  }
  // Per group, NCCL or staged (runtime/stage/device_comm.h). Every rank decides every
  // group in the same order (each decision gathers over its group), and the ranks agree on any
  // refusal before a communicator is made, so that none waits in a bootstrap another left.
  const auto groups = tensor_groups(mesh);
  std::array<DeviceCommPath, groups.size()> paths;
  std::string refused;
  for (size_t i = 0; i < groups.size(); ++i) {
    try {
      paths[i] = choose_group_comm(key, groups[i], device, pp_in_send_order);
    } catch (const UserError& e) {
      if (refused.empty()) refused = e.what();
    }
  }
  const std::string agreed = agreed_error(mesh.world(), refused);
  T3D_USER_CHECK(agreed.empty(), agreed);
  std::unique_ptr<parallel::TensorComm>* own[] = {&tp_, &pp_, &cp_, &dp_cp_, &edp_, &ep_};
  for (size_t i = 0; i < groups.size(); ++i) {
    // A bootstrap that fails on a rank (ncclCommInitRank) is agreed over the world after each
    // group, so that ranks outside that group end with its error instead of waiting in the next
    // group's bootstrap for a rank that left.
    // The error keeps its kind: the user's to fix (exit 2) unless any rank's was NCCL's or
    // CUDA's own (exit 1).
    std::string failed;
    int internal = 0;
    try {
      *own[i] = open_device_comm(paths[i], groups[i].name, *groups[i].comm, device);
    } catch (const UserError& e) {
      failed = std::string("tensor collectives of ") + groups[i].name + ": " + e.what();
    } catch (const std::exception& e) {
      failed = std::string("tensor collectives of ") + groups[i].name + ": " + e.what();
      internal = 1;
    }
    if (!failed.empty()) spdlog::error("{}", failed);  // in this rank's log, whatever follows
    const std::string agreed_open = agreed_error(mesh.world(), failed);
    if (agreed_open.empty()) continue;
    mesh.world().all_reduce(&internal, 1, parallel::ReduceOp::max);
    if (internal) throw InternalError(agreed_open);
    throw UserError(agreed_open);
  }
  // The pipeline's point-to-point pairs (its ring neighbours, interleaved schedules' wrap-around
  // included) connected before their first message (TensorComm::prepare_pairs); no other group
  // sends point to point but the replay's, which readies its own.
  const int n = pp_->size(), r = pp_->rank();
  if (n > 1) {
    std::vector<int> ring = {(r + 1) % n};
    if ((r + n - 1) % n != ring[0]) ring.push_back((r + n - 1) % n);
    pp_->prepare_pairs(ring, ring);
  }
}

parallel::Schedule stage_schedule(const Recipe& r, int pp) {
  return parallel::make_schedule(r.parallel.schedule, pp, static_cast<int>(r.train.micro_batches),
                                 static_cast<int>(r.parallel.virtual_stages));
}

std::vector<parallel::LayerRange> stage_layers(const ModelConfig& model,
                                               const std::vector<int64_t>& pipeline_split,
                                               const parallel::Schedule& schedule, int stage) {
  const auto split = parallel::split_layers(
      model.n_layers, schedule.num_chunks(),
      parallel::head_cost_in_layers(model.vocab_size, model.dim, model.ffn_dim), pipeline_split);
  return parallel::layers_of_stage(split, schedule.chunk_stage, stage);
}

ModelOptions model_options(const Recipe& r, const JobPrecision& precision, StagePurpose purpose,
                           int64_t micro_rows, const PipelineExecutor* executor,
                           const parallel::TensorComm* cp) {
  ModelOptions o;
  o.micro_rows = micro_rows;
  o.with_optimizer = false;
  // bf16 rounds stored activations and TP / PP traffic, the GEMM kind rounds GEMM inputs,
  // sequence parallelism moves the norms: all change the last bits of a loss, so every purpose
  // builds the stage as training does.
  o.bf16 = stores_bf16(precision);
  o.exec = precision.gemm;
  o.sequence_parallel = r.parallel.sequence_parallel;
  o.cp = cp;
  if (purpose == StagePurpose::kForward) return o;
  T3D_ASSERT(executor, "a training stage needs its executor's slots");
  o.slots = executor->max_slots();
  o.chunk_slots.assign(executor->slots_per_chunk().begin(), executor->slots_per_chunk().end());
  // The regions ZeRO shards are ShardedState's (runtime/train/sharded_state.h).
  const parallel::FullRegions full = parallel::full_regions(static_cast<int>(r.parallel.zero));
  o.param_region = full.params;
  o.grad_region = full.grads;
  o.with_optimizer = full.moments;
  o.checkpoint_every = r.train.activation_checkpoint.every;
  o.split_backward = executor->splits_backward();
  o.moe_aux_weight = r.model.router_aux_coef / static_cast<double>(r.train.global_batch);
  return o;
}

Stage build_stage(const Job& job, StagePurpose purpose) {
  const Recipe& r = job.recipe;
  const parallel::Mesh& mesh = *job.mesh;
  Stage s;
  const int pp = mesh.shape().size(Dim::pp), dp = mesh.shape().size(Dim::dp);
  parallel::Schedule schedule;
  // What a rank can fail at alone comes before the groups, which are collective on a GPU (device
  // gathers, NCCL's bootstrap): agreed first, so that no rank waits there for one that failed.
  agree_on(mesh.world(), [&] {
    s.threads = setup_rank_threads(r, job.env, purpose == StagePurpose::kTrain);
    kernels::verify_gemm_kind(kernels::GemmKind::kOpenBlasF32);  // attention's GEMMs
    const int n_micro = static_cast<int>(r.train.micro_batches);
    s.micro_rows = rows_per_micro(r.train.global_batch, dp, n_micro);
    schedule = stage_schedule(r, pp);
    s.layers = stage_layers(r.model, r.parallel.pipeline_split, schedule, mesh.coord().pp);
    s.device = open_device(job);
    use_gemm_table(*s.device, job.precision().gpu_gemm_table);
  });
  s.groups = std::make_unique<StageGroups>(mesh, *s.device, r.parallel.device_comm,
                                           parallel::receives_in_send_order(schedule));
  // bf16 training sends activations and their gradients between stages in bf16.
  s.executor = std::make_unique<PipelineExecutor>(
      std::move(schedule), s.groups->pp(),
      stores_bf16(job.precision()) ? WirePrecision::kBf16 : WirePrecision::kFp32);
  s.arena = std::make_unique<kernels::Arena>(static_cast<size_t>(r.hardware.hbm_gib * kGiB),
                                             s.device->memory());
  ModelOptions options =
      model_options(r, job.precision(), purpose, s.micro_rows, s.executor.get(), &s.groups->cp());
  options.exec = s.device->exec(options.exec.gemm);
  options.ep = &mesh.ep();  // every EP rank runs the same forwards and backwards
  options.ep_tensors = &s.groups->ep();
  s.model = std::make_unique<Model>(r.model, s.layers, s.groups->tp(), *s.arena, options);
  s.holds_loss = s.layers.back().last && mesh.coord().tp == 0;
  return s;
}

MicroBatchFeed::MicroBatchFeed(int64_t rows, int64_t seq_len, int cp, int cp_rank, int slots)
    : rows_(rows), seq_len_(seq_len), cp_(cp), cp_rank_(cp_rank), slots_(slots) {
  tokens_.resize(static_cast<size_t>(slots * rows * seq_len / cp));
  targets_.resize(tokens_.size());
  if (cp > 1) {
    whole_tokens_.resize(static_cast<size_t>(rows * seq_len));
    whole_targets_.resize(whole_tokens_.size());
  }
}

MicroBatchSource MicroBatchFeed::source(const Sampler& sampler, int64_t step, int dp_rank, int dp,
                                        int n_micro, Mask mask) {
  return [this, &sampler, step, dp_rank, dp, n_micro, mask = std::move(mask)](
             int mb, const int32_t** tokens, const int32_t** targets) {
    const int64_t local = rows_ * seq_len_ / cp_;  // this cp rank's positions of the rows
    const size_t at = static_cast<size_t>((mb % slots_) * local);
    const std::span<int32_t> tok(tokens_.data() + at, local), tgt(targets_.data() + at, local);
    if (cp_ == 1) {
      const Batch whole = sampler.sample(step, dp_rank, dp, mb, n_micro, tok, tgt);
      if (mask) mask(whole);
    } else {  // every cp rank samples the same rows and keeps its own positions
      const Batch whole =
          sampler.sample(step, dp_rank, dp, mb, n_micro, whole_tokens_, whole_targets_);
      if (mask) mask(whole);
      cp_local_positions(whole_tokens_.data(), tok.data(), rows_, seq_len_, cp_, cp_rank_);
      cp_local_positions(whole_targets_.data(), tgt.data(), rows_, seq_len_, cp_, cp_rank_);
    }
    *tokens = tok.data();
    *targets = tgt.data();
  };
}

StageData load_stage_data(const Recipe& r) {
  const int vocab = static_cast<int>(r.model.vocab_size);
  const TextTokenizer tokenizer =
      TextTokenizer::open(r.data.tokenizer, "data.tokenizer", r.data.bos);
  StageData d;
  d.train = load_stream(r.data.path, r.data.format, vocab, &tokenizer, "data.path");
  if (!r.data.val_path.empty()) {
    d.val = load_stream(r.data.val_path, r.data.format, vocab, &tokenizer, "data.val_path");
  } else if (r.data.val_fraction > 0) {
    auto split = split_train_val(d.train, r.data.val_fraction, r.model.seq_len + 1);
    d.train = std::move(split.train);
    d.val = std::move(split.val);
  }
  return d;
}

void check_tokenizer(const Recipe& r) {
  const TextTokenizer tokenizer =
      TextTokenizer::open(r.data.tokenizer, "data.tokenizer", r.data.bos);
  T3D_USER_CHECK(tokenizer.vocab_size() <= r.model.vocab_size, "recipe error: data.tokenizer `",
                 tokenizer.spec(), "` has ", tokenizer.vocab_size(),
                 " ids but model.vocab_size is ", r.model.vocab_size, " (",
                 r.origin("model.vocab_size"), "); set model.vocab_size to at least ",
                 tokenizer.vocab_size());
}

}  // namespace t3d::runtime
