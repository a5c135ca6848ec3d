#include "parallel/mesh.h"

#include "kernels/check.h"

namespace t3d::parallel {

const char* dim_name(Dim d) {
  static const char* names[] = {"pp", "dp", "cp", "tp"};
  return names[static_cast<int>(d)];
}

int& Coord::operator[](Dim d) {
  switch (d) {
    case Dim::pp:
      return pp;
    case Dim::dp:
      return dp;
    case Dim::cp:
      return cp;
    case Dim::tp:
      return tp;
  }
  T3D_ASSERT(false, "bad Dim");
}

int Coord::operator[](Dim d) const { return const_cast<Coord&>(*this)[d]; }

MeshShape::MeshShape(int pp, int dp, int cp, int tp, int ep) : sizes_{pp, dp, cp, tp}, ep_(ep) {
  for (int s : sizes_) T3D_ASSERT(s >= 1, "mesh sizes must be positive");
  T3D_ASSERT(ep >= 1 && dp * cp % ep == 0, "ep = ", ep, " does not divide dp·cp = ", dp * cp);
  // Row-major over (pp, dp, cp, tp): tp varies fastest.
  strides_[3] = 1;
  for (int i = 2; i >= 0; --i) strides_[i] = strides_[i + 1] * sizes_[i + 1];
}

Coord MeshShape::coord_of(int rank) const {
  T3D_ASSERT(rank >= 0 && rank < world(), "rank ", rank, " outside a world of ", world());
  Coord c;
  for (Dim d : kDims) {
    const int i = static_cast<int>(d);
    c[d] = rank / strides_[i] % sizes_[i];
  }
  return c;
}

int MeshShape::rank_of(const Coord& c) const {
  int rank = 0;
  for (Dim d : kDims) {
    const int i = static_cast<int>(d);
    T3D_ASSERT(c[d] >= 0 && c[d] < sizes_[i], "coordinate out of range");
    rank += c[d] * strides_[i];
  }
  return rank;
}

std::vector<int> MeshShape::group(Dim d, int rank) const {
  Coord c = coord_of(rank);
  std::vector<int> members;
  for (int k = 0; k < size(d); ++k) {
    c[d] = k;
    members.push_back(rank_of(c));
  }
  return members;
}

int MeshShape::group_index(Dim d, int rank) const {
  // Drop the d coordinate and number the remaining ones row-major.
  const Coord c = coord_of(rank);
  int index = 0;
  for (Dim e : kDims)
    if (e != d) index = index * size(e) + c[e];
  return index;
}

std::string MeshShape::label(int rank) const {
  const Coord c = coord_of(rank);
  std::string s = "[pp" + std::to_string(c.pp) + " dp" + std::to_string(c.dp);
  if (size(Dim::cp) > 1) s += " cp" + std::to_string(c.cp);
  return s + " tp" + std::to_string(c.tp) + "]";
}

int MeshShape::dp_cp_rank(int rank) const {
  const Coord c = coord_of(rank);
  return c.cp * size(Dim::dp) + c.dp;
}

std::vector<int> MeshShape::dp_cp_group(int rank) const {
  Coord c = coord_of(rank);
  std::vector<int> members;
  for (c.cp = 0; c.cp < size(Dim::cp); ++c.cp)
    for (c.dp = 0; c.dp < size(Dim::dp); ++c.dp) members.push_back(rank_of(c));
  return members;
}

int MeshShape::dp_cp_group_index(int rank) const {
  const Coord c = coord_of(rank);
  return c.pp * size(Dim::tp) + c.tp;
}

std::vector<int> MeshShape::ep_group(int rank) const {
  const std::vector<int> dp_cp = dp_cp_group(rank);
  const int first = dp_cp_rank(rank) / ep_ * ep_;
  return {dp_cp.begin() + first, dp_cp.begin() + first + ep_};
}

std::vector<int> MeshShape::edp_group(int rank) const {
  const std::vector<int> dp_cp = dp_cp_group(rank);
  std::vector<int> members;
  for (size_t i = static_cast<size_t>(dp_cp_rank(rank) % ep_); i < dp_cp.size(); i += ep_)
    members.push_back(dp_cp[i]);
  return members;
}

int MeshShape::ep_group_index(int rank) const {
  const int blocks = size(Dim::dp) * size(Dim::cp) / ep_;
  return dp_cp_group_index(rank) * blocks + dp_cp_rank(rank) / ep_;
}

int MeshShape::edp_group_index(int rank) const {
  return dp_cp_group_index(rank) * ep_ + dp_cp_rank(rank) % ep_;
}

}  // namespace t3d::parallel
