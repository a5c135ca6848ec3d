// The device mesh: rank <-> coordinates in torchtitan's order pp -> dp -> cp -> tp, tp innermost
// (a tp group is contiguous ranks, inside one node). Pure arithmetic, no MPI: tested against the
// references' golden tables; communicators are built from it in comm.h.
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
  MeshShape(int pp, int dp, int cp, int tp);  // each ≥ 1 (InternalError otherwise)
  int size(Dim d) const { return sizes_[static_cast<int>(d)]; }
  int world() const { return sizes_[0] * sizes_[1] * sizes_[2] * sizes_[3]; }

  Coord coord_of(int rank) const;
  int rank_of(const Coord& c) const;
  // Members of `rank`'s group along `d` (all coordinates equal except d), ascending.
  std::vector<int> group(Dim d, int rank) const;
  // Index of that group among all groups of dimension d: the colour for MPI_Comm_split.
  int group_index(Dim d, int rank) const;
  // "[pp0 dp1 tp0]" (cp shown only when the mesh has cp > 1).
  std::string label(int rank) const;

 private:
  std::array<int, 4> sizes_;
  std::array<int, 4> strides_;
};

}  // namespace t3d::parallel
