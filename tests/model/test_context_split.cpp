// The zig-zag split of context parallelism: which positions each cp rank holds, in which order.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "runtime/model/model.h"

using namespace t3d::runtime;

TEST(ContextSplit, ZigZagPartsInPartRowPositionOrder) {
  // 2 rows of 8 positions, cp = 2: four parts of 2 positions; rank 0 holds parts 0 and 3, rank 1
  // parts 1 and 2, each as (part, row, position).
  std::vector<int32_t> whole(16);
  std::iota(whole.begin(), whole.end(), 0);
  std::vector<int32_t> local(8);
  cp_local_positions(whole.data(), local.data(), 2, 8, 2, 0);
  EXPECT_EQ(local, (std::vector<int32_t>{0, 1, 8, 9, 6, 7, 14, 15}));
  cp_local_positions(whole.data(), local.data(), 2, 8, 2, 1);
  EXPECT_EQ(local, (std::vector<int32_t>{2, 3, 10, 11, 4, 5, 12, 13}));
}

TEST(ContextSplit, RanksCoverEveryPositionOnceWithEqualCausalWork) {
  const int64_t rows = 3, T = 48;
  for (int cp : {1, 2, 3, 4}) {
    std::vector<int32_t> whole(rows * T);
    std::iota(whole.begin(), whole.end(), 0);
    std::vector<int> seen(whole.size(), 0);
    std::vector<int64_t> work(cp, 0);  // keys visible to the rank's queries: sum of (position + 1)
    for (int r = 0; r < cp; ++r) {
      std::vector<int32_t> local(rows * T / cp);
      cp_local_positions(whole.data(), local.data(), rows, T, cp, r);
      for (int32_t token : local) {
        ++seen[token];
        work[r] += token % T + 1;
      }
    }
    for (int n : seen) EXPECT_EQ(n, 1) << "cp " << cp;
    for (int r = 1; r < cp; ++r) EXPECT_EQ(work[r], work[0]) << "cp " << cp << " rank " << r;
  }
}
