// What the pipeline executor (runtime/stage/executor.h) needs of this rank's part of the model:
// per local chunk and activation slot, the forward and backward passes and the buffers the
// pipeline traffic reads and fills. Model implements it; tests supply fake stages. It lives in
// model/ because stage/ sits above model/ in the layering and Model must implement it.
//
// The contracts are Model's (runtime/model/model.h), stated here once:
//   - `chunk` indexes chunks() (this rank's chunks, in model order); `slot` is an activation slot
//     of that chunk, below the count the model was built with; one micro-batch per slot from its
//     forward until its backward (BW) or deferred weight pass (W) has run.
//   - forward: the first chunk reads `tokens`, the others input(chunk, slot); the last chunk also
//     reads `targets` and keeps the micro-batch's summed loss; take_loss_sum returns the kept
//     losses since its last call, added in the order the forwards ran (0 on other stages).
//   - backward / backward_input: `dout` is the gradient of the chunk's output (nullptr for the
//     last chunk); every chunk but the first leaves the gradient of its input in
//     input_grad(chunk, slot). backward_weight runs after backward_input of the same slot.
//   - input, output and input_grad each hold io_floats() floats, in the memory of exec() (the
//     executor's hand-over buffers are made there and filled by kernel ops on it).
// One virtual call per micro-batch action: nothing inside a pass goes through this interface.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/exec.h"
#include "parallel/pipeline_split.h"

namespace t3d::runtime {

class StageModel {
 public:
  virtual const std::vector<parallel::LayerRange>& chunks() const = 0;
  virtual int64_t io_floats() const = 0;
  virtual const kernels::Exec& exec() const = 0;

  virtual void forward(int chunk, int slot, const int32_t* tokens, const int32_t* targets,
                       float grad_scale, bool training) = 0;
  virtual double take_loss_sum() = 0;
  virtual void backward(int chunk, int slot, const float* dout) = 0;
  virtual void backward_input(int chunk, int slot, const float* dout) = 0;
  virtual void backward_weight(int chunk, int slot) = 0;

  virtual float* input(int chunk, int slot) = 0;
  virtual const float* output(int chunk, int slot) const = 0;
  virtual const float* input_grad(int chunk, int slot) const = 0;

 protected:
  StageModel() = default;
  ~StageModel() = default;  // not owned through the interface
  StageModel(const StageModel&) = default;
  StageModel& operator=(const StageModel&) = default;
};

}  // namespace t3d::runtime
