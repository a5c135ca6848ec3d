// The model spec table (llm.c's TensorSpec table, train_gpt2.cu): every tensor the part of the
// model one rank holds takes from its arena, as a pure function of the model, the rank's layout
// (its layer ranges, tp / cp / sp slicing) and the training options (storage precision,
// activation checkpointing, split backward). Parameters come with their Hugging Face name and tp
// sharding; activations (per micro-batch in flight) and scratch (shared by all) with their element
// count and storage type.
//
// runtime::Model allocates exactly these rows in this order, its bf16 codec walks the block rows,
// and the planner's memory model sums them: what exists, its size and precision is written here
// once. Arithmetic only: no MPI, so the planner calls it without a communicator.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/pipeline_split.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// One row of the parameter table: the global (Hugging Face) tensor and how it is sharded.
struct ParamInfo {
  std::string name;
  std::vector<int64_t> global_shape;
  int split_dim = -1;  // -1 replicated over tp; 0 rows (column-parallel, vocab); 1 columns
  bool decay = true;   // AdamW weight decay (norm weights: no)
};

// The parameters of `chunks`, in layout order: per chunk the embedding (first), its blocks, then
// the final norm and (untied) LM head (last).
std::vector<ParamInfo> param_table(const ModelConfig& config,
                                   const std::vector<parallel::LayerRange>& chunks);

// Gradient units: float ranges of the parameter region (laid out as kernels::ParamLayout does,
// every tensor on a kernels::kAlignmentFloats boundary) that become final together. Unit -1 is the
// embedding, l a transformer block, n_layers the final norm and LM head. In region order.
struct ParamUnit {
  int64_t unit, begin, end;  // [begin, end): from the unit's first tensor to its last one's end
};
struct ParamUnits {
  std::vector<ParamUnit> units;
  int64_t total_floats = 0;  // the region, alignment padding included
};
ParamUnits param_units(const ModelConfig& config, const std::vector<parallel::LayerRange>& chunks,
                       int64_t tp);
// Floats one transformer block's parameters take in the region on one tp rank, padding included.
int64_t block_param_floats(const ModelConfig& config, int64_t tp);

// Activation checkpointing every K: blocks 0, K, 2K, ... of each chunk are recomputed in the
// backward instead of keeping their activations (K = 1: every block; 0: none).
inline bool recomputed_block(int64_t local_layer, int64_t every) {
  return every > 0 && local_layer % every == 0;
}
inline int64_t recomputed_blocks(int64_t layers, int64_t every) {
  return every <= 0 ? 0 : (layers + every - 1) / every;
}

enum class Dtype : uint8_t { kF32, kBF16, kI32 };
int64_t dtype_bytes(Dtype dtype);

// How activations are stored.
enum class ActivationStorage : uint8_t {
  kFp32,
  // titan3d's train.precision = "bf16" on CPUs: a block computes in one fp32 set of buffers
  // shared by all blocks and keeps bf16 copies of its large tensors (per-row statistics stay
  // fp32); TP traffic travels through bf16 staging buffers. Everything else fp32.
  kBf16Copies,
  // An accelerator training in bf16 (the planner's price for precision bf16): every
  // activation-sized tensor is bf16 where it lives; statistics, token ids, logits, the losses
  // and the RoPE table stay fp32 (int32 ids); no staging copies.
  kBf16,
};

// One rank's share of the model.
struct SpecLayout {
  std::vector<parallel::LayerRange> chunks;
  int64_t tp = 1;
  bool sequence_parallel = false;  // Megatron SP (has an effect with tp > 1 only)
  int64_t cp = 1;                  // context parallelism: the zig-zag split over 2·cp parts
};

struct SpecOptions {
  int64_t micro_rows = 1;            // sequences per micro-batch
  std::vector<int64_t> chunk_slots;  // micro-batches alive at once, per chunk of the layout
  int64_t checkpoint_every = 0;      // recomputed_block
  bool split_backward = false;       // zero-bubble B/W: keep the W pass's output gradients
  ActivationStorage storage = ActivationStorage::kFp32;
};

// The sizes one rank sees. Throws UserError when cp or sp cannot split the micro-batch.
struct ModelDims {
  int64_t B = 0;         // sequences per micro-batch
  int64_t T = 0;         // positions of each sequence on this rank: seq_len / cp
  int64_t N = 0;         // tokens per micro-batch: B·T
  int64_t Nl = 0;        // this rank's rows outside the TP blocks: N / tp with SP, else N
  int64_t C = 0, D = 0;  // model width, head width
  int64_t H = 0, Hkv = 0, F = 0, V = 0;  // heads, kv heads, ffn width, vocab: local to a tp rank
  int64_t seq_len = 0;                   // the whole sequence
  int64_t parts = 1;            // contiguous parts of a sequence on this rank: 1, or 2 with cp
  int64_t part_len = 0;         // positions per part
  bool sp = false, cp = false;  // sequence / context parallelism in effect
};
ModelDims model_dims(const ModelConfig& config, const SpecLayout& layout, int64_t micro_rows);

// clang-format off
// The activations one transformer block keeps for its backward, per micro-batch, in table order.
enum class BlockAct : uint8_t {
  kRstd1, kXn1, kQ, kK, kV, kAttn, kLse, kXmid, kRstd2, kXn2, kGate, kUp, kH
};
inline constexpr int kBlockActs = 13;
// The output gradients a block's deferred weight-gradient pass (W) needs, per micro-batch.
enum class WGrad : uint8_t { kDyDown, kDgate, kDup, kDyO, kDq, kDk, kDv };
inline constexpr int kWGrads = 7;
// The per-rank buffers every chunk and slot shares (one forward or backward runs at a time).
enum class ScratchBuf : uint8_t {
  kTmp, kDx, kSpRows, kSpAllRows, kDtmp, kDxn, kDatt, kDq, kDk, kDv, kDh, kDgate, kDup,
  kAttentionTiles, kLogits, kLosses, kRowMax, kSumExp, kTarget, kRope,
  kCpKeys, kCpValues, kCpKeyGrads, kCpValueGrads, kCpStaging, kCpKeyValuePart,
  kTpBf16, kTpBf16Rows
};
// clang-format on

// One row of the activation / scratch table.
struct SpecTensor {
  enum class Role : uint8_t {
    kResidual,     // index: residual stream 0..L of the chunk (0 its input, L its output)
    kBlock,        // index: BlockAct, where block `layer` computes and (fp32 or kBf16) keeps it
    kBlockStored,  // index: BlockAct, kBf16Copies: the copy block `layer` keeps
    kWGrad,        // index: WGrad, of block `layer`
    kTokens,       // first chunk: the ids, for the embedding backward
    kFinalNorm,    // last chunk: model.norm output and its rstd
    kFinalRstd,
    kLossGrad,   // last chunk: gradient of its output from the loss
    kInputGrad,  // not the first chunk: gradient of its input, per slot (its send may be in flight)
    kWorkBlock,  // scratch, index: BlockAct: the buffers recomputed / bf16-stored blocks use
    kScratch,    // index: ScratchBuf
  };
  Role role;
  int index = 0;
  int64_t layer = -1;  // global block of kBlock, kBlockStored, kWGrad rows
  Dtype dtype = Dtype::kF32;
  int64_t elems = 0;

  size_t bytes() const { return static_cast<size_t>(elems * dtype_bytes(dtype)); }
  size_t arena_bytes() const;  // rounded up as the arena allocates
  // The arena's name: activations without their "activations.chunkI.slotS." prefix
  // ("layer3.xn1.bf16", "residual0"), scratch in full ("scratch.tmp").
  std::string name() const;
};

struct ChunkSpec {
  parallel::LayerRange range;
  int64_t slots = 0;
  std::vector<SpecTensor> per_slot;  // one micro-batch's activations, in allocation order
  size_t slot_bytes() const;         // arena bytes of per_slot
};

struct ActivationSpec {
  ModelDims dims;
  std::vector<ChunkSpec> chunks;    // in layout order
  std::vector<SpecTensor> scratch;  // in allocation order
  // What a block stores per micro-batch where it is not recomputed: its rows (kBlock or
  // kBlockStored, layer -1) in the order the codec copies them.
  std::vector<SpecTensor> stored_block;
  size_t activation_bytes() const;  // Σ over chunks of slots · slot_bytes
  size_t scratch_bytes() const;
};

ActivationSpec activation_spec(const ModelConfig& config, const SpecLayout& layout,
                               const SpecOptions& options);

}  // namespace t3d::runtime
