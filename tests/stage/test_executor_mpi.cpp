// PipelineExecutor running every schedule table over fake stages (StageModel), on pipelines of
// 1, 2 and 4 ranks. The fake does exact integer arithmetic on what it is handed, so a wrong
// micro-batch, a skipped or reordered chunk, a stale buffer or a mixed-up slot shows up as a
// value it cannot decode:
//   - micro-batch mb enters chunk 0 as 4·mb + i (element i); chunk k's forward adds 1024·(k+1),
//     so chunk k must receive 4·mb + i + 1024·(1 + ... + k);
//   - the last chunk's backward starts from the gradient 4·mb + i; chunk k's backward adds
//     4096·(k+1), so chunk k must receive 4·mb + i + 4096·((k+2) + ... + K);
//   - a forward's micro-batch is decoded from its input (tokens on chunk 0); a backward's from
//     the slot's forward, and checked against the gradient it receives.
// Every value stays an integer below 2^24: exact in fp32, over MPI and in memory alike.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "parallel/comm.h"
#include "parallel/schedule.h"
#include "runtime/model/stage_model.h"
#include "runtime/stage/executor.h"

namespace t3d::runtime {
namespace {

using parallel::Action;
using parallel::Op;
using parallel::Schedule;
using parallel::ScheduleKind;

constexpr int kIo = 4;  // floats per hand-over

float token_value(int mb, int i) { return static_cast<float>(4 * mb + i); }
// What chunk k's forward receives (k > 0) and what its backward receives (k < K - 1).
float forward_input(int mb, int k, int i) {
  return token_value(mb, i) + 1024.0f * static_cast<float>(k * (k + 1) / 2);
}
float output_grad(int mb, int k, int K, int i) {
  return token_value(mb, i) + 4096.0f * static_cast<float>(K * (K + 1) / 2 - (k + 1) * (k + 2) / 2);
}
int32_t target_value(int mb, int i) { return -(4 * mb + i) - 1; }

// One rank's chunks of the schedule as a StageModel: records every call as the action it
// decodes, and every contract it sees broken as an error (never throws or stops, so that the
// other ranks' traffic still completes).
class FakeStage final : public StageModel {
 public:
  FakeStage(const Schedule& s, int stage, const std::vector<int>& slots)
      : K_(s.num_chunks()), n_micro_(s.n_micro) {
    for (int k = 0; k < K_; ++k) {
      if (s.chunk_stage[k] != stage) continue;
      ranges_.push_back({k, k + 1, k == 0, k == K_ - 1});
      global_.push_back(k);
    }
    // A training run needs slots_per_chunk(); validation runs use slot 0 only.
    for (size_t c = 0; c < ranges_.size(); ++c) {
      const int n = slots.empty() ? 1 : slots.at(c);
      slots_.emplace_back(static_cast<size_t>(n));
    }
  }

  const std::vector<parallel::LayerRange>& chunks() const override { return ranges_; }
  int64_t io_floats() const override { return kIo; }
  const kernels::Exec& exec() const override { return kernels::kCpu; }

  void forward(int c, int slot, const int32_t* tokens, const int32_t* targets, float grad_scale,
               bool training) override {
    Slot* s = at(c, slot, "forward");
    if (!s) return;
    const int k = global_[c];
    if (training != training_) error("F on chunk ", k, ": training = ", training);
    if (training && grad_scale != kGradScale) error("F on chunk ", k, ": grad_scale changed");
    int mb = -1;
    if (k == 0) {
      if (!tokens) return error("F on chunk 0 without tokens");
      mb = tokens[0] / 4;
      for (int i = 0; i < kIo; ++i)
        if (tokens[i] != token_value(mb, i)) error("F on chunk 0: token ", i, " = ", tokens[i]);
    } else {
      mb = static_cast<int>(s->in[0] - forward_input(0, k, 0)) / 4;
      for (int i = 0; i < kIo; ++i)
        if (s->in[i] != forward_input(mb, k, i))
          error("F on chunk ", k, ": input ", i, " = ", s->in[i], ", not what chunk ", k - 1,
                " sent for any micro-batch");
    }
    if (mb < 0 || mb >= n_micro_) return error("F on chunk ", k, ": micro-batch ", mb);
    if (training && s->mb >= 0)
      error("F(", mb, ",", k, ") on slot ", slot, " still held by micro-batch ", s->mb);
    for (int i = 0; i < kIo; ++i)
      s->out[i] = (k == 0 ? token_value(mb, i) : s->in[i]) + 1024.0f * static_cast<float>(k + 1);
    calls_.push_back({Op::kF, mb, k});
    if (training) s->mb = mb, s->input_grad_done = false;
    if (k != K_ - 1) return;
    if (!targets) return error("F on the last chunk without targets");
    for (int i = 0; i < kIo; ++i)
      if (targets[i] != target_value(mb, i)) error("F(", mb, ",", k, "): wrong targets");
    kept_loss_ += mb + 1;  // the loss of micro-batch mb
  }
  double take_loss_sum() override { return std::exchange(kept_loss_, 0.0); }

  void backward(int c, int slot, const float* dout) override { input_grad(c, slot, dout, Op::kBW); }
  void backward_input(int c, int slot, const float* dout) override {
    input_grad(c, slot, dout, Op::kB);
  }
  void backward_weight(int c, int slot) override {
    Slot* s = at(c, slot, "W");
    if (!s) return;
    const int k = global_[c];
    if (s->mb < 0 || !s->input_grad_done) error("W on chunk ", k, " slot ", slot, " before its B");
    calls_.push_back({Op::kW, s->mb, k});
    s->mb = -1;
  }

  float* input(int c, int slot) override {
    Slot* s = at(c, slot, "input");
    return s ? s->in : spare_;
  }
  const float* output(int c, int slot) const override { return slots_.at(c).at(slot).out; }
  const float* input_grad(int c, int slot) const override { return slots_.at(c).at(slot).in_grad; }

  // Before each run: what it is expected to be called with.
  void start(bool training) {
    training_ = training;
    calls_.clear();
  }
  static constexpr float kGradScale = 0.5f;
  const std::vector<Action>& calls() const { return calls_; }
  const std::vector<std::string>& errors() const { return errors_; }
  int live_slots() const {
    int n = 0;
    for (const auto& chunk : slots_)
      for (const auto& s : chunk) n += s.mb >= 0;
    return n;
  }

 private:
  struct Slot {
    float in[kIo] = {}, out[kIo] = {}, in_grad[kIo] = {};
    int mb = -1;  // the micro-batch whose forward ran and whose BW or W has not
    bool input_grad_done = false;
  };
  double kept_loss_ = 0;  // the last chunk's losses since take_loss_sum

  template <typename... A>
  void error(const A&... parts) {
    std::ostringstream s;
    (s << ... << parts);
    errors_.push_back(s.str());
  }
  Slot* at(int c, int slot, const char* what) {
    if (c < 0 || c >= static_cast<int>(slots_.size()) || slot < 0 ||
        slot >= static_cast<int>(slots_[c].size())) {
      error(what, ": chunk ", c, " slot ", slot, " out of range");
      return nullptr;
    }
    return &slots_[c][slot];
  }

  void input_grad(int c, int slot, const float* dout, Op op) {
    Slot* s = at(c, slot, "backward");
    if (!s) return;
    const int k = global_[c];
    const int mb = s->mb;
    if (mb < 0 || s->input_grad_done)
      return error(to_string(op), " on chunk ", k, " slot ", slot, " with no forward pending");
    if ((k == K_ - 1) != (dout == nullptr))
      return error(to_string(op), "(", mb, ",", k, "): dout ", dout ? "given" : "missing");
    float dx[kIo];
    for (int i = 0; i < kIo; ++i) {
      const float g = dout ? dout[i] : token_value(mb, i);
      if (g != output_grad(mb, k, K_, i))
        error(to_string(op), "(", mb, ",", k, "): output gradient ", i, " = ", g);
      dx[i] = g + 4096.0f * static_cast<float>(k + 1);
    }
    if (k > 0) std::copy(dx, dx + kIo, s->in_grad);
    calls_.push_back({op, mb, k});
    if (op == Op::kBW)
      s->mb = -1;
    else
      s->input_grad_done = true;
  }

  int K_, n_micro_;
  std::vector<parallel::LayerRange> ranges_;
  std::vector<int> global_;  // local chunk -> global chunk
  std::vector<std::vector<Slot>> slots_;
  float spare_[kIo] = {};  // where an out-of-range input() lands (already reported)
  bool training_ = true;
  std::vector<Action> calls_;
  std::vector<std::string> errors_;
};

std::string listing(const std::vector<Action>& actions) {
  std::string s;
  for (const auto& a : actions) s += to_string(a) + " ";
  return s;
}

class ExecutorTest : public ::testing::Test {
 protected:
  parallel::Comm world = parallel::Comm::world(60.0);

  // Pipelines of `pp` consecutive world ranks each run `s` for two steps (the executor keeps its
  // buffers between steps), then one validation pass.
  void run_schedule(const Schedule& s) {
    const int pp = s.pp;
    ASSERT_EQ(world.size() % pp, 0);
    const parallel::Comm group = world.split(world.rank() / pp, world.rank() % pp, "pp");
    const int stage = group.rank();
    SCOPED_TRACE(std::string(to_string(s.kind)) + " pp=" + std::to_string(pp) +
                 " v=" + std::to_string(s.v) + " micro-batches=" + std::to_string(s.n_micro) +
                 " stage " + std::to_string(stage));
    std::vector<std::vector<int32_t>> tokens(s.n_micro), targets(s.n_micro);
    for (int mb = 0; mb < s.n_micro; ++mb)
      for (int i = 0; i < kIo; ++i) {
        tokens[mb].push_back(static_cast<int32_t>(token_value(mb, i)));
        targets[mb].push_back(target_value(mb, i));
      }
    const MicroBatchSource source = [&](int mb, const int32_t** t, const int32_t** g) {
      *t = tokens.at(mb).data();
      *g = targets.at(mb).data();
    };
    PipelineExecutor executor(s, group, WirePrecision::kFp32);
    FakeStage fake(s, stage, executor.slots_per_chunk());
    const bool last = s.chunk_stage.back() == stage;
    const double all_losses = s.n_micro * (s.n_micro + 1) / 2.0;

    for (int step = 0; step < 2; ++step) {
      fake.start(true);
      const double loss = executor.run(fake, source, FakeStage::kGradScale, true);
      for (const auto& e : fake.errors()) ADD_FAILURE() << "step " << step << ": " << e;
      // The decoded micro-batches are the table's: each action ran on the data of its own
      // micro-batch, in the table's order.
      EXPECT_EQ(listing(fake.calls()), listing(s.ranks[stage])) << "step " << step;
      EXPECT_EQ(fake.live_slots(), 0) << "micro-batches left without their BW or W";
      EXPECT_EQ(loss, last ? all_losses : 0.0) << "step " << step;
      // Over the whole pipeline: every (micro-batch, chunk) has one F and one BW, or one B and
      // one W.
      const int K = s.num_chunks();
      std::vector<int> count(static_cast<size_t>(s.n_micro * K * 4), 0);
      for (const auto& a : fake.calls()) ++count[(a.mb * K + a.chunk) * 4 + int(a.op)];
      group.all_reduce(count.data(), count.size());
      for (int mb = 0; mb < s.n_micro; ++mb)
        for (int k = 0; k < K; ++k) {
          const int* n = &count[(mb * K + k) * 4];
          EXPECT_EQ(n[int(Op::kF)], 1) << "F(" << mb << "," << k << ")";
          const bool split = n[int(Op::kB)] == 1 && n[int(Op::kW)] == 1 && n[int(Op::kBW)] == 0;
          const bool whole = n[int(Op::kB)] == 0 && n[int(Op::kW)] == 0 && n[int(Op::kBW)] == 1;
          EXPECT_TRUE(split || whole) << "backward of (" << mb << "," << k << ")";
        }
    }

    // Validation: micro-batch by micro-batch, this stage's chunks in model order, no backward.
    FakeStage forward_only(s, stage, {});
    forward_only.start(false);
    const double loss = executor.run(forward_only, source, 0.0f, false);
    for (const auto& e : forward_only.errors()) ADD_FAILURE() << "validation: " << e;
    std::vector<Action> want;
    for (int mb = 0; mb < s.n_micro; ++mb)
      for (int k = 0; k < s.num_chunks(); ++k)
        if (s.chunk_stage[k] == stage) want.push_back({Op::kF, mb, k});
    EXPECT_EQ(listing(forward_only.calls()), listing(want));
    EXPECT_EQ(loss, last ? all_losses : 0.0);
  }

  // pp = 1, 2, 4 where the world divides.
  std::vector<int> pipeline_sizes() const {
    std::vector<int> out;
    for (int pp : {1, 2, 4})
      if (world.size() % pp == 0) out.push_back(pp);
    return out;
  }
};

TEST_F(ExecutorTest, GPipe) {
  for (int pp : pipeline_sizes())
    for (int m : {1, pp, 2 * pp + 1}) run_schedule(parallel::make_gpipe(pp, m));
}

TEST_F(ExecutorTest, OneFOneB) {
  for (int pp : pipeline_sizes())
    for (int m : {1, pp, 2 * pp + 1}) run_schedule(parallel::make_1f1b(pp, m));
}

// pp = 1 with two and three chunks: every hand-over is in memory.
TEST_F(ExecutorTest, Interleaved) {
  for (int pp : pipeline_sizes())
    for (int v : {2, 3})
      for (int m : {pp, 3 * pp}) run_schedule(parallel::make_interleaved_1f1b(pp, m, v));
}

TEST_F(ExecutorTest, ZeroBubbleH1) {
  for (int pp : pipeline_sizes())
    for (int m : {1, pp, 2 * pp + 1}) run_schedule(parallel::make_zb_h1(pp, m));
}

// The V turns on stage pp - 1 (chunks pp - 1 and pp): that hand-over is in memory.
TEST_F(ExecutorTest, ZeroBubbleV) {
  for (int pp : pipeline_sizes())
    if (pp >= 2)
      for (int m : {1, pp, 2 * pp + 1}) run_schedule(parallel::make_zb_v(pp, m));
}

// Slots: a chunk's count is its peak of live micro-batches, and the fake's slot checks above
// hold with exactly that many.
TEST_F(ExecutorTest, SlotsArePeaksOfLiveMicroBatches) {
  for (int pp : pipeline_sizes()) {
    const parallel::Comm group = world.split(world.rank() / pp, world.rank() % pp, "pp");
    const Schedule s = parallel::make_1f1b(pp, 2 * pp + 1);
    PipelineExecutor executor(s, group, WirePrecision::kFp32);
    ASSERT_EQ(executor.slots_per_chunk().size(), 1u);
    EXPECT_EQ(executor.slots_per_chunk()[0], pp - group.rank()) << "1F1B stage " << group.rank();
    EXPECT_FALSE(executor.splits_backward());
    EXPECT_TRUE(PipelineExecutor(parallel::make_zb_h1(pp, 4), group, WirePrecision::kFp32)
                    .splits_backward());
  }
}

}  // namespace
}  // namespace t3d::runtime
