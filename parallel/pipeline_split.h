// Which layers each pipeline chunk holds. Pure: tested without MPI, shared by the model, the
// planner and the simulator.
//
// With pp stages and v virtual stages there are pp·v chunks in model order; chunk k lives on stage
// k % pp (Megatron's interleaving), so with v = 1 chunk k is simply stage k. ZB-V places its two
// chunks per stage in a V instead (stage_of_chunk below).
#pragma once

#include <cstdint>
#include <vector>

namespace t3d::parallel {

struct LayerRange {
  int64_t begin = 0, end = 0;  // [begin, end) of the transformer blocks
  bool first = false;          // holds the token embedding
  bool last = false;           // holds the final norm, the LM head and the loss
  int64_t size() const { return end - begin; }
};

// `split` (pp·v − 1 increasing first-layers) when given, otherwise balanced: the cost of a chunk is
// its layers plus `head_cost` layers' worth for the LM head on the last chunk, and the split
// minimises the largest chunk cost (the pipeline's critical path), every chunk at least one layer.
std::vector<LayerRange> split_layers(int64_t n_layers, int64_t chunks, double head_cost,
                                     const std::vector<int64_t>& split = {});

// The LM head's cost in transformer layers: its FLOPs V·C against a block's 4·C² (attention
// projections at full kv) + 3·C·F (SwiGLU). Attention scores are left out of both.
double head_cost_in_layers(int64_t vocab, int64_t dim, int64_t ffn_dim);

// The stage holding chunk k of pp·v. Round-robin: k % pp. V shape (ZB-V, v = 2): chunks 0..pp-1
// walk down the stages and pp..2pp-1 walk back up, so stage s holds s and 2pp-1-s: stage 0 holds
// the embedding and the LM head, and stage pp-1 holds two consecutive chunks (a local hand-over).
// Inline so that the schedule library, which has no MPI, shares this one definition.
inline int64_t stage_of_chunk(int64_t k, int64_t pp, bool v_shape) {
  return v_shape && k >= pp ? 2 * pp - 1 - k : k % pp;
}

// The layer ranges `stage` holds, in model order: chunk k of `split` wherever the schedule's
// placement table says chunk_stage[k] == stage (parallel/schedule.h; the one representation of
// placement, which the executor runs).
std::vector<LayerRange> layers_of_stage(const std::vector<LayerRange>& split,
                                        const std::vector<int>& chunk_stage, int64_t stage);

}  // namespace t3d::parallel
