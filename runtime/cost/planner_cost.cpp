#include "runtime/cost/planner_cost.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cmath>

#include "checkpoint/snapshot.h"
#include "kernels/check.h"
#include "kernels/ops.h"
#include "parallel/pipeline_split.h"
#include "parallel/zero.h"
#include "runtime/data/data_sampler.h"
#include "runtime/model/model_spec.h"

namespace t3d::runtime {
namespace {

// The parameter units of a stage's chunks on one tp rank and one EP rank (every EP rank holds as
// many experts).
ParamUnits stage_units(const ModelConfig& m, const std::vector<parallel::LayerRange>& ranges,
                       int64_t tp, int64_t ep) {
  return param_units(m, ranges, tp, m.moe() ? expert_share(m, ep, 0) : ExpertRange{});
}

// Parameter elements (alignment padding included) of a stage's chunks on one tp and EP rank.
double stage_param_elems(const ModelConfig& m, const std::vector<parallel::LayerRange>& ranges,
                         int64_t tp, int64_t ep) {
  return static_cast<double>(stage_units(m, ranges, tp, ep).total_floats);
}

// ZeRO's per-rank sizes of a stage, per state group as runtime/train/sharded_state.h keeps them
// (parallel/zero.h: every bucket of the group split over its ranks, dp for the dense group and
// dp / ep for the routed experts): the group's region, the largest shard over its ranks, and its
// largest bucket, in floats. With `zero` 0: the regions alone.
std::vector<parallel::ZeroFloats> zero_floats(const ModelConfig& m,
                                              const std::vector<parallel::LayerRange>& ranges,
                                              int64_t tp, int64_t dp, int64_t ep, int64_t zero,
                                              double bucket_mb) {
  const ParamUnits param = stage_units(m, ranges, tp, ep);
  std::vector<parallel::ZeroFloats> out;
  for (const StateGroup group : kStateGroups) {
    const GroupUnits g = group_units(m, param, group);
    if (g.units.empty()) continue;
    std::vector<parallel::FloatRange> units;
    for (const auto& u : g.units) units.push_back({u.begin, u.end});
    parallel::ZeroFloats z;
    z.region = static_cast<double>(g.end - g.begin);
    if (zero >= 1) {
      const int64_t ranks = group == StateGroup::kExperts ? dp / ep : dp;
      std::vector<int> per_bucket;
      const auto buckets =
          parallel::make_buckets(units, parallel::bucket_floats(bucket_mb), &per_bucket);
      for (int64_t d = 0; d < ranks; ++d) {
        const parallel::BucketPartition part(buckets, static_cast<int>(ranks), static_cast<int>(d));
        z.owned = std::max(z.owned, static_cast<double>(part.shard_floats));
        z.largest_bucket = static_cast<double>(part.largest_bucket);
      }
    }
    out.push_back(z);
  }
  return out;
}

// The model spec table (runtime/model/model_spec.h) of a stage as the planner prices it: precision
// bf16 as an accelerator keeps it (every activation-sized tensor bf16), fp32 as the arena does.
ActivationSpec stage_activations(const PlanProblem& p, const Layout& l,
                                 const std::vector<parallel::LayerRange>& ranges,
                                 const std::vector<int64_t>& chunk_slots) {
  T3D_ASSERT(p.precision.activation == 2 || p.precision.activation == 4, "activations of ",
             p.precision.activation, " bytes");
  SpecOptions o;
  o.micro_rows = micro_rows(p, l);
  o.chunk_slots = chunk_slots;
  o.checkpoint_every = l.checkpoint_every;
  o.split_backward =
      l.schedule == parallel::ScheduleKind::kZBH1 || l.schedule == parallel::ScheduleKind::kZBV;
  o.storage = p.precision.activation == 2 ? ActivationStorage::kBf16 : ActivationStorage::kFp32;
  return activation_spec(p.model, {ranges, l.tp, false, 1, l.ep}, o);
}

std::string gib(double bytes) { return fmt::format("{:.4g} GiB", bytes / kGiB); }
std::string num(double x) { return fmt::format("{:.4g}", x); }
std::string sec(double s) {
  return s >= 1 ? fmt::format("{:.3f} s", s) : fmt::format("{:.3f} ms", s * 1e3);
}

std::vector<parallel::LayerRange> layer_split(const ModelConfig& m, const Layout& l) {
  return parallel::split_layers(m.n_layers, l.pp * l.virtual_stages,
                                parallel::head_cost_in_layers(m.vocab_size, m.dim, m.ffn_dim));
}

std::vector<parallel::LayerRange> ranges_of_stage(const std::vector<parallel::LayerRange>& split,
                                                  const Layout& l, int64_t stage) {
  return parallel::layers_of_stage(
      split,
      parallel::placement(l.schedule, static_cast<int>(l.pp), static_cast<int>(l.virtual_stages)),
      stage);
}

// Compute and tensor-parallel time of one stage for one micro-batch.
struct StageCost {
  double f = 0, b = 0, w = 0;  // compute seconds
  double f_tp = 0, b_tp = 0;   // TP all-reduce seconds inside the forward / backward
  double f_ep = 0, b_ep = 0;   // expert parallelism's all-to-all seconds, the same
  double total() const { return f + b + w + f_tp + b_tp + f_ep + b_ep; }
};

StageCost cost_of_stage(const PlanProblem& p, const Layout& l,
                        const std::vector<parallel::LayerRange>& ranges, std::ostream* why) {
  const double B = static_cast<double>(micro_rows(p, l)), N = B * double(p.model.seq_len);
  const double flops_s = p.cluster.peak_tflops * 1e12 * p.cluster.compute_efficiency;
  // Per token of one block (tp-local), the model spec's count: f = mm + att, b = mm + 2·att,
  // w = mm. The last block's mm: in a mixture of experts its router and K of its E experts.
  const BlockFlops block = block_flops_per_token(p.model, l.tp);
  const double mm = block.matmul, att = block.attention;
  // A mixture of experts' leading dense blocks (model.dense_layers) differ by their MLP: what
  // they add over the stage's blocks and over its recomputed ones (0 for a dense model).
  double dense_extra = 0, dense_extra_recomputed = 0;
  int64_t moe_blocks = 0;
  for (const auto& r : ranges)
    for (int64_t layer = r.begin; p.model.moe() && layer < r.end; ++layer) {
      if (p.model.moe_block(layer)) {
        ++moe_blocks;
        continue;
      }
      const double extra = block_flops_per_token(p.model, l.tp, layer).matmul - mm;
      dense_extra += extra;
      if (recomputed_block(layer - r.begin, l.checkpoint_every)) dense_extra_recomputed += extra;
    }
  const Link tp_link = group_link(p.cluster, 1, l.tp);
  const double act_msg = N * double(p.model.dim) * p.precision.activation;
  const double ar = ring_all_reduce_s(act_msg, l.tp, tp_link);
  StageCost c;
  int64_t layers = 0, recomputed = 0;
  bool first = false, last = false;
  for (const auto& r : ranges) {
    layers += r.size();
    recomputed += recomputed_blocks(r.size(), l.checkpoint_every);
    first |= r.first, last |= r.last;
  }
  // Every block's W holds all its weight-gradient GEMMs, a MoE block's router and experts too.
  c.f = layers * N * (mm + att) / flops_s + N * dense_extra / flops_s;
  c.b = (layers * N * (mm + 2 * att) + recomputed * N * (mm + att)) / flops_s +
        N * (dense_extra + dense_extra_recomputed) / flops_s;
  c.w = layers * N * mm / flops_s + N * dense_extra / flops_s;
  // Two all-reduces per block forward (o_proj, down_proj) and two backward (the inputs of the
  // column-parallel q/k/v and gate/up); recomputing a block repeats its forward pair.
  c.f_tp = 2 * layers * ar;
  c.b_tp = 2 * (layers + recomputed) * ar;
  if (first) c.f_tp += ar;  // vocab-parallel embedding rows
  // Expert parallelism (docs/moe.md): per MoE block the rows of a micro-batch's N·K slots go to
  // their experts' ranks and back in the forward (two all-to-alls), their gradients the same way
  // in the backward, and a recomputed block repeats its forward's. A rank keeps 1/ep of its rows
  // on average and sends the rest: (ep − 1)/ep of N·K·C activation-sized values per exchange,
  // over links at stride tp (dp neighbours), with a latency per peer.
  if (l.ep > 1 && moe_blocks > 0) {
    Link ep_link = group_link(p.cluster, l.tp, l.ep);
    if (p.cluster.all_to_all_gbps > 0) {  // measured (plan --calibrate) beats the link model
      ep_link.bytes_per_s = p.cluster.all_to_all_gbps * 1e9;
      ep_link.latency_s = p.cluster.all_to_all_latency_us * 1e-6;
    }
    const double peers = static_cast<double>(l.ep - 1);
    const double sent = N * double(p.model.experts_per_token) * double(p.model.dim) *
                        p.precision.activation * peers / static_cast<double>(l.ep);
    const double exchange = sent / ep_link.bytes_per_s + peers * ep_link.latency_s;
    int64_t moe_recomputed = 0;
    for (const auto& r : ranges)
      for (int64_t layer = r.begin; layer < r.end; ++layer)
        moe_recomputed +=
            p.model.moe_block(layer) && recomputed_block(layer - r.begin, l.checkpoint_every);
    c.f_ep = 2 * static_cast<double>(moe_blocks) * exchange;
    c.b_ep = 2 * static_cast<double>(moe_blocks + moe_recomputed) * exchange;
  }
  if (last) {
    // titan3d runs the LM head's forward and backward inside the last chunk's forward.
    c.f += N * head_train_flops_per_token(p.model, l.tp) / flops_s;
    c.f_tp += ar + 3 * ring_all_reduce_s(4 * N, l.tp, tp_link);  // dx of the head; CE statistics
  }
  if (why)
    *why << fmt::format(
        "  compute: {} blocks ({} recomputed) × {} rows; per row and block {} FLOPs matmul "
        "(2·weights per pass) + {} attention (4·H/tp·D·T);\n"
        "           f = {}, b = {}, w = {} at {} TFLOP/s × {} efficiency{}\n"
        "  tp: all-reduce of N·C·{} B = {} B over {} ranks, {} each; {} in f, {} in b\n",
        layers, recomputed, num(N), num(mm), num(att), sec(c.f), sec(c.b), sec(c.w),
        num(p.cluster.peak_tflops), num(p.cluster.compute_efficiency),
        last ? " (LM head fwd+bwd in f)" : "", num(p.precision.activation), num(act_msg), l.tp,
        sec(ar), sec(c.f_tp), sec(c.b_tp));
  if (why && l.ep > 1)
    *why << fmt::format("  ep: all-to-alls of the routed rows over {} ranks: {} in f, {} in b\n",
                        l.ep, sec(c.f_ep), sec(c.b_ep));
  return c;
}

// The slowest stage's costs (every stage runs at the pace of the slowest in the simulation).
StageCost slowest_stage(const PlanProblem& p, const Layout& l, int64_t* stage_out = nullptr) {
  const auto split = layer_split(p.model, l);
  StageCost worst;
  for (int64_t st = 0; st < l.pp; ++st) {
    const StageCost c = cost_of_stage(p, l, ranges_of_stage(split, l, st), nullptr);
    if (st == 0 || c.total() > worst.total()) {
      worst = c;
      if (stage_out) *stage_out = st;
    }
  }
  return worst;
}

}  // namespace

Precision Precision::from_recipe(TrainPrecision precision) {
  // auto is resolved by measuring the machine that trains; the planner prices it as bf16, what
  // the accelerators of a cluster train in (and the larger of the two speeds on a CPU with bf16).
  if (precision == TrainPrecision::kFp32) return {4, 4, 0, 4, 4};
  return {2, 2, 4, 4, 2};
}

std::string Layout::checkpoint_name() const {
  return ActivationCheckpoint{checkpoint_every}.name();
}

std::string Layout::label() const {
  std::string sched(parallel::to_string(schedule));
  if (virtual_stages > 1 && schedule != parallel::ScheduleKind::kZBV)  // zb_v: always 2
    sched += "×" + std::to_string(virtual_stages);
  return fmt::format(
      "dp{} tp{} pp{}{}{} {} m{} z{} ckpt:{}", dp, tp, pp, cp > 1 ? " cp" + std::to_string(cp) : "",
      ep > 1 ? " ep" + std::to_string(ep) : "", sched, micro_batches, zero, checkpoint_name());
}

void Layout::write_into(ParallelConfig& parallel, TrainConfig& train) const {
  parallel.pp = pp;
  parallel.dp = dp;
  parallel.cp = cp;
  parallel.tp = tp;
  parallel.ep = ep;
  parallel.schedule = schedule;
  parallel.virtual_stages = virtual_stages;
  parallel.pipeline_split.clear();
  parallel.zero = zero;
  train.micro_batches = micro_batches;
  train.activation_checkpoint = {checkpoint_every};
}

int64_t micro_rows(const PlanProblem& p, const Layout& l) {
  return rows_per_micro(p.global_batch, static_cast<int>(l.dp), static_cast<int>(l.micro_batches));
}

std::string invalid_reason(const PlanProblem& p, const Layout& l) {
  const auto& c = p.cluster;
  if (l.world() != c.world())
    return fmt::format("dp·cp·tp·pp = {} is not the cluster's {} devices", l.world(), c.world());
  if (c.devices_per_node % l.tp != 0)
    return fmt::format("tp = {} does not divide a node's {} devices", l.tp, c.devices_per_node);
  ParallelConfig parallel;
  TrainConfig train;
  train.global_batch = p.global_batch;
  l.write_into(parallel, train);
  const LayoutProblem rule = layout_problem(p.model, parallel, train);
  return rule.none() ? "" : rule.key + ": " + rule.reason;
}

parallel::Schedule make_layout_schedule(const Layout& l) {
  return parallel::make_schedule(l.schedule, static_cast<int>(l.pp),
                                 static_cast<int>(l.micro_batches),
                                 static_cast<int>(l.virtual_stages));
}

int64_t activation_slots(const parallel::Schedule& s, int64_t stage) {
  std::vector<int> alive(s.num_chunks(), 0), peak(s.num_chunks(), 0);
  for (const auto& a : s.ranks.at(stage)) {
    if (a.op == parallel::Op::kF) peak[a.chunk] = std::max(peak[a.chunk], ++alive[a.chunk]);
    // Activations are freed once the weight gradient no longer needs them.
    if (a.op == parallel::Op::kBW || a.op == parallel::Op::kW) --alive[a.chunk];
  }
  return *std::max_element(peak.begin(), peak.end());
}

std::vector<int64_t> chunk_activation_slots(const parallel::Schedule& s, int64_t stage) {
  std::vector<int64_t> out;
  for (int k = 0; k < s.num_chunks(); ++k) {
    if (s.chunk_stage[k] != stage) continue;
    int64_t alive = 0, peak = 0;
    for (const auto& a : s.ranks.at(stage)) {
      if (a.chunk != k) continue;
      if (a.op == parallel::Op::kF) peak = std::max(peak, ++alive);
      if (a.op == parallel::Op::kBW || a.op == parallel::Op::kW) --alive;
    }
    out.push_back(peak);
  }
  return out;
}

Memory stage_memory(const PlanProblem& p, const Layout& l, const parallel::Schedule& schedule,
                    int64_t stage, std::ostream* why) {
  const auto ranges = ranges_of_stage(layer_split(p.model, l), l, stage);
  const Precision& pr = p.precision;
  const double elems = stage_param_elems(p.model, ranges, l.tp, l.ep);
  const double largest_layer = static_cast<double>(block_param_floats(p.model, l.tp));
  // ZeRO as titan3d allocates it (parallel/zero.h, the rule ShardedState reports by), per state
  // group: with the largest shard over the group's ranks, the rank the planner prices.
  Memory mem;
  mem.stage = stage;
  parallel::ZeroFloats z;  // the groups together, for the explanation: largest bucket of any
  parallel::StateBytes state;
  for (const parallel::ZeroFloats& g :
       zero_floats(p.model, ranges, l.tp, l.dp, l.ep, l.zero, p.bucket_mb)) {
    const parallel::StateBytes b = parallel::zero_state_bytes(
        static_cast<int>(l.zero), g, {pr.weight, pr.grad, pr.moment, pr.master});
    state.params += b.params, state.grads += b.grads, state.optimizer += b.optimizer;
    z.region += g.region, z.owned += g.owned;
    z.largest_bucket = std::max(z.largest_bucket, g.largest_bucket);
  }
  const double kept = l.zero >= 1 ? z.owned : elems;  // elements of state kept per sharded kind
  mem.params = state.params;
  mem.grads = state.grads;
  mem.optimizer = state.optimizer;
  // A rank writes about 1/(dp) of its stage's parameters and both moments, fp32 (one writer per
  // box: runtime/train/snapshots.h), staged within the cap.
  if (p.snapshots)
    mem.snapshot_staging = checkpoint::staging_bytes(p.staging_gib, state.total(),
                                                     3.0 * 4.0 * elems / static_cast<double>(l.dp));
  mem.slots = activation_slots(schedule, stage);
  mem.chunk_slots = chunk_activation_slots(schedule, stage);
  T3D_ASSERT(mem.chunk_slots.size() == ranges.size(), "chunks of stage ", stage);
  const ActivationSpec spec = stage_activations(p, l, ranges, mem.chunk_slots);
  double per_slot = 0;
  // What --explain prints: "4 slots × X", or per chunk "{7, 1} slots × {X, Y}" when they differ.
  std::string slots_text, bytes_text;
  const bool uniform = std::all_of(mem.chunk_slots.begin(), mem.chunk_slots.end(),
                                   [&](int64_t n) { return n == mem.slots; });
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto bytes = static_cast<double>(spec.chunks[i].slot_bytes());
    per_slot += bytes;
    mem.activations += static_cast<double>(mem.chunk_slots[i]) * bytes;
    slots_text += (i ? ", " : "") + std::to_string(mem.chunk_slots[i]);
    bytes_text += (i ? ", " : "") + gib(bytes);
  }
  if (uniform)
    slots_text = std::to_string(mem.slots), bytes_text = gib(per_slot);
  else
    slots_text = "{" + slots_text + "}", bytes_text = "{" + bytes_text + "}";
  // Backward scratch, attention tiles, logits, and with checkpointing the block being recomputed.
  mem.workspace = static_cast<double>(spec.scratch_bytes());
  const bool recompute = l.checkpoint_every > 0;
  if (why) {
    const auto kind_bytes = [&](double n, double bytes) {
      return fmt::format("{} × {} B{}", num(n), num(bytes),
                         l.zero >= 1 && n == kept ? " (ZeRO: this rank's slices)" : "");
    };
    const auto zero_extra = [&](int buffers, const char* what) {
      return fmt::format(" + {} {} buffers × {} (the largest bucket)", buffers, what,
                         num(z.largest_bucket));
    };
    int64_t layers = 0, recomputed = 0;
    for (const auto& r : ranges) {
      layers += r.size();
      recomputed += recomputed_blocks(r.size(), l.checkpoint_every);
    }
    *why << fmt::format(
        "memory of pipeline stage {} ({} blocks{}{}), per rank:\n"
        "  parameters: {} elements on this tp rank ({} per block)\n"
        "  weights     {}{} = {}\n"
        "  gradients   {}{} = {}\n"
        "  optimizer   {} × ({} B master + 2 × {} B AdamW moments){} = {}\n"
        "  activations {} slots (micro-batches in flight per chunk, from the schedule) × {} per "
        "micro-batch of {} sequence(s) ({}) = {}\n"
        "  workspace   backward scratch, attention tiles, logits{}{} = {}\n"
        "  total       {} of {} GiB\n"
        "  host: snapshot staging {} (snapshot.staging_gib; 0: half the training state)\n",
        stage, layers, ranges.front().first ? ", embedding" : "",
        ranges.back().last ? ", final norm and LM head" : "", num(elems), num(largest_layer),
        kind_bytes(l.zero >= 3 ? kept : elems, pr.weight),
        l.zero >= 3 ? zero_extra(parallel::kGatherBuffers, "gather") : "", gib(mem.params),
        kind_bytes(l.zero >= 2 ? kept : elems, pr.grad),
        l.zero >= 2 ? zero_extra(parallel::kStagingBuffers, "staging") : "", gib(mem.grads),
        num(kept), num(pr.master), num(pr.moment), l.zero >= 1 ? " (ZeRO: this rank's slices)" : "",
        gib(mem.optimizer), slots_text, bytes_text, micro_rows(p, l),
        recompute ? "checkpointing " + l.checkpoint_name() + ": residual stream kept, " +
                        std::to_string(recomputed) + " blocks recomputed"
                  : "every block's activations kept",
        gib(mem.activations), recompute ? ", one recomputed block" : "", "", gib(mem.workspace),
        gib(mem.total()), num(p.cluster.hbm_gib),
        p.snapshots ? gib(mem.snapshot_staging) : std::string("none (snapshot.every = 0)"));
  }
  return mem;
}

Memory peak_memory(const PlanProblem& p, const Layout& l, const parallel::Schedule& schedule,
                   std::ostream* why) {
  Memory worst;
  for (int64_t st = 0; st < l.pp; ++st) {
    const Memory m = stage_memory(p, l, schedule, st, nullptr);
    if (st == 0 || m.total() > worst.total()) worst = m;
  }
  if (why) stage_memory(p, l, schedule, worst.stage, why);
  return worst;
}

Link group_link(const Cluster& c, int64_t stride, int64_t size) {
  const int64_t dpn = c.devices_per_node;
  Link intra{c.intra_node_gbps * 1e9, c.intra_node_latency_us * 1e-6, false};
  if (size <= 1 || stride * size <= dpn) return intra;
  // The group spans nodes. Each device has a 1/dpn share of its node's NICs; a group with k
  // members in a node can use k shares, but no more than the links inside the node allow.
  const int64_t members_per_node = stride >= dpn ? 1 : dpn / stride;
  const double share = c.inter_node_gbps * 1e9 / static_cast<double>(dpn) * members_per_node;
  return {std::min(share, intra.bytes_per_s), c.inter_node_latency_us * 1e-6, true};
}

// Ring algorithms (Patarasuk & Yuan 2009; nccl-tests PERFORMANCE.md): n-1 steps each moving
// bytes/n per rank for reduce-scatter or all-gather, twice that for all-reduce.
double ring_reduce_scatter_s(double bytes, int64_t n, const Link& link) {
  if (n <= 1) return 0;
  const double k = static_cast<double>(n - 1);
  return k / n * bytes / link.bytes_per_s + k * link.latency_s;
}
double ring_all_reduce_s(double bytes, int64_t n, const Link& link) {
  return 2 * ring_reduce_scatter_s(bytes, n, link);
}
double p2p_s(double bytes, const Link& link) { return bytes / link.bytes_per_s + link.latency_s; }

parallel::Costs stage_costs(const PlanProblem& p, const Layout& l) {
  const StageCost c = slowest_stage(p, l);
  const double act = micro_rows(p, l) * p.model.seq_len * p.model.dim * p.precision.activation;
  return {c.f + c.f_tp + c.f_ep, c.b + c.b_tp + c.b_ep, c.w,
          l.pp > 1 ? p2p_s(act, group_link(p.cluster, l.tp * l.dp, l.pp)) : 0.0};
}

DpSync dp_sync(const PlanProblem& p, const Layout& l) {
  const auto split = layer_split(p.model, l);
  DpSync best;
  for (int64_t st = 0; st < l.pp; ++st) {
    const ParamUnits units = stage_units(p.model, ranges_of_stage(split, l, st), l.tp, l.ep);
    DpSync stage;
    for (const StateGroup group : kStateGroups) {
      const GroupUnits g = group_units(p.model, units, group);
      const double n = static_cast<double>(g.end - g.begin);
      const bool experts = group == StateGroup::kExperts;
      const int64_t ranks = experts ? l.dp / l.ep : l.dp;
      const Link link = group_link(p.cluster, experts ? l.tp * l.ep : l.tp, ranks);
      stage.elems += n;
      stage.reduce_scatter_s += ring_reduce_scatter_s(n * p.precision.grad, ranks, link);
      stage.all_gather_s += ring_reduce_scatter_s(n * p.precision.weight, ranks, link);
    }
    if (st == 0 ||
        stage.reduce_scatter_s + stage.all_gather_s > best.reduce_scatter_s + best.all_gather_s)
      best = stage;
  }
  return best;
}

StepTime step_time(const PlanProblem& p, const Layout& l, const parallel::Schedule& schedule,
                   std::ostream* why) {
  int64_t slow = 0;
  const StageCost c = slowest_stage(p, l, &slow);
  const auto split = layer_split(p.model, l);
  if (why) {
    *why << fmt::format("time per micro-batch on the slowest stage ({}):\n", slow);
    cost_of_stage(p, l, ranges_of_stage(split, l, slow), why);
  }
  StepTime t;
  t.costs = stage_costs(p, l);
  const double m = static_cast<double>(l.micro_batches);
  parallel::Costs no_comm = t.costs;
  no_comm.comm = 0;
  const parallel::Timeline with = parallel::simulate(schedule, t.costs);
  const double makespan0 =
      t.costs.comm > 0 ? parallel::simulate(schedule, no_comm).makespan : with.makespan;
  const double busy = m * (t.costs.f + t.costs.b + t.costs.w);
  t.compute = m * (c.f + c.b + c.w);
  t.tp = m * (c.f_tp + c.b_tp);
  t.ep = m * (c.f_ep + c.b_ep);
  t.bubble = std::max(0.0, makespan0 - busy);
  t.pp = with.makespan - makespan0;
  t.bubble_fraction = with.bubble_fraction;

  const DpSync sync = dp_sync(p, l);
  const double elems = sync.elems, rs = sync.reduce_scatter_s, ag = sync.all_gather_s;
  const Link dp_link = group_link(p.cluster, l.tp, l.dp);
  double traffic = 0, window = 0;
  const double backward = t.costs.b + t.costs.w;
  switch (l.zero) {
    case 0:
      traffic = 2 * rs, window = backward;
      break;  // all-reduce once per step
    case 1:
      traffic = rs + ag, window = backward;
      break;  // + all-gather updated weights
    case 2:
      traffic = m * rs + ag, window = m * backward;
      break;  // reduce-scatter per micro-batch
    default:
      // Weights gathered for the forward and again for the backward, grads reduce-scattered,
      // per micro-batch. titan3d's gathers are blocking (no prefetch): only the reduce-scatters
      // hide behind the backward.
      traffic = m * (2 * ag + rs), window = std::min(m * rs, m * backward);
  }
  // Gradients of a micro-batch are final only after its backward: the sync overlaps with the
  // backward compute that is still running (bucketed, as DDP / ZeRO do), the rest is exposed.
  t.dp = std::max(0.0, traffic - window);
  if (p.replay_every > 0) t.replay = with.makespan / static_cast<double>(p.replay_every);
  t.total = with.makespan + t.dp + t.replay;
  t.tokens_per_s_per_device = static_cast<double>(p.global_batch * p.model.seq_len) / t.total /
                              static_cast<double>(l.world());
  if (why)
    *why << fmt::format(
        "  pp: {} B activations per transfer, {} each ({})\n"
        "  dp: {} gradient elements on {} ranks ({}, {:.1f} GB/s): ZeRO-{} traffic {} per step, "
        "{} of it hidden behind compute, {} exposed\n"
        "pipeline ({}, {} micro-batches, simulated): makespan {} = busy {} + bubble {} + "
        "transfers {} (bubble fraction {:.1f}%)\n"
        "step {} = compute {} + tp {} + ep {} + dp {} + pp {} + bubble {}{}\n"
        "tokens/s/device = {} · {} / {} / {} = {:.0f}\n",
        num(micro_rows(p, l) * p.model.seq_len * p.model.dim * p.precision.activation),
        sec(t.costs.comm),
        l.pp == 1 ? "no pipeline"
                  : (group_link(p.cluster, l.tp * l.dp, l.pp).inter_node ? "between nodes"
                                                                         : "inside a node"),
        num(elems), l.dp, dp_link.inter_node ? "between nodes" : "inside a node",
        dp_link.bytes_per_s / 1e9, l.zero, sec(traffic), sec(std::min(traffic, window)), sec(t.dp),
        parallel::to_string(l.schedule), l.micro_batches, sec(with.makespan), sec(busy),
        sec(t.bubble), sec(t.pp), 100 * t.bubble_fraction, sec(t.total), sec(t.compute), sec(t.tp),
        sec(t.ep), sec(t.dp), sec(t.pp), sec(t.bubble),
        t.replay > 0
            ? fmt::format(" + replay {} (a pass every {} steps)", sec(t.replay), p.replay_every)
            : "",
        p.global_batch, p.model.seq_len, sec(t.total), l.world(), t.tokens_per_s_per_device);
  return t;
}

}  // namespace t3d::runtime
