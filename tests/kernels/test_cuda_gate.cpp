// The shared experts' sigmoid gate's CUDA twin (kernels/cuda/ops_gate.cu) against the CPU op
// (kernels/ops_gate.h), through the ops' own dispatch (a GPU Exec): bit for bit, as both evaluate
// kernels/row_math.h in one order, and twice with the same bits. Skips where no GPU is visible.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops_gate.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::kernels {
namespace {

const cuda::Stream& gate_stream() { return *cuda::testing::the_gpu().stream; }

// A device copy of a host vector of floats, read back with host().
struct GateDev {
  cuda::DeviceMemory mem;
  std::size_t n = 0;
  explicit GateDev(const std::vector<float>& h)
      : mem(h.size() * sizeof(float), "test"), n(h.size()) {
    cuda::copy_to_device(gate_stream(), mem.data(), h.data(), n * sizeof(float));
  }
  float* p() const { return mem.as<float>(); }
  std::vector<float> host() const {
    std::vector<float> h(n);
    cuda::copy_to_host(gate_stream(), h.data(), mem.data(), n * sizeof(float));
    gate_stream().synchronize();
    return h;
  }
};

struct GateOutputs {
  std::vector<float> out, g, dg, dz, dshared, dx, dw;
  bool operator==(const GateOutputs&) const = default;
};

// Forward and the whole backward on `exec`, from host inputs (device copies made when on a GPU).
GateOutputs run_gate(const Exec& exec, int N, int C) {
  const auto x = ref::random_floats(N * C, 21), w = ref::random_floats(C, 22, -0.3f, 0.3f);
  const auto sh = ref::random_floats(N * C, 23), out0 = ref::random_floats(N * C, 24);
  const auto dy = ref::random_floats(N * C, 25), dx0 = ref::random_floats(N * C, 26);
  const auto dw0 = ref::random_floats(C, 27);
  const std::vector<float> rows(N), zeros(N * C);
  if (!exec.on_gpu()) {
    GateOutputs o{out0, rows, rows, rows, zeros, dx0, dw0};
    shared_gate_forward(exec, o.out.data(), o.g.data(), x.data(), w.data(), sh.data(), N, C);
    shared_gate_backward_dot(exec, o.dg.data(), dy.data(), sh.data(), N, C);
    shared_gate_backward(exec, o.dshared.data(), o.dz.data(), o.dg.data(), o.g.data(), dy.data(), N,
                         C);
    shared_gate_backward_input(exec, o.dx.data(), o.dz.data(), w.data(), N, C);
    shared_gate_backward_weight(exec, o.dw.data(), o.dz.data(), x.data(), N, C);
    return o;
  }
  GateDev dx_(x), dw_(w), dsh(sh), dout(out0), ddy(dy), ddx(dx0), ddw(dw0);
  GateDev dg(rows), dgg(rows), ddz(rows), ddshared(zeros);
  shared_gate_forward(exec, dout.p(), dg.p(), dx_.p(), dw_.p(), dsh.p(), N, C);
  shared_gate_backward_dot(exec, dgg.p(), ddy.p(), dsh.p(), N, C);
  shared_gate_backward(exec, ddshared.p(), ddz.p(), dgg.p(), dg.p(), ddy.p(), N, C);
  shared_gate_backward_input(exec, ddx.p(), ddz.p(), dw_.p(), N, C);
  shared_gate_backward_weight(exec, ddw.p(), ddz.p(), dx_.p(), N, C);
  return {dout.host(), dg.host(), dgg.host(), ddz.host(), ddshared.host(), ddx.host(), ddw.host()};
}

TEST(CudaSharedGate, IsTheCpuBitsAndRepeats) {
  REQUIRE_GPU();
  const Exec gpu(GemmKind::kOpenBlasF32, gate_stream());
  for (const auto& [N, C] : {std::pair{5, 37}, std::pair{300, 256}}) {
    SCOPED_TRACE(testing::Message() << "N " << N << " C " << C);
    const GateOutputs cpu = run_gate(kCpu, N, C);
    const GateOutputs first = run_gate(gpu, N, C), second = run_gate(gpu, N, C);
    EXPECT_EQ(first.out, cpu.out);
    EXPECT_EQ(first.g, cpu.g);
    EXPECT_EQ(first.dg, cpu.dg);
    EXPECT_EQ(first.dz, cpu.dz);
    EXPECT_EQ(first.dshared, cpu.dshared);
    EXPECT_EQ(first.dx, cpu.dx);
    EXPECT_EQ(first.dw, cpu.dw);
    EXPECT_TRUE(first == second) << "two GPU runs differ";
  }
}

}  // namespace
}  // namespace t3d::kernels
