// The model's private structures (runtime/model*.cpp only): the pointers its activation and
// scratch rows of the spec table (model_spec.h) are bound to.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/model/model.h"

namespace t3d::runtime {

// Activations one transformer block keeps for its backward, for one micro-batch: the pointers of
// its rows in the spec table (BlockAct; shapes there).
struct Model::LayerActs {
  float *rstd1, *xn1, *q, *kk, *v, *att, *lse, *xmid, *rstd2, *xn2, *gate, *up, *h;
};

// Output gradients a block's deferred weight-gradient pass (W) needs (WGrad rows).
struct Model::LayerGrads {
  float *dy_down = nullptr, *dgate = nullptr, *dup = nullptr, *dy_o = nullptr, *dq = nullptr,
        *dk = nullptr, *dv = nullptr;
};

struct Model::ChunkActs {
  std::vector<float*> x;  // L+1 residual streams (N, C): x[0] the chunk's input, x[L] its output
  std::vector<LayerActs> layers;
  std::vector<LayerGrads> wgrads;  // split backward only; empty pointers for recomputed blocks
  std::vector<StoredBlock> stored;  // bf16 only: the stored copies (blocks not recomputed)
  int32_t* tokens = nullptr;  // (N) first chunk: ids, kept for the embedding backward
  float* xf = nullptr;        // (N, C) last chunk: model.norm output
  float* rstdf = nullptr;     // (N)
  float* dx_last = nullptr;   // (N, C) last chunk: gradient of x[L] from the loss
  float* dx_in = nullptr;     // (N, C) other than the first chunk: gradient of x[0]
};

// Per-rank buffers shared by every chunk and slot: only one forward or backward runs at a time.
struct Model::Scratch {
  float* tmp;      // (N, C)
  float* dx;       // (N, C) running residual gradient of the first chunk
  float* dtmp;     // (N, C)
  float* dxn;      // (N, C)
  float* datt;     // (N, Hl·D)
  float* dq;       // (N, Hl·D)
  float* dk;       // (N, Hkvl·D)
  float* dv;       // (N, Hkvl·D)
  float* dh;       // (N, Fl)
  float* dgate;    // (N, Fl)
  float* dup;      // (N, Fl)
  float* attn;     // attention tiles
  float* logits;   // (N, Vl)
  float* losses;   // (N)
  float* row_max;  // (N)
  float* sum_exp;  // (N)
  float* target;   // (N)
  float* rope;     // (T, D)
  // Context parallelism: the whole sequence's keys and values, their gradients, and a staging
  // buffer in collective order (cp, B, T/cp, width).
  float* k_all = nullptr;    // (B, T, Hkvl·D)
  float* v_all = nullptr;    // (B, T, Hkvl·D)
  float* dk_all = nullptr;   // (B, T, Hkvl·D)
  float* dv_all = nullptr;   // (B, T, Hkvl·D)
  float* cp_stage = nullptr;  // (cp, 2, B, T/(2cp), Hkvl·D)
  float* cp_kv_part = nullptr;  // 2 × (B, T, Hkvl·D): the second part's dk, dv before adding
  uint16_t* tp16 = nullptr;       // (N, C) bf16 TP all-reduce buffer
  uint16_t* tp16_rows = nullptr;  // (N, C) bf16 second buffer for SP gathers / scatters
  float* rows = nullptr;          // (Nl, C) SP: this rank's rows of a gathered or scattered tensor
  float* all_rows = nullptr;      // (N, C) SP: all rows of a gradient gathered for the backward
};

}  // namespace t3d::runtime
