// The mixture-of-experts ops on a GPU (kernels/ops_moe.h's CUDA twins, kernels/cuda/ops_moe.cu)
// against the CPU's, called through the kernels:: ops with a GPU Exec (so the dispatch is tested
// too), on random inputs. Bit for bit where both evaluate kernels/moe_math.h's arithmetic in the
// same order (the router's backward and its selection on given scores, the gathers, the combine,
// the slot moves, the gate gradients, the auxiliary loss); the router's scores within 1e-6 (CUDA's
// expf against libm's); the experts' cuBLAS GEMMs within 1e-5 of each tensor's largest value
// (fp32 sums in another order). Every GPU result repeats its bits. Each test needs a GPU and skips
// with the reason where the process sees none.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "kernels/ops.h"
#include "kernels/ops_moe.h"
#include "kernels/precision.h"
#include "tests/kernels/gpu_compare.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/the_gpu.h"

namespace t3d::kernels {
namespace {

using cuda::testing::expect_close;
using cuda::testing::expect_same_bits;
using cuda::testing::S;
using I32 = std::vector<std::int32_t>;

Exec on_gpu(GemmKind kind = GemmKind::kOpenBlasF32) { return Exec(kind, S()); }

// A copy of a host vector in an Exec's memory (host or device), read back with host(): the same
// test code runs each op on either backend.
template <class T>
struct Mem {
  Buffer buffer;
  Exec exec;
  std::size_t n = 0;
  Mem(const Exec& e, const std::vector<T>& h) : exec(e), n(h.size()) {
    buffer.reserve(e, std::max<std::size_t>(n, 1) * sizeof(T), "test");
    copy_from_host(e, buffer.as<T>(), h.data(), n * sizeof(T));
  }
  Mem(const Exec& e, std::size_t count, T fill = T{}) : Mem(e, std::vector<T>(count, fill)) {}
  T* p() const { return buffer.as<T>(); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    copy_to_host(exec, h.data(), buffer.as<T>(), n * sizeof(T));
    return h;
  }
};

I32 random_experts(std::size_t n, int E, std::uint32_t seed) {  // in [0, E)
  std::mt19937 rng(seed);
  I32 c(n);
  for (auto& e : c) e = static_cast<std::int32_t>(rng() % static_cast<unsigned>(E));
  return c;
}

// Every |gpu - cpu| within rtol times the largest |cpu| (a whole-tensor relative bound: a GEMM's
// reordered sum errs relative to its terms, not to an output that cancels to near zero).
void expect_close_to_scale(const std::vector<float>& gpu, const std::vector<float>& cpu,
                           double rtol, const char* what) {
  double scale = 0;
  for (float v : cpu) scale = std::max(scale, std::fabs(static_cast<double>(v)));
  expect_close(gpu, cpu, 0.0, rtol * scale, what);
}

// ---- the router ---------------------------------------------------------------------------

struct Routed {
  std::vector<float> scores, gates;
  I32 chosen;
};

Routed route(const Exec& exec, const std::vector<float>& logits, const std::vector<float>* bias,
             const RouterShape& r) {
  Mem<float> s(exec, logits), g(exec, r.N * r.K), b(exec, bias ? *bias : std::vector<float>{});
  Mem<std::int32_t> c(exec, r.N * r.K);
  moe_route_forward(exec, s.p(), c.p(), g.p(), s.p(), bias ? b.p() : nullptr, r);  // in place
  return {s.host(), g.host(), c.host()};
}

TEST(CudaMoe, RouterIsTheCpusWithinExpAndRepeats) {
  REQUIRE_GPU();
  const int N = 300, E = 16, K = 4;
  auto logits = ref::random_floats(N * E, 400, -4, 4);
  for (int e = 0; e < E; ++e) logits[e] = 0.5f;  // row 0: all tied, so experts 0..K-1
  const auto bias = ref::random_floats(E, 401, -0.2f, 0.2f);
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid})
    for (bool normalize : {true, false})
      for (const std::vector<float>* b : {static_cast<const std::vector<float>*>(nullptr), &bias}) {
        SCOPED_TRACE(testing::Message() << "sigmoid " << (score == RouterScore::kSigmoid)
                                        << " normalize " << normalize << " bias " << !!b);
        const RouterShape r{N, E, K, score, normalize, 2.5f};
        const Routed cpu = route(kCpu, logits, b, r), gpu = route(on_gpu(), logits, b, r);
        const Routed again = route(on_gpu(), logits, b, r);
        expect_close(gpu.scores, cpu.scores, 1e-6, 1e-7, "scores");
        EXPECT_EQ(gpu.chosen, cpu.chosen);  // random logits: no near-ties that 2 ulp could flip
        expect_close(gpu.gates, cpu.gates, 2e-6, 1e-7, "gates");
        expect_same_bits(again.scores, gpu.scores, "scores twice");
        EXPECT_EQ(again.gates, gpu.gates);
        if (!b) {
          EXPECT_EQ(I32(gpu.chosen.begin(), gpu.chosen.begin() + K), (I32{0, 1, 2, 3}));
        }
      }
}

// The router's backward from the same scores, choices and gate gradients, with and without an
// extra score gradient: no exp in it, so the CPU's bits.
TEST(CudaMoe, RouterBackwardIsTheCpuBits) {
  REQUIRE_GPU();
  const int N = 257, E = 12, K = 3;
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid})
    for (bool normalize : {true, false})
      for (bool extra : {false, true}) {
        const RouterShape r{N, E, K, score, normalize, 1.5f};
        const Routed fwd = route(kCpu, ref::random_floats(N * E, 410, -3, 3), nullptr, r);
        const auto dgates = ref::random_floats(N * K, 411), dextra = ref::random_floats(N * E, 412);
        std::vector<float> out[2];
        for (int i = 0; i < 2; ++i) {
          const Exec exec = i ? on_gpu() : Exec(kCpu);
          Mem<float> d(exec, N * E, 99.0f), dg(exec, dgates), de(exec, dextra), s(exec, fwd.scores);
          Mem<std::int32_t> c(exec, fwd.chosen);
          moe_route_backward(exec, d.p(), dg.p(), extra ? de.p() : nullptr, s.p(), c.p(), r);
          out[i] = d.host();
        }
        expect_same_bits(out[1], out[0], "dlogits");
      }
}

// ---- permutation, gathers, combine, slots -------------------------------------------------

TEST(CudaMoe, GathersCombineAndSlotsAreTheCpuBits) {
  REQUIRE_GPU();
  const int N = 97, E = 6, K = 2, C = 70, S = N * K;
  const I32 chosen = random_experts(S, E, 420);
  for (const std::int64_t capacity : {std::int64_t{0}, moe_capacity(0.7, N, E, K)}) {
    SCOPED_TRACE(testing::Message() << "capacity " << capacity);
    std::vector<std::int64_t> offsets(E + 1);
    I32 row_of_slot(S), slot_of_row(S, 0);
    moe_permute(offsets.data(), row_of_slot.data(), slot_of_row.data(), chosen.data(), N, E, K,
                capacity);
    const int rows = static_cast<int>(offsets[E]);
    const auto x = ref::random_floats(N * C, 421), ys = ref::random_floats(S * C, 422),
               w = ref::random_floats(S, 423), y0 = ref::random_floats(N * C, 424);
    std::vector<bf16> x16(x.size());
    float_to_bf16(x16.data(), x.data(), static_cast<std::int64_t>(x.size()));
    std::vector<float> out[2][6];
    std::vector<bf16> out16[2];
    for (int i = 0; i < 2; ++i) {
      const Exec exec = i ? on_gpu() : Exec(kCpu);
      Mem<std::int32_t> ros(exec, row_of_slot), sor(exec, slot_of_row);
      Mem<float> gx(exec, x), gys(exec, ys), gw(exec, w), xs(exec, S * C), y(exec, y0),
          ya(exec, y0), yn(exec, y0), by_row(exec, S), by_slot(exec, w);
      Mem<bf16> gx16(exec, x16), xs16(exec, S * C);
      moe_gather(exec, xs.p(), gx.p(), sor.p(), rows, K, C);
      moe_gather(exec, xs16.p(), gx16.p(), sor.p(), rows, K, C);
      moe_combine(exec, y.p(), gys.p(), gw.p(), ros.p(), N, K, C, Out::kWrite);
      moe_combine(exec, ya.p(), gys.p(), gw.p(), ros.p(), N, K, C, Out::kAccumulate);
      moe_combine(exec, yn.p(), gys.p(), nullptr, ros.p(), N, K, C, Out::kWrite);
      moe_gather_slots(exec, by_row.p(), gw.p(), sor.p(), rows);
      moe_scatter_slots(exec, by_slot.p(), gys.p(), sor.p(), rows);  // the first S of ys
      out[i][0] = xs.host(), out[i][1] = y.host(), out[i][2] = ya.host(), out[i][3] = yn.host();
      out[i][4] = by_row.host(), out[i][5] = by_slot.host();
      out16[i] = xs16.host();
    }
    const char* what[] = {
        "gather",       "combine",      "combine accumulated", "combine of weight 1",
        "gather_slots", "scatter_slots"};
    for (int k = 0; k < 6; ++k) expect_same_bits(out[1][k], out[0][k], what[k]);
    EXPECT_EQ(out16[1], out16[0]) << "bf16 gather";
  }
}

// moe_ep_reorder's block copies on the device, there and back.
TEST(CudaMoe, EpReorderIsTheCpus) {
  REQUIRE_GPU();
  const int P = 3, El = 2, width = 5;
  const I32 counts = {2, 0, 1, 3, 4, 1};  // counts[s·El + j]
  std::vector<std::int64_t> offsets(El + 1), blocks(El * P + 1);
  moe_ep_offsets(offsets.data(), blocks.data(), counts.data(), P, El);
  const int rows = static_cast<int>(offsets[El]);
  const auto src = ref::random_floats(rows * width, 430);
  std::vector<float> out[2];
  for (int i = 0; i < 2; ++i) {
    const Exec exec = i ? on_gpu() : Exec(kCpu);
    Mem<float> a(exec, src), b(exec, rows * width), c(exec, rows * width);
    moe_ep_reorder(exec, b.p(), a.p(), counts.data(), blocks.data(), P, El, width, true);
    moe_ep_reorder(exec, c.p(), b.p(), counts.data(), blocks.data(), P, El, width, false);
    out[i] = b.host();
    EXPECT_EQ(c.host(), src) << "there and back, backend " << i;
  }
  EXPECT_EQ(out[1], out[0]);
}

// ---- the auxiliary loss -------------------------------------------------------------------

TEST(CudaMoe, AuxLossIsTheCpuBits) {
  REQUIRE_GPU();
  const int B = 3, T = 50, E = 10, K = 3, N = B * T;
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    const RouterShape r{N, E, K, score, true, 1.0f};
    const Routed fwd = route(kCpu, ref::random_floats(N * E, 440, -2, 2), nullptr, r);
    double loss[2][2];
    std::vector<float> d[2], alone[2];
    for (int i = 0; i < 2; ++i) {
      const Exec exec = i ? on_gpu() : Exec(kCpu);
      Mem<float> s(exec, fwd.scores), ds(exec, N * E, 99.0f), ds_alone(exec, N * E, 99.0f);
      Mem<std::int32_t> c(exec, fwd.chosen);
      loss[i][0] = moe_aux_loss(exec, ds.p(), s.p(), c.p(), B, T, r, 0.3f);
      loss[i][1] = moe_aux_loss(exec, nullptr, s.p(), c.p(), B, T, r, 0.3f);
      moe_aux_loss_backward(exec, ds_alone.p(), s.p(), c.p(), B, T, r, 0.3f);  // no value
      d[i] = ds.host();
      alone[i] = ds_alone.host();
    }
    EXPECT_EQ(loss[1][0], loss[0][0]);
    EXPECT_EQ(loss[1][1], loss[0][1]);
    expect_same_bits(d[1], d[0], "dscores");
    expect_same_bits(alone[1], d[0], "dscores without the value");
  }
}

// ---- the experts --------------------------------------------------------------------------

// cuda::moe_gate_grads against its definition, computed here: dgates[slot_of_row[r]] = the
// double sum over f in order of dh[r, f] · h[r, f], rounded once; then dh's and dys's rows times
// the row's gate. Bit for bit, from h's floats and from its bf16 copy.
TEST(CudaMoe, GateGradientsAreTheirDefinitionsBits) {
  REQUIRE_GPU();
  const int S = 123, C = 20, Fe = 37;
  const auto dh = ref::random_floats(S * Fe, 450), h = ref::random_floats(S * Fe, 451),
             dys = ref::random_floats(S * C, 452), gates = ref::random_floats(S, 453, 0.1f, 1);
  I32 slot_of_row(S);
  for (int r = 0; r < S; ++r) slot_of_row[r] = (r * 7) % S;  // a permutation (gcd(7, 123) = 1)
  std::vector<bf16> h16(h.size());
  float_to_bf16(h16.data(), h.data(), static_cast<std::int64_t>(h.size()));
  for (bool rounded : {false, true}) {
    std::vector<float> want_dg(S), want_dh = dh, want_dys = dys;
    for (int r = 0; r < S; ++r) {
      double dot = 0.0;
      for (int f = 0; f < Fe; ++f)
        dot += static_cast<double>(dh[r * Fe + f]) *
               (rounded ? bf16_to_float(h16[r * Fe + f]) : h[r * Fe + f]);
      want_dg[slot_of_row[r]] = static_cast<float>(dot);
      const float g = gates[slot_of_row[r]];
      for (int f = 0; f < Fe; ++f) want_dh[r * Fe + f] *= g;
      for (int c = 0; c < C; ++c) want_dys[r * C + c] *= g;
    }
    const Exec exec = on_gpu();
    Mem<float> gdh(exec, dh), gh(exec, h), gdys(exec, dys), gg(exec, gates), gdg(exec, S);
    Mem<bf16> gh16(exec, h16);
    Mem<std::int32_t> sor(exec, slot_of_row);
    cuda::moe_gate_grads(cuda::testing::S(), {gg.p(), gdg.p(), sor.p()}, gdh.p(), gdys.p(), gh.p(),
                         rounded ? gh16.p() : nullptr, S, C, Fe);
    expect_same_bits(gdg.host(), want_dg, "dgates");
    expect_same_bits(gdh.host(), want_dh, "dh");
    expect_same_bits(gdys.host(), want_dys, "dys");
  }
}

struct ExpertsCase {
  int N = 60, E = 5, K = 2, C = 48, Fe = 40;
  I32 chosen;
  std::vector<std::int64_t> offsets, parts;  // parts: each expert's rows in two halves
  I32 slot_of_row;
  std::vector<float> xs, wg, wu, wd, gates, dys;
};

ExpertsCase experts_case() {
  ExpertsCase c;
  const int S = c.N * c.K;
  c.chosen = random_experts(S, c.E - 1, 460);  // expert E - 1 takes no rows
  c.offsets.resize(c.E + 1);
  I32 row_of_slot(S);
  c.slot_of_row.resize(S);
  moe_permute(c.offsets.data(), row_of_slot.data(), c.slot_of_row.data(), c.chosen.data(), c.N, c.E,
              c.K);
  c.parts = {0};
  for (int e = 0; e < c.E; ++e) {
    c.parts.push_back((c.offsets[e] + c.offsets[e + 1]) / 2);
    c.parts.push_back(c.offsets[e + 1]);
  }
  c.xs = ref::random_floats(S * c.C, 461);
  c.wg = ref::random_floats(c.E * c.Fe * c.C, 462);
  c.wu = ref::random_floats(c.E * c.Fe * c.C, 463);
  c.wd = ref::random_floats(c.E * c.C * c.Fe, 464);
  c.gates = ref::random_floats(S, 465, 0.1f, 1.0f);
  c.dys = ref::random_floats(S * c.C, 466);
  return c;
}

// Everything the grouped pass writes: y, gate, up, h, dxs, dgates, dwg, dwu, dwd.
constexpr int kExpertOutputs = 9;
using ExpertOutputs = std::array<std::vector<float>, kExpertOutputs>;
const char* const kExpertOutputNames[kExpertOutputs] = {"y",      "gate", "up",  "h",  "dxs",
                                                        "dgates", "dwg",  "dwu", "dwd"};

// How run_experts takes the backward: whole, or its two halves (B then W) with the weight
// gradients in one GEMM per expert or in two parts per expert.
enum class Backward { kWhole, kSplit, kSplitInParts };

// The forward and backward on `exec`. With `fused` (bf16 GEMMs) the fused bf16 SwiGLU over
// copies, and the rows' inputs given rounded; h is then read back from its copy.
ExpertOutputs run_experts(const Exec& exec, const ExpertsCase& c, Backward how, bool fused) {
  const int S = c.N * c.K, SF = S * c.Fe;
  Mem<float> xs(exec, c.xs), wg(exec, c.wg), wu(exec, c.wu), wd(exec, c.wd), gates(exec, c.gates),
      dys(exec, c.dys), y(exec, S * c.C), gate(exec, SF), up(exec, SF), h(exec, SF),
      dxs(exec, S * c.C), dgates(exec, S), dwg(exec, c.wg.size(), 0.5f),
      dwu(exec, c.wu.size(), 0.5f), dwd(exec, c.wd.size(), 0.5f), dh(exec, SF), dgate(exec, SF),
      dup(exec, SF);
  Mem<bf16> gate16(exec, SF), up16(exec, SF), h16(exec, SF), xs16(exec, S * c.C);
  Mem<std::int32_t> sor(exec, c.slot_of_row);
  ExpertCopies copies;
  if (fused) {
    float_to_bf16(exec, xs16.p(), xs.p(), S * c.C);
    copies = {gate16.p(), up16.p(), h16.p(), xs16.p()};
  }
  const ExpertWeights w{wg.p(), wu.p(), wd.p()};
  const ExpertActs acts{gate.p(), up.p(), h.p()};
  const ExpertGating gating{gates.p(), dgates.p(), sor.p()};
  moe_experts_forward(exec, y.p(), acts, xs.p(), w, c.offsets.data(), {c.E, c.C, c.Fe}, copies);
  if (how != Backward::kWhole) {
    const ExpertShape parts = how == Backward::kSplit
                                  ? ExpertShape{c.E, c.C, c.Fe}
                                  : ExpertShape{c.E, c.C, c.Fe, 2, c.parts.data()};
    moe_experts_backward_input(exec, dxs.p(), gating, {dh.p(), dgate.p(), dup.p()}, dys.p(), acts,
                               w, c.offsets.data(), parts, copies);
    moe_experts_backward_weight(exec, {dwg.p(), dwu.p(), dwd.p()}, dys.p(),
                                {dh.p(), dgate.p(), dup.p()}, xs.p(), h.p(), c.offsets.data(),
                                parts, copies);
  } else {
    moe_experts_backward(exec, dxs.p(), gating, {dwg.p(), dwu.p(), dwd.p()},
                         {dh.p(), dgate.p(), dup.p()}, dys.p(), xs.p(), acts, w, c.offsets.data(),
                         {c.E, c.C, c.Fe}, copies);
  }
  std::vector<float> hv = h.host();
  if (fused) {
    const std::vector<bf16> h16v = h16.host();
    for (std::size_t i = 0; i < hv.size(); ++i) hv[i] = bf16_to_float(h16v[i]);
  }
  return {y.host(),      gate.host(), up.host(),  hv,        dxs.host(),
          dgates.host(), dwg.host(),  dwu.host(), dwd.host()};
}

TEST(CudaMoe, ExpertsMatchTheCpuAndRepeatTheirBits) {
  REQUIRE_GPU();
  const ExpertsCase c = experts_case();
  for (Backward how : {Backward::kWhole, Backward::kSplitInParts}) {
    SCOPED_TRACE(how == Backward::kWhole ? "whole backward" : "split, weight gradients in parts");
    const ExpertOutputs cpu = run_experts(kCpu, c, how, false);
    const ExpertOutputs gpu = run_experts(on_gpu(), c, how, false);
    const ExpertOutputs again = run_experts(on_gpu(), c, how, false);
    for (int k = 0; k < kExpertOutputs; ++k) {
      expect_close_to_scale(gpu[k], cpu[k], 1e-5, kExpertOutputNames[k]);
      expect_same_bits(again[k], gpu[k], kExpertOutputNames[k]);
    }
    // The idle expert's weight gradients stay as they were.
    const std::size_t idle = static_cast<std::size_t>((c.E - 1) * c.Fe * c.C);
    EXPECT_TRUE(
        std::all_of(gpu[6].begin() + idle, gpu[6].end(), [](float v) { return v == 0.5f; }));
  }
  // The two halves without parts give the whole backward's bits (ops_moe.h).
  const ExpertOutputs whole = run_experts(on_gpu(), c, Backward::kWhole, false);
  const ExpertOutputs halves = run_experts(on_gpu(), c, Backward::kSplit, false);
  for (int k = 0; k < kExpertOutputs; ++k)
    expect_same_bits(halves[k], whole[k], kExpertOutputNames[k]);
}

// The fused bf16 SwiGLU over bf16 copies: the GPU repeats its bits, follows its own fp32 run
// within bf16 rounding (2% of each tensor's largest value), and the CPU's bf16 run where this
// CPU has bf16 GEMMs.
TEST(CudaMoe, FusedBf16ExpertsRepeatAndFollowFp32) {
  REQUIRE_GPU();
  const ExpertsCase c = experts_case();
  const ExpertOutputs fp32 = run_experts(on_gpu(), c, Backward::kWhole, false);
  const ExpertOutputs a = run_experts(on_gpu(GemmKind::kOneDnnBf16), c, Backward::kWhole, true);
  const ExpertOutputs b = run_experts(on_gpu(GemmKind::kOneDnnBf16), c, Backward::kWhole, true);
  for (int k = 0; k < kExpertOutputs; ++k) {  // h read back from its copy (its floats unwritten)
    expect_same_bits(b[k], a[k], kExpertOutputNames[k]);
    expect_close_to_scale(a[k], fp32[k], 2e-2, kExpertOutputNames[k]);
  }
  try {
    verify_gemm_kind(GemmKind::kOneDnnBf16);
  } catch (const GemmUnavailable& e) {
    GTEST_SKIP() << "no bf16 GEMM on this CPU to compare with: " << e.reason();
  }
  const ExpertOutputs cpu = run_experts(GemmKind::kOneDnnBf16, c, Backward::kWhole, true);
  for (int k = 0; k < kExpertOutputs; ++k)
    expect_close_to_scale(a[k], cpu[k], 1e-2, kExpertOutputNames[k]);
}

}  // namespace
}  // namespace t3d::kernels
