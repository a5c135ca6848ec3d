// A LLaMA-style decoder, as the part one rank holds: some pipeline chunks (contiguous layer
// ranges; the first holds the embedding, the last the final norm, LM head and loss), each weight
// sharded over the tp group Megatron-style. With pp = tp = 1 it is the whole model on one rank.
//
// Tensor parallelism lives in four places, each a conjugate pair (Megatron's mappings):
//   - q/k/v and gate/up are column-parallel: forward needs no communication ("copy"); the
//     gradient of their shared input is a partial sum, all-reduced in backward;
//   - o_proj and down_proj are row-parallel: their output is a partial sum, all-reduced in forward
//     ("reduce"), before it joins the residual stream; backward needs no communication;
//   - the embedding is vocab-parallel: each rank looks up the ids it owns, rows are all-reduced;
//   - the LM head is vocab-parallel and the cross-entropy runs on vocab slices (max, sum-exp and
//     target logit all-reduced): no rank ever holds the full logits.
// So the residual stream, norms and their weights are replicated and identical across tp ranks.
//
// Memory: parameters, gradients and AdamW moments are four regions of the rank's arena (one
// layout); activations live in `slots`, one per micro-batch in flight, allocated once when the
// model is built, so a step never allocates and a too-small budget fails at build time.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/exec.h"
#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "kernels/ops_swiglu.h"
#include "parallel/comm.h"
#include "parallel/pipeline_split.h"
#include "parallel/zero.h"
#include "runtime/model/model_spec.h"
#include "runtime/model/stage_model.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

struct ModelOptions {
  int64_t micro_rows = 1;  // sequences per micro-batch
  int64_t slots = 1;       // micro-batches whose activations are alive at once, per chunk
  bool with_optimizer = true;
  // false (ZeRO-2): no full-size gradient region; the backward writes each unit's gradients where
  // set_grad_source points (the reducer's staging buffers).
  bool grad_region = true;
  // false (ZeRO-3): no full-size parameter region; the model reads each unit's weights where
  // set_weight_source points (the reducer's gathered buffers).
  bool param_region = true;
  // Activation checkpointing: 0 none; K recomputes blocks 0, K, 2K, ... of each chunk in the
  // backward instead of keeping their activations (K = 1: every block, "full").
  int64_t checkpoint_every = 0;
  // Zero-bubble schedules run the backward as B (input gradients) then, later, W (weight
  // gradients): keep per slot the output gradients W needs.
  bool split_backward = false;
  // Mixed precision (train.precision = "bf16"): saved activations are stored in bf16 and TP
  // traffic travels in bf16 (the pipeline's is the executor's WirePrecision); master weights,
  // the optimizer and accumulation stay fp32. Whether GEMM inputs are bf16 is `gemm`'s.
  bool bf16 = false;
  // Where and how this Model's ops run (kernels/exec.h): today always the CPU, with the GEMM kind
  // of the linear layers (kernels/gemm.h), which also decides attention's tile precision: the
  // job's measured or recorded choice (runtime/machine/gemm_choice.h). With a bf16 kind and
  // `bf16` the stored copies feed the GEMMs. Every kernel call of this Model gets it as an
  // argument, so Models of one process with different kinds each compute in their own.
  kernels::Exec exec = kernels::GemmKind::kOpenBlasF32;
  // Megatron sequence parallelism: outside the TP blocks (norms, residual stream, pipeline
  // traffic) each tp rank keeps only its 1/tp of the micro-batch's rows.
  bool sequence_parallel = false;
  // Slots per local chunk instead of `slots` for each, when given (the pipeline executor's
  // per-chunk peaks): ZB-V's two chunks peak at different counts, and only their sum keeps
  // 1F1B's memory.
  std::vector<int64_t> chunk_slots = {};
  // Context parallelism (parallel.cp > 1): this rank's cp group. The sequence is cut into 2·cp
  // parts and cp rank r holds parts r and 2·cp−1−r (the zig-zag split: under the causal mask
  // every rank then has the same attention work); attention all-gathers keys and values over the
  // group (Llama 3's all-gather CP) and reduce-scatters their gradients. nullptr or size 1: none.
  // The rank's tokens are ordered (part, row, position): see cp_local_positions.
  const parallel::TensorComm* cp = nullptr;
  // Mixture of experts: the weight of one sequence's auxiliary balance loss in the training
  // loss (model.router_aux_coef / sequences in the global batch); 0: none.
  double moe_aux_weight = 0;
  // Expert parallelism (parallel.ep > 1): this rank's EP group. EP rank r holds the routed
  // experts expert_share(config, ep, r) of every MoE block; each block's token slots travel to
  // the rank holding their expert and back (docs/moe.md). nullptr or size 1: every expert here.
  // Its counts travel on it (host values); its rows and gates on `ep_tensors` (the same group's
  // tensor transfers: a StagedComm on a GPU, whose tensors are device memory), or on `ep` itself
  // when that is null.
  const parallel::Comm* ep = nullptr;
  const parallel::TensorComm* ep_tensors = nullptr;
};

// Context parallelism: cp rank `cp_rank`'s tokens of `rows` whole sequences of `seq_len` (row
// major), in the model's order (part, row, position) of the zig-zag split (ModelOptions::cp).
// With cp = 1 a copy.
void cp_local_positions(const int32_t* whole, int32_t* local, int64_t rows, int64_t seq_len, int cp,
                        int cp_rank);

// The pipeline executor drives it through StageModel (stage_model.h); `final` lets every direct
// call on a Model bind statically.
class Model final : public StageModel {
 public:
  // `chunks`: this rank's layer ranges; `tp`: its tensor-parallel group (size 1: no sharding).
  Model(const ModelConfig& config, std::vector<parallel::LayerRange> chunks,
        const parallel::TensorComm& tp, kernels::Arena& arena, const ModelOptions& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const std::vector<parallel::LayerRange>& chunks() const override { return chunks_; }
  const kernels::ParamLayout& layout() const { return layout_; }
  const std::vector<ParamInfo>& params() const { return params_; }  // layout order
  kernels::ModelState& state() { return state_; }
  int64_t rows() const { return rows_; }  // tokens per micro-batch: micro_rows · seq_len / cp
  // Floats of one chunk input / output / input gradient on this rank: rows·C, or rows/tp·C with
  // sequence parallelism (what pipeline stages send each other).
  int64_t io_floats() const override { return rows_local_ * config_.dim; }
  const kernels::Exec& exec() const override { return options_.exec; }
  // Sequence parallelism leaves each tp rank with the norm-weight gradient of its own rows only,
  // and the q/k norms' (model.qk_norm, whatever sp) hold its own heads' share: sum those over
  // tp, before the dp reduction, for the replicated tensors that lie inside `range` (of the
  // gradient region), whose gradients start at `data`.
  void sum_replicated_grads(const parallel::FloatRange& range, float* data) const;
  int tp_rank() const { return tp_.rank(); }
  int tp_size() const { return tp_.size(); }

  // Deterministic and layout-independent: element g of a global tensor is drawn from a counter
  // hash of (seed, name, g), so every layout starts from the same global model.
  // Each tensor is drawn on the host and handed to `keep` with its offset in the parameter
  // region (floats); the default keeps it in the model's own region (a named crossing,
  // kernels::copy_from_host). A ZeRO-3 model has no region: its caller keeps the shard's slices,
  // so the whole model never exists on one rank.
  using InitSink = std::function<void(int64_t offset, const float* values, int64_t n)>;
  void init(uint64_t seed, const InitSink& keep = {});

  // Forward of `chunk` for the micro-batch in `slot`. The first chunk reads `tokens` (rows); other
  // chunks read input(chunk, slot), filled by the caller (pipeline receive). The last chunk also
  // takes `targets` and keeps the summed loss over the micro-batch's tokens in the Exec's memory
  // (take_loss_sum reads it); with `training` it computes the loss gradient scaled by
  // `grad_scale` right away (no logits kept per slot).
  void forward(int chunk, int slot, const int32_t* tokens, const int32_t* targets, float grad_scale,
               bool training) override;
  // The kept losses of the last chunk's forwards since the last call, added in double in the
  // order the forwards ran (0 when none): one crossing for all of them, so that a dense
  // micro-batch's forward makes the host wait for nothing (on a GPU the stream runs on).
  double take_loss_sum() override;
  // Backward of `chunk`: `dout` is the gradient of its output (nullptr for the last chunk, which
  // starts from its loss). Parameter gradients accumulate; the first chunk stops at the
  // embedding, others leave the gradient of their input in input_grad(chunk).
  void backward(int chunk, int slot, const float* dout) override;
  // The same backward in two parts (ModelOptions::split_backward): B computes the input gradient
  // (and the cheap norm and embedding weight gradients) and keeps what W needs; W, run later,
  // computes the projections' weight gradients (a mixture-of-experts block's router, routed and
  // shared experts' too; under expert parallelism the routed experts' at their ranks, from the
  // rows kept there, with no exchange in W). Recomputed blocks do all of it in B, since their
  // activations live in a buffer the next recompute overwrites.
  void backward_input(int chunk, int slot, const float* dout) override;
  void backward_weight(int chunk, int slot) override;

  float* input(int chunk, int slot) override;  // (rows, C): activations from the previous chunk
  const float* output(int chunk, int slot) const override;  // (rows, C): for the next chunk
  // (rows, C): gradient of the chunk's input, per slot so a send can still be in flight while the
  // next micro-batch's backward runs.
  const float* input_grad(int chunk, int slot) const override;

  // Gradient units: float ranges of the gradient region that become final together. Unit -1 is
  // the embedding, l a transformer block, n_layers the final norm and LM head, experts_unit(l)
  // block l's routed experts (model_spec.h). In region order; those of one state group are
  // contiguous, the dense group first.
  struct GradUnit {
    int64_t unit;
    parallel::FloatRange range;
  };
  std::vector<GradUnit> grad_units() const { return units_; }
  std::vector<GradUnit> grad_units(StateGroup group) const;
  // The part of the region a state group's units take (group_units in model_spec.h).
  const parallel::FloatRange& group_region(StateGroup group) const {
    return group_region_[static_cast<size_t>(group)];
  }
  // The routed experts this rank holds (all, or its EP rank's share).
  const ExpertRange& experts() const { return experts_; }
  // The hooks below are per state group: each group's ShardedState sets its own.
  // Called with a unit id each time a micro-batch has added its gradient to that unit (the data
  // parallel reducer starts a bucket once all micro-batches have).
  void set_grad_hook(StateGroup group, std::function<void(int64_t unit)> hook) {
    grad_hook_[static_cast<size_t>(group)] = std::move(hook);
  }
  // Where a unit's gradients accumulate (its first float), asked right before every write to them
  // (a pointer is not kept across another unit's writes: ZeRO-2 may move the unit meanwhile).
  // Default: the gradient region.
  void set_grad_source(StateGroup group, std::function<float*(int64_t unit)> source) {
    grad_source_[static_cast<size_t>(group)] = std::move(source);
  }
  // Where a unit's weights are (its first float), asked right before every read of them, as for
  // gradients. Default: the parameter region. ZeRO-3 gathers them there.
  void set_weight_source(StateGroup group, std::function<const float*(int64_t unit)> source) {
    weight_source_[static_cast<size_t>(group)] = std::move(source);
  }

  // The bf16 GEMMs' copy of the weights (kernels/exec.h, WeightCopy; exec() carries it):
  // round_weights rounds this rank's parameter region into it and makes it current, so that the
  // passes that follow read it instead of rounding each weight at every GEMM call (the same
  // bits); forget_rounded_weights ends that before anything writes a weight again (the
  // optimizer, a restore). RoundedWeights (below) is the pair around a step's passes. Nothing
  // without a bf16 GEMM kind or a parameter region (ZeRO-3's gathered weights are rounded per
  // call). The copy is library memory outside the arena (2 bytes a parameter), made at first use.
  void round_weights();
  void forget_rounded_weights() { weight_copy_->current = false; }

  // Memory this model took from the arena at build time, by kind.
  struct Footprint {
    size_t params = 0, grads = 0, optimizer = 0, activations = 0, scratch = 0;
  };
  const Footprint& footprint() const { return footprint_; }

  // The spec's activation rows of every chunk and slot, then its scratch rows, in allocation
  // order, each with the pointer the model bound it to (read back from the member the math
  // uses): a test checks that they tile the arena's activation and scratch regions.
  struct BoundRow {
    std::string name;  // the arena's
    const void* data;
    size_t bytes;  // as the arena rounds them
  };
  std::vector<BoundRow> bound_rows() const;

  // Mixture of experts, since the last reset_moe_stats: the tokens routed to each expert by the
  // training forwards (recomputes not counted), E per held MoE block in moe_layers() order, and
  // the weighted auxiliary loss they added (ModelOptions::moe_aux_weight; 0 when off), and the
  // slots the capacity dropped, one per held MoE block.
  const std::vector<int64_t>& moe_layers() const { return moe_layers_; }
  const std::vector<double>& expert_counts() const { return expert_counts_; }
  const std::vector<double>& dropped_slots() const { return dropped_slots_; }
  double aux_loss() const { return aux_loss_; }
  void reset_moe_stats();

  // Non-finite values in the stored activations of `slot`: the global index of the first block
  // whose output has one (-1: the embedding output), or INT64_MAX when all are finite.
  int64_t first_nonfinite_layer(int slot) const;

 private:
  // The tp shard of `p` (row-major) drawn from N(0, stddev²) by element of the global tensor.
  void draw_normal(const ParamInfo& p, uint64_t key, float stddev, float* data) const;
  using BlockParams = BlockTensors<float*>;       // one transformer block's gradients
  using ConstBlock = BlockTensors<const float*>;  // one transformer block's weights
  struct LayerActs;
  // A mixture-of-experts block's routing counts as the host holds them for one micro-batch: the
  // one place a block's math needs arena values on the host (the experts' GEMM shapes, the
  // all-to-alls' counts). The forward makes them (routing_to_host, moe_ep_dispatch) and keeps
  // them with the block's activations, so that its backward reads them without a crossing.
  struct BlockRouting {
    std::vector<int64_t> offsets;  // E + 1: the permutation's expert boundaries
    std::vector<int32_t>
        ep_recv;  // P·El under expert parallelism: the rows each EP rank sends here
    // A recomputed block's slot maps (N·K each; empty for other blocks): its arena rows are the
    // work block's, which other blocks overwrite, so the training forward keeps the maps here
    // and the recompute copies them back in (an upload: no wait) instead of routing again.
    std::vector<int32_t> row_of_slot, slot_of_row;
  };
  struct LayerGrads;
  struct ChunkActs;
  struct Scratch;
  // A bf16-stored block's kept tensors, by BlockAct: bf16 or fp32 as the spec's stored rows say.
  using StoredBlock = std::array<void*, kBlockActs>;
  // The member of row `index` (BlockAct), of the row's element type (T3D_BLOCK_ACTS): read, and
  // bound to arena memory.
  static void* block_act(const LayerActs& a, int index);
  static void set_block_act(LayerActs& a, int index, void* p);
  static float*& wgrad(LayerGrads& g, int index);  // the member of row `index` (WGrad)
  bool stored16(int64_t local_layer) const { return options_.bf16 && !recomputed(local_layer); }
  // The bf16 copies a bf16-stored block's forward fills itself (all null for other blocks): its
  // GEMM inputs, rounded once there and read as they are by the backward's GEMMs, and with bf16
  // GEMMs gate and up, which the fused SwiGLU writes along with h (whose floats then never
  // exist). encode16 leaves those rows alone; decode16 skips the rows nothing reads as floats.
  struct BlockCopies {
    kernels::bf16 *xn1 = nullptr, *att = nullptr, *xn2 = nullptr, *h = nullptr;
    kernels::bf16 *gate = nullptr, *up = nullptr;
    kernels::bf16 *egate = nullptr, *eup = nullptr, *eh = nullptr;  // the routed experts' rows
    kernels::bf16 *sgate = nullptr, *sup = nullptr, *sh = nullptr;  // the shared experts' rows
    bool fused_swiglu = false;  // bf16 GEMMs: SwiGLU reads and writes the copies
    // The routed experts' copies for their fused SwiGLU (kernels/ops_moe.h), or all null.
    kernels::ExpertCopies experts() const {
      return fused_swiglu ? kernels::ExpertCopies{egate, eup, eh} : kernels::ExpertCopies{};
    }
    // The dense MLP's and the shared experts' (kernels/ops_swiglu.h).
    kernels::SwigluCopies mlp() const { return {gate, up, h, fused_swiglu}; }
    kernels::SwigluCopies shared() const { return {sgate, sup, sh, fused_swiglu}; }
  };
  BlockCopies block_copies(ChunkActs& a, int64_t local_layer) const;
  static bool filled_by_forward(int index, bool bf16_gemms);
  static bool only_copy_read(int index, bool bf16_gemms);
  void encode16(LayerActs& from, const StoredBlock& to) const;
  void decode16(const StoredBlock& from, LayerActs& to) const;
  bool recomputed(int64_t local_layer) const {
    return recomputed_block(local_layer, options_.checkpoint_every);
  }

  // The constructor's parts: parameters and their regions, then the spec's activations and
  // scratch, each row bound to its pointer.
  void build_params();
  void allocate_activations(const ActivationSpec& spec);
  void allocate_scratch(const ActivationSpec& spec);
  void bind(ChunkActs& a, const parallel::LayerRange& range, const SpecTensor& t, void* p);
  void bind_scratch(ScratchBuf buf, void* p);
  // The pointer bound to row `t` (the reverse of bind and bind_scratch, for bound_rows).
  const void* bound(const ChunkActs& a, const parallel::LayerRange& range,
                    const SpecTensor& t) const;
  const void* bound_scratch(const SpecTensor& t) const;

  // What a block's forward is for: a training forward (MoE statistics and auxiliary loss), its
  // recompute in the backward (activation checkpointing: a MoE block reuses the routing its
  // training forward kept), or an evaluation.
  enum class BlockPass { kTraining, kRecompute, kEvaluation };
  void forward_layer(int64_t layer, LayerActs& a, const BlockCopies& copies, const float* x_in,
                     float* x_out, BlockPass pass);
  // A mixture-of-experts block's MLP part: from a.xn2 to its output in scratch tmp (before the
  // tp reduction); and its backward from dy (N, C) to the gradient of xn2 in scratch dxn.
  void moe_forward(int64_t layer, LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                   BlockPass pass);
  // With `keep` (split backward) its weight gradients are left to moe_backward_weights (W),
  // the output gradients they need kept there.
  void moe_backward(int64_t layer, LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                    const BlockParams& g, const float* dy, const LayerGrads* keep);
  void moe_backward_weights(int64_t layer, const LayerActs& a, const BlockCopies& copies,
                            const BlockParams& g, const LayerGrads& kept);
  // The forward's permutation of a.chosen into a.routing's offsets (host) and the slot maps
  // a.row_of_slot / a.slot_of_row (the capacity's drops included), through routing_host_ (or
  // a recomputed block's own maps in a.routing); returns the slots dropped. The named host
  // crossing below: the backward, W and a recompute read what it kept and make the host wait for
  // nothing.
  int64_t routing_to_host(const LayerActs& a, BlockPass pass);
  // A training forward's routing statistics of block `layer`: the auxiliary loss (before the
  // routing's crossing, whose wait then finds its value ready), then counts and drops.
  void add_aux_loss(const LayerActs& a, const kernels::RouterShape& r);
  void count_routing(int64_t layer, int64_t dropped);
  // The router's backward from the gates' gradient (scratch moe_dgates) into scratch dxn and its
  // weight gradient (or, with `keep`, the dlogits W reads).
  void router_backward(const LayerActs& a, const ConstBlock& w, const BlockParams& g,
                       const LayerGrads* keep);
  // The shared experts' sigmoid gate (model_shared_gate.cpp; model.shared_expert_gate): the
  // shared experts' down projection added to scratch tmp, gated where the block has the gate;
  // the gate's backward before the shared experts' (returns the gradient they take: g ⊙ dy, or
  // dy without a gate; with `keep` also kept for W) and after (its part of dxn, and its weight
  // gradient unless W takes it from the dz kept).
  void shared_experts_down(int64_t layer, LayerActs& a, const BlockCopies& copies,
                           const ConstBlock& w);
  const float* shared_gate_backward(int64_t layer, const LayerActs& a, const BlockCopies& copies,
                                    const ConstBlock& w, const float* dy, const LayerGrads* keep);
  void shared_gate_backward_finish(int64_t layer, const LayerActs& a, const ConstBlock& w,
                                   const BlockParams& g, const LayerGrads* keep);
  void shared_gate_weight_grad(const LayerActs& a, const BlockParams& g, const float* dz);
  kernels::ExpertShape expert_shape() const;  // every routed expert on this rank (no EP)
  static kernels::SwigluWeights shared_weights(const ConstBlock& w);
  // Expert parallelism: the routed experts' part of moe_forward / moe_backward on the EP group.
  int ep_size() const { return options_.ep ? options_.ep->size() : 1; }
  // The EP group's tensor transfers (ModelOptions::ep_tensors, else ep).
  const parallel::TensorComm& ep_rows() const {
    return options_.ep_tensors ? *options_.ep_tensors : *options_.ep;
  }
  // The forward's dispatch is started (counts exchanged, rows under way) before the shared
  // experts' compute and finished after it: moe_experts_ep_forward takes the rows in flight.
  // Its exchange is ep_exchange_, which carries one exchange at a time.
  struct RowsInFlight {
    float* recv = nullptr;  // where the rows land (bf16 on the wire: widened at finish)
    int64_t rows = 0;
  };
  // The routed experts' input rows (one rank's experts: the permuted slots of xn2, `rows` of
  // them) into scratch moe_rows: with the fused SwiGLU gathered from xn2's rounded copy into the
  // first half of moe_rows (the rows rounded, whose floats are not written), else the floats.
  // Returns the experts' copies to run with.
  kernels::ExpertCopies gather_expert_rows(const LayerActs& a, const BlockCopies& copies,
                                           int64_t rows);
  RowsInFlight moe_ep_dispatch(LayerActs& a);
  void moe_experts_ep_forward(LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                              RowsInFlight& dispatch);
  // The backward's: the gates and output gradients go out, the shared experts' gradients that
  // need nothing back are computed meanwhile, then the routed experts' backward.
  RowsInFlight moe_ep_dispatch_backward(LayerActs& a);
  void moe_experts_ep_backward(LayerActs& a, const BlockCopies& copies, const ConstBlock& w,
                               const BlockParams& g, RowsInFlight& dispatch,
                               const LayerGrads* keep);
  // ep_route_ from a block's routing: its offsets and the counts each EP rank sends here.
  void ep_plan(const BlockRouting& routing);
  // An all-to-allv of rows of model.dim floats over the EP group: `sent` rows per EP rank out
  // of `send`, `received` into `recv` (ep_route_'s counts, or their mirror). fp32, or bf16 when
  // the model stores bf16 (the precision of TP traffic too): each row rounded once on the way.
  // ep_exchange = start_ep_exchange, then finish_ep_exchange.
  void ep_exchange(const float* send, const std::vector<int>& sent, const std::vector<int>& sent_at,
                   float* recv, const std::vector<int>& received,
                   const std::vector<int>& received_at);
  RowsInFlight start_ep_exchange(const float* send, const std::vector<int>& sent,
                                 const std::vector<int>& sent_at, float* recv,
                                 const std::vector<int>& received,
                                 const std::vector<int>& received_at);
  void finish_ep_exchange(RowsInFlight& rows);
  bool moe_block(int64_t layer) const { return config_.moe_block(layer); }
  void backward_attention(const LayerActs& a, float* dq, float* dk, float* dv);
  // model.qkv_bias: q, k, v (this rank's heads, N rows) += their biases before the q/k norms and
  // RoPE; and the biases' gradients += the column sums of dq, dk, dv (the projections' outputs').
  void add_qkv_bias(const ConstBlock& w, float* q, float* kk, float* v) const;
  void qkv_bias_grads(const BlockParams& g, const float* dq, const float* dk,
                      const float* dv) const;
  // model.qk_norm: dq, dk (N rows of this rank's heads) from the gradients of the normalised q, k
  // to those of the projections' outputs (in place, through s.datt); the norms' weight gradients
  // += this rank's heads' share (sum_replicated_grads adds the tp ranks' up).
  void qk_norm_backward(const LayerActs& a, const ConstBlock& w, const BlockParams& g, float* dq,
                        float* dk) const;
  void backward_layer(int64_t layer, LayerActs& a, const BlockCopies& copies, const float* x_in,
                      float* dx_io, const LayerGrads* keep);
  void backward_layer_weights(int64_t layer, const LayerActs& a, const BlockCopies& copies,
                              const LayerGrads& keep);
  void backward_impl(int chunk, int slot, const float* dout, bool defer_weights);
  void forward_head(ChunkActs& c, const int32_t* host_targets, float grad_scale, bool training);
  // forward_head's micro-batch loss: summed in order into the next of loss_sums_'s doubles (the
  // kept ones first added into loss_sum_ when all kKeptLossSums are taken).
  void keep_loss_sum(const float* losses, int64_t n);
  void gather_loss_sums();  // the kept sums added into loss_sum_, in order (one crossing)
  // Weight and gradient of `name`, a tensor of unit `unit`; and of block l's tensors.
  const float* w(const std::string& name, int64_t unit) const;
  float* g(const std::string& name, int64_t unit) const;
  ConstBlock block_weights(int64_t l) const;
  BlockParams block_grads(int64_t l) const;
  const float* unit_weights(int64_t unit) const;
  float* unit_grads(int64_t unit) const;
  void tp_sum(float* data, int64_t n) const;
  const float* gather_rows(const float* local, float* full) const;
  float* reduce_rows(float* partial) const;
  // Context parallelism: the whole sequence's keys (or values) from every cp rank's positions,
  // and the conjugate, the sum of every rank's gradient for this rank's positions.
  // Part `part` of this rank's positions: its (B, part_len) queries against the whole sequence.
  kernels::AttentionShape attention_shape(int64_t part) const;
  int64_t part_begin(int64_t part) const;  // first position of the part in the sequence
  void gather_sequence(const float* local, float* full, int64_t width) const;
  void scatter_sequence_grad(const float* full, float* local, int64_t width) const;

  ModelConfig config_;
  std::vector<parallel::LayerRange> chunks_;
  const parallel::TensorComm& tp_;
  kernels::Arena& arena_;
  ModelOptions options_;
  int64_t rows_ = 0;
  int64_t rows_local_ = 0;  // rows_ / tp with sequence parallelism, else rows_
  int64_t seq_local_ = 0;   // positions of each sequence on this rank: seq_len / cp
  int64_t parts_ = 1;       // contiguous parts they come in: 1, or 2 with context parallelism
  int64_t part_len_ = 0;    // positions per part
  bool cp_ = false;         // options_.cp spans more than one rank
  bool sp_ = false;
  int64_t heads_ = 0, kv_heads_ = 0, ffn_ = 0, vocab_ = 0, vocab_start_ = 0;  // local to tp rank
  ModelDims dims_;  // the spec's sizes on this rank (model_spec.h)
  std::vector<ParamInfo> params_;
  kernels::ParamLayout layout_;
  kernels::ModelState state_;
  // By global layer (held layers only): each block tensor's offset from the start of its unit.
  std::vector<BlockTensors<int64_t>> block_offsets_;
  std::vector<int64_t> unit_begin_;  // [unit + 1]: region offset where the unit starts
  std::vector<GradUnit> units_;
  std::vector<SpecTensor> stored_block_;  // the codec's rows (ActivationSpec::stored_block)
  ActivationSpec spec_;                   // the activation and scratch rows, for bound_rows
  std::vector<std::vector<std::unique_ptr<ChunkActs>>> acts_;  // [chunk][slot]
  std::unique_ptr<Scratch> scratch_;
  Footprint footprint_;
  // Per StateGroup.
  std::array<std::function<void(int64_t)>, 2> grad_hook_;
  std::array<std::function<float*(int64_t)>, 2> grad_source_;
  std::array<std::function<const float*(int64_t)>, 2> weight_source_;
  void unit_done(int64_t unit) const;  // the unit's group's grad hook, if any
  // Block l's gradients are complete for this micro-batch: its unit and its experts' unit.
  void block_done(int64_t layer) const;
  ExpertRange experts_;
  std::array<parallel::FloatRange, 2> group_region_{};  // per StateGroup
  std::vector<int64_t> moe_layers_;    // held mixture-of-experts blocks, in layer order
  std::vector<double> expert_counts_;  // E per held MoE block
  std::vector<double> dropped_slots_;  // per held MoE block
  double aux_loss_ = 0;
  // The routing's host side (routing_to_host), N·K each: a.chosen's copy, and the slot maps
  // moe_permute builds here before they are copied into a.row_of_slot / a.slot_of_row.
  struct RoutingOnHost {
    std::vector<int32_t> chosen, row_of_slot, slot_of_row;
  } routing_host_;
  // Every (chunk, slot, MoE block)'s BlockRouting (LayerActs::routing points at its own).
  std::vector<std::unique_ptr<BlockRouting>> routings_;
  // Expert parallelism's exchange of one block (ep_plan), sized once: rows per EP rank.
  struct EpRoute {
    std::vector<int32_t> mine;  // E: this rank's rows per expert
    std::vector<int> send_counts, send_displs, recv_counts, recv_displs;  // P each
    std::vector<int64_t> local_offsets;   // El + 1: the local experts' rows, expert-major
    std::vector<int64_t> source_offsets;  // El·P + 1: their (expert, source rank) blocks
  } ep_route_;
  int64_t ep_rows_ = 0;  // ModelDims::R: the rows this rank's experts may take
  // Every all_to_allv of the EP group runs in this one exchange, one at a time (its count buffer
  // reused: the exchanges of a step allocate nothing).
  parallel::Comm::Exchange ep_exchange_;
  // round_weights' copy (options_.exec points at it: its address never changes) and its memory.
  std::unique_ptr<kernels::WeightCopy> weight_copy_ = std::make_unique<kernels::WeightCopy>();
  kernels::Buffer weight_copy_memory_;
  std::vector<kernels::Bf16Cast> weight_casts_;  // round_weights' casts (reused: no step allocates)
  // The last chunk's micro-batch losses since take_loss_sum (keep_loss_sum).
  static constexpr int kKeptLossSums = 256;
  kernels::Buffer loss_sums_;  // kKeptLossSums doubles of the Exec's memory, `kept_loss_sums_` used
  int kept_loss_sums_ = 0;
  std::vector<double> loss_sums_on_host_;  // kKeptLossSums: where gather_loss_sums reads them
  double loss_sum_ = 0;                    // the sums gathered before those kept
};

// A step's passes read `model`'s rounded weights (Model::round_weights) while this lives.
class RoundedWeights {
 public:
  explicit RoundedWeights(Model& model) : model_(model) { model_.round_weights(); }
  ~RoundedWeights() { model_.forget_rounded_weights(); }
  RoundedWeights(const RoundedWeights&) = delete;
  RoundedWeights& operator=(const RoundedWeights&) = delete;

 private:
  Model& model_;
};

}  // namespace t3d::runtime
