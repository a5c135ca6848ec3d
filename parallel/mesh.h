// The device mesh: rank <-> coordinates in torchtitan's order pp -> dp -> cp -> tp, tp innermost
// (a tp group is contiguous ranks, inside one node), and the expert-parallel groups folded into
// dp × cp. Pure arithmetic, no MPI: tested against the references' golden tables; communicators
// are built from it in comm.h.
#pragma once

#include <array>
#include <string>
#include <vector>

namespace t3d::parallel {

enum class Dim { pp = 0, dp = 1, cp = 2, tp = 3 };
inline constexpr std::array<Dim, 4> kDims = {Dim::pp, Dim::dp, Dim::cp, Dim::tp};
const char* dim_name(Dim d);

struct Coord {
  int pp = 0, dp = 0, cp = 0, tp = 0;
  int& operator[](Dim d);
  int operator[](Dim d) const;
  bool operator==(const Coord&) const = default;
};

class MeshShape {
 public:
  // Each ≥ 1 and ep dividing dp·cp (InternalError otherwise: the recipe's validation says why).
  MeshShape(int pp, int dp, int cp, int tp, int ep);
  int size(Dim d) const { return sizes_[static_cast<int>(d)]; }
  int world() const { return sizes_[0] * sizes_[1] * sizes_[2] * sizes_[3]; }
  int ep() const { return ep_; }

  Coord coord_of(int rank) const;
  int rank_of(const Coord& c) const;
  // Members of `rank`'s group along `d` (all coordinates equal except d), ascending.
  std::vector<int> group(Dim d, int rank) const;
  // Index of that group among all groups of dimension d: the colour for MPI_Comm_split.
  int group_index(Dim d, int rank) const;
  // "[pp0 dp1 tp0]" (cp shown only when the mesh has cp > 1).
  std::string label(int rank) const;

  // dp and cp flattened (Mesh::dp_cp): the ranks sharing `rank`'s pp and tp coordinates, by
  // dp_cp rank = cp · dp_size + dp, so the dp neighbours of one cp rank are adjacent.
  int dp_cp_rank(int rank) const;
  std::vector<int> dp_cp_group(int rank) const;
  int dp_cp_group_index(int rank) const;  // the colour for MPI_Comm_split

  // Expert parallelism folded into dp × cp (torchtitan's and Megatron's "MoE parallel folding",
  // docs/parallelism.md): the EP group of `rank` is the ep consecutive ranks of its dp_cp group
  // that contain it (dp_cp rank / ep numbers the block); the expert-data-parallel (EDP) group is
  // the dp_cp ranks with the same dp_cp rank mod ep. ep = 1: EP is the rank alone, EDP is dp_cp.
  // Members are world ranks by rank in the group (EP: dp_cp rank mod ep; EDP: dp_cp rank / ep).
  std::vector<int> ep_group(int rank) const;
  std::vector<int> edp_group(int rank) const;
  int ep_group_index(int rank) const;  // colours for MPI_Comm_split
  int edp_group_index(int rank) const;

 private:
  std::array<int, 4> sizes_;
  std::array<int, 4> strides_;
  int ep_;
};

}  // namespace t3d::parallel
