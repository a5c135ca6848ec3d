#include "runtime/cost/cluster.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <toml.hpp>

#include "kernels/check.h"
#include "kernels/gpu_specs.h"
#include "runtime/recipe/recipe.h"

namespace t3d::runtime {
namespace {

struct Key {
  std::string section, key, meaning;
  bool required;
  bool integer;  // else a number (integer literals accepted)
  std::function<void(Cluster&, double)> set;
  std::string full() const { return section + "." + key; }
};

template <typename T>
std::function<void(Cluster&, double)> member(T Cluster::*m) {
  return [m](Cluster& c, double x) { c.*m = static_cast<T>(x); };
}

const std::vector<Key>& schema() {
  static const std::vector<Key> keys = {
      {"cluster", "nodes", "Nodes in the cluster.", true, true, member(&Cluster::nodes)},
      {"cluster", "devices_per_node", "Accelerators per node (a tp group stays inside one).", true,
       true, member(&Cluster::devices_per_node)},
      {"device", "hbm_gib", "Device memory per accelerator, GiB.", true, false,
       member(&Cluster::hbm_gib)},
      {"device", "peak_tflops", "Dense peak TFLOP/s per accelerator at the training precision.",
       true, false, member(&Cluster::peak_tflops)},
      {"device", "compute_efficiency",
       "Fraction of the peak the model's GEMMs reach (default 0.5).", false, false,
       member(&Cluster::compute_efficiency)},
      {"network", "intra_node_gbps", "Bandwidth inside a node, GB/s one direction per device.",
       true, false, member(&Cluster::intra_node_gbps)},
      {"network", "intra_node_latency_us", "Latency of one message inside a node, µs (default 1).",
       false, false, member(&Cluster::intra_node_latency_us)},
      {"network", "inter_node_gbps",
       "Bandwidth between nodes, GB/s one direction per node (all its NICs together).", true, false,
       member(&Cluster::inter_node_gbps)},
      {"network", "inter_node_latency_us", "Latency of one message between nodes, µs (default 5).",
       false, false, member(&Cluster::inter_node_latency_us)},
      {"network", "all_to_all_gbps",
       "Measured all-to-all of the expert-parallel group: GB/s a rank sends (plan --calibrate "
       "writes it; default: priced from the links).",
       false, false, member(&Cluster::all_to_all_gbps)},
      {"network", "all_to_all_latency_us",
       "Measured all-to-all latency per peer, µs (with all_to_all_gbps).", false, false,
       member(&Cluster::all_to_all_latency_us)},
  };
  return keys;
}

std::string suggestion(const std::string& unknown) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& k : schema()) {
    // A bare key under the wrong section should still find its home.
    const size_t d = std::min(edit_distance(unknown, k.full()),
                              edit_distance(unknown.substr(unknown.find('.') + 1), k.key));
    if (d < best_d) best_d = d, best = k.full();
  }
  const bool close = best_d <= std::max<size_t>(2, unknown.size() / 3);
  return close ? ". Did you mean `" + best + "`?" : ". See docs/planner.md for every key";
}

std::string where(const std::string& source, const toml::value& v) {
  const auto line = v.location().line();
  return line > 0 ? source + ":" + std::to_string(line) : source;
}

[[noreturn]] void fail(const std::string& at, const std::string& key, const std::string& msg) {
  throw UserError("cluster error: " + at + ": `" + key + "`: " + msg);
}

}  // namespace

Cluster parse_cluster(const std::string& toml_text, const std::string& source_name) {
  std::istringstream in(toml_text);
  toml::value root;
  try {
    root = toml::parse(in, source_name);
  } catch (const toml::syntax_error& e) {
    throw UserError(std::string("cluster error: not valid TOML:\n") + e.what());
  }
  Cluster c;
  c.source = source_name;
  c.name = source_name;
  std::set<std::string> seen;
  const kernels::GpuSpec* gpu = nullptr;  // device.gpu: its datasheet's HBM and bf16 peak
  for (const auto& [section, body] : root.as_table()) {
    if (!body.is_table())
      fail(where(source_name, body), section,
           "top-level keys are not allowed; put it in [cluster], [device] or [network]" +
               suggestion(section));
    const bool known_section = section == "cluster" || section == "device" || section == "network";
    if (!known_section)
      fail(where(source_name, body), section,
           "unknown section; the sections are [cluster], [device] and [network]");
    for (const auto& [key, value] : body.as_table()) {
      const std::string full = section + "." + key;
      if (full == "cluster.name") {
        if (!value.is_string()) fail(where(source_name, value), full, "expected a string");
        c.name = value.as_string();
        continue;
      }
      if (full == "device.gpu") {
        if (!value.is_string()) fail(where(source_name, value), full, "expected a string");
        const std::string name = value.as_string();
        gpu = kernels::gpu_spec_by_key(name);
        if (!gpu)
          fail(where(source_name, value), full,
               "unknown GPU \"" + name + "\"; known: " + kernels::gpu_spec_keys() +
                   " (or give device.hbm_gib and device.peak_tflops instead)");
        continue;
      }
      auto k = std::find_if(schema().begin(), schema().end(),
                            [&](const Key& s) { return s.full() == full; });
      if (k == schema().end())
        fail(where(source_name, value), full, "unknown key" + suggestion(full));
      double x = 0;
      if (value.is_integer()) {
        x = static_cast<double>(value.as_integer());
      } else if (value.is_floating() && !k->integer) {
        x = value.as_floating();
      } else {
        fail(where(source_name, value), full,
             std::string("expected ") + (k->integer ? "an integer" : "a number"));
      }
      if (!(x > 0))
        fail(where(source_name, value), full, "must be positive, got " + toml::format(value));
      if (full == "device.compute_efficiency" && x > 1)
        fail(where(source_name, value), full, "is a fraction of the peak: (0, 1]");
      k->set(c, x);
      seen.insert(full);
    }
  }
  // What the recipe's keys say wins over the datasheet's.
  if (gpu && !seen.count("device.hbm_gib")) c.hbm_gib = gpu->hbm_gib, seen.insert("device.hbm_gib");
  if (gpu && !seen.count("device.peak_tflops"))
    c.peak_tflops = gpu->bf16_tflops, seen.insert("device.peak_tflops");
  for (const auto& k : schema())
    if (k.required && !seen.count(k.full()))
      fail(source_name, k.full(), "missing; it is required (" + k.meaning + ")");
  return c;
}

Cluster load_cluster(const std::string& path) {
  std::ifstream in(path);
  T3D_USER_CHECK(in.good(), "cluster error: cannot open cluster file `", path,
                 "`: check the path (see recipes/clusters/ for examples)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_cluster(text.str(), path);
}

}  // namespace t3d::runtime
