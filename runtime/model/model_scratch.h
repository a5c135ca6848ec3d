// The model's private structures (runtime/model*.cpp only): the pointers its activation and
// scratch rows of the spec table (model_spec.h) are bound to, one member per row, generated from
// the rows themselves (T3D_BLOCK_ACTS, T3D_WGRADS, T3D_SCRATCH; shapes there).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/model/model.h"

namespace t3d::runtime {

// Activations one transformer block keeps for its backward, for one micro-batch.
struct Model::LayerActs {
#define T3D_ROW_MEMBER(e, member, name, type, ...) type* member = nullptr;
  T3D_BLOCK_ACTS(T3D_ROW_MEMBER)
#undef T3D_ROW_MEMBER
  // Host memory, a mixture-of-experts block's only: this (chunk, slot, block)'s own, also where
  // the block's arena rows are the shared work block's.
  BlockRouting* routing = nullptr;
};

// Output gradients a block's deferred weight-gradient pass (W) needs.
struct Model::LayerGrads {
#define T3D_ROW_MEMBER(e, member, ...) float* member = nullptr;
  T3D_WGRADS(T3D_ROW_MEMBER)
#undef T3D_ROW_MEMBER
};

struct Model::ChunkActs {
  std::vector<float*> x;  // L+1 residual streams (N, C): x[0] the chunk's input, x[L] its output
  std::vector<LayerActs> layers;
  std::vector<LayerGrads> wgrads;   // split backward only; empty pointers for recomputed blocks
  std::vector<StoredBlock> stored;  // bf16 only: the stored copies (blocks not recomputed)
  int32_t* tokens = nullptr;        // (N) first chunk: ids, kept for the embedding backward
  float* xf = nullptr;              // (N, C) last chunk: model.norm output
  float* rstdf = nullptr;           // (N)
  float* dx_last = nullptr;         // (N, C) last chunk: gradient of x[L] from the loss
  float* dx_in = nullptr;           // (N, C) other than the first chunk: gradient of x[0]
};

// Per-rank buffers shared by every chunk and slot: only one forward or backward runs at a time.
// Rows absent from this rank's spec (sp, cp, last-chunk or bf16-only ones) stay null.
struct Model::Scratch {
#define T3D_ROW_MEMBER(e, member, name, type, ...) type* member = nullptr;
  T3D_SCRATCH(T3D_ROW_MEMBER)
#undef T3D_ROW_MEMBER
  // The work block (kWorkBlock rows): the activations every recomputed or bf16-stored block
  // computes in, rebuilt right before its backward.
  LayerActs work;
};

}  // namespace t3d::runtime
